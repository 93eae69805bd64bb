"""NUMA: a node's cells, and fitting instances onto them with the full request.

A request that carries a :class:`~reservoir.protocol.messages.NumaSpec` wants each instance
split evenly over ``nodes`` cells: its CPUs (``VCPU``, or ``PCPU`` when asked) and its
``MEMORY_MB``. With ``dedicated_cpus`` every CPU is a specific host CPU that no other
instance holds; with ``hugepage_kb`` the memory comes in pages of that size. The node picks
the cells and the CPUs when it *reserves*, and the reservation holds them, so two
concurrent pinned requests never get the same CPU. Instances without a NUMA shape float
and are not counted against cells, as in Nova.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from reservoir.protocol.messages import NumaPlacement, NumaSpec, ReservationRequest

__all__ = ["NumaCell", "NumaTopology", "fit_numa"]


@dataclass(frozen=True)
class NumaCell:
    cell_id: int
    cpus: frozenset[int]
    memory_mb: int
    #: huge pages the cell has: page size in KiB -> number of pages
    hugepages: Mapping[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class NumaTopology:
    cells: tuple[NumaCell, ...]

    def __post_init__(self) -> None:
        seen: set[int] = set()
        for cell in self.cells:
            if cell.cpus & seen:
                raise ValueError(f"cell {cell.cell_id} shares CPUs with another cell")
            seen |= cell.cpus
        if len({c.cell_id for c in self.cells}) != len(self.cells):
            raise ValueError("cell ids must be unique")

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


def fit_numa(
    topology: NumaTopology,
    held: Iterable[NumaPlacement],
    request: ReservationRequest,
    max_slots: int,
) -> tuple[list[NumaPlacement], str]:
    """Place up to ``max_slots`` instances on the cells left free by ``held``. Returns the
    placements and, when fewer than one fits, why."""
    spec = request.numa
    assert spec is not None
    shape = _shape(request, spec)
    if isinstance(shape, str):
        return [], shape
    cpus_per_cell, memory_per_cell = shape
    if spec.nodes > len(topology.cells):
        return [], f"needs {spec.nodes} NUMA cells, the node has {len(topology.cells)}"
    page_kb = spec.hugepage_kb
    if page_kb is not None and (memory_per_cell * 1024) % page_kb:
        return [], f"{memory_per_cell} MB per cell is not a whole number of {page_kb} KiB pages"
    use = _usage(topology, held)
    placements: list[NumaPlacement] = []
    why = "no cells with room"
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
            )
        )
    return placements, ("" if placements else why)
