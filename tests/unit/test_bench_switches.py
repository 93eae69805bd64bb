"""The bench's count of context switches by part (``reservoir.tools.bench.limits``): each
wait a thread is woken from, in another process or in this one, threads that have ended
included; a part that cannot be read is left out rather than counted as nothing."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from reservoir.tools.bench.limits import CpuMeter, CpuSnapshot, Switches

WAITS = 40

# Says it has started, waits for a line, then sleeps WAITS times (each sleep a wait the
# kernel wakes it from), says so, and waits for the end of its input.
SLEEPER = (
    "import sys, time\n"
    "print('ready', flush=True)\n"
    "sys.stdin.readline()\n"
    f"for _ in range({WAITS}): time.sleep(0.001)\n"
    "print('slept', flush=True)\n"
    "sys.stdin.read()\n"
)


def test_a_process_that_waits_is_counted_woken_once_for_each_wait() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", SLEEPER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        meter = CpuMeter({"sleeper": [child.pid]})
        assert child.stdout.readline() == "ready\n"  # its start-up's waits are behind it
        before = meter.snapshot()
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline() == "slept\n"
        after = meter.snapshot()
    finally:
        child.stdin.close()
        child.wait(10)
    woken = after.switches["sleeper"].woken - before.switches["sleeper"].woken
    assert WAITS <= woken <= WAITS + 20  # its sleeps, its reads, and the interpreter's few
    per_placement = CpuMeter.switches_per_placement(before, after, WAITS)
    assert per_placement["sleeper"]["woken"] == round(woken / WAITS, 2)
    assert per_placement["sleeper"]["preempted"] >= 0


def test_this_process_counts_the_waits_of_threads_that_have_ended() -> None:
    meter = CpuMeter()
    before = meter.snapshot()
    sleeper = threading.Thread(target=lambda: [time.sleep(0.001) for _ in range(WAITS)])
    sleeper.start()
    sleeper.join()
    after = meter.snapshot()
    woken = after.switches["this process"].woken - before.switches["this process"].woken
    assert woken >= WAITS


def test_a_process_that_cannot_be_read_leaves_its_part_out() -> None:
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait(10)
    snapshot = CpuMeter({"gone": [ended.pid]}).snapshot()
    assert "gone" not in snapshot.switches
    assert "gone" not in snapshot.seconds


def test_a_part_measured_at_one_end_only_is_not_divided() -> None:
    before = CpuSnapshot({}, {"nodes": Switches(10, 1), "broker": Switches(5, 5)})
    after = CpuSnapshot({}, {"nodes": Switches(30, 5)})
    assert CpuMeter.switches_per_placement(before, after, 4) == {
        "nodes": {"woken": 5.0, "preempted": 1.0}
    }


@pytest.mark.parametrize("placements", [0, -1])
def test_no_placement_gives_no_figure(placements: int) -> None:
    snapshot = CpuSnapshot({}, {"nodes": Switches(10, 1)})
    assert CpuMeter.switches_per_placement(snapshot, snapshot, placements) == {}


def test_switches_since_an_earlier_count_and_per_placement() -> None:
    later, earlier = Switches(130, 17), Switches(30, 5)

    assert later.since(earlier) == Switches(100, 12)
    assert later.since(earlier).per_placement(8) == {"woken": 12.5, "preempted": 1.5}
