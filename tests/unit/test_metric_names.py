"""Metric names as Prometheus's naming conventions have them (issue 33, defect 7): base
units, ``_ratio`` for ratios, one unit per family, no ``_percent``; a ``participant``
label that stays the same across restarts; ``reservoir_build_info``; and the HTTP route
template as the route label of every route, the documentation's included."""

from __future__ import annotations

import asyncio
import platform
import socket

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from reservoir import NodeAgent, Requestor
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.runtime.settings import Settings
from reservoir.service import create_app
from reservoir.testing import Simulation
from reservoir.testing.asgi import serving
from reservoir.version import __version__


def families(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Each family's samples, by sample name (the exposition parsed: it is valid)."""
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, float(sample.value)))
    return found


def test_node_metrics_use_base_units_ratios_and_one_unit_per_family(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    registry = prometheus_client.CollectorRegistry()
    sim.add_node("n1", vcpus=4, memory_mb=2048, disk_gb=10, metrics_registry=registry)
    requestor = sim.add_requestor("r1")
    placement = sim.place(requestor, vcpus=1, memory_mb=512, disk_gb=1)
    found = families(prometheus_client.generate_latest(registry).decode())

    assert not [name for name in found if "percent" in name]
    assert "reservoir_node_resource" not in found  # MiB and counts mixed: gone
    assert found["reservoir_node_tier_ratio"] == [({"node": "n1"}, 0.25)]
    [(_, utilisation)] = found["reservoir_node_utilisation_ratio"]
    assert 0 <= utilisation <= 1
    memory = {labels["state"]: v for labels, v in found["reservoir_node_memory_bytes"]}
    assert memory == {"capacity": 2048 * 2**20, "allocated": 512 * 2**20, "held": 0}
    disk = {labels["state"]: v for labels, v in found["reservoir_node_disk_bytes"]}
    assert disk == {"capacity": 10 * 2**30, "allocated": 2**30, "held": 0}
    units = found["reservoir_node_resource_units"]
    assert {labels["class"] for labels, _ in units} == {"VCPU"}  # counted in units only
    assert {labels["state"] for labels, _ in units} == {"capacity", "allocated", "held"}
    sim.finish([placement])


def test_an_unnamed_requestor_counts_under_the_same_participant_after_a_restart(
    broker: InProcessBroker,
) -> None:
    participants = []
    for _restart in range(2):
        registry = prometheus_client.CollectorRegistry()
        requestor = Requestor(broker, metrics_registry=registry)
        participants.append(requestor.metrics.participant)
        requestor.close()
    assert participants == [f"{socket.gethostname()}/requestor"] * 2

    named = Requestor(broker, settings=Settings(requestor_name="web-7"))
    assert named.metrics.participant == "web-7"
    named.close()


def test_two_requestors_in_one_registry_keep_series_of_their_own(broker: InProcessBroker) -> None:
    registry = prometheus_client.CollectorRegistry()
    one = Requestor(broker, metrics_registry=registry)
    two = Requestor(broker, metrics_registry=registry)
    host = socket.gethostname()
    assert (one.metrics.participant, two.metrics.participant) == (
        f"{host}/requestor",
        f"{host}/requestor-2",
    )
    one.metrics.inc("sent", "request")
    two.metrics.inc("sent", "request")
    found = families(prometheus_client.generate_latest(registry).decode())
    series = [
        (labels["participant"], labels["kind"])
        for labels, _ in found["reservoir_messages_sent_total"]
    ]
    assert len(series) == len(set(series))  # no label set twice
    assert {participant for participant, _ in series} == {
        f"{host}/requestor",
        f"{host}/requestor-2",
    }
    one.close()
    two.close()


def test_the_service_exposes_build_info_and_the_route_template_of_every_route(
    broker: InProcessBroker,
) -> None:
    node = NodeAgent(broker, name="m-1", vcpus=4, memory_mb=4096)
    app = create_app(broker)

    async def scenario() -> str:
        async with serving(app) as client:
            for path in ("/docs", "/openapi.json", "/openapi.json", "/nowhere"):
                await client.get(path)
            created = await client.post("/v1/reservations", json={"vcpus": 1})
            assert created.status_code == 201
            await client.get(f"/v1/reservations/{created.json()['request_id']}")
            text: str = (await client.get("/metrics")).text
            return text

    try:
        found = families(asyncio.run(scenario()))
    finally:
        node.close()
    assert found["reservoir_build_info"] == [
        ({"version": __version__, "python": platform.python_version()}, 1.0)
    ]
    routes = {
        labels["route"]: v
        for labels, v in found["reservoir_service_http_requests_total"]
        if labels["method"] == "GET" and labels["status"] in ("200", "404")
    }
    assert routes == {
        "/docs": 1.0,
        "/openapi.json": 2.0,
        "unmatched": 1.0,
        "/v1/reservations/{request_id}": 1.0,
    }
    participants = {labels["participant"] for labels, _ in found["reservoir_messages_sent_total"]}
    assert participants == {f"{socket.gethostname()}/serve"}
