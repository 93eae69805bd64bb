"""One requestor process of a chaos run (``python -m reservoir.tools.chaos.worker``).

It places requests one after another through a real :class:`~reservoir.Requestor`, keeps
at most ``--live`` placements and frees the oldest beyond that (an API server creating and
deleting instances), and writes everything it is told to its record
(:mod:`reservoir.tools.chaos.record`) before acting on it. Killed and restarted, it reads the
record and first settles what the killed process left open: placements never answered are
asked for again under the same request ids, frees never confirmed are sent again.

It stops after ``--placements`` placements, or on SIGTERM: then it starts nothing new,
waits for what is in flight, confirms its outstanding frees (retrying while nodes come
back) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from types import FrameType
from typing import Any, Final

from reservoir.interrupt import set_from_a_signal_handler
from reservoir.protocol.messages import TaskSpec
from reservoir.protocol.placement import Placement, PlacementError
from reservoir.runtime.auditor import placement_record, read_placements
from reservoir.runtime.backoff import until_connected
from reservoir.runtime.requestor import FreeIncomplete, Requestor
from reservoir.runtime.settings import Settings
from reservoir.tools.chaos.record import CallerRecord, RecordWriter, read_events

__all__ = ["main"]

#: the shapes a worker asks for: small enough that the run never fills the cluster, so
#: every failure is a false one
SHAPES: tuple[Mapping[str, int], ...] = (
    {"vcpus": 1, "memory_mb": 512},
    {"vcpus": 2, "memory_mb": 1024},
    {"vcpus": 1, "memory_mb": 2048},
)


#: every this-many-th placement (by its sequence number) carries a task: a long sleep on
#: the node, kept with its allocation until the worker frees it (which stops it), its
#: command naming the run's token and the request id, so the harness tells its processes
TASK_EVERY: Final = 3


def task_for(request_id: str, token: str) -> TaskSpec | None:
    """The task placement ``request_id`` carries, if any (the same after a restart)."""
    if not token or int(request_id.rsplit("-", 1)[1]) % TASK_EVERY:
        return None
    return TaskSpec(
        driver="exec",
        command=("sh", "-c", f"sleep 3600; : {token} {request_id}"),
        keep_allocation=True,
        stop_grace_s=1.0,
    )


#: how long a stopping worker keeps trying to get its frees confirmed
SETTLE_FREES_S = 120.0


class Worker:
    """Places and frees until its target or a stop, writing its record as it goes."""

    def __init__(
        self,
        requestor: Requestor,
        writer: RecordWriter,
        record: CallerRecord,
        *,
        name: str,
        placements: int,
        placed_before: int,
        live: int,
        timeout_s: float,
        seed: int,
        stop: threading.Event,
        task_token: str = "",
    ) -> None:
        self.requestor = requestor
        self.writer = writer
        self.name = name
        self.target = placements
        self.placed = placed_before
        self.live = live
        self.timeout_s = timeout_s
        self.stop = stop
        self.random = random.Random(seed)
        self.sequence = record.last_sequence + 1
        self.unanswered = dict(record.unanswered)
        #: request id -> placement held, oldest first (freed first)
        self.held: dict[str, Placement] = {
            p.request_id: p for p in read_placements(json.dumps(h) for h in record.held.values())
        }
        self.frees_in_flight: dict[str, Future[tuple[str, ...]]] = {}
        self.frees_to_resume = sorted(record.freeing & set(self.held))
        #: names the run in the tasks' commands (empty: no tasks)
        self.task_token = task_token

    def run(self) -> None:
        for request_id, shape in list(self.unanswered.items()):
            self.place(request_id, shape)
        for request_id in self.frees_to_resume:
            self.start_free(request_id)
        while not self.stop.is_set() and self.placed < self.target:
            request_id = f"{self.name}-{self.sequence}"
            self.sequence += 1
            self.place(request_id, self.random.choice(SHAPES))
            unfreed = [r for r in self.held if r not in self.frees_in_flight]
            for request_id in unfreed[: max(0, len(unfreed) - self.live)]:
                self.start_free(request_id)
            self.reap_frees(block=False)
        self.settle_frees()

    def place(self, request_id: str, shape: Mapping[str, Any]) -> None:
        # Asked again after a restart, the caller gets a fresh deadline: it asks anew.
        self.writer.write(
            "start",
            id=request_id,
            seq=int(request_id.rsplit("-", 1)[1]),
            shape=dict(shape),
            deadline=self.writer.clock.wall() + self.timeout_s,
        )
        try:
            placement = self.requestor.reserve(
                timeout_s=self.timeout_s,
                request_id=request_id,
                task=task_for(request_id, self.task_token),
                **shape,
            )
        except PlacementError as error:
            why = error.explanation
            self.writer.write(
                "failed",
                id=request_id,
                error=str(error),
                declines=why.declines_received,
                reasons=dict(why.reasons),
                busy=why.busy_nodes,
            )
            return
        self.writer.write("placed", id=request_id, placement=placement_record(placement))
        self.held[request_id] = placement
        self.placed += 1

    def start_free(self, request_id: str) -> None:
        self.writer.write("free", id=request_id)
        self.frees_in_flight[request_id] = self.requestor.release_future(self.held[request_id])

    def reap_frees(self, *, block: bool) -> None:
        for request_id, future in list(self.frees_in_flight.items()):
            if not block and not future.done():
                continue
            del self.frees_in_flight[request_id]
            try:
                future.result(timeout=self.timeout_s + 5)
            except (FreeIncomplete, TimeoutError) as error:
                self.writer.write("free_incomplete", id=request_id, error=str(error))
                self.start_free(request_id)  # again: the node may be back by now
                continue
            self.writer.write("freed", id=request_id)
            del self.held[request_id]

    def settle_frees(self) -> None:
        """Confirm every outstanding free before exiting (nodes may be coming back)."""
        deadline = self.writer.clock.now() + SETTLE_FREES_S
        while self.frees_in_flight and self.writer.clock.now() < deadline:
            self.reap_frees(block=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reservoir.tools.chaos.worker")
    parser.add_argument("--broker", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--record", type=Path, required=True)
    parser.add_argument("--placements", type=int, required=True)
    parser.add_argument("--live", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task-token", default="")
    args = parser.parse_args(argv)

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        set_from_a_signal_handler(stop)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    events = read_events(args.record)
    record = CallerRecord.replay(events)
    placed_before = len({e["id"] for e in events if e["e"] == "placed"})
    boots = sum(1 for e in events if e["e"] == "boot")
    writer = RecordWriter(args.record)
    writer.write("boot")
    settings = Settings(broker_url=args.broker, request_timeout_s=args.timeout)

    def say(attempt: int, error: BaseException, wait_s: float) -> None:
        print(f"{args.name}: cannot reach the broker (attempt {attempt}): {error}", file=sys.stderr)

    requestor = until_connected(
        # a name of its own per incarnation: the killed one's inbox may linger a moment
        lambda: Requestor(settings.broker_url, settings=settings, name=f"{args.name}.{boots}"),
        0,
        stop,
        on_wait=say,
    )
    if requestor is None:
        writer.close()
        return 0
    worker = Worker(
        requestor,
        writer,
        record,
        name=args.name,
        placements=args.placements,
        placed_before=placed_before,
        live=args.live,
        timeout_s=args.timeout,
        # each incarnation draws other shapes; the record, not the seed, makes it resume
        seed=args.seed * 1_000_003 + len(events),
        stop=stop,
        task_token=args.task_token,
    )
    try:
        worker.run()
    finally:
        requestor.close()
        writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
