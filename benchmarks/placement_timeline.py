"""Where a sequential placement's time goes on RabbitMQ, across the bench's processes.

    python benchmarks/placement_timeline.py [--nodes 50] [--placements 500] \\
        [--broker amqp://guest:guest@127.0.0.1:5672/] [--json]

Runs ``reservoir bench`` with a ``sitecustomize`` of this script's on ``PYTHONPATH``: in the
bench's process and in every node process it records, on ``time.monotonic_ns`` (one clock
for every process of the machine), each message a participant hands to its endpoint
(``send``, ``publish``) and each one its driver's handler starts on, with the message's kind
and request id, and when the bench's caller enters and leaves ``Requestor.reserve``. Then it
takes the sequential run's placements (the first 20 left out as warm-up) and prints the
median of each step of a placement's path: the caller's work before the first probe leaves
it, each hop (handed to the broker here, a handler starting there: the client library, the
socket, RabbitMQ and the reader's IO thread), each participant's work between a message
arriving and its answer handed over, and the caller waking with the placement.

It measures by wrapping the runtime's methods, so its figures carry that overhead (a few
microseconds a step); compare runs of it with each other, not with ``reservoir bench``'s
``place_p50_ms``. docs/performance.md holds what it showed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from functools import partial
from pathlib import Path

#: what every process of the bench runs first, when RESERVOIR_TIMELINE names a directory
HOOKS = """
import atexit, os, re, sys, threading, time

_DIR = os.environ.get("RESERVOIR_TIMELINE")
if _DIR:
    _events = []
    _now = time.monotonic_ns
    _KIND = re.compile(rb'"kind":"(\\w+)"')
    _ID = re.compile(rb'"request_id":"(\\w+)"')

    def _tag(body):
        kind, request_id = _KIND.search(body), _ID.search(body)
        return "%s %s" % (
            kind.group(1).decode() if kind else "?",
            request_id.group(1).decode() if request_id else "-",
        )

    def _write():
        with open(os.path.join(_DIR, "%d.txt" % os.getpid()), "w") as out:
            for at, what, detail in _events:
                out.write("%d %d %s %s\\n" % (at, os.getpid(), what, detail))

    atexit.register(_write)

    def _driver(module):
        handle = module.Driver._on_delivery

        def on_delivery(self, delivery):
            _events.append((_now(), "handles", _tag(delivery.body)))
            return handle(self, delivery)

        module.Driver._on_delivery = on_delivery

    def _endpoint(module):
        for name in ("send", "publish"):
            original = getattr(module.AmqpEndpoint, name)

            def hand_over(self, to, body, _original=original):
                _events.append((_now(), "hands", _tag(body)))
                return _original(self, to, body)

            setattr(module.AmqpEndpoint, name, hand_over)

    def _requestor(module):
        reserve = module.Requestor.reserve

        def timed(self, *args, **kwargs):
            _events.append((_now(), "reserve", threading.current_thread().name))
            try:
                return reserve(self, *args, **kwargs)
            finally:
                _events.append((_now(), "reserved", threading.current_thread().name))

        module.Requestor.reserve = timed

    _PENDING = {
        "reservoir.runtime.driver": _driver,
        "brokers.amqp.threaded": _endpoint,
        "reservoir.runtime.requestor": _requestor,
    }
    import builtins

    _import = builtins.__import__

    def _import_and_hook(name, *args, **kwargs):
        module = _import(name, *args, **kwargs)
        for ready in [n for n in _PENDING if n in sys.modules]:
            try:
                _PENDING[ready](sys.modules[ready])
            except AttributeError:  # still being imported: the next import hooks it
                continue
            del _PENDING[ready]
        if not _PENDING:
            builtins.__import__ = _import
        return module

    builtins.__import__ = _import_and_hook
"""

#: the steps of one placement, in order, as (label, from event, to event)
STEPS = (
    "caller: reserve() -> first probe handed over",
    "second probe handed over after the first",
    "hop: probe -> node handler",
    "node: probe -> offer handed over",
    "hop: last offer -> requestor handler",
    "requestor: last offer -> award handed over",
    "hop: award -> node handler",
    "node: award -> accepted handed over",
    "hop: accepted -> requestor handler",
    "requestor: accepted -> caller returns",
)


def run_bench(args: argparse.Namespace, directory: Path) -> None:
    (directory / "sitecustomize.py").write_text(HOOKS)
    env = dict(os.environ, RESERVOIR_TIMELINE=str(directory))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "reservoir", "bench", "--broker", args.broker]
    command += ["--nodes", str(args.nodes), "--placements", str(args.placements), "--json"]
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)


def read_events(directory: Path) -> list[tuple[int, str, str, str]]:
    events = []
    for path in directory.glob("*.txt"):
        for line in path.read_text().splitlines():
            at, pid, what, detail = line.split(" ", 3)
            events.append((int(at), pid, what, detail))
    events.sort()
    return events


def times_of(span: list[tuple[int, str, str, str]], t0: int, what: str, detail: str) -> list[float]:
    """When the events ``what`` with ``detail`` happened, in microseconds after ``t0``."""
    return [(t - t0) / 1000 for t, _, w, d in span if w == what and d == detail]


def steps_of(events: list[tuple[int, str, str, str]], warm_up: int = 20) -> dict[str, list[float]]:
    """Each step's durations in microseconds, over the sequential run's placements (those
    the bench's main thread made; the throughput run's threads are left out)."""
    bench_pid = Counter(pid for _, pid, _, _ in events).most_common(1)[0][0]
    starts = [
        i
        for i, (_, pid, what, detail) in enumerate(events)
        if pid == bench_pid and what == "reserve" and detail == "MainThread"
    ]
    steps: dict[str, list[float]] = defaultdict(list)
    for start in starts[warm_up:]:
        t0 = events[start][0]
        end = next(
            i
            for i in range(start, len(events))
            if events[i][1] == bench_pid and events[i][2] == "reserved"
        )
        span = events[start : end + 1]
        request_id = next(
            (d.split()[1] for _, _, w, d in span if w == "hands" and d.startswith("request ")),
            None,
        )
        if request_id is None:
            continue

        on = partial(times_of, span, t0)
        probes = on("hands", f"request {request_id}")
        heard = on("handles", f"request {request_id}")
        offers = on("hands", f"offer {request_id}")
        offered = on("handles", f"offer {request_id}")
        award = on("hands", f"award {request_id}")
        awarded = on("handles", f"award {request_id}")
        accepted = on("hands", f"accepted {request_id}")
        heard_accepted = on("handles", f"accepted {request_id}")
        whole = (span[-1][0] - t0) / 1000
        if len(probes) != 2 or len(offered) < 2 or not (award and awarded and accepted):
            continue  # not a two-probe placement awarded at once: not this path
        if not heard_accepted:
            continue
        durations = (
            probes[0],
            probes[1] - probes[0],
            min(heard) - probes[0],
            statistics.mean(b - a for a, b in zip(sorted(heard), sorted(offers), strict=False)),
            offered[-1] - max(offers),
            award[0] - offered[-1],
            awarded[0] - award[0],
            accepted[0] - awarded[0],
            heard_accepted[0] - accepted[0],
            whole - heard_accepted[0],
        )
        steps["whole placement"].append(whole)
        for label, duration in zip(STEPS, durations, strict=True):
            steps[label].append(duration)
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--placements", type=int, default=500)
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="reservoir-timeline-") as name:
        run_bench(args, Path(name))
        steps = steps_of(read_events(Path(name)))
    if not steps:
        print("no sequential placement took the two-probe path", file=sys.stderr)
        return 1
    medians = {label: round(statistics.median(values), 1) for label, values in steps.items()}
    if args.json:
        print(json.dumps({"placements": len(steps["whole placement"]), "p50_us": medians}))
        return 0
    print(f"{len(steps['whole placement'])} placements, median of each step in microseconds")
    for label, median in medians.items():
        print(f"{median:9.1f}  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
