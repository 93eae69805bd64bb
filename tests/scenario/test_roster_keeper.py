"""Requestors that take their rosters from a keeper (design.md, "The roster"), through the
real runtime on a virtual clock: what a requestor's start costs, that knowing part of the
cluster is enough, that nothing is lost when nobody hears an announcement, and that with
no keeper a requestor keeps a roster of its own. Each ends with the invariant audit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from reservoir.broker import Delivery
from reservoir.protocol.messages import ROOM_TOPIC, ROSTER_TOPIC, decode_message
from reservoir.runtime.settings import Settings
from reservoir.testing import Simulation

KEEPER = Settings(roster_from="keeper")


@pytest.fixture
def sim() -> Iterator[Simulation]:
    simulation = Simulation(settings=KEEPER)
    yield simulation
    simulation.close()


class Heard:
    """Every message of a kind delivered to some endpoint, counted by kind."""

    def __init__(self, sim: Simulation, *topics: str) -> None:
        self.kinds: list[str] = []
        self.endpoint = sim.broker.open_endpoint(self.hear, name="reservoir.requestor.ear")
        for topic in topics:
            self.endpoint.bind(topic)

    def hear(self, delivery: Delivery) -> None:
        self.kinds.append(decode_message(delivery.body).kind)


def test_a_requestors_start_is_one_query_and_one_sample_whatever_the_nodes(
    sim: Simulation,
) -> None:
    sim.add_keeper()
    sim.add_nodes(40, vcpus=8)
    requestor = sim.add_requestor()
    sim.scheduler.run_until_idle()
    counters = requestor.machine.counters
    assert counters["samples_asked"] == 1
    assert counters.get("no_keeper", 0) == 0
    # the roll call every node would answer was not sent
    assert requestor.metrics.get("sent", "roll_call") == 0
    assert requestor.metrics.get("received", "roster_sample") == 1
    assert requestor.metrics.get("received", "status") == 0
    assert len(requestor.machine.roster) == 40
    placement = sim.place(requestor, vcpus=2)
    sim.finish([placement])


def test_the_nodes_announcements_reach_the_keeper_not_the_requestors(sim: Simulation) -> None:
    keeper = sim.add_keeper()
    sim.add_nodes(6, vcpus=4)
    requestors = [sim.add_requestor() for _ in range(5)]
    placements = [sim.place(requestors[i % 5], vcpus=3) for i in range(6)]  # tiers move
    assert keeper.machine.counters["statuses"] > 6  # the starts, then the moves
    for requestor in requestors:
        assert requestor.metrics.get("received", "status") == 0
    sim.finish(placements)


def test_a_requestor_that_knows_only_part_of_the_cluster_finds_the_one_node_that_fits(
    sim: Simulation,
) -> None:
    # The requestor knows two small nodes of thirty; the one node with room for 16 VCPUs
    # is not among them. It asks the keeper for nodes that may fit before it would ask
    # every node.
    sim.add_keeper()
    sim.add_nodes(29, vcpus=4)
    sim.add_node("big", vcpus=16)
    requestor = sim.add_requestor()
    sim.scheduler.run_until_idle()  # its sample is in
    for name in [*sim.nodes][2:]:
        requestor.machine.roster.remove(name)
    assert len(requestor.machine.roster) == 2
    placement = sim.place(requestor, vcpus=16)
    assert placement.nodes == ("big",)
    assert requestor.machine.counters["exhaustive_steps"] == 0
    sim.finish([placement])


def test_a_requestor_with_no_keeper_follows_the_announcements_itself() -> None:
    sim = Simulation(settings=KEEPER)
    try:
        sim.add_nodes(5, vcpus=4)
        requestor = sim.add_requestor()
        sim.scheduler.run_until_idle()
        assert requestor.machine.counters["no_keeper"] == 1
        assert requestor.metrics.get("sent", "roll_call") == 1
        assert len(requestor.machine.roster) == 5
        placement = sim.place(requestor, vcpus=2)
        sim.finish([placement])
    finally:
        sim.close()


def test_a_node_stops_announcing_its_room_when_no_keeper_hears_and_loses_nothing(
    sim: Simulation,
) -> None:
    # 64 VCPUs: past 75 % the node stays in the last tier, and its room (a class per
    # power of two of what is free) shrinks a class at 12 -> 6 and at 4 -> 3 -> 1
    keeper = sim.add_keeper()
    node = sim.add_node("n1", vcpus=64)
    requestor = sim.add_requestor()
    sent = lambda: node.metrics.get("sent", "status")  # noqa: E731
    placements = [sim.place(requestor, vcpus=52)]  # free 12: the last tier
    heard = keeper.machine.counters["statuses"]
    placements.append(sim.place(requestor, vcpus=6))  # free 6: a smaller room
    assert keeper.machine.counters["statuses"] == heard + 1  # the keeper heard of it
    keeper.close()
    sim.keepers.remove(keeper)
    before = sent()
    placements.append(sim.place(requestor, vcpus=2))  # free 4: the same room
    placements.append(sim.place(requestor, vcpus=1))  # free 3: smaller, nobody hears
    sim.scheduler.run_until_idle()
    assert sent() == before + 1
    assert node.metrics.get("returned", "status") == 1  # it came back: the node stops
    placements.append(sim.place(requestor, vcpus=2))  # free 1: smaller, not announced
    sim.scheduler.run_until_idle()
    assert sent() == before + 1
    assert all(p.nodes == ("n1",) for p in placements)  # the requestor still places
    sim.finish(placements)


def test_without_keepers_a_node_announces_no_change_of_room_only_its_tiers() -> None:
    sim = Simulation()
    try:
        ear = Heard(sim, ROOM_TOPIC, ROSTER_TOPIC)
        sim.add_nodes(2, vcpus=64)
        requestor = sim.add_requestor()
        placements = [sim.place(requestor, vcpus=1) for _ in range(6)]
        sim.scheduler.run_until_idle()
        starts = ear.kinds.count("status")
        assert starts == 2  # one each at start; 6 VCPUs of 128 moved no tier
        ear.endpoint.close()
        sim.finish(placements)
    finally:
        sim.close()
