"""What one small step of reservoir's work costs this machine after a pause of its thread.

    python benchmarks/pause_cost.py [--pauses-us 0,50,300,1000,2500,10000] \\
        [--calls 1000] [--rounds 3] [--json]

The live runtime's steps run after their thread waited: a handler after its IO thread
was woken with a message, a caller after its placement's answer, and such steps cost
more than the same steps back to back: that bounds the targets of issue 36
(docs/performance.md, "The machine"). This script measures that cost of the machine by
itself, with one step and nothing else running:

- the step: a caller's request built and checked and its id made
  (:func:`~reservoir.protocol.placement.request_of`,
  :func:`~reservoir.runtime.request_ids.new_request_id`), the first work of
  ``Requestor.submit``, about 10 us of CPU back to back;
- before each call a pause of ``--pauses-us`` microseconds, either **sleeping** (the thread
  waits in ``time.sleep`` and its core may idle, as a woken handler's did) or **spinning**
  (the thread keeps its core busy in a loop of its own for as long);
- each call's CPU read with ``time.thread_time_ns`` on either side; per pause and way, the
  median of ``--calls`` calls (the first tenth left out as warm-up). The pauses and ways
  take turns, ``--rounds`` times, the order rotating.

If the step costs more after a longer pause while spinning too, the cost is not the core
going to sleep but the step's code and data gone from the caches meanwhile (on a shared
host, other guests' work): a cost a runtime pays per wake-up, whichever way it waits.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

from reservoir.protocol.placement import request_of
from reservoir.runtime.request_ids import new_request_id

Way = Literal["sleeping", "spinning"]
WAYS: tuple[Way, ...] = ("sleeping", "spinning")
DEFAULT_PAUSES_US = (0, 50, 300, 1000, 2500, 10000)


def step() -> None:
    """The measured work: a request built and checked, and its id."""
    request_of(vcpus=1, memory_mb=512)
    new_request_id()


def spin(seconds: float) -> None:
    """Keep this thread busy for ``seconds`` without waiting."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


@dataclass(frozen=True)
class Cost:
    """The median CPU of one call after a pause, in microseconds."""

    pause_us: int
    way: Way
    round: int
    median_us: float


def measure(
    pause_us: int,
    way: Way,
    calls: int,
    work: Callable[[], None] = step,
    round_: int = 0,
) -> Cost:
    """``calls`` calls of ``work``, each after a pause; the median of their CPU."""
    pause_s = pause_us / 1e6
    wait: Callable[[float], None] = time.sleep if way == "sleeping" else spin
    costs: list[int] = []
    for _ in range(calls):
        if pause_s:
            wait(pause_s)
        started = time.thread_time_ns()
        work()
        costs.append(time.thread_time_ns() - started)
    kept = costs[calls // 10 :]  # the first tenth: warm-up
    return Cost(pause_us, way, round_, round(statistics.median(kept) / 1000, 2))


def run(pauses_us: list[int], calls: int, rounds: int) -> list[Cost]:
    """Every pause both ways, ``rounds`` times, the order rotating by round."""
    kinds = list(itertools.product(pauses_us, WAYS))
    found = []
    for round_ in range(rounds):
        shift = round_ % len(kinds)
        for pause_us, way in kinds[shift:] + kinds[:shift]:
            found.append(measure(pause_us, way, calls, round_=round_))
    return found


def medians(costs: list[Cost]) -> dict[str, dict[str, float]]:
    """By way, then pause: the median over the rounds of each round's median."""
    table: dict[str, dict[str, float]] = {}
    for way in WAYS:
        pauses = sorted({c.pause_us for c in costs if c.way == way})
        table[way] = {
            str(p): statistics.median(
                c.median_us for c in costs if c.way == way and c.pause_us == p
            )
            for p in pauses
        }
    return table


def pauses_of(text: str) -> list[int]:
    """``--pauses-us``: comma-separated whole microseconds, each at least 0."""
    try:
        pauses = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not whole microseconds: {text!r}") from None
    if not pauses or min(pauses) < 0:
        raise argparse.ArgumentTypeError(f"give one or more pauses of 0 us or more: {text!r}")
    return pauses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pauses-us",
        type=pauses_of,
        default=list(DEFAULT_PAUSES_US),
        metavar="N,N,...",
        help="the pauses before each call, in microseconds (default: %(default)s)",
    )
    parser.add_argument("--calls", type=int, default=1000, help="calls per pause and way")
    parser.add_argument("--rounds", type=int, default=3, help="times each pause is measured")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    args = parser.parse_args(argv)
    if args.calls < 10 or args.rounds < 1:
        parser.error("--calls must be at least 10 and --rounds at least 1")
    costs = run(args.pauses_us, args.calls, args.rounds)
    table = medians(costs)
    if args.json:
        print(json.dumps({"runs": [asdict(c) for c in costs], "medians_us": table}))
        return 0
    back_to_back = {way: table[way].get("0") for way in WAYS}
    print("CPU of one step after a pause, median of the rounds' medians, microseconds")
    print(f"{'pause us':>9} {'sleeping':>16} {'spinning':>16}")
    for pause in sorted(args.pauses_us):
        cells = []
        for way in WAYS:
            cost = table[way][str(pause)]
            base = back_to_back[way]
            cells.append(f"{cost:8.1f}" + (f" (x{cost / base:4.1f})" if base else " " * 8))
        print(f"{pause:>9} {cells[0]:>16} {cells[1]:>16}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
