"""Placement throughput and latency per broker, as ratios to the in-process broker
measured in the same run (the machine is shared and noisy: only ratios compare).

    python benchmarks/broker_throughput.py --amqp amqp://guest:guest@127.0.0.1:5672/

Each broker runs the same seeded demo workload (``reservoir.tools.demo.run_demo``) ``--rounds``
times, interleaved, and the median of each figure is reported.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from reservoir.tools.demo import DemoResult, run_demo

FIGURES = ("placements_per_s", "p50_ms", "p99_ms", "messages_per_placement")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--amqp", help="RabbitMQ URL; adds the pika and kombu brokers")
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    brokers = {"memory": "memory://"}
    if args.amqp:
        brokers["pika"] = args.amqp
        brokers["kombu"] = "kombu+" + args.amqp
    results: dict[str, list[DemoResult]] = defaultdict(list)
    for round_ in range(args.rounds):
        for name, url in brokers.items():
            result = run_demo(
                nodes=args.nodes,
                requests=args.requests,
                concurrency=args.concurrency,
                seed=round_,
                broker_url=url,
            )
            if not result.invariants_hold or result.failed:
                raise SystemExit(f"{name}: the run itself went wrong: {result.as_json()}")
            results[name].append(result)
            print(
                f"round {round_ + 1}/{args.rounds} {name}: "
                f"{result.placements_per_s:.0f} placements/s",
                flush=True,
            )

    medians = {
        name: {f: statistics.median(getattr(r, f) for r in runs) for f in FIGURES}
        for name, runs in results.items()
    }
    base = medians["memory"]
    print(
        f"\n{args.nodes} nodes, {args.requests} requests, {args.concurrency} concurrent, "
        f"median of {args.rounds} rounds; ratio = broker / memory://"
    )
    print(f"{'broker':8} " + " ".join(f"{f:>24}" for f in FIGURES))
    for name, figures in medians.items():
        cells = [f"{figures[f]:>10.1f} (x{figures[f] / base[f]:5.2f})" for f in FIGURES]
        print(f"{name:8} " + " ".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
