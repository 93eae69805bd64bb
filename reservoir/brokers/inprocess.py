"""The embedded default broker: a RabbitMQ-shaped topic exchange inside one process.

This module owns the in-process transport: the endpoint registry (exclusive inboxes by
address), the binding table, delivery through a :class:`~reservoir.clock.Scheduler`, and
fault injection (loss, duplication, delay) for chaos tests and the simulator. What callers
may pass (bodies, keys, endpoint names) it checks by the rules in :mod:`reservoir.brokers._rules`,
as the RabbitMQ adapters do.

Every delivery is one ``scheduler.call_at``: with a :class:`~reservoir.clock.ThreadScheduler`
(the default, owned by the broker) messages flow in real time on one delivery thread; with a
:class:`~reservoir.clock.VirtualScheduler` they flow only as the caller advances virtual
time, deterministically. Nothing polls and nothing sleeps.

All state is per instance: two brokers in one process share nothing.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

from reservoir.broker import Broker, BrokerClosed, BrokerError, Delivery, Endpoint, Handler
from reservoir.brokers._rules import (
    call_handler,
    check_body,
    check_endpoint_name,
    check_handler,
    check_key,
)
from reservoir.brokers.routing import BindingTable
from reservoir.clock import Scheduler, ThreadScheduler

__all__ = ["BrokerStats", "Faults", "InProcessBroker", "InProcessEndpoint"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Faults:
    """Network misbehaviour to inject, per delivery (one publish reaching one endpoint).

    Draws come from the broker's own ``random.Random``, seeded from ``seed``, in the order
    deliveries are dispatched, so a single-threaded run on a virtual scheduler is
    reproducible. Returned (unroutable) notifications are never subject to faults.
    """

    #: probability a delivery is dropped
    loss: float = 0.0
    #: probability a delivery arrives twice
    duplicate: float = 0.0
    #: uniform extra delay per copy, in seconds; independent delays reorder messages
    delay_s: tuple[float, float] = (0.0, 0.0)
    #: seed for the broker's random source; None leaves it as it is
    seed: int | None = None
    #: only deliveries for which this returns True are subject to faults (None: all)
    applies_to: Callable[[Delivery], bool] | None = None

    def __post_init__(self) -> None:
        for name in ("loss", "duplicate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1], got {value!r}")
        if len(self.delay_s) != 2:
            raise ValueError(f"delay_s must be (low, high), got {self.delay_s!r}")
        low, high = self.delay_s
        if not (math.isfinite(low) and math.isfinite(high) and 0.0 <= low <= high):
            raise ValueError(f"delay_s must satisfy 0 <= low <= high, got {self.delay_s!r}")


@dataclass(slots=True)
class BrokerStats:
    """What the broker did, counted. ``InProcessBroker.stats`` hands out a snapshot."""

    #: publish calls accepted
    published: int = 0
    #: send calls accepted
    sent: int = 0
    #: messages handed to a handler (returned notifications not included)
    delivered: int = 0
    #: publishes and sends that reached nobody and were handed back to their sender
    returned: int = 0
    #: deliveries dropped by injected loss
    lost: int = 0
    #: extra copies made by injected duplication
    duplicated: int = 0
    #: deliveries dropped because their endpoint closed before they arrived
    dropped: int = 0
    #: handler calls that raised
    handler_errors: int = 0


class InProcessEndpoint(Endpoint):
    """An exclusive inbox on an :class:`InProcessBroker`. Made by ``open_endpoint``."""

    def __init__(self, broker: InProcessBroker, address: str, handler: Handler) -> None:
        self.address = address
        self._broker = broker
        self._handler = handler
        # Written only under the broker's lock; read without it where a stale read is
        # harmless (a delivery racing a close from another thread may still land).
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def bind(self, pattern: str) -> None:
        self._broker._bind(self, check_key(pattern, "binding pattern"))

    def unbind(self, pattern: str) -> None:
        self._broker._unbind(self, check_key(pattern, "binding pattern"))

    def publish(self, topic: str, body: bytes) -> None:
        self._broker._publish(self, check_key(topic, "topic"), check_body(body))

    def claim(self, key: str) -> bool:
        return self._broker._claim(self, check_key(key, "claim"))

    def unclaim(self, key: str) -> None:
        self._broker._unclaim(self, check_key(key, "claim"))

    def send(self, address: str, body: bytes) -> None:
        self._broker._send(self, check_key(address, "address"), check_body(body))

    def close(self) -> None:
        self._broker._close_endpoint(self)

    def __enter__(self) -> InProcessEndpoint:
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<InProcessEndpoint {self.address!r} {state}>"


class InProcessBroker(Broker):
    """A topic exchange plus exclusive inboxes, in this process.

    ``scheduler``: runs every delivery. None creates a ``ThreadScheduler`` the broker owns
    and closes; a given one (e.g. a ``VirtualScheduler``) is used and left open.
    ``faults``: network misbehaviour to inject; change it at any time through
    :attr:`faults` (set it to None to heal the network).
    """

    def __init__(
        self,
        scheduler: Scheduler | None = None,
        *,
        faults: Faults | None = None,
        url: str = "memory://",
    ) -> None:
        self.url = url
        self._owns_scheduler = scheduler is None
        self._scheduler: Scheduler = (
            scheduler
            if scheduler is not None
            else ThreadScheduler(name="reservoir-inprocess-broker")
        )
        # One lock guards the registry, the binding table, the counters and the random
        # source. Handlers and ``applies_to`` run outside it, so they may use the broker.
        self._lock = threading.Lock()
        self._endpoints: dict[str, InProcessEndpoint] = {}
        self._table = BindingTable()
        #: claimed key -> the address of the endpoint holding it
        self._claims: dict[str, str] = {}
        self._inbox_numbers = itertools.count(1)
        self._stats = BrokerStats()
        self._faults = faults
        self._rng = random.Random(faults.seed if faults is not None else None)
        self._closed = False

    # -- public -----------------------------------------------------------------------

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler every delivery runs on."""
        return self._scheduler

    @property
    def faults(self) -> Faults | None:
        """The injected faults, if any. Assigning replaces them at once (None heals the
        network); a :class:`Faults` with a seed also reseeds the broker's random source."""
        return self._faults

    @faults.setter
    def faults(self, faults: Faults | None) -> None:
        with self._lock:
            self._faults = faults
            if faults is not None and faults.seed is not None:
                self._rng.seed(faults.seed)

    @property
    def stats(self) -> BrokerStats:
        """A consistent snapshot of the counters."""
        with self._lock:
            return replace(self._stats)

    @property
    def closed(self) -> bool:
        return self._closed

    def addresses(self) -> frozenset[str]:
        """The addresses of the endpoints open now."""
        with self._lock:
            return frozenset(self._endpoints)

    def open_endpoint(
        self, handler: Handler, *, name: str | None = None, inline: bool = False
    ) -> InProcessEndpoint:
        # inline is moot: deliveries already run on the one thread that carries them, and
        # nothing here waits for an answer.
        check_handler(handler)
        if name is not None:
            check_endpoint_name(name)
        with self._lock:
            if self._closed:
                raise BrokerClosed("the broker is closed")
            if name is None:
                address = self._generate_address()
            elif name in self._endpoints:
                raise BrokerError(f"an endpoint named {name!r} is already open on this broker")
            else:
                address = name
            endpoint = InProcessEndpoint(self, address, handler)
            self._endpoints[address] = endpoint
        return endpoint

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for endpoint in self._endpoints.values():
                endpoint._closed = True
            self._endpoints.clear()
            self._table = BindingTable()
            self._claims.clear()
        if self._owns_scheduler:
            self._scheduler.close()

    def __enter__(self) -> InProcessBroker:
        return self

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._endpoints)} endpoints"
        return f"<InProcessBroker {self.url!r} {state}>"

    # -- what endpoints call ------------------------------------------------------------

    def _generate_address(self) -> str:
        while True:
            # A user may already have taken "inbox.<n>" by name: skip it.
            address = f"inbox.{next(self._inbox_numbers)}"
            if address not in self._endpoints:
                return address

    def _bind(self, endpoint: InProcessEndpoint, pattern: str) -> None:
        with self._lock:
            self._check_open(endpoint)
            self._table.bind(endpoint.address, pattern)

    def _unbind(self, endpoint: InProcessEndpoint, pattern: str) -> None:
        with self._lock:
            self._check_open(endpoint)
            self._table.unbind(endpoint.address, pattern)

    def _claim(self, endpoint: InProcessEndpoint, key: str) -> bool:
        with self._lock:
            self._check_open(endpoint)
            return self._claims.setdefault(key, endpoint.address) == endpoint.address

    def _unclaim(self, endpoint: InProcessEndpoint, key: str) -> None:
        with self._lock:
            self._check_open(endpoint)
            if self._claims.get(key) == endpoint.address:
                del self._claims[key]

    def _close_endpoint(self, endpoint: InProcessEndpoint) -> None:
        with self._lock:
            if endpoint._closed:
                return
            endpoint._closed = True
            if self._endpoints.get(endpoint.address) is endpoint:
                del self._endpoints[endpoint.address]
            self._table.unbind_all(endpoint.address)
            for key in [k for k, holder in self._claims.items() if holder == endpoint.address]:
                del self._claims[key]

    def _publish(self, sender: InProcessEndpoint, topic: str, body: bytes) -> None:
        with self._lock:
            self._check_open(sender)
            self._stats.published += 1
            # Sorted so that seeded fault draws do not depend on string hash randomisation.
            receivers = [self._endpoints[address] for address in sorted(self._table.route(topic))]
            if not receivers:
                self._stats.returned += 1
            faults = self._faults
        now = self._scheduler.clock.now()
        if not receivers:
            log.debug("publish on %r reached nobody; returning it to %s", topic, sender.address)
            self._schedule(now, sender, Delivery(body, topic=topic, returned=True))
            return
        for receiver in receivers:
            if faults is None:  # the common case, without two calls per delivery
                self._scheduler.call_at(
                    now, partial(self._deliver, receiver, Delivery(body, topic=topic))
                )
            else:
                self._dispatch(now, receiver, Delivery(body, topic=topic), faults)

    def _send(self, sender: InProcessEndpoint, address: str, body: bytes) -> None:
        with self._lock:
            self._check_open(sender)
            self._stats.sent += 1
            receiver = self._endpoints.get(address)
            if receiver is None:
                self._stats.returned += 1
            faults = self._faults
        now = self._scheduler.clock.now()
        if receiver is None:
            log.debug("send to %r reached nobody; returning it to %s", address, sender.address)
            self._schedule(now, sender, Delivery(body, returned=True))
            return
        if faults is None:  # the common case, without two calls per delivery
            self._scheduler.call_at(now, partial(self._deliver, receiver, Delivery(body)))
        else:
            self._dispatch(now, receiver, Delivery(body), faults)

    # -- delivery -------------------------------------------------------------------------

    def _check_open(self, endpoint: InProcessEndpoint) -> None:
        if endpoint._closed:
            what = "broker" if self._closed else f"endpoint {endpoint.address!r}"
            raise BrokerClosed(f"the {what} is closed")

    def _dispatch(
        self,
        now: float,
        receiver: InProcessEndpoint,
        delivery: Delivery,
        faults: Faults | None,
    ) -> None:
        if faults is None or (faults.applies_to is not None and not faults.applies_to(delivery)):
            self._schedule(now, receiver, delivery)
            return
        with self._lock:
            delays = self._draw(faults)
        for delay_s in delays:
            self._schedule(now + delay_s, receiver, delivery)

    def _draw(self, faults: Faults) -> list[float]:
        """The extra delay of each copy of one delivery: none if lost, two if duplicated.

        Called under the lock. Only the faults switched on draw from the random source, so
        a run with, say, loss alone replays exactly from its seed."""
        if faults.loss and self._rng.random() < faults.loss:
            self._stats.lost += 1
            return []
        copies = 1
        if faults.duplicate and self._rng.random() < faults.duplicate:
            self._stats.duplicated += 1
            copies = 2
        low, high = faults.delay_s
        if low == high:
            return [low] * copies
        return [self._rng.uniform(low, high) for _ in range(copies)]

    def _schedule(self, when: float, receiver: InProcessEndpoint, delivery: Delivery) -> None:
        self._scheduler.call_at(when, partial(self._deliver, receiver, delivery))

    def _deliver(self, receiver: InProcessEndpoint, delivery: Delivery) -> None:
        with self._lock:
            if receiver._closed:
                self._stats.dropped += 1
                return
            if not delivery.returned:
                # Counted before the handler runs so that a test woken by the handler
                # already sees it.
                self._stats.delivered += 1
        # One endpoint's bug must not stop delivery to the others, nor the scheduler.
        if not call_handler(receiver, delivery, log):
            with self._lock:
                self._stats.handler_errors += 1
