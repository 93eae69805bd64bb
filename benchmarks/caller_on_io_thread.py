"""What the threads' hand-overs cost a sequential placement on RabbitMQ, and what an
asyncio-native caller could gain: ``reservoir bench`` as it is, in turns with the same
bench whose caller runs on the broker's IO thread.

    python benchmarks/caller_on_io_thread.py [--pairs 3] [--nodes 50] \\
        [--broker amqp://guest:guest@127.0.0.1:5672/] [--json]

In ``reservoir bench`` the caller is the bench's main thread: each placement hands its
probes to the broker's IO thread and waits to be woken with the outcome, and each round
trip of the baseline does the same with its body. An asyncio-native runtime (the caller a
coroutine on the loop that reads the socket) would have neither hand-over. This script
measures that without writing such a runtime: a ``sitecustomize`` of its own, on
``PYTHONPATH`` for every run, replaces two functions of the bench's runner when
``RESERVOIR_CALLER_ON_IO_THREAD`` is set:

- the sequential run's placements (``place_timed``): the first is submitted from the main
  thread, and each one after it from the previous one's done-callback, which runs on the
  broker's IO thread as the outcome is read (``Requestor.submit`` allows it); a placement
  is timed from its submit to its done-callback, both on that thread;
- the round trips (``measure_round_trips``): each is sent from the reply handler of the
  one before, on the IO thread, and timed there.

Everything else (the warm-up, the nodes, the throughput run, the audit) is the bench's
own. The runs take turns, hooked and plain, the order alternating by pair, and the
script prints each run's ``place_p50_ms``, round trips, ``place_p50_over_rtt`` and
``place_floor_over_rtt``, with the medians by mode. It fails when a run's audit is not
clean, or when a hooked run did not take its hook. docs/performance.md holds what it
showed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

#: the hooked runs' sitecustomize: inert unless RESERVOIR_CALLER_ON_IO_THREAD names a file
HOOKS = """
import builtins, os, sys, threading, time

_MARK = os.environ.get("RESERVOIR_CALLER_ON_IO_THREAD")


def _hook(runner):
    from reservoir.tools.bench.node_host import echo_back
    from reservoir.tools.bench.placing import FLAVOUR_MEMORY_MB, FLAVOUR_VCPUS, PLACE_TIMEOUT_S

    def place_timed(requestor, count):
        latencies_s, failed, done = [], [0], threading.Event()
        state = {"made": 0, "started": 0.0}

        def submit():
            state["started"] = time.perf_counter()
            future = requestor.submit(
                vcpus=FLAVOUR_VCPUS, memory_mb=FLAVOUR_MEMORY_MB, timeout_s=PLACE_TIMEOUT_S
            )
            future.add_done_callback(finished)

        def finished(future):
            now = time.perf_counter()
            if future.exception() is not None:
                failed[0] += 1
            elif state["made"]:  # the first was submitted from the main thread: not timed
                latencies_s.append(now - state["started"])
            state["made"] += 1
            if state["made"] > count:
                done.set()
            else:
                submit()

        submit()
        if not done.wait(count * PLACE_TIMEOUT_S):
            raise RuntimeError("the placements driven from the IO thread did not finish")
        return latencies_s, failed[0]

    def measure_round_trips(broker, samples, elsewhere=()):
        addresses, seconds, done = [], [], threading.Event()
        state = {"round": 0, "echo": 0, "started": 0.0}

        def on_reply(delivery):
            now = time.perf_counter()
            if state["round"] >= runner.RTT_WARMUP:
                seconds[state["echo"]].append(now - state["started"])
            state["echo"] += 1
            if state["echo"] == len(addresses):
                state["echo"], state["round"] = 0, state["round"] + 1
            if state["round"] >= runner.RTT_WARMUP + samples:
                done.set()
                return
            state["started"] = time.perf_counter()
            back.send(addresses[state["echo"]], body)

        back = broker.open_endpoint(on_reply, inline=True)
        body = back.address.encode() + b"\\n"
        body += b"x" * max(0, runner.RTT_BODY_BYTES - len(body))
        local = None

        def echo(delivery):
            if local is not None:
                echo_back(local, delivery)

        local = broker.open_endpoint(echo, inline=True)
        addresses.extend([local.address, *elsewhere])
        seconds.extend([] for _ in addresses)
        try:
            state["started"] = time.perf_counter()
            back.send(addresses[0], body)
            if not done.wait(60.0):
                raise RuntimeError("the round trips driven from the IO thread did not finish")
        finally:
            local.close()
            back.close()
        return seconds

    runner.place_timed = place_timed
    runner.measure_round_trips = measure_round_trips
    with open(_MARK, "a") as mark:
        mark.write("%d\\n" % os.getpid())


if _MARK:
    _import = builtins.__import__

    def _import_and_hook(name, *args, **kwargs):
        module = _import(name, *args, **kwargs)
        runner = sys.modules.get("reservoir.tools.bench.runner")
        if runner is not None and hasattr(runner, "RTT_WARMUP"):  # imported whole
            builtins.__import__ = _import
            _hook(runner)
        return module

    builtins.__import__ = _import_and_hook
"""

#: what each run reports, from ``reservoir bench --json``
FIGURES = (
    "place_p50_ms",
    "rtt_p50_ms",
    "rtt_to_nodes_p50_ms",
    "place_p50_over_rtt",
    "place_floor_over_rtt",
)


def run_bench(args: argparse.Namespace, directory: Path, hooked: bool) -> dict[str, float]:
    """One ``reservoir bench`` run, hooked or plain; its figures, or SystemExit naming
    what went wrong."""
    mark = directory / "hooked.txt"
    mark.unlink(missing_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(directory), env.get("PYTHONPATH")]))
    env.pop("RESERVOIR_CALLER_ON_IO_THREAD", None)
    if hooked:
        env["RESERVOIR_CALLER_ON_IO_THREAD"] = str(mark)
    command = [sys.executable, "-m", "reservoir", "bench", "--broker", args.broker]
    command += ["--nodes", str(args.nodes), "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"reservoir bench failed ({done.returncode}): {done.stderr[-2000:]}")
    if hooked != mark.exists():
        raise SystemExit("a hooked run did not take its hook" if hooked else "a plain run did")
    result = json.loads(done.stdout)
    audit = result["audit"]
    if any(audit.values()):
        raise SystemExit(f"a run's audit is not clean: {audit}")
    return {name: float(result[name]) for name in FIGURES}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--pairs", type=int, default=3, help="hooked and plain runs, in turns")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args()
    if args.pairs < 1 or args.nodes < 2:
        parser.error("--pairs must be at least 1 and --nodes at least 2")
    runs: dict[str, list[dict[str, float]]] = {"threads": [], "io_thread": []}
    with tempfile.TemporaryDirectory(prefix="reservoir-io-caller-") as name:
        directory = Path(name)
        (directory / "sitecustomize.py").write_text(HOOKS)
        for pair in range(args.pairs):
            order = (False, True) if pair % 2 == 0 else (True, False)
            for hooked in order:
                figures = run_bench(args, directory, hooked)
                runs["io_thread" if hooked else "threads"].append(figures)
                if not args.json:
                    mode = "io thread" if hooked else "threads  "
                    print(
                        f"pair {pair + 1} {mode} "
                        + "  ".join(f"{k} {v}" for k, v in figures.items())
                    )
    medians = {
        mode: {k: round(statistics.median(r[k] for r in each), 3) for k in FIGURES}
        for mode, each in runs.items()
    }
    if args.json:
        print(json.dumps({"runs": runs, "medians": medians}))
        return 0
    for mode, figures in medians.items():
        print(f"median {mode:9} " + "  ".join(f"{k} {v}" for k, v in figures.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
