"""``reservoir node``: one node agent, until a signal stops it."""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import click

from reservoir.broker import BrokerError
from reservoir.cli.options import (
    broker_option,
    connect_attempts_option,
    load_settings,
    parse_pairs,
    set_up_tracing,
    shown_url,
)
from reservoir.exit_status import EXIT_BROKER, EXIT_USAGE
from reservoir.protocol.addresses import node_address
from reservoir.protocol.ledger import Inventory
from reservoir.protocol.numa import NumaTopology
from reservoir.protocol.placement import SHORTHAND_CLASSES


def _node_inventories(
    vcpus: int | None,
    memory_mb: int | None,
    disk_gb: int | None,
    inventory: Sequence[str],
    ratio: Sequence[str],
    reserved: Sequence[str],
) -> dict[str, Inventory]:
    shorthands = {"vcpus": vcpus, "memory_mb": memory_mb, "disk_gb": disk_gb}
    totals = {
        SHORTHAND_CLASSES[name]: amount for name, amount in shorthands.items() if amount is not None
    }
    for rc, total in parse_pairs(inventory, "CLASS=TOTAL").items():
        try:
            totals[rc] = int(total)
        except ValueError:
            raise click.BadParameter(f"{rc}={total}: the total must be a whole number") from None
    ratios = parse_pairs(ratio, "CLASS=RATIO")
    reserve = parse_pairs(reserved, "CLASS=AMOUNT")
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


@click.command()
@broker_option()
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
    "--driver",
    "drivers",
    multiple=True,
    metavar="NAME",
    help="A task driver the node offers (exec, docker, or one installed under the "
    "reservoir.task_drivers entry points). Repeatable. Default: RESERVOIR_TASK_DRIVERS, "
    "else none (the node takes no request carrying a task).",
)
@connect_attempts_option()
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
    drivers: tuple[str, ...],
    connect_attempts: int,
) -> None:
    """Run a node agent until SIGTERM or SIGINT.

    A broker that is not up yet (or restarting) is waited for, with a line per failed
    attempt. On a signal it stops taking requests, withdraws its live reservations and
    closes cleanly; allocations stay in --state-dir for the next start.
    """
    from reservoir.observe.logs import say
    from reservoir.runtime.backoff import quietly_connecting, until_connected
    from reservoir.runtime.node_agent import NodeAgent
    from reservoir.runtime.store import StateError
    from reservoir.runtime.tasks import TaskDriverError

    inventories = _node_inventories(vcpus, memory_mb, disk_gb, inventory, ratio, reserved)
    topology = _numa_topology(numa_cells, hugepages, inventories)
    settings = load_settings(
        broker_url=broker_url, state_dir=state_dir, task_drivers=drivers or None
    )
    # before connecting: a port in use is a usage error, said before any waiting
    registry = _serve_metrics(metrics_port) if metrics_port is not None else None
    set_up_tracing("node")
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
    except TaskDriverError as error:
        raise click.BadParameter(str(error), param_hint="--driver") from None
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
        f"node {name}: ready on {shown_url(settings.broker_url)}; "
        f"{len(snapshot.allocations)} allocation(s) held, utilisation "
        f"{snapshot.utilisation:.0%}, tier {snapshot.tier}%{metrics_at}"
        + (f"; task drivers {', '.join(sorted(agent.task_drivers))}" if agent.task_drivers else "")
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
            f"{node_address(name)} is taken); give this one another --name, or stop the "
            "other (one that just died is let go within the heartbeat, 30 s)"
        )
    return f"cannot reach the broker: {error}"


def _say_waiting(name: str) -> Callable[[int, BaseException, float], None]:
    from reservoir.observe.logs import say as say_line

    def say(attempt: int, error: BaseException, wait_s: float) -> None:
        say_line(
            f"node {name}: {_node_broker_problem(name, error)} (attempt {attempt}); "
            f"retrying in {wait_s:.1f} s"
        )

    return say


def _serve_metrics(port: int) -> Any:
    """The registry a node exports (its metrics and the process's), served on ``port``."""
    try:
        from reservoir.observe.exposition import process_registry, serve_metrics
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
        pages = {int(k): int(v) for k, v in parse_pairs(hugepages, "SIZE_KB=COUNT").items()}
        return NumaTopology.uniform(cells, cpus.total, memory.total, pages)
    except ValueError as error:
        raise click.BadParameter(str(error)) from None


# -- request -------------------------------------------------------------------------------
