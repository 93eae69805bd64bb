"""NUMA fitting: the node splits instances over its cells with the full request and the
reservation holds the very CPUs, so concurrent pinned requests never share one."""

from __future__ import annotations

import concurrent.futures
import contextlib
from typing import Any

import pytest

from reservoir.protocol.effects import Send
from reservoir.protocol.ledger import Inventory
from reservoir.protocol.messages import NumaSpec, Offer, ReservationRequest
from reservoir.protocol.node import NodeConfig, NodeMachine
from reservoir.protocol.numa import NumaTopology
from reservoir.protocol.placement import Placement, PlacementError
from reservoir.testing import Simulation

T0 = 100.0


def numa_node(cells: int = 2, cpus: int = 8, memory_mb: int = 16384, **kw: Any) -> NodeMachine:
    node = NodeMachine(
        NodeConfig(
            name="numa-node",
            address="reservoir.node.numa-node",
            inventories={
                "PCPU": Inventory(total=cpus),
                "VCPU": Inventory(total=cpus),
                "MEMORY_MB": Inventory(total=memory_mb),
            },
            numa=NumaTopology.uniform(cells, cpus, memory_mb, **kw),
        )
    )
    node.start(T0)
    return node


def request(request_id: str, **fields: Any) -> ReservationRequest:
    values: dict[str, Any] = {
        "request_id": request_id, "sender": "req", "reply_to": "req-inbox",
        "tier": 100, "attempt": 1, "ttl_s": 5.0, "explain": True,
    }  # fmt: skip
    values.update(fields)
    return ReservationRequest(**values)


def offered(node: NodeMachine, message: ReservationRequest) -> Offer | None:
    for effect in node.handle(message, T0):
        sent = getattr(effect, "message", None)
        if isinstance(sent, Offer):
            return sent
    return None


def test_a_pinned_instance_gets_specific_cpus_in_one_cell() -> None:
    node = numa_node()
    offer = offered(
        node,
        request("r1", resources={"PCPU": 2, "MEMORY_MB": 2048},
                numa=NumaSpec(nodes=1, dedicated_cpus=True)),
    )  # fmt: skip
    assert offer is not None
    (reservation,) = node.ledger.reservations.values()
    (placement,) = reservation.numa
    assert len(placement.cells) == 1
    assert len(placement.cpus) == 2


def test_concurrent_pinned_reservations_never_share_a_cpu() -> None:
    node = numa_node(cells=2, cpus=8)
    for i in range(6):
        node.handle(
            request(f"r{i}", resources={"PCPU": 2, "MEMORY_MB": 1024},
                    numa=NumaSpec(nodes=1, dedicated_cpus=True)),
            T0,
        )  # fmt: skip
    held = [cpu for r in node.ledger.reservations.values() for p in r.numa for cpu in p.cpus]
    assert len(held) == 8  # four instances fit, the fifth and sixth find no free CPUs
    assert len(set(held)) == len(held)


def test_an_instance_split_over_two_cells_takes_half_of_each() -> None:
    node = numa_node(cells=2, cpus=8, memory_mb=16384)
    offer = offered(
        node, request("r1", resources={"VCPU": 4, "MEMORY_MB": 4096}, numa=NumaSpec(nodes=2))
    )
    assert offer is not None
    (placement,) = next(iter(node.ledger.reservations.values())).numa
    assert placement.cells == (0, 1)
    assert placement.memory_mb_per_cell == (2048, 2048)
    assert placement.vcpus_per_cell == (2, 2)


def test_memory_per_cell_limits_numa_instances_even_when_the_node_total_would_fit() -> None:
    node = numa_node(cells=2, cpus=8, memory_mb=8192)  # 4096 MB per cell
    effects = node.handle(
        request("r1", resources={"VCPU": 1, "MEMORY_MB": 6144}, numa=NumaSpec(nodes=1)), T0
    )
    decline = next(e.message for e in effects if isinstance(e, Send))
    assert decline.kind == "decline"
    assert decline.reasons[0].code == "numa"
    assert "6144 MB" in decline.reasons[0].detail


def test_an_uneven_split_is_explained() -> None:
    node = numa_node()
    effects = node.handle(
        request("r1", resources={"VCPU": 3, "MEMORY_MB": 1024}, numa=NumaSpec(nodes=2)), T0
    )
    (decline,) = [e.message for e in effects if isinstance(e, Send)]
    assert "do not split evenly" in decline.reasons[0].detail


def test_huge_pages_are_counted_per_cell() -> None:
    node = numa_node(cells=1, cpus=8, memory_mb=16384, hugepages_per_cell={2048: 1024})
    spec = NumaSpec(nodes=1, hugepage_kb=2048)  # 1024 pages of 2 MiB = 2048 MB
    first = offered(node, request("r1", resources={"VCPU": 1, "MEMORY_MB": 1024}, numa=spec))
    second = offered(node, request("r2", resources={"VCPU": 1, "MEMORY_MB": 1024}, numa=spec))
    third = offered(node, request("r3", resources={"VCPU": 1, "MEMORY_MB": 1024}, numa=spec))
    assert first is not None and second is not None
    assert third is None


def test_a_node_without_numa_cells_cannot_take_a_numa_request() -> None:
    node = NodeMachine(
        NodeConfig(name="n", address="a", inventories={"VCPU": Inventory(total=8),
                                                       "MEMORY_MB": Inventory(total=8192)})
    )  # fmt: skip
    effects = node.handle(
        request("r1", resources={"VCPU": 1, "MEMORY_MB": 512}, numa=NumaSpec()), T0
    )
    (decline,) = [e.message for e in effects if isinstance(e, Send)]
    assert "no NUMA topology" in decline.reasons[0].detail


def test_cells_must_not_share_cpus() -> None:
    from reservoir.protocol.numa import NumaCell

    with pytest.raises(ValueError, match="shares CPUs"):
        NumaTopology((
            NumaCell(0, frozenset({0, 1}), 1024),
            NumaCell(1, frozenset({1, 2}), 1024),
        ))  # fmt: skip


def test_racing_requestors_pin_disjoint_cpus_end_to_end(reservoir_simulation: Simulation) -> None:
    sim = reservoir_simulation
    topology = NumaTopology.uniform(2, 16, 65536)
    for i in range(2):
        sim.add_node(f"n{i}", inventories={"PCPU": 16, "MEMORY_MB": 65536}, numa=topology)
    requestors = [sim.add_requestor(f"r{i}") for i in range(4)]
    futures: list[concurrent.futures.Future[Placement]] = [
        requestors[i % 4].submit(
            resources={"PCPU": 4, "MEMORY_MB": 4096},
            numa=NumaSpec(nodes=1, dedicated_cpus=True),
        )
        for i in range(10)
    ]
    assert sim.run_until_done(futures)
    placed = []
    for future in futures:
        with contextlib.suppress(PlacementError):
            placed.append(future.result(timeout=0))
    assert len(placed) == 8  # 2 nodes x 16 CPUs / 4 per instance
    for node in sim.nodes.values():
        cpus = [cpu for a in node.allocations() if a.numa for cpu in a.numa.cpus]
        assert len(cpus) == len(set(cpus)) == 16
    sim.finish(placed)
