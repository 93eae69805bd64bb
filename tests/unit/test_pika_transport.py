"""The pika driver's socket tuning (:func:`reservoir.brokers.pika_broker.tune_transport`), on pika's
own plaintext transport over a socket pair: frames waiting together leave in one write of
at most ``SEND_BYTES``, and a readable socket is read until a read comes back short."""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterator
from typing import Any

import pytest
from pika.adapters.utils import io_services_utils

from reservoir.brokers.pika_broker import (
    RECV_BYTES,
    SEND_BYTES,
    TunedPlaintextTransport,
    tune_transport,
)

PlaintextTransport: Any = io_services_utils._AsyncPlaintextTransport


class CountingSocket:
    """A non-blocking socket that records the size of every send and recv; it sends at
    most ``send_limit`` bytes at a time, and its first ``sends_refused`` sends fail with
    EAGAIN, to play a full socket buffer."""

    def __init__(
        self, sock: socket.socket, send_limit: int | None = None, sends_refused: int = 0
    ) -> None:
        self.sock = sock
        self.send_limit = send_limit
        self.sends_refused = sends_refused
        self.sends: list[int] = []
        #: bytes each recv returned, -1 for one that would have blocked
        self.recvs: list[int] = []

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, data: bytes) -> int:
        if self.sends_refused:
            self.sends_refused -= 1
            raise BlockingIOError(errno.EAGAIN, "the socket buffer is full")
        sent = self.sock.send(data[: self.send_limit] if self.send_limit else data)
        self.sends.append(sent)
        return sent

    def recv(self, max_bytes: int) -> bytes:
        try:
            data = self.sock.recv(max_bytes)
        except BlockingIOError:
            self.recvs.append(-1)  # a read that found nothing
            raise
        self.recvs.append(len(data))
        return data


class FakeIOServices:
    def __init__(self) -> None:
        self.writer: object | None = None
        self.reader: object | None = None

    def set_reader(self, _fd: int, callback: object) -> None:
        self.reader = callback

    def remove_reader(self, _fd: int) -> None:
        self.reader = None

    def set_writer(self, _fd: int, callback: object) -> None:
        self.writer = callback

    def remove_writer(self, _fd: int) -> None:
        self.writer = None

    def add_callback_threadsafe(self, _callback: object) -> None:
        pass  # pika's abort, after an end of file: nothing to run here


class RecordingProtocol:
    def __init__(self, *, aborts: bool = False, answers: tuple[bytes, ...] = ()) -> None:
        self.received = bytearray()
        self.eof = False
        self.aborts = aborts
        #: what it writes back for each read, as a node answers the messages it read
        self.answers = answers
        self.transport: Any = None

    def data_received(self, data: bytes) -> None:
        self.received += data
        for answer in self.answers:
            self.transport.write(answer)
        if self.aborts:
            self.transport.abort()  # as pika's connection does on a bad frame

    def eof_received(self) -> bool:
        self.eof = True
        return False

    def connection_lost(self, _error: BaseException | None) -> None:
        pass


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    theirs.settimeout(5)  # bytes gone missing fail the test rather than hang it
    yield ours, theirs
    ours.close()
    theirs.close()


def tuned(
    ours: socket.socket,
    send_limit: int | None = None,
    *,
    sends_refused: int = 0,
    aborts: bool = False,
    answers: tuple[bytes, ...] = (),
) -> tuple[Any, CountingSocket, RecordingProtocol, FakeIOServices]:
    counting = CountingSocket(ours, send_limit, sends_refused)
    protocol, io = RecordingProtocol(aborts=aborts, answers=answers), FakeIOServices()
    transport = PlaintextTransport(counting, protocol, io)
    protocol.transport = transport
    assert tune_transport(transport)
    assert type(transport) is TunedPlaintextTransport
    return transport, counting, protocol, io


def read_all(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        data += sock.recv(size - len(data))
    return bytes(data)


def test_frames_written_together_leave_in_one_send(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, counting, _, io = tuned(ours)
    for frame in (b"method", b"header", b"body"):
        transport.write(frame)

    transport._on_socket_writable()

    assert counting.sends == [len(b"methodheaderbody")]
    assert read_all(theirs, 16) == b"methodheaderbody"
    assert io.writer is None  # nothing left: pika stops watching for writability
    assert transport.get_write_buffer_size() == 0


def test_a_long_backlog_leaves_in_writes_of_at_most_send_bytes_in_order(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, counting, _, _ = tuned(ours)
    frames = [bytes([index % 256]) * 1000 for index in range(150)]
    for frame in frames:
        transport.write(frame)

    transport._on_socket_writable()

    assert max(counting.sends) <= SEND_BYTES
    assert len(counting.sends) == -(-150_000 // (SEND_BYTES // 1000 * 1000))
    assert read_all(theirs, 150_000) == b"".join(frames)
    assert transport.get_write_buffer_size() == 0


def test_a_partial_send_keeps_the_rest_in_order_for_the_next_write(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, counting, _, io = tuned(ours, send_limit=5)
    transport.write(b"abcdefgh")
    transport.write(b"ijkl")

    transport._on_socket_writable()

    assert counting.sends == [5, 5, 2]
    assert read_all(theirs, 12) == b"abcdefghijkl"
    assert io.writer is None
    assert transport.get_write_buffer_size() == 0


def test_a_send_refused_with_eagain_keeps_every_byte_for_the_next_writable_event(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, counting, _, io = tuned(ours, sends_refused=1)
    for frame in (b"method", b"header", b"body"):
        transport.write(frame)

    transport._on_socket_writable()  # refused: nothing went out
    assert counting.sends == []
    assert transport.get_write_buffer_size() == 16
    assert io.writer is not None  # pika still waits to write
    transport.write(b"next")
    transport._on_socket_writable()

    assert read_all(theirs, 20) == b"methodheaderbodynext"
    assert transport.get_write_buffer_size() == 0
    assert io.writer is None


def test_a_readable_socket_is_read_once_when_the_read_comes_back_short(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, counting, protocol, _ = tuned(ours)
    theirs.sendall(b"one" + b"two" + b"three")

    transport._on_socket_readable()

    assert bytes(protocol.received) == b"onetwothree"
    assert counting.recvs == [11]  # pika alone reads again and finds nothing


def test_a_read_that_fills_the_buffer_is_followed_by_another(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, counting, protocol, _ = tuned(ours)
    payload = bytes(range(256)) * (RECV_BYTES // 256) + b"tail"
    theirs.sendall(payload)

    transport._on_socket_readable()

    assert bytes(protocol.received) == payload
    assert counting.recvs[0] == RECV_BYTES
    assert sum(counting.recvs) == len(payload)


def test_one_readable_event_reads_no_more_than_pikas_limit_and_the_next_reads_the_rest(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, counting, protocol, _ = tuned(ours)
    payload = bytes(range(256)) * 586  # 150,016 bytes: more than the limit of 100 KiB
    theirs.sendall(payload)

    transport._on_socket_readable()
    first = len(protocol.received)
    transport._on_socket_readable()

    limit = PlaintextTransport._MAX_CONSUME_BYTES
    assert limit <= first < limit + RECV_BYTES
    assert bytes(protocol.received) == payload
    assert counting.recvs == [RECV_BYTES, RECV_BYTES, len(payload) - 2 * RECV_BYTES]


def test_a_transport_aborted_while_handling_a_read_reads_no_more(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, counting, protocol, _ = tuned(ours, aborts=True)
    theirs.sendall(b"x" * (2 * RECV_BYTES))

    transport._on_socket_readable()

    assert counting.recvs == [RECV_BYTES]
    assert len(protocol.received) == RECV_BYTES


def test_the_peer_closing_still_reaches_pika_as_end_of_file(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, _, protocol, _ = tuned(ours)
    theirs.shutdown(socket.SHUT_WR)

    transport._on_socket_readable()

    assert protocol.eof


def test_another_transport_class_is_left_as_it_is(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, _ = pair

    class OtherTransport(PlaintextTransport):  # type: ignore[misc]
        """as pika's SSL transport is to the tuning: not the plaintext one"""

    transport = OtherTransport(CountingSocket(ours), RecordingProtocol(), FakeIOServices())
    assert not tune_transport(transport)
    assert type(transport) is OtherTransport


def test_a_transport_of_another_shape_is_left_as_it_is() -> None:
    class Unknown:
        pass

    unknown = Unknown()
    assert not tune_transport(unknown)
    assert not tune_transport(None)
    assert vars(unknown) == {}


def test_what_is_written_while_reading_leaves_in_one_send_when_the_read_ends(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, counting, _, io = tuned(ours, answers=(b"offer", b"status"))
    theirs.sendall(b"request")

    transport._on_socket_readable()

    assert counting.sends == [len(b"offerstatus")]  # at once, not after a writable event
    assert read_all(theirs, 11) == b"offerstatus"
    assert io.writer is None  # never watched for writability
    assert transport.get_write_buffer_size() == 0


def test_what_the_socket_will_not_take_at_the_end_of_a_read_waits_for_writability(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, counting, _, io = tuned(ours, sends_refused=1, answers=(b"offer",))
    theirs.sendall(b"request")

    transport._on_socket_readable()  # the send is refused: EAGAIN

    assert counting.sends == []
    assert transport.get_write_buffer_size() == 5
    assert io.writer is not None
    transport._on_socket_writable()
    assert counting.sends == [5]
    assert read_all(theirs, 5) == b"offer"
    assert io.writer is None


def test_a_hold_begun_behind_a_waiting_backlog_leaves_it_to_the_writable_event(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, counting, _, io = tuned(ours, answers=(b"answer",))
    transport.write(b"earlier")  # pika now watches for writability
    assert io.writer is not None
    theirs.sendall(b"request")

    transport._on_socket_readable()

    assert counting.sends == []  # nothing jumps the queue, nothing is sent twice
    transport._on_socket_writable()
    assert read_all(theirs, 13) == b"earlieranswer"
    assert io.writer is None


def test_holds_nest_and_only_the_outermost_release_sends(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, counting, _, io = tuned(ours)
    transport.hold_writes()
    transport.hold_writes()
    transport.write(b"a")
    transport.release_writes()
    assert counting.sends == []
    transport.write(b"b")
    transport.release_writes()
    assert counting.sends == [2]
    assert read_all(theirs, 2) == b"ab"
    assert io.writer is None


class FailingSocket(CountingSocket):
    """A socket whose peer went away: after ``reads`` good reads every recv fails with
    ``read_error``, and every send with EPIPE."""

    def __init__(self, sock: socket.socket, reads: int, read_error: OSError) -> None:
        super().__init__(sock)
        self.reads = reads
        self.read_error = read_error

    def recv(self, max_bytes: int) -> bytes:
        if self.reads == 0:
            raise self.read_error
        self.reads -= 1
        return self.sock.recv(max_bytes)

    def send(self, data: bytes) -> int:
        raise BrokenPipeError(errno.EPIPE, "the peer is gone")


def failing(ours: socket.socket, read_error: OSError) -> tuple[Any, FakeIOServices]:
    protocol, io = RecordingProtocol(answers=(b"offer",)), FakeIOServices()
    transport = PlaintextTransport(FailingSocket(ours, 1, read_error), protocol, io)
    protocol.transport = transport
    assert tune_transport(transport)
    return transport, io


def test_a_read_that_fails_after_answers_were_written_aborts_the_transport_once(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, _ = failing(ours, ConnectionResetError(errno.ECONNRESET, "reset by peer"))
    theirs.sendall(b"x" * RECV_BYTES)  # a full read, so the transport reads again

    transport._on_socket_readable()  # the second read fails: pika aborts, flushing nothing

    assert transport._state == PlaintextTransport._STATE_FAILED
    assert transport.get_write_buffer_size() == 5  # the answer was never sent


def test_a_read_that_would_block_still_sends_what_was_answered(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    transport, io = failing(ours, BlockingIOError(errno.EAGAIN, "would block"))
    theirs.sendall(b"x" * RECV_BYTES)

    transport._on_socket_readable()  # EAGAIN: nothing more to read, the connection lives

    # the answer went to send() at once (here the send fails: the transport is aborted)
    assert transport._state == PlaintextTransport._STATE_FAILED
    assert io.writer is None
