"""benchmarks/placement_timeline.py splits each hop of a placement where its bytes cross a
socket: these tests give it stamps whose gaps are known and check the split it reports."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

BENCH, NODE_A, NODE_B = "100", "200", "300"
REQUEST_ID = "r1"


@pytest.fixture(scope="module")
def timeline(benchmark_script: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_script("placement_timeline")


def stamp(at_us: int, pid: str, what: str, kind: str) -> tuple[int, str, str, str]:
    return (at_us * 1000, pid, what, f"{kind} {REQUEST_ID}")


def a_placement() -> list[tuple[int, str, str, str]]:
    """Two probes written together, two offers (node B's last), an award and its acceptance,
    with every gap chosen so that each part of each hop has its own value."""
    return sorted(
        [
            stamp(0, BENCH, "hands", "request"),
            stamp(10, BENCH, "hands", "request"),
            stamp(40, BENCH, "writes", "request"),
            stamp(40, BENCH, "writes", "request"),
            stamp(140, NODE_A, "reads", "request"),
            stamp(150, NODE_B, "reads", "request"),
            stamp(165, NODE_A, "handles", "request"),
            stamp(170, NODE_B, "handles", "request"),
            stamp(200, NODE_A, "hands", "offer"),
            stamp(230, NODE_B, "hands", "offer"),
            stamp(210, NODE_A, "writes", "offer"),
            stamp(250, NODE_B, "writes", "offer"),
            stamp(300, BENCH, "reads", "offer"),
            stamp(390, BENCH, "reads", "offer"),
            stamp(310, BENCH, "handles", "offer"),
            stamp(400, BENCH, "handles", "offer"),
            stamp(450, BENCH, "hands", "award"),
            stamp(455, BENCH, "writes", "award"),
            stamp(600, NODE_B, "reads", "award"),
            stamp(607, NODE_B, "handles", "award"),
            stamp(650, NODE_B, "hands", "accepted"),
            stamp(680, NODE_B, "writes", "accepted"),
            stamp(800, BENCH, "reads", "accepted"),
            stamp(811, BENCH, "handles", "accepted"),
        ]
    )


def test_each_hop_is_split_into_sender_wire_and_reader(timeline: ModuleType) -> None:
    hops = timeline.hops_at_the_socket(a_placement(), REQUEST_ID, BENCH)

    assert hops == {
        # the first probe: handed at 0, written at 40, first read at 140, first handler 165
        "hop: probe -> node handler": (40.0, 100.0, 25.0),
        # the placement waits for the last offer: node B's, 230 -> 250 -> 390 -> 400
        "hop: last offer -> requestor handler": (20.0, 140.0, 10.0),
        "hop: award -> node handler": (5.0, 145.0, 7.0),
        "hop: accepted -> requestor handler": (30.0, 120.0, 11.0),
    }
    assert set(hops) <= set(timeline.STEPS)


def test_a_write_is_the_senders_and_a_read_the_readers(timeline: ModuleType) -> None:
    # a node process echoing the award's bytes does not make them the bench's write
    span = sorted([*a_placement(), stamp(441, NODE_A, "writes", "award")])

    hops = timeline.hops_at_the_socket(span, REQUEST_ID, BENCH)

    assert hops["hop: award -> node handler"] == (5.0, 145.0, 7.0)


def test_a_hop_not_stamped_at_the_socket_is_left_out(timeline: ModuleType) -> None:
    # another transport than pika's tuned plaintext one writes without the stamp
    span = [event for event in a_placement() if not event[3].startswith("accepted")]
    span += [stamp(650, NODE_B, "hands", "accepted"), stamp(811, BENCH, "handles", "accepted")]

    hops = timeline.hops_at_the_socket(sorted(span), REQUEST_ID, BENCH)

    assert "hop: accepted -> requestor handler" not in hops
    assert len(hops) == 3


def test_the_machines_wake_ups_are_measured_in_microseconds(timeline: ModuleType) -> None:
    woken = timeline.wake_ups(rounds=50)

    assert set(woken) == {"thread", "process"}
    # a wake-up is more than nothing and far less than the 10 ms no machine takes
    assert all(0 < woken[what] < 10_000 for what in woken)


def test_the_round_trips_hops_to_a_node_process_are_taken_from_their_stamps(
    timeline: ModuleType,
) -> None:
    def trip(at_us: int, pid: str, what: str) -> tuple[int, str, str, str]:
        return (at_us * 1000, pid, what, "round-trip -")

    events = [
        # to the echo in the bench's own process: not a hop between processes
        trip(0, BENCH, "writes"),
        trip(50, BENCH, "reads"),
        trip(60, BENCH, "writes"),
        trip(110, BENCH, "reads"),
        # to a node process: out 70, back 90
        trip(200, BENCH, "writes"),
        trip(270, NODE_A, "reads"),
        trip(280, NODE_A, "writes"),
        trip(370, BENCH, "reads"),
        stamp(400, BENCH, "reserve", "MainThread"),
    ]

    assert timeline.bench_pid_of(events) == BENCH
    assert timeline.round_trip_hops(events, BENCH) == [70.0, 90.0]
