"""Replicas of the ``reservoir serve`` app: two apps (two processes' worth: a requestor
each) on one in-process broker in front of the same node agents, driven through httpx's
ASGI transport. ``GET`` and ``DELETE`` are answered from the nodes, so either replica
answers for a placement the other made, and so does a replica started afresh; each test
ends with the invariant audit over the nodes' ledgers."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from reservoir import NodeAgent, audit
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.runtime.auditor import read_placements
from reservoir.service import ReservoirService, create_app
from reservoir.testing import InProcessCluster
from reservoir.testing.asgi import serving

PROBLEM_JSON = "application/problem+json"
SHAPE = {"vcpus": 2, "memory_mb": 1024}

Client = httpx.AsyncClient


@pytest.fixture
def nodes(reservoir_cluster: InProcessCluster) -> list[NodeAgent]:
    return reservoir_cluster.add_nodes(3, "replica", vcpus=16, memory_mb=32768)


def audited(nodes: list[NodeAgent], bodies: list[dict[str, Any]]) -> None:
    """The invariant audit, against the placements clients were answered with."""
    import json

    placements = read_placements(json.dumps(body) for body in bodies)
    audit([n.snapshot() for n in nodes], placements).raise_if_failed()


def held(nodes: list[NodeAgent]) -> int:
    return sum(len(n.allocations()) for n in nodes)


def two_replicas(
    broker: InProcessBroker, scenario: Callable[[Client, Client], Awaitable[Any]]
) -> Any:
    async def main() -> Any:
        async with serving(create_app(broker)) as a, serving(create_app(broker)) as b:
            return await scenario(a, b)

    return asyncio.run(main())


def allocations(body: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted((a["node"], a["allocation_id"]) for a in body["allocations"])


def test_a_placement_made_on_one_replica_is_read_and_released_on_the_other(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    async def scenario(a: Client, b: Client) -> None:
        # no Idempotency-Key: the id is generated, and still findable
        created = await a.post("/v1/reservations", json={**SHAPE, "count": 2})
        assert created.status_code == 201, created.text
        placed = created.json()
        request_id = placed["request_id"]

        read = await b.get(f"/v1/reservations/{request_id}")
        assert read.status_code == 200, read.text
        assert allocations(read.json()) == allocations(placed)
        assert read.json()["requested"] == 2 and read.json()["partial"] is False
        # the replica that placed it answers with its own placement, confirmed
        assert (await a.get(f"/v1/reservations/{request_id}")).json() == placed

        released = await b.delete(f"/v1/reservations/{request_id}")
        assert released.status_code == 204, released.text
        assert held(nodes) == 0
        for replica in (a, b):
            gone = await replica.get(f"/v1/reservations/{request_id}")
            assert gone.status_code == 404
            assert gone.headers["content-type"] == PROBLEM_JSON
            assert "no node holds" in gone.json()["detail"]
        again = await a.delete(f"/v1/reservations/{request_id}")
        assert again.status_code == 404

    two_replicas(broker, scenario)
    audited(nodes, [])


def test_an_idempotent_post_retried_on_the_other_replica_returns_the_same_placement(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    async def scenario(a: Client, b: Client) -> list[dict[str, Any]]:
        key = {"Idempotency-Key": "order-1"}
        first = await a.post("/v1/reservations", json=SHAPE, headers=key)
        assert first.status_code == 201, first.text
        retried = await b.post("/v1/reservations", json=SHAPE, headers=key)
        # found on the nodes by B's lookup: B had not answered for the key yet
        assert retried.status_code == 201, retried.text
        assert allocations(retried.json()) == allocations(first.json())
        # and again on each: now both have answered for it
        for replica in (a, b):
            replay = await replica.post("/v1/reservations", json=SHAPE, headers=key)
            assert replay.status_code == 200, replay.text
            assert allocations(replay.json()) == allocations(first.json())
        assert held(nodes) == 1
        return [first.json()]

    audited(nodes, two_replicas(broker, scenario))


def test_a_key_released_on_the_other_replica_is_placed_anew_not_replayed_from_memory(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    async def scenario(a: Client, b: Client) -> list[dict[str, Any]]:
        key = {"Idempotency-Key": "order-2"}
        first = await a.post("/v1/reservations", json=SHAPE, headers=key)
        assert first.status_code == 201, first.text
        assert (await b.delete("/v1/reservations/order-2")).status_code == 204
        assert held(nodes) == 0
        # A remembers answering for the key; the nodes say it is gone: placed anew
        renewed = await a.post("/v1/reservations", json=SHAPE, headers=key)
        assert renewed.status_code == 201, renewed.text
        assert held(nodes) == 1
        assert (await b.delete("/v1/reservations/order-2")).status_code == 204
        # and the key is free again on A for another body, though A saw the first one
        other = await a.post("/v1/reservations", json={**SHAPE, "vcpus": 4}, headers=key)
        assert other.status_code == 201, other.text
        return [other.json()]

    audited(nodes, two_replicas(broker, scenario))


def test_another_body_under_a_key_is_a_422_on_its_replica_and_a_409_on_another(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    """What the per-process check covers across replicas: the replica that answered for a
    key tells another body apart (422); another replica knows no body, and the nodes
    refuse another *shape* under a placed key (409); the same shape with other fields
    (traits, say) is not told apart there."""

    async def scenario(a: Client, b: Client) -> list[dict[str, Any]]:
        key = {"Idempotency-Key": "order-3"}
        first = await a.post("/v1/reservations", json=SHAPE, headers=key)
        assert first.status_code == 201, first.text
        bigger = {**SHAPE, "vcpus": 8}
        on_a = await a.post("/v1/reservations", json=bigger, headers=key)
        assert on_a.status_code == 422
        assert "different body" in on_a.json()["detail"]
        on_b = await b.post("/v1/reservations", json=bigger, headers=key)
        assert on_b.status_code == 409, on_b.text
        assert on_b.headers["content-type"] == PROBLEM_JSON
        assert "another shape" in on_b.json()["detail"]
        assert held(nodes) == 1
        return [first.json()]

    audited(nodes, two_replicas(broker, scenario))


def test_a_replica_started_afresh_reads_and_releases_what_the_nodes_hold(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    async def place() -> dict[str, Any]:
        async with serving(create_app(broker)) as client:
            created = await client.post("/v1/reservations", json={**SHAPE, "count": 3})
            assert created.status_code == 201, created.text
            body: dict[str, Any] = created.json()
            return body

    placed = asyncio.run(place())  # that replica is gone: its requestor closed

    async def restarted() -> None:
        async with serving(create_app(broker)) as client:
            read = await client.get(f"/v1/reservations/{placed['request_id']}")
            assert read.status_code == 200, read.text
            assert allocations(read.json()) == allocations(placed)
            audited(nodes, [placed])
            released = await client.delete(f"/v1/reservations/{placed['request_id']}")
            assert released.status_code == 204, released.text

    asyncio.run(restarted())
    assert held(nodes) == 0
    audited(nodes, [])


async def deleted(client: Client, path: str) -> httpx.Response:
    """A DELETE, asked again while the answer is 503 "not known yet", as a client told to
    retry does (sooner than its Retry-After, to keep the test short): a busy machine may
    keep a holder's answer past the lookup's deadline, and 503 is then the right answer."""
    for _ in range(20):
        answer = await client.delete(path)
        if answer.status_code != 503:
            return answer
        assert "Retry-After" in answer.headers
        await asyncio.sleep(0.1)
    return answer


def test_deletes_of_one_id_at_once_on_both_replicas_all_succeed_and_free_it_once(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    async def scenario(a: Client, b: Client) -> None:
        created = await a.post("/v1/reservations", json={**SHAPE, "count": 2})
        request_id = created.json()["request_id"]
        answers = await asyncio.gather(
            *(deleted(r, f"/v1/reservations/{request_id}") for r in (a, a, b, b))
        )
        # each holder frees what it holds once; a second Free finds nothing left there
        assert {x.status_code for x in answers} <= {204, 404}, [x.text for x in answers]
        assert answers[0].status_code == answers[1].status_code == 204  # joined on A
        assert held(nodes) == 0

    two_replicas(broker, scenario)
    audited(nodes, [])


def test_a_bad_id_is_a_422_naming_the_path_and_a_down_broker_a_503(
    nodes: list[NodeAgent],
) -> None:
    class FlakyBroker(InProcessBroker):
        connected = True

    broker = FlakyBroker()
    node = NodeAgent(broker, name="replica-flaky", vcpus=4, memory_mb=4096)
    app = create_app(broker)

    async def main() -> None:
        async with serving(app) as client:
            for method in ("GET", "DELETE"):
                bad = await client.request(method, "/v1/reservations/not@all%20right")
                assert bad.status_code == 422, bad.text
                assert bad.headers["content-type"] == PROBLEM_JSON
                assert bad.json()["errors"][0]["field"] == "path.request_id"
            broker.connected = False
            for method in ("GET", "DELETE"):
                down = await client.request(method, "/v1/reservations/order-9")
                assert down.status_code == 503
                assert down.headers["content-type"] == PROBLEM_JSON
            broker.connected = True
            service = app.state.reservoir
            assert isinstance(service, ReservoirService)
            assert service.requestor.metrics.get("sent", "lookup") == 0

    try:
        asyncio.run(main())
        audit([node.snapshot()], []).raise_if_failed()
    finally:
        node.close()
        broker.close()
    audited(nodes, [])


def lookups_sent(app: Any) -> int:
    """Lookups the replica's requestor (and its finder, which counts in the same
    metrics) has sent."""
    service = app.state.reservoir
    assert isinstance(service, ReservoirService)
    return int(service.requestor.metrics.get("sent", "lookup"))


def test_a_delete_on_the_replica_that_placed_frees_it_with_no_lookup(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker)

    async def main() -> None:
        async with serving(app) as a:
            created = await a.post("/v1/reservations", json={**SHAPE, "count": 2})
            request_id = created.json()["request_id"]
            assert (await a.get(f"/v1/reservations/{request_id}")).status_code == 200
            before = lookups_sent(app)
            assert before == 1  # the GET's: the counter counts what a find sends
            assert (await a.delete(f"/v1/reservations/{request_id}")).status_code == 204
            assert lookups_sent(app) == before  # it knew what it placed: freed at once
            assert held(nodes) == 0
            # a second DELETE, nothing held now, is a 404 from the nodes
            assert (await a.delete(f"/v1/reservations/{request_id}")).status_code == 404

    asyncio.run(main())
    audited(nodes, [])


def test_a_delete_of_what_another_replica_released_is_a_404_not_a_204(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    async def scenario(a: Client, b: Client) -> None:
        key = {"Idempotency-Key": "stale-1"}
        created = await a.post("/v1/reservations", json=SHAPE, headers=key)
        assert created.status_code == 201
        assert (await b.delete("/v1/reservations/stale-1")).status_code == 204
        # A still remembers it; the nodes freed nothing of it for A
        gone = await a.delete("/v1/reservations/stale-1")
        assert gone.status_code == 404, gone.text
        assert held(nodes) == 0

    two_replicas(broker, scenario)
    audited(nodes, [])
