"""What the messages of one placement cost to build, encode and decode through the wire
codec (:class:`reservoir.runtime.wire.Codec`, unsigned), against the standard library's
``json.loads`` of one fixed 300-byte document measured in the same run.

    python benchmarks/codec.py [--rounds N]

Prints, per message kind and for the seven messages of a placement together (a probe, an
offer, a decline, an award, an acceptance, a release, a status), microseconds per call
(best of five repeats), and the placement's figures as multiples of the fixed
``json.loads``: those hold across a noisy machine's swings. It uses only the messages'
constructors and the codec, so the same command times another build of the project: put
that build's checkout first on ``PYTHONPATH`` and run the two in turns.
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable
from typing import Any

from reservoir.protocol import messages as m
from reservoir.runtime.wire import Codec

ROOM = {"VCPU": 4, "MEMORY_MB": 13, "DISK_GB": 7}
ALLOCATION = {"allocation_id": "res-6c1f0e2a/0", "resources": {"VCPU": 2, "MEMORY_MB": 4096}}
ENVELOPE = {"request_id": "4be0c5b0a9e34f7c9d1e0f6a2b3c4d5e", "sender": "requestor-a1b2c3d4"}
NODE = {"request_id": ENVELOPE["request_id"], "sender": "node-0042"}

#: (kind, class, fields): the messages of a placement, as the machines build them
PLACEMENT: list[tuple[str, Any, dict[str, Any]]] = [
    ("probe", m.ReservationRequest, {
        **ENVELOPE, "reply_to": "requestor-a1b2c3d4", "tier": 10, "attempt": 1,
        "ttl_s": 5.0, "resources": {"VCPU": 2, "MEMORY_MB": 4096, "DISK_GB": 20},
        "probed_node": "node-0042"}),
    ("offer", m.Offer, {
        **NODE, "reply_to": "node-0042", "reservation_id": "res-6c1f0e2a", "attempt": 1,
        "slots": 1, "utilisation": 0.42, "score": 0.1, "ttl_s": 5.0, "room": ROOM}),
    ("decline", m.Decline, {**NODE, "reply_to": "node-0042", "attempt": 1, "room": ROOM}),
    ("award", m.Award, {
        **ENVELOPE, "reply_to": "requestor-a1b2c3d4", "reservation_id": "res-6c1f0e2a",
        "slots": 1}),
    ("accepted", m.Accepted, {
        **NODE, "reply_to": "node-0042", "reservation_id": "res-6c1f0e2a",
        "allocations": (m.AllocationInfo(**ALLOCATION),), "room": ROOM}),
    ("release", m.Release, {**ENVELOPE, "reservation_id": "res-77aa0b1c"}),
    ("status", m.NodeStatus, {
        "sender": "node-0042", "reply_to": "node-0042", "tier": 20, "room": ROOM}),
]  # fmt: skip


#: the baseline: the same bytes whatever the build (the shape of an offer, as JSON)
REFERENCE = json.dumps(
    {"kind": "offer", "version": 1, **NODE, "reply_to": "node-0042",
     "reservation_id": "res-6c1f0e2a", "attempt": 1, "slots": 1, "utilisation": 0.42,
     "score": 0.1, "ttl_s": 5.0, "group_members": 0, "room": ROOM, "pad": "x" * 40}
).encode()  # fmt: skip


def best_us(call: Callable[[], object], number: int) -> float:
    return min(timeit.repeat(call, number=number, repeat=5)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20_000, help="calls per repeat")
    rounds = parser.parse_args().rounds
    codec = Codec()
    totals = {"build": 0.0, "encode": 0.0, "decode": 0.0, "json.loads": 0.0}
    reference_us = best_us(lambda: json.loads(REFERENCE), rounds)
    print(f"{'message':<10} {'bytes':>6} {'build':>8} {'encode':>8} {'decode':>8} "
          f"{'json.loads':>11}   (us per call)")  # fmt: skip
    for kind, cls, fields in PLACEMENT:
        message = cls(**fields)
        body = codec.encode(message, 0.0, destination="tier.10")
        figures = {
            "build": best_us(lambda cls=cls, fields=fields: cls(**fields), rounds),
            "encode": best_us(
                lambda message=message: codec.encode(message, 0.0, destination="tier.10"),
                rounds,
            ),
            "decode": best_us(
                lambda body=body: codec.decode(body, 0.0, destination="tier.10"), rounds
            ),
            "json.loads": best_us(lambda body=body: json.loads(body), rounds),
        }
        for name, us in figures.items():
            totals[name] += us
        print(
            f"{kind:<10} {len(body):>6} "
            + " ".join(f"{figures[n]:>8.2f}" for n in ("build", "encode", "decode"))
            + f" {figures['json.loads']:>11.2f}"
        )
    print(
        f"{'placement':<10} {'':>6} "
        + " ".join(f"{totals[n]:>8.2f}" for n in ("build", "encode", "decode"))
        + f" {totals['json.loads']:>11.2f}"
    )
    print(
        f"placement, as multiples of json.loads of the {len(REFERENCE)}-byte reference "
        f"({reference_us:.2f} us): build x{totals['build'] / reference_us:.1f}, "
        f"encode x{totals['encode'] / reference_us:.1f}, "
        f"decode x{totals['decode'] / reference_us:.1f}, "
        f"all three x{sum(totals[n] for n in ('build', 'encode', 'decode')) / reference_us:.1f}"
    )


if __name__ == "__main__":
    main()
