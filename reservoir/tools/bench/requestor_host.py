"""The requestor-host process of ``reservoir bench --requestor-processes``: several
requestors sharing one broker connection, placing their share of the throughput run when
told to, as the workers of an API tier would.

This module owns the host's side of its conversation with ``reservoir.tools.bench.runner``,
one JSON object per line on stdout (nothing else is ever written there; logs go to stderr):

- ``{"event": "ready", "requestors": K}`` once every requestor knows the nodes and has
  placed its warm-up placements;
- on a line ``go`` on stdin, every requestor places its share in a thread of its own,
  then ``{"event": "done", "latencies_s": [...], "failed": N, "sent": {KIND: COUNT},
  "received": {...}}``, the messages counted from ``go`` on, summed over the requestors;
- ``{"event": "stopped"}`` once every requestor has closed, on a line ``stop``, on
  SIGTERM or SIGINT, or when stdin closes (the bench is gone).

    python -m reservoir.tools.bench.requestor_host --broker 'amqp://...?exchange=...' \\
        --names r-0,r-1 --placements 500 --nodes 200 [--roster-from keeper]

Exit status: 0 once stopped, 2 on bad arguments, 3 when the broker cannot be reached.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import queue
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from types import FrameType

from reservoir.broker import Broker, BrokerError
from reservoir.clock import SystemClock, ThreadScheduler
from reservoir.exit_status import EXIT_BROKER
from reservoir.protocol.placement import PlacementError
from reservoir.runtime.requestor import Requestor
from reservoir.runtime.settings import Settings
from reservoir.tools.bench.runner import (
    FLAVOUR_MEMORY_MB,
    FLAVOUR_VCPUS,
    PLACE_TIMEOUT_S,
    READY_TIMEOUT_S,
    WARMUP_PLACEMENTS,
)

__all__ = ["main", "place_one"]

_POLL_S = 0.2


def place_one(requestor: Requestor) -> None:
    """One placement of the bench's flavour (the runner's, so that both runs ask alike)."""
    requestor.reserve(vcpus=FLAVOUR_VCPUS, memory_mb=FLAVOUR_MEMORY_MB, timeout_s=PLACE_TIMEOUT_S)


def _say(event: str, **fields: object) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}, sort_keys=True) + "\n")
    sys.stdout.flush()


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m reservoir.tools.bench.requestor_host",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--broker", required=True, help="broker URL (with ?exchange=)")
    parser.add_argument("--names", required=True, help="requestor names, comma-separated")
    parser.add_argument("--placements", type=int, required=True, help="this host's share")
    parser.add_argument("--nodes", type=int, required=True, help="nodes a roster must know")
    parser.add_argument("--roster-from", choices=("announcements", "keeper"),
                        default="announcements")  # fmt: skip
    args = parser.parse_args(argv)
    args.names = [name for name in args.names.split(",") if name]
    if not args.names or args.placements < 0 or args.nodes < 1:
        parser.error("give at least one name, --placements >= 0 and --nodes >= 1")
    return args


def _counters(requestors: Sequence[Requestor], label: str) -> Counter[str]:
    total: Counter[str] = Counter()
    for requestor in requestors:
        total.update(requestor.metrics.by_label(label))
    return total


def _ready(requestors: Sequence[Requestor], nodes: int) -> None:
    """Each requestor knows the nodes (all of them, or a keeper's full sample), then
    warms up."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    for requestor in requestors:
        wanted = min(nodes, requestor.machine.config.keeper_sample)
        if requestor.machine.config.roster_from == "announcements":
            wanted = nodes
        while len(requestor.machine.roster) < wanted:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{requestor.name} knew {len(requestor.machine.roster)} nodes")
            time.sleep(0.01)
        for _ in range(WARMUP_PLACEMENTS):
            with contextlib.suppress(PlacementError):
                place_one(requestor)


def _place(requestors: Sequence[Requestor], placements: int) -> tuple[list[float], int]:
    """Every requestor places its share at once, a thread each."""
    shares = [
        placements // len(requestors) + (1 if i < placements % len(requestors) else 0)
        for i in range(len(requestors))
    ]
    lock = threading.Lock()
    latencies_s: list[float] = []
    failed = [0]

    def worker(requestor: Requestor, share: int) -> None:
        mine: list[float] = []
        misses = 0
        for _ in range(share):
            started = time.perf_counter()
            try:
                place_one(requestor)
            except PlacementError:
                misses += 1
            else:
                mine.append(time.perf_counter() - started)
        with lock:
            latencies_s.extend(mine)
            failed[0] += misses

    threads = [
        threading.Thread(target=worker, args=(r, s), daemon=True)
        for r, s in zip(requestors, shares, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return latencies_s, failed[0]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    commands: queue.SimpleQueue[str] = queue.SimpleQueue()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        commands.put("stop")  # SimpleQueue.put is reentrant: safe in a signal handler

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def read_stdin() -> None:
        for line in sys.stdin:
            commands.put(line.strip())
        commands.put("stop")  # the bench is gone: do not outlive it

    settings = Settings(broker_url=args.broker, roster_from=args.roster_from)
    from brokers import connect

    try:
        broker: Broker = connect(settings.broker_url)
    except BrokerError as error:
        print(f"bench requestors: cannot reach the broker: {error}", file=sys.stderr)
        return EXIT_BROKER
    timers = ThreadScheduler(SystemClock(), name="bench-requestor-timers")
    requestors: list[Requestor] = []
    try:
        for name in args.names:
            requestors.append(Requestor(broker, name=name, settings=settings, scheduler=timers))
        _ready(requestors, args.nodes)
        _say("ready", requestors=len(requestors))
        threading.Thread(target=read_stdin, name="bench-requestor-stdin", daemon=True).start()
        while True:
            try:
                command = commands.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if command == "stop":
                break
            if command == "go":
                sent, received = _counters(requestors, "sent"), _counters(requestors, "received")
                latencies_s, failed = _place(requestors, args.placements)
                _say(
                    "done",
                    latencies_s=latencies_s,
                    failed=failed,
                    sent=dict(_counters(requestors, "sent") - sent),
                    received=dict(_counters(requestors, "received") - received),
                )
    except (BrokerError, TimeoutError) as error:
        print(f"bench requestors: {error}", file=sys.stderr)
        return EXIT_BROKER
    finally:
        for requestor in requestors:
            requestor.close()
        timers.close()
        broker.close()
    _say("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
