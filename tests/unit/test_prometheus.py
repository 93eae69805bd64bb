"""Prometheus exposition of a participant's counters and a node's state."""

from __future__ import annotations

import prometheus_client

from reservoir.broker import Delivery
from reservoir.testing import Simulation


def test_counters_and_node_state_are_exposed(reservoir_simulation: Simulation) -> None:
    from reservoir.prometheus import ReservoirCollector

    sim = reservoir_simulation
    node = sim.add_node("n1", vcpus=4, memory_mb=4096)
    requestor = sim.add_requestor("r1")
    sim.place(requestor, vcpus=2, memory_mb=1024)
    node._on_delivery(Delivery(b"{not json"))
    registry = prometheus_client.CollectorRegistry()
    registry.register(ReservoirCollector([node, requestor]))
    text = prometheus_client.generate_latest(registry).decode()
    assert 'reservoir_messages_sent_total{kind="offer",participant="n1"} 1.0' in text
    assert 'reservoir_messages_dropped_total{participant="n1",reason="malformed"} 1.0' in text
    assert 'reservoir_placements_total{outcome="placed",participant="r1"} 1.0' in text
    assert 'reservoir_node_utilisation{node="n1"} 0.5' in text
    assert 'reservoir_node_tier_percent{node="n1"} 50.0' in text
    assert 'reservoir_node_resource{class="VCPU",node="n1",state="allocated"} 2.0' in text
