"""benchmarks/pause_cost.py times one small step of reservoir's work after a pause of its
thread, sleeping or spinning: these tests hold it to pausing the way it says, before
every call, and to reporting the medians it measured."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from types import ModuleType

import pytest


@pytest.fixture
def pause_cost(benchmark_script: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_script("pause_cost")


def test_a_sleeping_pause_sleeps_before_every_call_and_spins_never(
    pause_cost: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    spun: list[float] = []
    calls: list[None] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    monkeypatch.setattr(pause_cost, "spin", spun.append)

    pause_cost.measure(300, "sleeping", 20, work=lambda: calls.append(None))

    assert slept == [0.0003] * 20
    assert spun == []
    assert len(calls) == 20


def test_a_spinning_pause_keeps_the_thread_busy_and_never_sleeps(
    pause_cost: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    started = time.thread_time()

    pause_cost.measure(2000, "spinning", 20, work=lambda: None)

    assert slept == []
    # 20 pauses of 2 ms spent on this thread's CPU, not waited out
    assert time.thread_time() - started >= 0.02


def test_no_pause_means_calls_back_to_back(
    pause_cost: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(time, "sleep", lambda _s: pytest.fail("slept with no pause"))
    monkeypatch.setattr(pause_cost, "spin", lambda _s: pytest.fail("spun with no pause"))

    cost = pause_cost.measure(0, "sleeping", 20)

    assert cost.median_us > 0


def test_the_median_leaves_out_the_first_tenth_as_warm_up(
    pause_cost: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = iter(range(0, 10**9, 1000))  # each read 1 us after the one before
    monkeypatch.setattr(time, "thread_time_ns", lambda: next(clock))
    taken: list[list[int]] = []
    monkeypatch.setattr(pause_cost.statistics, "median", lambda xs: taken.append(xs) or 0)
    durations = iter([5, 5] + [0] * 18)

    def work() -> None:
        for _ in range(next(durations)):
            time.thread_time_ns()  # 1 us more on the clock each

    pause_cost.measure(0, "sleeping", 20, work=work)

    assert taken == [[1000] * 18]  # the two slow first calls left out


def test_every_pause_is_measured_both_ways_each_round_and_summarised(
    pause_cost: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(time, "sleep", lambda _s: None)
    monkeypatch.setattr(pause_cost, "spin", lambda _s: None)

    costs = pause_cost.run([0, 50], calls=10, rounds=2)

    assert sorted((c.round, c.pause_us, c.way) for c in costs) == sorted(
        (r, p, w) for r in (0, 1) for p in (0, 50) for w in ("sleeping", "spinning")
    )
    table = pause_cost.medians(costs)
    assert set(table) == {"sleeping", "spinning"}
    assert set(table["sleeping"]) == {"0", "50"}


def test_the_json_holds_every_run_and_the_medians(
    pause_cost: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(time, "sleep", lambda _s: None)
    monkeypatch.setattr(pause_cost, "spin", lambda _s: None)

    assert (
        pause_cost.main(["--pauses-us", "0,100", "--calls", "10", "--rounds", "1", "--json"]) == 0
    )

    out = json.loads(capsys.readouterr().out)
    assert len(out["runs"]) == 4
    assert set(out["medians_us"]["spinning"]) == {"0", "100"}


@pytest.mark.parametrize("text", ["", "10,-1", "ten", "1.5"])
def test_a_bad_list_of_pauses_is_refused_with_the_text_named(
    pause_cost: ModuleType, text: str
) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"pause|microseconds"):
        pause_cost.pauses_of(text)
