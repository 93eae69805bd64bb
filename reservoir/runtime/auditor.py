"""The cluster-wide auditor behind ``reservoir audit``: every live node's ledger, asked for
over the broker, checked against the protocol's invariants.

:class:`LedgerCollector` publishes one :class:`~reservoir.protocol.messages.LedgerQuery`
on the widest tier's topic (every serving node hears it) and gathers the
:class:`~reservoir.protocol.messages.LedgerReport` parts the nodes send back. The reports
come through the same codec as every other message, so under signing an auditor believes
only ledgers signed with a node's key, and under per-role broker users only from node
users. :func:`snapshot_of` turns one node's parts into the
:class:`~reservoir.protocol.audit.NodeSnapshot` the checks of :mod:`reservoir.protocol.audit`
take: the very checks every test and demo ends with, over durable state or over the wire
alike.

The callers' record (``--placements FILE``) is what callers were told: JSON lines as
``reservoir request --json`` prints them. With it, the audit also checks that every
placement a caller heard of is held by the nodes, and lists each allocation no caller
heard of as an orphan, with the command that frees it.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec.structs

from reservoir.broker import Broker
from reservoir.brokers import BrokerUrl
from reservoir.clock import Scheduler
from reservoir.observe.metrics import Metrics
from reservoir.protocol.addresses import node_address
from reservoir.protocol.audit import AuditReport, NodeSnapshot, audit
from reservoir.protocol.compatibility import said_release
from reservoir.protocol.ledger import Allocation, Reservation, ResourceUsage
from reservoir.protocol.messages import LedgerQuery, LedgerReport, Message
from reservoir.protocol.placement import PlacedAllocation, Placement
from reservoir.runtime.asking import AskEveryNode
from reservoir.runtime.settings import Settings

__all__ = [
    "ClusterAudit",
    "LedgerCollector",
    "audit_cluster",
    "check",
    "free_command",
    "node_fields",
    "placement_record",
    "read_placements",
    "read_placements_file",
    "snapshot_of",
]

#: A reservation may outlive its deadline by this much before it counts as leaked: the
#: node drops it on a timer, which fires a little late on a busy machine.
LEAK_GRACE_S = 1.0


def node_fields(snapshot: NodeSnapshot) -> dict[str, Any]:
    """A live node in the one field vocabulary of ``reservoir nodes`` and ``GET
    /v1/nodes``: ``name``, ``release`` (what its configuration names; a node that names
    none is of 0.1.0, the one release that did not), ``tier`` (percent), ``utilisation``
    (0..1), ``allocations``
    and ``reservations`` (counts held), and ``usage`` per resource class: its inventory
    (``total``, ``reserved``: host-reserved, as Placement has it, ``allocation_ratio``),
    ``capacity`` ((total - reserved) x ratio), ``used`` by allocations, ``held`` by live
    reservations, and ``free``."""
    return {
        "name": snapshot.name,
        "release": said_release(snapshot.configuration),
        "tier": snapshot.tier,
        "utilisation": round(snapshot.utilisation, 4),
        "allocations": len(snapshot.allocations),
        "reservations": len(snapshot.reservations),
        "usage": {
            rc: {
                "total": u.total,
                "reserved": u.host_reserved,
                "allocation_ratio": u.allocation_ratio,
                "capacity": u.capacity,
                "used": u.allocated,
                "held": u.reserved,
                "free": u.free,
            }
            for rc, u in snapshot.usages.items()
        },
    }


def snapshot_of(parts: Sequence[LedgerReport]) -> NodeSnapshot:
    """One node's complete report as a snapshot taken at time 0 of its own clock (so a
    reservation's deadline is its ``expires_in_s``). Overcommit is worked out here from the
    entries themselves, not taken from the node's word, and the node's own findings are
    kept beside it."""
    first = parts[0]
    allocations = tuple(
        Allocation(
            allocation_id=a.allocation_id,
            request_id=a.request_id,
            reservation_id=a.reservation_id,
            owner=a.owner,
            resources=a.resources,
            request_count=a.request_count,
        )
        for part in parts
        for a in part.allocations
    )
    reservations = tuple(
        Reservation(
            reservation_id=r.reservation_id,
            request_id=r.request_id,
            owner=r.owner,
            reply_to=r.owner,
            slots=r.slots,
            per_instance=r.per_instance,
            deadline=r.expires_in_s,
        )
        for part in parts
        for r in part.reservations
    )
    allocated: dict[str, int] = {}
    reserved: dict[str, int] = {}
    for allocation in allocations:
        for rc, amount in allocation.resources.items():
            allocated[rc] = allocated.get(rc, 0) + amount
    for reservation in reservations:
        for rc, amount in reservation.holds().items():
            reserved[rc] = reserved.get(rc, 0) + amount
    usages: dict[str, ResourceUsage] = {}
    violations = list(first.violations)
    for rc in sorted(set(first.tallies) | set(allocated) | set(reserved)):
        tally = first.tallies.get(rc)
        usage = ResourceUsage(
            capacity=tally.capacity if tally is not None else 0,
            allocated=allocated.get(rc, 0),
            reserved=reserved.get(rc, 0),
            # an older node reports no inventory: its capacity stands for the total
            total=(tally.total if tally.total is not None else tally.capacity) if tally else 0,
            host_reserved=tally.host_reserved if tally is not None else 0,
            allocation_ratio=tally.allocation_ratio if tally is not None else 1.0,
        )
        usages[rc] = usage
        if usage.allocated + usage.reserved > usage.capacity:
            finding = (
                f"{rc}: allocated {usage.allocated} + reserved {usage.reserved} "
                f"> capacity {usage.capacity}"
            )
            if finding not in violations:
                violations.append(finding)
    capacities = [u for u in usages.values() if u.capacity > 0]
    utilisation = max(((u.allocated + u.reserved) / u.capacity for u in capacities), default=0.0)
    return NodeSnapshot(
        name=first.sender,
        taken_at=0.0,
        utilisation=utilisation,
        tier=first.tier,
        usages=usages,
        allocations=allocations,
        reservations=reservations,
        violations=tuple(violations),
        configuration=next((p.configuration for p in parts if p.part == 0), {}),
    )


class LedgerCollector(AskEveryNode):
    """An auditor's endpoint: asks once, then gathers answers until :meth:`close`."""

    asker = "an auditor"

    def __init__(
        self,
        broker: Broker | BrokerUrl | str | None = None,
        *,
        settings: Settings | None = None,
        scheduler: Scheduler | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.audit_id = secrets.token_hex(8)
        #: (node, incarnation) -> part number -> the part
        self._parts: dict[tuple[str, str], dict[int, LedgerReport]] = {}
        super().__init__(
            broker,
            name=f"auditor-{self.audit_id}",
            settings=settings,
            scheduler=scheduler,
            metrics=metrics,
        )

    def collect(self, *, wait_s: float, expect_nodes: int | None = None) -> list[NodeSnapshot]:
        """Wait up to ``wait_s`` for answers (less when ``expect_nodes`` nodes have answered
        in full, or when the broker said no node is listening), and return a snapshot of
        every node whose report came complete."""
        self.wait_for_answers(wait_s=wait_s, expect_nodes=expect_nodes)
        with self._changed:
            complete = self._complete()
        return [snapshot_of(parts) for _node, parts in sorted(complete.items())]

    def incomplete_nodes(self) -> list[str]:
        """Nodes that sent some parts of their report but not all."""
        with self._changed:
            done = set(self._complete())
            return sorted({node for node, _ in self._parts} - done)

    def _complete(self) -> dict[str, list[LedgerReport]]:
        complete: dict[str, list[LedgerReport]] = {}
        for (node, _incarnation), parts in self._parts.items():
            expected = next(iter(parts.values())).parts
            if len(parts) == expected:
                # A node restarted mid-answer may have two incarnations: either is whole.
                complete[node] = [parts[index] for index in range(expected)]
        return complete

    # -- what is asked, what is taken ----------------------------------------------------

    def _question(self, widest_tier: int) -> Message:
        return LedgerQuery(sender=self.address, reply_to=self.address, audit_id=self.audit_id)

    def _take(self, message: Message) -> bool:
        if not isinstance(message, LedgerReport) or message.audit_id != self.audit_id:
            return False
        self._parts.setdefault((message.sender, message.incarnation), {})[message.part] = message
        return True

    def _nodes_answered(self) -> int:
        return len(self._complete())


def free_command(node: str, request_id: str, allocation_id: str) -> str:
    """The command an operator runs to free one allocation."""
    return f"reservoir free --node {node} --request-id {request_id} --allocation {allocation_id}"


@dataclass(frozen=True)
class ClusterAudit:
    """What an audit over the broker found."""

    nodes: tuple[str, ...]
    incomplete_nodes: tuple[str, ...]
    allocations: int
    reservations: int
    report: AuditReport
    #: allocations no caller in the record heard of, with the command that frees each
    #: (empty without a record: then no allocation can be called an orphan)
    orphans: tuple[str, ...]
    record_given: bool

    @property
    def ok(self) -> bool:
        return self.report.ok and not self.incomplete_nodes

    def as_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "nodes": len(self.nodes),
            "incomplete_nodes": list(self.incomplete_nodes),
            "allocations": self.allocations,
            "reservations": self.reservations,
            "overcommitted": list(self.report.overcommitted),
            "duplicate_placements": list(self.report.duplicate_placements),
            "leaked_reservations": list(self.report.leaked_reservations),
            "orphans": list(self.orphans) if self.record_given else None,
        }


def check(
    snapshots: Sequence[NodeSnapshot],
    placements: Iterable[Placement] | None = None,
    *,
    incomplete_nodes: Sequence[str] = (),
) -> ClusterAudit:
    """The invariants over snapshots gathered from the nodes (see :func:`audit_cluster`)."""
    record = list(placements) if placements is not None else None
    report = audit(snapshots, record or (), grace_s=LEAK_GRACE_S)
    orphans: list[str] = []
    if record is not None:
        claimed = {a.allocation_id for p in record for a in p.allocations}
        orphans = [
            f"{s.name}: {a.allocation_id} of {a.request_id}: "
            f"{free_command(s.name, a.request_id, a.allocation_id)}"
            for s in snapshots
            for a in s.allocations
            if a.allocation_id not in claimed
        ]
    return ClusterAudit(
        nodes=tuple(s.name for s in snapshots),
        incomplete_nodes=tuple(incomplete_nodes),
        allocations=sum(len(s.allocations) for s in snapshots),
        reservations=sum(len(s.reservations) for s in snapshots),
        report=report,
        orphans=tuple(orphans),
        record_given=record is not None,
    )


def audit_cluster(
    broker: Broker | BrokerUrl | str | None = None,
    *,
    settings: Settings | None = None,
    placements: Iterable[Placement] | None = None,
    wait_s: float = 2.0,
    expect_nodes: int | None = None,
) -> ClusterAudit:
    """Ask every live node for its ledger and check the invariants across them."""
    collector = LedgerCollector(broker, settings=settings)
    try:
        collector.ask()
        snapshots = collector.collect(wait_s=wait_s, expect_nodes=expect_nodes)
        incomplete = collector.incomplete_nodes()
    finally:
        collector.close()
    return check(snapshots, placements, incomplete_nodes=incomplete)


def placement_record(placement: Placement) -> dict[str, Any]:
    """A placement as ``reservoir request --json`` prints it and a callers' record keeps
    it: what :func:`read_placements` reads back."""
    return {
        "placed": True,
        "request_id": placement.request_id,
        "partial": placement.partial,
        "allocations": [
            {
                "node": a.node,
                "allocation_id": a.allocation_id,
                "resources": dict(a.resources),
                **({"numa": msgspec.structs.asdict(a.numa)} if a.numa else {}),
            }
            for a in placement.allocations
        ],
        "tiers_tried": list(placement.tiers_tried),
        "elapsed_s": round(placement.elapsed_s, 4),
    }


def read_placements(lines: Iterable[str], where: str = "record") -> list[Placement]:
    """Placements from JSON lines as ``reservoir request --json`` prints them; lines that
    report a failure (``"placed": false``) and blank lines are skipped."""
    placements: list[Placement] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            if not isinstance(item, Mapping):
                raise ValueError("not a JSON object")
            if not item.get("placed", False):
                continue
            allocations = tuple(
                PlacedAllocation(
                    node=str(a["node"]),
                    address=node_address(str(a["node"])),
                    allocation_id=str(a["allocation_id"]),
                    resources=dict(a.get("resources", {})),
                )
                for a in item["allocations"]
            )
            placements.append(
                Placement(
                    request_id=str(item["request_id"]),
                    allocations=allocations,
                    requested=int(item.get("requested", len(allocations))),
                )
            )
        except (ValueError, KeyError, TypeError) as error:
            raise ValueError(f"{where}, line {number}: not a placement ({error})") from None
    return placements


def read_placements_file(path: Path) -> list[Placement]:
    with path.open(encoding="utf-8") as lines:
        return read_placements(lines, str(path))
