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

Each hop is split where its bytes cross a socket, stamped in the pika driver
(``reservoir.brokers.pika_broker``: the bytes a ``send()`` wrote, stamped as the call starts, and
the bytes the connection was handed as they were read): the sender's IO thread (handed over ->
written), the wire (written -> read: the kernel, RabbitMQ, and the reading process woken)
and the reader's adapter (read -> handler). Stamped as ``send()`` starts, not as it
returns: on loopback the call can return late, once the sender has its core and the
interpreter's lock back, long after its bytes have gone.

Before the bench starts it measures what this machine takes to wake a waiting thread and a
waiting process (:func:`wake_ups`), the floor under every hand-over and hop.

It measures by wrapping the runtime's methods, so its figures carry that overhead (a few
microseconds a step); compare runs of it with each other, not with ``reservoir bench``'s
``place_p50_ms``. What it showed: docs/performance.md, "The library's targets".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
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

    def _tags(data):
        # every message in a chunk of the socket's bytes (a write or a read holds several)
        kinds = list(_KIND.finditer(data))
        if not kinds:  # the round trips' bodies: an address, a newline, "x" to 512 bytes
            return ["round-trip -"] * data.count(b"x" * 16 + b"\\xce")
        found = []
        for i, kind in enumerate(kinds):
            end = kinds[i + 1].start() if i + 1 < len(kinds) else len(data)
            request_id = _ID.search(data, kind.end(), end)
            found.append("%s %s" % (
                kind.group(1).decode(), request_id.group(1).decode() if request_id else "-"
            ))
        return found

    def _socket(module):
        # the pika driver's socket: bytes written (as send() starts) and read (as the
        # connection is handed them); a transport or a pika it does not tune goes unstamped
        transport = module.TunedPlaintextTransport
        send = transport._sigint_safe_send

        def written(self, sock, chunk):
            at = _now()  # the bytes go as the call starts; it may return much later
            sent = send(self, sock, chunk)
            for tag in _tags(chunk[:sent]):
                _events.append((at, "writes", tag))
            return sent

        transport._sigint_safe_send = written
        connection = module.HotPathConnection
        data_available = connection._on_data_available

        def read(self, data):
            at = _now()
            for tag in _tags(data):
                _events.append((at, "reads", tag))
            return data_available(self, data)

        connection._on_data_available = read

    _PENDING = {
        "reservoir.runtime.machine_runner": _driver,
        "reservoir.brokers.amqp.threaded": _endpoint,
        "reservoir.runtime.requestor": _requestor,
        "reservoir.brokers.pika_broker": _socket,
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


def bench_pid_of(events: list[tuple[int, str, str, str]]) -> str:
    """The bench's process: the one whose caller enters ``Requestor.reserve``."""
    return Counter(pid for _, pid, what, _ in events if what == "reserve").most_common(1)[0][0]


def steps_of(events: list[tuple[int, str, str, str]], warm_up: int = 20) -> dict[str, list[float]]:
    """Each step's durations in microseconds, over the sequential run's placements (those
    the bench's main thread made; the throughput run's threads are left out)."""
    bench_pid = bench_pid_of(events)
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
        for label, parts in hops_at_the_socket(span, request_id, bench_pid).items():
            for part, duration in zip(HOP_PARTS, parts, strict=True):
                steps[f"{label}: {part}"].append(duration)
    return steps


#: a hop's three parts, split where its bytes leave one process's socket and reach another's
HOP_PARTS = (
    "handed over -> written (the sender's IO thread)",
    "written -> read (the kernel, RabbitMQ, the reader woken)",
    "read -> handler (the reader's adapter)",
)

#: each hop: its message's kind, whether the bench's process sends it, and whether the
#: placement waits for the last of its kind (the second offer) rather than the first
HOPS = (
    ("hop: probe -> node handler", "request", True, False),
    ("hop: last offer -> requestor handler", "offer", False, True),
    ("hop: award -> node handler", "award", True, False),
    ("hop: accepted -> requestor handler", "accepted", False, False),
)


def hops_at_the_socket(
    span: list[tuple[int, str, str, str]], request_id: str, bench_pid: str
) -> dict[str, tuple[float, float, float]]:
    """Each hop of one placement split at the socket (``HOP_PARTS``), in microseconds; a hop
    whose bytes were not all stamped (another transport, a message split across reads) is
    left out."""
    found = {}
    for label, kind, from_bench, last in HOPS:
        tag = f"{kind} {request_id}"
        times: dict[str, list[int]] = defaultdict(list)
        for at, pid, what, detail in span:
            if detail != tag:
                continue
            if what in ("hands", "handles"):
                times[what].append(at)
            elif what == "writes" and (pid == bench_pid) == from_bench:
                times[what].append(at)  # the sender's socket
            elif what == "reads" and (pid == bench_pid) != from_bench:
                times[what].append(at)  # the reader's
        if len(times) < 4:
            continue
        pick = max if last else min
        handed, written, read, handled = (
            pick(times[what]) for what in ("hands", "writes", "reads", "handles")
        )
        found[label] = (
            (written - handed) / 1000,
            (read - written) / 1000,
            (handled - read) / 1000,
        )
    return found


def round_trip_hops(events: list[tuple[int, str, str, str]], bench_pid: str) -> list[float]:
    """The wire part (written -> read) of each hop of the bench's round trips to a node
    process (out and back), in microseconds: the same path as a placement's hops, with an
    echo at the far end that does nothing else. Its round trips to an echo in its own
    process are left out."""
    stamps = [
        (at, pid, what)
        for at, pid, what, detail in events
        if detail == "round-trip -" and what in ("writes", "reads")
    ]
    hops = []
    for out, there, echoed, back in zip(stamps, stamps[1:], stamps[2:], stamps[3:], strict=False):
        if (
            (out[1], out[2], back[1], back[2]) == (bench_pid, "writes", bench_pid, "reads")
            and (there[2], echoed[2]) == ("reads", "writes")
            and there[1] == echoed[1] != bench_pid
        ):
            hops += [(there[0] - out[0]) / 1000, (back[0] - echoed[0]) / 1000]
    return hops


def wake_ups(rounds: int = 2000) -> dict[str, float]:
    """What this machine takes to wake a thread, and a process on another core, that waits:
    half the median of ``rounds`` ping-pongs (two ``threading.Event``; two pipes to a child
    process), in microseconds. A hop pays one or more of these wherever nothing else runs."""
    ping, pong = threading.Event(), threading.Event()

    def answer() -> None:
        for _ in range(rounds):
            ping.wait()
            ping.clear()
            pong.set()

    peer = threading.Thread(target=answer)
    peer.start()
    threads = []
    for _ in range(rounds):
        started = time.perf_counter_ns()
        ping.set()
        pong.wait()
        pong.clear()
        threads.append(time.perf_counter_ns() - started)
    peer.join()
    # The two processes on two cores: on one, a pipe's wake-up is a context switch the
    # kernel makes at once, which no hop between processes on two cores gets.
    allowed = sorted(os.sched_getaffinity(0))
    there, here = os.pipe(), os.pipe()
    child = os.fork()
    if child == 0:  # the child answers each byte, and goes when the parent's end closes
        os.sched_setaffinity(0, {allowed[-1]})
        os.close(there[1])
        while os.read(there[0], 1):
            os.write(here[1], b"x")
        os._exit(0)
    processes = []
    os.sched_setaffinity(0, {allowed[0]})
    try:
        for _ in range(rounds):
            started = time.perf_counter_ns()
            os.write(there[1], b"x")
            os.read(here[0], 1)
            processes.append(time.perf_counter_ns() - started)
    finally:
        os.sched_setaffinity(0, allowed)
        for fd in (*there, *here):
            os.close(fd)
        os.waitpid(child, 0)
    return {
        "thread": round(statistics.median(threads) / 2000, 1),
        "process": round(statistics.median(processes) / 2000, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--placements", type=int, default=500)
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    woken = wake_ups()  # first, on a machine the bench does not load yet
    with tempfile.TemporaryDirectory(prefix="reservoir-timeline-") as name:
        run_bench(args, Path(name))
        events = read_events(Path(name))
    steps = steps_of(events)
    if not steps:
        print("no sequential placement took the two-probe path", file=sys.stderr)
        return 1
    echoes = round_trip_hops(events, bench_pid_of(events))
    echo_p50 = round(statistics.median(echoes), 1) if echoes else None
    medians = {label: round(statistics.median(values), 1) for label, values in steps.items()}
    if args.json:
        placements = len(steps["whole placement"])
        print(
            json.dumps(
                {
                    "placements": placements,
                    "p50_us": medians,
                    "round_trip_hop_written_to_read_us": echo_p50,
                    "wake_up_us": woken,
                }
            )
        )
        return 0
    print(f"{len(steps['whole placement'])} placements, median of each step in microseconds")
    for label in ("whole placement", *STEPS):
        print(f"{medians[label]:9.1f}  {label}")
        for part in HOP_PARTS:
            if f"{label}: {part}" in medians:
                print(f"{medians[f'{label}: {part}']:13.1f}  {part}")
    if echo_p50 is not None:
        print(
            f"{echo_p50:13.1f}  written -> read, a hop of the round trips to a node process "
            f"(median of {len(echoes)})"
        )
    print(
        f"this machine wakes a waiting thread in {woken['thread']} us and a waiting process on "
        f"another core in {woken['process']} us (half a ping-pong, median, before the bench)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
