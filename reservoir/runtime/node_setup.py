"""What a node runs with: its configuration file, what discovery found on its host, the
environment and the command line, merged in one place.

The precedence, lowest first (docs/deploying.md, "A node's configuration file"):

1. what discovery found (``[discovery] enabled``, or ``--discover``): CPUs, memory, disk,
   the memory the host keeps, the CPU's traits, the NUMA topology;
2. the configuration file (``--config``), over what was found: its ``inventory``,
   ``reserved`` and ``allocation_ratio`` per class, its ``traits`` beside the discovered
   ones, its ``name``, ``broker_url``, ``state_dir``, ``node_key``, ``metrics_port``,
   ``status_interval``, ``[numa]`` (when nothing was discovered) and ``[tasks] user``;
3. the environment: ``RESERVOIR_BROKER_URL``, ``RESERVOIR_STATE_DIR`` and
   ``RESERVOIR_NODE_KEY`` over the file (read with the flags that stand for them, which
   rank as they do), ``RESERVOIR_TASK_DRIVERS`` and every other ``RESERVOIR_*`` setting
   through :class:`~reservoir.runtime.settings.Settings` (the file names none of them);
4. the flags, over all of the above (``--traits`` add to the file's and the discovered).

:func:`node_setup` applies it to :class:`NodeFlags` (the command line, its environment
variables read) and returns a :class:`NodeSetup`; :meth:`NodeSetup.settings_fields` is
what :class:`~reservoir.runtime.settings.Settings` is made from, so that the node's
settings follow the same order. A configuration that cannot run is a
:class:`NodeSetupError` saying what is wrong, in the words ``reservoir node`` prints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from reservoir.protocol.ledger import Inventory
from reservoir.protocol.numa import NumaTopology, PciDevice
from reservoir.protocol.placement import SHORTHAND_CLASSES
from reservoir.runtime.host import Host
from reservoir.runtime.node_config import (
    NodeFile,
    devices_of,
    host_inventories,
    host_topology,
    inventories_of,
)
from reservoir.runtime.tasks import TaskConfig

__all__ = ["NodeFlags", "NodeSetup", "NodeSetupError", "node_setup", "pairs_of"]

#: the default of ``--status-interval`` when neither it nor the file gives one (seconds)
DEFAULT_STATUS_INTERVAL_S = 1.0


class NodeSetupError(ValueError):
    """A node configuration that cannot run. ``kind`` says what the command makes of it:
    ``usage`` (the command line as a whole is wrong), ``value`` (one option's value is)
    or ``no_broker`` (nothing names a broker: the command's own line for that)."""

    def __init__(self, problem: str, kind: Literal["usage", "value", "no_broker"]) -> None:
        super().__init__(problem)
        self.kind = kind


@dataclass(frozen=True)
class NodeFlags:
    """What ``reservoir node``'s command line says: None (or empty) where a flag was not
    given. ``broker_url``, ``state_dir`` and ``node_key`` hold the environment variable
    that stands for the flag when the flag is absent."""

    config_path: Path | None = None
    discovering: bool | None = None
    discovery_root: Path | None = None
    name: str | None = None
    broker_url: str | None = None
    vcpus: int | None = None
    memory_mb: int | None = None
    disk_gb: int | None = None
    #: ``CLASS=TOTAL`` each
    inventory: tuple[str, ...] = ()
    #: ``CLASS=RATIO`` each
    ratio: tuple[str, ...] = ()
    #: ``CLASS=AMOUNT`` each
    reserved: tuple[str, ...] = ()
    traits: tuple[str, ...] = ()
    state_dir: Path | None = None
    node_key: Path | None = None
    numa_cells: int | None = None
    #: ``SIZE_KB=COUNT`` each
    hugepages: tuple[str, ...] = ()
    metrics_port: int | None = None
    status_interval: float | None = None
    drivers: tuple[str, ...] = ()
    task_user: str | None = None

    def discovers(self, file: NodeFile) -> bool:
        """Whether to read the host: ``--discover``/``--no-discover``, else the file's."""
        return file.discovery.enabled if self.discovering is None else self.discovering


@dataclass(frozen=True)
class NodeSetup:
    """The configuration a node runs with, every layer applied."""

    name: str
    broker_url: str
    inventories: dict[str, Inventory]
    #: as written (the file's, the discovered, the flags'), upper-cased where used
    traits: tuple[str, ...]
    topology: NumaTopology | None
    state_dir: Path | None
    node_key: Path | None
    metrics_port: int | None
    status_interval: float
    drivers: tuple[str, ...]
    task_user: str | None
    file: NodeFile

    def settings_fields(self) -> dict[str, Any]:
        """The :class:`~reservoir.runtime.settings.Settings` fields the node's layers
        decide (None: not decided here, so the settings' own environment variable and
        default stand: ``RESERVOIR_TASK_DRIVERS`` without ``--driver``)."""
        return {
            "broker_url": self.broker_url,
            "state_dir": self.state_dir,
            "node_key": self.node_key,
            "task_drivers": self.drivers or None,
        }

    def task_config(self) -> TaskConfig:
        """How the node runs tasks: the file's ``[tasks]``, ``--task-user`` over its
        ``user``; raises :class:`~reservoir.runtime.tasks.TaskConfigError`."""
        return self.file.tasks.task_config(user=self.task_user)


def pairs_of(values: Sequence[str], what: str, *, upper: bool = True) -> dict[str, str]:
    """``KEY=VALUE`` strings as a mapping (the last of a key standing), keys upper-cased
    unless ``upper`` is false; raises ValueError naming a malformed one and ``what`` was
    expected, in the words of ``reservoir.cli.options.parse_pairs`` (the commands' own,
    which the layers here cannot import)."""
    pairs = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key or not rest:
            raise ValueError(f"{value!r}: expected {what}")
        key = key.strip()
        pairs[key.upper() if upper else key] = rest.strip()
    return pairs


def node_setup(
    flags: NodeFlags,
    file: NodeFile,
    host: Host | None,
    *,
    on_warning: Callable[[str, str], None] = lambda name, line: None,
) -> NodeSetup:
    """``flags`` over the environment over ``file`` over what was discovered on ``host``
    (None: nothing was). ``on_warning`` hears (the node's name, a line) what the node
    runs without (the CPU's traits, when the ``host`` extra is missing). Raises
    :class:`NodeSetupError`, the problems checked in the order the command has always
    said them."""
    name = flags.name or file.name
    if not name:
        raise NodeSetupError("a node needs a name: --name, or name in the --config file", "usage")
    broker_url = flags.broker_url or file.broker_url
    if not broker_url:
        raise NodeSetupError("no broker", "no_broker")
    found_totals, found_reserved, found_traits = _discovered(host, file, name, on_warning)
    shorthands = {"vcpus": flags.vcpus, "memory_mb": flags.memory_mb, "disk_gb": flags.disk_gb}
    # Each layer written as the flags are, and read as they are (keys upper-cased): a
    # later one overrides an earlier one class by class.
    inventories = _inventories(
        totals=(
            *(f"{rc}={n}" for rc, n in found_totals.items()),
            *(f"{rc}={n}" for rc, n in file.inventory.items()),
            *(f"{SHORTHAND_CLASSES[k]}={v}" for k, v in shorthands.items() if v is not None),
            *flags.inventory,
        ),
        ratios=(*(f"{rc}={r}" for rc, r in file.allocation_ratio.items()), *flags.ratio),
        reserved=(
            *(f"{rc}={n}" for rc, n in found_reserved.items()),
            *(f"{rc}={n}" for rc, n in file.reserved.items()),
            *flags.reserved,
        ),
    )
    return NodeSetup(
        name=name,
        broker_url=broker_url,
        inventories=inventories,
        traits=(*file.traits, *sorted(found_traits), *flags.traits),
        topology=_topology(file, host, flags.numa_cells, flags.hugepages, inventories),
        state_dir=flags.state_dir or (Path(file.state_dir) if file.state_dir else None),
        node_key=flags.node_key or (Path(file.node_key) if file.node_key else None),
        metrics_port=flags.metrics_port or file.metrics_port,
        status_interval=(
            flags.status_interval or file.status_interval or DEFAULT_STATUS_INTERVAL_S
        ),
        drivers=flags.drivers,
        task_user=flags.task_user,
        file=file,
    )


def _discovered(
    host: Host | None, file: NodeFile, name: str, on_warning: Callable[[str, str], None]
) -> tuple[dict[str, int], dict[str, int], frozenset[str]]:
    if host is None:
        return {}, {}, frozenset()
    found = host_inventories(host, file)
    if found.traits_unread is not None:
        on_warning(
            name,
            f"node {name}: warning: discovered without the CPU's traits: {found.traits_unread}",
        )
    return found.totals, found.reserved, found.traits


def _pairs(values: Sequence[str], what: str) -> dict[str, str]:
    try:
        return pairs_of(values, what)
    except ValueError as error:
        raise NodeSetupError(str(error), "value") from None


def _inventories(
    *, totals: Sequence[str], ratios: Sequence[str], reserved: Sequence[str]
) -> dict[str, Inventory]:
    amounts: dict[str, int] = {}
    for rc, total in _pairs(totals, "CLASS=TOTAL").items():
        try:
            amounts[rc] = int(total)
        except ValueError:
            raise NodeSetupError(
                f"{rc}={total}: the total must be a whole number", "value"
            ) from None
    by_ratio = _pairs(ratios, "CLASS=RATIO")
    by_reserve = _pairs(reserved, "CLASS=AMOUNT")
    for rc in (*by_ratio, *by_reserve):
        if rc not in amounts:
            raise NodeSetupError(f"{rc} has no inventory: give its total first", "value")
    if not amounts:
        raise NodeSetupError(
            "a node needs an inventory: --vcpus, --memory-mb, --disk-gb or --inventory CLASS=TOTAL",
            "usage",
        )
    try:
        return inventories_of(
            amounts,
            {rc: float(r) for rc, r in by_ratio.items()},
            {rc: int(n) for rc, n in by_reserve.items()},
        )
    except ValueError as error:
        raise NodeSetupError(str(error), "value") from None


def _topology(
    file: NodeFile,
    host: Host | None,
    numa_cells: int | None,
    hugepages: Sequence[str],
    inventories: Mapping[str, Inventory],
) -> NumaTopology | None:
    """The discovered topology, or equal cells (--numa-cells, else the file's), with the
    file's PCI devices."""
    if host is not None and numa_cells is None and not hugepages:
        try:
            return host_topology(host, file, devices_of(file, host))
        except ValueError as error:
            raise NodeSetupError(f"--discover: {error}", "usage") from None
    cells = numa_cells or file.numa.cells
    pages = (*(f"{size}={n}" for size, n in file.numa.hugepages.items()), *hugepages)
    devices = devices_of(file, None)
    if devices and cells is None:
        raise NodeSetupError(
            "PCI devices sit on NUMA cells: set [numa] cells in the file, or --numa-cells",
            "usage",
        )
    return _equal_cells(cells, pages, inventories, devices)


def _equal_cells(
    cells: int | None,
    hugepages: Sequence[str],
    inventories: Mapping[str, Inventory],
    devices: Sequence[PciDevice] = (),
) -> NumaTopology | None:
    if cells is None:
        if hugepages:
            raise NodeSetupError("--hugepages describes NUMA cells: give --numa-cells too", "usage")
        return None
    cpus = inventories.get("PCPU") or inventories.get("VCPU")
    memory = inventories.get("MEMORY_MB")
    if cpus is None or memory is None:
        raise NodeSetupError("--numa-cells needs CPUs (--vcpus or PCPU) and --memory-mb", "usage")
    try:
        pages = {int(k): int(v) for k, v in pairs_of(hugepages, "SIZE_KB=COUNT").items()}
        uniform = NumaTopology.uniform(cells, cpus.total, memory.total, pages)
        return NumaTopology(uniform.cells, devices=tuple(devices))
    except ValueError as error:
        raise NodeSetupError(str(error), "value") from None
