"""The requestor's state machine, driven by hand on a fake clock: no broker, no threads.

Each test plays the nodes' part by feeding the machine the messages nodes would send and
reads the effects it returns.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest

from reservoir.protocol.effects import (
    CancelTimer,
    Claim,
    Effect,
    Failed,
    Placed,
    Publish,
    Send,
    SetTimer,
    Unclaim,
)
from reservoir.protocol.messages import (
    Accepted,
    AllocationInfo,
    AlreadyPlaced,
    Award,
    Decline,
    Free,
    Freed,
    Lookup,
    Message,
    NodeStatus,
    Offer,
    Reason,
    Refused,
    Release,
    ReservationRequest,
    bucket_bitmap,
    lookup_bucket,
    lookup_topic,
)
from reservoir.protocol.placement import PlacementRequest, PlacementTimeout
from reservoir.protocol.requestor import RequestorMachine
from reservoir.protocol.requestor_state import RequestorConfig
from reservoir.protocol.room import NOTHING_FREE

T0 = 1000.0
TIMEOUT_S = 60.0


def a_requestor(**config: Any) -> RequestorMachine:
    """A requestor machine. Unless a test says otherwise, one that does not claim its
    caller-chosen ids, as on a broker that cannot claim or after a claim was lost: these
    tests drive the lookups such a requestor makes before every decision; the claim's own
    tests are below ("claims"). The tests play the nodes, not keepers: a requestor of the
    default ``auto`` would also ask a keeper for a sample as it places
    (tests/scenario/test_roster_keeper.py)."""
    config.setdefault("claims", False)
    config.setdefault("roster_from", "announcements")
    return RequestorMachine(RequestorConfig(requestor_id="req", reply_to="req-inbox", **config))


#: what each instance of the default request holds (and a node's allocations of it)
SHAPE = {"VCPU": 2, "MEMORY_MB": 1024}


def spec(**fields: Any) -> PlacementRequest:
    fields.setdefault("resources", dict(SHAPE))
    return PlacementRequest(**fields)


def published(effects: list[Effect]) -> list[ReservationRequest]:
    return [e.message for e in effects if isinstance(e, Publish)]  # type: ignore[misc]


def sent(effects: list[Effect], kind: type[Message] | None = None) -> list[Send]:
    return [
        e for e in effects if isinstance(e, Send) and (kind is None or isinstance(e.message, kind))
    ]


def timer_at(effects: list[Effect], what: str) -> tuple[Hashable, float]:
    (timer,) = [
        e for e in effects if isinstance(e, SetTimer) and getattr(e.key, "kind", None) == what
    ]
    return timer.key, timer.at


def offer(node: str, request_id: str = "r1", attempt: int = 1, slots: int = 1, **kw: Any) -> Offer:
    kw.setdefault("utilisation", 0.1)
    return Offer(
        request_id=request_id,
        sender=node,
        reply_to=f"addr-{node}",
        reservation_id=f"{node}.res.{request_id}",
        attempt=attempt,
        slots=slots,
        ttl_s=5.0,
        **kw,
    )


def accepted(node: str, request_id: str = "r1", slots: int = 1) -> Accepted:
    return Accepted(
        request_id=request_id,
        sender=node,
        reply_to=f"addr-{node}",
        reservation_id=f"{node}.res.{request_id}",
        allocations=tuple(
            AllocationInfo(allocation_id=f"{node}.res.{request_id}/{i}", resources=dict(SHAPE))
            for i in range(slots)
        ),
    )


def collect(machine: RequestorMachine, effects: list[Effect], now: float) -> list[Effect]:
    """Fire the collect window that the first offer opened."""
    key, at = timer_at(effects, "collect")
    assert at >= now
    return machine.on_timer(key, at)


def outcome(effects: list[Effect]) -> Placed | Failed:
    (result,) = [e for e in effects if isinstance(e, Placed | Failed)]
    return result


def test_a_request_is_first_broadcast_on_the_lowest_tier() -> None:
    machine = a_requestor()
    effects = machine.place(spec(), "r1", T0, TIMEOUT_S)
    (request,) = published(effects)
    assert (request.tier, request.attempt, request.ttl_s) == (10, 1, 5.0)
    assert [e.topic for e in effects if isinstance(e, Publish)] == ["tier.10"]
    _, widen_at = timer_at(effects, "widen")
    assert widen_at == T0 + 2.0  # no latency observed yet: the "couple of seconds"


def test_an_unroutable_tier_widens_at_once() -> None:
    machine = a_requestor()
    (request,) = published(machine.place(spec(), "r1", T0, TIMEOUT_S))
    (wider,) = published(machine.on_unroutable(request, T0 + 0.001))
    assert (wider.tier, wider.attempt) == (25, 2)


def test_a_probe_that_comes_back_unroutable_takes_its_node_off_the_roster() -> None:
    machine = a_requestor()
    for node in ("n1", "n2"):
        machine.handle(NodeStatus(sender=node, reply_to=f"addr-{node}", tier=10), T0)
    effects = machine.place(spec(), "r1", T0, TIMEOUT_S)
    probes = {s.message.probed_node: s.message for s in sent(effects, ReservationRequest)}  # type: ignore[attr-defined]
    assert sorted(probes) == ["n1", "n2"]
    machine.on_unroutable(probes["n2"], T0 + 0.001)  # n2's inbox is gone
    assert "n2" not in machine.roster and "n1" in machine.roster


def walk_the_ladder(machine: RequestorMachine, effects: list[Effect]) -> list[Effect]:
    """Let every tier's wait run out, from the first tier to the last; returns what the
    last wait's end produced."""
    for _ in range(5):
        key, now = timer_at(effects, "widen")
        effects = machine.on_timer(key, now)
    return effects


def test_widening_walks_every_tier_then_a_request_some_node_declined_fails() -> None:
    machine = a_requestor()
    effects = machine.place(spec(), "r1", T0, TIMEOUT_S)
    tiers = [published(effects)[0].tier]
    machine.handle(Decline(request_id="r1", sender="n0", reply_to="addr-n0", attempt=1), T0)
    for _ in range(4):
        key, now = timer_at(effects, "widen")
        effects = machine.on_timer(key, now)
        tiers.append(published(effects)[0].tier)
    key, now = timer_at(effects, "widen")
    failed = outcome(machine.on_timer(key, now))
    assert isinstance(failed, Failed)
    assert tiers == [10, 25, 50, 75, 100]
    assert failed.error.explanation.tiers_tried == (10, 25, 50, 75, 100)
    assert "tiers tried: 10%, 25%, 50%, 75%, 100%" in str(failed.error)
    assert not machine.is_active("r1")


def test_when_no_node_answers_at_all_the_requestor_starts_over_until_the_deadline() -> None:
    machine = a_requestor()
    effects = machine.place(spec(), "r1", T0, 30.0)
    rounds = 0
    while not any(isinstance(e, Placed | Failed) for e in effects):
        effects = walk_the_ladder(machine, effects)
        if any(isinstance(e, Failed) for e in effects):
            break
        key, retry_at = timer_at(effects, "retry")  # a pause, then the first tier again
        effects = machine.on_timer(key, retry_at)
        assert published(effects)[0].tier == 10
        rounds += 1
    failed = outcome(effects)
    assert isinstance(failed, Failed)
    assert rounds >= 2
    assert failed.error.explanation.tiers_tried == (10, 25, 50, 75, 100)
    assert f"no node answered in {rounds} round(s)" in str(failed.error)
    assert machine.counters["unheard_retries"] == rounds


def test_a_pass_no_node_answers_is_no_verdict_even_when_nodes_answered_before() -> None:
    machine = a_requestor()
    effects = machine.place(spec(), "r1", T0, TIMEOUT_S)
    busy = Decline(request_id="r1", sender="n0", reply_to="addr-n0", attempt=1, busy=True)
    machine.handle(busy, T0 + 0.01)
    effects = walk_the_ladder(machine, effects)
    key, retry_at = timer_at(effects, "retry")  # busy: ask n0 again after a pause
    effects = machine.on_timer(key, retry_at)
    assert [s.address for s in sent(effects, ReservationRequest)] == ["addr-n0"]
    # The network goes down: n0 never answers the retry, and no tier answers either.
    key, now = timer_at(effects, "widen")
    effects = machine.on_timer(key, now)
    assert not [e for e in effects if isinstance(e, Failed)]
    key, retry_at = timer_at(effects, "retry")  # a pause, then the first tier again
    assert published(machine.on_timer(key, retry_at))[0].tier == 10
    assert machine.counters["unheard_retries"] == 1


def test_a_node_answering_after_a_start_over_places_the_request() -> None:
    machine = a_requestor()
    effects = walk_the_ladder(machine, machine.place(spec(), "r1", T0, TIMEOUT_S))
    key, retry_at = timer_at(effects, "retry")
    effects = machine.on_timer(key, retry_at)
    (request,) = published(effects)
    effects = machine.handle(offer("n1", attempt=request.attempt), retry_at + 0.01)
    (award,) = sent(collect(machine, effects, retry_at + 0.01), Award)
    assert award.address == "addr-n1"


def test_explained_declines_are_counted_per_reason_in_the_failure() -> None:
    machine = a_requestor()
    effects = machine.place(spec(explain=True), "r1", T0, TIMEOUT_S)
    short = Reason(code="insufficient", subject="MEMORY_MB", shortfall=512)
    for i in range(3):
        machine.handle(
            Decline(
                request_id="r1",
                sender=f"n{i}",
                reply_to=f"addr-n{i}",
                attempt=1,
                reasons=(short,),
            ),
            T0,
        )
    for _ in range(5):
        key, at = timer_at(effects, "widen")
        effects = machine.on_timer(key, at)
    failed = outcome(effects)
    assert isinstance(failed, Failed)
    assert failed.error.explanation.reasons == {"MEMORY_MB exhausted": 3}
    assert "MEMORY_MB exhausted on 3 node(s)" in str(failed.error)


def test_the_best_offer_wins_and_the_others_are_released() -> None:
    machine = a_requestor()
    effects = machine.place(spec(), "r1", T0, TIMEOUT_S)
    first = machine.handle(offer("busy-node", utilisation=0.5), T0 + 0.01)
    machine.handle(offer("empty-node", utilisation=0.0), T0 + 0.011)
    machine.handle(offer("half-node", utilisation=0.3), T0 + 0.012)
    decided = collect(machine, first, T0 + 0.01)
    (award,) = sent(decided, Award)
    assert award.address == "addr-empty-node"
    # one spare stays held until the winner accepts; the rest is released at once
    assert [s.address for s in sent(decided, Release)] == ["addr-busy-node"]
    done = machine.handle(accepted("empty-node"), T0 + 0.02)
    placed = outcome(done)
    assert isinstance(placed, Placed)
    assert placed.placement.nodes == ("empty-node",)
    assert [s.address for s in sent(done, Release)] == ["addr-half-node"]
    assert effects  # the broadcast happened


class LiveTimers:
    """The timers a driver would hold, following a machine's effects and firings."""

    def __init__(self) -> None:
        self.live: dict[Hashable, float] = {}

    def follow(self, effects: list[Effect]) -> list[Effect]:
        for effect in effects:
            if isinstance(effect, SetTimer):
                self.live[effect.key] = effect.at
            elif isinstance(effect, CancelTimer):
                assert effect.key in self.live, f"cancelled {effect.key}, which was never set"
                del self.live[effect.key]
        return effects

    def fire(self, machine: RequestorMachine, key: Hashable) -> list[Effect]:
        at = self.live.pop(key)
        return self.follow(machine.on_timer(key, at))


def test_a_placement_cancels_only_timers_it_set_and_leaves_none_behind() -> None:
    machine = a_requestor()
    timers = LiveTimers()
    timers.follow(machine.place(spec(), "r1", T0, TIMEOUT_S))
    first = timers.follow(machine.handle(offer("n1"), T0 + 0.01))
    timers.follow(machine.handle(offer("n2"), T0 + 0.011))
    key, _ = timer_at(first, "collect")
    timers.fire(machine, key)
    placed = outcome(timers.follow(machine.handle(accepted("n1"), T0 + 0.02)))
    assert isinstance(placed, Placed)
    assert timers.live == {}


def test_a_failed_request_leaves_no_timer_of_its_conversation_behind() -> None:
    machine = a_requestor()
    timers = LiveTimers()
    timers.follow(machine.place(spec(), "r1", T0, TIMEOUT_S))
    failed = None
    while failed is None:  # every tier's wait runs out, then the deadline
        key = min(timers.live, key=timers.live.__getitem__)
        failed = next((e for e in timers.fire(machine, key) if isinstance(e, Failed)), None)
    assert timers.live == {}


def test_the_collect_window_follows_the_first_offers_latency() -> None:
    machine = a_requestor()
    machine.place(spec(), "r1", T0, TIMEOUT_S)
    effects = machine.handle(offer("n1"), T0 + 0.03)
    _, at = timer_at(effects, "collect")
    assert at == pytest.approx(T0 + 0.06)


def test_a_late_offer_is_released_at_once() -> None:
    machine = a_requestor()
    machine.place(spec(), "r1", T0, TIMEOUT_S)
    first = machine.handle(offer("n1"), T0 + 0.01)
    collect(machine, first, T0 + 0.01)
    outcome(machine.handle(accepted("n1"), T0 + 0.03))
    effects = machine.handle(offer("slowpoke"), T0 + 0.5)
    assert [s.address for s in sent(effects, Release)] == ["addr-slowpoke"]


def test_a_duplicated_offer_is_counted_once() -> None:
    machine = a_requestor()
    machine.place(spec(count=2), "r1", T0, TIMEOUT_S)
    first = machine.handle(offer("n1"), T0 + 0.01)
    machine.handle(offer("n1"), T0 + 0.011)
    decided = collect(machine, first, T0 + 0.01)
    assert sent(decided, Award) == []  # one slot is not two


def test_a_refusal_is_covered_by_the_spare_offer() -> None:
    machine = a_requestor()
    machine.place(spec(), "r1", T0, TIMEOUT_S)
    first = machine.handle(offer("n1", utilisation=0.0), T0 + 0.01)
    machine.handle(offer("n2", utilisation=0.2), T0 + 0.01)
    collect(machine, first, T0 + 0.01)
    refusal = Refused(
        request_id="r1",
        sender="n1",
        reply_to="addr-n1",
        reservation_id="n1.res.r1",
        reason="expired",
    )
    effects = machine.handle(refusal, T0 + 0.05)
    (award,) = sent(effects, Award)
    assert award.address == "addr-n2"
    placed = outcome(machine.handle(accepted("n2"), T0 + 0.06))
    assert isinstance(placed, Placed) and placed.placement.nodes == ("n2",)


def test_a_refusal_with_no_spare_broadcasts_again() -> None:
    machine = a_requestor(spare_slots=0)
    machine.place(spec(), "r1", T0, TIMEOUT_S)
    first = machine.handle(offer("n1"), T0 + 0.01)
    collect(machine, first, T0 + 0.01)
    refusal = Refused(
        request_id="r1", sender="n1", reply_to="addr-n1", reservation_id="n1.res.r1", reason="x"
    )
    (again,) = published(machine.handle(refusal, T0 + 0.05))
    assert (again.tier, again.attempt) == (10, 2)


def test_an_unanswered_award_is_sent_again_then_given_up_with_a_free() -> None:
    machine = a_requestor(spare_slots=0)
    machine.place(spec(), "r1", T0, TIMEOUT_S)
    first = machine.handle(offer("n1"), T0 + 0.01)
    decided = collect(machine, first, T0 + 0.01)
    key, at = timer_at(decided, "award")
    resent = machine.on_timer(key, at)
    assert [s.address for s in sent(resent, Award)] == ["addr-n1"]
    now = at
    while not sent(resent, Free):
        key, now = timer_at(resent, "award")
        resent = machine.on_timer(key, now)
    assert now - (T0 + 0.01) >= 5.0  # not before the reservation must have expired
    (free,) = sent(resent, Free)
    assert free.address == "addr-n1" and free.message.allocation_ids == ()  # type: ignore[union-attr]
    assert published(resent)  # and it looks elsewhere


def run_tiers_with(
    machine: RequestorMachine, effects: list[Effect], nodes: list[str], now: float
) -> list[Effect]:
    """Play nodes that hear every tier: each broadcast gets the same offers again."""
    seen: list[Effect] = list(effects)
    for _ in range(10):
        (request,) = published(effects)
        first: list[Effect] = []
        for node in nodes:
            first += machine.handle(offer(node, attempt=request.attempt), now + 0.01)
        effects = collect(machine, first, now + 0.01)
        seen += first + effects
        now += 0.02
        if not published(effects):
            return seen
    raise AssertionError("the requestor never stopped widening")


def test_multi_instance_requests_are_all_or_nothing() -> None:
    machine = a_requestor()
    effects = machine.place(spec(count=3), "r1", T0, TIMEOUT_S)
    effects = run_tiers_with(machine, effects, ["n1", "n2"], T0)
    failed = outcome(effects)
    assert isinstance(failed, Failed)
    assert [r.tier for r in published(effects)] == [10, 25, 50, 75, 100]
    assert sorted(s.address for s in sent(effects, Release)) == ["addr-n1", "addr-n2"]
    assert sent(effects, Award) == []
    assert "offers received: 2" in str(failed.error)


def test_min_count_accepts_a_partial_placement() -> None:
    machine = a_requestor()
    effects = machine.place(spec(count=3, min_count=2), "r1", T0, TIMEOUT_S)
    effects = run_tiers_with(machine, effects, ["n1", "n2"], T0)
    assert sorted(s.address for s in sent(effects, Award)) == ["addr-n1", "addr-n2"]
    machine.handle(accepted("n1"), T0 + 1)
    placed = outcome(machine.handle(accepted("n2"), T0 + 1))
    assert isinstance(placed, Placed)
    assert placed.placement.partial and len(placed.placement.allocations) == 2


def test_offers_from_several_tiers_combine_for_a_multi_instance_request() -> None:
    machine = a_requestor()
    effects = machine.place(spec(count=2), "r1", T0, TIMEOUT_S)
    first = machine.handle(offer("n1"), T0 + 0.01)
    widened = collect(machine, first, T0 + 0.01)
    (request,) = published(widened)
    assert request.tier == 25
    second = machine.handle(offer("n2", attempt=2), T0 + 0.05)
    decided = collect(machine, second, T0 + 0.05)
    assert sorted(s.address for s in sent(decided, Award)) == ["addr-n1", "addr-n2"]
    assert effects


def test_placing_a_placed_id_returns_the_same_placement() -> None:
    machine = a_requestor()
    machine.place(spec(), "r1", T0, TIMEOUT_S)
    first = machine.handle(offer("n1"), T0 + 0.01)
    collect(machine, first, T0 + 0.01)
    placed = outcome(machine.handle(accepted("n1"), T0 + 0.02))
    again = machine.place(spec(), "r1", T0 + 10, TIMEOUT_S)
    assert again == [placed]
    assert published(again) == []


def test_placing_an_id_in_flight_joins_it() -> None:
    machine = a_requestor()
    machine.place(spec(), "r1", T0, TIMEOUT_S)
    assert machine.place(spec(), "r1", T0 + 0.001, TIMEOUT_S) == []
    assert machine.in_flight() == 1


def test_a_node_that_already_holds_the_request_completes_it_without_a_new_award() -> None:
    machine = a_requestor()
    machine.place(spec(), "r1", T0, TIMEOUT_S)
    held = AlreadyPlaced(
        request_id="r1",
        sender="n1",
        reply_to="addr-n1",
        allocations=(AllocationInfo(allocation_id="old/0", resources=dict(SHAPE)),),
    )
    first = machine.handle(held, T0 + 0.01)
    assert sent(first, Award) == []
    placed = outcome(first)
    assert isinstance(placed, Placed)
    assert [a.allocation_id for a in placed.placement.allocations] == ["old/0"]


def test_an_acceptance_for_a_failed_request_is_freed() -> None:
    machine = a_requestor()
    effects = machine.place(spec(), "r1", T0, 1.0)
    key, at = timer_at(effects, "deadline")
    failed = outcome(machine.on_timer(key, at))
    assert isinstance(failed, Failed) and isinstance(failed.error, PlacementTimeout)
    late = machine.handle(accepted("n1"), at + 1)
    (free,) = sent(late, Free)
    assert free.message.allocation_ids == ("n1.res.r1/0",)  # type: ignore[union-attr]


def test_a_duplicated_acceptance_is_harmless() -> None:
    machine = a_requestor()
    machine.place(spec(), "r1", T0, TIMEOUT_S)
    first = machine.handle(offer("n1"), T0 + 0.01)
    collect(machine, first, T0 + 0.01)
    outcome(machine.handle(accepted("n1"), T0 + 0.02))
    again = machine.handle(accepted("n1"), T0 + 0.03)
    assert sent(again) == []


def test_timing_out_while_awarding_frees_what_was_awarded() -> None:
    machine = a_requestor()
    effects = machine.place(spec(), "r1", T0, 1.0)
    first = machine.handle(offer("n1"), T0 + 0.01)
    collect(machine, first, T0 + 0.01)
    key, at = timer_at(effects, "deadline")
    timed_out = machine.on_timer(key, at)
    assert isinstance(outcome(timed_out), Failed)
    assert [s.address for s in sent(timed_out, Free)] == ["addr-n1"]


def test_busy_nodes_are_asked_again_alone_instead_of_failing() -> None:
    machine = a_requestor()
    effects = machine.place(spec(), "r1", T0, TIMEOUT_S)
    busy = Decline(request_id="r1", sender="n1", reply_to="addr-n1", attempt=5, busy=True)
    for _ in range(4):
        key, at = timer_at(effects, "widen")
        effects = machine.on_timer(key, at)
    machine.handle(busy, at)
    key, at = timer_at(effects, "widen")
    effects = machine.on_timer(key, at)
    assert not any(isinstance(e, Failed) for e in effects)
    key, retry_at = timer_at(effects, "retry")
    retried = machine.on_timer(key, retry_at)
    assert published(retried) == []  # not the whole tier again
    (again,) = sent(retried, ReservationRequest)
    assert again.address == "addr-n1"
    assert again.message.probed_node == "n1"  # type: ignore[attr-defined]


def test_a_node_that_told_of_more_room_after_declining_is_asked_again_before_a_failure() -> None:
    machine = a_requestor()
    full = {"VCPU": NOTHING_FREE, "MEMORY_MB": 12}
    for node in ("n1", "n2"):
        machine.handle(NodeStatus(sender=node, reply_to=f"addr-{node}", tier=100, room=full), T0)
    effects = machine.place(spec(), "r1", T0, TIMEOUT_S)  # no room may fit: every tier
    for _ in range(4):
        key, at = timer_at(effects, "widen")
        effects = machine.on_timer(key, at)
    for node in ("n1", "n2"):
        decline = Decline(request_id="r1", sender=node, reply_to=f"addr-{node}", attempt=5,
                          room=full)  # fmt: skip
        effects += machine.handle(decline, at)
    # An instance on n1 ends before the verdict: n1 tells every requestor of its room.
    roomier = {"VCPU": 3, "MEMORY_MB": 12}
    machine.handle(NodeStatus(sender="n1", reply_to="addr-n1", tier=100, room=roomier), at)
    key, at = timer_at(effects, "widen")
    effects = machine.on_timer(key, at)
    assert not any(isinstance(e, Failed) for e in effects)
    (again,) = sent(effects, ReservationRequest)  # n2's room is as it was: not asked
    assert (again.address, again.message.probed_node) == ("addr-n1", "n1")  # type: ignore[attr-defined]
    assert machine.counters["room_rechecks"] == 1
    # Another requestor took that room first: n1 declines again, and that is the verdict.
    decline = Decline(request_id="r1", sender="n1", reply_to="addr-n1", attempt=6, room=full)
    assert isinstance(outcome(machine.handle(decline, at + 0.001)), Failed)


def test_freeing_a_placement_sends_free_to_each_node_and_completes_on_confirmation() -> None:
    machine = a_requestor()
    machine.place(spec(count=2), "r1", T0, TIMEOUT_S)
    first = machine.handle(offer("n1"), T0 + 0.01)
    machine.handle(offer("n2"), T0 + 0.01)
    collect(machine, first, T0 + 0.01)
    machine.handle(accepted("n1"), T0 + 0.02)
    placed = outcome(machine.handle(accepted("n2"), T0 + 0.02))
    assert isinstance(placed, Placed)
    effects = machine.free(placed.placement, T0 + 1)
    assert sorted(s.address for s in sent(effects, Free)) == ["addr-n1", "addr-n2"]
    for node in ("n1", "n2"):
        done = machine.handle(
            Freed(
                request_id="r1",
                sender=node,
                reply_to=f"addr-{node}",
                allocation_ids=(f"{node}.res.r1/0",),
            ),
            T0 + 1.01,
        )
    (completed,) = [e for e in done if type(e).__name__ == "FreeCompleted"]
    assert completed.missing == ()  # type: ignore[union-attr]
    assert machine.placement_of("r1") is None


def test_a_requestor_stands_back_when_one_with_precedence_places_the_same_id() -> None:
    machine = a_requestor()  # "req"
    machine.place(spec(), "r1", T0, TIMEOUT_S)
    first = machine.handle(offer("n1"), T0 + 0.01)
    contended = Decline(
        request_id="r1",
        sender="n2",
        reply_to="addr-n2",
        attempt=1,
        reasons=(Reason(code="in_flight_elsewhere", subject="another-req"),),
    )
    machine.handle(contended, T0 + 0.01)
    decided = collect(machine, first, T0 + 0.01)
    assert sent(decided, Award) == []
    assert [s.address for s in sent(decided, Release)] == ["addr-n1"]
    key, at = timer_at(decided, "retry")
    retry = machine.on_timer(key, at)
    (again,) = published(retry)
    held = AlreadyPlaced(
        request_id="r1",
        sender="n2",
        reply_to="addr-n2",
        allocations=(AllocationInfo(allocation_id="n2.x/0", resources=dict(SHAPE)),),
    )
    placed = outcome(machine.handle(held, at + 0.01))
    assert isinstance(placed, Placed) and placed.placement.nodes == ("n2",)
    assert again.attempt == 2


def test_a_requestor_with_precedence_goes_on_despite_contention() -> None:
    machine = a_requestor()  # "req" sorts before "zed"
    machine.place(spec(), "r1", T0, TIMEOUT_S)
    first = machine.handle(offer("n1"), T0 + 0.01)
    contended = Decline(
        request_id="r1",
        sender="n2",
        reply_to="addr-n2",
        attempt=1,
        reasons=(Reason(code="in_flight_elsewhere", subject="zed"),),
    )
    machine.handle(contended, T0 + 0.01)
    decided = collect(machine, first, T0 + 0.01)
    assert sent(decided, Award) == []
    (lookup,) = [e for e in decided if isinstance(e, Publish)]
    assert isinstance(lookup.message, Lookup)  # first: has the other placed it already?
    assert lookup.topic == lookup_topic("r1")
    (award,) = sent(machine.on_unroutable(lookup.message, T0 + 0.011), Award)
    assert award.address == "addr-n1"  # nobody holds it: we go on


def test_no_failure_while_another_requestors_reservation_of_the_id_may_live() -> None:
    # The other requestor may have died mid-conversation: only its reservation's TTL
    # settles whether the id is placed. Until then, ask again; after it, place.
    machine = a_requestor(max_widen_s=0.2)  # the ladder is walked within a second
    effects = machine.place(spec(request_id="job"), "job", T0, TIMEOUT_S)
    # "zed" sorts after us: we have precedence, and nothing else stops a verdict
    busy = Reason(code="in_flight_elsewhere", subject="zed")
    decline = Decline(request_id="job", sender="n0", reply_to="addr-n0", attempt=1, reasons=(busy,))
    machine.handle(decline, T0 + 0.01)
    now = T0
    while not any(isinstance(e, Failed) for e in effects) and now < T0 + 5.0:
        timers = [e for e in effects if isinstance(e, SetTimer)]
        key, now = min(((t.key, t.at) for t in timers), key=lambda pair: pair[1])
        effects = machine.on_timer(key, now)
    assert not any(isinstance(e, Failed) for e in effects)
    assert machine.is_active("job")


def held_by(node: str, request_id: str, at_s: float, owner: str = "someone") -> AlreadyPlaced:
    return AlreadyPlaced(
        request_id=request_id,
        sender=node,
        reply_to=f"addr-{node}",
        allocations=(AllocationInfo(allocation_id=f"{node}.res/0", resources=dict(SHAPE)),),
        owner=owner,
        requested_at_s=at_s,
    )


def back(node: str, *request_ids: str) -> NodeStatus:
    return NodeStatus(
        sender=node,
        reply_to=f"addr-{node}",
        tier=10,
        rejoined_buckets=bucket_bitmap(lookup_bucket(r) for r in request_ids),
    )


def placed_job_7(machine: RequestorMachine, on: str, at_s: float) -> Placed:
    """A caller-chosen id, placed by adopting what ``on`` holds (asked for at ``at_s``)."""
    machine.place(spec(request_id="job-7"), "job-7", T0, TIMEOUT_S, requested_at_s=at_s)
    done = outcome(machine.handle(held_by(on, "job-7", at_s), T0 + 0.01))
    assert isinstance(done, Placed)
    return done


def test_a_placement_keeps_when_it_was_asked_for_and_every_award_carries_it() -> None:
    machine = a_requestor()
    machine.place(spec(), "r1", T0, TIMEOUT_S, requested_at_s=1_700_000_001.0)
    effects = collect(machine, machine.handle(offer("n1"), T0 + 0.01), T0 + 0.01)
    assert [s.message.requested_at_s for s in sent(effects, Award)] == [1_700_000_001.0]  # type: ignore[union-attr]
    placed = outcome(machine.handle(accepted("n1"), T0 + 0.02))
    assert isinstance(placed, Placed)
    assert placed.placement.requested_at_s == 1_700_000_001.0


def test_a_node_back_holding_ids_we_answered_for_or_are_placing_draws_lookups_of_them() -> None:
    machine = a_requestor()
    placed_job_7(machine, "n2", at_s=200.0)
    machine.place(spec(request_id="job-8"), "job-8", T0, TIMEOUT_S)  # in flight
    machine.place(spec(), "generated", T0, TIMEOUT_S)  # its id is ours alone: never looked up
    status = back("n1", "job-7", "job-8", "generated", "other")
    looked_up = published(machine.handle(status, T0 + 1))
    assert [(type(m), m.request_id) for m in looked_up] == [(Lookup, "job-7"), (Lookup, "job-8")]
    assert machine.counters["lookups_again"] == 2


def test_an_earlier_placement_of_an_id_we_placed_and_freed_since_is_freed() -> None:
    machine = a_requestor()
    ours = placed_job_7(machine, "n2", at_s=200.0)
    machine.free(ours.placement, T0 + 0.5)
    assert published(machine.handle(back("n1", "job-7"), T0 + 1))  # still looked up
    (free,) = sent(machine.handle(held_by("n1", "job-7", at_s=100.0), T0 + 1), Free)
    assert free.address == "addr-n1"
    # placed again under the same id after our free: that one stands
    assert sent(machine.handle(held_by("n3", "job-7", at_s=300.0), T0 + 2), Free) == []


def test_an_earlier_placement_of_an_id_we_answered_for_is_freed() -> None:
    machine = a_requestor()
    ours = placed_job_7(machine, "n2", at_s=200.0)
    effects = machine.handle(held_by("n1", "job-7", at_s=100.0), T0 + 1)
    (free,) = sent(effects, Free)
    assert free.address == "addr-n1"
    assert free.message.allocation_ids == ("n1.res/0",)  # type: ignore[union-attr]
    assert machine.counters["superseded_frees"] == 1
    assert machine.placement_of("job-7") == ours.placement  # ours stands


def test_a_later_placement_of_an_id_we_answered_for_stands_and_ours_is_forgotten() -> None:
    machine = a_requestor()
    placed_job_7(machine, "n2", at_s=200.0)
    effects = machine.handle(held_by("n1", "job-7", at_s=300.0), T0 + 1)
    assert sent(effects, Free) == []
    assert machine.placement_of("job-7") is None  # a retry here looks it up again
    assert machine.counters["superseded_placements"] == 1


def test_another_placement_asked_for_at_the_same_time_as_ours_is_left_alone() -> None:
    machine = a_requestor()
    ours = placed_job_7(machine, "n2", at_s=200.0)
    effects = machine.handle(held_by("n1", "job-7", at_s=200.0, owner="other"), T0 + 1)
    assert sent(effects, Free) == []  # no time to tell them apart: neither is superseded
    assert machine.placement_of("job-7") == ours.placement


def test_our_own_allocation_of_a_placement_asked_for_later_is_not_freed_as_ours() -> None:
    machine = a_requestor()
    placed_job_7(machine, "n2", at_s=200.0)
    effects = machine.handle(held_by("n1", "job-7", at_s=300.0, owner="req"), T0 + 1)
    assert sent(effects, Free) == []  # another requestor may have adopted it: it stands
    assert machine.placement_of("job-7") is None


def test_our_own_placement_found_again_is_left_alone() -> None:
    machine = a_requestor()
    ours = placed_job_7(machine, "n2", at_s=200.0)
    effects = machine.handle(held_by("n2", "job-7", at_s=200.0), T0 + 1)
    assert sent(effects, Free) == []
    assert machine.placement_of("job-7") == ours.placement


# -- claims -------------------------------------------------------------------------------


def a_claiming_requestor(**config: Any) -> RequestorMachine:
    return a_requestor(claims=True, **config)


def lookups(effects: list[Effect]) -> list[Publish]:
    return [e for e in effects if isinstance(e, Publish) and isinstance(e.message, Lookup)]


def test_a_caller_chosen_id_is_claimed_before_anything_is_sent() -> None:
    machine = a_claiming_requestor()
    effects = machine.place(spec(request_id="r1"), "r1", T0, TIMEOUT_S)
    assert Claim("r1") in effects
    assert not [e for e in effects if isinstance(e, Publish | Send)]
    # a generated id is not claimed: nobody else can know it
    assert Claim("g1") not in machine.place(spec(), "g1", T0, TIMEOUT_S)


def test_under_a_claim_and_a_lookup_nobody_answers_the_decision_waits_for_no_lookup() -> None:
    machine = a_claiming_requestor()
    machine.place(spec(request_id="r1"), "r1", T0, TIMEOUT_S)
    (lookup,) = lookups(machine.on_claim("r1", True, T0 + 0.001))
    assert lookup.topic == lookup_topic("r1")
    asked = machine.on_unroutable(lookup.message, T0 + 0.002)  # nobody holds anything of it
    assert [r.tier for r in published(asked) if isinstance(r, ReservationRequest)] == [10]
    first = machine.handle(offer("n1"), T0 + 0.003)
    decided = collect(machine, first, T0 + 0.003)
    # awarded at once: no second lookup, no wait for its answers
    assert [a.address for a in sent(decided, Award)] == ["addr-n1"]
    assert lookups(decided) == []
    done = machine.handle(accepted("n1"), T0 + 0.004)
    assert isinstance(outcome(done), Placed)
    assert Unclaim("r1") in done and machine.claims_held == 0


def test_a_claim_held_elsewhere_is_asked_again_after_a_pause_and_the_placement_adopted() -> None:
    machine = a_claiming_requestor()
    machine.place(spec(request_id="r1"), "r1", T0, TIMEOUT_S)
    paused = machine.on_claim("r1", False, T0 + 0.001)  # another requestor is placing it
    assert not [e for e in paused if isinstance(e, Publish | Send)]
    key, at = timer_at(paused, "retry")
    assert Claim("r1") in machine.on_timer(key, at)
    assert len(lookups(machine.on_claim("r1", True, at + 0.001))) == 1
    # the other placed it: its holder answers, saying the placement has one instance
    done = machine.handle(held_by("n2", "r1", at_s=5.0), at + 0.002)
    placed = outcome(done)
    assert isinstance(placed, Placed) and placed.placement.nodes == ("n2",)
    assert published(done) == [] and sent(done, Award) == []
    assert Unclaim("r1") in done


def test_a_broker_that_cannot_claim_leaves_the_lookup_before_every_decision() -> None:
    machine = a_claiming_requestor()
    machine.place(spec(request_id="r1"), "r1", T0, TIMEOUT_S)
    asked = machine.on_claim("r1", None, T0 + 0.001)
    assert [r.tier for r in published(asked)] == [10]
    decided = collect(machine, machine.handle(offer("n1"), T0 + 0.002), T0 + 0.002)
    assert sent(decided, Award) == [] and len(lookups(decided)) == 1


def test_a_claim_lost_with_the_connection_brings_the_lookup_back() -> None:
    machine = a_claiming_requestor()
    machine.place(spec(request_id="r1"), "r1", T0, TIMEOUT_S)
    (lookup,) = lookups(machine.on_claim("r1", True, T0 + 0.001))
    machine.on_unroutable(lookup.message, T0 + 0.002)
    assert machine.claims_held == 1
    machine.claims_lost()  # the connection went and came back: so did the claim
    decided = collect(machine, machine.handle(offer("n1"), T0 + 0.003), T0 + 0.003)
    assert sent(decided, Award) == [] and len(lookups(decided)) == 1
    assert machine.claims_held == 0


def test_a_claim_answered_after_its_conversation_ended_is_let_go() -> None:
    machine = a_claiming_requestor()
    started = machine.place(spec(request_id="r1"), "r1", T0, 1.0)
    key, at = timer_at(started, "deadline")
    failed = outcome(machine.on_timer(key, at))  # the broker never answered in time
    assert isinstance(failed, Failed)
    assert machine.on_claim("r1", True, at + 0.1) == [Unclaim("r1")]
