"""The node-host process of ``reservoir bench``: several node agents sharing one broker
connection, until told to stop.

This module owns the host's side of its conversation with ``reservoir.tools.bench.runner``, one JSON
object per line on stdout (nothing else is ever written there; logs go to stderr):

- ``{"event": "ready", "nodes": N, "echo": ADDRESS}`` once every agent has started;
  ``ADDRESS`` is an endpoint on the same connection that sends every body back to the
  address on its first line (:func:`echo_back`), so that the bench can time a round trip
  to a node process beside the one within its own;
- ``{"event": "counters", "sent": {KIND: COUNT}, "received": {...}}``, the messages its
  agents have sent and received so far, summed over the agents, each time a line
  ``counters`` arrives on stdin;
- ``{"event": "stopped", "sent": {...}, "received": {...}, "stop_s": S}`` on SIGTERM or
  SIGINT, or when stdin closes (the bench is gone), after every agent has closed.

    python -m reservoir.tools.bench.node_host --broker 'amqp://...?exchange=reservoir.bench.1a2b' \\
        --names n-000,n-001 --vcpus 64 --memory-mb 262144 --vcpu-ratio 4

Exit status: 0 once stopped, 2 on bad arguments, 3 when the broker cannot be reached.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from reservoir.broker import Broker, BrokerError, Delivery, Endpoint
from reservoir.clock import SystemClock, ThreadScheduler
from reservoir.exit_status import EXIT_BROKER
from reservoir.protocol.ledger import Inventory
from reservoir.runtime.node_agent import NodeAgent
from reservoir.runtime.plugins import load_filters, load_weighers
from reservoir.runtime.settings import Settings
from reservoir.tools.bench.hosting import Commands, names_of, say

__all__ = ["counters_of", "echo_back", "ledger_summary", "main", "node_inventories"]


def node_inventories(vcpus: int, memory_mb: int, vcpu_ratio: float) -> dict[str, Inventory]:
    """The inventory every bench node has: VCPU (overcommitted ``vcpu_ratio``:1) and memory."""
    return {
        "VCPU": Inventory(total=vcpus, allocation_ratio=vcpu_ratio),
        "MEMORY_MB": Inventory(total=memory_mb),
    }


def echo_back(endpoint: Endpoint, delivery: Delivery) -> None:
    """Send a round-trip body back to the address on its first line (see
    :func:`reservoir.tools.bench.runner.measure_round_trips`); anything else is dropped."""
    reply_to, newline, _padding = delivery.body.partition(b"\n")
    if newline and not delivery.returned:
        endpoint.send(reply_to.decode("utf-8", "replace"), delivery.body)


def counters_of(agents: Sequence[NodeAgent], name: str) -> dict[str, int]:
    """Counter ``name`` (``sent``, ``received``) by message kind, summed over ``agents``."""
    total: Counter[str] = Counter()
    for agent in agents:
        total.update(agent.metrics.by_label(name))
    return dict(total)


def ledger_summary(agents: Sequence[NodeAgent]) -> dict[str, Any]:
    """What the invariant audit needs of these nodes' ledgers, as plain data: the nodes
    that are overcommitted, the reservations alive more than a second past their TTL, and
    for each request id the instances held here and the count it asked for (the bench adds
    those up across processes: more instances than asked is a duplicate placement)."""
    snapshots = [agent.snapshot() for agent in agents]
    instances: dict[str, list[int]] = {}
    for snapshot in snapshots:
        for allocation in snapshot.allocations:
            held = instances.setdefault(allocation.request_id, [0, allocation.request_count])
            held[0] += 1
    return {
        "overcommitted": [s.name for s in snapshots if s.violations],
        "leaked_reservations": sum(
            1 for s in snapshots for r in s.reservations if r.deadline < s.taken_at - 1.0
        ),
        "instances": instances,
    }


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m reservoir.tools.bench.node_host", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--broker", required=True, help="broker URL (with ?exchange=)")
    parser.add_argument("--names", required=True, help="node names, comma-separated")
    parser.add_argument("--vcpus", type=int, required=True)
    parser.add_argument("--memory-mb", type=int, required=True)
    parser.add_argument("--vcpu-ratio", type=float, default=1.0)
    args = parser.parse_args(argv)
    args.names = names_of(args.names)
    if not args.names:
        parser.error("--names: give at least one node name")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    commands = Commands()
    settings = Settings(broker_url=args.broker)
    from reservoir.brokers import connect

    try:
        broker: Broker = connect(args.broker)
    except BrokerError as error:
        print(f"bench nodes: cannot reach the broker: {error}", file=sys.stderr)
        return EXIT_BROKER
    timers = ThreadScheduler(SystemClock(), name="bench-node-timers")
    agents: list[NodeAgent] = []
    try:
        filters, weighers = load_filters(settings.filters), load_weighers(settings.weighers)
        inventories = node_inventories(args.vcpus, args.memory_mb, args.vcpu_ratio)
        for name in args.names:
            agents.append(
                NodeAgent(
                    broker,
                    name=name,
                    inventories=inventories,
                    settings=settings,
                    scheduler=timers,
                    filters=filters,
                    weighers=weighers,
                )
            )
        echo: Endpoint | None = None

        def on_round_trip(delivery: Delivery) -> None:
            if echo is not None:
                echo_back(echo, delivery)

        echo = broker.open_endpoint(on_round_trip, name=f"{args.names[0]}-echo", inline=True)
        say("ready", nodes=len(agents), echo=echo.address)
        commands.listen("bench-node-stdin")
        for command in commands:
            if command == "ledgers":
                say("ledgers", **ledger_summary(agents))
            if command == "counters":
                say(
                    "counters",
                    sent=counters_of(agents, "sent"),
                    received=counters_of(agents, "received"),
                )
    except BrokerError as error:
        print(f"bench nodes: the broker failed: {error}", file=sys.stderr)
        return EXIT_BROKER
    finally:
        started = time.perf_counter()
        for agent in agents:
            agent.close()
        timers.close()
        broker.close()
        stop_s = time.perf_counter() - started
    say(
        "stopped",
        sent=counters_of(agents, "sent"),
        received=counters_of(agents, "received"),
        stop_s=round(stop_s, 3),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
