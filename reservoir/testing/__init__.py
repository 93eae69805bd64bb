"""Test helpers for reservoir and for projects that embed it.

- :class:`Simulation`: nodes and requestors on one in-process broker and one virtual clock,
  deterministic from a seed, ending with the invariant audit.
- :class:`InProcessCluster`: live node agents on one in-process broker, in real time.
- :class:`ProcessCluster`: real ``reservoir node`` processes and commands on one broker
  URL (:mod:`reservoir.testing.processes`, with :class:`ReservoirProcess` and
  :func:`run_reservoir`).
- The pytest plugin (:mod:`reservoir.testing.plugin`, registered automatically when
  reservoir is installed) provides the ``reservoir_simulation``, ``reservoir_broker``,
  ``reservoir_cluster`` and ``reservoir_amqp_url`` fixtures (the latter on an exchange of
  the test's own, deleted afterwards), ``reservoir_amqp_broker_url`` (the broker as found)
  and ``reservoir_process_cluster`` (node processes on ``reservoir_amqp_url``), and no
  option: ``--run-slow`` is reservoir's own suite's.
- :mod:`reservoir.testing.rabbitmq`: where ``reservoir_amqp_url`` finds its RabbitMQ
  (``RESERVOIR_TEST_AMQP_URL``, else a throwaway testcontainers container) and how it
  runs ``rabbitmqctl`` on it.
"""

from reservoir.testing.in_process import InProcessCluster
from reservoir.testing.processes import ProcessCluster, ReservoirProcess, run_reservoir
from reservoir.testing.simulation import Simulation

__all__ = ["InProcessCluster", "ProcessCluster", "ReservoirProcess", "Simulation", "run_reservoir"]
