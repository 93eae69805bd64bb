"""What one run of one system at one offered load measured, and how it becomes a row.

This module owns :class:`RunResult` and the definitions of the reported figures:

- ``success_rate``: placed / arrivals;
- ``false_failures``: failures at a moment when some node had room for the request
  (allocations only: transient reservations do not count as "no room"), checked with the
  exact node state at the moment of the failure;
- ``p50_ms``/``p99_ms``: placement latency of the placed requests, in virtual time, from
  the arrival to the moment the placing side knows the instance is claimed;
- ``reschedules_per_placement``: reservoir, awards a node refused (the analogue of a
  failed claim); Nova, failed claims sent back to be rescheduled; sampling, re-samples
  (after a failed claim, or when no probed node fitted);
- ``messages_per_placement``: every message handed to a receiver (for reservoir: every
  delivery, roster announcements included; for Nova: state reports included, one per node
  per scheduler refresh, also shown alone as ``state_messages_per_placement``), divided by
  the placements;
- ``reserved_fraction``: time-averaged fraction of the cluster's VCPUs held by live
  reservations over the arrival window (0 for the baselines, which reserve nothing);
- ``fill_at_first_failure``: fraction of the VCPUs allocated when the first request
  failed (None when none did);
- ``roster_messages_per_placement`` (reservoir only): the deliveries that keep rosters
  (nodes' statuses, roll calls, keepers' queries, samples and news that they are up),
  the part that grows with the requestors when every requestor follows the announcements;
  ``conversation_messages_per_placement``: every other delivery;
- ``requestor_start_messages`` (reservoir only): the deliveries in the two virtual seconds
  after one more requestor starts at the end of the run, when nothing else is in flight:
  what a requestor's start (a deploy's restart) costs; ``roster_entries_max``: the largest
  requestor roster at the end; ``roster_mb_max``: its memory, at the bytes per entry
  measured (tracemalloc) in the same run; ``requestor_restarts``: requestors replaced by
  new ones during the arrivals (``--requestor-restarts-per-s``);
- ``broadcasts_per_placement`` (reservoir only): how often a requestor fell back to
  broadcasting (the exhaustive step; see ``reservoir.tools.simulator.engine.broadcasts_of``),
  per placement; ``tier_broadcasts_per_placement``: every ``Publish`` of a
  ``ReservationRequest`` (each tier widened to counts); ``probes_per_placement``: requests
  sent to one node (``Send``), the roster's sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["ROSTER_KINDS", "ROW_KEYS", "RunResult"]

#: the message kinds that keep requestors' rosters rather than place a request
ROSTER_KINDS = frozenset({"status", "roll_call", "roster_query", "roster_sample", "keeper_up"})

#: The keys of every row, in the order tables show them.
ROW_KEYS = (
    "system",
    "offered_load",
    "requests",
    "placed",
    "failed",
    "success_rate",
    "false_failures",
    "p50_ms",
    "p99_ms",
    "reschedules_per_placement",
    "messages_per_placement",
    "state_messages_per_placement",
    "roster_messages_per_placement",
    "conversation_messages_per_placement",
    "requestor_start_messages",
    "roster_entries_max",
    "roster_mb_max",
    "requestor_restarts",
    "reserved_fraction",
    "fill_at_first_failure",
    "broadcasts_per_placement",
    "tier_broadcasts_per_placement",
    "probes_per_placement",
    "audit_ok",
    "overcommitted",
    "leaked_reservations",
    "duplicate_placements",
    "orphaned_allocations",
    "lost_messages",
    "prefilled_instances",
    "virtual_s",
    "events",
    "wall_s",
)


@dataclass
class RunResult:
    system: str
    offered_load: float
    nodes: int
    requests: int
    placed: int = 0
    failed: int = 0
    false_failures: int = 0
    latencies_s: list[float] = field(default_factory=list)
    reschedules: int = 0
    messages: int = 0
    state_messages: int = 0
    #: reservoir: the deliveries of :data:`ROSTER_KINDS`
    roster_messages: int | None = None
    start_messages: int | None = None
    roster_entries: int | None = None
    roster_bytes: float | None = None
    restarts: int | None = None
    reserved_fraction: float = 0.0
    fill_at_first_failure: float | None = None
    broadcasts: int | None = None
    tier_broadcasts: int | None = None
    probes: int | None = None
    #: audit counts (reservoir only): overcommitted, leaked_reservations, ...
    audit: dict[str, int] | None = None
    deliveries_by_kind: dict[str, int] = field(default_factory=dict)
    publishes_by_kind: dict[str, int] = field(default_factory=dict)
    sends_by_kind: dict[str, int] = field(default_factory=dict)
    dropped_by_reason: dict[str, int] = field(default_factory=dict)
    unroutable_by_kind: dict[str, int] = field(default_factory=dict)
    lost: int = 0
    prefilled: int = 0
    events: int = 0
    virtual_s: float = 0.0
    wall_s: float = 0.0

    @property
    def audit_ok(self) -> bool | None:
        if self.audit is None:
            return None
        return not (
            self.audit["overcommitted"]
            or self.audit["leaked_reservations"]
            or self.audit["duplicate_placements"]
        )

    def latency_ms(self, quantile: float) -> float | None:
        if not self.latencies_s:
            return None
        return float(np.quantile(np.asarray(self.latencies_s), quantile)) * 1000

    def record_failure(self, some_node_had_room: bool, allocated_fraction: float) -> None:
        self.failed += 1
        if some_node_had_room:
            self.false_failures += 1
        if self.fill_at_first_failure is None:
            self.fill_at_first_failure = allocated_fraction

    def row(self) -> dict[str, Any]:
        """The run as one flat row of JSON-ready values."""
        per = max(self.placed, 1)
        audit = self.audit or {}

        def rounded(value: float | None, digits: int = 4) -> float | None:
            return None if value is None else round(value, digits)

        return {
            "system": self.system,
            "offered_load": self.offered_load,
            "requests": self.requests,
            "placed": self.placed,
            "failed": self.failed,
            "success_rate": rounded(self.placed / self.requests if self.requests else None, 6),
            "false_failures": self.false_failures,
            "p50_ms": rounded(self.latency_ms(0.5), 3),
            "p99_ms": rounded(self.latency_ms(0.99), 3),
            "reschedules_per_placement": rounded(self.reschedules / per),
            "messages_per_placement": rounded(self.messages / per, 2),
            "state_messages_per_placement": rounded(self.state_messages / per, 2),
            "roster_messages_per_placement": None
            if self.roster_messages is None
            else rounded(self.roster_messages / per, 2),
            "conversation_messages_per_placement": None
            if self.roster_messages is None
            else rounded((self.messages - self.roster_messages) / per, 2),
            "requestor_start_messages": self.start_messages,
            "roster_entries_max": self.roster_entries,
            "roster_mb_max": None
            if self.roster_bytes is None
            else rounded(self.roster_bytes / 1e6, 3),
            "requestor_restarts": self.restarts,
            "reserved_fraction": rounded(self.reserved_fraction, 6),
            "fill_at_first_failure": rounded(self.fill_at_first_failure),
            "broadcasts_per_placement": None
            if self.broadcasts is None
            else rounded(self.broadcasts / per),
            "tier_broadcasts_per_placement": None
            if self.tier_broadcasts is None
            else rounded(self.tier_broadcasts / per),
            "probes_per_placement": None if self.probes is None else rounded(self.probes / per),
            "audit_ok": self.audit_ok,
            "overcommitted": audit.get("overcommitted"),
            "leaked_reservations": audit.get("leaked_reservations"),
            "duplicate_placements": audit.get("duplicate_placements"),
            "orphaned_allocations": audit.get("orphaned_allocations"),
            "lost_messages": self.lost,
            "prefilled_instances": self.prefilled,
            "virtual_s": round(self.virtual_s, 3),
            "events": self.events,
            "wall_s": round(self.wall_s, 3),
            "deliveries_by_kind": dict(sorted(self.deliveries_by_kind.items())),
            "publishes_by_kind": dict(sorted(self.publishes_by_kind.items())),
            "sends_by_kind": dict(sorted(self.sends_by_kind.items())),
            "dropped_by_reason": dict(sorted(self.dropped_by_reason.items())),
            "unroutable_by_kind": dict(sorted(self.unroutable_by_kind.items())),
        }
