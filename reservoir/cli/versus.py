"""``reservoir versus placement``: reservoir's bench and OpenStack Placement, claimed
against as Nova's scheduler does, with the same nodes and flavour in the same run
(:mod:`reservoir.tools.versus_placement.runner` does the run)."""

from __future__ import annotations

import json
import sys

import click

from reservoir.broker import BrokerError, UnsupportedBroker
from reservoir.brokers import BrokerUrl
from reservoir.cli.options import require_message_counts, stopped_by_sigterm
from reservoir.exit_status import EXIT_BROKER, EXIT_INTERRUPTED, EXIT_RUN_FAILED
from reservoir.tools.bench.errors import BenchError
from reservoir.tools.bench.runner import bench_url
from reservoir.tools.versus_placement.runner import LEFT_OUT, run_versus

LEFT_OUT_HELP = "What it leaves out of Nova: " + "; ".join(LEFT_OUT) + "."


def _parse_url(ctx: click.Context, param: click.Parameter, value: str) -> BrokerUrl:
    try:
        url = bench_url(value)
    except (UnsupportedBroker, ValueError) as error:
        raise click.BadParameter(str(error)) from None
    if url.adapter == "memory":
        raise click.BadParameter("give a real broker (amqp://...): the nodes run in processes")
    return url


@click.command(epilog=LEFT_OUT_HELP)
@click.argument("incumbent", type=click.Choice(["placement"]))
@click.option(
    "--broker",
    "broker_url",
    envvar="RESERVOIR_BROKER_URL",
    required=True,
    callback=_parse_url,
    help="reservoir's broker: amqp://user:pass@host:5672/vhost [env: RESERVOIR_BROKER_URL].",
)
@click.option(
    "--nodes",
    "node_counts",
    multiple=True,
    default=(100, 1000),
    show_default=True,
    type=click.IntRange(1, 5000),
    help="Nodes (resource providers) to measure at; repeat for several sizes.",
)
@click.option(
    "--requestors",
    default=8,
    show_default=True,
    type=click.IntRange(1, 64),
    help="reservoir's requestor processes and Placement's scheduler processes, as many each.",
)
@click.option(
    "--placements",
    default=2000,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="reservoir's placements (its bench's --placements).",
)
@click.option(
    "--incumbent-placements",
    default=200,
    show_default=True,
    type=click.IntRange(1, 100_000),
    help="Placement's claims in its throughput run (it is slower: fewer keep the run short).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print exactly one JSON object with the results, nothing else on stdout.",
)
def versus(
    incumbent: str,
    broker_url: BrokerUrl,
    node_counts: tuple[int, ...],
    requestors: int,
    placements: int,
    incumbent_placements: int,
    as_json: bool,
) -> None:
    """Measure reservoir beside OpenStack Placement in one run, with the same nodes and
    flavour: placements/s, p50 and p99, CPU per placement by part, conflicts and retries,
    false failures at 90 % fill, and the ratios.

    Placement runs on a MariaDB server and under a gunicorn (2 workers) that this command
    starts on loopback (a private datadir in a temporary directory) and stops at the end,
    Ctrl-C included; K scheduler processes claim as Nova's scheduler does (GET
    /allocation_candidates with limit=1000 at microversion 1.36, RAM and CPU weighers,
    PUT /allocations/{consumer}, the next candidate on a 409). Needs
    pip install 'reservoir-scheduler[placement]' and MariaDB's server (apt-get install
    mariadb-server). Exit status 3 when the broker cannot be reached, 2 when the run
    cannot be carried out, 130 when stopped by Ctrl-C or SIGTERM.
    """
    from reservoir.tools.versus_placement.services import IncumbentUnavailable, missing

    require_message_counts("versus")
    lacking = missing()
    if lacking:
        raise click.UsageError("reservoir versus placement needs " + ", ".join(lacking))

    def progress(message: str) -> None:
        click.echo(f"versus: {message}", err=True)

    try:
        with stopped_by_sigterm():
            result = run_versus(
                broker_url=broker_url,
                nodes=node_counts,
                requestors=requestors,
                placements=placements,
                incumbent_placements=incumbent_placements,
                progress=progress,
            )
    except BrokerError as error:
        click.echo(
            f"reservoir versus: cannot use the broker at {broker_url.display}: {error}", err=True
        )
        sys.exit(EXIT_BROKER)
    except BenchError as error:
        click.echo(f"reservoir versus: {error}", err=True)
        sys.exit(error.exit_status)
    except IncumbentUnavailable as error:
        click.echo(f"reservoir versus: cannot start Placement: {error}", err=True)
        sys.exit(EXIT_RUN_FAILED)
    except KeyboardInterrupt:
        # everything the run started was stopped and removed on the way out
        click.echo("reservoir versus: stopped; what it started is gone", err=True)
        sys.exit(EXIT_INTERRUPTED)
    if as_json:
        click.echo(json.dumps(result.as_json(), sort_keys=True))
    else:
        _print_table(result.as_json())
    broken = {
        f"{size['nodes']} nodes: {name}": count
        for size in result.as_json()["sizes"]
        for name, count in size["reservoir"]["audit"].items()
        if count
    }
    if broken:
        click.echo(f"reservoir versus: the invariant audit failed: {broken}", err=True)
        sys.exit(EXIT_RUN_FAILED)


def _print_table(result: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(
        f"reservoir vs OpenStack Placement on {result['broker']}, "
        f"{result['requestors']} requestors / schedulers each; load average "
        f"{result['load_before']} before, {result['load_after']} after"
    )
    sizes = result["sizes"]
    assert isinstance(sizes, list)
    for size in sizes:
        r, p, ratio = size["reservoir"], size["placement"], size["ratio"]
        table = Table(title=f"{size['nodes']} nodes of {size['slots_per_node']} instances")
        table.add_column("measure")
        table.add_column("reservoir", justify="right")
        table.add_column("Placement", justify="right")
        table.add_column("ratio", justify="right")

        def times(value: object) -> str:
            return f"x{value}" if value is not None else "-"

        def cpu(parts: dict[str, float]) -> str:
            return ", ".join(f"{k} {v:.2f}" for k, v in parts.items())

        table.add_row(
            "placements/s", f"{r['placements_per_s']:,.1f}", f"{p['placements_per_s']:,.1f}",
            times(ratio["placements_per_s"]),
        )  # fmt: skip
        table.add_row("p50", f"{r['p50_ms']:.1f} ms", f"{p['p50_ms']:.1f} ms", times(ratio["p50"]))
        table.add_row("p99", f"{r['p99_ms']:.1f} ms", f"{p['p99_ms']:.1f} ms", times(ratio["p99"]))
        table.add_row(
            "CPU per placement", f"{r['cpu_ms_total']:.2f} ms", f"{p['cpu_ms_total']:.2f} ms",
            times(ratio["cpu_ms_per_placement"]),
        )  # fmt: skip
        table.add_row(
            "  by part", cpu(r["cpu_ms_per_placement"]), cpu(p["cpu_ms_per_placement"]), ""
        )
        table.add_row(
            "placed, refused",
            f"{r['placed']}, {r['refused']}",
            f"{p['placed']}, {p['refused']}",
            "",
        )
        conflicts = ", ".join(f"{k} {v}" for k, v in p["conflicts"].items()) or "0"
        retries = ", ".join(f"{k} {v}" for k, v in p["retries"].items())
        table.add_row("409 conflicts", "-", conflicts, "")
        table.add_row("retries", "-", retries, "")
        conflicts = ", ".join(f"{k} {v}" for k, v in p["fill_conflicts"].items()) or "0"
        retries = ", ".join(f"{k} {v}" for k, v in p["fill_retries"].items())
        table.add_row("  at 90 % fill: 409s", "-", conflicts, "")
        table.add_row("  at 90 % fill: retries", "-", retries, "")
        table.add_row(
            "false failures at 90 % fill",
            f"{r['false_failures_at_90']} of {r['fill_placed'] + r['false_failures_at_90']}",
            f"{p['false_failures_at_90']} of {p['fill_placed'] + p['false_failures_at_90']}",
            "",
        )
        console.print(table)
    left_out = result["left_out"]
    assert isinstance(left_out, list)
    for line in left_out:
        console.print(f"left out of Nova: {line}")
    notes = result["notes"]
    assert isinstance(notes, list)
    for note in notes:
        console.print(f"note: {note}")
