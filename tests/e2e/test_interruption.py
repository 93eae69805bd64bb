"""One interruption path, with real processes: Ctrl-C (SIGINT) or SIGTERM in any command
prints one line and exits 130; no "Aborted!", no traceback from the imports or from a
command's threads; SIGHUP stops a node as SIGTERM does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

INTERRUPTED = 130


#: the processes the running test started: killed at its end if still running, so a
#: failed assertion leaves no node behind (its inbox would keep its name taken)
_STARTED: list[subprocess.Popen[str]] = []


@pytest.fixture(autouse=True)
def no_process_outlives_its_test() -> Iterator[None]:
    yield
    while _STARTED:
        process = _STARTED.pop()
        if process.poll() is None:
            process.kill()
            process.communicate(timeout=30)


def started(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("RESERVOIR_BROKER_URL", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "reservoir", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    _STARTED.append(process)
    return process


def messages(err: str) -> list[str]:
    """The log lines' messages: what follows ``<time> INFO reservoir: ``."""
    return [line.split(" reservoir: ", 1)[1] for line in err.splitlines()]


def stopped_by(process: subprocess.Popen[str], signum: int) -> tuple[int, str, str]:
    process.send_signal(signum)
    out, err = process.communicate(timeout=60)
    return process.returncode, out, err


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_request_waiting_for_nodes_stops_with_one_line_and_status_130(signum: int) -> None:
    # nobody answers on an empty in-process broker: the request waits its whole timeout
    process = started("request", "--broker", "memory://", "--vcpus", "1", "--timeout", "30")
    time.sleep(1.5)  # started (0.4 s) and waiting for an answer
    status, out, err = stopped_by(process, signum)
    assert status == INTERRUPTED
    assert err.splitlines() == ["reservoir request: interrupted"], err
    assert out == ""


def handler_installed(process: subprocess.Popen[str], timeout_s: float = 20.0) -> None:
    """Wait until the process catches SIGTERM (Python leaves it to the default until the
    entry point installs its handler), read from /proc: the first moment the command
    promises one line, while it is still importing its modules (which take most of a
    second)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:") and int(line.split()[1], 16) & (
                1 << (signal.SIGTERM - 1)
            ):
                return
        time.sleep(0.002)
    raise AssertionError("the command never installed its handler")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc (Linux)")
@pytest.mark.parametrize("after_s", [0.0, 0.2, 0.4])
def test_ctrl_c_while_the_command_is_still_loading_is_one_line_not_a_traceback(
    after_s: float,
) -> None:
    process = started("request", "--broker", "memory://", "--vcpus", "1", "--timeout", "30")
    handler_installed(process)
    time.sleep(after_s)
    status, _, err = stopped_by(process, signal.SIGINT)
    assert status == INTERRUPTED
    assert len(err.splitlines()) == 1, err
    assert err.rstrip().endswith("interrupted") and "Traceback" not in err


def test_ctrl_c_in_the_demo_stops_its_threads_without_a_traceback() -> None:
    process = started("demo", "--nodes", "20", "--requests", "1000000", "--json")
    time.sleep(2.0)  # started, and its threads placing
    status, out, err = stopped_by(process, signal.SIGINT)
    assert status == INTERRUPTED
    assert err.splitlines() == ["reservoir demo: interrupted"], err
    assert out == ""


@pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGTERM, signal.SIGINT])
def test_a_node_stops_on_sighup_as_on_sigterm_says_stopped_and_exits_130(signum: int) -> None:
    process = started("node", "--broker", "memory://", "--name", "h1", "--vcpus", "2")
    assert process.stderr is not None
    assert "node h1: configuration" in process.stderr.readline()  # what it runs with, first
    assert "node h1: ready" in process.stderr.readline()
    status, _, err = stopped_by(process, signum)
    assert status == INTERRUPTED
    assert messages(err) == ["node h1: stopped"], err


def test_a_keeper_stops_on_sighup_says_stopped_and_exits_130() -> None:
    process = started("keeper", "--broker", "memory://", "--name", "k1")
    assert process.stderr is not None
    assert "keeper k1: ready" in process.stderr.readline()
    status, _, err = stopped_by(process, signal.SIGHUP)
    assert status == INTERRUPTED
    assert messages(err) == ["keeper k1: stopped, 0 node(s) known"], err
