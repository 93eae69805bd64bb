"""End to end: two replicas of ``reservoir serve`` (processes of their own, on two ports)
in front of two real ``reservoir node`` processes on a real RabbitMQ. A placement made on
replica A is read, retried and released on replica B; A is restarted and reads what the
nodes hold; the cluster is audited over the broker at the end, and the broker is left as
it was found (the run's exchanges deleted, no queue of the run left behind)."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from reservoir.brokers import BrokerUrl, admin
from reservoir.protocol.addresses import node_address, requestor_address
from reservoir.runtime.auditor import audit_cluster, read_placements
from reservoir.testing.processes import NODE_READY, ProcessCluster, ReservoirProcess, free_port
from tests.e2e.serving import node_args, wait_until_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]

RUN = uuid.uuid4().hex[:6]
NODES = tuple(f"replicas-{RUN}-{letter}" for letter in "ab")
PROBLEM_JSON = "application/problem+json"
SHAPE = {"vcpus": 1, "memory_mb": 512}
#: the tree under test, for the children (their working directory is the test's)
TREE = str(Path(__file__).resolve().parents[2])


@dataclass
class Replica:
    name: str
    port: int
    process: ReservoirProcess

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class Cluster:
    processes: ProcessCluster
    nodes: list[ReservoirProcess]
    replicas: dict[str, Replica]
    #: the requestors the replicas ran (from their /metrics), whose inboxes must be gone
    requestors: set[str]

    @property
    def url(self) -> str:
        return self.processes.url

    @property
    def env(self) -> dict[str, str]:
        return self.processes.env

    def start(self, name: str, port: int) -> Replica:
        process = self.processes.start(f"serve {name}", "serve", "--port", str(port))
        replica = self.replicas[name] = Replica(name, port, process)
        wait_until_ready(replica.base_url, process)
        return replica


@pytest.fixture
def cluster(reservoir_amqp_url: str, tmp_path: Path) -> Iterator[Cluster]:
    url = reservoir_amqp_url
    path = os.pathsep.join(p for p in (TREE, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "RESERVOIR_BROKER_URL": url, "PYTHONPATH": path}
    with ProcessCluster(url, tmp_path, env) as processes:
        nodes = [processes.start(name, *node_args(name, tmp_path)) for name in NODES]
        cluster = Cluster(processes, nodes, {}, set())
        for node in nodes:
            node.wait_for(NODE_READY)
        cluster.start("a", free_port())
        cluster.start("b", free_port())
        yield cluster
    # the broker as it was found: the run's exchanges (deleted here, before the plugin's
    # own fixture would) and every inbox of the run gone
    topology = admin(url)
    assert topology is not None
    topology.delete_reservoir_exchanges()
    assert not topology.exchange_exists(BrokerUrl.parse(url).exchange)
    assert not topology.exchange_exists(BrokerUrl.parse(url).inbox_exchange)
    inboxes = [node_address(n) for n in NODES]
    inboxes += [requestor_address(r) for r in cluster.requestors]
    inboxes += [requestor_address(f"{r}.find") for r in cluster.requestors]
    assert not queues_left(url, inboxes)


def queues_left(url: str, names: list[str]) -> list[str]:
    """The queues among ``names`` that still exist on the broker."""
    import pika
    import pika.exceptions

    parsed = BrokerUrl.parse(url)
    params = pika.ConnectionParameters(
        host=parsed.host or "localhost",
        port=parsed.port or 5672,
        virtual_host=parsed.vhost,
        credentials=pika.PlainCredentials(parsed.username or "guest", parsed.password or "guest"),
    )
    left = []
    with pika.BlockingConnection(params) as connection:
        for name in names:
            channel = connection.channel()
            try:
                channel.queue_declare(name, passive=True)
            except pika.exceptions.ChannelClosedByBroker as error:
                if error.reply_code != 404:  # anything else: it may still be there
                    raise
                continue
            left.append(name)
            channel.close()
    return left


def counts(text: str) -> tuple[str, dict[tuple[str, str], float]]:
    """The replica's requestor name, and its messages sent and received by kind."""
    from prometheus_client.parser import text_string_to_metric_families

    participant = ""
    found: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "reservoir_requestor_in_flight":
                participant = sample.labels["participant"]
            elif sample.name in (
                "reservoir_messages_sent_total",
                "reservoir_messages_received_total",
            ):
                way = "sent" if "sent" in sample.name else "received"
                found[(way, sample.labels["kind"])] = sample.value
    return participant, found


def messages(client: httpx.Client, cluster: Cluster) -> dict[tuple[str, str], float]:
    participant, found = counts(client.get("/metrics").text)
    cluster.requestors.add(participant)
    return found


def settled(client: httpx.Client, cluster: Cluster) -> dict[tuple[str, str], float]:
    """The replica's counts once nothing has moved them for 0.3 s (5 s at most): a call
    may answer before every message it caused has arrived (the other node's offer to a
    retried id that one node already holds comes after that node's answer, and is
    released on arrival), and those belong to it, not to the next call measured."""
    reading = messages(client, cluster)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        time.sleep(0.3)
        again = messages(client, cluster)
        if again == reading:
            break
        reading = again
    return reading


def spent(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> dict[str, int]:
    """The messages between two readings, as ``sent lookup`` -> how many. Roster
    announcements are left out: a node whose tier a free changes tells every requestor,
    a cost of the roster's (docs/design.md, the bound), not of the call."""
    keys = (set(before) | set(after)) - {("received", "status")}
    moved = {f"{w} {k}": int(after.get((w, k), 0) - before.get((w, k), 0)) for w, k in keys}
    return {k: n for k, n in sorted(moved.items()) if n}


def allocations(body: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted((a["node"], a["allocation_id"]) for a in body["allocations"])


def test_any_replica_answers_for_what_the_nodes_hold_also_after_a_restart(
    cluster: Cluster,
) -> None:
    a = httpx.Client(base_url=cluster.replicas["a"].base_url, timeout=60)
    b = httpx.Client(base_url=cluster.replicas["b"].base_url, timeout=60)
    with a, b:
        # on A: a generated id over both nodes, and a caller-chosen one
        created = a.post("/v1/reservations", json={**SHAPE, "count": 2})
        assert created.status_code == 201, created.text
        spread = created.json()
        holders = len({n for n, _ in allocations(spread)})
        keyed = a.post("/v1/reservations", json=SHAPE, headers={"Idempotency-Key": f"k-{RUN}"})
        assert keyed.status_code == 201, keyed.text
        kept = keyed.json()

        # on B, which made neither: read (one lookup, an answer per holder)
        before = settled(b, cluster)
        read = b.get(f"/v1/reservations/{spread['request_id']}")
        assert read.status_code == 200, read.text
        assert allocations(read.json()) == allocations(spread)
        get_cost = spent(before, messages(b, cluster))
        assert get_cost == {"received already_placed": holders, "sent lookup": 1}, get_cost

        # the idempotent POST retried on B: the same placement (B's lookup finds it)
        retried = b.post("/v1/reservations", json=SHAPE, headers={"Idempotency-Key": f"k-{RUN}"})
        assert retried.status_code == 201, retried.text
        assert allocations(retried.json()) == allocations(kept)

        # release on B: a lookup, then a Free to each holder, confirmed
        before = settled(b, cluster)
        released = b.delete(f"/v1/reservations/{spread['request_id']}")
        assert released.status_code == 204, released.text
        delete_cost = spent(before, messages(b, cluster))
        assert delete_cost == {
            "received already_placed": holders,
            "received freed": holders,
            "sent free": holders,
            "sent lookup": 1,
        }, delete_cost
        gone = a.get(f"/v1/reservations/{spread['request_id']}")
        assert gone.status_code == 404
        assert gone.headers["content-type"] == PROBLEM_JSON
        assert a.get(f"/v1/reservations/k-{RUN}").json() == kept  # A's own, confirmed

        # A restarted: it remembers nothing, and reads what the nodes hold
        messages(a, cluster)
        assert cluster.replicas["a"].process.terminate() == 0
        restarted = cluster.start("a", cluster.replicas["a"].port)
        read = a.get(f"/v1/reservations/k-{RUN}")
        assert read.status_code == 200, read.text
        assert allocations(read.json()) == allocations(kept)
        messages(a, cluster)
        assert restarted.process.process.poll() is None

        report = audit_cluster(
            cluster.url, placements=read_placements([read.text]), expect_nodes=2, wait_s=10
        )
        assert report.ok, report.as_json()
        assert (report.allocations, report.reservations, report.orphans) == (1, 0, ())

        # released through the restarted A: nothing held, the key free
        assert a.delete(f"/v1/reservations/k-{RUN}").status_code == 204
        assert b.get(f"/v1/reservations/k-{RUN}").status_code == 404

    for replica in cluster.replicas.values():
        assert replica.process.terminate() == 0, "".join(replica.process.said)
    report = audit_cluster(cluster.url, placements=[], expect_nodes=2, wait_s=10)
    assert report.ok, report.as_json()
    assert (len(report.nodes), report.allocations, report.reservations) == (2, 0, 0)
    for node in cluster.nodes:
        # a node stopped by a signal exits 130 (one interruption path); serve drains, 0
        assert node.terminate() == 130, "".join(node.said)
