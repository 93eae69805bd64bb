"""Bounded fan-out, through the real runtime on a virtual clock: a placement asks a few
sampled nodes whatever the cluster's size, the tier broadcast runs only when sampling comes
back short, and a request that fits nowhere fails within a second.

Each test's simulation ends with the invariant audit (the ``reservoir_simulation`` fixture).
"""

from __future__ import annotations

import pytest

from reservoir import PlacementError
from reservoir.broker import Delivery
from reservoir.brokers.inprocess import Faults
from reservoir.protocol.placement import Placement
from reservoir.runtime.settings import Settings
from reservoir.testing import Simulation


def delivered(sim: Simulation, kind: str) -> int:
    return sim.counters().get(f"received:{kind}", 0)


def place_some(sim: Simulation, how_many: int) -> list[Placement]:
    requestor = sim.requestors[0]
    return [sim.place(requestor, vcpus=1, memory_mb=1024) for _ in range(how_many)]


@pytest.mark.parametrize("nodes", [20, 400])
def test_a_placement_asks_two_nodes_whatever_the_size_of_the_cluster(
    reservoir_simulation: Simulation, nodes: int
) -> None:
    sim = reservoir_simulation
    sim.add_nodes(nodes, vcpus=64, memory_mb=262144)
    sim.add_requestor("r0")
    sim.advance(0.1)  # the roll call's answers
    before = delivered(sim, "request")
    place_some(sim, 50)
    assert delivered(sim, "request") - before == 2 * 50
    assert sim.requestors[0].machine.counters["exhaustive_steps"] == 0


def test_a_new_requestor_learns_every_node_from_its_roll_call(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.add_nodes(30, vcpus=8)
    requestor = sim.add_requestor("r0")
    sim.advance(0.1)
    assert len(requestor.machine.roster) == 30


def test_a_node_that_stops_leaves_every_roster(reservoir_simulation: Simulation) -> None:
    sim = reservoir_simulation
    sim.add_nodes(3, vcpus=8)
    requestor = sim.add_requestor("r0")
    sim.advance(0.1)
    sim.nodes.pop("node-1").close()
    sim.advance(0.1)
    assert "node-1" not in requestor.machine.roster
    assert len(requestor.machine.roster) == 2


def test_a_request_only_a_rare_node_can_take_goes_straight_to_it_by_its_room(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.add_nodes(40, vcpus=8)
    sim.add_node("big", vcpus=128)
    requestor = sim.add_requestor("r0", settings=Settings(probe_rounds=2))
    sim.advance(0.1)
    first = sim.place(requestor, vcpus=70)  # big is now in tier 75, with 58 VCPUs free
    probes_before = requestor.machine.counters["probes"]
    second = sim.place(requestor, vcpus=50)
    assert first.nodes == second.nodes == ("big",)
    # No 8-VCPU node's room can take 50 VCPUs: the one probe goes to big.
    assert requestor.machine.counters["probes"] == probes_before + 1
    assert requestor.machine.counters["exhaustive_steps"] == 0


def test_a_node_the_roster_lost_is_still_found_by_the_exhaustive_step(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.add_nodes(40, vcpus=8)
    sim.add_node("big", vcpus=128)
    requestor = sim.add_requestor("r0", settings=Settings(probe_rounds=2))
    sim.advance(0.1)
    # As if big's announcement had been lost: sampling cannot know of it.
    assert requestor.machine.roster.remove("big")
    placed = sim.place(requestor, vcpus=70)
    assert placed.nodes == ("big",)
    assert requestor.machine.counters["exhaustive_steps"] == 1


@pytest.mark.parametrize("explain", [False, True])
def test_a_request_that_fits_nowhere_fails_within_a_second(
    explain: bool,
) -> None:
    sim = Simulation(faults=Faults(delay_s=(0.001, 0.002), seed=3))
    sim.add_nodes(50, vcpus=8, memory_mb=16384)
    requestor = sim.add_requestor("r0")
    sim.advance(0.5)
    started = sim.scheduler.clock.now()
    with pytest.raises(PlacementError):
        sim.place(requestor, vcpus=64, memory_mb=1024, explain=explain)
    assert sim.scheduler.clock.now() - started < 1.0
    sim.finish()


def test_a_full_cluster_fails_the_next_request_within_a_second() -> None:
    sim = Simulation(faults=Faults(delay_s=(0.001, 0.002), seed=4))
    sim.add_nodes(20, vcpus=4, memory_mb=8192)
    requestor = sim.add_requestor("r0")
    sim.advance(0.5)
    placements = [sim.place(requestor, vcpus=4, memory_mb=1024) for _ in range(20)]
    started = sim.scheduler.clock.now()
    with pytest.raises(PlacementError):
        sim.place(requestor, vcpus=1, memory_mb=1024)
    assert sim.scheduler.clock.now() - started < 1.0
    sim.finish(placements)


def test_slow_answers_to_probes_are_waited_for_rather_than_asking_more_nodes() -> None:
    # The roll call times the network at a millisecond; offers then take 0.3 s (a busy
    # moment). Giving up on them would ask more nodes and add to the load.
    def offers_only(delivery: Delivery) -> bool:
        return b'"kind":"offer"' in delivery.body

    faults = Faults(delay_s=(0.3, 0.3), applies_to=offers_only, seed=5)
    sim = Simulation(faults=faults)
    sim.add_nodes(20, vcpus=8)
    requestor = sim.add_requestor("r0")
    sim.advance(0.1)
    before = delivered(sim, "request")
    placement = sim.place(requestor, vcpus=1)
    assert len(placement.nodes) == 1
    assert delivered(sim, "request") - before == 2
    sim.finish([placement])
