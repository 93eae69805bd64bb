"""Participants' Prometheus metrics (reservoir.observe.metrics): what a node and a requestor count
and report, in registries of their own or one they share, and nothing at all without
prometheus_client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from reservoir import PlacementError
from reservoir.broker import Delivery
from reservoir.observe.metrics import Metrics, failure_reason
from reservoir.testing import Simulation


@pytest.fixture
def unused_tcp_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def exposition(registry: prometheus_client.CollectorRegistry) -> str:
    return prometheus_client.generate_latest(registry).decode()


def value(text: str, sample: str, **labels: str) -> float:
    """The value of one sample in an exposition (parsed, so the format itself is valid)."""
    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == sample and found.labels == labels:
                return float(found.value)
    raise AssertionError(f"no {sample}{labels} in:\n{text}")


def test_a_node_exposes_its_messages_state_and_what_became_of_its_reservations(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    node = sim.add_node("n1", vcpus=4, memory_mb=4096)
    requestor = sim.add_requestor("r1")
    sim.place(requestor, vcpus=2, memory_mb=1024)
    node._on_delivery(Delivery(b"{not json"))
    assert node.metrics.registry is not None
    text = exposition(node.metrics.registry)
    assert value(text, "reservoir_messages_sent_total", participant="n1", kind="offer") == 1
    assert value(text, "reservoir_messages_received_total", participant="n1", kind="award") == 1
    assert (
        value(text, "reservoir_messages_dropped_total", participant="n1", reason="malformed") == 1
    )
    assert value(text, "reservoir_node_utilisation_ratio", node="n1") == 0.5
    assert value(text, "reservoir_node_tier_ratio", node="n1") == 0.5
    assert value(text, "reservoir_node_resource_units", node="n1", **{"class": "VCPU"},
                 state="allocated") == 2  # fmt: skip
    assert value(text, "reservoir_node_memory_bytes", node="n1", state="allocated") == 1024**3
    assert value(text, "reservoir_node_memory_bytes", node="n1", state="capacity") == 4 * 1024**3
    assert value(text, "reservoir_node_reservations", node="n1") == 0
    assert value(text, "reservoir_node_reservations_made_total", node="n1") == 1
    assert value(text, "reservoir_node_reservations_ended_total", node="n1", how="awarded") == 1
    assert value(text, "reservoir_node_reservations_ended_total", node="n1", how="expired") == 0
    # the counters read back as the hand-kept ones did, for the demo, bench and tests
    assert node.metrics.get("sent", "offer") == 1
    assert node.metrics.by_label("dropped") == {"malformed": 1}


def test_a_reservation_nobody_awards_is_counted_as_expired(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    node = sim.add_node("n1", vcpus=4, memory_mb=4096)
    requestor = sim.add_requestor("r1")
    future = requestor.submit(vcpus=1, memory_mb=1)
    requestor.close()  # gone before awarding: the node's reservation runs out its TTL
    sim.settle()
    assert future.done()
    assert node.machine.counters["expired"] + node.machine.counters["released"] == 1
    assert node.metrics.registry is not None
    text = exposition(node.metrics.registry)
    assert value(text, "reservoir_node_reservations_made_total", node="n1") == 1
    ended = sum(
        value(text, "reservoir_node_reservations_ended_total", node="n1", how=how)
        for how in ("expired", "released")
    )
    assert ended == 1
    assert value(text, "reservoir_node_reservations", node="n1") == 0


def test_a_requestor_times_its_placements_and_counts_offers_widenings_and_failures(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.add_nodes(3, vcpus=4, memory_mb=4096)
    requestor = sim.add_requestor("r1")
    placements = [sim.place(requestor, vcpus=1, memory_mb=512) for _ in range(4)]
    with pytest.raises(PlacementError) as refused:
        sim.place(requestor, vcpus=64, memory_mb=1, explain=True)
    assert failure_reason(refused.value) == "not_placed"
    assert requestor.metrics.registry is not None
    text = exposition(requestor.metrics.registry)
    seconds = "reservoir_placement_seconds_count"
    assert value(text, seconds, participant="r1", outcome="placed") == 4
    assert value(text, seconds, participant="r1", outcome="failed") == 1
    offers = sum(p.offers_received for p in placements) + refused.value.explanation.offers_received
    assert value(text, "reservoir_placement_offers_sum", participant="r1") == offers
    assert value(text, "reservoir_placement_offers_count", participant="r1") == 5
    widenings = sum(len(p.tiers_tried) - 1 for p in placements)
    widenings += len(refused.value.explanation.tiers_tried) - 1
    assert value(text, "reservoir_tier_widenings_total", participant="r1") == widenings
    failures = "reservoir_placement_failures_total"
    assert value(text, failures, participant="r1", reason="not_placed") == 1
    assert value(text, failures, participant="r1", reason="timeout") == 0
    assert value(text, "reservoir_requestor_in_flight", participant="r1") == 0
    assert value(text, "reservoir_requestor_roster_nodes", participant="r1") == 3
    probes = requestor.machine.counters["probes"]
    assert probes > 0
    assert value(text, "reservoir_requestor_steps_total", participant="r1", step="probes") == probes
    sim.finish(placements)


def test_a_requestor_says_where_its_roster_comes_from_and_how_often_that_changed(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.add_nodes(2, vcpus=4, memory_mb=4096)
    requestor = sim.add_requestor("r1")
    sim.scheduler.run_until_idle()
    assert requestor.metrics.registry is not None

    def source(text: str) -> list[str]:
        return [
            each
            for each in ("keepers", "announcements", "asking")
            if value(text, "reservoir_requestor_roster_source", participant="r1", source=each)
        ]

    switches = "reservoir_requestor_roster_switches_total"
    text = exposition(requestor.metrics.registry)
    assert source(text) == ["announcements"]  # no keeper yet
    assert value(text, switches, participant="r1", to="announcements") == 1
    sim.add_keeper()
    text = exposition(requestor.metrics.registry)
    assert source(text) == ["keepers"]
    assert value(text, switches, participant="r1", to="keepers") == 1
    sim.finish([sim.place(requestor, vcpus=1, memory_mb=512)])


def test_an_answer_from_memory_is_not_timed_as_another_placement(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.add_nodes(2, vcpus=4, memory_mb=4096)
    requestor = sim.add_requestor("r1")
    first = sim.place(requestor, vcpus=1, memory_mb=1, request_id="order-1")
    again = sim.place(requestor, vcpus=1, memory_mb=1, request_id="order-1")
    assert again == first
    assert requestor.metrics.registry is not None
    text = exposition(requestor.metrics.registry)
    count = value(text, "reservoir_placement_seconds_count", participant="r1", outcome="placed")
    assert count == 1
    sim.finish([first])


def test_participants_sharing_a_registry_are_one_family_each_with_its_own_series(
    reservoir_simulation: Simulation,
) -> None:
    registry = prometheus_client.CollectorRegistry()
    sim = reservoir_simulation
    for name in ("a", "b"):
        sim.add_node(name, vcpus=4, memory_mb=4096, metrics_registry=registry)
    requestor = sim.add_requestor("r1", metrics_registry=registry)
    placement = sim.place(requestor, vcpus=4, memory_mb=1)
    sim.settle()  # the spare offer's release lands
    text = exposition(registry)
    assert text.count("# TYPE reservoir_node_utilisation_ratio gauge") == 1
    assert text.count("# TYPE reservoir_messages_sent_total counter") == 1
    [holder] = placement.nodes
    other = "b" if holder == "a" else "a"
    assert value(text, "reservoir_node_utilisation_ratio", node=holder) == 1.0
    assert value(text, "reservoir_node_utilisation_ratio", node=other) == 0.0
    assert value(text, "reservoir_messages_sent_total", participant="r1", kind="award") == 1
    # a node that closes leaves the scrape-time part of the exposition
    sim.nodes[other].close()
    with pytest.raises(AssertionError):
        value(exposition(registry), "reservoir_node_utilisation_ratio", node=other)
    sim.finish([placement])


def test_failure_reasons_are_bounded_labels(reservoir_simulation: Simulation) -> None:
    sim = reservoir_simulation
    sim.add_node("n1", vcpus=4, memory_mb=4096)
    requestor = sim.add_requestor("r1")
    placement = sim.place(requestor, vcpus=1, memory_mb=1, request_id="k1")
    with pytest.raises(PlacementError) as conflict:
        sim.place(requestor, vcpus=2, memory_mb=1, request_id="k1")
    assert failure_reason(conflict.value) == "conflict"
    lonely = Simulation()
    try:
        nobody = lonely.add_requestor("r2")
        with pytest.raises(PlacementError) as unheard:
            lonely.place(nobody, vcpus=1, memory_mb=1, timeout_s=1.0)
        assert failure_reason(unheard.value) in ("no_answer", "timeout")
        assert unheard.value.explanation.offers_received == 0
    finally:
        lonely.finish()
    sim.finish([placement])


def test_metrics_are_a_registry_of_their_own_by_default() -> None:
    first, second = Metrics("same-name"), Metrics("same-name")
    assert first.registry is not None and second.registry is not None
    assert first.registry is not second.registry
    first.inc("sent", "offer")
    assert (first.get("sent", "offer"), second.get("sent", "offer")) == (1, 0)
    assert (
        prometheus_client.REGISTRY.get_sample_value(
            "reservoir_messages_sent_total", {"participant": "same-name", "kind": "offer"}
        )
        is None
    )


BLOCKED = (
    "import sys; sys.modules['prometheus_client'] = None; sys.modules['opentelemetry'] = None; "
)


def test_without_prometheus_client_nothing_is_counted_and_the_demo_still_runs() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    code = BLOCKED + (
        "from reservoir.observe import metrics; assert not metrics.AVAILABLE; "
        "from reservoir.cli import main; "
        "main(['demo', '--nodes', '4', '--requests', '20', '--json'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["placed"] == 20
    assert result["messages_per_placement"] is None
    audit = ("overcommitted", "leaked_reservations", "duplicate_placements")
    assert [result[found] for found in audit] == [0, 0, 0]


def test_a_node_serves_its_metrics_and_the_processs_on_its_metrics_port(
    unused_tcp_port: int,
) -> None:
    node = subprocess.Popen(
        [sys.executable, "-m", "reservoir", "node", "--broker", "memory://", "--name", "m1",
         "--vcpus", "4", "--memory-mb", "1024", "--metrics-port", str(unused_tcp_port)],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert node.stderr is not None
        assert "configuration" in node.stderr.readline()  # what it runs with, logged first
        ready = node.stderr.readline()
        assert "ready" in ready, ready
        url = f"http://127.0.0.1:{unused_tcp_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        assert value(text, "reservoir_node_utilisation_ratio", node="m1") == 0
        assert value(text, "reservoir_node_resource_units", node="m1", **{"class": "VCPU"},
                     state="capacity") == 4  # fmt: skip
        assert value(text, "reservoir_node_memory_bytes", node="m1", state="capacity") == 1024**3
        assert value(text, "process_cpu_seconds_total") > 0
        assert "python_info" in text
    finally:
        node.terminate()
        assert node.wait(timeout=30) == 130  # stopped by a signal


def test_a_metrics_port_in_use_is_one_line_and_status_2(unused_tcp_port: int) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", unused_tcp_port))
        taken.listen()
        done = subprocess.run(
            [sys.executable, "-m", "reservoir", "node", "--broker", "memory://", "--name", "m2",
             "--vcpus", "4", "--metrics-port", str(unused_tcp_port)],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert f"--metrics-port {unused_tcp_port}" in done.stderr
    assert "Traceback" not in done.stderr
