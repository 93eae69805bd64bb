"""Fixtures for the broker contract: every adapter runs the same tests.

To put another broker under contract, add one ``pytest.param`` to ``BROKERS``: a factory
that takes the fixture request and returns a connected :class:`~reservoir.broker.Broker`
(it may ask the request for fixtures such as ``reservoir_amqp_broker_url``, which skips when no
broker is reachable, and register finalizers, which run after the broker is closed), an
id, and a mark such as ``pytest.mark.rabbitmq`` if it needs one.

Tests never sleep: a :class:`Collector` wakes the test on a condition when deliveries
arrive, and a test that must show something did *not* arrive sends a marker after it on the
same path and waits for the marker (per-sender FIFO makes that sound).

What only the two RabbitMQ drivers share (reconnection, confirms and stats, returns and
``user_id``, flow control, cancelled consumers, refusals) is tested by
``test_amqp_contract.py`` over ``AMQP_DRIVERS``, with these fixtures: ``open_amqp`` (a
driver on an exchange of the test's own, deleted afterwards), ``ctl`` (``rabbitmqctl``,
which must manage the RabbitMQ under test: the machine's own, or ``docker exec`` into the
testcontainers broker; skipped where it cannot, failed under ``CI``)
and ``restricted_user`` (a user of the test's own, deleted afterwards).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

import pytest

from reservoir.broker import Broker, Delivery, Endpoint
from reservoir.brokers import BrokerUrl, admin, connect
from reservoir.brokers.amqp.threaded import AmqpBroker
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.brokers.kombu_broker import KombuBroker
from reservoir.brokers.pika_broker import PikaBroker
from reservoir.testing.rabbitmq import rabbitmqctl_command

#: generous: a healthy broker answers in milliseconds; only a hang ever waits this long
WAIT_S = 10.0


def _inprocess(request: pytest.FixtureRequest) -> Broker:
    return InProcessBroker()


def _loopback(request: pytest.FixtureRequest) -> Broker:
    """The AMQP session and threaded front of both RabbitMQ drivers, with RabbitMQ played
    in memory (see loopback.py): the contract without a broker, and without a client."""
    from loopback import LoopbackBroker

    return LoopbackBroker()


def _on_rabbitmq(adapter: str) -> Callable[[pytest.FixtureRequest], Broker]:
    """A factory for the ``adapter`` (``pika`` or ``kombu``) on a real RabbitMQ, on exchanges
    of its own, deleted afterwards."""

    def open_broker(request: pytest.FixtureRequest) -> Broker:
        # the plugin's fixture, asked for here, is torn down after the broker fixture: its
        # exchanges are deleted after broker.close()
        url: str = request.getfixturevalue("reservoir_amqp_url")
        return connect(f"kombu+{url}" if adapter == "kombu" else url)

    return open_broker


BROKERS = [
    pytest.param(_inprocess, id="inprocess"),
    pytest.param(_loopback, id="amqp-session"),
    pytest.param(_on_rabbitmq("kombu"), id="kombu", marks=pytest.mark.rabbitmq),
    pytest.param(_on_rabbitmq("pika"), id="pika", marks=pytest.mark.rabbitmq),
]


@pytest.fixture(params=BROKERS)
def broker(request: pytest.FixtureRequest) -> Iterator[Broker]:
    factory: Callable[[pytest.FixtureRequest], Broker] = request.param
    opened = factory(request)
    try:
        yield opened
    finally:
        opened.close()


@pytest.fixture
def ns() -> str:
    """A unique prefix for this test's topics and names, so runs on a shared RabbitMQ
    never hear each other."""
    return f"rc{uuid.uuid4().hex[:12]}"


class Collector:
    """A handler that records every delivery and lets a test wait for them.

    ``endpoint`` is the endpoint it was opened with, when the ``inbox`` fixture opened it.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._deliveries: list[Delivery] = []
        self.endpoint: Endpoint | None = None

    def __call__(self, delivery: Delivery) -> None:
        with self._condition:
            self._deliveries.append(delivery)
            self._condition.notify_all()

    # -- what arrived -----------------------------------------------------------------------

    @property
    def ep(self) -> Endpoint:
        assert self.endpoint is not None, "this collector was not opened by the inbox fixture"
        return self.endpoint

    @property
    def address(self) -> str:
        return self.ep.address

    @property
    def deliveries(self) -> list[Delivery]:
        with self._condition:
            return list(self._deliveries)

    @property
    def received(self) -> list[Delivery]:
        """Deliveries from others (not our own messages coming back)."""
        return [d for d in self.deliveries if not d.returned]

    @property
    def returned(self) -> list[Delivery]:
        """Our own publishes and sends that reached nobody."""
        return [d for d in self.deliveries if d.returned]

    @property
    def bodies(self) -> list[bytes]:
        """Bodies of the deliveries from others, in arrival order."""
        return [d.body for d in self.received]

    # -- waiting --------------------------------------------------------------------------

    def wait_until(
        self,
        predicate: Callable[[list[Delivery]], bool],
        what: str,
        timeout_s: float = WAIT_S,
    ) -> list[Delivery]:
        """Block until ``predicate(all deliveries so far)`` holds; fail the test after
        ``timeout_s``. Returns every delivery so far."""
        with self._condition:
            if not self._condition.wait_for(lambda: predicate(self._deliveries), timeout_s):
                got = [(d.body[:40], d.topic, d.returned) for d in self._deliveries[-10:]]
                pytest.fail(
                    f"timed out after {timeout_s}s waiting for {what}; "
                    f"{len(self._deliveries)} deliveries, the last ones: {got}"
                )
            return list(self._deliveries)

    def arrives(self, predicate: Callable[[list[Delivery]], bool], timeout_s: float = 0.1) -> bool:
        """Whether ``predicate(all deliveries so far)`` comes to hold within ``timeout_s``
        (for a test that retries; it does not fail the test)."""
        with self._condition:
            return self._condition.wait_for(lambda: predicate(self._deliveries), timeout_s)

    def wait_for_count(self, count: int, timeout_s: float = WAIT_S) -> list[Delivery]:
        """Wait for ``count`` deliveries from others; return them."""
        self.wait_until(
            lambda ds: sum(not d.returned for d in ds) >= count,
            f"{count} deliveries",
            timeout_s,
        )
        return self.received

    def wait_for_body(self, body: bytes, timeout_s: float = WAIT_S) -> Delivery:
        """Wait for a delivery from others with this body; return it."""
        self.wait_until(
            lambda ds: any(d.body == body and not d.returned for d in ds),
            f"a delivery of {body[:40]!r}",
            timeout_s,
        )
        return next(d for d in self.received if d.body == body)

    def wait_for_return(self, body: bytes, timeout_s: float = WAIT_S) -> Delivery:
        """Wait for our own message with this body to come back; return it."""
        self.wait_until(
            lambda ds: any(d.body == body and d.returned for d in ds),
            f"{body[:40]!r} to come back",
            timeout_s,
        )
        return next(d for d in self.returned if d.body == body)


@pytest.fixture
def new_collector() -> Callable[[], Collector]:
    """Makes a :class:`Collector` for a test that opens its endpoint itself."""
    return Collector


@pytest.fixture
def inbox(broker: Broker) -> Iterator[Callable[..., Collector]]:
    """A factory: ``inbox(name=None, bind=())`` opens an endpoint whose handler is a new
    :class:`Collector`, binds its patterns, and returns the collector. Every endpoint it
    opened is closed after the test."""
    opened: list[Endpoint] = []

    def open_inbox(name: str | None = None, bind: Iterable[str] = ()) -> Collector:
        collector = Collector()
        endpoint = broker.open_endpoint(collector, name=name)
        opened.append(endpoint)
        collector.endpoint = endpoint
        for pattern in bind:
            endpoint.bind(pattern)
        return collector

    yield open_inbox
    for endpoint in opened:
        endpoint.close()


# -- the two RabbitMQ drivers ---------------------------------------------------------------

AMQP_DRIVERS = [
    pytest.param("pika", marks=pytest.mark.rabbitmq),
    pytest.param("kombu", marks=pytest.mark.rabbitmq),
]

OpenAmqp = Callable[..., AmqpBroker]


def driver_url(driver: str, amqp_url: str) -> str:
    """``amqp_url`` as the URL ``driver`` (``pika`` or ``kombu``) is reached by."""
    return f"kombu+{amqp_url}" if driver == "kombu" else amqp_url


@pytest.fixture(params=AMQP_DRIVERS)
def driver(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def amqp_exchange(reservoir_amqp_broker_url: str) -> Iterator[str]:
    """An exchange name of the test's own; it and its inbox exchange are deleted after."""
    name = f"contract-{uuid.uuid4().hex}"
    yield name
    topology = admin(BrokerUrl.parse(reservoir_amqp_broker_url).with_exchange(name))
    assert topology is not None
    topology.delete_reservoir_exchanges()


@pytest.fixture
def open_amqp(
    driver: str, reservoir_amqp_broker_url: str, amqp_exchange: str
) -> Iterator[OpenAmqp]:
    """``open_amqp(url=None, **options)``: the driver on the test's exchange (``url``: the
    RabbitMQ URL to use instead, e.g. with other credentials); closed after the test."""
    opened: list[AmqpBroker] = []
    driver_class = {"pika": PikaBroker, "kombu": KombuBroker}[driver]

    def open_one(url: str | None = None, **options: Any) -> AmqpBroker:
        base = BrokerUrl.parse(driver_url(driver, url or reservoir_amqp_broker_url))
        broker = driver_class(base.with_exchange(amqp_exchange), **options)
        opened.append(broker)
        return broker

    yield open_one
    for broker in opened:
        broker.close()


class Ctl:
    """``rabbitmqctl`` on the RabbitMQ under test: ``command`` runs it (the machine's own,
    or ``docker exec`` into the container serving the URL)."""

    def __init__(self, command: list[str]) -> None:
        self.command = command

    def __call__(self, *args: str) -> str:
        done = subprocess.run(
            [*self.command, "-q", *args], capture_output=True, text=True, timeout=60, check=False
        )
        if done.returncode != 0:
            raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {done.stderr or done.stdout}")
        return done.stdout

    def pids_named(self, connection_name: str) -> list[str]:
        """The connections announcing exactly ``connection_name``: only ever ours."""
        rows = self("list_connections", "--no-table-headers", "pid", "client_properties")
        return [r.split("\t", 1)[0] for r in rows.splitlines() if f'"{connection_name}"' in r]

    def close_connection(self, connection_name: str) -> None:
        """Close our one connection from the server side, as an operator would."""
        (pid,) = self.pids_named(connection_name)
        self("close_connection", pid, "reservoir contract test")


@pytest.fixture(scope="session")
def ctl(reservoir_amqp_broker_url: str) -> Ctl:
    """:class:`Ctl`, once a connection of ours is seen through it (so it manages the
    RabbitMQ the URL reaches, not another one)."""

    def unavailable(reason: str) -> None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must be able to manage its RabbitMQ: {reason}", pytrace=False)
        pytest.skip(f"rabbitmqctl cannot manage the RabbitMQ under test: {reason}")

    command = rabbitmqctl_command(reservoir_amqp_broker_url)
    if shutil.which(command[0]) is None:
        unavailable(f"{command[0]} is not on PATH")
    ctl = Ctl(command)
    probe_url = BrokerUrl.parse(reservoir_amqp_broker_url).with_exchange(
        f"ctl-probe-{uuid.uuid4().hex}"
    )
    probe = connect(probe_url)
    try:
        seen = ctl.pids_named(probe.connection_name)  # type: ignore[attr-defined]
    except (OSError, subprocess.SubprocessError, RuntimeError) as error:
        unavailable(str(error))
    finally:
        probe.close()
        topology = admin(probe_url)
        assert topology is not None
        topology.delete_reservoir_exchanges()
    if len(seen) != 1:
        unavailable("it manages another RabbitMQ than the one the URL reaches")
    return ctl


@dataclass(frozen=True)
class RestrictedUser:
    name: str
    #: the RabbitMQ URL with this user's credentials
    url: str


@pytest.fixture
def restricted_user(
    ctl: Ctl, reservoir_amqp_broker_url: str, amqp_exchange: str
) -> Iterator[Callable[[str], RestrictedUser]]:
    """``restricted_user(may_send_to)``: a user of the test's own who may do everything on
    the vhost but send (on the test's inbox exchange) only to addresses matching the regex
    ``may_send_to``; deleted after the test, whatever happened."""
    made: list[str] = []
    parts = urlsplit(reservoir_amqp_broker_url)
    vhost = BrokerUrl.parse(reservoir_amqp_broker_url).vhost

    def make(may_send_to: str) -> RestrictedUser:
        name = f"reservoir-contract-{uuid.uuid4().hex[:12]}"
        password = uuid.uuid4().hex
        ctl("add_user", name, password)
        made.append(name)
        ctl("set_permissions", "-p", vhost, name, ".*", ".*", ".*")
        ctl("set_topic_permissions", "-p", vhost, name, f"{amqp_exchange}.inbox", may_send_to, ".*")
        host = f"{parts.hostname}:{parts.port or 5672}"
        url = urlsplit(reservoir_amqp_broker_url)._replace(
            netloc=f"{quote(name)}:{password}@{host}"
        )
        return RestrictedUser(name, url.geturl())

    yield make
    for name in made:
        ctl("delete_user", name)
