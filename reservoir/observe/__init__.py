"""Observability: :mod:`.logs` (text or JSON lines with the conversation's request id),
:mod:`.tracing` (OpenTelemetry spans across the broker), :mod:`.metrics` (each participant's
Prometheus metrics) and :mod:`.exposition` (serving them, with the process's own).
"""
