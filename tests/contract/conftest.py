"""Fixtures for the broker contract: every adapter runs the same tests.

To put another broker under contract, add one ``pytest.param`` to ``BROKERS``: a factory
that takes the fixture request and returns a connected :class:`~reservoir.broker.Broker`
(it may ask the request for fixtures such as ``reservoir_amqp_url``, which skips when no
broker is reachable, and register finalizers, which run after the broker is closed), an
id, and a mark such as ``pytest.mark.rabbitmq`` if it needs one.

Tests never sleep: a :class:`Collector` wakes the test on a condition when deliveries
arrive, and a test that must show something did *not* arrive sends a marker after it on the
same path and waits for the marker (per-sender FIFO makes that sound).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterable, Iterator

import pytest

from brokers import connect
from brokers.inprocess import InProcessBroker
from reservoir.broker import Broker, Delivery, Endpoint

#: generous: a healthy broker answers in milliseconds; only a hang ever waits this long
WAIT_S = 10.0


def _inprocess(request: pytest.FixtureRequest) -> Broker:
    return InProcessBroker()


def _on_rabbitmq(adapter: str) -> Callable[[pytest.FixtureRequest], Broker]:
    """A factory for the ``adapter`` (``pika`` or ``kombu``) on a real RabbitMQ, on exchanges
    of its own, deleted afterwards."""

    def open_broker(request: pytest.FixtureRequest) -> Broker:
        amqp_url: str = request.getfixturevalue("reservoir_amqp_url")
        separator = "&" if "?" in amqp_url else "?"
        url = f"{amqp_url}{separator}exchange=contract-{uuid.uuid4().hex}"
        broker = connect(f"kombu+{url}" if adapter == "kombu" else url)
        # Registered before the broker fixture's own teardown, so it runs after broker.close()
        # (delete_exchanges uses a connection of its own).
        request.addfinalizer(broker.delete_exchanges)  # type: ignore[attr-defined]
        return broker

    return open_broker


BROKERS = [
    pytest.param(_inprocess, id="inprocess"),
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
