"""The kombu adapter: reservoir's broker interface over kombu's py-amqp transport.

This module owns everything between :mod:`reservoir.broker` and a RabbitMQ reached through
kombu (URLs ``kombu+amqp://``, ``kombu+amqps://``, ``kombu+pyamqp://``): the topology, the
threads that drive one kombu connection, publisher confirms, returns, heartbeats and
reconnection. Every other kombu transport is refused (see :data:`REFUSED_TRANSPORTS`). The
rules it shares with the other adapters live in :mod:`brokers._rules`.

Topology, shared with :mod:`brokers.pika_broker` so both interoperate on one RabbitMQ:

- two durable, non-auto-delete **topic exchanges**: ``<exchange>``, ``reservoir`` unless
  the URL says ``?exchange=<name>`` (a reservoir-only parameter, stripped before kombu sees
  the URL), for ``publish``; and ``<exchange>.inbox`` (``reservoir.inbox``) for ``send``,
  routed by the destination address. Names starting with ``amq.`` are refused: RabbitMQ
  reserves the prefix, so ``amq.topic.inbox`` could never be created;
- one **exclusive queue per endpoint**, named by the endpoint's address; when it opens (and
  on every reconnect) it is bound to ``<exchange>.inbox`` with its own address as binding
  key (so an address may not contain ``*`` or ``#``); ``bind`` binds it to ``<exchange>``;
- every publish and send is **mandatory** and carries ``user_id`` (RabbitMQ validates it
  against the connection's user), so an unroutable message comes back (``basic.return``)
  to the sending endpoint's handler as ``Delivery(returned=True)``, with the routing key as
  topic when it came back from ``<exchange>`` and None when from the inbox exchange.

Why sends do not use the default exchange: it is a direct exchange, and RabbitMQ's topic
permissions apply only to topic exchanges. With sends on ``<exchange>.inbox``, per-role
users (``deploy/rabbitmq/``) can be limited by topic permissions: a node's credentials may
answer requestors (``reservoir.requestor.*``) but cannot send an ``Award`` to another node,
and, with no write permission on ``<exchange>``, cannot publish a request.

Exchanges under restricted users. Both exchanges are declared actively, which also checks
that an existing one is a durable topic exchange (``406 PRECONDITION_FAILED`` otherwise).
A user without ``configure`` permission on them gets ``403 ACCESS_REFUSED``; the adapter
then declares passively, which needs no permission and only checks existence, because an
operator creates them from the definitions. A missing exchange the user may not create
fails the first connection at once; on a reconnect it is retried. The refusal costs such a
user one control-channel reopen and an ``access refused`` line in the RabbitMQ log, on the
first connection only (reconnects remember it and go straight to the passive declare);
passive first would skip the type check for everyone.

``delete_exchanges()`` deletes both over a short-lived connection of its own (so it works
before or after ``close()``), for demos and tests that made their own exchanges.

Refused publishes. A publish or send the user may not make (``403 ACCESS_REFUSED``: a node
sending to another node under the per-role definitions, or to a ``reply_to`` outside
``reservoir.requestor.*``) makes RabbitMQ close that endpoint's channel. The refused
messages go back to their sender as ``Delivery(returned=True)`` (nobody received them) and
are logged; RabbitMQ handles a channel's publishes in order and ignores what follows a
refused one, so the unconfirmed ones before it count as delivered, and the endpoint gets a
new channel and consumer on the same connection and publishes the rest again, in order.
py-amqp raises a server's channel close from whichever read received it and without
saying which channel, so the adapter notes the closing channel in its ``Channel.Close``
handler first. A refusal that surfaces in the middle of another operation costs a
reconnect instead, but the refused message is never replayed: a replay would be refused
again, for ever.

Threads. kombu connections and channels are not thread-safe, so one **IO thread** owns the
connection and every channel. Other threads hand it operations through a queue and wake it
through a socketpair; it waits in a selector on the AMQP socket and the wake socket, so
nothing polls: the only timed wake-up is the heartbeat tick (a quarter of the negotiated
heartbeat). Handlers run on one **dispatcher thread**, serialised in arrival order, so a
handler may call back into its endpoint, including the blocking ``bind``/``unbind``: the IO
thread never waits for the dispatcher.

Channels. A *control* channel carries declarations, bindings and deletions, so a refused
declaration (a name locked by another connection) costs only that channel, which py-amqp
reopens. Each endpoint has its own channel for its consumer and its publishes: returns and
confirms arrive on the channel that published, which is how they find their endpoint.

Confirms. Each endpoint channel is put in confirm mode once; acks are handled as they
arrive on the IO thread, so no publish waits for one (kombu's ``confirm_publish`` option
would wait for every ack, one round trip per message, serialising all throughput). A
publish stays in its endpoint's *unconfirmed* buffer until acked; when the connection is
lost, those are published again after recovery. Across a reconnect delivery is therefore
at least once; the protocol treats ``request_id`` as an idempotency key. A nack (RabbitMQ
refusing responsibility, e.g. a full ``reject-publish`` queue) is logged, not retried.
Accepted-but-unconfirmed messages (queued, in flight, held, awaiting a reconnect) are
capped at ``max_pending``; past it ``publish``/``send`` raise :class:`BrokerError` at once.
While RabbitMQ says ``connection.blocked`` (a resource alarm), publishes are held in memory
instead of being written into a socket nobody reads.

Reconnection. When the connection fails (socket error, forced close, missed heartbeats,
a reply not arriving within ``timeout_s``), the IO thread reconnects with tenacity's
jittered exponential backoff, re-declares both exchanges, re-creates every open endpoint's
queue under the same name, re-binds its address and its patterns, restarts its consumer,
and only then re-publishes what was unconfirmed, so a replayed publish finds the bindings
restored.
Operations queued meanwhile wait for it; ``bind``/``unbind``/``open_endpoint`` give up
with :class:`BrokerError` after ``timeout_s``. Messages that were in the old exclusive
queues are lost with them. A queue name still held by our dead connection (the server has
not noticed yet) is retried like any other failure until the server lets it go.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import select
import selectors
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlencode, urlsplit, urlunsplit

import amqp.exceptions
import amqp.spec
import kombu.connection
import kombu.entity
import kombu.messaging
from kombu.utils.url import maybe_sanitize_url
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_never,
)

from brokers._rules import (
    DEFAULT_EXCHANGE,
    INBOX_SUFFIX,
    aimed_at,
    check_body,
    check_endpoint_name,
    check_exchange,
    check_handler,
    check_key,
    check_limits,
    check_no_wildcards,
    check_pending,
    inbox_exchange,
    mask_password,
    missing_exchange,
    reconnect_wait,
    refused_target,
    run_handlers,
    split_reservoir_params,
    topic_of,
)
from reservoir.broker import (
    Broker,
    BrokerClosed,
    BrokerError,
    Delivery,
    Endpoint,
    Handler,
    UnsupportedBroker,
)

__all__ = [
    "ACCEPTED_TRANSPORTS",
    "DEFAULT_EXCHANGE",
    "INBOX_SUFFIX",
    "REFUSED_TRANSPORTS",
    "KombuBroker",
    "KombuEndpoint",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

# kombu ships py.typed but leaves these unannotated: held as Any, so that mypy --strict
# checks this module rather than kombu.
Connection: Any = kombu.connection.Connection
Exchange: Any = kombu.entity.Exchange
Queue: Any = kombu.entity.Queue
Producer: Any = kombu.messaging.Producer

#: kombu URL schemes this adapter accepts, and the kombu transport each one is given.
#: ``amqp`` is pinned to py-amqp: kombu would pick librabbitmq when it is installed, and
#: this adapter relies on py-amqp's channel events and socket.
ACCEPTED_TRANSPORTS: dict[str, str] = {"amqp": "pyamqp", "pyamqp": "pyamqp", "amqps": "amqps"}

_VIRTUAL_LACKS = (
    "it has no mandatory publishing and no basic.return (an unroutable publish, or a send "
    "to an address nobody holds, is silently dropped, or parked in the deadletter_queue "
    "when one is set, instead of coming back to the sender, so a requestor cannot widen "
    "at once); "
    "its topic exchange does not route like RabbitMQ's (kombu 5.7's regex emulation: "
    "'a.#' does not match 'a', 'a.#.z' does not match 'a.z', '*' does not match an empty "
    "word, and 'a*' is a regular expression instead of a literal word)"
)

#: why each known kombu transport is refused; any other transport gets a generic reason
REFUSED_TRANSPORTS: dict[str, str] = {
    "memory": (
        f"{_VIRTUAL_LACKS}; its queues are not exclusive to a client; it polls for "
        "messages every polling_interval (1 s by default), and its state is global to "
        "the process. For an embedded broker use reservoir's own memory://"
    ),
    "redis": (
        f"{_VIRTUAL_LACKS}; its queues are Redis lists that are neither exclusive nor "
        "removed when a client dies, so a crashed node's inbox keeps swallowing what is "
        "sent to it"
    ),
    "librabbitmq": (
        "this adapter drives py-amqp's channel events and socket directly; "
        "use kombu+amqp:// (py-amqp) for the same RabbitMQ"
    ),
}
REFUSED_TRANSPORTS["rediss"] = REFUSED_TRANSPORTS["redis"]
REFUSED_TRANSPORTS["sentinel"] = REFUSED_TRANSPORTS["redis"]

#: how long the IO thread waits for the rest of a frame once the socket said "readable"
_FRAME_TIMEOUT_S = 1.0

#: frames the IO thread reads before it serves queued operations again
_READ_BATCH = 256

#: names connections ``reservoir-kombu:<pid>:<n>``; only ever read to make a new name
_connection_numbers = itertools.count(1)


class _Closing(Exception):
    """Raised inside the IO thread to stop a reconnect loop because close() was called."""


class _ServerClose(NamedTuple):
    """An endpoint channel the server closed, as its Channel.Close said."""

    endpoint: KombuEndpoint
    channel: Any
    reply_code: int
    reply_text: str
    method: tuple[int, int]


#: (class, method) of basic.publish, as a Channel.Close names the method it refused
_BASIC_PUBLISH = (60, 40)


class _Outgoing(NamedTuple):
    """One publish or send, kept until the broker confirms it."""

    exchange: str
    routing_key: str
    body: bytes


@dataclass(eq=False, slots=True)
class _Op:
    """Work for the IO thread. ``future`` is None for fire-and-forget operations."""

    run: Callable[[], Any]
    future: Future[Any] | None
    #: a publish or send: held while RabbitMQ blocks publishing, and not run again when
    #: the connection fails under it (it is in the unconfirmed buffer, which recovery
    #: replays); every other operation is run again after the reconnect
    publish: bool = False
    started: bool = False


@dataclass(eq=False, slots=True)
class _Link:
    """One live connection and its control channel. Rebuilt on every reconnect."""

    connection: Any  # kombu.Connection
    control: Any  # kombu.transport.pyamqp.Channel
    sock: socket.socket
    #: negotiated heartbeat in seconds; 0 disables heartbeats
    heartbeat_s: float
    user_id: str | None


class _Target(NamedTuple):
    kombu_url: str
    exchange: str
    display_url: str


def _parse_url(url: str) -> _Target:
    """Split a ``kombu+<kombu URL>`` into what kombu gets and what reservoir keeps.

    Refuses, with :class:`UnsupportedBroker`, every transport but py-amqp's."""
    prefix, separator, inner = url.partition("+")
    if prefix.lower() != "kombu" or not separator or "://" not in inner:
        raise UnsupportedBroker(f"not a kombu+<kombu URL>: {maybe_sanitize_url(url)!r}")
    parts = urlsplit(inner)
    scheme = parts.scheme.lower()
    if scheme not in ACCEPTED_TRANSPORTS:
        reason = REFUSED_TRANSPORTS.get(
            scheme,
            "only kombu's py-amqp transport offers mandatory publishing with basic.return, "
            "exclusive queues that vanish with their client and RabbitMQ's topic routing",
        )
        accepted = ", ".join(f"kombu+{name}://" for name in ACCEPTED_TRANSPORTS)
        raise UnsupportedBroker(
            f"kombu transport {scheme!r} cannot honour reservoir's broker contract: {reason}. "
            f"The kombu adapter accepts {accepted}."
        )
    ours, kept = split_reservoir_params(parts.query)
    exchange = check_exchange(ours.get("exchange", DEFAULT_EXCHANGE))
    kombu_url = urlunsplit(
        (ACCEPTED_TRANSPORTS[scheme], parts.netloc, parts.path, urlencode(kept), parts.fragment)
    )
    # Shown without its fragment; kombu URLs have always masked the password as "**".
    display = mask_password(urlunsplit(parts._replace(fragment="")), mask="**")
    return _Target(kombu_url, exchange, f"kombu+{display}")


class KombuEndpoint(Endpoint):
    """An exclusive queue on a :class:`KombuBroker`. Made by ``open_endpoint``.

    Everything but ``address``, ``_handler`` and ``_closed`` belongs to the IO thread."""

    def __init__(self, broker: KombuBroker, address: str, handler: Handler) -> None:
        self.address = address
        self._broker = broker
        self._handler = handler
        # Written under the broker's lock; read without it where a stale read is harmless.
        self._closed = False
        # -- IO thread only ----------------------------------------------------------------
        #: patterns bound on the server, in binding order (a dict as an ordered set)
        self._patterns: dict[str, None] = {}
        self._queue: Any = Queue(address, exclusive=True, durable=False)
        # kombu turns exclusive into auto-delete too; a plain exclusive queue matches the
        # pika adapter and survives its consumer being cancelled (it dies with the link).
        self._queue.auto_delete = False
        self._link: _Link | None = None
        self._channel: Any = None
        self._producer: Any = None
        #: delivery tag -> message, until the broker acks it; replayed after a reconnect
        self._unconfirmed: dict[int, _Outgoing] = {}
        self._next_tag = 1

    @property
    def closed(self) -> bool:
        return self._closed

    def bind(self, pattern: str) -> None:
        pattern = check_key(pattern, "binding pattern")
        self._broker._call(self, partial(self._broker._bind_io, self, pattern), "bind")

    def unbind(self, pattern: str) -> None:
        pattern = check_key(pattern, "binding pattern")
        self._broker._call(self, partial(self._broker._unbind_io, self, pattern), "unbind")

    def publish(self, topic: str, body: bytes) -> None:
        topic = check_key(topic, "topic")
        self._broker._publish(self, _Outgoing(self._broker.exchange, topic, check_body(body)))

    def send(self, address: str, body: bytes) -> None:
        address = check_key(address, "address")
        self._broker._publish(
            self, _Outgoing(self._broker.inbox_exchange, address, check_body(body))
        )

    def close(self) -> None:
        self._broker._close_endpoint(self)

    def __enter__(self) -> KombuEndpoint:
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<KombuEndpoint {self.address!r} {state}>"


class KombuBroker(Broker):
    """A RabbitMQ connection through kombu's py-amqp transport.

    ``url`` is ``kombu+<kombu URL>``, e.g. ``kombu+amqp://guest:guest@127.0.0.1:5672//``,
    optionally with ``?exchange=<name>``; kombu's own query parameters (``heartbeat``,
    ``connect_timeout``, ``ssl_*``) pass through and win over the options below.

    The options, named and defaulted as :class:`brokers.pika_broker.PikaBroker` names them:
    ``exchange`` overrides the URL's. ``timeout_s``: how long ``open_endpoint``, ``bind``
    and ``unbind`` wait, a reconnect included, before raising :class:`BrokerError`.
    ``heartbeat_s``: AMQP heartbeat to ask for (0 disables it). ``connect_attempts``:
    attempts at the first connection before the constructor raises. ``reconnect_initial_s``
    and ``reconnect_max_s``: the backoff between attempts. ``max_pending``: publishes and
    sends accepted but not yet confirmed (queued, in flight, or waiting for a reconnect);
    past it ``publish``/``send`` raise :class:`BrokerError` at once rather than grow
    without bound. ``close_timeout_s``: how long ``close`` waits for the threads.

    Only here: ``connect_timeout_s``, the TCP connect timeout of one attempt;
    ``reconnect_attempts``, attempts at each reconnection (None: until closed);
    ``connection_name``, the client property RabbitMQ shows (default
    ``reservoir-kombu:<pid>:<n>``), the same across reconnects.
    """

    def __init__(
        self,
        url: str,
        *,
        exchange: str | None = None,
        timeout_s: float = 10.0,
        heartbeat_s: float = 30.0,
        connect_attempts: int = 3,
        reconnect_initial_s: float = 0.1,
        reconnect_max_s: float = 10.0,
        max_pending: int = 50_000,
        close_timeout_s: float = 5.0,
        connect_timeout_s: float = 5.0,
        reconnect_attempts: int | None = None,
        connection_name: str | None = None,
    ) -> None:
        target = _parse_url(url)
        if exchange is not None:
            target = target._replace(exchange=check_exchange(exchange))
        check_limits(
            timeout_s=timeout_s,
            close_timeout_s=close_timeout_s,
            max_pending=max_pending,
            connect_attempts=connect_attempts,
        )
        if reconnect_attempts is not None and reconnect_attempts < 1:
            raise ValueError("reconnect_attempts must be at least 1 (None: retry until closed)")
        self.url = target.display_url
        self._kombu_url = target.kombu_url
        self._exchange: Any = Exchange(
            target.exchange, type="topic", durable=True, auto_delete=False
        )
        self._inbox: Any = Exchange(
            inbox_exchange(target.exchange), type="topic", durable=True, auto_delete=False
        )
        self._timeout_s = timeout_s
        self._heartbeat_s = heartbeat_s
        self._connect_attempts = connect_attempts
        self._reconnect_initial_s = reconnect_initial_s
        self._reconnect_max_s = reconnect_max_s
        self._max_pending = max_pending
        self._close_timeout_s = close_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._reconnect_attempts = reconnect_attempts
        self._connection_name = (
            connection_name or f"reservoir-kombu:{os.getpid()}:{next(_connection_numbers)}"
        )
        # Building (not connecting) a kombu Connection here rejects a malformed URL or an
        # unknown kombu query parameter in the caller's thread, with the caller's traceback.
        try:
            self._new_connection().release()
        except (TypeError, ValueError) as error:
            raise ValueError(f"kombu cannot use {self.url!r}: {error}") from error

        # One lock guards the endpoint registry, the operation queue, the closing flag and
        # the connection counter; the IO thread never holds it across network calls.
        self._lock = threading.Lock()
        self._connected = threading.Condition(self._lock)
        self._endpoints: dict[str, KombuEndpoint] = {}
        self._ops: deque[_Op] = deque()
        self._wake_pending = False
        self._closing = False
        self._closing_event = threading.Event()
        self._connections = 0
        #: publishes and sends accepted and not yet settled (acked, nacked or dropped)
        self._pending = 0
        self._failure: BaseException | None = None
        # -- IO thread only --
        self._link: _Link | None = None
        #: exchanges this user may not configure: declared passively
        self._passive_exchanges: set[str] = set()
        #: endpoint channels the server closed, noted before py-amqp raised the close
        self._server_closes: list[_ServerClose] = []
        #: RabbitMQ said connection.blocked (a resource alarm): publishes wait in _held
        self._blocked = False
        self._held: deque[_Op] = deque()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._deliveries: queue.SimpleQueue[tuple[KombuEndpoint, Delivery] | None]
        self._deliveries = queue.SimpleQueue()

        ready: Future[None] = Future()
        self._io_thread = threading.Thread(
            target=self._io_main,
            args=(ready,),
            name=f"{self._connection_name}:io",
            daemon=True,
        )
        self._dispatch_thread = threading.Thread(
            target=self._dispatch_main, name=f"{self._connection_name}:dispatch", daemon=True
        )
        self._dispatch_thread.start()
        self._io_thread.start()
        try:
            ready.result()
        except BaseException:
            self.close()
            raise

    # -- public -------------------------------------------------------------------------

    @property
    def exchange(self) -> str:
        """The topic exchange this broker publishes on and binds to."""
        return str(self._exchange.name)

    @property
    def inbox_exchange(self) -> str:
        """The topic exchange sends go to, routed by the destination address."""
        return str(self._inbox.name)

    @property
    def connection_name(self) -> str:
        """The ``connection_name`` client property, as ``rabbitmqctl list_connections``
        shows it; the same on every reconnect."""
        return self._connection_name

    @property
    def connections(self) -> int:
        """How many times the broker has connected: 1 after the constructor, one more per
        completed recovery (the exchange, queues, bindings and consumers all restored)."""
        with self._lock:
            return self._connections

    @property
    def closed(self) -> bool:
        return self._closing

    def delete_exchanges(self) -> None:
        """Delete ``<exchange>`` and ``<exchange>.inbox``, with their bindings.

        For demos and tests that made exchanges of their own; never for a shared one (other
        participants' bindings go with it). Runs over a short-lived connection of its own,
        so it works before or after :meth:`close`. Idempotent: an exchange already gone is
        no error. Raises :class:`BrokerError` if RabbitMQ cannot be reached or refuses
        (a user without ``configure`` permission on the exchanges)."""
        connection = Connection(
            self._kombu_url,
            connect_timeout=self._connect_timeout_s,
            transport_options={
                "client_properties": {
                    "connection_name": f"{self._connection_name}:delete-exchanges"
                }
            },
        )
        try:
            connection.ensure_connection(max_retries=0, reraise_as_library_errors=False)
            connection.connection.sock.settimeout(self._timeout_s)
            for name in (self.exchange, self.inbox_exchange):
                channel = connection.channel()
                try:
                    channel.exchange_delete(name)
                finally:
                    with contextlib.suppress(Exception):
                        channel.close()
        except amqp.exceptions.AMQPError as error:
            raise BrokerError(f"RabbitMQ refused to delete the exchanges: {error}") from error
        except OSError as error:
            raise BrokerError(
                f"cannot reach {self.url} to delete the exchanges: {error!r}"
            ) from error
        finally:
            with contextlib.suppress(Exception):
                connection.release()

    def wait_for_connections(self, count: int, timeout_s: float) -> bool:
        """Block until :attr:`connections` reaches ``count``; False after ``timeout_s``."""
        with self._connected:
            return self._connected.wait_for(
                lambda: self._connections >= count or self._closing, timeout_s
            ) and (self._connections >= count)

    def open_endpoint(self, handler: Handler, *, name: str | None = None) -> KombuEndpoint:
        check_handler(handler)
        if name is not None:
            check_no_wildcards(check_endpoint_name(name))
        address = name if name is not None else f"inbox.{uuid.uuid4().hex}"
        with self._lock:
            self._check_usable()
            if address in self._endpoints:
                raise BrokerError(f"an endpoint named {address!r} is already open on this broker")
            endpoint = KombuEndpoint(self, address, handler)
            # Registered before the queue exists so that a concurrent open of the same
            # name is refused here, not by the server.
            self._endpoints[address] = endpoint
        try:
            self._call(None, partial(self._open_io, endpoint), "open_endpoint")
        except BaseException:
            wake = False
            with self._lock:
                if self._endpoints.get(address) is endpoint:
                    del self._endpoints[address]
                endpoint._closed = True
                if not self._closing:
                    # It may still complete on the IO thread after we gave up waiting:
                    # undo whatever it did. FIFO puts this before any later reopen.
                    wake = self._enqueue(_Op(partial(self._close_endpoint_io, endpoint), None))
            if wake:
                self._wake()
            raise
        return endpoint

    def close(self) -> None:
        with self._lock:
            first = not self._closing
            if first:
                self._closing = True
                endpoints = list(self._endpoints.values())
                for endpoint in endpoints:
                    endpoint._closed = True
                self._endpoints.clear()
                # Last in the queue: what was published before close() still goes out.
                self._enqueue(_Op(partial(self._shutdown_io, endpoints), None))
                self._connected.notify_all()
        if first:
            self._closing_event.set()
            self._wake()
        current = threading.current_thread()
        if current is not self._io_thread and self._io_thread.is_alive():
            self._io_thread.join(self._close_timeout_s)
            if self._io_thread.is_alive():
                log.warning("%s: IO thread did not stop in time", self._connection_name)
        if first:
            self._deliveries.put(None)
        if current is not self._dispatch_thread and self._dispatch_thread.is_alive():
            # A handler that closes the broker cannot wait for its own thread; the
            # dispatcher stops when that handler returns.
            self._dispatch_thread.join(self._close_timeout_s)
        if first and not self._io_thread.is_alive():
            self._wake_r.close()
            self._wake_w.close()

    def __enter__(self) -> KombuBroker:
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closing else f"{len(self._endpoints)} endpoints"
        return f"<KombuBroker {self.url!r} {self._connection_name} {state}>"

    # -- what other threads call --------------------------------------------------------------

    def _check_usable(self, endpoint: KombuEndpoint | None = None) -> None:
        """Called under the lock."""
        if self._closing:
            raise BrokerClosed("the broker is closed")
        if endpoint is not None and endpoint._closed:
            raise BrokerClosed(f"the endpoint {endpoint.address!r} is closed")
        if self._failure is not None:
            raise BrokerError(f"the broker's connection failed for good: {self._failure}")

    def _enqueue(self, op: _Op, *, front: bool = False) -> bool:
        """Queue ``op`` for the IO thread; called under the lock. Returns whether the IO
        thread needs waking (the caller wakes it after releasing the lock)."""
        if front:
            self._ops.appendleft(op)
        else:
            self._ops.append(op)
        return self._enqueue_wake()

    def _enqueue_wake(self) -> bool:
        """Under the lock: whether the IO thread needs a wake-up byte for new work."""
        if self._wake_pending:
            return False
        self._wake_pending = True
        return True

    def _wake(self) -> None:
        # Full of wake-ups already, or closed at shutdown: either way awake enough.
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"\0")

    def _publish(self, endpoint: KombuEndpoint, outgoing: _Outgoing) -> None:
        with self._lock:
            self._check_usable(endpoint)
            check_pending(self._pending, self._max_pending, connected=self._link is not None)
            self._pending += 1
            wake = self._enqueue(_Op(partial(self._publish_io, endpoint, outgoing), None, True))
        if wake:
            self._wake()

    def _call(self, endpoint: KombuEndpoint | None, run: Callable[[], T], what: str) -> T:
        """Run ``run`` on the IO thread and wait for its result."""
        if threading.current_thread() is self._io_thread:
            return run()
        future: Future[T] = Future()
        with self._lock:
            self._check_usable(endpoint)
            wake = self._enqueue(_Op(run, future))
        if wake:
            self._wake()
        timeout_s = self._timeout_s
        try:
            return future.result(timeout_s)
        except FutureTimeout:
            if not future.cancel():
                # Already running: the IO thread finishes it or fails it shortly.
                try:
                    return future.result(timeout_s)
                except FutureTimeout:
                    pass
            raise BrokerError(
                f"{what} did not complete within {timeout_s} s (is the broker reachable?)"
            ) from None

    def _close_endpoint(self, endpoint: KombuEndpoint) -> None:
        future: Future[None] = Future()
        with self._lock:
            if endpoint._closed:
                return
            endpoint._closed = True
            if self._endpoints.get(endpoint.address) is endpoint:
                del self._endpoints[endpoint.address]
            if self._closing:
                return
            wake = self._enqueue(_Op(partial(self._close_endpoint_io, endpoint), future))
        if wake:
            self._wake()
        if threading.current_thread() is self._io_thread or self._link is None:
            # Disconnected: the queue died with the connection it was declared on, and
            # recovery no longer knows the endpoint. Nothing to wait for.
            return
        # Waited for, so that a send after close() returns comes back to its sender.
        try:
            future.result(self._timeout_s)
        except FutureTimeout:
            log.warning(
                "closing endpoint %r timed out; its queue goes with the connection",
                endpoint.address,
            )
        except Exception as error:
            log.warning("closing endpoint %r failed: %s", endpoint.address, error)

    # -- the dispatcher thread ----------------------------------------------------------------

    def _dispatch_main(self) -> None:
        run_handlers(self._deliveries, log)

    # -- the IO thread: main loop ---------------------------------------------------------------

    def _io_main(self, ready: Future[None]) -> None:
        try:
            self._connect_with_retries(initial=True)
        except BaseException as error:
            ready.set_exception(
                error
                if isinstance(error, BrokerError)
                else BrokerError(f"cannot connect to {self.url}: {error!r}")
            )
            self._io_finish(error)
            return
        ready.set_result(None)
        failure: BaseException | None = None
        while True:
            try:
                self._serve()
                break
            except _Closing:
                break
            except self._link_errors() as error:
                # Nothing the server refused may be replayed on the next connection.
                self._recover_refused(repair=False)
                self._drop_link()
                if self._closing:
                    break
                log.warning("%s: connection lost (%r); reconnecting", self._connection_name, error)
                try:
                    self._connect_with_retries(initial=False)
                except _Closing:
                    break
                except BaseException as fatal:
                    log.error("%s: giving up reconnecting: %r", self._connection_name, fatal)
                    failure = fatal
                    break
            except BaseException as bug:
                log.exception("%s: IO thread failed", self._connection_name)
                failure = bug
                break
        self._io_finish(failure)

    def _link_errors(self) -> tuple[type[BaseException], ...]:
        """What means "this connection is unusable, make another": socket errors, AMQP
        connection errors, and a channel error the server raised on its own (a channel
        error caused by one operation is caught and reported by that operation)."""
        return (OSError, amqp.exceptions.ConnectionError, amqp.exceptions.ChannelError)

    def _serve(self) -> None:
        link = self._link
        assert link is not None
        selector = selectors.DefaultSelector()
        try:
            selector.register(self._wake_r, selectors.EVENT_READ)
            selector.register(link.sock, selectors.EVENT_READ)
            tick_s = link.heartbeat_s / 4 if link.heartbeat_s else None
            next_tick = time.monotonic() + tick_s if tick_s else None
            while True:
                if self._run_ops():
                    return  # shut down
                timeout = None if next_tick is None else max(0.0, next_tick - time.monotonic())
                events = selector.select(timeout)
                if any(key.fileobj is link.sock for key, _ in events) or _has_pending(link.sock):
                    try:
                        self._read(link)
                    except amqp.exceptions.ChannelError:
                        # A refused publish costs its endpoint's channel, not the link.
                        if not self._recover_refused(repair=True):
                            raise
                if next_tick is not None and tick_s is not None:
                    now = time.monotonic()
                    if now >= next_tick:
                        # Sends our heartbeat when due; raises when the server's are missed.
                        link.connection.heartbeat_check(rate=2)
                        next_tick = now + tick_s
        finally:
            selector.close()

    def _read(self, link: _Link) -> None:
        """Read what the socket has: at most ``_READ_BATCH`` methods, so that a flood of
        deliveries cannot starve queued operations."""
        for _ in range(_READ_BATCH):
            try:
                link.connection.connection.drain_events(timeout=_FRAME_TIMEOUT_S)
            except TimeoutError:
                return  # the rest of a frame is late; py-amqp keeps what it read
            if not _readable_now(link.sock):
                return

    def _run_ops(self) -> bool:
        """Run every queued operation; True when one of them shut the broker down."""
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        with self._lock:
            batch = list(self._ops)
            self._ops.clear()
            self._wake_pending = False
        if self._held and not self._blocked:
            batch[:0] = self._held
            self._held.clear()
        for index, op in enumerate(batch):
            if (
                op.future is not None
                and not op.started
                and not op.future.set_running_or_notify_cancel()
            ):
                continue  # the caller gave up waiting before it started
            if op.publish and (self._blocked or self._held):
                # Behind any still held (an unblock mid-batch releases them next time).
                self._held.append(op)
                continue
            op.started = True
            try:
                result = op.run()
            except self._link_errors() as error:
                if self._channel_error_of_op(error):
                    self._fail_op(op, error)
                    continue
                # A refused publish that surfaced here (py-amqp raises a channel's close
                # from whatever read the frame) must not be replayed after the reconnect.
                self._recover_refused(repair=False)
                # The connection is gone: this operation and the rest wait for the next.
                retry = [] if op.publish else [op]
                with self._lock:
                    self._ops.extendleft(reversed(retry + batch[index + 1 :]))
                raise
            except _Closing:
                return True
            except Exception as error:
                self._fail_op(op, error)
            else:
                if op.future is not None:
                    op.future.set_result(result)
        return False

    @staticmethod
    def _channel_error_of_op(error: BaseException) -> bool:
        """True for an error the server raised on the control channel in answer to the
        operation itself (e.g. a queue name locked by another connection). py-amqp has
        already reopened that channel, so the connection stays usable."""
        if not isinstance(error, amqp.exceptions.ChannelError):
            return False
        method = getattr(error, "method_sig", None) or (0, 0)
        # class 40 is exchange.*, 50 is queue.*: only the control channel sends those.
        return bool(method[0] in (40, 50))

    def _fail_op(self, op: _Op, error: BaseException) -> None:
        if op.future is None:
            log.warning("%s: an operation failed: %r", self._connection_name, error)
            return
        if isinstance(error, BrokerError | TypeError | ValueError):
            op.future.set_exception(error)
        elif isinstance(error, amqp.exceptions.ResourceLocked):
            op.future.set_exception(BrokerError(f"the name is held by another connection: {error}"))
        else:
            op.future.set_exception(BrokerError(f"the broker refused: {error!r}"))

    def _io_finish(self, failure: BaseException | None) -> None:
        """The IO thread's last act: release the connection and everyone still waiting."""
        self._drop_link()
        with self._lock:
            if failure is not None and not self._closing:
                self._failure = failure
            pending = list(self._ops)
            self._ops.clear()
            self._connected.notify_all()
        for op in pending:
            if op.future is not None and op.future.set_running_or_notify_cancel():
                op.future.set_exception(
                    BrokerClosed("the broker is closed")
                    if failure is None
                    else BrokerError(f"the broker's connection failed for good: {failure!r}")
                )

    # -- the IO thread: connecting ------------------------------------------------------

    def _new_connection(self) -> Any:
        return Connection(
            self._kombu_url,
            heartbeat=self._heartbeat_s,
            connect_timeout=self._connect_timeout_s,
            transport_options={
                "client_properties": {"connection_name": self._connection_name},
                "on_blocked": self._on_blocked,
                "on_unblocked": self._on_unblocked,
            },
        )

    def _connect_with_retries(self, *, initial: bool) -> None:
        if initial:
            # A wrong password, vhost or exchange type will not fix itself: fail fast.
            transient = (
                OSError,
                amqp.exceptions.RecoverableConnectionError,
                amqp.exceptions.RecoverableChannelError,
            )
            retry = retry_if_exception(lambda error: isinstance(error, transient))
            stop: Any = stop_after_attempt(self._connect_attempts)
        else:
            # Once we have been connected, anything may be passing (a restarting node, a
            # queue name still held by our dead connection): retry all but a close().
            retry = retry_if_exception(lambda error: not isinstance(error, _Closing))
            stop = (
                stop_never
                if self._reconnect_attempts is None
                else stop_after_attempt(self._reconnect_attempts)
            )
        retrying = Retrying(
            retry=retry,
            stop=stop,
            wait=reconnect_wait(self._reconnect_initial_s, self._reconnect_max_s),
            sleep=self._sleep_unless_closing,
            before_sleep=self._log_retry,
            reraise=True,
        )
        for attempt in retrying:
            with attempt:
                if self._closing:
                    raise _Closing
                self._connect()

    def _sleep_unless_closing(self, seconds: float) -> None:
        if self._closing_event.wait(seconds):
            raise _Closing

    def _log_retry(self, state: RetryCallState) -> None:
        outcome = state.outcome
        error = outcome.exception() if outcome is not None else None
        log.warning(
            "%s: connecting failed (attempt %d): %r",
            self._connection_name,
            state.attempt_number,
            error,
        )

    def _connect(self) -> None:
        connection = self._new_connection()
        try:
            # One try: tenacity owns the retries (kombu's own connect() would retry once
            # more after sleeping two seconds).
            connection.ensure_connection(max_retries=0, reraise_as_library_errors=False)
            sock = connection.connection.sock
            # The heartbeat tick does not run while the IO thread waits for a reply, so the
            # socket's own timeout keeps a silent server from holding an RPC for ever.
            sock.settimeout(self._timeout_s)
            # py-amqp polls the socket (drain_events(timeout=0)) before every publish when
            # the server supports connection.blocked, to see a Blocked notification early.
            # This thread reads the socket whenever it is readable anyway, so the poll only
            # costs syscalls: without it a connection carries twice the messages (measured
            # 4 000 -> 8 000 msg/s). Blocked/Unblocked still arrive, and are logged.
            capabilities = connection.connection.client_properties.get("capabilities", {})
            capabilities["connection.blocked"] = False
            control = connection.channel()
            for exchange in (self._exchange, self._inbox):
                self._declare_exchange_io(control, exchange, connection.userid)
            user_id = connection.userid if connection.login_method != "EXTERNAL" else None
            self._link = _Link(
                connection=connection,
                control=control,
                sock=sock,
                heartbeat_s=float(connection.get_heartbeat_interval() or 0),
                user_id=user_id,
            )
            with self._lock:
                endpoints = list(self._endpoints.values())
            # Every queue, binding and consumer first, then the replay: a replayed publish
            # must find the bindings of this broker's own endpoints in place.
            for endpoint in endpoints:
                self._attach_io(endpoint)
            for endpoint in endpoints:
                self._replay_io(endpoint)
        except BaseException:
            self._recover_refused(repair=False)
            self._drop_link(connection)
            raise
        with self._lock:
            self._connections += 1
            self._connected.notify_all()
        log.info("%s: connected to %s", self._connection_name, self.url)

    def _declare_exchange_io(self, channel: Any, exchange: Any, user: str | None) -> None:
        """Declare a durable topic exchange; passively when the user may not configure it
        (see "Exchanges under restricted users" in the module docstring)."""
        if exchange.name not in self._passive_exchanges:
            try:
                exchange(channel).declare()
                return
            except amqp.exceptions.AccessRefused as error:
                # py-amqp has reopened the channel the refusal closed.
                log.info(
                    "%s: user %r may not declare exchange %r (%s); checking that it exists",
                    self._connection_name,
                    user,
                    exchange.name,
                    error,
                )
            # Reconnects go straight to the passive declare: one refusal is enough.
            self._passive_exchanges.add(exchange.name)
        try:
            exchange(channel).declare(passive=True)
        except amqp.exceptions.NotFound as error:
            raise BrokerError(missing_exchange(exchange.name, user)) from error

    def _drop_link(self, connection: Any = None) -> None:
        """Forget the current connection without talking to the server (it may be gone)."""
        link, self._link = self._link, None
        self._release_held()
        if connection is None and link is not None:
            connection = link.connection
        if connection is not None:
            try:
                connection.collect()
            except Exception as error:  # it is already broken; nothing more to do with it
                log.debug("%s: releasing a dead connection: %r", self._connection_name, error)

    # -- the IO thread: endpoints -------------------------------------------------------

    def _require_link(self) -> _Link:
        link = self._link
        if link is None:
            raise amqp.exceptions.RecoverableConnectionError("not connected")
        return link

    def _open_io(self, endpoint: KombuEndpoint) -> None:
        if endpoint._closed:
            raise BrokerClosed(f"the endpoint {endpoint.address!r} is closed")
        self._attach_io(endpoint)

    def _attach_io(self, endpoint: KombuEndpoint) -> None:
        """Create the endpoint's queue, bindings, channel, producer and consumer on the
        current connection: when it opens, and again after every reconnect."""
        link = self._require_link()
        # Declared on the control channel first: a name locked by another connection then
        # fails before anything else exists.
        endpoint._queue(link.control).queue_declare()
        endpoint._link = link
        # Its address on the inbox exchange, before anything is consumed: once open() has
        # returned, a send to the address reaches it.
        endpoint._queue(link.control).bind_to(self._inbox.name, routing_key=endpoint.address)
        for pattern in endpoint._patterns:
            endpoint._queue(link.control).bind_to(self._exchange.name, routing_key=pattern)
        channel = link.connection.channel()
        endpoint._channel = channel
        self._watch_server_close(endpoint, channel)
        channel.confirm_select()
        endpoint._next_tag = 1
        channel.events["basic_ack"].add(partial(self._on_ack, endpoint, channel))
        channel.events["basic_nack"].add(partial(self._on_nack, endpoint, channel))
        endpoint._producer = Producer(
            channel, auto_declare=False, on_return=partial(self._on_return, endpoint)
        )
        endpoint._queue(channel).consume(
            callback=partial(self._on_message, endpoint),
            no_ack=True,
            on_cancel=partial(self._on_cancel, endpoint),
        )

    def _watch_server_close(self, endpoint: KombuEndpoint, channel: Any) -> None:
        """Note which endpoint channel the server closes, and why, before py-amqp reopens it
        and raises the close from whichever read received it (the error says neither the
        channel nor the endpoint)."""
        callbacks = getattr(channel, "_callbacks", None)
        close = amqp.spec.Channel.Close
        if not isinstance(callbacks, dict) or close not in callbacks:
            return  # another py-amqp: a refused publish then costs a reconnect
        original = callbacks[close]

        def on_close(reply_code: int, reply_text: str, class_id: int, method_id: int) -> Any:
            self._server_closes.append(
                _ServerClose(endpoint, channel, reply_code, reply_text, (class_id, method_id))
            )
            return original(reply_code, reply_text, class_id, method_id)

        callbacks[close] = on_close

    def _recover_refused(self, *, repair: bool) -> bool:
        """Deal with endpoint channels the server closed since the last call. For a publish
        RabbitMQ refused (403: this user may not publish there, e.g. a node sending to
        another node), the refused messages go back to their sender as returned (nobody
        received them) and, with ``repair``, the endpoint gets a new channel, consumer and
        replay of the rest. Without this, every reconnect would replay the refused message
        and be refused again, for ever. False if a close was anything else (the caller
        then treats the link as broken)."""
        handled = bool(self._server_closes)
        broken: list[KombuEndpoint] = []
        while True:
            # First hand back what every close so far refused (no network involved), so
            # that nothing refused is replayed, whatever happens next.
            closes, self._server_closes = self._server_closes, []
            for close in closes:
                endpoint = close.endpoint
                if close.reply_code != 403 or close.method != _BASIC_PUBLISH:
                    handled = False
                    continue
                if endpoint._channel is not close.channel:
                    continue  # closed or replaced since
                self._hand_back_refused(endpoint, close.reply_text)
                if endpoint not in broken:
                    broken.append(endpoint)
            if not (repair and handled and broken):
                return handled
            endpoint = broken.pop(0)
            if endpoint._closed or endpoint._link is not self._link:
                continue
            try:
                self._reattach_io(endpoint)
            except amqp.exceptions.ChannelError:
                if not self._server_closes:
                    raise
                # Another endpoint's refusal surfaced meanwhile: that one first, then this
                # one again.
                broken.append(endpoint)

    def _reattach_io(self, endpoint: KombuEndpoint) -> None:
        """A new channel and consumer for the endpoint on the current connection (its queue
        and bindings are redeclared, which is harmless), then the replay of the rest."""
        old, endpoint._channel = endpoint._channel, None
        if old is not None:
            old.close()  # the one py-amqp reopened after the server closed it
        self._attach_io(endpoint)
        self._replay_io(endpoint)

    def _hand_back_refused(self, endpoint: KombuEndpoint, reply_text: str) -> None:
        """RabbitMQ handles a channel's publishes in order and ignores what follows a
        refused one: those before it were routed (their acks are lost with the channel) and
        are settled; the refused ones go back to the sender; those after stay unconfirmed,
        for the replay."""
        target = refused_target(reply_text)
        unconfirmed = endpoint._unconfirmed
        refused = [
            tag
            for tag, out in unconfirmed.items()
            if aimed_at(out.exchange, out.routing_key, target)
        ]
        if refused:
            routed = [tag for tag in unconfirmed if tag < refused[0]]
            for tag in routed:
                del unconfirmed[tag]
            self._settle(len(routed))
        else:
            # We cannot tell which it was: hand them all back rather than loop (the
            # protocol survives lost messages).
            refused = list(unconfirmed)
        link = self._link
        user_id = link.user_id if link is not None else None
        log.warning(
            "%s: RabbitMQ refused %d message(s) from %r (%s); handed back as returned",
            self._connection_name,
            len(refused),
            endpoint.address,
            reply_text,
        )
        for tag in refused:
            outgoing = unconfirmed.pop(tag)
            self._deliveries.put(
                (
                    endpoint,
                    Delivery(
                        outgoing.body,
                        topic=topic_of(
                            outgoing.exchange, outgoing.routing_key, self.inbox_exchange
                        ),
                        returned=True,
                        user_id=user_id,
                    ),
                )
            )
        self._settle(len(refused))

    def _replay_io(self, endpoint: KombuEndpoint) -> None:
        """Publish again what the broker never confirmed on the endpoint's last channel."""
        pending, endpoint._unconfirmed = endpoint._unconfirmed, {}
        if pending:
            log.info(
                "%s: republishing %d unconfirmed messages from %r",
                self._connection_name,
                len(pending),
                endpoint.address,
            )
        for outgoing in pending.values():
            self._publish_io(endpoint, outgoing)

    def _bind_io(self, endpoint: KombuEndpoint, pattern: str) -> None:
        if endpoint._closed:
            raise BrokerClosed(f"the endpoint {endpoint.address!r} is closed")
        if pattern in endpoint._patterns:
            return  # RabbitMQ would treat it as one binding anyway
        link = self._require_link()
        queue = endpoint._queue(link.control)
        try:
            queue.bind_to(self._exchange.name, routing_key=pattern)
        except amqp.exceptions.NotFound:
            # The exchange was deleted under us (by an operator, say). A publish would
            # reconnect, which declares it again; a bind does that here, once.
            log.warning(
                "%s: exchange %r is gone; declaring it again",
                self._connection_name,
                self._exchange.name,
            )
            self._declare_exchange_io(link.control, self._exchange, link.user_id)
            queue.bind_to(self._exchange.name, routing_key=pattern)
        endpoint._patterns[pattern] = None

    def _unbind_io(self, endpoint: KombuEndpoint, pattern: str) -> None:
        if endpoint._closed:
            raise BrokerClosed(f"the endpoint {endpoint.address!r} is closed")
        if pattern not in endpoint._patterns:
            return
        link = self._require_link()
        endpoint._queue(link.control).unbind_from(self._exchange, routing_key=pattern)
        del endpoint._patterns[pattern]

    def _publish_io(self, endpoint: KombuEndpoint, outgoing: _Outgoing) -> None:
        link = self._link
        if endpoint._closed and endpoint._channel is None:
            log.debug("dropping a publish from closed endpoint %r", endpoint.address)
            self._settle(1)
            return
        # Recorded before it is written: if the write fails, recovery replays it.
        tag = endpoint._next_tag
        endpoint._next_tag += 1
        endpoint._unconfirmed[tag] = outgoing
        if link is None or endpoint._link is not link or endpoint._channel is None:
            return  # not attached to this connection (yet): the next attach replays it
        properties = {} if link.user_id is None else {"user_id": link.user_id}
        endpoint._producer.publish(
            outgoing.body,
            exchange=outgoing.exchange,
            routing_key=outgoing.routing_key,
            mandatory=True,
            delivery_mode=1,  # the queues are exclusive: nothing to persist for
            content_type="application/octet-stream",
            content_encoding="binary",
            **properties,
        )

    def _close_endpoint_io(self, endpoint: KombuEndpoint) -> None:
        link, channel = self._link, endpoint._channel
        endpoint._channel = endpoint._producer = None
        # What it sent before closing was written before the channel closes, so RabbitMQ
        # routes it; its acks would arrive on a closed channel: settle it now.
        self._settle(len(endpoint._unconfirmed))
        endpoint._unconfirmed.clear()
        if link is None or endpoint._link is not link:
            return  # its queue died with the connection it was declared on
        endpoint._link = None
        # The channel first, which ends the consumer, so that deleting the queue does not
        # make the server cancel a consumer we still have.
        if channel is not None:
            channel.close()
        endpoint._queue(link.control).delete()

    def _shutdown_io(self, endpoints: list[KombuEndpoint]) -> None:
        link = self._link
        if link is not None:
            try:
                # Bounded so that close() returns in time even if the server went silent.
                link.sock.settimeout(max(self._close_timeout_s / 2, 0.1))
                for endpoint in endpoints:
                    self._close_endpoint_io(endpoint)
                link.control.close()
                link.connection.release()
                self._link = None
            except self._link_errors() as error:
                log.debug("%s: connection failed while closing: %r", self._connection_name, error)
        raise _Closing

    # -- the IO thread: callbacks from py-amqp ------------------------------------------------

    def _on_blocked(self, reason: str) -> None:
        # Writing now would only fill the socket until the write timed out and the link
        # were dropped: publishes wait in memory (up to max_pending) until unblocked.
        log.warning(
            "%s: RabbitMQ blocks publishing (%s); holding publishes",
            self._connection_name,
            reason,
        )
        self._blocked = True

    def _on_unblocked(self) -> None:
        log.warning(
            "%s: RabbitMQ accepts publishes again; sending %d held",
            self._connection_name,
            len(self._held),
        )
        self._release_held()

    def _release_held(self) -> None:
        """Let held publishes go: the next ``_run_ops`` runs them first, in order."""
        self._blocked = False
        if self._held:
            with self._lock:
                wake = self._enqueue_wake()
            if wake:
                self._wake()

    def _on_message(self, endpoint: KombuEndpoint, message: Any) -> None:
        info = message.delivery_info
        topic = topic_of(info.get("exchange"), info.get("routing_key"), self.inbox_exchange)
        self._deliveries.put(
            (
                endpoint,
                Delivery(
                    _as_bytes(message.body),
                    topic=topic,
                    user_id=message.properties.get("user_id"),
                ),
            )
        )

    def _on_return(
        self, endpoint: KombuEndpoint, error: Any, exchange: str, routing_key: str, message: Any
    ) -> None:
        log.debug("%r came back from %r (%s)", routing_key, exchange or "(default)", error)
        self._deliveries.put(
            (
                endpoint,
                Delivery(
                    _as_bytes(message.body),
                    topic=topic_of(exchange, routing_key, self.inbox_exchange),
                    returned=True,
                    user_id=message.properties.get("user_id"),
                ),
            )
        )

    def _on_ack(self, endpoint: KombuEndpoint, channel: Any, tag: int, multiple: bool) -> None:
        if endpoint._channel is not channel:
            return  # an ack for a channel we have since replaced
        self._settle(len(self._confirm(endpoint, tag, multiple)))

    def _on_nack(self, endpoint: KombuEndpoint, channel: Any, tag: int, multiple: bool) -> None:
        if endpoint._channel is not channel:
            return
        refused = self._confirm(endpoint, tag, multiple)
        self._settle(len(refused))
        # RabbitMQ refused responsibility (e.g. a queue with overflow=reject-publish is
        # full). Not retried, as in the pika adapter: the protocol survives a lost message
        # (reservations expire, requests widen), and republishing into a full queue only
        # adds load.
        for outgoing in refused:
            log.warning(
                "%s: RabbitMQ nacked a message from %r to %r; dropped",
                self._connection_name,
                endpoint.address,
                outgoing.routing_key,
            )

    @staticmethod
    def _confirm(endpoint: KombuEndpoint, tag: int, multiple: bool) -> list[_Outgoing]:
        """Remove and return what an ack or nack settles."""
        unconfirmed = endpoint._unconfirmed
        if not multiple:
            outgoing = unconfirmed.pop(tag, None)
            return [] if outgoing is None else [outgoing]
        settled: list[_Outgoing] = []
        # Tags are inserted in increasing order, so the settled ones are a prefix.
        while unconfirmed:
            oldest = next(iter(unconfirmed))
            if oldest > tag:
                break
            settled.append(unconfirmed.pop(oldest))
        return settled

    def _settle(self, count: int) -> None:
        if count:
            with self._lock:
                self._pending -= count

    def _on_cancel(self, endpoint: KombuEndpoint, consumer_tag: str) -> None:
        if endpoint._closed:
            return
        # Someone deleted the queue under us (an operator, a policy): rebuild it on this
        # connection, before anything else the IO thread does next.
        log.warning(
            "%s: the server cancelled the consumer of %r; re-creating its queue",
            self._connection_name,
            endpoint.address,
        )

        def reattach() -> None:
            if endpoint._closed or endpoint._link is not self._link:
                return
            old = endpoint._channel
            endpoint._channel = None
            try:
                if old is not None:
                    old.close()
                self._attach_io(endpoint)
            except Exception as error:
                # An endpoint left half-attached would swallow publishes: start afresh.
                raise amqp.exceptions.RecoverableConnectionError(
                    f"cannot re-create the queue of {endpoint.address!r}: {error!r}"
                ) from error
            self._replay_io(endpoint)

        with self._lock:
            wake = self._enqueue(_Op(reattach, None), front=True)
        if wake:
            self._wake()


def _as_bytes(body: object) -> bytes:
    if type(body) is bytes:
        return body
    if isinstance(body, bytes | bytearray | memoryview):
        return bytes(body)
    if isinstance(body, str):  # py-amqp does not decode bodies; be exact if it ever does
        return body.encode("utf-8", "surrogateescape")
    raise TypeError(f"unexpected message body type {type(body).__name__}")


def _has_pending(sock: socket.socket) -> bool:
    """TLS can hold decrypted bytes the selector cannot see."""
    pending = getattr(sock, "pending", None)
    return bool(pending and pending())


def _readable_now(sock: socket.socket) -> bool:
    if _has_pending(sock):
        return True
    if hasattr(select, "poll"):
        poller = select.poll()  # no descriptor limit, unlike select.select
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))
    return bool(select.select([sock], [], [], 0)[0])
