"""What only the kombu driver has, on a real RabbitMQ: refused kombu transports, kombu URLs,
recovery after a silent peer (heartbeats, through a proxy that stops forwarding), the bounds
that keep a silent RabbitMQ from growing memory or hanging ``close``, and interoperation
with the pika driver on one exchange.

Everything the pika and kombu drivers share (topology, returns, ``user_id``, confirms,
stats, reconnection, cancelled consumers, refusals, flow control, threads) is in the
contract suite, ``tests/contract/test_amqp_contract.py``, which runs it on both.
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

from reservoir.broker import BrokerError, Delivery, UnsupportedBroker
from reservoir.brokers import connect
from reservoir.brokers.kombu_broker import KombuBroker

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
    pika_broker = pytest.importorskip("reservoir.brokers.pika_broker")
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
