"""Placement fidelity on a real RabbitMQ, through both adapters: resource classes and
traits, NUMA pinning, server groups, multi-instance requests, idempotency, operators'
filters, explanations and releases. Every test ends with the invariant audit over the
nodes' ledgers."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from reservoir import (
    GroupSpec,
    Inventory,
    NodeAgent,
    NumaSpec,
    NumaTopology,
    Placement,
    PlacementError,
    Requestor,
    SqliteStore,
    audit,
)
from reservoir.broker import Broker
from reservoir.brokers import connect

pytestmark = pytest.mark.rabbitmq


@pytest.fixture(params=["pika", "kombu"])
def broker(request: pytest.FixtureRequest, reservoir_amqp_url: str) -> Iterator[Broker]:
    url = reservoir_amqp_url
    with connect(url if request.param == "pika" else "kombu+" + url) as opened:
        yield opened


class Cloud:
    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.nodes: list[NodeAgent] = []
        self.placements: list[Placement] = []

    def node(self, name: str, **kwargs: object) -> NodeAgent:
        agent = NodeAgent(self.broker, name=f"{name}-{uuid.uuid4().hex[:6]}", **kwargs)  # type: ignore[arg-type]
        self.nodes.append(agent)
        return agent

    def audit(self) -> None:
        report = audit([n.snapshot() for n in self.nodes], self.placements)
        report.raise_if_failed(allow_orphans=False)


@pytest.fixture
def cloud(broker: Broker) -> Iterator[Cloud]:
    cloud = Cloud(broker)
    yield cloud
    for node in cloud.nodes:
        node.close()


def test_traits_custom_classes_and_explanations(cloud: Cloud) -> None:
    gpu = cloud.node("gpu", vcpus=16, memory_mb=32768, traits=["HW_GPU"],
                     inventories={"CUSTOM_GPU": 2})  # fmt: skip
    cloud.node("plain", vcpus=16, memory_mb=32768)
    with Requestor(cloud.broker) as requestor:
        placement = requestor.reserve(vcpus=2, resources={"CUSTOM_GPU": 1},
                                      required_traits=["HW_GPU"])  # fmt: skip
        assert placement.nodes == (gpu.name,)
        cloud.placements.append(placement)
        with pytest.raises(PlacementError) as failed:
            requestor.reserve(vcpus=64, explain=True, timeout_s=10)
        assert failed.value.explanation.reasons == {"VCPU larger than one instance may take": 2}
    cloud.audit()


def test_multi_instance_all_or_nothing_and_partial(cloud: Cloud) -> None:
    for i in range(3):
        cloud.node(f"m{i}", vcpus=4, memory_mb=8192)
    with Requestor(cloud.broker) as requestor:
        spread = requestor.reserve(vcpus=2, count=3)
        assert len(set(spread.nodes)) == 3
        with pytest.raises(PlacementError):
            requestor.reserve(vcpus=2, count=4, timeout_s=10)  # only 3 slots left
        partial = requestor.reserve(vcpus=2, count=5, min_count=2, timeout_s=10)
        assert len(partial.allocations) == 3
        assert partial.partial
        cloud.placements += [spread, partial]
    cloud.audit()


def test_pinned_numa_requests_from_racing_threads_never_share_a_cpu(cloud: Cloud) -> None:
    topology = NumaTopology.uniform(2, 8, 16384)
    nodes = [cloud.node(f"numa{i}", inventories={"PCPU": 8, "MEMORY_MB": 16384},
                        numa=topology) for i in range(2)]  # fmt: skip
    placed: list[Placement] = []
    with Requestor(cloud.broker) as requestor:

        def place() -> None:
            for _ in range(3):
                with contextlib.suppress(PlacementError):  # the ninth and later find no room
                    placed.append(
                        requestor.reserve(
                            resources={"PCPU": 2, "MEMORY_MB": 1024},
                            numa=NumaSpec(nodes=1, dedicated_cpus=True),
                            timeout_s=15,
                        )
                    )

        threads = [threading.Thread(target=place) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(placed) == 8  # 16 pinned CPUs, 2 per instance
    for node in nodes:
        cpus = [c for a in node.allocations() if a.numa for c in a.numa.cpus]
        assert sorted(cpus) == list(range(8))
    cloud.placements += placed
    cloud.audit()


def test_concurrent_anti_affinity_members_never_share_a_node(cloud: Cloud) -> None:
    for i in range(3):
        cloud.node(f"aa{i}", vcpus=16, memory_mb=32768)
    group = GroupSpec(name=f"web-{uuid.uuid4().hex[:6]}", policy="anti-affinity")
    requestors = [Requestor(cloud.broker) for _ in range(3)]
    futures = [requestors[i % 3].submit(vcpus=1, group=group, timeout_s=15) for i in range(6)]
    placed = [f.result(timeout=30) for f in futures if f.exception(timeout=30) is None]
    for requestor in requestors:
        requestor.close()
    assert sorted(n for p in placed for n in p.nodes) == sorted(n.name for n in cloud.nodes)
    cloud.placements += placed
    cloud.audit()


def test_an_id_is_placed_once_across_requestors_and_restarts(cloud: Cloud, tmp_path: Path) -> None:
    name = f"durable-{uuid.uuid4().hex[:6]}"
    node = NodeAgent(cloud.broker, name=name, vcpus=8, store=SqliteStore.for_node(tmp_path, name))
    with Requestor(cloud.broker) as first:
        placement = first.reserve(vcpus=2, request_id="order-1")
    node.close()
    node = NodeAgent(cloud.broker, name=name, vcpus=8, store=SqliteStore.for_node(tmp_path, name))
    cloud.nodes.append(node)
    with Requestor(cloud.broker) as second:
        assert second.reserve(vcpus=2, request_id="order-1").allocations == placement.allocations
    assert len(node.allocations()) == 1
    cloud.placements.append(placement)
    cloud.audit()


def test_releasing_frees_the_node_and_lowers_its_tier(cloud: Cloud) -> None:
    node = cloud.node("rel", inventories={"VCPU": Inventory(total=10)})
    with Requestor(cloud.broker) as requestor:
        placement = requestor.reserve(vcpus=8)
        assert node.tier() == 100
        requestor.release(placement)
    assert node.allocations() == []
    assert node.tier() == 10
    cloud.audit()


def test_concurrent_requestors_place_everything_on_a_busy_broker(cloud: Cloud) -> None:
    # Many nodes and requestors in one process keep the broker connection and the GIL
    # busy: answers then take longer than the latency a requestor measured at its start.
    # It must wait for them rather than ask ever more nodes (which once collapsed into
    # "offers received: 0" for nearly every request).
    for i in range(30):
        cloud.node(f"busy{i}", vcpus=32, memory_mb=65536)
    requestors = [Requestor(cloud.broker) for _ in range(6)]
    futures = [requestors[i % 6].submit(vcpus=1, timeout_s=20) for i in range(180)]
    placed = [f.result(timeout=60) for f in futures]
    for requestor in requestors:
        requestor.close()
    assert len(placed) == 180
    cloud.placements += placed
    cloud.audit()
