"""End to end: real ``reservoir node`` and ``reservoir request`` processes on a real
RabbitMQ, including a node killed with SIGKILL mid-run, then audited from what the nodes
themselves keep (their SQLite ledgers and status files)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from reservoir.runtime.requestor import Requestor
from reservoir.testing import ProcessCluster, ReservoirProcess
from reservoir.testing.processes import NODE_READY
from reservoir.version import __version__

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]


class Cluster(ProcessCluster):
    """Node processes on the test's own exchange, with the size each was started with."""

    def __init__(self, url: str, state_dir: Path) -> None:
        super().__init__(url, state_dir)
        self.sizes: dict[str, tuple[int, int]] = {}

    def start_node(  # type: ignore[override]
        self, name: str, vcpus: int = 8, memory_mb: int = 16384
    ) -> ReservoirProcess:
        node = super().start_node(
            name, "--status-interval", "0.2", vcpus=vcpus, memory_mb=memory_mb
        )
        self.sizes[name] = (vcpus, memory_mb)
        return node

    def request(self, *args: str) -> tuple[int, dict[str, Any]]:
        done = self.run("request", "--json", "--timeout", "20", *args)
        return done.returncode, json.loads(done.stdout) if done.stdout.strip() else {}

    def allocations(self, name: str) -> list[dict[str, Any]]:
        done = self.run("inspect", "--state-dir", str(self.state_dir), "--name", name, "--json")
        assert done.returncode == 0, done.stderr
        allocations: list[dict[str, Any]] = json.loads(done.stdout)["allocations"]
        return allocations

    def status(self, name: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.state_dir / f"{name}.status.json").read_text())
        return data

    def stop(self, name: str) -> None:
        node = self.nodes[name]
        assert node.terminate(timeout_s=20) == 130  # stopped by a signal
        node.wait_for("stopped")


@pytest.fixture
def cluster(reservoir_amqp_url: str, tmp_path: Path) -> Iterator[Cluster]:
    with Cluster(reservoir_amqp_url, tmp_path) as cluster:
        yield cluster


def audit_nodes(cluster: Cluster, placements: list[dict[str, Any]], counts: dict[str, int]) -> None:
    """The invariants, from what the nodes keep on disk: no class over capacity, no
    request holding more than it asked for, every reported placement held."""
    held: dict[str, list[str]] = defaultdict(list)
    for name in cluster.nodes:
        node_vcpus, node_memory_mb = cluster.sizes[name]
        allocations = cluster.allocations(name)
        vcpus = sum(a["resources"].get("VCPU", 0) for a in allocations)
        memory = sum(a["resources"].get("MEMORY_MB", 0) for a in allocations)
        assert vcpus <= node_vcpus, f"{name} overcommitted: {vcpus} VCPU > {node_vcpus}"
        assert memory <= node_memory_mb, f"{name} overcommitted: {memory} MB"
        for allocation in allocations:
            held[allocation["request_id"]].append(allocation["allocation_id"])
    for request_id, ids in held.items():
        assert len(ids) <= counts.get(request_id, 1), f"{request_id} placed twice: {ids}"
    for placement in placements:
        ids = {a["allocation_id"] for a in placement["allocations"]}
        assert ids <= set(held[placement["request_id"]]), placement


def test_a_request_places_on_one_of_two_nodes_and_an_oversized_one_fails(
    cluster: Cluster,
) -> None:
    cluster.start_node("a", vcpus=4, memory_mb=8192)
    cluster.start_node("b", vcpus=4, memory_mb=8192)
    status, placed = cluster.request("--vcpus", "2", "--memory-mb", "1024")
    assert status == 0, placed
    assert placed["placed"] is True
    assert [a["node"] for a in placed["allocations"]] in (["a"], ["b"])
    # its generated id is findable by any process (a replica of reservoir serve, say)
    with Requestor(cluster.env["RESERVOIR_BROKER_URL"]) as other:
        found = other.find(placed["request_id"])
    assert found is not None and [a.node for a in found.allocations] == [
        a["node"] for a in placed["allocations"]
    ]
    status, failed = cluster.request("--vcpus", "64", "--memory-mb", "1024")
    assert status == 1
    assert failed["placed"] is False
    assert "tiers tried: 10%, 25%, 50%, 75%, 100%" in failed["explanation"]
    for name in list(cluster.nodes):
        cluster.stop(name)
    audit_nodes(cluster, [placed], {placed["request_id"]: 1})


def test_anti_affinity_and_explanations_through_the_cli(cluster: Cluster) -> None:
    cluster.start_node("a", vcpus=4, memory_mb=8192)
    cluster.start_node("b", vcpus=4, memory_mb=8192)
    group = ("--group", "g1", "--policy", "anti-affinity")
    status, pair = cluster.request("--vcpus", "2", "--memory-mb", "1024", "--count", "2", *group)
    assert status == 0, pair
    assert sorted(a["node"] for a in pair["allocations"]) == ["a", "b"]
    status, third = cluster.request("--vcpus", "2", "--memory-mb", "1024", *group)
    assert status == 1
    assert "anti-affinity group g1" in third["explanation"]
    status, big = cluster.request("--vcpus", "64", "--memory-mb", "1024", "--explain")
    assert status == 1
    assert "VCPU" in big["explanation"]
    assert big["reasons"] == {"VCPU larger than one instance may take": 2}
    for name in list(cluster.nodes):
        cluster.stop(name)
    audit_nodes(cluster, [pair], {pair["request_id"]: 2})


def test_a_node_killed_and_restarted_holds_the_same_allocations(cluster: Cluster) -> None:
    cluster.start_node("a", vcpus=8, memory_mb=16384)
    placed = [cluster.request("--vcpus", "2", "--memory-mb", "1024")[1] for _ in range(3)]
    assert all(p["placed"] for p in placed)
    before = cluster.allocations("a")
    assert len(before) == 3
    cluster.nodes["a"].process.send_signal(signal.SIGKILL)
    cluster.nodes["a"].process.wait(timeout=10)
    restarted = cluster.start_node("a", vcpus=8, memory_mb=16384)
    ready = next(line for line in restarted.said if NODE_READY in line)
    assert "3 allocation(s) held, utilisation 75%, tier 75%" in ready
    assert cluster.allocations("a") == before
    # and it still answers for them: the same request id gives the same placement
    status, again = cluster.request(
        "--vcpus", "2", "--memory-mb", "1024", "--request-id", placed[0]["request_id"]
    )
    assert status == 0
    assert again["allocations"] == placed[0]["allocations"]
    cluster.stop("a")
    audit_nodes(cluster, placed, {p["request_id"]: 1 for p in placed})


def test_concurrent_requests_with_a_node_killed_mid_run_double_book_nothing(
    cluster: Cluster,
) -> None:
    for name in ("a", "b", "c"):
        cluster.start_node(name, vcpus=8, memory_mb=16384)
    results: list[tuple[int, dict[str, Any]]] = []

    def one(index: int) -> tuple[int, dict[str, Any]]:
        if index == 6:
            cluster.nodes["b"].process.send_signal(signal.SIGKILL)
        return cluster.request("--vcpus", "2", "--memory-mb", "2048")

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(one, range(16)))
    cluster.nodes["b"].process.wait(timeout=10)
    placements = [r for status, r in results if status == 0]
    assert len(placements) >= 8  # a and c alone hold 8 such instances
    assert all(status in (0, 1) for status, _ in results)
    # whatever was reserved is gone within one reservation TTL (5 s) and a margin
    deadline = time.monotonic() + 6.5
    for name in ("a", "c"):
        status = cluster.status(name)
        while status["reservations"] and time.monotonic() < deadline:
            time.sleep(0.25)
            status = cluster.status(name)
        assert status["reservations"] == [], status
        assert status["violations"] == []
        assert status["connected"] is True  # its broker connection, for probes
    for name in ("a", "c"):
        cluster.stop(name)
    audit_nodes(cluster, placements, {p["request_id"]: 1 for p in placements})


def test_reservoir_audit_reads_every_node_over_the_broker_and_lists_orphans_to_free(
    cluster: Cluster,
) -> None:
    cluster.start_node("a", vcpus=8, memory_mb=16384)
    cluster.start_node("b", vcpus=8, memory_mb=16384)
    placed = [cluster.request("--vcpus", "2", "--memory-mb", "1024")[1] for _ in range(3)]
    assert all(p["placed"] for p in placed)
    record = cluster.state_dir / "record.jsonl"
    record.write_text("".join(json.dumps(p) + "\n" for p in placed[:2]))
    audit_args = ("audit", "--json", "--expect-nodes", "2", "--placements", str(record))
    done = cluster.run(*audit_args)
    found = json.loads(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (found["nodes"], found["allocations"], found["ok"]) == (2, 3, True)
    (orphan,) = found["orphans"]
    assert placed[2]["allocations"][0]["allocation_id"] in orphan
    # the command the audit names frees the orphan, and the next audit is clean
    command = orphan.split(": ", 2)[2].split()
    assert command[:2] == ["reservoir", "free"]
    freed = cluster.run(*command[1:])
    assert freed.returncode == 0, freed.stderr
    again = json.loads(cluster.run(*audit_args).stdout)
    assert (again["allocations"], again["orphans"], again["ok"]) == (2, [], True)
    # told of a placement the nodes do not hold, the audit fails with status 2
    record.write_text("".join(json.dumps(p) + "\n" for p in placed))
    broken = cluster.run(*audit_args)
    assert broken.returncode == 2
    assert placed[2]["request_id"] in " ".join(json.loads(broken.stdout)["duplicate_placements"])
    for name in list(cluster.nodes):
        cluster.stop(name)
    audit_nodes(cluster, placed[:2], {p["request_id"]: 1 for p in placed})


def test_a_demo_pointed_at_a_live_exchange_refuses_it_and_the_node_on_it_keeps_placing(
    cluster: Cluster,
) -> None:
    cluster.start_node("live", vcpus=8, memory_mb=16384)
    demo = cluster.run("demo", "--broker", cluster.url, "--nodes", "2", "--requests", "5", "--json")
    assert demo.returncode == 2, demo.stdout + demo.stderr
    assert "already exists" in demo.stderr
    assert "Traceback" not in demo.stderr
    # a demo with no exchange named runs on one of its own, and removes it after
    plain = cluster.url.split("?", 1)[0]
    done = cluster.run("demo", "--broker", plain, "--nodes", "2", "--requests", "5", "--json")
    assert done.returncode == 0, done.stderr
    status, placed = cluster.request("--vcpus", "1", "--memory-mb", "512")
    assert status == 0, placed
    assert [a["node"] for a in placed["allocations"]] == ["live"]
    cluster.stop("live")
    audit_nodes(cluster, [placed], {placed["request_id"]: 1})


def test_reservoir_nodes_lists_every_live_node_with_its_usage_and_tier(cluster: Cluster) -> None:
    cluster.start_node("a", vcpus=8, memory_mb=16384)
    cluster.start_node("b", vcpus=4, memory_mb=8192)
    status, placed = cluster.request("--vcpus", "2", "--memory-mb", "1024")
    assert status == 0, placed
    done = cluster.run("nodes", "-f", "json", "--expect-nodes", "2")
    assert done.returncode == 0, done.stderr
    # a row per node and resource class, in the field names of GET /v1/nodes
    listed = {(row["name"], row["class"]): row for row in json.loads(done.stdout)}
    assert {name for name, _ in listed} == {"a", "b"}
    assert listed["a", "VCPU"]["capacity"] == listed["a", "VCPU"]["total"] == 8
    assert listed["b", "MEMORY_MB"]["capacity"] == 8192
    assert listed["b", "MEMORY_MB"]["unit"] == "MiB"
    (holder,) = [a["node"] for a in placed["allocations"]]
    assert listed[holder, "VCPU"]["used"] == 2
    assert listed[holder, "VCPU"]["free"] == listed[holder, "VCPU"]["capacity"] - 2
    assert listed[holder, "VCPU"]["allocations"] == 1
    assert {n["tier"] for n in listed.values()} <= {10, 25, 50}
    table = cluster.run("nodes", "--expect-nodes", "2")
    assert table.returncode == 0 and "VCPU" in table.stdout
    assert table.stdout.split("\n")[0].split()[:5] == ["node", "release", "class", "unit", "total"]
    assert {n["release"] for n in listed.values()} == {__version__}
    picked = cluster.run("nodes", "--expect-nodes", "2", "-f", "value", "-c", "name", "-c",
                         "class", "-c", "used", "-c", "total")  # fmt: skip
    assert f"{holder} VCPU 2 {8 if holder == 'a' else 4}" in picked.stdout.splitlines()
    for name in list(cluster.nodes):
        cluster.stop(name)
    audit_nodes(cluster, [placed], {placed["request_id"]: 1})


def test_a_mistyped_broker_url_is_one_line_and_status_2(cluster: Cluster) -> None:
    done = cluster.run("request", "--broker", "amqp://guest:guest@127.0.0.1:5672/?exchnge=x",
                       "--vcpus", "1", "--memory-mb", "1")  # fmt: skip
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "did you mean 'exchange'" in done.stderr
    assert "guest:guest" not in done.stderr and "Traceback" not in done.stderr


def test_python_dash_m_reservoir_is_the_reservoir_command(cluster: Cluster) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "reservoir", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0
    assert done.stdout.startswith("reservoir, version ")


def test_a_second_node_of_the_same_name_is_told_one_is_connected(cluster: Cluster) -> None:
    cluster.start_node("twin", vcpus=2, memory_mb=1024)
    done = cluster.run(
        "node", "--name", "twin", "--vcpus", "2", "--memory-mb", "1024", "--connect-attempts", "1"
    )
    assert done.returncode == 3
    assert "a node named twin is already connected to this broker" in done.stderr
    assert "Traceback" not in done.stderr
    cluster.stop("twin")


def test_free_without_a_node_frees_wherever_the_request_holds_allocations(
    cluster: Cluster,
) -> None:
    cluster.start_node("a", vcpus=4, memory_mb=8192)
    cluster.start_node("b", vcpus=4, memory_mb=8192)
    status, pair = cluster.request(
        "--vcpus",
        "1",
        "--memory-mb",
        "512",
        "--count",
        "2",
        "--group",
        "g",
        "--policy",
        "anti-affinity",
    )
    assert status == 0, pair
    freed = cluster.run("free", "--request-id", pair["request_id"])
    assert freed.returncode == 0, freed.stderr
    assert sorted(line.split()[-1] for line in freed.stdout.splitlines()) == ["a", "b"]
    again = cluster.run("free", "--request-id", pair["request_id"])
    assert again.returncode == 1
    assert "no node answering holds anything" in again.stderr
    for name in list(cluster.nodes):
        cluster.stop(name)
        assert cluster.allocations(name) == []


def test_requestors_take_their_roster_from_a_keeper_process(cluster: Cluster) -> None:
    keeper = cluster.start("keeper k1", "keeper", "--name", "k1")
    try:
        keeper.wait_for("keeper k1: ready")
        cluster.start_node("a", vcpus=4, memory_mb=8192)
        cluster.start_node("b", vcpus=4, memory_mb=8192)
        keeping = {**cluster.env, "RESERVOIR_ROSTER_FROM": "keeper"}
        placed = []
        for _ in range(3):
            done = cluster.run("request", "--json", "--timeout", "20", "--vcpus", "2",
                               "--memory-mb", "1024", env=keeping)  # fmt: skip
            assert done.returncode == 0, done.stderr
            placed.append(json.loads(done.stdout))
        assert sorted(a["node"] for p in placed for a in p["allocations"])[-1] in ("a", "b")
        assert keeper.terminate(timeout_s=20) == 130  # stopped by a signal
        keeper.wait_for("keeper k1: stopped, 2 node(s) known")
        # with no keeper, a requestor follows the announcements itself: it still places
        done = cluster.run("request", "--json", "--timeout", "20", "--vcpus", "1",
                           "--memory-mb", "512", env=keeping)  # fmt: skip
        assert done.returncode == 0, done.stderr
        placed.append(json.loads(done.stdout))
        for name in list(cluster.nodes):
            cluster.stop(name)
        audit_nodes(cluster, placed, {p["request_id"]: 1 for p in placed})
    finally:
        keeper.kill()
