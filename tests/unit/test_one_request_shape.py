"""One request shape: the library's keywords, ``reservoir request`` and
``POST /v1/reservations``, given the same request, put the same ``ReservationRequest`` on
the wire; conflicting amounts and a resource class's spelling are judged alike by all three.

The three front doors share one in-process broker here (the CLI's ``connect`` is pointed at
it), and a listener bound to every tier topic hears what each publishes. No node answers,
so each request times out after its first broadcasts; what matters is what was asked."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from click.testing import CliRunner

from reservoir import PlacementError, Requestor
from reservoir.broker import Delivery
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.cli import main
from reservoir.protocol.messages import GroupSpec, NumaSpec, ReservationRequest, TaskSpec
from reservoir.protocol.placement import InvalidRequest, PlacementRequest, request_of
from reservoir.runtime.settings import Settings
from reservoir.service import create_app
from reservoir.testing.asgi import serving

#: the shape's fields, and what the requestor adds that the caller chose (the wait and ids
#: of the conversation differ between requestors and are left out)
COMPARED = (*PlacementRequest.__struct_fields__, "findable", "dry_run")


class Shared:
    """The one broker, as the command opens it; closing it is the test's business."""

    def __init__(self, broker: InProcessBroker) -> None:
        self._broker = broker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._broker, name)

    def close(self) -> None:
        pass


@pytest.fixture
def heard(broker: InProcessBroker) -> Iterator[dict[str, ReservationRequest]]:
    """Every ReservationRequest published on a tier topic, the first of each id."""
    codec = Settings().codec()
    found: dict[str, ReservationRequest] = {}
    lock = threading.Lock()

    def hear(delivery: Delivery) -> None:
        message = codec.decode(delivery.body, 0.0, destination=None, check_replay=False)
        if isinstance(message, ReservationRequest):
            with lock:
                found.setdefault(message.request_id, message)

    listener = broker.open_endpoint(hear, name="reservoir.listener")
    listener.bind("tier.#")
    yield found
    listener.close()


def shape_of(message: ReservationRequest) -> dict[str, Any]:
    return {name: getattr(message, name) for name in COMPARED}


def by_the_library(broker: InProcessBroker, request_id: str) -> None:
    with Requestor(broker) as requestor, pytest.raises(PlacementError):
        requestor.reserve(
            vcpus=2,
            memory_mb=1024,
            resources={"CUSTOM_GPU": 1},
            count=2,
            min_count=1,
            required_traits=["HW_CPU_X86_AVX2"],
            forbidden_traits=["CUSTOM_SLOW"],
            any_of_traits=[{"CUSTOM_RACK_A", "CUSTOM_RACK_B"}, {"CUSTOM_SSD"}],
            group=GroupSpec(name="web", policy="soft-anti-affinity"),
            numa=NumaSpec(nodes=2, dedicated_cpus=True, hugepage_kb=2048),
            pci={"gpu-a100": 1, "nic-vf": 2},
            numa_policy="required",
            hints={"zone": "z1"},
            explain=True,
            request_id=request_id,
            timeout_s=0.3,
        )


def by_the_command(broker: InProcessBroker, request_id: str, monkeypatch: Any) -> None:
    monkeypatch.setattr("reservoir.brokers.connect", lambda url: Shared(broker))
    done = CliRunner().invoke(
        main,
        ["request", "--broker", "memory://", "--vcpus", "2", "--memory-mb", "1024",
         "--resource", "CUSTOM_GPU=1", "--count", "2", "--min-count", "1",
         "--require", "HW_CPU_X86_AVX2", "--forbid", "CUSTOM_SLOW",
         "--any-of", "CUSTOM_RACK_A,CUSTOM_RACK_B",
         "--any-of", "CUSTOM_SSD", "--group", "web", "--policy", "soft-anti-affinity",
         "--numa-nodes", "2", "--pinned", "--hugepage-kb", "2048", "--hint", "zone=z1",
         "--pci", "gpu-a100:1", "--pci", "nic-vf:2", "--numa-policy", "required",
         "--request-id", request_id, "--timeout", "0.3"],
    )  # fmt: skip
    assert done.exit_code == 1, done.output  # not placed: nobody answered


def by_http(broker: InProcessBroker, request_id: str) -> None:
    body = {
        "vcpus": 2, "memory_mb": 1024, "resources": {"CUSTOM_GPU": 1}, "count": 2,
        "min_count": 1, "required_traits": ["HW_CPU_X86_AVX2"],
        "forbidden_traits": ["CUSTOM_SLOW"],
        "any_of_traits": [["CUSTOM_RACK_A", "CUSTOM_RACK_B"], ["CUSTOM_SSD"]],
        "group": "web", "policy": "soft-anti-affinity",
        "numa": {"nodes": 2, "dedicated_cpus": True, "hugepage_kb": 2048},
        "pci": {"gpu-a100": 1, "nic-vf": 2}, "numa_policy": "required",
        "hints": {"zone": "z1"}, "request_id": request_id, "timeout_s": 0.3,
    }  # fmt: skip

    async def post() -> httpx.Response:
        async with serving(create_app(broker)) as client:
            return await client.post("/v1/reservations", json=body)

    response = asyncio.run(post())
    assert response.status_code == 504, response.text


def test_the_three_front_doors_put_the_same_request_on_the_wire(
    broker: InProcessBroker, heard: dict[str, ReservationRequest], monkeypatch: Any
) -> None:
    by_the_library(broker, "by-library")
    by_the_command(broker, "by-command", monkeypatch)
    by_http(broker, "by-http")
    library, command, http = (heard[i] for i in ("by-library", "by-command", "by-http"))
    assert shape_of(library)["any_of_traits"]  # the fields under test did reach the wire
    assert shape_of(library)["numa"] == NumaSpec(nodes=2, dedicated_cpus=True, hugepage_kb=2048)
    assert shape_of(library)["hints"] == {"zone": "z1"}
    assert shape_of(library)["pci"] == {"gpu-a100": 1, "nic-vf": 2}
    assert shape_of(library)["numa_policy"] == "required"
    for other in (command, http):
        assert {**shape_of(other), "request_id": None} == {**shape_of(library), "request_id": None}


@pytest.mark.parametrize(
    "fields",
    [
        {"vcpus": 2, "resources": {"VCPU": 1}},
        {"memory_mb": 512, "resources": {"MEMORY_MB": 1024}},
    ],
)
def test_a_shorthand_and_resources_disagreeing_is_an_error(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequest, match="disagree: give the amount once"):
        request_of(**fields)


def test_a_shorthand_and_resources_agreeing_is_one_amount() -> None:
    assert request_of(vcpus=2, resources={"VCPU": 2}).resources == {"VCPU": 2}


def test_the_command_refuses_disagreeing_amounts_in_one_line() -> None:
    done = CliRunner().invoke(
        main, ["request", "--broker", "memory://", "--vcpus", "2", "--resource", "VCPU=1"]
    )
    assert done.exit_code == 2
    assert "disagree: give the amount once" in done.output


def test_http_refuses_disagreeing_amounts_as_a_422_naming_resources(
    broker: InProcessBroker,
) -> None:
    async def post() -> httpx.Response:
        async with serving(create_app(broker)) as client:
            return await client.post(
                "/v1/reservations", json={"vcpus": 2, "resources": {"VCPU": 1}}
            )

    response = asyncio.run(post())
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "body.resources"


@pytest.mark.parametrize("spelling", ["vcpu", "Vcpu"])
def test_a_resource_class_in_another_case_is_refused_alike_everywhere(
    broker: InProcessBroker, spelling: str
) -> None:
    with pytest.raises(InvalidRequest, match=r"classes are upper case: VCPU"):
        request_of(resources={spelling: 1})
    done = CliRunner().invoke(
        main, ["request", "--broker", "memory://", "--resource", f"{spelling}=1"]
    )
    assert done.exit_code == 2
    assert "classes are upper case: VCPU" in done.output

    async def post() -> httpx.Response:
        async with serving(create_app(broker)) as client:
            return await client.post("/v1/reservations", json={"resources": {spelling: 1}})

    response = asyncio.run(post())
    assert response.status_code == 422
    assert "classes are upper case: VCPU" in response.json()["detail"]


def test_every_field_of_the_request_is_reachable_over_http() -> None:
    from reservoir.service.shapes import ReservationIn

    # request_id comes as the Idempotency-Key header or in the body; the rest by name
    assert set(PlacementRequest.__struct_fields__) <= set(ReservationIn.model_fields)
    assert msgspec.structs.fields(PlacementRequest)  # a struct, read by its fields


def test_the_command_line_refuses_what_the_http_api_refuses_with_the_same_bounds() -> None:
    """``FRONT_DOOR_LIMITS`` are ``POST /v1/reservations``'s own: an amount the HTTP API
    refuses is refused by ``reservoir request`` and ``reservoir run`` too."""
    from annotated_types import Le

    from reservoir.cli.request import request as request_command
    from reservoir.cli.run import run as run_command
    from reservoir.protocol.placement import FRONT_DOOR_LIMITS
    from reservoir.service.shapes import ReservationIn

    for field, limit in FRONT_DOOR_LIMITS.items():
        bounds = [m.le for m in ReservationIn.model_fields[field].metadata if isinstance(m, Le)]
        assert bounds == [limit], field
    for command in (request_command, run_command):
        options = {p.name: p for p in command.params}
        for field, limit in FRONT_DOOR_LIMITS.items():
            assert getattr(options[field].type, "max", None) == limit, (command.name, field)


def test_reservoir_run_puts_the_same_request_on_the_wire_with_its_task(
    broker: InProcessBroker, heard: dict[str, ReservationRequest], monkeypatch: Any
) -> None:
    by_the_library(broker, "by-library")
    monkeypatch.setattr("reservoir.brokers.connect", lambda url: Shared(broker))
    done = CliRunner().invoke(
        main,
        ["run", "--broker", "memory://", "--vcpus", "2", "--memory-mb", "1024",
         "--resource", "CUSTOM_GPU=1", "--count", "2", "--min-count", "1",
         "--require", "HW_CPU_X86_AVX2", "--forbid", "CUSTOM_SLOW",
         "--any-of", "CUSTOM_RACK_A,CUSTOM_RACK_B",
         "--any-of", "CUSTOM_SSD", "--group", "web", "--policy", "soft-anti-affinity",
         "--numa-nodes", "2", "--pinned", "--hugepage-kb", "2048", "--hint", "zone=z1",
         "--pci", "gpu-a100:1", "--pci", "nic-vf:2", "--numa-policy", "required",
         "--request-id", "by-run", "--timeout", "0.3", "--", "sh", "-c", "exit 0"],
    )  # fmt: skip
    assert done.exit_code == 1, done.output  # not placed: nobody answered
    library, run = heard["by-library"], heard["by-run"]
    assert run.task == TaskSpec(driver="exec", command=("sh", "-c", "exit 0"))
    assert {**shape_of(run), "request_id": None, "task": None} == {
        **shape_of(library), "request_id": None}  # fmt: skip
