"""End to end (issue 33, defect 2): ``reservoir serve`` in a process of its own on a real
RabbitMQ, stopped with SIGTERM while a placement is in flight that cannot finish within
the drain (no node answers it). The client hears a 503 problem with Retry-After, not a
bare 500; a request arriving during the drain hears a 503 too; the process exits 0
within the drain plus about a second, without a traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest

from reservoir.brokers import admin

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]

PROBLEM_JSON = "application/problem+json"
DRAIN_S = 2.0
READY_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def exchange_url(reservoir_amqp_broker_url: str) -> Iterator[str]:
    separator = "&" if "?" in reservoir_amqp_broker_url else "?"
    url = f"{reservoir_amqp_broker_url}{separator}exchange=e2e-stop-{uuid.uuid4().hex[:10]}"
    yield url
    topology = admin(url)
    assert topology is not None
    topology.delete_reservoir_exchanges()


def test_sigterm_with_a_placement_that_cannot_finish_answers_503_and_exits_within_the_drain(
    exchange_url: str,
) -> None:
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "RESERVOIR_BROKER_URL": exchange_url}
    serve = subprocess.Popen(
        [sys.executable, "-m", "reservoir.cli", "serve", "--port", str(port),
         "--drain-timeout", str(DRAIN_S)],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    stderr: list[str] = []

    def pump() -> None:
        assert serve.stderr is not None
        stderr.extend(serve.stderr)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        with httpx.Client(base_url=base_url, timeout=30.0) as client:
            wait_until_ready(client, serve, stderr)
            with ThreadPoolExecutor(1) as pool:
                # no node is there to answer: it would go on widening for a minute
                in_flight: Future[httpx.Response] = pool.submit(
                    client.post,
                    "/v1/reservations",
                    json={"vcpus": 1, "timeout_s": 60},
                    headers={"Idempotency-Key": "stop-1"},
                )
                wait_until(lambda: client.get("/healthz").json()["in_flight"] == 1, serve)
                serve.send_signal(signal.SIGTERM)
                stopped_at = time.monotonic()
                # a new request during the drain: refused at once, with a problem
                wait_until(lambda: client.get("/readyz").status_code == 503, serve)
                during = client.post("/v1/reservations", json={"vcpus": 1})
                answer = in_flight.result(timeout=30)
        status = serve.wait(timeout=30)
        took_s = time.monotonic() - stopped_at
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait(timeout=10)
        reader.join(timeout=10)
    log = "".join(stderr)

    assert during.status_code == 503, during.text
    assert during.headers["content-type"] == PROBLEM_JSON
    assert during.json()["title"] == "shutting down"
    assert during.headers["retry-after"] == "1"

    assert answer.status_code == 503, answer.text
    assert answer.headers["content-type"] == PROBLEM_JSON
    assert answer.headers["retry-after"] == "1"
    problem = answer.json()
    assert problem["title"] == "shutting down"
    assert problem["request_id"] == "stop-1"

    assert status == 0, log
    # the drain, then a second for the answers (and the interpreter's own exit)
    assert took_s < DRAIN_S + 1.5, (took_s, log)
    assert "Traceback" not in log and "CancelledError" not in log, log
    assert "timeout graceful shutdown exceeded" not in log, log
    assert "still in flight: failing them" in log, log


def wait_until_ready(client: httpx.Client, serve: subprocess.Popen[str], stderr: list[str]) -> None:
    def ready() -> bool:
        try:
            return client.get("/readyz").status_code == 200
        except httpx.TransportError:
            return False

    wait_until(ready, serve, READY_TIMEOUT_S, stderr)


def wait_until(
    condition: object,
    serve: subprocess.Popen[str],
    timeout_s: float = 10.0,
    stderr: list[str] | None = None,
) -> None:
    assert callable(condition)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        assert serve.poll() is None or stderr is None, "".join(stderr or [])
        time.sleep(0.05)  # a real process: nothing to wait on but its answers
    raise AssertionError(f"not within {timeout_s} s: {''.join(stderr or [])}")
