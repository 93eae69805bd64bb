"""reservoir's pytest plugin, registered through the ``pytest11`` entry point.

Fixtures:

- ``reservoir_simulation``: a :class:`~reservoir.testing.Simulation` that, when the test
  ends, settles the run and audits the invariants (the test fails if one is broken);
- ``reservoir_broker``: an :class:`~reservoir.brokers.inprocess.InProcessBroker`, closed
  when the test ends;
- ``reservoir_cluster``: an :class:`~reservoir.testing.InProcessCluster` on
  ``reservoir_broker``, to add live node agents to; they are closed when the test ends;
- ``reservoir_amqp_url``: the URL of a real RabbitMQ on an exchange of the test's own
  (``?exchange=reservoir-test-<random>``), deleted with its inbox exchange when the test
  ends. A test on it reaches only the nodes it starts itself: nodes of a deployment
  sharing the broker (another exchange, ``reservoir`` by default) never see its requests,
  and nothing of the test is left on the broker. The ``?exchange=`` parameter is
  reservoir's: give the URL to reservoir (``reservoir.brokers.connect``, ``NodeAgent``,
  ``Requestor``, the ``reservoir`` commands), not to a client library;
- ``reservoir_amqp_broker_url``: the broker under those, found once per session:
  ``RESERVOIR_TEST_AMQP_URL`` if set, else a testcontainers ``RabbitMqContainer``;
  without either the test is skipped, except when ``CI`` is set, where a missing broker
  fails the test. A ``RESERVOIR_TEST_AMQP_URL`` where nothing answers fails the fixture
  with one line (repeated, as pytest does, for each test that asks for it) rather than
  each test's client library failing at length. Its URL is the broker's as found, shared
  by every test of the session: for a test that makes exchanges, users or vhosts of its
  own and removes them;
- ``reservoir_process_cluster``: a :class:`~reservoir.testing.ProcessCluster` on
  ``reservoir_amqp_url``, its state in the test's ``tmp_path``: real ``reservoir node``
  processes and commands; whatever still runs is stopped when the test ends.

It adds fixtures and nothing else: no command-line option, no marker and no collection
hook, so it never clashes with a project's own ``--run-slow`` or ``slow`` marker and never
skips a project's own tests. (reservoir's own suite keeps its options in its own
``tests/conftest.py``.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from reservoir.brokers.inprocess import InProcessBroker
from reservoir.testing.in_process import InProcessCluster
from reservoir.testing.processes import ProcessCluster
from reservoir.testing.rabbitmq import amqp_url_for_tests, private_exchange
from reservoir.testing.simulation import Simulation


@pytest.fixture
def reservoir_simulation() -> Iterator[Simulation]:
    simulation = Simulation()
    yield simulation
    simulation.finish()


@pytest.fixture(scope="session")
def reservoir_amqp_broker_url() -> Iterator[str]:
    with amqp_url_for_tests() as url:
        yield url


@pytest.fixture
def reservoir_amqp_url(reservoir_amqp_broker_url: str) -> Iterator[str]:
    with private_exchange(reservoir_amqp_broker_url) as url:
        yield url


@pytest.fixture
def reservoir_broker() -> Iterator[InProcessBroker]:
    with InProcessBroker() as broker:
        yield broker


@pytest.fixture
def reservoir_cluster(reservoir_broker: InProcessBroker) -> Iterator[InProcessCluster]:
    with InProcessCluster(reservoir_broker) as cluster:
        yield cluster


@pytest.fixture
def reservoir_process_cluster(reservoir_amqp_url: str, tmp_path: Path) -> Iterator[ProcessCluster]:
    with ProcessCluster(reservoir_amqp_url, tmp_path) as cluster:
        yield cluster
