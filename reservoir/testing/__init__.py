"""Test helpers for reservoir and for projects that embed it.

- :class:`Simulation`: nodes and requestors on one in-process broker and one virtual clock,
  deterministic from a seed, ending with the invariant audit.
- The pytest plugin (:mod:`reservoir.testing.plugin`, registered automatically when
  reservoir is installed) provides the ``reservoir_simulation`` and ``reservoir_amqp_url``
  fixtures and the ``--run-slow`` option.
"""

from reservoir.testing.simulation import Simulation

__all__ = ["Simulation"]
