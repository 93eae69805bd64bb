"""A requestor process placing without pause while a cluster is upgraded, for
tests/upgrade/test_rolling_upgrade.py: run with either release's interpreter (it imports
nothing of reservoir but what it runs with, and uses only what release 0.1.0 already had).

    python rolling_requestor.py NAME DIRECTORY TOKEN    (RESERVOIR_BROKER_URL set)

Driven over stdin, reporting on stdout (one JSON object a line):

- ``start``: one long task (``sleep``, held until ``release``) is placed, then a thread
  per kind places one request after another: ``plain`` (a third kept until the end, the
  rest freed after a moment), ``task`` (a short task that ends by itself, which frees its
  allocation; its exit code is awaited), ``devices`` (a PCI device, freed after a moment)
  and ``canary`` (a request only nodes of 0.2 or later can take: it requires their
  release trait, and asks for reasons); each attempt is a line of
  ``DIRECTORY/NAME.outcomes.jsonl``;
- ``stop``: no new attempt; once every one in flight is done, what is held (the kept
  placements and the long task's) goes to ``DIRECTORY/NAME.held.jsonl`` as ``reservoir
  request --json`` prints it (``reservoir audit --placements`` reads it);
- ``release``: what is held is freed (the long task is stopped by it);
- ``exit``.

Times (``started``, ``ended``) are the machine's monotonic clock, which every process on
it shares: the test sets them against when each node ran which release.
"""

from __future__ import annotations

import json
import random
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from reservoir import FreeIncomplete, Placement, PlacementError, Requestor
from reservoir.runtime.auditor import placement_record

#: a request's deadline: a placement that takes it is a failure (by timeout)
TIMEOUT_S = 30.0
#: plain placements kept until the end, at most
KEPT = 8
#: the pause between one attempt of a kind and the next
PACE_S = 0.05
#: how long a placement that is freed is held first
HOLD_S = 0.3
CANARY_TRAIT = "RESERVOIR_RELEASE_0_2"


def say(event: str, **fields: object) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


class Placing:
    def __init__(self, requestor: Requestor, name: str, directory: Path, token: str) -> None:
        self.requestor, self.name, self.token = requestor, name, token
        self.outcomes = (directory / f"{name}.outcomes.jsonl").open("a")
        self.held_path = directory / f"{name}.held.jsonl"
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.kept: list[Placement] = []
        self.long_task: Any = None
        self.threads: list[threading.Thread] = []
        self.random = random.Random(name)
        self.sequence = 0

    def request_id(self, kind: str) -> str:
        with self.lock:
            self.sequence += 1
            return f"{self.name}-{kind}-{self.sequence}"

    def record(self, **fields: object) -> None:
        with self.lock:
            self.outcomes.write(json.dumps({"requestor": self.name, **fields}) + "\n")
            self.outcomes.flush()

    def attempt(self, kind: str, place: Callable[[str], Placement]) -> Placement | None:
        request_id = self.request_id(kind)
        started = time.monotonic()
        try:
            placement = place(request_id)
        except PlacementError as error:
            self.record(kind=kind, request_id=request_id, placed=False, started=started,
                        ended=time.monotonic(), error=str(error))  # fmt: skip
            return None
        self.record(kind=kind, request_id=request_id, placed=True, started=started,
                    ended=time.monotonic(), elapsed_s=placement.elapsed_s,
                    nodes=sorted({a.node for a in placement.allocations}))  # fmt: skip
        return placement

    def free(self, kind: str, placement: Placement) -> None:
        try:
            self.requestor.release(placement, timeout_s=60)
        except FreeIncomplete as error:
            self.record(kind=kind, request_id=placement.request_id, freed=False, error=str(error))
        else:
            self.record(kind=kind, request_id=placement.request_id, freed=True)

    # -- the kinds ---------------------------------------------------------------------

    def plain(self) -> None:
        placement = self.attempt(
            "plain",
            lambda rid: self.requestor.reserve(
                vcpus=1, memory_mb=128, request_id=rid, timeout_s=TIMEOUT_S
            ),
        )
        if placement is None:
            return
        with self.lock:
            keep = len(self.kept) < KEPT and self.random.random() < 0.3
            if keep:
                self.kept.append(placement)
        if not keep:
            time.sleep(HOLD_S)
            self.free("plain", placement)

    def task(self) -> None:
        request_id = self.request_id("task")
        started = time.monotonic()
        run = self.requestor.run(
            ["sh", "-c", f"exit 0; : {self.token}"], vcpus=1, memory_mb=64,
            request_id=request_id, timeout_s=TIMEOUT_S,
        )  # fmt: skip
        try:
            placement = run.placement.result(timeout=TIMEOUT_S + 5)
        except PlacementError as error:
            self.record(kind="task", request_id=request_id, placed=False, started=started,
                        ended=time.monotonic(), error=str(error))  # fmt: skip
            return
        ended = time.monotonic()
        try:
            run.wait(timeout_s=60)
            exit_code = run.exit_code
            states = sorted({s.state for s in run.states().values()})
        except Exception as error:
            exit_code, states = None, [f"not done: {error}"]
        self.record(kind="task", request_id=request_id, placed=True, started=started,
                    ended=ended, elapsed_s=placement.elapsed_s,
                    nodes=sorted({a.node for a in placement.allocations}),
                    exit_code=exit_code, states=states)  # fmt: skip

    def devices(self) -> None:
        placement = self.attempt(
            "devices",
            lambda rid: self.requestor.reserve(
                vcpus=1, memory_mb=128, pci={"gpu-a100": 1}, request_id=rid, timeout_s=TIMEOUT_S
            ),
        )
        if placement is not None:
            time.sleep(HOLD_S)
            self.free("devices", placement)

    def canary(self) -> None:
        placement = self.attempt(
            "canary",
            lambda rid: self.requestor.reserve(
                vcpus=1,
                memory_mb=64,
                required_traits=[CANARY_TRAIT],
                explain=True,
                request_id=rid,
                timeout_s=TIMEOUT_S,
            ),
        )
        if placement is not None:
            time.sleep(HOLD_S)
            self.free("canary", placement)

    def loop(self, kind: Callable[[], None]) -> None:
        while not self.stopping.is_set():
            kind()
            time.sleep(PACE_S)

    # -- commands ----------------------------------------------------------------------

    def start(self) -> None:
        request_id = self.request_id("long")
        self.long_task = self.requestor.run(
            ["sh", "-c", f"sleep 3600; : {self.token}"], vcpus=1, memory_mb=64,
            request_id=request_id, timeout_s=TIMEOUT_S, stop_grace_s=1.0,
        )  # fmt: skip
        placement = self.long_task.placement.result(timeout=TIMEOUT_S + 5)
        self.long_task.wait_started(timeout_s=30)
        self.record(kind="long", request_id=request_id, placed=True,
                    nodes=sorted({a.node for a in placement.allocations}))  # fmt: skip
        for kind in (self.plain, self.task, self.devices, self.canary):
            thread = threading.Thread(target=self.loop, args=(kind,), daemon=True)
            thread.start()
            self.threads.append(thread)
        say("started", long_task=request_id)

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join()
        held = [*self.kept, self.long_task.placement.result()]
        with self.held_path.open("w") as out:
            for placement in held:
                out.write(json.dumps(placement_record(placement)) + "\n")
        say("stopped", held=len(held))

    def release(self) -> None:
        for placement in self.kept:
            self.free("plain", placement)
        self.free("long", self.long_task.placement.result())
        self.long_task.wait(timeout_s=30)
        states = sorted({s.state for s in self.long_task.states().values()})
        self.record(kind="long", request_id=self.long_task.request_id, states=states)
        say("released", long_task_states=states)


def main() -> None:
    name, directory, token = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    with Requestor(name=name) as requestor:
        placing = Placing(requestor, name, directory, token)
        say("ready")
        for line in sys.stdin:
            command = line.strip()
            if command == "start":
                placing.start()
            elif command == "stop":
                placing.stop()
            elif command == "release":
                placing.release()
            elif command == "exit":
                break
    say("exited")


if __name__ == "__main__":
    main()
