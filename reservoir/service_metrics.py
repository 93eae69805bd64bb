"""The placement service's Prometheus metrics (``GET /metrics`` of ``reservoir serve``).

Every :class:`ServiceMetrics` keeps its own :class:`~prometheus_client.CollectorRegistry`,
so two apps in one process (tests, or a user's app mounting the service twice) never
collide on metric names, and ``/metrics`` shows this app's numbers only.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["CONTENT_TYPE_LATEST", "ServiceMetrics"]

#: placement latency buckets, seconds: a warm placement takes milliseconds, a widening one
#: up to a few seconds, a timed-out one the request timeout (30 s by default)
PLACEMENT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServiceMetrics:
    """The metrics of one service instance, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.placement_seconds = Histogram(
            "reservoir_service_placement_seconds",
            "Time from a POST /v1/reservations reaching the requestor to its outcome.",
            labelnames=("outcome",),
            buckets=PLACEMENT_BUCKETS_S,
            registry=self.registry,
        )
        self.placements = Counter(
            "reservoir_service_placements",
            "POST /v1/reservations answered with a placement (whole or partial) by the "
            "requestor (replays from this process's record are not counted).",
            labelnames=("partial",),
            registry=self.registry,
        )
        self.failures = Counter(
            "reservoir_service_placement_failures",
            "Requests not placed, by reason: not_placed (409), timeout (504), unavailable (503).",
            labelnames=("reason",),
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "reservoir_service_placements_in_flight",
            "Placements this service is waiting on right now.",
            registry=self.registry,
        )
        self.held = Gauge(
            "reservoir_service_placements_held",
            "Placements this process made and has not released.",
            registry=self.registry,
        )
        self.http_requests = Counter(
            "reservoir_service_http_requests",
            "HTTP requests answered, by method, route template and status code.",
            labelnames=("method", "route", "status"),
            registry=self.registry,
        )

    def exposition(self) -> bytes:
        """The registry in the Prometheus text format."""
        return generate_latest(self.registry)
