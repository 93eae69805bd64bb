"""Test helpers for reservoir and for projects that embed it.

- :class:`Simulation`: nodes and requestors on one in-process broker and one virtual clock,
  deterministic from a seed, ending with the invariant audit.
- The pytest plugin (:mod:`reservoir.testing.plugin`, registered automatically when
  reservoir is installed) provides the ``reservoir_simulation`` and ``reservoir_amqp_url``
  fixtures (the latter on an exchange of the test's own, deleted afterwards) and
  ``reservoir_amqp_broker_url`` (the broker as found), and no option: ``--run-slow`` is
  reservoir's own suite's.
- :mod:`reservoir.testing.rabbitmq`: where ``reservoir_amqp_url`` finds its RabbitMQ
  (``RESERVOIR_TEST_AMQP_URL``, else a throwaway testcontainers container) and how it
  runs ``rabbitmqctl`` on it.
"""

from reservoir.testing.simulation import Simulation

__all__ = ["Simulation"]
