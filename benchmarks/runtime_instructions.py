"""The live runtime's own work per placement, on one thread and in a fixed order, for
instruction counts and exact profiles that do not move with the machine's load.

    python benchmarks/runtime_instructions.py --placements N [--nodes 50] [--profile K]

One :class:`~reservoir.Requestor` and ``--nodes`` node agents on the in-process broker,
every delivery and timer run by a :class:`~reservoir.clock.VirtualScheduler` on this
thread: each placement goes through the same drivers, wire codec, in-process broker and
state machines as ``reservoir bench --broker memory://``, without the threads (the hand-overs
between them are left out, and are measured by that bench). Placements are made one at a
time, each waited for; the run ends with the invariant audit of the nodes' ledgers
against the requestor's placements (no overcommit, one placement per request id, no
reservation left held) and prints one JSON line.

Instructions per placement: run it under callgrind at two sizes and divide the difference
of the totals by the difference of the sizes (start-up and roll call cancel out)::

    PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null \\
        "$(python -c 'import sys; print(sys.executable)')" \\
        benchmarks/runtime_instructions.py --placements 100
    (the same with --placements 1100; Ir per placement = (I2 - I1) / 1000)

(``valgrind python`` on a pyenv shim measures the shim: give it the interpreter itself.)
With ``--profile K`` it runs under :mod:`cProfile` and prints the K functions with the
most time of their own, per placement, instead: where the instructions go.
``--gc-freeze`` and ``--gc-threshold N`` set the garbage collector before the run, to
price it. ``--woken-us N`` sleeps N microseconds before every step
of a placement (every delivery and timer), so that each runs after its thread was woken,
as the live runtime's do; the JSON line's ``steps`` counts them, so that the sleeps' own
CPU can be taken off (``benchmarks/message_floor.py`` does).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import random
import sys
import time
import uuid
from collections.abc import Callable

import reservoir  # noqa: F401  (the package first: brokers imports it back)
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.clock import VirtualScheduler
from reservoir.protocol.audit import audit
from reservoir.runtime.node_agent import NodeAgent
from reservoir.runtime.requestor import Requestor
from reservoir.runtime.settings import Settings
from reservoir.tools.bench.node_host import node_inventories

#: a flavour every node has room for many times over, so no placement fails
VCPUS, MEMORY_MB = 1, 512


def run(placements: int, nodes: int, *, woken_s: float = 0.0) -> dict[str, int]:
    random.seed(7)
    # The requestor names each request with uuid4; which nodes a request samples follows
    # from its id, so random ids made two runs of one build differ by up to 0.5 %. Seeded
    # ones, still version-4 UUIDs: a caller's own request_id would instead take the path
    # of a caller-chosen id (a lookup, two more messages per placement).
    ids = random.Random(7)
    uuid.uuid4 = lambda: uuid.UUID(int=ids.getrandbits(128), version=4)
    scheduler = VirtualScheduler()
    broker = InProcessBroker(scheduler)
    settings = Settings()
    inventories = node_inventories(
        placements * VCPUS + 1, (placements + 1) * MEMORY_MB, vcpu_ratio=1.0
    )
    agents = [
        NodeAgent(
            broker,
            name=f"node-{i}",
            inventories=inventories,
            settings=settings,
            scheduler=scheduler,
        )
        for i in range(nodes)
    ]
    requestor = Requestor(broker, name="requestor", settings=settings, scheduler=scheduler)
    # the roll call: every node's announcement reaches the requestor
    settle = scheduler.clock.now() + 2.0
    while scheduler.step(settle):
        pass
    if len(requestor.machine.roster) < nodes:
        raise SystemExit(f"only {len(requestor.machine.roster)} of {nodes} nodes announced")
    delivered_before = broker.stats.delivered
    placed = []
    steps = 0
    step: Callable[..., bool] = scheduler.step
    if woken_s:
        # --woken-us: each step of a placement runs after a real sleep, as the live
        # runtime's handlers run after their thread was woken (only then wrapped: the
        # instruction counts of a plain run stay comparable with those before)
        def step(until: float | None = None) -> bool:
            nonlocal steps
            steps += 1
            time.sleep(woken_s)
            return scheduler.step(until)

    for _ in range(placements):
        future = requestor.submit(vcpus=VCPUS, memory_mb=MEMORY_MB)
        while not future.done():
            if not step():
                raise SystemExit("a placement stalled: nothing left to run")
        placed.append(future.result())
        # the losers' releases and the winner's confirmation, before the next one
        quiet = scheduler.clock.now() + 0.001
        while step(quiet):
            pass
    messages = broker.stats.delivered - delivered_before
    # every reservation past its deadline: any still held then has leaked
    past_ttl = scheduler.clock.now() + settings.ttl_s + 1.0
    while scheduler.step(past_ttl):
        pass
    scheduler.clock.set(past_ttl)
    report = audit([agent.snapshot() for agent in agents], placed)
    requestor.close()
    for agent in agents:
        agent.close()
    broker.close()
    report.raise_if_failed(allow_orphans=False)
    result = {"placements": len(placed), "nodes": nodes, "messages": messages}
    return {**result, "steps": steps} if woken_s else result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--placements", type=int, default=1000)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--profile", type=int, default=0, metavar="K")
    parser.add_argument(
        "--woken-us",
        type=int,
        default=0,
        metavar="N",
        help="sleep N us before every step of a placement (its CPU: see --help's text)",
    )
    parser.add_argument(
        "--gc-freeze", action="store_true", help="collect, then gc.freeze() before the run"
    )
    parser.add_argument(
        "--gc-threshold", type=int, default=0, metavar="N", help="gc.set_threshold(N, 10, 10)"
    )
    args = parser.parse_args()
    if args.placements < 1 or args.nodes < 1:
        parser.error("--placements and --nodes must be at least 1")
    if args.woken_us < 0:
        parser.error("--woken-us must be at least 0")
    if args.gc_threshold < 0:
        parser.error("--gc-threshold must be at least 1 (0: as Python sets it)")
    if args.gc_freeze:
        gc.collect()
        gc.freeze()
    if args.gc_threshold:
        gc.set_threshold(args.gc_threshold, 10, 10)
    if not args.profile:
        print(json.dumps(run(args.placements, args.nodes, woken_s=args.woken_us / 1e6)))
        return
    profiler = cProfile.Profile()
    result = profiler.runcall(run, args.placements, args.nodes)
    stats = pstats.Stats(profiler, stream=sys.stdout)
    total = sum(row[2] for row in stats.stats.values())  # type: ignore[attr-defined]
    print(json.dumps(result))
    print(f"{'self us/placement':>17} {'share':>6}  function (cProfile's clock, inflated)")
    rows = sorted(stats.stats.items(), key=lambda item: -item[1][2])  # type: ignore[attr-defined]
    for (filename, line, name), (_, _, own, _, _) in rows[: args.profile]:
        where = filename.rsplit("/reservoir/", 1)[-1].rsplit("/site-packages/", 1)[-1]
        print(f"{own / args.placements * 1e6:>17.1f} {own / total:>6.1%}  {where}:{line} {name}")


if __name__ == "__main__":
    main()
