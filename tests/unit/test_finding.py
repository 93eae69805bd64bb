"""Finding what the nodes hold of a request id (``Requestor.find``: the machine in
reservoir/protocol/finding.py on an inbox of its own, reservoir/runtime/finding.py), on an
in-process broker with node agents, each test ending with the invariant audit."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest

from reservoir import NodeAgent, Placement, Requestor, RequestorClosed, audit
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.protocol.effects import Found, Publish, SetTimer
from reservoir.protocol.finding import Finding, FindTimer
from reservoir.protocol.messages import (
    IN_FLIGHT_ELSEWHERE,
    AllocationInfo,
    AlreadyPlaced,
    Decline,
    InvalidField,
    Lookup,
    Reason,
    ReservationRequest,
    encode_message,
    lookup_topic,
)
from reservoir.protocol.placement import Holdings
from reservoir.runtime.requestor import FindIncomplete
from reservoir.runtime.store import MemoryStore
from reservoir.testing import InProcessCluster

#: long enough that a find ending sooner shows it did not wait it out
LONG_WAIT_S = 5.0


@pytest.fixture
def nodes(reservoir_cluster: InProcessCluster) -> list[NodeAgent]:
    return reservoir_cluster.add_nodes(3, "find", vcpus=8, memory_mb=8192)


def audited(nodes: list[NodeAgent], placements: list[Placement]) -> None:
    audit([n.snapshot() for n in nodes], placements).raise_if_failed()


def held(nodes: list[NodeAgent]) -> int:
    return sum(len(n.allocations()) for n in nodes)


@contextlib.contextmanager
def silent_holder(broker: InProcessBroker, request_id: str) -> Iterator[None]:
    """A participant bound to ``request_id``'s lookup topic that never answers, as a
    holder too busy to answer in time would be."""
    endpoint = broker.open_endpoint(lambda delivery: None, name="silent-holder")
    endpoint.bind(lookup_topic(request_id))
    try:
        yield
    finally:
        endpoint.close()


def test_a_generated_id_placed_findable_is_found_by_another_requestor_with_no_lookup_first(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    with Requestor(broker, findable=True) as placing, Requestor(broker) as other:
        placement = placing.reserve(vcpus=1, memory_mb=512, count=2)
        # placed without a lookup: a generated id costs no lookup wait
        assert placing.metrics.get("sent", "lookup") == 0
        assert all(a.findable for n in nodes for a in n.allocations())

        found = other.find(placement.request_id)
        assert found is not None
        assert found.request_id == placement.request_id
        assert sorted(found.allocations, key=lambda a: a.allocation_id) == sorted(
            placement.allocations, key=lambda a: a.allocation_id
        )
        # what the nodes know: the instances they hold, not how it was placed
        assert found.requested == 2 and not found.partial
        assert found.tiers_tried == () and found.attempts == 0
        assert found.requested_at_s == placement.requested_at_s > 0
        # one Lookup out, one AlreadyPlaced back from each holder: nothing else
        holders = len(set(placement.nodes))
        assert other.metrics.get("sent", "lookup") == 1
        assert other.metrics.get("received", "already_placed") == holders
        sent = other.metrics.by_label("sent")
        roster = ("roll_call", "roster_query")  # its start's, whichever way it takes
        assert {k: n for k, n in sent.items() if n and k not in roster} == {"lookup": 1}
        audited(nodes, [placement])


def test_a_generated_id_of_a_requestor_not_findable_is_not_found(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    with Requestor(broker) as placing, Requestor(broker) as other:
        placement = placing.reserve(vcpus=1, memory_mb=512)
        assert other.find(placement.request_id, deadline_s=LONG_WAIT_S) is None
        # a caller-chosen id always is
        chosen = placing.reserve(vcpus=1, memory_mb=512, request_id="chosen-1")
        found = other.find("chosen-1")
        assert found is not None and found.nodes == chosen.nodes
        audited(nodes, [placement, chosen])


def test_the_placing_requestor_finds_its_own_placement_as_it_remembers_it_without_waiting(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    with Requestor(broker, findable=True) as requestor:
        placement = requestor.reserve(vcpus=1, memory_mb=512, count=3)
        started = time.monotonic()
        found = requestor.find(placement.request_id, deadline_s=LONG_WAIT_S)
        # over once every remembered allocation was reported: no wait for more holders
        assert time.monotonic() - started < LONG_WAIT_S / 2
        assert found == placement  # tiers tried and all, as it was answered
        audited(nodes, [placement])


def test_an_id_nobody_holds_is_none_at_once(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    with Requestor(broker, findable=True) as requestor:
        started = time.monotonic()
        # no node binds the id's bucket: the Lookup comes back unroutable
        assert requestor.find("never-placed", deadline_s=LONG_WAIT_S) is None
        assert time.monotonic() - started < LONG_WAIT_S / 2
        audited(nodes, [])


def test_a_placement_released_through_another_requestor_is_gone_for_every_requestor(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    with Requestor(broker, findable=True) as placing, Requestor(broker, findable=True) as other:
        placement = placing.reserve(vcpus=2, memory_mb=1024, count=2)
        found = other.find(placement.request_id)
        assert found is not None
        other.release(found)  # freed on each holder, by a requestor that did not place it
        assert held(nodes) == 0
        assert other.find(placement.request_id, deadline_s=LONG_WAIT_S) is None
        # the placing requestor still remembers it; the nodes say it is gone
        assert placing.find(placement.request_id, deadline_s=LONG_WAIT_S) is None
        placing.forget(placement.request_id)
        again = placing.reserve(vcpus=2, memory_mb=1024, request_id=placement.request_id)
        assert again.allocations != placement.allocations  # placed anew, not replayed
        audited(nodes, [again])


def test_a_caller_chosen_id_placed_again_through_another_requestor_is_the_same_placement(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    """The protocol's lookup, which an idempotent POST retried on another replica relies
    on: the retry adopts the placement the nodes hold."""
    with Requestor(broker, findable=True) as first, Requestor(broker, findable=True) as second:
        placement = first.reserve(vcpus=1, memory_mb=256, count=2, request_id="order-7")
        retried = second.reserve(vcpus=1, memory_mb=256, count=2, request_id="order-7")
        assert sorted(retried.allocations, key=lambda a: a.allocation_id) == sorted(
            placement.allocations, key=lambda a: a.allocation_id
        )
        assert held(nodes) == 2
        audited(nodes, [placement])


def test_allocations_a_restarted_node_loaded_from_its_store_are_found(
    broker: InProcessBroker,
) -> None:
    store = MemoryStore()
    node = NodeAgent(broker, name="find-stored", vcpus=4, memory_mb=4096, store=store)
    try:
        with Requestor(broker, findable=True) as requestor:
            placement = requestor.reserve(vcpus=1, memory_mb=256)
        node.close()
        node = NodeAgent(broker, name="find-stored", vcpus=4, memory_mb=4096, store=store)
        with Requestor(broker) as restarted:  # a new process: it remembers nothing
            found = restarted.find(placement.request_id)
            assert found is not None and found.nodes == ("find-stored",)
            assert [a.allocation_id for a in found.allocations] == [
                a.allocation_id for a in placement.allocations
            ]
        audited([node], [placement])
    finally:
        node.close()


def test_finds_of_one_id_at_once_share_one_lookup(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    with Requestor(broker, findable=True) as placing, Requestor(broker) as other:
        placement = placing.reserve(vcpus=1, memory_mb=1)
        futures = [other.holdings_future(placement.request_id) for _ in range(4)]
        answers = [f.result(timeout=10) for f in futures]
        assert all(a is answers[0] for a in answers) and answers[0].placement is not None
        assert other.metrics.get("sent", "lookup") == 1
        audited(nodes, [placement])


def test_find_async_awaits_without_blocking_the_loop(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    with Requestor(broker) as other, silent_holder(broker, "held-by-a-mute"):

        async def main() -> tuple[BaseException | None, int]:
            ticks = 0

            async def tick() -> None:
                nonlocal ticks
                while True:
                    ticks += 1
                    await asyncio.sleep(0.01)

            ticking = asyncio.create_task(tick())
            try:
                await other.find_async("held-by-a-mute", deadline_s=0.3)
            except FindIncomplete as error:
                return error, ticks
            finally:
                ticking.cancel()
            return None, ticks

        error, ticks = asyncio.run(main())
        assert isinstance(error, FindIncomplete)
        assert ticks >= 5  # the loop ran while the find waited out its 0.3 s
        audited(nodes, [])


def test_a_bad_id_or_wait_is_a_clear_error_and_asks_nobody(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    with Requestor(broker) as requestor:
        with pytest.raises(InvalidField) as bad:
            requestor.find("no spaces allowed")
        assert bad.value.field == "request_id"
        with pytest.raises(ValueError, match="positive"):
            requestor.find("fine", deadline_s=0)
        assert requestor.metrics.get("sent", "lookup") == 0
        audited(nodes, [])


def test_closing_the_requestor_fails_a_find_in_progress(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    with Requestor(broker, findable=True) as placing:
        placement = placing.reserve(vcpus=1, memory_mb=1)
        other = Requestor(broker)
        waiting = other.holdings_future(placement.request_id, deadline_s=LONG_WAIT_S)
        other.close()
        with pytest.raises(RequestorClosed):
            waiting.result(timeout=10)
        with pytest.raises(RequestorClosed):
            other.find(placement.request_id)
        audited(nodes, [placement])


def _answer(node: str, *allocation_ids: str, instances: int = 0) -> AlreadyPlaced:
    return AlreadyPlaced(
        request_id="r1",
        sender=node,
        reply_to=f"reservoir.node.{node}",
        allocations=tuple(
            AllocationInfo(allocation_id=a, resources={"VCPU": 1}) for a in allocation_ids
        ),
        requested_at_s=5.0,
        instances=instances,
    )


def _found(effects: list[Any]) -> list[Holdings]:
    return [e.holdings for e in effects if isinstance(e, Found)]


def test_the_machine_settles_once_the_instances_heard_reach_the_placements_size(
    nodes: list[NodeAgent],
) -> None:
    """The pure machine, fed by hand: each holder says how many instances the placement
    has; the find is settled when that many are heard, not when a wait is over."""
    finding = Finding(sender="asker", reply_to="reservoir.requestor.asker")
    effects = finding.find("r1", 10.0, 0.5)
    assert effects == [
        Publish(
            lookup_topic("r1"),
            Lookup(
                request_id="r1",
                sender="asker",
                reply_to="reservoir.requestor.asker",
                following=True,
            ),
        ),
        SetTimer(FindTimer("r1"), 10.5),
    ]
    assert finding.find("r1", 10.1, 0.5) == []  # joins
    assert _found(finding.handle(_answer("n1", "n1.a/0", instances=3), 10.2)) == []
    [holdings] = _found(finding.handle(_answer("n2", "n2.b/0", "n2.b/1", instances=3), 10.3))
    assert holdings.settled and holdings.placement is not None
    assert sorted(holdings.placement.nodes) == ["n1", "n2", "n2"]
    assert finding.pending() == 0
    # a late answer is dropped, counted, never an error
    [late] = finding.handle(_answer("n1", "n1.a/0", instances=3), 10.6)
    assert late.reason == "late_found"  # type: ignore[union-attr]
    audited(nodes, [])


def test_the_machine_knows_nobody_holds_an_id_when_its_lookup_comes_back() -> None:
    finding = Finding(sender="asker", reply_to="reservoir.requestor.asker")
    [publish, _timer] = finding.find("r1", 10.0, 0.5)
    assert isinstance(publish, Publish)
    [holdings] = _found(finding.on_unroutable(publish.message, 10.001))
    assert holdings.settled and holdings.placement is None and not holdings.held


def test_the_machine_says_a_find_its_deadline_ended_is_not_settled_never_nothing() -> None:
    finding = Finding(sender="asker", reply_to="reservoir.requestor.asker")
    finding.find("r1", 10.0, 0.5)
    finding.handle(_answer("n1", "n1.a/0", instances=2), 10.1)
    [holdings] = _found(finding.on_timer(FindTimer("r1"), 10.5))
    assert not holdings.settled
    assert holdings.placement is not None and holdings.placement.nodes == ("n1",)


def test_the_machine_names_the_requestor_still_placing_the_id() -> None:
    finding = Finding(sender="asker", reply_to="reservoir.requestor.asker")
    finding.find("r1", 10.0, 0.5)
    in_flight = Decline(
        request_id="r1",
        sender="n1",
        reply_to="reservoir.node.n1",
        attempt=1,
        reasons=(Reason(code=IN_FLIGHT_ELSEWHERE, subject="req-x", detail="also being placed"),),
    )
    assert _found(finding.handle(in_flight, 10.1)) == []  # an answer may yet settle it
    [holdings] = _found(finding.on_timer(FindTimer("r1"), 10.5))
    assert not holdings.settled and holdings.placing == "req-x"


def test_the_machine_without_a_size_ends_on_the_placement_it_remembers() -> None:
    """Nodes of an earlier release say no size: the asker's own placement ends the find."""
    finding = Finding(sender="asker", reply_to="reservoir.requestor.asker")
    finding.find("r1", 10.0, 0.5)
    assert _found(finding.handle(_answer("n1", "n1.a/0"), 10.1)) == []
    [unsettled] = _found(finding.on_timer(FindTimer("r1"), 10.5))
    assert not unsettled.settled and unsettled.placement is not None
    finding.find("r1", 11.0, 0.5, expected=unsettled.placement)
    [ended] = _found(finding.handle(_answer("n1", "n1.a/0"), 11.1))
    assert ended.settled and ended.placement is unsettled.placement


def test_a_find_future_resolves_on_its_own_thread_safe_future(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    with Requestor(broker, findable=True) as requestor:
        placement = requestor.reserve(vcpus=1, memory_mb=1)
        future = requestor.holdings_future(placement.request_id)
        assert isinstance(future, concurrent.futures.Future)
        assert future.result(timeout=10).placement == placement
        audited(nodes, [placement])


def test_another_requestor_finds_a_placement_on_several_nodes_as_soon_as_all_have_answered(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    with Requestor(broker, findable=True) as placing, Requestor(broker) as other:
        placement = placing.reserve(vcpus=4, memory_mb=4096, count=3)
        assert len(set(placement.nodes)) > 1  # spread: several holders to hear from
        started = time.monotonic()
        found = other.find(placement.request_id, deadline_s=LONG_WAIT_S)
        # each holder said the placement has 3 instances: the third heard settles it
        assert time.monotonic() - started < LONG_WAIT_S / 2
        assert found is not None and sorted(found.nodes) == sorted(placement.nodes)
        audited(nodes, [placement])


def test_a_partial_placement_is_found_whole_by_another_requestor(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    """A min_count placement has fewer instances than the request's count: its awards
    say how many, so a find does not wait for instances that will never exist."""
    with Requestor(broker, findable=True) as placing, Requestor(broker) as other:
        placement = placing.reserve(vcpus=8, memory_mb=8192, count=5, min_count=2)
        assert placement.partial and len(placement.allocations) == 3
        started = time.monotonic()
        found = other.find(placement.request_id, deadline_s=LONG_WAIT_S)
        assert time.monotonic() - started < LONG_WAIT_S / 2
        assert found is not None and len(found.allocations) == 3
        audited(nodes, [placement])


def test_a_holder_that_does_not_answer_in_time_is_not_known_never_nothing(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    with Requestor(broker) as requestor, silent_holder(broker, "held-by-a-mute"):
        with pytest.raises(FindIncomplete, match="not every holder answered") as unknown:
            requestor.find("held-by-a-mute", deadline_s=0.2)
        assert unknown.value.request_id == "held-by-a-mute"
        holdings = requestor.holdings_future("held-by-a-mute", deadline_s=0.2).result(10)
        assert not holdings.settled and holdings.placement is None
        audited(nodes, [])


def test_an_id_still_being_placed_is_found_being_placed_by_its_requestor(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    """A node holds the placing requestor's reservation (its award not yet sent): the id
    is neither held nor free, and the find names who is placing it."""
    endpoint = broker.open_endpoint(lambda delivery: None, name="slow-requestor")
    try:
        probe = ReservationRequest(
            request_id="in-flight-1",
            sender="slow-requestor",
            reply_to=endpoint.address,
            tier=100,
            attempt=1,
            ttl_s=30.0,
            resources={"VCPU": 1},
            probed_node=nodes[0].name,
            findable=True,
        )
        endpoint.send(nodes[0].address, encode_message(probe))
        deadline = time.monotonic() + 5
        while not nodes[0].snapshot().reservations and time.monotonic() < deadline:
            time.sleep(0.005)
        with (
            Requestor(broker) as other,
            pytest.raises(FindIncomplete, match="being placed by slow-requestor"),
        ):
            other.find("in-flight-1", deadline_s=0.3)
    finally:
        endpoint.close()
    audited(nodes, [])
