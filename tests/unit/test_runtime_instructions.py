"""benchmarks/runtime_instructions.py runs the live runtime's work on one thread; with
``woken_s`` every step of a placement runs after a real sleep, as the live handlers run
after a wake-up."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from types import ModuleType

import pytest


@pytest.fixture
def runtime(
    benchmark_script: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> ModuleType:
    monkeypatch.setattr(uuid, "uuid4", uuid.uuid4)  # the run seeds it: put it back after
    return benchmark_script("runtime_instructions")


def test_a_woken_run_sleeps_once_before_every_step_it_counts(
    runtime: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)

    woken = runtime.run(5, 3, woken_s=0.0002)

    assert slept == [0.0002] * woken["steps"]
    assert woken["placements"] == 5


def test_the_placements_and_messages_do_not_depend_on_the_sleep(
    runtime: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(time, "sleep", lambda _s: None)

    plain = runtime.run(5, 3)
    monkeypatch.setattr(uuid, "uuid4", uuid.uuid4)
    woken = runtime.run(5, 3, woken_s=0.0002)

    steps = woken.pop("steps")
    assert plain == woken
    assert steps > plain["messages"] > 0
