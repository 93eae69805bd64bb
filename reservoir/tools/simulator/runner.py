"""One simulation: every chosen system at every offered load, on one seeded workload.

This module owns :class:`SimulationConfig` (what ``reservoir simulate`` was asked),
:func:`simulate` (the runs over loads and systems, one after another or in worker
processes) and :class:`SimulationResult` (its rows and the JSON object the command prints).

Every (offered load, system) pair is an independent run: it builds the cluster and the
workload again from the seed, so a run in a worker process is the same run, event for
event, as in this one, and the rows do not depend on ``jobs``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Final

from reservoir.tools.simulator import engine
from reservoir.tools.simulator.baselines import BASELINES, BaselineRun
from reservoir.tools.simulator.engine import ReservoirRun
from reservoir.tools.simulator.memory import collector_paused
from reservoir.tools.simulator.network import LatencyModel
from reservoir.tools.simulator.results import RunResult
from reservoir.tools.simulator.workload import Cluster, Workload, make_cluster, make_workload

__all__ = [
    "SYSTEMS",
    "SimulationConfig",
    "SimulationResult",
    "default_jobs",
    "machines_build",
    "simulate",
]

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
    #: reservoir: roster keepers, two by default as in the recommended deployment
    #: (deploy/compose, deploy/kubernetes); 0: every requestor follows the announcements
    keepers: int = 2
    #: reservoir: requestors replaced by new ones per second of arrivals (a rolling deploy)
    requestor_restarts_per_s: float = 0.0
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
            "serialisation": "none: messages are passed as msgspec structs",
            "build": machines_build(),
        }


def machines_build() -> str:
    """``compiled`` when the protocol machines and this event loop run as the mypyc build
    (docs/benchmarks.md, "The compiled build"), else ``interpreted``: the two differ in speed by
    1.3-1.4x, so a timing is worth little without it."""
    return "interpreted" if str(engine.__file__).endswith(".py") else "compiled"


#: (label of the run, arrivals processed since the last call)
Progress = Callable[[str, int], None]


#: resident memory a reservoir run takes per simulated node and per arrival, a third over
#: the largest measured at 100,000 nodes and 95 % load (1.75 million steady-state
#: instances): 2.2 GB with 20,000 arrivals, 3.1 GB with a million (the workload, the
#: latencies, the placements still live at the end)
RUN_BYTES_PER_NODE: Final = 28 * 1024
RUN_BYTES_PER_REQUEST: Final = 1024


def cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1


def default_jobs(config: SimulationConfig | None = None) -> int:
    """The default for ``--jobs``: the cores; or, when reservoir's runs outnumber them,
    a worker for each of those and one for the baselines, as far as memory allows.

    Reservoir's runs take tens of times a baseline's. With two cores and three of them,
    two workers run two, then the third alone, the other core idle after the baselines:
    about twice one run. A worker each shares the cores between them until they all end:
    about half the CPU of all the runs (1,026 s of wall time for 2,007 s of CPU at
    100,000 nodes)."""
    jobs = cores()
    if config is None or "reservoir" not in config.systems:
        return jobs
    long_runs = len(config.loads)
    wanted = long_runs + (1 if len(config.systems) > 1 else 0)
    if wanted <= jobs:
        return jobs
    run_bytes = RUN_BYTES_PER_NODE * config.nodes + RUN_BYTES_PER_REQUEST * config.requests
    affordable = available_memory_bytes() // run_bytes
    return max(jobs, min(wanted, affordable))


def available_memory_bytes() -> int:
    """What the kernel says can be allocated without swapping (``MemAvailable``)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def simulate(
    config: SimulationConfig, progress: Progress | None = None, *, jobs: int = 1
) -> SimulationResult:
    """Run every system of ``config`` at every offered load, on the same workload: in
    this process when ``jobs`` is 1, else in up to ``jobs`` worker processes (the rows
    are the same either way, in the same order)."""
    if jobs < 1:
        raise ValueError("jobs must be at least 1")
    started = time.perf_counter()
    pairs = [(load, system) for load in config.loads for system in config.systems]
    if jobs == 1 or len(pairs) == 1:
        with collector_paused():
            cluster = make_cluster(config.nodes, config.seed)
            runs = []
            for load in config.loads:
                workload = _workload(config, cluster, load)
                runs += [
                    _run(config, cluster, workload, system, progress) for system in config.systems
                ]
    else:
        runs = _in_workers(config, pairs, progress, jobs)
    return SimulationResult(config=config, runs=runs, elapsed_s=time.perf_counter() - started)


def _workload(config: SimulationConfig, cluster: Cluster, load: float) -> Workload:
    return make_workload(
        cluster,
        offered_load=load,
        requests=config.requests,
        seed=config.seed,
        mean_lifetime_s=config.mean_lifetime_s,
        prefill=config.prefill,
    )


def _run(
    config: SimulationConfig,
    cluster: Cluster,
    workload: Workload,
    system: str,
    progress: Progress | None,
) -> RunResult:
    label = f"{system} at load {workload.offered_load:g}"

    def advance(n: int) -> None:
        if progress is not None:
            progress(label, n)

    advance(0)
    if system == "reservoir":
        return ReservoirRun(
            cluster,
            workload,
            latency=config.latency,
            loss=config.loss,
            requestors=config.requestors,
            keepers=config.keepers,
            requestor_restarts_per_s=config.requestor_restarts_per_s,
            seed=config.seed,
            timeout_s=config.timeout_s,
            progress=advance,
        ).run()
    return BaselineRun(
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


#: the dearest runs first, so the last one to finish is a short one: reservoir's runs
#: cost tens of times a baseline's, and a higher load holds more instances
_COST_ORDER: Final = {"reservoir": 0, "nova": 1, "sampling": 2, "omniscient": 3}

#: where a worker process sends its progress: set by the pool's initializer
_progress_queue: Any = None


def _in_workers(
    config: SimulationConfig,
    pairs: list[tuple[float, str]],
    progress: Progress | None,
    jobs: int,
) -> list[RunResult]:
    # spawn, not fork: the parent may hold threads (the progress bar's) and their locks
    context = multiprocessing.get_context("spawn")
    # a SimpleQueue's put writes to the pipe before it returns, so every report a worker
    # made is readable once its future is done; a Queue's feeder thread may still hold some
    progress_queue = context.SimpleQueue()
    by_cost = sorted(pairs, key=lambda pair: (_COST_ORDER.get(pair[1], 9), -pair[0]))
    done: dict[tuple[float, str], RunResult] = {}
    pool = ProcessPoolExecutor(
        max_workers=min(jobs, len(pairs)),
        mp_context=context,
        initializer=_start_worker,
        initargs=(progress_queue,),
    )
    try:
        running: dict[Future[RunResult], tuple[float, str]] = {
            pool.submit(_worker_run, config, load, system): (load, system)
            for load, system in by_cost
        }
        pending = set(running)
        while pending:
            finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            _relay(progress_queue, progress)
            for future in finished:
                done[running[future]] = future.result()  # a worker's error is raised here
        _relay(progress_queue, progress)
    except BaseException:
        # Ctrl-C, SIGTERM (the command turns it into KeyboardInterrupt) or one run's
        # error: the other runs are worth nothing now, and waiting for them, as leaving
        # the pool's ``with`` would, can take as long as the whole simulation.
        _stop_workers(pool)
        raise
    pool.shutdown()
    return [done[pair] for pair in pairs]


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Drop the runs not started and end the worker processes at once."""
    processes = list((pool._processes or {}).values())
    # typeshed calls this attribute a _ThreadWakeup; it is the pool's manager thread
    manager: threading.Thread | None = getattr(pool, "_executor_manager_thread", None)
    # Python 3.14's ``terminate_workers`` is the public way; 3.11 has none, so the
    # processes and the pool's manager thread are taken before ``shutdown`` forgets them.
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        process.terminate()
    # The manager thread reaps the workers too: joined first, so that it has recorded
    # each exit code. Else its waitpid can reap a worker between ours and its record,
    # and the worker, gone, would be "alive" to multiprocessing from then on.
    if manager is not None:
        manager.join(timeout=10)
    for process in processes:
        process.join(timeout=10)
        if process.is_alive():
            process.kill()
            process.join()


def _relay(progress_queue: Any, progress: Progress | None) -> None:
    while not progress_queue.empty():
        label, n = progress_queue.get()
        if progress is not None:
            progress(label, n)


def _start_worker(progress_queue: Any) -> None:
    global _progress_queue
    _progress_queue = progress_queue
    # Ctrl-C at a terminal reaches the whole process group: the parent stops the workers
    # (``_stop_workers``), so a worker need not die of it with a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker_run(config: SimulationConfig, load: float, system: str) -> RunResult:
    def report(label: str, n: int) -> None:
        _progress_queue.put((label, n))

    with collector_paused():
        cluster = make_cluster(config.nodes, config.seed)
        return _run(config, cluster, _workload(config, cluster, load), system, report)
