"""Whole conversations through the real runtime (NodeAgent, Requestor, in-process broker)
on a virtual clock: what happens when messages go missing, nodes stop, tiers fill up.

Each test's simulation ends with the invariant audit (the ``reservoir_simulation`` fixture
settles the run and fails the test if an invariant is broken).
"""

from __future__ import annotations

import itertools

import pytest

from reservoir import FreeIncomplete, Inventory, PlacementError, PlacementTimeout
from reservoir.broker import Delivery
from reservoir.brokers.inprocess import Faults
from reservoir.protocol.messages import ReservationRequest, encode_message
from reservoir.testing import Simulation


def test_a_reservation_nobody_claims_expires_at_its_ttl(reservoir_simulation: Simulation) -> None:
    sim = reservoir_simulation
    node = sim.add_node("n1", vcpus=4)
    silent = sim.broker.open_endpoint(lambda delivery: None, name="silent-requestor")
    request = ReservationRequest(
        request_id="r1", sender="silent", reply_to=silent.address,
        resources={"VCPU": 2}, tier=10, attempt=1, ttl_s=5.0,
    )  # fmt: skip
    silent.publish("tier.10", encode_message(request))
    sim.scheduler.run_until_idle()
    assert len(node.snapshot().reservations) == 1
    sim.advance(4.999)
    assert len(node.snapshot().reservations) == 1
    sim.advance(0.001)
    assert node.snapshot().reservations == ()
    silent.close()


def test_a_lost_award_is_sent_again_and_the_request_is_placed_once(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    awards = itertools.count()

    def first_award_only(delivery: Delivery) -> bool:
        return b'"kind":"award"' in delivery.body and next(awards) == 0

    sim.broker.faults = Faults(loss=1.0, applies_to=first_award_only)
    sim.add_nodes(3, vcpus=8)
    requestor = sim.add_requestor()
    placement = sim.place(requestor, vcpus=2)
    assert len(placement.allocations) == 1
    assert requestor.metrics.get("sent", "award") == 2
    sim.finish([placement])


def test_a_lost_acceptance_is_recovered_by_the_resent_award(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.broker.faults = Faults(loss=1.0, applies_to=lambda d: b'"kind":"accepted"' in d.body)
    sim.add_node("n1", vcpus=8)
    requestor = sim.add_requestor()
    future = requestor.submit(vcpus=2, timeout_s=3.0)
    sim.advance(1.2)
    sim.broker.faults = None  # the network heals: the next re-sent award is answered
    assert sim.run_until_done([future])
    placement = future.result(timeout=0)
    assert len(sim.nodes["n1"].allocations()) == 1
    sim.finish([placement])


def test_requests_widen_past_full_tiers_at_once(reservoir_simulation: Simulation) -> None:
    sim = reservoir_simulation
    busy = sim.add_node("busy", vcpus=10)
    sim.add_node("idle", vcpus=10)
    requestor = sim.add_requestor()
    sim.place(requestor, vcpus=6, request_id="fill")  # lands somewhere: 60 %
    filled = [n for n in sim.nodes.values() if n.allocations()]
    assert len(filled) == 1
    started = sim.scheduler.clock.now()
    big = sim.place(requestor, vcpus=6)
    assert big.nodes != (filled[0].name,)
    assert sim.scheduler.clock.now() - started < 0.1  # no two-second waits on the way
    assert busy.tier() in (10, 75)
    sim.finish()


def test_a_request_nothing_can_take_fails_with_the_tiers_and_reasons(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.add_nodes(4, vcpus=8, traits=["HW_CPU_X86_AVX2"])
    requestor = sim.add_requestor()
    with pytest.raises(PlacementError) as failed:
        sim.place(requestor, vcpus=2, required_traits=["HW_GPU"], explain=True)
    explanation = failed.value.explanation
    assert explanation.tiers_tried == (10, 25, 50, 75, 100)
    assert explanation.reasons == {"trait HW_GPU missing": 4}
    assert "trait HW_GPU missing on 4 node(s)" in str(failed.value)


def test_tiers_tried_are_reported_in_the_ladders_order_after_a_probe_of_a_fuller_tier(
    reservoir_simulation: Simulation,
) -> None:
    # Nodes filled to different tiers: the requestor's first probes sample nodes up to the
    # 50 % tier, before the broadcasts widen from 10 %. The report is the tiers asked, in
    # the order a request widens, not in the order they were first reached.
    sim = reservoir_simulation
    sim.add_nodes(6, vcpus=8, memory_mb=16384)
    requestor = sim.add_requestor()
    placed = [sim.place(requestor, vcpus=size, memory_mb=256) for size in (1, 3, 5, 7, 8)]
    with pytest.raises(PlacementError) as failed:
        sim.place(requestor, vcpus=6, memory_mb=256, count=3)
    explanation = failed.value.explanation
    assert explanation.tiers_tried == (10, 25, 50, 75, 100)
    assert "tiers tried: 10%, 25%, 50%, 75%, 100%" in str(explanation)
    sim.finish(placed)


def test_a_multi_instance_request_spreads_over_nodes(reservoir_simulation: Simulation) -> None:
    sim = reservoir_simulation
    sim.add_nodes(4, vcpus=16)
    requestor = sim.add_requestor()
    placement = sim.place(requestor, vcpus=2, count=4)
    assert sorted(placement.nodes) == [f"node-{i}" for i in range(4)]
    sim.finish([placement])


def test_a_multi_instance_request_that_cannot_all_fit_takes_nothing(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.add_nodes(2, vcpus=4)
    requestor = sim.add_requestor()
    with pytest.raises(PlacementError):
        sim.place(requestor, vcpus=4, count=3)
    sim.settle()
    assert all(not n.allocations() for n in sim.nodes.values())
    assert all(n.snapshot().reservations == () for n in sim.nodes.values())


def test_a_stopping_node_withdraws_its_offer_and_the_request_goes_elsewhere(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.broker.faults = Faults(delay_s=(0.01, 0.01))
    leaving = sim.add_node("leaving", vcpus=8, inventories={"MEMORY_MB": 1})
    sim.add_node("staying", vcpus=8)
    requestor = sim.add_requestor()
    future = requestor.submit(vcpus=2)
    sim.advance(0.015)  # both have reserved and offered
    leaving.close()
    del sim.nodes["leaving"]
    assert sim.run_until_done([future])
    assert future.result(timeout=0).nodes == ("staying",)


def test_releasing_a_placement_frees_the_allocation_and_lowers_the_tier(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    node = sim.add_node("n1", vcpus=10)
    requestor = sim.add_requestor()
    placement = sim.place(requestor, vcpus=8)
    assert node.tier() == 100
    released = requestor.release_future(placement)
    assert sim.run_until_done([released])
    released.result(timeout=0)
    assert node.allocations() == []
    assert node.tier() == 10


def test_a_timeout_fails_the_request_and_frees_what_it_held(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    # every acceptance is lost: the requestor can never know it was placed
    sim.broker.faults = Faults(loss=1.0, applies_to=lambda d: b'"kind":"accepted"' in d.body)
    node = sim.add_node("n1", vcpus=8)
    requestor = sim.add_requestor()
    with pytest.raises(PlacementTimeout):
        sim.place(requestor, vcpus=2, timeout_s=1.0)
    sim.broker.faults = None
    sim.settle()
    assert node.allocations() == []  # the node allocated, then the requestor's free came


def test_closing_a_requestor_fails_what_is_in_flight(reservoir_simulation: Simulation) -> None:
    sim = reservoir_simulation
    sim.broker.faults = Faults(delay_s=(0.5, 0.5))
    sim.add_node("n1", vcpus=8)
    requestor = sim.add_requestor()
    future = requestor.submit(vcpus=2)
    sim.advance(0.6)
    requestor.close()
    sim.settle()
    with pytest.raises(Exception, match="closed"):
        future.result(timeout=0)


def test_nodes_keep_to_their_inventory_rules(reservoir_simulation: Simulation) -> None:
    sim = reservoir_simulation
    sim.add_node(
        "n1",
        inventories={
            "VCPU": Inventory(total=4, allocation_ratio=4.0),
            "MEMORY_MB": Inventory(total=8192, reserved=2048, step_size=256),
        },
    )
    requestor = sim.add_requestor()
    placements = [sim.place(requestor, vcpus=1, memory_mb=256) for _ in range(16)]
    with pytest.raises(PlacementError):
        sim.place(requestor, vcpus=1, memory_mb=256)  # 16 VCPU = 4 x 4.0: full
    with pytest.raises(PlacementError):
        sim.place(requestor, vcpus=0, memory_mb=300, explain=True)  # not a step of 256
    sim.finish(placements)


def is_a_free(delivery: Delivery) -> bool:
    return b'"kind":"free"' in delivery.body


def test_a_free_lost_for_longer_than_its_attempts_still_frees_the_instance_later(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    node = sim.add_node("n1", vcpus=4)
    requestor = sim.add_requestor()
    placement = sim.place(requestor, vcpus=2)
    # Every Free is lost for a minute: far longer than the caller waits for one.
    sim.broker.faults = Faults(loss=1.0, applies_to=is_a_free)
    release = requestor.release_future(placement)
    sim.advance(10.0)
    assert isinstance(release.exception(timeout=0), FreeIncomplete)  # the caller hears of it
    sim.advance(50.0)
    assert len(node.snapshot().allocations) == 1
    sim.broker.faults = None
    sim.advance(30.0)  # the longest wait between two tries
    assert node.snapshot().allocations == ()  # nothing is left behind on the node
