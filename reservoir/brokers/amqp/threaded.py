"""The threaded front of both RabbitMQ drivers: what callers' threads talk to.

This module owns the part of a RabbitMQ broker that has nothing to do with the client
library: the :class:`~reservoir.broker.Broker` and :class:`~reservoir.broker.Endpoint`
methods, the one lock under which the :class:`~reservoir.brokers.amqp.session.Session` is called,
callers waiting (``timeout_s``) on a future the session resolves, the dispatcher thread that
runs handlers one at a time in arrival order (and the ``inline`` ones, run on the IO thread
itself), readiness (:meth:`AmqpBroker.wait_ready`),
stats, and the pump that carries the session's actions to the driver.

A driver subclasses :class:`AmqpBroker` and supplies the IO thread: ``_io_main`` (run the
client's loop until the session says Stop), ``_send_wake`` (make the IO thread call ``_pump``
soon; from any thread), and ``_do`` (carry out one action with the client library and
report what happened through ``_event``). Everything the session decides is the same for
both drivers; so are these methods, stats and readiness.

A handler runs on the dispatcher thread unless its endpoint was opened ``inline``: a
blocking ``bind`` there would wait for the IO thread, that is for itself. An inline handler
runs on the IO thread as the message is read, and what it sends is carried out as soon as it
returns, without waking the IO thread through the client library: two thread hand-overs
fewer per message each way (docs/performance.md, "The runtime", measures the quicker
round trip and the CPU saved per placement). Its ``bind`` and ``unbind`` raise, and its
endpoint's ``blocking_allowed()`` is False, so a caller such as reservoir's driver hands a
bind to a thread of its own.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import os
import queue
import random
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar, ParamSpec

from reservoir.broker import Broker, BrokerClosed, BrokerError, Delivery, Endpoint, Handler
from reservoir.brokers._rules import (
    check_body,
    check_endpoint_name,
    check_exchange,
    check_handler,
    check_key,
    check_limits,
    check_no_wildcards,
    run_handler,
    run_handlers,
)
from reservoir.brokers.admin import RabbitAdmin
from reservoir.brokers.amqp.session import (
    Action,
    AmqpStats,
    ClaimedElsewhere,
    Deliver,
    Message,
    Publish,
    Resolve,
    Session,
    State,
)
from reservoir.brokers.url import BrokerUrl

__all__ = ["AmqpBroker", "AmqpEndpoint", "Future"]

log = logging.getLogger("reservoir.brokers.amqp")

Future = concurrent.futures.Future[None]
P = ParamSpec("P")

#: brokers opened in this process, for connection names
_numbers = itertools.count(1)


class _Batch:
    """One thread's :meth:`AmqpEndpoint.batch` blocks on one broker: while ``depth`` is
    above 0 the wake-up a send would make is put off (``wake_due``) until the outermost
    block ends, so that the IO thread takes every message of the block in one pump."""

    __slots__ = ("_wake", "depth", "wake_due")

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self.depth = 0
        self.wake_due = False

    def __enter__(self) -> None:
        self.depth += 1

    def __exit__(self, *exc_info: object) -> None:
        self.depth -= 1
        if not self.depth and self.wake_due:
            self.wake_due = False
            self._wake()


class AmqpEndpoint(Endpoint):
    """An exclusive queue on an :class:`AmqpBroker`. Made by ``open_endpoint``."""

    def __init__(
        self, broker: AmqpBroker, address: str, handler: Handler, token: str, *, inline: bool
    ) -> None:
        self.address = address
        self._broker = broker
        self._handler = handler
        self._token = token
        #: the handler runs on the IO thread (see the module docstring)
        self.inline = inline
        # Set under the broker's lock; read anywhere (a stale read lets one more delivery
        # through, as with the in-process broker).
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def bind(self, pattern: str) -> None:
        pattern = check_key(pattern, "binding pattern")
        self._broker._wait(self, f"bind {pattern!r}", Session.bind, self._token, pattern)

    def unbind(self, pattern: str) -> None:
        pattern = check_key(pattern, "binding pattern")
        self._broker._wait(self, f"unbind {pattern!r}", Session.unbind, self._token, pattern)

    #: bind_ordered and unbind_ordered wait for nothing (see Endpoint.binds_in_order)
    binds_in_order = True

    def bind_ordered(self, pattern: str) -> None:
        pattern = check_key(pattern, "binding pattern")
        self._broker._order(self, Session.bind_ordered, pattern)

    def unbind_ordered(self, pattern: str) -> None:
        pattern = check_key(pattern, "binding pattern")
        self._broker._order(self, Session.unbind_ordered, pattern)

    def claim(self, key: str) -> bool:
        key = check_key(key, "claim")
        try:
            self._broker._wait(self, f"claim {key!r}", Session.claim, self._token, key)
        except ClaimedElsewhere:
            return False
        return True

    def unclaim(self, key: str) -> None:
        key = check_key(key, "claim")
        self._broker._wait(self, f"unclaim {key!r}", Session.unclaim, self._token, key)

    def publish(self, topic: str, body: bytes) -> None:
        topic = check_key(topic, "topic")
        self._broker._accept(self, self._broker.exchange, topic, check_body(body))

    def send(self, address: str, body: bytes) -> None:
        address = check_key(address, "address")
        self._broker._accept(self, self._broker.inbox_exchange, address, check_body(body))

    def close(self) -> None:
        self._broker._close_endpoint(self)

    def batch(self) -> _Batch:
        return self._broker._batch()

    def blocking_allowed(self) -> bool:
        return not self._broker._on_io_thread()

    def __enter__(self) -> AmqpEndpoint:
        return self

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.address!r} {'closed' if self._closed else 'open'}>"


class AmqpBroker(Broker, ABC):
    """A RabbitMQ connection that hands out endpoints; a driver supplies the IO thread.

    Options, the same for both drivers: ``exchange`` (overrides the URL's), ``timeout_s``
    (for open, bind, unbind and each connection step), ``heartbeat_s`` (read by the
    driver, when the URL gives none; 0 disables), ``connect_attempts`` (the first
    connection), ``reconnect_initial_s`` and ``reconnect_max_s`` (the backoff),
    ``max_pending`` (accepted but unconfirmed messages), ``close_timeout_s`` and
    ``connection_name`` (what ``rabbitmqctl list_connections`` shows, the same across
    reconnects; ``reservoir-<driver>:<pid>:<n>`` unless given).
    """

    #: names the driver in connection and thread names
    driver = "amqp"

    def __init__(
        self,
        url: str | BrokerUrl,
        *,
        exchange: str | None = None,
        timeout_s: float = 10.0,
        heartbeat_s: float = 30.0,
        connect_attempts: int = 3,
        reconnect_initial_s: float = 0.1,
        reconnect_max_s: float = 10.0,
        max_pending: int = 50_000,
        close_timeout_s: float = 5.0,
        connection_name: str | None = None,
    ) -> None:
        parsed = BrokerUrl.parse(url)
        if exchange is not None:
            parsed = parsed.with_exchange(check_exchange(exchange))
        check_limits(
            timeout_s=timeout_s,
            close_timeout_s=close_timeout_s,
            max_pending=max_pending,
            connect_attempts=connect_attempts,
        )
        self.broker_url = parsed
        self.url = parsed.display
        self.exchange: str = parsed.exchange
        #: the topic exchange sends go to, routed by destination address
        self.inbox_exchange: str = parsed.inbox_exchange
        number = next(_numbers)
        self.connection_name = connection_name or f"reservoir-{self.driver}:{os.getpid()}:{number}"
        self._timeout_s = timeout_s
        self._close_timeout_s = close_timeout_s

        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._closed = False
        self._session: Session[Future] = Session(
            exchange=self.exchange,
            inbox_exchange=self.inbox_exchange,
            max_pending=max_pending,
            timeout_s=timeout_s,
            close_timeout_s=close_timeout_s,
            connect_attempts=connect_attempts,
            reconnect_initial_s=reconnect_initial_s,
            reconnect_max_s=reconnect_max_s,
            jitter=random.Random().random,
            name=self.connection_name,
            url=parsed.display,
        )
        self._endpoints: dict[str, AmqpEndpoint] = {}
        self._tokens = itertools.count(1)
        self._wake_pending = False
        self._pumping = False
        #: the IO thread's identity, once it runs (compared on every send)
        self._io_ident: int | None = None
        #: an inline handler runs now (on the IO thread; read and written there only)
        self._in_handler = False
        #: ... and it sent something, which the IO thread carries out when it returns
        self._sent_from_handler = False
        #: an event was reported while the pump carried out actions (see _event)
        self._reported = False
        #: each thread's batch of sends (see :class:`_Batch`), made on its first batch
        self._batches = threading.local()
        #: callables other threads handed to the IO thread (see :meth:`call_on_io_thread`)
        self._soon: list[Callable[[], None]] = []
        self._deliveries: queue.SimpleQueue[tuple[AmqpEndpoint, Delivery] | None] = (
            queue.SimpleQueue()
        )
        self._dispatcher = threading.Thread(
            target=self._dispatch_main, name=f"{self.connection_name}:dispatch", daemon=True
        )
        self._io_thread = threading.Thread(
            target=self._io_run, name=f"{self.connection_name}:io", daemon=True
        )
        self._dispatcher.start()
        self._io_thread.start()
        # Every attempt is bounded by timeout_s, every backoff by reconnect_max_s.
        self._wait_state(
            lambda: self._session.state in (State.READY, State.CLOSED),
            connect_attempts * (timeout_s + reconnect_max_s) + 5.0,
        )
        with self._lock:
            state, failure = self._session.state, self._session.failure
        if state is not State.READY:
            self.close()
            why = failure or BrokerError("no connection came up in time")
            raise BrokerError(f"cannot connect to {self.url}: {why}") from failure

    # -- public ----------------------------------------------------------------------------

    @property
    def stats(self) -> AmqpStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return replace(self._session.stats)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def connected(self) -> bool:
        """Whether the connection is up and the topology restored."""
        with self._lock:
            return self._session.ready

    reconnects: ClassVar[bool] = True

    @property
    def connections(self) -> int:
        """Connections completed so far: 1 after the constructor, one more per recovery."""
        with self._lock:
            return self._session.stats.reconnects + 1

    def wait_ready(self, timeout_s: float, *, min_reconnects: int = 0) -> bool:
        """Block until connected, the topology restored, with at least ``min_reconnects``
        reconnections behind us: the readiness probe (tests use it after killing the
        connection). False on timeout or once closed."""
        session = self._session
        return self._wait_state(
            lambda: session.ready and session.stats.reconnects >= min_reconnects, timeout_s
        )

    def wait_connected(self, timeout_s: float, *, min_reconnects: int = 0) -> bool:
        """The pika adapter's old name for :meth:`wait_ready`."""
        return self.wait_ready(timeout_s, min_reconnects=min_reconnects)

    def wait_for_connections(self, count: int, timeout_s: float) -> bool:
        """The kombu adapter's old form of :meth:`wait_ready`: ``count`` connections."""
        return self.wait_ready(timeout_s, min_reconnects=count - 1)

    def delete_exchanges(self) -> None:
        """Delete ``<exchange>`` and ``<exchange>.inbox`` (see :mod:`reservoir.brokers.admin`: only
        for exchanges this run made itself). Works before or after :meth:`close`."""
        admin = RabbitAdmin(self.broker_url, timeout_s=self._timeout_s, client=self.connection_name)
        admin.delete_reservoir_exchanges()

    def open_endpoint(
        self, handler: Handler, *, name: str | None = None, inline: bool = False
    ) -> AmqpEndpoint:
        check_handler(handler)
        if name is not None:
            check_no_wildcards(check_endpoint_name(name))
        if self._on_io_thread():
            # It waits for RabbitMQ's answers, which only this thread could read.
            raise RuntimeError("open_endpoint on the broker's IO thread would hang")
        address = name if name is not None else f"inbox.{uuid.uuid4().hex}"
        future: Future = concurrent.futures.Future()
        with self._lock:
            self._check_usable()
            token = str(next(self._tokens))
            endpoint = AmqpEndpoint(self, address, handler, token, inline=inline)
            self._session.open_endpoint(token, address, future)  # refuses a name in use
            self._endpoints[token] = endpoint
        self._wake()
        try:
            self._result(future, f"open endpoint {address!r}")
        except BaseException:
            self._close_endpoint(endpoint, wait=False)
            raise
        return endpoint

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                for endpoint in self._endpoints.values():
                    endpoint._closed = True
                self._session.close(self._now())
                self._changed.notify_all()
        self._wake()
        current = threading.current_thread()
        if current is not self._io_thread and self._io_thread.is_alive():
            self._io_thread.join(2 * self._close_timeout_s + self._timeout_s + 5.0)
            if self._io_thread.is_alive():
                log.error("%s: the IO thread did not stop", self.connection_name)
        self._deliveries.put(None)
        if current is not self._dispatcher and self._dispatcher.is_alive():
            # A handler that closes the broker cannot wait for its own thread.
            self._dispatcher.join(self._close_timeout_s)

    def __enter__(self) -> AmqpBroker:
        return self

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url!r} {self._session.state.value}>"

    # -- callers' threads ------------------------------------------------------------------

    def _check_usable(self, endpoint: AmqpEndpoint | None = None) -> None:
        """Under the lock."""
        if self._closed:
            raise BrokerClosed("the broker is closed")
        if endpoint is not None and endpoint._closed:
            raise BrokerClosed(f"the endpoint {endpoint.address!r} is closed")
        if self._session.state is State.CLOSED:
            raise BrokerError(f"the broker's connection failed for good: {self._session.failure}")

    def _accept(self, endpoint: AmqpEndpoint, exchange: str, key: str, body: bytes) -> None:
        # Every send and publish passes here: one lock for the session and the wake-up.
        with self._lock:
            self._check_usable(endpoint)
            first = self._session.accept(Message(endpoint._token, exchange, key, body))
            wake = first and self._claim_wake()
        if self._in_handler and self._on_io_thread():
            # An inline handler's: carried out when it returns (see _hand_to), with no
            # wake-up through the client library.
            self._sent_from_handler = True
        elif wake:
            batch: _Batch | None = getattr(self._batches, "batch", None)
            if batch is not None and batch.depth:
                batch.wake_due = True  # claimed: no other thread's send wakes it meanwhile
            else:
                self._send_wake()

    def _batch(self) -> _Batch:
        """This thread's batch on this broker."""
        batch: _Batch | None = getattr(self._batches, "batch", None)
        if batch is None:
            batch = self._batches.batch = _Batch(self._send_wake)
        return batch

    def _wait(
        self,
        endpoint: AmqpEndpoint,
        what: str,
        call: Callable[[Session[Future], str, str, Future], None],
        token: str,
        pattern: str,
    ) -> None:
        if self._on_io_thread():
            raise RuntimeError(f"{what}: a blocking call on the broker's IO thread would hang")
        future: Future = concurrent.futures.Future()
        with self._lock:
            self._check_usable(endpoint)
            call(self._session, token, pattern, future)
        self._wake()
        self._result(future, what)

    def _order(
        self,
        endpoint: AmqpEndpoint,
        call: Callable[[Session[Future], str, str], None],
        pattern: str,
    ) -> None:
        """A control call nobody waits for (an ordered bind or unbind): safe on any thread,
        the IO thread's included."""
        with self._lock:
            self._check_usable(endpoint)
            call(self._session, endpoint._token, pattern)
        self._wake()

    def _result(self, future: Future, what: str) -> None:
        try:
            future.result(self._timeout_s)
        except TimeoutError:
            raise BrokerError(f"{what}: no answer from RabbitMQ in {self._timeout_s}s") from None

    def _close_endpoint(self, endpoint: AmqpEndpoint, *, wait: bool = True) -> None:
        future: Future = concurrent.futures.Future()
        with self._lock:
            if endpoint._closed and not self._endpoints.get(endpoint._token):
                return
            endpoint._closed = True
            self._endpoints.pop(endpoint._token, None)
            if self._closed:
                return
            self._session.close_endpoint(endpoint._token, future)
        self._wake()
        if not wait or threading.current_thread() is self._io_thread:
            return
        # Waited for, so that a send after close() returns comes back to its sender.
        try:
            future.result(self._timeout_s)
        except TimeoutError:
            log.warning("%s: deleting queue %r timed out", self.connection_name, endpoint.address)
        except BrokerError:
            pass  # the broker closed meanwhile, and its queues with it

    def _wait_state(self, ready: Callable[[], bool], timeout_s: float) -> bool:
        with self._changed:
            return bool(self._changed.wait_for(lambda: self._closed or ready(), timeout_s)) and (
                not self._closed and ready()
            )

    # -- the dispatcher thread -------------------------------------------------------------

    def _dispatch_main(self) -> None:
        run_handlers(self._deliveries, log, dropped=self._count_dropped, failed=self._count_failed)

    def _count_dropped(self) -> None:
        with self._lock:
            self._session.stats.dropped += 1

    def _count_failed(self) -> None:
        with self._lock:
            self._session.stats.handler_errors += 1

    # -- the IO thread ---------------------------------------------------------------------

    def _io_run(self) -> None:
        self._io_ident = threading.get_ident()
        try:
            self._event(Session.start, self._now())
            self._io_main()
        except BaseException as error:  # a bug: say so, and let callers fail fast
            log.exception("%s: the IO thread failed", self.connection_name)
            with self._lock:
                self._session.abort(BrokerError(f"the IO thread failed: {error!r}"))
                actions = self._session.take_actions()
            for action in actions:
                if isinstance(action, Resolve | Deliver):
                    self._carry_out(action)
        finally:
            # A thread started later may get the same id: it is not the IO thread.
            self._io_ident = None
            with self._lock:
                self._changed.notify_all()

    @staticmethod
    def _now() -> float:
        return time.monotonic()

    def _event(self, event: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Tell the session what happened (``event`` is a :class:`Session` method), then
        carry out what it decides. On the IO thread only."""
        with self._lock:
            state = self._session.state
            event(self._session, *args, **kwargs)
            if self._session.state is not state:
                self._changed.notify_all()
            if self._pumping:
                # Reported while an action runs (kombu's calls answer at once, py-amqp
                # reports while it reads): the pump in progress takes what it decided.
                self._reported = True
                return
            # Most events (a confirm above all, one per message) decide nothing: find that
            # out under this lock rather than take it again in _pump.
            actions = None if self._soon else self._take_actions()
            if actions is not None and not actions:
                return
        self._pump(actions)

    def _pump(self, actions: list[Action[Future]] | None = None) -> None:
        """Carry out the session's actions (``actions``, taken already, first) until it has
        none. Reentrant: an event reported while an action runs is picked up by the outer
        loop. Messages accepted meanwhile need no second look: the take reset the wake-up
        claim, so the first of them wakes the IO thread again."""
        if self._pumping:
            return
        self._pumping = True
        try:
            while True:
                if actions is None:
                    with self._lock:
                        soon, self._soon = self._soon, []
                        if not soon:  # one lock for the common case: nothing from tests
                            actions = self._take_actions()
                    if soon:
                        for call in soon:
                            call()
                        with self._lock:
                            actions = self._take_actions()
                if not actions:
                    return
                self._reported = False
                for action in actions:
                    self._carry_out(action)
                if not self._reported:
                    return
                actions = None
        finally:
            self._pumping = False

    def _take_actions(self) -> list[Action[Future]]:
        """Under the lock: the session's actions, waking waiters when they may care."""
        self._wake_pending = False
        state = self._session.state
        actions = self._session.take_actions()
        if self._session.state is not state or (
            actions and any(type(a) is Resolve for a in actions)
        ):
            self._changed.notify_all()
        return actions

    def _carry_out(self, action: Action[Future]) -> None:
        if type(action) is Publish:  # nearly every action: first, and one test
            if action.channel == self._session.publish_channel:
                self._do(action)
            # else its channel was replaced meanwhile: the session republishes it
            return
        if isinstance(action, Resolve):
            if not action.waiter.done():
                if action.error is None:
                    action.waiter.set_result(None)
                else:
                    action.waiter.set_exception(action.error)
        elif isinstance(action, Deliver):
            with self._lock:
                endpoint = self._endpoints.get(action.token)
            if endpoint is not None:
                self._hand_to(endpoint, action.delivery)
        elif isinstance(action, Publish) and action.channel != self._session.publish_channel:
            pass  # its channel was replaced meanwhile: the session republishes it
        else:
            self._do(action)

    def call_on_io_thread(self, call: Callable[[], None]) -> None:
        """Run ``call`` on the IO thread soon, between two of the client library's events.
        For tests that play the client library's part: ``broker.call_on_io_thread(lambda:
        broker.report(Session.blocked, "alarm"))`` is what a ``connection.blocked`` does."""
        with self._lock:
            self._soon.append(call)
            self._wake_pending = False  # a wake-up already sent may have been consumed
        self._wake()

    def report(self, event: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Report a client library event to the session (a :class:`Session` method), as the
        driver's callbacks do. On the IO thread only (see :meth:`call_on_io_thread`)."""
        self._event(event, *args, **kwargs)

    def _request_wake(self) -> bool:
        """Whether a wake-up must be sent (one is enough until the pump runs)."""
        with self._lock:
            return self._claim_wake()

    def _claim_wake(self) -> bool:
        """Under the lock: whether this caller is the one to send the wake-up."""
        if self._wake_pending:
            return False
        self._wake_pending = True
        return True

    def _message(
        self, token: str, exchange: str, routing_key: str, body: bytes, user_id: str | None
    ) -> None:
        """A message for the endpoint ``token`` arrived."""
        with self._lock:
            endpoint = self._endpoints.get(token)
            delivery = self._session.message(exchange, routing_key, body, user_id)
            if endpoint is None:
                self._session.stats.dropped += 1
                return
        self._hand_to(endpoint, delivery)

    def _returned(
        self, token: str, exchange: str, routing_key: str, body: bytes, user_id: str | None
    ) -> None:
        """Our message from endpoint ``token`` came back unroutable."""
        with self._lock:
            endpoint = self._endpoints.get(token)
            delivery = self._session.returned(exchange, routing_key, body, user_id)
        if endpoint is not None:
            self._hand_to(endpoint, delivery)

    def _hand_to(self, endpoint: AmqpEndpoint, delivery: Delivery) -> None:
        """On the IO thread: run an inline endpoint's handler now, queue any other's for
        the dispatcher. Either way one endpoint's deliveries keep their order."""
        if not endpoint.inline:
            self._deliveries.put((endpoint, delivery))
            return
        self._in_handler = True
        try:
            run_handler(
                endpoint, delivery, log, dropped=self._count_dropped, failed=self._count_failed
            )
        finally:
            self._in_handler = False
        if self._sent_from_handler:
            self._sent_from_handler = False
            if self._pumping:
                self._reported = True  # the pump in progress takes another look
            else:
                self._pump()

    def _on_io_thread(self) -> bool:
        return threading.get_ident() == self._io_ident

    @abstractmethod
    def _io_main(self) -> None:
        """Run the client library's loop until a Stop action was carried out."""

    def _wake(self) -> None:
        """Make the IO thread call :meth:`_pump` soon. From any thread."""
        batch: _Batch | None = getattr(self._batches, "batch", None)
        if batch is not None and batch.wake_due:
            # This thread put a wake-up off in a batch and now needs the IO thread (to
            # bind, or to close): it must not wait on its own put-off wake-up.
            batch.wake_due = False
            self._send_wake()
        elif self._request_wake():
            self._send_wake()

    @abstractmethod
    def _send_wake(self) -> None:
        """Wake the IO thread to call :meth:`_pump` (one wake-up per pump is enough: the
        callers see to that). From any thread."""

    @abstractmethod
    def _do(self, action: Action[Future]) -> None:
        """Carry out one I/O action; report what happens through :meth:`_event`."""
