"""The cluster-wide auditor over the in-process broker: it finds every live node through
the broker, reads their ledgers from their own reports and judges the invariants."""

from __future__ import annotations

import json

import msgspec.structs
import pytest

from reservoir import NodeAgent, Requestor
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.protocol.ledger import Allocation, Inventory
from reservoir.protocol.messages import LedgerQuery
from reservoir.protocol.node import LEDGER_REPORT_ENTRIES, NodeConfig, NodeMachine
from reservoir.runtime.auditor import LedgerCollector, audit_cluster, read_placements, snapshot_of


def allocation(i: int, request_id: str | None = None, vcpus: int = 1) -> Allocation:
    return Allocation(
        allocation_id=f"a-{i}",
        request_id=request_id or f"r-{i}",
        reservation_id=f"res-{i}",
        owner="requestor-1",
        resources={"VCPU": vcpus},
    )


def test_a_large_ledger_is_reported_in_parts_that_add_up_to_it() -> None:
    held = [allocation(i) for i in range(2 * LEDGER_REPORT_ENTRIES + 7)]
    machine = NodeMachine(
        NodeConfig(name="n1", address="reservoir.node.n1", inventories={"VCPU": Inventory(500)}),
        allocations=held,
    )
    query = LedgerQuery(sender="auditor", reply_to="auditor", audit_id="x1")
    parts = machine.ledger_report(query, now=0.0)
    assert [p.part for p in parts] == [0, 1, 2]
    assert {p.parts for p in parts} == {3}
    snapshot = snapshot_of(parts)
    assert {a.allocation_id for a in snapshot.allocations} == {a.allocation_id for a in held}
    assert snapshot.usages["VCPU"].allocated == len(held)
    assert snapshot.violations == ()


def test_the_auditor_finds_overcommit_in_the_entries_when_the_node_does_not_say_so() -> None:
    # A ledger loaded over a shrunk inventory: 3 VCPUs held where 2 exist.
    machine = NodeMachine(
        NodeConfig(name="n1", address="reservoir.node.n1", inventories={"VCPU": Inventory(2)}),
        allocations=[allocation(i) for i in range(3)],
    )
    parts = machine.ledger_report(LedgerQuery(sender="a", reply_to="a", audit_id="x"), 0.0)
    silent = [msgspec.structs.replace(p, violations=()) for p in parts]
    assert snapshot_of(silent).violations == ("VCPU: allocated 3 + reserved 0 > capacity 2",)


def test_every_live_node_answers_and_the_placements_are_accounted_for(
    broker: InProcessBroker,
) -> None:
    nodes = [NodeAgent(broker, name=f"audited-{i}", vcpus=8, memory_mb=8192) for i in range(4)]
    try:
        with Requestor(broker) as requestor:
            placements = [requestor.reserve(vcpus=2, memory_mb=512) for _ in range(6)]
        found = audit_cluster(broker, placements=placements, wait_s=5.0, expect_nodes=4)
        assert sorted(found.nodes) == sorted(n.name for n in nodes)
        assert found.allocations == 6
        assert found.ok
        assert found.orphans == ()
    finally:
        for node in nodes:
            node.close()


def test_an_allocation_no_caller_heard_of_is_an_orphan_with_the_command_that_frees_it(
    broker: InProcessBroker,
) -> None:
    node = NodeAgent(broker, name="keeper", vcpus=8, memory_mb=8192)
    try:
        with Requestor(broker) as requestor:
            kept = requestor.reserve(vcpus=1, memory_mb=256)
            forgotten = requestor.reserve(vcpus=1, memory_mb=256)
        found = audit_cluster(broker, placements=[kept], wait_s=5.0, expect_nodes=1)
        (orphan,) = found.orphans
        allocation_id = forgotten.allocations[0].allocation_id
        assert allocation_id in orphan
        assert (
            f"reservoir free --node keeper --request-id {forgotten.request_id} "
            f"--allocation {allocation_id}" in orphan
        )
        assert found.report.ok  # an orphan is reported, not an invariant broken
    finally:
        node.close()


def test_a_placement_the_caller_was_told_of_but_no_node_holds_fails_the_audit(
    broker: InProcessBroker,
) -> None:
    node = NodeAgent(broker, name="forgetful", vcpus=8, memory_mb=8192)
    try:
        with Requestor(broker) as requestor:
            placement = requestor.reserve(vcpus=1, memory_mb=256)
        node.free_allocations([a.allocation_id for a in placement.allocations])
        found = audit_cluster(broker, placements=[placement], wait_s=5.0, expect_nodes=1)
        assert not found.ok
        assert any(placement.request_id in d for d in found.report.duplicate_placements)
    finally:
        node.close()


def test_with_no_node_listening_the_audit_ends_at_once_with_nobody(
    broker: InProcessBroker,
) -> None:
    collector = LedgerCollector(broker)
    try:
        collector.ask()
        assert collector.collect(wait_s=30.0) == []
    finally:
        collector.close()


def test_a_report_for_another_audit_is_not_counted(broker: InProcessBroker) -> None:
    node = NodeAgent(broker, name="chatty", vcpus=4, memory_mb=4096)
    first = LedgerCollector(broker)
    second = LedgerCollector(broker)
    try:
        first.ask()
        assert [s.name for s in first.collect(wait_s=5.0, expect_nodes=1)] == ["chatty"]
        assert second.collect(wait_s=0.2) == []
    finally:
        first.close()
        second.close()
        node.close()


def test_the_callers_record_is_read_from_request_json_lines() -> None:
    lines = [
        json.dumps(
            {
                "placed": True,
                "request_id": "r1",
                "allocations": [{"node": "n1", "allocation_id": "a1", "resources": {"VCPU": 1}}],
            }
        ),
        "",
        json.dumps({"placed": False, "request_id": "r2"}),
    ]
    (placement,) = read_placements(lines)
    assert placement.request_id == "r1"
    assert placement.allocations[0].address == "reservoir.node.n1"
    with pytest.raises(ValueError, match="line 1: not a placement"):
        read_placements(['{"placed": true}'])
