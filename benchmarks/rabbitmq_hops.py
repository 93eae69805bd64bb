"""RabbitMQ's own time for each message of a sequential placement, read off the loopback.

    tcpdump -i lo -s 0 -w run.pcap 'tcp port 5672' &     # as root; then
    python benchmarks/placement_timeline.py --nodes 50 --placements 500
    kill -INT %1
    python benchmarks/rabbitmq_hops.py run.pcap [--port 5672] [--json]

``benchmarks/placement_timeline.py`` splits a hop where its bytes leave one process and
reach the next; the middle part (written -> read) is the kernel, RabbitMQ and the reader
woken, together. A capture of the broker's port splits it again: for each message, the
first TCP segment carrying it to the broker and the first carrying it away from there
(to a consumer) are RabbitMQ's own time for it (reading, routing, the queue, the
consumer's channel, its writer, and its own wake-ups between them), with only the
loopback device on either side. The publisher confirm each message brings back is timed
the same way (the first ``basic.ack`` to the publisher's connection after the message).

Sequential placements are those whose four messages in a row (``request``, ``offer``,
``award``, ``accepted``) reached the broker with no other placement's in between; the
round trips are the bench's (``measure_round_trips``: a body of ``x`` to 512 bytes, one in
flight), each an echo to a node process and back. Both come from the same capture, so
they saw the same machine. What it showed: docs/performance.md, "Open questions".
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
import struct
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

#: the placement's messages in the order they go, each once per placement
PLACEMENT = ("request", "offer", "award", "accepted")
_KIND = re.compile(rb'"kind":"(\w+)"')
_ID = re.compile(rb'"request_id":"(\w+)"')
#: what ends a round trip's body in its frame: its padding, then the frame's end octet
_ROUND_TRIP_END = b"x" * 16 + b"\xce"
#: a publisher confirm's method frame from its type octet: channel, size, basic.ack
_BASIC_ACK = re.compile(rb"\x01..\x00\x00\x00\x0d\x00\x3c\x00\x50", re.DOTALL)
#: link-layer header lengths of the capture types a loopback capture comes in
_LINK_HEADER = {1: 14, 113: 16, 276: 20}  # Ethernet, Linux cooked, Linux cooked v2


class CaptureError(ValueError):
    """The file is not a capture this script reads."""


class Segment(NamedTuple):
    """One TCP segment with data: when (microseconds), its ports, its payload."""

    at_us: float
    source_port: int
    destination_port: int
    payload: bytes


def read_pcap(data: bytes) -> Iterator[Segment]:
    """The TCP segments with data of a classic pcap capture (tcpdump's ``-w``) over IPv4."""
    if len(data) < 24:
        raise CaptureError("too short for a pcap file")
    magic = data[:4]
    if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1"):
        order = "<"
    elif magic in (b"\xa1\xb2\xc3\xd4", b"\xa1\xb2\x3c\x4d"):
        order = ">"
    else:
        raise CaptureError("not a pcap file (a pcapng one? write it with tcpdump -w)")
    nanoseconds = magic in (b"\x4d\x3c\xb2\xa1", b"\xa1\xb2\x3c\x4d")
    link_type = struct.unpack(order + "I", data[20:24])[0] & 0xFFFF
    if link_type not in _LINK_HEADER:
        raise CaptureError(f"link type {link_type} is not one this script reads")
    skip = _LINK_HEADER[link_type]
    record = struct.Struct(order + "IIII")
    offset = 24
    while offset + record.size <= len(data):
        seconds, fraction, captured, _length = record.unpack_from(data, offset)
        offset += record.size
        frame = data[offset : offset + captured]
        offset += captured
        ip = frame[skip:]
        if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 6:  # IPv4 carrying TCP only
            continue
        tcp = ip[(ip[0] & 0x0F) * 4 :]
        source_port, destination_port = struct.unpack(">HH", tcp[:4])
        payload = tcp[(tcp[12] >> 4) * 4 :]
        if payload:
            at_us = seconds * 1e6 + (fraction / 1e3 if nanoseconds else fraction)
            yield Segment(at_us, source_port, destination_port, bytes(payload))


def messages_in(payload: bytes) -> list[str]:
    """The messages a segment carries: ``"<kind> <request id>"`` for each reservoir message,
    ``"round trip"`` for each of the bench's round-trip bodies."""
    kinds = list(_KIND.finditer(payload))
    found = []
    for index, kind in enumerate(kinds):
        end = kinds[index + 1].start() if index + 1 < len(kinds) else len(payload)
        request_id = _ID.search(payload, kind.end(), end)
        found.append(
            f"{kind.group(1).decode()} {request_id.group(1).decode() if request_id else '-'}"
        )
    return found + ["round trip"] * payload.count(_ROUND_TRIP_END)


def broker_times(segments: list[Segment], port: int) -> dict[str, list[float]]:
    """Microseconds from a message's first segment to the broker to its first segment from
    it, by kind for the sequential placements' messages and ``"round trip"`` for the
    round trips' bodies, and ``"<kind> confirmed"`` for the publisher confirms."""
    arrived: dict[str, tuple[float, int]] = {}
    left: dict[str, float] = {}
    confirms: dict[int, list[float]] = defaultdict(list)
    trips: list[tuple[float, bool, int, int]] = []  # at, to the broker, client port, bodies
    for segment in segments:
        to_broker = segment.destination_port == port
        client = segment.source_port if to_broker else segment.destination_port
        if not to_broker and _BASIC_ACK.match(segment.payload):
            confirms[client].append(segment.at_us)
        carried = messages_in(segment.payload)
        bodies = carried.count("round trip")
        if bodies:
            trips.append((segment.at_us, to_broker, client, bodies))
        for message in carried:
            if message == "round trip":
                continue
            if to_broker:
                arrived.setdefault(message, (segment.at_us, client))
            else:
                left.setdefault(message, segment.at_us)
    times: dict[str, list[float]] = defaultdict(list)
    for request_id in sequential_placements(arrived):
        for kind in PLACEMENT:
            message = f"{kind} {request_id}"
            if message not in left:
                continue
            at, client = arrived[message]
            times[kind].append(left[message] - at)
            times[f"{kind} confirmed"] += _confirmed_after(confirms[client], at)
    for at, client, gone in round_trips(trips):
        times["round trip"].append(gone - at)
        times["round trip confirmed"] += _confirmed_after(confirms[client], at)
    return dict(times)


def _confirmed_after(acks: list[float], at: float) -> list[float]:
    """How long after ``at`` the first of a connection's confirms (``acks``, in time order)
    came: one figure, or none when none came after it."""
    first = bisect.bisect_left(acks, at)
    return [acks[first] - at] if first < len(acks) else []


def sequential_placements(arrived: dict[str, tuple[float, int]]) -> list[str]:
    """The request ids whose placement's messages reached the broker with no other
    placement's message in between."""
    spans = []
    for message, (at, _client) in arrived.items():
        kind, _, request_id = message.partition(" ")
        if kind != "request":
            continue
        ends = [arrived.get(f"{later} {request_id}") for later in PLACEMENT[1:]]
        if all(end is not None for end in ends):
            spans.append((at, max(end[0] for end in ends if end is not None), request_id))
    spans.sort()
    alone = []
    for index, (start, end, request_id) in enumerate(spans):
        after_previous = index == 0 or start > spans[index - 1][1]
        before_next = index + 1 == len(spans) or end < spans[index + 1][0]
        if after_previous and before_next:
            alone.append(request_id)
    return alone


def round_trips(trips: list[tuple[float, bool, int, int]]) -> list[tuple[float, int, float]]:
    """Each body of the round trips to an echo on another connection (a body in from A,
    out to B, in from B, out to A, one body a segment): when it reached the broker, from
    which client port, and when it left."""
    bodies = []
    for out, there, echoed, back in zip(trips, trips[1:], trips[2:], trips[3:], strict=False):
        if any(step[3] != 1 for step in (out, there, echoed, back)):
            continue
        if (out[1], there[1], echoed[1], back[1]) != (True, False, True, False):
            continue
        if out[2] == back[2] != there[2] == echoed[2]:
            bodies += [(out[0], out[2], there[0]), (echoed[0], echoed[2], back[0])]
    return bodies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("capture", type=Path, help="a pcap file of the broker's port")
    parser.add_argument("--port", type=int, default=5672, help="the broker's AMQP port")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    try:
        segments = list(read_pcap(args.capture.read_bytes()))
    except (OSError, CaptureError) as error:
        print(f"rabbitmq_hops: {args.capture}: {error}", file=sys.stderr)
        return 2
    times = broker_times(segments, args.port)
    if not times.get("request") or not times.get("round trip"):
        print(
            "rabbitmq_hops: no sequential placement or no round trip in the capture",
            file=sys.stderr,
        )
        return 1
    medians = {what: round(statistics.median(values), 1) for what, values in times.items()}
    if args.json:
        counts = {what: len(values) for what, values in times.items()}
        print(json.dumps({"p50_us": medians, "count": counts}))
        return 0
    print(f"{len(times['request'])} sequential placements; RabbitMQ's time, in -> out (us)")
    print(f"{'':22}{'p10':>7}{'p50':>7}{'p90':>7}")
    for what, values in times.items():
        deciles = statistics.quantiles(values, n=10) if len(values) > 1 else values * 9
        print(f"{what:22}{deciles[0]:7.0f}{deciles[4]:7.0f}{deciles[8]:7.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
