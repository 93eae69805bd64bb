"""The HTTP contract of the ``reservoir serve`` app (issue 33, defect 3), against a live
in-process cluster through httpx's ASGI transport: a body limit answered 413 before the
body is read whole, ``Location`` on 201, ``Allow`` on 405, 415 for a body that is not
JSON, strict types, malformed JSON and validation errors in reservoir's own words, an
OpenAPI document whose errors are problem+json, and access lines with their facts as
fields."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest

from reservoir import NodeAgent, audit
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.observe.logs import JsonFormatter
from reservoir.service import ReservoirService, create_app
from reservoir.testing import InProcessCluster
from reservoir.testing.asgi import serving

PROBLEM_JSON = "application/problem+json"


@pytest.fixture
def nodes(reservoir_cluster: InProcessCluster) -> list[NodeAgent]:
    return reservoir_cluster.add_nodes(2, "http", vcpus=16, memory_mb=32768)


def against(
    broker: InProcessBroker,
    scenario: Callable[[httpx.AsyncClient, ReservoirService], Awaitable[Any]],
    **options: Any,
) -> Any:
    app = create_app(broker, **options)

    async def main() -> Any:
        async with serving(app) as client:
            return await scenario(client, app.state.reservoir)

    return asyncio.run(main())


def is_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == PROBLEM_JSON
    problem: dict[str, Any] = response.json()
    assert problem["status"] == status
    return problem


def test_a_body_over_the_limit_by_its_content_length_is_a_413_problem_and_places_nothing(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    traits = [f"CUSTOM_T{i}" for i in range(20_000)]  # some 260 kB of JSON

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        answer = await client.post("/v1/reservations", json={"vcpus": 1, "required_traits": traits})
        problem = is_problem(answer, 413)
        assert "100000 bytes" in problem["detail"]

    against(broker, scenario, max_body_bytes=100_000)
    assert all(not n.snapshot().reservations and not n.allocations() for n in nodes)


def test_a_streamed_body_is_refused_once_its_bytes_pass_the_limit_unread_beyond(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    chunks_read = 0

    async def whitespace() -> AsyncIterator[bytes]:
        # 50 MB of whitespace, chunked (no Content-Length): the service stops early
        nonlocal chunks_read
        for _ in range(50 * 16):
            chunks_read += 1
            yield b" " * 65536

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        answer = await client.post(
            "/v1/reservations",
            content=whitespace(),
            headers={"content-type": "application/json"},
        )
        is_problem(answer, 413)

    against(broker, scenario, max_body_bytes=1024 * 1024)
    # httpx's ASGI transport hands over the body as the app asks for it; the limit is
    # passed in the 17th chunk of 64 KiB (the transport may have read one ahead)
    assert chunks_read <= 18


def test_a_placement_is_created_with_201_and_its_location(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        created = await client.post(
            "/v1/reservations", json={"vcpus": 1}, headers={"Idempotency-Key": "loc-1"}
        )
        assert created.status_code == 201, created.text
        assert created.headers["location"] == "http://api.test/v1/reservations/loc-1"
        read = await client.get(created.headers["location"])
        assert read.status_code == 200
        assert read.json()["request_id"] == "loc-1"
        audit([n.snapshot() for n in nodes], list(service.placements.values())).raise_if_failed()

    against(broker, scenario)


def test_a_method_a_path_does_not_take_is_a_405_problem_with_allow_naming_every_method(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        put = await client.put("/v1/reservations/x", json={"vcpus": 1})
        is_problem(put, 405)
        assert put.headers["allow"] == "DELETE, GET"
        get = await client.get("/v1/reservations")
        is_problem(get, 405)
        assert get.headers["allow"] == "POST"

    against(broker, scenario)


def test_a_body_that_is_not_json_is_a_415_problem(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        text = await client.post(
            "/v1/reservations", content=b"vcpus=2", headers={"content-type": "text/plain"}
        )
        problem = is_problem(text, 415)
        assert "text/plain" in problem["detail"]
        # +json and a charset are JSON
        fine = await client.post(
            "/v1/reservations",
            content=b'{"vcpus": 1}',
            headers={"content-type": "application/merge-patch+json; charset=utf-8"},
        )
        assert fine.status_code == 201, fine.text

    against(broker, scenario)


@pytest.mark.parametrize(
    "body",
    [
        {"vcpus": True},
        {"vcpus": "2"},
        {"vcpus": 1.5},
        {"vcpus": 1, "count": "3"},
        {"vcpus": 1, "numa": {"nodes": True}},
    ],
)
def test_an_integer_given_as_a_boolean_string_or_fraction_is_a_422_naming_the_field(
    broker: InProcessBroker, nodes: list[NodeAgent], body: dict[str, Any]
) -> None:
    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> dict[str, Any]:
        return is_problem(await client.post("/v1/reservations", json=body), 422)

    problem = against(broker, scenario)
    [error] = problem["errors"]
    assert error["field"] in ("body.vcpus", "body.count", "body.numa.nodes")
    assert error["message"].startswith("must be")
    assert all(not n.allocations() for n in nodes)


def test_malformed_json_is_a_400_problem_in_our_words(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> dict[str, Any]:
        answer = await client.post(
            "/v1/reservations",
            content=b'{"vcpus": 2, "memory_mb": }',
            headers={"content-type": "application/json"},
        )
        return is_problem(answer, 400)

    problem = against(broker, scenario)
    assert problem["title"] == "malformed JSON"
    assert problem["detail"].startswith("the body is not valid JSON at character 26")
    assert "JSON decode error" not in problem["detail"]


def test_validation_details_are_in_our_words_not_pydantics(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> list[str]:
        details = []
        for body in ({"vcpus": 1, "policy": "affinity"}, {"vcpus": -1}, {"cpus": 1}):
            details.append(is_problem(await client.post("/v1/reservations", json=body), 422))
        return [d["detail"] for d in details]

    policy, negative, unknown = against(broker, scenario)
    assert policy == "body: policy needs a group"
    assert negative == "body.vcpus: must be at least 0"
    assert unknown == "body.cpus: is not a field of this request"


def test_the_openapi_document_describes_every_error_as_a_problem(
    broker: InProcessBroker,
) -> None:
    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> dict[str, Any]:
        answer = await client.get("/openapi.json")
        assert answer.status_code == 200
        document: dict[str, Any] = answer.json()
        return document

    document = against(broker, scenario)
    schemas = document["components"]["schemas"]
    assert "Problem" in schemas
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    errors = 0
    for path in document["paths"].values():
        for operation in path.values():
            for code, response in operation["responses"].items():
                if code[0] in "45":
                    errors += 1
                    assert response["content"] == {
                        PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}
                    }, (code, response)
    assert errors >= 10
    post = document["paths"]["/v1/reservations"]["post"]["responses"]
    assert {"400", "409", "413", "415", "422", "503", "504"} <= set(post)
    assert "Location" in post["201"]["headers"]


def test_access_lines_carry_request_id_status_and_path_as_fields(
    broker: InProcessBroker, nodes: list[NodeAgent], caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(broker)
    app.state.access_log = True

    async def main() -> None:
        async with serving(app) as client:
            created = await client.post(
                "/v1/reservations", json={"vcpus": 1}, headers={"Idempotency-Key": "acc-1"}
            )
            assert created.status_code == 201
            assert (await client.get("/v1/reservations/acc-1")).status_code == 200

    with caplog.at_level(logging.INFO, logger="reservoir.serve.access"):
        asyncio.run(main())
    lines = [
        json.loads(JsonFormatter().format(r))
        for r in caplog.records
        if r.name == "reservoir.serve.access"
    ]
    assert [(line["path"], line["status"], line["request_id"]) for line in lines] == [
        ("/v1/reservations", 201, "acc-1"),
        ("/v1/reservations/acc-1", 200, "acc-1"),
    ]
    assert lines[1]["route"] == "/v1/reservations/{request_id}"
    assert all(isinstance(line["elapsed_ms"], float) for line in lines)
