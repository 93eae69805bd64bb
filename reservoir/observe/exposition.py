"""Serving Prometheus metrics from a reservoir process (the ``prometheus`` extra).

The metrics themselves are kept by each participant (:mod:`reservoir.observe.metrics`); this module
makes the registry a process exports, with the process's own metrics beside the
participants' (``process_*`` CPU, memory and file descriptors, ``python_gc_*``,
``python_info``), and serves it over HTTP::

    reservoir node --name n1 --vcpus 16 --memory-mb 65536 --metrics-port 9100

or, for a long-lived requestor of one's own::

    registry = process_registry()
    requestor = Requestor(url, metrics_registry=registry)
    serve_metrics(registry, 9101)
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

__all__ = ["add_process_metrics", "process_registry", "serve_metrics"]


def add_process_metrics(registry: CollectorRegistry) -> CollectorRegistry:
    """Add the process's CPU, memory, file descriptors, garbage collection and Python
    version, and ``reservoir_build_info``, to ``registry`` (once per registry: a second
    call adds nothing)."""
    from reservoir.observe.metrics import build_info

    build_info(registry)
    if not getattr(registry, "_reservoir_process_metrics", False):
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        GCCollector(registry=registry)
        registry._reservoir_process_metrics = True  # type: ignore[attr-defined]
    return registry


def process_registry() -> CollectorRegistry:
    """A new registry for what one process exports, process metrics included."""
    return add_process_metrics(CollectorRegistry())


def serve_metrics(registry: CollectorRegistry, port: int, address: str = "0.0.0.0") -> None:
    """Serve ``registry`` on ``address``:``port`` (``/metrics``, from a daemon thread).
    Raises :class:`OSError` when the port cannot be had."""
    start_http_server(port, addr=address, registry=registry)
