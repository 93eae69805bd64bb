"""The users' ``reservoir_amqp_url`` keeps their test to itself: the README's example test,
run three times by pytest in a project of its own, passes every time on a broker where a
deployment of two ``reservoir node`` processes idles, places nothing on those nodes and
leaves no exchange of its own behind.

``RESERVOIR_TEST_AMQP_URL`` is the URL the deployment itself runs on (its exchange named),
as a user would copy it from ``RESERVOIR_BROKER_URL``: a fixture that handed it on as it
is would put the test's requests before the deployment's nodes, which take them."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from reservoir.brokers import BrokerUrl, admin
from reservoir.testing import ProcessCluster, run_reservoir

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]

ROOT = Path(__file__).resolve().parents[2]
RUNS = 3

#: records the URL each test got, so that the test below can look for what it left
RECORDING_CONFTEST = """
import os

import pytest


@pytest.fixture(autouse=True)
def record_the_url(request):
    if "reservoir_amqp_url" in request.fixturenames:
        with open(os.environ["URLS_FILE"], "a") as urls:
            urls.write(request.getfixturevalue("reservoir_amqp_url") + "\\n")
"""


def readme_example() -> str:
    """The README's test that uses ``reservoir_amqp_url``, exactly as written there."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (example,) = [b for b in blocks if "def test_" in b and "reservoir_amqp_url" in b]
    return example


@pytest.fixture
def deployment(reservoir_amqp_broker_url: str) -> Iterator[dict[str, str]]:
    """Two idle nodes, unrelated to the user's test, on an exchange of the same broker."""
    url = BrokerUrl.parse(reservoir_amqp_broker_url).with_exchange(
        f"users-deployment-{uuid.uuid4().hex[:10]}"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESERVOIR_")}
    env.update(PYTHONPATH=str(ROOT), RESERVOIR_BROKER_URL=url.given)
    try:
        with ProcessCluster(url.given, env=env) as nodes:
            for n in (1, 2):
                nodes.start_node(f"idle-{n}-{uuid.uuid4().hex[:6]}")
            yield env
    finally:
        topology = admin(url)
        assert topology is not None
        topology.delete_reservoir_exchanges()


def test_the_readme_example_passes_three_runs_of_three_beside_a_deployment_and_leaves_nothing(
    deployment: dict[str, str], tmp_path: Path
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_users_example.py").write_text(readme_example())
    (project / "conftest.py").write_text(RECORDING_CONFTEST)
    urls_file = tmp_path / "urls.txt"
    users_env = {
        **deployment,
        "RESERVOIR_TEST_AMQP_URL": deployment["RESERVOIR_BROKER_URL"],
        "URLS_FILE": str(urls_file),
    }
    del users_env["RESERVOIR_BROKER_URL"]
    passed = 0
    outputs = []
    for _ in range(RUNS):
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(project)],
            cwd=project, env=users_env, capture_output=True, text=True, timeout=240, check=False,
        )  # fmt: skip
        outputs.append(done.stdout[-2000:] + done.stderr[-2000:])
        passed += done.returncode == 0 and "1 passed" in done.stdout
    assert passed == RUNS, "\n".join(outputs)

    # nothing placed on, or left held by, the deployment's nodes
    audited = run_reservoir(
        "audit", "--json", "--expect-nodes", "2", "--wait", "10", env=deployment
    )
    assert audited.returncode == 0, audited.stdout + audited.stderr
    found = json.loads(audited.stdout)
    assert (found["nodes"], found["allocations"], found["reservations"]) == (2, 0, 0), found

    # each run had an exchange of its own, and it is gone
    given = urls_file.read_text().split()
    exchanges = {parse_qs(urlsplit(url).query)["exchange"][0] for url in given}
    assert len(given) == len(exchanges) == RUNS, given
    deployment_exchange = BrokerUrl.parse(deployment["RESERVOIR_BROKER_URL"]).exchange
    assert deployment_exchange not in exchanges
    topology = admin(deployment["RESERVOIR_BROKER_URL"])
    assert topology is not None
    base = BrokerUrl.parse(deployment["RESERVOIR_BROKER_URL"])
    left = [
        name
        for exchange in exchanges
        for name in (exchange, base.with_exchange(exchange).inbox_exchange)
        if topology.exchange_exists(name)
    ]
    assert left == []
