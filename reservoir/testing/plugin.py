"""reservoir's pytest plugin, registered through the ``pytest11`` entry point.

Fixtures:

- ``reservoir_simulation``: a :class:`~reservoir.testing.Simulation` that, when the test
  ends, settles the run and audits the invariants (the test fails if one is broken);
- ``reservoir_amqp_url``: the URL of a real RabbitMQ: ``RESERVOIR_TEST_AMQP_URL`` if set,
  else a testcontainers ``RabbitMqContainer``; without either the test is skipped, except
  when ``CI`` is set, where a missing broker fails the test. A ``RESERVOIR_TEST_AMQP_URL``
  where nothing answers fails the fixture with one line (repeated, as pytest does, for each
  test that asks for it) rather than each test's client library failing at length.

It adds fixtures and nothing else: no command-line option, no marker and no collection
hook, so it never clashes with a project's own ``--run-slow`` or ``slow`` marker and never
skips a project's own tests. (reservoir's own suite keeps its options in its own
``tests/conftest.py``.)
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from reservoir.testing.rabbitmq import amqp_url_for_tests
from reservoir.testing.simulation import Simulation


@pytest.fixture
def reservoir_simulation() -> Iterator[Simulation]:
    simulation = Simulation()
    yield simulation
    simulation.finish()


@pytest.fixture(scope="session")
def reservoir_amqp_url() -> Iterator[str]:
    with amqp_url_for_tests() as url:
        yield url
