"""The AMQP 0-9-1 frames on reservoir's hot path, as bytes and back: pure functions.

This module owns the three frame sequences that every message of a placement goes
through, written straight with :mod:`struct` rather than through a client library's
general method and property objects:

- **out**, a ``basic.publish``: its method frame, a content header carrying only
  ``user_id`` and ``app_id`` (what :mod:`reservoir.brokers.amqp.session` puts on every message), and
  the body in frames of at most the negotiated ``frame_max``;
- **in**, a ``basic.deliver``: the method frame, the content header and every body frame,
  taken only when all of them are in the buffer, so a client library never sees half a
  message;
- **in**, a ``basic.ack`` or ``basic.nack`` (a publisher confirm).

Everything else (the handshake, heartbeats, control replies, returns, a content header
carrying a ``headers`` table) is not recognised here: :func:`next_hot_frame` says so and the
client library reads that frame the way it reads any other. The bytes are those the
library writes (``tests/unit/test_amqp_frames.py`` holds them against pika's own encoder
and decoder); the layout is the AMQP 0-9-1 specification's, section 4.2.

Why: under ``reservoir bench`` on RabbitMQ, pika's general path (a ``Method`` and a
``Frame`` object per frame, ``BasicProperties`` decoded field by field, a callback lookup
per frame, the frame buffer copied once per frame) was a quarter of each process's CPU;
docs/performance.md, "The pika driver", has the figures before and after.
"""

from __future__ import annotations

import struct
from typing import final

import msgspec

__all__ = [
    "FRAME_END",
    "Confirm",
    "Deliver",
    "FrameError",
    "Incomplete",
    "frame_end",
    "hot_frames",
    "publish_frames",
    "publish_properties",
]

FRAME_METHOD = 1
FRAME_HEADER = 2
FRAME_BODY = 3
FRAME_END = 0xCE
#: type (1), channel (2), size (4) before the payload; the end octet after it
FRAME_OVERHEAD = 8

BASIC = 60
#: class id and method id as one big-endian 32-bit number, as a method frame starts
BASIC_PUBLISH = (BASIC << 16) | 40
BASIC_DELIVER = (BASIC << 16) | 60
BASIC_ACK = (BASIC << 16) | 80
BASIC_NACK = (BASIC << 16) | 120

# Content header property flags (spec 4.2.6.1): the first field is the highest bit.
_CONTENT_TYPE = 1 << 15
_CONTENT_ENCODING = 1 << 14
_HEADERS = 1 << 13
_DELIVERY_MODE = 1 << 12
_PRIORITY = 1 << 11
_CORRELATION_ID = 1 << 10
_REPLY_TO = 1 << 9
_EXPIRATION = 1 << 8
_MESSAGE_ID = 1 << 7
_TIMESTAMP = 1 << 6
_TYPE = 1 << 5
_USER_ID = 1 << 4
_APP_ID = 1 << 3
_CLUSTER_ID = 1 << 2
_MORE_FLAGS = 1

#: the property fields this module reads, in the order they follow the flags, and their
#: kind: "s" a short string, "o" an octet, "q" a 64-bit timestamp
_FIELDS: tuple[tuple[int, str], ...] = (
    (_CONTENT_TYPE, "s"),
    (_CONTENT_ENCODING, "s"),
    (_DELIVERY_MODE, "o"),
    (_PRIORITY, "o"),
    (_CORRELATION_ID, "s"),
    (_REPLY_TO, "s"),
    (_EXPIRATION, "s"),
    (_MESSAGE_ID, "s"),
    (_TIMESTAMP, "q"),
    (_TYPE, "s"),
    (_USER_ID, "s"),
    (_APP_ID, "s"),
    (_CLUSTER_ID, "s"),
)
#: a header with any other flag (a ``headers`` table, a second flag word) is not ours
_UNREAD = 0xFFFF & ~(sum(flag for flag, _kind in _FIELDS))
#: the bytes an octet ("o") and a timestamp ("q") take
_WIDTH = {"o": 1, "q": 8}
#: the fields that come before ``user_id`` in a header (reservoir's publishers send none:
#: only ``user_id`` and ``app_id``)
_AHEAD_OF_USER_ID = sum(flag for flag, _kind in _FIELDS if flag > _USER_ID)

_frame_start = struct.Struct(">BHI")
_method_id = struct.Struct(">I")
_u64 = struct.Struct(">Q")
_header_start = struct.Struct(">HHQH")
_publish_start = struct.Struct(">BHIIH")
_header_frame_start = struct.Struct(">BHIHHQ")


class FrameError(ValueError):
    """The bytes break the framing (a frame's end octet is not 0xCE): the connection
    cannot go on."""


@final
class Deliver(msgspec.Struct, frozen=True):
    """A whole ``basic.deliver``: the method's fields, the sender's ``user_id`` (None when
    the header has none) and the body."""

    channel: int
    consumer_tag: str
    delivery_tag: int
    exchange: str
    routing_key: str
    user_id: str | None
    body: bytes


@final
class Confirm(msgspec.Struct, frozen=True):
    """A publisher confirm: ``ack`` (else a nack) of ``delivery_tag``, and of every tag
    before it when ``multiple``."""

    channel: int
    delivery_tag: int
    multiple: bool
    ack: bool


class Incomplete(Exception):
    """The frame at this offset is recognised, but what it needs is not all in the buffer
    yet: wait for more bytes and read from the same offset."""


def _short_string(value: str) -> bytes:
    encoded = value.encode("utf-8")
    if len(encoded) > 255:
        raise ValueError(f"an AMQP short string holds at most 255 bytes, not {len(encoded)}")
    return bytes((len(encoded),)) + encoded


def _read_short_string(buffer: bytes, offset: int) -> tuple[str, int]:
    length = buffer[offset]
    start = offset + 1
    end = start + length
    # As pika does, a short string that is not UTF-8 is kept as it is; here, as latin-1,
    # so that it is still a str (reservoir's names are ASCII; such a message is refused
    # later by where it arrived).
    raw = buffer[start:end]
    try:
        return raw.decode("utf-8"), end
    except UnicodeDecodeError:
        return raw.decode("latin-1"), end


def publish_properties(user_id: str | None, app_id: str) -> bytes:
    """A content header's property flags and list with only ``user_id`` (when given) and
    ``app_id``: computed once per sending endpoint, put into every header it sends."""
    flags = _APP_ID | (_USER_ID if user_id is not None else 0)
    fields = (_short_string(user_id) if user_id is not None else b"") + _short_string(app_id)
    return struct.pack(">H", flags) + fields


def publish_frames(
    channel: int,
    exchange: str,
    routing_key: str,
    body: bytes,
    properties: bytes,
    *,
    mandatory: bool,
    body_max: int,
) -> tuple[bytes, int]:
    """The frames of one ``basic.publish``, joined, and how many they are. ``properties``
    comes from :func:`publish_properties`; ``body_max`` is the largest body frame payload,
    ``frame_max`` less :data:`FRAME_OVERHEAD`."""
    names = _short_string(exchange) + _short_string(routing_key)
    method_size = 4 + 2 + len(names) + 1
    parts = [
        _publish_start.pack(FRAME_METHOD, channel, method_size, BASIC_PUBLISH, 0),
        names,
        b"\x01\xce" if mandatory else b"\x00\xce",
        _header_frame_start.pack(FRAME_HEADER, channel, 12 + len(properties), BASIC, 0, len(body)),
        properties,
        b"\xce",
    ]
    count = 2
    length = len(body)
    if length <= body_max:
        if length:
            parts += (_frame_start.pack(FRAME_BODY, channel, length), body, b"\xce")
            count += 1
    else:
        for start in range(0, length, body_max):
            chunk = body[start : start + body_max]
            parts += (_frame_start.pack(FRAME_BODY, channel, len(chunk)), chunk, b"\xce")
            count += 1
    return b"".join(parts), count


def _frame_at(buffer: bytes, offset: int) -> tuple[int, int, int, int]:
    """The type, channel, payload offset and end (past the end octet) of the whole frame
    at ``offset``; :class:`Incomplete` when it is not all there."""
    if len(buffer) - offset < FRAME_OVERHEAD:
        raise Incomplete
    kind, channel, size = _frame_start.unpack_from(buffer, offset)
    end = offset + FRAME_OVERHEAD + size
    if end > len(buffer):
        raise Incomplete
    if buffer[end - 1] != FRAME_END:
        raise FrameError(f"a frame of type {kind} does not end with 0xCE")
    return kind, channel, offset + 7, end


def frame_end(buffer: bytes, offset: int) -> int:
    """The offset past the whole frame at ``offset`` (which must be all there)."""
    return offset + FRAME_OVERHEAD + int(_frame_start.unpack_from(buffer, offset)[2])


def hot_frames(buffer: bytes, offset: int) -> tuple[Deliver | Confirm | None, int, int]:
    """What starts at ``offset``: a whole :class:`Deliver` or a :class:`Confirm`, the
    offset past it and how many frames it spans; or ``(None, end, 1)`` for a whole frame
    this module does not read (the client library's to read, ``buffer[offset:end]``).
    Raises :class:`Incomplete` when more bytes are needed and :class:`FrameError` when the
    framing is broken."""
    kind, channel, payload, end = _frame_at(buffer, offset)
    if kind != FRAME_METHOD or end - payload < 5:
        return None, end, 1
    method = _method_id.unpack_from(buffer, payload)[0]
    if method == BASIC_DELIVER:
        return _deliver(buffer, channel, payload + 4, end)
    if method in (BASIC_ACK, BASIC_NACK):
        tag = _u64.unpack_from(buffer, payload + 4)[0]
        bits = buffer[payload + 12]
        return Confirm(channel, tag, bool(bits & 1), method == BASIC_ACK), end, 1
    return None, end, 1


def _deliver(buffer: bytes, channel: int, at: int, end: int) -> tuple[Deliver | None, int, int]:
    consumer_tag, at = _read_short_string(buffer, at)
    delivery_tag = _u64.unpack_from(buffer, at)[0]
    exchange, at = _read_short_string(buffer, at + 9)  # past the tag and ``redelivered``
    routing_key, _at = _read_short_string(buffer, at)
    kind, header_channel, payload, header_end = _frame_at(buffer, end)
    if kind != FRAME_HEADER or header_channel != channel:
        return None, end, 1  # out of order: the library's reader reports it
    _class, _weight, size, flags = _header_start.unpack_from(buffer, payload)
    if flags & _UNREAD:
        return None, end, 1  # a headers table or more flags: the library reads this one
    user_id = None
    if flags & _USER_ID:
        at = payload + 14
        if flags & _AHEAD_OF_USER_ID:  # not reservoir's own: step over what comes first
            for flag, field in _FIELDS:
                if flag == _USER_ID:
                    break
                if flags & flag:
                    # a short string is its length octet and that many bytes
                    at += 1 + buffer[at] if field == "s" else _WIDTH[field]
        user_id = _read_short_string(buffer, at)[0]
    pieces = []
    remaining = size
    next_frame = header_end
    while remaining > 0:
        kind, body_channel, payload, body_end = _frame_at(buffer, next_frame)
        if kind != FRAME_BODY or body_channel != channel:
            return None, end, 1
        pieces.append(buffer[payload : body_end - 1])
        remaining -= body_end - 1 - payload
        next_frame = body_end
    body = pieces[0] if len(pieces) == 1 else b"".join(pieces)
    return (
        Deliver(channel, consumer_tag, delivery_tag, exchange, routing_key, user_id, body),
        next_frame,
        2 + len(pieces),
    )
