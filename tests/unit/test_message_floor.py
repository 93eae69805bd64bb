"""benchmarks/message_floor.py sends a placement's seven messages with no work: these tests
hold its requestor and node sides to the protocol's exchange, and its message sizes to the
protocol's own messages."""

from __future__ import annotations

import argparse
import statistics
import threading
import uuid
from collections import defaultdict
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest

from reservoir.runtime import wire


@pytest.fixture(scope="module")
def floor(benchmark_script: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_script("message_floor")


def kinds(floor: ModuleType, messages: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
    return [(node, floor.read(body)[0]) for node, body in messages]


def test_a_placement_asks_two_different_nodes(floor: ModuleType) -> None:
    placements = floor.Placements(nodes=2)

    requests = placements.start()

    assert sorted(kinds(floor, requests)) == [(0, floor.REQUEST), (1, floor.REQUEST)]


def test_nothing_is_decided_until_both_nodes_have_offered(floor: ModuleType) -> None:
    placements = floor.Placements(nodes=5)
    placements.start()

    assert placements.offered(0, node=3) == []
    decided = placements.offered(0, node=1)

    assert sorted(kinds(floor, decided)) == [(1, floor.RELEASE), (3, floor.AWARD)]
    assert placements.faults == []


def test_a_placement_ends_when_its_awarded_node_accepts(floor: ModuleType) -> None:
    placements = floor.Placements(nodes=5)
    done = threading.Event()
    placements.start(done)
    placements.offered(0, node=3)
    placements.offered(0, node=1)

    assert placements.accepted_by(0, node=3) is done
    assert (placements.accepted, placements.in_flight(), placements.faults) == (1, 0, [])


def test_an_acceptance_before_the_award_is_a_fault(floor: ModuleType) -> None:
    placements = floor.Placements(nodes=5)
    placements.start()
    placements.offered(0, node=3)

    placements.accepted_by(0, node=3)

    assert placements.accepted == 0
    assert placements.faults == ["acceptance of placement 0 by node 3: unexpected"]


def test_an_acceptance_by_the_released_node_is_a_fault(floor: ModuleType) -> None:
    placements = floor.Placements(nodes=5)
    placements.start()
    placements.offered(0, node=3)
    placements.offered(0, node=1)

    placements.accepted_by(0, node=1)

    assert placements.accepted == 0
    assert placements.faults == ["acceptance of placement 0 by node 1: unexpected"]


def test_a_third_offer_is_a_fault(floor: ModuleType) -> None:
    placements = floor.Placements(nodes=5)
    placements.start()
    placements.offered(0, node=3)
    placements.offered(0, node=1)

    assert placements.offered(0, node=2) == []
    assert placements.faults == ["offer for placement 0 from node 2: unexpected"]


def test_a_node_offers_for_a_request_accepts_an_award_and_drops_a_release(
    floor: ModuleType,
) -> None:
    answers = [
        floor.node_answer(floor.body(kind, 7, 0), node=4)
        for kind in (floor.REQUEST, floor.AWARD, floor.RELEASE)
    ]

    assert [floor.read(a) if a else None for a in answers] == [
        (floor.OFFER, 7, 4),
        (floor.ACCEPTED, 7, 4),
        None,
    ]


def test_every_body_has_its_kinds_size(floor: ModuleType) -> None:
    assert {kind: len(floor.body(kind, 1, 2)) for kind in floor.SIZES} == floor.SIZES


def test_the_sizes_are_those_of_the_protocols_own_messages(
    floor: ModuleType,
    benchmark_script: Callable[[str], ModuleType],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The protocol's messages, as the runtime encodes them in a few placements; the
    floor's sizes are the bench's (longer node and requestor names than these), so within
    a third."""
    sizes: dict[str, list[int]] = defaultdict(list)
    encode = wire.Codec.encode

    def recording(self: Any, message: Any, wall_s: float, *, destination: str) -> bytes:
        body: bytes = encode(self, message, wall_s, destination=destination)
        sizes[type(message).__name__].append(len(body))
        return body

    monkeypatch.setattr(wire.Codec, "encode", recording)
    monkeypatch.setattr(uuid, "uuid4", uuid.uuid4)  # the run seeds it: put it back after
    benchmark_script("runtime_instructions").run(20, 10)

    names = {
        floor.REQUEST: "ReservationRequest",
        floor.OFFER: "Offer",
        floor.AWARD: "Award",
        floor.RELEASE: "Release",
        floor.ACCEPTED: "Accepted",
    }
    for kind, name in names.items():
        assert statistics.median(sizes[name]) == pytest.approx(floor.SIZES[kind], rel=1 / 3)


def test_the_bound_is_each_floor_and_the_work_over_the_benchs_rabbitmq(
    floor: ModuleType,
) -> None:
    table = {
        floor.FLOORS["io"]: {"own_cpu_ms_per_placement": 0.3, "broker cpu_ms_per_placement": 0.5},
        floor.FLOORS["threads"]: {
            "own_cpu_ms_per_placement": 0.45,
            "broker cpu_ms_per_placement": 0.5,
        },
        floor.WORK: {"own_cpu_ms_per_placement": 0.25},
        floor.BENCH: {"own_cpu_ms_per_placement": 1.0, "broker cpu_ms_per_placement": 0.7},
    }

    assert floor.bound(table) == {"io": 0.79, "threads": 1.0}
    table[floor.WORK_WOKEN] = {"own_cpu_ms_per_placement": 0.6}
    woken = {"io, woken": 1.29, "threads, woken": 1.5}
    assert floor.bound(table) == {"io": 0.79, "threads": 1.0, **woken}
    assert floor.bound({k: v for k, v in table.items() if k != floor.BENCH}) == {}


def test_medians_are_taken_by_kind_of_run(floor: ModuleType) -> None:
    def run(kind: str, own: float, broker: float) -> Any:
        cpu = {"this process": own, "broker": broker}
        switches = {"nodes": {"woken": own, "preempted": broker}}
        return floor.Run(
            kind, cpu, own, round(own / broker, 2), 100.0, 7.0, switches_per_placement=switches
        )

    table = floor.medians([run("a", 1.0, 2.0), run("b", 5.0, 5.0), run("a", 3.0, 2.0)])

    assert table["a"]["own_cpu_ms_per_placement"] == 2.0
    assert table["a"]["own_cpu_over_broker_cpu"] == 1.0
    assert table["a"]["broker cpu_ms_per_placement"] == 2.0
    assert table["a"]["nodes woken_per_placement"] == 2.0
    assert table["a"]["nodes preempted_per_placement"] == 2.0
    assert table["b"]["own_cpu_ms_per_placement"] == 5.0
    assert table["b"]["nodes woken_per_placement"] == 5.0


def stats(**counts: int) -> dict[str, int]:
    return {"sent": 10, "confirmed": 10, "nacked": 0, "returned": 0, "refused": 0,
            "reconnects": 0, **counts}  # fmt: skip


def test_a_clean_run_has_no_problems(floor: ModuleType) -> None:
    report = {"received": 8, "stats": stats()}

    assert floor.problems_of(floor.Placements(nodes=2), stats(), [report, report], 2) == []


@pytest.mark.parametrize(
    "counts",
    [{"nacked": 1}, {"returned": 1}, {"refused": 1}, {"reconnects": 1}, {"confirmed": 9}],
)
def test_a_message_lost_on_either_side_is_a_problem(
    floor: ModuleType, counts: dict[str, int]
) -> None:
    placements = floor.Placements(nodes=2)
    clean = {"received": 8, "stats": stats()}

    on_a_node = floor.problems_of(placements, stats(), [clean, {"stats": stats(**counts)}], 2)
    at_the_requestor = floor.problems_of(placements, stats(**counts), [clean, clean], 2)

    assert len(on_a_node) == len(at_the_requestor) == 1


def test_a_node_process_that_said_nothing_is_a_problem(floor: ModuleType) -> None:
    report = {"received": 8, "stats": stats()}

    problems = floor.problems_of(floor.Placements(nodes=2), stats(), [report], 2)

    assert problems == ["1 node process(es) said nothing"]


@pytest.mark.parametrize("woken_us", [0, 100])
def test_the_work_runs_both_back_to_back_and_woken(floor: ModuleType, woken_us: int) -> None:
    args = argparse.Namespace(nodes=3, work_placements=(2, 4))

    run = floor.run_work(args, woken_us)

    assert run.kind == (floor.WORK_WOKEN if woken_us else floor.WORK)
    assert set(run.cpu_ms_per_placement) == {"this process"}


@pytest.mark.parametrize("text", ["", "500", "3500,500", "0,10", "a,b", "1,2,3"])
def test_work_sizes_other_than_two_growing_counts_are_refused_with_the_text_named(
    floor: ModuleType, text: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=repr(text)):
        floor.sizes_of(text)


def test_work_sizes_are_read_small_then_large(floor: ModuleType) -> None:
    assert floor.sizes_of("20,60") == (20, 60)
