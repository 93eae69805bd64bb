"""The audit against its definition: whatever the nodes hold and the placements name, the
fast audit (one pass, no list or set for the common case) reports exactly what the plain
reading of each invariant does, in the same order."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from reservoir.protocol.audit import AuditReport, NodeSnapshot, audit
from reservoir.protocol.ledger import Allocation


@dataclass(frozen=True)
class Named:
    allocation_id: str


@dataclass(frozen=True)
class Claimed:
    request_id: str
    allocations: tuple[Named, ...]


def reference(snapshots: list[NodeSnapshot], placements: list[Claimed]) -> AuditReport:
    """Each invariant as the module docstring states it, with no shortcut."""
    held: defaultdict[str, list[tuple[str, Allocation]]] = defaultdict(list)
    for snapshot in snapshots:
        for allocation in snapshot.allocations:
            held[allocation.request_id].append((snapshot.name, allocation))
    duplicates = []
    for request_id in sorted(held):
        entries = held[request_id]
        wanted = max(a.request_count for _, a in entries)
        if len(entries) > wanted:
            where = ", ".join(sorted(f"{n}:{a.allocation_id}" for n, a in entries))
            duplicates.append(
                f"request {request_id} wanted {wanted}, nodes hold {len(entries)}: {where}"
            )
    claimed = set()
    for placement in placements:
        ids = {a.allocation_id for _, a in held.get(placement.request_id, [])}
        missing = [a.allocation_id for a in placement.allocations if a.allocation_id not in ids]
        claimed.update(a.allocation_id for a in placement.allocations)
        if missing:
            duplicates.append(
                f"placement {placement.request_id} names allocations no node "
                f"holds: {', '.join(missing)}"
            )
    orphans = sorted(
        (request_id, position, f"{node}: {a.allocation_id} of {request_id}")
        for request_id, entries in held.items()
        for position, (node, a) in enumerate(entries)
        if a.allocation_id not in claimed
    )
    return AuditReport(
        overcommitted=(),
        leaked_reservations=(),
        duplicate_placements=tuple(duplicates),
        orphaned_allocations=tuple(problem for _, _, problem in orphans),
    )


REQUEST_IDS = st.sampled_from([f"r{i}" for i in range(6)])


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[NodeSnapshot], list[Claimed]]:
    snapshots = []
    every_id = []
    for n in range(draw(st.integers(0, 4))):
        allocations = []
        for k in range(draw(st.integers(0, 5))):
            allocation_id = f"n{n}.a{k}"
            every_id.append(allocation_id)
            allocations.append(
                Allocation(
                    allocation_id=allocation_id,
                    request_id=draw(REQUEST_IDS),
                    reservation_id=f"n{n}.res{k}",
                    owner="req",
                    resources={"VCPU": 1},
                    request_count=draw(st.integers(1, 3)),
                )
            )
        snapshots.append(
            NodeSnapshot(
                name=f"n{n}",
                taken_at=0.0,
                utilisation=0.0,
                tier=10,
                usages={},
                allocations=tuple(allocations),
                reservations=(),
                violations=(),
            )
        )
    # placements name held allocations, of their own request or another's, or none held
    names = st.sampled_from([*every_id, "ghost.a0", "ghost.a1"])
    placements = draw(
        st.lists(
            st.builds(
                Claimed,
                REQUEST_IDS,
                st.lists(names.map(Named), min_size=1, max_size=3).map(tuple),
            ),
            max_size=8,
        )
    )
    return snapshots, placements


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_the_audit_reports_what_each_invariant_says_in_the_same_order(
    cluster: tuple[list[NodeSnapshot], list[Claimed]],
) -> None:
    snapshots, placements = cluster
    assert audit(snapshots, placements) == reference(snapshots, placements)
