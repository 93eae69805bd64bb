"""reservoir against the omniscient, stale-state scheduler it replaces, on one workload.

    python benchmarks/versus_stale_scheduler.py [--nodes 50] [--fill 0.9]
        [--schedulers 8] [--latency-ms 5] [--seed 0]

Both run in virtual time with the same one-way message latency, the same nodes and the
same requests, arriving as fast as ``--schedulers`` concurrent callers can place them.

The baseline is Nova's model (see docs/design.md): each scheduler reads
every host's state as the nodes last reported it, picks the least-loaded host that fits
(spread) and decrements its own copy; the compute node then *claims*, and a claim that no
longer fits sends the request back to be rescheduled without that host, up to three
attempts (Nova's default ``max_attempts``), after which it fails ("NoValidHost"). Nodes
report their state the moment a claim lands, so staleness is only the claim's flight time,
the most generous version of the baseline.

reservoir runs the real protocol (``reservoir.testing.Simulation``) over the in-process
broker with the same latency. The figures printed are per run; the ratio column is
reservoir / baseline.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import heapq
import itertools
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from brokers.inprocess import Faults
from reservoir.protocol.placement import Placement, PlacementError
from reservoir.runtime.settings import Settings
from reservoir.testing import Simulation

FLAVOURS = [(1, 2048), (2, 4096), (4, 8192), (8, 16384)]
NODE_SHAPES = [(32, 65536), (48, 98304), (64, 131072)]


@dataclass
class Outcome:
    placed: int = 0
    failed: int = 0
    reschedules: int = 0
    latencies_s: list[float] = field(default_factory=list)
    messages: int = 0

    def row(self) -> dict[str, float]:
        return {
            "placed": self.placed,
            "failed": self.failed,
            "reschedules per placement": self.reschedules / max(self.placed, 1),
            "p50 ms": statistics.median(self.latencies_s) * 1000 if self.latencies_s else 0,
            "p99 ms": _p99(self.latencies_s) * 1000,
            "messages per placement": self.messages / max(self.placed, 1),
        }


def _p99(samples: list[float]) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def workload(
    seed: int, nodes: int, fill: float
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Node shapes, and requests whose VCPUs add up to ``fill`` of the cloud's."""
    rng = random.Random(seed)
    shapes = [rng.choice(NODE_SHAPES) for _ in range(nodes)]
    supply = sum(vcpus for vcpus, _ in shapes)
    flavours: list[tuple[int, int]] = []
    while sum(vcpus for vcpus, _ in flavours) < fill * supply:
        flavours.append(rng.choice(FLAVOURS))
    return shapes, flavours


def run_stale_scheduler(
    shapes: list[tuple[int, int]],
    flavours: list[tuple[int, int]],
    schedulers: int,
    latency_s: float,
    max_attempts: int = 3,
) -> Outcome:
    """Discrete-event run of the stale-state scheduler and claim-and-reschedule."""
    capacity = [list(shape) for shape in shapes]
    used = [[0, 0] for _ in shapes]  # the truth, on the nodes
    reported = [[0, 0] for _ in shapes]  # what schedulers read
    events: list[tuple[float, int, Callable[[], None]]] = []
    sequence = itertools.count()
    outcome = Outcome()
    queue = list(enumerate(flavours))
    now = 0.0

    def at(when: float, action: Callable[[], None]) -> None:
        heapq.heappush(events, (when, next(sequence), action))

    def next_request() -> None:
        if queue:
            _index, flavour = queue.pop(0)
            started = now
            # the caller's request reaches a scheduler one message later (an RPC call:
            # conductor to scheduler, and the answer back, are two more legs below)
            at(now + latency_s, lambda: schedule(flavour, started, set(), 1))

    def schedule(
        flavour: tuple[int, int], started: float, excluded: set[int], attempt: int
    ) -> None:
        view = [list(r) for r in reported]  # this scheduler's picture, stale by in-flight claims
        fits = [
            i
            for i in range(len(shapes))
            if i not in excluded
            and view[i][0] + flavour[0] <= capacity[i][0]
            and view[i][1] + flavour[1] <= capacity[i][1]
        ]
        outcome.messages += 2  # request to the scheduler, its answer
        if not fits:
            outcome.failed += 1
            at(now, next_request)
            return
        host = min(fits, key=lambda i: (view[i][0] / capacity[i][0], i))
        outcome.messages += 1  # the build request to the compute node
        # the decision travels back to the conductor, then on to the compute node
        at(now + 2 * latency_s, lambda: claim(flavour, host, started, excluded, attempt))

    def claim(
        flavour: tuple[int, int], host: int, started: float, excluded: set[int], attempt: int
    ) -> None:
        if (
            used[host][0] + flavour[0] <= capacity[host][0]
            and used[host][1] + flavour[1] <= capacity[host][1]
        ):
            used[host][0] += flavour[0]
            used[host][1] += flavour[1]
            reported[host][:] = used[host]  # the node reports at once: the kindest case
            outcome.placed += 1
            outcome.messages += 1  # success back to the caller
            at(now + latency_s, lambda: (outcome.latencies_s.append(now - started), next_request()))
            return
        outcome.messages += 1  # the failure goes back to be rescheduled
        if attempt >= max_attempts:
            outcome.failed += 1
            at(now + latency_s, next_request)
            return
        outcome.reschedules += 1
        at(now + latency_s, lambda: schedule(flavour, started, excluded | {host}, attempt + 1))

    for _ in range(schedulers):
        at(0.0, next_request)
    while events:
        now, _, action = heapq.heappop(events)
        action()
    return outcome


def run_reservoir(
    shapes: list[tuple[int, int]],
    flavours: list[tuple[int, int]],
    schedulers: int,
    latency_s: float,
) -> Outcome:
    sim = Simulation(faults=Faults(delay_s=(latency_s, latency_s)), settings=Settings())
    for i, (vcpus, memory_mb) in enumerate(shapes):
        sim.add_node(f"n{i}", vcpus=vcpus, memory_mb=memory_mb)
    requestors = [sim.add_requestor(f"r{i}") for i in range(schedulers)]
    outcome = Outcome()
    queue = list(flavours)
    placements: list[Placement] = []
    pending: dict[concurrent.futures.Future[Placement], float] = {}

    def submit(requestor_index: int) -> None:
        if queue:
            vcpus, memory_mb = queue.pop(0)
            future = requestors[requestor_index].submit(vcpus=vcpus, memory_mb=memory_mb)
            pending[future] = sim.scheduler.clock.now()
            future.add_done_callback(lambda f, i=requestor_index: done(f, i))

    def done(future: concurrent.futures.Future[Placement], requestor_index: int) -> None:
        started = pending.pop(future)
        try:
            placements.append(future.result(timeout=0))
        except PlacementError:
            outcome.failed += 1
        else:
            outcome.placed += 1
            outcome.latencies_s.append(sim.scheduler.clock.now() - started)
        submit(requestor_index)

    for i in range(schedulers):
        submit(i)
    sim.scheduler.run_until(lambda: not queue and not pending, timeout_s=10_000)
    outcome.messages = sum(v for k, v in sim.counters().items() if k.startswith("sent:"))
    report = sim.finish(placements)
    assert report.ok
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument(
        "--fill", type=float, default=0.9, help="requests add up to this share of the cloud's VCPUs"
    )
    parser.add_argument("--schedulers", type=int, default=8)
    parser.add_argument("--latency-ms", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    shapes, flavours = workload(args.seed, args.nodes, args.fill)
    latency_s = args.latency_ms / 1000
    baseline = run_stale_scheduler(shapes, flavours, args.schedulers, latency_s).row()
    ours = run_reservoir(shapes, flavours, args.schedulers, latency_s).row()
    demand = sum(v for v, _ in flavours)
    supply = sum(v for v, _ in shapes)
    print(
        f"{args.nodes} nodes ({supply} VCPU), {len(flavours)} requests ({demand} VCPU), "
        f"{args.schedulers} concurrent schedulers/requestors, {args.latency_ms} ms one way"
    )
    print(f"{'':28}{'stale scheduler':>18}{'reservoir':>14}{'ratio':>10}")
    for key in baseline:
        ratio = ours[key] / baseline[key] if baseline[key] else float("nan")
        print(f"{key:28}{baseline[key]:>18.2f}{ours[key]:>14.2f}{ratio:>10.2f}")


if __name__ == "__main__":
    main()
