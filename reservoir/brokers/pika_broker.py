"""The RabbitMQ driver on pika, the default for ``amqp://`` and ``amqps://`` URLs.

This module owns only what is pika's: one ``SelectConnection`` and pika's ``IOLoop`` on an
IO thread the broker owns (the loop outlives reconnects), the three channels, and turning
pika's callbacks into the session's events and the session's actions into pika calls.
What reservoir does on RabbitMQ (topology, confirms, returns, the 403 in a batch,
reconnection and replay, flow control, stats) is decided by the sans-I/O session in
:mod:`reservoir.brokers.amqp.session`, the same one the kombu driver runs; callers' threads talk to
:mod:`reservoir.brokers.amqp.threaded`. Read those first.

Why ``SelectConnection`` rather than a ``BlockingConnection`` on a thread: confirms must be
asynchronous. The blocking adapter's ``confirm_delivery`` turns every publish into a round
trip; the select adapter reports acks and nacks as callbacks, so publishes are pipelined and
confirmed in batches (``multiple=True``). Calls from other threads reach the IO thread
through the loop's ``add_callback_threadsafe``, one wake-up for everything queued since the
last.

Reply path: an exclusive named queue, not direct reply-to
    The founding design asked to choose between direct reply-to
    (``amq.rabbitmq.reply-to``) and a reply queue. Direct reply-to cannot meet the
    contract: its address exists only while the channel that published the request lives
    (a reply after a reconnect is returned, and the requestor never sees it), only someone
    who received a request can learn it, and it cannot be bound to a topic. So every
    endpoint, requestors included, is an exclusive named queue: a stable address across
    reconnects, mandatory returns, bindings. Measured beside it with pika, direct reply-to
    was not the quicker either (docs/performance.md, "The pika driver").

Each connection announces ``connection_name`` (``reservoir-pika:<pid>:<n>``), the same
across reconnects, so an operator or a test can find and close exactly this broker's.
"""

from __future__ import annotations

import collections
import errno
import logging
from collections.abc import Callable
from functools import partial
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pika
import pika.exceptions
from pika.adapters.select_connection import IOLoop
from pika.adapters.utils import io_services_utils

from reservoir.brokers._rules import DEFAULT_EXCHANGE, INBOX_SUFFIX, failure_words
from reservoir.brokers.amqp import frames
from reservoir.brokers.amqp import session as core
from reservoir.brokers.amqp.session import Action, Role, Session
from reservoir.brokers.amqp.threaded import AmqpBroker, AmqpEndpoint, Future
from reservoir.brokers.url import BrokerUrl

__all__ = [
    "DEFAULT_EXCHANGE",
    "INBOX_SUFFIX",
    "PikaBroker",
    "PikaEndpoint",
    "PikaStats",
    "strip_reservoir_params",
]

log = logging.getLogger(__name__)

# pika has no type information; these names say what each Any is.
Channel = Any
Frame = Any

PikaEndpoint = AmqpEndpoint
PikaStats = core.AmqpStats

#: errors that retrying the first connection cannot fix
_FATAL = (
    pika.exceptions.AuthenticationError,
    pika.exceptions.ProbableAuthenticationError,
    pika.exceptions.ProbableAccessDeniedError,
    pika.exceptions.IncompatibleProtocolError,
)


#: what one read of the socket may take (pika reads 4 KiB at a time), and what one write
#: may join of the frames waiting to go out
RECV_BYTES = 65536
SEND_BYTES = 65536

_PLAINTEXT_TRANSPORT: Any = getattr(io_services_utils, "_AsyncPlaintextTransport", None)
#: the socket errors pika takes for "not now" (and not for a broken connection)
_TRY_AGAIN: tuple[int, ...] = getattr(
    io_services_utils, "_TRY_IO_AGAIN_SOCK_ERROR_CODES", (errno.EAGAIN, errno.EWOULDBLOCK)
)


class TunedPlaintextTransport(_PLAINTEXT_TRANSPORT or object):  # type: ignore[misc]
    """pika's plaintext transport, writing and reading in fewer system calls: what
    :func:`tune_transport` makes of one (a subclass, so that nothing on the instance
    refers back to it and a closed connection goes with its last reference)."""

    def _sigint_safe_send(self, sock: Any, chunk: bytes) -> int:
        # pika's _produce sends buffers[0] and then pops it: make that the next SEND_BYTES
        # joined, put back before sending, so that an EAGAIN leaves the bytes as they were
        buffers = self._tx_buffers
        if len(buffers) > 1 and chunk is buffers[0] and len(chunk) < SEND_BYTES:
            pieces = [buffers.popleft()]
            size = len(pieces[0])
            while buffers and size + len(buffers[0]) <= SEND_BYTES:
                piece = buffers.popleft()
                pieces.append(piece)
                size += len(piece)
            chunk = b"".join(pieces)
            buffers.appendleft(chunk)
        # pika retries on EINTR around this; Python's socket calls already do (PEP 475)
        sent: int = sock.send(chunk)
        return sent

    #: while above 0, a write is buffered and left for :meth:`release_writes` to send
    _writes_held = 0
    #: whether pika was already watching for writability when the hold began
    _watched_before_hold = False

    def write(self, data: bytes) -> None:
        if self._writes_held and self._state == self._STATE_ACTIVE:
            self._buffer_tx_data(data)
            return
        super().write(data)

    def hold_writes(self) -> None:
        """From now until the matching :meth:`release_writes`, buffer what is written:
        whatever one turn of the IO loop writes then leaves in one ``send()``, at once,
        rather than after pika has watched the socket for writability (two ``epoll_ctl``
        and a poll more per turn, and the answer to a message a poll later)."""
        if not self._writes_held:
            # pika watches for writability exactly while anything is buffered
            self._watched_before_hold = bool(self._tx_buffers)
        self._writes_held += 1

    def release_writes(self) -> None:
        """Send what was buffered while held; the writability watcher only for what the
        socket would not take now (pika's rule: a watcher while anything is buffered)."""
        self._writes_held -= 1
        if self._writes_held or self._state != self._STATE_ACTIVE or not self._tx_buffers:
            return
        if not self._watched_before_hold:
            try:
                self._produce()
            except OSError as error:
                if error.errno not in _TRY_AGAIN:
                    self._initiate_abort(error)
                    return
            if self._tx_buffers:
                self._nbio.set_writer(self._sock.fileno(), self._on_socket_writable)
        # else the watcher set before the hold sends it all, in order

    def _consume(self) -> None:
        self.hold_writes()
        try:
            self._read()
        except BaseException as error:
            if isinstance(error, OSError) and error.errno in _TRY_AGAIN:
                self.release_writes()  # pika takes this for "nothing more to read now"
            else:
                # The read failed (reset, end of file, a bug): pika aborts the transport,
                # which flushes nothing, and an abort of ours first would trip its checks.
                self._writes_held -= 1
            raise
        self.release_writes()

    def _read(self) -> None:
        consumed = 0
        while self._state == self._STATE_ACTIVE and consumed < self._MAX_CONSUME_BYTES:
            data: bytes = self._sock.recv(RECV_BYTES)  # EINTR retried by Python (PEP 475)
            if not data:
                raise self.RxEndOfFile()
            consumed += len(data)
            self._protocol.data_received(data)
            if len(data) < RECV_BYTES:
                return  # the poller is level-triggered: anything left is reported again


def tune_transport(transport: Any) -> bool:
    """Make pika's socket I/O one system call per batch rather than one per frame or 4 KiB.

    pika's plaintext transport (1.3 and 1.4) sends each buffered frame with a ``send()`` of
    its own (a publish is three frames: method, header, body), with ``TCP_NODELAY`` on, so
    each frame is a segment the broker must take in on its own; and it reads 4 KiB at a
    time until a read fails with EAGAIN (or 100 KiB are in), so nearly every readable event
    ends in a read that finds nothing. Tuned, the frames waiting go out joined,
    ``SEND_BYTES`` at most per ``send()`` (so a long backlog is never copied again whole
    after a partial send), and the socket is read ``RECV_BYTES`` at a time until a read
    comes back short, 100 KiB per event at most as before (pika's pollers are all
    level-triggered: whatever is left is reported again). Why: every system call on the hot
    path is CPU a placement pays in each process, and a segment per frame is work RabbitMQ
    pays per segment (docs/performance.md, "The pika driver").

    Only pika's plaintext transport, exactly: an SSL socket keeps pika's I/O, since
    decrypted bytes may wait in the SSL object where no poll sees them, and a write OpenSSL
    asks to retry must be retried with the same bytes. These are private parts of pika:
    for any other transport (another pika), nothing changes and False is returned."""
    if _PLAINTEXT_TRANSPORT is None or type(transport) is not _PLAINTEXT_TRANSPORT:
        return False
    if not isinstance(getattr(transport, "_tx_buffers", None), collections.deque):
        return False
    transport.__class__ = TunedPlaintextTransport
    return True


class HotPathConnection(pika.SelectConnection):  # type: ignore[misc]
    """pika's ``SelectConnection``, reading the frames of a delivery and of a publisher
    confirm itself (:mod:`reservoir.brokers.amqp.frames`) and handing them to ``hot`` straight, and
    every other frame to pika as pika would. ``hot`` is the broker's: it takes a frame
    (True) or declines it, and a declined frame goes pika's way.

    What pika keeps is what it needs to see: the handshake (nothing is read here until the
    connection is open), heartbeats, every control reply, returns, and any delivery whose
    header carries a ``headers`` table. The counters pika's heartbeat checker reads
    (``bytes_received``, ``frames_received``) are kept as pika keeps them."""

    #: the broker's taker of a hot frame (True: taken); None until the broker sets it
    hot: Callable[[frames.Deliver | frames.Confirm], bool] | None = None

    def _on_data_available(self, data_in: bytes) -> None:
        hot = self.hot
        if hot is None or not self.is_open:
            super()._on_data_available(data_in)
            return
        held: bytes = self._frame_buffer  # type: ignore[has-type]
        buffer = held + data_in if held else data_in
        # pika trims its buffer after every frame, which copies the rest each time; here it
        # is trimmed once, and whatever a callback does to the connection meanwhile (a
        # close resets the buffer) shows as a buffer that is no longer this one.
        self._frame_buffer = buffer
        offset = 0
        try:
            while offset < len(buffer):
                try:
                    value, end, count = frames.hot_frames(buffer, offset)
                except frames.Incomplete:
                    break
                except frames.FrameError as error:
                    raise pika.exceptions.InvalidFrameError(str(error)) from None
                taken = False
                if value is not None:
                    try:
                        taken = hot(value)
                    except BaseException:
                        offset = end  # consumed, as pika trims a frame before handling it
                        raise
                if taken:
                    self.bytes_received += end - offset
                    self.frames_received += count
                    offset = end
                else:
                    # pika's way, this one frame; a delivery declined goes frame by frame
                    # through pika's reader from its method frame on
                    end = frames.frame_end(buffer, offset)
                    consumed, frame_value = pika.frame.decode_frame(buffer[offset:end])
                    self.bytes_received += consumed
                    offset = end
                    self._process_frame(frame_value)
                if self._frame_buffer is not buffer:
                    return  # the connection was reset by a callback: what is left is gone
        finally:
            if self._frame_buffer is buffer and offset:
                self._frame_buffer = buffer[offset:]


def strip_reservoir_params(url: str) -> tuple[str, dict[str, str]]:
    """``url`` as pika should see it, and reservoir's own query parameters."""
    parsed = BrokerUrl.parse(url)
    return parsed.transport_url, ({"exchange": parsed.exchange} if parsed.exchange_given else {})


def _describe(reason: object) -> str:
    if isinstance(reason, pika.exceptions.ChannelClosed | pika.exceptions.ConnectionClosed):
        return f"{reason.reply_code} {reason.reply_text}"
    if isinstance(reason, BaseException):
        log.info("the connection failed: %r", reason)  # the whole of it, with -v
        return failure_words(reason)
    return str(reason)


class PikaBroker(AmqpBroker):
    """A RabbitMQ connection through pika. Options:
    :class:`~reservoir.brokers.amqp.threaded.AmqpBroker`; the URL's pika query parameters
    (``heartbeat``, ``ssl_options``...) win over them."""

    driver = "pika"

    def __init__(self, url: str | BrokerUrl, **options: Any) -> None:
        parsed = BrokerUrl.parse(url)
        #: one per broker the URL names: a lost connection is made again to the next
        self._params_each = [pika.URLParameters(u) for u in parsed.transport_urls]
        for params, transport_url in zip(self._params_each, parsed.transport_urls, strict=True):
            if "heartbeat" not in dict(parse_qsl(urlsplit(transport_url).query)):
                params.heartbeat = int(options.get("heartbeat_s", 30))
        if parsed.verifies_tls:
            for params in self._params_each:
                params.ssl_options = pika.SSLOptions(parsed.ssl_context(), params.host)
        self._params = self._params_each[0]
        # RabbitMQ checks user_id against the authenticated user; EXTERNAL (certificate)
        # auth has no user name we could know, so it stays unset there.
        self._user_id: str | None = getattr(self._params.credentials, "username", None)
        self._ioloop = IOLoop()
        self._connection: Any = None
        self._gen = 0
        self._channels: dict[Role, Channel] = {}
        #: consumer tag -> endpoint token, for a cancelled consumer
        self._consumers: dict[str, str] = {}
        #: token -> the content header properties of its messages, as bytes
        self._wire_properties: dict[str, bytes] = {}
        self._timer: object | None = None
        self._stopping = False
        super().__init__(parsed, **options)

    # -- the IO thread's loop --------------------------------------------------------------

    def _io_main(self) -> None:
        while not self._stopping:
            self._ioloop.start()
        self._ioloop.close()

    def _send_wake(self) -> None:
        try:
            self._ioloop.add_callback_threadsafe(self._pump_held)
        except Exception:  # the loop has closed: nothing left to wake
            log.debug("%s: wake-up after the loop closed", self.connection_name)

    def _pump_held(self) -> None:
        """The pump a wake-up runs: what it publishes leaves in one write at its end."""
        transport = getattr(self._connection, "_transport", None)
        if not isinstance(transport, TunedPlaintextTransport):
            self._pump()
            return
        transport.hold_writes()
        try:
            self._pump()
        finally:
            transport.release_writes()

    # -- actions ---------------------------------------------------------------------------

    def _do(self, action: Action[Future]) -> None:
        gen = self._gen
        if isinstance(action, core.Publish):
            message = action.message
            try:
                self._publish(message.exchange, message.routing_key, message.body, message.token)
            except Exception as error:
                self._close(f"publish failed: {error!r}")
        elif isinstance(action, core.Connect):
            self._connect(action.gen)
        elif isinstance(action, core.OpenChannel):
            self._channels.pop(action.role, None)
            try:
                self._connection.channel(on_open_callback=partial(self._opened, gen, action.role))
            except Exception as error:
                self._close(f"cannot open the {action.role} channel: {error!r}")
        elif isinstance(action, core.SetTimer):
            if self._timer is not None:
                self._ioloop.remove_timeout(self._timer)
            delay_s = max(0.0, action.at_s - self._now())
            self._timer = self._ioloop.call_later(delay_s, self._tick)
        elif isinstance(action, core.CloseConnection):
            self._close(action.reason)
        elif isinstance(action, core.Stop):
            self._stopping = True
            if not self._close("closing"):
                self._ioloop.stop()
        else:
            self._control(gen, action)

    def _control(self, gen: int, action: Action[Future]) -> None:
        replied = partial(self._replied, gen)
        try:
            if isinstance(action, core.Consume):
                tag = self._channels["consume"].basic_consume(
                    action.address,
                    partial(self._on_message, action.token),
                    auto_ack=True,
                    exclusive=True,
                    callback=replied,
                )
                self._consumers[tag] = action.token
                return
            control = self._channels["control"]
            if isinstance(action, core.DeclareExchange):
                control.exchange_declare(
                    action.name,
                    exchange_type="topic",
                    durable=True,
                    auto_delete=False,
                    passive=action.passive,
                    callback=replied,
                )
            elif isinstance(action, core.DeclareQueue):
                control.queue_declare(action.address, exclusive=True, callback=replied)
            elif isinstance(action, core.BindQueue):
                control.queue_bind(
                    action.address, action.exchange, routing_key=action.pattern, callback=replied
                )
            elif isinstance(action, core.UnbindQueue):
                control.queue_unbind(
                    action.address, action.exchange, routing_key=action.pattern, callback=replied
                )
            elif isinstance(action, core.DeleteQueue):
                control.queue_delete(action.address, callback=replied)
        except Exception as error:  # the channel closed under us: its callback says why
            log.debug("%s: a control method failed: %r", self.connection_name, error)

    def _connect(self, gen: int) -> None:
        self._gen = gen
        # Round the cluster's brokers: each new attempt (gen counts them) tries the next.
        self._params = self._params_each[(gen - 1) % len(self._params_each)]
        self._params.client_properties = {
            **(self._params.client_properties or {}),
            "connection_name": self.connection_name,
            "product": "reservoir",
        }
        try:
            self._connection = HotPathConnection(
                self._params,
                on_open_callback=partial(self._on_open, gen),
                on_open_error_callback=partial(self._on_lost, gen, opening=True),
                on_close_callback=partial(self._on_lost, gen, opening=False),
                custom_ioloop=self._ioloop,
            )
        except Exception as error:
            self._on_lost(gen, None, error, opening=True)

    def _close(self, reason: str) -> bool:
        """Close the connection; False if there was none to close."""
        connection = self._connection
        if connection is None or connection.is_closing or connection.is_closed:
            return False
        try:
            connection.close(320, reason[:200])
        except Exception:
            log.debug("%s: closing the connection", self.connection_name, exc_info=True)
            return False
        return True

    def _publish(self, exchange: str, routing_key: str, body: bytes, token: str) -> None:
        """``basic.publish``, ``mandatory``, with our ``user_id`` and the sender's token as
        ``app_id`` (so that a ``basic.return`` finds its sender), written as frames here
        (:mod:`reservoir.brokers.amqp.frames`) rather than through pika's ``basic_publish``."""
        channel = self._channels["publish"]
        connection: HotPathConnection = self._connection
        if not channel.is_open:
            raise pika.exceptions.ChannelWrongStateError("the publish channel is not open")
        properties = self._wire_properties.get(token)
        if properties is None:
            properties = self._wire_properties[token] = frames.publish_properties(
                self._user_id, token
            )
        data, count = frames.publish_frames(
            channel.channel_number,
            exchange,
            routing_key,
            body,
            properties,
            mandatory=True,
            body_max=connection.params.frame_max - frames.FRAME_OVERHEAD,
        )
        # what pika's _output_marshaled_frames counts, for its heartbeat checker
        connection.bytes_sent += len(data)
        connection.frames_sent += count
        connection._adapter_emit_data(data)

    def _hot_frame(self, gen: int, value: frames.Deliver | frames.Confirm) -> bool:
        """A delivery or a confirm :class:`HotPathConnection` read: taken (True) when it is
        for our open consume or publish channel, as pika's callbacks would have had it."""
        if gen != self._gen:
            return False
        if type(value) is frames.Deliver:  # final: isinstance on a struct is the slow path
            channel = self._channels.get("consume")
            token = self._consumers.get(value.consumer_tag)
            if token is None or channel is None or value.channel != channel.channel_number:
                return False
            if not channel.is_open:
                return False
            self._message(token, value.exchange, value.routing_key, value.body, value.user_id)
            return True
        channel = self._channels.get("publish")
        if channel is None or value.channel != channel.channel_number or not channel.is_open:
            return False
        self._event(
            Session.confirmed, gen, value.delivery_tag, multiple=value.multiple, ack=value.ack
        )
        return True

    # -- pika's callbacks ------------------------------------------------------------------

    def _tick(self) -> None:
        self._timer = None
        self._event(Session.tick, self._now())

    def _on_open(self, gen: int, connection: Any) -> None:
        connection.hot = partial(self._hot_frame, gen)  # a HotPathConnection: see _connect
        if not tune_transport(getattr(connection, "_transport", None)):
            log.debug(
                "%s: pika's own socket I/O kept (an SSL or unfamiliar transport)",
                self.connection_name,
            )
        connection.add_on_connection_blocked_callback(
            lambda _c, frame: self._event(Session.blocked, str(frame.method.reason))
        )
        connection.add_on_connection_unblocked_callback(
            lambda _c, _frame: self._event(Session.unblocked)
        )
        self._event(Session.connected, gen, self._now(), self._user_id)

    def _on_lost(self, gen: int, _connection: Any, reason: object, *, opening: bool) -> None:
        if gen != self._gen:
            return
        self._connection = None
        self._channels.clear()
        self._consumers.clear()
        fatal = opening and isinstance(reason, _FATAL)
        self._event(Session.lost, gen, self._now(), _describe(reason), fatal=fatal)
        if self._stopping:
            self._ioloop.stop()

    def _opened(self, gen: int, role: Role, channel: Channel) -> None:
        if gen != self._gen:
            return
        self._channels[role] = channel
        channel.add_on_close_callback(partial(self._channel_closed, gen, role))
        if role == "publish":
            channel.add_on_return_callback(self._on_return)
            channel.confirm_delivery(
                partial(self._on_confirm, gen),
                callback=lambda _frame: self._event(Session.channel_opened, gen, role),
            )
            return
        if role == "consume":
            channel.add_on_cancel_callback(partial(self._on_cancel, gen))
        self._event(Session.channel_opened, gen, role)

    def _channel_closed(self, gen: int, role: Role, channel: Channel, reason: object) -> None:
        connection = self._connection
        if gen != self._gen or self._channels.get(role) is not channel:
            return  # a channel already replaced
        if connection is None or not connection.is_open:
            return  # the whole connection is going: its close callback says so
        del self._channels[role]
        by_broker = isinstance(reason, pika.exceptions.ChannelClosedByBroker)
        code = reason.reply_code if by_broker else None  # type: ignore[attr-defined]
        self._event(Session.channel_closed, gen, role, code, _describe(reason))

    def _replied(self, gen: int, _frame: Frame) -> None:
        self._event(Session.replied, gen)

    def _on_confirm(self, gen: int, frame: Frame) -> None:
        method = frame.method
        ack = isinstance(method, pika.spec.Basic.Ack)
        self._event(Session.confirmed, gen, method.delivery_tag, multiple=method.multiple, ack=ack)

    def _on_return(self, _channel: Channel, method: Any, properties: Any, body: bytes) -> None:
        self._returned(
            properties.app_id, method.exchange, method.routing_key, body, properties.user_id
        )

    def _on_message(
        self, token: str, _channel: Channel, method: Any, properties: Any, body: bytes
    ) -> None:
        self._message(token, method.exchange, method.routing_key, body, properties.user_id)

    def _on_cancel(self, gen: int, frame: Frame) -> None:
        token = self._consumers.pop(frame.method.consumer_tag, None)
        if token is not None:
            self._event(Session.consumer_cancelled, gen, token)
