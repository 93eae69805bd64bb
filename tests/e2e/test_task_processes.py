"""End to end with tasks: ``reservoir node --driver exec`` processes on a real RabbitMQ,
``reservoir run``, ``logs``, ``wait``, ``tasks`` and ``free`` as processes, a node agent
killed with SIGKILL while its tasks run, a follow-up killed and started again, and 200
short tasks from 8 concurrent callers. Every test ends with ``reservoir audit`` (which
checks the tasks' invariants too)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from reservoir.testing import ProcessCluster
from reservoir.testing.processes import NODE_READY

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]


def processes_with(token: str) -> list[int]:
    """The live processes whose command line holds ``token`` (tasks these tests started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token in cmdline and state != "Z" and "pytest" not in cmdline:
            found.append(int(entry.name))
    return found


class TaskCluster(ProcessCluster):
    """Node processes offering the exec driver; ``token`` marks the tasks the test starts."""

    def __init__(self, url: str, state_dir: Path, token: str) -> None:
        super().__init__(url, state_dir)
        self.token = token

    def start_node(self, name: str, vcpus: int = 2) -> str:  # type: ignore[override]
        """The node's ready line."""
        node = super().start_node(name, "--driver", "exec", vcpus=vcpus, memory_mb=4096)
        return next(line for line in node.said if NODE_READY in line)

    def run_task(self, *args: str) -> subprocess.CompletedProcess[str]:
        return self.run("run", "--timeout", "20", *args)

    def stop_node(self, name: str) -> None:
        self.nodes[name].terminate()

    def tasks(self, request_id: str) -> list[dict[str, Any]]:
        done = self.run("tasks", "--request-id", request_id, "--json")
        assert done.returncode == 0, done.stderr
        return [json.loads(line) for line in done.stdout.splitlines()]

    def allocations(self, name: str) -> list[dict[str, Any]]:
        done = self.run("inspect", "--state-dir", str(self.state_dir), "--name", name, "--json")
        assert done.returncode == 0, done.stderr
        held: list[dict[str, Any]] = json.loads(done.stdout)["allocations"]
        return held

    def audit(self) -> None:
        done = self.run("audit", "--expect-nodes", str(len(self.nodes)))
        assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
def cluster(reservoir_amqp_url: str, tmp_path: Path) -> Iterator[TaskCluster]:
    with TaskCluster(reservoir_amqp_url, tmp_path, token=f"tok{uuid.uuid4().hex[:8]}") as cluster:
        yield cluster
    for pid in processes_with(cluster.token):  # a task a failing test left behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)  # its session: wrapper and all


def eventually(check: Any, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.1)


def test_run_exits_with_the_tasks_code_and_its_room_is_placed_again_on_that_node(
    cluster: TaskCluster,
) -> None:
    cluster.start_node("a", vcpus=2)
    done = cluster.run_task("--vcpus", "2", "--memory-mb", "256", "--", "sh", "-c", "exit 3")
    assert done.returncode == 3, done.stderr
    assert "task started on a" in done.stderr and "task exited with 3 on a" in done.stderr
    assert cluster.allocations("a") == []
    # all of a's VCPUs: placed only because the ended task freed them
    placed = cluster.run("request", "--vcpus", "2", "--json")
    assert placed.returncode == 0, placed.stderr
    assert [a["node"] for a in json.loads(placed.stdout)["allocations"]] == ["a"]
    cluster.audit()


def test_a_released_task_is_stopped(cluster: TaskCluster) -> None:
    cluster.start_node("a", vcpus=2)
    done = cluster.run_task(
        "--detach", "--vcpus", "1", "--grace", "1", "--", "sh", "-c", f"sleep 60; : {cluster.token}"
    )
    assert done.returncode == 0, done.stderr
    request_id = done.stdout.strip()
    assert len(processes_with(cluster.token)) == 1
    freed = cluster.run("free", "--node", "a", "--request-id", request_id)
    assert freed.returncode == 0, freed.stderr
    eventually(lambda: processes_with(cluster.token) == [])
    eventually(lambda: [t["state"] for t in cluster.tasks(request_id)] == ["stopped"])
    assert cluster.allocations("a") == []
    cluster.audit()


def test_a_node_killed_while_its_tasks_run_reports_them_once_restarted_and_leaks_nothing(
    cluster: TaskCluster,
) -> None:
    cluster.start_node("a", vcpus=2)
    token = cluster.token
    early = cluster.run_task(
        "--detach", "--vcpus", "1", "--", "sh", "-c", f"sleep 3; exit 5; : {token}"
    )
    late = cluster.run_task(
        "--detach", "--vcpus", "1", "--", "sh", "-c", f"sleep 6; exit 6; : {token}"
    )
    assert early.returncode == late.returncode == 0, early.stderr + late.stderr
    cluster.nodes["a"].process.send_signal(signal.SIGKILL)
    cluster.nodes["a"].process.wait(timeout=10)
    assert len(processes_with(token)) == 2  # the tasks outlive their agent
    eventually(lambda: len(processes_with(token)) == 1)  # the early one ends meanwhile
    ready = cluster.start_node("a", vcpus=2)
    # the early task's end was found as it started again, and its allocation freed
    assert "1 allocation(s) held" in ready
    (early_state,) = cluster.tasks(early.stdout.strip())
    assert (early_state["state"], early_state["exit_code"]) == ("exited", 5)
    eventually(lambda: [t["exit_code"] for t in cluster.tasks(late.stdout.strip())] == [6])
    assert cluster.allocations("a") == []
    assert processes_with(token) == []
    cluster.audit()


def test_96_short_tasks_from_8_concurrent_callers_each_run_once_with_their_own_code(
    cluster: TaskCluster, task_files: Path
) -> None:
    from reservoir import Requestor

    for name in ("a", "b", "c"):
        cluster.start_node(name, vcpus=8)
    runs = task_files  # the tasks' user (nobody) writes there

    def caller(first: int) -> list[tuple[int, int | None]]:
        codes = []
        with Requestor(cluster.url) as requestor:
            for number in range(first, first + 12):
                task = requestor.run(
                    ["sh", "-c", f'echo ran >> {runs}/{number}; exit "$0"', str(number)],
                    vcpus=1,
                    memory_mb=64,
                    timeout_s=20,
                )
                task.wait(timeout_s=30)
                codes.append((number, task.exit_code))
        return codes

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = [code for codes in pool.map(caller, range(0, 96, 12)) for code in codes]
    assert sorted(results) == [(number, number) for number in range(96)]
    assert sorted(int(p.name) for p in runs.iterdir()) == list(range(96))
    assert all(p.read_text() == "ran\n" for p in runs.iterdir())  # exactly once each
    for name in cluster.nodes:
        assert cluster.allocations(name) == []
    cluster.audit()


def test_run_prints_the_tasks_stdout_and_stderr_and_exits_with_its_code(
    cluster: TaskCluster,
) -> None:
    cluster.start_node("a")
    done = cluster.run_task("--", "sh", "-c", "echo out; echo err >&2; exit 3")
    assert done.returncode == 3, done.stderr
    assert done.stdout == "out\n"
    assert "err\n" in done.stderr.splitlines(keepends=True)
    cluster.audit()


def test_logs_follows_a_running_task_and_ends_when_it_does(
    cluster: TaskCluster, task_files: Path
) -> None:
    cluster.start_node("a")
    go_on = task_files / "go-on"
    # bounded: a test that fails leaves no task waiting for ever
    wait = f"i=0; while [ ! -e {go_on} ] && [ $i -lt 600 ]; do i=$((i+1)); sleep 0.05; done"
    script = f"echo first; {wait}; echo last"
    started = cluster.run_task("--detach", "--", "sh", "-c", script)
    assert started.returncode == 0, started.stderr
    request_id = started.stdout.strip()
    follow = subprocess.Popen(
        [sys.executable, "-m", "reservoir.cli", "logs", "-f", request_id],
        env=cluster.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert follow.stdout is not None
    assert follow.stdout.readline() == "first\n"  # shown while the task runs
    assert follow.poll() is None
    go_on.touch()
    rest, errors = follow.communicate(timeout=30)
    assert (follow.returncode, rest) == (0, "last\n"), errors  # it ended with the task
    again = cluster.run("logs", request_id)  # and after: kept by the node
    assert (again.returncode, again.stdout) == (0, "first\nlast\n")
    unknown = cluster.run("logs", "no-such-request-here")
    assert unknown.returncode == 1 and "no node holds a task of" in unknown.stderr
    cluster.audit()


def test_exec_tasks_on_a_default_node_do_not_run_as_root(cluster: TaskCluster) -> None:
    ready = cluster.start_node("a")
    assert "ready" in ready
    done = cluster.run_task("--", "id", "-u")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() not in ("", "0")
    cluster.audit()


def memory_is_limited_here() -> bool:
    from reservoir.runtime.cgroups import CgroupHost

    if os.geteuid() != 0:
        return False
    host = CgroupHost.discover()
    unified = host.unified is not None and "memory" in (
        (host.unified / "cgroup.controllers").read_text().split()
    )
    return unified or "memory" in host.v1


@pytest.mark.skipif(not memory_is_limited_here(), reason="no memory cgroup on this host")
def test_a_task_exceeding_its_memory_is_killed_and_run_says_so(cluster: TaskCluster) -> None:
    cluster.start_node("a")
    done = cluster.run_task(
        "--memory-mb", "64", "--", "python3", "-c", "x = bytearray(256 * 1024 * 1024)"
    )
    assert done.returncode == 137, done.stderr
    assert "task exited with 137 on a" in done.stderr
    assert "out of memory (limit 64 MiB)" in done.stderr
    cluster.audit()


def test_run_with_an_image_and_no_docker_node_names_the_reason(cluster: TaskCluster) -> None:
    cluster.start_node("a")
    done = cluster.run_task("--image", "alpine", "--", "true")
    assert done.returncode == 1
    assert "not placed" in done.stderr and "no docker task driver on 1 node(s)" in done.stderr
    other = cluster.run_task("--driver", "nosuch", "--", "true")
    assert "no nosuch task driver on 1 node(s)" in other.stderr
    cluster.audit()


def test_a_follow_up_killed_and_started_again_ends_with_the_tasks_code(
    cluster: TaskCluster, task_files: Path
) -> None:
    cluster.start_node("a")
    go_on = task_files / "go-on"
    # bounded: a test that fails leaves no task waiting for ever
    wait = f"i=0; while [ ! -e {go_on} ] && [ $i -lt 600 ]; do i=$((i+1)); sleep 0.05; done"
    started = cluster.run_task("--detach", "--", "sh", "-c", f"{wait}; exit 7")
    assert started.returncode == 0, started.stderr
    request_id = started.stdout.strip()

    def waiting() -> subprocess.Popen[str]:
        return subprocess.Popen(
            [sys.executable, "-m", "reservoir.cli", "wait", request_id],
            env=cluster.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    first = waiting()
    time.sleep(2.0)  # attached by now, as far as the test can tell: killed, whatever it did
    assert first.poll() is None
    first.kill()
    first.wait(timeout=10)
    second = waiting()
    time.sleep(1.0)
    go_on.touch()
    _, errors = second.communicate(timeout=30)
    assert second.returncode == 7, errors
    assert "task exited with 7 on a" in errors
    after = cluster.run("wait", request_id)  # once it ended: said at once
    assert after.returncode == 7, after.stderr
    cluster.audit()


def test_ended_tasks_stay_listed_across_a_restart_of_their_node(cluster: TaskCluster) -> None:
    cluster.start_node("a")
    done = cluster.run_task("--", "sh", "-c", "echo before; exit 4")
    assert done.returncode == 4, done.stderr
    request_id = next(
        line.split()[1] for line in done.stderr.splitlines() if line.startswith("placed ")
    )
    cluster.stop_node("a")
    cluster.start_node("a")
    # reservoir tasks gathers the answers for 0.5 s: asked again, in case a busy node was late
    eventually(
        lambda: [(t["state"], t["exit_code"]) for t in cluster.tasks(request_id)] == [("exited", 4)]
    )
    kept = cluster.run("logs", request_id)
    assert (kept.returncode, kept.stdout) == (0, "before\n")
    cluster.audit()


def test_a_task_writing_much_keeps_the_nodes_memory_and_the_brokers_queues_bounded(
    reservoir_amqp_broker_url: str, benchmark_script: Any
) -> None:
    """What a task writing 256 MiB costs, followed as reservoir run follows it
    (benchmarks/task_output.py; the closing note has the 1 GiB figures)."""
    figures = benchmark_script("task_output").measure(reservoir_amqp_broker_url, 256 * 1024**2)
    assert figures.exit_code == 0
    assert figures.audit_status == 0  # the node's audit at the end, clean
    assert figures.bytes_read + figures.bytes_skipped == figures.bytes_written
    assert figures.bytes_read >= 16 * 1024**2  # the last 16 MiB at least: what the node keeps
    assert figures.node_rss_peak_mib - figures.node_rss_at_start_mib < 16
    assert 0 < figures.supervisor_rss_peak_mib < 32
    assert figures.kept_bytes_peak <= figures.kept_bytes_bound
    if figures.queue_samples:  # rabbitmqctl here: one answer in flight at a time
        assert (figures.reply_queue_peak or 0) <= 2 and (figures.node_queue_peak or 0) <= 2
