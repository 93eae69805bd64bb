"""The callers' record of a chaos run: what each requestor process was told, one JSON line
per event, written before the process acts on it and flushed at once, so a process
killed with SIGKILL loses nothing it had heard.

Events (``e``), each with the wall-clock time ``at``:

- ``boot``: the requestor process (re)started;
- ``start``: a placement begins (``id``, ``shape``, ``deadline``: wall time by which the
  caller must have an answer);
- ``placed``: the caller was told it is placed (the placement as ``reservoir request
  --json`` prints it, under ``placement``);
- ``failed``: the caller was told it is not (``error``);
- ``free``: freeing a placement begins; ``freed``: the nodes confirmed it;
  ``free_incomplete``: not confirmed yet (it is tried again).

A restarted requestor reads its record to carry on: a placement started and never
answered is asked for again under the same request id (the protocol's idempotency key),
a free never confirmed is sent again. :func:`judge` reads every record at the end.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from reservoir.clock import Clock, SystemClock
from reservoir.protocol.placement import Placement
from reservoir.runtime.auditor import read_placements

__all__ = ["CallerRecord", "RecordWriter", "Verdict", "judge", "read_events"]

#: an answer may come this much after the caller's deadline before the caller counts as
#: hung (the requestor's own verdict grace, and a busy machine's scheduling)
HUNG_GRACE_S = 2.0


class RecordWriter:
    """Appends events to one requestor's record; thread-safe."""

    def __init__(self, path: Path, clock: Clock | None = None) -> None:
        self.clock: Clock = clock if clock is not None else SystemClock()
        self._file: TextIO = path.open("a", encoding="utf-8", buffering=1)
        self._lock = threading.Lock()

    def write(self, event: str, **fields: Any) -> None:
        """Append one event, stamped with the wall clock's time."""
        at = self.clock.wall()
        line = json.dumps({"e": event, "at": round(at, 4), **fields}, sort_keys=True)
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_events(path: Path) -> list[dict[str, Any]]:
    """Every whole event of a record (a line cut short by a kill is skipped)."""
    events: list[dict[str, Any]] = []
    if not path.exists():
        return events
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "e" in event:
            events.append(event)
    return events


@dataclass
class CallerRecord:
    """One requestor's record, replayed: what it still owes and what it holds."""

    #: request id -> shape, for placements started and never answered
    unanswered: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    #: request id -> placement JSON, for placements held and not freed
    held: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    #: request ids whose free was started and never confirmed
    freeing: set[str] = field(default_factory=set)
    #: the highest sequence number used in a request id
    last_sequence: int = -1

    @classmethod
    def replay(cls, events: Iterable[Mapping[str, Any]]) -> CallerRecord:
        record = cls()
        for event in events:
            kind, request_id = event["e"], str(event.get("id"))
            if kind == "start":
                record.unanswered[request_id] = event["shape"]
                record.last_sequence = max(record.last_sequence, int(event.get("seq", -1)))
            elif kind == "placed":
                record.unanswered.pop(request_id, None)
                record.held[request_id] = event["placement"]
            elif kind == "failed":
                record.unanswered.pop(request_id, None)
            elif kind == "free":
                record.freeing.add(request_id)
            elif kind == "freed":
                record.freeing.discard(request_id)
                record.held.pop(request_id, None)
        return record


@dataclass(frozen=True)
class Verdict:
    """What the callers' records say, across every requestor of a run."""

    placements: int
    failures: tuple[str, ...]
    hung: tuple[str, ...]
    frees: int
    #: placements callers hold at the end (told placed, never confirmed freed)
    held: tuple[Placement, ...]
    #: frees never confirmed by the end: the placement may or may not still be held
    unconfirmed_frees: tuple[str, ...]


def judge(records: Mapping[str, list[dict[str, Any]]]) -> Verdict:
    """Read every requestor's events. A caller is hung when its answer came more than
    :data:`HUNG_GRACE_S` after its deadline, or never came although its process lived on
    (a later ``boot`` means the process was killed: that caller died, it did not hang)."""
    placed: set[str] = set()
    failures: list[str] = []
    hung: list[str] = []
    frees = 0
    held: list[Placement] = []
    unconfirmed: list[str] = []
    for name, events in sorted(records.items()):
        open_starts: dict[str, dict[str, Any]] = {}
        for event in events:
            kind, request_id = event["e"], str(event.get("id"))
            if kind == "boot":
                open_starts.clear()
            elif kind == "start":
                open_starts[request_id] = event
            elif kind in ("placed", "failed"):
                start = open_starts.pop(request_id, None)
                if start is not None and event["at"] > start["deadline"] + HUNG_GRACE_S:
                    late_s = event["at"] - start["deadline"]
                    hung.append(f"{name}: {request_id} answered {late_s:.1f} s after its deadline")
                if kind == "placed":
                    placed.add(request_id)
                else:
                    failures.append(f"{name}: {request_id}: {event.get('error', '')}")
            elif kind == "freed":
                frees += 1
        hung += [f"{name}: {request_id} never answered" for request_id in open_starts]
        final = CallerRecord.replay(events)
        held += read_placements(json.dumps(p) for p in final.held.values())
        unconfirmed += [f"{name}: {request_id}" for request_id in sorted(final.freeing)]
    return Verdict(
        placements=len(placed),
        failures=tuple(failures),
        hung=tuple(hung),
        frees=frees,
        held=tuple(held),
        unconfirmed_frees=tuple(unconfirmed),
    )
