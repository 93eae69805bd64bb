"""Faults between the participants and the real RabbitMQ, made by a loopback TCP proxy:
connections cut and stalled, a broker that is not up yet. Every test ends with the
cluster-wide audit."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest

from reservoir import NodeAgent, Requestor
from reservoir.broker import Broker
from reservoir.brokers import connect
from reservoir.runtime.auditor import audit_cluster
from reservoir.testing.tcp_proxy import TcpProxy

pytestmark = pytest.mark.rabbitmq


@pytest.fixture
def proxy(amqp_url: str) -> Iterator[TcpProxy]:
    with TcpProxy(urlsplit(amqp_url).port or 5672) as proxy:
        yield proxy


def through(url: str, proxy: TcpProxy, exchange: str) -> str:
    parts = urlsplit(url)
    netloc = f"{parts.netloc.rsplit('@', 1)[0]}@127.0.0.1:{proxy.port}"
    query = f"{parts.query}&" if parts.query else ""
    return urlunsplit(parts._replace(netloc=netloc, query=f"{query}exchange={exchange}"))


def wait_until(condition: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not callable(condition) or not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def test_the_proxy_carries_a_placement_and_participants_carry_on_after_a_cut(
    amqp_url: str, exchange: str, proxy: TcpProxy
) -> None:
    url = through(amqp_url, proxy, exchange)
    broker: Broker = connect(url)
    try:
        node = NodeAgent(broker, name="behind-proxy", vcpus=8, memory_mb=8192)
        with Requestor(broker) as requestor:
            first = requestor.reserve(vcpus=1, memory_mb=256, timeout_s=20)
            assert proxy.connections >= 1
            assert proxy.cut() >= 1
            # the adapter reconnects, re-creates the inboxes and bindings, and carries on
            second = requestor.reserve(vcpus=1, memory_mb=256, timeout_s=30)
            assert proxy.accepted >= 2
        found = audit_cluster(broker, placements=[first, second], expect_nodes=1, wait_s=10)
        assert found.ok, found.as_json()
        assert found.orphans == ()
        node.close()
    finally:
        broker.close()


def test_a_stalled_connection_delays_a_placement_but_does_not_lose_it(
    amqp_url: str, exchange: str, proxy: TcpProxy
) -> None:
    url = through(amqp_url, proxy, exchange)
    broker: Broker = connect(url)
    try:
        node = NodeAgent(broker, name="stalled", vcpus=8, memory_mb=8192)
        with Requestor(broker) as requestor:
            proxy.stall()
            future = requestor.submit(vcpus=1, memory_mb=256)
            time.sleep(1.0)  # real bytes held back by a real proxy: there is no fake clock
            assert not future.done()
            proxy.restore()
            placement = future.result(timeout=30)
        found = audit_cluster(broker, placements=[placement], expect_nodes=1, wait_s=10)
        assert found.ok, found.as_json()
        node.close()
    finally:
        broker.close()


def test_a_node_started_before_its_broker_waits_and_then_serves(
    amqp_url: str, exchange: str, proxy: TcpProxy
) -> None:
    url = through(amqp_url, proxy, exchange)
    proxy.refuse()
    process = subprocess.Popen(
        [sys.executable, "-m", "reservoir.cli", "node", "--name", "early",
         "--vcpus", "4", "--memory-mb", "4096", "--broker", url],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert process.stderr is not None
        attempts: list[str] = []
        while len(attempts) < 2:
            line = process.stderr.readline()
            assert line, "the node exited instead of waiting for its broker"
            if "cannot connect to" in line and "(attempt " in line:
                attempts.append(line)
        assert process.poll() is None
        proxy.restore()
        for line in iter(process.stderr.readline, ""):
            if "node early: ready" in line:
                break
        else:
            raise AssertionError("the node never became ready")
        with connect(url) as broker, Requestor(broker) as requestor:
            placement = requestor.reserve(vcpus=1, memory_mb=128, timeout_s=20)
            assert placement.nodes == ("early",)
            found = audit_cluster(broker, placements=[placement], expect_nodes=1, wait_s=10)
            assert found.ok, found.as_json()
    finally:
        process.terminate()
        process.wait(timeout=20)


def test_a_node_that_may_try_twice_gives_up_with_status_3(
    amqp_url: str, exchange: str, proxy: TcpProxy
) -> None:
    proxy.refuse()
    done = subprocess.run(
        [sys.executable, "-m", "reservoir.cli", "node", "--name", "impatient",
         "--vcpus", "4", "--memory-mb", "4096", "--connect-attempts", "2",
         "--broker", through(amqp_url, proxy, exchange)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 3
    assert done.stderr.count("(attempt 1)") == 1
    assert "Traceback" not in done.stderr


def test_an_id_placed_again_while_its_holder_was_cut_off_is_held_once_after_it_is_back(
    amqp_url: str, exchange: str, proxy: TcpProxy
) -> None:
    """The gap the full chaos run found, on the real RabbitMQ: the node holding job-7 is
    cut off (its exclusive inbox and bindings go with its connection), a second requestor
    asked for job-7 again finds nobody holding it and places it elsewhere. Once the holder
    is back it names the buckets of what it holds; the second requestor looks job-7 up
    again and frees the earlier placement, and the first requestor, hearing of the later
    one, leaves it alone."""
    parts = urlsplit(amqp_url)
    query = f"{parts.query}&" if parts.query else ""
    direct: Broker = connect(urlunsplit(parts._replace(query=f"{query}exchange={exchange}")))
    cut_off: Broker = connect(through(amqp_url, proxy, exchange))
    try:
        holder = NodeAgent(cut_off, name="holder", vcpus=8, memory_mb=8192)
        with Requestor(direct, name="first") as first:
            earlier = first.reserve(request_id="job-7", vcpus=1, memory_mb=256, timeout_s=20)
            assert earlier.nodes == ("holder",)
            elsewhere = NodeAgent(direct, name="elsewhere", vcpus=8, memory_mb=8192)
            proxy.refuse()
            assert proxy.cut() >= 1
            wait_until(lambda: not cut_off.connected)
            with Requestor(direct, name="second") as second:
                later = second.reserve(request_id="job-7", vcpus=1, memory_mb=256, timeout_s=20)
                assert later.nodes == ("elsewhere",)
                proxy.restore()
                wait_until(lambda: second.machine.counters["superseded_frees"] == 1)
                wait_until(lambda: holder.allocations() == [])
                # the first requestor heard of the later placement: it left it alone and
                # forgot its own, so a retry through it adopts the one that stands
                wait_until(lambda: first.machine.counters["superseded_placements"] == 1)
                again = first.reserve(request_id="job-7", vcpus=1, memory_mb=256, timeout_s=20)
                assert again.allocations == later.allocations
        found = audit_cluster(direct, placements=[later], expect_nodes=2, wait_s=10)
        assert found.ok, found.as_json()
        assert found.orphans == ()
        elsewhere.close()
        holder.close()
    finally:
        cut_off.close()
        direct.close()
