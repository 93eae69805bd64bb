"""The bench's side of its host processes: node agents (``node_host``) and requestors
(``requestor_host``) in processes of their own, as they run in a deployment.

This module owns starting them (this checkout first on their path, :func:`child_env`),
the lines they exchange with the bench (commands to their stdin, events read from their
stdout; :mod:`reservoir.tools.bench.hosting` is their side), and stopping them: each
gets :data:`STOP_TIMEOUT_S` to stop by itself, then SIGKILL. A host that dies, or does not
say what it was asked within the time given, is a :class:`BenchError` naming its exit
status and the tail of its stderr.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Final

from reservoir.brokers import BrokerUrl
from reservoir.exit_status import EXIT_BROKER, EXIT_RUN_FAILED
from reservoir.tools.bench.errors import BenchError
from reservoir.tools.bench.limits import Switches

__all__ = ["COUNTERS_TIMEOUT_S", "STOP_TIMEOUT_S", "ProcessNodes", "ProcessRequestors", "child_env"]

#: how long host processes get to stop before SIGKILL
STOP_TIMEOUT_S: Final = 30.0
#: how long a host may take to report its counters or its ledgers
COUNTERS_TIMEOUT_S: Final = 10.0


def child_env() -> dict[str, str]:
    """A child process's environment: this checkout first on its path."""
    # the directory holding the reservoir package: reservoir/tools/bench/children.py
    package_root = str(Path(__file__).resolve().parents[3])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    return env


@dataclass
class _Child:
    """One host process: what it said (its events), and its stderr's last lines."""

    process: subprocess.Popen[str]
    #: what it hosts, for errors: "node" or "requestor"
    role: str
    #: how many participants it hosts
    participants: int
    events: queue.SimpleQueue[dict[str, Any]] = field(default_factory=queue.SimpleQueue)
    #: its round-trip echo, from its ``ready`` event (node hosts)
    echo: str = ""
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=20))

    def next_event(self, event: str, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BenchError(f"{self.role} process {self.process.pid} never said {event!r}")
            try:
                message = self.events.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                if self.process.poll() is not None and self.events.empty():
                    raise self.died() from None
                continue
            if message.get("event") == event:
                return message

    def tell(self, command: str) -> None:
        """A line to its stdin; a child that is gone is a :class:`BenchError`."""
        assert self.process.stdin is not None
        try:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        except OSError:
            raise self.died() from None

    def died(self) -> BenchError:
        status = self.process.wait()
        tail = " | ".join(line.strip() for line in self.stderr_tail if line.strip())
        exit_status = EXIT_BROKER if status == EXIT_BROKER else EXIT_RUN_FAILED
        return BenchError(
            f"{self.role} process {self.process.pid} exited with status {status}: "
            f"{tail or 'no output'}",
            exit_status,
        )


def _pump_events(stream: IO[str], events: queue.SimpleQueue[dict[str, Any]]) -> None:
    for line in stream:
        with contextlib.suppress(ValueError):
            message = json.loads(line)
            if isinstance(message, dict):
                events.put(message)


def _pump_lines(stream: IO[str], tail: deque[str]) -> None:
    for line in stream:
        tail.append(line)


def _spawn(module: str, role: str, args: list[str], participants: int) -> _Child:
    """``python -m module args``: its events read from stdout, its stderr's tail kept."""
    process = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env=child_env(),
    )  # fmt: skip
    child = _Child(process, role, participants)
    assert process.stdout is not None and process.stderr is not None
    threading.Thread(target=_pump_events, args=(process.stdout, child.events), daemon=True).start()
    threading.Thread(
        target=_pump_lines, args=(process.stderr, child.stderr_tail), daemon=True
    ).start()
    return child


class _Hosts:
    """Host processes of one kind, each given a share of the participants' names."""

    #: the module each runs, ``python -m``, and what it hosts
    module: str
    role: str

    def __init__(self, names: Sequence[str], processes: int) -> None:
        shares = [list(names[index::processes]) for index in range(processes)]
        self._children: list[_Child] = []
        try:
            for share in (s for s in shares if s):
                self._children.append(
                    _spawn(self.module, self.role, self._arguments(share), len(share))
                )
        except BaseException:
            for child in self._children:
                child.process.kill()  # never told what to do: nothing to wait for
            self._reap()
            raise

    def _arguments(self, share: list[str]) -> list[str]:
        """The command line of the process hosting ``share``."""
        raise NotImplementedError

    @property
    def pids(self) -> list[int]:
        return [child.process.pid for child in self._children]

    def _ready(self, timeout_s: float) -> list[dict[str, Any]]:
        """Each child's ``ready`` event, in order."""
        deadline = time.monotonic() + timeout_s
        return [
            child.next_event("ready", max(0.1, deadline - time.monotonic()))
            for child in self._children
        ]

    def _reap(self, deadline: float | None = None) -> None:
        """Wait for every child to exit until ``deadline`` (now + :data:`STOP_TIMEOUT_S`),
        SIGKILL the rest, and close their stdin."""
        if deadline is None:
            deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in self._children:
            try:
                child.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
            if child.process.stdin is not None:
                with contextlib.suppress(OSError):
                    child.process.stdin.close()


class ProcessNodes(_Hosts):
    """Node agents in processes of their own (``python -m reservoir.tools.bench.node_host``), the
    agents of one process sharing its broker connection."""

    module = "reservoir.tools.bench.node_host"
    role = "node"

    def __init__(
        self,
        url: BrokerUrl,
        names: Sequence[str],
        processes: int,
        *,
        vcpus: int,
        memory_mb: int,
        vcpu_ratio: float,
    ) -> None:
        self._common = ["--broker", url.given, "--vcpus", str(vcpus)]
        self._common += ["--memory-mb", str(memory_mb), "--vcpu-ratio", str(vcpu_ratio)]
        super().__init__(names, processes)

    def _arguments(self, share: list[str]) -> list[str]:
        return [*self._common, "--names", ",".join(share)]

    def wait_ready(self, timeout_s: float) -> None:
        for child, ready in zip(self._children, self._ready(timeout_s), strict=True):
            child.echo = str(ready.get("echo", ""))

    @property
    def echoes(self) -> list[str]:
        return [child.echo for child in self._children if child.echo]

    def sent(self) -> Counter[str]:
        return self._counters("sent")

    def received(self) -> Counter[str]:
        return self._counters("received")

    def _counters(self, label: str) -> Counter[str]:
        for child in self._children:
            child.tell("counters")
        total: Counter[str] = Counter()
        for child in self._children:
            total.update(child.next_event("counters", COUNTERS_TIMEOUT_S).get(label, {}))
        return total

    def ledgers(self) -> list[dict[str, Any]]:
        for child in self._children:
            child.tell("ledgers")
        return [child.next_event("ledgers", COUNTERS_TIMEOUT_S) for child in self._children]

    def stop(self) -> Counter[str]:
        """SIGTERM every process, read what it sent, SIGKILL any still up after
        :data:`STOP_TIMEOUT_S`."""
        for child in self._children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        total: Counter[str] = Counter()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in self._children:
            with contextlib.suppress(BenchError):
                stopped = child.next_event("stopped", max(0.1, deadline - time.monotonic()))
                total.update(stopped.get("sent", {}))
        self._reap(deadline)
        return total


class ProcessRequestors(_Hosts):
    """The throughput run's requestors in processes of their own
    (``python -m reservoir.tools.bench.requestor_host``), as an API tier's workers are."""

    module = "reservoir.tools.bench.requestor_host"
    role = "requestor"

    def __init__(
        self,
        url: BrokerUrl,
        names: Sequence[str],
        processes: int,
        placements: int,
        *,
        nodes: int,
        roster_from: str,
    ) -> None:
        self._placements, self._names = placements, len(names)
        self._common = ["--broker", url.given, "--nodes", str(nodes)]
        self._common += ["--roster-from", roster_from]
        super().__init__(names, processes)

    def _arguments(self, share: list[str]) -> list[str]:
        count = round(self._placements * len(share) / self._names)
        return [*self._common, "--names", ",".join(share), "--placements", str(count)]

    def wait_ready(self, timeout_s: float) -> None:
        self._ready(timeout_s)

    def place(self, timeout_s: float) -> tuple[list[float], int, Counter[str], Switches]:
        """Every process places its share at once; their latencies, failures, the
        messages their requestors received meanwhile, and their context switches."""
        for child in self._children:
            child.tell("go")
        latencies_s: list[float] = []
        failed = 0
        received: Counter[str] = Counter()
        switched: Counter[str] = Counter()
        deadline = time.monotonic() + timeout_s
        for child in self._children:
            done = child.next_event("done", max(0.1, deadline - time.monotonic()))
            latencies_s.extend(float(s) for s in done.get("latencies_s", []))
            failed += int(done.get("failed", 0))
            received.update(done.get("received", {}))
            switched.update(done.get("switches", {}))
        return latencies_s, failed, received, Switches(switched["woken"], switched["preempted"])

    def stop(self) -> None:
        for child in self._children:
            with contextlib.suppress(BenchError):
                child.tell("stop")
        self._reap()
