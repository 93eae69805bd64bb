"""Prometheus metrics for node agents and requestors (the ``prometheus`` extra).

:class:`ReservoirCollector` reads the participants' own counters and state when Prometheus
scrapes, so nothing is counted twice and nothing runs between scrapes:

- ``reservoir_messages_sent_total{participant,kind}`` and ``..._received_total``
- ``reservoir_messages_dropped_total{participant,reason}``: bad input refused by the codec
  (malformed, oversized, unsigned, replayed, untrusted sender)
- ``reservoir_messages_ignored_total{participant,reason}``: late or duplicate messages
- ``reservoir_placements_total{participant,outcome}`` for requestors
- ``reservoir_node_utilisation``, ``reservoir_node_tier_percent``,
  ``reservoir_node_allocations``, ``reservoir_node_reservations`` and
  ``reservoir_node_resource{class,state}`` (capacity, allocated, reserved) for nodes

    reservoir node --name n1 --vcpus 16 --memory-mb 65536 --metrics-port 9100
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from reservoir.node_agent import NodeAgent
from reservoir.requestor import Requestor

__all__ = ["ReservoirCollector", "serve_metrics"]

_COUNTERS = {
    "sent": ("reservoir_messages_sent", "Messages sent, by kind", "kind"),
    "received": ("reservoir_messages_received", "Messages received, by kind", "kind"),
    "dropped": ("reservoir_messages_dropped", "Messages refused as bad input", "reason"),
    "ignored": ("reservoir_messages_ignored", "Late, duplicate or stray messages", "reason"),
    "transport_errors": ("reservoir_transport_errors", "Messages the broker refused", "kind"),
}


class ReservoirCollector(Collector):
    """Exposes the given participants' counters and, for nodes, their state."""

    def __init__(self, participants: Iterable[NodeAgent | Requestor]) -> None:
        self.participants = list(participants)

    def collect(self) -> Iterator[Metric]:
        for counter, (name, documentation, label) in _COUNTERS.items():
            family = CounterMetricFamily(name, documentation, labels=["participant", label])
            for participant in self.participants:
                for value, count in sorted(participant.metrics.by_label(counter).items()):
                    family.add_metric([_name(participant), value], count)
            yield family
        placements = CounterMetricFamily(
            "reservoir_placements", "Requests decided, by outcome",
            labels=["participant", "outcome"],
        )  # fmt: skip
        for participant in self.participants:
            if isinstance(participant, Requestor):
                for outcome in ("placed", "failed"):
                    placements.add_metric(
                        [participant.name, outcome], participant.metrics.get(outcome)
                    )
        yield placements
        yield from self._node_gauges()

    def _node_gauges(self) -> Iterator[Metric]:
        nodes = [p for p in self.participants if isinstance(p, NodeAgent)]
        utilisation = GaugeMetricFamily(
            "reservoir_node_utilisation", "Dominant share, reservations included (0..1)",
            labels=["node"],
        )  # fmt: skip
        tier = GaugeMetricFamily(
            "reservoir_node_tier_percent", "Narrowest tier the node hears", labels=["node"]
        )
        allocations = GaugeMetricFamily(
            "reservoir_node_allocations", "Allocations held", labels=["node"]
        )
        reservations = GaugeMetricFamily(
            "reservoir_node_reservations", "Live reservations", labels=["node"]
        )
        resources = GaugeMetricFamily(
            "reservoir_node_resource", "Per resource class: capacity, allocated, reserved",
            labels=["node", "class", "state"],
        )  # fmt: skip
        for node in nodes:
            snapshot = node.snapshot()
            utilisation.add_metric([node.name], snapshot.utilisation)
            tier.add_metric([node.name], snapshot.tier)
            allocations.add_metric([node.name], len(snapshot.allocations))
            reservations.add_metric([node.name], len(snapshot.reservations))
            for rc, usage in snapshot.usages.items():
                resources.add_metric([node.name, rc, "capacity"], usage.capacity)
                resources.add_metric([node.name, rc, "allocated"], usage.allocated)
                resources.add_metric([node.name, rc, "reserved"], usage.reserved)
        yield from (utilisation, tier, allocations, reservations, resources)


def _name(participant: NodeAgent | Requestor) -> str:
    return participant.name


def serve_metrics(
    participants: Iterable[NodeAgent | Requestor], port: int, address: str = "0.0.0.0"
) -> CollectorRegistry:
    """Serve the participants' metrics over HTTP on ``port`` (a daemon thread)."""
    registry = CollectorRegistry()
    registry.register(ReservoirCollector(participants))
    start_http_server(port, addr=address, registry=registry)
    return registry
