"""The placement service's Prometheus metrics (``GET /metrics`` of ``reservoir serve``).

Every :class:`ServiceMetrics` keeps its own :class:`~prometheus_client.CollectorRegistry`,
so two apps in one process (tests, or a user's app mounting the service twice) never
collide on metric names, and ``/metrics`` shows this app's numbers only. The service's
requestor counts into the same registry (its messages, placement latency, offers,
widenings and failures: see :mod:`reservoir.observe.metrics`), and so do the process metrics.
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

from reservoir.observe.metrics import PLACEMENT_BUCKETS_S


class ServiceMetrics:
    """The metrics of one service instance, in a registry of their own."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        from reservoir.observe.exposition import add_process_metrics

        self.registry = registry if registry is not None else CollectorRegistry()
        add_process_metrics(self.registry)
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
            "Placements in this process's cache: answered for here, not released and not "
            "found gone since (GET and DELETE ask the nodes, which are the truth).",
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
