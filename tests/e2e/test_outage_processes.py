"""End to end, through a loopback TCP proxy in front of the real RabbitMQ that the test
turns off and on (the broker looks down: connections cut, new ones closed at once):
``reservoir serve`` started while the broker is down waits for it and serves once it is
up; after an outage, ``reservoir serve``, ``reservoir node`` and ``reservoir keeper`` each
log the loss once and "reconnected" once, and the service places again. The cluster is
audited over the broker at the end, and the run's exchanges deleted."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest

from reservoir.runtime.auditor import audit_cluster, read_placements
from reservoir.testing.processes import NODE_READY, ReservoirProcess, free_port
from reservoir.testing.tcp_proxy import TcpProxy
from tests.e2e.serving import node_args, wait_until_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]

RUN = uuid.uuid4().hex[:6]
SHAPE = {"vcpus": 1, "memory_mb": 512}


@dataclass
class Outage:
    """The run's URL through the proxy, and the proxy."""

    url: str
    direct_url: str
    proxy: TcpProxy
    env: dict[str, str]


@pytest.fixture
def outage(reservoir_amqp_url: str) -> Iterator[Outage]:
    parts = urlsplit(reservoir_amqp_url)
    with TcpProxy(parts.port or 5672) as proxy:
        netloc = f"{parts.netloc.rsplit('@', 1)[0]}@127.0.0.1:{proxy.port}"
        url = urlunsplit(parts._replace(netloc=netloc))
        env = {**os.environ, "RESERVOIR_BROKER_URL": url}
        yield Outage(url, reservoir_amqp_url, proxy, env)


def stopped(*children: ReservoirProcess) -> None:
    for child in children:
        if child.process.poll() is None:
            child.process.kill()
            child.process.wait(timeout=10)


def test_serve_started_while_the_broker_is_down_waits_for_it_then_serves(
    outage: Outage, tmp_path: Path
) -> None:
    outage.proxy.refuse()  # down before anything starts
    port = free_port()
    serve = ReservoirProcess("serve", ["serve", "--port", str(port)], outage.env)
    node_name = f"outage-{RUN}-start"
    node = ReservoirProcess(node_name, node_args(node_name, tmp_path), outage.env)
    try:
        # it retries rather than exiting 3 (its first wait is a second, then 2 s, 4 s ...)
        serve.wait_for("reservoir serve: cannot connect to")
        serve.wait_for("retrying in")
        assert serve.process.poll() is None, "".join(serve.said)
        outage.proxy.restore()
        node.wait_for(NODE_READY)
        base_url = f"http://127.0.0.1:{port}"
        wait_until_ready(base_url, serve)
        with httpx.Client(base_url=base_url, timeout=30) as client:
            placed = client.post("/v1/reservations", json=SHAPE)
            assert placed.status_code == 201, placed.text
        assert serve.terminate() == 0, "".join(serve.said)
        report = audit_cluster(
            outage.direct_url,
            placements=read_placements([json.dumps(placed.json())]),
            expect_nodes=1,
            wait_s=10,
        )
        assert report.ok and report.allocations == 1, report.as_json()
    finally:
        stopped(serve, node)


def test_after_an_outage_serve_node_and_keeper_each_say_reconnected_once(
    outage: Outage, tmp_path: Path
) -> None:
    port = free_port()
    node_name = f"outage-{RUN}-node"
    node = ReservoirProcess(node_name, node_args(node_name, tmp_path), outage.env)
    keeper = ReservoirProcess("keeper", ["keeper", "--name", f"outage-{RUN}-keeper"], outage.env)
    serve = ReservoirProcess("serve", ["serve", "--port", str(port)], outage.env)
    children = (serve, node, keeper)
    try:
        node.wait_for(NODE_READY)
        keeper.wait_for("ready")
        base_url = f"http://127.0.0.1:{port}"
        wait_until_ready(base_url, serve)
        with httpx.Client(base_url=base_url, timeout=30) as client:
            before = client.post("/v1/reservations", json=SHAPE)
            assert before.status_code == 201, before.text

            outage.proxy.refuse()
            assert outage.proxy.cut() >= 3  # one connection each, at least
            for child in children:
                child.wait_for("connection lost")
            # down for long enough that each fails several attempts (their backoff starts
            # at 0.1 s and doubles): real processes on a real proxy, no clock to fake
            time.sleep(3.0)
            assert client.get("/readyz").status_code == 503
            outage.proxy.restore()
            for child in children:
                child.wait_for("reconnected after")
            wait_until_ready(base_url, serve)
            after = client.post("/v1/reservations", json=SHAPE)
            assert after.status_code == 201, after.text

        for child in children:
            said = "".join(child.said)
            assert said.count("; reconnecting") == 1, said  # the loss, said once
            assert said.count("reconnected after") == 1, said
            assert "attempt(s)" in said
        assert serve.terminate() == 0, "".join(serve.said)
        report = audit_cluster(
            outage.direct_url,
            placements=read_placements(json.dumps(p.json()) for p in (before, after)),
            expect_nodes=1,
            wait_s=10,
        )
        assert report.ok and report.allocations == 2, report.as_json()
    finally:
        stopped(*children)
