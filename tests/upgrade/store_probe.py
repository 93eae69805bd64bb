"""Opens a node's state file with the running build, for
tests/upgrade/test_store_across_releases.py, which runs it with a released build's
interpreter too: that release's own store reads and writes, not a copy of its rules. It
imports nothing of reservoir but what it runs with.

    python store_probe.py load DIR NODE
        -> {"allocations": [...], "tasks": [...]} as the build loads them, or
           {"refused": <the one line it refuses the file with>}
    python store_probe.py put DIR NODE ID
        -> the same, after storing one allocation ``ID`` with a NUMA placement and a task,
           and its task's handle
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import msgspec


def _open(directory: str, node: str) -> Any:
    from reservoir.runtime.store import SqliteStore

    return SqliteStore.for_node(Path(directory), node)


def load(directory: str, node: str) -> dict[str, Any]:
    from reservoir.runtime.store import StateError

    try:
        store = _open(directory, node)
    except StateError as error:
        return {"refused": str(error)}
    try:
        return {
            "allocations": [msgspec.to_builtins(dataclasses.asdict(a)) for a in store.load()],
            "tasks": [msgspec.to_builtins(t) for t in store.load_tasks()],
        }
    finally:
        store.close()


def put(directory: str, node: str, allocation_id: str) -> dict[str, Any]:
    from reservoir.protocol.ledger import Allocation
    from reservoir.protocol.messages import NumaPlacement, TaskSpec
    from reservoir.runtime.tasks import TaskHandle

    store = _open(directory, node)
    try:
        store.put(
            Allocation(
                allocation_id=allocation_id,
                request_id=f"request-of-{allocation_id}",
                reservation_id=allocation_id.rsplit("/", 1)[0],
                owner="api-1",
                resources={"VCPU": 2, "MEMORY_MB": 512},
                request_count=2,
                group="web",
                numa=NumaPlacement(
                    cells=(0,), cpus=(4, 5), memory_mb_per_cell=(512,), devices=("0000:3b:00.0",)
                ),
                requested_at_s=1_765_000_000.25,
                task=TaskSpec(
                    driver="exec",
                    command=("sleep", "600"),
                    env={"A": "1"},
                    keep_allocation=True,
                    stop_grace_s=1.5,
                ),
                reply_to="reservoir.requestor.api-1",
            )
        )
        store.put_task(
            TaskHandle(
                driver="exec",
                allocation_id=allocation_id,
                request_id=f"request-of-{allocation_id}",
                ref="4242:17",
                limits="rlimit",
                data={"exit_file": "/tmp/x.exit"},
            )
        )
    finally:
        store.close()
    return load(directory, node)


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "load":
        json.dump(load(*args), sys.stdout)
    elif command == "put":
        json.dump(put(*args), sys.stdout)
    else:
        sys.exit(f"store_probe.py: no command {command!r} (load, put)")
