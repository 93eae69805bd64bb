"""The bench's roster keepers: in this process on ``memory://`` (an in-process broker cannot
be shared), else ``reservoir keeper`` processes, as a deployment runs them; either way one
can be killed and started again during a run (``--kill-keeper``).

This module owns starting them, knowing when each knows every node of the measured cluster
(:meth:`Keepers.wait_ready`), killing one (a process gets SIGKILL: its connection drops and
the broker deletes its inbox; in this process the keeper's inbox is deleted, as the broker
does for a dead one) and starting it again under the same name, and reading what each has
received and sent. A keeper process reports through its ``--status-file``, rewritten
every :data:`STATUS_INTERVAL_S`.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from reservoir.broker import Broker
from reservoir.brokers import BrokerUrl
from reservoir.clock import Scheduler
from reservoir.runtime.keeper import RosterKeeper
from reservoir.runtime.settings import Settings
from reservoir.tools.bench.children import STOP_TIMEOUT_S, child_env
from reservoir.tools.bench.errors import BenchError

__all__ = ["STATUS_INTERVAL_S", "InProcessKeepers", "Keepers", "ProcessKeepers"]

#: how often a keeper process rewrites its status file
STATUS_INTERVAL_S: Final = 0.05


class Keepers(ABC):
    """The run's keepers, by index; each named ``names[index]`` for the run."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)

    def wait_ready(self, nodes: int, timeout_s: float) -> None:
        """Until every keeper running knows ``nodes`` nodes; :class:`BenchError` after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            known = self.nodes_known()
            if all(n >= nodes for n in known.values()):
                return
            if time.monotonic() > deadline:
                raise BenchError(f"the keepers did not hear of {nodes} nodes in time: {known}")
            time.sleep(0.01)

    @abstractmethod
    def nodes_known(self) -> dict[str, int]:
        """How many nodes each running keeper knows, by name."""

    @abstractmethod
    def kill(self, index: int) -> None:
        """The keeper dies: its inbox and bindings are gone."""

    @abstractmethod
    def start(self, index: int) -> None:
        """Start keeper ``index`` (again, after :meth:`kill`), under the same name."""

    @abstractmethod
    def samples(self, index: int) -> int:
        """The samples keeper ``index`` sent since it last started."""

    @abstractmethod
    def received(self) -> Counter[str]:
        """What the running keepers received since they last started, by kind."""

    @abstractmethod
    def stop(self) -> None:
        """Stop every keeper. Idempotent."""


class InProcessKeepers(Keepers):
    """Keepers of this process, on the bench's broker and timer thread."""

    def __init__(
        self, broker: Broker, names: Sequence[str], settings: Settings, scheduler: Scheduler
    ) -> None:
        super().__init__(names)
        self._broker, self._settings, self._scheduler = broker, settings, scheduler
        self._running: dict[int, RosterKeeper] = {}
        for index in range(len(self.names)):
            self.start(index)

    def nodes_known(self) -> dict[str, int]:
        return {k.name: k.nodes_known() for k in self._running.values()}

    def kill(self, index: int) -> None:
        self._running.pop(index).close()

    def start(self, index: int) -> None:
        self._running[index] = RosterKeeper(
            self._broker, name=self.names[index], settings=self._settings,
            scheduler=self._scheduler,
        )  # fmt: skip

    def samples(self, index: int) -> int:
        keeper = self._running.get(index)
        return 0 if keeper is None else keeper.machine.counters["samples"]

    def received(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for keeper in self._running.values():
            total.update(keeper.metrics.by_label("received"))
        return total

    def stop(self) -> None:
        for index in list(self._running):
            self._running.pop(index).close()


class ProcessKeepers(Keepers):
    """``reservoir keeper`` processes, one per keeper, each on a connection of its own."""

    def __init__(self, url: BrokerUrl, names: Sequence[str]) -> None:
        super().__init__(names)
        self._url = url
        self._directory = tempfile.TemporaryDirectory(prefix="reservoir-bench-keepers-")
        self._running: dict[int, subprocess.Popen[str]] = {}
        try:
            for index in range(len(self.names)):
                self.start(index)
        except BaseException:
            self.stop()
            raise

    def _status_path(self, index: int) -> Path:
        return Path(self._directory.name) / f"{self.names[index]}.json"

    def _log_path(self, index: int) -> Path:
        return Path(self._directory.name) / f"{self.names[index]}.log"

    def _status(self, index: int) -> dict[str, Any]:
        """The keeper's last status, or {} before its first (a file being replaced is read
        whole: the keeper writes it beside and renames it)."""
        process = self._running[index]
        if process.poll() is not None:
            lines = self._log_path(index).read_text(errors="replace").splitlines()
            tail = " | ".join(line.strip() for line in lines[-5:] if line.strip())
            raise BenchError(
                f"keeper {self.names[index]} (process {process.pid}) exited with status "
                f"{process.returncode}: {tail or 'no output'}"
            )
        try:
            status: dict[str, Any] = json.loads(self._status_path(index).read_text())
        except FileNotFoundError:
            return {}
        return status

    def nodes_known(self) -> dict[str, int]:
        return {self.names[i]: int(self._status(i).get("nodes_known", 0)) for i in self._running}

    def kill(self, index: int) -> None:
        process = self._running.pop(index)
        process.send_signal(signal.SIGKILL)
        process.wait()
        self._status_path(index).unlink(missing_ok=True)

    def start(self, index: int) -> None:
        self._status_path(index).unlink(missing_ok=True)
        command = [
            sys.executable, "-m", "reservoir", "keeper", "--broker", self._url.given,
            "--name", self.names[index], "--status-file", str(self._status_path(index)),
            "--status-interval", str(STATUS_INTERVAL_S), "--connect-attempts", "1",
        ]  # fmt: skip
        with self._log_path(index).open("a") as log:  # its lines, for an error's tail
            self._running[index] = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                text=True, env=child_env(),
            )  # fmt: skip

    def samples(self, index: int) -> int:
        if index not in self._running:
            return 0
        return int(self._status(index).get("counters", {}).get("samples", 0))

    def received(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for index in self._running:
            total.update(self._status(index).get("received", {}))
        return total

    def stop(self) -> None:
        for process in self._running.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in self._running.values():
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._running.clear()
        with contextlib.suppress(OSError):
            self._directory.cleanup()
