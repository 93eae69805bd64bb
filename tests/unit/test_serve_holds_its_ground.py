"""The ``reservoir serve`` app holds its ground (issue 52, point 5), against a live
in-process cluster through httpx's ASGI transport: no input makes a 500 (hypothesis
drives the query parameters and the maps of a body), every map key of a body is
bounded and a bad one named without being repeated whole, an error nothing expected is a
problem+json 500 that is logged, counted and has its access line, and node listings wait
on threads of their own, so a listing's wait holds up no other request."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reservoir import NodeAgent, audit
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.service import ReservoirService, create_app
from reservoir.service.shapes import MAX_HINT_DEPTH
from reservoir.testing import InProcessCluster
from reservoir.testing.asgi import running, serving

PROBLEM_JSON = "application/problem+json"


@pytest.fixture
def nodes(reservoir_cluster: InProcessCluster) -> list[NodeAgent]:
    return reservoir_cluster.add_nodes(2, "ground", vcpus=16, memory_mb=32768)


def is_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"] == PROBLEM_JSON
    problem: dict[str, Any] = response.json()
    assert problem["status"] == status
    return problem


# -- no input makes a 500 ------------------------------------------------------------------


def nested(depth: int) -> str:
    """A placeholder for a list nested ``depth`` deep (deeper than json.dumps can write)."""
    return f"<nested {depth}>"


def encoded(body: dict[str, Any]) -> bytes:
    """``body`` as JSON, each :func:`nested` placeholder written out."""
    text = json.dumps(body, allow_nan=True)
    for depth in re.findall(r'"<nested (\d+)>"', text):
        deep = "[" * int(depth) + "1" + "]" * int(depth)
        text = text.replace(f'"<nested {depth}>"', deep)
    return text.encode()


#: query values as a client may send them: numbers of every size, and any text
QUERY_VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.floats(min_value=1e-320, max_value=1e-3).map(repr),
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.text(max_size=40),
)
#: JSON that nests, for hints
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=20,
)
MAP_KEYS = st.one_of(st.text(max_size=300), st.sampled_from(["VCPU", "CUSTOM_GPU", "", "A=B"]))
BODIES = st.fixed_dictionaries(
    {"vcpus": st.just(1)},
    optional={
        "resources": st.dictionaries(MAP_KEYS, st.integers(min_value=-5, max_value=2**60)),
        "pci": st.dictionaries(MAP_KEYS, st.integers(min_value=-1, max_value=100)),
        "hints": st.dictionaries(
            MAP_KEYS, JSON_VALUES | st.integers(0, 1000).map(nested), max_size=3
        ),
        "task": st.fixed_dictionaries(
            {"command": st.just(["true"])},
            optional={"env": st.dictionaries(MAP_KEYS, st.text(max_size=20), max_size=3)},
        ),
        "timeout_s": st.floats(allow_nan=False),
    },
)


class Running:
    """The app started in an event loop of its own, which each example runs in (hypothesis
    calls the test once per example, synchronously)."""

    def __init__(self, app: Any) -> None:
        self.loop = asyncio.new_event_loop()
        self.lifespan = running(app)
        self.loop.run_until_complete(self.lifespan.__aenter__())
        self.client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://api.test"
        )

    def ask(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """The answer, which is no 500, and a problem when it is an error (a 504 is one:
        a tiny timeout_s)."""
        answer = self.loop.run_until_complete(self.client.request(method, url, **kwargs))
        assert answer.status_code != 500, (method, url, kwargs, answer.text[:300])
        if answer.status_code >= 400:
            is_problem(answer, answer.status_code)
        return answer

    def close(self) -> None:
        self.loop.run_until_complete(self.client.aclose())
        self.loop.run_until_complete(self.lifespan.__aexit__(None, None, None))
        self.loop.close()


@pytest.fixture
def app(broker: InProcessBroker, nodes: list[NodeAgent]) -> Iterator[Running]:
    started = Running(create_app(broker))
    try:
        yield started
    finally:
        started.close()
    audit([n.snapshot() for n in nodes], []).raise_if_failed()


EXAMPLES = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@EXAMPLES
@given(window=QUERY_VALUES, bucket=QUERY_VALUES)
def test_no_activity_query_makes_a_500(app: Running, window: str, bucket: str) -> None:
    app.ask("GET", "/v1/activity", params={"window_s": window})
    app.ask("GET", "/v1/activity", params={"bucket_s": bucket})
    answer = app.ask("GET", "/v1/activity", params={"window_s": window, "bucket_s": bucket})
    if answer.status_code == 200:
        assert len(answer.json()["placed_per_bucket"]) <= 3600


@EXAMPLES
@given(wait=QUERY_VALUES)
def test_no_node_listing_query_makes_a_500_and_each_is_bounded(app: Running, wait: str) -> None:
    # both nodes expected: a valid wait ends as soon as they have answered
    app.ask("GET", "/v1/nodes", params={"wait_s": wait, "expect_nodes": 2})
    app.ask("GET", "/v1/nodes", params={"wait_s": 0.05, "expect_nodes": wait})
    for wait_s, expect_nodes in [(30.5, 2), (0.05, 1_000_001), (0.05, 10**20)]:
        answer = app.ask(
            "GET", "/v1/nodes", params={"wait_s": wait_s, "expect_nodes": expect_nodes}
        )
        assert answer.status_code == 422, answer.text


@EXAMPLES
@given(body=BODIES)
def test_no_body_makes_a_500(app: Running, body: dict[str, Any]) -> None:
    content = encoded(body)
    answer = app.ask(
        "POST", "/v1/reservations", content=content, headers={"content-type": "application/json"}
    )
    if answer.status_code == 201:
        freed = app.ask("DELETE", f"/v1/reservations/{answer.json()['request_id']}")
        assert freed.status_code == 204


# -- every map key of a body bounded ------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"resources": {"X" * 100_000: 1}}, "body.resources"),
        ({"resources": {"CUSTOM_A": -1}}, "body.resources.CUSTOM_A"),
        ({"resources": {"CUSTOM_A": 2**60}}, "body.resources.CUSTOM_A"),
        ({"resources": {f"CUSTOM_{i}": 1 for i in range(65)}}, "body.resources"),
        ({"pci": {"": 1}}, "body.pci"),
        ({"pci": {"gpu": 65}}, "body.pci.gpu"),
        ({"task": {"command": ["true"], "env": {"A=B": "x"}}}, "body.task.env"),
        ({"task": {"command": ["true"], "env": {"A": "x" * 5000}}}, "body.task.env.A"),
        ({"task": {"command": ["x" * 5000]}}, "body.task.command.0"),
        ({"hints": {"k" * 300: 1}}, "body.hints"),
        ({"hints": {f"h{i}": 1 for i in range(65)}}, "body.hints"),
        ({"hints": {"deep": nested(MAX_HINT_DEPTH + 1)}}, "body.hints"),
    ],
)
def test_a_bad_map_key_or_value_is_a_422_naming_its_map_and_short(
    broker: InProcessBroker, nodes: list[NodeAgent], body: dict[str, Any], field: str
) -> None:
    async def scenario() -> httpx.Response:
        async with serving(create_app(broker)) as client:
            content = encoded({"vcpus": 1, **body})
            headers = {"content-type": "application/json"}
            return await client.post("/v1/reservations", content=content, headers=headers)

    problem = is_problem(asyncio.run(scenario()), 422)
    assert [e["field"] for e in problem["errors"]] == [field], problem
    assert len(problem["detail"]) < 500
    audit([n.snapshot() for n in nodes], []).raise_if_failed()


def test_hints_that_are_not_json_numbers_are_a_422(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    async def scenario() -> httpx.Response:
        async with serving(create_app(broker)) as client:
            content = b'{"vcpus": 1, "hints": {"weight": NaN}}'
            headers = {"content-type": "application/json"}
            return await client.post("/v1/reservations", content=content, headers=headers)

    problem = is_problem(asyncio.run(scenario()), 422)
    assert "NaN" in problem["detail"]
    audit([n.snapshot() for n in nodes], []).raise_if_failed()


# -- an unexpected error: problem+json, logged, counted -----------------------------------


def test_an_error_nothing_expected_is_a_500_problem_logged_counted_and_in_the_access_log(
    broker: InProcessBroker, nodes: list[NodeAgent], caplog: pytest.LogCaptureFixture
) -> None:
    app = create_app(broker)
    app.state.access_log = True

    def broken(*args: object, **kwargs: object) -> dict[str, Any]:
        raise RuntimeError("secret cause")

    async def scenario() -> tuple[httpx.Response, httpx.Response, str]:
        async with serving(app) as client:
            service = app.state.reservoir
            assert isinstance(service, ReservoirService)
            service.activity.summary = broken  # type: ignore[method-assign]
            in_a_route = await client.get("/v1/activity")
            # and outside the service's routes: FastAPI's own, which the app answers for
            app.openapi = broken  # type: ignore[method-assign]
            outside = await client.get("/openapi.json")
            return in_a_route, outside, (await client.get("/metrics")).text

    with caplog.at_level(logging.INFO):
        in_a_route, outside, metrics = asyncio.run(scenario())
    for answer, path in ((in_a_route, "/v1/activity"), (outside, "/openapi.json")):
        problem = is_problem(answer, 500)
        assert "secret" not in answer.text  # the cause is for the log, not the client
        assert path in problem["detail"]
        logged = [r for r in caplog.records if r.name == "reservoir.serve" and path in r.message]
        assert [r.levelno for r in logged] == [logging.ERROR]
        assert logged[0].exc_info is not None and "secret cause" in logged[0].message
        access = [r for r in caplog.records if r.name == "reservoir.serve.access"]
        assert [getattr(r, "status", None) for r in access if getattr(r, "path", "") == path] == [
            500
        ]
        counted = f'route="{path}",status="500"}} 1.0'
        assert f'reservoir_service_http_requests_total{{method="GET",{counted}' in metrics


# -- node listings wait on threads of their own -------------------------------------------


def test_node_listings_waiting_hold_up_no_other_request(
    broker: InProcessBroker, nodes: list[NodeAgent]
) -> None:
    """More listings than the loop's default thread pool has threads, each waiting its
    whole wait_s (no expect_nodes): a reservation's GET, which asks the nodes through
    that pool, answers while every listing is still waiting."""
    default_pool = min(32, (os.cpu_count() or 1) + 4)  # asyncio's default executor
    app = create_app(broker)

    async def scenario() -> tuple[httpx.Response, list[bool], list[httpx.Response]]:
        async with serving(app) as client:
            placed = await client.post("/v1/reservations", json={"vcpus": 1})
            assert placed.status_code == 201, placed.text
            listings = [
                asyncio.create_task(client.get("/v1/nodes", params={"wait_s": 3}))
                for _ in range(default_pool + 2)
            ]
            await asyncio.sleep(0.2)  # every listing asked and waiting
            read = await client.get(f"/v1/reservations/{placed.json()['request_id']}")
            waiting = [not listing.done() for listing in listings]
            listed = await asyncio.gather(*listings)
            freed = await client.delete(f"/v1/reservations/{placed.json()['request_id']}")
            assert freed.status_code == 204
            return read, waiting, listed

    read, waiting, listed = asyncio.run(scenario())
    assert read.status_code == 200, read.text
    assert all(waiting), waiting
    assert all(len(listing.json()) == len(nodes) for listing in listed)
    audit([n.snapshot() for n in nodes], []).raise_if_failed()
