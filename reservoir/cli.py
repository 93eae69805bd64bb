"""The ``reservoir`` command: ``demo``, ``node``, ``request``, ``free``, ``inspect``,
``nodes`` and ``audit`` (and ``simulate``, ``bench``, ``chaos``).

Every command reads ``RESERVOIR_BROKER_URL`` (and the other ``RESERVOIR_*`` settings) when
the matching option is absent. Exit status: 0 on success, 1 when a request could not be
placed, 2 on bad usage or a broken invariant, 3 when the broker cannot be reached.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, cast

import click
import msgspec.structs
from pydantic import ValidationError

from brokers.admin import ExchangeInUse
from reservoir.broker import BrokerError
from reservoir.exit_status import EXIT_BROKER, EXIT_INTERRUPTED, EXIT_NOT_PLACED, EXIT_USAGE
from reservoir.protocol.ledger import Inventory
from reservoir.protocol.messages import GroupPolicy, GroupSpec, NumaSpec
from reservoir.protocol.numa import NumaTopology
from reservoir.protocol.placement import PlacementError, PlacementRequest, checked_request
from reservoir.settings import Settings

BROKER_HELP = (
    "Broker URL: memory://, amqp://user:pass@host:5672/vhost or kombu+amqp://... "
    "[env: RESERVOIR_BROKER_URL]"
)


def _settings(**overrides: Any) -> Settings:
    try:
        settings = Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as error:
        # One line naming each setting (and its environment variable) and what is wrong,
        # not pydantic's report with its links.
        command = click.get_current_context().command_path
        problems = "; ".join(
            f"{_setting_name(e['loc'])}{e['msg'].removeprefix('Value error, ')}"
            for e in error.errors(include_url=False)
        )
        click.echo(f"{command}: bad setting: {problems}", err=True)
        sys.exit(EXIT_USAGE)
    from brokers import BrokerUrl
    from reservoir.broker import UnsupportedBroker

    try:
        BrokerUrl.parse(settings.broker_url)
    except UnsupportedBroker:
        pass  # the command says so when it opens the broker (exit 3), as it always did
    except ValueError as error:
        # One line, naming what is wrong: a mistyped URL is not worth a usage screen.
        command = click.get_current_context().command_path
        click.echo(f"{command}: --broker / RESERVOIR_BROKER_URL: {error}", err=True)
        sys.exit(EXIT_USAGE)
    return settings


def _setting_name(loc: tuple[int | str, ...]) -> str:
    """``ttl_s (RESERVOIR_TTL_S): `` for a field's error; nothing for one about several
    settings together (its message names them)."""
    if not loc:
        return ""
    field = str(loc[0])
    return f"{field} (RESERVOIR_{field.upper()}): "


def _set_up_tracing(command: str) -> None:
    """OpenTelemetry for this process, when OTEL_TRACES_EXPORTER asks for it."""
    from reservoir.tracing import configure_from_environment

    problem = configure_from_environment(f"reservoir-{command}")
    if problem is not None:
        click.echo(f"reservoir {command}: {problem}", err=True)
        sys.exit(EXIT_USAGE)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="reservoir", prog_name="reservoir")
@click.option("-v", "--verbose", count=True, help="More logging on stderr (-vv for debug).")
@click.option(
    "--log-format",
    type=click.Choice(["text", "json"]),
    default="text",
    show_default=True,
    envvar="RESERVOIR_LOG_FORMAT",
    help="Log lines on stderr as text, or as one JSON object each (with the request_id "
    "of the conversation a line belongs to) [env: RESERVOIR_LOG_FORMAT].",
)
def main(verbose: int, log_format: str) -> None:
    """reservoir places work on compute nodes with a fanout reservation protocol.

    A requestor broadcasts a reservation request on utilisation-tiered topics; every node
    that can take it reserves the resources and answers; the requestor awards a winner
    and releases the rest; unclaimed reservations expire after a TTL (5 s).
    """
    from reservoir.logs import configure

    configure(verbose, "json" if log_format == "json" else "text")


# -- demo ----------------------------------------------------------------------------------


@main.command()
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
@click.option(
    "--broker",
    "broker_url",
    envvar="RESERVOIR_BROKER_URL",
    default="memory://",
    show_default=True,
    help=BROKER_HELP,
)
@click.option(
    "--policy",
    type=click.Choice(["spread", "pack", "least-utilised"]),
    default=None,
    help="How requestors pick winners [default: spread].",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print exactly one JSON object with the results, nothing else on stdout.",
)
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
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from reservoir.demo import run_demo

    settings = _settings(broker_url=broker_url, policy=policy)
    stderr = Console(stderr=True)
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    try:
        with Progress(
            *columns, console=stderr, transient=as_json, disable=not stderr.is_terminal
        ) as bar:
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
        shown = _shown_url(broker_url)
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


def _shown_url(url: str | None) -> str:
    """A broker URL fit to print: its password masked (the one owner of that: BrokerUrl)."""
    from brokers import BrokerUrl

    try:
        return BrokerUrl.parse(url or "memory://").display
    except (ValueError, BrokerError):
        return "(an unparseable broker URL)"


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


def _parse_pairs(values: Sequence[str], what: str) -> dict[str, str]:
    pairs = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key or not rest:
            raise click.BadParameter(f"{value!r}: expected {what}")
        pairs[key.strip().upper()] = rest.strip()
    return pairs


def _node_inventories(
    vcpus: int | None,
    memory_mb: int | None,
    disk_gb: int | None,
    inventory: Sequence[str],
    ratio: Sequence[str],
    reserved: Sequence[str],
) -> dict[str, Inventory]:
    totals: dict[str, int] = {}
    for rc, amount in {"VCPU": vcpus, "MEMORY_MB": memory_mb, "DISK_GB": disk_gb}.items():
        if amount is not None:
            totals[rc] = amount
    for rc, total in _parse_pairs(inventory, "CLASS=TOTAL").items():
        try:
            totals[rc] = int(total)
        except ValueError:
            raise click.BadParameter(f"{rc}={total}: the total must be a whole number") from None
    ratios = _parse_pairs(ratio, "CLASS=RATIO")
    reserve = _parse_pairs(reserved, "CLASS=AMOUNT")
    for rc in (*ratios, *reserve):
        if rc not in totals:
            raise click.BadParameter(f"{rc} has no inventory: give its total first")
    if not totals:
        raise click.UsageError(
            "a node needs an inventory: --vcpus, --memory-mb, --disk-gb or --inventory CLASS=TOTAL"
        )
    try:
        return {
            rc: Inventory(
                total=total,
                allocation_ratio=float(ratios.get(rc, 1.0)),
                reserved=int(reserve.get(rc, 0)),
            )
            for rc, total in totals.items()
        }
    except ValueError as error:
        raise click.BadParameter(str(error)) from None


@main.command()
@click.option(
    "--broker", "broker_url", envvar="RESERVOIR_BROKER_URL", default=None, help=BROKER_HELP
)
@click.option("--name", required=True, help="The node's name; its inbox is reservoir.node.NAME.")
@click.option("--vcpus", type=click.IntRange(0), help="VCPU inventory.")
@click.option("--memory-mb", type=click.IntRange(0), help="MEMORY_MB inventory.")
@click.option("--disk-gb", type=click.IntRange(0), help="DISK_GB inventory.")
@click.option(
    "--inventory",
    multiple=True,
    metavar="CLASS=TOTAL",
    help="Any other resource class, e.g. CUSTOM_GPU=4 or PCPU=16. Repeatable.",
)
@click.option(
    "--allocation-ratio",
    "ratio",
    multiple=True,
    metavar="CLASS=RATIO",
    help="Overcommit a class, e.g. VCPU=4.0. Repeatable.",
)
@click.option(
    "--reserved",
    multiple=True,
    metavar="CLASS=AMOUNT",
    help="Keep some of a class for the host, e.g. MEMORY_MB=2048. Repeatable.",
)
@click.option("--trait", "traits", multiple=True, help="A trait the node has, e.g. HW_GPU.")
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    envvar="RESERVOIR_STATE_DIR",
    help="Keep allocations durably (SQLite) here, so a restart keeps them.",
)
@click.option(
    "--numa-cells",
    type=click.IntRange(1),
    default=None,
    help="Describe N equal NUMA cells sharing the CPUs (PCPU, else VCPU) and the memory.",
)
@click.option(
    "--hugepages",
    multiple=True,
    metavar="SIZE_KB=COUNT",
    help="Huge pages per NUMA cell, e.g. 2048=512. Repeatable.",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Serve Prometheus metrics on this port (needs the prometheus extra).",
)
@click.option(
    "--status-interval",
    type=click.FloatRange(0.1),
    default=1.0,
    show_default=True,
    help="With --state-dir, rewrite NAME.status.json this often (seconds).",
)
@click.option(
    "--connect-attempts",
    type=click.IntRange(0),
    default=0,
    show_default=True,
    help="Give up after this many failed attempts to reach the broker (0: keep trying, "
    "with backoff up to 15 s between attempts, until stopped).",
)
def node(
    broker_url: str | None,
    name: str,
    vcpus: int | None,
    memory_mb: int | None,
    disk_gb: int | None,
    inventory: tuple[str, ...],
    ratio: tuple[str, ...],
    reserved: tuple[str, ...],
    traits: tuple[str, ...],
    state_dir: Path | None,
    numa_cells: int | None,
    hugepages: tuple[str, ...],
    metrics_port: int | None,
    status_interval: float,
    connect_attempts: int,
) -> None:
    """Run a node agent until SIGTERM or SIGINT.

    A broker that is not up yet (or restarting) is waited for, with a line per failed
    attempt. On a signal it stops taking requests, withdraws its live reservations and
    closes cleanly; allocations stay in --state-dir for the next start.
    """
    from reservoir.backoff import quietly_connecting, until_connected
    from reservoir.logs import say
    from reservoir.node_agent import NodeAgent
    from reservoir.store import StateError

    inventories = _node_inventories(vcpus, memory_mb, disk_gb, inventory, ratio, reserved)
    topology = _numa_topology(numa_cells, hugepages, inventories)
    settings = _settings(broker_url=broker_url, state_dir=state_dir)
    # before connecting: a port in use is a usage error, said before any waiting
    registry = _serve_metrics(metrics_port) if metrics_port is not None else None
    _set_up_tracing("node")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def start_agent() -> NodeAgent:
        # the adapters' own line per attempt would repeat ours (one per attempt, below)
        with quietly_connecting():
            return NodeAgent(
                settings.broker_url,
                name=name,
                inventories=inventories,
                traits=[t.upper() for t in traits],
                numa=topology,
                settings=settings,
                metrics_registry=registry,
            )

    try:
        agent = until_connected(start_agent, connect_attempts, stop, on_wait=_say_waiting(name))
    except StateError as error:
        click.echo(f"reservoir node: {error}", err=True)
        sys.exit(EXIT_USAGE)
    except BrokerError as error:
        click.echo(f"reservoir node: {_node_broker_problem(name, error)}", err=True)
        sys.exit(EXIT_BROKER)
    except ValueError as error:
        raise click.UsageError(str(error)) from None
    if agent is None:
        say(f"node {name}: stopped before the broker answered")
        return
    snapshot = agent.snapshot()
    metrics_at = f"; metrics on port {metrics_port}" if metrics_port is not None else ""
    say(
        f"node {name}: ready on {_shown_url(settings.broker_url)}; "
        f"{len(snapshot.allocations)} allocation(s) held, utilisation "
        f"{snapshot.utilisation:.0%}, tier {snapshot.tier}%{metrics_at}"
    )
    status_path = state_dir / f"{name}.status.json" if state_dir else None
    try:
        while True:
            if status_path is not None:
                agent.write_status(status_path)
            if stop.wait(status_interval):
                break
    finally:
        agent.close()
        if status_path is not None:
            agent.write_status(status_path)
        say(f"node {name}: stopped")


def _node_broker_problem(name: str, error: BaseException) -> str:
    """What keeps a node off the broker, in words an operator can act on."""
    if "RESOURCE_LOCKED" in str(error):
        # Its inbox is an exclusive queue named after it: another connection holds it.
        return (
            f"a node named {name} is already connected to this broker (its inbox "
            f"reservoir.node.{name} is taken); give this one another --name, or stop the "
            "other (one that just died is let go within the heartbeat, 30 s)"
        )
    return f"cannot reach the broker: {error}"


def _say_waiting(name: str) -> Callable[[int, BaseException, float], None]:
    from reservoir.logs import say as say_line

    def say(attempt: int, error: BaseException, wait_s: float) -> None:
        say_line(
            f"node {name}: {_node_broker_problem(name, error)} (attempt {attempt}); "
            f"retrying in {wait_s:.1f} s"
        )

    return say


def _serve_metrics(port: int) -> Any:
    """The registry a node exports (its metrics and the process's), served on ``port``."""
    try:
        from reservoir.prometheus import process_registry, serve_metrics
    except ImportError:
        raise click.UsageError(
            "--metrics-port needs prometheus-client: pip install 'reservoir[prometheus]'"
        ) from None
    registry = process_registry()
    try:
        serve_metrics(registry, port)
    except OSError as error:
        click.echo(
            f"reservoir node: --metrics-port {port}: cannot listen: {error.strerror or error}",
            err=True,
        )
        sys.exit(EXIT_USAGE)
    return registry


def _numa_topology(
    cells: int | None, hugepages: Sequence[str], inventories: dict[str, Inventory]
) -> NumaTopology | None:
    if cells is None:
        if hugepages:
            raise click.UsageError("--hugepages describes NUMA cells: give --numa-cells too")
        return None
    cpus = inventories.get("PCPU") or inventories.get("VCPU")
    memory = inventories.get("MEMORY_MB")
    if cpus is None or memory is None:
        raise click.UsageError("--numa-cells needs CPUs (--vcpus or PCPU) and --memory-mb")
    try:
        pages = {int(k): int(v) for k, v in _parse_pairs(hugepages, "SIZE_KB=COUNT").items()}
        return NumaTopology.uniform(cells, cpus.total, memory.total, pages)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None


# -- request -------------------------------------------------------------------------------


def _open_requestor(command: str, broker_url: str | None) -> Any:
    from reservoir.backoff import quietly_connecting
    from reservoir.requestor import Requestor

    settings = _settings(broker_url=broker_url)
    try:
        with quietly_connecting():
            return Requestor(settings.broker_url, settings=settings)
    except BrokerError as error:
        click.echo(f"reservoir {command}: cannot reach the broker: {error}", err=True)
        sys.exit(EXIT_BROKER)


@main.command()
@click.option(
    "--broker", "broker_url", envvar="RESERVOIR_BROKER_URL", default=None, help=BROKER_HELP
)
@click.option("--vcpus", type=click.IntRange(0), help="VCPUs per instance.")
@click.option("--memory-mb", type=click.IntRange(0), help="Memory per instance, MiB.")
@click.option("--disk-gb", type=click.IntRange(0), help="Disk per instance, GiB.")
@click.option(
    "--resource",
    "resources",
    multiple=True,
    metavar="CLASS=AMOUNT",
    help="Any other resource class per instance, e.g. CUSTOM_GPU=1. Repeatable.",
)
@click.option(
    "--count",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Instances wanted; all or nothing unless --min-count.",
)
@click.option(
    "--min-count", type=click.IntRange(1), help="Accept a partial placement of this many."
)
@click.option(
    "--require",
    "required",
    multiple=True,
    metavar="TRAIT",
    help="A trait the node must have. Repeatable.",
)
@click.option(
    "--forbid",
    "forbidden",
    multiple=True,
    metavar="TRAIT",
    help="A trait the node must not have. Repeatable.",
)
@click.option("--group", help="Server group the instances join.")
@click.option(
    "--policy",
    "group_policy",
    type=click.Choice(["affinity", "anti-affinity", "soft-affinity", "soft-anti-affinity"]),
    help="The server group's policy (with --group).",
)
@click.option(
    "--numa-nodes", type=click.IntRange(1), help="Spread each instance over N NUMA cells."
)
@click.option("--pinned", is_flag=True, help="Dedicated (pinned) CPUs, with --numa-nodes.")
@click.option(
    "--hint",
    "hints",
    multiple=True,
    metavar="KEY=VALUE",
    help="Free-form hint for node-side filters. Repeatable.",
)
@click.option("--request-id", help="Idempotency key: asking again returns the same placement.")
@click.option(
    "--explain/--no-explain",
    default=True,
    show_default=True,
    help="Ask nodes that cannot take it to say why (each such node answers with its "
    "reasons; --no-explain keeps them silent on broadcasts).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(0.1),
    default=30.0,
    show_default=True,
    help="Give up after this many seconds.",
)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Only ask: list the nodes that would take it and why the others would not, "
    "reserving nothing (answers gathered for 1 s, or --timeout if shorter); exit status "
    "1 when there is not room enough.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def request(
    broker_url: str | None,
    vcpus: int | None,
    memory_mb: int | None,
    disk_gb: int | None,
    resources: tuple[str, ...],
    count: int,
    min_count: int | None,
    required: tuple[str, ...],
    forbidden: tuple[str, ...],
    group: str | None,
    group_policy: str | None,
    numa_nodes: int | None,
    pinned: bool,
    hints: tuple[str, ...],
    request_id: str | None,
    explain: bool,
    timeout_s: float,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Place one request and print the placement, or the failure with its explanation
    (exit status 1). With --dry-run, only say where it would fit."""

    amounts: dict[str, int] = {}
    for rc, given in {"VCPU": vcpus, "MEMORY_MB": memory_mb, "DISK_GB": disk_gb}.items():
        if given:
            amounts[rc] = given
    for rc, text in _parse_pairs(resources, "CLASS=AMOUNT").items():
        try:
            amounts[rc] = int(text)
        except ValueError:
            raise click.BadParameter(f"{rc}={text}: a whole number") from None
    if (group is None) != (group_policy is None):
        raise click.UsageError("--group and --policy go together")
    if pinned and numa_nodes is None:
        numa_nodes = 1
    try:
        spec = PlacementRequest(
            resources=amounts,
            count=count,
            min_count=min_count,
            required_traits=frozenset(t.upper() for t in required),
            forbidden_traits=frozenset(t.upper() for t in forbidden),
            group=GroupSpec(name=group, policy=cast(GroupPolicy, group_policy)) if group else None,
            numa=NumaSpec(nodes=numa_nodes, dedicated_cpus=pinned) if numa_nodes else None,
            explain=explain,
            hints=dict(_parse_pairs(hints, "KEY=VALUE")) if hints else {},
            request_id=request_id,
        )
        spec = checked_request(spec)
    except ValueError as error:
        raise click.UsageError(f"not a valid request: {error}") from None
    if dry_run:
        _dry_run(spec, broker_url, min(timeout_s, DRY_RUN_WAIT_S), as_json)
        return
    _set_up_tracing("request")
    requestor = _open_requestor("request", broker_url)
    with requestor:
        try:
            placement = requestor.reserve(spec, timeout_s=timeout_s)
        except PlacementError as error:
            explanation = error.explanation
            if as_json:
                click.echo(
                    json.dumps(
                        {
                            "placed": False,
                            "request_id": explanation.request_id,
                            "explanation": str(explanation),
                            "reasons": dict(explanation.reasons),
                            "tiers_tried": list(explanation.tiers_tried),
                            "offers_received": explanation.offers_received,
                            "timed_out": type(error).__name__ == "PlacementTimeout",
                        },
                        sort_keys=True,
                    )
                )
            else:
                click.echo(f"not placed: {explanation}", err=True)
            sys.exit(EXIT_NOT_PLACED)
    if as_json:
        from reservoir.auditor import placement_record

        click.echo(json.dumps(placement_record(placement), sort_keys=True))
        return
    placed = len(placement.allocations)
    partly = f" (partial: {placed} of {placement.requested} asked for)" if placement.partial else ""
    click.echo(
        f"placed {placement.request_id}: {placed} instance(s){partly} "
        f"after tiers {', '.join(f'{t}%' for t in placement.tiers_tried)}"
    )
    for allocation in placement.allocations:
        shown = ", ".join(f"{rc}={n}" for rc, n in sorted(allocation.resources.items()))
        click.echo(f"  {allocation.node}  {allocation.allocation_id}  {shown}")


#: how long a dry run gathers the nodes' answers
DRY_RUN_WAIT_S = 1.0


def _dry_run(spec: PlacementRequest, broker_url: str | None, wait_s: float, as_json: bool) -> None:
    from reservoir.backoff import quietly_connecting
    from reservoir.dry_run import DryRun

    settings = _settings(broker_url=broker_url)
    try:
        with quietly_connecting():
            asking = DryRun(spec, settings.broker_url, settings=settings)
    except BrokerError as error:
        click.echo(f"reservoir request: cannot reach the broker: {error}", err=True)
        sys.exit(EXIT_BROKER)
    with asking:
        asking.ask()
        report = asking.collect(wait_s=wait_s)
    if as_json:
        click.echo(json.dumps(report.as_json(), sort_keys=True))
    else:
        shape = ", ".join(f"{rc}={n}" for rc, n in sorted(spec.resources.items()) if n)
        if not report.answers:
            click.echo(f"dry run of {spec.count} instance(s) of {shape}: no node answered")
        else:
            click.echo(
                f"dry run of {spec.count} instance(s) of {shape}: "
                f"{len(report.takers)} of {len(report.answers)} node(s) could take it, "
                f"room for {report.room} instance(s) (wanted {report.wanted}); "
                "nothing was reserved"
            )
        for answer in report.answers:
            if answer.slots:
                click.echo(
                    f"  would take   {answer.node}: {answer.slots} instance(s), utilisation "
                    f"{answer.utilisation:.0%}, tier {answer.tier}%, score {answer.score:.2f}"
                )
            else:
                why = "; ".join(answer.reasons) or "no room"
                busy = " (held by others' live reservations)" if answer.busy else ""
                click.echo(f"  would not    {answer.node}: {why}{busy}")
    if not report.would_place:
        sys.exit(EXIT_NOT_PLACED)


# -- free ----------------------------------------------------------------------------------


@main.command()
@click.option(
    "--broker", "broker_url", envvar="RESERVOIR_BROKER_URL", default=None, help=BROKER_HELP
)
@click.option("--request-id", required=True, help="The request whose allocations to free.")
@click.option(
    "--node",
    "node_name",
    help="The node holding them [default: every node that holds any, found over the broker].",
)
@click.option(
    "--allocation",
    "allocation_ids",
    multiple=True,
    metavar="ID",
    help="Free only these allocations [default: all of the request on the node].",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(0.1),
    default=30.0,
    show_default=True,
    help="Give up waiting for the node's confirmation after this.",
)
def free(
    broker_url: str | None,
    request_id: str,
    node_name: str | None,
    allocation_ids: tuple[str, ...],
    timeout_s: float,
) -> None:
    """Free a request's allocations (its instances were deleted): on --node, or wherever
    the nodes say they hold allocations of the request."""
    from reservoir.requestor import FreeIncomplete

    settings = _settings(broker_url=broker_url)
    if node_name is not None:
        holders = [node_name]
    else:
        holders = _nodes_holding(settings, request_id)
        if not holders:
            click.echo(
                f"reservoir free: no node answering holds anything of {request_id}", err=True
            )
            sys.exit(EXIT_NOT_PLACED)
    requestor = _open_requestor("free", settings.broker_url)
    with requestor:
        for holder in holders:
            try:
                requestor.free_future(request_id, holder, allocation_ids).result(timeout_s)
            except FreeIncomplete as error:
                click.echo(f"reservoir free: {holder} did not confirm: {error}", err=True)
                sys.exit(EXIT_NOT_PLACED)
            except TimeoutError:
                click.echo(
                    f"reservoir free: {holder} did not confirm within {timeout_s:g} s "
                    "(is it running? its allocations stay until it is freed)",
                    err=True,
                )
                sys.exit(EXIT_NOT_PLACED)
            click.echo(f"freed {request_id} on {holder}")


def _nodes_holding(settings: Settings, request_id: str, wait_s: float = 1.0) -> list[str]:
    """The live nodes that hold allocations of ``request_id``, asked over the broker (every
    node answers with its ledger: an operator's command, O(N) once, not per placement)."""
    from reservoir.auditor import LedgerCollector
    from reservoir.backoff import quietly_connecting

    try:
        with quietly_connecting():
            collector = LedgerCollector(settings.broker_url, settings=settings)
    except BrokerError as error:
        click.echo(f"reservoir free: cannot reach the broker: {error}", err=True)
        sys.exit(EXIT_BROKER)
    try:
        collector.ask()
        snapshots = collector.collect(wait_s=wait_s)
    finally:
        collector.close()
    return sorted(
        s.name for s in snapshots if any(a.request_id == request_id for a in s.allocations)
    )


# -- inspect -------------------------------------------------------------------------------


@main.command()
@click.option(
    "--state-dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    required=True,
    envvar="RESERVOIR_STATE_DIR",
    help="The node's state directory.",
)
@click.option("--name", required=True, help="The node's name.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def inspect(state_dir: Path, name: str, as_json: bool) -> None:
    """Show the allocations a node's durable ledger holds (the node may be stopped)."""
    from reservoir.store import SqliteStore, StateError

    path = state_dir / f"{name}.sqlite3"
    if not path.exists():
        click.echo(f"reservoir inspect: no state file {path}", err=True)
        sys.exit(EXIT_USAGE)
    try:
        store = SqliteStore(path, node_name=name)
        allocations = store.load()
        store.close()
    except StateError as error:
        click.echo(f"reservoir inspect: {error}", err=True)
        sys.exit(EXIT_USAGE)
    status_path = state_dir / f"{name}.status.json"
    status = json.loads(status_path.read_text()) if status_path.exists() else None
    if as_json:
        click.echo(
            json.dumps(
                {
                    "node": name,
                    "status": status,
                    "allocations": [
                        {
                            "allocation_id": a.allocation_id,
                            "request_id": a.request_id,
                            "resources": dict(a.resources),
                            "group": a.group,
                            **({"numa": msgspec.structs.asdict(a.numa)} if a.numa else {}),
                        }
                        for a in allocations
                    ],
                },
                sort_keys=True,
            )
        )
        return
    click.echo(f"node {name}: {len(allocations)} allocation(s)")
    if status is not None:
        click.echo(
            f"  last status: utilisation {status['utilisation']:.0%}, tier {status['tier']}%, "
            f"{len(status['reservations'])} live reservation(s)"
        )
    for a in allocations:
        shown = ", ".join(f"{rc}={n}" for rc, n in sorted(a.resources.items()))
        click.echo(f"  {a.allocation_id}  request {a.request_id}  {shown}")


# -- nodes ---------------------------------------------------------------------------------


@main.command("nodes")
@click.option(
    "--broker", "broker_url", envvar="RESERVOIR_BROKER_URL", default=None, help=BROKER_HELP
)
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(0.1),
    default=1.0,
    show_default=True,
    help="How long to wait for the nodes to answer (seconds).",
)
@click.option(
    "--expect-nodes",
    type=click.IntRange(1),
    help="Stop waiting once this many nodes answered.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def nodes_command(
    broker_url: str | None, wait_s: float, expect_nodes: int | None, as_json: bool
) -> None:
    """List every live node: its tier, and per resource class its capacity, what is
    allocated and what live reservations hold.

    Gathered over the broker (every serving node answers one query with its ledger), so
    it shows what the nodes themselves hold, within --wait seconds."""
    from reservoir.auditor import LedgerCollector

    settings = _settings(broker_url=broker_url)
    from reservoir.backoff import quietly_connecting

    try:
        with quietly_connecting():
            collector = LedgerCollector(settings.broker_url, settings=settings)
    except BrokerError as error:
        click.echo(f"reservoir nodes: cannot reach the broker: {error}", err=True)
        sys.exit(EXIT_BROKER)
    try:
        collector.ask()
        snapshots = collector.collect(wait_s=wait_s, expect_nodes=expect_nodes)
    finally:
        collector.close()
    listed = [
        {
            "node": s.name,
            "tier": s.tier,
            "utilisation": round(s.utilisation, 4),
            "usage": {
                rc: {"capacity": u.capacity, "allocated": u.allocated, "reserved": u.reserved}
                for rc, u in s.usages.items()
            },
            "allocations": len(s.allocations),
            "reservations": len(s.reservations),
        }
        for s in snapshots
    ]
    if as_json:
        click.echo(json.dumps({"nodes": listed}, sort_keys=True))
        return
    if not listed:
        click.echo("no node answered")
        return
    from rich.console import Console
    from rich.table import Table

    classes = sorted({rc for node in listed for rc in node["usage"]})  # type: ignore[attr-defined]
    table = Table(box=None)
    for heading in ("node", "tier", "allocations", "reservations", *classes):
        table.add_column(heading, justify="left" if heading == "node" else "right")
    for node in listed:
        usage: dict[str, dict[str, int]] = node["usage"]  # type: ignore[assignment]
        cells = [
            f"{usage[rc]['allocated'] + usage[rc]['reserved']}/{usage[rc]['capacity']}"
            if rc in usage
            else "-"
            for rc in classes
        ]
        table.add_row(
            str(node["node"]), f"{node['tier']}%", str(node["allocations"]),
            str(node["reservations"]), *cells,
        )  # fmt: skip
    Console().print(table)


# -- audit ---------------------------------------------------------------------------------


@main.command("audit")
@click.option(
    "--broker", "broker_url", envvar="RESERVOIR_BROKER_URL", default=None, help=BROKER_HELP
)
@click.option(
    "--placements",
    "record_path",
    type=click.Path(dir_okay=False, exists=True, path_type=Path),
    help="The callers' record: JSON lines as `reservoir request --json` prints them. With "
    "it, every placement a caller heard of must be on the nodes, and allocations no caller "
    "heard of are listed as orphans with the command that frees each.",
)
@click.option(
    "--wait",
    "wait_s",
    type=click.FloatRange(0.1),
    default=2.0,
    show_default=True,
    help="How long to wait for the nodes' ledgers (seconds).",
)
@click.option(
    "--expect-nodes",
    type=click.IntRange(1),
    help="Stop waiting once this many nodes answered; fewer is a failure.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def audit_command(
    broker_url: str | None,
    record_path: Path | None,
    wait_s: float,
    expect_nodes: int | None,
    as_json: bool,
) -> None:
    """Ask every live node for its ledger and check the invariants across the cluster.

    Checks: no resource class overcommitted on any node; no request id holding more
    instances across nodes than it asked for; no reservation alive more than a second past
    its deadline; with --placements, every placement callers were told of held by the nodes,
    and every allocation accounted for. Exit status 0 when every check holds, 2 when one
    does not (or fewer nodes than --expect-nodes answered), 3 when the broker is
    unreachable.
    """
    from reservoir.auditor import audit_cluster, read_placements_file

    settings = _settings(broker_url=broker_url)
    try:
        record = read_placements_file(record_path) if record_path is not None else None
    except (OSError, ValueError) as error:
        raise click.BadParameter(str(error), param_hint="--placements") from None
    try:
        found = audit_cluster(
            settings.broker_url,
            settings=settings,
            placements=record,
            wait_s=wait_s,
            expect_nodes=expect_nodes,
        )
    except BrokerError as error:
        click.echo(f"reservoir audit: cannot reach the broker: {error}", err=True)
        sys.exit(EXIT_BROKER)
    missing = expect_nodes is not None and len(found.nodes) < expect_nodes
    if as_json:
        click.echo(json.dumps({**found.as_json(), "expected_nodes": expect_nodes}, sort_keys=True))
    else:
        click.echo(
            f"{len(found.nodes)} node(s) answered: {found.allocations} allocation(s), "
            f"{found.reservations} live reservation(s)"
        )
        for title, items in (
            ("overcommitted", found.report.overcommitted),
            ("placed more than once", found.report.duplicate_placements),
            ("leaked reservations", found.report.leaked_reservations),
            ("answered in part only", found.incomplete_nodes),
            ("orphaned allocations", found.orphans),
        ):
            if items:
                click.echo(f"{title}: {len(items)}")
                for item in items:
                    click.echo(f"  {item}")
        if missing:
            click.echo(f"expected {expect_nodes} node(s), {len(found.nodes)} answered")
        click.echo("invariants hold" if found.ok and not missing else "invariants BROKEN")
    if not found.ok or missing:
        sys.exit(EXIT_USAGE)


# -- simulate ------------------------------------------------------------------------------


def _simulator() -> Any:
    """The ``reservoir.simulator`` package, or a usage error naming what it lacks (numpy
    is not a dependency of the library itself; the plots extra brings it)."""
    try:
        import reservoir.simulator
    except ImportError as error:
        raise click.UsageError(
            f"reservoir simulate needs {error.name or 'numpy'}: pip install 'reservoir[simulate]'"
        ) from None
    return reservoir.simulator


def _parse_loads(ctx: click.Context, param: click.Parameter, value: str) -> tuple[float, ...]:
    try:
        loads = tuple(float(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r}: comma-separated numbers, e.g. 0.5,0.8,0.95") from None
    if not loads or any(not 0 < load <= 2 for load in loads):
        raise click.BadParameter(f"{value!r}: each offered load must be in (0, 2]")
    return loads


def _parse_systems(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    known = _simulator().SYSTEMS
    systems = tuple(
        dict.fromkeys(part.strip().lower() for part in value.split(",") if part.strip())
    )
    unknown = [s for s in systems if s not in known]
    if unknown or not systems:
        raise click.BadParameter(f"{', '.join(unknown) or value!r}: choose from {', '.join(known)}")
    return systems


def _parse_latency(ctx: click.Context, param: click.Parameter, value: str) -> Any:
    try:
        return _simulator().parse_latency_ms(value)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None


@main.command()
@click.option(
    "--nodes",
    default=1000,
    show_default=True,
    type=click.IntRange(1, 1_000_000),
    help="Simulated nodes (32, 48 and 64 VCPUs, 2 GiB per VCPU).",
)
@click.option(
    "--requests",
    default=10_000,
    show_default=True,
    type=click.IntRange(1),
    help="Arrivals per offered load per system (1, 2, 4 or 8 VCPUs each).",
)
@click.option(
    "--loads",
    default="0.5,0.8,0.95",
    show_default=True,
    callback=_parse_loads,
    help="Offered loads: steady-state demand as a fraction of the cluster's VCPUs.",
)
@click.option(
    "--systems",
    default="reservoir,nova,sampling,omniscient",
    show_default=True,
    callback=_parse_systems,
    help="Systems to run on the same workload.",
)
@click.option(
    "--schedulers",
    default=8,
    show_default=True,
    type=click.IntRange(1, 1024),
    help="Nova: scheduler processes, each with its own host-state cache.",
)
@click.option(
    "--refresh-s",
    default=1.0,
    show_default=True,
    type=click.FloatRange(0.001),
    help="Nova: how often each scheduler refreshes its cache from the nodes.",
)
@click.option(
    "--probes",
    default=2,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Sampling: nodes probed per placement attempt (power of d choices).",
)
@click.option(
    "--requestors",
    default=8,
    show_default=True,
    type=click.IntRange(1, 1024),
    help="reservoir: requestors placing concurrently (arrivals go round robin).",
)
@click.option(
    "--latency-ms",
    "latency",
    default="1",
    show_default=True,
    callback=_parse_latency,
    help="One-way latency: MS, fixed:MS, uniform:LO,HI or lognormal:MEDIAN,SIGMA.",
)
@click.option(
    "--loss",
    default=0.0,
    show_default=True,
    type=click.FloatRange(0.0, 0.5),
    help="Probability that a message is lost.",
)
@click.option(
    "--lifetime-s",
    default=3600.0,
    show_default=True,
    type=click.FloatRange(0.001),
    help="Mean instance lifetime (exponential); the offered load sets the arrival rate.",
)
@click.option(
    "--prefill/--no-prefill",
    default=True,
    show_default=True,
    help="Start at the steady state (Poisson-many instances placed by spread) or empty.",
)
@click.option(
    "--seed", default=0, show_default=True, type=int, help="Seed for the nodes and workload."
)
@click.option(
    "--jobs",
    default=None,
    type=click.IntRange(1, 256),
    help="Runs (one per system and load) in parallel worker processes; the results do "
    "not depend on it.  [default: the cores this process may use, or one worker per "
    "reservoir run and one for the baselines when there are more of those and memory "
    "allows]",
)
@click.option(
    "--output",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Write results.md, results.json and PNG plots here (needs the plots extra).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print exactly one JSON object with the results, nothing else on stdout.",
)
def simulate(
    nodes: int,
    requests: int,
    loads: tuple[float, ...],
    systems: tuple[str, ...],
    schedulers: int,
    refresh_s: float,
    probes: int,
    requestors: int,
    latency: Any,
    loss: float,
    lifetime_s: float,
    prefill: bool,
    seed: int,
    jobs: int | None,
    output: Path | None,
    as_json: bool,
) -> None:
    """Simulate NODES nodes in virtual time and compare reservoir with baselines.

    reservoir runs its real node and requestor state machines on a discrete-event engine
    (no broker, no threads; messages are passed as objects, without byte serialisation);
    Nova's cached scheduler, power-of-d sampling and an omniscient scheduler run the
    identical workload: Poisson arrivals at each offered load, exponential lifetimes, the
    same latency and loss. Each reservoir run ends with the invariant audit of every
    node's ledger; a broken invariant exits with status 2.

    A run of 100,000 nodes takes minutes per load; the mypyc build of the machines
    (README, "The compiled build") runs it about 1.3x faster, with the same results. The
    output says which build ran.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    simulator = _simulator()
    from reservoir.bench import stopped_by_sigterm
    from reservoir.simulator.report import print_table, require_matplotlib, write_outputs

    if output is not None:
        try:
            require_matplotlib()
        except ImportError:
            raise click.UsageError(
                "--output draws plots with matplotlib: pip install 'reservoir[plots]'"
            ) from None
    config = simulator.SimulationConfig(
        nodes=nodes,
        requests=requests,
        loads=loads,
        systems=systems,
        schedulers=schedulers,
        requestors=requestors,
        refresh_s=refresh_s,
        probes=probes,
        latency=latency,
        loss=loss,
        seed=seed,
        mean_lifetime_s=lifetime_s,
        prefill=prefill,
    )
    stderr = Console(stderr=True)
    columns = (
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(
        *columns, console=stderr, transient=as_json, disable=not stderr.is_terminal
    ) as bar:
        task = bar.add_task("simulating", total=requests * len(loads) * len(systems))
        try:
            with stopped_by_sigterm():
                result = simulator.simulate(
                    config,
                    progress=lambda label, n: bar.update(task, description=label, advance=n),
                    jobs=jobs if jobs is not None else simulator.default_jobs(config),
                )
        except KeyboardInterrupt:
            bar.stop()
            click.echo("reservoir simulate: interrupted; its worker processes stopped", err=True)
            sys.exit(EXIT_INTERRUPTED)
    if as_json:
        click.echo(json.dumps(result.as_json(), sort_keys=True))
    else:
        print_table(result)
    if output is not None:
        written = write_outputs(result, output)
        if not as_json:
            click.echo(f"wrote {', '.join(str(path) for path in written)}")
    if not result.invariants_hold:
        if not as_json:
            for run in result.runs:
                if run.audit_ok is False:
                    click.echo(
                        f"  {run.system} at load {run.offered_load:g}: audit {run.audit}",
                        err=True,
                    )
        sys.exit(EXIT_USAGE)


# The bench command is defined with its harness, in reservoir/bench.py.
from reservoir.bench import bench  # noqa: E402

main.add_command(bench)

# So is the chaos command, in reservoir/chaos/harness.py.
from reservoir.chaos.harness import chaos  # noqa: E402

main.add_command(chaos)

# So is the serve command, with the service, in reservoir/serve.py.
from reservoir.serve import serve  # noqa: E402

main.add_command(serve)

if __name__ == "__main__":  # pragma: no cover
    main()
