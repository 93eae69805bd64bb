"""PCI devices: a request asks for devices by alias and count with a NUMA affinity policy;
the node picks the addresses when it reserves, on the cells the policy allows, and the
reservation and then the allocation hold them, so no device is ever handed out twice."""

from __future__ import annotations

import concurrent.futures
import contextlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from reservoir.protocol.effects import Send
from reservoir.protocol.ledger import Allocation, Inventory, Ledger
from reservoir.protocol.messages import NumaPlacement, NumaSpec, Offer, ReservationRequest
from reservoir.protocol.node import NodeConfig, NodeMachine
from reservoir.protocol.numa import NumaCell, NumaTopology, PciDevice
from reservoir.protocol.placement import (
    InvalidRequest,
    Placement,
    PlacementError,
    reason_label,
    request_of,
)
from reservoir.testing import Simulation

T0 = 100.0


def two_cell_topology(*devices: PciDevice, sockets: tuple[int, int] | None = None) -> NumaTopology:
    """Two cells of 4 CPUs and 8 GiB each (CPUs 0-3 on cell 0, 4-7 on cell 1)."""
    return NumaTopology(
        tuple(
            NumaCell(
                cell_id=i,
                cpus=frozenset(range(4 * i, 4 * i + 4)),
                memory_mb=8192,
                socket=None if sockets is None else sockets[i],
            )
            for i in range(2)
        ),
        devices=devices,
    )


GPU_ON_0 = PciDevice("0000:3b:00.0", "gpu", cell=0)
GPU_ON_1 = PciDevice("0000:af:00.0", "gpu", cell=1)
GPU_NOWHERE = PciDevice("0000:05:00.0", "gpu", cell=None)


def device_node(topology: NumaTopology) -> NodeMachine:
    node = NodeMachine(
        NodeConfig(
            name="pci-node",
            address="reservoir.node.pci-node",
            inventories={
                "PCPU": Inventory(total=8),
                "VCPU": Inventory(total=8),
                "MEMORY_MB": Inventory(total=16384),
            },
            numa=topology,
        )
    )
    node.start(T0)
    return node


def request(request_id: str, **fields: Any) -> ReservationRequest:
    values: dict[str, Any] = {
        "request_id": request_id, "sender": "req", "reply_to": "req-inbox",
        "tier": 100, "attempt": 1, "ttl_s": 5.0, "explain": True,
        "resources": {"PCPU": 2, "MEMORY_MB": 1024},
        "numa": NumaSpec(nodes=1, dedicated_cpus=True),
    }  # fmt: skip
    values.update(fields)
    return ReservationRequest(**values)


def answer(node: NodeMachine, message: ReservationRequest) -> Any:
    (sent,) = [e.message for e in node.handle(message, T0) if isinstance(e, Send)]
    return sent


def held_placement(node: NodeMachine, request_id: str) -> NumaPlacement:
    reservation = node.ledger.reservation_for(request_id)
    assert reservation is not None
    (placement,) = reservation.numa
    return placement


def test_a_required_device_comes_from_the_cell_of_the_pinned_cpus() -> None:
    node = device_node(two_cell_topology(GPU_ON_1))
    offer = answer(node, request("r1", pci={"gpu": 1}, numa_policy="required"))
    assert isinstance(offer, Offer)
    placement = held_placement(node, "r1")
    assert placement.cells == (1,)
    assert placement.devices == ("0000:af:00.0",)
    assert set(placement.cpus) <= set(range(4, 8))
    assert node.ledger.violations() == []


def test_a_required_device_is_refused_when_its_cell_has_no_room_for_the_cpus() -> None:
    node = device_node(two_cell_topology(GPU_ON_0))
    assert isinstance(answer(node, request("busy", resources={"PCPU": 3, "MEMORY_MB": 512})), Offer)
    assert held_placement(node, "busy").cells == (0,)  # one free CPU left beside the GPU
    decline = answer(node, request("r1", pci={"gpu": 1}, numa_policy="required"))
    assert decline.kind == "decline"
    assert decline.reasons[0].code == "pci"
    assert node.ledger.reservation_for("r1") is None


def test_the_refusal_names_the_device_and_the_cell_it_was_wanted_on() -> None:
    node = device_node(two_cell_topology(GPU_ON_1))
    assert isinstance(answer(node, request("first", pci={"gpu": 1}, numa_policy="required")), Offer)
    decline = answer(node, request("second", pci={"gpu": 1}, numa_policy="required"))
    assert decline.kind == "decline"
    (reason,) = decline.reasons
    assert reason.code == "pci" and reason.subject == "gpu"
    assert reason_label(reason) == (
        "no free gpu on the NUMA cell of 2 free dedicated CPUs (numa_policy required)"
    )


def test_a_node_without_the_alias_says_so() -> None:
    node = device_node(two_cell_topology(GPU_ON_0))
    decline = answer(node, request("r1", pci={"nic-vf": 1}))
    assert decline.reasons[0].code == "pci"
    assert "no PCI device with alias nic-vf" in decline.reasons[0].detail


def test_legacy_lets_a_device_without_a_numa_cell_go_anywhere_but_required_does_not() -> None:
    node = device_node(two_cell_topology(GPU_NOWHERE))
    refused = answer(node, request("r1", pci={"gpu": 1}, numa_policy="required"))
    assert refused.kind == "decline"
    assert isinstance(answer(node, request("r2", pci={"gpu": 1}, numa_policy="legacy")), Offer)
    assert held_placement(node, "r2").devices == ("0000:05:00.0",)


def test_preferred_takes_a_device_from_another_cell_when_its_own_has_none() -> None:
    node = device_node(two_cell_topology(GPU_ON_0))
    # fill cell 0's CPUs, so the instance lands on cell 1
    assert isinstance(answer(node, request("fill", resources={"PCPU": 4, "MEMORY_MB": 512})), Offer)
    fill_cells = held_placement(node, "fill").cells
    assert isinstance(answer(node, request("r1", pci={"gpu": 1}, numa_policy="preferred")), Offer)
    placement = held_placement(node, "r1")
    assert placement.cells != fill_cells
    assert placement.devices == (GPU_ON_0.address,)
    assert answer(node, request("r2", pci={"gpu": 1}, numa_policy="required")).kind == "decline"


def test_socket_allows_a_device_on_another_cell_of_the_same_socket() -> None:
    same_socket = device_node(two_cell_topology(GPU_ON_0, sockets=(0, 0)))
    assert isinstance(
        answer(same_socket, request("fill", resources={"PCPU": 4, "MEMORY_MB": 64})), Offer
    )
    assert isinstance(
        answer(same_socket, request("r1", pci={"gpu": 1}, numa_policy="socket")), Offer
    )
    assert held_placement(same_socket, "r1").cells != held_placement(same_socket, "fill").cells
    two_sockets = device_node(two_cell_topology(GPU_ON_0, sockets=(0, 1)))
    assert isinstance(
        answer(two_sockets, request("fill", resources={"PCPU": 4, "MEMORY_MB": 64})), Offer
    )
    decline = answer(two_sockets, request("r1", pci={"gpu": 1}, numa_policy="socket"))
    assert "no free gpu on the socket of" in decline.reasons[0].detail


def test_a_request_without_a_numa_shape_takes_devices_from_any_cell() -> None:
    node = device_node(two_cell_topology(GPU_ON_0, GPU_ON_1))
    for request_id in ("r1", "r2"):
        shape = request(
            request_id, resources={"VCPU": 1, "MEMORY_MB": 64}, numa=None, pci={"gpu": 1}
        )
        assert isinstance(answer(node, shape), Offer)
    devices = {held_placement(node, r).devices for r in ("r1", "r2")}
    assert devices == {(GPU_ON_0.address,), (GPU_ON_1.address,)}
    third = request("r3", resources={"VCPU": 1, "MEMORY_MB": 64}, numa=None, pci={"gpu": 1})
    assert "no 1 free gpu: 0 of 2 free" in answer(node, third).reasons[0].detail


def test_a_node_without_a_topology_has_no_devices() -> None:
    node = NodeMachine(NodeConfig(name="n", address="a", inventories={"VCPU": Inventory(total=8)}))
    node.start(T0)
    decline = answer(node, request("r1", resources={"VCPU": 1}, numa=None, pci={"gpu": 1}))
    assert decline.reasons[0].code == "pci"


def test_several_instances_of_one_request_get_different_devices() -> None:
    node = device_node(two_cell_topology(GPU_ON_0, GPU_ON_1))
    assert isinstance(answer(node, request("r1", count=2, pci={"gpu": 1})), Offer)
    reservation = node.ledger.reservation_for("r1")
    assert reservation is not None
    assert sorted(p.devices for p in reservation.numa) == [(GPU_ON_0.address,), (GPU_ON_1.address,)]


def test_the_ledger_reports_a_device_held_twice_or_not_the_nodes() -> None:
    ledger = Ledger({"VCPU": Inventory(total=8)}, devices=frozenset({"0000:3b:00.0"}))
    for allocation_id in ("a1", "a2"):
        ledger.add_allocation(
            Allocation(
                allocation_id=allocation_id, request_id=allocation_id, reservation_id="x",
                owner="req", resources={"VCPU": 1},
                numa=NumaPlacement(cells=(), devices=("0000:3b:00.0",)),
            )
        )  # fmt: skip
    ledger.add_allocation(
        Allocation(
            allocation_id="a3", request_id="a3", reservation_id="x", owner="req",
            resources={"VCPU": 1}, numa=NumaPlacement(cells=(), devices=("0000:99:00.0",)),
        )
    )  # fmt: skip
    problems = ledger.violations()
    assert any("0000:3b:00.0 held 2 times" in p for p in problems)
    assert any("0000:99:00.0" in p and "not the node's" in p for p in problems)


def test_a_topology_refuses_a_device_listed_twice_or_on_a_cell_it_lacks() -> None:
    with pytest.raises(ValueError, match="listed twice"):
        two_cell_topology(GPU_ON_0, GPU_ON_0)
    with pytest.raises(ValueError, match="NUMA cell 7"):
        two_cell_topology(PciDevice("0000:01:00.0", "gpu", cell=7))


def test_the_request_shape_takes_pci_and_checks_it() -> None:
    spec = request_of(vcpus=1, pci={"gpu-a100": 1}, numa_policy="required")
    assert spec.pci == {"gpu-a100": 1} and spec.numa_policy == "required"
    with pytest.raises(InvalidRequest, match="numa_policy places PCI devices"):
        request_of(vcpus=1, numa_policy="required")
    with pytest.raises(InvalidRequest, match="pci"):
        request_of(vcpus=1, pci={"gpu a100": 1})
    with pytest.raises(InvalidRequest, match="numa_policy"):
        request_of(vcpus=1, pci={"gpu": 1}, numa_policy="sometimes")


def test_racing_requestors_get_disjoint_devices_end_to_end(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    for i in range(2):
        sim.add_node(
            f"n{i}",
            inventories={"PCPU": 8, "MEMORY_MB": 16384},
            numa=two_cell_topology(
                PciDevice(f"0000:0{i}:00.0", "gpu", cell=0),
                PciDevice(f"0000:0{i}:01.0", "gpu", cell=1),
            ),
        )
    requestors = [sim.add_requestor(f"r{i}") for i in range(3)]
    futures: list[concurrent.futures.Future[Placement]] = [
        requestors[i % 3].submit(
            resources={"PCPU": 1, "MEMORY_MB": 512},
            numa=NumaSpec(nodes=1, dedicated_cpus=True),
            pci={"gpu": 1},
            numa_policy="required",
        )
        for i in range(6)
    ]
    assert sim.run_until_done(futures)
    placed = []
    for future in futures:
        with contextlib.suppress(PlacementError):
            placed.append(future.result(timeout=0))
    assert len(placed) == 4  # four GPUs in all
    for placement in placed:
        (allocation,) = placement.allocations
        assert allocation.numa is not None and len(allocation.numa.devices) == 1
    sim.finish(placed)


def test_the_sqlite_store_keeps_an_allocations_device_addresses(tmp_path: Path) -> None:
    from reservoir.runtime.store import SqliteStore

    allocation = Allocation(
        allocation_id="a1", request_id="r1", reservation_id="x", owner="req",
        resources={"PCPU": 2},
        numa=NumaPlacement(cells=(1,), cpus=(4, 5), devices=("0000:af:00.0",)),
    )  # fmt: skip
    store = SqliteStore.for_node(tmp_path, "pci-node")
    store.put(allocation)
    store.close()
    reopened = SqliteStore.for_node(tmp_path, "pci-node")
    (loaded,) = reopened.load()
    reopened.close()
    assert loaded.numa is not None and loaded.numa.devices == ("0000:af:00.0",)


def test_a_device_held_only_by_a_live_reservation_makes_the_node_busy_not_full() -> None:
    node = device_node(two_cell_topology(GPU_ON_1))
    assert isinstance(answer(node, request("first", pci={"gpu": 1}, numa_policy="required")), Offer)
    decline = answer(node, request("second", pci={"gpu": 1}, numa_policy="required"))
    assert decline.kind == "decline" and decline.busy  # worth asking again shortly
    expired = node.on_timer("expire-reservations", T0 + 6.0)  # the first is never awarded
    assert expired is not None and node.ledger.reservation_for("first") is None
    assert isinstance(answer(node, request("third", pci={"gpu": 1})), Offer)


def test_a_device_held_by_an_allocation_makes_the_node_full_not_busy() -> None:
    node = device_node(two_cell_topology(GPU_ON_1))
    node.ledger.add_allocation(
        Allocation(
            allocation_id="a1", request_id="placed", reservation_id="x", owner="req",
            resources={"PCPU": 2, "MEMORY_MB": 1024},
            numa=NumaPlacement(cells=(1,), cpus=(4, 5), memory_mb_per_cell=(1024,),
                               vcpus_per_cell=(2,), devices=(GPU_ON_1.address,)),
        )
    )  # fmt: skip
    answer(node, request("other", resources={"PCPU": 1, "MEMORY_MB": 64}))  # a reservation
    decline = answer(node, request("second", pci={"gpu": 1}, numa_policy="required"))
    assert decline.kind == "decline" and not decline.busy


def test_over_http_a_gpu_request_is_placed_and_names_its_device_and_cell() -> None:
    import asyncio

    from reservoir import NodeAgent, audit
    from reservoir.brokers.inprocess import InProcessBroker
    from reservoir.service import create_app
    from reservoir.testing.asgi import serving

    broker = InProcessBroker()
    node = NodeAgent(
        broker,
        name="gpu-node",
        inventories={"PCPU": 8, "MEMORY_MB": 16384},
        numa=two_cell_topology(GPU_ON_1),
    )
    body = {
        "resources": {"PCPU": 2}, "memory_mb": 1024, "pci": {"gpu": 1},
        "numa": {"nodes": 1, "dedicated_cpus": True}, "numa_policy": "required",
        "timeout_s": 5,
    }  # fmt: skip

    async def post_twice() -> tuple[httpx.Response, httpx.Response]:
        async with serving(create_app(broker)) as client:
            first = await client.post("/v1/reservations", json=body)
            second = await client.post("/v1/reservations", json=body)
            return first, second

    try:
        first, second = asyncio.run(post_twice())
    finally:
        node.close()
        broker.close()
    assert first.status_code == 201, first.text
    (allocation,) = first.json()["allocations"]
    assert allocation["pci_devices"] == [GPU_ON_1.address]
    assert allocation["numa_cells"] == [1]
    assert second.status_code == 409, second.text
    assert "no free gpu on the NUMA cell of 2 free dedicated CPUs" in second.text
    audit([node.snapshot()]).raise_if_failed()
