"""A requestor killed mid-conversation (SIGKILL: no releases, no goodbye), and the same
request id asked for again through a new requestor, as an API client retries with its
idempotency key after its server died. Found by ``reservoir chaos``: the new requestor
stood back for the dead one and then failed the request (and once left the dead one's
allocation an orphan)."""

from __future__ import annotations

from collections.abc import Callable

import prometheus_client
import pytest

from reservoir.broker import Delivery
from reservoir.brokers.inprocess import Faults
from reservoir.protocol.placement import PlacementError
from reservoir.runtime.requestor import Requestor
from reservoir.runtime.store import MemoryStore
from reservoir.testing.simulation import Simulation


def kill(requestor: Requestor) -> None:
    """What SIGKILL leaves: the requestor's inbox gone, nothing sent on its way out."""
    with requestor._lock:
        requestor._closed = True
        requestor._cancel_all_timers()
    requestor.endpoint.close()


def held_anywhere(sim: Simulation, request_id: str, what: str) -> Callable[[], bool]:
    def holds() -> bool:
        for snapshot in sim.snapshots():
            items = snapshot.reservations if what == "reservation" else snapshot.allocations
            if any(item.request_id == request_id for item in items):
                return True
        return False

    return holds


@pytest.mark.parametrize("nodes", [6, 30])
@pytest.mark.parametrize("dies_holding", ["reservation", "allocation"])
def test_a_request_asked_again_after_its_requestor_died_is_placed_exactly_once(
    dies_holding: str, nodes: int
) -> None:
    sim = Simulation()
    sim.add_nodes(nodes, vcpus=16, memory_mb=32768)
    first = sim.add_requestor("worker.1")
    first.submit(request_id="job-7", vcpus=1, memory_mb=512, timeout_s=30)
    assert sim.scheduler.run_until(held_anywhere(sim, "job-7", dies_holding), timeout_s=10)
    kill(first)
    # The restarted process: a new requestor whose name sorts after the dead one's.
    second = sim.add_requestor("worker.2")
    placement = sim.place(second, request_id="job-7", vcpus=1, memory_mb=512, timeout_s=30)
    assert placement.request_id == "job-7"
    assert len(placement.allocations) == 1
    sim.finish([placement], allow_orphans=False)


def awards_of(requestor: str) -> Callable[[Delivery], bool]:
    def is_its_award(delivery: Delivery) -> bool:
        return b'"kind":"award"' in delivery.body and f'"sender":"{requestor}"'.encode() in (
            delivery.body
        )

    return is_its_award


def test_an_outage_fails_no_request_and_the_dead_ones_late_award_is_adopted() -> None:
    """What the chaos run's orphan was: the killed requestor's award sat in a stalled
    network and landed after its successor had asked again; the successor heard of the
    dead one's reservation, then the network went down, and it failed the request from
    rounds no node answered, leaving the allocation the late award made to nobody."""
    sim = Simulation()
    sim.add_nodes(3, vcpus=16, memory_mb=32768)
    first = sim.add_requestor("worker.1")
    sim.broker.faults = Faults(delay_s=(2.0, 2.0), applies_to=awards_of("worker.1"))
    first.submit(request_id="job-7", vcpus=1, memory_mb=512, timeout_s=30)
    assert sim.scheduler.run_until(lambda: first.metrics.get("sent", "award") == 1, timeout_s=10)
    kill(first)
    second = sim.add_requestor("worker.2")
    again = second.submit(request_id="job-7", vcpus=1, memory_mb=512, timeout_s=30)
    # The stalled award lands: the dead one's reservation becomes its allocation.
    assert sim.scheduler.run_until(held_anywhere(sim, "job-7", "allocation"), timeout_s=5)
    (late,) = [a for s in sim.snapshots() for a in s.allocations]
    assert late.owner == "worker.1"
    # Then nothing gets through, for longer than any reservation of the id could live.
    sim.broker.faults = Faults(loss=1.0)
    sim.advance(15.0)
    assert not again.done(), "a verdict from rounds that no node answered"
    sim.broker.faults = None
    assert sim.run_until_done([again])
    placement = again.result(timeout=0)
    assert [a.allocation_id for a in placement.allocations] == [late.allocation_id]
    sim.finish([placement], allow_orphans=False)


def test_the_same_request_id_with_another_shape_is_refused_and_the_first_placement_kept() -> None:
    sim = Simulation()
    sim.add_nodes(3, vcpus=16, memory_mb=32768)
    first = sim.add_requestor("api-1")
    placed = sim.place(first, request_id="order-1", vcpus=1, memory_mb=512, timeout_s=30)
    # the same key and shape again: the same placement, from memory and through another
    # requestor (the nodes answer for it)
    again = sim.place(first, request_id="order-1", vcpus=1, memory_mb=512, timeout_s=30)
    assert again == placed
    other = sim.add_requestor("api-2")
    elsewhere = sim.place(other, request_id="order-1", vcpus=1, memory_mb=512, timeout_s=30)
    assert elsewhere.allocations == placed.allocations
    for requestor in (first, other):
        with pytest.raises(PlacementError, match="already placed with another shape"):
            sim.place(requestor, request_id="order-1", vcpus=8, memory_mb=512, timeout_s=30)
    sim.finish([placed], allow_orphans=False)


def durable_nodes(sim: Simulation, count: int = 6) -> dict[str, MemoryStore]:
    """Nodes whose ledgers outlive them, as a node's SQLite file does."""
    stores = {f"node-{i}": MemoryStore() for i in range(count)}
    for name, store in stores.items():
        sim.add_node(name, vcpus=16, memory_mb=32768, store=store)
    return stores


def placed_by_a_requestor_now_dead(sim: Simulation, request_id: str) -> str:
    """A requestor's award became an allocation, and then it was killed: the holder."""
    first = sim.add_requestor("worker.1")
    first.submit(request_id=request_id, vcpus=1, memory_mb=512, timeout_s=30)
    assert sim.scheduler.run_until(held_anywhere(sim, request_id, "allocation"), timeout_s=10)
    kill(first)
    # the retry comes later (the chaos run's, 1.8 s): what tells the two placements apart
    sim.advance(1.0)
    (holder,) = [s.name for s in sim.snapshots() for _allocation in s.allocations]
    return holder


def away(sim: Simulation, node: str) -> None:
    """It hears nothing, and what it holds stays stored."""
    sim.nodes.pop(node).close()


def back(sim: Simulation, node: str, stores: dict[str, MemoryStore]) -> None:
    sim.add_node(node, vcpus=16, memory_mb=32768, store=stores[node])


def test_a_retry_while_the_holder_is_away_leaves_one_placement_once_it_is_back() -> None:
    """What the full chaos run (seed 7) found: the dead requestor's award had become an
    allocation on a node that was reconnecting after a cut (its inbox and bindings gone
    with its connection) when the successor looked the id up, so the successor placed it
    again elsewhere. Here the holder is away by stopping it, and comes back with its
    store, as a restarted node comes back with its ledger (a reconnect is the RabbitMQ
    test's). Back, it names the buckets of what it holds; the successor looks job-7 up
    again and frees the earlier placement, asked for before its own."""
    sim = Simulation()
    stores = durable_nodes(sim)
    holder = placed_by_a_requestor_now_dead(sim, "job-7")
    away(sim, holder)
    second = sim.add_requestor("worker.2")
    placement = sim.place(second, request_id="job-7", vcpus=1, memory_mb=512, timeout_s=30)
    assert holder not in placement.nodes
    assert [a.request_id for a in stores[holder].load()] == ["job-7"]  # placed twice now
    back(sim, holder, stores)
    sim.advance(5.0)
    assert second.machine.counters["superseded_frees"] == 1
    assert second.metrics.registry is not None
    exposition = prometheus_client.generate_latest(second.metrics.registry).decode()
    assert (
        'reservoir_requestor_reconciliations_total{kind="superseded_frees",'
        'participant="worker.2"} 1.0' in exposition
    )
    sim.finish([placement], allow_orphans=False)
    held = [s.name for s in sim.snapshots() for a in s.allocations if a.request_id == "job-7"]
    assert held == list(placement.nodes)


def test_an_earlier_placement_back_after_the_later_one_was_freed_is_freed_too() -> None:
    """What the next full chaos run (seed 7) found: the successor placed the id again,
    and its caller had freed that placement before the holder of the dead one's
    allocation was back. Nothing held the id by then, so the earlier allocation is an
    orphan: the successor remembers when its placement was asked for, freed or not."""
    sim = Simulation()
    stores = durable_nodes(sim)
    holder = placed_by_a_requestor_now_dead(sim, "job-7")
    away(sim, holder)
    second = sim.add_requestor("worker.2")
    placement = sim.place(second, request_id="job-7", vcpus=1, memory_mb=512, timeout_s=30)
    assert sim.run_until_done([second.release_future(placement)])
    back(sim, holder, stores)
    sim.advance(5.0)
    assert second.machine.counters["superseded_frees"] == 1
    sim.finish([], allow_orphans=False)
    assert stores[holder].load() == []


def test_a_requestor_whose_placement_was_superseded_answers_a_retry_with_the_later_one() -> None:
    """The same, with the first requestor alive: it hears of the later placement when the
    holder is back, leaves it alone, and forgets its own, so a retry through it looks the
    id up and adopts the one that stands."""
    sim = Simulation()
    stores = durable_nodes(sim)
    first = sim.add_requestor("worker.1")
    earlier = sim.place(first, request_id="job-7", vcpus=1, memory_mb=512, timeout_s=30)
    (holder,) = earlier.nodes
    away(sim, holder)
    sim.advance(1.0)  # the retry comes later
    second = sim.add_requestor("worker.2")
    later = sim.place(second, request_id="job-7", vcpus=1, memory_mb=512, timeout_s=30)
    back(sim, holder, stores)
    sim.advance(5.0)
    assert first.machine.counters["superseded_placements"] == 1
    assert first.machine.counters["superseded_frees"] == 0
    assert second.machine.counters["superseded_frees"] == 1
    again = sim.place(first, request_id="job-7", vcpus=1, memory_mb=512, timeout_s=30)
    assert again.allocations == later.allocations
    sim.finish([later], allow_orphans=False)
