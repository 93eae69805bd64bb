"""Requestors and roster keepers (design.md, "Many requestors: roster keepers"), through
the real runtime on a virtual clock: what a requestor's start costs, that knowing part of
the cluster is enough, that nothing is lost when nobody hears an announcement, that a
requestor with no setting takes samples while a keeper answers and follows the
announcements while none does, switching both ways as keepers start, die and return, and
that no placement waits for a sample. Each ends with the invariant audit."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from reservoir.broker import Delivery
from reservoir.brokers.inprocess import Faults, InProcessBroker
from reservoir.clock import VirtualScheduler
from reservoir.protocol.messages import ROOM_TOPIC, ROSTER_TOPIC, decode_message
from reservoir.runtime.requestor import Requestor
from reservoir.runtime.settings import Settings
from reservoir.testing import Simulation

#: the requestors' own default: a keeper's samples while one answers (``auto``)
DEFAULT = Settings()


@pytest.fixture
def sim() -> Iterator[Simulation]:
    simulation = Simulation(settings=DEFAULT)
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
    # it sampled again as the keeper's answer came, not after a timer
    assert placement.elapsed_s < 0.05
    sim.finish([placement])


def test_a_requestor_with_no_keeper_follows_the_announcements_itself() -> None:
    sim = Simulation(settings=DEFAULT)
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


# -- switching between keepers and the announcements ------------------------------------


def source(requestor: Requestor) -> str:
    """Where the requestor's roster comes from now: keepers, announcements or asking."""
    return requestor.machine.roster_source.state


def kill(sim: Simulation, name: str) -> None:
    """The keeper's inbox and bindings are gone, as when its process dies."""
    (keeper,) = [k for k in sim.keepers if k.name == name]
    keeper.close()
    sim.keepers.remove(keeper)
    sim.scheduler.run_until_idle()


#: how old a requestor's sample gets before a placement asks for a new one, and how long
#: a requestor following the announcements waits before a placement asks for a keeper
REFRESH_S = 10.0


def test_requestors_on_the_announcements_are_back_on_keepers_once_one_starts(
    sim: Simulation,
) -> None:
    sim.add_nodes(20, vcpus=8)
    requestors = [sim.add_requestor() for _ in range(3)]
    sim.scheduler.run_until_idle()
    assert [source(r) for r in requestors] == ["announcements"] * 3
    placements = [sim.place(requestors[0], vcpus=2)]
    sim.add_keeper()
    for requestor in requestors:
        # one delivery of the keeper's news and one query each, whatever the nodes
        assert requestor.metrics.get("received", "keeper_up") == 1
        # at start, once more as it bound the announcements, and now
        assert requestor.metrics.get("sent", "roster_query") == 3
        assert requestor.machine.counters["back_on_keepers"] == 1
        assert source(requestor) == "keepers"
        assert len(requestor.machine.roster) == 20  # the nodes it knew stay
    heard = [r.metrics.get("received", "status") for r in requestors]
    keeper_heard = sim.keepers[0].machine.counters["statuses"]
    # 6 VCPUs of 8: every placement moves a node's tier, which it announces
    placements += [sim.place(requestors[i % 3], vcpus=6) for i in range(6)]
    assert sim.keepers[0].machine.counters["statuses"] > keeper_heard  # the nodes announced
    assert [r.metrics.get("received", "status") for r in requestors] == heard
    sim.finish(placements)


def test_a_requestor_whose_only_keeper_died_follows_the_announcements_until_it_returns(
    sim: Simulation,
) -> None:
    sim.add_keeper()
    sim.add_nodes(10, vcpus=8)
    requestor = sim.add_requestor()
    placements = [sim.place(requestor, vcpus=1)]
    assert source(requestor) == "keepers"
    kill(sim, "keeper-0")
    sim.advance(REFRESH_S)
    # the sample is old: this placement asks for a new one, which reaches nobody; it is
    # placed all the same, and the requestor follows the announcements from then on
    placements.append(sim.place(requestor, vcpus=1))
    assert source(requestor) == "announcements"
    assert requestor.machine.counters["no_keeper"] == 1
    assert requestor.metrics.get("sent", "roll_call") == 1
    placements += [sim.place(requestor, vcpus=1) for _ in range(3)]
    assert requestor.metrics.get("received", "status") >= 10  # the roll call's answers
    sim.add_keeper("keeper-0")  # it returns
    assert source(requestor) == "keepers"
    assert requestor.machine.counters["back_on_keepers"] == 1
    statuses = requestor.metrics.get("received", "status")
    placements += [sim.place(requestor, vcpus=6) for _ in range(3)]  # tiers move
    assert requestor.metrics.get("received", "status") == statuses
    assert all(p.allocations for p in placements)
    sim.finish(placements)


def test_one_of_two_keepers_dying_leaves_its_requestors_on_the_other(sim: Simulation) -> None:
    sim.add_keeper()
    sim.add_keeper()
    sim.add_nodes(10, vcpus=8)
    requestors = [sim.add_requestor() for _ in range(3)]
    placements = [sim.place(r, vcpus=1) for r in requestors]
    kill(sim, "keeper-0")
    sim.advance(REFRESH_S)
    placements += [sim.place(r, vcpus=1) for r in requestors]  # each asks; one answers
    for requestor in requestors:
        assert source(requestor) == "keepers"
        assert requestor.machine.counters["no_keeper"] == 0
        assert requestor.metrics.get("sent", "roll_call") == 0
        assert requestor.metrics.get("received", "status") == 0
    samples = [r.metrics.get("received", "roster_sample") for r in requestors]
    sim.add_keeper("keeper-0")  # back: the next samples come from both
    sim.advance(REFRESH_S)
    placements += [sim.place(r, vcpus=1) for r in requestors]
    assert [r.metrics.get("received", "roster_sample") for r in requestors] == [
        n + 2 for n in samples
    ]
    sim.finish(placements)


def test_a_requestor_that_missed_a_keeper_starting_asks_again_as_it_places() -> None:
    # The news that a keeper started is lost on its way (the requestor's connection was
    # down, say): a placement asks once REFRESH_S has passed since the requestor last did.
    def keeper_up(delivery: Delivery) -> bool:
        return b'"kind":"keeper_up"' in delivery.body

    sim = Simulation(settings=DEFAULT, faults=Faults(loss=1.0, applies_to=keeper_up))
    try:
        sim.add_nodes(5, vcpus=8)
        requestor = sim.add_requestor()
        sim.scheduler.run_until_idle()
        sim.add_keeper()
        placements = [sim.place(requestor, vcpus=1)]
        assert source(requestor) == "announcements"  # not asked again yet
        asked = requestor.metrics.get("sent", "roster_query")  # as it started following
        sim.advance(REFRESH_S)
        placements.append(sim.place(requestor, vcpus=1))
        assert requestor.metrics.get("sent", "roster_query") == asked + 1
        sim.scheduler.run_until_idle()
        assert source(requestor) == "keepers"
        sim.finish(placements)
    finally:
        sim.close()


def test_a_keeper_starting_while_a_query_comes_back_unroutable_is_not_missed(
    sim: Simulation,
) -> None:
    # The only keeper is dead; a placement's query reaches nobody, and before the broker's
    # answer is back a keeper starts and says so, to nobody (no requestor follows the
    # announcements yet). The requestor asks once more as it binds them: that query
    # reaches the new keeper.
    sim.add_keeper()
    sim.add_nodes(5, vcpus=8)
    requestor = sim.add_requestor()
    placements = [sim.place(requestor, vcpus=1)]
    kill(sim, "keeper-0")
    sim.advance(REFRESH_S)
    placing = requestor.submit(vcpus=1)  # its query is on its way back, unroutable
    sim.add_keeper("keeper-0")  # started before that answer is heard
    assert sim.run_until_done([placing])
    placements.append(placing.result(timeout=0))
    assert requestor.machine.counters["no_keeper"] == 1
    assert source(requestor) == "keepers"
    sim.finish(placements)


class Reconnecting(InProcessBroker):
    """An in-process broker that says its connection came back when told to."""

    reconnects = True

    def __init__(self, scheduler: VirtualScheduler) -> None:
        super().__init__(scheduler)
        self.count = 1

    @property
    def connections(self) -> int:
        return self.count


def test_a_keeper_back_on_the_broker_after_an_outage_says_so_again() -> None:
    # Its news at start went unheard (the requestor's side of the network was down): once
    # the keeper's own connection is back, it roll-calls the nodes and says it is up again.
    sim = Simulation(settings=DEFAULT)
    sim.broker.close()
    sim.broker = Reconnecting(sim.scheduler)
    try:
        sim.add_nodes(3, vcpus=8)
        requestor = sim.add_requestor()
        sim.scheduler.run_until_idle()
        assert source(requestor) == "announcements"  # no keeper yet

        def keeper_up(delivery: Delivery) -> bool:
            return b'"kind":"keeper_up"' in delivery.body

        sim.broker.faults = Faults(loss=1.0, applies_to=keeper_up)
        keeper = sim.add_keeper()
        sim.broker.faults = None
        sim.advance(2.0)  # the keeper looks at its connection every second: unchanged
        assert source(requestor) == "announcements"
        assert keeper.metrics.get("sent", "keeper_up") == 1
        sim.broker.count += 1  # its connection came back
        sim.advance(1.0)
        assert keeper.metrics.get("sent", "keeper_up") == 2
        assert keeper.metrics.get("sent", "roll_call") >= 2
        assert source(requestor) == "keepers"
        sim.finish([sim.place(requestor, vcpus=1)])
    finally:
        sim.close()


def test_a_requestor_set_to_announcements_never_asks_a_keeper() -> None:
    sim = Simulation(settings=Settings(roster_from="announcements"))
    try:
        sim.add_nodes(5, vcpus=8)
        requestor = sim.add_requestor()
        sim.add_keeper()  # its news reaches the requestor, which follows the nodes anyway
        placements = [sim.place(requestor, vcpus=1)]
        sim.advance(REFRESH_S)
        placements.append(sim.place(requestor, vcpus=1))
        assert requestor.metrics.get("received", "keeper_up") == 1
        assert requestor.metrics.get("sent", "roster_query") == 0
        assert source(requestor) == "announcements"
        sim.finish(placements)
    finally:
        sim.close()


def test_the_setting_keeper_is_the_same_as_auto() -> None:
    sim = Simulation(settings=Settings(roster_from="keeper"))
    try:
        sim.add_nodes(5, vcpus=8)
        requestor = sim.add_requestor()
        sim.scheduler.run_until_idle()
        assert source(requestor) == "announcements"  # no keeper yet
        sim.add_keeper()
        assert source(requestor) == "keepers"
        sim.finish([sim.place(requestor, vcpus=1)])
    finally:
        sim.close()


# -- no placement waits for a sample --------------------------------------------------------


@pytest.mark.parametrize("keeper", ["running", "down"])
def test_the_first_placement_goes_out_at_once_on_what_the_requestor_has(
    sim: Simulation, keeper: str
) -> None:
    sim.add_nodes(10, vcpus=8)
    if keeper == "running":
        sim.add_keeper()
    # placed at once: the requestor's query (and, with no keeper, its roll call) is
    # still on its way, and its roster is empty
    requestor = sim.add_requestor()
    assert len(requestor.machine.roster) == 0
    placement = sim.place(requestor, vcpus=2)
    assert placement.elapsed_s < 0.05  # not the longest widening wait (2 s)
    assert requestor.machine.counters["exhaustive_steps"] == 1  # every node of a tier
    assert source(requestor) == ("keepers" if keeper == "running" else "announcements")
    sim.finish([placement])


def test_a_placement_waiting_for_nodes_with_room_goes_on_when_no_keeper_is_left(
    sim: Simulation,
) -> None:
    # The requestor's sample has no node with room for 16 VCPUs; it asks the keeper for
    # some, and the query reaches nobody (the keeper died): it asks every node at once.
    sim.add_keeper()
    sim.add_nodes(29, vcpus=4)
    sim.add_node("big", vcpus=16)
    requestor = sim.add_requestor()
    sim.scheduler.run_until_idle()
    requestor.machine.roster.remove("big")
    kill(sim, "keeper-0")
    placement = sim.place(requestor, vcpus=16)
    assert placement.nodes == ("big",)
    assert placement.elapsed_s < 0.05
    assert requestor.machine.counters["sample_waits"] == 1
    assert requestor.machine.counters["exhaustive_steps"] == 1
    sim.finish([placement])
