"""``reservoir demo``: a whole cloud in one process, placing a mixed workload, then audited."""

from __future__ import annotations

import json
import sys
from typing import Any

import click

from reservoir.broker import BrokerError
from reservoir.brokers.admin import ExchangeInUse
from reservoir.cli.options import (
    broker_option,
    json_option,
    load_settings,
    progress_bar,
    shown_url,
)
from reservoir.exit_status import EXIT_BROKER, EXIT_USAGE


@click.command()
@click.option(
    "--nodes",
    default=50,
    show_default=True,
    type=click.IntRange(1, 5000),
    help="Node agents to start, with varied capacities.",
)
@click.option(
    "--requests",
    default=2000,
    show_default=True,
    type=click.IntRange(0),
    help="Requests to place, of mixed flavours.",
)
@click.option(
    "--concurrency",
    default=8,
    show_default=True,
    type=click.IntRange(1, 512),
    help="Requestors placing at the same time (one worker thread each).",
)
@click.option(
    "--seed", default=0, show_default=True, type=int, help="Seed for node shapes and the workload."
)
@broker_option(default="memory://")
@click.option(
    "--policy",
    type=click.Choice(["spread", "pack", "least-utilised"]),
    default=None,
    help="How requestors pick winners [default: spread].",
)
@json_option("Print exactly one JSON object with the results, nothing else on stdout.")
def demo(
    nodes: int,
    requests: int,
    concurrency: int,
    seed: int,
    broker_url: str,
    policy: str | None,
    as_json: bool,
) -> None:
    """Start NODES node agents and CONCURRENCY requestors placing REQUESTS requests, then
    audit every node's ledger and print a summary.

    The audit checks the protocol's invariants independently of the requestors' view:
    no resource class overcommitted on any node, no reservation alive past its TTL, no
    request placed more than once.
    """
    from reservoir.tools.demo import run_demo

    settings = load_settings(broker_url=broker_url, policy=policy)
    try:
        with progress_bar(as_json) as bar:
            task = bar.add_task("placing", total=requests)
            result = run_demo(
                nodes=nodes,
                requests=requests,
                concurrency=concurrency,
                seed=seed,
                broker_url=broker_url,
                settings=settings,
                progress=lambda n: bar.advance(task, n),
            )
    except ExchangeInUse as error:
        click.echo(f"reservoir demo: {error}", err=True)
        sys.exit(EXIT_USAGE)
    except BrokerError as error:
        shown = shown_url(broker_url)
        click.echo(f"reservoir demo: cannot use the broker at {shown}: {error}", err=True)
        sys.exit(EXIT_BROKER)
    if as_json:
        click.echo(json.dumps(result.as_json(), sort_keys=True))
    else:
        _print_demo(result)
    if not result.invariants_hold:
        if result.audit is not None and not as_json:
            for problem in [
                *result.audit.overcommitted,
                *result.audit.leaked_reservations,
                *result.audit.duplicate_placements,
            ][:20]:
                click.echo(f"  {problem}", err=True)
        sys.exit(EXIT_USAGE)


def _print_demo(result: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    table = Table(
        title=f"reservoir demo: {result.nodes} nodes, {result.requests} requests, "
        f"{result.concurrency} concurrent requestors on {result.broker}"
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("placed", f"{result.placed}"),
        ("failed", f"{result.failed}"),
        ("overcommitted (audit)", f"{result.overcommitted}"),
        ("leaked reservations (audit)", f"{result.leaked_reservations}"),
        ("duplicate placements (audit)", f"{result.duplicate_placements}"),
        ("latency p50", f"{result.p50_ms:.2f} ms"),
        ("latency p99", f"{result.p99_ms:.2f} ms"),
        ("placements per second", f"{result.placements_per_s:.1f}"),
        (
            "messages per placement",
            "n/a (counted with the prometheus extra)"
            if result.messages_per_placement is None
            else f"{result.messages_per_placement:.1f}",
        ),
        ("wall time", f"{result.elapsed_s:.2f} s"),
        ("mean node utilisation", f"{result.mean_utilisation:.0%}"),
        ("placed at tier", ", ".join(f"{k}: {v}" for k, v in result.tiers_used.items())),
        ("nodes per tier now", ", ".join(f"{k}: {v}" for k, v in result.node_tiers.items())),
    ]
    if result.dropped:
        rows.append(("messages dropped", ", ".join(f"{k}: {v}" for k, v in result.dropped.items())))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    verdict = "[green]invariants hold[/]" if result.invariants_hold else "[red]INVARIANTS BROKEN[/]"
    console.print(verdict)
    for failure in result.failures[:5]:
        console.print(f"[yellow]failed:[/] {failure}")


# -- node ----------------------------------------------------------------------------------
