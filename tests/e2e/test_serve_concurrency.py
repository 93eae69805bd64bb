"""End to end, under concurrency: sixteen HTTP clients at once, each POSTing a
reservation on one ``reservoir serve`` replica, GETting it on the other and DELETEing it
at once, in front of real ``reservoir node`` processes on a real RabbitMQ. No answer may
be a 404 for an id a POST has just placed (nor a 5xx), and the run ends with
``reservoir audit --placements`` over the broker: nothing held, nothing orphaned."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from reservoir.testing.processes import NODE_READY, ProcessCluster, ReservoirProcess, free_port
from tests.e2e.serving import node_args, wait_until_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]

RUN = uuid.uuid4().hex[:6]
NODES = tuple(f"concurrent-{RUN}-{index}" for index in range(4))
CLIENTS = 16
CYCLES_EACH = 15
SHAPE = {"vcpus": 1, "memory_mb": 256}
TREE = str(Path(__file__).resolve().parents[2])


@dataclass
class Service:
    #: the broker URL of the run's own exchange
    url: str
    #: the two replicas' base URLs
    bases: list[str]
    #: the node processes by name
    nodes: dict[str, ReservoirProcess]


@pytest.fixture
def service(reservoir_amqp_url: str, tmp_path: Path) -> Iterator[Service]:
    """Four node processes and two replicas of ``reservoir serve``."""
    path = os.pathsep.join(p for p in (TREE, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "RESERVOIR_BROKER_URL": reservoir_amqp_url, "PYTHONPATH": path}
    with ProcessCluster(reservoir_amqp_url, tmp_path, env) as cluster:
        nodes = {name: cluster.start(name, *node_args(name, tmp_path)) for name in NODES}
        for node in nodes.values():
            node.wait_for(NODE_READY)
        bases = []
        for name in ("a", "b"):
            port = free_port()
            serve = cluster.start(f"serve {name}", "serve", "--port", str(port))
            bases.append(f"http://127.0.0.1:{port}")
            wait_until_ready(bases[-1], serve)
        yield Service(reservoir_amqp_url, bases, nodes)


async def cycle_at_once(bases: list[str], keyed: bool) -> Counter[str]:
    """Every client POSTs on its replica, GETs on the other, DELETEs on its own."""
    answers: Counter[str] = Counter()

    async def client(index: int) -> None:
        own, other = bases[index % 2], bases[(index + 1) % 2]
        async with (
            httpx.AsyncClient(base_url=own, timeout=30) as mine,
            httpx.AsyncClient(base_url=other, timeout=30) as theirs,
        ):
            for _ in range(CYCLES_EACH):
                headers = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"} if keyed else {}
                posted = await mine.post("/v1/reservations", json=SHAPE, headers=headers)
                answers[f"POST {posted.status_code}"] += 1
                assert posted.status_code == 201, posted.text
                request_id = posted.json()["request_id"]
                got = await theirs.get(f"/v1/reservations/{request_id}")
                answers[f"GET {got.status_code}"] += 1
                deleted = await mine.delete(f"/v1/reservations/{request_id}")
                answers[f"DELETE {deleted.status_code}"] += 1

    await asyncio.gather(*(client(index) for index in range(CLIENTS)))
    return answers


@pytest.mark.parametrize("keyed", [False, True], ids=["generated-ids", "idempotency-keys"])
def test_sixteen_clients_posting_and_deleting_at_once_get_no_404_and_leave_nothing_held(
    service: Service, tmp_path: Path, keyed: bool
) -> None:
    answers = asyncio.run(cycle_at_once(service.bases, keyed))

    cycles = CLIENTS * CYCLES_EACH
    assert answers == Counter({"POST 201": cycles, "GET 200": cycles, "DELETE 204": cycles}), (
        f"every id just placed is found and freed, on either replica: {dict(answers)}"
    )
    audit_nothing_held(service.url, tmp_path)


def test_a_holder_too_slow_to_answer_is_a_503_with_retry_after_never_a_404(
    service: Service, tmp_path: Path
) -> None:
    """The holder of a placement is paused (SIGSTOP) when a DELETE and a GET ask for it:
    what it holds is not known, so the answer is 503 and Retry-After, not "not found".
    Once it runs again the same DELETE frees the placement."""
    placing, other = service.bases
    posted = httpx.post(f"{placing}/v1/reservations", json=SHAPE, timeout=30)
    assert posted.status_code == 201, posted.text
    placement = posted.json()
    [holder] = {a["node"] for a in placement["allocations"]}
    paused = service.nodes[holder].process
    paused.send_signal(signal.SIGSTOP)
    try:
        for base in (other, placing):
            got = httpx.get(f"{base}/v1/reservations/{placement['request_id']}", timeout=30)
            assert got.status_code == 503, got.text
            assert got.headers["Retry-After"]
            assert "not known yet" in got.json()["detail"]
        deleted = httpx.delete(f"{other}/v1/reservations/{placement['request_id']}", timeout=30)
        assert deleted.status_code == 503, deleted.text
    finally:
        paused.send_signal(signal.SIGCONT)
    deleted = httpx.delete(f"{other}/v1/reservations/{placement['request_id']}", timeout=30)
    assert deleted.status_code == 204, deleted.text
    audit_nothing_held(service.url, tmp_path)


def audit_nothing_held(url: str, tmp_path: Path) -> None:
    """``reservoir audit --placements`` with the callers holding nothing: any allocation
    a node still holds is an orphan, and the audit fails."""
    placements = tmp_path / "held-by-callers.jsonl"
    placements.write_text("")
    audited = subprocess.run(
        [sys.executable, "-m", "reservoir.cli", "audit", "--broker", url,
         "--placements", str(placements), "--expect-nodes", str(len(NODES)), "--json"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": TREE},
    )  # fmt: skip
    assert audited.returncode == 0, audited.stdout + audited.stderr
    found = json.loads(audited.stdout)
    assert found["ok"] and found["nodes"] == len(NODES)
    assert found["allocations"] == 0 and found["orphans"] == []
