"""A task's output is asked only of nodes that keep it: a node of release 0.1.0 drops a
``TaskOutputQuery`` as a kind it does not know, so a reader asks a node's configuration
first (every release answers a ``LedgerQuery``) and tells its caller which release the
node runs rather than waiting out an answer that cannot come (docs/design.md,
"Upgrades"). On the in-process broker, each test ending with the audit."""

from __future__ import annotations

import pytest

from reservoir import NodeAgent, Requestor, audit
from reservoir.broker import Delivery
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.protocol.addresses import node_address
from reservoir.protocol.messages import (
    LedgerQuery,
    LedgerReport,
    decode_message,
    encode_message,
)
from reservoir.runtime.output_reader import OutputNotKnown


class NodeOfTheFirstRelease:
    """A node's inbox answering as release 0.1.0 does: its ledger without a release or
    features, and nothing at all to a kind it does not know (the output query)."""

    def __init__(self, broker: InProcessBroker, name: str) -> None:
        self.name = name
        self.asked: list[str] = []
        self.endpoint = broker.open_endpoint(self.heard, name=node_address(name))

    def heard(self, delivery: Delivery) -> None:
        message = decode_message(delivery.body)
        self.asked.append(message.kind)
        if isinstance(message, LedgerQuery):
            report = LedgerReport(
                sender=self.name, reply_to=self.endpoint.address, audit_id=message.audit_id,
                incarnation="old", part=0, parts=1, tier=10, tallies={},
            )  # fmt: skip
            self.endpoint.send(message.reply_to, encode_message(report))


def test_a_reader_is_told_a_node_of_0_1_0_keeps_no_output_and_asks_it_nothing_it_drops(
    broker: InProcessBroker,
) -> None:
    old = NodeOfTheFirstRelease(broker, "old-1")
    with Requestor(broker) as requestor:
        asked = requestor.output_future("old-1", "r1", "old-1.a.1/0", "stdout", 0)
        with pytest.raises(OutputNotKnown, match=r"node old-1 runs release 0\.1\.0"):
            asked.result(timeout=10)
    assert old.asked == ["ledger_query"]  # never the query it would drop
    old.endpoint.close()


def test_a_node_of_this_release_is_asked_its_features_once_then_read_from(
    broker: InProcessBroker,
) -> None:
    node = NodeAgent(broker, name="new-1", vcpus=2, memory_mb=1024)
    try:
        with Requestor(broker) as requestor:
            for offset in (0, 0):
                answer = requestor.output_future("new-1", "r1", "new-1.x.1/0", "stdout", offset)
                assert answer.result(timeout=10).task is None  # no such task there
            assert requestor.metrics.get("sent", "ledger_query") == 1
            assert requestor.metrics.get("sent", "task_output_query") == 2
        audit([node.snapshot()], []).raise_if_failed()
    finally:
        node.close()
