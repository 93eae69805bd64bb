"""reservoir's pytest plugin, registered through the ``pytest11`` entry point.

Fixtures:

- ``reservoir_simulation``: a :class:`~reservoir.testing.Simulation` that, when the test
  ends, settles the run and audits the invariants (the test fails if one is broken);
- ``reservoir_amqp_url``: the URL of a real RabbitMQ: ``RESERVOIR_TEST_AMQP_URL`` if set,
  else a testcontainers ``RabbitMqContainer``; without either the test is skipped, except
  when ``CI`` is set, where a missing broker fails the test.

Option ``--run-slow`` runs tests marked ``slow`` (soak and fuzz runs), skipped by default.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from reservoir.testing.rabbitmq import amqp_url_for_tests
from reservoir.testing.simulation import Simulation


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="run tests marked slow (soak and fuzz runs)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: long soak or fuzz run; opt in with --run-slow")
    config.addinivalue_line("markers", "rabbitmq: needs a real RabbitMQ")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def reservoir_simulation() -> Iterator[Simulation]:
    simulation = Simulation()
    yield simulation
    simulation.finish()


@pytest.fixture(scope="session")
def reservoir_amqp_url() -> Iterator[str]:
    with amqp_url_for_tests() as url:
        yield url
