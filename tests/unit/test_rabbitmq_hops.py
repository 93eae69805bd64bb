"""benchmarks/rabbitmq_hops.py reads RabbitMQ's time per message off a capture of its
port: these tests write a capture whose gaps are known and check what it reads back."""

from __future__ import annotations

import struct
from collections.abc import Callable
from types import ModuleType

import pytest

BROKER, BENCH, NODE = 5672, 40001, 40002


@pytest.fixture(scope="module")
def hops(benchmark_script: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_script("rabbitmq_hops")


def body(kind: str, request_id: str) -> bytes:
    """A message's body frame, as the broker's port sees it."""
    json = f'{{"kind":"{kind}","request_id":"{request_id}","sender":"x"}}'.encode()
    return b"\x03\x00\x01" + struct.pack(">I", len(json)) + json + b"\xce"


ROUND_TRIP = b"\x03\x00\x01" + struct.pack(">I", 512) + b"inbox.a\n" + b"x" * 504 + b"\xce"
CONFIRM = b"\x01\x00\x01\x00\x00\x00\x0d\x00\x3c\x00\x50" + b"\x00" * 9 + b"\xce"


def capture(segments: list[tuple[int, int, int, bytes]], *, nanoseconds: bool = False) -> bytes:
    """A pcap file (Ethernet, IPv4) of ``(at_us, source port, destination port, payload)``."""
    magic = 0xA1B23C4D if nanoseconds else 0xA1B2C3D4
    out = struct.pack("<IHHiIII", magic, 2, 4, 0, 0, 262144, 1)
    for at_us, source, destination, payload in segments:
        tcp = struct.pack(">HHIIBBHHH", source, destination, 0, 0, 5 << 4, 0x18, 65535, 0, 0)
        ip = struct.pack(">BBHHHBBH4s4s", 0x45, 0, 20 + len(tcp) + len(payload), 0, 0, 64, 6, 0,
                         b"\x7f\x00\x00\x01", b"\x7f\x00\x00\x01")  # fmt: skip
        frame = b"\x00" * 12 + b"\x08\x00" + ip + tcp + payload
        fraction = at_us * 1000 if nanoseconds else at_us
        out += struct.pack("<IIII", 0, fraction, len(frame), len(frame)) + frame
    return out


def a_placement(request_id: str, start: int) -> list[tuple[int, int, int, bytes]]:
    """Each message 100 us in the broker plus its position (1-4), confirmed 10 us sooner."""
    segments = []
    at = start
    for step, (kind, sender, receiver) in enumerate(
        [
            ("request", BENCH, NODE),
            ("offer", NODE, BENCH),
            ("award", BENCH, NODE),
            ("accepted", NODE, BENCH),
        ],
        start=1,
    ):
        segments.append((at, sender, BROKER, body(kind, request_id)))
        segments.append((at + 90 + step, BROKER, sender, CONFIRM))
        segments.append((at + 100 + step, BROKER, receiver, body(kind, request_id)))
        at += 300
    return segments


def a_round_trip(start: int) -> list[tuple[int, int, int, bytes]]:
    """A round trip's body to an echo on another connection and back: 70 us in the broker
    on the way there (confirmed after 40), 50 on the way back."""
    return [
        (start, BENCH, BROKER, ROUND_TRIP),
        (start + 40, BROKER, BENCH, CONFIRM),
        (start + 70, BROKER, NODE, ROUND_TRIP),
        (start + 100, NODE, BROKER, ROUND_TRIP),
        (start + 150, BROKER, BENCH, ROUND_TRIP),
    ]


def test_the_broker_time_of_each_message_and_its_confirm(hops: ModuleType) -> None:
    segments = list(hops.read_pcap(capture(a_placement("r1", 0) + a_placement("r2", 2000))))

    times = hops.broker_times(segments, BROKER)

    assert times["request"] == [101.0, 101.0]
    assert times["offer"] == [102.0, 102.0]
    assert times["accepted"] == [104.0, 104.0]
    assert times["award confirmed"] == [93.0, 93.0]


def test_placements_that_overlap_are_left_out(hops: ModuleType) -> None:
    # r2 starts while r1 is under way, r3 long after both
    segments = a_placement("r1", 0) + a_placement("r2", 500) + a_placement("r3", 5000)

    times = hops.broker_times(list(hops.read_pcap(capture(sorted(segments)))), BROKER)

    assert times["request"] == [101.0]


def test_a_round_trip_to_an_echo_on_another_connection(hops: ModuleType) -> None:
    # a request after it carries no round trip's body: not counted
    segments = [*a_round_trip(0), (5000, BENCH, BROKER, body("request", "r9"))]

    times = hops.broker_times(list(hops.read_pcap(capture(segments, nanoseconds=True))), BROKER)

    assert times["round trip"] == [70.0, 50.0]
    assert times["round trip confirmed"] == [40.0]
    assert "request" not in times


def test_a_file_that_is_not_a_capture_is_named_as_such(hops: ModuleType) -> None:
    with pytest.raises(hops.CaptureError, match="not a pcap file"):
        list(hops.read_pcap(b"# reservoir\n" * 4))


def test_a_round_trip_to_an_echo_on_the_same_connection_is_left_out(hops: ModuleType) -> None:
    # the bench's own echo: in from the bench, out to the bench, and back the same way
    segments = [
        (0, BENCH, BROKER, ROUND_TRIP),
        (70, BROKER, BENCH, ROUND_TRIP),
        (100, BENCH, BROKER, ROUND_TRIP),
        (150, BROKER, BENCH, ROUND_TRIP),
    ]

    times = hops.broker_times(list(hops.read_pcap(capture(segments))), BROKER)

    assert times.get("round trip", []) == []
