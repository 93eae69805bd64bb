"""The RabbitMQ adapter (pika), the default for ``amqp://`` and ``amqps://`` URLs.

This module owns everything between reservoir's :class:`~reservoir.broker.Broker` contract
and one RabbitMQ connection: the topology (one durable topic exchange, one exclusive queue
per endpoint, named by the endpoint's address), mandatory publishing with pipelined
publisher confirms, handing ``basic.return`` back to the sending endpoint, the connection's
IO thread and the handlers' dispatcher thread, and reconnection. The rules it shares with
the other adapters (what a body, key, name or exchange may be, the exchange names, the
reservoir-only URL parameters, how a 403 names what it refused, the dispatcher loop) live in
:mod:`brokers._rules`.

Topology
    Two durable, not auto-deleted topic exchanges (an auto-deleted one would vanish when
    the last queue unbinds and the next publish would kill the channel):

    - ``<exchange>`` (``reservoir`` unless the URL says ``?exchange=<name>``): ``publish``
      goes here with the topic as routing key; ``bind`` is ``queue.bind`` on it.
    - ``<exchange>.inbox`` (``reservoir.inbox`` by default): ``send`` goes here with the
      destination address as routing key. Every endpoint binds its own queue to it with
      binding key = its own address when it opens (and again on every reconnect), so an
      address, which may not contain ``*`` or ``#``, matches exactly one queue.

    Every endpoint is an exclusive queue whose name is its address, so the address
    survives a reconnect. Reservoir-only query parameters (``exchange``) are stripped
    before pika sees the URL. Exchange names starting with ``amq.`` are refused: RabbitMQ
    reserves the prefix, so ``amq.topic.inbox`` could never be created.

    Why sends do not use the default exchange: it is a direct exchange, and RabbitMQ's
    topic permissions only apply to topic exchanges. Through ``<exchange>.inbox`` an
    operator can give each role a user whose topic permissions say where it may send and
    which addresses it may bind: a node's credentials can answer requestors
    (``reservoir.requestor.*``) but cannot send an ``Award`` to another node, nor (without
    write permission on ``<exchange>``) publish a request. ``deploy/rabbitmq/`` ships those
    definitions. A returned send is told from a returned publish by the exchange in the
    ``basic.return``: the inbox exchange (or the default one) means a send.

    Declaring exchanges under restricted users: the exchanges are declared actively (which
    checks that an existing one has the right type and durability: ``406
    PRECONDITION_FAILED`` otherwise). A user without ``configure`` permission on them gets
    ``403 ACCESS_REFUSED``; the adapter then declares passively, which needs no permission
    and only checks that the exchange exists, as an operator creates it from the
    definitions. A missing exchange the user may not create fails the first connection at
    once (``404 NOT_FOUND``); on a reconnect it is retried, as an operator may yet create
    it. The refused active declare costs that user a control-channel reopen and an ``access
    refused`` line in the RabbitMQ log (and a pika warning), on the first connection only:
    reconnects remember it and declare passively. Active first rather than passive first,
    because passive never checks the type: a ``direct`` exchange of that name would route
    topic patterns literally and silently.

    ``delete_exchanges()`` deletes both exchanges over a short-lived connection of its own
    (so it works before or after ``close()``), for demos and tests that made their own.

Threading model: a ``SelectConnection`` on its own IO thread
    pika connections are not thread-safe. The broker runs one ``SelectConnection`` (and its
    ``IOLoop``, which outlives reconnects) on a thread it owns. ``SelectConnection`` rather
    than a ``BlockingConnection`` on a thread because confirms must be asynchronous: the
    blocking adapter's ``confirm_delivery`` turns every publish into a round trip, while the
    select adapter reports acks and nacks as callbacks, so publishes are pipelined and
    confirmed in batches (``multiple=True``). Every call from another thread reaches the IO
    thread through ``IOLoop.add_callback_threadsafe``; publishes and sends are appended to
    an outbox under a lock and one wake-up drains everything queued since, so a burst costs
    one wake-up, not one per message, and the outbox keeps the callers' order.
    ``bind``, ``unbind``, ``open_endpoint`` and endpoint ``close`` wait (``timeout_s``) on a
    future the IO thread resolves when RabbitMQ answers (``BindOk``...); ``publish`` and
    ``send`` never wait on RabbitMQ.

    Handlers run on a separate dispatcher thread, one per broker, in arrival order, never
    concurrently (like the in-process broker's one delivery thread). They must not run on
    the IO thread: reservoir's handlers call back into the endpoint, including the blocking
    ``bind`` (a node re-binds its tier topics from inside its handler), and a blocking call
    on the IO thread would wait for itself.

    Three channels per connection: *publish* (confirm mode, ``basic.return`` handler),
    *consume* (every endpoint's consumer) and *control* (declare, bind, unbind, delete). A
    control method can legitimately fail (``queue.declare`` of a name another connection
    holds exclusively gets ``405 RESOURCE_LOCKED``, which closes the channel); keeping it on
    its own channel fails that one call and reopens the control channel, instead of
    disturbing consumers and in-flight publishes. Likewise a publish RabbitMQ refuses
    (``403 ACCESS_REFUSED``: the user's permissions forbid that exchange or topic) closes
    the publish channel only, which is reopened (see below). Any other channel loss resets
    the connection.

Publishing, confirms, returns, user_id
    Every publish and send is ``mandatory`` on the confirm-mode channel. Messages wait in an
    in-order map until acked; an ack (or nack) with ``multiple`` settles everything up to
    its tag. A nack means RabbitMQ refused responsibility (for example a queue with
    ``overflow=reject-publish`` is full); it is counted and logged, not retried: the
    protocol treats it as a lost message (reservations expire, requests widen), and
    re-publishing into a full queue only adds load. Each message carries ``app_id`` = the
    sending endpoint's broker-local token; a ``basic.return`` is mapped back by that token
    and handed to the sender's handler as ``Delivery(returned=True)`` with the routing key
    as topic for publishes and None for sends (RabbitMQ sends the return before the ack).
    ``user_id`` is set to the connection's username on every message; RabbitMQ refuses a
    message whose ``user_id`` is not the authenticated user, so ``Delivery.user_id`` is an
    authenticated sender.

    A publish or send the user may not make (a node sending to another node under the
    per-role definitions, or to a ``reply_to`` outside ``reservoir.requestor.*``) makes
    RabbitMQ close the publish channel with ``403``. It is handed back to its sender as
    ``Delivery(returned=True)``, like an unroutable one (nobody received it), logged and
    counted (``stats.refused``); RabbitMQ handles a channel's publishes in order and
    ignores what follows a refused one, so the unconfirmed messages before it count as
    delivered and those after it are published again, in order, on a new publish channel.
    The connection is not reset: a reconnect would republish the refused message and be
    refused again, for ever.

Consuming: auto-ack
    Endpoint queues are exclusive, so they die with the connection: a manual ack could not
    get a message redelivered to anyone after a crash, and the protocol is built to survive
    lost messages. Auto-ack saves one cross-thread hop and one frame per delivery. The cost:
    RabbitMQ pushes without a prefetch limit, so a handler slower than its inflow grows the
    dispatcher's in-memory queue rather than the broker-side queue.

Reconnection
    On a lost connection (broker restart, ``rabbitmqctl close_connection``, missed
    heartbeats: 30 s unless the URL says ``heartbeat=``) the IO thread reconnects with
    tenacity's exponential backoff with jitter (``Retrying``, ``reconnect_initial_s`` to
    ``reconnect_max_s``, forever, until ``close()``), re-declares both exchanges, re-creates
    every open endpoint's exclusive queue under the same name, re-binds its address on the
    inbox exchange and every pattern on the topic exchange, and restarts the consumers;
    ``bind``/``unbind``/``open_endpoint`` calls made meanwhile wait for that (up to
    ``timeout_s``). The first connection is tried ``connect_attempts`` times
    and the constructor raises :class:`~reservoir.broker.BrokerError` if all fail.

    Messages published while disconnected are **buffered, bounded**: accepted messages that
    RabbitMQ has not yet confirmed (queued, in flight, or waiting for the reconnect) are
    capped at ``max_pending`` (default 50 000); past it, ``publish``/``send`` raise
    ``BrokerError`` at once rather than grow without bound or block. After a reconnect the
    messages that were in flight unconfirmed are published again, before the buffered ones,
    so each sender's order holds: publishing is at-least-once across a reconnect, which the
    protocol tolerates (every message is idempotent by ``request_id``; late ones are
    harmless). Failing fast on every disconnect would instead turn a one-second broker blip
    into failed placements and a lost ``Release`` into a reservation held to its TTL. What
    RabbitMQ had already queued for *our* endpoints when the connection dropped is lost
    with their exclusive queues; reservation expiry and widening recover from that.

    Each connection announces ``connection_name`` ``reservoir:<pid>:<n>`` (``n`` counts
    brokers in this process), the same across reconnects, so an operator (or a test) can
    find and close exactly this broker's connection.

``close()`` waits (up to ``close_timeout_s``) for accepted messages to be confirmed, deletes
the endpoints' queues, closes the connection and joins both threads. Idempotent.

Reply path: exclusive named queue, not direct reply-to (measured)
    The founding design asked to choose between direct reply-to
    (``amq.rabbitmq.reply-to``) and a reply
    queue by measuring both. ``benchmarks/reply_path.py`` does, with pika, in one run
    (responder in its own process, paths alternated, medians of 3 rounds of 2000
    sequential round trips and 20 000 requests with 100 in flight; 256-byte bodies;
    RabbitMQ 3.10.8 on localhost, a 2-CPU machine shared by broker and both clients):

    ===============  ===============  ===============  ==================
    run              p50 latency us   p99 latency us   throughput req/s
                     queue / direct   queue / direct   queue / direct
    ===============  ===============  ===============  ==================
    1                627 / 747        1641 / 4331      3398 / 2938
    2                582 / 682        3190 / 984       5252 / 3032
    ===============  ===============  ===============  ==================

    Direct reply-to was *slower* in every run: x1.17-1.19 the p50 latency and x0.58-0.86
    the throughput (two earlier runs with the responder as a thread agreed: x1.15-1.18,
    x0.77-0.87). Tails are noise on two CPUs. The queue hop direct reply-to saves is
    evidently not where the time goes. And it cannot meet the contract: its address exists
    only while the channel that published the request lives (a reply after a reconnect is
    returned, the requestor never sees it), only someone who received a request can learn
    it, and it cannot be bound to a topic. So every endpoint, requestors included, is an
    exclusive named queue: a stable address across reconnects, mandatory returns,
    bindings, and no measured cost.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import queue
import threading
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

import pika
import pika.exceptions
from pika.adapters.select_connection import IOLoop
from tenacity import RetryCallState, Retrying, retry_if_exception

from brokers._rules import (
    DEFAULT_EXCHANGE,
    INBOX_SUFFIX,
    RESERVOIR_PARAMS,
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
from reservoir.broker import Broker, BrokerClosed, BrokerError, Delivery, Endpoint, Handler

__all__ = [
    "DEFAULT_EXCHANGE",
    "INBOX_SUFFIX",
    "PikaBroker",
    "PikaEndpoint",
    "PikaStats",
    "strip_reservoir_params",
]

log = logging.getLogger(__name__)

#: brokers opened in this process, for ``connection_name`` and thread names
_broker_numbers = itertools.count(1)

# pika has no type information; these names say what each Any is.
Connection = Any
Channel = Any
Frame = Any


@dataclass(slots=True)
class PikaStats:
    """What the broker did, counted. ``PikaBroker.stats`` hands out a snapshot."""

    #: publish calls accepted
    published: int = 0
    #: send calls accepted
    sent: int = 0
    #: messages RabbitMQ acked
    confirmed: int = 0
    #: messages RabbitMQ nacked (refused responsibility for); not retried
    nacked: int = 0
    #: our messages that came back unroutable (``basic.return``)
    returned: int = 0
    #: messages received for an endpoint (returned ones not included)
    delivered: int = 0
    #: deliveries dropped because their endpoint had closed
    dropped: int = 0
    #: handler calls that raised
    handler_errors: int = 0
    #: connections re-established after one was lost
    reconnects: int = 0
    #: unconfirmed messages published again after a reconnect
    republished: int = 0
    #: accepted messages still unconfirmed when ``close()`` gave up waiting
    abandoned: int = 0
    #: our messages RabbitMQ refused (403: this user may not publish there), handed back
    #: to their sender as returned
    refused: int = 0


class _Stopping(Exception):
    """The broker is closing: abandon what the IO thread is waiting for."""


class _ConnectionLost(Exception):
    """The connection (or a channel of it) closed under an operation."""


def strip_reservoir_params(url: str) -> tuple[str, dict[str, str]]:
    """Split ``url`` into the URL pika should see and reservoir's own query parameters."""
    parts = urlsplit(url)
    if not any(key in RESERVOIR_PARAMS for key, _ in parse_qsl(parts.query)):
        return url, {}  # untouched: nothing to strip, nothing re-encoded
    ours, theirs = split_reservoir_params(parts.query)
    return urlunsplit(parts._replace(query=urlencode(theirs, quote_via=quote))), ours


def _resolve(future: concurrent.futures.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _settle(future: concurrent.futures.Future[Any], value: Any) -> None:
    # A late answer (after a timeout failed the future) must not raise inside pika's loop.
    if not future.done():
        future.set_result(value)


def _fail(future: concurrent.futures.Future[Any], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


def _refused_with(error: BaseException, code: int) -> bool:
    """Whether ``error`` is a channel RabbitMQ closed with reply code ``code``."""
    cause = error.__cause__ if isinstance(error, _ConnectionLost) else error
    return isinstance(cause, pika.exceptions.ChannelClosedByBroker) and cause.reply_code == code


def _as_error(reason: object) -> BaseException:
    return reason if isinstance(reason, BaseException) else _ConnectionLost(repr(reason))


def _describe(reason: object) -> str:
    if isinstance(reason, pika.exceptions.ChannelClosed | pika.exceptions.ConnectionClosed):
        return f"{reason.reply_code} {reason.reply_text}"
    return repr(reason)


def _is_fatal(error: BaseException) -> bool:
    """Errors that retrying the first connection cannot fix: credentials, permissions, an
    exchange declared differently, a bad parameter."""
    if isinstance(
        error,
        pika.exceptions.AuthenticationError
        | pika.exceptions.ProbableAuthenticationError
        | pika.exceptions.ProbableAccessDeniedError
        | pika.exceptions.IncompatibleProtocolError
        | ValueError
        | TypeError,
    ):
        return True
    if isinstance(error, _ConnectionLost) and isinstance(
        error.__cause__, pika.exceptions.ChannelClosedByBroker
    ):
        # 403 ACCESS_REFUSED, 404 NOT_FOUND (an exchange we may not create is missing),
        # 406 PRECONDITION_FAILED (an exchange exists with another type)
        return error.__cause__.reply_code in (403, 404, 406)
    return False


@dataclass(slots=True)
class _Outgoing:
    """One accepted publish or send, kept until RabbitMQ confirms it."""

    exchange: str
    routing_key: str
    body: bytes
    properties: Any


@dataclass(eq=False)
class _Session:
    """One connection and its channels. Callbacks carry their session, so one from a
    connection that has since been replaced is recognised and ignored."""

    generation: int
    connection: Connection = None
    publish: Channel = None
    consume: Channel = None
    control: Channel = None
    opened: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)
    closed: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)
    #: futures the IO thread is running the loop for, failed if the connection goes
    waiters: set[concurrent.futures.Future[Any]] = field(default_factory=set)
    #: topology restored and consumers running: operations may go straight to RabbitMQ
    ready: bool = False
    closing: bool = False
    #: the publish channel is open and in confirm mode (False while it is being replaced)
    publish_ready: bool = False
    #: delivery tag of the last publish on the confirm-mode channel
    sequence: int = 0
    #: delivery tag -> message, in publish order, until acked or nacked
    unconfirmed: OrderedDict[int, _Outgoing] = field(default_factory=OrderedDict)


@dataclass(eq=False)
class _ControlCall:
    """One method on the control channel and what to do with its answer."""

    issue: Callable[[Channel, Callable[[Frame], None]], None]
    on_ok: Callable[[Frame], None]
    on_error: Callable[[BrokerError], None]


class _Op:
    """An operation a caller waits for, carried out on the IO thread when connected.

    ``run`` starts it against the current connection; ``lost`` is called if that
    connection goes before it finished (the default runs it again once reconnected)."""

    def __init__(self, broker: PikaBroker, endpoint: PikaEndpoint) -> None:
        self.broker = broker
        self.endpoint = endpoint
        self.future: concurrent.futures.Future[None] = concurrent.futures.Future()

    def run(self) -> None:
        raise NotImplementedError

    def run_disconnected(self) -> bool:
        """Try to finish without a connection; True if done."""
        return False

    def lost(self) -> None:
        self.broker._deferred.append(self)

    def done(self) -> None:
        self.broker._inflight.discard(self)
        _resolve(self.future)

    def failed(self, error: BaseException) -> None:
        self.broker._inflight.discard(self)
        _fail(self.future, error)


class _OpenOp(_Op):
    def run(self) -> None:
        broker, endpoint = self.broker, self.endpoint
        if endpoint._closed:
            # The caller gave up waiting and closed it before we got here.
            broker._release_name(endpoint)
            self.failed(BrokerClosed(f"endpoint {endpoint.address!r} closed while opening"))
            return
        broker._inflight.add(self)
        broker._control(
            _ControlCall(
                issue=lambda channel, callback: channel.queue_declare(
                    endpoint.address, exclusive=True, callback=callback
                ),
                on_ok=self._declared,
                on_error=self._refused,
            )
        )

    def _declared(self, _frame: Frame) -> None:
        # Its address on the inbox exchange, before anything is consumed: once open() has
        # returned, a send to the address reaches it.
        broker, endpoint = self.broker, self.endpoint
        broker._control(
            _ControlCall(
                issue=lambda channel, callback: channel.queue_bind(
                    endpoint.address,
                    broker.inbox_exchange,
                    routing_key=endpoint.address,
                    callback=callback,
                ),
                on_ok=self._bound,
                on_error=self._bind_refused,
            )
        )

    def _bound(self, _frame: Frame) -> None:
        broker, session = self.broker, self.broker._session
        assert session is not None
        try:
            broker._start_consumer(session, self.endpoint, partial(self._consuming, session))
        except Exception as error:  # the consume channel is gone: the connection resets
            broker._reset(session, f"basic.consume failed: {error!r}")

    def _consuming(self, session: _Session, _frame: Frame) -> None:
        broker, endpoint = self.broker, self.endpoint
        if session is not broker._session:
            return
        endpoint._generation = session.generation
        broker._endpoints[endpoint._token] = endpoint
        if endpoint._closed:
            # Closed while we were opening it: carry out the close now.
            broker._endpoints.pop(endpoint._token, None)
            broker._delete_queue(endpoint, lambda: None)
        self.done()

    def _refused(self, error: BrokerError) -> None:
        self.broker._release_name(self.endpoint)
        self.failed(error)

    def _bind_refused(self, error: BrokerError) -> None:
        # The queue was declared: delete it (it would die with the connection anyway), then
        # fail, so that a retry under this name starts from nothing.
        endpoint = self.endpoint
        self.broker._control(
            _ControlCall(
                issue=lambda channel, callback: channel.queue_delete(
                    endpoint.address, callback=callback
                ),
                on_ok=lambda _frame: self._refused(error),
                on_error=lambda _error: self._refused(error),
            )
        )


class _BindOp(_Op):
    def __init__(self, broker: PikaBroker, endpoint: PikaEndpoint, pattern: str) -> None:
        super().__init__(broker, endpoint)
        self.pattern = pattern

    def run(self) -> None:
        broker, endpoint, pattern = self.broker, self.endpoint, self.pattern
        if endpoint._closed:
            self.failed(BrokerClosed(f"endpoint {endpoint.address!r} is closed"))
            return
        # Desired state first: a reconnect from here on binds it too.
        endpoint._patterns.add(pattern)
        broker._inflight.add(self)
        broker._control(
            _ControlCall(
                issue=lambda channel, callback: channel.queue_bind(
                    endpoint.address, broker.exchange, routing_key=pattern, callback=callback
                ),
                on_ok=lambda _frame: self.done(),
                on_error=self._refused,
            )
        )

    def _refused(self, error: BrokerError) -> None:
        self.endpoint._patterns.discard(self.pattern)
        self.failed(error)


class _UnbindOp(_BindOp):
    def run(self) -> None:
        broker, endpoint, pattern = self.broker, self.endpoint, self.pattern
        if endpoint._closed:
            self.failed(BrokerClosed(f"endpoint {endpoint.address!r} is closed"))
            return
        if pattern not in endpoint._patterns:
            self.done()  # never bound (or already unbound): nothing to ask RabbitMQ
            return
        endpoint._patterns.discard(pattern)
        broker._inflight.add(self)
        broker._control(
            _ControlCall(
                issue=lambda channel, callback: channel.queue_unbind(
                    endpoint.address, broker.exchange, routing_key=pattern, callback=callback
                ),
                on_ok=lambda _frame: self.done(),
                on_error=self.failed,
            )
        )


class _DeleteOp(_Op):
    def run(self) -> None:
        broker, endpoint = self.broker, self.endpoint
        if broker._endpoints.pop(endpoint._token, None) is None:
            # Not open yet: the open still in flight sees it closed and deletes the queue.
            self.done()
            return
        session = broker._session
        if session is None or endpoint._generation != session.generation:
            self._gone()  # its queue went with an earlier connection
            return
        broker._inflight.add(self)
        broker._delete_queue(endpoint, self.done)

    def run_disconnected(self) -> bool:
        session = self.broker._session
        if session is not None and self.endpoint._generation == session.generation:
            return False  # re-created on the connection being set up: delete it there
        if self.broker._endpoints.pop(self.endpoint._token, None) is not None:
            self._gone()
        else:
            self.done()
        return True

    def lost(self) -> None:
        self._gone()  # an exclusive queue dies with its connection

    def _gone(self) -> None:
        self.broker._release_name(self.endpoint)
        self.done()


class PikaEndpoint(Endpoint):
    """An exclusive queue on a :class:`PikaBroker`. Made by ``open_endpoint``."""

    def __init__(
        self, broker: PikaBroker, address: str, handler: Handler, token: str, properties: Any
    ) -> None:
        self.address = address
        self._broker = broker
        self._handler = handler
        self._token = token
        self._properties = properties
        # Set under the broker's lock by whoever closes it; read anywhere (a stale read
        # only lets one more delivery through, as with the in-process broker).
        self._closed = False
        # The IO thread's alone: the patterns to (re-)bind, the connection generation its
        # queue was last declared on, and its consumer tag there.
        self._patterns: set[str] = set()
        self._generation = 0
        self._consumer_tag: str | None = None

    @property
    def closed(self) -> bool:
        return self._closed

    def bind(self, pattern: str) -> None:
        pattern = check_key(pattern, "binding pattern")
        self._broker._wait_for(_BindOp(self._broker, self, pattern), f"bind {pattern!r}")

    def unbind(self, pattern: str) -> None:
        pattern = check_key(pattern, "binding pattern")
        self._broker._wait_for(_UnbindOp(self._broker, self, pattern), f"unbind {pattern!r}")

    def publish(self, topic: str, body: bytes) -> None:
        topic = check_key(topic, "topic")
        body = check_body(body)
        self._broker._enqueue(self, _Outgoing(self._broker.exchange, topic, body, self._properties))

    def send(self, address: str, body: bytes) -> None:
        address = check_key(address, "address")
        body = check_body(body)
        self._broker._enqueue(
            self, _Outgoing(self._broker.inbox_exchange, address, body, self._properties)
        )

    def close(self) -> None:
        self._broker._close_endpoint(self)

    def __enter__(self) -> PikaEndpoint:
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<PikaEndpoint {self.address!r} {state}>"


class PikaBroker(Broker):
    """A RabbitMQ connection that hands out endpoints. See the module docstring.

    ``url``: ``amqp://`` or ``amqps://``, with pika's query parameters (``heartbeat``,
    ``ssl_options``...) and reservoir's ``exchange``. Options: ``exchange`` (overrides the
    URL's), ``timeout_s`` (for bind, unbind, open and each connection step),
    ``heartbeat_s`` (when the URL gives none), ``connect_attempts`` (first connection),
    ``reconnect_initial_s`` and ``reconnect_max_s`` (backoff), ``max_pending`` (accepted
    but unconfirmed messages) and ``close_timeout_s``.
    """

    def __init__(
        self,
        url: str,
        *,
        exchange: str | None = None,
        timeout_s: float = 10.0,
        heartbeat_s: int = 30,
        connect_attempts: int = 3,
        reconnect_initial_s: float = 0.1,
        reconnect_max_s: float = 10.0,
        max_pending: int = 50_000,
        close_timeout_s: float = 5.0,
    ) -> None:
        pika_url, ours = strip_reservoir_params(url)
        self.url = mask_password(url)
        self.exchange: str = check_exchange(exchange or ours.get("exchange") or DEFAULT_EXCHANGE)
        #: the topic exchange sends go to, routed by destination address
        self.inbox_exchange: str = inbox_exchange(self.exchange)
        check_limits(
            timeout_s=timeout_s,
            close_timeout_s=close_timeout_s,
            max_pending=max_pending,
            connect_attempts=connect_attempts,
        )
        self._timeout_s = timeout_s
        self._connect_attempts = connect_attempts
        self._reconnect_initial_s = reconnect_initial_s
        self._reconnect_max_s = reconnect_max_s
        self._max_pending = max_pending
        self._close_timeout_s = close_timeout_s

        number = next(_broker_numbers)
        self.connection_name = f"reservoir:{os.getpid()}:{number}"
        self._pika_url = pika_url
        self._params = pika.URLParameters(pika_url)
        if "heartbeat" not in dict(parse_qsl(urlsplit(pika_url).query)):
            self._params.heartbeat = heartbeat_s
        self._params.client_properties = {
            **(self._params.client_properties or {}),
            "connection_name": self.connection_name,
            "product": "reservoir",
        }
        # RabbitMQ checks user_id against the authenticated user; EXTERNAL (certificate)
        # auth has no username we could know, so we leave it unset there.
        self._user_id: str | None = getattr(self._params.credentials, "username", None)

        # -- shared between threads, under the lock --------------------------------------
        self._lock = threading.Lock()
        self._state_changed = threading.Condition(self._lock)
        self._closed = False
        self._io_exited = False
        self._outbox: deque[_Outgoing] = deque()
        self._drain_scheduled = False
        #: accepted messages not yet acked or nacked (queued, in flight or buffered)
        self._pending = 0
        self._names: set[str] = set()
        self._tokens: dict[str, PikaEndpoint] = {}
        self._token_numbers = itertools.count(1)
        self._stats = PikaStats()
        self._connected = False
        self._startup_error: BaseException | None = None

        # -- the IO thread's alone ---------------------------------------------------------
        self._ioloop = IOLoop()
        self._session: _Session | None = None
        self._generation = 0
        #: exchanges this user may not configure: declared passively
        self._passive_exchanges: set[str] = set()
        self._stopping = False
        self._endpoints: dict[str, PikaEndpoint] = {}
        self._deferred: deque[_Op] = deque()
        self._inflight: set[_Op] = set()
        self._control_calls: deque[_ControlCall] = deque()
        self._io_outbox: deque[_Outgoing] = deque()
        self._sleepers: set[concurrent.futures.Future[None]] = set()

        self._started = threading.Event()
        #: (endpoint, delivery) for the dispatcher thread; None stops it
        self._dispatch_queue: queue.SimpleQueue[tuple[PikaEndpoint, Delivery] | None] = (
            queue.SimpleQueue()
        )
        self._dispatcher = threading.Thread(
            target=self._dispatch_loop, name=f"reservoir-pika-dispatch-{number}", daemon=True
        )
        self._io_thread = threading.Thread(
            target=self._io_main, name=f"reservoir-pika-io-{number}", daemon=True
        )
        self._dispatcher.start()
        self._io_thread.start()
        # Every attempt is bounded by timeout_s, every backoff by reconnect_max_s.
        if not self._started.wait(connect_attempts * (timeout_s + reconnect_max_s) + 5.0):
            self.close()
            raise BrokerError(f"no connection to {self.url} came up in time")
        if self._startup_error is not None:
            error = self._startup_error
            self.close()
            raise BrokerError(f"cannot connect to {self.url}: {error!r}") from error

    # -- public -----------------------------------------------------------------------------

    @property
    def stats(self) -> PikaStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return replace(self._stats)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def connected(self) -> bool:
        """Whether the connection is up and the topology restored."""
        with self._lock:
            return self._connected

    def wait_connected(self, timeout_s: float, *, min_reconnects: int = 0) -> bool:
        """Block until connected with at least ``min_reconnects`` reconnections behind us
        (a readiness probe; tests use it after killing the connection). False on timeout."""
        with self._state_changed:
            return (
                self._state_changed.wait_for(
                    lambda: (
                        self._closed
                        or (self._connected and self._stats.reconnects >= min_reconnects)
                    ),
                    timeout_s,
                )
                and not self._closed
            )

    def delete_exchanges(self) -> None:
        """Delete ``<exchange>`` and ``<exchange>.inbox``, with their bindings.

        For demos and tests that made exchanges of their own; never for a shared one (other
        participants' bindings go with it). Runs over a short-lived connection of its own,
        so it works before or after :meth:`close`. Idempotent: an exchange already gone is
        no error. Raises :class:`BrokerError` if RabbitMQ cannot be reached or refuses
        (a user without ``configure`` permission on the exchanges)."""
        params = pika.URLParameters(self._pika_url)
        params.client_properties = {
            "connection_name": f"{self.connection_name}:delete-exchanges",
            "product": "reservoir",
        }
        params.socket_timeout = params.blocked_connection_timeout = self._timeout_s
        try:
            connection = pika.BlockingConnection(params)
        except pika.exceptions.AMQPError as error:
            raise BrokerError(
                f"cannot connect to {self.url} to delete exchanges: {error!r}"
            ) from error
        try:
            for name in (self.exchange, self.inbox_exchange):
                channel = connection.channel()
                try:
                    channel.exchange_delete(name)
                except pika.exceptions.ChannelClosedByBroker as error:
                    raise BrokerError(
                        f"RabbitMQ refused to delete exchange {name!r}: {_describe(error)}"
                    ) from error
                channel.close()
        except pika.exceptions.AMQPError as error:
            raise BrokerError(f"deleting exchanges on {self.url} failed: {error!r}") from error
        finally:
            if connection.is_open:
                connection.close()

    def open_endpoint(self, handler: Handler, *, name: str | None = None) -> PikaEndpoint:
        check_handler(handler)
        if name is not None:
            check_no_wildcards(check_endpoint_name(name))
        with self._lock:
            self._check_usable()
            address = name if name is not None else f"reservoir.inbox.{uuid.uuid4().hex}"
            if address in self._names:
                raise BrokerError(f"an endpoint named {address!r} is already open on this broker")
            self._names.add(address)
            token = str(next(self._token_numbers))
            properties = pika.BasicProperties(user_id=self._user_id, app_id=token)
            endpoint = PikaEndpoint(self, address, handler, token, properties)
            self._tokens[token] = endpoint
        try:
            self._wait_for(_OpenOp(self, endpoint), f"open endpoint {address!r}")
        except BaseException:
            with self._lock:
                self._tokens.pop(token, None)
                if not endpoint._closed:
                    endpoint._closed = True
                    if not self._closed and not self._io_exited:
                        # Timed out: the open may still land; this deletes it if it does.
                        self._ioloop.add_callback_threadsafe(
                            partial(self._start_op, _DeleteOp(self, endpoint))
                        )
            raise
        return endpoint

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                for endpoint in self._tokens.values():
                    endpoint._closed = True
                self._state_changed.notify_all()
                if not self._io_exited:
                    self._ioloop.add_callback_threadsafe(self._io_close)
        current = threading.current_thread()
        if current is not self._io_thread and self._io_thread.is_alive():
            self._io_thread.join(self._close_timeout_s + self._timeout_s + 5.0)
            if self._io_thread.is_alive():
                log.error("%s: the IO thread did not stop", self.connection_name)
        self._dispatch_queue.put(None)
        if current is not self._dispatcher and self._dispatcher.is_alive():
            self._dispatcher.join(self._timeout_s)

    def __enter__(self) -> PikaBroker:
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self._connected else "connecting")
        return f"<PikaBroker {self.url!r} exchange={self.exchange!r} {state}>"

    # -- caller threads -------------------------------------------------------------------

    def _check_usable(self) -> None:
        """Under the lock."""
        if self._closed:
            raise BrokerClosed("the broker is closed")
        if self._io_exited:
            raise BrokerError("the broker's connection thread has stopped")

    def _enqueue(self, endpoint: PikaEndpoint, message: _Outgoing) -> None:
        with self._lock:
            if endpoint._closed:
                what = "broker" if self._closed else f"endpoint {endpoint.address!r}"
                raise BrokerClosed(f"the {what} is closed")
            self._check_usable()
            check_pending(self._pending, self._max_pending, connected=self._connected)
            self._pending += 1
            if message.exchange == self.exchange:
                self._stats.published += 1
            else:
                self._stats.sent += 1
            self._outbox.append(message)
            if not self._drain_scheduled:
                # One wake-up drains everything appended until it runs.
                self._drain_scheduled = True
                self._ioloop.add_callback_threadsafe(self._drain)

    def _wait_for(self, op: _Op, what: str) -> None:
        if threading.current_thread() is self._io_thread:
            raise RuntimeError(f"{what}: a blocking call on the broker's IO thread would hang")
        with self._lock:
            if op.endpoint._closed:
                what_closed = "broker" if self._closed else f"endpoint {op.endpoint.address!r}"
                raise BrokerClosed(f"the {what_closed} is closed")
            self._check_usable()
            self._ioloop.add_callback_threadsafe(partial(self._start_op, op))
        try:
            op.future.result(self._timeout_s)
        except TimeoutError:
            raise BrokerError(f"{what}: no answer from RabbitMQ in {self._timeout_s}s") from None

    def _close_endpoint(self, endpoint: PikaEndpoint) -> None:
        with self._lock:
            if endpoint._closed:
                return
            endpoint._closed = True
            self._tokens.pop(endpoint._token, None)
            op = _DeleteOp(self, endpoint)
            self._ioloop.add_callback_threadsafe(partial(self._start_op, op))
        if threading.current_thread() is self._io_thread:
            return
        try:
            op.future.result(self._timeout_s)
        except TimeoutError:
            # Closing must not fail; the queue goes with the connection at the latest.
            log.warning("%s: deleting queue %r timed out", self.connection_name, endpoint.address)
        except BrokerError:
            pass  # the broker closed meanwhile, and its queues with it

    def _release_name(self, endpoint: PikaEndpoint) -> None:
        with self._lock:
            self._names.discard(endpoint.address)

    # -- the dispatcher thread ------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        def dropped() -> None:
            with self._lock:
                self._stats.dropped += 1

        def failed() -> None:
            with self._lock:
                self._stats.handler_errors += 1

        run_handlers(self._dispatch_queue, log, dropped=dropped, failed=failed)

    # -- the IO thread: lifecycle -----------------------------------------------------------

    def _io_main(self) -> None:
        initial = True
        try:
            while not self._stopping:
                try:
                    self._retrying(initial)(self._establish)
                except BaseException as error:
                    if not self._stopping:
                        self._startup_error = error
                        log.error("%s: giving up connecting: %r", self.connection_name, error)
                    break
                if initial:
                    initial = False
                    self._started.set()
                self._serve()
                self._after_session()
        except BaseException as error:  # a bug: say so, and let callers fail fast
            log.exception("%s: the IO thread failed", self.connection_name)
            self._startup_error = self._startup_error or error
        finally:
            self._io_shutdown()
            self._started.set()

    def _retrying(self, initial: bool) -> Retrying:
        def stop(state: RetryCallState) -> bool:
            return self._stopping or (initial and state.attempt_number >= self._connect_attempts)

        def retryable(error: BaseException) -> bool:
            if self._stopping or isinstance(error, _Stopping):
                return False
            # Later, an operator may fix credentials or the exchange: keep trying.
            return not (initial and _is_fatal(error))

        def before_sleep(state: RetryCallState) -> None:
            outcome = state.outcome
            error = outcome.exception() if outcome is not None else None
            wait = state.next_action.sleep if state.next_action is not None else 0.0
            log.warning(
                "%s: connecting to %s failed (attempt %d): %r; retrying in %.2fs",
                self.connection_name,
                self.url,
                state.attempt_number,
                error,
                wait,
            )

        return Retrying(
            stop=stop,
            wait=reconnect_wait(self._reconnect_initial_s, self._reconnect_max_s),
            retry=retry_if_exception(retryable),
            sleep=self._backoff_sleep,
            before_sleep=before_sleep,
            reraise=True,
        )

    def _backoff_sleep(self, seconds: float) -> None:
        """tenacity's sleep: keep the loop running (calls from other threads are queued or
        answered meanwhile) and wake early when the broker closes."""
        waiter: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._sleepers.add(waiter)
        timer = self._ioloop.call_later(seconds, partial(_resolve, waiter))
        try:
            self._run_until(waiter)
        finally:
            self._ioloop.remove_timeout(timer)
            self._sleepers.discard(waiter)
        waiter.result()  # raises _Stopping when closing

    def _run_until(self, future: concurrent.futures.Future[Any]) -> None:
        """Run the loop until ``future`` is done. Only from the top of the IO thread (the
        loop is not reentrant); the future must be resolved on the IO thread."""
        future.add_done_callback(lambda _future: self._ioloop.stop())
        while not future.done():
            self._ioloop.start()

    def _await(self, session: _Session, future: concurrent.futures.Future[Any]) -> Any:
        """Run the loop until ``future`` is done, failing it if the connection goes, the
        broker closes or ``timeout_s`` passes; return its result."""
        session.waiters.add(future)
        timer = self._ioloop.call_later(
            self._timeout_s, partial(_fail, future, TimeoutError("no answer from RabbitMQ"))
        )
        try:
            self._run_until(future)
        finally:
            self._ioloop.remove_timeout(timer)
            session.waiters.discard(future)
        return future.result()

    def _call(self, session: _Session, issue: Callable[[Callable[[Frame], None]], None]) -> Any:
        """One RPC during set-up: ``issue(callback)`` sends it; wait for the answer."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        issue(partial(_settle, future))
        return self._await(session, future)

    def _establish(self) -> None:
        """Connect and restore the topology; on failure leave nothing open and raise."""
        if self._stopping:
            raise _Stopping
        self._generation += 1
        session = _Session(self._generation)
        self._session = session
        try:
            session.connection = pika.SelectConnection(
                self._params,
                on_open_callback=lambda _connection: _resolve(session.opened),
                on_open_error_callback=partial(self._on_open_error, session),
                on_close_callback=partial(self._on_connection_closed, session),
                custom_ioloop=self._ioloop,
            )
            self._await(session, session.opened)
            session.publish = self._open_channel(session, "publish")
            self._call(
                session,
                lambda cb: session.publish.confirm_delivery(
                    partial(self._on_confirm, session), callback=cb
                ),
            )
            session.publish.add_on_return_callback(self._on_return)
            session.publish_ready = True
            session.consume = self._open_channel(session, "consume")
            session.control = self._open_channel(session, "control")
            for name in (self.exchange, self.inbox_exchange):
                self._declare_exchange(session, name)
            for endpoint in list(self._endpoints.values()):
                self._restore(session, endpoint)
        except BaseException:
            self._discard(session)
            raise
        session.ready = True
        restored = self._generation > 1
        with self._lock:
            self._connected = True
            if restored:
                self._stats.reconnects += 1
            self._state_changed.notify_all()
        log.info(
            "%s: %s to %s (exchange %r, %d endpoints)",
            self.connection_name,
            "reconnected" if restored else "connected",
            self.url,
            self.exchange,
            len(self._endpoints),
        )
        deferred, self._deferred = self._deferred, deque()
        for op in deferred:
            op.run()
        self._flush()

    def _declare_exchange(self, session: _Session, name: str) -> None:
        """Declare a durable topic exchange; passively when the user may not configure it
        (see "Declaring exchanges under restricted users" in the module docstring)."""
        if name not in self._passive_exchanges:
            try:
                self._call(
                    session,
                    lambda cb: session.control.exchange_declare(
                        name, exchange_type="topic", durable=True, auto_delete=False, callback=cb
                    ),
                )
                return
            except _ConnectionLost as error:
                if not _refused_with(error, 403) or session.closed.done():
                    raise
                log.info(
                    "%s: user %r may not declare exchange %r; checking that it exists",
                    self.connection_name,
                    self._user_id,
                    name,
                )
            # Reconnects go straight to the passive declare: one refusal is enough.
            self._passive_exchanges.add(name)
            # The refusal closed the control channel.
            session.control = self._open_channel(session, "control")
        try:
            self._call(
                session,
                lambda cb: session.control.exchange_declare(name, passive=True, callback=cb),
            )
        except _ConnectionLost as error:
            if not _refused_with(error, 404):
                raise
            raise _ConnectionLost(missing_exchange(name, self._user_id)) from error.__cause__

    def _open_channel(self, session: _Session, role: str) -> Channel:
        future: concurrent.futures.Future[Channel] = concurrent.futures.Future()
        session.connection.channel(on_open_callback=partial(_settle, future))
        channel = self._await(session, future)
        channel.add_on_close_callback(partial(self._on_channel_closed, session, role))
        return channel

    def _restore(self, session: _Session, endpoint: PikaEndpoint) -> None:
        """Re-create one endpoint's queue, bindings and consumer on a new connection."""
        if endpoint._closed:
            return  # its delete op, waiting for us, only has to forget it
        # Set first: a close arriving while we wait here must delete the queue we create.
        endpoint._generation = session.generation
        self._call(
            session,
            lambda cb: session.control.queue_declare(endpoint.address, exclusive=True, callback=cb),
        )
        self._call(
            session,
            lambda cb: session.control.queue_bind(
                endpoint.address, self.inbox_exchange, routing_key=endpoint.address, callback=cb
            ),
        )
        for pattern in sorted(endpoint._patterns):

            def bind(callback: Callable[[Frame], None], pattern: str = pattern) -> None:
                session.control.queue_bind(
                    endpoint.address, self.exchange, routing_key=pattern, callback=callback
                )

            self._call(session, bind)
        self._call(session, lambda cb: self._start_consumer(session, endpoint, cb))

    def _start_consumer(
        self, session: _Session, endpoint: PikaEndpoint, callback: Callable[[Frame], None]
    ) -> None:
        endpoint._consumer_tag = session.consume.basic_consume(
            endpoint.address,
            partial(self._on_message, endpoint),
            auto_ack=True,
            exclusive=True,
            callback=callback,
        )

    def _discard(self, session: _Session) -> None:
        """Close a connection whose set-up failed and wait (bounded) until it is closed."""
        connection = session.connection
        if connection is not None and not (connection.is_closed or connection.is_closing):
            try:
                connection.close()
            except Exception:
                log.debug("closing a failed connection", exc_info=True)
        if connection is not None and not session.closed.done():
            timer = self._ioloop.call_later(
                self._timeout_s, partial(_fail, session.closed, TimeoutError())
            )
            self._run_until(session.closed)
            self._ioloop.remove_timeout(timer)

    def _serve(self) -> None:
        session = self._session
        assert session is not None
        while not session.closed.done():
            try:
                self._ioloop.start()
            except Exception:
                # A bug in one of our callbacks (or pika's) must cost a reconnect, not the
                # broker: the connection's state is suspect, so start over.
                log.exception("%s: a callback on the IO thread failed", self.connection_name)
                self._reset(session, "a callback on the IO thread failed")
                self._ioloop.call_later(self._close_timeout_s, partial(self._abandon, session))

    def _after_session(self) -> None:
        """The connection is gone: mark everything for the next one."""
        session = self._session
        assert session is not None
        session.ready = False
        with self._lock:
            self._connected = False
            self._state_changed.notify_all()
        self._control_calls.clear()
        inflight, self._inflight = self._inflight, set()
        if self._stopping:
            for op in inflight:
                _fail(op.future, BrokerClosed("the broker is closed"))
            return
        log.warning("%s: lost the connection to %s; reconnecting", self.connection_name, self.url)
        for op in inflight:
            op.lost()
        # Unconfirmed messages may or may not have arrived: send them again, ahead of
        # what was queued after them (at-least-once, each sender's order kept).
        unconfirmed = list(session.unconfirmed.values())
        session.unconfirmed.clear()
        self._io_outbox.extendleft(reversed(unconfirmed))
        if unconfirmed:
            with self._lock:
                self._stats.republished += len(unconfirmed)

    def _io_shutdown(self) -> None:
        closed = BrokerClosed("the broker is closed")
        for op in [*self._deferred, *self._inflight]:
            _fail(op.future, closed)
        self._deferred.clear()
        self._inflight.clear()
        session = self._session
        lost = len(self._io_outbox) + (len(session.unconfirmed) if session is not None else 0)
        with self._lock:
            self._io_exited = True
            self._connected = False
            lost += len(self._outbox)
            self._outbox.clear()
            self._stats.abandoned += lost
            self._state_changed.notify_all()
        if lost:
            log.warning("%s: %d accepted messages were never confirmed", self.connection_name, lost)
        self._io_outbox.clear()
        self._ioloop.close()

    # -- the IO thread: closing ---------------------------------------------------------

    def _io_close(self) -> None:
        self._stopping = True
        closed = BrokerClosed("the broker is closed")
        for op in [*self._deferred, *self._inflight]:
            _fail(op.future, closed)
        self._deferred.clear()
        for sleeper in list(self._sleepers):
            _fail(sleeper, _Stopping())
        session = self._session
        if session is None or not session.ready:
            if session is not None:
                for waiter in list(session.waiters):
                    _fail(waiter, _Stopping())
            return
        # Say goodbye properly: what callers published before close() goes out first.
        self._drain()
        for endpoint in list(self._endpoints.values()):
            if endpoint._generation == session.generation:
                self._delete_queue(endpoint, lambda: None)
        self._endpoints.clear()
        self._ioloop.call_later(self._close_timeout_s, partial(self._finish_close, session))
        self._maybe_finish_close()

    def _maybe_finish_close(self) -> None:
        session = self._session
        if (
            self._stopping
            and session is not None
            and session.ready
            and not self._io_outbox
            and not session.unconfirmed
            and not self._control_calls
        ):
            self._finish_close(session)

    def _finish_close(self, session: _Session) -> None:
        if session.closing or session.closed.done():
            return
        session.closing = True
        if session.unconfirmed or self._io_outbox:
            log.warning(
                "%s: closing with %d messages unconfirmed",
                self.connection_name,
                len(session.unconfirmed) + len(self._io_outbox),
            )
        try:
            session.connection.close()
        except Exception:
            log.debug("closing the connection", exc_info=True)
        # If RabbitMQ never answers the close, stop waiting for it.
        self._ioloop.call_later(self._close_timeout_s, partial(self._abandon, session))

    def _abandon(self, session: _Session) -> None:
        if not session.closed.done():
            log.warning("%s: the connection did not close in time", self.connection_name)
            _resolve(session.closed)
            self._ioloop.stop()

    # -- the IO thread: pika callbacks ---------------------------------------------------

    def _on_open_error(self, session: _Session, _connection: Connection, error: object) -> None:
        cause = error if isinstance(error, BaseException) else _ConnectionLost(str(error))
        _fail(session.opened, cause)
        self._on_connection_closed(session, _connection, cause)

    def _on_connection_closed(
        self, session: _Session, _connection: Connection, reason: object
    ) -> None:
        _resolve(session.closed)
        for waiter in list(session.waiters):
            lost = _ConnectionLost(f"connection closed: {_describe(reason)}")
            lost.__cause__ = reason if isinstance(reason, BaseException) else None
            _fail(waiter, lost)
        self._ioloop.stop()

    def _on_channel_closed(
        self, session: _Session, role: str, channel: Channel, reason: object
    ) -> None:
        if session is not self._session or session.closed.done():
            return
        if not session.ready:
            # During set-up: the step waiting for this channel fails and set-up starts over.
            for waiter in list(session.waiters):
                lost = _ConnectionLost(f"{role} channel closed: {_describe(reason)}")
                lost.__cause__ = reason if isinstance(reason, BaseException) else None
                _fail(waiter, lost)
            return
        if session.closing or not session.connection.is_open:
            return  # the whole connection is going: its close callback handles that
        if role == "control" and channel is not session.control:
            return  # a control channel we already replaced
        if role == "publish" and channel is not session.publish:
            return  # a publish channel we already replaced
        if role == "publish" and _refused_with(_as_error(reason), 403):
            self._publish_refused(session, reason)
            return
        if role == "control" and isinstance(reason, pika.exceptions.ChannelClosedByBroker):
            # One control method was refused (e.g. 405 RESOURCE_LOCKED for a queue name
            # another connection holds). Methods go one at a time, so it was the oldest.
            session.control = None
            if self._control_calls:
                refused = self._control_calls.popleft()
                refused.on_error(BrokerError(f"RabbitMQ refused it: {_describe(reason)}"))
            try:
                session.connection.channel(
                    on_open_callback=partial(self._on_control_reopened, session)
                )
            except Exception as error:
                self._reset(session, f"cannot reopen the control channel: {error!r}")
            return
        self._reset(session, f"{role} channel closed: {_describe(reason)}")

    def _publish_refused(self, session: _Session, reason: Any) -> None:
        """RabbitMQ refused a publish or send (403: this user may not publish there, e.g. a
        node sending to another node) and closed the publish channel. The refused messages
        go back to their senders as returned (nobody received them); the others are
        published again, in order, on a new channel. The connection, its consumers and its
        control channel carry on. Resetting the connection instead would republish the
        refused message after every reconnect, for ever.

        RabbitMQ handles a channel's publishes in order and ignores what follows a refused
        one: those before it were routed (their acks may be lost with the channel), those
        after it were dropped and go out again."""
        session.publish_ready = False
        unconfirmed = list(session.unconfirmed.values())
        session.unconfirmed.clear()
        session.sequence = 0
        target = refused_target(reason.reply_text)
        aimed = [aimed_at(m.exchange, m.routing_key, target) for m in unconfirmed]
        if any(aimed):
            first = aimed.index(True)
            routed = first
            refused = [m for m, hit in zip(unconfirmed, aimed, strict=True) if hit]
            kept = [m for m, hit in zip(unconfirmed[first:], aimed[first:], strict=True) if not hit]
        else:
            # We cannot tell which it was: hand them all back rather than loop (the
            # protocol survives lost messages).
            routed, refused, kept = 0, unconfirmed, []
        self._io_outbox.extendleft(reversed(kept))
        with self._lock:
            self._pending -= routed + len(refused)
            self._stats.confirmed += routed
            self._stats.refused += len(refused)
            self._stats.republished += len(kept)
            senders = [self._tokens.get(m.properties.app_id) for m in refused]
        log.warning(
            "%s: RabbitMQ refused %d message(s) (%s); handed back to their senders as returned",
            self.connection_name,
            len(refused),
            _describe(reason),
        )
        for sender, message in zip(senders, refused, strict=True):
            if sender is not None:
                returned = Delivery(
                    message.body,
                    topic=topic_of(message.exchange, message.routing_key, self.inbox_exchange),
                    returned=True,
                    user_id=message.properties.user_id,
                )
                self._dispatch_queue.put((sender, returned))
        try:
            session.connection.channel(on_open_callback=partial(self._on_publish_reopened, session))
        except Exception as error:
            self._reset(session, f"cannot reopen the publish channel: {error!r}")

    def _on_publish_reopened(self, session: _Session, channel: Channel) -> None:
        if session is not self._session or session.closed.done():
            return
        session.publish = channel
        channel.add_on_close_callback(partial(self._on_channel_closed, session, "publish"))
        channel.add_on_return_callback(self._on_return)

        def confirming(_frame: Frame) -> None:
            if session is not self._session or channel is not session.publish:
                return
            session.publish_ready = True
            self._flush()
            if self._stopping:
                self._maybe_finish_close()

        try:
            channel.confirm_delivery(partial(self._on_confirm, session), callback=confirming)
        except Exception as error:
            self._reset(session, f"cannot put the publish channel in confirm mode: {error!r}")

    def _on_control_reopened(self, session: _Session, channel: Channel) -> None:
        if session is not self._session or session.closed.done():
            return
        session.control = channel
        channel.add_on_close_callback(partial(self._on_channel_closed, session, "control"))
        for call in list(self._control_calls):
            self._issue(session, call)
        self._maybe_finish_close()

    def _reset(self, session: _Session, why: str) -> None:
        """Give up on this connection; the IO loop reconnects and restores everything."""
        log.warning("%s: resetting the connection: %s", self.connection_name, why)
        connection = session.connection
        if connection is not None and connection.is_open:
            try:
                connection.close(320, why[:200])
            except Exception:
                log.debug("closing the connection", exc_info=True)

    def _on_confirm(self, session: _Session, frame: Frame) -> None:
        if session is not self._session:
            return
        method = frame.method
        acked = isinstance(method, pika.spec.Basic.Ack)
        unconfirmed = session.unconfirmed
        settled = 0
        if method.multiple:
            while unconfirmed and next(iter(unconfirmed)) <= method.delivery_tag:
                unconfirmed.popitem(last=False)
                settled += 1
        elif unconfirmed.pop(method.delivery_tag, None) is not None:
            settled = 1
        with self._lock:
            self._pending -= settled
            if acked:
                self._stats.confirmed += settled
            else:
                self._stats.nacked += settled
        if not acked:
            log.warning(
                "%s: RabbitMQ nacked %d message(s) (up to tag %d); they may be lost",
                self.connection_name,
                settled,
                method.delivery_tag,
            )
        if self._stopping:
            self._maybe_finish_close()

    def _on_return(self, _channel: Channel, method: Any, properties: Any, body: bytes) -> None:
        with self._lock:
            self._stats.returned += 1
            sender = self._tokens.get(properties.app_id)
        if sender is None:
            log.debug("a return for a closed endpoint (%r): dropped", method.routing_key)
            return
        topic = topic_of(method.exchange, method.routing_key, self.inbox_exchange)
        self._dispatch_queue.put(
            (sender, Delivery(body, topic=topic, returned=True, user_id=properties.user_id))
        )

    def _on_message(
        self, endpoint: PikaEndpoint, _channel: Channel, method: Any, properties: Any, body: bytes
    ) -> None:
        topic = topic_of(method.exchange, method.routing_key, self.inbox_exchange)
        with self._lock:
            self._stats.delivered += 1
        self._dispatch_queue.put(
            (endpoint, Delivery(body, topic=topic, user_id=properties.user_id))
        )

    # -- the IO thread: operations and publishing -----------------------------------------

    def _start_op(self, op: _Op) -> None:
        if self._stopping:
            _fail(op.future, BrokerClosed("the broker is closed"))
            return
        session = self._session
        if session is not None and session.ready:
            op.run()
        elif not op.run_disconnected():
            self._deferred.append(op)

    def _control(self, call: _ControlCall) -> None:
        self._control_calls.append(call)
        session = self._session
        if session is not None and session.control is not None and session.control.is_open:
            self._issue(session, call)

    def _issue(self, session: _Session, call: _ControlCall) -> None:
        try:
            call.issue(session.control, partial(self._control_answered, session, call))
        except Exception as error:  # e.g. the channel closed under us: it will be reopened
            log.debug("issuing a control method failed: %r", error)

    def _control_answered(self, session: _Session, call: _ControlCall, frame: Frame) -> None:
        if session is not self._session:
            return
        try:
            self._control_calls.remove(call)
        except ValueError:
            return
        call.on_ok(frame)
        if self._stopping:
            self._maybe_finish_close()

    def _delete_queue(self, endpoint: PikaEndpoint, then: Callable[[], None]) -> None:
        def finished() -> None:
            self._release_name(endpoint)
            then()

        self._control(
            _ControlCall(
                issue=lambda channel, callback: channel.queue_delete(
                    endpoint.address, callback=callback
                ),
                on_ok=lambda _frame: finished(),
                on_error=lambda _error: finished(),
            )
        )

    def _drain(self) -> None:
        with self._lock:
            self._drain_scheduled = False
            batch, self._outbox = self._outbox, deque()
        self._io_outbox.extend(batch)
        self._flush()

    def _flush(self) -> None:
        session = self._session
        if session is None or not session.ready or session.closing or not session.publish_ready:
            return  # buffered until the connection (or the publish channel) is back
        publish = session.publish
        outbox = self._io_outbox
        while outbox:
            message = outbox[0]
            try:
                publish.basic_publish(
                    message.exchange,
                    message.routing_key,
                    message.body,
                    message.properties,
                    mandatory=True,
                )
            except Exception as error:
                self._reset(session, f"publish failed: {error!r}")
                return
            outbox.popleft()
            session.sequence += 1
            session.unconfirmed[session.sequence] = message
