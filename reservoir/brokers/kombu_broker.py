"""The RabbitMQ driver on kombu's py-amqp transport (``kombu+amqp://``, ``kombu+amqps://``,
``kombu+pyamqp://``).

This module owns only what is kombu's: which kombu transports may serve reservoir (every
other one is refused, see :data:`REFUSED_TRANSPORTS`), one kombu connection and its three
channels on an IO thread the broker owns, a selector loop over the AMQP socket and a wake-up
socket (nothing polls: the only timed wake-ups are the session's timer and the heartbeat
tick), and turning py-amqp's events into the session's and the session's actions into kombu
calls. What reservoir does on RabbitMQ is decided by the sans-I/O session in
:mod:`reservoir.brokers.amqp.session`, the same one the pika driver runs, so both behave, count and
report readiness alike; callers' threads talk to :mod:`reservoir.brokers.amqp.threaded`.

kombu's calls are synchronous: each control method is answered (or refused) before the call
returns, so the driver reports the answer at once. py-amqp raises a channel the server
closed from whichever read received the close, without naming the channel, but with the
method the server refused: ``basic.publish`` (60, 40) can only be the publish channel,
``basic.consume`` (60, 20) the consume channel, ``exchange.*`` and ``queue.*`` the control
channel. A refused publish that surfaces while a control method waits for its answer
leaves that method's answer in doubt, so it costs a reconnect too (the refused message is
still handed back, never replayed).

What kombu's public API cannot do, and what this module uses instead:

- *Asynchronous publisher confirms*: kombu only offers ``confirm_publish``, which waits for
  every ack (one round trip per message). The driver registers on py-amqp's
  ``channel.events["basic_ack"]`` and ``["basic_nack"]`` (public attributes of py-amqp's
  ``Channel``, which kombu itself uses) after ``confirm_select()``.
- *No poll before every publish*: when the server supports ``connection.blocked``, py-amqp
  reads the socket (``drain_events(timeout=0)``) before every ``basic_publish`` to notice a
  ``connection.blocked`` early. This IO thread reads the socket whenever it is readable
  anyway, so the poll only costs syscalls (it halved a connection's rate: docs/performance.md,
  "Adapter speed"). After the handshake, the driver sets ``connection.blocked`` to False in the
  ``capabilities`` of py-amqp's ``Connection.client_properties`` (a public attribute, but
  editing it after the handshake relies on py-amqp reading it at every publish): the server
  has already seen the capability, so Blocked/Unblocked still arrive.

- *Publishing without kombu's* ``Producer``: the driver builds the ``amqp.Message`` and calls
  the publish channel's ``basic_publish`` (public methods of py-amqp, which kombu's
  ``Producer.publish`` ends in after re-deriving the same properties on every call), a
  layer that cost a tenth of the IO thread per message (docs/performance.md, "Adapter
  speed"); returned
  messages come from the channel's ``events["basic_return"]``, where the ``Producer``
  would have registered the same callback.

kombu turns an exclusive ``Queue`` into an auto-delete one; the driver sets ``auto_delete``
back to False on the entity, so that the queue survives its consumer being cancelled, as the
pika driver's does.
"""

from __future__ import annotations

import contextlib
import logging
import select
import selectors
import socket
import ssl
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import amqp.exceptions
import kombu.connection
import kombu.entity

from reservoir.broker import UnsupportedBroker
from reservoir.brokers._rules import DEFAULT_EXCHANGE, INBOX_SUFFIX, failure_words
from reservoir.brokers.amqp import session as core
from reservoir.brokers.amqp.session import Action, Role, Session
from reservoir.brokers.amqp.threaded import AmqpBroker, AmqpEndpoint, Future
from reservoir.brokers.url import BrokerUrl

__all__ = [
    "ACCEPTED_TRANSPORTS",
    "DEFAULT_EXCHANGE",
    "INBOX_SUFFIX",
    "REFUSED_TRANSPORTS",
    "KombuBroker",
    "KombuEndpoint",
]

log = logging.getLogger(__name__)

# kombu ships py.typed but leaves these unannotated: held as Any, so that mypy --strict
# checks this module rather than kombu.
Connection: Any = kombu.connection.Connection
Exchange: Any = kombu.entity.Exchange
Queue: Any = kombu.entity.Queue

KombuEndpoint = AmqpEndpoint

#: kombu URL schemes this driver accepts, and the kombu transport each one is given.
#: ``amqp`` is pinned to py-amqp: kombu would pick librabbitmq when it is installed.
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

#: the method a server's channel close names -> the channel that sent it
_ROLE_OF_CLASS: dict[int, Role] = {40: "control", 50: "control"}
_ROLE_OF_METHOD: dict[tuple[int, int], Role] = {(60, 40): "publish", (60, 20): "consume"}
#: failures of a first connection that retrying may fix; anything else is fatal there
_TRANSIENT = (
    OSError,
    amqp.exceptions.RecoverableConnectionError,
    amqp.exceptions.RecoverableChannelError,
)
#: what means this connection is unusable
_LINK_ERRORS = (OSError, amqp.exceptions.ConnectionError, amqp.exceptions.ChannelError)
#: frames read before queued work is served again, so a flood cannot starve it
_READ_BATCH = 256


def kombu_transport_url(url: BrokerUrl) -> str:
    """The URL kombu gets; :class:`UnsupportedBroker` for a transport that cannot honour
    the contract."""
    scheme = url.scheme.removeprefix("kombu+")
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
    parts = urlsplit(url.transport_url)
    return urlunsplit(parts._replace(scheme=ACCEPTED_TRANSPORTS[scheme], fragment=""))


class KombuBroker(AmqpBroker):
    """A RabbitMQ connection through kombu's py-amqp transport. Options:
    :class:`~reservoir.brokers.amqp.threaded.AmqpBroker`, and ``connect_timeout_s``, the TCP connect
    timeout of one attempt. kombu's query parameters (``heartbeat``, ``ssl_*``) win."""

    driver = "kombu"

    def __init__(
        self, url: str | BrokerUrl, *, connect_timeout_s: float = 5.0, **options: Any
    ) -> None:
        parsed = BrokerUrl.parse(url)
        if parsed.adapter != "kombu":
            raise UnsupportedBroker(f"not a kombu+<kombu URL>: {parsed.display!r}")
        #: one per broker the URL names: a lost connection is made again to the next
        self._kombu_urls = [
            kombu_transport_url(replace(parsed, transport_url=u)) for u in parsed.transport_urls
        ]
        self._kombu_url = self._kombu_urls[0]
        #: py-amqp's TLS options when reservoir sets up TLS (``tls_*`` on the URL)
        self._ssl: dict[str, Any] | None = None
        if parsed.verifies_tls:
            self._ssl = {
                "ca_certs": parsed.tls_ca,
                "certfile": parsed.tls_cert,
                "keyfile": parsed.tls_key,
                "cert_reqs": ssl.CERT_REQUIRED,
                "server_hostname": parsed.host,
            }
        self._connect_timeout_s = connect_timeout_s
        self._heartbeat = float(options.get("heartbeat_s", 30.0))
        # Building (not connecting) a kombu Connection rejects a malformed URL or an
        # unknown kombu option in the caller's thread, with the caller's traceback.
        try:
            self._new_connection("reservoir-kombu:check").release()
        except (TypeError, ValueError) as error:
            raise ValueError(f"kombu cannot use {parsed.display!r}: {error}") from error
        self._connection: Any = None
        self._sock: socket.socket | None = None
        self._gen = 0
        self._user_id: str | None = None
        self._channels: dict[Role, Any] = {}
        self._poller: select.poll | None = None
        self._timer_at: float | None = None
        self._stopping = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ)
        super().__init__(parsed, **options)

    # -- the IO thread's loop --------------------------------------------------------------

    def _io_main(self) -> None:
        next_beat: float | None = None
        try:
            while not self._stopping:
                self._pump()
                if self._stopping:
                    break
                now = self._now()
                beat_s = self._beat_s()
                if beat_s and next_beat is None:
                    next_beat = now + beat_s
                due = [t for t in (self._timer_at, next_beat if beat_s else None) if t is not None]
                events = self._selector.select(max(0.0, min(due) - now) if due else None)
                with contextlib.suppress(BlockingIOError, InterruptedError):
                    while self._wake_r.recv(4096):
                        pass
                sock = self._sock
                if sock is not None and (
                    any(key.fileobj is sock for key, _ in events) or _has_pending(sock)
                ):
                    self._guard(self._read)
                now = self._now()
                if self._timer_at is not None and now >= self._timer_at:
                    self._timer_at = None
                    self._event(Session.tick, now)
                if beat_s and next_beat is not None and now >= next_beat:
                    next_beat = now + beat_s
                    # Sends our heartbeat when due; raises when the server's are missed.
                    self._guard(lambda: self._connection.heartbeat_check(rate=2))
        finally:
            self._drop()
            self._selector.close()
            self._wake_r.close()
            self._wake_w.close()

    def _beat_s(self) -> float:
        connection = self._connection
        interval = connection.get_heartbeat_interval() if connection is not None else 0
        return float(interval or 0) / 4

    def _send_wake(self) -> None:
        # Full of wake-ups already, or closed at shutdown: either way awake enough.
        with contextlib.suppress(OSError):
            self._wake_w.send(b"\0")

    def _read(self) -> None:
        """Read what the socket has, at most ``_READ_BATCH`` frames. Events py-amqp reports
        meanwhile are acted on after the read, not from inside py-amqp's callbacks."""
        assert self._sock is not None
        self._pumping = True
        try:
            for _ in range(_READ_BATCH):
                try:
                    # No timeout of its own: the socket's (``timeout_s``) bounds the wait for
                    # the rest of a frame, and py-amqp changes no socket setting per read.
                    self._connection.connection.drain_events(timeout=None)
                except TimeoutError:
                    return  # the rest of a frame is late; py-amqp keeps what it read
                if not self._readable_now():
                    return
        finally:
            self._pumping = False

    def _readable_now(self) -> bool:
        """Whether another frame can be read without waiting."""
        assert self._sock is not None and self._poller is not None
        return _has_pending(self._sock) or bool(self._poller.poll(0))

    def _guard(self, run: Callable[[], object], role: Role | None = None) -> bool:
        """Run one call into py-amqp; turn what it raises into the session's events. False
        if it failed. ``role``: the channel the call was for."""
        gen = self._gen
        try:
            run()
        except amqp.exceptions.ChannelError as error:
            method = tuple(getattr(error, "method_sig", None) or (0, 0))
            closed = _ROLE_OF_METHOD.get(method[:2]) or _ROLE_OF_CLASS.get(method[0])
            code = getattr(error, "reply_code", None)
            text = str(getattr(error, "reply_text", "") or error)
            if closed is None:
                self._lost(gen, f"channel error: {error!r}")
                return False
            self._event(Session.channel_closed, gen, closed, code, f"{code} {text}")
            if role is not None and closed != role:
                # Another channel's close cut this call short: its answer is in doubt.
                self._close(f"{closed} channel closed during a {role} call")
            return False
        except _LINK_ERRORS as error:
            log.info("the connection failed: %r", error)  # the whole of it, with -v
            self._lost(gen, failure_words(error))
            return False
        return True

    # -- actions ---------------------------------------------------------------------------

    def _do(self, action: Action[Future]) -> None:
        if self._sock is not None and self._session.state is core.State.CLOSING:
            # Bounded, so that close() returns in time even if the server went silent.
            self._sock.settimeout(max(self._close_timeout_s / 2, 0.1))
        if isinstance(action, core.Publish):
            message = action.message
            properties = {"user_id": self._user_id} if self._user_id is not None else {}
            amqp_message = amqp.Message(
                message.body,
                delivery_mode=1,  # the queues are exclusive: nothing to persist for
                content_type="application/octet-stream",
                content_encoding="binary",
                app_id=message.token,
                **properties,
            )
            self._guard(
                lambda: self._channels["publish"].basic_publish(
                    amqp_message, message.exchange, message.routing_key, mandatory=True
                ),
                "publish",
            )
        elif isinstance(action, core.SetTimer):
            self._timer_at = action.at_s
        elif isinstance(action, core.Connect):
            self._connect(action.gen)
        elif isinstance(action, core.Stop):
            self._stopping = True
            self._close("closing")
        elif self._connection is None:
            return  # for a connection already gone
        elif isinstance(action, core.CloseConnection):
            self._close(action.reason)
        elif isinstance(action, core.OpenChannel):
            self._open_channel(action.role)
        else:
            role: Role = "consume" if isinstance(action, core.Consume) else "control"
            if self._guard(partial(self._control, action), role):
                self._event(Session.replied, self._gen)

    def _control(self, action: Action[Future]) -> None:
        if isinstance(action, core.DeclareExchange):
            exchange = Exchange(action.name, type="topic", durable=True, auto_delete=False)
            exchange(self._channels["control"]).declare(passive=action.passive)
        elif isinstance(action, core.Consume):
            self._queue(action.address, "consume").consume(
                callback=partial(self._on_message, action.token),
                no_ack=True,
                on_cancel=partial(self._on_cancel, self._gen, action.token),
            )
        elif isinstance(action, core.DeclareQueue):
            self._queue(action.address).queue_declare()
        elif isinstance(action, core.BindQueue):
            self._queue(action.address).bind_to(action.exchange, routing_key=action.pattern)
        elif isinstance(action, core.UnbindQueue):
            exchange = Exchange(action.exchange)
            self._queue(action.address).unbind_from(exchange, routing_key=action.pattern)
        elif isinstance(action, core.DeleteQueue):
            self._queue(action.address).delete()

    def _queue(self, address: str, role: Role = "control") -> Any:
        queue = Queue(address, exclusive=True, durable=False)
        queue.auto_delete = False  # kombu makes exclusive imply it; see the module docstring
        return queue(self._channels[role])

    def _new_connection(self, name: str) -> Any:
        tls = {"ssl": self._ssl} if self._ssl is not None else {}
        return Connection(
            self._kombu_url,
            **tls,
            heartbeat=self._heartbeat,
            connect_timeout=self._connect_timeout_s,
            transport_options={
                "client_properties": {"connection_name": name},
                "on_blocked": lambda reason: self._event(Session.blocked, reason),
                "on_unblocked": lambda: self._event(Session.unblocked),
            },
        )

    def _connect(self, gen: int) -> None:
        self._gen = gen
        # Round the cluster's brokers: each new attempt (gen counts them) tries the next.
        self._kombu_url = self._kombu_urls[(gen - 1) % len(self._kombu_urls)]
        connection = self._new_connection(self.connection_name)
        try:
            # One try: the session owns the retries (kombu's own connect() would retry
            # once more after sleeping two seconds).
            connection.ensure_connection(max_retries=0, reraise_as_library_errors=False)
            sock = connection.connection.sock
            # A silent server must not hold a synchronous call for ever.
            sock.settimeout(self._timeout_s)
            capabilities = connection.connection.client_properties.get("capabilities", {})
            capabilities["connection.blocked"] = False  # see the module docstring
        except Exception as error:
            with contextlib.suppress(Exception):
                connection.collect()
            self._event(
                Session.lost,
                gen,
                self._now(),
                repr(error),
                fatal=not isinstance(error, _TRANSIENT),
            )
            return
        self._connection, self._sock = connection, sock
        self._selector.register(sock, selectors.EVENT_READ)
        self._poller = select.poll()  # no descriptor limit, unlike select.select
        self._poller.register(sock, select.POLLIN)
        self._user_id = connection.userid if connection.login_method != "EXTERNAL" else None
        self._event(Session.connected, gen, self._now(), self._user_id)

    def _open_channel(self, role: Role) -> None:
        old = self._channels.pop(role, None)
        if old is not None:
            with contextlib.suppress(Exception):
                old.close()  # the one py-amqp revived after the server closed it

        def open_it() -> None:
            channel = self._connection.channel()
            if role == "publish":
                channel.confirm_select()
                channel.events["basic_ack"].add(partial(self._on_confirm, channel, True))
                channel.events["basic_nack"].add(partial(self._on_confirm, channel, False))
                channel.events["basic_return"].add(self._on_return)
            self._channels[role] = channel

        if self._guard(open_it, role):
            self._event(Session.channel_opened, self._gen, role)

    def _close(self, reason: str) -> None:
        connection = self._connection
        if connection is None:
            return
        log.info("%s: closing the connection: %s", self.connection_name, reason)
        try:
            connection.release()
        except Exception as error:
            log.debug("%s: closing: %r", self.connection_name, error)
        self._lost(self._gen, reason)

    def _lost(self, gen: int, reason: str) -> None:
        if gen != self._gen or self._connection is None:
            return
        self._drop()
        self._event(Session.lost, gen, self._now(), reason)

    def _drop(self) -> None:
        """Forget the connection without talking to the server (it may be gone)."""
        connection, sock = self._connection, self._sock
        self._connection = self._sock = self._poller = None
        self._channels.clear()
        if sock is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(sock)
        if connection is not None:
            with contextlib.suppress(Exception):
                connection.collect()

    # -- py-amqp's callbacks ---------------------------------------------------------------

    def _on_confirm(self, channel: Any, ack: bool, tag: int, multiple: bool) -> None:
        if channel is self._channels.get("publish"):
            self._event(Session.confirmed, self._gen, tag, multiple=multiple, ack=ack)

    def _on_return(self, _error: Any, exchange: str, routing_key: str, message: Any) -> None:
        properties = message.properties
        self._returned(
            properties.get("app_id", ""),
            exchange,
            routing_key,
            _as_bytes(message.body),
            properties.get("user_id"),
        )

    def _on_message(self, token: str, message: Any) -> None:
        info = message.delivery_info
        self._message(
            token,
            info.get("exchange"),
            info.get("routing_key"),
            _as_bytes(message.body),
            message.properties.get("user_id"),
        )

    def _on_cancel(self, gen: int, token: str, _consumer_tag: str) -> None:
        self._event(Session.consumer_cancelled, gen, token)


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
