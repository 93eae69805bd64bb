"""The documentation's embedding snippets, run as written: each is taken from where a
reader finds it (the Python block of docs/http-api.md that embeds the service, the
example in ``reservoir_lifespan``'s docstring) into a file of its own and run, against a
node on a real RabbitMQ (the snippets read ``RESERVOIR_BROKER_URL``, which the test points
at an exchange of its own). A snippet that drifts from the code (a name gone, an import
missing, an answer that changed) fails here. The excerpt of examples/asgi_service.py on
the same page must be in that file, which tests/examples/test_asgi_service.py runs."""

from __future__ import annotations

import asyncio
import inspect
import re
import runpy
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest

from reservoir import NodeAgent, audit
from reservoir.brokers import connect
from reservoir.service import ReservoirService, reservoir_lifespan
from reservoir.testing.asgi import serving

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "http-api.md"
PROBLEM_JSON = "application/problem+json"


def page_block(marker: str) -> str:
    """The Python block of docs/http-api.md with ``marker`` in it."""
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"docs/http-api.md has {len(found)} Python blocks with {marker!r}"
    return found[0]


def docstring_block(function: Any) -> str:
    """The literal block (``::``) of ``function``'s docstring, dedented."""
    doc = inspect.getdoc(function) or ""
    _, marker, rest = doc.partition("::\n\n")
    assert marker, f"{function.__qualname__}'s docstring has no example"
    lines = []
    for line in rest.splitlines():
        if line and not line.startswith("    "):
            break  # the prose after the block
        lines.append(line)
    return textwrap.dedent("\n".join(lines)).strip() + "\n"


SNIPPETS = {
    "docs/http-api.md": lambda: page_block("app.include_router(router)"),
    "reservoir_lifespan's docstring": lambda: docstring_block(reservoir_lifespan),
}


@pytest.fixture
def run_url(reservoir_amqp_url: str, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("RESERVOIR_BROKER_URL", reservoir_amqp_url)
    return reservoir_amqp_url


@pytest.mark.rabbitmq
@pytest.mark.parametrize("where", list(SNIPPETS))
def test_the_embedding_snippet_serves_the_service_and_its_own_route_as_written(
    where: str, run_url: str, tmp_path: Path
) -> None:
    snippet = tmp_path / "embedding.py"
    snippet.write_text(SNIPPETS[where]())
    app = runpy.run_path(str(snippet))["app"]  # a NameError here is a missing import
    broker = connect(run_url)
    node = NodeAgent(broker, name=f"docs-{uuid.uuid4().hex[:6]}", vcpus=2, memory_mb=4096)

    async def scenario() -> list[Any]:
        async with serving(app) as client:
            service = app.state.reservoir
            assert isinstance(service, ReservoirService)
            # its own route: placed, and then a PlacementError (the node is full) is a
            # 409 problem naming why, not a 500
            placed = await client.post("/servers")
            assert placed.status_code == 201, placed.text
            assert placed.json() == {"node": node.name}
            refused = await client.post("/servers")
            assert refused.status_code == 409, refused.text
            assert refused.headers["content-type"] == PROBLEM_JSON
            assert "placed 0 of 1" in refused.json()["detail"]
            # the service's routes: the listing the dashboard polls, the dashboard, and
            # the service's own answers
            listed = await client.get("/v1/nodes", params={"expect_nodes": 1, "wait_s": 10})
            assert listed.status_code == 200, listed.text
            assert [n["name"] for n in listed.json()] == [node.name]
            page = await client.get("/ui/")
            assert page.status_code == 200 and "text/html" in page.headers["content-type"]
            not_json = await client.post(
                "/v1/reservations", content=b"vcpus=1", headers={"content-type": "text/plain"}
            )
            assert not_json.status_code == 415, not_json.text
            assert not_json.headers["content-type"] == PROBLEM_JSON
            return list(service.placements.values())

    try:
        placements = asyncio.run(scenario())
        audit([node.snapshot()], placements).raise_if_failed()
        assert len(placements) == 1
    finally:
        node.close()
        broker.close()


def test_the_asgi_examples_excerpt_on_the_page_is_in_the_example() -> None:
    excerpt = page_block("reservoir_lifespan(app, broker")
    source = (ROOT / "examples" / "asgi_service.py").read_text()
    lines = [line.strip() for line in excerpt.splitlines() if line.strip()]
    assert lines, excerpt
    stripped = [line.strip() for line in source.splitlines()]
    starts = [i for i, line in enumerate(stripped) if line == lines[0]]
    assert any(stripped[i : i + len(lines)] == lines for i in starts), (
        "docs/http-api.md quotes examples/asgi_service.py as it is not:\n" + excerpt
    )
