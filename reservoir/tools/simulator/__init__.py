"""``reservoir simulate``: the protocol's own state machines at scale, in virtual time.

The package drives :class:`~reservoir.protocol.node.NodeMachine` and
:class:`~reservoir.protocol.requestor.RequestorMachine` through a lean discrete-event
engine (:mod:`~reservoir.tools.simulator.engine`) on a seeded workload
(:mod:`~reservoir.tools.simulator.workload`), and runs the same workload through baselines
(:mod:`~reservoir.tools.simulator.baselines`: Nova's cached scheduler, power-of-d sampling and an
omniscient scheduler), so that scaling and the comparison come from one command. Messages
are passed as objects, without byte serialisation.
"""

from __future__ import annotations

from reservoir.tools.simulator.network import LatencyModel, parse_latency_ms
from reservoir.tools.simulator.runner import (
    SYSTEMS,
    SimulationConfig,
    SimulationResult,
    default_jobs,
    simulate,
)

__all__ = [
    "SYSTEMS",
    "LatencyModel",
    "SimulationConfig",
    "SimulationResult",
    "default_jobs",
    "parse_latency_ms",
    "simulate",
]
