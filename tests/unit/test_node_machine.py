"""The node's state machine, driven by hand on a fake clock: no broker, no threads."""

from __future__ import annotations

from typing import Any

import msgspec.structs
import pytest

from reservoir.protocol.audit import NodeSnapshot, audit
from reservoir.protocol.effects import (
    Bind,
    CancelTimer,
    DeleteAllocation,
    Dropped,
    Effect,
    Publish,
    Send,
    SetTimer,
    StoreAllocation,
    Unbind,
)
from reservoir.protocol.ledger import Allocation, Inventory
from reservoir.protocol.messages import (
    LOOKUP_BUCKETS,
    ROSTER_TOPIC,
    Accepted,
    AlreadyPlaced,
    Award,
    Decline,
    Free,
    Freed,
    Lookup,
    Message,
    NodeStatus,
    Offer,
    Refused,
    Release,
    ReservationRequest,
    RollCall,
    bucket_bitmap,
    buckets_in,
    lookup_bucket,
    lookup_topic,
)
from reservoir.protocol.node import EXPIRY_TIMER, NodeConfig, NodeMachine

T0 = 1000.0
REQUESTOR = "req-1"
REPLY = "reservoir.requestor.req-1"


def a_node(vcpus: int = 8, memory_mb: int = 16384, **inventories: Inventory) -> NodeMachine:
    config = NodeConfig(
        name="node-a",
        address="reservoir.node.node-a",
        inventories={
            "VCPU": Inventory(total=vcpus),
            "MEMORY_MB": Inventory(total=memory_mb),
            **inventories,
        },
        traits=frozenset({"HW_CPU_X86_AVX2"}),
    )
    node = NodeMachine(config)
    node.start(T0)
    return node


def a_request(request_id: str = "r1", **fields: Any) -> ReservationRequest:
    values: dict[str, Any] = {
        "request_id": request_id,
        "sender": REQUESTOR,
        "reply_to": REPLY,
        "resources": {"VCPU": 2, "MEMORY_MB": 2048},
        "tier": 10,
        "attempt": 1,
        "ttl_s": 5.0,
    }
    values.update(fields)
    return ReservationRequest(**values)


def sent(effects: list[Effect]) -> list[Message]:
    return [e.message for e in effects if isinstance(e, Send)]


def the_offer(effects: list[Effect]) -> Offer:
    offers = [m for m in sent(effects) if isinstance(m, Offer)]
    assert len(offers) == 1, effects
    return offers[0]


def award(offer: Offer, slots: int | None = None, sender: str = REQUESTOR) -> Award:
    return Award(
        request_id=offer.request_id,
        sender=sender,
        reply_to=REPLY,
        reservation_id=offer.reservation_id,
        slots=slots or offer.slots,
    )


def test_a_node_that_fits_reserves_and_offers_to_the_reply_address() -> None:
    node = a_node()
    effects = node.handle(a_request(), T0)
    offer = the_offer(effects)
    assert offer.slots == 1
    assert offer.ttl_s == pytest.approx(5.0)
    assert [e.address for e in effects if isinstance(e, Send)] == [REPLY]
    assert node.ledger.usage("VCPU").reserved == 2


def test_a_node_offers_as_many_slots_as_fit_up_to_the_count() -> None:
    node = a_node(vcpus=8)
    assert the_offer(node.handle(a_request(count=10), T0)).slots == 4


def test_a_node_that_cannot_fit_says_nothing() -> None:
    node = a_node(vcpus=1)
    assert sent(node.handle(a_request(), T0)) == []


def test_a_node_that_cannot_fit_explains_itself_when_asked() -> None:
    node = a_node(vcpus=4)
    effects = node.handle(a_request(resources={"VCPU": 6}, explain=True), T0)
    (decline,) = sent(effects)
    assert isinstance(decline, Decline)
    assert not decline.busy
    (reason,) = decline.reasons
    assert reason.code == "too_large"
    assert reason.subject == "VCPU"


def test_an_explained_shortage_names_the_class_and_how_much_is_missing() -> None:
    node = a_node(vcpus=4)
    node.handle(award(the_offer(node.handle(a_request("r0", resources={"VCPU": 3}), T0))), T0)
    effects = node.handle(a_request(resources={"VCPU": 2}, explain=True), T0)
    (decline,) = sent(effects)
    assert isinstance(decline, Decline)
    (reason,) = decline.reasons
    assert (reason.code, reason.subject, reason.shortfall) == ("insufficient", "VCPU", 1)


def test_missing_and_forbidden_traits_are_reasons() -> None:
    node = a_node()
    request = a_request(
        required_traits=frozenset({"HW_GPU"}),
        forbidden_traits=frozenset({"HW_CPU_X86_AVX2"}),
        explain=True,
    )
    (decline,) = sent(node.handle(request, T0))
    assert isinstance(decline, Decline)
    assert {(r.code, r.subject) for r in decline.reasons} == {
        ("trait_missing", "HW_GPU"),
        ("trait_forbidden", "HW_CPU_X86_AVX2"),
    }


def test_a_reservation_expires_at_exactly_its_ttl_and_not_before() -> None:
    node = a_node()
    effects = node.handle(a_request(), T0)
    assert SetTimer(EXPIRY_TIMER, T0 + 5.0) in effects
    node.on_timer(EXPIRY_TIMER, T0 + 4.999)
    assert len(node.ledger.reservations) == 1
    node.on_timer(EXPIRY_TIMER, T0 + 5.0)
    assert node.ledger.reservations == {}
    assert node.ledger.usage("VCPU").reserved == 0


def timer_effects(effects: list[Effect]) -> list[Effect]:
    return [e for e in effects if isinstance(e, SetTimer | CancelTimer)]


def assert_invariants(node: NodeMachine, now: float) -> None:
    """No overcommit, no reservation past its deadline, and each request id held once
    (the tests using it ask for one instance each)."""
    assert node.ledger.violations() == []
    assert all(r.deadline > now for r in node.ledger.reservations.values())
    held = [a.request_id for a in node.ledger.allocations.values()]
    assert len(held) == len(set(held))


def test_reservations_that_end_early_leave_the_expiry_timer_where_it_is() -> None:
    node = a_node()
    first = the_offer(node.handle(a_request("r1"), T0))
    released = node.handle(
        Release(request_id="r1", sender=REQUESTOR, reservation_id=first.reservation_id), T0
    )
    assert timer_effects(released) == []  # not cancelled: it fires once and finds nothing
    later = node.handle(a_request("r2"), T0 + 1.0)
    assert timer_effects(later) == []  # due at T0 + 6, after the timer: found when it fires
    fired = node.on_timer(EXPIRY_TIMER, T0 + 5.0)
    assert [r.request_id for r in node.ledger.reservations.values()] == ["r2"]
    assert timer_effects(fired) == [SetTimer(EXPIRY_TIMER, T0 + 6.0)]
    node.handle(award(the_offer(later)), T0 + 5.5)
    assert timer_effects(node.on_timer(EXPIRY_TIMER, T0 + 6.0)) == []  # nothing left to time
    assert_invariants(node, T0 + 6.0)


def test_a_reservation_due_sooner_than_the_expiry_timer_moves_it() -> None:
    node = a_node()
    node.handle(a_request("r1"), T0)
    sooner = node.handle(a_request("r2", ttl_s=1.0), T0 + 0.5)
    assert timer_effects(sooner) == [SetTimer(EXPIRY_TIMER, T0 + 1.5)]
    fired = node.on_timer(EXPIRY_TIMER, T0 + 1.5)
    assert [r.request_id for r in node.ledger.reservations.values()] == ["r1"]
    assert timer_effects(fired) == [SetTimer(EXPIRY_TIMER, T0 + 5.0)]
    assert_invariants(node, T0 + 1.5)


def test_any_event_after_the_deadline_expires_the_reservation_even_without_the_timer() -> None:
    node = a_node()
    node.handle(a_request(), T0)
    node.handle(a_request("other"), T0 + 5.0)
    assert [r.request_id for r in node.ledger.reservations.values()] == ["other"]


def test_a_requests_ttl_is_honoured_up_to_the_nodes_bound() -> None:
    node = a_node()
    assert the_offer(node.handle(a_request(ttl_s=2.0), T0)).ttl_s == pytest.approx(2.0)
    offer = the_offer(node.handle(a_request("long", ttl_s=3600), T0))
    assert offer.ttl_s == pytest.approx(node.config.max_ttl_s)


def test_an_award_stores_the_allocation_before_accepting() -> None:
    node = a_node()
    offer = the_offer(node.handle(a_request(), T0))
    effects = node.handle(award(offer), T0 + 1)
    kinds = [type(e).__name__ for e in effects if isinstance(e, StoreAllocation | Send)]
    assert kinds == ["StoreAllocation", "Send"]
    (accepted,) = sent(effects)
    assert isinstance(accepted, Accepted)
    assert len(accepted.allocations) == 1
    assert node.ledger.usage("VCPU").allocated == 2
    assert node.ledger.usage("VCPU").reserved == 0


def test_an_award_for_fewer_slots_releases_the_rest() -> None:
    node = a_node(vcpus=8)
    offer = the_offer(node.handle(a_request(count=4), T0))
    node.handle(award(offer, slots=1), T0)
    assert node.ledger.usage("VCPU").allocated == 2
    assert node.ledger.usage("VCPU").reserved == 0


def test_an_award_for_an_expired_reservation_is_refused() -> None:
    node = a_node()
    offer = the_offer(node.handle(a_request(), T0))
    (refused,) = sent(node.handle(award(offer), T0 + 5.0))
    assert isinstance(refused, Refused)
    assert node.ledger.allocations == {}


def test_a_repeated_award_repeats_the_acceptance_without_allocating_twice() -> None:
    node = a_node()
    offer = the_offer(node.handle(a_request(), T0))
    (first,) = sent(node.handle(award(offer), T0))
    (again,) = sent(node.handle(award(offer), T0 + 30))
    assert first == again
    assert len(node.ledger.allocations) == 1


def test_an_award_from_a_stranger_is_ignored() -> None:
    node = a_node()
    offer = the_offer(node.handle(a_request(), T0))
    effects = node.handle(award(offer, sender="someone-else"), T0)
    assert sent(effects) == []
    assert any(isinstance(e, Dropped) and e.reason == "foreign_award" for e in effects)
    assert len(node.ledger.reservations) == 1


def test_a_release_frees_the_reservation() -> None:
    node = a_node()
    offer = the_offer(node.handle(a_request(), T0))
    release = Release(request_id="r1", sender=REQUESTOR, reservation_id=offer.reservation_id)
    node.handle(release, T0)
    assert node.ledger.reservations == {}


def test_a_release_for_an_unknown_reservation_is_dropped_quietly() -> None:
    node = a_node()
    release = Release(request_id="r1", sender=REQUESTOR, reservation_id="nope")
    effects = node.handle(release, T0)
    assert sent(effects) == []
    assert [e.reason for e in effects if isinstance(e, Dropped)] == ["late_release"]


def test_a_duplicated_request_gets_the_same_offer_and_no_second_reservation() -> None:
    node = a_node()
    first = the_offer(node.handle(a_request(), T0))
    again = the_offer(node.handle(a_request(attempt=2, tier=25), T0 + 1))
    assert again.reservation_id == first.reservation_id
    assert again.attempt == 2
    assert len(node.ledger.reservations) == 1


def test_a_request_for_a_placed_id_is_answered_with_the_existing_allocations() -> None:
    node = a_node()
    offer = the_offer(node.handle(a_request(), T0))
    (accepted,) = sent(node.handle(award(offer), T0))
    assert isinstance(accepted, Accepted)
    (answer,) = sent(node.handle(a_request(attempt=1), T0 + 60))
    assert isinstance(answer, AlreadyPlaced)
    assert answer.allocations == accepted.allocations
    assert node.ledger.reservations == {}


def test_the_same_request_id_from_two_requestors_is_reserved_once_and_both_are_told() -> None:
    node = a_node()
    node.handle(a_request(), T0)
    effects = node.handle(a_request(sender="req-2", reply_to="elsewhere"), T0)
    to_newcomer, to_holder = [e for e in effects if isinstance(e, Send)]
    assert to_newcomer.address == "elsewhere" and to_holder.address == REPLY
    assert [(r.code, r.subject) for r in to_newcomer.message.reasons] == [  # type: ignore[union-attr]
        ("in_flight_elsewhere", REQUESTOR)
    ]
    assert [(r.code, r.subject) for r in to_holder.message.reasons] == [  # type: ignore[union-attr]
        ("in_flight_elsewhere", "req-2")
    ]
    assert len(node.ledger.reservations) == 1


def test_a_node_is_busy_when_only_live_reservations_stand_in_the_way() -> None:
    node = a_node(vcpus=2)
    node.handle(a_request("first"), T0)
    (decline,) = sent(node.handle(a_request("second"), T0))
    assert isinstance(decline, Decline)
    assert decline.busy
    assert decline.reasons == ()  # reasons only when asked to explain


def test_a_node_rebinds_when_its_allocations_cross_a_tier_boundary() -> None:
    config = NodeConfig(
        name="n", address="reservoir.node.n", inventories={"VCPU": Inventory(total=10)}
    )
    node = NodeMachine(config)
    started = node.start(T0)
    assert {e for e in started if isinstance(e, Bind)} == {
        Bind(f"tier.{t}") for t in (10, 25, 50, 75, 100)
    }
    offered = node.handle(a_request(resources={"VCPU": 2}), T0)
    assert not any(isinstance(e, Bind | Unbind) for e in offered)  # a reservation: no move
    effects = node.handle(award(the_offer(offered)), T0)  # allocated 20 %: leaves tier.10
    assert Unbind("tier.10") in effects
    assert not any(isinstance(e, Bind) and e.topic.startswith("tier.") for e in effects)
    assert node.bound_topics == {"tier.25", "tier.50", "tier.75", "tier.100"}
    ids = tuple(node.ledger.allocations)
    free = Free(request_id="r1", sender=REQUESTOR, reply_to=REPLY, allocation_ids=ids)
    assert Bind("tier.10") in node.handle(free, T0 + 1)  # back to 0 %


def test_free_releases_allocations_and_confirms() -> None:
    node = a_node()
    offer = the_offer(node.handle(a_request(), T0))
    (accepted,) = sent(node.handle(award(offer), T0))
    assert isinstance(accepted, Accepted)
    ids = tuple(a.allocation_id for a in accepted.allocations)
    free = Free(request_id="r1", sender=REQUESTOR, reply_to=REPLY, allocation_ids=ids)
    effects = node.handle(free, T0 + 10)
    assert [DeleteAllocation(i) for i in ids] == [
        e for e in effects if isinstance(e, DeleteAllocation)
    ]
    (freed,) = sent(effects)
    assert isinstance(freed, Freed) and freed.allocation_ids == ids
    assert node.ledger.allocations == {}
    (again,) = sent(node.handle(free, T0 + 11))  # idempotent
    assert isinstance(again, Freed)


def test_a_free_without_ids_drops_everything_the_request_holds_here() -> None:
    node = a_node()
    node.handle(a_request(), T0)
    free = Free(request_id="r1", sender=REQUESTOR, reply_to=REPLY, allocation_ids=())
    node.handle(free, T0)
    assert node.ledger.reservations == {}


def test_stopping_withdraws_live_reservations_and_unbinds() -> None:
    node = a_node()
    node.handle(a_request(), T0)
    effects = node.stop(T0)
    assert {e.topic for e in effects if isinstance(e, Unbind)} == {
        f"tier.{t}" for t in (10, 25, 50, 75, 100)
    }
    (refused,) = sent(effects)
    assert isinstance(refused, Refused)
    assert node.ledger.reservations == {}
    assert sent(node.handle(a_request("late"), T0)) == []


def test_capacity_follows_placement_arithmetic() -> None:
    inventory = Inventory(total=10, reserved=2, allocation_ratio=4.0)
    assert inventory.capacity == 32
    node = a_node(vcpus=1, CUSTOM_FPGA=Inventory(total=2))
    offer = the_offer(node.handle(a_request(resources={"CUSTOM_FPGA": 1}, count=5), T0))
    assert offer.slots == 2


def test_inventory_units_are_enforced() -> None:
    node = a_node(MEMORY_MB=Inventory(total=16384, step_size=512, min_unit=512))
    effects = node.handle(a_request(resources={"MEMORY_MB": 700}, explain=True), T0)
    (decline,) = sent(effects)
    assert isinstance(decline, Decline)
    assert "step size 512" in decline.reasons[0].detail


def test_a_node_never_overcommits_under_a_burst_of_requests() -> None:
    node = a_node(vcpus=8, memory_mb=8192)
    for i in range(50):
        effects = node.handle(a_request(f"r{i}", resources={"VCPU": 3, "MEMORY_MB": 1000}), T0)
        for message in sent(effects):
            if isinstance(message, Offer):
                node.handle(award(message), T0)
    assert node.ledger.violations() == []
    assert node.ledger.usage("VCPU").allocated == 6


def published(effects: list[Effect]) -> list[tuple[str, Message]]:
    return [(e.topic, e.message) for e in effects if isinstance(e, Publish)]


def test_a_node_announces_its_tier_when_it_starts_changes_tier_and_leaves() -> None:
    node = NodeMachine(a_node(vcpus=10).config)
    ((topic, started),) = published(node.start(T0))
    assert topic == ROSTER_TOPIC
    assert isinstance(started, NodeStatus) and (started.tier, started.leaving) == (10, False)
    offered = node.handle(a_request(resources={"VCPU": 2}), T0)
    assert published(offered) == []  # a reservation comes and goes: the tier stays
    ((_, moved),) = published(node.handle(award(the_offer(offered)), T0))
    assert isinstance(moved, NodeStatus) and moved.tier == 25
    offered = node.handle(a_request("r2", resources={"MEMORY_MB": 64}), T0)
    assert published(node.handle(award(the_offer(offered)), T0)) == []  # still 25 %
    ((_, left),) = published(node.stop(T0))
    assert isinstance(left, NodeStatus) and left.leaving


def test_a_node_answers_a_roll_call_with_its_status() -> None:
    node = a_node()
    call = RollCall(sender=REQUESTOR, reply_to=REPLY)
    (status,) = sent(node.handle(call, T0))
    assert isinstance(status, NodeStatus)
    assert (status.sender, status.reply_to, status.tier) == (node.name, node.config.address, 10)


def test_a_probed_node_that_cannot_take_the_request_still_answers() -> None:
    node = a_node(vcpus=2)
    assert sent(node.handle(a_request(resources={"VCPU": 4}), T0)) == []  # broadcast: silent
    (decline,) = sent(node.handle(a_request("r2", resources={"VCPU": 4}, probed_node="node-a"), T0))
    assert isinstance(decline, Decline)
    assert (decline.busy, decline.reasons) == (False, ())  # compact: no reasons unasked


def test_a_node_binds_the_lookup_bucket_of_what_it_holds_before_it_offers() -> None:
    node = a_node()
    effects = node.handle(a_request(findable=True), T0)
    bind = effects.index(Bind(lookup_topic("r1")))
    offer = next(i for i, e in enumerate(effects) if isinstance(e, Send))
    assert bind < offer
    accepted = node.handle(award(the_offer(effects)), T0)
    assert not any(  # reservation -> allocation: the bucket stays bound
        isinstance(e, Unbind | Bind) and e.topic.startswith("lookup.") for e in accepted
    )
    ids = tuple(a.allocation_id for a in node.ledger.allocations.values())
    free = Free(request_id="r1", sender=REQUESTOR, reply_to=REPLY, allocation_ids=ids)
    assert Unbind(lookup_topic("r1")) in node.handle(free, T0)


def test_an_id_findable_only_once_placed_is_bound_when_awarded_before_it_is_accepted() -> None:
    node = a_node()
    offered = node.handle(a_request(findable_when_placed=True), T0)
    assert not [e for e in offered if isinstance(e, Bind) and e.topic.startswith("lookup.")]
    accepted = node.handle(award(the_offer(offered)), T0)
    bind = accepted.index(Bind(lookup_topic("r1")))
    answer = next(i for i, e in enumerate(accepted) if isinstance(e, Send))
    assert bind < answer  # found by a Lookup before the requestor hears it is placed
    assert [a.findable for a in node.ledger.allocations.values()] == [True]


def test_a_released_or_expired_reservation_leaves_its_lookup_bucket() -> None:
    node = a_node()
    node.handle(a_request(findable=True), T0)
    assert Unbind(lookup_topic("r1")) in node.on_timer(EXPIRY_TIMER, T0 + 5)


def test_a_request_nobody_will_look_up_binds_no_lookup_bucket() -> None:
    node = a_node()
    effects = node.handle(a_request(), T0)  # a generated id: only its requestor knows it
    effects += node.handle(award(the_offer(effects)), T0)
    assert not any(isinstance(e, Bind | Unbind) and e.topic.startswith("lookup.") for e in effects)


def test_a_restarted_node_binds_the_buckets_of_its_stored_allocations() -> None:
    node = a_node()
    node.handle(award(the_offer(node.handle(a_request(findable=True), T0))), T0)
    restarted = NodeMachine(node.config, list(node.ledger.allocations.values()))
    assert Bind(lookup_topic("r1")) in restarted.start(T0)


def test_a_lookup_from_another_requestor_finds_a_held_reservation() -> None:
    node = a_node()
    node.handle(a_request(findable=True), T0)
    lookup = Lookup(request_id="r1", sender="other", reply_to="other-inbox")
    told = sent(node.handle(lookup, T0))
    assert {type(m) for m in told} == {Decline}
    assert all(m.reasons[0].code == "in_flight_elsewhere" for m in told)  # type: ignore[union-attr]


def test_every_answer_and_status_tells_the_nodes_room_as_powers_of_two() -> None:
    node = NodeMachine(a_node(vcpus=10, memory_mb=4096).config)
    ((_, started),) = published(node.start(T0))
    assert isinstance(started, NodeStatus)
    assert started.room == {"VCPU": 3, "MEMORY_MB": 12}  # 10 free: 8..15; 4096: 2**12
    offer = the_offer(node.handle(a_request(resources={"VCPU": 3, "MEMORY_MB": 1024}), T0))
    assert offer.room == {"VCPU": 3, "MEMORY_MB": 12}  # a reservation leaves the room be
    (accepted,) = sent(node.handle(award(offer), T0))
    assert isinstance(accepted, Accepted)
    assert accepted.room == {"VCPU": 2, "MEMORY_MB": 11}  # 7 and 3072 left
    (decline,) = sent(node.handle(a_request("r2", resources={"VCPU": 9}, probed_node="n"), T0))
    assert isinstance(decline, Decline) and decline.room == {"VCPU": 2, "MEMORY_MB": 11}
    ids = tuple(a.allocation_id for a in accepted.allocations)
    (freed,) = sent(node.handle(Free(request_id="r1", sender=REQUESTOR, reply_to=REPLY,
                                     allocation_ids=ids), T0))  # fmt: skip
    assert isinstance(freed, Freed) and freed.room == {"VCPU": 3, "MEMORY_MB": 12}


def test_a_full_node_announces_room_that_grows_but_not_room_that_shrinks() -> None:
    node = a_node(vcpus=16, memory_mb=65536)
    held = {}
    for request_id, vcpus in (("a", 8), ("b", 4), ("c", 2)):  # 14 of 16: the last tier
        offer = the_offer(node.handle(a_request(request_id, resources={"VCPU": vcpus}), T0))
        (accepted,) = sent(node.handle(award(offer), T0))
        assert isinstance(accepted, Accepted)
        held[request_id] = accepted.allocations[0].allocation_id
    assert node.tier() == 100
    offer = the_offer(node.handle(a_request("d", resources={"VCPU": 1}), T0))
    assert published(node.handle(award(offer), T0)) == []  # 2 -> 1 free: shrinks, quiet
    free = Free(request_id="c", sender=REQUESTOR, reply_to=REPLY, allocation_ids=(held["c"],))
    ((topic, status),) = published(node.handle(free, T0))  # 1 -> 3 free, still over 75 %
    assert topic == ROSTER_TOPIC and isinstance(status, NodeStatus)
    assert (status.tier, status.room["VCPU"]) == (100, 1)


def rejoin_announcements(effects: list[Effect]) -> list[NodeStatus]:
    return [
        e.message
        for e in effects
        if isinstance(e, Publish)
        and isinstance(e.message, NodeStatus)
        and e.message.rejoined_buckets
    ]


def test_an_award_keeps_when_its_placement_was_asked_for_and_already_placed_tells_it() -> None:
    node = a_node()
    offer = the_offer(node.handle(a_request(findable=True), T0))
    stamped = msgspec.structs.replace(award(offer), requested_at_s=1_700_000_042.5)
    node.handle(stamped, T0)
    (allocation,) = node.ledger.allocations.values()
    assert allocation.requested_at_s == 1_700_000_042.5
    lookup = Lookup(request_id="r1", sender="other", reply_to="other-inbox")
    (found,) = sent(node.handle(lookup, T0))
    assert isinstance(found, AlreadyPlaced)
    assert found.requested_at_s == 1_700_000_042.5


def test_a_node_back_with_stored_allocations_names_their_lookup_buckets() -> None:
    node = a_node()
    node.handle(award(the_offer(node.handle(a_request(findable=True), T0))), T0)
    restarted = NodeMachine(node.config, list(node.ledger.allocations.values()))
    effects = restarted.start(T0)
    (announced,) = rejoin_announcements(effects)
    assert list(buckets_in(announced.rejoined_buckets)) == [lookup_bucket("r1")]
    # bound before it is announced, so the lookups it draws reach it
    bind = effects.index(Bind(lookup_topic("r1")))
    announce = next(i for i, e in enumerate(effects) if getattr(e, "message", None) is announced)
    assert bind < announce


def test_a_node_holding_no_caller_chosen_id_announces_a_plain_status_when_back() -> None:
    node = a_node()
    node.handle(award(the_offer(node.handle(a_request(), T0))), T0)  # a generated id
    ((topic, status),) = published(node.rejoined(T0 + 1))
    assert topic == ROSTER_TOPIC
    assert isinstance(status, NodeStatus) and status.rejoined_buckets == b""


def test_a_node_back_on_the_broker_names_the_buckets_of_what_it_allocated() -> None:
    node = a_node()
    node.handle(award(the_offer(node.handle(a_request(findable=True), T0))), T0)
    node.handle(a_request("r2", findable=True), T0)  # only reserved: nothing to reconcile
    (announced,) = rejoin_announcements(node.rejoined(T0 + 1))
    assert list(buckets_in(announced.rejoined_buckets)) == [lookup_bucket("r1")]


def test_a_stopped_node_announces_nothing_when_its_connection_comes_back() -> None:
    node = a_node()
    node.handle(award(the_offer(node.handle(a_request(findable=True), T0))), T0)
    node.stop(T0)
    assert node.rejoined(T0 + 1) == []


def test_the_bucket_bitmap_holds_exactly_the_buckets_given() -> None:
    buckets = [0, 7, 8, 4242, LOOKUP_BUCKETS - 1]
    bitmap = bucket_bitmap(buckets)
    assert len(bitmap) == LOOKUP_BUCKETS // 8
    assert list(buckets_in(bitmap)) == buckets


def a_node_restarted_smaller(vcpus: int, held: list[int]) -> NodeMachine:
    """A node whose stored allocations (``held`` VCPU each, 1024 MB) were made when it had
    more VCPUs than ``vcpus``, its inventory now."""
    allocations = [
        Allocation(
            allocation_id=f"a{i}",
            request_id=f"old-{i}",
            reservation_id=f"res-{i}",
            owner=REQUESTOR,
            resources={"VCPU": amount, "MEMORY_MB": 1024},
        )
        for i, amount in enumerate(held)
    ]
    config = NodeConfig(
        name="node-a",
        address="reservoir.node.node-a",
        inventories={"VCPU": Inventory(total=vcpus), "MEMORY_MB": Inventory(total=16384)},
    )
    node = NodeMachine(config, allocations)
    node.start(T0)
    return node


def test_a_node_holding_more_than_its_new_inventory_refuses_new_requests_until_it_fits() -> None:
    node = a_node_restarted_smaller(vcpus=2, held=[8, 3])
    assert node.overcommitted() == ["VCPU: allocated 11 + reserved 0 > capacity 2"]
    # memory would fit, and so would no VCPU at all: it still takes nothing new
    assert sent(node.handle(a_request("m", resources={"MEMORY_MB": 512}), T0)) == []
    (decline,) = sent(node.handle(a_request("e", resources={"MEMORY_MB": 512}, explain=True), T0))
    assert isinstance(decline, Decline)
    assert [r.code for r in decline.reasons] == ["overcommitted"]
    assert node.ledger.reservations == {}
    assert node.counters["refused_overcommitted"] == 2
    # freed below capacity (the 8 VCPU one), it takes requests again
    node.free_local(["a0"])
    assert node.overcommitted() == ["VCPU: allocated 3 + reserved 0 > capacity 2"]
    node.free_local(["a1"])
    assert node.overcommitted() == []
    offer = the_offer(node.handle(a_request("m2", resources={"MEMORY_MB": 512}), T0))
    node.handle(award(offer), T0)
    assert audit([NodeSnapshot.of(node.name, node.ledger, T0, node.tier())]).ok


def test_an_offer_that_reaches_no_requestor_releases_its_reservation_at_once() -> None:
    # A retry of a placed id: the requestor found the placement on another node and exited
    # before this node's offer came; its inbox is gone and the offer comes back.
    node = a_node()
    offer = the_offer(node.handle(a_request("rr-2"), T0))
    assert node.ledger.usage("VCPU").reserved == 2
    effects = node.on_unroutable(offer, T0 + 0.01)
    assert node.ledger.reservations == {}
    assert node.ledger.usage("VCPU").reserved == 0
    assert node.counters["released"] == 1
    assert [e.reason for e in effects if isinstance(e, Dropped)] == ["returned"]
    assert audit([NodeSnapshot.of(node.name, node.ledger, T0, node.tier())]).ok
