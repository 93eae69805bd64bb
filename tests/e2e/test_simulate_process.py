"""``reservoir simulate`` as a real process, stopped the two ways a user stops it: Ctrl-C at
a terminal (SIGINT to its whole process group) and SIGTERM to it alone. Either way it says
so, exits 130 and leaves no worker process running on, where a 100,000-node simulation's
workers would otherwise run for many minutes after their parent is gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

#: minutes of work in two worker processes (two loads of one reservoir run each)
LONG_SIMULATION = (
    "simulate", "--nodes", "20000", "--requests", "1000000", "--loads", "0.8,0.95",
    "--systems", "reservoir", "--jobs", "2",
)  # fmt: skip


def children_of(pid: int) -> set[int]:
    """The live processes whose parent is ``pid``, from /proc."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone while we looked
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")"
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def started_with_its_workers() -> tuple[subprocess.Popen[str], set[int]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "reservoir", *LONG_SIMULATION],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a process group of its own, as a terminal would give it
    )
    deadline = time.monotonic() + 60
    # two workers and multiprocessing's resource tracker
    while len(workers := children_of(process.pid)) < 3:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.1)
    return process, workers


@pytest.mark.parametrize(
    "stop",
    [
        pytest.param(lambda p: os.killpg(p.pid, signal.SIGINT), id="ctrl-c"),
        pytest.param(lambda p: p.send_signal(signal.SIGTERM), id="sigterm"),
    ],
)
def test_a_stopped_simulation_says_so_and_takes_its_workers_with_it(
    stop: Callable[[subprocess.Popen[str]], None],
) -> None:
    process, workers = started_with_its_workers()
    try:
        time.sleep(1.0)  # into the runs, past the workers' start-up
        stop(process)
        stdout, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == 130, stderr
    assert "interrupted; its worker processes stopped" in stderr
    assert "Traceback" not in stderr, stderr
    assert stdout == ""
    deadline = time.monotonic() + 10  # the resource tracker exits once its pipe closes
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in workers if alive(pid)] == []
