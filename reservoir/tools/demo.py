"""``reservoir demo``: a whole cloud in one process, placing a mixed workload, then audited.

It starts N node agents with varied capacities and K requestors (one worker thread each)
placing M requests of mixed flavours concurrently, over any broker: the in-process one by
default, RabbitMQ with ``--broker amqp://...``. When the run is over it audits every node's
ledger, independently of what the requestors believe, and reports the invariants next to
the latency and throughput figures.
"""

from __future__ import annotations

import contextlib
import queue
import random
import secrets
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from reservoir.broker import Broker
from reservoir.clock import SystemClock, ThreadScheduler
from reservoir.protocol.audit import AuditReport, audit
from reservoir.protocol.ledger import Inventory
from reservoir.protocol.placement import Placement, PlacementError
from reservoir.runtime.node_agent import NodeAgent
from reservoir.runtime.plugins import load_filters, load_weighers
from reservoir.runtime.requestor import Requestor, RequestorClosed
from reservoir.runtime.settings import Settings

__all__ = ["FLAVOURS", "DemoResult", "run_demo"]


@dataclass(frozen=True)
class Flavour:
    name: str
    vcpus: int
    memory_mb: int
    disk_gb: int
    weight: int


#: The workload's instance sizes and how often each is asked for.
FLAVOURS = (
    Flavour("tiny", 1, 512, 10, 20),
    Flavour("small", 1, 2048, 20, 30),
    Flavour("medium", 2, 4096, 40, 25),
    Flavour("large", 4, 8192, 80, 15),
    Flavour("xlarge", 8, 16384, 160, 10),
)

#: Node shapes: (vcpus, memory_mb, disk_gb). VCPU is overcommitted 4:1, as clouds do.
NODE_SHAPES = ((32, 262144, 2000), (48, 393216, 4000), (64, 524288, 4000), (96, 786432, 8000))
VCPU_ALLOCATION_RATIO = 4.0


@dataclass
class DemoResult:
    placed: int
    failed: int
    overcommitted: int
    leaked_reservations: int
    duplicate_placements: int
    p50_ms: float
    p99_ms: float
    placements_per_s: float
    #: None without prometheus-client, which counts the messages
    messages_per_placement: float | None
    elapsed_s: float
    nodes: int
    requests: int
    concurrency: int
    broker: str
    tiers_used: dict[str, int] = field(default_factory=dict)
    node_tiers: dict[str, int] = field(default_factory=dict)
    mean_utilisation: float = 0.0
    failures: list[str] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)
    audit: AuditReport | None = None

    def as_json(self) -> dict[str, Any]:
        data = {k: v for k, v in self.__dict__.items() if k != "audit"}
        data["failures"] = self.failures[:10]
        return data

    @property
    def invariants_hold(self) -> bool:
        return not (self.overcommitted or self.leaked_reservations or self.duplicate_placements)


def _percentile(samples: list[float], fraction: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


@contextlib.contextmanager
def _opened(url: str, run_id: str) -> Iterator[Broker]:
    """A broker on exchanges of the demo's own: a fresh ``reservoir-demo-<run>`` unless
    the URL names one, which must not exist yet (an existing exchange belongs to a live
    deployment: the demo refuses it rather than talk to its nodes, or delete it after).
    Deleted when the demo ends."""
    from reservoir.brokers import connect, own_exchange

    with own_exchange(url, name=f"reservoir-demo-{run_id}") as run_url, connect(run_url) as broker:
        yield broker


def run_demo(
    *,
    nodes: int = 50,
    requests: int = 2000,
    concurrency: int = 8,
    seed: int = 0,
    broker_url: str = "memory://",
    settings: Settings | None = None,
    progress: Callable[[int], None] | None = None,
) -> DemoResult:
    """Run the demo and return what it measured. ``progress`` is called once per request
    decided (placed or failed)."""
    settings = settings or Settings()
    rng = random.Random(seed)
    run_id = secrets.token_hex(3)
    flavours = rng.choices(FLAVOURS, weights=[f.weight for f in FLAVOURS], k=requests)
    with _opened(broker_url, run_id) as broker, _Cluster(broker, settings) as cluster:
        cluster.start(run_id, rng, nodes, concurrency)
        outcomes = _place_all(cluster.requestors, flavours, progress)
        report = _audit_after_ttl(cluster.agents, outcomes.placements, settings.ttl_s)
        return _result(cluster, outcomes, report, broker.url, nodes, requests, concurrency)


class _Cluster:
    """The demo's node agents and requestors on one broker, each kind on one timer
    thread, all closed on exit."""

    def __init__(self, broker: Broker, settings: Settings) -> None:
        self.broker = broker
        self.settings = settings
        self.node_timers = ThreadScheduler(SystemClock(), name="demo-node-timers")
        self.requestor_timers = ThreadScheduler(SystemClock(), name="demo-requestor-timers")
        self.agents: list[NodeAgent] = []
        self.requestors: list[Requestor] = []

    def __enter__(self) -> _Cluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        for requestor in self.requestors:
            requestor.close()
        for agent in self.agents:
            agent.close()
        self.node_timers.close()
        self.requestor_timers.close()

    def start(self, run_id: str, rng: random.Random, nodes: int, concurrency: int) -> None:
        """``nodes`` agents of shapes drawn from :data:`NODE_SHAPES`, and the requestors."""
        settings = self.settings
        # Discovering entry points reads every installed package's metadata: once will do.
        filters = load_filters(settings.filters)
        weighers = load_weighers(settings.weighers)
        for index in range(nodes):
            vcpus, memory_mb, disk_gb = rng.choice(NODE_SHAPES)
            self.agents.append(
                NodeAgent(
                    self.broker,
                    name=f"demo-{run_id}-node-{index:03d}",
                    inventories={
                        "VCPU": Inventory(total=vcpus, allocation_ratio=VCPU_ALLOCATION_RATIO),
                        "MEMORY_MB": Inventory(total=memory_mb, reserved=4096),
                        "DISK_GB": Inventory(total=disk_gb),
                    },
                    settings=settings,
                    scheduler=self.node_timers,
                    filters=filters,
                    weighers=weighers,
                )
            )
        for i in range(concurrency):
            self.requestors.append(
                Requestor(
                    self.broker,
                    name=f"demo-{run_id}-requestor-{i}",
                    settings=settings,
                    scheduler=self.requestor_timers,
                )
            )


@dataclass
class _Outcomes:
    placements: list[Placement]
    latencies_s: list[float]
    failures: list[str]
    elapsed_s: float


def _place_all(
    requestors: list[Requestor],
    flavours: list[Flavour],
    progress: Callable[[int], None] | None,
) -> _Outcomes:
    """Every flavour placed by whichever requestor's worker thread takes it next."""
    work: queue.SimpleQueue[Flavour | None] = queue.SimpleQueue()
    for flavour in flavours:
        work.put(flavour)
    outcomes = _Outcomes([], [], [], 0.0)
    lock = threading.Lock()
    # Set when the main thread is interrupted (Ctrl-C, SIGTERM): the workers take no more
    # work, and one whose requestor is closed under it stops quietly rather than with a
    # traceback; the requestors' close releases what they held.
    stopping = threading.Event()

    def worker(requestor: Requestor) -> None:
        while not stopping.is_set() and (flavour := work.get()) is not None:
            started = time.perf_counter()
            try:
                placement = requestor.reserve(
                    vcpus=flavour.vcpus, memory_mb=flavour.memory_mb, disk_gb=flavour.disk_gb
                )
            except RequestorClosed:
                return
            except PlacementError as error:
                with lock:
                    outcomes.failures.append(str(error))
            else:
                with lock:
                    outcomes.placements.append(placement)
                    outcomes.latencies_s.append(time.perf_counter() - started)
            if progress is not None:
                progress(1)

    started = time.perf_counter()
    threads = [
        threading.Thread(target=worker, args=(r,), name=f"demo-worker-{i}", daemon=True)
        for i, r in enumerate(requestors)
    ]
    for thread in threads:
        work.put(None)  # one stop sign per worker, after the work
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except BaseException:
        stopping.set()
        raise
    outcomes.elapsed_s = time.perf_counter() - started
    return outcomes


def _result(
    cluster: _Cluster,
    outcomes: _Outcomes,
    report: AuditReport,
    shown_url: str,
    nodes: int,
    requests: int,
    concurrency: int,
) -> DemoResult:
    """The demo's figures, read from the participants' counters and the nodes' state."""
    participants = [*cluster.agents, *cluster.requestors]
    messages = sum(participant.metrics.total("sent") for participant in participants)
    counted = all(p.metrics.enabled for p in participants)
    dropped: Counter[str] = Counter()
    for participant in participants:
        dropped.update(participant.metrics.by_label("dropped"))
    placements, latencies_s, elapsed_s = (
        outcomes.placements,
        outcomes.latencies_s,
        outcomes.elapsed_s,
    )
    tiers_used: Counter[str] = Counter(f"{p.tiers_tried[-1]}%" for p in placements if p.tiers_tried)
    snapshots = [agent.snapshot() for agent in cluster.agents]
    placed = len(placements)
    return DemoResult(
        placed=placed,
        failed=len(outcomes.failures),
        overcommitted=len(report.overcommitted),
        leaked_reservations=len(report.leaked_reservations),
        duplicate_placements=len(report.duplicate_placements),
        p50_ms=round(statistics.median(latencies_s) * 1000, 2) if latencies_s else 0.0,
        p99_ms=round(_percentile(latencies_s, 0.99) * 1000, 2),
        placements_per_s=round(placed / elapsed_s, 1) if elapsed_s else 0.0,
        messages_per_placement=(
            None if not counted else round(messages / placed, 1) if placed else 0.0
        ),
        elapsed_s=round(elapsed_s, 3),
        nodes=nodes,
        requests=requests,
        concurrency=concurrency,
        broker=shown_url,
        tiers_used=dict(sorted(tiers_used.items(), key=lambda kv: int(kv[0][:-1]))),
        node_tiers=dict(
            sorted(Counter(f"{s.tier}%" for s in snapshots).items(), key=lambda kv: int(kv[0][:-1]))
        ),
        mean_utilisation=round(statistics.fmean(s.utilisation for s in snapshots), 3)
        if snapshots
        else 0.0,
        failures=outcomes.failures,
        dropped=dict(dropped),
        audit=report,
    )


def _audit_after_ttl(
    agents: list[NodeAgent], placements: list[Placement], ttl_s: float
) -> AuditReport:
    """Audit once every reservation made during the run is past its deadline.

    Reservations are normally released long before: only if some are still held does this
    wait, until the latest deadline (at most a TTL) plus a little slack for the timer.
    """
    clock = SystemClock()
    grace_s = 0.25
    deadline = max(
        (r.deadline for agent in agents for r in agent.snapshot().reservations), default=None
    )
    if deadline is not None:
        time.sleep(max(0.0, min(deadline - clock.now(), ttl_s)) + grace_s)
    return audit([agent.snapshot() for agent in agents], placements, grace_s=grace_s)
