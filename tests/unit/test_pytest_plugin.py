"""The pytest plugin reservoir installs stays out of its users' way: a project with its own
``--run-slow`` option and ``slow`` marker runs as it would without reservoir, and the
plugin's fixtures are there."""

from __future__ import annotations

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
    assert "2 passed" in done.stdout
    assert "skipped" not in done.stdout
