"""reservoir.testing's process helpers, on a node of an in-process broker (``memory://``):
a node started is waited for until it says it is ready, a process that ends without saying
what is waited for fails at once with what it said, and closing the cluster stops what
still runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from reservoir.testing import ProcessCluster, ReservoirProcess, run_reservoir


def test_a_node_started_is_ready_and_closing_the_cluster_stops_it(tmp_path: Path) -> None:
    with ProcessCluster("memory://", tmp_path) as cluster:
        node = cluster.start_node("solo", vcpus=1, memory_mb=64)
        assert node.running
        assert any("node solo: ready on memory://" in line for line in node.said)
        assert cluster.nodes == {"solo": node}
    assert not node.running
    assert node.process.returncode == 130  # stopped by SIGTERM, as an operator would
    node.wait_for("stopped")


def test_waiting_on_a_process_that_ended_fails_at_once_with_what_it_said() -> None:
    child = ReservoirProcess("wrong", ["node", "--no-such-option"], os.environ)
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)wrong never said 'ready'.*no-such-option"):
        child.wait_for("ready", timeout_s=30)
    assert time.monotonic() - started < 15  # not the whole timeout
    assert child.process.wait(timeout=10) == 2


def test_a_command_run_to_its_end_is_returned_failing_or_not() -> None:
    done = run_reservoir("--version", env=os.environ)
    assert done.returncode == 0 and done.stdout.startswith("reservoir, version ")
    wrong = run_reservoir("request", "--no-such-option", env=os.environ)
    assert wrong.returncode == 2 and "no-such-option" in wrong.stderr
