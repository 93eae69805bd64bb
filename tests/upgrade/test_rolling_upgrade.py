"""A rolling upgrade, end to end, on RabbitMQ with real processes: nodes of release 0.1.0
(its build, in a venv of its own: tests/upgrade/release_builds.py) and of this tree,
requestors and keepers of both, while the requestors place without pause: plain
requests (some kept to the end), short tasks, PCI devices, and canaries only nodes of
0.2 or later can take (they require the release trait). Each node in turn is stopped,
started again on the other release with its state directory kept, and, once every node
runs this tree, rolled back the same way.

What must hold (docs/design.md, "Upgrades: two releases at once"): every placement is
held exactly once (the audit, given what the requestors hold, by both releases' audit
commands), nothing overcommitted, no reservation leaked; no request fails but a canary
when no node of 0.2 could take it, and that one with the reason, never by timeout; every
short task ends with its code; each requestor's long task, started before the roll, runs
through every restart of its node on either release and stops when released.

The short form runs by default (3 nodes, about a minute); ``--run-upgrade`` runs the full
one (6 nodes, longer pauses, and first a run of the same length with no roll, whose p50
the roll's is set against). Both print their closing figures (``-s`` shows them)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from reservoir.version import __version__
from tests.e2e.test_task_processes import processes_with
from tests.upgrade.release_builds import ROOT, ReleaseBuild

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]

HERE = Path(__file__).parent
NEW, OLD = "new", "old"

NODE_FILE = """
name = "{name}"
state_dir = "{state_dir}"

[inventory]
VCPU = 16
MEMORY_MB = 16384

[numa]
cells = 2

[[pci.alias]]
name = "gpu-a100"
vendor_id = "10de"
product_id = "20b0"

[[pci.device_spec]]
address = "0000:3b:00.0"
vendor_id = "10de"
product_id = "20b0"
numa_cell = 0

[[pci.device_spec]]
address = "0000:af:00.0"
vendor_id = "10de"
product_id = "20b0"
numa_cell = 1
"""


@dataclass(frozen=True)
class Form:
    nodes: int
    #: placing before the roll, and between two nodes' restarts (seconds)
    warm_up_s: float
    pause_s: float
    #: a run of the same length with no roll first, as the figures' baseline
    baseline: bool


SHORT = Form(nodes=3, warm_up_s=3.0, pause_s=1.0, baseline=False)
FULL = Form(nodes=6, warm_up_s=10.0, pause_s=3.0, baseline=True)


class Lines:
    """A process's output, line by line, read on a thread of its own."""

    def __init__(self, stream: Any) -> None:
        self.queue: queue.Queue[str] = queue.Queue()
        self.said: list[str] = []
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self.queue.put(line)

    def wait_for(self, text: str, timeout_s: float = 60.0) -> str:
        """The first line holding ``text`` (AssertionError after ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"never said {text!r}: {self.said[-20:]}"
            with contextlib.suppress(queue.Empty):
                line = self.queue.get(timeout=min(left, 1.0))
                self.said.append(line)
                if text in line:
                    return line


@dataclass
class Upgrade:
    """The cluster being upgraded: its processes, and when each node ran what."""

    old: ReleaseBuild
    url: str
    directory: Path
    token: str
    nodes: dict[str, tuple[str, subprocess.Popen[str], Lines]] = field(default_factory=dict)
    others: list[subprocess.Popen[str]] = field(default_factory=list)
    #: (node, release it ran, up from, down at or None)
    timeline: list[list[Any]] = field(default_factory=list)
    requestors: dict[str, tuple[subprocess.Popen[str], Lines]] = field(default_factory=dict)

    def command(self, build: str, *args: str) -> tuple[list[str], dict[str, str]]:
        """``reservoir ARGS`` as ``build`` runs it, and its environment."""
        env = {"RESERVOIR_BROKER_URL": self.url}
        if build == OLD:
            return [str(self.old.reservoir), *args], self.old.env(**env)
        return [sys.executable, "-m", "reservoir.cli", *args], {
            **os.environ, **env, "PYTHONPATH": str(ROOT)
        }  # fmt: skip

    def python(self, build: str, *args: str) -> tuple[list[str], dict[str, str]]:
        env = {"RESERVOIR_BROKER_URL": self.url}
        if build == OLD:
            return [str(self.old.python), *args], self.old.env(**env)
        return [sys.executable, *args], {**os.environ, **env, "PYTHONPATH": str(ROOT)}

    def start_node(self, name: str, build: str) -> None:
        config = self.directory / f"{name}.toml"
        if not config.exists():
            state = self.directory / "state" / name
            config.write_text(NODE_FILE.format(name=name, state_dir=state))
        args, env = self.command(build, "node", "--config", str(config), "--driver", "exec")
        # From before it starts to after it exits: a canary's node must have run this
        # tree at some moment of its placement, and nothing is served outside of these
        spawned = time.monotonic()
        process = subprocess.Popen(
            args, env=env, cwd=self.directory, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        lines = Lines(process.stderr)
        ready = lines.wait_for(": ready on ")
        # this tree's node names its release; 0.1.0's does not
        assert (f"release {__version__}" in ready) == (build == NEW), ready
        self.nodes[name] = (build, process, lines)
        self.timeline.append([name, build, spawned, None])

    def stop_node(self, name: str) -> None:
        _, process, _ = self.nodes.pop(name)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 130
        exited = time.monotonic()
        for entry in self.timeline:
            if entry[0] == name and entry[3] is None:
                entry[3] = exited

    def roll(self, name: str, to: str) -> None:
        self.stop_node(name)
        self.start_node(name, to)

    def start_keeper(self, build: str) -> None:
        args, env = self.command(build, "keeper", "--name", f"keeper-{build}")
        process = subprocess.Popen(
            args, env=env, cwd=self.directory, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        Lines(process.stderr).wait_for(": ready on ")
        self.others.append(process)

    def start_requestor(self, build: str) -> None:
        name = f"requestor-{build}"
        args, env = self.python(
            build, str(HERE / "rolling_requestor.py"), name, str(self.directory), self.token
        )
        with (self.directory / f"{name}.stderr").open("w") as stderr:
            process = subprocess.Popen(
                args, env=env, cwd=self.directory, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=stderr, text=True,
            )  # fmt: skip
        lines = Lines(process.stdout)
        lines.wait_for('"ready"')
        self.requestors[name] = (process, lines)

    def tell(self, command: str, answer: str, timeout_s: float = 60.0) -> dict[str, Any]:
        """Every requestor is told ``command``; their answers (``answer`` events)."""
        for process, _ in self.requestors.values():
            assert process.stdin is not None
            process.stdin.write(command + "\n")
            process.stdin.flush()
        said = {}
        for name, (process, lines) in self.requestors.items():
            try:
                said[name] = json.loads(lines.wait_for(f'"{answer}"', timeout_s))
            except AssertionError:
                stderr = (self.directory / f"{name}.stderr").read_text()[-3000:]
                raise AssertionError(
                    f"{name} did not answer {command!r} (exit {process.poll()}): {stderr}"
                ) from None
        return said

    def reservoir(self, build: str, *args: str) -> subprocess.CompletedProcess[str]:
        command, env = self.command(build, *args)
        return subprocess.run(command, env=env, cwd=self.directory, capture_output=True,
                              text=True, timeout=120, check=False)  # fmt: skip

    def audit(self, build: str, *args: str) -> dict[str, Any]:
        done = self.reservoir(build, "audit", "--json", "--expect-nodes", str(len(self.nodes)),
                              *args)  # fmt: skip
        assert done.returncode == 0, f"{build} audit: {done.stdout}{done.stderr}"
        return json.loads(done.stdout)  # type: ignore[no-any-return]

    def outcomes(self) -> list[dict[str, Any]]:
        return [
            json.loads(line)
            for path in sorted(self.directory.glob("*.outcomes.jsonl"))
            for line in path.read_text().splitlines()
        ]

    def ran(self, node: str, build: str, started: float, ended: float) -> bool:
        """Whether ``node`` ran ``build`` at some moment of ``started..ended``."""
        return any(
            name == node and ran == build and up <= ended and (down is None or down >= started)
            for name, ran, up, down in self.timeline
        )


@pytest.fixture
def upgrade(
    previous_release: ReleaseBuild, reservoir_amqp_url: str, tmp_path: Path
) -> Iterator[Upgrade]:
    token = f"tok{uuid.uuid4().hex[:8]}"
    cluster = Upgrade(previous_release, reservoir_amqp_url, tmp_path, token)
    yield cluster
    for process in [*(p for _, p, _ in cluster.nodes.values()), *cluster.others,
                    *(p for p, _ in cluster.requestors.values())]:  # fmt: skip
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
    for pid in processes_with(cluster.token):  # a task a failing test left behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)


def p50_ms(outcomes: list[dict[str, Any]]) -> float | None:
    times = [o["elapsed_s"] * 1000 for o in outcomes if o.get("placed") and "elapsed_s" in o]
    return round(statistics.median(times), 1) if times else None


def roll_and_check(upgrade: Upgrade, form: Form) -> dict[str, Any]:
    names = [f"node-{i}" for i in range(1, form.nodes + 1)]
    for name in names:
        upgrade.start_node(name, OLD)
    upgrade.start_keeper(OLD)
    upgrade.start_keeper(NEW)
    upgrade.start_requestor(OLD)
    upgrade.start_requestor(NEW)
    upgrade.tell("start", "started")
    time.sleep(form.warm_up_s)
    baseline_until = time.monotonic()
    if form.baseline:  # as long as the roll will take, on the old release, with no roll
        time.sleep(2 * form.nodes * (form.pause_s + 2.0))
        baseline_until = time.monotonic()
    roll_from = time.monotonic()
    for name in names:
        upgrade.roll(name, NEW)
        time.sleep(form.pause_s)
    upgraded = time.monotonic()
    for name in names:
        upgrade.roll(name, OLD)
        time.sleep(form.pause_s)
    roll_until = time.monotonic()
    time.sleep(form.pause_s)
    upgrade.tell("stop", "stopped")

    # -- what the requestors saw -----------------------------------------------------
    outcomes = upgrade.outcomes()
    attempts = [o for o in outcomes if "placed" in o and o["kind"] != "long"]
    failed = [o for o in attempts if not o["placed"]]
    false_failures = [
        o for o in failed
        if o["kind"] != "canary" or "trait RESERVOIR_RELEASE_0_2 missing" not in o["error"]
    ]  # fmt: skip
    assert false_failures == [], false_failures[:5]
    assert all("timed out" not in o["error"] for o in failed)
    tasks = [o for o in attempts if o["kind"] == "task"]
    assert tasks and all(o["exit_code"] == 0 and o["states"] == ["exited"] for o in tasks), [
        o for o in tasks if o["exit_code"] != 0 or o["states"] != ["exited"]
    ][:5]
    frees = [o for o in outcomes if "freed" in o]
    assert frees and all(o["freed"] for o in frees), [o for o in frees if not o["freed"]][:5]
    canaries = [o for o in attempts if o["kind"] == "canary" and o["placed"]]
    wrongly = [
        o for o in canaries
        if not all(upgrade.ran(n, NEW, o["started"], o["ended"]) for n in o["nodes"])
    ]  # fmt: skip
    assert wrongly == [], wrongly[:5]
    # nodes of 0.2 ran for a while: some canaries were placed, and before any did, some
    # failed, with the reason, at once
    assert canaries, "no canary was placed while nodes of 0.2 ran"
    assert any(o["kind"] == "canary" for o in failed)
    for kind in ("plain", "task", "devices"):
        assert any(o["kind"] == kind and o["placed"] for o in attempts), kind

    # -- what the nodes hold: every placement once, nothing else -----------------------
    held = upgrade.directory / "held.jsonl"
    held.write_text("".join(p.read_text() for p in sorted(upgrade.directory.glob("*.held.jsonl"))))
    assert len(held.read_text().splitlines()) >= 2  # the long tasks at least
    for build in (NEW, OLD):  # each release's own audit, of a cluster of 0.1.0's nodes
        audited = upgrade.audit(build, "--placements", str(held))
        assert audited["ok"] and audited["orphans"] == [], audited
    long_tasks = [o for o in outcomes if o["kind"] == "long" and "nodes" in o]
    assert len(long_tasks) == 2
    upgrade.tell("release", "released")
    after = [o for o in upgrade.outcomes() if o["kind"] == "long" and "states" in o]
    assert [o["states"] for o in after] == [["stopped"], ["stopped"]]
    emptied = upgrade.audit(NEW)
    assert (emptied["allocations"], emptied["reservations"]) == (0, 0), emptied
    assert processes_with(upgrade.token) == []
    upgrade.tell("exit", "exited")

    during = [o for o in attempts if o["placed"] and roll_from <= o["started"] <= roll_until]
    before = [o for o in attempts if o["placed"] and o["started"] < baseline_until]
    figures = {
        "nodes": form.nodes,
        "roll_s": round(roll_until - roll_from, 1),
        "forward_s": round(upgraded - roll_from, 1),
        "placements_during_roll": len(during),
        "p50_ms_during_roll": p50_ms(during),
        "p50_ms_without_roll": p50_ms(before),
        "baseline": "a run of the same length with no roll"
        if form.baseline
        else f"the {form.warm_up_s:g} s before the roll",
        "placements_in_all": sum(1 for o in attempts if o["placed"]),
        "canaries_failed_with_the_reason": sum(1 for o in failed if o["kind"] == "canary"),
        "false_failures": len(false_failures),
    }
    print(f"\nrolling upgrade figures: {json.dumps(figures)}")
    return figures


def test_a_cluster_rolled_forward_and_back_node_by_node_places_all_along_and_loses_nothing(
    upgrade: Upgrade,
) -> None:
    figures = roll_and_check(upgrade, SHORT)
    assert figures["placements_during_roll"] > 0


@pytest.mark.upgrade_full
def test_the_full_rolling_upgrade_against_a_run_with_no_roll(upgrade: Upgrade) -> None:
    figures = roll_and_check(upgrade, FULL)
    assert figures["placements_during_roll"] > 0
