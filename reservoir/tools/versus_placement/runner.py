"""One run of ``reservoir versus placement``: for each node count, reservoir's own bench
and OpenStack Placement claimed against as Nova's scheduler does, with the same nodes, the
same flavour and as many schedulers as reservoir has requestors, then both filled to 90 %.

For each ``--nodes N``, in order:

1. **reservoir's throughput**: :func:`reservoir.tools.bench.runner.run_bench` on the
   broker with N nodes over two processes and K requestors in K processes of their own
   (its throughput run's placements/s, p50, p99 and CPU per placement by part);
2. **Placement's throughput**: MariaDB and Placement started afresh
   (:mod:`.services`), N resource providers with the inventory every bench node has
   (VCPU overcommitted 4:1 and MEMORY_MB, :func:`slots_per_node` instances each), then K
   scheduler processes (:mod:`.scheduler`) place ``--incumbent-placements`` instances of
   the bench's flavour between them, all at once; CPU of the gunicorn processes, of
   mariadbd and of the schedulers read from ``/proc`` over that run;
3. **false failures at 90 % fill**, on both: N nodes of :data:`FILL_SLOTS` instances
   each, every one first given one allocation of :data:`FILLER_SLOTS` instances (80 %;
   on Placement written in bulk, on reservoir placed by its requestors), then K
   schedulers or requestors place ``N * FILL_SLOTS / 10`` single instances at once,
   taking the cluster to 90 %. Each instance takes one slot and the cluster never holds
   more than 90 % of its slots, so every refusal there is a request refused while some
   node still had room for it.

Everything started (node and requestor processes, MariaDB, gunicorn, the run's
exchanges, temporary directories) is stopped and removed on leaving, error or Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import platform
import queue
import secrets
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Final

from reservoir.brokers import BrokerUrl
from reservoir.clock import SystemClock, ThreadScheduler
from reservoir.protocol.placement import PlacementError
from reservoir.runtime.requestor import Requestor
from reservoir.runtime.settings import Settings
from reservoir.tools.bench.children import ProcessNodes, child_env
from reservoir.tools.bench.errors import BenchError
from reservoir.tools.bench.limits import CpuMeter
from reservoir.tools.bench.placing import (
    FLAVOUR_MEMORY_MB,
    FLAVOUR_VCPUS,
    PLACE_TIMEOUT_S,
    READY_TIMEOUT_S,
    wait_for_roster,
)
from reservoir.tools.bench.runner import (
    VCPU_ALLOCATION_RATIO,
    audit_ledgers,
    bench_url,
    percentile,
    run_bench,
    slots_per_node,
)
from reservoir.tools.versus_placement.scheduler import (
    MICROVERSION,
    PROJECT_ID,
    USER_ID,
    PlacementClient,
)
from reservoir.tools.versus_placement.services import PlacementService, start_placement

__all__ = ["LEFT_OUT", "Side", "VersusResult", "run_versus"]

#: instances each node of the fill measurement holds, and the one allocation of this
#: many it is given first (80 %)
FILL_SLOTS: Final = 5
FILLER_SLOTS: Final = 4
#: their VCPUs (overcommitted 4:1 as the bench's): memory is what fills up, and a filler's
#: VCPUs stay within the most one instance may take (the total, by default, on both)
FILL_VCPUS: Final = FILL_SLOTS * FLAVOUR_VCPUS
#: tries of a filler refused while pre-filling reservoir's nodes (each is counted)
FILLER_ATTEMPTS: Final = 5
#: consumers written per POST /allocations when pre-filling Placement
BULK_CONSUMERS: Final = 100
#: threads creating the resource providers (setup, not measured)
SETUP_THREADS: Final = 4
#: node processes of reservoir's runs (the bench's default)
NODE_PROCESSES: Final = 2
#: what the incumbent's side leaves out of Nova (also in --help and docs/benchmarks.md)
LEFT_OUT: Final = (
    "Nova's filters on host state (the HostManager's view of compute nodes, "
    "ComputeFilter, NUMA, PCI, affinity): candidates come from Placement alone",
    "nova-api and nova-conductor (build requests, the RequestSpec, cells, quotas)",
    "the RPC to the scheduler and from the conductor to nova-compute, and the "
    "compute's own claim and its reschedule to an alternate host on failure",
    "Keystone: Placement runs with auth_strategy = noauth2",
    "the weighers other than RAM and CPU, which weigh every provider of this run alike",
)

Progress = Callable[[str], None]


@dataclass
class Side:
    """One system's figures at one node count. Times in milliseconds."""

    system: str
    placements_per_s: float
    placed: int
    refused: int
    p50_ms: float
    p99_ms: float
    cpu_ms_per_placement: dict[str, float]
    #: Placement: its 409 answers by error code; reservoir: none (a node refuses by offer)
    conflicts: dict[str, int]
    #: Placement: claims sent again after a generation conflict, and claims moved on to
    #: the next candidate; reservoir: not counted (empty)
    retries: dict[str, int]
    #: the 90 % fill: single instances placed and refused (refused = false failures),
    #: and fillers refused while pre-filling to 80 % (tried again)
    fill_placed: int
    false_failures_at_90: int
    filler_refused: int
    #: Placement: the 409s and retries of the fill's claims (as ``conflicts``, ``retries``)
    fill_conflicts: dict[str, int] = field(default_factory=dict)
    fill_retries: dict[str, int] = field(default_factory=dict)
    audit: dict[str, int] = field(default_factory=dict)

    @property
    def cpu_ms_total(self) -> float:
        return round(sum(self.cpu_ms_per_placement.values()), 3)


@dataclass
class Size:
    nodes: int
    slots_per_node: int
    reservoir: Side
    placement: Side

    def ratios(self) -> dict[str, float | None]:
        """reservoir's advantage: placements/s over Placement's, Placement's p50 and
        CPU per placement over reservoir's."""

        def over(a: float, b: float) -> float | None:
            return round(a / b, 1) if b > 0 else None

        return {
            "placements_per_s": over(
                self.reservoir.placements_per_s, self.placement.placements_per_s
            ),
            "p50": over(self.placement.p50_ms, self.reservoir.p50_ms),
            "p99": over(self.placement.p99_ms, self.reservoir.p99_ms),
            "cpu_ms_per_placement": over(self.placement.cpu_ms_total, self.reservoir.cpu_ms_total),
        }


@dataclass
class VersusResult:
    broker: str
    requestors: int
    placements: int
    incumbent_placements: int
    sizes: list[Size]
    machine: dict[str, Any]
    load_before: list[float]
    load_after: list[float]
    elapsed_s: float
    left_out: list[str] = field(default_factory=lambda: list(LEFT_OUT))
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        sizes = []
        for size in self.sizes:
            entry = asdict(size)
            for side in ("reservoir", "placement"):
                entry[side]["cpu_ms_total"] = getattr(size, side).cpu_ms_total
            entry["ratio"] = size.ratios()
            sizes.append(entry)
        return {
            "broker": self.broker,
            "requestors": self.requestors,
            "placements": self.placements,
            "incumbent_placements": self.incumbent_placements,
            "sizes": sizes,
            "machine": self.machine,
            "load_before": self.load_before,
            "load_after": self.load_after,
            "elapsed_s": round(self.elapsed_s, 1),
            "left_out": self.left_out,
            "notes": self.notes,
        }


def _say_nothing(message: str) -> None:
    return


def run_versus(
    *,
    broker_url: str | BrokerUrl,
    nodes: Sequence[int] = (100, 1000),
    requestors: int = 8,
    placements: int = 2000,
    incumbent_placements: int = 200,
    progress: Progress = _say_nothing,
) -> VersusResult:
    """The run the module docstring describes. Raises :class:`BrokerError` when the broker
    cannot be used, :class:`BenchError` when reservoir's side cannot be carried out and
    :class:`IncumbentUnavailable` when Placement or MariaDB cannot be started."""
    url = bench_url(broker_url)
    if url.adapter == "memory":
        raise BenchError("versus placement needs a real broker: give an amqp:// URL")
    started = time.perf_counter()
    load_before = list(os.getloadavg())
    sizes = []
    for count in nodes:
        sizes.append(_one_size(url, count, requestors, placements, incumbent_placements, progress))
    return VersusResult(
        broker=url.display,
        requestors=requestors,
        placements=placements,
        incumbent_placements=incumbent_placements,
        sizes=sizes,
        machine={
            "cores": os.cpu_count() or 0,
            "python": platform.python_version(),
            "platform": platform.platform(terse=True),
        },
        load_before=load_before,
        load_after=list(os.getloadavg()),
        elapsed_s=time.perf_counter() - started,
        notes=[
            f"reservoir's {requestors} requestors ran in {requestors} processes, "
            f"Placement's {requestors} schedulers in {requestors} processes",
            f"Placement answered at microversion {MICROVERSION.split()[1]}, "
            "under gunicorn with 2 sync workers, on MariaDB on loopback",
        ],
    )


def _one_size(
    url: BrokerUrl,
    nodes: int,
    requestors: int,
    placements: int,
    incumbent_placements: int,
    progress: Progress,
) -> Size:
    slots = slots_per_node(nodes, requestors, placements)
    progress(f"{nodes} nodes: reservoir bench ({placements} placements, {requestors} requestors)")
    bench = run_bench(
        broker_url=url,
        nodes=nodes,
        requestors=requestors,
        node_processes=min(NODE_PROCESSES, nodes),
        placements=placements,
        requestor_processes=requestors,
        progress=lambda message: progress(f"  bench: {message}"),
    )
    fill = _reservoir_fill(url, nodes, requestors, progress)
    reservoir = Side(
        system="reservoir",
        placements_per_s=bench.placements_per_s,
        placed=bench.throughput_placed,
        refused=bench.throughput_failed,
        p50_ms=bench.throughput_p50_ms,
        p99_ms=bench.throughput_p99_ms,
        cpu_ms_per_placement=dict(bench.cpu_ms_per_placement),
        conflicts={},
        retries={},
        fill_placed=fill.placed,
        false_failures_at_90=fill.refused,
        filler_refused=fill.filler_refused,
        audit={k: bench.audit.get(k, 0) + fill.audit.get(k, 0) for k in bench.audit},
    )
    placement = _placement_side(nodes, slots, requestors, incumbent_placements, progress)
    return Size(nodes, slots, reservoir, placement)


# -- reservoir's fill ----------------------------------------------------------------------


@dataclass
class _Fill:
    placed: int
    refused: int
    filler_refused: int
    audit: dict[str, int] = field(default_factory=dict)


def _spread(count: int, workers: int) -> list[int]:
    return [count // workers + (1 if index < count % workers else 0) for index in range(workers)]


def _in_threads(
    requestors: Sequence[Requestor], count: int, one: Callable[[Requestor], bool]
) -> int:
    """``count`` calls of ``one`` spread over a thread per requestor, all at once; how
    many returned False."""
    refused = Counter[str]()
    lock = threading.Lock()

    def worker(requestor: Requestor, share: int) -> None:
        mine = sum(1 for _ in range(share) if not one(requestor))
        with lock:
            refused["refused"] += mine

    threads = [
        threading.Thread(target=worker, args=(r, s), daemon=True)
        for r, s in zip(requestors, _spread(count, len(requestors)), strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return refused["refused"]


def _reservoir_fill(url: BrokerUrl, nodes: int, requestors: int, progress: Progress) -> _Fill:
    from reservoir.brokers import admin, connect

    run_id = secrets.token_hex(4)
    fill_url = url.with_exchange(f"reservoir.versus.{run_id}")
    names = [f"versus-{run_id}-node-{index:04d}" for index in range(nodes)]
    progress(f"{nodes} nodes: reservoir filled to 90 % ({FILL_SLOTS} instances a node)")
    filler_refused = Counter[str]()
    with contextlib.ExitStack() as stack:
        topology = admin(fill_url)
        if topology is not None:
            stack.callback(topology.delete_reservoir_exchanges)
        host = ProcessNodes(
            fill_url, names, min(NODE_PROCESSES, nodes),
            vcpus=FILL_VCPUS,
            memory_mb=FILL_SLOTS * FLAVOUR_MEMORY_MB, vcpu_ratio=VCPU_ALLOCATION_RATIO,
        )  # fmt: skip
        stack.callback(host.stop)
        host.wait_ready(READY_TIMEOUT_S)
        broker = connect(fill_url)
        stack.callback(broker.close)
        timers = ThreadScheduler(SystemClock(), name="versus-requestor-timers")
        stack.callback(timers.close)
        settings = Settings(broker_url=fill_url)
        opened = [
            Requestor(broker, name=f"versus-{run_id}-r{index}", settings=settings, scheduler=timers)
            for index in range(requestors)
        ]
        for requestor in opened:
            stack.callback(requestor.close)
            wait_for_roster(requestor, nodes, READY_TIMEOUT_S)

        def filler(requestor: Requestor) -> bool:
            for _ in range(FILLER_ATTEMPTS):
                try:
                    requestor.reserve(
                        vcpus=FILLER_SLOTS * FLAVOUR_VCPUS,
                        memory_mb=FILLER_SLOTS * FLAVOUR_MEMORY_MB,
                        timeout_s=PLACE_TIMEOUT_S,
                    )
                    return True
                except PlacementError:
                    filler_refused["refused"] += 1
            return False

        def single(requestor: Requestor) -> bool:
            try:
                requestor.reserve(
                    vcpus=FLAVOUR_VCPUS, memory_mb=FLAVOUR_MEMORY_MB, timeout_s=PLACE_TIMEOUT_S
                )
            except PlacementError:
                return False
            return True

        unfilled = _in_threads(opened, nodes, filler)
        if unfilled:
            raise BenchError(
                f"reservoir could not pre-fill {unfilled} of {nodes} nodes to 80 % "
                f"({FILLER_ATTEMPTS} tries each)"
            )
        wanted = nodes * FILL_SLOTS // 10
        refused = _in_threads(opened, wanted, single)
        audit = audit_ledgers(host.ledgers())
    return _Fill(wanted - refused, refused, filler_refused["refused"], audit)


# -- Placement's side ----------------------------------------------------------------------


def _check(status: int, answer: object, what: str, ok: tuple[int, ...] = (200, 201, 204)) -> None:
    if status not in ok:
        raise BenchError(f"Placement answered {status} to {what}: {answer}")


def _providers(
    service: PlacementService, nodes: int, vcpus: int, memory_mb: int, prefix: str
) -> list[str]:
    """N resource providers with the bench node's inventory, created in a few threads."""
    uuids = [str(uuid.uuid4()) for _ in range(nodes)]
    local = threading.local()

    def create(index: int) -> None:
        if not hasattr(local, "client"):
            local.client = PlacementClient(service.url)
        client: PlacementClient = local.client
        provider = uuids[index]
        status, answer = client.call(
            "POST", "/resource_providers", {"uuid": provider, "name": f"{prefix}-{index:04d}"}
        )
        _check(status, answer, "POST /resource_providers")
        inventories = {
            "resource_provider_generation": 0,
            "inventories": {
                "VCPU": {"total": vcpus, "allocation_ratio": VCPU_ALLOCATION_RATIO},
                "MEMORY_MB": {"total": memory_mb, "allocation_ratio": 1.0},
            },
        }
        status, answer = client.call(
            "PUT", f"/resource_providers/{provider}/inventories", inventories
        )
        _check(status, answer, "PUT /resource_providers/{uuid}/inventories")

    with ThreadPoolExecutor(SETUP_THREADS) as pool:
        list(pool.map(create, range(nodes)))
    return uuids


@dataclass
class _Schedulers:
    latencies_s: list[float]
    refused: int
    conflicts: Counter[str]
    retries: int
    next_candidate: int
    elapsed_s: float
    cpu_ms_per_placement: dict[str, float]


def _pump(stream: IO[str], lines: queue.SimpleQueue[str]) -> None:
    for line in stream:
        lines.put(line)


def _run_schedulers(
    service: PlacementService, schedulers: int, placements: int, stack: contextlib.ExitStack
) -> _Schedulers:
    """K scheduler processes placing ``placements`` instances between them at once."""
    import json

    children: list[tuple[subprocess.Popen[str], queue.SimpleQueue[str]]] = []
    for share in _spread(placements, schedulers):
        process = subprocess.Popen(
            [sys.executable, "-m", "reservoir.tools.versus_placement.scheduler",
             "--url", service.url, "--placements", str(share),
             "--vcpus", str(FLAVOUR_VCPUS), "--memory-mb", str(FLAVOUR_MEMORY_MB)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env(),
        )  # fmt: skip
        stack.callback(_end, process)
        lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        assert process.stdout is not None
        threading.Thread(target=_pump, args=(process.stdout, lines), daemon=True).start()
        children.append((process, lines))

    def event(
        process: subprocess.Popen[str], lines: queue.SimpleQueue[str], name: str
    ) -> dict[str, Any]:
        deadline = time.monotonic() + max(READY_TIMEOUT_S, PLACE_TIMEOUT_S * placements)
        while time.monotonic() < deadline:
            try:
                message = json.loads(lines.get(timeout=0.5))
            except queue.Empty:
                if process.poll() is not None:
                    raise BenchError(
                        f"scheduler process {process.pid} exited with status {process.returncode}"
                    ) from None
                continue
            if message.get("event") == name:
                return dict(message)
        raise BenchError(f"scheduler process {process.pid} never said {name!r}")

    for process, lines in children:
        event(process, lines, "ready")
    meter = CpuMeter(
        {
            "placement (gunicorn)": service.placement_pids,
            "mariadb": service.mariadb_pids,
            "schedulers": [process.pid for process, _ in children],
        }
    )
    before = meter.snapshot()
    started = time.perf_counter()
    for process, _ in children:
        assert process.stdin is not None
        process.stdin.write("go\n")
        process.stdin.flush()
    done = [event(process, lines, "done") for process, lines in children]
    elapsed_s = time.perf_counter() - started
    after = meter.snapshot()  # before the schedulers exit, so that /proc still has them
    latencies = [float(s) for d in done for s in d["latencies_s"]]
    conflicts: Counter[str] = Counter()
    for d in done:
        conflicts.update(d["conflicts"])
    return _Schedulers(
        latencies_s=latencies,
        refused=sum(int(d["refused"]) for d in done),
        conflicts=conflicts,
        retries=sum(int(d["retries"]) for d in done),
        next_candidate=sum(int(d["next_candidate"]) for d in done),
        elapsed_s=elapsed_s,
        cpu_ms_per_placement=CpuMeter.per_placement_ms(before, after, len(latencies)),
    )


def _end(process: subprocess.Popen[str]) -> None:
    """A scheduler that has said ``done`` exits when its stdin closes; one still placing
    (the run was interrupted) is terminated."""
    if process.stdin is not None:
        with contextlib.suppress(OSError):
            process.stdin.close()
    try:
        process.wait(1)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _prefill(service: PlacementService, providers: Sequence[str]) -> None:
    """One allocation of FILLER_SLOTS instances on every provider, written in bulk
    (POST /allocations, many consumers a request): setup, not measured."""
    client = PlacementClient(service.url)
    try:
        resources = {
            "VCPU": FILLER_SLOTS * FLAVOUR_VCPUS,
            "MEMORY_MB": FILLER_SLOTS * FLAVOUR_MEMORY_MB,
        }
        for start in range(0, len(providers), BULK_CONSUMERS):
            body = {
                str(uuid.uuid4()): {
                    "allocations": {provider: {"resources": resources}},
                    "project_id": PROJECT_ID,
                    "user_id": USER_ID,
                    "consumer_generation": None,
                }
                for provider in providers[start : start + BULK_CONSUMERS]
            }
            status, answer = client.call("POST", "/allocations", body)
            _check(status, answer, "POST /allocations")
    finally:
        client.close()


def _placement_side(
    nodes: int, slots: int, schedulers: int, placements: int, progress: Progress
) -> Side:
    with contextlib.ExitStack() as stack:
        service = start_placement(stack, lambda message: progress(f"  placement: {message}"))
        progress(f"{nodes} nodes: {nodes} resource providers of {slots} instances each")
        _providers(
            service, nodes, slots * FLAVOUR_VCPUS // int(VCPU_ALLOCATION_RATIO),
            slots * FLAVOUR_MEMORY_MB, "versus-node",
        )  # fmt: skip
        progress(f"{nodes} nodes: {placements} claims by {schedulers} scheduler processes")
        run = _run_schedulers(service, schedulers, placements, stack)
    with contextlib.ExitStack() as stack:
        service = start_placement(stack, lambda message: progress(f"  placement: {message}"))
        progress(f"{nodes} nodes: Placement filled to 90 % ({FILL_SLOTS} instances a node)")
        providers = _providers(
            service, nodes, FILL_VCPUS,
            FILL_SLOTS * FLAVOUR_MEMORY_MB, "versus-fill",
        )  # fmt: skip
        _prefill(service, providers)
        fill = _run_schedulers(service, schedulers, nodes * FILL_SLOTS // 10, stack)
    p50 = percentile(run.latencies_s, 0.50) * 1000 if run.latencies_s else 0.0
    p99 = percentile(run.latencies_s, 0.99) * 1000 if run.latencies_s else 0.0
    return Side(
        system="placement",
        placements_per_s=round(len(run.latencies_s) / run.elapsed_s, 1) if run.elapsed_s else 0.0,
        placed=len(run.latencies_s),
        refused=run.refused,
        p50_ms=round(p50, 3),
        p99_ms=round(p99, 3),
        cpu_ms_per_placement=run.cpu_ms_per_placement,
        conflicts=dict(run.conflicts),
        retries={"same_provider": run.retries, "next_candidate": run.next_candidate},
        fill_placed=len(fill.latencies_s),
        false_failures_at_90=fill.refused,
        filler_refused=0,
        fill_conflicts=dict(fill.conflicts),
        fill_retries={"same_provider": fill.retries, "next_candidate": fill.next_candidate},
    )
