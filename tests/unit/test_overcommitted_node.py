"""A node restarted with a smaller inventory than its stored allocations: it says so at
start in one warning line, in its status and in a metric, and places nothing new until
what it holds fits again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from reservoir import NodeAgent, PlacementError, Requestor, audit
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.protocol.ledger import Allocation
from reservoir.runtime.store import SqliteStore


def stored(state_dir: Path, node: str, vcpus: list[int]) -> None:
    """Allocations of ``vcpus`` VCPU each, as a bigger node of that name left them."""
    store = SqliteStore.for_node(state_dir, node)
    for i, amount in enumerate(vcpus):
        store.put(
            Allocation(
                allocation_id=f"a{i}",
                request_id=f"old-{i}",
                reservation_id=f"res-{i}",
                owner="r0",
                resources={"VCPU": amount, "MEMORY_MB": 1024},
            )
        )
    store.close()


def gauge(registry: prometheus_client.CollectorRegistry, name: str) -> float:
    text = prometheus_client.generate_latest(registry).decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"no {name} in {text}")


def test_an_overcommitted_node_reports_it_and_places_nothing_until_freed(tmp_path: Path) -> None:
    stored(tmp_path, "small", [8, 3])
    broker = InProcessBroker()
    registry = prometheus_client.CollectorRegistry()
    store = SqliteStore.for_node(tmp_path, "small")
    with (
        NodeAgent(broker, name="small", vcpus=2, memory_mb=16384, store=store,
                  metrics_registry=registry) as node,
        Requestor(broker) as requestor,
    ):  # fmt: skip
        assert node.status()["violations"] == ["VCPU: allocated 11 + reserved 0 > capacity 2"]
        assert gauge(registry, "reservoir_node_overcommitted_classes") == 1
        with pytest.raises(PlacementError):  # memory alone would fit: it takes nothing
            requestor.reserve(memory_mb=512, timeout_s=0.5)
        assert node.snapshot().reservations == ()
        node.free_allocations(["a0", "a1"])
        assert gauge(registry, "reservoir_node_overcommitted_classes") == 0
        placement = requestor.reserve(memory_mb=512, timeout_s=5)
        assert placement.nodes == ("small",)
        assert audit([node.snapshot()], [placement]).ok


def test_the_node_command_warns_in_one_line_at_start(tmp_path: Path) -> None:
    stored(tmp_path, "w1", [8, 3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(
        [sys.executable, "-m", "reservoir", "node", "--broker", "memory://", "--name", "w1",
         "--vcpus", "2", "--memory-mb", "16384", "--state-dir", str(tmp_path)],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert process.stderr is not None
    assert "node w1: configuration" in process.stderr.readline()  # what it runs with, first
    assert "node w1: ready" in process.stderr.readline()
    warning = process.stderr.readline().rstrip("\n").split(" INFO reservoir: ", 1)[1]
    process.send_signal(signal.SIGTERM)
    rest = process.stderr.read()
    assert process.wait(timeout=30) == 130
    assert warning == (
        "node w1: warning: it holds more than its inventory (VCPU: allocated 11 + reserved 0 "
        "> capacity 2); it takes no new request until frees bring it within"
    )
    assert [line.split(" INFO reservoir: ", 1)[1] for line in rest.splitlines()] == [
        "node w1: stopped"
    ]
    status = json.loads((tmp_path / "w1.status.json").read_text())
    assert status["violations"] == ["VCPU: allocated 11 + reserved 0 > capacity 2"]
