"""``reservoir bench-service``: the HTTP service over real HTTP, beside the library on the
same nodes in the same run (:mod:`reservoir.tools.bench.service` does the run)."""

from __future__ import annotations

import json
import os
import sys

import click

from reservoir.broker import BrokerError, UnsupportedBroker
from reservoir.brokers import BrokerUrl
from reservoir.cli.options import stopped_by_sigterm, usage_error
from reservoir.exit_status import EXIT_BROKER, EXIT_RUN_FAILED
from reservoir.tools.bench.errors import BenchError
from reservoir.tools.bench.runner import bench_url
from reservoir.version import install_hint


def _parse_url(ctx: click.Context, param: click.Parameter, value: str) -> BrokerUrl:
    try:
        url = bench_url(value)
    except (UnsupportedBroker, ValueError) as error:
        raise click.BadParameter(str(error)) from None
    if url.adapter == "memory":
        raise click.BadParameter(
            "the service runs in processes of their own, which memory:// cannot reach: "
            "give a RabbitMQ URL"
        )
    return url


@click.command("bench-service")
@click.option(
    "--broker",
    "broker_url",
    envvar="RESERVOIR_BROKER_URL",
    required=True,
    callback=_parse_url,
    help="RabbitMQ URL: amqp://user:pass@host:5672/vhost [env: RESERVOIR_BROKER_URL]. "
    "?exchange=NAME prefixes the run's own exchanges.",
)
@click.option(
    "--nodes", default=10, show_default=True, type=click.IntRange(1, 1000), help="Node agents."
)
@click.option(
    "--node-processes",
    default=2,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Processes the node agents are spread over.",
)
@click.option(
    "--replicas",
    default=2,
    show_default=True,
    type=click.IntRange(1, 16),
    help="reservoir serve processes (the second answers GETs of what the first placed).",
)
@click.option(
    "--clients",
    default=16,
    show_default=True,
    type=click.IntRange(1, 256),
    help="HTTP clients at once (one connection each) in the concurrent runs, and the "
    "library's threads in its own.",
)
@click.option(
    "--sequential",
    default=300,
    show_default=True,
    type=click.IntRange(10, 100_000),
    help="Requests one at a time on each path (POST, keyed POST, GET).",
)
@click.option(
    "--cycles",
    default=1000,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="POST, GET, DELETE cycles of the concurrent clients, unkeyed and again keyed.",
)
@click.option(
    "--load-seconds",
    "load_s",
    default=4,
    show_default=True,
    type=click.IntRange(1, 600),
    help="How long wrk POSTs in each throughput run (with wrk installed).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print exactly one JSON object with the results, nothing else on stdout.",
)
def bench_service(
    broker_url: BrokerUrl,
    nodes: int,
    node_processes: int,
    replicas: int,
    clients: int,
    sequential: int,
    cycles: int,
    load_s: int,
    as_json: bool,
) -> None:
    """Measure reservoir serve as its users meet it, over real HTTP with concurrent
    clients, beside the library on the same nodes in the same run: POST, GET and DELETE
    p50/p99 against the library's reserve and release, placements per second, the
    replicas' CPU per request, and every answer of the concurrent POST-GET-DELETE cycles
    by status (a 404 for an id just placed fails the run).

    Runs on exchanges of its own, removed at the end, and ends with the audit of every
    node's ledger (nothing held, nothing overcommitted). Exit status 3 when the broker
    cannot be reached, 1 when the audit or the 404 count fails, 2 when the run cannot be
    carried out.
    """
    if node_processes > nodes:
        raise click.BadParameter(
            f"{node_processes} processes for {nodes} nodes: give at most --nodes",
            param_hint="'--node-processes'",
        )
    try:
        import httpx  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        usage_error(f"reservoir bench-service needs the api extra: {install_hint('api')}")
    from reservoir.tools.bench.service import run_service_bench

    def progress(message: str) -> None:
        click.echo(f"bench-service: {message}", err=True)

    try:
        with stopped_by_sigterm():
            result = run_service_bench(
                broker_url=broker_url,
                nodes=nodes,
                node_processes=node_processes,
                replicas=replicas,
                clients=clients,
                sequential=sequential,
                cycles=cycles,
                load_s=load_s,
                progress=progress,
            )
    except BrokerError as error:
        shown = broker_url.display
        click.echo(f"reservoir bench-service: cannot use the broker at {shown}: {error}", err=True)
        sys.exit(EXIT_BROKER)
    except BenchError as error:
        click.echo(f"reservoir bench-service: {error}", err=True)
        sys.exit(error.exit_status)
    if as_json:
        click.echo(json.dumps(result.as_json(), sort_keys=True))
    else:
        _print_table(result)
    broken = {name: count for name, count in result.audit.items() if count}
    if result.held_at_end:
        broken["held_at_end"] = result.held_at_end
    if result.not_found_for_held:
        broken["not_found_for_held"] = result.not_found_for_held
    if broken:
        click.echo(f"reservoir bench-service: the run failed: {broken}", err=True)
        sys.exit(EXIT_RUN_FAILED)


def _print_table(result: object) -> None:
    from rich.console import Console
    from rich.table import Table

    from reservoir.tools.bench.service import ServiceBenchResult

    assert isinstance(result, ServiceBenchResult)
    r = result
    console = Console()
    console.print(
        f"reservoir bench-service on {r.broker}: {r.nodes} nodes in {r.node_processes} "
        f"processes, {r.replicas} replica(s), {r.clients} clients; run took {r.elapsed_s:.0f} s"
    )
    table = Table()
    for column in ("measure", "library", "service", "ratio", "target", "met"):
        table.add_column(column, justify="left" if column == "measure" else "right")

    def row(name: str, library: str, service: str, figure: str = "", ratio: str = "") -> None:
        target = r.targets.get(figure)
        bound = met = ""
        if target is not None:
            bound = f"{'<=' if target['at_most'] else '>='} {target['bound']:g}"
            met = "[green]yes[/]" if target["met"] else "[red]no[/]"
        table.add_row(name, library, service, ratio, bound, met)

    lib, http, ratios = r.library, r.http, r.ratios
    row("POST p50 / reserve p50", f"{lib['reserve_p50_ms']:.2f} ms",
        f"{http['post_p50_ms']:.2f} ms", "post_p50_over_library",
        f"x{ratios['post_p50_over_library']:.2f}")  # fmt: skip
    row("  p99", f"{lib['reserve_p99_ms']:.2f} ms", f"{http['post_p99_ms']:.2f} ms")
    row("keyed POST p50 / reserve p50", f"{lib['keyed_reserve_p50_ms']:.2f} ms (keyed)",
        f"{http['keyed_post_p50_ms']:.2f} ms", "keyed_post_p50_over_library",
        f"x{ratios['keyed_post_p50_over_library']:.2f}")  # fmt: skip
    row("DELETE p50 / release p50", f"{lib['release_p50_ms']:.2f} ms",
        f"{http['delete_p50_ms']:.2f} ms")  # fmt: skip
    row("GET p50, the replica that placed", "", f"{http['get_p50_placing_ms']:.2f} ms",
        "get_p50_placing_ms")  # fmt: skip
    row("GET p50, another replica", "", f"{http['get_p50_other_ms']:.2f} ms", "get_p50_other_ms")
    row("GET p50, an id nobody holds", "", f"{http['get_unknown_p50_ms']:.2f} ms",
        "get_unknown_p50_ms")  # fmt: skip
    row("CPU per placement and release", f"{r.library_cpu_ms_per_cycle:.2f} ms",
        f"{r.serve_cpu_ms_per_cycle:.2f} ms", "cpu_per_cycle_over_library",
        f"x{ratios['cpu_per_cycle_over_library']:.2f}")  # fmt: skip
    row(f"placements/s, {r.clients} at once, one replica", f"{r.library_per_s:,.0f}",
        f"{r.post_per_s_one_replica:,.0f}", "post_per_s_over_library",
        f"x{ratios['post_per_s_over_library']:.2f}")  # fmt: skip
    row(f"  on {r.replicas} replica(s)", "", f"{r.post_per_s_every_replica:,.0f}")
    row("  the replicas' CPU per POST", "", f"{r.serve_cpu_ms_per_post_under_load:.2f} ms")
    library_cpu = sum(r.library_cpu_ms_per_placement.values())
    service_cpu = sum(r.service_cpu_ms_per_post.values())
    row("  CPU per placement, every process", f"{library_cpu:.2f} ms", f"{service_cpu:.2f} ms")
    cores = os.cpu_count()
    row(f"  placements/s {cores} cores allow at that", f"{r.library_cpu_bound_per_s:,.0f}",
        f"{r.service_cpu_bound_per_s:,.0f}")  # fmt: skip
    for label, per_s in r.cycle_per_s.items():
        statuses = ", ".join(f"{k}: {v}" for k, v in r.cycle_statuses[label].items())
        row(f"cycles/s, {label} ({statuses})", "", f"{per_s:,.0f}")
    row("404 for an id just placed", "", str(r.not_found_for_held), "not_found_for_held")
    row("instances held at the end", "", str(r.held_at_end), "held_at_end")
    console.print(table)
    console.print(f"audit: {r.audit}")
    console.print(f"the concurrent POSTs were driven by {r.load_tool}")
    library_parts = ", ".join(f"{k} {v:.3f}" for k, v in r.library_cpu_ms_per_placement.items())
    service_parts = ", ".join(f"{k} {v:.3f}" for k, v in r.service_cpu_ms_per_post.items())
    console.print(f"CPU per placement by part (ms): library {library_parts}")
    console.print(f"  service {service_parts}")
    for note in r.notes:
        console.print(f"note: {note}")
