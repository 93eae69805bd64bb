"""Long-lived requestors in a process of their own, for tests/e2e/test_keeper_processes.py:
a ``reservoir serve`` replica's or an API worker's requestors, driven over stdin and
reporting on stdout, one JSON object a line.

    python tests/e2e/keeper_requestors.py COUNT RECORD_FILE   (RESERVOIR_BROKER_URL set)

Commands: ``place N`` (the requestors place N single-VCPU requests between them, a thread
each; ``{"event": "progress", "placed": n}`` every 25, then ``{"event": "placed",
"placed": n, "failed": f, "errors": [...]}``; each placement's record goes to RECORD_FILE
as ``reservoir request --json`` prints it); ``sources`` (``{"event": "sources",
"sources": [...], "no_keeper": n, "back_on_keepers": n}``: where each requestor's roster
comes from now, and how often they switched); ``stop``.
"""

from __future__ import annotations

import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import IO

from reservoir import PlacementError, Requestor
from reservoir.runtime.auditor import placement_record
from reservoir.runtime.settings import Settings


def say(event: str, **fields: object) -> None:
    sys.stdout.write(json.dumps({"event": event, **fields}) + "\n")
    sys.stdout.flush()


class Placing:
    """N placements between the requestors, a thread each; each recorded as it is made."""

    def __init__(self, requestors: list[Requestor], record: IO[str]) -> None:
        self.requestors, self.record = requestors, record
        self.lock = threading.Lock()
        self.placed = 0
        self.failed: list[str] = []

    def one(self, index: int) -> None:
        requestor = self.requestors[index % len(self.requestors)]
        try:
            placement = requestor.reserve(vcpus=1, memory_mb=64, timeout_s=30)
        except PlacementError as error:
            with self.lock:
                self.failed.append(str(error))
            return
        with self.lock:
            self.record.write(json.dumps(placement_record(placement)) + "\n")
            self.placed += 1
            if self.placed % 25 == 0:
                say("progress", placed=self.placed)

    def run(self, wanted: int) -> None:
        with ThreadPoolExecutor(len(self.requestors)) as pool:
            list(pool.map(self.one, range(wanted)))
        self.record.flush()
        say("placed", placed=self.placed, failed=len(self.failed), errors=self.failed[:3])


def main() -> None:
    count, record_path = int(sys.argv[1]), sys.argv[2]
    settings = Settings()  # the default roster_from (auto), as every requestor has
    requestors = [Requestor(settings=settings, name=f"e2e-r{i}") for i in range(count)]
    with open(record_path, "a") as record:
        say("ready")
        for line in sys.stdin:
            command = line.split()
            if command[:1] == ["place"]:
                Placing(requestors, record).run(int(command[1]))
            elif command[:1] == ["sources"]:
                say(
                    "sources",
                    sources=[r.machine.roster_source.state for r in requestors],
                    no_keeper=sum(r.machine.counters["no_keeper"] for r in requestors),
                    back_on_keepers=sum(r.machine.counters["back_on_keepers"] for r in requestors),
                )
            elif command[:1] == ["stop"]:
                break
    for requestor in requestors:
        requestor.close()
    say("stopped")


if __name__ == "__main__":
    main()
