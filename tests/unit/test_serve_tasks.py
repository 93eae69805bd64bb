"""``POST /v1/reservations`` with a task, and ``GET`` showing its state, against a live
in-process node that runs it with the exec driver; the audit at the end."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from brokers.inprocess import InProcessBroker
from reservoir import NodeAgent, audit
from reservoir.runtime.cgroups import CgroupHost
from reservoir.runtime.exec_driver import ExecDriver
from reservoir.runtime.settings import Settings
from reservoir.service import ReservoirService, create_app
from reservoir.testing.asgi import serving


@pytest.fixture
def broker() -> Iterator[InProcessBroker]:
    broker = InProcessBroker()
    yield broker
    broker.close()


def test_a_task_posted_runs_and_get_shows_it_ended_after_its_allocation_was_freed(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    # no control groups: its limits are the same on every host
    exec_driver = ExecDriver(state_dir=tmp_path / "exec", cgroups=CgroupHost())
    node = NodeAgent(broker, name="http-node", vcpus=2, memory_mb=1024,
                     settings=Settings(state_dir=tmp_path), task_drivers=[exec_driver])  # fmt: skip
    app = create_app(broker)

    async def scenario(client: httpx.AsyncClient, service: ReservoirService) -> None:
        created = await client.post(
            "/v1/reservations",
            json={"vcpus": 1, "task": {"driver": "exec", "command": ["sh", "-c", "exit 4"]}},
        )
        assert created.status_code == 201, created.text
        request_id = created.json()["request_id"]
        for _ in range(100):
            read = await client.get(f"/v1/reservations/{request_id}")
            assert read.status_code == 200, read.text
            tasks = read.json()["tasks"]
            if tasks and tasks[0]["state"] == "exited":
                break
            await asyncio.sleep(0.05)
        (task,) = tasks
        assert (task["node"], task["exit_code"], task["limits"]) == ("http-node", 4, "none")
        assert read.json()["allocations"] == []  # the task's end freed it
        bad = await client.post("/v1/reservations", json={"vcpus": 1, "task": {"driver": "X"}})
        assert bad.status_code == 422

    async def main() -> None:
        async with serving(app) as client:
            service = app.state.reservoir
            assert isinstance(service, ReservoirService)
            await scenario(client, service)

    asyncio.run(main())
    assert node.allocations() == []
    audit([node.snapshot()]).raise_if_failed()
    node.close()
