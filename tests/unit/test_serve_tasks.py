"""``POST /v1/reservations`` with a task, and ``GET`` showing its state, against a live
in-process node that runs it with the exec driver; the audit at the end."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx

from reservoir import NodeAgent, audit
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.runtime.cgroups import CgroupHost
from reservoir.runtime.exec_driver import ExecDriver
from reservoir.runtime.settings import Settings
from reservoir.service import ReservoirService, create_app
from reservoir.testing.asgi import serving


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


def test_a_tasks_output_is_read_over_http_and_followed_until_the_task_ends(
    broker: InProcessBroker, tmp_path: Path, task_files: Path
) -> None:
    node = NodeAgent(broker, name="http-node", vcpus=2, memory_mb=1024,
                     settings=Settings(state_dir=tmp_path, task_drivers=("exec",)))  # fmt: skip
    app = create_app(broker)
    go_on = task_files / "go-on"
    # bounded: a test that fails leaves no task waiting for ever
    wait = f"i=0; while [ ! -e {go_on} ] && [ $i -lt 600 ]; do i=$((i+1)); sleep 0.02; done"
    script = f"echo one; echo oops >&2; {wait}; echo two"

    async def followed(path: str) -> tuple[asyncio.Task[None], asyncio.Queue[dict[str, Any]]]:
        """GET ``path`` with follow=true straight through the ASGI app (httpx's transport
        would wait for the whole body): each message the app sends, as it sends it."""
        sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET",
            "scheme": "http", "path": path, "raw_path": path.encode(),
            "query_string": b"follow=true", "root_path": "", "headers": [(b"host", b"api.test")],
            "client": ("127.0.0.1", 1), "server": ("api.test", 80),
        }  # fmt: skip

        asked = [{"type": "http.request", "body": b"", "more_body": False}]
        connected = asyncio.Event()  # the client never goes away

        async def receive() -> dict[str, Any]:
            if asked:
                return asked.pop()
            await connected.wait()
            return {"type": "http.disconnect"}

        return asyncio.create_task(app(scope, receive, sent.put)), sent

    async def scenario(client: httpx.AsyncClient) -> None:
        created = await client.post(
            "/v1/reservations",
            json={"vcpus": 1, "task": {"driver": "exec", "command": ["sh", "-c", script]}},
        )
        assert created.status_code == 201, created.text
        logs = f"/v1/reservations/{created.json()['request_id']}/logs"
        request, sent = await followed(logs)
        start = await asyncio.wait_for(sent.get(), 10)
        assert (start["type"], start["status"]) == ("http.response.start", 200)
        assert dict(start["headers"])[b"content-type"].startswith(b"text/plain")
        first = await asyncio.wait_for(sent.get(), 10)
        assert (first["body"], first["more_body"]) == (b"one\n", True)  # the task still runs
        go_on.touch()
        rest = b""
        while True:
            message = await asyncio.wait_for(sent.get(), 10)
            rest += message.get("body", b"")
            if not message.get("more_body", False):
                break
        assert rest == b"two\n"  # to the task's end, and the response ends with it
        await request
        now = await client.get(logs)
        assert (now.status_code, now.content) == (200, b"one\ntwo\n")
        errors = await client.get(logs, params={"stream": "stderr"})
        assert errors.content == b"oops\n"
        missing = await client.get("/v1/reservations/no-such-request/logs")
        assert missing.status_code == 404
        assert missing.headers["content-type"] == "application/problem+json"
        bad = await client.get(logs, params={"stream": "stdin"})
        assert bad.status_code == 422

    async def main() -> None:
        async with serving(app) as client:
            await scenario(client)

    asyncio.run(main())
    audit([node.snapshot()]).raise_if_failed()
    node.close()
