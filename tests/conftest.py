"""Suite-wide settings. Hypothesis explores freshly on a developer's machine and replays a
fixed set of examples under CI, so a CI run is reproducible; ``--run-slow`` runs the tests
marked ``slow`` (the soak runs of tests/property/test_soak.py and the full chaos run),
skipped otherwise, and ``--run-upgrade`` the full rolling upgrade of
tests/upgrade/test_rolling_upgrade.py (its short form runs by default). These options are
this suite's own: the pytest plugin reservoir
installs for its users adds none. The report's header says where the RabbitMQ tests' broker
comes from (the URL in ``RESERVOIR_TEST_AMQP_URL``, or a testcontainers image). The
``benchmark_script`` fixture loads a script of ``benchmarks/`` for its tests; ``task_files``
is a directory the (unprivileged) tasks of a test's nodes can use; ``broker`` is the
in-process broker most tests run on (the plugin's ``reservoir_broker``; the contract and
integration suites define a ``broker`` of their own)."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import settings

from reservoir.brokers import BrokerUrl
from reservoir.brokers.inprocess import InProcessBroker


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="run tests marked slow (soak runs, the full chaos run)",
    )
    parser.addoption(
        "--run-upgrade",
        action="store_true",
        default=False,
        help="run the full rolling upgrade (tests marked upgrade_full); its short form "
        "runs by default",
    )


def pytest_report_header(config: pytest.Config) -> str:
    url = os.environ.get("RESERVOIR_TEST_AMQP_URL")
    if url:
        return f"rabbitmq: RESERVOIR_TEST_AMQP_URL ({BrokerUrl.parse(url).display})"
    from reservoir.testing.rabbitmq import rabbitmq_image

    return f"rabbitmq: testcontainers, image {rabbitmq_image()} (RESERVOIR_TEST_AMQP_URL unset)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    opted_out = {
        marker: pytest.mark.skip(reason=f"{marker}: run with {option}")
        for marker, option in (("slow", "--run-slow"), ("upgrade_full", "--run-upgrade"))
        if not config.getoption(option)
    }
    for item in items:
        for marker, skip in opted_out.items():
            if marker in item.keywords:
                item.add_marker(skip)


settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="session")
def benchmark_script() -> Callable[[str], ModuleType]:
    """Load ``benchmarks/<name>.py`` (scripts, not a package) as the module ``name``."""

    def load(name: str) -> ModuleType:
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: its dataclasses look it up
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def task_files() -> Iterator[Path]:
    """A directory the tasks of a node can read and write: exec tasks run as an
    unprivileged user (nobody, for an agent running as root), who cannot reach a test's
    own tmp_path (its parents are the test runner's alone). Removed afterwards."""
    import shutil
    import tempfile

    directory = Path(tempfile.mkdtemp(prefix="reservoir-task-files-"))
    directory.chmod(0o777)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def broker(reservoir_broker: InProcessBroker) -> InProcessBroker:
    """The plugin's ``reservoir_broker``, under the name the suite's tests give it: the
    broker of the plugin's ``reservoir_cluster`` too, closed when the test ends."""
    return reservoir_broker
