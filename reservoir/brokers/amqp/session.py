"""The AMQP session, sans I/O: what reservoir does on one RabbitMQ connection, as a state
machine that takes the client library's events and returns the actions to carry out.

This module owns, for both RabbitMQ drivers (:mod:`reservoir.brokers.pika_broker`,
:mod:`reservoir.brokers.kombu_broker`):

- the **outbox** (accepted, not yet written) and its cap, ``max_pending``, which counts the
  outbox and the unconfirmed messages together;
- the **confirm tag map**: delivery tag -> message on the confirm-mode publish channel,
  settled by ``basic.ack``/``basic.nack`` (``multiple`` settles every tag up to it);
- the **desired topology**: both exchanges, every endpoint's exclusive inbox (a queue named
  by its address, bound to the inbox exchange by that address) and every binding; it is
  restored, in that order, after a reconnect and after the broker cancelled a consumer;
- the **replay order**: after a reconnect the unconfirmed messages go out again before the
  ones queued after them, and only once the topology is back (so a replay finds its
  bindings); delivery across a reconnect is at least once;
- **ordered binds** (``bind_ordered``): a binding asked for without waiting, before which
  nothing accepted after it is published (a barrier in the outbox, let go by the
  binding's answer): a node binds an id's lookup topic and sends its offer behind it, on
  its IO thread, with no thread waiting out the round trip;
- **flow control**: while RabbitMQ says ``connection.blocked`` nothing is written;
- the **403 on a publish**: RabbitMQ closes the publish channel and ignores what followed
  the refused message, so the unconfirmed messages before it count as delivered, the refused
  ones go back to their sender as returned (never replayed: a replay would be refused again,
  for ever) and the rest are published again, in order, on a new publish channel;
- a **403 on an active exchange declare** (a user without configure permission): declared
  passively from then on, which only checks it exists;
- **claims**: a key held by one endpoint across every connection to the broker, as an
  exclusive queue named after it (:func:`claim_queue`), declared on the control channel:
  RabbitMQ refuses a second connection's declare with 405 ``RESOURCE_LOCKED``, and this
  session refuses a second endpoint of its own connection. A claim dies with its
  connection and is never restored (whoever holds one learns of the reconnect from
  ``stats.reconnects`` and does without it);
- **reconnect with backoff** (doubling from ``reconnect_initial_s`` to ``reconnect_max_s``,
  plus jitter), the first connection's attempts, and what is fatal on it;
- the **stats** both drivers report, and readiness.

It is pure: no sockets, threads, sleeps or clock reads. Time comes in with the events that
need it (``now_s``, seconds on any monotonic clock), and randomness (the jitter) through an
injected function, so tests drive it on a fake clock. It is not thread-safe: a driver calls
it under one lock and carries out the actions outside it.

Control methods (declare, bind, unbind, delete, consume) go out **one at a time**: a
channel error then names its method without doubt (the oldest one out), a refusal costs
that one call, and every sequence (declare a queue, bind it, consume) keeps its order
across any interleaving with callers' calls.

The connection's states and the events that move it are :data:`TRANSITIONS`.

Topology
    Two durable, not auto-deleted topic exchanges (an auto-deleted one would vanish when
    the last queue unbinds, and the next publish would kill the channel): ``<exchange>``
    for ``publish`` (routing key = topic; ``bind`` binds there) and ``<exchange>.inbox``
    for ``send`` (routing key = destination address). Every endpoint is an exclusive queue
    named by its address, so the address survives a reconnect, bound to the inbox exchange
    by that address (which may not contain ``*`` or ``#``, so it matches one queue).

    Sends do not use the default exchange because it is a direct exchange, and RabbitMQ's
    topic permissions apply only to topic exchanges: through ``<exchange>.inbox`` an
    operator gives each role a user whose topic permissions say where it may send and which
    addresses it may bind (``deploy/rabbitmq/``). Exchanges are declared actively first,
    because only an active declare checks an existing one's type (a ``direct`` exchange of
    that name would route patterns literally, silently); a user refused that (403) declares
    passively from then on, at the cost of one control channel and one ``access refused``
    line in RabbitMQ's log on the first connection only.

Publishing and consuming
    Every message is ``mandatory`` and carries ``user_id`` (RabbitMQ checks it against the
    authenticated user, so ``Delivery.user_id`` is an authenticated sender) and its sending
    endpoint's token (``app_id``), by which a ``basic.return`` finds its sender. A nack
    (RabbitMQ refusing responsibility, e.g. a full ``reject-publish`` queue) is counted,
    not retried: the protocol survives a lost message. Consumers are auto-ack: the queues
    are exclusive, so a manual ack could not get a message redelivered to anyone after a
    crash, and it would cost a frame and a hop per delivery.
"""

from __future__ import annotations

import enum
import hashlib
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, Literal, TypeVar

import msgspec

from reservoir.broker import BrokerClosed, BrokerError, Delivery
from reservoir.brokers._rules import (
    aimed_at,
    check_pending,
    missing_exchange,
    refused_target,
    topic_of,
)

__all__ = [
    "TRANSITIONS",
    "Action",
    "AmqpStats",
    "BindQueue",
    "ClaimedElsewhere",
    "CloseConnection",
    "Connect",
    "Consume",
    "DeclareExchange",
    "DeclareQueue",
    "DeleteQueue",
    "Deliver",
    "Message",
    "OpenChannel",
    "Publish",
    "Resolve",
    "Role",
    "Session",
    "SetTimer",
    "State",
    "Stop",
    "UnbindQueue",
    "claim_queue",
]

log = logging.getLogger("reservoir.brokers.amqp")

W = TypeVar("W")

#: the three channels of a connection: confirm-mode publishing, every consumer, and
#: control methods (so a refused declare costs neither consumers nor in-flight publishes)
Role = Literal["publish", "consume", "control"]
ROLES: tuple[Role, ...] = ("publish", "consume", "control")


class State(enum.Enum):
    IDLE = "idle"  # made, not started
    CONNECTING = "connecting"  # a Connect is out
    SETTING_UP = "setting up"  # connected; channels, exchanges and endpoints being restored
    READY = "ready"  # topology in place: publishes go out
    DISCONNECTED = "disconnected"  # waiting for the backoff to pass
    CLOSING = "closing"  # close(): draining, deleting queues, closing
    CLOSED = "closed"  # for good (``failure`` says why, when it was not close())


#: (state, event) -> next state. Every state change goes through this table; an event
#: not listed for a state changes nothing (a late answer from a connection already gone).
TRANSITIONS: dict[tuple[State, str], State] = {
    (State.IDLE, "start"): State.CONNECTING,
    (State.IDLE, "close"): State.CLOSED,
    (State.CONNECTING, "connected"): State.SETTING_UP,
    (State.CONNECTING, "lost"): State.DISCONNECTED,
    (State.CONNECTING, "fatal"): State.CLOSED,
    (State.CONNECTING, "close"): State.CLOSING,
    (State.SETTING_UP, "set up"): State.READY,
    (State.SETTING_UP, "lost"): State.DISCONNECTED,
    (State.SETTING_UP, "fatal"): State.CLOSED,
    (State.SETTING_UP, "close"): State.CLOSING,
    (State.READY, "lost"): State.DISCONNECTED,
    (State.READY, "close"): State.CLOSING,
    (State.DISCONNECTED, "backoff passed"): State.CONNECTING,
    (State.DISCONNECTED, "close"): State.CLOSED,
    (State.CLOSING, "lost"): State.CLOSED,
    (State.CLOSING, "abandon"): State.CLOSED,
}
# ... and any state but CLOSED goes to CLOSED when the driver itself fails (Session.abort).


@dataclass(slots=True)
class AmqpStats:
    """What the broker did, counted. Both drivers report exactly these."""

    #: publish calls accepted
    published: int = 0
    #: send calls accepted
    sent: int = 0
    #: messages RabbitMQ acked (and those before a refused one, which it routed)
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
    #: unconfirmed messages published again (after a reconnect or a refusal)
    republished: int = 0
    #: accepted messages still unconfirmed when the broker closed
    abandoned: int = 0
    #: our messages RabbitMQ refused (403), handed back to their sender as returned
    refused: int = 0
    #: times RabbitMQ blocked publishing (``connection.blocked``, a resource alarm)
    blocked: int = 0
    #: consumers the broker cancelled (their queue deleted), re-created
    cancelled: int = 0


class Message(msgspec.Struct, frozen=True):
    """One accepted publish or send, kept until RabbitMQ confirms it."""

    #: the sending endpoint's token: a return or refusal finds its sender by it
    token: str
    exchange: str
    routing_key: str
    body: bytes


class ClaimedElsewhere(BrokerError):
    """Another endpoint holds the key a claim asked for (a waiter's answer, which an
    endpoint's ``claim`` turns into False)."""


def claim_queue(exchange: str, key: str) -> str:
    """The exclusive queue that stands for a claim of ``key`` on ``exchange``'s broker.
    Queue names are the virtual host's, so the exchange is in the hash: deployments (and
    test runs) sharing a RabbitMQ never claim each other's keys. It starts like a
    requestor's inbox, which the requestor's user of ``deploy/rabbitmq/`` may declare."""
    digest = hashlib.blake2b(f"{exchange}\0{key}".encode(), digest_size=16).hexdigest()
    return f"reservoir.requestor.claim.{digest}"


# -- actions: what the driver carries out --------------------------------------------------


class Connect(msgspec.Struct, frozen=True):
    """Open a connection; answer ``connected(gen)`` or ``lost(gen)``."""

    gen: int


class OpenChannel(msgspec.Struct, frozen=True):
    """Open (or replace) the ``role`` channel, the publish one in confirm mode; answer
    ``channel_opened``."""

    role: Role


class DeclareExchange(msgspec.Struct, frozen=True):
    """A durable topic exchange, or with ``passive`` only a check that it exists. Every
    control action is answered by ``replied`` or ``channel_closed``."""

    name: str
    passive: bool


class DeclareQueue(msgspec.Struct, frozen=True):
    """An exclusive, non-durable queue named ``address``."""

    address: str


class BindQueue(msgspec.Struct, frozen=True):
    address: str
    exchange: str
    pattern: str


class UnbindQueue(msgspec.Struct, frozen=True):
    address: str
    exchange: str
    pattern: str


class DeleteQueue(msgspec.Struct, frozen=True):
    address: str


class Consume(msgspec.Struct, frozen=True):
    """Start the auto-ack consumer of ``address`` for ``token``, on the consume channel."""

    token: str
    address: str


class Publish(msgspec.Struct, frozen=True):
    """``basic.publish`` (mandatory) on the publish channel; ``tag`` is its delivery tag."""

    tag: int
    message: Message
    #: the publish channel it is for (:attr:`Session.publish_channel`): a driver drops a
    #: publish whose channel was replaced before it went out, which the session replays
    channel: int


class Deliver(msgspec.Struct, frozen=True):
    """Hand ``delivery`` to the handler of the endpoint ``token``."""

    token: str
    delivery: Delivery


class Resolve(msgspec.Struct, Generic[W], frozen=True):
    """The call ``waiter`` stands for is done: with ``error``, it failed."""

    waiter: W
    error: BrokerError | None = None


class CloseConnection(msgspec.Struct, frozen=True):
    """Close the connection (or abandon its opening); answer ``lost``."""

    reason: str


class SetTimer(msgspec.Struct, frozen=True):
    """Call ``tick`` once the clock reaches ``at_s`` (an earlier tick is harmless)."""

    at_s: float


class Stop(msgspec.Struct, frozen=True):
    """The session is closed for good: stop the IO loop."""


ControlAction = DeclareExchange | DeclareQueue | BindQueue | UnbindQueue | DeleteQueue | Consume
Action = (
    Connect
    | OpenChannel
    | ControlAction
    | Publish
    | Deliver
    | Resolve[W]
    | CloseConnection
    | SetTimer
    | Stop
)


# -- the session's own records --------------------------------------------------------------


@dataclass(eq=False, slots=True)
class _Endpoint(Generic[W]):
    token: str
    address: str
    #: patterns bound (or being bound) on the topic exchange, in binding order
    patterns: dict[str, None] = field(default_factory=dict)
    #: its queue exists on some connection: restored after every reconnect
    live: bool = False
    #: the connection its queue was last declared on
    gen: int = 0
    #: the open_endpoint call waiting for it
    waiter: W | None = None


@dataclass(eq=False, slots=True)
class _Barrier:
    """Outbox entries ahead of it go out; the rest wait for its control call's answer."""

    ahead: int


@dataclass(eq=False, slots=True)
class _Call:
    """One control method, and what its answer means."""

    action: ControlAction | None  # None: a marker run in order, with no I/O
    #: answered
    ok: Callable[[], None] | None = None
    #: RabbitMQ closed the channel over it, with this reply code and text
    refused: Callable[[int, str], None] | None = None
    #: the connection went before it was answered
    lost: Callable[[], None] | None = None
    #: dropped unsent because its endpoint closed
    dropped: Callable[[], None] | None = None

    @property
    def channel(self) -> Role:
        """The channel it goes out on."""
        return "consume" if isinstance(self.action, Consume) else "control"


class Session(Generic[W]):
    """One broker's AMQP session across every connection it makes. See the module docstring.

    ``W`` is whatever the driver waits on (a future); the session only hands it back in
    :class:`Resolve`. Callers' methods raise :class:`BrokerError` at once for what they may
    not do; everything else comes back as actions from :meth:`take_actions`.
    """

    def __init__(
        self,
        *,
        exchange: str,
        inbox_exchange: str,
        max_pending: int,
        timeout_s: float,
        close_timeout_s: float,
        connect_attempts: int,
        reconnect_initial_s: float,
        reconnect_max_s: float,
        jitter: Callable[[], float],
        name: str = "reservoir",
        url: str = "the broker",
    ) -> None:
        self.exchange = exchange
        self.inbox_exchange = inbox_exchange
        self.name = name
        #: the broker's URL, password masked, for the lines a failed connection gets
        self.url = url
        self._max_pending = max_pending
        self._timeout_s = timeout_s
        self._close_timeout_s = close_timeout_s
        self._connect_attempts = connect_attempts
        self._reconnect_initial_s = reconnect_initial_s
        self._reconnect_max_s = reconnect_max_s
        self._jitter = jitter

        self.state = State.IDLE
        self.stats = AmqpStats()
        #: why the session closed, when it was not close(): the first connection failed
        self.failure: BrokerError | None = None
        self._actions: deque[Action[W]] = deque()
        #: connection generation: events from an older one are ignored
        self._gen = 0
        self._ever_ready = False
        #: connection attempts that failed in a row
        self._failures = 0
        #: when the working connection was lost (None: none is), and the attempts to get
        #: it back that failed since, for the one line its return gets
        self._lost_at_s: float | None = None
        self._failed_since_lost = 0
        #: when the connection being set up was opened
        self._connected_at_s = 0.0
        self._user_id: str | None = None
        self._deadline_s: float | None = None

        self._open: set[Role] = set()
        self._blocked = False
        self._passive: set[str] = set()
        self._endpoints: dict[str, _Endpoint[W]] = {}
        self._calls: deque[_Call] = deque()
        self._issued = False
        #: callers' calls that the restore after the reconnect carries out
        self._after_ready: list[W] = []
        #: claim queue -> the token of the endpoint holding it, on this connection
        self._claims: dict[str, str] = {}

        self._outbox: deque[Message] = deque()
        #: ordered binds not yet answered, oldest first (see ``bind_ordered``)
        self._barriers: list[_Barrier] = []
        self._tag = 0
        self._unconfirmed: OrderedDict[int, Message] = OrderedDict()
        self._close_sent = False
        #: this connection's restore has run (set-up waits for it and the publish channel)
        self._restored = False
        #: numbers publish channels: each OpenChannel("publish") and each lost connection
        self.publish_channel = 0

    # -- reading -------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.state is State.READY

    @property
    def pending(self) -> int:
        """Accepted messages not yet settled: queued, in flight or waiting for a reconnect."""
        return len(self._outbox) + len(self._unconfirmed)

    def address_in_use(self, address: str) -> bool:
        return any(e.address == address for e in self._endpoints.values())

    def take_actions(self) -> list[Action[W]]:
        """Everything to carry out now, in order; publishes last, as many as may go."""
        if self._outbox:
            self._flush()
        if not self._actions:
            return []  # the common case of a confirm: nothing to do
        actions = list(self._actions)
        self._actions.clear()
        return actions

    # -- what callers do -----------------------------------------------------------------

    def start(self, now_s: float) -> None:
        self._move("start")
        self._connect(now_s)

    def accept(self, message: Message) -> bool:
        """Accept a publish or send; raise :class:`BrokerError` past ``max_pending``.
        True when the outbox was empty: the driver wakes its IO thread for it."""
        self._check_open()
        pending = self.pending
        if pending >= self._max_pending:  # (``ready`` is only for the error's text)
            check_pending(pending, self._max_pending, connected=self.ready)
        if message.exchange == self.exchange:
            self.stats.published += 1
        else:
            self.stats.sent += 1
        self._outbox.append(message)
        return len(self._outbox) == 1

    def open_endpoint(self, token: str, address: str, waiter: W) -> None:
        self._check_open()
        if self.address_in_use(address):
            raise BrokerError(f"an endpoint named {address!r} is already open on this broker")
        endpoint: _Endpoint[W] = _Endpoint(token, address, waiter=waiter)
        self._endpoints[token] = endpoint
        if self._live():
            self._attach(endpoint, restoring=False)
        # else: the next connection's set-up opens it

    def bind(self, token: str, pattern: str, waiter: W) -> None:
        endpoint = self._endpoint(token)
        if pattern in endpoint.patterns:
            self._resolve(waiter)  # RabbitMQ would treat it as one binding anyway
            return
        # Desired state first: a reconnect from here on binds it too.
        endpoint.patterns[pattern] = None

        def refused(code: int, text: str) -> None:
            endpoint.patterns.pop(pattern, None)
            self._resolve(waiter, BrokerError(f"RabbitMQ refused the binding: {code} {text}"))

        self._call_or_defer(
            BindQueue(endpoint.address, self.exchange, pattern), waiter, refused, endpoint
        )

    def bind_ordered(self, token: str, pattern: str) -> None:
        """Bind without a waiter: what is accepted from now on is published only once
        RabbitMQ has answered (the binding in place, or refused: logged, and the messages
        go anyway). Disconnected, the restore after the reconnect binds it before anything
        is published again."""
        endpoint = self._endpoint(token)
        if pattern in endpoint.patterns:
            return
        endpoint.patterns[pattern] = None
        if not (self._live() and endpoint.live):
            return
        barrier = _Barrier(len(self._outbox))
        self._barriers.append(barrier)

        def let_go() -> None:
            if barrier in self._barriers:
                self._barriers.remove(barrier)
                self._flush()

        def refused(code: int, text: str) -> None:
            endpoint.patterns.pop(pattern, None)
            log.warning("%s: RabbitMQ refused binding %r: %s %s", self.name, pattern, code, text)
            let_go()

        self._calls.append(
            _Call(
                BindQueue(endpoint.address, self.exchange, pattern),
                ok=let_go,
                refused=refused,
                dropped=let_go,
            )
        )
        self._issue()

    def unbind_ordered(self, token: str, pattern: str) -> None:
        """Unbind without a waiter (nothing waits for it: a publish that still reaches the
        queue meanwhile is one its endpoint handles as it would any)."""
        endpoint = self._endpoint(token)
        if pattern not in endpoint.patterns:
            return
        del endpoint.patterns[pattern]
        if not (self._live() and endpoint.live):
            return

        def refused(code: int, text: str) -> None:
            log.warning("%s: RabbitMQ refused unbinding %r: %s %s", self.name, pattern, code, text)

        self._calls.append(
            _Call(UnbindQueue(endpoint.address, self.exchange, pattern), refused=refused)
        )
        self._issue()

    def unbind(self, token: str, pattern: str, waiter: W) -> None:
        endpoint = self._endpoint(token)
        if pattern not in endpoint.patterns:
            self._resolve(waiter)  # never bound: nothing to ask RabbitMQ
            return
        del endpoint.patterns[pattern]

        def refused(code: int, text: str) -> None:
            self._resolve(waiter, BrokerError(f"RabbitMQ refused the unbinding: {code} {text}"))

        self._call_or_defer(
            UnbindQueue(endpoint.address, self.exchange, pattern), waiter, refused, endpoint
        )

    def claim(self, token: str, key: str, waiter: W) -> None:
        """Hold ``key`` for the endpoint ``token``: the waiter is resolved once its queue is
        declared on this connection (or at once when the endpoint holds it already), with
        :class:`ClaimedElsewhere` when another endpoint holds it, here or on another
        connection (405), and with a :class:`BrokerError` when no connection is up: a claim
        belongs to one connection, so it is never deferred to the next."""
        endpoint = self._endpoint(token)
        name = claim_queue(self.exchange, key)
        holder = self._claims.get(name)
        if holder is not None:
            error = None if holder == token else ClaimedElsewhere(f"{key!r} is claimed here")
            self._resolve(waiter, error)
            return
        if not (self._live() and endpoint.live):
            self._resolve(waiter, BrokerError(f"not connected: {key!r} cannot be claimed now"))
            return
        self._claims[name] = token  # held here while the declare is out

        def refused(code: int, text: str) -> None:
            self._claims.pop(name, None)
            if code == 405:
                self._resolve(waiter, ClaimedElsewhere(f"{key!r} is claimed elsewhere"))
            else:
                self._resolve(waiter, BrokerError(f"RabbitMQ refused the claim: {code} {text}"))

        def lost() -> None:
            # the claims went with the connection (_drop_connection); so did this one
            self._resolve(waiter, BrokerError(f"the connection went while claiming {key!r}"))

        def declared() -> None:
            if self._claims.get(name) == token:
                self._resolve(waiter)
            else:  # its endpoint closed meanwhile: nobody holds it
                self._delete_claim(name, None)
                self._resolve(waiter, BrokerClosed(f"endpoint {endpoint.address!r} closed"))

        self._calls.append(_Call(DeclareQueue(name), ok=declared, refused=refused, lost=lost))
        self._issue()

    def unclaim(self, token: str, key: str, waiter: W | None) -> None:
        """Let go of ``key`` if the endpoint ``token`` holds it: its queue is deleted."""
        name = claim_queue(self.exchange, key)
        if self._claims.get(name) != token:
            if waiter is not None:
                self._resolve(waiter)
            return
        del self._claims[name]
        self._delete_claim(name, waiter)

    def _delete_claim(self, name: str, waiter: W | None) -> None:
        done = (lambda: self._resolve(waiter)) if waiter is not None else None
        self._calls.append(
            _Call(
                DeleteQueue(name),
                ok=done,
                refused=(lambda _c, _t: done()) if done is not None else None,
                lost=done,  # an exclusive queue dies with its connection
            )
        )
        self._issue()

    def close_endpoint(self, token: str, waiter: W | None) -> None:
        """Forget the endpoint and delete its queue. Its name is free at once: a reopen's
        declare goes out after this delete."""
        endpoint = self._endpoints.pop(token, None)
        if endpoint is None:
            if waiter is not None:
                self._resolve(waiter)
            return
        if endpoint.waiter is not None:
            self._resolve(endpoint.waiter, BrokerClosed(f"endpoint {endpoint.address!r} closed"))
            endpoint.waiter = None
        for name in [n for n, holder in self._claims.items() if holder == token]:
            del self._claims[name]
            if self._live():
                self._delete_claim(name, None)
        out = self._prune(endpoint.address)
        if not (self._live() and (endpoint.gen == self._gen or out)):
            # Its queue went with an earlier connection, or was never declared.
            if waiter is not None:
                self._resolve(waiter)
            return
        done = (lambda: self._resolve(waiter)) if waiter is not None else None
        self._calls.append(
            _Call(
                DeleteQueue(endpoint.address),
                ok=done,
                refused=(lambda _c, _t: done()) if done is not None else None,
                lost=done,  # an exclusive queue dies with its connection
            )
        )
        self._issue()

    def close(self, now_s: float) -> None:
        """Close for good: what was accepted goes out first, then every queue is deleted
        and the connection closed; after ``close_timeout_s`` it is closed regardless."""
        if self.state in (State.CLOSING, State.CLOSED):
            return
        was = self.state
        self._move("close")
        if was in (State.IDLE, State.DISCONNECTED):
            self._finish()
            return
        self._set_deadline(now_s + self._close_timeout_s)
        if was is State.READY:
            for token in list(self._endpoints):
                self.close_endpoint(token, None)
        else:
            self._close_connection("closing while connecting")
        self._maybe_drained()

    # -- events from the client library ----------------------------------------------------

    def connected(self, gen: int, now_s: float, user_id: str | None) -> None:
        if gen != self._gen or self.state is not State.CONNECTING:
            return
        self._move("connected")
        self._user_id = user_id
        self._connected_at_s = now_s
        self._set_deadline(now_s + self._timeout_s)
        for role in ROLES:
            self._open_channel(role)
        for name in (self.exchange, self.inbox_exchange):
            self._calls.append(self._declare_exchange(name))
        # Endpoints that had a queue: restore it; if that fails, start over.
        for endpoint in self._endpoints.values():
            if endpoint.live:
                self._attach(endpoint, restoring=True)
        self._restored = False
        self._calls.append(_Call(None, ok=self._set_up))
        # New endpoints opened meanwhile: a refusal fails that open only.
        for endpoint in self._endpoints.values():
            if not endpoint.live:
                self._attach(endpoint, restoring=False)

    def channel_opened(self, gen: int, role: Role) -> None:
        if gen != self._gen or not self._live():
            return
        self._open.add(role)
        if role == "publish":
            # A new confirm-mode channel numbers its messages from 1.
            self._tag = 0

        self._issue()
        self._maybe_ready()

    def replied(self, gen: int) -> None:
        """The control method out got its answer."""
        if gen != self._gen or not self._issued or not self._calls:
            return
        call = self._calls.popleft()
        self._issued = False
        if call.ok is not None:
            call.ok()
        self._issue()
        self._maybe_drained()

    def channel_closed(self, gen: int, role: Role, code: int | None, text: str) -> None:
        """RabbitMQ closed a channel (``code`` its reply code; None: closed for another
        reason, which costs the connection)."""
        if gen != self._gen or not self._live():
            return
        self._open.discard(role)
        if role == "publish" and code == 403:
            self._publish_refused(text)
            self._open_channel("publish")
        elif code is not None and self._issued and self._calls[0].channel == role:
            # Methods go one at a time: the one out on that channel was refused. It costs
            # that call and the channel, which is reopened; the connection carries on.
            call = self._calls.popleft()
            self._issued = False
            self._open_channel(role)
            if call.refused is not None:
                call.refused(code, text)
            self._issue()  # the next call, if its channel is still open
        else:
            self._close_connection(f"{role} channel closed: {code} {text}")
        self._maybe_drained()

    def confirmed(self, gen: int, tag: int, *, multiple: bool, ack: bool) -> None:
        if gen != self._gen:
            return
        unconfirmed = self._unconfirmed
        settled = 0
        if multiple:
            while unconfirmed and next(iter(unconfirmed)) <= tag:
                unconfirmed.popitem(last=False)
                settled += 1
        elif unconfirmed.pop(tag, None) is not None:
            settled = 1
        if ack:
            self.stats.confirmed += settled
        else:
            # RabbitMQ refused responsibility (a full reject-publish queue, say). Not
            # retried: the protocol survives a lost message, and a retry only adds load.
            self.stats.nacked += settled
            log.warning("%s: RabbitMQ nacked %d message(s)", self.name, settled)
        self._maybe_drained()

    def returned(
        self, exchange: str, routing_key: str, body: bytes, user_id: str | None
    ) -> Delivery:
        """A ``basic.return``: the delivery to hand back to its sender."""
        self.stats.returned += 1
        topic = topic_of(exchange, routing_key, self.inbox_exchange)
        return Delivery(body, topic=topic, returned=True, user_id=user_id)

    def message(
        self, exchange: str, routing_key: str, body: bytes, user_id: str | None
    ) -> Delivery:
        """A message for one of our endpoints: the delivery to hand to its handler."""
        self.stats.delivered += 1
        return Delivery(
            body, topic=topic_of(exchange, routing_key, self.inbox_exchange), user_id=user_id
        )

    def blocked(self, reason: str) -> None:
        # Writing now would only fill a socket nobody reads: publishes wait in the outbox
        # (up to max_pending) until RabbitMQ unblocks.
        if not self._blocked:
            log.warning("%s: RabbitMQ blocks publishing (%s)", self.name, reason)
            self.stats.blocked += 1
        self._blocked = True

    def unblocked(self) -> None:
        if self._blocked:
            log.warning("%s: RabbitMQ accepts publishes again", self.name)
        self._blocked = False

    def consumer_cancelled(self, gen: int, token: str) -> None:
        """The broker cancelled a consumer (its queue was deleted under us): re-create the
        queue, its bindings and its consumer on this connection."""
        endpoint = self._endpoints.get(token)
        if gen != self._gen or endpoint is None or not self._live():
            return
        log.warning("%s: consumer of %r cancelled; re-creating it", self.name, endpoint.address)
        self.stats.cancelled += 1
        self._attach(endpoint, restoring=True)

    def lost(self, gen: int, now_s: float, reason: str, *, fatal: bool = False) -> None:
        """The connection closed, or could not be opened. ``fatal``: retrying cannot fix it
        (credentials, permissions), which ends a first connection at once."""
        if gen != self._gen or self.state not in (
            State.CONNECTING,
            State.SETTING_UP,
            State.READY,
            State.CLOSING,
        ):
            return
        was_ready = self.ready
        if self.state is State.CLOSING:
            self._move("lost")
            self._finish()
            return
        self._drop_connection()
        if not self._ever_ready:
            self._failures += 1
            if fatal or self._failures >= self._connect_attempts:
                self.failure = BrokerError(reason)
                self._move("fatal")
                self._finish()
                return
        elif not was_ready:
            self._failures += 1
        else:
            self._failures = 0
        wait_s = self._backoff_s()
        if self._ever_ready and was_ready:
            # one warning for the outage; its attempts are INFO, its end a warning again
            self._lost_at_s, self._failed_since_lost = now_s, 0
            log.warning("%s: connection lost (%s); reconnecting", self.name, reason)
        elif self._ever_ready:
            self._failed_since_lost += 1
            log.info(
                "%s: reconnect attempt %d failed (%s); retrying in %.1f s",
                self.name, self._failed_since_lost, reason, wait_s,
            )  # fmt: skip
        else:
            # never connected: nothing was lost, and "reconnecting" would say it had been
            log.warning(
                "cannot connect to %s: %s; retrying in %.1f s (attempt %d)",
                self.url, reason, wait_s, self._failures,
            )  # fmt: skip
        self._move("lost")
        self._set_deadline(now_s + wait_s)

    def tick(self, now_s: float) -> None:
        """Time passed: act on the deadline that is due, if any."""
        if self._deadline_s is None or now_s < self._deadline_s:
            return
        self._deadline_s = None
        if self.state is State.DISCONNECTED:
            self._move("backoff passed")
            self._connect(now_s)
        elif self.state in (State.CONNECTING, State.SETTING_UP):
            self._close_connection(f"no answer from RabbitMQ in {self._timeout_s}s")
        elif self.state is State.CLOSING:
            if not self._close_sent:
                self._close_connection("closing: the rest was not confirmed in time")
                self._set_deadline(now_s + self._close_timeout_s)
            else:
                log.warning("%s: the connection did not close in time", self.name)
                self._move("abandon")
                self._finish()

    def abort(self, error: BrokerError) -> None:
        """The driver failed (a bug): closed for good, everyone waiting told why."""
        if self.state is not State.CLOSED:
            self.failure = self.failure or error
            self.state = State.CLOSED
            self._finish()

    # -- inside ----------------------------------------------------------------------------

    def _move(self, event: str) -> None:
        self.state = TRANSITIONS[(self.state, event)]

    def _live(self) -> bool:
        """Connected: control methods may be queued on this connection."""
        return self.state in (State.SETTING_UP, State.READY, State.CLOSING) and not (
            self.state is State.CLOSING and self._close_sent
        )

    def _check_open(self) -> None:
        if self.state in (State.CLOSING, State.CLOSED):
            raise BrokerClosed("the broker is closed")

    def _endpoint(self, token: str) -> _Endpoint[W]:
        endpoint = self._endpoints.get(token)
        if endpoint is None or self.state in (State.CLOSING, State.CLOSED):
            raise BrokerClosed("the endpoint is closed")
        return endpoint

    def _resolve(self, waiter: W, error: BrokerError | None = None) -> None:
        self._actions.append(Resolve(waiter, error))

    def _set_deadline(self, at_s: float) -> None:
        self._deadline_s = at_s
        self._actions.append(SetTimer(at_s))

    def _backoff_s(self) -> float:
        if self._failures == 0:
            return 0.0  # the first try after losing a working connection: at once
        doubled: float = self._reconnect_initial_s * 2.0 ** (self._failures - 1)
        # Jitter, so that every client one broker restart disconnected does not come back
        # in the same millisecond.
        return min(doubled, self._reconnect_max_s) + self._jitter() * self._reconnect_initial_s

    def _connect(self, now_s: float) -> None:
        self._gen += 1
        self._set_deadline(now_s + self._timeout_s)
        self._actions.append(Connect(self._gen))

    def _open_channel(self, role: Role) -> None:
        if role == "publish":
            self.publish_channel += 1
        self._actions.append(OpenChannel(role))

    def _close_connection(self, reason: str) -> None:
        if self.state is State.CLOSING:
            if self._close_sent:
                return
            self._close_sent = True
        self._actions.append(CloseConnection(reason))

    def _call_or_defer(
        self,
        action: ControlAction,
        waiter: W,
        refused: Callable[[int, str], None],
        endpoint: _Endpoint[W],
    ) -> None:
        if not (self._live() and endpoint.live):
            # The restore after the reconnect does it (desired state is already recorded).
            self._after_ready.append(waiter)
            return
        self._calls.append(
            _Call(
                action,
                ok=lambda: self._resolve(waiter),
                refused=refused,
                lost=lambda: self._after_ready.append(waiter),
                dropped=lambda: self._resolve(waiter, BrokerClosed("the endpoint is closed")),
            )
        )
        self._issue()

    def _prune(self, address: str) -> bool:
        """Drop the queued calls for the queue ``address`` that are not out yet; True if
        one of its calls is out (so its queue may exist)."""
        out = self._issued and bool(self._calls) and _address(self._calls[0]) == address
        head = [self._calls.popleft()] if self._issued and self._calls else []
        kept: list[_Call] = []
        for call in self._calls:
            if _address(call) != address:
                kept.append(call)
            elif call.dropped is not None:
                call.dropped()
        self._calls = deque(head + kept)
        return out

    def _issue(self) -> None:
        """Send the oldest control method, unless one is out; run markers on the way."""
        while self._calls and not self._issued:
            call = self._calls[0]
            if call.action is None:
                self._calls.popleft()
                if call.ok is not None:
                    call.ok()
                continue
            if call.channel not in self._open:
                return  # issued once its channel is (re)opened
            self._issued = True
            self._actions.append(call.action)

    def _declare_exchange(self, name: str) -> _Call:
        passive = name in self._passive

        def refused(code: int, text: str) -> None:
            if code == 403 and not passive:
                # No configure permission: an operator created it; check it exists. Later
                # connections go straight to the passive declare.
                log.info("%s: may not declare exchange %r; checking it exists", self.name, name)
                self._passive.add(name)
                self._calls.appendleft(self._declare_exchange(name))
                return
            why = missing_exchange(name, self._user_id) if code == 404 and passive else text
            if not self._ever_ready and code in (403, 404, 406):
                self.failure = BrokerError(f"{code} {why}")
                self._move("fatal")
                self._finish()
            else:
                self._close_connection(f"declaring exchange {name!r}: {code} {why}")

        return _Call(DeclareExchange(name, passive), refused=refused)

    def _attach(self, endpoint: _Endpoint[W], *, restoring: bool) -> None:
        """Queue the calls that give ``endpoint`` its queue, its address on the inbox
        exchange, its bindings and its consumer on this connection. Restoring, a refusal
        costs the connection (it is retried); opening, it fails the open."""
        gen = self._gen

        def refused(code: int, text: str) -> None:
            if restoring:
                self._close_connection(f"restoring {endpoint.address!r}: {code} {text}")
                return
            self._endpoints.pop(endpoint.token, None)
            if endpoint.waiter is not None:
                error = BrokerError(f"RabbitMQ refused it: {code} {text}")
                self._resolve(endpoint.waiter, error)
                endpoint.waiter = None
            self._prune(endpoint.address)
            if code != 405:  # declared: delete it, so that a retry starts from nothing
                self._calls.appendleft(_Call(DeleteQueue(endpoint.address)))

        def declared() -> None:
            endpoint.gen = gen

        def consuming() -> None:
            endpoint.live = True
            if endpoint.waiter is not None:
                self._resolve(endpoint.waiter)
                endpoint.waiter = None

        address = endpoint.address
        actions: list[ControlAction] = [
            DeclareQueue(address),
            # Its address before anything is consumed: once open returns, a send reaches it.
            BindQueue(address, self.inbox_exchange, address),
            *(BindQueue(address, self.exchange, p) for p in endpoint.patterns),
        ]
        self._calls.append(_Call(actions[0], ok=declared, refused=refused))
        self._calls.extend(_Call(a, refused=refused) for a in actions[1:])
        self._calls.append(_Call(Consume(endpoint.token, address), ok=consuming, refused=refused))
        self._issue()

    def _set_up(self) -> None:
        self._restored = True
        self._maybe_ready()

    def _maybe_ready(self) -> None:
        if self.state is not State.SETTING_UP or not self._restored or "publish" not in self._open:
            return
        self._move("set up")
        self._deadline_s = None
        reconnected = self._ever_ready
        if reconnected:
            self.stats.reconnects += 1
        self._ever_ready = True
        self._failures = 0
        waiting, self._after_ready = self._after_ready, []
        for waiter in waiting:
            self._resolve(waiter)
        if reconnected and self._lost_at_s is not None:
            # the end of the outage "connection lost" began: said once, at its level
            log.warning(
                "%s: reconnected after %.1f s (%d attempt(s)); %d endpoint(s) restored",
                self.name,
                max(0.0, self._connected_at_s - self._lost_at_s),
                self._failed_since_lost + 1,
                len(self._endpoints),
            )
            self._lost_at_s = None
        else:
            log.info(
                "%s: ready (exchange %r, %d endpoints)",
                self.name,
                self.exchange,
                len(self._endpoints),
            )

    def _publishable(self) -> bool:
        return (
            self.state in (State.READY, State.CLOSING)
            and not self._close_sent
            and "publish" in self._open
            and not self._blocked
        )

    def _flush(self) -> None:
        if not self._outbox or not self._publishable():
            return
        outbox, unconfirmed, actions = self._outbox, self._unconfirmed, self._actions
        barriers = self._barriers
        # up to the oldest ordered bind not yet answered
        going = min(min(b.ahead for b in barriers), len(outbox)) if barriers else len(outbox)
        for _ in range(going):
            message = outbox.popleft()
            self._tag += 1
            unconfirmed[self._tag] = message
            actions.append(Publish(self._tag, message, self.publish_channel))
        for barrier in barriers:
            barrier.ahead -= going

    def _publish_refused(self, reply_text: str) -> None:
        """RabbitMQ handles a channel's publishes in order and ignores what follows a
        refused one: those before it were routed (their acks are lost with the channel),
        the refused ones go back to their senders, the rest go out again in order."""
        unconfirmed = list(self._unconfirmed.values())
        self._unconfirmed.clear()
        target = refused_target(reply_text)
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
        self._outbox.extendleft(reversed(kept))
        for barrier in self._barriers:
            barrier.ahead += len(kept)  # they were ahead of it
        self.stats.confirmed += routed
        self.stats.refused += len(refused)
        self.stats.republished += len(kept)
        log.warning(
            "%s: RabbitMQ refused %d message(s) (%s); handed back as returned",
            self.name,
            len(refused),
            reply_text,
        )
        for message in refused:
            topic = topic_of(message.exchange, message.routing_key, self.inbox_exchange)
            delivery = Delivery(message.body, topic=topic, returned=True, user_id=self._user_id)
            self._actions.append(Deliver(message.token, delivery))

    def _drop_connection(self, *, replay: bool = True) -> None:
        """The connection is gone: what was under way waits for the next one."""
        self._open.clear()
        self.publish_channel += 1
        self._blocked = False
        self._issued = False
        # exclusive queues die with their connection: every claim with them; and the
        # restore binds every pattern before anything is published again
        self._claims.clear()
        self._barriers.clear()
        calls, self._calls = self._calls, deque()
        for call in calls:
            if call.lost is not None:
                call.lost()
        # Unconfirmed messages may or may not have arrived: send them again, ahead of what
        # was queued after them (at least once, each sender's order kept).
        unconfirmed = list(self._unconfirmed.values())
        self._unconfirmed.clear()
        self._outbox.extendleft(reversed(unconfirmed))
        if replay:
            self.stats.republished += len(unconfirmed)

    def _maybe_drained(self) -> None:
        if (
            self.state is State.CLOSING
            and not self._close_sent
            and not self._outbox
            and not self._unconfirmed
            and not self._calls
        ):
            self._close_connection("closing")

    def _finish(self) -> None:
        """Closed for good: everyone still waiting is told."""
        self._drop_connection(replay=False)
        self.stats.abandoned += len(self._outbox)
        if self._outbox:
            log.warning("%s: %d accepted messages never confirmed", self.name, len(self._outbox))
        self._outbox.clear()
        error = self.failure or BrokerClosed("the broker is closed")
        for endpoint in self._endpoints.values():
            if endpoint.waiter is not None:
                self._resolve(endpoint.waiter, error)
                endpoint.waiter = None
        waiting, self._after_ready = self._after_ready, []
        for waiter in waiting:
            self._resolve(waiter, error)
        self._deadline_s = None
        self._actions.append(Stop())


def _address(call: _Call) -> str | None:
    """The queue a control call is about, if any."""
    action = call.action
    if isinstance(action, DeclareQueue | BindQueue | UnbindQueue | DeleteQueue | Consume):
        return action.address
    return None
