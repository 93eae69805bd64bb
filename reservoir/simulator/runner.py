"""One simulation: every chosen system at every offered load, on one seeded workload.

This module owns :class:`SimulationConfig` (what ``reservoir simulate`` was asked),
:func:`simulate` (the loop over loads and systems) and :class:`SimulationResult` (its rows
and the JSON object the command prints).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from reservoir.simulator.baselines import BASELINES, BaselineRun
from reservoir.simulator.engine import ReservoirRun
from reservoir.simulator.memory import collector_paused
from reservoir.simulator.metrics import RunResult
from reservoir.simulator.network import LatencyModel
from reservoir.simulator.workload import make_cluster, make_workload

__all__ = ["SYSTEMS", "SimulationConfig", "SimulationResult", "simulate"]

SYSTEMS: Final = ("reservoir", *BASELINES)


def settle_s(timeout_s: float, ttl_s: float = 5.0) -> float:
    """How long after the last arrival every system runs on with no new arrivals: the
    request timeout, then three reservation TTLs and a second, so every TTL runs out."""
    return timeout_s + 3 * ttl_s + 1.0


@dataclass(frozen=True)
class SimulationConfig:
    nodes: int = 1000
    #: arrivals per offered load per system
    requests: int = 10_000
    loads: tuple[float, ...] = (0.5, 0.8, 0.95)
    systems: tuple[str, ...] = SYSTEMS
    schedulers: int = 8
    requestors: int = 8
    refresh_s: float = 1.0
    probes: int = 2
    max_attempts: int = 3
    latency: LatencyModel = field(default_factory=lambda: LatencyModel("fixed", 1.0))
    loss: float = 0.0
    seed: int = 0
    mean_lifetime_s: float = 3600.0
    prefill: bool = True
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown:
            raise ValueError(
                f"unknown system {', '.join(unknown)}; choose from {', '.join(SYSTEMS)}"
            )
        if not self.systems or not self.loads:
            raise ValueError("at least one system and one offered load are needed")


@dataclass
class SimulationResult:
    config: SimulationConfig
    runs: list[RunResult]
    elapsed_s: float

    @property
    def invariants_hold(self) -> bool:
        return all(run.audit_ok is not False for run in self.runs)

    def rows(self) -> list[dict[str, Any]]:
        return [run.row() for run in self.runs]

    def as_json(self) -> dict[str, Any]:
        config = self.config
        return {
            "rows": self.rows(),
            "elapsed_s": round(self.elapsed_s, 3),
            "nodes": config.nodes,
            "requests": config.requests,
            "seed": config.seed,
            "loads": list(config.loads),
            "systems": list(config.systems),
            "schedulers": config.schedulers,
            "requestors": config.requestors,
            "refresh_s": config.refresh_s,
            "latency": config.latency.describe(),
            "loss": config.loss,
            "mean_lifetime_s": config.mean_lifetime_s,
            "prefill": config.prefill,
            "invariants_hold": self.invariants_hold,
            "serialisation": "none: messages are passed as pydantic objects",
        }


#: (label of the run, arrivals processed since the last call)
Progress = Callable[[str, int], None]


def simulate(config: SimulationConfig, progress: Progress | None = None) -> SimulationResult:
    """Run every system of ``config`` at every offered load, on the same workload."""
    with collector_paused():
        return _simulate(config, progress)


def _simulate(config: SimulationConfig, progress: Progress | None) -> SimulationResult:
    started = time.perf_counter()
    cluster = make_cluster(config.nodes, config.seed)
    runs: list[RunResult] = []
    for load in config.loads:
        workload = make_workload(
            cluster,
            offered_load=load,
            requests=config.requests,
            seed=config.seed,
            mean_lifetime_s=config.mean_lifetime_s,
            prefill=config.prefill,
        )
        for system in config.systems:
            label = f"{system} at load {load:g}"

            def advance(n: int, label: str = label) -> None:
                if progress is not None:
                    progress(label, n)

            advance(0)
            if system == "reservoir":
                runs.append(
                    ReservoirRun(
                        cluster,
                        workload,
                        latency=config.latency,
                        loss=config.loss,
                        requestors=config.requestors,
                        seed=config.seed,
                        timeout_s=config.timeout_s,
                        progress=advance,
                    ).run()
                )
            else:
                runs.append(
                    BaselineRun(
                        system,  # type: ignore[arg-type]
                        cluster,
                        workload,
                        latency=config.latency,
                        loss=config.loss,
                        schedulers=config.schedulers,
                        refresh_s=config.refresh_s,
                        probes=config.probes,
                        max_attempts=config.max_attempts,
                        seed=config.seed,
                        settle_s=settle_s(config.timeout_s),
                        progress=advance,
                    ).run()
                )
    return SimulationResult(config=config, runs=runs, elapsed_s=time.perf_counter() - started)
