"""What the kombu adapter promises beyond the broker contract, on a real RabbitMQ.

The contract suite (tests/contract) already runs against this adapter; these tests cover
what only it has: refused transports, returns and ``user_id`` over AMQP, thread ownership,
recovery after a forced close (``rabbitmqctl close_connection``) and after a silent peer
(heartbeats, through a proxy that stops forwarding), the bounds that keep a silent or
blocking RabbitMQ from growing memory or hanging ``close``, and interoperation with the
pika adapter on one exchange.

Nothing sleeps to wait: handlers wake the test through a Condition, and reconnection is
awaited with :meth:`KombuBroker.wait_for_connections`.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
from amqp.exceptions import NotFound
from kombu import Connection

from brokers import connect
from brokers.amqp.session import Session
from brokers.kombu_broker import KombuBroker
from reservoir.broker import BrokerError, Delivery, Endpoint, UnsupportedBroker

WAIT_S = 10.0

OpenBroker = Callable[..., KombuBroker]


class Inbox:
    """A handler that records deliveries, and lets the test wait on them."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self.deliveries: list[Delivery] = []
        self.threads: set[str] = set()

    def __call__(self, delivery: Delivery) -> None:
        with self._condition:
            self.deliveries.append(delivery)
            self.threads.add(threading.current_thread().name)
            self._condition.notify_all()

    def wait(self, predicate: Callable[[list[Delivery]], bool], what: str) -> list[Delivery]:
        with self._condition:
            if not self._condition.wait_for(lambda: predicate(self.deliveries), WAIT_S):
                pytest.fail(f"timed out waiting for {what}; got {self.deliveries[-5:]}")
            return list(self.deliveries)

    def wait_for_body(self, body: bytes, *, returned: bool = False) -> Delivery:
        self.wait(
            lambda ds: any(d.body == body and d.returned == returned for d in ds),
            f"{body!r} (returned={returned})",
        )
        return next(d for d in self.deliveries if d.body == body and d.returned == returned)

    def wait_for_count(self, count: int) -> list[Delivery]:
        return self.wait(lambda ds: len(ds) >= count, f"{count} deliveries")


def _with_exchange(amqp_url: str, exchange: str) -> str:
    separator = "&" if "?" in amqp_url else "?"
    return f"kombu+{amqp_url}{separator}exchange={exchange}"


@pytest.fixture
def open_broker(amqp_url: str, exchange: str) -> Iterator[OpenBroker]:
    """``open_broker(url=None, **options)``: a KombuBroker on this test's exchange (or on
    ``url``), closed after the test."""
    opened: list[KombuBroker] = []

    def open_one(url: str | None = None, **options: Any) -> KombuBroker:
        broker = KombuBroker(url or _with_exchange(amqp_url, exchange), **options)
        opened.append(broker)
        return broker

    yield open_one
    for broker in opened:
        broker.close()


def _via(amqp_url: str, port: int) -> str:
    """``amqp_url`` pointed at 127.0.0.1:``port`` instead, credentials kept."""
    parts = urlsplit(amqp_url)
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, ""))


def _threads_of(broker: KombuBroker) -> set[str]:
    prefix = f"{broker.connection_name}:"
    return {t.name for t in threading.enumerate() if t.name.startswith(prefix)}


# -- refused transports (no RabbitMQ needed) ------------------------------------------------


@pytest.mark.parametrize(
    ("url", "lacking"),
    [
        ("kombu+redis://127.0.0.1:6379/0", "basic.return"),
        ("kombu+rediss://127.0.0.1:6380/0", "neither exclusive nor removed"),
        ("kombu+memory://", "polling_interval"),
        ("kombu+memory://", "'a.#' does not match 'a'"),
        ("kombu+sqs://", "basic.return"),
        ("kombu+librabbitmq://127.0.0.1//", "py-amqp"),
    ],
)
def test_transports_that_cannot_honour_the_contract_are_refused(url: str, lacking: str) -> None:
    before = set(threading.enumerate())
    with pytest.raises(UnsupportedBroker, match="cannot honour") as refused:
        connect(url)
    message = str(refused.value)
    assert lacking in message
    assert "kombu+amqp://" in message  # says what would work
    assert set(threading.enumerate()) == before  # refused before anything started


def test_malformed_urls_are_refused() -> None:
    with pytest.raises(ValueError, match="exchange"):
        KombuBroker("kombu+amqp://guest:guest@127.0.0.1:5672//?exchange=")
    with pytest.raises(ValueError, match="kombu cannot use"):
        KombuBroker("kombu+amqp://guest:guest@127.0.0.1:5672//?no_such_kombu_option=1")


def test_unreachable_broker_fails_the_constructor() -> None:
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(BrokerError, match="connect"):
        KombuBroker(f"kombu+amqp://guest:guest@127.0.0.1:{port}//", connect_attempts=2)
    assert time.monotonic() - started < 5


# -- on RabbitMQ ----------------------------------------------------------------------------


@pytest.mark.rabbitmq
def test_url_and_topology(open_broker: OpenBroker, amqp_url: str, exchange: str) -> None:
    broker = open_broker()
    assert broker.exchange == exchange
    assert f"exchange={exchange}" in broker.url
    password = urlsplit(amqp_url).password
    if password:
        assert f":{password}@" not in broker.url
    with Connection(amqp_url) as admin:
        # Passive declare: the exchange exists, durable topic, as the pika adapter makes it.
        admin.default_channel.exchange_declare(
            exchange, "topic", durable=True, auto_delete=False, passive=True
        )


def _exists(amqp_url: str, name: str) -> bool:
    with Connection(amqp_url) as admin:
        try:
            admin.default_channel.exchange_declare(name, "topic", passive=True)
        except NotFound:
            return False
        return True


@pytest.mark.rabbitmq
def test_sends_go_through_the_inbox_exchange_by_address(
    open_broker: OpenBroker, amqp_url: str, exchange: str
) -> None:
    broker = open_broker()
    ns = f"k{uuid.uuid4().hex[:10]}"
    assert broker.inbox_exchange == f"{exchange}.inbox"
    with Connection(amqp_url) as admin:
        channel = admin.default_channel
        # Both durable topic exchanges: an equivalent active declare is accepted.
        for name in (exchange, f"{exchange}.inbox"):
            channel.exchange_declare(name, "topic", durable=True, auto_delete=False)

        # What the adapter sends reaches whatever is bound to the inbox exchange by address.
        channel.queue_declare(f"{ns}-spy", exclusive=True)
        channel.queue_bind(f"{ns}-spy", f"{exchange}.inbox", routing_key=f"{ns}-spy")
        sent = Inbox()
        sender = broker.open_endpoint(sent)
        sender.send(f"{ns}-spy", b"to the spy")
        got: list[Any] = []
        channel.basic_consume(f"{ns}-spy", callback=got.append, no_ack=True)
        while not got:
            admin.drain_events(timeout=WAIT_S)
        info = got[0].delivery_info
        assert (info["exchange"], info["routing_key"]) == (f"{exchange}.inbox", f"{ns}-spy")
        assert got[0].body == b"to the spy"

        # An endpoint is bound there by its own address, and only by it.
        received = Inbox()
        broker.open_endpoint(received, name=f"{ns}.node.a")
        for target_exchange, body in ((f"{exchange}.inbox", b"via inbox"), ("", b"via default")):
            channel.basic_publish(channel.prepare_message(body), target_exchange, f"{ns}.node.a")
        assert received.wait_for_body(b"via inbox").topic is None
        assert received.wait_for_body(b"via default").topic is None
    sender.send(f"{ns}.node.b", b"to a sibling")
    assert sent.wait_for_body(b"to a sibling", returned=True).topic is None
    assert all(d.body != b"to a sibling" for d in received.deliveries)


@pytest.mark.rabbitmq
@pytest.mark.parametrize("name", ["node.*", "node.#", "#", "a*b"])
def test_endpoint_names_with_wildcards_are_refused(open_broker: OpenBroker, name: str) -> None:
    broker = open_broker()
    with pytest.raises(ValueError, match=r"'\*' or '#'"):
        broker.open_endpoint(Inbox(), name=name)
    broker.open_endpoint(Inbox())  # and the broker carries on


def test_amq_exchanges_are_refused() -> None:
    with pytest.raises(ValueError, match=r"amq\.topic\.inbox"):
        KombuBroker("kombu+amqp://guest:guest@127.0.0.1:5672//?exchange=amq.topic")


@pytest.mark.rabbitmq
def test_delete_exchanges_deletes_both_before_or_after_close_and_is_idempotent(
    amqp_url: str,
) -> None:
    for when in ("open", "closed"):
        name = f"kombu-it-delete-{when}-{uuid.uuid4().hex}"
        broker = KombuBroker(_with_exchange(amqp_url, name))
        try:
            endpoint = broker.open_endpoint(Inbox(), name=f"{name}-ep")
            endpoint.bind(f"{name}.t")
            assert _exists(amqp_url, name)
            assert _exists(amqp_url, f"{name}.inbox")
            if when == "closed":
                broker.close()
            broker.delete_exchanges()
            assert not _exists(amqp_url, name)
            assert not _exists(amqp_url, f"{name}.inbox")
            broker.delete_exchanges()  # already gone: no error
        finally:
            broker.close()


@pytest.mark.rabbitmq
def test_bad_credentials_fail_fast(amqp_url: str) -> None:
    parts = urlsplit(amqp_url)
    host = parts.hostname or "127.0.0.1"
    wrong = urlunsplit(
        (parts.scheme, f"nobody:wrong@{host}:{parts.port or 5672}", parts.path, "", "")
    )
    started = time.monotonic()
    with pytest.raises(BrokerError):
        KombuBroker(f"kombu+{wrong}")
    assert time.monotonic() - started < 5


@pytest.mark.rabbitmq
def test_unroutable_publish_and_send_come_back_to_their_sender_only(
    open_broker: OpenBroker,
) -> None:
    broker = open_broker()
    ns = f"k{uuid.uuid4().hex[:10]}"
    sender, bystander = Inbox(), Inbox()
    sending = broker.open_endpoint(sender)
    watching = broker.open_endpoint(bystander)
    watching.bind(f"{ns}.marker")

    sending.publish(f"{ns}.tier.10", b"anyone at 10?")
    sending.send(f"{ns}-nobody", b"hello?")
    published = sender.wait_for_body(b"anyone at 10?", returned=True)
    sent = sender.wait_for_body(b"hello?", returned=True)
    assert published.topic == f"{ns}.tier.10"
    assert sent.topic is None

    sending.publish(f"{ns}.marker", b"marker")
    bystander.wait_for_body(b"marker")
    assert [d.body for d in bystander.deliveries] == [b"marker"]
    assert all(d.returned for d in sender.deliveries)


@pytest.mark.rabbitmq
def test_user_id_is_the_authenticated_user(open_broker: OpenBroker, amqp_url: str) -> None:
    broker = open_broker()
    receiver = Inbox()
    endpoint = broker.open_endpoint(receiver, name=f"kombu-uid-{uuid.uuid4().hex[:8]}")
    broker.open_endpoint(Inbox()).send(endpoint.address, b"who am i")
    assert receiver.wait_for_body(b"who am i").user_id == (urlsplit(amqp_url).username or "guest")

    # A message from a client that sets no user_id arrives with none.
    with Connection(amqp_url) as plain:
        plain.default_channel.basic_publish(
            plain.default_channel.prepare_message(b"anonymous"), "", endpoint.address
        )
    assert receiver.wait_for_body(b"anonymous").user_id is None


@pytest.mark.rabbitmq
def test_handlers_run_on_the_dispatcher_and_may_bind(open_broker: OpenBroker) -> None:
    broker = open_broker()
    ns = f"k{uuid.uuid4().hex[:10]}"
    inbox = Inbox()
    holder: list[Endpoint] = []

    def rebinding(delivery: Delivery) -> None:
        inbox(delivery)
        if delivery.body == b"move to 25":
            # What a node does when its utilisation crosses a tier boundary.
            holder[0].unbind(f"{ns}.tier.10")
            holder[0].bind(f"{ns}.tier.25")
            holder[0].send(holder[0].address, b"rebound")

    node = broker.open_endpoint(rebinding)
    holder.append(node)
    node.bind(f"{ns}.tier.10")
    requestor = Inbox()
    sender = broker.open_endpoint(requestor)
    sender.publish(f"{ns}.tier.10", b"move to 25")
    inbox.wait_for_body(b"rebound")
    sender.publish(f"{ns}.tier.25", b"at 25")
    sender.publish(f"{ns}.tier.10", b"at 10")
    inbox.wait_for_body(b"at 25")
    requestor.wait_for_body(b"at 10", returned=True)
    assert inbox.threads == {f"{broker.connection_name}:dispatch"}


@pytest.mark.rabbitmq
def test_eight_threads_publishing_through_one_endpoint(open_broker: OpenBroker) -> None:
    broker = open_broker()
    ns = f"k{uuid.uuid4().hex[:10]}"
    receiver = Inbox()
    broker.open_endpoint(receiver).bind(f"{ns}.load")
    returns = Inbox()
    shared = broker.open_endpoint(returns)
    threads_n, per_thread = 8, 250
    start = threading.Barrier(threads_n)
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            start.wait(timeout=WAIT_S)
            for i in range(per_thread):
                shared.publish(f"{ns}.load", f"{index}:{i}".encode())
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(threads_n)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    publish_s = time.monotonic() - started
    received = receiver.wait_for_count(threads_n * per_thread)
    assert errors == []
    assert len(received) == threads_n * per_thread
    for index in range(threads_n):
        sequence = [
            int(d.body.split(b":")[1]) for d in received if d.body.startswith(b"%d:" % index)
        ]
        assert sequence == list(range(per_thread))
    assert returns.deliveries == []
    # publish() only queues for the IO thread: it never waits on a round trip.
    assert publish_s < 5


@pytest.mark.rabbitmq
def test_close_joins_its_threads_and_is_idempotent(open_broker: OpenBroker) -> None:
    broker = open_broker()
    name = broker.connection_name
    assert _threads_of(broker) == {f"{name}:io", f"{name}:dispatch"}
    endpoint = broker.open_endpoint(Inbox())
    endpoint.bind("kombu.close.test")
    broker.close()
    assert _threads_of(broker) == set()
    assert broker.closed
    broker.close()
    endpoint.close()


@pytest.mark.rabbitmq
def test_a_handler_may_close_the_broker(open_broker: OpenBroker) -> None:
    broker = open_broker()
    closed = threading.Event()
    holder: list[KombuBroker] = [broker]

    def close_everything(delivery: Delivery) -> None:
        holder[0].close()
        closed.set()

    endpoint = broker.open_endpoint(close_everything)
    broker.open_endpoint(Inbox()).send(endpoint.address, b"close it")
    assert closed.wait(WAIT_S)
    broker.close()  # from the test thread: joins the dispatcher the handler ran on
    assert _threads_of(broker) == set()


@pytest.mark.rabbitmq
def test_publishes_wait_while_rabbitmq_blocks_publishing(open_broker: OpenBroker) -> None:
    # A real resource alarm would block every client of the shared RabbitMQ, so this
    # reports connection.blocked / unblocked on the IO thread, as py-amqp's callbacks do.
    broker = open_broker()
    ns = f"k{uuid.uuid4().hex[:10]}"
    receiver = Inbox()
    receiving = broker.open_endpoint(receiver)
    receiving.bind(f"{ns}.a")
    sender = broker.open_endpoint(Inbox())
    reported = threading.Event()

    def block() -> None:
        broker.report(Session.blocked, "test alarm")
        reported.set()

    broker.call_on_io_thread(block)
    assert reported.wait(WAIT_S)

    for i in range(3):
        sender.publish(f"{ns}.a", b"held %d" % i)
    receiving.bind(f"{ns}.b")  # other operations go on meanwhile
    assert broker.stats.blocked == 1
    assert receiver.deliveries == []

    broker.call_on_io_thread(lambda: broker.report(Session.unblocked))
    sender.publish(f"{ns}.b", b"after")
    receiver.wait_for_count(4)
    assert [d.body for d in receiver.deliveries] == [b"held 0", b"held 1", b"held 2", b"after"]


# -- recovery -------------------------------------------------------------------------------


@pytest.mark.rabbitmq
def test_recovers_after_a_forced_close(
    open_broker: OpenBroker, close_connection: Callable[[str], None]
) -> None:
    broker = open_broker(reconnect_max_s=0.5)
    ns = f"k{uuid.uuid4().hex[:10]}"
    receiver = Inbox()
    named = broker.open_endpoint(receiver, name=f"{ns}-node")
    named.bind(f"{ns}.tier.#")
    sender_inbox = Inbox()
    sender = broker.open_endpoint(sender_inbox)
    sender.publish(f"{ns}.tier.10", b"before")
    receiver.wait_for_body(b"before")

    close_connection(broker.connection_name)
    # Issued while the connection is down or dying: queued, or replayed as unconfirmed.
    sender.publish(f"{ns}.tier.10", b"during")
    assert broker.wait_for_connections(2, WAIT_S), "did not reconnect"

    receiver.wait_for_body(b"during")
    # Same queue name, same bindings, consumers running again.
    sender.send(f"{ns}-node", b"direct after")
    sender.publish(f"{ns}.tier.50.x", b"pattern after")
    receiver.wait_for_body(b"direct after")
    receiver.wait_for_body(b"pattern after")
    # Returns and blocking operations work on the new connection.
    sender.publish(f"{ns}.nobody", b"returned after")
    sender_inbox.wait_for_body(b"returned after", returned=True)
    named.bind(f"{ns}.extra")
    sender.publish(f"{ns}.extra", b"new binding")
    receiver.wait_for_body(b"new binding")
    assert broker.connections == 2


class FreezableProxy:
    """A TCP proxy in front of RabbitMQ that can go silent without closing anything: to the
    client, the server just stops talking, as behind a dead NAT or a partition. Only the
    pipes open when :meth:`freeze` is called freeze; new connections flow normally."""

    def __init__(self, host: str, port: int) -> None:
        self._target = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pipes: list[tuple[socket.socket, socket.socket, threading.Event]] = []
        self._stopped = threading.Event()
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            frozen = threading.Event()
            with self._lock:
                self._pipes.append((client, server, frozen))
            for source, sink in ((client, server), (server, client)):
                thread = threading.Thread(
                    target=self._pump, args=(source, sink, frozen), daemon=True
                )
                self._threads.append(thread)
                thread.start()

    def _pump(self, source: socket.socket, sink: socket.socket, frozen: threading.Event) -> None:
        while True:
            try:
                data = source.recv(65536)
            except OSError:
                return
            if frozen.is_set():
                self._stopped.wait()  # swallow it and everything after: silence
                return
            if not data:
                return
            try:
                sink.sendall(data)
            except OSError:
                return

    def freeze(self) -> None:
        with self._lock:
            for _, _, frozen in self._pipes:
                frozen.set()

    def close(self) -> None:
        self._stopped.set()
        # shutdown() wakes a thread blocked in accept() or recv(); close() alone does not.
        with self._lock:
            sockets = [self._listener] + [s for pipe in self._pipes for s in pipe[:2]]
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(WAIT_S)
            assert not thread.is_alive()


@pytest.fixture
def via_proxy(amqp_url: str, exchange: str) -> Iterator[tuple[FreezableProxy, str]]:
    """A :class:`FreezableProxy` in front of the RabbitMQ under test, and the kombu URL (on
    this test's exchange) that goes through it. The proxy is closed after the test."""
    parts = urlsplit(amqp_url)
    proxy = FreezableProxy(parts.hostname or "127.0.0.1", parts.port or 5672)
    try:
        yield proxy, _with_exchange(_via(amqp_url, proxy.port), exchange)
    finally:
        proxy.close()


@pytest.mark.rabbitmq
def test_heartbeats_detect_a_silent_server_and_recover(
    via_proxy: tuple[FreezableProxy, str], open_broker: OpenBroker
) -> None:
    proxy, url = via_proxy
    broker = open_broker(url, heartbeat_s=1.0, reconnect_max_s=0.5)
    ns = f"k{uuid.uuid4().hex[:10]}"
    receiver = Inbox()
    broker.open_endpoint(receiver, name=f"{ns}-node").bind(f"{ns}.t")
    sender = broker.open_endpoint(Inbox())

    started = time.monotonic()
    proxy.freeze()
    # Two missed heartbeats (2 s) to notice; then our old connection must die on the
    # server (its heartbeats stop too) before the queue name is free again.
    assert broker.wait_for_connections(2, 20), "did not detect the silent server"
    recovered_s = time.monotonic() - started
    sender.publish(f"{ns}.t", b"after the silence")
    receiver.wait_for_body(b"after the silence")
    assert recovered_s < 15
    broker.close()  # before the proxy goes, or it would see that and reconnect


@pytest.mark.rabbitmq
def test_silent_server_bounds_pending_publishes_and_close(
    via_proxy: tuple[FreezableProxy, str], open_broker: OpenBroker
) -> None:
    proxy, url = via_proxy
    broker = open_broker(
        url,
        heartbeat_s=0,  # nobody notices the silence: only the bounds below help
        max_pending=20,
        close_timeout_s=1.0,
    )
    sender = broker.open_endpoint(Inbox())
    proxy.freeze()
    for i in range(20):
        sender.publish("kombu.silent", b"%d" % i)
    with pytest.raises(BrokerError, match="waiting for RabbitMQ to confirm"):
        sender.publish("kombu.silent", b"one too many")
    started = time.monotonic()
    broker.close()
    assert time.monotonic() - started < 3
    assert _threads_of(broker) == set()


@pytest.mark.rabbitmq
def test_interoperates_with_the_pika_adapter(
    open_broker: OpenBroker, amqp_url: str, exchange: str
) -> None:
    pika_broker = pytest.importorskip("brokers.pika_broker")
    kombu_side = open_broker()
    pika_side = pika_broker.PikaBroker(amqp_url, exchange=exchange)
    try:
        ns = f"k{uuid.uuid4().hex[:10]}"
        at_kombu, at_pika = Inbox(), Inbox()
        kombu_node = kombu_side.open_endpoint(at_kombu, name=f"{ns}-kombu")
        pika_node = pika_side.open_endpoint(at_pika, name=f"{ns}-pika")
        kombu_node.bind(f"{ns}.tier.#")
        pika_node.bind(f"{ns}.tier.*")

        pika_node.publish(f"{ns}.tier.10", b"from pika")
        kombu_node.publish(f"{ns}.tier.25", b"from kombu")
        for inbox in (at_kombu, at_pika):
            from_pika = inbox.wait_for_body(b"from pika")
            from_kombu = inbox.wait_for_body(b"from kombu")
            assert (from_pika.topic, from_kombu.topic) == (f"{ns}.tier.10", f"{ns}.tier.25")
            assert (
                from_pika.user_id == from_kombu.user_id == (urlsplit(amqp_url).username or "guest")
            )

        kombu_node.send(pika_node.address, b"kombu to pika")
        pika_node.send(kombu_node.address, b"pika to kombu")
        assert at_pika.wait_for_body(b"kombu to pika").topic is None
        assert at_kombu.wait_for_body(b"pika to kombu").topic is None

        # An unroutable message comes back to whichever adapter sent it.
        pika_node.publish(f"{ns}.elsewhere", b"pika unroutable")
        kombu_node.publish(f"{ns}.elsewhere", b"kombu unroutable")
        at_pika.wait_for_body(b"pika unroutable", returned=True)
        at_kombu.wait_for_body(b"kombu unroutable", returned=True)
        assert not any(d.returned and d.body == b"pika unroutable" for d in at_kombu.deliveries)
    finally:
        pika_side.close()
