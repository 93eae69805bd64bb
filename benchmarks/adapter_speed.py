"""The RabbitMQ adapters' own cost: request/reply round trip and message rate through
``reservoir.brokers.connect(url)``, against raw pika doing the same on the wire, in one run.

    python benchmarks/adapter_speed.py --url amqp://guest:guest@127.0.0.1:5672/ \\
        [--round-trips 2000] [--messages 20000] [--body-bytes 200] [--repeats 3] [--json]

For each client (the pika adapter, ``amqp://``; the kombu adapter, ``kombu+amqp://``; raw
pika) it opens one connection with two endpoints A and B and measures:

1. **round trip**: A sends a body to B's address, B's handler sends it back to A, A waits
   for it; one at a time, after 50 unmeasured ones: p50 and p99 over ``--round-trips``.
2. **message rate**: A sends ``--messages`` bodies to B as fast as the client takes them;
   the time from the first send until B's handler has received the last one. (Confirms
   still outstanding then are waited for afterwards, outside the timing.)

Raw pika does exactly what the adapters put on the wire: one connection, a publish
channel in confirm mode and a consume channel; reservoir's two durable topic exchanges
(sends go to ``<exchange>.inbox``, routed by the destination address); every endpoint an
exclusive queue named by its address and bound there by it, consumed with auto-ack; every
message ``mandatory`` with ``user_id`` and ``app_id`` set; confirms pipelined, tracked in a
tag map settled by ``basic.ack`` (``multiple`` too), never waited for per message.

Why a ``SelectConnection`` on an IO thread of its own, not a ``BlockingConnection``: that is
the adapters' design (the kombu adapter runs its own selector loop the same way), and the
only way pika pipelines confirms; a blocking channel in confirm mode turns every publish
into a wait for its ack, which would slow the baseline down and flatter the adapters. The
application (the measuring loop) runs on the main thread in both, so both pay the hand-off
to the IO thread: raw pika queues publishes in a list and wakes the loop once per batch
(``add_callback_threadsafe``, which alone would wake it once per message), as the adapters
do. Raw pika's handlers run where pika calls them, on the IO thread, and B's reply is
published right there: that is the least a pika program must do. The adapters' endpoints
are opened ``inline``, as reservoir's driver opens them: their handlers run on the IO thread
too, and what they send goes out when they return. An endpoint opened without it has its
handlers run on a dispatcher thread (where a handler may call the blocking ``bind``), and a
reply crosses two more threads: "pika adapter, dispatched" measures that, and so does "raw
pika + handler thread", raw pika with its handlers moved to a dispatcher thread and its
replies handed back to the IO thread. Both are reported beside the others; the targets are
against plain raw pika.

Clients alternate (the order rotates every repeat) over ``--repeats`` repeats, so the
machine's drift hits each alike; the medians over repeats are reported, with the ratios
``adapter p50 / raw p50`` (target <= 1.2) and ``adapter rate / raw rate`` (target >= 0.8).
Everything runs on exchanges of the run's own, ``reservoir.adapterbench.<hex>``, deleted at
the end, on Ctrl-C or SIGTERM too (``reservoir.brokers.own_exchange``); the queues are exclusive and
go with their connections. ``--json`` prints one JSON object and nothing else on stdout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import json
import queue
import selectors
import signal
import socket
import statistics
import sys
import threading
import time
import urllib.parse
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from types import FrameType
from typing import Any, Protocol

import amqp
import pika
import pika.spec

import reservoir.brokers
from reservoir.broker import Delivery
from reservoir.brokers.amqp.threaded import AmqpBroker
from reservoir.brokers.url import BrokerUrl

WARM_UP = 50
#: how long any one wait may take before the run is declared broken
STALL_S = 60.0
#: the adapters' default bound on accepted but unconfirmed messages
ADAPTER_MAX_PENDING = 50_000
TARGET_P50 = 1.2
TARGET_RATE = 0.8

RAW = "raw pika"
RAW_THREAD = "raw pika + handler thread"
RAW_AMQP = "raw py-amqp"
PIKA = "pika adapter"
PIKA_DISPATCHED = "pika adapter, dispatched"
KOMBU = "kombu adapter"


@dataclass(frozen=True)
class Result:
    p50_us: float
    p99_us: float
    rate_per_s: float


class Roles:
    """What A's and B's handlers do, the same for every client: B echoes (round trip) or
    counts (rate); A counts replies."""

    def __init__(self) -> None:
        self.echo = True
        self.replies = 0
        self.reply = threading.Event()
        self.received = 0
        self.expected = 0
        self.all_received = threading.Event()
        self.unexpected = 0

    def on_b(self, body: bytes) -> bool:
        """B got ``body``; True if B must send it back to A."""
        if self.echo:
            return True
        self.received += 1
        if self.received == self.expected:
            self.all_received.set()
        return False

    def on_a(self, body: bytes) -> None:
        self.replies += 1
        self.reply.set()


class Client(Protocol):
    def send(self, body: bytes) -> None:
        """A sends ``body`` to B's address."""
        ...

    def wait_confirmed(self) -> None:
        """Until RabbitMQ has confirmed everything sent so far."""
        ...

    def close(self) -> None: ...


def _wait_until(done: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + STALL_S
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not done after {STALL_S:.0f}s")
        time.sleep(0.005)


# -- the adapters ----------------------------------------------------------------------------


class AdapterClient:
    """Two endpoints of one ``reservoir.brokers.connect(url)`` broker; ``inline``: as reservoir's
    driver opens them, handlers on the IO thread."""

    def __init__(self, url: BrokerUrl, roles: Roles, *, inline: bool = True) -> None:
        self._roles = roles
        broker = reservoir.brokers.connect(url)
        if not isinstance(broker, AmqpBroker):
            broker.close()
            raise TypeError(f"not a RabbitMQ adapter: {broker!r}")
        self._broker = broker
        try:
            self._a = broker.open_endpoint(
                self._on_a, name=f"adapterbench.{uuid.uuid4().hex}.a", inline=inline
            )
            self._b = broker.open_endpoint(
                self._on_b, name=f"adapterbench.{uuid.uuid4().hex}.b", inline=inline
            )
        except BaseException:
            broker.close()
            raise

    def _on_a(self, delivery: Delivery) -> None:
        if delivery.returned:
            self._roles.unexpected += 1
            return
        self._roles.on_a(delivery.body)

    def _on_b(self, delivery: Delivery) -> None:
        if delivery.returned:
            self._roles.unexpected += 1
            return
        if self._roles.on_b(delivery.body):
            self._b.send(self._a.address, delivery.body)

    def send(self, body: bytes) -> None:
        self._a.send(self._b.address, body)

    def wait_confirmed(self) -> None:
        def settled() -> bool:
            stats = self._broker.stats
            return stats.confirmed + stats.nacked + stats.refused >= stats.sent + stats.published

        _wait_until(settled, "confirms")
        stats = self._broker.stats
        self._roles.unexpected += stats.nacked + stats.returned + stats.refused + stats.reconnects

    def close(self) -> None:
        self._broker.close()


# -- raw pika --------------------------------------------------------------------------------


class RawPikaClient:
    """Raw pika on the adapters' topology: see the module docstring."""

    def __init__(self, url: BrokerUrl, roles: Roles, *, handler_thread: bool) -> None:
        self._roles = roles
        self._exchange = url.exchange
        self._inbox = url.inbox_exchange
        params = pika.URLParameters(url.transport_url)
        params.client_properties = {"connection_name": "reservoir-adapterbench:raw"}
        user = getattr(params.credentials, "username", None)
        self._properties = pika.BasicProperties(user_id=user, app_id="1")
        self._lock = threading.Lock()
        self._outbox: list[tuple[str, bytes]] = []
        self._flush_pending = False
        self._tags = itertools.count(1)
        self._unconfirmed: OrderedDict[int, None] = OrderedDict()
        self._published = 0
        self._settled = 0
        self._closed = threading.Event()
        opened: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._connection = pika.SelectConnection(
            params,
            on_open_callback=opened.set_result,
            on_open_error_callback=lambda _c, error: opened.set_exception(
                RuntimeError(f"cannot connect: {error!r}")
            ),
            on_close_callback=lambda _c, _reason: self._closed.set(),
        )
        self._ioloop = self._connection.ioloop
        self._io = threading.Thread(target=self._ioloop.start, name="raw-pika:io", daemon=True)
        self._io.start()
        self._dispatch: threading.Thread | None = None
        self._deliveries: queue.SimpleQueue[tuple[Callable[[bytes], None], bytes] | None] = (
            queue.SimpleQueue()
        )
        try:
            opened.result(STALL_S)
            self._setup()
            if handler_thread:
                self._dispatch = threading.Thread(target=self._dispatch_main, daemon=True)
                self._dispatch.start()
        except BaseException:
            self.close()
            raise

    # setup, driven from the main thread one call at a time, as the adapters do it
    def _call(
        self, method: Callable[..., Any], *args: Any, done: str = "callback", **kw: Any
    ) -> Any:
        """``method(*args, **kw)`` on the IO thread; what its ``done`` callback is given."""
        answer: concurrent.futures.Future[Any] = concurrent.futures.Future()
        kw[done] = answer.set_result
        self._ioloop.add_callback_threadsafe(lambda: method(*args, **kw))
        return answer.result(STALL_S)

    def _setup(self) -> None:
        connection = self._connection
        publish = self._call(connection.channel, done="on_open_callback")
        publish.add_on_return_callback(self._on_return)
        self._call(publish.confirm_delivery, self._on_confirm)
        self._publish_channel = publish
        consume = self._call(connection.channel, done="on_open_callback")
        for name in (self._exchange, self._inbox):
            self._call(
                consume.exchange_declare,
                name,
                exchange_type="topic",
                durable=True,
                auto_delete=False,
            )
        run = uuid.uuid4().hex
        self._a, self._b = f"adapterbench.{run}.raw-a", f"adapterbench.{run}.raw-b"
        for address, handler in ((self._a, self._on_a), (self._b, self._on_b)):
            self._call(consume.queue_declare, address, exclusive=True)
            self._call(consume.queue_bind, address, self._inbox, routing_key=address)
            self._call(
                consume.basic_consume,
                address,
                self._consumer(handler),
                auto_ack=True,
                exclusive=True,
            )

    def _consumer(self, handler: Callable[[bytes], None]) -> Callable[..., None]:
        def on_message(_channel: Any, _method: Any, _properties: Any, body: bytes) -> None:
            if self._dispatch is None:
                handler(body)
            else:
                self._deliveries.put((handler, body))

        return on_message

    def _dispatch_main(self) -> None:
        while (item := self._deliveries.get()) is not None:
            handler, body = item
            handler(body)

    # the handlers
    def _on_a(self, body: bytes) -> None:
        self._roles.on_a(body)

    def _on_b(self, body: bytes) -> None:
        if self._roles.on_b(body):
            if self._dispatch is None:
                self._publish(self._a, body)  # on the IO thread already
            else:
                self._hand_over(self._a, body)

    # publishing: callers' threads hand over, the IO thread publishes
    def send(self, body: bytes) -> None:
        self._hand_over(self._b, body)

    def _hand_over(self, address: str, body: bytes) -> None:
        with self._lock:
            self._outbox.append((address, body))
            wake = not self._flush_pending
            self._flush_pending = True
        if wake:
            self._ioloop.add_callback_threadsafe(self._flush)

    def _flush(self) -> None:
        with self._lock:
            batch, self._outbox = self._outbox, []
            self._flush_pending = False
        for address, body in batch:
            self._publish(address, body)

    def _publish(self, address: str, body: bytes) -> None:
        self._publish_channel.basic_publish(
            self._inbox, address, body, self._properties, mandatory=True
        )
        self._unconfirmed[next(self._tags)] = None
        self._published += 1

    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        if not isinstance(method, pika.spec.Basic.Ack):
            self._roles.unexpected += 1
        tag = method.delivery_tag
        if method.multiple:
            while self._unconfirmed and next(iter(self._unconfirmed)) <= tag:
                self._unconfirmed.popitem(last=False)
                self._settled += 1
        elif tag in self._unconfirmed:
            del self._unconfirmed[tag]
            self._settled += 1

    def _on_return(self, *_args: Any) -> None:
        self._roles.unexpected += 1

    def wait_confirmed(self) -> None:
        _wait_until(lambda: self._settled >= self._published, "confirms")

    def close(self) -> None:
        if self._dispatch is not None:
            self._deliveries.put(None)
            self._dispatch.join(5)
        if self._io.is_alive():

            def stop() -> None:
                if self._connection.is_open:
                    self._connection.close()
                else:
                    self._ioloop.stop()

            self._ioloop.add_callback_threadsafe(stop)
            if self._closed.wait(10):
                self._ioloop.add_callback_threadsafe(self._ioloop.stop)
            self._io.join(10)


class RawPyAmqpClient:
    """Raw py-amqp (the library under kombu's ``amqp`` transport) on the same topology, so
    that the kombu adapter can be held against what its own client library can do here.

    Like raw pika: one connection with a publish channel in confirm mode (acks taken from
    ``channel.events``, pipelined, never waited for per message) and a consume channel, an
    IO thread of its own running a selector over the socket and a wake-up socket, handlers
    called right where py-amqp delivers, B's echo published there. py-amqp's read of the
    socket before every publish (to notice ``connection.blocked``) is turned off as the
    kombu adapter turns it off: this loop reads whenever the socket is readable anyway.
    """

    def __init__(self, url: BrokerUrl, roles: Roles) -> None:
        self._roles = roles
        parts = urllib.parse.urlsplit(url.transport_url)
        host = f"{parts.hostname or '127.0.0.1'}:{parts.port or 5672}"
        vhost = urllib.parse.unquote(parts.path[1:]) if len(parts.path) > 1 else "/"
        user = urllib.parse.unquote(parts.username or "guest")
        self._connection = amqp.Connection(
            host=host,
            userid=user,
            password=urllib.parse.unquote(parts.password or "guest"),
            virtual_host=vhost,
            client_properties={"connection_name": "reservoir-adapterbench:raw-py-amqp"},
        )
        self._connection.connect()
        self._connection.client_properties.get("capabilities", {})["connection.blocked"] = False
        self._user = user
        self._inbox = url.inbox_exchange
        self._lock = threading.Lock()
        self._outbox: list[tuple[str, bytes]] = []
        self._tags = itertools.count(1)
        self._unconfirmed: OrderedDict[int, None] = OrderedDict()
        self._published = 0
        self._settled = 0
        self._stopping = False
        publish = self._connection.channel()
        publish.confirm_select()
        publish.events["basic_ack"].add(self._on_ack)
        publish.events["basic_nack"].add(self._on_nack)
        publish.events["basic_return"].add(self._on_return)
        self._publish_channel = publish
        consume = self._connection.channel()
        for name in (url.exchange, self._inbox):
            consume.exchange_declare(name, "topic", durable=True, auto_delete=False)
        run = uuid.uuid4().hex
        self._a, self._b = f"adapterbench.{run}.raw-amqp-a", f"adapterbench.{run}.raw-amqp-b"
        for address, handler in ((self._a, self._on_a), (self._b, self._on_b)):
            consume.queue_declare(address, exclusive=True, auto_delete=False)
            consume.queue_bind(address, self._inbox, routing_key=address)
            consume.basic_consume(
                address, callback=self._consumer(handler), no_ack=True, exclusive=True
            )
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._io = threading.Thread(target=self._io_main, name="raw-py-amqp:io", daemon=True)
        self._io.start()

    def _consumer(self, handler: Callable[[bytes], None]) -> Callable[[Any], None]:
        def on_message(message: Any) -> None:
            handler(bytes(message.body))

        return on_message

    def _io_main(self) -> None:
        sock = self._connection.sock
        selector = selectors.DefaultSelector()
        selector.register(sock, selectors.EVENT_READ)
        selector.register(self._wake_r, selectors.EVENT_READ)
        try:
            while not self._stopping:
                self._flush()
                for key, _ in selector.select():
                    if key.fileobj is self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            while self._wake_r.recv(4096):
                                pass
                    else:
                        self._connection.drain_events(timeout=0)
        finally:
            selector.close()

    # the handlers
    def _on_a(self, body: bytes) -> None:
        self._roles.on_a(body)

    def _on_b(self, body: bytes) -> None:
        if self._roles.on_b(body):
            self._publish(self._a, body)  # on the IO thread already

    # publishing: callers' threads hand over, the IO thread publishes
    def send(self, body: bytes) -> None:
        with self._lock:
            self._outbox.append((self._b, body))
            wake = len(self._outbox) == 1
        if wake:
            self._wake_w.send(b"\0")

    def _flush(self) -> None:
        with self._lock:
            batch, self._outbox = self._outbox, []
        for address, body in batch:
            self._publish(address, body)

    def _publish(self, address: str, body: bytes) -> None:
        message = amqp.Message(body, user_id=self._user, app_id="1")
        self._publish_channel.basic_publish(message, self._inbox, address, mandatory=True)
        self._unconfirmed[next(self._tags)] = None
        self._published += 1

    def _on_ack(self, tag: int, multiple: bool) -> None:
        if multiple:
            while self._unconfirmed and next(iter(self._unconfirmed)) <= tag:
                self._unconfirmed.popitem(last=False)
                self._settled += 1
        elif tag in self._unconfirmed:
            del self._unconfirmed[tag]
            self._settled += 1

    def _on_nack(self, tag: int, multiple: bool) -> None:
        self._roles.unexpected += 1
        self._on_ack(tag, multiple)

    def _on_return(self, *_args: Any) -> None:
        self._roles.unexpected += 1

    def wait_confirmed(self) -> None:
        _wait_until(lambda: self._settled >= self._published, "confirms")

    def close(self) -> None:
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")
        self._io.join(10)
        with contextlib.suppress(Exception):
            self._connection.close()
        self._wake_r.close()
        self._wake_w.close()


# -- measuring -------------------------------------------------------------------------------


def measure(
    make: Callable[[Roles], Client], round_trips: int, messages: int, body: bytes
) -> Result:
    roles = Roles()
    client = make(roles)
    try:
        samples: list[float] = []
        for i in range(WARM_UP + round_trips):
            roles.reply.clear()
            start = time.perf_counter()
            client.send(body)
            if not roles.reply.wait(STALL_S):
                raise RuntimeError("no reply")
            if i >= WARM_UP:
                samples.append(time.perf_counter() - start)
        client.wait_confirmed()

        roles.echo = False
        roles.expected = messages
        start = time.perf_counter()
        for _ in range(messages):
            client.send(body)
        if not roles.all_received.wait(STALL_S):
            raise RuntimeError(f"B received {roles.received} of {messages}")
        elapsed = time.perf_counter() - start
        client.wait_confirmed()
        if roles.unexpected:
            raise RuntimeError(f"{roles.unexpected} nacked, returned or lost message(s)")
    finally:
        client.close()
    samples.sort()

    def pct(q: float) -> float:
        return samples[min(len(samples) - 1, int(q * len(samples)))] * 1e6

    return Result(p50_us=pct(0.50), p99_us=pct(0.99), rate_per_s=messages / elapsed)


def _terminate(_signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--round-trips", type=int, default=2000, help="sequential, per repeat")
    parser.add_argument("--messages", type=int, default=20000, help="pipelined, per repeat")
    parser.add_argument("--body-bytes", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    base = BrokerUrl.parse(args.url)
    if base.adapter != "pika":
        parser.error("--url: an amqp:// or amqps:// URL (the kombu form is derived from it)")
    if not 0 < args.messages < ADAPTER_MAX_PENDING - WARM_UP - args.round_trips:
        parser.error(f"--messages: 1 to {ADAPTER_MAX_PENDING - WARM_UP - args.round_trips - 1}")
    if args.round_trips < 1 or args.repeats < 1 or args.body_bytes < 0:
        parser.error("--round-trips and --repeats: at least 1; --body-bytes: at least 0")
    signal.signal(signal.SIGTERM, _terminate)

    exchange = f"reservoir.adapterbench.{uuid.uuid4().hex[:12]}"
    pika_url = base.with_exchange(exchange)
    kombu_url = BrokerUrl.parse("kombu+" + args.url).with_exchange(exchange)
    clients: dict[str, Callable[[Roles], Client]] = {
        RAW: lambda roles: RawPikaClient(pika_url, roles, handler_thread=False),
        PIKA: lambda roles: AdapterClient(pika_url, roles),
        RAW_THREAD: lambda roles: RawPikaClient(pika_url, roles, handler_thread=True),
        PIKA_DISPATCHED: lambda roles: AdapterClient(pika_url, roles, inline=False),
        KOMBU: lambda roles: AdapterClient(kombu_url, roles),
        RAW_AMQP: lambda roles: RawPyAmqpClient(kombu_url, roles),
    }
    names = list(clients)
    body = b"x" * args.body_bytes
    runs: dict[str, list[Result]] = {name: [] for name in names}

    def progress(text: str) -> None:
        print(text, file=sys.stderr, flush=True)

    try:
        with reservoir.brokers.own_exchange(pika_url, name=exchange):
            for repeat in range(args.repeats):
                for name in names[repeat % len(names) :] + names[: repeat % len(names)]:
                    result = measure(clients[name], args.round_trips, args.messages, body)
                    runs[name].append(result)
                    progress(
                        f"repeat {repeat + 1}/{args.repeats} {name}: p50 {result.p50_us:.0f} us, "
                        f"p99 {result.p99_us:.0f} us, {result.rate_per_s:.0f} msg/s"
                    )
    except KeyboardInterrupt:
        progress("interrupted: the run's exchanges are deleted")
        return 130

    medians = {
        name: Result(
            p50_us=statistics.median(r.p50_us for r in results),
            p99_us=statistics.median(r.p99_us for r in results),
            rate_per_s=statistics.median(r.rate_per_s for r in results),
        )
        for name, results in runs.items()
    }
    raw = medians[RAW]
    ratios = {
        name: {
            "p50_ratio": medians[name].p50_us / raw.p50_us,
            "p50_met": medians[name].p50_us / raw.p50_us <= TARGET_P50,
            "rate_ratio": medians[name].rate_per_s / raw.rate_per_s,
            "rate_met": medians[name].rate_per_s / raw.rate_per_s >= TARGET_RATE,
        }
        for name in (PIKA, KOMBU, PIKA_DISPATCHED, RAW_THREAD, RAW_AMQP)
    }
    # The kombu adapter against its own client library: what py-amqp allows on this machine.
    raw_amqp = medians[RAW_AMQP]
    kombu_to_own_library = {
        "p50_ratio": medians[KOMBU].p50_us / raw_amqp.p50_us,
        "rate_ratio": medians[KOMBU].rate_per_s / raw_amqp.rate_per_s,
    }
    if args.json:
        report = {
            "config": {
                "round_trips": args.round_trips,
                "messages": args.messages,
                "body_bytes": args.body_bytes,
                "repeats": args.repeats,
                "targets": {"p50_ratio_max": TARGET_P50, "rate_ratio_min": TARGET_RATE},
            },
            "medians": {name: asdict(r) for name, r in medians.items()},
            "runs": {name: [asdict(r) for r in results] for name, results in runs.items()},
            "ratios_to_raw_pika": ratios,
            "kombu_adapter_to_raw_py_amqp": kombu_to_own_library,
        }
        print(json.dumps(report, indent=2))
        return 0

    print(
        f"\nmedians of {args.repeats} repeats; {args.round_trips} sequential round trips, "
        f"{args.messages} messages, {args.body_bytes}-byte bodies"
    )
    print(f"{'client':<26} {'p50 us':>8} {'p99 us':>8} {'msg/s':>8}")
    for name, r in medians.items():
        print(f"{name:<26} {r.p50_us:8.0f} {r.p99_us:8.0f} {r.rate_per_s:8.0f}")

    def verdict(met: object) -> str:
        return "met" if met else "not met"

    print(f"\nratios to raw pika (targets: p50 <= {TARGET_P50}, rate >= {TARGET_RATE})")
    for name, ratio in ratios.items():
        print(
            f"{name:<26} p50 x{ratio['p50_ratio']:.2f} ({verdict(ratio['p50_met'])}), "
            f"rate x{ratio['rate_ratio']:.2f} ({verdict(ratio['rate_met'])})"
        )
    print(
        f"\nkombu adapter to raw py-amqp (its own client library): "
        f"p50 x{kombu_to_own_library['p50_ratio']:.2f}, "
        f"rate x{kombu_to_own_library['rate_ratio']:.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
