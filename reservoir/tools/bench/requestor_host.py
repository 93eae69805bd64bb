"""The requestor-host process of ``reservoir bench --requestor-processes``: several
requestors sharing one broker connection, placing their share of the throughput run when
told to, as the workers of an API tier would.

This module owns the host's side of its conversation with ``reservoir.tools.bench.runner``,
one JSON object per line on stdout (nothing else is ever written there; logs go to stderr):

- ``{"event": "ready", "requestors": K}`` once every requestor knows the nodes and has
  placed its warm-up placements;
- on a line ``go`` on stdin, every requestor places its share in a thread of its own,
  then ``{"event": "done", "latencies_s": [...], "failed": N, "sent": {KIND: COUNT},
  "received": {...}, "switches": {"woken": W, "preempted": P}}``, the messages counted
  from ``go`` on, summed over the requestors, and the process's context switches
  meanwhile (its placing threads' included, which ``/proc`` no longer lists once they
  end);
- ``{"event": "stopped"}`` once every requestor has closed, on a line ``stop``, on
  SIGTERM or SIGINT, or when stdin closes (the bench is gone).

    python -m reservoir.tools.bench.requestor_host --broker 'amqp://...?exchange=...' \\
        --names r-0,r-1 --placements 500 --nodes 200 [--roster-from auto]

Exit status: 0 once stopped, 2 on bad arguments, 3 when the broker cannot be reached.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict

from reservoir.broker import Broker, BrokerError
from reservoir.clock import SystemClock, ThreadScheduler
from reservoir.exit_status import EXIT_BROKER
from reservoir.protocol.placement import PlacementError
from reservoir.protocol.roster_source import ROSTER_FROM
from reservoir.runtime.requestor import Requestor
from reservoir.runtime.settings import Settings
from reservoir.tools.bench.errors import BenchError
from reservoir.tools.bench.hosting import Commands, names_of, say
from reservoir.tools.bench.limits import own_switches
from reservoir.tools.bench.placing import (
    WARMUP_PLACEMENTS,
    place_in_threads,
    place_one,
    wait_for_roster,
)

__all__ = ["main"]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m reservoir.tools.bench.requestor_host",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--broker", required=True, help="broker URL (with ?exchange=)")
    parser.add_argument("--names", required=True, help="requestor names, comma-separated")
    parser.add_argument("--placements", type=int, required=True, help="this host's share")
    parser.add_argument("--nodes", type=int, required=True, help="nodes a roster must know")
    parser.add_argument("--roster-from", choices=ROSTER_FROM,
                        default="announcements")  # fmt: skip
    args = parser.parse_args(argv)
    args.names = names_of(args.names)
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
    for requestor in requestors:
        wait_for_roster(requestor, nodes)
        for _ in range(WARMUP_PLACEMENTS):
            with contextlib.suppress(PlacementError):
                place_one(requestor)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    commands = Commands()
    settings = Settings(broker_url=args.broker, roster_from=args.roster_from)
    from reservoir.brokers import connect

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
        say("ready", requestors=len(requestors))
        commands.listen("bench-requestor-stdin")
        for command in commands:
            if command == "go":
                sent, received = _counters(requestors, "sent"), _counters(requestors, "received")
                switched = own_switches()
                latencies_s, failed = place_in_threads(requestors, args.placements)
                # the placing threads have ended: only this process's own count has them
                switches = own_switches().since(switched)
                say(
                    "done",
                    latencies_s=latencies_s,
                    failed=failed,
                    sent=dict(_counters(requestors, "sent") - sent),
                    received=dict(_counters(requestors, "received") - received),
                    switches=asdict(switches),
                )
    except (BrokerError, BenchError) as error:
        print(f"bench requestors: {error}", file=sys.stderr)
        return EXIT_BROKER
    finally:
        for requestor in requestors:
            requestor.close()
        timers.close()
        broker.close()
    say("stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
