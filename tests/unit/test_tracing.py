"""OpenTelemetry across the broker (reservoir.observe.tracing): one trace from the HTTP call into
``reservoir serve`` through the requestor's placement to every node that evaluated the
request and the one that took the award; and nothing at all while nobody traces."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from reservoir import NodeAgent, Placement, audit
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.observe import tracing
from reservoir.protocol.messages import ReservationRequest, encode_message
from reservoir.service import create_app
from reservoir.testing import Simulation
from tests.unit.test_serve import serving


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Every span reservoir makes, in memory (a provider for reservoir alone: the global
    one is left alone for the rest of the suite)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use(provider)
    yield exporter
    tracing.use(None)
    provider.shutdown()


def named(finished: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [span for span in finished if span.name == name]


def test_one_trace_runs_from_the_http_call_through_every_nodes_offer(
    spans: InMemorySpanExporter,
) -> None:
    broker = InProcessBroker()
    nodes = [NodeAgent(broker, name=f"t{i}", vcpus=4, memory_mb=4096) for i in range(3)]
    app = create_app(broker)
    # the HTTP caller's own span, as a traced client would send it
    caller = TracerProvider().get_tracer("caller").start_span("client call")
    headers: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(headers, trace.set_span_in_context(caller))
    trace_id = caller.get_span_context().trace_id

    async def scenario() -> tuple[httpx.Response, list[Placement]]:
        async with serving(app) as client:
            response = await client.post(
                "/v1/reservations", json={"vcpus": 1, "memory_mb": 64}, headers=headers
            )
            return response, list(app.state.reservoir.placements.values())

    try:
        response, placements = asyncio.run(scenario())
        assert response.status_code == 201, response.text
        finished = spans.get_finished_spans()
        assert {span.context.trace_id for span in finished} == {trace_id}
        [server] = named(finished, "POST /v1/reservations")
        assert (
            server.parent is not None and server.parent.span_id == caller.get_span_context().span_id
        )
        [place] = named(finished, "reservoir.place")
        assert place.parent is not None and place.parent.span_id == server.context.span_id
        assert place.attributes is not None and place.attributes["reservoir.outcome"] == "placed"
        evaluated = named(finished, "reservoir.node.evaluate")
        assert evaluated, [span.name for span in finished]
        assert all(s.parent is not None and s.parent.span_id == place.context.span_id
                   for s in evaluated)  # fmt: skip
        answers = {s.attributes["reservoir.node"]: s.attributes["reservoir.answer"]
                   for s in evaluated if s.attributes}  # fmt: skip
        [winner] = {a["node"] for a in response.json()["allocations"]}
        assert answers[winner] == "offer"
        [award] = named(finished, "reservoir.node.award")
        assert award.attributes is not None
        assert award.attributes["reservoir.node"] == winner
        assert award.attributes["reservoir.answer"] == "accepted"
        assert award.parent is not None and award.parent.span_id == place.context.span_id
        audit([n.snapshot() for n in nodes], placements).raise_if_failed()
    finally:
        for node in nodes:
            node.close()
        broker.close()


def test_a_failed_placement_ends_its_span_in_error(
    spans: InMemorySpanExporter, reservoir_simulation: Simulation
) -> None:
    sim = reservoir_simulation
    sim.add_node("n1", vcpus=2, memory_mb=1024)
    requestor = sim.add_requestor("r1")
    future = requestor.submit(vcpus=8, memory_mb=1, explain=True)
    sim.run_until_done([future])
    assert future.exception() is not None
    [place] = named(spans.get_finished_spans(), "reservoir.place")
    assert place.status.status_code is trace.StatusCode.ERROR
    assert place.attributes is not None and place.attributes["reservoir.outcome"] == "failed"
    evaluated = named(spans.get_finished_spans(), "reservoir.node.evaluate")
    assert evaluated  # probed, then asked on every tier: each time it said no
    assert {s.attributes["reservoir.answer"] for s in evaluated if s.attributes} == {"decline"}


def test_while_nobody_traces_no_span_is_made_and_no_message_changes(
    reservoir_simulation: Simulation,
) -> None:
    assert tracing.tracer() is None  # the API is installed, but no provider is set
    sim = reservoir_simulation
    node = sim.add_node("n1", vcpus=2, memory_mb=1024)
    requestor = sim.add_requestor("r1")
    seen: list[ReservationRequest] = []
    handle = node._handle_message  # the agent's (the machine may be compiled: read-only)

    def spy(message: object, now: float) -> object:
        if isinstance(message, ReservationRequest):
            seen.append(message)
        return handle(message, now)  # type: ignore[arg-type]

    node._handle_message = spy  # type: ignore[method-assign,assignment]
    placement = sim.place(requestor, vcpus=1, memory_mb=1)
    assert seen and all(m.traceparent is None for m in seen)
    assert "traceparent" not in json.loads(encode_message(seen[0]).decode())
    assert "dry_run" not in json.loads(encode_message(seen[0]).decode())
    sim.finish([placement])


def run_request(exporter: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OTEL_TRACES_EXPORTER": exporter}
    return subprocess.run(
        [sys.executable, "-m", "reservoir", "request", "--broker", "memory://", "--vcpus", "1",
         "--timeout", "0.3", "--json"],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_command_asked_for_console_spans_writes_them_to_stderr_and_keeps_stdout_its_answer() -> (
    None
):
    done = run_request("console")
    assert done.returncode == 1  # memory:// is a broker of its own, with no node on it
    assert json.loads(done.stdout)["placed"] is False
    assert '"name": "reservoir.place"' in done.stderr
    assert '"reservoir.outcome": "failed"' in done.stderr


def test_an_exporter_reservoir_does_not_know_is_one_line_and_status_2() -> None:
    done = run_request("carrier-pigeon")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "reservoir request: OTEL_TRACES_EXPORTER='carrier-pigeon': "
        "reservoir knows console, otlp and none"
    ]
