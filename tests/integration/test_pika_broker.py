"""What the pika adapter promises beyond the broker contract, on a real RabbitMQ.

Reconnection after RabbitMQ closes the connection, returns mapped to their sender, the
validated ``user_id``, confirms (nacks counted), the bounded buffer, thread hygiene. Every
test has its own exchange (deleted afterwards) and its own names. Tests wait on conditions,
never by sleeping.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit

import pika
import pika.exceptions
import pytest

from brokers import connect
from brokers.pika_broker import PikaBroker, strip_reservoir_params
from reservoir.broker import BrokerError, Delivery, Endpoint

pytestmark = pytest.mark.rabbitmq

WAIT_S = 10.0


class Collector:
    """A handler that records deliveries and lets the test wait for them."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self.deliveries: list[Delivery] = []

    def __call__(self, delivery: Delivery) -> None:
        with self._condition:
            self.deliveries.append(delivery)
            self._condition.notify_all()

    def wait_until(self, predicate: Callable[[list[Delivery]], bool], what: str) -> None:
        with self._condition:
            if not self._condition.wait_for(lambda: predicate(self.deliveries), WAIT_S):
                pytest.fail(f"timed out waiting for {what}; got {self.deliveries[-5:]}")

    def wait_for_body(self, body: bytes, *, returned: bool = False) -> Delivery:
        self.wait_until(
            lambda ds: any(d.body == body and d.returned == returned for d in ds), repr(body)
        )
        with self._condition:
            return next(d for d in self.deliveries if d.body == body and d.returned == returned)

    def wait_for_count(self, count: int) -> list[Delivery]:
        self.wait_until(lambda ds: sum(not d.returned for d in ds) >= count, f"{count} messages")
        with self._condition:
            return [d for d in self.deliveries if not d.returned]

    @property
    def returned(self) -> list[Delivery]:
        with self._condition:
            return [d for d in self.deliveries if d.returned]


@pytest.fixture
def ns() -> str:
    return f"it{uuid.uuid4().hex[:12]}"


@pytest.fixture
def admin(amqp_url: str) -> Iterator[pika.BlockingConnection]:
    """A plain pika connection for doing what the adapter would not (or must not) do."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    yield connection
    if connection.is_open:
        connection.close()


def _with_exchange(amqp_url: str, exchange: str) -> str:
    separator = "&" if "?" in amqp_url else "?"
    return f"{amqp_url}{separator}exchange={exchange}"


@pytest.fixture
def open_broker(amqp_url: str, exchange: str) -> Iterator[Callable[..., PikaBroker]]:
    """``open_broker(**options)``: a PikaBroker on this test's exchange, closed afterwards."""
    opened: list[PikaBroker] = []

    def make(query: str = "", **options: object) -> PikaBroker:
        url = _with_exchange(amqp_url, exchange) + (f"&{query}" if query else "")
        broker = PikaBroker(url, **options)  # type: ignore[arg-type]
        opened.append(broker)
        return broker

    yield make
    for broker in opened:
        broker.close()


# -- configuration --------------------------------------------------------------------------


def test_reservoir_params_are_stripped_and_credentials_masked(
    open_broker: Callable[..., PikaBroker], exchange: str
) -> None:
    url, ours = strip_reservoir_params(f"amqp://u:secret@h/vh?heartbeat=5&exchange={exchange}")
    assert ours == {"exchange": exchange}
    assert url == "amqp://u:secret@h/vh?heartbeat=5"
    broker = open_broker()
    assert broker.exchange == exchange
    assert "guest" not in broker.url.split("@")[0].split(":", 2)[-1]
    assert "***" in broker.url


def test_connect_picks_pika_for_amqp_urls(amqp_url: str, exchange: str) -> None:
    broker = connect(_with_exchange(amqp_url, exchange))
    try:
        assert isinstance(broker, PikaBroker)
    finally:
        broker.close()


def test_unreachable_broker_fails_fast_with_broker_error() -> None:
    with pytest.raises(BrokerError):
        # Port 1 refuses at once; one attempt, no backoff.
        PikaBroker("amqp://guest:guest@127.0.0.1:1/", connect_attempts=1)


def test_wrong_credentials_fail_at_once(amqp_url: str) -> None:
    parts = urlsplit(amqp_url)
    wrong = parts._replace(
        netloc=f"{parts.username}:not-the-password@{parts.hostname}:{parts.port}"
    )
    with pytest.raises(BrokerError, match="ACCESS_REFUSED"):
        PikaBroker(wrong.geturl(), connect_attempts=5, reconnect_initial_s=5.0)  # no retries


def test_exchange_of_another_type_is_refused_at_once(
    open_broker: Callable[..., PikaBroker], admin: pika.BlockingConnection, exchange: str
) -> None:
    admin.channel().exchange_declare(exchange, "direct")
    with pytest.raises(BrokerError, match="PRECONDITION_FAILED"):
        open_broker(connect_attempts=5, reconnect_initial_s=5.0)  # no retries


def test_connection_is_named_and_heartbeat_comes_from_the_url(
    open_broker: Callable[..., PikaBroker], rabbitmqctl: Callable[..., str]
) -> None:
    broker = open_broker("heartbeat=7")
    lines = rabbitmqctl("list_connections", "--no-table-headers", "timeout", "client_properties")
    ours = [line for line in lines.splitlines() if f'"{broker.connection_name}"' in line]
    assert len(ours) == 1
    assert ours[0].split("\t", 1)[0] == "7"


# -- topology: the inbox exchange ---------------------------------------------------------


def _exists(admin: pika.BlockingConnection, name: str) -> bool:
    try:
        admin.channel().exchange_declare(name, passive=True)
    except pika.exceptions.ChannelClosedByBroker as error:
        if error.reply_code == 404:
            return False
        raise
    return True


def test_sends_go_through_the_inbox_exchange_by_address(
    open_broker: Callable[..., PikaBroker],
    admin: pika.BlockingConnection,
    exchange: str,
    ns: str,
) -> None:
    broker = open_broker()
    assert broker.inbox_exchange == f"{exchange}.inbox"
    # Both durable topic exchanges: an equivalent active declare is accepted.
    for name in (exchange, f"{exchange}.inbox"):
        admin.channel().exchange_declare(name, "topic", durable=True, auto_delete=False)

    # What the adapter sends reaches whatever is bound to the inbox exchange by address ...
    channel = admin.channel()
    spy = channel.queue_declare(f"{ns}-spy", exclusive=True).method.queue
    channel.queue_bind(spy, f"{exchange}.inbox", routing_key=f"{ns}-spy")
    sent = Collector()
    sender = broker.open_endpoint(sent)
    sender.send(f"{ns}-spy", b"to the spy")
    method, properties, body = _get_one(channel, spy)
    assert (method.exchange, method.routing_key, body) == (
        f"{exchange}.inbox",
        f"{ns}-spy",
        b"to the spy",
    )
    assert properties.user_id == "guest"

    # ... and an endpoint is bound there by its own address (and only that: no wildcard).
    receiver = Collector()
    receiver_ep = broker.open_endpoint(receiver, name=f"{ns}.node.a")
    channel.basic_publish(f"{exchange}.inbox", f"{ns}.node.a", b"via inbox")
    channel.basic_publish("", f"{ns}.node.a", b"via the default exchange")
    assert receiver.wait_for_body(b"via inbox").topic is None
    assert receiver.wait_for_body(b"via the default exchange").topic is None
    sender.send(f"{ns}.node.b", b"to a sibling")
    assert sender.address != receiver_ep.address
    assert sent.wait_for_body(b"to a sibling", returned=True).topic is None
    assert all(d.body != b"to a sibling" for d in receiver.deliveries)
    stats = broker.stats
    assert (stats.sent, stats.published) == (2, 0)


def _get_one(channel: Any, queue_name: str) -> tuple[Any, Any, bytes]:
    """The next message on ``queue_name`` (waits, without sleeping, through consume)."""
    for method, properties, body in channel.consume(queue_name, inactivity_timeout=WAIT_S):
        assert method is not None, f"nothing arrived on {queue_name} in {WAIT_S}s"
        channel.basic_ack(method.delivery_tag)
        channel.cancel()
        return method, properties, body
    raise AssertionError("unreachable")


@pytest.mark.parametrize("name", ["node.*", "node.#", "#", "a*b"])
def test_endpoint_names_with_wildcards_are_refused(
    open_broker: Callable[..., PikaBroker], name: str
) -> None:
    broker = open_broker()
    with pytest.raises(ValueError, match=r"'\*' or '#'"):
        broker.open_endpoint(Collector(), name=name)
    broker.open_endpoint(Collector())  # and the broker carries on


def test_amq_exchanges_are_refused(amqp_url: str) -> None:
    with pytest.raises(ValueError, match=r"amq\.topic\.inbox"):
        PikaBroker(_with_exchange(amqp_url, "amq.topic"))


def test_delete_exchanges_deletes_both_before_or_after_close_and_is_idempotent(
    amqp_url: str, admin: pika.BlockingConnection, ns: str
) -> None:
    for when in ("open", "closed"):
        name = f"it-delete-{when}-{uuid.uuid4().hex}"
        broker = PikaBroker(_with_exchange(amqp_url, name))
        try:
            endpoint = broker.open_endpoint(Collector(), name=f"{ns}-{when}")
            endpoint.bind(f"{ns}.t")
            assert _exists(admin, name)
            assert _exists(admin, f"{name}.inbox")
            if when == "closed":
                broker.close()
            broker.delete_exchanges()
            assert not _exists(admin, name)
            assert not _exists(admin, f"{name}.inbox")
            broker.delete_exchanges()  # already gone: no error
        finally:
            broker.close()


# -- reconnection -------------------------------------------------------------------------


def test_reconnects_after_forced_close_with_same_address_and_bindings(
    open_broker: Callable[..., PikaBroker], close_connection: Callable[[str], None], ns: str
) -> None:
    broker = open_broker(reconnect_initial_s=0.05)
    node = Collector()
    node_ep = broker.open_endpoint(node, name=f"{ns}-node")
    node_ep.bind(f"{ns}.tier.#")
    requestor = Collector()
    requestor_ep = broker.open_endpoint(requestor)
    requestor_ep.publish(f"{ns}.tier.10", b"before")
    node.wait_for_body(b"before")

    close_connection(broker.connection_name)
    # Straight after the kill, before or after the adapter noticed: a publish is buffered
    # (or re-published unconfirmed) and a bind waits for the reconnect or is redone by it.
    requestor_ep.publish(f"{ns}.tier.10", b"during")
    node_ep.bind(f"{ns}.extra")
    assert broker.wait_connected(WAIT_S, min_reconnects=1)

    assert node_ep.address == f"{ns}-node"
    requestor_ep.publish(f"{ns}.tier.25", b"after, on the old binding")
    requestor_ep.publish(f"{ns}.extra", b"after, on the new binding")
    requestor_ep.send(f"{ns}-node", b"after, by address")
    requestor_ep.publish(f"{ns}.nobody", b"after, unroutable")
    for body in (b"during", b"after, on the old binding", b"after, on the new binding"):
        node.wait_for_body(body)
    node.wait_for_body(b"after, by address")
    requestor.wait_for_body(b"after, unroutable", returned=True)
    # The requestor's generated address survived too: the node can still answer it.
    node_ep.send(requestor_ep.address, b"reply")
    requestor.wait_for_body(b"reply")
    assert broker.stats.reconnects == 1


def test_name_held_by_another_connection_is_refused_and_the_broker_carries_on(
    open_broker: Callable[..., PikaBroker], ns: str
) -> None:
    first, second = open_broker(), open_broker()
    first.open_endpoint(Collector(), name=f"{ns}-taken")
    with pytest.raises(BrokerError, match="405"):
        second.open_endpoint(Collector(), name=f"{ns}-taken")
    # The refused declare cost its control channel only: the broker still works.
    receiver = Collector()
    receiver_ep = second.open_endpoint(receiver, name=f"{ns}-free")
    receiver_ep.bind(f"{ns}.t")
    second.open_endpoint(Collector()).publish(f"{ns}.t", b"still working")
    receiver.wait_for_body(b"still working")
    assert second.stats.reconnects == 0


# -- returns, user_id ---------------------------------------------------------------------


def test_returns_reach_their_own_sender_with_the_topic(
    open_broker: Callable[..., PikaBroker], ns: str
) -> None:
    broker = open_broker()
    a, b = Collector(), Collector()
    a_ep, b_ep = broker.open_endpoint(a), broker.open_endpoint(b)
    a_ep.publish(f"{ns}.tier.10", b"a-publish")
    b_ep.publish(f"{ns}.tier.50", b"b-publish")
    a_ep.send(f"{ns}-nobody", b"a-send")
    returned = a.wait_for_body(b"a-publish", returned=True)
    assert returned.topic == f"{ns}.tier.10"
    assert returned.user_id == "guest"
    assert a.wait_for_body(b"a-send", returned=True).topic is None
    assert b.wait_for_body(b"b-publish", returned=True).topic == f"{ns}.tier.50"
    assert [d.body for d in a.returned] == [b"a-publish", b"a-send"]
    assert [d.body for d in b.returned] == [b"b-publish"]


def test_user_id_is_the_authenticated_user_and_rabbitmq_checks_it(
    open_broker: Callable[..., PikaBroker],
    admin: pika.BlockingConnection,
    exchange: str,
    ns: str,
) -> None:
    broker = open_broker()
    receiver = Collector()
    receiver_ep = broker.open_endpoint(receiver, name=f"{ns}-inbox")
    receiver_ep.bind(f"{ns}.t")
    broker.open_endpoint(Collector()).publish(f"{ns}.t", b"from the adapter")
    assert receiver.wait_for_body(b"from the adapter").user_id == "guest"

    channel = admin.channel()
    channel.basic_publish(exchange, f"{ns}.t", b"anonymous")
    assert receiver.wait_for_body(b"anonymous").user_id is None
    # A forged user_id never reaches anyone: RabbitMQ closes the channel instead.
    channel.basic_publish(exchange, f"{ns}.t", b"forged", pika.BasicProperties(user_id="mallory"))
    with pytest.raises(pika.exceptions.ChannelClosedByBroker) as refused:
        channel.queue_declare("", exclusive=True)  # any round trip surfaces the close
    assert refused.value.reply_code == 406
    broker.open_endpoint(Collector()).send(f"{ns}-inbox", b"marker")
    receiver.wait_for_body(b"marker")
    assert all(d.body != b"forged" for d in receiver.deliveries)


# -- confirms, buffering, threads ----------------------------------------------------------


def test_nacked_publish_is_counted(
    open_broker: Callable[..., PikaBroker],
    admin: pika.BlockingConnection,
    exchange: str,
    ns: str,
) -> None:
    broker = open_broker()
    channel = admin.channel()
    # A queue that refuses every message: RabbitMQ nacks what is routed to it.
    full = channel.queue_declare(
        f"{ns}-full", exclusive=True, arguments={"x-max-length": 0, "x-overflow": "reject-publish"}
    ).method.queue
    channel.queue_bind(full, exchange, f"{ns}.full")
    sender = Collector()
    sender_ep = broker.open_endpoint(sender)
    sender_ep.publish(f"{ns}.full", b"refused")
    sender_ep.publish(f"{ns}.nobody", b"marker")
    sender.wait_for_body(b"marker", returned=True)
    broker.close()  # waits for every confirm
    stats = broker.stats
    assert stats.nacked == 1
    assert stats.confirmed == 1  # the marker: returned, then acked
    assert stats.abandoned == 0
    assert [d.body for d in sender.returned] == [b"marker"]  # routed, so not returned


def test_concurrent_publishers_on_one_endpoint_from_8_threads(
    open_broker: Callable[..., PikaBroker], ns: str
) -> None:
    broker = open_broker()
    receiver = Collector()
    broker.open_endpoint(receiver).bind(f"{ns}.seq")
    shared = broker.open_endpoint(Collector())
    threads_n, per_thread = 8, 500
    start = threading.Barrier(threads_n)

    def run(index: int) -> None:
        start.wait(timeout=WAIT_S)
        for i in range(per_thread):
            shared.publish(f"{ns}.seq", f"{index}:{i}".encode())

    threads = [threading.Thread(target=run, args=(i,)) for i in range(threads_n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    received = receiver.wait_for_count(threads_n * per_thread)
    for index in range(threads_n):
        prefix = f"{index}:".encode()
        sequence = [int(d.body[len(prefix) :]) for d in received if d.body.startswith(prefix)]
        assert sequence == list(range(per_thread))
    broker.close()
    stats = broker.stats
    assert stats.published == stats.confirmed == threads_n * per_thread
    assert stats.nacked == stats.abandoned == 0


def test_handler_rebinds_from_inside_the_handler(
    open_broker: Callable[..., PikaBroker], ns: str
) -> None:
    # A node crossing a tier boundary re-binds from within its message handler.
    broker = open_broker()
    moved = threading.Event()
    node: list[Endpoint] = []
    seen = Collector()

    def handler(delivery: Delivery) -> None:
        seen(delivery)
        if delivery.body == b"move":
            node[0].unbind(f"{ns}.tier.10")
            node[0].bind(f"{ns}.tier.50")
            moved.set()

    node.append(broker.open_endpoint(handler))
    node[0].bind(f"{ns}.tier.10")
    sender = Collector()
    sender_ep = broker.open_endpoint(sender)
    sender_ep.publish(f"{ns}.tier.10", b"move")
    assert moved.wait(WAIT_S)
    sender_ep.publish(f"{ns}.tier.10", b"old tier")
    sender_ep.publish(f"{ns}.tier.50", b"new tier")
    seen.wait_for_body(b"new tier")
    sender.wait_for_body(b"old tier", returned=True)


def test_publishes_beyond_max_pending_fail_fast(
    open_broker: Callable[..., PikaBroker], ns: str
) -> None:
    broker = open_broker(max_pending=3)
    receiver = Collector()
    broker.open_endpoint(receiver).bind(f"{ns}.t")
    sender = broker.open_endpoint(Collector())
    # Hold the IO thread, as a long outage would: nothing gets confirmed meanwhile.
    release = threading.Event()
    broker._ioloop.add_callback_threadsafe(lambda: release.wait(WAIT_S))
    try:
        for i in range(3):
            sender.publish(f"{ns}.t", b"%d" % i)
        with pytest.raises(BrokerError, match="waiting for RabbitMQ"):
            sender.publish(f"{ns}.t", b"one too many")
    finally:
        release.set()
    assert [d.body for d in receiver.wait_for_count(3)] == [b"0", b"1", b"2"]


def test_close_joins_its_threads_even_from_a_handler(
    open_broker: Callable[..., PikaBroker], ns: str
) -> None:
    broker = open_broker()
    mine = [t for t in threading.enumerate() if t.name.startswith(f"{broker.connection_name}:")]
    assert sorted(t.name.rsplit(":", 1)[1] for t in mine) == ["dispatch", "io"]
    closed = threading.Event()

    def close_broker(delivery: Delivery) -> None:
        broker.close()  # from the dispatcher thread: must not join itself
        closed.set()

    endpoint = broker.open_endpoint(close_broker, name=f"{ns}-closer")
    broker.open_endpoint(Collector()).send(endpoint.address, b"close")
    assert closed.wait(WAIT_S)
    for thread in mine:
        thread.join(WAIT_S)  # the dispatcher finishes the handler, then stops
        assert not thread.is_alive(), thread.name
    broker.close()  # idempotent
    assert broker.closed
