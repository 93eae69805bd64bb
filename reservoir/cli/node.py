"""``reservoir node``: one node agent, until a signal stops it."""

from __future__ import annotations

import fnmatch
import json
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from reservoir.broker import BrokerError
from reservoir.cli.options import (
    NO_BROKER,
    broker_option,
    broker_problem,
    connect_attempts_option,
    load_settings,
    set_up_tracing,
    shown_url,
    usage_error,
)
from reservoir.exit_status import EXIT_BROKER, EXIT_USAGE
from reservoir.interrupt import stop_on_signals, stopped
from reservoir.protocol.addresses import node_address
from reservoir.version import __version__, install_hint

if TYPE_CHECKING:
    from reservoir.runtime.host import Host
    from reservoir.runtime.node_config import NodeFile
    from reservoir.runtime.node_setup import NodeFlags, NodeSetup


@click.command()
@broker_option(checked_by_the_command=True)
@click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="A node configuration file (TOML): inventory, ratios, NUMA, PCI devices and "
    "aliases, discovery, state dir, metrics port. Flags override it.",
)
@click.option(
    "--discover/--no-discover",
    "discovering",
    default=None,
    help="Read the host's CPUs, NUMA cells, memory, huge pages, PCI devices and CPU "
    "traits from /sys and /proc (default: the file's [discovery] enabled).",
)
@click.option(
    "--root",
    "discovery_root",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Discover under this root instead of / (or the file's [discovery] root).",
)
@click.option(
    "--print",
    "print_only",
    is_flag=True,
    help="With --discover: show what was found (a table, or --json) and exit.",
)
@click.option("--json", "as_json", is_flag=True, help="With --print: JSON.")
@click.option("--name", default=None, help="The node's name; its inbox is reservoir.node.NAME.")
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
    "--node-key",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    envvar="RESERVOIR_NODE_KEY",
    help="Sign with this node's own key (a file `reservoir keys add-node` wrote); "
    "requestors then believe only this node's key for its messages.",
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
    default=None,
    help="With --state-dir, rewrite NAME.status.json this often (seconds; default 1).",
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
@click.option(
    "--task-user",
    metavar="USER",
    help="The user exec tasks run as (overrides tasks.user of --config). Default: nobody "
    "when the agent runs as root (root itself only with tasks.allow_root = true), else "
    "the agent's own user.",
)
@connect_attempts_option()
def node(print_only: bool, as_json: bool, connect_attempts: int, **given: Any) -> None:
    """Run a node agent until SIGTERM, SIGINT or SIGHUP (all three alike).

    A broker that is not up yet (or restarting) is waited for, with a line per failed
    attempt. On a signal it stops taking requests, withdraws its live reservations and
    closes cleanly, says "stopped" and exits with status 130; allocations stay in
    --state-dir for the next start. SIGHUP stops it too (it does not reload anything).
    """
    from reservoir.observe.logs import say
    from reservoir.runtime.backoff import quietly_connecting, until_connected
    from reservoir.runtime.keys import KeyConfigError
    from reservoir.runtime.node_agent import NodeAgent
    from reservoir.runtime.node_config import NodeFile
    from reservoir.runtime.node_setup import NodeFlags
    from reservoir.runtime.store import StateError
    from reservoir.runtime.tasks import TaskConfigError, TaskDriverError

    flags = NodeFlags(**given)
    config_path = flags.config_path
    file = _node_file(config_path) if config_path is not None else NodeFile()
    host = _discover(file, flags.discovery_root) if flags.discovers(file) else None
    if print_only:
        if host is None:
            raise click.UsageError("--print shows what discovery finds: give --discover")
        _print_host(host, file, as_json)
        return
    setup = _node_setup(flags, file, host)
    name, state_dir, metrics_port = setup.name, setup.state_dir, setup.metrics_port
    settings = load_settings(**setup.settings_fields())
    # before connecting: a port in use is a usage error, said before any waiting
    registry = _serve_metrics(metrics_port) if metrics_port is not None else None
    set_up_tracing("node")
    stop = threading.Event()
    stop_on_signals(stop, hangup=True)

    running = _running_configuration(config_path, setup, host)
    try:
        task_config = setup.task_config()
    except TaskConfigError as error:
        usage_error(f"{config_path or 'the node'}: {error}")

    def start_agent() -> NodeAgent:
        # the adapters' own line per attempt would repeat ours (one per attempt, below)
        with quietly_connecting():
            return NodeAgent(
                settings.broker_url,
                name=name,
                inventories=setup.inventories,
                traits=[t.upper() for t in setup.traits],
                numa=setup.topology,
                configuration=json.loads(running),
                settings=settings,
                metrics_registry=registry,
                task_config=task_config,
            )

    try:
        agent = until_connected(start_agent, connect_attempts, stop, on_wait=_say_waiting(name))
    except (StateError, KeyConfigError, TaskConfigError) as error:
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
        say(f"node {name}: stopped before the broker answered", node=name, outcome="stopped")
        stopped()
    say(f"node {name}: configuration {running}", node=name)
    for line in _task_lines(agent):
        say(f"node {name}: {line}", node=name)
    snapshot = agent.snapshot()
    metrics_at = f"; metrics on port {metrics_port}" if metrics_port is not None else ""
    say(
        f"node {name}: ready on {shown_url(settings.broker_url)}; "
        f"release {__version__}, writing for {settings.compatible_with}; "
        f"{len(snapshot.allocations)} allocation(s) held, utilisation "
        f"{snapshot.utilisation:.0%}, tier {snapshot.tier}%{metrics_at}"
        + (f"; task drivers {', '.join(sorted(agent.task_drivers))}" if agent.task_drivers else ""),
        node=name,
        outcome="ready",
        allocations=len(snapshot.allocations),
        utilisation=round(snapshot.utilisation, 4),
        tier=snapshot.tier,
    )
    if snapshot.violations:
        say(
            f"node {name}: warning: it holds more than its inventory "
            f"({'; '.join(snapshot.violations)}); it takes no new request until frees "
            "bring it within",
            node=name,
            outcome="overcommitted",
        )
    status_path = state_dir / f"{name}.status.json" if state_dir else None
    try:
        while True:
            if status_path is not None:
                agent.write_status(status_path)
            if stop.wait(setup.status_interval):
                break
    finally:
        agent.close()
        if status_path is not None:
            agent.write_status(status_path)
        say(f"node {name}: stopped", node=name, outcome="stopped")
    stopped()  # only a signal ends the loop above


def _node_broker_problem(name: str, error: BaseException) -> str:
    """What keeps a node off the broker, in words an operator can act on."""
    if "RESOURCE_LOCKED" in str(error):
        # Its inbox is an exclusive queue named after it: another connection holds it.
        return (
            f"a node named {name} is already connected to this broker (its inbox "
            f"{node_address(name)} is taken); give this one another --name, or stop the "
            "other (one that just died is let go within the heartbeat, 30 s)"
        )
    return broker_problem(error)


def _say_waiting(name: str) -> Callable[[int, BaseException, float], None]:
    from reservoir.observe.logs import say as say_line

    def say(attempt: int, error: BaseException, wait_s: float) -> None:
        say_line(
            f"node {name}: {_node_broker_problem(name, error)}; "
            f"retrying in {wait_s:.1f} s (attempt {attempt})",
            node=name,
            outcome="retrying",
            attempt=attempt,
            retry_in_s=round(wait_s, 1),
        )

    return say


def _serve_metrics(port: int) -> Any:
    """The registry a node exports (its metrics and the process's), served on ``port``."""
    try:
        from reservoir.observe.exposition import process_registry, serve_metrics
    except ImportError:
        raise click.UsageError(
            f"--metrics-port needs prometheus-client: {install_hint('prometheus')}"
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


def _node_file(path: Path) -> Any:
    from reservoir.runtime.node_config import ConfigError, load_node_file

    try:
        return load_node_file(path)
    except ConfigError as error:
        click.echo(f"reservoir node: --config {error}", err=True)
        sys.exit(EXIT_USAGE)


def _discover(file: Any, root: Path | None) -> Any:
    from reservoir.runtime.node_config import discover_for

    try:
        return discover_for(file, str(root) if root is not None else None)
    except ValueError as error:
        raise click.UsageError(f"--discover: {error}") from None
    except OSError as error:
        raise click.UsageError(f"--discover: cannot read the host: {error}") from None


def _node_setup(flags: NodeFlags, file: NodeFile, host: Host | None) -> NodeSetup:
    """The configuration the node runs with (reservoir/runtime/node_setup.py says which
    layer wins), or the line the command says when it cannot run."""
    from reservoir.observe.logs import say
    from reservoir.runtime.node_setup import NodeSetupError, node_setup

    def warn(name: str, line: str) -> None:
        say(line, node=name, outcome="warning")

    try:
        return node_setup(flags, file, host, on_warning=warn)
    except NodeSetupError as error:
        if error.kind == "no_broker":
            usage_error(NO_BROKER)  # (the file may name it too: see --config)
        if error.kind == "value":
            raise click.BadParameter(str(error)) from None
        raise click.UsageError(str(error)) from None


def _print_host(host: Any, file: Any, as_json: bool) -> None:
    """What discovery found, and which devices the configuration hands out."""
    import json

    from reservoir.runtime.node_config import devices_of, host_inventories

    handed_out = {d.address: d.alias for d in devices_of(file, host)}
    excluded = sorted(
        d.address
        for d in host.pci
        if any(fnmatch.fnmatchcase(d.address, x) for x in file.discovery.excluded_devices)
    )
    found = host_inventories(host, file)
    if as_json:
        shown = host.as_json()
        shown["inventory"] = found.totals
        shown["reserved"] = found.reserved
        shown["traits"] = sorted(found.traits)
        shown["traits_unread"] = found.traits_unread
        shown["devices"] = handed_out
        shown["excluded_devices"] = excluded
        click.echo(json.dumps(shown, indent=2, sort_keys=True))
        return
    click.echo(f"host under {host.root}")
    click.echo("cell  socket  cpus                 memory MB  huge pages")
    for cell in host.cells:
        pages = ", ".join(f"{n} x {size} KiB" for size, n in sorted(cell.hugepages.items()))
        cpus = _cpu_ranges(cell.cpus)
        socket = "-" if cell.socket is None else str(cell.socket)
        click.echo(f"{cell.cell_id:<5} {socket:<7} {cpus:<20} {cell.memory_mb:>9}  {pages or '-'}")
    shared = sorted({s for s in host.siblings.values() if len(s) > 1})
    click.echo(f"thread siblings: {', '.join(_cpu_ranges(s) for s in shared) or 'none'}")
    if host.disk_gb is not None:
        click.echo(f"disk: {host.disk_gb} GB")
    amounts = [
        f"{rc}={n}" + (f" (host-reserved {found.reserved[rc]})" if found.reserved.get(rc) else "")
        for rc, n in sorted(found.totals.items())
    ]
    click.echo(f"inventory: {', '.join(amounts)}")
    unread = f" ({found.traits_unread})" if found.traits_unread else ""
    click.echo(f"traits: {' '.join(sorted(found.traits)) or 'none'}{unread}")
    click.echo("pci address    vendor:product  class   cell  kind      alias")
    for device in host.pci:
        cell = "-" if device.cell is None else str(device.cell)
        kind = device.kind
        if device.virtual_functions:
            kind += f" ({len(device.virtual_functions)} VFs)"
        click.echo(
            f"{device.address:<14} {device.vendor_id}:{device.product_id:<10} "
            f"{device.class_id[:6]:<7} {cell:<5} {kind:<9} "
            + ("excluded" if device.address in excluded else handed_out.get(device.address, "-"))
        )


def _cpu_ranges(cpus: Sequence[int]) -> str:
    """CPU numbers in the kernel's list format (0-3,8)."""
    parts: list[str] = []
    for cpu in sorted(cpus):
        if parts and "-" not in parts[-1].split(",")[-1] and int(parts[-1]) == cpu - 1:
            parts[-1] = f"{parts[-1]}-{cpu}"
        elif parts and "-" in parts[-1] and int(parts[-1].split("-")[1]) == cpu - 1:
            parts[-1] = f"{parts[-1].split('-')[0]}-{cpu}"
        else:
            parts.append(str(cpu))
    return ",".join(parts)


def _task_lines(agent: Any) -> list[str]:
    """How the node runs tasks, for its log: whom as, and under which limits."""
    from reservoir.runtime.exec_driver import ExecDriver

    lines = []
    for driver in agent.task_drivers.values():
        if isinstance(driver, ExecDriver):
            user = driver.user
            who = (
                f"{user.name} (uid {user.uid})"
                if user.uid is not None
                else (f"{user.name}, the agent's own user")
            )
            lines.append(f"exec tasks run as {who}; limits: {driver.cgroups.describe()}")
    return lines


def _running_configuration(config_path: Path | None, setup: NodeSetup, host: Any) -> str:
    """The configuration the node runs with, as one line of JSON for its log."""
    import json

    shown: dict[str, Any] = {
        "config_file": str(config_path) if config_path else None,
        "discovered_under": host.root if host is not None else None,
        "inventory": {
            rc: {"total": i.total, "reserved": i.reserved, "allocation_ratio": i.allocation_ratio}
            for rc, i in sorted(setup.inventories.items())
        },
        "traits": sorted({t.upper() for t in setup.traits}),
        "state_dir": str(setup.state_dir) if setup.state_dir else None,
        "metrics_port": setup.metrics_port,
    }
    topology = setup.topology
    if topology is not None:
        shown["numa_cells"] = [
            {"cell": c.cell_id, "cpus": _cpu_ranges(sorted(c.cpus)), "memory_mb": c.memory_mb}
            for c in topology.cells
        ]
        shown["pci_devices"] = [
            {"address": d.address, "alias": d.alias, "cell": d.cell} for d in topology.devices
        ]
    return json.dumps(shown, sort_keys=True)


# -- request -------------------------------------------------------------------------------
