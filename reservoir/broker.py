"""The one small Broker interface every transport adapter implements.

A broker hands out *endpoints*. An endpoint is an exclusive inbox with an address: it
receives what is sent to its address and what is published on topics it has bound, and it
publishes and sends. Topics route like a RabbitMQ topic exchange: words separated by dots,
``*`` matches exactly one word, ``#`` matches zero or more.

Bodies are bytes: the runtime serialises every message before it reaches a broker, so every
adapter, the in-process one included, carries exactly what goes over the wire.

A handler runs on a thread the broker owns. A RabbitMQ adapter has two: its IO thread, which
talks to the socket, and a dispatcher thread that runs handlers. An endpoint opened with
``inline=True`` has its handler run on the IO thread itself, saving a hand-over between
threads on every message it receives and on every message it sends from the handler (the
IO thread carries those out as soon as the handler returns). Such a handler must not block
on the broker: ``bind`` and ``unbind`` wait for the broker's answer, which the IO thread
itself would have to read, so there they raise (``RuntimeError``: a bug in the caller, not
a transport failure), and ``close`` returns before the broker has deleted the inbox (what is
sent to it meanwhile is dropped rather than returned). :meth:`Endpoint.blocking_allowed` says
whether the calling thread may wait. A broker without an IO thread ignores ``inline``.
Several messages sent at once from another thread (a requestor's probes) are best made in
an :meth:`Endpoint.batch` block: they then cost the IO thread one wake-up, not one each.

A publish or send that reaches no queue is handed back to the sender's handler as a
:class:`Delivery` with ``returned=True``: that is how a requestor learns at once that no
node is bound to a tier (RabbitMQ's ``mandatory`` flag and ``basic.return``).

Adapters live in the ``reservoir.brokers`` package, one module each;
``reservoir.brokers.connect(url)`` picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import ClassVar

import msgspec

__all__ = [
    "Broker",
    "BrokerClosed",
    "BrokerError",
    "Delivery",
    "Endpoint",
    "Handler",
    "UnsupportedBroker",
]


class BrokerError(Exception):
    """A transport failed in a way its adapter could not recover from."""


class BrokerClosed(BrokerError):
    """The broker or endpoint was used after it was closed."""


class UnsupportedBroker(BrokerError):
    """The URL names a transport that cannot honour the broker contract."""


class Delivery(msgspec.Struct, frozen=True):
    """One message handed to an endpoint's handler."""

    body: bytes
    #: the routing key it was published with; None for a direct send to this address
    topic: str | None = None
    #: True when this is our own publish or send coming back because nothing received it
    returned: bool = False
    #: the broker-authenticated user that sent it, where the transport validates one
    user_id: str | None = None


Handler = Callable[[Delivery], None]


class Endpoint(ABC):
    """An exclusive inbox on a broker, and the way to publish and send from it.

    The handler is called from a thread the broker owns, never concurrently for one
    endpoint, and in the order each sender sent. Every method is safe from any thread.
    """

    #: where others ``send`` to reach this endpoint
    address: str

    @abstractmethod
    def bind(self, pattern: str) -> None:
        """Receive publishes whose topic matches ``pattern``. Takes effect before returning."""

    @abstractmethod
    def unbind(self, pattern: str) -> None:
        """Stop receiving publishes for ``pattern``. Unbinding an unbound pattern is a no-op."""

    @abstractmethod
    def publish(self, topic: str, body: bytes) -> None:
        """Publish on the topic exchange. Never blocks on the receivers."""

    @abstractmethod
    def send(self, address: str, body: bytes) -> None:
        """Send to one endpoint's address. Never blocks on the receiver."""

    @abstractmethod
    def close(self) -> None:
        """Delete the inbox and its bindings. Idempotent."""

    #: whether :meth:`bind_ordered` and :meth:`unbind_ordered` are the broker's own (they
    #: wait for nothing, and may be called on its IO thread); else they are ``bind`` and
    #: ``unbind``, which wait
    binds_in_order: ClassVar[bool] = False

    def bind_ordered(self, pattern: str) -> None:
        """Bind ``pattern`` without waiting for the broker: whatever this broker's
        endpoints send or publish after this call leaves only once the binding is in
        place (a refusal is logged, and the messages go anyway). The default is
        :meth:`bind`, which waits."""
        self.bind(pattern)

    def unbind_ordered(self, pattern: str) -> None:
        """Unbind ``pattern`` without waiting for the broker. The default is
        :meth:`unbind`, which waits."""
        self.unbind(pattern)

    def claim(self, key: str) -> bool | None:
        """Hold ``key`` for this endpoint alone, for as long as its broker connection lasts
        or until :meth:`unclaim`: True once it is held (or was already held here), False
        while another endpoint holds it, on any connection to the same broker. None: this
        broker cannot say (callers then do without). Waits for the broker, as ``bind``
        does. A claim is not restored after a reconnect: one made before
        :attr:`Broker.connections` last grew may be gone. Keys are scoped to the broker's
        exchange, so deployments sharing a RabbitMQ never claim each other's."""
        return None

    def unclaim(self, key: str) -> None:  # noqa: B027 (a broker that cannot claim holds none)
        """Let go of ``key``, so that another endpoint may claim it. Waits for the broker;
        letting go of a key not held here is a no-op."""

    def batch(self) -> AbstractContextManager[None]:
        """A block whose sends and publishes, made on this thread, leave together: a
        broker with an IO thread is woken once, as the block ends, and writes them in one
        go, rather than woken by the first while the others are still being made. They
        keep their order and are sent even if the block raises. Blocks nest. The default
        sends each at once, as outside a block."""
        return nullcontext()

    def blocking_allowed(self) -> bool:
        """Whether the calling thread may make the calls that wait for the broker (``bind``,
        ``unbind``, ``claim``, ``unclaim``): False on a broker's IO thread, where an
        ``inline`` handler runs."""
        return True

    def __enter__(self) -> Endpoint:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Broker(ABC):
    """A connection to a message broker that hands out endpoints."""

    #: the URL this broker was opened with (credentials masked)
    url: str

    @abstractmethod
    def open_endpoint(
        self, handler: Handler, *, name: str | None = None, inline: bool = False
    ) -> Endpoint:
        """Create an exclusive inbox. ``name`` becomes part of its address when given.
        ``inline``: run ``handler`` on the broker's IO thread, where it has one (see the
        module's docstring: it must not call ``bind`` or ``unbind`` there)."""

    @abstractmethod
    def close(self) -> None:
        """Close every endpoint and the connection. Idempotent."""

    @property
    def connected(self) -> bool:
        """Whether messages can flow now: a broker with a connection to lose says so
        while it is down (and reconnecting); one in this process is always connected."""
        return True

    #: whether :attr:`connections` can grow: a broker with a connection to lose
    reconnects: ClassVar[bool] = False

    @property
    def connections(self) -> int:
        """Connections completed so far: 1, and one more each time the connection came
        back with its inbox and bindings restored. Between two of them, whoever was
        listening heard nothing (a node agent announces itself again)."""
        return 1

    def __enter__(self) -> Broker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
