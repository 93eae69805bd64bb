"""Faults only a RabbitMQ of the test's own can take without disturbing anyone else, run
on both adapters: the broker application stopped and started again (``rabbitmqctl
stop_app`` / ``start_app``), and a memory alarm that blocks every publisher
(``connection.blocked``) and then clears. Each ends with the cluster audit.

Needs the machine's ``rabbitmq-server`` and root; skipped without them, failed under
``CI``."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from reservoir import NodeAgent, Requestor
from reservoir.brokers import connect
from reservoir.brokers.amqp.threaded import AmqpBroker
from reservoir.runtime.auditor import audit_cluster
from reservoir.testing.rabbitmq_cluster import ClusterUnavailable, RabbitMqCluster

pytestmark = pytest.mark.rabbitmq

SCHEMES = ["amqp", "kombu+amqp"]


@pytest.fixture(scope="module")
def own_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RabbitMqCluster]:
    try:
        broker = RabbitMqCluster(Path(tmp_path_factory.mktemp("own-rabbitmq")), size=1)
    except ClusterUnavailable as error:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run these tests: {error}")
        pytest.skip(str(error))
    with broker:
        yield broker


def url_for(cluster: RabbitMqCluster, scheme: str) -> str:
    return cluster.url(0).replace("amqp://", f"{scheme}://", 1)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_broker_restarted_under_the_participants_and_they_carry_on(
    own_broker: RabbitMqCluster, scheme: str
) -> None:
    node0 = own_broker.nodes[0]
    with connect(url_for(own_broker, scheme)) as broker:
        assert isinstance(broker, AmqpBroker)
        node = NodeAgent(broker, name=f"restarted-{scheme}", vcpus=4, memory_mb=4096)
        try:
            with Requestor(broker) as requestor:
                before = requestor.reserve(vcpus=1, memory_mb=256, timeout_s=20)
                own_broker.ctl(node0, "stop_app")
                own_broker.ctl(node0, "start_app")
                own_broker.ctl(node0, "await_startup")
                assert broker.wait_ready(60, min_reconnects=1)
                after = requestor.reserve(vcpus=1, memory_mb=256, timeout_s=60)
            assert broker.stats.reconnects >= 1
            found = audit_cluster(broker, placements=[before, after], expect_nodes=1, wait_s=10)
            assert found.ok and found.orphans == (), found.as_json()
        finally:
            node.close()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_memory_alarm_holds_placements_back_until_it_clears(
    own_broker: RabbitMqCluster, scheme: str
) -> None:
    node0 = own_broker.nodes[0]
    with connect(url_for(own_broker, scheme)) as broker:
        assert isinstance(broker, AmqpBroker)
        node = NodeAgent(broker, name=f"alarmed-{scheme}", vcpus=4, memory_mb=4096)
        try:
            with Requestor(broker) as requestor:
                requestor.reserve(vcpus=1, memory_mb=256, timeout_s=20)
                own_broker.ctl(node0, "set_vm_memory_high_watermark", "0")
                try:
                    deadline = time.monotonic() + 20
                    while broker.stats.blocked == 0 and time.monotonic() < deadline:
                        # a publish is what makes RabbitMQ tell a connection it is blocked
                        requestor.submit(vcpus=1, memory_mb=128, timeout_s=60)
                        time.sleep(0.2)
                    assert broker.stats.blocked >= 1
                    held = requestor.submit(vcpus=1, memory_mb=128, timeout_s=60)
                    time.sleep(1.0)  # the real broker's alarm, in real time
                    assert not held.done()
                finally:
                    own_broker.ctl(node0, "set_vm_memory_high_watermark", "0.4")
                placement = held.result(timeout=60)
            found = audit_cluster(broker, expect_nodes=1, wait_s=10)
            assert found.ok, found.as_json()
            assert placement.nodes == (f"alarmed-{scheme}",)
        finally:
            node.close()
