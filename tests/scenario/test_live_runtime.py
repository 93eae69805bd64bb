"""The embedded library in real time: many threads and an asyncio loop share one Requestor
over the in-process broker; every test audits the nodes afterwards."""

from __future__ import annotations

import asyncio
import threading

import pytest

from reservoir import NodeAgent, Placement, PlacementError, Requestor, audit
from reservoir.brokers.inprocess import Faults, InProcessBroker
from reservoir.testing import InProcessCluster


@pytest.fixture
def cluster(reservoir_cluster: InProcessCluster) -> tuple[InProcessBroker, list[NodeAgent]]:
    nodes = reservoir_cluster.add_nodes(6, "live", vcpus=16, memory_mb=32768)
    return reservoir_cluster.broker, nodes


def audited(nodes: list[NodeAgent], placements: list[Placement]) -> None:
    report = audit([n.snapshot() for n in nodes], placements)
    report.raise_if_failed(allow_orphans=False)


def test_many_threads_share_one_requestor(
    cluster: tuple[InProcessBroker, list[NodeAgent]],
) -> None:
    broker, nodes = cluster
    placements: list[Placement] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    with Requestor(broker) as requestor:

        def place_some() -> None:
            for _ in range(10):
                try:
                    placement = requestor.reserve(vcpus=1, memory_mb=512, timeout_s=10)
                except BaseException as error:
                    errors.append(error)
                else:
                    with lock:
                        placements.append(placement)

        threads = [threading.Thread(target=place_some) for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert errors == []
        assert len(placements) == 80
        assert len({p.request_id for p in placements}) == 80
        audited(nodes, placements)


def test_reserve_async_never_blocks_the_event_loop() -> None:
    # Every delivery takes 20 ms, so the 30 placements take a few tenths of a second in
    # all: a loop left free ticks thousands of times meanwhile, one blocked by each call
    # ticks once between calls (about 30). Without the delay, placements finish so fast
    # that a busy machine gives the ticker fewer than 30 turns either way.
    broker = InProcessBroker(faults=Faults(delay_s=(0.02, 0.02)))
    nodes = [NodeAgent(broker, name=f"live-{i}", vcpus=16, memory_mb=32768) for i in range(6)]

    async def main() -> tuple[list[Placement], int]:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        async with Requestor(broker) as requestor:
            beat = asyncio.create_task(ticker())
            placements = await asyncio.gather(
                *(requestor.reserve_async(vcpus=1, memory_mb=256) for _ in range(30))
            )
            stop.set()
            await beat
        return list(placements), ticks

    try:
        placements, ticks = asyncio.run(main())
        assert len(placements) == 30
        assert ticks > 300  # the loop kept running while the placements were under way
        audited(nodes, placements)
    finally:
        for node in nodes:
            node.close()
        broker.close()


def test_a_retry_with_the_same_request_id_returns_the_same_placement(
    cluster: tuple[InProcessBroker, list[NodeAgent]],
) -> None:
    broker, nodes = cluster
    with Requestor(broker) as first:
        placement = first.reserve(vcpus=2, request_id="order-42")
        assert first.reserve(vcpus=2, request_id="order-42") == placement
    with Requestor(broker) as restarted:  # a new requestor knows nothing of it
        again = restarted.reserve(vcpus=2, request_id="order-42")
    assert again.allocations == placement.allocations
    audited(nodes, [placement])


def test_concurrent_calls_with_one_request_id_share_one_placement(
    cluster: tuple[InProcessBroker, list[NodeAgent]],
) -> None:
    broker, nodes = cluster
    with Requestor(broker) as requestor:
        futures = [requestor.submit(vcpus=1, request_id="same") for _ in range(10)]
        placements = [f.result(timeout=10) for f in futures]
    assert all(p.allocations == placements[0].allocations for p in placements)
    assert sum(len(n.allocations()) for n in nodes) == 1
    audited(nodes, placements[:1])


def test_a_closed_requestor_refuses_new_work(
    cluster: tuple[InProcessBroker, list[NodeAgent]],
) -> None:
    broker, _nodes = cluster
    requestor = Requestor(broker)
    requestor.close()
    with pytest.raises(RuntimeError, match="closed"):
        requestor.reserve(vcpus=1)


def test_nothing_is_left_running_after_close() -> None:
    before = {t.name for t in threading.enumerate()}
    broker = InProcessBroker()
    with NodeAgent(broker, name="n", vcpus=2) as node, Requestor(broker) as requestor:
        placement = requestor.reserve(vcpus=1)
        with pytest.raises(PlacementError):
            requestor.reserve(vcpus=2, timeout_s=2)
        audited([node], [placement])
    broker.close()
    after = {t.name for t in threading.enumerate() if t.is_alive()}
    assert after <= before


def test_a_cancelled_waiter_does_not_stop_others_waiting_on_the_same_id(
    cluster: tuple[InProcessBroker, list[NodeAgent]],
) -> None:
    broker, nodes = cluster

    async def main() -> Placement:
        async with Requestor(broker) as requestor:
            impatient = asyncio.create_task(requestor.reserve_async(vcpus=1, request_id="x"))
            patient = asyncio.create_task(requestor.reserve_async(vcpus=1, request_id="x"))
            await asyncio.sleep(0)
            impatient.cancel()
            return await asyncio.wait_for(patient, timeout=10)

    placement = asyncio.run(main())
    audited(nodes, [placement])
