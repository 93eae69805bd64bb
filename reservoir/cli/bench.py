"""``reservoir bench``: how fast placement is on a broker, as ratios to that broker's own
round trip measured in the same run (:mod:`reservoir.tools.bench.runner` does the run)."""

from __future__ import annotations

import json
import sys

import click

from reservoir.broker import BrokerError, UnsupportedBroker
from reservoir.brokers import BrokerUrl
from reservoir.cli.options import require_message_counts, stopped_by_sigterm
from reservoir.exit_status import EXIT_BROKER, EXIT_RUN_FAILED
from reservoir.tools.bench.errors import BenchError
from reservoir.tools.bench.runner import BenchResult, bench_url, run_bench


def _parse_url(ctx: click.Context, param: click.Parameter, value: str) -> BrokerUrl:
    try:
        return bench_url(value)
    except (UnsupportedBroker, ValueError) as error:
        raise click.BadParameter(str(error)) from None


@click.command()
@click.option(
    "--broker",
    "broker_url",
    envvar="RESERVOIR_BROKER_URL",
    required=True,
    callback=_parse_url,
    help="Broker URL: memory://, amqp://user:pass@host:5672/vhost or kombu+amqp://... "
    "[env: RESERVOIR_BROKER_URL]. ?exchange=NAME prefixes the run's own exchanges.",
)
@click.option(
    "--nodes",
    default=50,
    show_default=True,
    type=click.IntRange(1, 5000),
    help="Node agents to start.",
)
@click.option(
    "--requestors",
    default=8,
    show_default=True,
    type=click.IntRange(1, 512),
    help="Requestors placing at once in the throughput run (one thread each).",
)
@click.option(
    "--node-processes",
    default=2,
    show_default=True,
    type=click.IntRange(1, 256),
    help="Processes the node agents are spread over (ignored on memory://).",
)
@click.option(
    "--placements",
    default=2000,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="Placements in the sequential run, and again in the throughput run.",
)
@click.option(
    "--requestor-processes",
    default=0,
    show_default=True,
    type=click.IntRange(0, 256),
    help="Spread the throughput run's requestors over this many processes, as an API "
    "tier's workers are (0: threads of this process; ignored on memory://).",
)
@click.option(
    "--keepers",
    default=0,
    show_default=True,
    type=click.IntRange(0, 16),
    help="Start this many roster keepers (reservoir keeper processes; in this process on "
    "memory://); every requestor then takes its roster from them rather than following "
    "every node's announcements.",
)
@click.option(
    "--kill-keeper",
    is_flag=True,
    help="After the throughput run, a keeper outage run: as many requestors place "
    "--placements requests at once while the first keeper is killed (SIGKILL) a third of "
    "the way through and started again at two thirds. Needs --keepers.",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print exactly one JSON object with the results, nothing else on stdout.",
)
def bench(
    broker_url: BrokerUrl,
    nodes: int,
    requestors: int,
    node_processes: int,
    placements: int,
    requestor_processes: int,
    keepers: int,
    kill_keeper: bool,
    as_json: bool,
) -> None:
    """Measure placement against the broker's own round trip: sequential latency,
    throughput of concurrent requestors, messages per placement and the time to a clear
    failure on a full cluster, with node agents in processes of their own.

    Runs on exchanges of its own, removed at the end. Exit status 3 when the broker
    cannot be reached, 2 when the run cannot be carried out.
    """
    require_message_counts("bench")
    if kill_keeper and not keepers:
        raise click.BadParameter(
            "a keeper outage needs keepers: give --keepers 1 or more",
            param_hint="'--kill-keeper'",
        )
    if broker_url.adapter != "memory" and node_processes > nodes:
        raise click.BadParameter(
            f"{node_processes} processes for {nodes} nodes: give at most --nodes",
            param_hint="'--node-processes'",
        )

    def progress(message: str) -> None:
        click.echo(f"bench: {message}", err=True)

    try:
        with stopped_by_sigterm():
            result = run_bench(
                broker_url=broker_url,
                nodes=nodes,
                requestors=requestors,
                node_processes=node_processes,
                placements=placements,
                requestor_processes=requestor_processes,
                keepers=keepers,
                kill_keeper=kill_keeper,
                progress=progress,
            )
    except UnsupportedBroker as error:
        raise click.BadParameter(str(error), param_hint="'--broker'") from None
    except BrokerError as error:
        shown = broker_url.display
        click.echo(f"reservoir bench: cannot use the broker at {shown}: {error}", err=True)
        sys.exit(EXIT_BROKER)
    except BenchError as error:
        click.echo(f"reservoir bench: {error}", err=True)
        sys.exit(error.exit_status)
    if as_json:
        click.echo(json.dumps(result.as_json(), sort_keys=True))
    else:
        _print_table(result)
    broken = {name: count for name, count in result.audit.items() if count}
    if broken:
        click.echo(f"reservoir bench: the invariant audit failed: {broken}", err=True)
        sys.exit(EXIT_RUN_FAILED)


def _print_table(result: BenchResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    r, machine = result, result.machine
    nodes_where = (
        "in this process" if r.node_mode == "in-process" else f"in {r.node_processes} processes"
    )
    console.print(f"reservoir bench on {r.broker}")
    console.print(
        f"{r.nodes} nodes {nodes_where}, {r.requestors} requestors ({r.requestor_mode}), "
        f"{r.placements} placements; run took {r.elapsed_s:.0f} s"
    )
    console.print(
        f"machine: {machine['cores']} cores, {machine['implementation']} {machine['python']}, "
        f"{machine['platform']}"
    )
    table = Table()
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("target")
    table.add_column("met")
    to_nodes: list[tuple[str, str, str]] = []
    floor: list[tuple[str, str, str]] = []
    if r.rtt_to_nodes_p50_ms is not None and r.rtt_to_nodes_p99_ms is not None:
        to_nodes = [
            ("round trip to a node process p50", f"{r.rtt_to_nodes_p50_ms:.3f} ms", ""),
            ("  p99", f"{r.rtt_to_nodes_p99_ms:.3f} ms", ""),
        ]
    if r.place_floor_over_rtt is not None:
        floor = [("  least it can be: 2 trips to nodes", f"x{r.place_floor_over_rtt:.2f}", "")]
    rows: list[tuple[str, str, str]] = [
        ("round trip p50", f"{r.rtt_p50_ms:.3f} ms", ""),
        (
            "  before, after the sequential run",
            f"{r.rtt_p50_before_ms:.3f}, {r.rtt_p50_after_ms:.3f} ms",
            "",
        ),
        ("round trip p99", f"{r.rtt_p99_ms:.3f} ms", ""),
        *to_nodes,
        ("placement p50", f"{r.place_p50_ms:.3f} ms", ""),
        ("placement p95", f"{r.place_p95_ms:.3f} ms", ""),
        ("placement p99", f"{r.place_p99_ms:.3f} ms", ""),
        ("placement p50 / round trip p50", f"x{r.place_p50_over_rtt:.2f}", "place_p50_over_rtt"),
        *floor,
        ("placement p99 / round trip p99", f"x{r.place_p99_over_rtt:.2f}", "place_p99_over_rtt"),
        ("placements per second", f"{r.placements_per_s:,.0f}", "placements_per_s"),
        ("messages per placement", f"{r.messages_per_placement:.2f}", "messages_per_placement"),
        ("  delivered, throughput run", f"{r.throughput_messages_per_placement:.2f}", ""),
        ("time to a clear failure", f"{r.time_to_failure_ms:.1f} ms", "time_to_failure_ms"),
        ("  with explain", f"{r.time_to_failure_explain_ms:.1f} ms", ""),
        ("failed: sequential, throughput", f"{r.sequential_failed}, {r.throughput_failed}", ""),
        ("exhaustive steps (sequential)", f"{r.exhaustive_steps}", ""),
        ("broker's bare message rate", f"{r.broker_msgs_per_s:,.0f}/s", ""),
        ("  placements/s it allows", f"{r.broker_bound_placements_per_s:,.0f}", ""),
        ("CPU per placement (throughput)", f"{sum(r.cpu_ms_per_placement.values()):.3f} ms", ""),
        (
            f"  placements/s it allows on {r.cpu_bound_cores} core(s)",
            f"{r.cpu_bound_placements_per_s:,.0f}",
            "",
        ),
        (
            "  reservoir's own (all but the broker)",
            f"{r.own_cpu_ms_per_placement:.3f} ms",
            "own_cpu_ms_per_placement",
        ),
        *(
            [
                (
                    "  reservoir's own / the broker's",
                    f"x{r.own_cpu_over_broker_cpu:.2f}",
                    "own_cpu_over_broker_cpu",
                )
            ]
            if r.own_cpu_over_broker_cpu is not None
            else []
        ),
        (
            "  least with this client adapter",
            f"{r.client_floor_cpu_ms_per_placement:.3f} ms",
            "",
        ),
    ]
    for name, value, figure in rows:
        target = r.targets.get(figure)
        if target is None:
            table.add_row(name, value, "", "")
        else:
            met = "[green]yes[/]" if target["met"] else "[red]no[/]"
            table.add_row(name, value, target["target"], met)
    console.print(table)
    stated: dict[str, list[str]] = {}
    for figure, target in r.targets.items():
        stated.setdefault(target["stated_for"], []).append(figure)
    if stated:
        groups = "; ".join(f"{where}: {', '.join(f)}" for where, f in sorted(stated.items()))
        console.print(f"targets as stated for: {groups}")
    kinds = ", ".join(f"{k} {v:g}" for k, v in r.messages_per_placement_by_kind.items())
    console.print(f"messages per placement by kind: {kinds}")
    parts = ", ".join(f"{k} {v:.3f} ms" for k, v in r.cpu_ms_per_placement.items())
    console.print(f"CPU per placement by part: {parts}")
    switches = ", ".join(
        f"{k} {v['woken']:g} woken, {v['preempted']:g} preempted"
        for k, v in r.switches_per_placement.items()
    )
    console.print(f"threads' context switches per placement by part: {switches}")
    outage = r.keeper_outage
    if outage is not None:
        sources = ", ".join(f"{n} on {s}" for s, n in outage["requestors_by_roster_source"].items())
        console.print(
            f"keeper outage: {outage['killed']} (of {outage['keepers']}) killed after "
            f"{outage['killed_after_placements']} of {outage['placements']} placements, started "
            f"again after {outage['started_again_after_placements']} "
            f"({outage['keeper_down_s']:.2f} s down); placed {outage['placed']}, "
            f"false failures {outage['false_failures']}, p50 {outage['p50_ms']:.3f} ms, "
            f"p99 {outage['p99_ms']:.3f} ms; at the end {sources}; "
            f"{outage['requestors_that_fell_back']} fell back to the announcements, "
            f"{outage['requestors_back_on_keepers']} came back; the restarted keeper sent "
            f"{outage['samples_from_the_restarted_keeper']} sample(s)"
        )
    for note in r.notes:
        console.print(f"note: {note}")
