"""The chaos harness's fault schedule and callers' record, without any process."""

from __future__ import annotations

from reservoir.tools.chaos.harness import FAULT_KINDS, fault_schedule, live_per_requestor
from reservoir.tools.chaos.record import CallerRecord, judge

NODES = [f"n{i}" for i in range(30)]
REQUESTORS = [f"r{i}" for i in range(8)]


def schedule(seed: int, seconds: float = 120.0) -> list[object]:
    return list(fault_schedule(seed, seconds=seconds, nodes=NODES, requestors=REQUESTORS))


def test_the_same_seed_gives_the_same_schedule_and_another_seed_another() -> None:
    assert schedule(5) == schedule(5)
    assert schedule(5) != schedule(6)


def test_the_first_faults_of_a_run_are_every_kind_once() -> None:
    for seed in range(20):
        faults = fault_schedule(seed, seconds=60, nodes=NODES, requestors=REQUESTORS)
        assert {f.kind for f in faults[: len(FAULT_KINDS)]} == set(FAULT_KINDS)


def test_never_more_than_a_tenth_of_the_nodes_are_down_at_once() -> None:
    for seed in range(20):
        faults = fault_schedule(seed, seconds=600, nodes=NODES, requestors=REQUESTORS)
        kills = [f for f in faults if f.kind == "kill_node"]
        assert kills
        for fault in kills:
            down = [k for k in kills if k.at_s <= fault.at_s < k.at_s + k.duration_s]
            assert len(down) <= 3


def test_requestors_hold_well_under_the_clusters_room() -> None:
    assert live_per_requestor(30, 8) * 8 * 2 <= 0.4 * 30 * 16
    assert live_per_requestor(2, 64) == 1


def record(*events: dict[str, object]) -> list[dict[str, object]]:
    return [{"at": 100.0 + i, **e} for i, e in enumerate(events)]


PLACED = {
    "placed": True,
    "request_id": "w-1",
    "allocations": [{"node": "n1", "allocation_id": "a1", "resources": {"VCPU": 1}}],
}


def test_a_restarted_requestor_asks_again_for_what_was_never_answered() -> None:
    replayed = CallerRecord.replay(
        record(
            {"e": "boot"},
            {"e": "start", "id": "w-0", "seq": 0, "shape": {"vcpus": 1}, "deadline": 130},
            {"e": "placed", "id": "w-0", "placement": {**PLACED, "request_id": "w-0"}},
            {"e": "start", "id": "w-1", "seq": 1, "shape": {"vcpus": 2}, "deadline": 131},
            {"e": "free", "id": "w-0"},
        )
    )
    assert replayed.unanswered == {"w-1": {"vcpus": 2}}
    assert set(replayed.held) == {"w-0"}
    assert replayed.freeing == {"w-0"}
    assert replayed.last_sequence == 1


def test_a_caller_killed_mid_request_is_not_hung_but_one_left_waiting_is() -> None:
    killed = record(
        {"e": "boot"},
        {"e": "start", "id": "w-1", "seq": 1, "shape": {}, "deadline": 102},
        {"e": "boot"},
        {"e": "start", "id": "w-1", "seq": 1, "shape": {}, "deadline": 150},
        {"e": "placed", "id": "w-1", "placement": PLACED},
    )
    waiting = record(
        {"e": "boot"},
        {"e": "start", "id": "v-1", "seq": 1, "shape": {}, "deadline": 150},
    )
    late = record(
        {"e": "boot"},
        {"e": "start", "id": "u-1", "seq": 1, "shape": {}, "deadline": 90},
        {"e": "failed", "id": "u-1", "error": "no room"},
    )
    verdict = judge({"killed": killed, "waiting": waiting, "late": late})
    assert verdict.placements == 1
    assert [h.split(":")[0] for h in verdict.hung] == ["late", "waiting"]
    assert verdict.failures == ("late: u-1: no room",)
    assert [p.request_id for p in verdict.held] == ["w-1"]
