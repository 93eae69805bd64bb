"""Host discovery: what a compute host has, read from ``/sys`` and ``/proc`` under a root.

As Nova's libvirt driver and the kubelet do, a node agent can learn its inventory from the
host rather than from its command line: the online CPUs, the NUMA cell and sibling threads
of each, memory and huge pages (per size) per cell, disk from a path (statvfs), PCI
devices (address, vendor and product ids, class, NUMA cell, SR-IOV physical functions and
their virtual functions) and the CPU's features as OpenStack traits (``os-traits``, the
``host`` extra). The root is a parameter so that tests read trees of their own.

Discovery only reads; :mod:`reservoir.runtime.node_config` turns what was found, reduced by
the operator's configuration (reserved CPUs and memory, ratios, excluded devices, which
devices are handed out under which alias), into a node's inventories and topology.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from reservoir.version import install_hint

__all__ = [
    "Host",
    "HostCell",
    "HostPci",
    "cpu_traits",
    "discover",
    "parse_cpu_list",
]


@dataclass(frozen=True)
class HostCell:
    """One NUMA cell: its online CPUs, memory and huge pages (page size KiB -> pages)."""

    cell_id: int
    cpus: tuple[int, ...]
    memory_mb: int
    hugepages: dict[int, int] = field(default_factory=dict)
    #: the CPU socket (physical package) of its CPUs, when they say
    socket: int | None = None


@dataclass(frozen=True)
class HostPci:
    """One PCI function."""

    address: str
    vendor_id: str
    product_id: str
    class_id: str
    #: the NUMA cell it is attached to (None: the host does not say)
    cell: int | None
    #: an SR-IOV physical function: how many virtual functions it may have, and those it has
    sriov_totalvfs: int | None = None
    virtual_functions: tuple[str, ...] = ()
    #: a virtual function: its physical function's address
    physical_function: str | None = None

    @property
    def kind(self) -> str:
        if self.physical_function is not None:
            return "type-VF"
        if self.sriov_totalvfs:
            return "type-PF"
        return "type-PCI"


@dataclass(frozen=True)
class Host:
    """What discovery found."""

    root: str
    cells: tuple[HostCell, ...]
    #: every online CPU -> its thread siblings (itself included)
    siblings: dict[int, tuple[int, ...]]
    memory_mb: int
    pci: tuple[HostPci, ...]
    cpu_flags: tuple[str, ...]
    #: whose names the flags are: ``x86`` (cpuinfo's ``flags``) or ``aarch64`` (``Features``)
    cpu_architecture: str = "x86"
    #: DISK_GB of the configured path (None when none was given)
    disk_gb: int | None = None

    @property
    def cpus(self) -> tuple[int, ...]:
        return tuple(sorted(cpu for cell in self.cells for cpu in cell.cpus))

    def as_json(self) -> dict[str, Any]:
        found = asdict(self)
        found["siblings"] = {str(cpu): list(s) for cpu, s in self.siblings.items()}
        for cell in found["cells"]:
            cell["hugepages"] = {str(size): n for size, n in cell["hugepages"].items()}
        for device, pci in zip(found["pci"], self.pci, strict=True):
            device["kind"] = pci.kind
        return found


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """``0-3,8,10-11`` as CPU numbers (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    return tuple(cpus)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int(path: Path) -> int | None:
    text = _read(path)
    try:
        return None if text is None else int(text, 0)
    except ValueError:
        return None


def discover(root: Path | str = "/", disk_path: Path | str | None = None) -> Host:
    """What the host under ``root`` has. Parts the tree lacks are empty (a container
    without ``/sys/devices/system/node`` is one cell holding every online CPU)."""
    root = Path(root)
    system = root / "sys" / "devices" / "system"
    online_text = _read(system / "cpu" / "online")
    online = set(parse_cpu_list(online_text)) if online_text else set()
    siblings: dict[int, tuple[int, ...]] = {}
    sockets: dict[int, int] = {}
    for cpu in sorted(online):
        topology = system / "cpu" / f"cpu{cpu}" / "topology"
        listed = _read(topology / "thread_siblings_list")
        siblings[cpu] = parse_cpu_list(listed) if listed else (cpu,)
        package = _int(topology / "physical_package_id")
        if package is not None and package >= 0:
            sockets[cpu] = package
    cells = _cells(system / "node", online, sockets)
    if not cells:
        cells = (_whole_host_cell(root, online, sockets),)
    disk_gb = None
    if disk_path is not None:
        stat = os.statvfs(disk_path)
        disk_gb = stat.f_blocks * stat.f_frsize // 2**30
    flags, architecture = _cpu_flags(root / "proc" / "cpuinfo")
    return Host(
        root=str(root),
        cells=cells,
        siblings=siblings,
        memory_mb=sum(c.memory_mb for c in cells),
        pci=_pci_devices(root / "sys" / "bus" / "pci" / "devices"),
        cpu_flags=flags,
        cpu_architecture=architecture,
        disk_gb=disk_gb,
    )


def _cells(nodes: Path, online: set[int], sockets: dict[int, int]) -> tuple[HostCell, ...]:
    cells = []
    for directory in sorted(nodes.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cell_id = int(directory.name[4:])
        listed = _read(directory / "cpulist")
        cpus = tuple(c for c in (parse_cpu_list(listed) if listed else ()) if c in online)
        memory_kb = 0
        for line in (_read(directory / "meminfo") or "").splitlines():
            # "Node 0 MemTotal:       16384 kB"
            match = re.match(r"Node\s+\d+\s+MemTotal:\s+(\d+)\s*kB", line)
            if match:
                memory_kb = int(match.group(1))
        cell_sockets = {sockets[c] for c in cpus if c in sockets}
        cells.append(
            HostCell(
                cell_id=cell_id,
                cpus=cpus,
                memory_mb=memory_kb // 1024,
                hugepages=_hugepages(directory / "hugepages"),
                socket=cell_sockets.pop() if len(cell_sockets) == 1 else None,
            )
        )
    return tuple(cells)


def _whole_host_cell(root: Path, online: set[int], sockets: dict[int, int]) -> HostCell:
    memory_kb = 0
    for line in (_read(root / "proc" / "meminfo") or "").splitlines():
        match = re.match(r"MemTotal:\s+(\d+)\s*kB", line)
        if match:
            memory_kb = int(match.group(1))
    cell_sockets = set(sockets.values())
    return HostCell(
        cell_id=0,
        cpus=tuple(sorted(online)),
        memory_mb=memory_kb // 1024,
        hugepages=_hugepages(root / "sys" / "kernel" / "mm" / "hugepages"),
        socket=cell_sockets.pop() if len(cell_sockets) == 1 else None,
    )


def _hugepages(directory: Path) -> dict[int, int]:
    pages = {}
    for size_dir in sorted(directory.glob("hugepages-*kB")):
        size_kb = int(size_dir.name[len("hugepages-") : -len("kB")])
        count = _int(size_dir / "nr_hugepages")
        if count:
            pages[size_kb] = count
    return pages


def _hex_id(path: Path) -> str:
    text = _read(path) or ""
    return text.removeprefix("0x").lower()


def _pci_devices(devices: Path) -> tuple[HostPci, ...]:
    found = []
    for directory in sorted(devices.glob("*")):
        numa_node = _int(directory / "numa_node")
        physfn = directory / "physfn"
        virtfns = sorted(directory.glob("virtfn[0-9]*"), key=lambda p: int(p.name[len("virtfn") :]))
        found.append(
            HostPci(
                address=directory.name,
                vendor_id=_hex_id(directory / "vendor"),
                product_id=_hex_id(directory / "device"),
                class_id=_hex_id(directory / "class"),
                cell=numa_node if numa_node is not None and numa_node >= 0 else None,
                sriov_totalvfs=_int(directory / "sriov_totalvfs"),
                virtual_functions=tuple(os.readlink(v).rsplit("/", 1)[-1] for v in virtfns),
                physical_function=(
                    os.readlink(physfn).rsplit("/", 1)[-1] if physfn.is_symlink() else None
                ),
            )
        )
    return tuple(found)


def _cpu_flags(cpuinfo: Path) -> tuple[tuple[str, ...], str]:
    """The first CPU's flags, and whose names they are (x86's ``flags``, aarch64's
    ``Features``)."""
    for line in (_read(cpuinfo) or "").splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            architecture = "x86" if key.strip() == "flags" else "aarch64"
            return tuple(sorted(set(value.split()))), architecture
    return (), "x86"


#: /proc/cpuinfo flags whose os-traits name is not the flag's upper-cased letters
_FLAG_TRAITS = {
    "aes": "HW_CPU_X86_AESNI",
    "fma": "HW_CPU_X86_FMA3",
    "pclmulqdq": "HW_CPU_X86_CLMUL",
    "sha_ni": "HW_CPU_X86_SHA",
    "bmi1": "HW_CPU_X86_BMI",
    "rtm": "HW_CPU_X86_TSX",
    "vaes": "HW_CPU_X86_AVX512VAES",
    "gfni": "HW_CPU_X86_AVX512GFNI",
    "vpclmulqdq": "HW_CPU_X86_AVX512VPCLMULQDQ",
    "avx512_vnni": "HW_CPU_X86_AVX512VNNI",
    "avx512_vbmi2": "HW_CPU_X86_AVX512VBMI2",
    "avx512_bitalg": "HW_CPU_X86_AVX512BITALG",
    "avx512_vpopcntdq": "HW_CPU_X86_AVX512VPOPCNTDQ",
    "amx_bf16": "HW_CPU_X86_AMXBF16",
    "amx_int8": "HW_CPU_X86_AMXINT8",
    "amx_tile": "HW_CPU_X86_AMXTILE",
}


def cpu_traits(flags: tuple[str, ...], architecture: str = "x86") -> frozenset[str]:
    """The standard traits (``os-traits``) the CPU flags stand for, e.g. ``avx2`` ->
    ``HW_CPU_X86_AVX2`` (``architecture``: ``x86`` or ``aarch64``, whose trait names the
    flags are read as). Needs the ``host`` extra; raises ImportError saying so."""
    try:
        import os_traits  # type: ignore[import-untyped]
    except ImportError:
        raise ImportError(f"CPU traits need os-traits: {install_hint('host')}") from None
    known = set(os_traits.get_traits("HW_CPU_"))
    traits: set[str] = set()
    for flag in flags:
        letters = flag.replace(".", "").replace("_", "").upper()
        if architecture == "aarch64":
            candidates = [f"HW_CPU_AARCH64_{letters}"]
        else:
            candidates = [_FLAG_TRAITS.get(flag, ""), f"HW_CPU_X86_{letters}"]
        traits.update(c for c in candidates if c in known)
    return frozenset(traits)
