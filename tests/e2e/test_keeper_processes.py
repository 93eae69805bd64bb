"""End to end on a real RabbitMQ with real processes: two ``reservoir keeper`` processes,
``reservoir node`` processes and long-lived requestors in a process of their own (as a
``reservoir serve`` replica's), with the default settings. Keepers are SIGKILLed while
requests are placed and started again: no placement fails, the requestors follow the
announcements only while no keeper is left and are back on keepers once one returns, and
``reservoir audit`` finds every placement held and nothing else. Also: ``reservoir
request`` with keepers running takes no longer than without (no wait for a sample)."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]

HERE = Path(__file__).resolve().parent
READY_TIMEOUT_S = 20.0
#: requestors in the requestor process
REQUESTORS = 4


def reservoir(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reservoir.cli", *args],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@dataclass
class Lines:
    """A process whose stdout says JSON objects, one a line."""

    process: subprocess.Popen[str]
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)

    def __post_init__(self) -> None:
        def pump() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                if line.startswith("{"):
                    self.events.put(json.loads(line))

        threading.Thread(target=pump, daemon=True).start()

    def next(self, event: str, timeout_s: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                said = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"never said {event!r}") from None
            if said["event"] == event:
                return said

    def tell(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()


@dataclass
class Deployment:
    env: dict[str, str]
    directory: Path
    processes: list[subprocess.Popen[str]] = field(default_factory=list)
    keepers: dict[str, subprocess.Popen[str]] = field(default_factory=dict)

    def spawn(self, *args: str, stdin: bool = False) -> subprocess.Popen[str]:
        process = subprocess.Popen(
            [sys.executable, *args], env=self.env, text=True,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.processes.append(process)
        return process

    def start_node(self, name: str) -> None:
        self.spawn("-m", "reservoir.cli", "node", "--name", name, "--vcpus", "1000",
                   "--memory-mb", "1000000")  # fmt: skip

    def keeper_status(self, name: str) -> dict[str, Any]:
        try:
            status: dict[str, Any] = json.loads((self.directory / f"{name}.json").read_text())
        except FileNotFoundError:
            return {}
        return status

    def start_keeper(self, name: str, nodes: int) -> None:
        (self.directory / f"{name}.json").unlink(missing_ok=True)
        self.keepers[name] = self.spawn(
            "-m", "reservoir.cli", "keeper", "--name", name,
            "--status-file", str(self.directory / f"{name}.json"), "--status-interval", "0.1",
        )  # fmt: skip
        wait_until(lambda: self.keeper_status(name).get("nodes_known", 0) >= nodes)

    def kill_keeper(self, name: str) -> None:
        keeper = self.keepers.pop(name)
        keeper.send_signal(signal.SIGKILL)
        keeper.wait(timeout=10)

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)


def wait_until(condition: Any, timeout_s: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def deployment(reservoir_amqp_url: str, tmp_path: Path) -> Iterator[Deployment]:
    env = {**os.environ, "RESERVOIR_BROKER_URL": reservoir_amqp_url}
    env.pop("RESERVOIR_ROSTER_FROM", None)  # the default, as deployed
    built = Deployment(env, tmp_path)
    yield built
    built.close()


def samples_sent(deployment: Deployment, keeper: str) -> int:
    """The samples the keeper sent since it started, as its status file says."""
    return int(deployment.keeper_status(keeper).get("counters", {}).get("samples", 0))


def place(requestors: Lines, count: int, during: Any = None) -> int:
    """``count`` placements; ``during()`` once a quarter of them are made. None fails."""
    requestors.tell(f"place {count}")
    if during is not None:
        while requestors.next("progress")["placed"] < count // 4:
            pass
        during()
    placed = requestors.next("placed")
    assert placed["failed"] == 0, placed["errors"]
    assert placed["placed"] == count
    return count


def sources(requestors: Lines) -> dict[str, Any]:
    requestors.tell("sources")
    return requestors.next("sources")


def place_until(requestors: Lines, where: str, timeout_s: float = 15.0) -> int:
    """Place a few at a time until every requestor's roster comes from ``where``: a query
    that was on its way to a keeper as it died goes unanswered, and is asked again at a
    placement once the widening wait (2 s) has passed. Returns the placements made."""
    made = 0
    deadline = time.monotonic() + timeout_s
    while sources(requestors)["sources"] != [where] * REQUESTORS:
        assert time.monotonic() < deadline, sources(requestors)
        made += place(requestors, 2 * REQUESTORS)
        time.sleep(0.2)
    return made


def test_keepers_killed_during_placements_lose_none_and_the_requestors_come_back_to_them(
    deployment: Deployment,
) -> None:
    for name in ("n1", "n2"):
        deployment.start_node(name)
    for name in ("k1", "k2"):
        deployment.start_keeper(name, nodes=2)
    record = deployment.directory / "placements.jsonl"
    process = deployment.spawn(str(HERE / "keeper_requestors.py"), str(REQUESTORS), str(record),
                               stdin=True)  # fmt: skip
    requestors = Lines(process)
    requestors.next("ready")
    wait_until(lambda: sources(requestors)["sources"] == ["keepers"] * REQUESTORS)

    # one of two killed while placing: the other answers, nobody follows the nodes
    made = place(requestors, 400, during=lambda: deployment.kill_keeper("k1"))
    now = sources(requestors)
    assert now["sources"] == ["keepers"] * REQUESTORS
    assert now["no_keeper"] == 0

    # the other one too: each requestor's next query reaches nobody, and it follows the
    # announcements; every placement is still made
    made += place(requestors, 400, during=lambda: deployment.kill_keeper("k2"))
    made += place_until(requestors, "announcements")
    assert sources(requestors)["no_keeper"] == REQUESTORS

    # one returns: it says so, and every requestor is back on keepers without placing
    deployment.start_keeper("k1", nodes=2)
    wait_until(lambda: sources(requestors)["sources"] == ["keepers"] * REQUESTORS)
    assert sources(requestors)["back_on_keepers"] == REQUESTORS
    made += place(requestors, 400, during=lambda: deployment.start_keeper("k2", nodes=2))
    assert samples_sent(deployment, "k1") >= REQUESTORS
    assert sources(requestors)["sources"] == ["keepers"] * REQUESTORS

    requestors.tell("stop")
    requestors.next("stopped")
    audited = reservoir("audit", "--json", "--expect-nodes", "2", "--wait", "10",
                        "--placements", str(record), env=deployment.env)  # fmt: skip
    assert audited.returncode == 0, audited.stdout + audited.stderr
    report = json.loads(audited.stdout)
    assert report["ok"] is True, report
    assert report["allocations"] == made  # every placement held, once
    assert report["orphans"] == [], report


def test_reservoir_request_takes_no_longer_with_keepers_running(deployment: Deployment) -> None:
    # It starts a requestor for one placement: that placement goes out on what the
    # requestor has (nothing yet: it asks the first tier), with no wait for a sample.
    deployment.start_node("n1")
    wait_until(lambda: reservoir("nodes", "--json", env=deployment.env).returncode == 0)

    def elapsed() -> float:
        done = reservoir("request", "--json", "--vcpus", "1", "--memory-mb", "64",
                         env=deployment.env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        return float(json.loads(done.stdout)["elapsed_s"])

    without = min(elapsed() for _ in range(3))
    deployment.start_keeper("k1", nodes=1)
    deployment.start_keeper("k2", nodes=1)
    with_keepers = min(elapsed() for _ in range(3))
    # each of those requestors asked the keepers, and each keeper answered it
    for name in ("k1", "k2"):
        wait_until(lambda name=name: samples_sent(deployment, name) >= 3)
    deployment.kill_keeper("k1")
    deployment.kill_keeper("k2")
    keepers_down = min(elapsed() for _ in range(3))
    # 2 s was the wait for a sample, with keepers up or down; a placement here takes
    # milliseconds (the bound is loose: the machine is shared)
    assert with_keepers < 0.5 and keepers_down < 0.5, (without, with_keepers, keepers_down)
    print(f"reservoir request elapsed_s: {without=}, {with_keepers=}, {keepers_down=}")
