"""The rules the broker adapters share, each in one place.

Every adapter (:mod:`reservoir.brokers.inprocess`, :mod:`reservoir.brokers.pika_broker`,
:mod:`reservoir.brokers.kombu_broker`) refuses the same input alike: a body must be bytes, a key
must fit in an AMQP short string (RabbitMQ could not carry a longer one, so the in-process broker
refuses it too), and an endpoint name may not be empty or start with ``amq.``.

The two RabbitMQ drivers share reservoir's topology and RabbitMQ's ways, so that they
interoperate on one exchange: the exchange names (``<exchange>``, ``reservoir`` unless the
URL says ``?exchange=``, and ``<exchange>.inbox`` for sends), which exchange a delivery or
return came through (the inbox exchange or the default one means a send), how RabbitMQ names
what it refused a publish for, the bound on unconfirmed messages, how a password is masked,
and the dispatcher thread's loop, which runs handlers one at a time in arrival order.

What the drivers do on a connection is decided in one place, :mod:`reservoir.brokers.amqp.session`;
URLs are parsed in one place, :mod:`reservoir.brokers.url`.
"""

from __future__ import annotations

import logging
import queue
import re
import socket
import ssl
from collections.abc import Callable
from typing import Final, Protocol, TypeVar
from urllib.parse import urlsplit, urlunsplit

from reservoir.broker import BrokerError, Delivery, Handler

__all__ = [
    "DEFAULT_EXCHANGE",
    "INBOX_SUFFIX",
    "MAX_SHORTSTR_BYTES",
    "Receiver",
    "aimed_at",
    "call_handler",
    "check_body",
    "check_endpoint_name",
    "check_exchange",
    "check_handler",
    "check_key",
    "check_limits",
    "check_no_wildcards",
    "check_pending",
    "failure_words",
    "inbox_exchange",
    "mask_password",
    "missing_exchange",
    "refused_target",
    "run_handler",
    "run_handlers",
    "topic_of",
]

#: the exchange requests are published on, unless the URL says ``?exchange=``
DEFAULT_EXCHANGE: Final = "reservoir"
#: sends go to the topic exchange named ``<exchange>`` + this, routed by address
INBOX_SUFFIX: Final = ".inbox"
#: AMQP 0-9-1 carries routing keys, binding keys and queue names as short strings
MAX_SHORTSTR_BYTES: Final = 255

# -- what callers pass ----------------------------------------------------------------------


def check_body(body: object) -> bytes:
    """A message body: bytes, and plain bytes."""
    if type(body) is bytes:
        return body
    if isinstance(body, bytes):
        # A bytes subclass can carry mutable attributes; receivers get plain bytes.
        return bytes(body)
    raise TypeError(f"a message body must be bytes, not {type(body).__name__}")


def check_key(value: object, what: str) -> str:
    """A topic, binding pattern, address or name: a str that fits in an AMQP short string."""
    if not isinstance(value, str):
        raise TypeError(f"{what} must be str, not {type(value).__name__}")
    # Parity with RabbitMQ, which cannot carry a longer one: fail here, not in production.
    if len(value) > MAX_SHORTSTR_BYTES // 4 and len(value.encode()) > MAX_SHORTSTR_BYTES:
        raise ValueError(f"{what} is longer than {MAX_SHORTSTR_BYTES} bytes: {value[:40]!r}...")
    return value


def check_handler(handler: object) -> None:
    """An endpoint's handler: anything callable."""
    if not callable(handler):
        raise TypeError("handler must be callable")


def check_endpoint_name(name: object) -> str:
    """An endpoint name a caller chose, as every adapter accepts it."""
    name = check_key(name, "endpoint name")
    if not name:
        raise ValueError("an endpoint name must not be empty; pass None to generate one")
    if name.startswith("amq."):
        # RabbitMQ reserves the prefix; refusing it everywhere keeps the transports alike.
        raise ValueError(f"endpoint names starting with 'amq.' are reserved: {name!r}")
    return name


def check_no_wildcards(name: str) -> str:
    """On RabbitMQ an endpoint's name is its binding key on the inbox exchange: a wildcard
    there would receive what is sent to other addresses."""
    if "*" in name or "#" in name:
        raise ValueError(f"an endpoint name must not contain '*' or '#': {name!r}")
    return name


def check_limits(
    *, timeout_s: float, close_timeout_s: float, max_pending: int, connect_attempts: int
) -> None:
    """The options both RabbitMQ adapters take, named and bounded alike."""
    if timeout_s <= 0 or close_timeout_s < 0 or max_pending < 1 or connect_attempts < 1:
        raise ValueError("timeouts, max_pending and connect_attempts must be positive")


def check_pending(pending: int, max_pending: int, *, connected: bool) -> None:
    """Accepted but unconfirmed messages are bounded: past ``max_pending``, a publish or
    send fails at once rather than grow without bound or block."""
    if pending >= max_pending:
        raise BrokerError(
            f"{pending} messages are waiting for RabbitMQ to confirm them "
            f"(connected: {connected}); refusing more"
        )


# -- reservoir's topology on RabbitMQ --------------------------------------------------------


def check_exchange(name: str) -> str:
    """An exchange name reservoir can use: not the default exchange, not ``amq.``, and
    short enough for its inbox exchange's name."""
    if not name:
        raise ValueError("exchange= must name a topic exchange; the default exchange is not one")
    if name.startswith("amq."):
        raise ValueError(
            f"exchange names starting with 'amq.' are reserved by RabbitMQ: {name!r} (its "
            f"inbox exchange {inbox_exchange(name)!r} could never be created)"
        )
    check_key(inbox_exchange(name), "exchange name (with its inbox suffix)")
    return name


def inbox_exchange(exchange: str) -> str:
    """The topic exchange sends go to, routed by the destination address."""
    return exchange + INBOX_SUFFIX


def topic_of(exchange: str | None, routing_key: str | None, inbox: str) -> str | None:
    """The topic of a delivery or return: None for a send (through the inbox exchange
    ``inbox``, or the default exchange a plain client may use), else the routing key."""
    if not exchange or exchange == inbox:
        return None
    return routing_key


def missing_exchange(name: str, user: str | None) -> str:
    """Why connecting fails when an exchange is missing and the user may not declare it."""
    return (
        f"exchange {name!r} does not exist and user {user!r} may not declare it (no "
        "configure permission): an operator must create it, e.g. from "
        "deploy/rabbitmq/definitions.json"
    )


# -- URLs -------------------------------------------------------------------------------------


def mask_password(url: str, mask: str = "***") -> str:
    """``url`` with its password, if any, replaced by ``mask``."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo.partition(':')[0]}:{mask}@{hostport}"))


# -- what RabbitMQ refused --------------------------------------------------------------------

#: how RabbitMQ names what it refused a publish for: the exchange, or a topic in it
_REFUSED = re.compile(
    r"access to (?:topic '(?P<key>.*)' in )?exchange '(?P<exchange>.*?)' in vhost"
)


def refused_target(reply_text: str) -> tuple[str, str | None] | None:
    """(exchange, routing key or None for the whole exchange) from a 403's reply text."""
    match = _REFUSED.search(reply_text or "")
    if match is None:
        return None
    return match["exchange"], match["key"]


def aimed_at(exchange: str, routing_key: str, target: tuple[str, str | None] | None) -> bool:
    """Whether a message published on ``exchange`` with ``routing_key`` is what a 403 with
    ``target`` (from :func:`refused_target`) refused."""
    if target is None:
        return False
    refused_exchange, refused_key = target
    # RabbitMQ names the default exchange amq.default in permission errors.
    if (exchange or "amq.default") != refused_exchange:
        return False
    return refused_key is None or refused_key == routing_key


# -- running handlers -------------------------------------------------------------------------


class Receiver(Protocol):
    """What the dispatcher needs of an endpoint."""

    address: str
    _closed: bool
    _handler: Handler


R = TypeVar("R", bound=Receiver)


def call_handler(receiver: Receiver, delivery: Delivery, log: logging.Logger) -> bool:
    """Hand one delivery to its endpoint's handler. False if the handler raised: that is
    logged (on the adapter's ``log``), and must not stop delivery to the others."""
    try:
        receiver._handler(delivery)
    except Exception:
        log.exception("handler of endpoint %r failed on a delivery", receiver.address)
        return False
    return True


def run_handlers(
    deliveries: queue.SimpleQueue[tuple[R, Delivery] | None],
    log: logging.Logger,
    *,
    dropped: Callable[[], None] | None = None,
    failed: Callable[[], None] | None = None,
) -> None:
    """The dispatcher thread: run handlers one at a time, in arrival order, until a None
    arrives. A delivery for an endpoint closed meanwhile is dropped (``dropped`` counts
    it); a handler that raises is logged (``failed`` counts it) and the rest go on."""
    while True:
        item = deliveries.get()
        if item is None:
            return
        run_handler(*item, log, dropped=dropped, failed=failed)


def run_handler(
    endpoint: Receiver,
    delivery: Delivery,
    log: logging.Logger,
    *,
    dropped: Callable[[], None] | None = None,
    failed: Callable[[], None] | None = None,
) -> None:
    """One delivery, as :func:`run_handlers` runs each (and an adapter's IO thread an
    inline endpoint's): dropped and counted if its endpoint closed meanwhile, the handler's
    failure logged and counted."""
    if endpoint._closed:
        if dropped is not None:
            dropped()
        return
    if not call_handler(endpoint, delivery, log) and failed is not None:
        failed()


def failure_words(error: BaseException) -> str:
    """What went wrong with a connection, in the words operators know from celery and
    dramatiq (``connection refused``, ``unknown host``, ``timed out``), dug out of the
    client library's wrapping (pika nests the socket's error two exceptions deep); the
    whole exception is for the log at INFO (``-v``), not for this line."""
    cause = _socket_error(error, depth=0)
    if cause is None:
        return str(error) or type(error).__name__
    if isinstance(cause, socket.gaierror):
        return "unknown host"
    if isinstance(cause, TimeoutError | socket.timeout):
        return "timed out"
    if isinstance(cause, ssl.SSLError):
        return f"TLS: {cause.reason or cause}".lower()
    return (cause.strerror or type(cause).__name__).lower()


def _socket_error(error: BaseException, *, depth: int) -> OSError | None:
    """The OS-level error inside ``error`` (its arguments, its ``exceptions``, its
    ``exception``, its cause), if any."""
    if isinstance(error, OSError):
        return error
    if depth > 6:
        return None
    inner: list[object] = [*error.args, *(getattr(error, "exceptions", None) or ())]
    # pika's connector errors keep theirs in ``exception``
    inner += [getattr(error, "exception", None), error.__cause__, error.__context__]
    for candidate in inner:
        if isinstance(candidate, BaseException):
            found = _socket_error(candidate, depth=depth + 1)
            if found is not None:
                return found
    return None
