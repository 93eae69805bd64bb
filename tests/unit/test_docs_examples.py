"""The Python examples of the README and the documentation pages run as written: the
library example places and releases on an in-process broker, and the lifespan example
defines its app with nothing missing (its imports included). Examples that need a broker
or are fragments (a test function, a lifespan excerpt) are run elsewhere or not at all:
the README's RabbitMQ test by tests/containers/test_users_fixture.py."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest
from fastapi import FastAPI

ROOT = Path(__file__).resolve().parents[2]


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), re.S)


def block_with(page: str, marker: str) -> str:
    found = [block for block in python_blocks(page) if marker in block]
    assert found, f"{page} has no Python example with {marker!r}"
    return found[0]


@pytest.mark.parametrize("page", ["README.md", "docs/getting-started.md"])
def test_the_library_example_places_and_releases_on_an_in_process_broker(
    page: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    example = tmp_path / "example.py"
    example.write_text(block_with(page, "with Requestor(broker) as requestor:"))
    runpy.run_path(str(example), run_name="__main__")
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("('node-")
    assert "placed 0 of 1" in printed[1]


def test_the_lifespan_example_defines_its_app_with_every_import_it_needs(tmp_path: Path) -> None:
    example = tmp_path / "lifespan_example.py"
    example.write_text(block_with("docs/http-api.md", "reservoir_lifespan(app)"))
    scope = runpy.run_path(str(example))  # a NameError here is a missing import
    app = scope["app"]
    assert isinstance(app, FastAPI)
    assert "/servers" in {getattr(route, "path", "") for route in app.routes}
    # (tests/examples/test_docs_embedding.py runs it, against a node on RabbitMQ)


def test_the_node_configuration_file_in_the_deploying_page_loads_as_written(
    tmp_path: Path,
) -> None:
    from reservoir.runtime.node_config import load_node_file

    (block,) = re.findall(r"```toml\n(.*?)```", (ROOT / "docs/deploying.md").read_text(), re.S)
    (tmp_path / "node.toml").write_text(block)
    loaded = load_node_file(tmp_path / "node.toml")
    assert loaded.discovery.enabled and loaded.pci.alias[0].name == "gpu-a100"
