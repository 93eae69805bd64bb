"""The compose deployment (deploy/compose/compose.yaml) brought up for real: RabbitMQ with
deploy/rabbitmq's definitions, three node agents, two roster keepers and ``reservoir
serve``, all healthy; the host places requests through the ports published on 127.0.0.1
(HTTP, and AMQP with the requestor's credentials) and reads the nodes' state both ways;
the API's requestors take their rosters from the keepers. The deployment is taken
down with its volumes at the end of the module.

The short test runs by default (the deployment is up in about 15 s here); the one marked
``slow`` (``--run-slow``) also restarts a node agent, which must keep its allocations in
its state volume, and releases through the API."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING, Any

import httpx
import pytest

if TYPE_CHECKING:
    from conftest import Compose

pytestmark = pytest.mark.docker

NODES = ("node-1", "node-2", "node-3")
#: the example password of deploy/rabbitmq/definitions.json, as compose.yaml defaults to
REQUESTOR = "reservoir-requestor:requestor-example-change-me"


def api(compose: Compose, replica: str = "api") -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{compose.port(replica, 8000)}", timeout=30)


def reservoir_on_the_host(compose: Compose, *args: str) -> Any:
    """``reservoir ARGS --json`` run on the host, as the requestor, through the published
    AMQP port: its JSON."""
    url = f"amqp://{REQUESTOR}@127.0.0.1:{compose.port('rabbitmq', 5672)}/reservoir"
    done = subprocess.run(
        [sys.executable, "-m", "reservoir.cli", *args, "--json"],
        env={**compose.env, "RESERVOIR_BROKER_URL": url},
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def allocated_vcpus(nodes: list[dict[str, Any]]) -> dict[str, int]:
    """VCPUs allocated per node, from either listing (GET /v1/nodes: a node each, its
    usage per class; ``reservoir nodes -f json``: a row per node and class, in the same
    field names)."""
    return {
        node["name"]: node["usage"]["VCPU"]["used"] if "usage" in node else node["used"]
        for node in nodes
        if node.get("class", "VCPU") == "VCPU"
    }


def test_a_request_placed_through_the_composed_service_is_held_by_a_node(
    compose: Compose,
) -> None:
    with api(compose) as client:
        assert client.get("/readyz").json() == {"status": "ready"}
        key = f"compose-{uuid.uuid4().hex[:8]}"
        placed = client.post(
            "/v1/reservations",
            json={"vcpus": 3, "memory_mb": 2048},
            headers={"Idempotency-Key": key},
        )
        assert placed.status_code == 201, placed.text
        (allocation,) = placed.json()["allocations"]
        assert allocation["node"] in NODES
        assert allocation["resources"] == {"VCPU": 3, "MEMORY_MB": 2048}
        # the other replica answers for it: it asks the nodes
        with api(compose, "api-2") as other:
            read = other.get(f"/v1/reservations/{key}")
            assert read.status_code == 200, read.text
            assert read.json()["allocations"] == placed.json()["allocations"]

        over_http = client.get("/v1/nodes", params={"expect_nodes": 3}).json()
    over_amqp = reservoir_on_the_host(compose, "nodes", "--expect-nodes", "3")

    for listing in (over_http, over_amqp):
        vcpus = allocated_vcpus(listing)
        assert sorted(vcpus) == list(NODES)
        assert vcpus[allocation["node"]] >= 3


#: where a requestor's roster comes from, as the service's /metrics says
ROSTER_SOURCE = re.compile(r'reservoir_requestor_roster_source\{[^}]*source="(\w+)"[^}]*\} (\S+)')


def test_the_composed_service_takes_its_roster_from_the_keepers(compose: Compose) -> None:
    # a replica that started before the keepers follows the nodes until one says it is up
    deadline = time.monotonic() + 10
    for replica in ("api", "api-2"):
        with api(compose, replica) as client:
            while True:
                sources = dict(ROSTER_SOURCE.findall(client.get("/metrics").text))
                if float(sources["keepers"]) == 1 or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        assert float(sources["keepers"]) == 1, (replica, sources)


@pytest.mark.slow
def test_a_restarted_node_agent_keeps_its_allocations_and_the_api_frees_them(
    compose: Compose,
) -> None:
    # placed from the host over AMQP, as a scheduler of its own would
    ours = reservoir_on_the_host(compose, "request", "--vcpus", "5", "--memory-mb", "1024")
    (held,) = ours["allocations"]
    before = allocated_vcpus(reservoir_on_the_host(compose, "nodes", "--expect-nodes", "3"))

    compose("restart", "--timeout", "10", held["node"])
    compose.wait_healthy(len(NODES) + 5)  # RabbitMQ, the two keepers, the API's two replicas
    after = allocated_vcpus(reservoir_on_the_host(compose, "nodes", "--expect-nodes", "3"))
    assert after == before, "the restarted agent lost allocations its state volume held"

    with api(compose) as client:
        key = f"compose-{uuid.uuid4().hex[:8]}"
        placed = client.post(
            "/v1/reservations", json={"vcpus": 7}, headers={"Idempotency-Key": key}
        ).json()
        node = placed["allocations"][0]["node"]
        with_it = allocated_vcpus(client.get("/v1/nodes", params={"expect_nodes": 3}).json())
        assert client.delete(f"/v1/reservations/{key}").status_code == 204
        without_it = allocated_vcpus(client.get("/v1/nodes", params={"expect_nodes": 3}).json())
        assert without_it[node] == with_it[node] - 7
        metrics = client.get("/metrics").text
    assert 'outcome="placed"' in metrics
