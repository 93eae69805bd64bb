"""The invariant audit every protocol test and every demo run ends with.

It looks at what the *nodes* hold, independently of what requestors believe, and reports:

- **overcommitted**: a node where allocations plus live reservations exceed capacity for
  some resource class;
- **leaked reservations**: a reservation still held after its deadline;
- **duplicate placements**: a request id holding more instances across all nodes than it
  asked for, or a placement a requestor returned that the nodes do not hold;
- **task violations** (counted with the node's own violations): a task running without
  a live allocation, or an allocation whose task ended still held (unless the request
  kept it);
- **orphaned allocations** (informational): allocations no returned placement accounts
  for, e.g. a placement abandoned when a ``Free`` was lost. Only meaningful when every
  placement of the run is passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from reservoir.protocol.ledger import Allocation, Ledger, Reservation, ResourceUsage

__all__ = ["AuditFailed", "AuditReport", "Claim", "NodeSnapshot", "audit"]


@dataclass(frozen=True)
class NodeSnapshot:
    """A node's ledger at one moment of its clock."""

    name: str
    taken_at: float
    utilisation: float
    tier: int
    usages: Mapping[str, ResourceUsage]
    allocations: tuple[Allocation, ...]
    reservations: tuple[Reservation, ...]
    violations: tuple[str, ...]
    #: the configuration the node said it runs with (when it was asked over the broker)
    configuration: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        name: str,
        ledger: Ledger,
        taken_at: float,
        tier: int,
        task_violations: Iterable[str] = (),
    ) -> NodeSnapshot:
        """``task_violations``: what the node's machine finds wrong with its tasks
        (:meth:`~reservoir.protocol.node.NodeMachine.task_violations`), judged with the
        ledger's own."""
        return cls(
            name=name,
            taken_at=taken_at,
            utilisation=ledger.utilisation(),
            tier=tier,
            usages=ledger.usages(),
            allocations=tuple(ledger.allocations.values()),
            reservations=tuple(ledger.reservations.values()),
            violations=(*ledger.violations(), *task_violations),
        )


class AuditFailed(AssertionError):
    """An invariant of the protocol does not hold."""


@dataclass(frozen=True)
class AuditReport:
    overcommitted: tuple[str, ...]
    leaked_reservations: tuple[str, ...]
    duplicate_placements: tuple[str, ...]
    orphaned_allocations: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """True when the three invariants hold (orphans are reported, not judged)."""
        return not (self.overcommitted or self.leaked_reservations or self.duplicate_placements)

    def raise_if_failed(self, *, allow_orphans: bool = True) -> None:
        problems = [*self.overcommitted, *self.leaked_reservations, *self.duplicate_placements]
        if not allow_orphans:
            problems += self.orphaned_allocations
        if problems:
            shown = "\n  ".join(problems[:20])
            more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise AuditFailed(f"protocol invariants broken:\n  {shown}{more}")


class ClaimedAllocation(Protocol):
    @property
    def allocation_id(self) -> str: ...


class Claim(Protocol):
    """What the audit reads of a placement a requestor returned (a
    :class:`~reservoir.protocol.placement.Placement` is one)."""

    @property
    def request_id(self) -> str: ...

    @property
    def allocations(self) -> Sequence[ClaimedAllocation]: ...


def audit(
    snapshots: Iterable[NodeSnapshot],
    placements: Iterable[Claim] = (),
    *,
    grace_s: float = 0.0,
) -> AuditReport:
    """Check the invariants over node snapshots (and the placements requestors returned).

    A reservation counts as leaked when its deadline is ``grace_s`` or more behind the
    snapshot's time: a live runtime's timer may fire a hair late, a simulated one never.
    """
    overcommitted: list[str] = []
    leaked: list[str] = []
    # A simulated cluster of 100,000 nodes holds millions of allocations, nearly every one
    # the only one of its request and named by exactly one placement: that case takes no
    # list, no set and no second pass. ``first`` holds each request id's first allocation
    # (and the node), ``more`` every allocation of the ids that have several.
    first: dict[str, tuple[str, Allocation]] = {}
    more: dict[str, list[tuple[str, Allocation]]] = {}
    for snapshot in snapshots:
        overcommitted += [f"{snapshot.name}: {v}" for v in snapshot.violations]
        for reservation in snapshot.reservations:
            late_s = snapshot.taken_at - reservation.deadline
            if late_s >= grace_s:
                leaked.append(
                    f"{snapshot.name}: reservation {reservation.reservation_id} for "
                    f"{reservation.request_id} still held {late_s:.3f}s past its deadline"
                )
        name = snapshot.name
        for allocation in snapshot.allocations:
            request_id = allocation.request_id
            earlier = first.get(request_id)
            if earlier is None:
                first[request_id] = (name, allocation)
            elif request_id in more:
                more[request_id].append((name, allocation))
            else:
                more[request_id] = [earlier, (name, allocation)]
    # Problems are listed by request id, but only the problems are sorted.
    placed_twice: list[tuple[str, str]] = []
    for request_id, held in more.items():
        count = max(a.request_count for _, a in held)
        if len(held) > count:
            where = ", ".join(sorted(f"{node}:{a.allocation_id}" for node, a in held))
            placed_twice.append(
                (
                    request_id,
                    f"request {request_id} wanted {count}, nodes hold {len(held)}: {where}",
                )
            )
    duplicates = [problem for _, problem in sorted(placed_twice)]
    # the single allocations no placement has named yet, and the ids of the others named
    unclaimed = dict(first)
    claimed: set[str] = set()
    for placement in placements:
        request_id = placement.request_id
        named = placement.allocations
        single = first.get(request_id)
        if len(named) == 1 and request_id not in more:  # the common case
            allocation_id = named[0].allocation_id
            if single is not None and single[1].allocation_id == allocation_id:
                unclaimed.pop(request_id, None)
                continue
            claimed.add(allocation_id)
            missing = [allocation_id]
        else:
            several = more.get(request_id)
            if several is not None:
                held_ids = {a.allocation_id for _, a in several}
            else:
                held_ids = set() if single is None else {single[1].allocation_id}
            missing = [a.allocation_id for a in named if a.allocation_id not in held_ids]
            claimed.update(a.allocation_id for a in named)
        if missing:
            duplicates.append(
                f"placement {placement.request_id} names allocations no node "
                f"holds: {', '.join(missing)}"
            )
    orphaned = [
        (request_id, 0, f"{node}: {allocation.allocation_id} of {request_id}")
        for request_id, (node, allocation) in unclaimed.items()
        if request_id not in more and allocation.allocation_id not in claimed
    ]
    orphaned += [
        (request_id, position, f"{node}: {allocation.allocation_id} of {request_id}")
        for request_id, held in more.items()
        for position, (node, allocation) in enumerate(held)
        if allocation.allocation_id not in claimed
    ]
    orphans = [problem for _, _, problem in sorted(orphaned)]
    return AuditReport(
        overcommitted=tuple(overcommitted),
        leaked_reservations=tuple(leaked),
        duplicate_placements=tuple(duplicates),
        orphaned_allocations=tuple(orphans),
    )
