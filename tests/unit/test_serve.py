"""The ``reservoir serve`` app (reservoir/service/) over HTTP, against a live in-process
cluster: node agents on their own threads and the app's one shared Requestor on one
:class:`~reservoir.brokers.inprocess.InProcessBroker`, driven through httpx's ASGI transport, with
the invariant audit over the nodes' ledgers at the end."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from fastapi import FastAPI, Request

from reservoir import NodeAgent, Placement, PlacementRequest, RequestorClosed, audit
from reservoir.brokers.inprocess import Faults, InProcessBroker
from reservoir.cli import main
from reservoir.service import ReservoirService, create_app, reservoir_lifespan
from reservoir.testing import InProcessCluster
from reservoir.testing.asgi import running, serving
from reservoir.version import __version__

NODE_VCPUS = 16
NODE_MEMORY_MB = 32768
PROBLEM_JSON = "application/problem+json"


@pytest.fixture
def nodes(reservoir_cluster: InProcessCluster) -> list[NodeAgent]:
    return reservoir_cluster.add_nodes(3, "serve", vcpus=NODE_VCPUS, memory_mb=NODE_MEMORY_MB)


def run_against(
    app: FastAPI, scenario: Callable[[httpx.AsyncClient, ReservoirService], Awaitable[Any]]
) -> Any:
    async def main() -> Any:
        async with serving(app) as client:
            service = app.state.reservoir
            assert isinstance(service, ReservoirService)
            return await scenario(client, service)

    return asyncio.run(main())


def audited(nodes: list[NodeAgent], placements: list[Placement]) -> None:
    audit([n.snapshot() for n in nodes], placements).raise_if_failed()


def test_a_request_is_placed_with_201_and_read_back_and_released(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker)

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        created = await client.post("/v1/reservations", json={"vcpus": 2, "memory_mb": 4096})
        assert created.status_code == 201, created.text
        body = created.json()
        assert body["placed"] is True
        assert body["partial"] is False
        [allocation] = body["allocations"]
        assert allocation["resources"] == {"VCPU": 2, "MEMORY_MB": 4096}
        assert allocation["node"] in {n.name for n in nodes}
        audited(nodes, list(service.placements.values()))

        read = await client.get(f"/v1/reservations/{body['request_id']}")
        assert read.status_code == 200
        assert read.json() == body

        released = await client.delete(f"/v1/reservations/{body['request_id']}")
        assert released.status_code == 204
        assert released.content == b""
        assert sum(len(n.allocations()) for n in nodes) == 0
        gone = await client.get(f"/v1/reservations/{body['request_id']}")
        assert gone.status_code == 404
        assert gone.headers["content-type"] == PROBLEM_JSON
        again = await client.delete(f"/v1/reservations/{body['request_id']}")
        assert again.status_code == 404

    run_against(app, scenario)
    audited(nodes, [])


def test_the_same_key_again_gets_the_same_placement_with_200(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker)
    shape = {"vcpus": 1, "memory_mb": 1024, "count": 2}

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        key = {"Idempotency-Key": "order-1"}
        first = await client.post("/v1/reservations", json=shape, headers=key)
        assert first.status_code == 201, first.text
        assert first.json()["request_id"] == "order-1"
        retried = await client.post("/v1/reservations", json=shape, headers=key)
        assert retried.status_code == 200, retried.text
        assert retried.json() == first.json()
        # the key in the body is the same key
        in_body = await client.post("/v1/reservations", json={**shape, "request_id": "order-1"})
        assert in_body.status_code == 200
        assert in_body.json()["allocations"] == first.json()["allocations"]
        assert sum(len(n.allocations()) for n in nodes) == 2
        audited(nodes, list(service.placements.values()))

    run_against(app, scenario)


def test_concurrent_requests_with_one_key_share_one_placement(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker)

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        answers = await asyncio.gather(
            *(
                client.post(
                    "/v1/reservations",
                    json={"vcpus": 1, "memory_mb": 512},
                    headers={"Idempotency-Key": "shared"},
                )
                for _ in range(5)
            )
        )
        assert {a.status_code for a in answers} <= {200, 201}
        assert len({str(a.json()["allocations"]) for a in answers}) == 1
        assert sum(len(n.allocations()) for n in nodes) == 1
        audited(nodes, list(service.placements.values()))

    run_against(app, scenario)


def test_a_key_reused_with_another_body_is_a_422_problem(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker)

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        key = {"Idempotency-Key": "order-2"}
        first = await client.post(
            "/v1/reservations", json={"vcpus": 1, "memory_mb": 1}, headers=key
        )
        assert first.status_code == 201, first.text
        other = await client.post(
            "/v1/reservations", json={"vcpus": 8, "memory_mb": 1}, headers=key
        )
        assert other.status_code == 422
        assert other.headers["content-type"] == PROBLEM_JSON
        problem = other.json()
        assert problem["status"] == 422
        assert problem["request_id"] == "order-2"
        assert "different body" in problem["detail"]
        # nothing new was placed, and the first placement stands
        assert sum(len(n.allocations()) for n in nodes) == 1
        # once released, the key is free for a new body
        assert (await client.delete("/v1/reservations/order-2")).status_code == 204
        renewed = await client.post(
            "/v1/reservations", json={"vcpus": 8, "memory_mb": 1}, headers=key
        )
        assert renewed.status_code == 201, renewed.text
        audited(nodes, list(service.placements.values()))

    run_against(app, scenario)


def test_a_key_being_released_is_not_placed_again_under_the_release(
    broker: InProcessBroker, nodes: list[NodeAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(broker)
    shape = {"vcpus": 1, "memory_mb": 1}

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        key = {"Idempotency-Key": "order-3"}
        assert (await client.post("/v1/reservations", json=shape, headers=key)).status_code == 201
        entered, gate = asyncio.Event(), asyncio.Event()
        release = service.requestor.release_async

        async def gated_release(placement: Placement) -> tuple[str, ...]:
            entered.set()
            await gate.wait()
            return await release(placement)

        monkeypatch.setattr(service.requestor, "release_async", gated_release)
        deleting = asyncio.create_task(client.delete("/v1/reservations/order-3"))
        await entered.wait()
        meanwhile = await client.post("/v1/reservations", json=shape, headers=key)
        assert meanwhile.status_code == 409
        assert meanwhile.json()["title"] == "being released"
        gate.set()
        assert (await deleting).status_code == 204
        assert sum(len(n.allocations()) for n in nodes) == 0

    run_against(app, scenario)
    audited(nodes, [])


def test_an_impossible_request_is_a_409_problem_naming_the_short_resource(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker)

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        failed = await client.post("/v1/reservations", json={"vcpus": 64, "memory_mb": 1024})
        assert failed.status_code == 409
        assert failed.headers["content-type"] == PROBLEM_JSON
        problem = failed.json()
        assert problem["type"] == "urn:reservoir:problem:not-placed"
        assert problem["status"] == 409
        assert "VCPU" in problem["detail"]
        assert problem["reasons"] == {"VCPU larger than one instance may take": len(nodes)}
        assert problem["tiers_tried"]
        assert problem["request_id"]
        assert service.placements == {}

    run_against(app, scenario)
    audited(nodes, [])


def test_a_request_not_placed_in_its_timeout_is_a_504_problem(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker)

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        broker.faults = Faults(loss=1.0)  # the request never reaches a node
        try:
            late = await client.post(
                "/v1/reservations", json={"vcpus": 1, "memory_mb": 1, "timeout_s": 0.2}
            )
        finally:
            broker.faults = None
        assert late.status_code == 504
        assert late.headers["content-type"] == PROBLEM_JSON
        assert late.json()["type"] == "urn:reservoir:problem:timeout"
        assert "timed out" in late.json()["detail"]
        exposition = (await client.get("/metrics")).text
        assert 'reservoir_service_placement_failures_total{reason="timeout"} 1.0' in exposition

    run_against(app, scenario)
    audited(nodes, [])


def test_a_bad_body_is_a_422_problem_naming_the_field(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker)

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        negative = await client.post("/v1/reservations", json={"vcpus": -1, "memory_mb": 1})
        assert negative.status_code == 422
        assert negative.headers["content-type"] == PROBLEM_JSON
        assert negative.json()["errors"][0]["field"] == "body.vcpus"
        assert "body.vcpus" in negative.json()["detail"]
        nothing = await client.post("/v1/reservations", json={"vcpus": 0, "memory_mb": 0})
        assert nothing.status_code == 422
        assert "positive amount" in nothing.json()["detail"]
        too_few = await client.post(
            "/v1/reservations", json={"vcpus": 1, "memory_mb": 1, "count": 1, "min_count": 2}
        )
        assert too_few.status_code == 422
        assert "min_count" in too_few.json()["detail"]
        bad_key = await client.post(
            "/v1/reservations",
            json={"vcpus": 1, "memory_mb": 1},
            headers={"Idempotency-Key": "no spaces allowed"},
        )
        assert bad_key.status_code == 422
        assert bad_key.json()["errors"][0]["field"] == "header.Idempotency-Key"
        unknown = await client.post("/v1/reservations", json={"vcpus": 1, "cpus": 2})
        assert unknown.status_code == 422
        assert unknown.json()["errors"][0]["field"] == "body.cpus"

    run_against(app, scenario)
    audited(nodes, [])


def test_the_nodes_list_shows_every_node_with_its_usage_and_tier(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    app = create_app(broker)

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        placed = await client.post("/v1/reservations", json={"vcpus": 4, "memory_mb": 1024})
        assert placed.status_code == 201
        [allocation] = placed.json()["allocations"]
        listed = await client.get("/v1/nodes", params={"expect_nodes": len(nodes), "wait_s": 10})
        assert listed.status_code == 200, listed.text
        by_name = {node["name"]: node for node in listed.json()}
        assert sorted(by_name) == sorted(n.name for n in nodes)
        holder = by_name[allocation["node"]]
        assert holder["allocations"] == 1
        assert holder["reservations"] == 0
        assert holder["usage"]["VCPU"] == {
            "total": NODE_VCPUS,
            "reserved": 0,
            "allocation_ratio": 1.0,
            "capacity": NODE_VCPUS,
            "used": 4,
            "held": 0,
            "free": NODE_VCPUS - 4,
        }
        assert all(isinstance(node["tier"], int) for node in by_name.values())
        assert {node["release"] for node in by_name.values()} == {__version__}

    run_against(app, scenario)


def test_probes_and_metrics(broker: InProcessBroker, nodes: list[NodeAgent]) -> None:
    app = create_app(broker)

    async def scenario(
        client: httpx.AsyncClient, service: ReservoirService
    ) -> tuple[str, str, list[Placement]]:
        assert (await client.get("/healthz")).json()["status"] == "ok"
        assert (await client.get("/readyz")).status_code == 200
        await client.post("/v1/reservations", json={"vcpus": 1, "memory_mb": 1})
        await client.post("/v1/reservations", json={"vcpus": 99, "memory_mb": 1})
        service.closing = True  # as during shutdown: not ready, nothing new accepted
        not_ready = await client.get("/readyz")
        assert not_ready.status_code == 503
        assert not_ready.headers["content-type"] == PROBLEM_JSON
        refused = await client.post("/v1/reservations", json={"vcpus": 1, "memory_mb": 1})
        assert refused.status_code == 503
        service.closing = False
        exposition = await client.get("/metrics")
        assert exposition.status_code == 200
        return (
            exposition.text,
            service.requestor.metrics.participant,
            list(service.placements.values()),
        )

    text, requestor, placements = run_against(app, scenario)
    assert 'reservoir_service_placement_seconds_bucket{le="0.005",outcome="placed"}' in text
    assert 'reservoir_service_placement_seconds_count{outcome="placed"} 1.0' in text
    assert 'reservoir_service_placements_total{partial="false"} 1.0' in text
    assert 'reservoir_service_placement_failures_total{reason="not_placed"} 1.0' in text
    assert "reservoir_service_placements_in_flight 0.0" in text
    assert (
        'reservoir_service_http_requests_total{method="POST",route="/v1/reservations",'
        'status="201"} 1.0'
    ) in text
    assert 'route="/readyz",status="503"' in text
    # the service's requestor counts into the same registry: what the protocol did
    who = f'participant="{requestor}"'
    assert f'reservoir_placement_seconds_count{{outcome="placed",{who}}} 1.0' in text
    assert f'reservoir_placement_failures_total{{{who},reason="not_placed"}} 1.0' in text
    assert f'reservoir_messages_sent_total{{kind="award",{who}}} 1.0' in text
    assert f"reservoir_requestor_in_flight{{{who}}} 0.0" in text
    # and the process's own
    assert "process_cpu_seconds_total" in text
    assert "python_info" in text
    audited(nodes, placements)


class FlakyBroker(InProcessBroker):
    """An in-process broker whose connection the test can take down, as an AMQP
    broker's ``connected`` property reports it."""

    connected = True


def test_while_the_broker_connection_is_down_the_service_is_not_ready_and_refuses_with_503() -> (
    None
):
    broker = FlakyBroker()
    node = NodeAgent(broker, name="flaky-node", vcpus=4, memory_mb=4096)
    app = create_app(broker)

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        assert (await client.get("/readyz")).status_code == 200
        broker.connected = False
        not_ready = await client.get("/readyz")
        assert not_ready.status_code == 503
        assert not_ready.headers["content-type"] == PROBLEM_JSON
        assert "broker connection is down" in not_ready.json()["detail"]
        refused = await client.post("/v1/reservations", json={"vcpus": 1, "memory_mb": 1})
        assert refused.status_code == 503
        assert refused.json()["type"] == "urn:reservoir:problem:unavailable"
        assert (await client.get("/healthz")).status_code == 200  # the process lives on
        broker.connected = True
        placed = await client.post("/v1/reservations", json={"vcpus": 1, "memory_mb": 1})
        assert placed.status_code == 201, placed.text

    try:
        run_against(app, scenario)
    finally:
        node.close()
        broker.close()


async def shut_down_with_a_placement_in_flight(
    app: FastAPI, monkeypatch: pytest.MonkeyPatch, *, open_gate_before_draining: bool
) -> tuple[httpx.Response, ReservoirService, bool]:
    """POST a placement held at a gate inside the service, shut the app down, and open
    the gate as the drain begins (or only once the drain has ended and the requestor has
    closed: opened any earlier, the placement could finish in the moment between the two,
    and did once). Returns the POST's answer, the service, and whether the POST was still
    running when the shutdown began."""
    entered, gate = asyncio.Event(), asyncio.Event()
    still_running_at_shutdown = False
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as client:
        async with running(app):
            service = app.state.reservoir
            assert isinstance(service, ReservoirService)
            reserve, drain = service.requestor.reserve_async, service.drain

            async def gated_reserve(*args: Any, **kwargs: Any) -> Placement:
                entered.set()
                await gate.wait()
                return await reserve(*args, **kwargs)

            drains = 0

            async def observed_drain(timeout_s: float) -> int:
                nonlocal still_running_at_shutdown, drains
                drains += 1
                if drains == 1:  # (the second waits for what the closed requestor failed)
                    still_running_at_shutdown = not post.done()
                if open_gate_before_draining:
                    gate.set()
                return await drain(timeout_s)

            loop = asyncio.get_running_loop()
            close = service.requestor.close

            def close_then_open_the_gate() -> None:
                close()
                loop.call_soon_threadsafe(gate.set)

            monkeypatch.setattr(service.requestor, "reserve_async", gated_reserve)
            monkeypatch.setattr(service.requestor, "close", close_then_open_the_gate)
            monkeypatch.setattr(service, "drain", observed_drain)
            post = asyncio.create_task(
                client.post("/v1/reservations", json={"vcpus": 1, "memory_mb": 1})
            )
            await entered.wait()
        # the lifespan has shut down: the requestor is closed
        return await post, service, still_running_at_shutdown


def test_a_placement_in_flight_at_shutdown_finishes_before_the_requestor_closes(
    broker: InProcessBroker, nodes: list[NodeAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(broker, drain_timeout_s=30)
    answer, service, in_flight = asyncio.run(
        shut_down_with_a_placement_in_flight(app, monkeypatch, open_gate_before_draining=True)
    )
    assert in_flight
    assert answer.status_code == 201, answer.text
    assert sum(len(n.allocations()) for n in nodes) == 1
    assert all(not n.snapshot().reservations for n in nodes)
    with pytest.raises(RequestorClosed):
        service.requestor.reserve(vcpus=1, memory_mb=1)
    audited(nodes, list(service.placements.values()))


def test_a_placement_still_in_flight_when_the_drain_ends_fails_clearly_and_holds_nothing(
    broker: InProcessBroker, nodes: list[NodeAgent], monkeypatch: pytest.MonkeyPatch
) -> None:
    app = create_app(broker, drain_timeout_s=0)
    answer, service, in_flight = asyncio.run(
        shut_down_with_a_placement_in_flight(app, monkeypatch, open_gate_before_draining=False)
    )
    assert in_flight
    # the requestor closed under it: the client is told to try again elsewhere
    assert answer.status_code == 503, answer.text
    assert answer.headers["content-type"] == PROBLEM_JSON
    assert answer.json()["title"] == "shutting down"
    assert service.placements == {}
    assert sum(len(n.allocations()) for n in nodes) == 0
    # Offers that reach the closed requestor's endpoint are never answered: the nodes'
    # reservations for them lapse at their TTL, as the protocol has it. The audit checks
    # that none outlives it.
    audited(nodes, [])


def test_two_apps_in_one_process_keep_their_own_metrics(broker: InProcessBroker) -> None:
    first, second = create_app(broker), create_app(broker)
    assert first.state.metrics.registry is not second.state.metrics.registry


def test_the_openapi_document_lists_the_endpoints(broker: InProcessBroker) -> None:
    paths = create_app(broker).openapi()["paths"]
    assert {"/v1/reservations", "/v1/reservations/{request_id}", "/v1/nodes"} <= set(paths)
    assert {"/healthz", "/readyz", "/metrics"} <= set(paths)


def test_shutdown_closes_the_requestor(broker: InProcessBroker, nodes: list[NodeAgent]) -> None:
    app = create_app(broker)

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> ReservoirService:
        assert (await client.post("/v1/reservations", json={"vcpus": 1, "memory_mb": 1})).is_success
        return service

    service = run_against(app, scenario)
    assert app.state.reservoir is None
    with pytest.raises(RequestorClosed):
        service.requestor.reserve(vcpus=1, memory_mb=1)
    # what was placed stays placed (it is the clients'); nothing is left merely reserved
    assert all(not n.snapshot().reservations for n in nodes)
    audited(nodes, list(service.placements.values()))


def test_the_lifespan_helper_serves_a_users_own_app(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with reservoir_lifespan(app, broker):
            yield

    app = FastAPI(lifespan=lifespan)

    @app.post("/servers")
    async def create(request: Request) -> dict[str, str]:
        service: ReservoirService = request.app.state.reservoir
        placement = await service.place(PlacementRequest(resources={"VCPU": 2}))
        return {"node": placement.allocations[0].node}

    async def main() -> str:
        async with serving(app) as client:
            answer = await client.post("/servers")
            assert answer.status_code == 200, answer.text
            node: str = answer.json()["node"]
            return node

    assert asyncio.run(main()) in {n.name for n in nodes}


def test_the_serve_command_is_registered_and_explains_itself() -> None:
    shown = CliRunner().invoke(main, ["serve", "--help"])
    assert shown.exit_code == 0, shown.output
    for words in ("--broker", "--host", "--port", "RESERVOIR_SERVE_PORT", "/v1/reservations"):
        assert words in shown.output


def test_the_serve_command_on_a_port_in_use_says_so_in_one_line_and_exits_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(main, ["serve", "--broker", "memory://", "--port", str(port)])
    assert result.exit_code == 2, result.output
    [line] = result.output.strip().splitlines()
    assert line.startswith(f"reservoir serve: cannot listen on 127.0.0.1:{port}: ")
    assert "in use" in line


def unused_port() -> int:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_the_serve_command_gives_up_on_a_broker_after_its_connect_attempts_with_one_line() -> None:
    import re
    import subprocess
    import sys

    broker_port, port = unused_port(), unused_port()
    done = subprocess.run(
        [sys.executable, "-m", "reservoir", "serve", "--port", str(port),
         "--connect-attempts", "2", "--broker", f"amqp://guest:guest@127.0.0.1:{broker_port}/"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    shown = f"amqp://guest:***@127.0.0.1:{broker_port}/"
    waited, gave_up = done.stderr.splitlines()
    assert re.search(
        rf"reservoir serve: cannot connect to {re.escape(shown)}: connection refused; "
        r"retrying in \d+\.\d s \(attempt 1\)$",
        waited,
    ), waited
    assert gave_up == f"reservoir serve: cannot connect to {shown}: connection refused"


def test_the_serve_command_waits_for_its_broker_until_stopped_and_then_exits_0() -> None:
    import os
    import signal
    import subprocess
    import sys

    broker_port, port = unused_port(), unused_port()
    waiting = subprocess.Popen(
        [sys.executable, "-m", "reservoir", "serve", "--port", str(port),
         "--broker", f"amqp://guest:guest@127.0.0.1:{broker_port}/"],
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert waiting.stderr is not None
        lines = [waiting.stderr.readline() for _ in range(2)]  # two attempts retried
        assert waiting.poll() is None, lines  # it went on waiting: it did not exit 3
        assert all("retrying in" in line for line in lines), lines
        assert [line.rsplit("(", 1)[1] for line in lines] == ["attempt 1)\n", "attempt 2)\n"]
        waiting.send_signal(signal.SIGTERM)
        _out, rest = waiting.communicate(timeout=30)
    finally:
        if waiting.poll() is None:
            waiting.kill()
            waiting.wait(timeout=10)
    assert waiting.returncode == 0, rest
    assert rest.strip().endswith("reservoir serve: stopped before the broker answered"), rest


def test_the_serve_process_takes_its_configuration_from_the_environment_and_exits_0_on_sigterm(
    tmp_path: Any,
) -> None:
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "RESERVOIR_BROKER_URL": "memory://",
        "RESERVOIR_SERVE_HOST": "127.0.0.1",
        "RESERVOIR_SERVE_PORT": str(port),
        "RESERVOIR_REQUEST_TIMEOUT_S": "0.5",
        "RESERVOIR_LOG_FORMAT": "json",
    }
    serving_process = subprocess.Popen(
        [sys.executable, "-m", "reservoir", "-v", "serve"],  # -v: placements at info
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5) as client:
            while True:
                assert serving_process.poll() is None, serving_process.communicate()[1]
                try:
                    if client.get("/readyz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "reservoir serve never became ready"
                time.sleep(0.1)  # a real process starting: nothing to wait on but its port
            # memory:// is a broker of the process's own, with no node: the request
            # timeout from the environment bounds the wait
            started = time.monotonic()
            unplaced = client.post("/v1/reservations", json={"vcpus": 1, "memory_mb": 1})
            assert unplaced.status_code in (409, 504), unplaced.text
            assert time.monotonic() - started < 5
        serving_process.send_signal(signal.SIGTERM)
        _out, stderr = serving_process.communicate(timeout=30)
    finally:
        if serving_process.poll() is None:
            serving_process.kill()
            serving_process.wait(timeout=10)
    assert serving_process.returncode == 0, stderr
    lines = [json.loads(line) for line in stderr.splitlines()]
    messages = [line["message"] for line in lines]
    assert "Application shutdown complete." in messages, messages
    assert f"reservoir serve: listening on http://127.0.0.1:{port}, broker memory://" in messages
    [unplaced_line] = [line for line in lines if str(line["message"]).startswith("not placed")]
    assert unplaced_line["request_id"] == unplaced.json()["request_id"]


def test_the_service_router_gives_a_users_app_the_routes_the_dashboard_and_problem_answers(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    """One include: the reservations, the node listing the dashboard polls, the dashboard,
    and the service's answers as problem+json (415, 413, 422, a logged 500); the app's own
    routes keep their own error handling."""
    import logging

    from fastapi import HTTPException

    import reservoir.service

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with reservoir_lifespan(app, broker):
            yield

    app = FastAPI(lifespan=lifespan)
    app.include_router(reservoir.service.router)

    @app.get("/mine")
    async def mine() -> None:
        raise HTTPException(418, "the app's own")

    def broken(*args: object, **kwargs: object) -> dict[str, Any]:
        raise RuntimeError("unexpected")

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> list[Placement]:
        page = await client.get("/ui/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        listed = await client.get("/v1/nodes", params={"expect_nodes": len(nodes), "wait_s": 10})
        assert listed.status_code == 200, listed.text
        assert sorted(n["name"] for n in listed.json()) == sorted(n.name for n in nodes)
        assert (await client.get("/v1/activity")).status_code == 200

        not_json = await client.post(
            "/v1/reservations", content=b"vcpus=1", headers={"content-type": "text/plain"}
        )
        assert not_json.status_code == 415 and not_json.headers["content-type"] == PROBLEM_JSON
        too_large = await client.post(
            "/v1/reservations", json={"vcpus": 1, "hints": {"x": "y" * 2_000_000}}
        )
        assert too_large.status_code == 413 and too_large.headers["content-type"] == PROBLEM_JSON
        invalid = await client.post("/v1/reservations", json={"vcpus": True})
        assert invalid.status_code == 422 and invalid.headers["content-type"] == PROBLEM_JSON
        assert invalid.json()["errors"][0]["field"] == "body.vcpus"
        refused = await client.post("/v1/reservations", json={"vcpus": 99})
        assert refused.status_code == 409 and refused.headers["content-type"] == PROBLEM_JSON
        bad_bucket = await client.get("/v1/activity", params={"bucket_s": "1e-11"})
        assert bad_bucket.status_code == 422, bad_bucket.text

        placed = await client.post("/v1/reservations", json={"vcpus": 1, "memory_mb": 256})
        assert placed.status_code == 201, placed.text
        request_id = placed.json()["request_id"]
        assert (await client.get(f"/v1/reservations/{request_id}")).status_code == 200
        assert (await client.delete(f"/v1/reservations/{request_id}")).status_code == 204

        service.activity.summary = broken  # type: ignore[method-assign]
        failed = await client.get("/v1/activity")
        assert failed.status_code == 500 and failed.headers["content-type"] == PROBLEM_JSON

        own = await client.get("/mine")  # the app's own route: FastAPI's answer, untouched
        assert own.status_code == 418
        assert own.headers["content-type"] == "application/json"
        assert own.json() == {"detail": "the app's own"}
        return list(service.placements.values())

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(logging.getLogger("reservoir.serve"), "disabled", True)  # the 500's line
        placements = run_against(app, scenario)
    audited(nodes, placements)
