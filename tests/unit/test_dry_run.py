"""Dry runs: a node answers what it would make of a request and reserves nothing; a
``DryRun`` across a cluster lists who would take it and why the others would not, and
leaves every ledger as it found it."""

from __future__ import annotations

from click.testing import CliRunner

from reservoir.cli import main
from reservoir.protocol.effects import Send
from reservoir.protocol.ledger import Inventory
from reservoir.protocol.messages import Assessment, ReservationRequest
from reservoir.protocol.node import NodeConfig, NodeMachine
from reservoir.protocol.placement import PlacementRequest
from reservoir.runtime.dry_run import DryRun
from reservoir.testing import Simulation

T0 = 1000.0


def a_node() -> NodeMachine:
    node = NodeMachine(
        NodeConfig(
            name="node-a",
            address="reservoir.node.node-a",
            inventories={"VCPU": Inventory(total=8), "MEMORY_MB": Inventory(total=16384)},
        )
    )
    node.start(T0)
    return node


def a_dry_run(vcpus: int, count: int = 1, **fields: object) -> ReservationRequest:
    return ReservationRequest(
        request_id="dry-1",
        sender="req-1",
        reply_to="reservoir.requestor.req-1",
        tier=100,
        attempt=1,
        ttl_s=5.0,
        dry_run=True,
        explain=True,
        resources={"VCPU": vcpus, "MEMORY_MB": 1024},
        count=count,
        **fields,  # type: ignore[arg-type]
    )


def test_a_node_assesses_a_dry_run_and_reserves_nothing() -> None:
    node = a_node()
    effects = node.handle(a_dry_run(vcpus=2, count=8), T0 + 1)
    [send] = effects
    assert isinstance(send, Send) and send.address == "reservoir.requestor.req-1"
    answer = send.message
    assert isinstance(answer, Assessment)
    assert (answer.slots, answer.sender, answer.tier) == (4, "node-a", node.tier())
    assert node.ledger.reservations == {}
    assert node.counters["reserved"] == 0
    assert node.counters["dry_runs"] == 1


def test_a_node_says_why_it_could_not_take_a_dry_run() -> None:
    node = a_node()
    [send] = node.handle(a_dry_run(vcpus=64), T0 + 1)
    answer = send.message  # type: ignore[union-attr]
    assert isinstance(answer, Assessment)
    assert answer.slots == 0
    assert [(r.code, r.subject) for r in answer.reasons] == [("too_large", "VCPU")]
    assert node.ledger.reservations == {}


def test_a_dry_run_lists_who_would_take_it_and_why_the_others_would_not(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.add_node("big", vcpus=16, memory_mb=65536)
    sim.add_node("small", vcpus=2, memory_mb=65536)
    sim.add_node("gpu", vcpus=16, memory_mb=65536, traits=["HW_GPU"])
    spec = PlacementRequest(resources={"VCPU": 4, "MEMORY_MB": 1024}, count=3,
                            forbidden_traits=frozenset({"HW_GPU"}))  # fmt: skip
    with DryRun(spec, sim.broker, settings=sim.settings, scheduler=sim.scheduler) as asking:
        asking.ask()
        sim.scheduler.run_until_idle()
        report = asking.report()
    assert [(a.node, a.slots) for a in report.answers] == [("big", 3), ("gpu", 0), ("small", 0)]
    by_node = {a.node: a for a in report.answers}
    assert by_node["small"].reasons == ("VCPU larger than one instance may take",)
    assert by_node["gpu"].reasons == ("forbidden trait HW_GPU present",)
    assert (report.room, report.wanted, report.would_place) == (3, 3, True)
    # nothing held anywhere: no reservation, no allocation, and the audit agrees
    for snapshot in sim.snapshots():
        assert snapshot.reservations == () and snapshot.allocations == ()
    assert all(node.machine.counters["reserved"] == 0 for node in sim.nodes.values())
    sim.finish([])


def test_a_dry_run_with_too_little_room_says_it_would_not_place(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.add_nodes(2, vcpus=4, memory_mb=4096)
    spec = PlacementRequest(resources={"VCPU": 4}, count=3)
    with DryRun(spec, sim.broker, settings=sim.settings, scheduler=sim.scheduler) as asking:
        asking.ask()
        sim.scheduler.run_until_idle()
        report = asking.report()
    assert (report.room, report.would_place) == (2, False)
    assert report.as_json()["would_place"] is False
    sim.finish([])


def test_reservoir_request_dry_run_with_no_node_says_so_and_exits_1() -> None:
    result = CliRunner().invoke(
        main, ["request", "--broker", "memory://", "--vcpus", "1", "--dry-run"]
    )
    assert result.exit_code == 1, result.output
    assert "dry run of 1 instance(s) of VCPU=1: no node answered" in result.output
