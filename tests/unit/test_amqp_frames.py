"""The hot path's AMQP frames are byte for byte what pika writes, and read back what pika
reads: held against pika's own encoder and decoder."""

from __future__ import annotations

from typing import Any

import pika
import pika.callback
import pika.frame
import pika.spec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from reservoir.brokers.amqp import frames

names = st.text(
    st.characters(min_codepoint=32, max_codepoint=0x2FFF, exclude_categories=("Cs",)),
    max_size=60,
)
bodies = st.binary(max_size=700)
channels = st.integers(min_value=1, max_value=2047)
tags = st.integers(min_value=0, max_value=2**64 - 1)
#: small frames, so that bodies span several
FRAME_MAX = 4096


def pika_bytes(channel: int, method: object, properties: object = None, body: bytes = b"") -> bytes:
    """What pika's connection writes for a method and, with properties, its content."""
    out = [pika.frame.Method(channel, method).marshal()]
    if properties is not None:
        out.append(pika.frame.Header(channel, len(body), properties).marshal())
        step = FRAME_MAX - frames.FRAME_OVERHEAD
        for start in range(0, len(body), step):
            out.append(pika.frame.Body(channel, body[start : start + step]).marshal())
    return b"".join(out)


@given(channels, names, names, bodies, st.one_of(st.none(), names), names, st.booleans())
def test_a_publish_is_written_as_pika_writes_it(
    channel: int,
    exchange: str,
    routing_key: str,
    body: bytes,
    user_id: str | None,
    app_id: str,
    mandatory: bool,
) -> None:
    ours, count = frames.publish_frames(
        channel,
        exchange,
        routing_key,
        body,
        frames.publish_properties(user_id, app_id),
        mandatory=mandatory,
        body_max=FRAME_MAX - frames.FRAME_OVERHEAD,
    )
    theirs = pika_bytes(
        channel,
        pika.spec.Basic.Publish(exchange=exchange, routing_key=routing_key, mandatory=mandatory),
        pika.spec.BasicProperties(user_id=user_id, app_id=app_id),
        body,
    )
    assert ours == theirs
    assert count == 2 + -(-len(body) // (FRAME_MAX - frames.FRAME_OVERHEAD))


def test_a_name_longer_than_a_short_string_is_refused() -> None:
    with pytest.raises(ValueError, match="255"):
        frames.publish_properties(None, "x" * 256)


@given(
    channels,
    names,
    tags,
    st.booleans(),
    names,
    names,
    st.one_of(st.none(), names),
    st.one_of(st.none(), names),
    st.one_of(st.none(), st.integers(1, 2)),
    bodies,
)
def test_a_delivery_pika_writes_is_read_whole(
    channel: int,
    consumer_tag: str,
    delivery_tag: int,
    redelivered: bool,
    exchange: str,
    routing_key: str,
    user_id: str | None,
    app_id: str | None,
    delivery_mode: int | None,
    body: bytes,
) -> None:
    wire = pika_bytes(
        channel,
        pika.spec.Basic.Deliver(
            consumer_tag=consumer_tag,
            delivery_tag=delivery_tag,
            redelivered=redelivered,
            exchange=exchange,
            routing_key=routing_key,
        ),
        pika.spec.BasicProperties(
            user_id=user_id,
            app_id=app_id,
            delivery_mode=delivery_mode,
            content_type="application/json",
            timestamp=1_700_000_000,
        ),
        body,
    )
    value, end, _count = frames.hot_frames(wire, 0)
    assert value == frames.Deliver(
        channel, consumer_tag, delivery_tag, exchange, routing_key, user_id, body
    )
    assert end == len(wire)
    # cut anywhere short of the last byte, the delivery waits for the rest
    for cut in {0, 1, 7, len(wire) // 2, len(wire) - 1}:
        with pytest.raises(frames.Incomplete):
            frames.hot_frames(wire[:cut], 0)


def test_a_delivery_whose_header_carries_a_table_is_left_to_the_library() -> None:
    wire = pika_bytes(
        3,
        pika.spec.Basic.Deliver(consumer_tag="c", delivery_tag=1, exchange="x", routing_key="k"),
        pika.spec.BasicProperties(headers={"a": 1}, user_id="guest"),
        b"body",
    )
    value, end, _count = frames.hot_frames(wire, 0)
    assert value is None
    assert end == frames.frame_end(wire, 0)  # the method frame alone: pika reads on from there
    consumed, method = pika.frame.decode_frame(wire[:end])
    assert consumed == end
    assert isinstance(method.method, pika.spec.Basic.Deliver)


@given(channels, tags, st.booleans(), st.booleans())
def test_a_confirm_is_read_as_pika_reads_it(
    channel: int, delivery_tag: int, multiple: bool, ack: bool
) -> None:
    method = (
        pika.spec.Basic.Ack(delivery_tag=delivery_tag, multiple=multiple)
        if ack
        else pika.spec.Basic.Nack(delivery_tag=delivery_tag, multiple=multiple, requeue=True)
    )
    wire = pika_bytes(channel, method) + b"left over"
    value, end, _count = frames.hot_frames(wire, 0)
    assert value == frames.Confirm(channel, delivery_tag, multiple, ack)
    assert wire[end:] == b"left over"


def test_any_other_frame_is_left_to_the_library_whole() -> None:
    heartbeat = pika.frame.Heartbeat().marshal()
    close = pika_bytes(
        1, pika.spec.Channel.Close(reply_code=403, reply_text="no", class_id=60, method_id=40)
    )
    wire = heartbeat + close
    assert frames.hot_frames(wire, 0) == (None, len(heartbeat), 1)
    assert frames.hot_frames(wire, len(heartbeat)) == (None, len(wire), 1)


def test_broken_framing_is_an_error_not_a_wait() -> None:
    wire = bytearray(pika_bytes(1, pika.spec.Basic.Ack(delivery_tag=5)))
    wire[-1] = 0
    with pytest.raises(frames.FrameError, match="0xCE"):
        frames.hot_frames(bytes(wire), 0)


class FakeChannel:
    """Where pika's connection hands the frames of a channel it reads itself."""

    def __init__(self) -> None:
        self.frames: list[object] = []

    def _handle_content_frame(self, frame_value: object) -> None:
        self.frames.append(frame_value)


def open_connection(taken: list[object], *, take: bool = True) -> Any:
    """A HotPathConnection as an open one is, with no socket: bytes go in through
    ``_on_data_available`` as its transport would put them."""
    from reservoir.brokers.pika_broker import HotPathConnection

    connection: Any = HotPathConnection.__new__(HotPathConnection)
    connection.connection_state = HotPathConnection.CONNECTION_OPEN
    connection._frame_buffer = b""
    connection.bytes_received = 0
    connection.frames_received = 0
    connection.callbacks = pika.callback.CallbackManager()
    connection._heartbeat_checker = None
    connection._channels = {7: FakeChannel()}

    def hot(value: object) -> bool:
        taken.append(value)
        return take

    connection.hot = hot
    return connection


def stream() -> tuple[bytes, int]:
    """Deliveries, confirms, a heartbeat and a delivery pika must read, and their frames."""
    deliver = pika_bytes(
        7,
        pika.spec.Basic.Deliver(consumer_tag="c", delivery_tag=1, exchange="x", routing_key="k"),
        pika.spec.BasicProperties(user_id="guest", app_id="t"),
        b"a" * 5000,  # two body frames
    )
    with_table = pika_bytes(
        7,
        pika.spec.Basic.Deliver(consumer_tag="c", delivery_tag=2, exchange="x", routing_key="k"),
        pika.spec.BasicProperties(headers={"h": "v"}),
        b"b",
    )
    ack = pika_bytes(7, pika.spec.Basic.Ack(delivery_tag=9, multiple=True))
    heartbeat = pika.frame.Heartbeat().marshal()
    return deliver + ack + heartbeat + with_table + deliver, 4 + 1 + 1 + 3 + 4


@given(st.lists(st.integers(min_value=1, max_value=900), max_size=40))
def test_the_connection_reads_a_stream_the_same_however_it_is_cut(cuts: list[int]) -> None:
    wire, frame_count = stream()
    taken: list[object] = []
    connection = open_connection(taken)
    at = 0
    for size in [*cuts, len(wire)]:
        if at < len(wire):
            connection._on_data_available(wire[at : at + size])
            at += size
    assert [type(value).__name__ for value in taken] == ["Deliver", "Confirm", "Deliver"]
    assert taken[0].body == b"a" * 5000  # type: ignore[attr-defined]
    # pika read the heartbeat itself, and the delivery with a table frame by frame
    channel_frames = connection._channels[7].frames
    assert [type(f).__name__ for f in channel_frames] == ["Method", "Header", "Body"]
    assert connection.bytes_received == len(wire)
    assert connection.frames_received == frame_count
    assert connection._frame_buffer == b""


def test_a_frame_the_broker_declines_goes_pikas_way() -> None:
    taken: list[object] = []
    connection = open_connection(taken, take=False)
    wire, frame_count = stream()
    connection._on_data_available(wire)
    assert len(taken) == 3  # offered, and declined
    # every frame of the three deliveries and the confirm
    assert len(connection._channels[7].frames) == 4 + 1 + 3 + 4
    assert connection.frames_received == frame_count


def test_a_frame_whose_taker_raised_is_not_read_again() -> None:
    wire, _ = stream()
    taken: list[object] = []
    connection = open_connection(taken)

    def raising(value: object) -> bool:
        taken.append(value)
        raise RuntimeError("a bug in the taker")

    connection.hot = raising
    with pytest.raises(RuntimeError):
        connection._on_data_available(wire)
    # pika aborts the connection on an error from its protocol; were it to read on, the
    # delivery that failed would not come a second time
    first = frames.hot_frames(wire, 0)[1]
    assert connection._frame_buffer == wire[first:]
    assert connection.bytes_received == 0  # what failed is not counted as taken
