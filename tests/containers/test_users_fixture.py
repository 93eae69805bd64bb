"""The users' ``reservoir_amqp_url`` (reservoir's pytest plugin) in a project of their own:
the README's example test, run by pytest in a directory of its own with
``RESERVOIR_TEST_AMQP_URL`` unset, passes on a throwaway RabbitMQ container that is gone
afterwards. (With no engine it is skipped, failed under ``CI``:
tests/unit/test_testing_rabbitmq.py.)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from reservoir.testing.rabbitmq import RUN_LABEL, run_id

if TYPE_CHECKING:
    from conftest import Docker

ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> str:
    """The README's test that uses ``reservoir_amqp_url``, exactly as written there."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (example,) = [b for b in blocks if "def test_" in b and "reservoir_amqp_url" in b]
    return example


def run_users_project(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """pytest on a project holding only the README's example (reservoir from this checkout,
    its plugin loaded through the entry point as in any project)."""
    (tmp_path / "test_users_example.py").write_text(readme_example())
    environment = {
        k: v for k, v in os.environ.items() if k not in ("RESERVOIR_TEST_AMQP_URL", "CI")
    }
    environment.update(PYTHONPATH=str(ROOT), RESERVOIR_TEST_RUN=run_id(), **env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rs", str(tmp_path)],
        cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip


@pytest.mark.docker
def test_the_readme_example_passes_on_a_throwaway_container(
    docker: Docker, rabbitmq_test_image: str, tmp_path: Path
) -> None:
    since = str(int(time.time()) - 1)  # noqa: TID251  # docker events take wall-clock times
    done = run_users_project(tmp_path, CI="1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout

    until = str(int(time.time()) + 1)  # noqa: TID251
    events = docker(
        "events", "--since", since, "--until", until,
        "--filter", f"label={RUN_LABEL}={run_id()}", "--filter", "type=container",
        "--format", "{{.Action}} {{.From}}",
    ).splitlines()  # fmt: skip
    assert f"start {rabbitmq_test_image}" in events, events
    assert f"destroy {rabbitmq_test_image}" in events, events
    assert docker.containers_of_this_run() == []
