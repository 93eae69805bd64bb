"""End to end: ``reservoir serve`` in a process of its own in front of three real
``reservoir node`` processes on a real RabbitMQ, driven over HTTP by concurrent clients,
asked for a dry run by ``reservoir request --dry-run``, its ``/metrics`` and a node's
checked against what happened, stopped with SIGTERM, and the cluster audited over the
broker at the end."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from reservoir.runtime.auditor import audit_cluster, read_placements
from reservoir.testing.processes import NODE_READY, ProcessCluster, ReservoirProcess, free_port
from tests.e2e.serving import NODE_VCPUS, node_args, wait_until_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]

#: node names are queue names on the whole vhost: unique per run, so that nothing else
#: on the same RabbitMQ holds them
RUN = uuid.uuid4().hex[:6]
NODES = tuple(f"serve-{RUN}-{letter}" for letter in "abc")
PROBLEM_JSON = "application/problem+json"


@dataclass
class Deployment:
    url: str
    base_url: str
    serve: ReservoirProcess
    nodes: list[ReservoirProcess]
    #: the first node serves its metrics here
    node_metrics_port: int
    env: dict[str, str]


def sample(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus exposition, parsed (so the exposition is valid)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for found in family.samples:
            if found.name == name and all(found.labels.get(k) == v for k, v in labels.items()):
                return float(found.value)
    raise AssertionError(f"no {name}{labels} in the exposition")


@pytest.fixture
def deployment(reservoir_amqp_url: str, tmp_path: Path) -> Iterator[Deployment]:
    # PYTHONPATH passes through, so the children run this tree's reservoir
    with ProcessCluster(reservoir_amqp_url, tmp_path) as cluster:
        metrics_port = free_port()
        nodes = [
            cluster.start(name, *node_args(name, tmp_path, metrics_port if i == 0 else None))
            for i, name in enumerate(NODES)
        ]
        port = free_port()
        serve = cluster.start("serve", "serve", "--port", str(port))
        for node in nodes:
            node.wait_for(NODE_READY)
        base_url = f"http://127.0.0.1:{port}"
        wait_until_ready(base_url, serve)
        yield Deployment(reservoir_amqp_url, base_url, serve, nodes, metrics_port, cluster.env)


def test_the_service_places_reads_lists_releases_and_explains_over_http(
    deployment: Deployment,
) -> None:
    shape = {"vcpus": 1, "memory_mb": 512}

    # a dry run first: every node could take it, and nothing is held afterwards
    asked = subprocess.run(
        [sys.executable, "-m", "reservoir.cli", "request", "--vcpus", "2", "--memory-mb", "512",
         "--count", "3", "--require", "HW_GPU", "--dry-run", "--json"],
        env=deployment.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert asked.returncode == 1, asked.stderr  # no node has the trait: not room enough
    dry = json.loads(asked.stdout)
    assert dry["nodes_answering"] == 3 and dry["room"] == 0
    assert all(n["reasons"] == ["trait HW_GPU missing"] for n in dry["nodes"]), dry
    asked = subprocess.run(
        [sys.executable, "-m", "reservoir.cli", "request", "--vcpus", "2", "--memory-mb", "512",
         "--count", "3", "--dry-run", "--json"],
        env=deployment.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    dry = json.loads(asked.stdout)
    assert dry["would_place"] is True
    assert sorted(n["name"] for n in dry["nodes"]) == sorted(NODES)
    assert all(n["slots"] == 3 for n in dry["nodes"]), dry
    held = audit_cluster(deployment.url, expect_nodes=3, wait_s=10)
    assert held.ok and (held.allocations, held.reservations) == (0, 0), held.as_json()

    async def scenario() -> tuple[list[dict[str, Any]], str]:
        async with httpx.AsyncClient(base_url=deployment.base_url, timeout=60.0) as client:
            # concurrent clients, each with a key of its own
            created = await asyncio.gather(
                *(
                    client.post(
                        "/v1/reservations", json=shape, headers={"Idempotency-Key": f"k{i}"}
                    )
                    for i in range(12)
                )
            )
            assert [c.status_code for c in created] == [201] * 12, [c.text for c in created]
            placed = [c.json() for c in created]
            assert sorted(p["request_id"] for p in placed) == sorted(f"k{i}" for i in range(12))

            reads = await asyncio.gather(
                *(client.get(f"/v1/reservations/{p['request_id']}") for p in placed)
            )
            assert [r.json() for r in reads] == placed

            # an idempotent retry, and the same key with another body
            retried = await client.post(
                "/v1/reservations", json=shape, headers={"Idempotency-Key": "k0"}
            )
            assert retried.status_code == 200
            assert retried.json()["allocations"] == placed[0]["allocations"]
            reused = await client.post(
                "/v1/reservations",
                json={"vcpus": 2, "memory_mb": 512},
                headers={"Idempotency-Key": "k0"},
            )
            assert reused.status_code == 422
            assert reused.headers["content-type"] == PROBLEM_JSON
            assert "different body" in reused.json()["detail"]

            # a failure with its explanation: no node has 64 VCPUs
            failed = await client.post("/v1/reservations", json={"vcpus": 64, "memory_mb": 1})
            assert failed.status_code == 409
            assert failed.headers["content-type"] == PROBLEM_JSON
            problem = failed.json()
            assert "VCPU" in problem["detail"]
            assert problem["reasons"] == {"VCPU larger than one instance may take": 3}

            listed = await client.get("/v1/nodes", params={"expect_nodes": 3, "wait_s": 10})
            assert listed.status_code == 200
            nodes = listed.json()
            assert sorted(n["name"] for n in nodes) == sorted(NODES)
            assert sum(n["allocations"] for n in nodes) == 12
            assert sum(n["usage"]["VCPU"]["used"] for n in nodes) == 12
            assert all(n["usage"]["VCPU"]["capacity"] == NODE_VCPUS for n in nodes)

            # release a third, concurrently
            released = await asyncio.gather(
                *(client.delete(f"/v1/reservations/{p['request_id']}") for p in placed[:4])
            )
            assert [r.status_code for r in released] == [204] * 4
            assert (await client.get("/v1/reservations/k0")).status_code == 404
            after = (await client.get("/v1/nodes", params={"expect_nodes": 3})).json()
            assert sum(n["allocations"] for n in after) == 8

            exposition = await client.get("/metrics")
            assert exposition.status_code == 200
            return placed[4:], exposition.text

    held, metrics = asyncio.run(scenario())
    # the service's own record: 12 placed (replays not counted), one not placed
    assert 'reservoir_service_placements_total{partial="false"} 12.0' in metrics
    assert 'reservoir_service_placement_failures_total{reason="not_placed"} 1.0' in metrics
    assert 'reservoir_service_placement_seconds_count{outcome="placed"} 12.0' in metrics
    assert "reservoir_service_placements_held 8.0" in metrics
    assert (
        'reservoir_service_http_requests_total{method="POST",route="/v1/reservations",'
        'status="201"} 12.0'
    ) in metrics
    # its requestor's, in the same exposition: the protocol's view of the same work
    assert sample(metrics, "reservoir_placement_seconds_count", outcome="placed") == 12
    assert sample(metrics, "reservoir_placement_seconds_count", outcome="failed") == 1
    assert sample(metrics, "reservoir_placement_failures_total", reason="not_placed") == 1
    assert sample(metrics, "reservoir_placement_offers_count") == 13
    assert sample(metrics, "reservoir_messages_sent_total", kind="award") >= 12
    assert sample(metrics, "process_resident_memory_bytes") > 0
    # and a node's, on its own port: what it holds, what became of its reservations
    first = NODES[0]
    node_url = f"http://127.0.0.1:{deployment.node_metrics_port}/metrics"
    node_metrics = httpx.get(node_url, timeout=10).text
    allocations = sample(node_metrics, "reservoir_node_allocations", node=first)
    awarded = sample(node_metrics, "reservoir_node_reservations_ended_total", node=first,
                     how="awarded")  # fmt: skip
    assert awarded >= allocations
    assert sample(node_metrics, "reservoir_node_dry_runs_total", node=first) == 2
    vcpus = sample(node_metrics, "reservoir_node_resource_units", node=first, state="allocated",
                   **{"class": "VCPU"})  # fmt: skip
    assert vcpus == allocations

    # SIGTERM: the service closes its requestor and exits cleanly
    assert deployment.serve.terminate() == 0, "".join(deployment.serve.said)
    assert any("Application shutdown complete" in line for line in deployment.serve.said)

    placements = read_placements(json.dumps(p) for p in held)
    report = audit_cluster(deployment.url, placements=placements, expect_nodes=3, wait_s=10)
    assert report.ok, report.as_json()
    assert report.allocations == 8
    assert report.orphans == ()


def test_sigterm_with_requests_in_flight_lets_them_finish_or_fail_clearly(
    deployment: Deployment,
) -> None:
    """Every client hears a placement (201) or a problem (503 while shutting down), or
    cannot connect once the service stopped listening; the service exits 0, and the nodes
    hold exactly the placements clients heard of."""

    async def scenario() -> list[httpx.Response | BaseException]:
        async with httpx.AsyncClient(base_url=deployment.base_url, timeout=60.0) as client:

            async def place(i: int) -> httpx.Response:
                return await client.post(
                    "/v1/reservations",
                    json={"vcpus": 1, "memory_mb": 256},
                    headers={"Idempotency-Key": f"t{i}"},
                )

            first = await place(0)
            assert first.status_code == 201, first.text
            posts = [asyncio.create_task(place(i)) for i in range(1, 21)]
            await asyncio.sleep(0)  # let them start: then stop the service under them
            deployment.serve.process.send_signal(signal.SIGTERM)
            answers = await asyncio.gather(*posts, return_exceptions=True)
            return [first, *answers]

    answers = asyncio.run(scenario())
    assert deployment.serve.process.wait(timeout=30) == 0, "".join(deployment.serve.said)
    placed: list[dict[str, Any]] = []
    for answer in answers:
        if isinstance(answer, httpx.Response):
            if answer.status_code == 201:
                placed.append(answer.json())
            else:
                assert answer.status_code == 503, answer.text
                assert answer.headers["content-type"] == PROBLEM_JSON
        else:
            assert isinstance(answer, httpx.TransportError), repr(answer)
    report = audit_cluster(
        deployment.url,
        placements=read_placements(json.dumps(p) for p in placed),
        expect_nodes=3,
        wait_s=10,
    )
    assert report.ok, report.as_json()
    assert report.allocations == len(placed)
    assert report.orphans == ()


def test_the_service_holds_its_ground_under_bad_queries_and_long_node_listings(
    deployment: Deployment,
) -> None:
    """Over real HTTP, on a replica with its access log on: a /v1/activity bucket small
    enough to overflow (or to build a 60 MB body) is a 422 problem, logged and counted;
    eight listings of the nodes waiting 8 s each hold up no reservation's GET."""
    port = free_port()
    replica = ReservoirProcess(
        "serve-ground", ["serve", "--port", str(port), "--access-log"], deployment.env
    )
    try:
        base_url = f"http://127.0.0.1:{port}"
        wait_until_ready(base_url, replica)

        async def scenario() -> tuple[list[httpx.Response], str, dict[str, Any]]:
            async with httpx.AsyncClient(base_url=base_url, timeout=60.0) as client:
                tiny = [
                    await client.get("/v1/activity", params={"bucket_s": value})
                    for value in ("5e-324", "1e-300", "1e-11", "1e-5")
                ]
                placed = await client.post("/v1/reservations", json={"vcpus": 1})
                assert placed.status_code == 201, placed.text
                request_id = placed.json()["request_id"]
                listings = [
                    asyncio.create_task(client.get("/v1/nodes", params={"wait_s": 8}))
                    for _ in range(8)
                ]
                await asyncio.sleep(0.5)  # every listing asked and waiting
                read = await client.get(f"/v1/reservations/{request_id}")
                waiting = [not listing.done() for listing in listings]
                assert read.status_code == 200, read.text
                assert all(waiting), waiting  # answered while all eight still waited
                for listed in await asyncio.gather(*listings):
                    assert sorted(n["name"] for n in listed.json()) == sorted(NODES)
                freed = await client.delete(f"/v1/reservations/{request_id}")
                assert freed.status_code == 204, freed.text
                return tiny, (await client.get("/metrics")).text, placed.json()

        tiny, metrics, _placed = asyncio.run(scenario())
        for answer in tiny:
            assert answer.status_code == 422, answer.text[:200]
            assert answer.headers["content-type"] == PROBLEM_JSON
            assert answer.json()["errors"][0]["field"] == "query.bucket_s"
            assert len(answer.content) < 1000
        counted = 'method="GET",route="/v1/activity",status="422"} 4.0'
        assert f"reservoir_service_http_requests_total{{{counted}" in metrics
        assert replica.terminate() == 0, "".join(replica.said)
        access = [line for line in replica.said if "GET /v1/activity 422" in line]
        assert len(access) == 4, "".join(replica.said)
    finally:
        if replica.process.poll() is None:
            replica.process.kill()
            replica.process.wait(timeout=10)
    report = audit_cluster(deployment.url, expect_nodes=3, wait_s=10)
    assert report.ok and report.allocations == 0, report.as_json()
