"""A real three-node RabbitMQ cluster on loopback: participants are given every node's
address; the node a participant is connected to is killed and placements carry on on
another, after the participant reconnects and re-declares its inbox and bindings.

Needs the machine's ``rabbitmq-server`` and root; skipped without them, failed under
``CI`` (which must run it)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from reservoir import NodeAgent, Placement, PlacementError, Requestor
from reservoir.brokers import connect
from reservoir.runtime.auditor import audit_cluster
from reservoir.testing.rabbitmq_cluster import ClusterUnavailable, RabbitMqCluster

pytestmark = pytest.mark.rabbitmq


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitMqCluster]:
    try:
        cluster = RabbitMqCluster(Path(tmp_path_factory.mktemp("rabbitmq-cluster")))
    except ClusterUnavailable as error:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the cluster test: {error}")
        pytest.skip(str(error))
    with cluster:
        yield cluster


def connections(cluster: RabbitMqCluster, index: int, *, asking: int = 2) -> int:
    """Client connections held by broker node ``index`` (asked of a node that is up)."""
    # a connection's pid names the node that holds it: <name@host.N.M.K>
    listed = cluster.ctl(cluster.nodes[asking], "list_connections", "pid").split()
    return sum(1 for pid in listed if pid.startswith(f"<{cluster.nodes[index].node_name}."))


def test_killing_the_broker_node_under_the_participants_moves_them_to_another(
    cluster: RabbitMqCluster,
) -> None:
    # Everyone starts on node 0: its death is theirs to survive.
    addresses = ";".join(cluster.urls())
    broker = connect(addresses)
    nodes = [NodeAgent(broker, name=f"clustered-{i}", vcpus=8, memory_mb=8192) for i in range(3)]
    placements: list[Placement] = []
    try:
        with Requestor(broker) as requestor:
            placements += [
                requestor.reserve(vcpus=1, memory_mb=256, timeout_s=30) for _ in range(5)
            ]
            cluster.kill(0)
            # in flight at the moment of the kill: placed or failed clearly, never hung
            outcomes: list[Placement | PlacementError] = []
            for _ in range(10):
                try:
                    outcomes.append(requestor.reserve(vcpus=1, memory_mb=256, timeout_s=60))
                except PlacementError as error:
                    outcomes.append(error)
            placements += [p for p in outcomes if isinstance(p, Placement)]
            assert len(placements) >= 10, outcomes
            assert connections(cluster, 1) + connections(cluster, 2) >= 1  # moved on
        found = audit_cluster(cluster.url(1), placements=placements, expect_nodes=3, wait_s=15)
        assert found.ok, found.as_json()
        assert found.orphans == ()
    finally:
        for node in nodes:
            node.close()
        broker.close()
        cluster.restart(0)


def test_a_node_whose_port_is_taken_as_it_starts_moves_to_fresh_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The ports are picked free, not held: here another listener takes one first. What
    # the failed start writes where the VM runs (an Erlang crash dump) stays out of the
    # caller's directory.
    try:
        cluster = RabbitMqCluster(tmp_path / "cluster", size=1)
    except ClusterUnavailable as error:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the cluster test: {error}")
        pytest.skip(str(error))
    caller = tmp_path / "caller"
    caller.mkdir()
    monkeypatch.chdir(caller)
    node = cluster.nodes[0]
    taken = node.dist_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", taken))
        squatter.listen()
        with cluster.start():
            assert node.dist_port != taken
            with connect(cluster.url(0)) as broker:
                assert broker.wait_ready(30)
    assert list(caller.iterdir()) == []
