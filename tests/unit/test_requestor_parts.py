"""The machines the requestor is made of, each on its own: the conversation's phase table,
request-id contention, freeing, and the record of what was answered."""

from __future__ import annotations

import pytest

from reservoir.protocol.answers import AnsweredIds
from reservoir.protocol.contention import ClaimState, IdContention, LookupOutcome
from reservoir.protocol.conversation import (
    TRANSITIONS,
    Conversation,
    Event,
    Phase,
    ProtocolBug,
)
from reservoir.protocol.effects import CancelTimer, Dropped, Effect, FreeCompleted, Send, SetTimer
from reservoir.protocol.freeing import Freeing, FreeTarget
from reservoir.protocol.messages import LOOKUP_BUCKETS, Free, Freed, lookup_bucket
from reservoir.protocol.placement import PlacementRequest
from reservoir.protocol.timers import ConversationTimer, FreeTimer, TimerKind

T0 = 100.0


def a_conversation() -> Conversation:
    return Conversation(
        request_id="r1",
        spec=PlacementRequest(resources={"VCPU": 1}),
        started_at=T0,
        deadline=T0 + 30,
        ttl_s=5.0,
        target=1,
        contention=IdContention("req"),
    )


def test_timer_keys_are_values_that_cannot_change_once_a_timer_is_set_on_them() -> None:
    key = ConversationTimer("r1", TimerKind.COLLECT, 2)
    timers = {key: "set"}
    # the same fields find the timer; another attempt, kind or conversation does not
    assert timers[ConversationTimer("r1", TimerKind.COLLECT, 2)] == "set"
    assert ConversationTimer("r1", TimerKind.COLLECT, 3) not in timers
    assert ConversationTimer("r1", TimerKind.WIDEN, 2) not in timers
    assert ConversationTimer("r2", TimerKind.COLLECT, 2) not in timers
    assert FreeTimer("r1", True) != FreeTimer("r1", False)
    with pytest.raises(AttributeError):
        key.attempt = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        FreeTimer("r1", True).notify = False  # type: ignore[misc]


def test_a_new_conversation_can_only_probe_broadcast_claim_or_wait_for_a_keepers_sample() -> None:
    assert TRANSITIONS[Phase.NEW] == {Event.PROBE, Event.BROADCAST, Event.BACK_OFF, Event.CLAIM}
    conversation = a_conversation()
    with pytest.raises(ProtocolBug):
        conversation.enter(Event.AWARD)
    conversation.enter(Event.PROBE)
    assert conversation.phase is Phase.PROBING and conversation.collecting


def test_the_exhaustive_broadcast_may_ask_nodes_alone_again() -> None:
    conversation = a_conversation()
    conversation.enter(Event.BROADCAST)
    conversation.enter(Event.PROBE)  # decliners that told of more room since, before failing
    assert conversation.phase is Phase.PROBING
    conversation.enter(Event.BROADCAST)
    conversation.enter(Event.BACK_OFF)
    conversation.enter(Event.PROBE)  # asking the busy nodes again, alone
    assert conversation.phase is Phase.PROBING


def test_every_phase_is_in_the_table() -> None:
    assert set(TRANSITIONS) == set(Phase)


def test_a_claim_is_asked_for_first_or_again_after_a_pause_and_never_mid_conversation() -> None:
    conversation = a_conversation()
    conversation.enter(Event.CLAIM)
    assert conversation.phase is Phase.CLAIMING
    with pytest.raises(ProtocolBug):
        conversation.enter(Event.AWARD)  # nothing is held while claiming
    conversation.enter(Event.BACK_OFF)  # claimed elsewhere
    conversation.enter(Event.CLAIM)  # again, after the pause
    conversation.enter(Event.PROBE)
    with pytest.raises(ProtocolBug):
        conversation.enter(Event.CLAIM)


def test_a_held_claim_with_nobody_found_is_exclusive_until_another_requestor_shows() -> None:
    contention = IdContention("bob", True)
    assert not contention.exclusive()
    contention.claim, contention.clear = ClaimState.HELD, True
    assert contention.exclusive() and not contention.must_look_up(1)
    contention.in_flight_elsewhere("carol", alive_until=T0 + 6)
    assert not contention.exclusive() and contention.must_look_up(1)


def test_a_claim_lost_with_its_connection_is_no_longer_exclusive() -> None:
    contention = IdContention("bob", True)
    contention.claim, contention.clear = ClaimState.HELD, True
    contention.claim_lost()
    assert contention.claim is ClaimState.NONE and contention.must_look_up(1)


def test_a_requestor_whose_id_sorts_later_defers_to_the_other() -> None:
    contention = IdContention("bob")
    contention.in_flight_elsewhere("carol", alive_until=T0 + 6)
    assert contention.looks_up and not contention.defers_to_others()
    contention.in_flight_elsewhere("alice", alive_until=T0 + 6)
    assert contention.defers_to_others()
    assert contention.stand_back() == "the same request id is being placed by alice"
    assert not contention.defers_to_others()


def test_an_id_stays_contended_until_the_others_reservation_must_have_expired() -> None:
    contention = IdContention("bob")
    assert not contention.contended(T0)
    contention.in_flight_elsewhere("alice", alive_until=T0 + 6)
    contention.in_flight_elsewhere("alice", alive_until=T0 + 4)  # an older report
    contention.stand_back()
    assert contention.contended(T0 + 5.9)
    assert not contention.contended(T0 + 6)


def test_a_lookup_is_needed_once_per_attempt_after_the_offers() -> None:
    contention = IdContention("req", looks_up=True)
    assert contention.must_look_up(1)
    contention.lookup_sent(1, T0 + 0.1)
    assert contention.looking_up() and not contention.must_look_up(1)
    assert contention.lookup_over() is LookupOutcome.DECIDE
    assert contention.must_look_up(2)


def test_a_follower_whose_owner_let_go_places_the_id_itself() -> None:
    contention = IdContention("req")
    contention.placed_already("n1.x/0", owner="other", ours=False)
    assert contention.following == "other"
    contention.lookup_sent(1, T0 + 0.1, following=True)
    assert contention.lookup_over() is LookupOutcome.OWNER_GONE  # nobody said "placed"
    assert contention.following is None


def a_freeing() -> Freeing:
    return Freeing(sender="req", reply_to="req-inbox", retry_s=1.0, attempts=2)


def test_frees_are_sent_again_until_every_node_confirms() -> None:
    freeing = a_freeing()
    effects: list[Effect] = []
    target = FreeTarget("addr-n1", "n1", ("a/0",))
    freeing.free("r1", [target], T0, effects, notify=True)
    (free,) = [e for e in effects if isinstance(e, Send)]
    assert isinstance(free.message, Free) and free.message.allocation_ids == ("a/0",)
    assert SetTimer(FreeTimer("r1", True), T0 + 1.0) in effects
    again: list[Effect] = []
    freeing.on_timer(FreeTimer("r1", True), T0 + 1.0, again)
    assert len([e for e in again if isinstance(e, Send)]) == 1
    done: list[Effect] = []
    freed = Freed(
        request_id="r1", sender="n1", reply_to="addr-n1", allocation_ids=("a/0",), freed=("a/0",)
    )
    freeing.on_freed(freed, done)
    assert FreeCompleted("r1", ("a/0",), ()) in done
    assert CancelTimer(FreeTimer("r1", True)) in done
    assert not freeing.for_caller("r1")


def test_the_caller_hears_of_the_silent_node_and_its_free_goes_on_as_tidying() -> None:
    freeing = a_freeing()
    freeing.free("r1", [FreeTarget("addr-n1", "n1")], T0, [], notify=True)
    for attempt in range(2):
        outcome: list[Effect] = []
        freeing.on_timer(FreeTimer("r1", True), T0 + attempt + 1, outcome)
    assert FreeCompleted("r1", (), ("n1",)) in outcome
    assert not freeing.for_caller("r1")
    assert [e.address for e in outcome if isinstance(e, Send)] == ["addr-n1"]
    assert SetTimer(FreeTimer("r1", False), T0 + 3.0) in outcome
    # The node comes back and confirms: nothing is left to do, nobody is told twice.
    done: list[Effect] = []
    freeing.on_freed(Freed(request_id="r1", sender="n1", reply_to="addr-n1", freed=("a/0",)), done)
    assert done == [CancelTimer(FreeTimer("r1", False))]


def test_tidying_up_never_gives_up_but_backs_off_and_says_so_once() -> None:
    freeing = Freeing(sender="req", reply_to="req-inbox", retry_s=1.0, attempts=2, max_retry_s=8.0)
    freeing.free("r1", [FreeTarget("addr-n1", "n1")], T0, [])
    at, delays, notes = T0 + 1.0, [], 0
    for _ in range(8):
        outcome: list[Effect] = []
        freeing.on_timer(FreeTimer("r1", False), at, outcome)
        notes += sum(1 for e in outcome if isinstance(e, Dropped))
        assert len([e for e in outcome if isinstance(e, Send)]) == 1  # the free, again
        (timer,) = [e for e in outcome if isinstance(e, SetTimer)]
        delays.append(timer.at - at)
        at = timer.at
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0, 8.0, 8.0]
    assert notes == 1


def test_answered_ids_forget_the_oldest_beyond_their_capacity_and_their_buckets_with_them() -> None:
    answers = AnsweredIds(capacity=2)
    answers.answered("a", 1.0)
    answers.answered("b", 2.0)
    answers.answered("a", 3.0)  # renewed: now the newest
    answers.answered("c", 4.0)
    assert len(answers) == 2
    assert answers.requested_at_s("b") is None
    assert (answers.requested_at_s("a"), answers.requested_at_s("c")) == (3.0, 4.0)
    every_bucket = range(LOOKUP_BUCKETS)
    assert answers.in_buckets(every_bucket) == {"a", "c"}
    assert answers.in_buckets([lookup_bucket("a")]) >= {"a"}
    assert "b" not in answers.in_buckets([lookup_bucket("b")])
