"""The live runtime's engine: drives one protocol state machine with a broker endpoint, a
scheduler and a codec.

A :class:`Driver` owns the lock that serialises every call into its machine, whichever
thread the call comes from (the broker's delivery thread, the scheduler's timer thread, a
caller's thread). It decodes bodies *outside* that lock (decoding is the costly part and is
thread-safe) and carries out the machine's effects in order: timers, stores and drops under
the lock; what goes to the broker (sends, publishes, binds) is queued under it and
transmitted after it is released, in the order the machine asked for, by whichever thread
holds the transmit lock. So no broker round trip (a bind waits for RabbitMQ's bind-ok)
ever holds up the machine, and a node still binds a lookup bucket before it sends the
offer that follows. Outcome callbacks run last, so a caller's callback can call straight
back in.

Deliveries run on the broker's IO thread where it has one (the endpoint is ``inline``, see
:mod:`reservoir.broker`): a message is decoded, handled and answered there with no hand-over
between threads. That thread must not wait for the broker, so a bind or unbind it finds at
the head of the outbox goes, with everything queued after it, to a thread of the driver's
own (``<name>:binds``, started the first time), and the IO thread carries on, unless the
broker binds in order (``Endpoint.binds_in_order``, RabbitMQ's adapters): then a bind is
asked for without waiting, and what follows it leaves the broker only once it is in
place, with no thread waiting out the round trip. Binds are
rare (a node's tier changes, a lookup topic for a findable id); sends are not.

A requestor's claim of a caller-chosen id waits for the broker too, but nothing it sends
waits for it (the machine sends the id's lookup once it hears the answer): claims are
asked for apart from the outbox, once the machine's lock is let go, on threads of their
own (``<name>:claims``) when the broker is remote, so that neither a caller's thread (an
event loop's, for ``reserve_async``) nor the transmit lock waits out a round trip. The
answer is fed to the machine as any event (``_handle_claim``); on an in-process broker it
is scheduled at once, in order with deliveries, so a virtual clock's runs stay exact.

The decode path is here too: a delivery is decoded with the codec of the driver's role,
checked against where it arrived (its routing key, or our address), and dropped and
counted when refused; a drop for a signature reason also logs one rate-limited warning
naming the reason and the sender.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import threading
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from functools import partial

from reservoir.broker import Broker, BrokerClosed, BrokerError, Delivery, Endpoint
from reservoir.brokers import BrokerUrl
from reservoir.clock import Scheduler, ThreadScheduler, Timer
from reservoir.observe.logs import REQUEST_ID
from reservoir.observe.metrics import Metrics
from reservoir.protocol.addresses import node_address
from reservoir.protocol.effects import (
    Bind,
    CancelTimer,
    Claim,
    DeleteAllocation,
    Dropped,
    Effect,
    Failed,
    ForgetTask,
    Found,
    FreeCompleted,
    Placed,
    Publish,
    RememberTask,
    Send,
    SetTimer,
    StartTask,
    StopTask,
    StoreAllocation,
    Unbind,
    Unclaim,
)
from reservoir.protocol.messages import (
    AUDIT_ID,
    IDENTIFIER_MAX_LENGTH,
    IDENTIFIER_PATTERN,
    REQUESTOR_KINDS,
    ROSTER_ID,
    UNTRUSTED_ID,
    Message,
    Untrusted,
)
from reservoir.runtime.keys import Role
from reservoir.runtime.settings import Settings
from reservoir.runtime.wire import DecodeError, DropWarnings

__all__ = ["Driver"]

# the logger's name predates the runtime package: operators' logging configs name it
log = logging.getLogger("reservoir.driver")

#: request ids of messages that belong to no conversation (membership, audits)
_NOT_A_CONVERSATION = frozenset({ROSTER_ID, AUDIT_ID, UNTRUSTED_ID})

#: what is handed on after the machine's lock is released: a caller's outcome, or a
#: task to start or stop (a node agent's, after its Accepted went out)
Outcome = Placed | Failed | FreeCompleted | Found | StartTask | StopTask

# Effects are told apart by their exact class, by identity or in a set (each is final):
# ``isinstance`` asks a struct's metaclass for ``__instancecheck__`` and tries a tuple's
# classes one by one, several tests per message on the hot path.
_TO_TRANSMIT = frozenset({Send, Publish, Bind, Unbind})
_BINDING = frozenset({Bind, Unbind})
_CLAIMING = frozenset({Claim, Unclaim})
#: what a node keeps in its store, under the machine's lock, before anything is said of it
_DURABLE = frozenset({StoreAllocation, DeleteAllocation, RememberTask, ForgetTask})
#: threads asking a remote broker for claims at once (it answers them one at a time)
CLAIM_THREADS = 4


def _could_be_a_name(name: str) -> bool:
    """Whether ``name`` is an id a participant could have (so a message can go to it)."""
    return len(name) <= IDENTIFIER_MAX_LENGTH and re.fullmatch(IDENTIFIER_PATTERN, name) is not None


class Driver:
    """Carries out effects for one state machine. Subclasses say how events reach the
    machine (``_handle_message``, ``_handle_returned``, ``_handle_timer``) and what to do
    with durable and outcome effects."""

    def __init__(
        self,
        *,
        broker: Broker | BrokerUrl | str | None,
        settings: Settings,
        scheduler: Scheduler | None,
        metrics: Metrics | None,
        endpoint_name: str,
        role: Role,
    ) -> None:
        """``broker`` may be a :class:`Broker` (shared, left open on close), a URL or None
        (``settings.broker_url``), opened here and closed on close; likewise a scheduler
        of None gets one of our own. ``role`` is whose keys we sign with. The machine must
        exist before this runs: deliveries can arrive as soon as the endpoint is open."""
        self.settings = settings
        self.role: Role = role
        #: our address, known before the endpoint is: a delivery can race its opening
        self._endpoint_name = endpoint_name
        self._requestor_users = settings.requestor_users
        self._node_users = settings.node_users
        #: whether senders are checked at all (roles configured): most runs skip the call
        self._senders_checked = self._requestor_users is not None or self._node_users is not None
        self.codec = settings.codec(role)
        #: the wall clock matters to the codec only for a signature's time stamp: while
        #: unsigned, no message reads it (a call saved on each message both ways)
        self._signing = self.codec.signing
        self._drop_warnings = DropWarnings(log)
        self._warn_about_private_keys_of_others(endpoint_name)
        self._check_own_key()
        self.metrics = metrics if metrics is not None else Metrics()
        self._lock = threading.Lock()
        #: what the machine asked to send, bind or unbind, in order, not yet transmitted
        self._outbox: deque[Send | Publish | Bind | Unbind] = deque()
        self._transmit_lock = threading.Lock()
        #: where the outbox goes from a bind on, when the thread that met it may not wait
        self._binder: concurrent.futures.ThreadPoolExecutor | None = None
        #: claims and unclaims the machine asked for, not yet asked of the broker
        self._claims_due: list[Claim | Unclaim] = []
        #: where a remote broker's claims wait for their answers
        self._claimer: concurrent.futures.ThreadPoolExecutor | None = None
        #: key -> (timer, generation); a firing whose generation is stale is ignored
        self._timers: dict[Hashable, tuple[Timer, int]] = {}
        self._timer_generation = 0
        self._closed = False
        self._owned_broker: Broker | None = None
        if not isinstance(broker, Broker):
            from reservoir.brokers import connect  # the adapters package; imported only when needed

            broker = self._owned_broker = connect(broker or settings.broker_url)
        self._owned_scheduler: Scheduler | None = None
        if scheduler is None:
            scheduler = self._owned_scheduler = ThreadScheduler(name=endpoint_name)
        self.scheduler = scheduler
        try:
            self.endpoint: Endpoint = broker.open_endpoint(
                self._on_delivery, name=endpoint_name, inline=True
            )
            #: the broker the endpoint is on (its ``connected`` is the participant's health)
            self.broker: Broker = broker
        except BaseException:
            self._let_go_of_owned()
            raise
        #: binds asked for without waiting, what follows them held back by the broker
        self._binds_in_order = self.endpoint.binds_in_order
        if self.endpoint.address != endpoint_name:
            self.endpoint.close()
            self._let_go_of_owned()
            raise BrokerError(
                f"the broker named our endpoint {self.endpoint.address!r}, not {endpoint_name!r}"
            )

    def _let_go(self) -> None:
        """Close the endpoint, and the scheduler and broker if they are ours."""
        self.endpoint.close()
        for executor in (self._binder, self._claimer):
            if executor is not None:
                # Not waited for: a bind or claim in progress fails at once on the closed
                # endpoint.
                executor.shutdown(wait=False)
        self._let_go_of_owned()

    def _let_go_of_owned(self) -> None:
        if self._owned_scheduler is not None:
            self._owned_scheduler.close()
        if self._owned_broker is not None:
            self._owned_broker.close()

    @property
    def address(self) -> str:
        return self.endpoint.address

    # -- events in ---------------------------------------------------------------------

    def _warn_about_private_keys_of_others(self, participant: str) -> None:
        keys = self.codec.keys
        other: Role = "requestor" if self.role == "node" else "node"
        if keys is None or keys.shared:
            return
        private = [k.key_id for k in keys.of(other) if k.can_sign and k.algorithm == "ed25519"]
        if private:
            # With HMAC that is unavoidable (see docs/design.md); with Ed25519 it throws
            # away the one thing the key pair buys.
            log.warning(
                "%s (a %s) holds the private half of %s key(s) %s: it could sign their "
                "messages; give it their public keys only (ed25519-public)",
                participant,
                self.role,
                other,
                ", ".join(private),
            )

    def _check_own_key(self) -> None:
        """Before the endpoint opens: whether what we sign with will be believed (a node
        holding the node keyring checks its own key against it: NodeAgent)."""

    def _on_delivery(self, delivery: Delivery) -> None:
        # Where it arrived: the routing key it was published with, or our own address for
        # a direct send. Our own returned messages may have been meant for anywhere.
        destination = None if delivery.returned else (delivery.topic or self._endpoint_name)
        try:
            message = self.codec.decode(
                delivery.body,
                self.scheduler.clock.wall() if self._signing else 0.0,
                destination=destination,
                check_replay=not delivery.returned,
            )
        except DecodeError as error:
            self.metrics.inc("dropped", error.reason)
            name = self._endpoint_name
            warned = self._drop_warnings.dropped(name, error, self.scheduler.clock.now())
            if not warned:
                log.debug("%s dropped a message: %s", name, error)
            if error.node_key and self.role == "requestor":
                if warned:  # as rarely as the warning: once a minute per reason and node
                    self._tell_the_node(error)
                if error.signed_body is not None:
                    self._refused_answer(error.signed_body)
            return
        if (
            self._senders_checked
            and not delivery.returned
            and not self._trusted(message, delivery.user_id)
        ):
            self.metrics.inc("dropped", "untrusted_sender")
            log.debug(
                "%s dropped a %s from broker user %r, not allowed to send it",
                self.address,
                message.kind,
                delivery.user_id,
            )
            return
        self.metrics.inc("received", message.kind)
        if delivery.returned:
            self.metrics.inc("returned", message.kind)
            self._call(self._handle_returned, message)
        else:
            self._call(self._handle_message, message)

    def _tell_the_node(self, error: DecodeError) -> None:
        """Tell the node a message in its name was refused for the key that signed it: it
        cannot see that itself (nothing answers its offers), and its operator reads its
        log, not every requestor's."""
        node = error.sender
        if node is None or error.key_id is None or not _could_be_a_name(node):
            return  # no name a node could have: nobody to tell
        notice = Untrusted(
            request_id=UNTRUSTED_ID,
            sender=self._endpoint_name,
            reason="impersonation" if error.reason == "impersonation" else "unknown_key",
            key_id=error.key_id,
            detail=error.detail[:500],
        )
        self._run(lambda now: [Send(node_address(node), notice)])

    def _refused_answer(self, body: bytes) -> None:
        """A message refused as ``impersonation``: signed by a real key, another node's.
        A requestor hears of it as of an answer it cannot use (see Requestor); others
        ignore it."""

    def _trusted(self, message: Message, user_id: str | None) -> bool:
        """Whether the broker-authenticated sender may send this kind of message. Only
        enforced when roles are configured; then an unauthenticated message is refused."""
        allowed = self._requestor_users if message.kind in REQUESTOR_KINDS else self._node_users
        return allowed is None or (user_id is not None and user_id in allowed)

    def _on_timer(self, key: Hashable, generation: int) -> None:
        request_id = self._conversation_of(key)
        token = REQUEST_ID.set(request_id) if request_id is not None else None
        try:
            self._fire(key, generation)
        finally:
            if token is not None:
                REQUEST_ID.reset(token)

    def _fire(self, key: Hashable, generation: int) -> None:
        outcomes: list[Outcome] = []
        with self._lock:
            current = self._timers.get(key)
            if self._closed or current is None or current[1] != generation:
                return  # replaced or cancelled after it was due
            del self._timers[key]
            effects = self._handle_timer(key, self.scheduler.clock.now())
            self._execute(effects, outcomes)
        self._settle(outcomes)

    def _call(self, handler: Callable[[Message, float], list[Effect]], message: Message) -> None:
        # Every log line while a conversation's message is handled, and its effects
        # carried out, names the conversation (reservoir.observe.logs). One function, not
        # two: this runs for every message.
        request_id = message.request_id
        token = None if request_id in _NOT_A_CONVERSATION else REQUEST_ID.set(request_id)
        try:
            outcomes: list[Outcome] = []
            with self._lock:
                if self._closed:
                    return
                effects = handler(message, self.scheduler.clock.now())
                self._execute(effects, outcomes)
            self._settle(outcomes)
        finally:
            if token is not None:
                REQUEST_ID.reset(token)

    def _run(self, step: Callable[[float], list[Effect]]) -> None:
        """Feed the machine an event that is not a message (a caller's request, start, stop)."""
        outcomes: list[Outcome] = []
        with self._lock:
            effects = step(self.scheduler.clock.now())
            self._execute(effects, outcomes)
        self._settle(outcomes)

    # -- effects out -------------------------------------------------------------------

    def _execute(self, effects: Sequence[Effect], outcomes: list[Outcome]) -> None:
        """Carry out effects, under the machine's lock; what goes to the broker is queued
        for :meth:`_settle`."""
        for effect in effects:
            if type(effect) in _TO_TRANSMIT:
                self._outbox.append(effect)  # type: ignore[arg-type]  # the set narrows it
            elif type(effect) is SetTimer:
                self._set_timer(effect.key, effect.at)
            elif type(effect) is CancelTimer:
                cancelled = self._timers.pop(effect.key, None)
                if cancelled is not None:
                    cancelled[0].cancel()
            elif type(effect) is Dropped:
                self.metrics.inc("ignored", effect.reason)
                log.debug(
                    "%s ignored a message (%s): %s", self.address, effect.reason, effect.detail
                )
            elif type(effect) in _DURABLE:
                self._persist(effect)  # type: ignore[arg-type]  # the set narrows it
            elif type(effect) in _CLAIMING:
                self._claims_due.append(effect)  # type: ignore[arg-type]  # the set narrows it
            else:
                outcomes.append(effect)  # type: ignore[arg-type]  # what is left: outcomes

    def _settle(self, outcomes: list[Outcome]) -> None:
        """After the machine's lock is released: transmit what is queued, ask for the
        claims due, then hand the outcomes to whoever waits for them."""
        self._flush_outbox()
        if self._claims_due:
            self._ask_for_claims()
        self._deliver(outcomes)

    def _ask_for_claims(self) -> None:
        with self._lock:
            due, self._claims_due = self._claims_due, []
        for effect in due:
            if not self.broker.reconnects:  # in this process: answered at once
                self._claim_or_unclaim(effect)
                continue
            if self._claimer is None:
                with self._lock:
                    if self._claimer is None:
                        self._claimer = concurrent.futures.ThreadPoolExecutor(
                            max_workers=CLAIM_THREADS,
                            thread_name_prefix=f"{self._endpoint_name}:claims",
                        )
            try:
                self._claimer.submit(self._claim_or_unclaim, effect)
            except RuntimeError:  # shut down: we are closing
                return

    def _claim_or_unclaim(self, effect: Claim | Unclaim) -> None:
        request_id = effect.request_id
        if type(effect) is Unclaim:
            try:
                self.endpoint.unclaim(request_id)
            except BrokerError as error:  # the claim goes with the endpoint or connection
                log.debug("%s could not let go of %s: %s", self.address, request_id, error)
            return
        connections = self.broker.connections
        held: bool | None
        try:
            held = self.endpoint.claim(request_id)
        except BrokerError as error:
            log.debug("%s could not claim %s: %s", self.address, request_id, error)
            held = None
        if held and self.broker.connections != connections:
            held = None  # made on a connection that went since: it may be gone
        if self.broker.reconnects:
            self._feed_claim(request_id, held)
        else:
            self.scheduler.call_at(
                self.scheduler.clock.now(), partial(self._feed_claim, request_id, held)
            )

    def _feed_claim(self, request_id: str, held: bool | None) -> None:
        token = REQUEST_ID.set(request_id)
        try:
            with self._lock:
                closed = self._closed
            if not closed:
                self._run(partial(self._handle_claim, request_id, held))
        finally:
            REQUEST_ID.reset(token)

    def _flush_outbox(self) -> None:
        # Whoever holds the transmit lock drains the queue, ours included, in order. A
        # thread that may not wait (the broker's IO thread) does not wait for the lock
        # either: its holder drains what it queued, since it looks again after letting go.
        outbox = self._outbox
        if not outbox:
            return
        may_block = self.endpoint.blocking_allowed()
        while outbox:
            if not self._transmit_lock.acquire(blocking=may_block):
                return
            try:
                if not may_block:
                    if not self._drain_on_io_thread():
                        return
                elif len(outbox) > 1:
                    # A caller's or a timer's thread: what it queued leaves together, for
                    # one wake-up of the broker's IO thread and one write, so a requestor's
                    # second probe does not wait on the IO thread its first woke
                    # (docs/performance.md, "The runtime").
                    with self.endpoint.batch():
                        self._drain()
                else:
                    self._drain()
            finally:
                self._transmit_lock.release()

    def _drain(self) -> None:
        """Under the transmit lock: transmit everything queued, in order."""
        outbox = self._outbox
        while outbox:
            self._transmit_one(outbox.popleft())

    def _drain_on_io_thread(self) -> bool:
        """Under the transmit lock, on a thread that may not wait: transmit what is queued
        up to the first bind or unbind, which goes to the binder thread with what follows
        it (False: the binder drains the rest)."""
        outbox = self._outbox
        in_order = self._binds_in_order
        while outbox:
            if not in_order and type(outbox[0]) in _BINDING:
                self._hand_to_binder()
                return False
            self._transmit_one(outbox.popleft())
        return True

    def _hand_to_binder(self) -> None:
        if self._binder is None:
            self._binder = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix=f"{self._endpoint_name}:binds"
            )
        try:
            self._binder.submit(self._flush_on_binder)
        except RuntimeError:  # shut down: we are closing, and what is left goes nowhere
            log.debug("%s closed before it could bind", self.address)

    def _flush_on_binder(self) -> None:
        # The executor keeps an exception in a future nobody reads: say it here.
        try:
            self._flush_outbox()
        except Exception:
            log.exception("%s: transmitting from the binder thread failed", self.address)

    def _transmit_one(self, effect: Send | Publish | Bind | Unbind) -> None:
        try:
            self._transmit(effect, self.scheduler.clock.wall() if self._signing else 0.0)
        except BrokerClosed:
            log.debug("%s closed before it could send its last messages", self.address)
        except BrokerError as error:
            # The transport gave up on this one (its buffer is full, a bind timed out
            # during an outage). The protocol survives a lost message, and the messages
            # after it must still go.
            what = effect.message.kind if isinstance(effect, Send | Publish) else "bind"
            self.metrics.inc("transport_errors", what)
            log.warning("%s could not %s: %s", self.address, what, error)

    def _transmit(self, effect: Send | Publish | Bind | Unbind, wall_s: float) -> None:
        if type(effect) is Send:
            self.metrics.inc("sent", effect.message.kind)
            body = self.codec.encode(effect.message, wall_s, destination=effect.address)
            self.endpoint.send(effect.address, body)
        elif type(effect) is Publish:
            self.metrics.inc("sent", effect.message.kind)
            body = self.codec.encode(effect.message, wall_s, destination=effect.topic)
            self.endpoint.publish(effect.topic, body)
        elif type(effect) is Bind:
            if self._binds_in_order:
                self.endpoint.bind_ordered(effect.topic)
            else:
                self.endpoint.bind(effect.topic)
        elif self._binds_in_order:
            self.endpoint.unbind_ordered(effect.topic)
        else:
            self.endpoint.unbind(effect.topic)

    def _set_timer(self, key: Hashable, at: float) -> None:
        previous = self._timers.pop(key, None)
        if previous is not None:
            previous[0].cancel()
        self._timer_generation += 1
        generation = self._timer_generation
        timer = self.scheduler.call_at(at, partial(self._on_timer, key, generation))
        self._timers[key] = (timer, generation)

    def _cancel_all_timers(self) -> None:
        for timer, _generation in self._timers.values():
            timer.cancel()
        self._timers.clear()

    # -- for subclasses ----------------------------------------------------------------

    def _handle_message(self, message: Message, now: float) -> list[Effect]:
        raise NotImplementedError

    def _handle_returned(self, message: Message, now: float) -> list[Effect]:
        return [Dropped("returned", f"{message.kind} for {message.request_id} reached nobody")]

    def _handle_timer(self, key: Hashable, now: float) -> list[Effect]:
        raise NotImplementedError

    def _handle_claim(self, request_id: str, held: bool | None, now: float) -> list[Effect]:
        """The broker's answer to a :class:`Claim` the machine asked for."""
        return []

    def _conversation_of(self, key: Hashable) -> str | None:
        """The request id a timer belongs to, for the logs (None: no conversation's)."""
        return None

    def _persist(
        self, effect: StoreAllocation | DeleteAllocation | RememberTask | ForgetTask
    ) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps no allocations")

    def _deliver(self, outcomes: list[Outcome]) -> None:
        if outcomes:
            raise NotImplementedError(f"{type(self).__name__} produces no outcomes")
