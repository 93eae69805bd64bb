"""NUMA: a node's cells, and fitting instances onto them with the full request.

A request that carries a :class:`~reservoir.protocol.messages.NumaSpec` wants each instance
split evenly over ``nodes`` cells: its CPUs (``VCPU``, or ``PCPU`` when asked) and its
``MEMORY_MB``. With ``dedicated_cpus`` every CPU is a specific host CPU that no other
instance holds; with ``hugepage_kb`` the memory comes in pages of that size. The node picks
the cells and the CPUs when it *reserves*, and the reservation holds them, so two
concurrent pinned requests never get the same CPU. Instances without a NUMA shape float
and are not counted against cells, as in Nova.

PCI devices are chosen the same way. A node's topology lists its devices (address, the
alias the operator gave it, its NUMA cell); a request's ``pci`` asks for a count per alias,
and its ``numa_policy`` says where they may sit relative to the instance's cells (Nova's
``hw:pci_numa_affinity_policy``: ``required``, ``legacy``, ``preferred``, ``socket``). The
cells are chosen together with the devices: among the cells with room for the CPUs and
memory, the first set (emptiest first) whose devices satisfy the policy. The chosen
addresses go in the instance's :class:`NumaPlacement`, which the reservation and then the
allocation hold, so no device is ever held twice (the audit checks it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from reservoir.protocol.messages import NumaPlacement, NumaSpec, ReservationRequest

__all__ = ["NumaCell", "NumaTopology", "PciDevice", "Shortfall", "fit_instances", "fit_numa"]

#: the most sets of cells tried for one instance's devices: a node has a handful of cells,
#: and this bounds the work of a 16-cell node asked for 8 of them
_MAX_CELL_SETS = 256


@dataclass(frozen=True)
class NumaCell:
    cell_id: int
    cpus: frozenset[int]
    memory_mb: int
    #: huge pages the cell has: page size in KiB -> number of pages
    hugepages: Mapping[int, int] = field(default_factory=dict)
    #: the CPU socket the cell belongs to (None: unknown, taken as a socket of its own)
    socket: int | None = None


@dataclass(frozen=True)
class PciDevice:
    """A device the node may hand out: its address, the alias requests name it by, and
    its NUMA cell (None when the host does not say)."""

    address: str
    alias: str
    cell: int | None = None
    vendor_id: str = ""
    product_id: str = ""


@dataclass(frozen=True)
class NumaTopology:
    cells: tuple[NumaCell, ...]
    devices: tuple[PciDevice, ...] = ()

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for cell in self.cells:
            if cell.cpus & seen:
                raise ValueError(f"cell {cell.cell_id} shares CPUs with another cell")
            seen |= cell.cpus
        if len({c.cell_id for c in self.cells}) != len(self.cells):
            raise ValueError("cell ids must be unique")
        cell_ids = {c.cell_id for c in self.cells}
        addresses: set[str] = set()
        for device in self.devices:
            if device.address in addresses:
                raise ValueError(f"PCI device {device.address} is listed twice")
            addresses.add(device.address)
            if device.cell is not None and device.cell not in cell_ids:
                raise ValueError(
                    f"PCI device {device.address} is on NUMA cell {device.cell}, "
                    f"which the node does not have"
                )

    def device_addresses(self) -> frozenset[str]:
        return frozenset(d.address for d in self.devices)

    def socket_of(self, cell_id: int) -> int:
        for cell in self.cells:
            if cell.cell_id == cell_id and cell.socket is not None:
                return cell.socket
        return -1 - cell_id  # unknown: a socket of its own, apart from every known one

    @classmethod
    def uniform(
        cls,
        cells: int,
        cpus: int,
        memory_mb: int,
        hugepages_per_cell: Mapping[int, int] | None = None,
    ) -> NumaTopology:
        """``cells`` equal cells sharing ``cpus`` CPUs (numbered 0..cpus-1, in blocks) and
        ``memory_mb`` between them."""
        if cells < 1 or cpus < cells:
            raise ValueError("need at least one cell and one CPU per cell")
        per_cell = cpus // cells
        return cls(
            tuple(
                NumaCell(
                    cell_id=i,
                    cpus=frozenset(range(i * per_cell, (i + 1) * per_cell)),
                    memory_mb=memory_mb // cells,
                    hugepages=dict(hugepages_per_cell or {}),
                )
                for i in range(cells)
            )
        )


@dataclass
class _CellUse:
    cell: NumaCell
    pinned: set[int] = field(default_factory=set)
    vcpus: int = 0
    memory_mb: int = 0
    pages: dict[int, int] = field(default_factory=dict)

    def free_memory_mb(self) -> int:
        return self.cell.memory_mb - self.memory_mb

    def free_pages(self, page_kb: int) -> int:
        return self.cell.hugepages.get(page_kb, 0) - self.pages.get(page_kb, 0)

    def free_cpus(self) -> list[int]:
        return sorted(self.cell.cpus - self.pinned)


def _usage(topology: NumaTopology, held: Iterable[NumaPlacement]) -> dict[int, _CellUse]:
    use = {cell.cell_id: _CellUse(cell) for cell in topology.cells}
    for placement in held:
        for index, cell_id in enumerate(placement.cells):
            cell_use = use.get(cell_id)
            if cell_use is None:
                continue  # a cell the topology no longer has; the ledger audit reports it
            memory = placement.memory_mb_per_cell[index] if placement.memory_mb_per_cell else 0
            cell_use.memory_mb += memory
            if placement.hugepage_kb:
                pages = memory * 1024 // placement.hugepage_kb
                cell_use.pages[placement.hugepage_kb] = (
                    cell_use.pages.get(placement.hugepage_kb, 0) + pages
                )
            if placement.vcpus_per_cell:
                cell_use.vcpus += placement.vcpus_per_cell[index]
        for cpu in placement.cpus:
            for cell_use in use.values():
                if cpu in cell_use.cell.cpus:
                    cell_use.pinned.add(cpu)
    return use


def _shape(request: ReservationRequest, spec: NumaSpec) -> tuple[int, int] | str:
    """(cpus, memory) per cell, or why the request cannot be split."""
    cpus = request.resources.get("PCPU", 0) or request.resources.get("VCPU", 0)
    memory = request.resources.get("MEMORY_MB", 0)
    if cpus % spec.nodes or memory % spec.nodes:
        return f"{cpus} CPUs and {memory} MB do not split evenly over {spec.nodes} cells"
    return cpus // spec.nodes, memory // spec.nodes


@dataclass(frozen=True)
class Shortfall:
    """Why no instance fits: the words, and the PCI alias at fault when it is devices."""

    why: str
    alias: str | None = None


def fit_instances(
    topology: NumaTopology,
    held: Iterable[NumaPlacement],
    request: ReservationRequest,
    max_slots: int,
) -> tuple[list[NumaPlacement], Shortfall | None]:
    """Place up to ``max_slots`` instances of a request with a NUMA shape, PCI devices or
    both on what ``held`` leaves free. Returns the placements and, when none fits, why."""
    placed = list(held)
    taken = {address for placement in placed for address in placement.devices}
    missing = sorted(alias for alias in request.pci if not _devices_of(topology, alias))
    if missing:
        return [], Shortfall(f"the node has no PCI device with alias {missing[0]}", missing[0])
    if request.numa is None:
        return _fit_floating_devices(topology, taken, request, max_slots)
    return _fit_numa(topology, placed, taken, request, max_slots)


def fit_numa(
    topology: NumaTopology,
    held: Iterable[NumaPlacement],
    request: ReservationRequest,
    max_slots: int,
) -> tuple[list[NumaPlacement], str]:
    """Place up to ``max_slots`` instances on the cells left free by ``held``. Returns the
    placements and, when fewer than one fits, why."""
    placements, shortfall = fit_instances(topology, held, request, max_slots)
    return placements, "" if shortfall is None else shortfall.why


def _devices_of(topology: NumaTopology, alias: str) -> list[PciDevice]:
    return [d for d in topology.devices if d.alias == alias]


def _fit_floating_devices(
    topology: NumaTopology, taken: set[str], request: ReservationRequest, max_slots: int
) -> tuple[list[NumaPlacement], Shortfall | None]:
    """An instance without a NUMA shape floats, so its devices may sit on any cell (as in
    Nova, the affinity policy binds only instances with a NUMA topology)."""
    placements: list[NumaPlacement] = []
    for _ in range(max_slots):
        chosen: list[str] = []
        for alias, count in sorted(request.pci.items()):
            free = [d.address for d in _devices_of(topology, alias) if d.address not in taken]
            if len(free) < count:
                if placements:
                    return placements, None
                return [], Shortfall(
                    f"no {count} free {alias}: {len(free)} of "
                    f"{len(_devices_of(topology, alias))} free",
                    alias,
                )
            chosen += sorted(free)[:count]
        taken.update(chosen)
        placements.append(NumaPlacement(cells=(), devices=tuple(chosen)))
    return placements, None


def _choose_devices(
    topology: NumaTopology,
    taken: set[str],
    pci: Mapping[str, int],
    cells: Sequence[int],
    policy: str,
) -> tuple[list[str], str | None]:
    """Devices for one instance on ``cells`` under ``policy``, or the alias short of them."""
    sockets = {topology.socket_of(c) for c in cells}

    def allowed(device: PciDevice) -> bool:
        if policy == "required":
            return device.cell in cells
        if policy == "legacy":
            return device.cell is None or device.cell in cells
        if policy == "socket":
            return device.cell is not None and topology.socket_of(device.cell) in sockets
        return True  # preferred: any, the instance's cells first

    chosen: list[str] = []
    for alias, count in sorted(pci.items()):
        free = [
            d
            for d in _devices_of(topology, alias)
            if d.address not in taken and d.address not in chosen and allowed(d)
        ]
        free.sort(key=lambda d: (d.cell not in cells, d.address))
        if len(free) < count:
            return [], alias
        chosen += [d.address for d in free[:count]]
    return chosen, None


def _fit_numa(
    topology: NumaTopology,
    held: list[NumaPlacement],
    held_devices: set[str],
    request: ReservationRequest,
    max_slots: int,
) -> tuple[list[NumaPlacement], Shortfall | None]:
    spec = request.numa
    assert spec is not None
    policy = request.numa_policy or "legacy"
    shape = _shape(request, spec)
    if isinstance(shape, str):
        return [], Shortfall(shape)
    cpus_per_cell, memory_per_cell = shape
    if spec.nodes > len(topology.cells):
        return [], Shortfall(f"needs {spec.nodes} NUMA cells, the node has {len(topology.cells)}")
    page_kb = spec.hugepage_kb
    if page_kb is not None and (memory_per_cell * 1024) % page_kb:
        return [], Shortfall(
            f"{memory_per_cell} MB per cell is not a whole number of {page_kb} KiB pages"
        )
    use = _usage(topology, held)
    placements: list[NumaPlacement] = []
    why = "no cells with room"
    short_alias: str | None = None
    for _ in range(max_slots):
        candidates = []
        for cell_use in use.values():
            if cell_use.free_memory_mb() < memory_per_cell:
                why = f"no cell has {memory_per_cell} MB of memory free"
                continue
            pages_needed = memory_per_cell * 1024 // page_kb if page_kb else 0
            if page_kb is not None and cell_use.free_pages(page_kb) < pages_needed:
                why = f"no cell has {memory_per_cell} MB of free {page_kb} KiB pages"
                continue
            if spec.dedicated_cpus and len(cell_use.free_cpus()) < cpus_per_cell:
                why = f"no cell has {cpus_per_cell} unpinned CPUs"
                continue
            candidates.append(cell_use)
        if len(candidates) < spec.nodes:
            break
        # Emptiest cells first, so instances spread over the sockets.
        candidates.sort(key=lambda u: (-u.free_memory_mb(), -len(u.free_cpus()), u.cell.cell_id))
        chosen = sorted(candidates[: spec.nodes], key=lambda u: u.cell.cell_id)
        devices: list[str] = []
        if request.pci:
            picked = _cells_with_devices(
                topology, held_devices, request.pci, candidates, spec, policy
            )
            if isinstance(picked, str):
                short_alias = picked
                where = (
                    f"{cpus_per_cell} free dedicated CPUs"
                    if spec.dedicated_cpus
                    else f"{memory_per_cell} MB free"
                )
                cells_word = "NUMA cell" if spec.nodes == 1 else f"{spec.nodes} NUMA cells"
                scope = "socket" if policy == "socket" else cells_word
                why = f"no free {picked} on the {scope} of {where} (numa_policy {policy})"
                break
            chosen, devices = picked
            held_devices.update(devices)
        cpus: list[int] = []
        for cell_use in chosen:
            if spec.dedicated_cpus:
                taken = cell_use.free_cpus()[:cpus_per_cell]
                cell_use.pinned.update(taken)
                cpus += taken
            cell_use.vcpus += cpus_per_cell
            cell_use.memory_mb += memory_per_cell
            if page_kb is not None:
                cell_use.pages[page_kb] = (
                    cell_use.pages.get(page_kb, 0) + memory_per_cell * 1024 // page_kb
                )
        placements.append(
            NumaPlacement(
                cells=tuple(u.cell.cell_id for u in chosen),
                cpus=tuple(cpus),
                memory_mb_per_cell=tuple(memory_per_cell for _ in chosen),
                vcpus_per_cell=tuple(cpus_per_cell for _ in chosen),
                hugepage_kb=page_kb,
                devices=tuple(devices),
            )
        )
    return placements, (None if placements else Shortfall(why, short_alias))


def _cells_with_devices(
    topology: NumaTopology,
    taken: set[str],
    pci: Mapping[str, int],
    candidates: Sequence[_CellUse],
    spec: NumaSpec,
    policy: str,
) -> tuple[list[_CellUse], list[str]] | str:
    """The first set of ``spec.nodes`` candidate cells (in the candidates' order) whose
    devices satisfy ``policy``, with the devices; or the alias short everywhere. With
    ``preferred``, the emptiest cells and devices from anywhere when no set has them."""
    short = ""
    sets = itertools.islice(itertools.combinations(candidates, spec.nodes), _MAX_CELL_SETS)
    strict = "required" if policy == "preferred" else policy
    for cell_set in sets:
        cells = sorted(u.cell.cell_id for u in cell_set)
        devices, alias = _choose_devices(topology, taken, pci, cells, strict)
        if alias is None:
            return sorted(cell_set, key=lambda u: u.cell.cell_id), devices
        short = short or alias
    if policy == "preferred":
        chosen = sorted(candidates[: spec.nodes], key=lambda u: u.cell.cell_id)
        cells = [u.cell.cell_id for u in chosen]
        devices, alias = _choose_devices(topology, taken, pci, cells, policy)
        if alias is None:
            return chosen, devices
        short = alias
    return short
