"""Every message kind of release 0.1.0, twice: with its required fields only (``minimal``)
and with every field it has set to something other than its default (``full``), as JSON
fields. The golden fixtures (``wire/0.1.0/<kind>.<variant>.json``) are these, encoded by
0.1.0's own build: ``python tests/upgrade/wire_examples.py DIR`` run with 0.1.0's
interpreter writes them (tests/upgrade/test_wire_fixtures.py checks they are exactly what
it writes). This file imports nothing of reservoir but what it runs with, so it runs
with either build.

Sets hold one member each, so that their JSON has one order.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REQUEST_ID = "req-7f3a"
NODE = "node-1"
NODE_INBOX = "reservoir.node.node-1"
REQUESTOR = "api-1"
REQUESTOR_INBOX = "reservoir.requestor.api-1"
ROOM = {"VCPU": 3, "MEMORY_MB": 12, "CUSTOM_FPGA": -1}
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
NUMA_PLACEMENT = {
    "cells": [0, 1],
    "cpus": [2, 3, 18, 19],
    "memory_mb_per_cell": [1024, 1024],
    "vcpus_per_cell": [2, 2],
    "hugepage_kb": 2048,
    "devices": ["0000:3b:00.0"],
}
ALLOCATION = {
    "allocation_id": "node-1.9c1e.4/0",
    "resources": {"VCPU": 4, "MEMORY_MB": 2048},
    "numa": NUMA_PLACEMENT,
}
REASON = {"code": "insufficient", "subject": "VCPU", "shortfall": 2, "detail": "2 free of 4"}
TASK = {
    "driver": "exec",
    "command": ["sh", "-c", "echo hello"],
    "env": {"GREETING": "hello"},
    "workdir": "/srv/work",
    "image": "alpine:3.20",
    "keep_allocation": True,
    "stop_grace_s": 2.5,
}
SHAPE: dict[str, Any] = {
    "count": 2,
    "min_count": 1,
    "resources": {"VCPU": 4, "MEMORY_MB": 2048, "CUSTOM_FPGA": 1},
    "required_traits": ["HW_CPU_X86_AVX2"],
    "forbidden_traits": ["COMPUTE_STATUS_DISABLED"],
    "any_of_traits": [["HW_NIC_SRIOV"]],
    "numa": {"nodes": 2, "dedicated_cpus": True, "hugepage_kb": 2048},
    "pci": {"gpu-a100": 1},
    "numa_policy": "required",
    "group": {"name": "web-tier", "policy": "soft-anti-affinity"},
    "explain": True,
    "hints": {"rack": "r12", "weights": [1, 2.5, None, True]},
    "task": TASK,
}


def _message(kind: str, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, **fields}


#: kind -> (minimal fields, full fields)
EXAMPLES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "request": (
        _message("request", request_id=REQUEST_ID, sender=REQUESTOR, reply_to=REQUESTOR_INBOX,
                 resources={"VCPU": 1}, tier=10, attempt=1, ttl_s=5.0),
        _message("request", request_id=REQUEST_ID, sender=REQUESTOR, reply_to=REQUESTOR_INBOX,
                 tier=25, attempt=3, ttl_s=7.5, probed_node=NODE, findable=True,
                 findable_when_placed=True, declines_wanted=True, dry_run=True,
                 traceparent=TRACEPARENT, **SHAPE),
    ),
    "lookup": (
        _message("lookup", request_id=REQUEST_ID, sender=REQUESTOR, reply_to=REQUESTOR_INBOX),
        _message("lookup", request_id=REQUEST_ID, sender=REQUESTOR, reply_to=REQUESTOR_INBOX,
                 following=True),
    ),
    "offer": (
        _message("offer", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX,
                 reservation_id="node-1.9c1e.4", attempt=1, slots=1, utilisation=0.25,
                 ttl_s=5.0),
        _message("offer", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX,
                 reservation_id="node-1.9c1e.4", attempt=2, slots=2, utilisation=0.5,
                 score=1.75, ttl_s=4.5, group_members=3, room=ROOM),
    ),
    "decline": (
        _message("decline", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX, attempt=1),
        _message("decline", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX, attempt=2,
                 busy=True, reasons=[REASON], group_members=1, room=ROOM),
    ),
    "already_placed": (
        _message("already_placed", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX,
                 allocations=[]),
        _message("already_placed", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX,
                 allocations=[ALLOCATION], owner=REQUESTOR, requested_at_s=1_765_000_000.5,
                 instances=2, tasks=[{"allocation_id": "node-1.9c1e.4/0", "state": "exited",
                                      "driver": "exec", "exit_code": 3, "reason": "exit 3",
                                      "limits": "rlimit", "kept": True}]),
    ),
    "award": (
        _message("award", request_id=REQUEST_ID, sender=REQUESTOR, reply_to=REQUESTOR_INBOX,
                 reservation_id="node-1.9c1e.4", slots=1),
        _message("award", request_id=REQUEST_ID, sender=REQUESTOR, reply_to=REQUESTOR_INBOX,
                 reservation_id="node-1.9c1e.4", slots=2, traceparent=TRACEPARENT,
                 requested_at_s=1_765_000_000.5, instances=2),
    ),
    "assessment": (
        _message("assessment", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX,
                 slots=0, utilisation=0.0, tier=10),
        _message("assessment", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX,
                 slots=3, utilisation=0.75, score=-0.5, tier=100, busy=True, reasons=[REASON]),
    ),
    "release": (
        _message("release", request_id=REQUEST_ID, sender=REQUESTOR,
                 reservation_id="node-1.9c1e.4"),
        _message("release", request_id=REQUEST_ID, sender=REQUESTOR,
                 reservation_id="node-1.9c1e.4"),
    ),
    "accepted": (
        _message("accepted", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX,
                 reservation_id="node-1.9c1e.4", allocations=[]),
        _message("accepted", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX,
                 reservation_id="node-1.9c1e.4", allocations=[ALLOCATION], room=ROOM),
    ),
    "refused": (
        _message("refused", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX,
                 reservation_id="node-1.9c1e.4", reason=""),
        _message("refused", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX,
                 reservation_id="node-1.9c1e.4", reason="the reservation expired"),
    ),
    "free": (
        _message("free", request_id=REQUEST_ID, sender=REQUESTOR, reply_to=REQUESTOR_INBOX),
        _message("free", request_id=REQUEST_ID, sender=REQUESTOR, reply_to=REQUESTOR_INBOX,
                 allocation_ids=["node-1.9c1e.4/0"], reservation_id="node-1.9c1e.4"),
    ),
    "freed": (
        _message("freed", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX),
        _message("freed", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX,
                 allocation_ids=["node-1.9c1e.4/0"], reservation_id="node-1.9c1e.4",
                 freed=["node-1.9c1e.4/0"], room=ROOM),
    ),
    "status": (
        _message("status", sender=NODE, reply_to=NODE_INBOX, tier=10),
        _message("status", request_id="roster", sender=NODE, reply_to=NODE_INBOX, tier=75,
                 leaving=True, answering=True, room=ROOM, room_news=True,
                 rejoined_buckets="AAEC"),
    ),
    "roll_call": (
        _message("roll_call", sender=REQUESTOR, reply_to=REQUESTOR_INBOX),
        _message("roll_call", request_id="roster", sender="keeper-1",
                 reply_to="reservoir.requestor.keeper-1", from_keeper=True),
    ),
    "roster_query": (
        _message("roster_query", sender=REQUESTOR, reply_to=REQUESTOR_INBOX, wanted=128),
        _message("roster_query", request_id="roster", sender=REQUESTOR,
                 reply_to=REQUESTOR_INBOX, wanted=16, needs={"VCPU": 4}),
    ),
    "roster_sample": (
        _message("roster_sample", sender="keeper-1", reply_to="reservoir.requestor.keeper-1"),
        _message("roster_sample", request_id="roster", sender="keeper-1",
                 reply_to="reservoir.requestor.keeper-1",
                 members=[{"name": NODE, "address": NODE_INBOX, "tier": 25, "room": ROOM}]),
    ),
    "keeper_up": (
        _message("keeper_up", sender="keeper-1", reply_to="reservoir.requestor.keeper-1"),
        _message("keeper_up", request_id="roster", sender="keeper-1",
                 reply_to="reservoir.requestor.keeper-1"),
    ),
    "ledger_query": (
        _message("ledger_query", sender="auditor-1", reply_to="reservoir.requestor.auditor-1",
                 audit_id="audit-5d2e"),
        _message("ledger_query", request_id="audit", sender="auditor-1",
                 reply_to="reservoir.requestor.auditor-1", audit_id="audit-5d2e"),
    ),
    "ledger_report": (
        _message("ledger_report", sender=NODE, reply_to=NODE_INBOX, audit_id="audit-5d2e",
                 incarnation="9c1e", part=0, parts=1, tier=10, tallies={}),
        _message("ledger_report", request_id="audit", sender=NODE, reply_to=NODE_INBOX,
                 audit_id="audit-5d2e", incarnation="9c1e", part=0, parts=2, tier=50,
                 tallies={"VCPU": {"capacity": 30, "allocated": 4, "reserved": 2, "total": 16,
                                   "host_reserved": 1, "allocation_ratio": 2.0}},
                 allocations=[{"allocation_id": "node-1.9c1e.4/0", "request_id": REQUEST_ID,
                               "reservation_id": "node-1.9c1e.4", "owner": REQUESTOR,
                               "resources": {"VCPU": 4}, "request_count": 2}],
                 reservations=[{"reservation_id": "node-1.9c1e.5", "request_id": "req-8",
                                "owner": REQUESTOR, "slots": 1, "per_instance": {"VCPU": 2},
                                "expires_in_s": 3.25}],
                 violations=["VCPU: allocated 40 > capacity 30"],
                 configuration={"name": NODE, "vcpus": 16, "sources": ["node.toml"]}),
    ),
    "task_state": (
        _message("task_state", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX,
                 allocation_id="node-1.9c1e.4/0", state="started"),
        _message("task_state", request_id=REQUEST_ID, sender=NODE, reply_to=NODE_INBOX,
                 allocation_id="node-1.9c1e.4/0", state="stopped", driver="exec",
                 exit_code=143, reason="released", limits="cgroup", kept=True, answering=True),
    ),
    "task_query": (
        _message("task_query", request_id=REQUEST_ID, sender=REQUESTOR,
                 reply_to=REQUESTOR_INBOX),
        _message("task_query", request_id="tasks", sender=REQUESTOR, reply_to=REQUESTOR_INBOX,
                 every=True),
    ),
    "untrusted": (
        _message("untrusted", request_id="untrusted", sender=REQUESTOR, reason="unknown_key",
                 key_id="n1-old", detail=""),
        _message("untrusted", request_id="untrusted", sender=REQUESTOR,
                 reason="impersonation", key_id="mallory-1",
                 detail="signed with the key 'mallory-1' of node 'mallory'"),
    ),
}  # fmt: skip

VARIANTS = ("minimal", "full")


def encoded(kind: str, variant: str) -> bytes:
    """The example as the running build's codec writes it (its messages module's own
    ``message_from_fields`` and ``encode_message``)."""
    from reservoir.protocol.messages import encode_message, message_from_fields

    fields = EXAMPLES[kind][VARIANTS.index(variant)]
    return encode_message(message_from_fields(fields))


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for kind in sorted(EXAMPLES):
        for variant in VARIANTS:
            path = directory / f"{kind}.{variant}.json"
            path.write_bytes(encoded(kind, variant) + b"\n")
            written.append(path)
    return written


if __name__ == "__main__":
    for path in write(Path(sys.argv[1])):
        print(path)
