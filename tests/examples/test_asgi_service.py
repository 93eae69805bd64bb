"""The ASGI example (examples/asgi_service.py) through its HTTP API, against a live
in-process cluster: real node agents on real threads, the app's one shared Requestor, and
the invariant audit over the nodes' ledgers at the end of every test."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import httpx
import pytest
from fastapi import FastAPI

from examples.asgi_service import PlacementOut, create_app
from reservoir import NodeAgent, Placement, Requestor, RequestorClosed, Settings, audit
from reservoir.brokers.inprocess import Faults, InProcessBroker
from reservoir.service import ReservoirService
from reservoir.testing import InProcessCluster
from reservoir.testing.asgi import serving

NODE_VCPUS = 16
NODE_MEMORY_MB = 32768


@pytest.fixture
def nodes(reservoir_cluster: InProcessCluster) -> list[NodeAgent]:
    return reservoir_cluster.add_nodes(4, "api", vcpus=NODE_VCPUS, memory_mb=NODE_MEMORY_MB)


def service_of(app: FastAPI) -> ReservoirService:
    """The example's state: the lifespan helper's service, one requestor for the app."""
    service = app.state.reservoir
    assert isinstance(service, ReservoirService)
    return service


def audited(nodes: list[NodeAgent], placements: Iterable[Placement]) -> None:
    audit([n.snapshot() for n in nodes], list(placements)).raise_if_failed()


def allocation_count(nodes: list[NodeAgent]) -> int:
    return sum(len(node.allocations()) for node in nodes)


def allocated(node: NodeAgent, resource_class: str) -> int:
    return node.snapshot().usages[resource_class].allocated


def test_place_and_free(broker: InProcessBroker, nodes: list[NodeAgent]) -> None:
    app = create_app(broker)
    by_name = {node.name: node for node in nodes}

    async def scenario() -> Requestor:
        async with serving(app) as client:  # the lifespan runs: one Requestor for the app
            service = service_of(app)
            created = await client.post("/servers", json={"vcpus": 2, "memory_mb": 4096})
            assert created.status_code == 201, created.text
            body = created.json()
            [allocation] = body["allocations"]
            assert allocation["resources"] == {"VCPU": 2, "MEMORY_MB": 4096}
            assert allocated(by_name[allocation["node"]], "VCPU") == 2
            assert allocated(by_name[allocation["node"]], "MEMORY_MB") == 4096
            assert list(service.placements) == [body["request_id"]]
            audited(nodes, service.placements.values())

            freed = await client.delete(f"/servers/{body['request_id']}")
            assert freed.status_code == 204
            assert freed.content == b""
            assert allocation_count(nodes) == 0
            assert all(allocated(node, "VCPU") == 0 for node in nodes)
            assert (await client.delete(f"/servers/{body['request_id']}")).status_code == 404
            assert (await client.delete("/servers/never-placed")).status_code == 404
            health = await client.get("/healthz")
            assert health.json() == {"status": "ok", "in_flight": 0, "placements": 0}
            audited(nodes, service.placements.values())
            return service.requestor

    requestor = asyncio.run(scenario())
    with pytest.raises(RequestorClosed):  # shutdown closed the shared requestor
        requestor.reserve(vcpus=1, memory_mb=1)
    audited(nodes, [])


def test_the_disk_request_goes_to_nodes_with_disk(broker: InProcessBroker) -> None:
    nodes = [
        NodeAgent(broker, name="diskless", vcpus=8, memory_mb=8192),
        NodeAgent(broker, name="disky", vcpus=8, memory_mb=8192, disk_gb=100),
    ]
    app = create_app(broker)

    async def scenario() -> tuple[httpx.Response, list[Placement]]:
        async with serving(app) as client:
            body = {"vcpus": 1, "memory_mb": 512, "disk_gb": 40}
            created = await client.post("/servers", json=body)
            return created, list(service_of(app).placements.values())

    try:
        created, placements = asyncio.run(scenario())
        assert created.status_code == 201, created.text
        [allocation] = created.json()["allocations"]
        assert allocation["node"] == "disky"
        assert allocation["resources"] == {"VCPU": 1, "MEMORY_MB": 512, "DISK_GB": 40}
        audited(nodes, placements)
    finally:
        for node in nodes:
            node.close()


def test_fifty_concurrent_posts_are_all_placed_without_overcommit(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker)

    async def scenario() -> tuple[list[httpx.Response], list[Placement]]:
        async with serving(app) as client:
            responses = await asyncio.gather(
                *(client.post("/servers", json={"vcpus": 1, "memory_mb": 2048}) for _ in range(50))
            )
            return list(responses), list(service_of(app).placements.values())

    responses, placements = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [201] * 50, [r.text for r in responses]
    bodies = [r.json() for r in responses]
    assert len({b["request_id"] for b in bodies}) == 50
    allocation_ids = [a["allocation_id"] for b in bodies for a in b["allocations"]]
    assert len(set(allocation_ids)) == 50
    assert allocation_count(nodes) == 50
    assert sum(allocated(node, "VCPU") for node in nodes) == 50
    for node in nodes:
        assert allocated(node, "VCPU") <= NODE_VCPUS
        assert allocated(node, "MEMORY_MB") <= NODE_MEMORY_MB
    assert len(placements) == 50
    audited(nodes, placements)


def test_the_same_idempotency_key_places_once(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker)
    replica = create_app(broker)  # a second process of the service: its own Requestor
    order = {"vcpus": 2, "memory_mb": 1024}
    key = {"Idempotency-Key": "order-7f3a"}

    async def scenario() -> tuple[list[httpx.Response], list[Placement]]:
        async with serving(app) as client, serving(replica) as other:
            at_once = await asyncio.gather(
                client.post("/servers", json=order, headers=key),
                client.post("/servers", json=order, headers=key),
                client.post("/servers", json={**order, "request_id": "order-7f3a"}),
            )
            later = await client.post("/servers", json=order, headers=key)
            elsewhere = await other.post("/servers", json=order, headers=key)
            conflicting = await client.post(
                "/servers", json={**order, "request_id": "order-other"}, headers=key
            )
            assert conflicting.status_code == 422
            placements = [
                *service_of(app).placements.values(),
                *service_of(replica).placements.values(),
            ]
            return [*at_once, later, elsewhere], placements

    responses, placements = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [201] * 5, [r.text for r in responses]
    bodies = [r.json() for r in responses]
    assert {b["request_id"] for b in bodies} == {"order-7f3a"}
    assert all(b["allocations"] == bodies[0]["allocations"] for b in bodies)
    assert allocation_count(nodes) == 1
    audited(nodes, placements)


def test_an_impossible_request_is_409_with_the_explanation(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker)

    async def scenario() -> httpx.Response:
        async with serving(app) as client:
            return await client.post("/servers", json={"vcpus": 64, "memory_mb": 1024})

    response = asyncio.run(scenario())
    assert response.status_code == 409, response.text
    failure = response.json()
    assert failure["tiers_tried"] == list(Settings().tiers)  # every tier, widest last
    assert "tiers tried: 10%, 25%" in failure["detail"]
    assert failure["offers_received"] == 0
    assert sum(n for label, n in failure["reasons"].items() if "VCPU" in label) == len(nodes)
    assert "VCPU" in failure["detail"]
    assert allocation_count(nodes) == 0
    audited(nodes, [])


def test_a_request_nobody_answers_in_time_is_504(broker: InProcessBroker) -> None:
    # A listener that hears every tier and never answers (a hung node): the requestor
    # waits for answers until its deadline. (A full cluster, whose nodes decline, is a
    # 409 at once: see the next test.)
    hung = broker.open_endpoint(lambda delivery: None, name="reservoir.node.hung")
    for tier in (10, 25, 50, 75, 100):
        hung.bind(f"tier.{tier}")
    app = create_app(broker, settings=Settings(request_timeout_s=0.3), explain=False)

    async def scenario() -> httpx.Response:
        async with serving(app) as client:
            return await client.post("/servers", json={"vcpus": 1, "memory_mb": 1024})

    try:
        response = asyncio.run(scenario())
    finally:
        hung.close()
    assert response.status_code == 504, response.text
    assert response.json()["offers_received"] == 0


def test_a_request_no_node_can_take_is_409_at_once_even_without_explain(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker, settings=Settings(request_timeout_s=5.0), explain=False)

    async def scenario() -> httpx.Response:
        async with serving(app) as client:
            return await client.post("/servers", json={"vcpus": 64, "memory_mb": 1024})

    response = asyncio.run(scenario())
    # Not a 504: the exhaustive step asks the nodes to decline, so the verdict comes
    # from their answers, long before the 5 s deadline.
    assert response.status_code == 409, response.text
    assert response.json()["offers_received"] == 0
    assert allocation_count(nodes) == 0
    audited(nodes, [])


def test_health_checks_answer_while_placements_run(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker)

    async def scenario() -> tuple[list[httpx.Response], list[int], list[Placement]]:
        async with serving(app) as client:
            posts = [
                asyncio.create_task(
                    client.post(
                        "/servers",
                        json={"vcpus": 1, "memory_mb": 512},
                        headers={"Idempotency-Key": f"health-{i}"},  # keyed: each takes a while
                    )
                )
                for i in range(20)
            ]
            seen: list[int] = []
            while not all(post.done() for post in posts):
                health = await client.get("/healthz")
                assert health.status_code == 200
                seen.append(health.json()["in_flight"])
                await asyncio.sleep(0.005)
            responses = [await post for post in posts]
            final = (await client.get("/healthz")).json()
            assert final == {"status": "ok", "in_flight": 0, "placements": 20}
            return responses, seen, list(service_of(app).placements.values())

    responses, seen, placements = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [201] * 20
    assert max(seen) > 0  # the health checks ran while placements were under way
    assert allocation_count(nodes) == 20
    audited(nodes, placements)


def test_a_client_that_goes_away_leaves_a_placement_its_retry_finds(
    broker: InProcessBroker, nodes: list[NodeAgent], caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(broker)
    order = {"vcpus": 1, "memory_mb": 256}
    key = {"Idempotency-Key": "gone-away"}
    # every message a little late, so that the placement is still in flight when the
    # client goes away, however busy the machine (it takes several of them)
    broker.faults = Faults(delay_s=(0.05, 0.05))

    async def scenario() -> tuple[httpx.Response, list[Placement]]:
        async with serving(app) as client:
            requestor = service_of(app).requestor
            first = asyncio.create_task(client.post("/servers", json=order, headers=key))
            while requestor.in_flight() == 0 and not first.done():
                await asyncio.sleep(0.001)
            assert not first.done(), "placed before the client could go away"
            first.cancel()  # the ASGI handler is cancelled with it
            with pytest.raises(asyncio.CancelledError):
                await first
            for _ in range(1500):  # the placement goes on, and the service lists it
                if "gone-away" in service_of(app).placements:
                    break
                await asyncio.sleep(0.01)
            listed = service_of(app).placements["gone-away"]
            retry = await asyncio.wait_for(
                client.post("/servers", json=order, headers=key), timeout=15
            )
            assert retry.json() == PlacementOut.of(listed).model_dump()
            return retry, list(service_of(app).placements.values())

    with caplog.at_level(logging.ERROR):
        retry, placements = asyncio.run(scenario())
    assert retry.status_code == 201, retry.text
    assert [p.request_id for p in placements] == ["gone-away"]
    assert allocation_count(nodes) == 1
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    audited(nodes, placements)


def test_server_groups_spread_the_servers(broker: InProcessBroker, nodes: list[NodeAgent]) -> None:
    app = create_app(broker)

    async def scenario() -> tuple[httpx.Response, list[Placement]]:
        async with serving(app) as client:
            body = {"vcpus": 1, "memory_mb": 512, "count": 3, "group": "web"}
            created = await client.post("/servers", json=body)
            return created, list(service_of(app).placements.values())

    created, placements = asyncio.run(scenario())
    assert created.status_code == 201, created.text
    placed_on = [a["node"] for a in created.json()["allocations"]]
    assert len(placed_on) == len(set(placed_on)) == 3  # anti-affinity by default
    audited(nodes, placements)


@pytest.mark.parametrize(
    ("body", "headers"),
    [
        ({"memory_mb": 512}, {}),
        ({"vcpus": 0, "memory_mb": 512}, {}),
        ({"vcpus": 1, "memory_mb": 512, "count": 0}, {}),
        ({"vcpus": 1, "memory_mb": 512, "gpus": 1}, {}),
        ({"vcpus": 1, "memory_mb": 512, "policy": "anti-affinity"}, {}),
        ({"vcpus": 1, "memory_mb": 512, "group": "g", "policy": "scattered"}, {}),
        ({"vcpus": 1, "memory_mb": 512}, {"Idempotency-Key": "not a valid key"}),
        ({"vcpus": 1, "memory_mb": 512, "request_id": "a"}, {"Idempotency-Key": "b"}),
    ],
)
def test_an_invalid_request_is_422(
    broker: InProcessBroker,
    nodes: list[NodeAgent],
    body: dict[str, object],
    headers: dict[str, str],
) -> None:
    app = create_app(broker)

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with serving(app) as client:
            response = await client.post("/servers", json=body, headers=headers)
            return response, await client.get("/healthz")

    response, health = asyncio.run(scenario())
    assert response.status_code == 422, response.text
    assert health.json()["placements"] == 0
    assert allocation_count(nodes) == 0
    audited(nodes, [])


def test_the_module_app_runs_on_its_own_empty_broker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RESERVOIR_BROKER_URL", raising=False)
    # No node is bound anywhere, which the requestor takes for an outage and retries until
    # the request's timeout (30 s by default): a short one gives the same 409 sooner.
    monkeypatch.setenv("RESERVOIR_REQUEST_TIMEOUT_S", "1")
    from examples.asgi_service import app

    async def scenario() -> tuple[httpx.Response, httpx.Response]:
        async with serving(app) as client:
            health = await client.get("/healthz")
            return health, await client.post("/servers", json={"vcpus": 1, "memory_mb": 512})

    health, response = asyncio.run(scenario())
    assert health.json() == {"status": "ok", "in_flight": 0, "placements": 0}
    assert response.status_code == 409  # memory:// is a new broker: no node is on it
    assert "tiers tried" in response.json()["detail"]
    audited([], [])


def test_the_same_key_with_another_shape_is_a_409_and_the_first_placement_stays(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker)
    key = {"Idempotency-Key": "order-shape"}

    async def scenario() -> tuple[httpx.Response, httpx.Response, list[Placement]]:
        async with serving(app) as client:
            first = await client.post("/servers", json={"vcpus": 1, "memory_mb": 256}, headers=key)
            other = await client.post("/servers", json={"vcpus": 4, "memory_mb": 256}, headers=key)
            return first, other, list(service_of(app).placements.values())

    first, other, placements = asyncio.run(scenario())
    assert first.status_code == 201, first.text
    assert other.status_code == 409, other.text
    assert "another shape" in other.json()["detail"]
    assert [p.request_id for p in placements] == ["order-shape"]
    assert allocation_count(nodes) == 1
    assert sum(allocated(node, "VCPU") for node in nodes) == 1
    audited(nodes, placements)
