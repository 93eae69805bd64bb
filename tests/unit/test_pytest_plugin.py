"""The pytest plugin reservoir installs stays out of its users' way: a project with its own
``--run-slow`` option and ``slow`` marker runs as it would without reservoir, and the
plugin's fixtures are there."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

USERS_CONFTEST = """
import pytest

def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False)
"""

USERS_TESTS = """
import pytest

@pytest.mark.slow
def test_users_own_slow_test_runs():
    pass

def test_the_simulation_fixture_is_there(reservoir_simulation):
    reservoir_simulation.add_nodes(1, vcpus=2, memory_mb=1024)

def test_the_in_process_cluster_fixture_places_on_its_nodes(reservoir_cluster):
    from reservoir import Requestor

    reservoir_cluster.add_nodes(2, "users", vcpus=4, memory_mb=4096)
    with Requestor(reservoir_cluster.broker) as requestor:
        placement = requestor.reserve(vcpus=2, memory_mb=1024)
    assert placement.nodes[0] in ("users-0", "users-1")
    assert reservoir_cluster.held() == 1
    reservoir_cluster.audit([placement])
"""


def test_a_users_own_run_slow_option_and_slow_tests_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(USERS_CONFTEST)
    (tmp_path / "test_users.py").write_text(USERS_TESTS)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: the user's own\n")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout
    assert "skipped" not in done.stdout


USERS_BROKER_TESTS = """
from reservoir.brokers import connect

def test_one(reservoir_amqp_url):
    connect(reservoir_amqp_url).close()

def test_two(reservoir_amqp_url):
    connect(reservoir_amqp_url).close()

def test_three(reservoir_amqp_url):
    connect(reservoir_amqp_url).close()
"""


def test_a_test_broker_url_where_nothing_answers_fails_at_the_fixture_in_one_line(
    tmp_path: Path,
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "test_users.py").write_text(USERS_BROKER_TESTS)
    url = f"amqp://guest:guest@127.0.0.1:{port}/"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
        env={**os.environ, "RESERVOIR_TEST_AMQP_URL": url,
             "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 1, output
    assert "3 errors" in done.stdout and "failed" not in done.stdout, output
    line = (
        f"RESERVOIR_TEST_AMQP_URL: nothing answers at amqp://guest:***@127.0.0.1:{port}/ "
        f"(127.0.0.1:{port}: connection refused)"
    )
    # pytest repeats a session fixture's failure for each test that asks for it: the same
    # one line each time, and nothing of the client library's connection attempts (the
    # short summary may repeat it too: under CI pytest does not cut its lines short)
    assert output.splitlines().count(line) == 3, output
    assert "pika" not in output and "Traceback" not in output and "guest:guest" not in output
    assert len(output.splitlines()) < 20, output
