"""A node's configuration file (TOML, ``reservoir node --config node.toml``).

Everything ``reservoir node``'s flags hold, and the node's PCI devices::

    name = "compute-7"
    broker_url = "amqp://node:secret@rabbit:5672/"
    state_dir = "/var/lib/reservoir"
    metrics_port = 9100
    traits = ["CUSTOM_RACK_A"]

    [inventory]            # resource class -> total (with discovery: overrides it)
    VCPU = 32
    MEMORY_MB = 131072
    [allocation_ratio]
    VCPU = 4.0
    [reserved]
    MEMORY_MB = 4096

    [numa]                 # equal cells, when not discovered
    cells = 2
    hugepages = { 2048 = 1024 }

    [discovery]            # read the host instead (reservoir.runtime.host)
    enabled = true
    root = "/"
    disk_path = "/var/lib/nova"
    reserved_cpus = [0, 1]
    excluded_devices = ["0000:00:1f.6"]

    [[pci.alias]]          # like Nova's [pci] alias: a name for a kind of device
    name = "gpu-a100"
    vendor_id = "10de"
    product_id = "20b0"

    [[pci.device_spec]]    # like Nova's [pci] device_spec: which devices are handed out
    vendor_id = "10de"     # (address may be a glob; alias names the alias directly;
    product_id = "20b0"    #  numa_cell places a device written by hand, without discovery)

    [tasks]                # how the node runs tasks (docs/design.md, "Tasks")
    user = "nobody"        # exec tasks run as this user (the default for an agent run as
                           # root; root itself only with allow_root = true)
    commands = ["sh", "python3", "/opt/jobs/*"]   # what tasks may run, by glob (default:
    images = ["alpine:*", "registry.example.com/*"]  # anything); env: the variables a
    env = ["LANG", "APP_*"]                          # request may set
    [tasks.output]         # each stream of a task's output: max_files of max_file_kb,
    max_file_kb = 8192     # kept retention_h hours after the task ended (its state too)
    max_files = 2
    retention_h = 24
    [tasks.docker]
    privileged = false     # never privileged, no host path mounted, unless said here
    volumes = []           # "/host/path:/in/container[:ro]", mounted into every container

A device is handed out when a ``device_spec`` matches it (address, vendor, product) and it
has an alias (the spec's, else the first ``alias`` entry matching its vendor and
product). Without discovery a ``device_spec`` with an exact address *is* the device.

A typo is one line naming the file, its line and the key (:class:`ConfigError`).
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from reservoir.protocol.ledger import Inventory
from reservoir.protocol.numa import NumaCell, NumaTopology, PciDevice
from reservoir.protocol.task_policy import TaskPolicy
from reservoir.runtime.host import Host, HostPci, cpu_traits, discover
from reservoir.runtime.tasks import TaskConfig

__all__ = [
    "ConfigError",
    "DeviceSpec",
    "DiscoveryConfig",
    "NodeFile",
    "PciAliasConfig",
    "TasksConfig",
    "devices_of",
    "host_inventories",
    "host_topology",
    "load_node_file",
]


class _Section(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    pass


_HEX_ID = r"^(?:[0-9A-Fa-f]{4})?\Z"
_ALIAS = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}\Z"
#: a PCI vendor or product id as the kernel shows it (``10de``): 4 hex digits, or none
#: (any); a longer or shorter one would match no device, silently
HexId = Annotated[str, Meta(pattern=_HEX_ID)]
#: what msgspec's "Expected `str` matching regex ..." means, in words
_PATTERN_WORDS = {
    _HEX_ID: "expected 4 hex digits, as lspci -n shows them (e.g. 10de)",
    _ALIAS: "expected 1 to 64 letters, digits and ._- (not starting with . _ or -)",
}


class PciAliasConfig(_Section):
    name: Annotated[str, Meta(pattern=_ALIAS)]
    vendor_id: HexId = ""
    product_id: HexId = ""


class DeviceSpec(_Section):
    #: a PCI address or a glob of them (``0000:3b:*``)
    address: str = "*"
    vendor_id: HexId = ""
    product_id: HexId = ""
    #: the alias the matched devices go by (else an alias entry matching them)
    alias: str = ""
    #: a device written by hand (no discovery): its NUMA cell
    numa_cell: int | None = None

    def matches(self, device: HostPci) -> bool:
        return (
            fnmatch.fnmatchcase(device.address, self.address)
            and self.vendor_id.lower() in ("", device.vendor_id)
            and self.product_id.lower() in ("", device.product_id)
        )


class PciConfig(_Section):
    device_spec: list[DeviceSpec] = []
    alias: list[PciAliasConfig] = []


class NumaConfig(_Section):
    cells: Annotated[int, Meta(ge=1, le=64)] | None = None
    #: page size in KiB -> pages per cell
    hugepages: dict[str, Annotated[int, Meta(ge=0)]] = {}


class DiscoveryConfig(_Section):
    enabled: bool = False
    root: str = "/"
    #: DISK_GB is the size of the file system holding this path
    disk_path: str | None = None
    #: CPUs kept for the host: never counted, never pinned
    reserved_cpus: list[Annotated[int, Meta(ge=0)]] = []
    #: memory kept for the host (MEMORY_MB's reserved)
    reserved_memory_mb: Annotated[int, Meta(ge=0)] = 0
    #: PCI addresses (or globs) never handed out
    excluded_devices: list[str] = []


class TaskOutputConfig(_Section):
    max_file_kb: Annotated[int, Meta(ge=1, le=1024 * 1024)] = 8192
    max_files: Annotated[int, Meta(ge=1, le=100)] = 2
    retention_h: Annotated[float, Meta(ge=0)] = 24.0


class DockerConfig(_Section):
    privileged: bool = False
    volumes: list[str] = []


class TasksConfig(_Section):
    #: who exec tasks run as (a name or a uid); default nobody (for a root agent)
    user: str | None = None
    allow_root: bool = False
    #: globs of what tasks may run; absent: anything
    commands: list[str] | None = None
    images: list[str] | None = None
    env: list[str] | None = None
    output: TaskOutputConfig = msgspec.field(default_factory=TaskOutputConfig)
    docker: DockerConfig = msgspec.field(default_factory=DockerConfig)

    def task_config(self, *, user: str | None = None) -> TaskConfig:
        """The node's task configuration (``user`` overrides the file's)."""
        return TaskConfig(
            user=user or self.user,
            allow_root=self.allow_root,
            policy=TaskPolicy(
                commands=tuple(self.commands) if self.commands is not None else None,
                images=tuple(self.images) if self.images is not None else None,
                env=tuple(self.env) if self.env is not None else None,
            ),
            output_file_bytes=self.output.max_file_kb * 1024,
            output_files=self.output.max_files,
            retention_s=self.output.retention_h * 3600,
            docker_privileged=self.docker.privileged,
            docker_volumes=tuple(self.docker.volumes),
        )


class NodeFile(_Section):
    name: str | None = None
    #: where the broker is (``--broker`` and ``RESERVOIR_BROKER_URL`` override it)
    broker_url: str | None = None
    state_dir: str | None = None
    #: the node's own signing key (``--node-key`` and ``RESERVOIR_NODE_KEY`` override it)
    node_key: str | None = None
    metrics_port: Annotated[int, Meta(ge=1, le=65535)] | None = None
    status_interval: Annotated[float, Meta(ge=0.1)] | None = None
    traits: list[str] = []
    inventory: dict[str, Annotated[int, Meta(ge=0)]] = {}
    allocation_ratio: dict[str, Annotated[float, Meta(gt=0)]] = {}
    reserved: dict[str, Annotated[int, Meta(ge=0)]] = {}
    numa: NumaConfig = msgspec.field(default_factory=NumaConfig)
    discovery: DiscoveryConfig = msgspec.field(default_factory=DiscoveryConfig)
    pci: PciConfig = msgspec.field(default_factory=PciConfig)
    tasks: TasksConfig = msgspec.field(default_factory=TasksConfig)


class ConfigError(ValueError):
    """A configuration file that cannot be used, said in one line."""


def load_node_file(path: Path) -> NodeFile:
    """The file at ``path``, checked; raises :class:`ConfigError` naming the file, the line
    and the key at fault."""
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read: {error.strerror or error}") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: not TOML: {error}") from None
    try:
        return msgspec.convert(raw, NodeFile)
    except msgspec.ValidationError as error:
        message = str(error)
        problem, _, where = message.partition(" - at `")
        for pattern, words in _PATTERN_WORDS.items():
            problem = problem.replace(f"Expected `str` matching regex {pattern!r}", words)
        steps = re.findall(r"\.(\w+)|\[(\d+)\]", where.rstrip("`"))
        unknown = re.search(r"unknown field `([^`]+)`", problem)
        keys = [name for name, _ in steps if name]
        if where.rstrip("`").endswith("[...]"):  # a table's value: find which key holds it
            keys.append(_bad_entry(raw, steps))
        key = unknown.group(1) if unknown else (keys[-1] if keys else "")
        dotted = ".".join([*keys, key] if unknown else keys) or key
        line = _line_of(text, steps, key)
        at = f", line {line}" if line else ""
        raise ConfigError(f"{path}{at}: {dotted}: {problem}") from None


def _bad_entry(raw: dict[str, Any], steps: list[tuple[str, str]]) -> str:
    """The key of the table at ``steps`` whose value the schema refuses (each tried
    alone, the rest of the file as it is)."""
    table: Any = raw
    for name, index in steps:
        table = table[name] if name else table[int(index)]
    for entry in list(table):
        kept = dict(table)
        table.clear()
        table[entry] = kept[entry]
        try:
            msgspec.convert(raw, NodeFile)
        except msgspec.ValidationError:
            return str(entry)
        finally:
            table.clear()
            table.update(kept)
    return ""


def _line_of(text: str, steps: list[tuple[str, str]], key: str) -> int | None:
    """The line where ``key`` is set, looked for after the header of its table (and the
    n-th ``[[array]]`` header for an index)."""
    lines = text.splitlines()
    start = 0
    tables = [name for name, _ in steps if name]
    if tables and tables[-1] == key:
        tables = tables[:-1]
    index = next((int(i) for _, i in reversed(steps) if i), 0)
    if tables:
        header = re.compile(r"^\s*\[\[?\s*" + re.escape(".".join(tables)) + r"\s*\]\]?")
        seen = -1
        for number, line in enumerate(lines):
            if header.match(line):
                seen += 1
                start = number
                if seen == index:
                    break
    setting = re.compile(r"^\s*\"?" + re.escape(key) + r"\"?\s*=")
    for number in range(start, len(lines)):
        if setting.match(lines[number]):
            return number + 1
    return start + 1 if tables else None


def devices_of(config: NodeFile, host: Host | None) -> tuple[PciDevice, ...]:
    """The devices the node hands out: with ``host``, the discovered ones the specs match;
    without, the specs that name an exact address."""
    aliases = config.pci.alias
    excluded = config.discovery.excluded_devices

    def alias_for(spec: DeviceSpec, vendor: str, product: str) -> str:
        if spec.alias:
            return spec.alias
        for alias in aliases:
            if alias.vendor_id.lower() in ("", vendor) and alias.product_id.lower() in (
                "",
                product,
            ):
                return alias.name
        return ""

    devices: list[PciDevice] = []
    if host is None:
        for spec in config.pci.device_spec:
            if any(ch in spec.address for ch in "*?["):
                continue  # a glob needs discovery to match against
            name = alias_for(spec, spec.vendor_id.lower(), spec.product_id.lower())
            if name and not any(fnmatch.fnmatchcase(spec.address, x) for x in excluded):
                devices.append(
                    PciDevice(spec.address, name, spec.numa_cell, spec.vendor_id, spec.product_id)
                )
        return tuple(devices)
    for device in host.pci:
        if any(fnmatch.fnmatchcase(device.address, x) for x in excluded):
            continue
        for spec in config.pci.device_spec:
            if spec.matches(device):
                name = alias_for(spec, device.vendor_id, device.product_id)
                if name:
                    devices.append(
                        PciDevice(
                            device.address,
                            name,
                            device.cell,
                            device.vendor_id,
                            device.product_id,
                        )
                    )
                break
    return tuple(devices)


def host_topology(host: Host, config: NodeFile, devices: tuple[PciDevice, ...]) -> NumaTopology:
    """The node's NUMA topology from what was discovered, the host's CPUs left out."""
    reserved = set(config.discovery.reserved_cpus)
    known_cells = {c.cell_id for c in host.cells}
    return NumaTopology(
        tuple(
            NumaCell(
                cell_id=cell.cell_id,
                cpus=frozenset(cell.cpus) - reserved,
                memory_mb=cell.memory_mb,
                hugepages=dict(cell.hugepages),
                socket=cell.socket,
            )
            for cell in host.cells
        ),
        # a device on a cell the tree does not list (a firmware quirk) floats
        devices=tuple(
            d
            if d.cell is None or d.cell in known_cells
            else PciDevice(d.address, d.alias, None, d.vendor_id, d.product_id)
            for d in devices
        ),
    )


@dataclass(frozen=True)
class HostInventory:
    """Totals and reserved amounts discovery gives, before the file's and flags' own."""

    totals: dict[str, int]
    reserved: dict[str, int] = field(default_factory=dict)
    traits: frozenset[str] = frozenset()
    #: why the CPU's traits were not read (the ``host`` extra is missing), or None
    traits_unread: str | None = None


def host_inventories(host: Host, config: NodeFile) -> HostInventory:
    """VCPU and PCPU (the online CPUs the host does not keep; both classes draw on the
    same CPUs: pinned instances take PCPU and specific CPUs, floating ones VCPU),
    MEMORY_MB (the host's reserve set aside), DISK_GB (with a disk path), and the CPU's
    traits."""
    cpus = [c for c in host.cpus if c not in set(config.discovery.reserved_cpus)]
    totals = {"VCPU": len(cpus), "PCPU": len(cpus), "MEMORY_MB": host.memory_mb}
    if host.disk_gb is not None:
        totals["DISK_GB"] = host.disk_gb
    traits: set[str] = set()
    unread = None
    try:
        traits.update(cpu_traits(host.cpu_flags, host.cpu_architecture))
    except ImportError as error:
        # The traits are the optional part: CPUs, memory, disk and devices are read
        # without them (the caller says what is missing).
        unread = str(error)
    if any(len(s) > 1 for s in host.siblings.values()):
        traits.add("HW_CPU_HYPERTHREADING")
    reserved = {"MEMORY_MB": min(config.discovery.reserved_memory_mb, host.memory_mb)}
    return HostInventory(
        totals=totals, reserved=reserved, traits=frozenset(traits), traits_unread=unread
    )


def discover_for(config: NodeFile, root: str | None = None) -> Host:
    """Discovery as ``config`` says (``root`` overrides its root). Raises ValueError, in
    words, for a root that is no directory, and for one under which no online CPU is
    found: a host with nothing is no host to offer, whatever the tree there holds."""
    where = Path(root or config.discovery.root)
    if not where.is_dir():
        raise ValueError(f"root {where}: no such directory")
    host = discover(where, config.discovery.disk_path)
    if not host.cpus:
        raise ValueError(
            f"no online CPU under {where} ({where / 'sys/devices/system/cpu/online'} is "
            "missing or empty): is it a host's root?"
        )
    return host


def inventories_of(
    totals: dict[str, int], ratios: dict[str, float], reserved: dict[str, int]
) -> dict[str, Inventory]:
    """Inventories; raises ValueError naming the class at fault."""
    for rc in (*ratios, *reserved):
        if rc not in totals:
            raise ValueError(f"{rc} has no inventory: give its total first")
    return {
        rc: Inventory(
            total=total,
            allocation_ratio=float(ratios.get(rc, 1.0)),
            reserved=int(reserved.get(rc, 0)),
        )
        for rc, total in totals.items()
    }
