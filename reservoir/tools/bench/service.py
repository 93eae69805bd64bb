"""``reservoir bench-service``: the HTTP service as its users meet it, beside the library,
on the same nodes in the same run.

This module owns one run, in order:

1. **nodes**: ``--nodes`` node agents in ``--node-processes`` processes of their own, on
   exchanges of the run's own (removed at the end), as ``reservoir bench`` starts them;
2. **the library**: one :class:`~reservoir.Requestor` in this process places and releases
   one request at a time (unkeyed, then keyed), then ``--clients`` threads place on it at
   once: the latencies, the placements per second, and this process's CPU per placement
   and release;
3. **the service**: ``--replicas`` ``reservoir serve`` processes on the same nodes, driven
   over real HTTP (httpx, one connection per client) from this process, after the
   library's requestor is closed:
   - one client at a time: POST then DELETE, unkeyed and keyed (the p50s set against the
     library's, and the replicas' CPU per POST and DELETE against the library's per
     placement and release); GET of a placement on the replica that placed it, on
     another, and of ids nobody holds;
   - ``--clients`` connections at once POSTing on one replica (placements per second
     against the library's), then on every replica: driven by wrk, a C load tool, where
     it is installed (a Python client's own CPU would be a large share of the machine's),
     else by httpx clients of this process, which the result says (``load_tool``);
   - ``--clients`` clients at once, each POST then GET (on the next replica) then DELETE,
     ``--cycles`` times, unkeyed and keyed: every answer counted by status, and any 404
     for an id that was just placed is a failure of the run;
4. **the audit** of every node's ledger: nothing held at the end, no reservation past its
   time, no overcommit, no id placed twice.

Progress goes to stderr; stdout gets the table, or with ``--json`` one JSON object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import secrets
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from reservoir.brokers import BrokerUrl
from reservoir.runtime.requestor import Requestor
from reservoir.runtime.settings import Settings
from reservoir.tools.bench.children import ProcessNodes, child_env
from reservoir.tools.bench.errors import BenchError
from reservoir.tools.bench.limits import broker_processes
from reservoir.tools.bench.runner import (
    Target,
    audit_ledgers,
    bench_url,
    percentile,
    run_exchanges,
)

__all__ = ["ServiceBenchResult", "run_service_bench"]

#: every request of the run asks for this much, so that nodes fill slowly
VCPUS: Final = 1
MEMORY_MB: Final = 64
#: how long a replica may take to say it is ready, and a request to be answered
READY_TIMEOUT_S: Final = 60.0
HTTP_TIMEOUT_S: Final = 30.0
#: requests before the timed ones, on each path
WARMUP: Final = 20
#: unknown ids a GET asks for
UNKNOWN_GETS: Final = 100
#: how long wrk POSTs in a throughput run, by default
WRK_DURATION_S: Final = 4

Progress = Callable[[str], None]


#: the API tier's targets (issue 52), stated for this command's defaults on RabbitMQ
_STATED: Final = "RabbitMQ, 10 nodes, 16 clients"
TARGETS: Final = (
    Target("get_p50_placing_ms", 10, True, _STATED),
    Target("get_p50_other_ms", 20, True, _STATED),
    Target("get_unknown_p50_ms", 10, True, _STATED),
    Target("post_p50_over_library", 2, True, _STATED),
    Target("keyed_post_p50_over_library", 2, True, _STATED),
    Target("cpu_per_cycle_over_library", 2, True, _STATED),
    Target("post_per_s_over_library", 0.5, False, _STATED),
    Target("not_found_for_held", 0, True, "any broker"),
    Target("held_at_end", 0, True, "any broker"),
)


@dataclass
class ServiceBenchResult:
    """What one run measured. Times in milliseconds unless the name says otherwise."""

    broker: str
    nodes: int
    node_processes: int
    replicas: int
    clients: int
    sequential: int
    cycles: int
    #: the library, one request at a time: reserve and release p50/p99, unkeyed and keyed
    library: dict[str, float]
    #: the service, one request at a time (the replica that placed, and another)
    http: dict[str, float]
    #: placements per second with ``clients`` at once: the library's requestor, one
    #: replica, every replica (the replicas' driven by ``load_tool``)
    library_per_s: float
    post_per_s_one_replica: float
    post_per_s_every_replica: float
    #: CPU per placement and release (ms): this process for the library, the replicas'
    #: processes together for the service
    library_cpu_ms_per_cycle: float
    serve_cpu_ms_per_cycle: float
    serve_cpu_ms_per_post_under_load: float
    #: CPU per placement of the concurrent runs by part (the library's requestor is "this
    #: process"; the service's clients are the load tool), and the placements per second
    #: the machine's cores allow at those costs
    library_cpu_ms_per_placement: dict[str, float]
    service_cpu_ms_per_post: dict[str, float]
    library_cpu_bound_per_s: float
    service_cpu_bound_per_s: float
    #: the concurrent cycles, unkeyed and keyed: answers by method and status
    cycle_statuses: dict[str, dict[str, int]]
    cycle_per_s: dict[str, float]
    #: a GET or DELETE answered 404 for an id a POST had just placed
    not_found_for_held: int
    #: instances the nodes hold at the end (every placement was deleted)
    held_at_end: int
    #: what drove the concurrent POSTs: ``wrk`` (a C load tool), else ``httpx``
    load_tool: str
    audit: dict[str, int]
    elapsed_s: float
    ratios: dict[str, float] = field(default_factory=dict)
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def run_service_bench(
    *,
    broker_url: str | BrokerUrl,
    nodes: int = 10,
    node_processes: int = 2,
    replicas: int = 2,
    clients: int = 16,
    sequential: int = 300,
    cycles: int = 1000,
    load_s: int = WRK_DURATION_S,
    progress: Progress = lambda message: None,
) -> ServiceBenchResult:
    """One run; see the module docstring. Raises :class:`BenchError` when the run cannot
    be carried out (a replica that does not start, an answer that is not HTTP)."""
    url = bench_url(broker_url)
    if url.adapter == "memory":
        raise BenchError("the service runs in processes of its own: give a RabbitMQ URL")
    started = time.perf_counter()
    run_id = secrets.token_hex(4)
    exchange, _ = run_exchanges(url, run_id)
    run_url = url.with_exchange(exchange)
    # what the run holds at once at most: wrk's POSTs (at up to 3,000 a second) are the most
    slots = 4 * (sequential * 6 + cycles * 2 + clients * 200 + 3000 * load_s) // nodes + 64
    with contextlib.ExitStack() as stack:
        stack.callback(_delete_exchanges, run_url)
        progress(f"starting {nodes} node agents in {node_processes} processes")
        host = ProcessNodes(
            run_url,
            [f"svc-{run_id}-node-{i:03d}" for i in range(nodes)],
            node_processes,
            vcpus=slots,
            memory_mb=slots * MEMORY_MB * 4,
            vcpu_ratio=4.0,
        )
        stack.callback(host.stop)
        host.wait_ready(READY_TIMEOUT_S)
        parts = _Parts({"nodes": host.pids, "broker": broker_processes(url)})
        progress("the library: one request at a time, then concurrently")
        library = _library(run_url, sequential, clients, parts)
        progress(f"starting {replicas} reservoir serve replica(s)")
        bases = [stack.enter_context(_replica(run_url, index)) for index in range(replicas)]
        parts.parts["replicas"] = [_REPLICA_PIDS[base] for base in bases]
        progress("the service over HTTP")

        def held_ids() -> list[str]:
            return sorted({r for ledger in host.ledgers() for r in ledger["instances"]})

        service = asyncio.run(
            _service(bases, sequential, cycles, clients, load_s, progress, held_ids, parts)
        )
        ledgers = host.ledgers()
    audit = audit_ledgers(ledgers)
    held = sum(count for s in ledgers for count, _asked in s["instances"].values())
    result = ServiceBenchResult(
        broker=url.display,
        nodes=nodes,
        node_processes=node_processes,
        replicas=replicas,
        clients=clients,
        sequential=sequential,
        cycles=cycles,
        library=library.latencies,
        http=service.latencies,
        library_per_s=library.per_s,
        post_per_s_one_replica=service.per_s_one,
        post_per_s_every_replica=service.per_s_every,
        library_cpu_ms_per_cycle=library.cpu_ms_per_cycle,
        serve_cpu_ms_per_cycle=service.cpu_ms_per_cycle,
        serve_cpu_ms_per_post_under_load=service.cpu_ms_per_post,
        library_cpu_ms_per_placement=library.cpu_ms_per_placement,
        service_cpu_ms_per_post=service.cpu_ms_per_post_by_part,
        library_cpu_bound_per_s=_bound(library.cpu_ms_per_placement),
        service_cpu_bound_per_s=_bound(service.cpu_ms_per_post_by_part),
        cycle_statuses=service.statuses,
        cycle_per_s=service.cycle_per_s,
        not_found_for_held=service.not_found_for_held,
        held_at_end=held,
        load_tool=service.load_tool,
        audit=audit,
        elapsed_s=round(time.perf_counter() - started, 1),
        notes=service.notes,
    )
    result.ratios = _ratios(result)
    figures = {
        **result.ratios,
        **result.http,
        "not_found_for_held": float(service.not_found_for_held),
        "held_at_end": float(held),
    }
    result.targets = {
        t.figure: {"value": figures[t.figure], "bound": t.bound, "at_most": t.at_most,
                   "met": t.met_by(figures[t.figure])}
        for t in TARGETS if t.figure in figures
    }  # fmt: skip
    return result


def _ratios(result: ServiceBenchResult) -> dict[str, float]:
    def ratio(numerator: float, denominator: float) -> float:
        return round(numerator / denominator, 2) if denominator > 0 else 0.0

    reserve = result.library["reserve_p50_ms"]
    return {
        "post_p50_over_library": ratio(result.http["post_p50_ms"], reserve),
        "keyed_post_p50_over_library": ratio(result.http["keyed_post_p50_ms"], reserve),
        "keyed_post_p50_over_library_keyed": ratio(
            result.http["keyed_post_p50_ms"], result.library["keyed_reserve_p50_ms"]
        ),
        "cpu_per_cycle_over_library": ratio(
            result.serve_cpu_ms_per_cycle, result.library_cpu_ms_per_cycle
        ),
        "post_per_s_over_library": ratio(result.post_per_s_one_replica, result.library_per_s),
    }


# -- what the machine spends ---------------------------------------------------------------


class _Parts:
    """The CPU the run's processes spend, by part: ``this process`` (the library's
    requestor, or the HTTP clients), the replicas, the node processes, the broker and the
    load tool (wrk, a child that has ended)."""

    def __init__(self, parts: dict[str, list[int]]) -> None:
        self.parts = parts

    def read(self) -> dict[str, float]:
        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        read = {part: _cpu_s(pids) for part, pids in self.parts.items() if pids}
        read["this process"] = time.process_time()
        read["load tool"] = children.ru_utime + children.ru_stime
        return read

    def per(self, before: dict[str, float], count: int) -> dict[str, float]:
        """CPU (ms) per one of ``count`` since ``before``, by part."""
        after = self.read()
        return {
            part: round((after[part] - before[part]) / max(count, 1) * 1000, 3)
            for part in after
            if part in before
        }


def _bound(per_ms: dict[str, float]) -> float:
    """What the machine's cores allow at ``per_ms`` CPU (every part's) per placement."""
    total = sum(per_ms.values())
    return round((os.cpu_count() or 1) * 1000 / total, 1) if total > 0 else 0.0


# -- the library ------------------------------------------------------------------------


@dataclass
class _Library:
    latencies: dict[str, float]
    per_s: float
    cpu_ms_per_cycle: float
    #: CPU per placement of the concurrent run, by part
    cpu_ms_per_placement: dict[str, float]


def _library(url: BrokerUrl, sequential: int, clients: int, parts: _Parts) -> _Library:
    """One requestor of this process, as an API worker embeds it."""
    with Requestor(url, settings=Settings(broker_url=url)) as requestor:
        for _ in range(WARMUP):
            requestor.release(requestor.reserve(vcpus=VCPUS, memory_mb=MEMORY_MB))
        reserve, release = [], []
        cpu_before = time.process_time()
        for _ in range(sequential):
            began = time.perf_counter()
            placement = requestor.reserve(vcpus=VCPUS, memory_mb=MEMORY_MB)
            placed = time.perf_counter()
            requestor.release(placement)
            reserve.append(placed - began)
            release.append(time.perf_counter() - placed)
        cpu_ms = (time.process_time() - cpu_before) / sequential * 1000
        keyed = []
        for _ in range(sequential):
            began = time.perf_counter()
            placement = requestor.reserve(
                vcpus=VCPUS, memory_mb=MEMORY_MB, request_id=f"lib-{secrets.token_hex(8)}"
            )
            keyed.append(time.perf_counter() - began)
            requestor.release(placement)
        per_s, by_part = _library_throughput(requestor, clients, sequential * 2, parts)
    return _Library(
        latencies={
            **_summary("reserve", reserve),
            **_summary("release", release),
            **_summary("keyed_reserve", keyed),
        },
        per_s=per_s,
        cpu_ms_per_cycle=round(cpu_ms, 3),
        cpu_ms_per_placement=by_part,
    )


def _library_throughput(
    requestor: Requestor, threads: int, placements: int, parts: _Parts
) -> tuple[float, dict[str, float]]:
    """``threads`` threads place ``placements`` between them at once (placements per
    second, and the CPU per placement by part), then release them."""
    placed: list[Any] = []
    lock = threading.Lock()
    left = [placements]
    start = threading.Barrier(threads + 1)

    def place() -> None:
        start.wait()
        while True:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            placement = requestor.reserve(vcpus=VCPUS, memory_mb=MEMORY_MB)
            with lock:
                placed.append(placement)

    workers = [threading.Thread(target=place) for _ in range(threads)]
    for worker in workers:
        worker.start()
    before = parts.read()
    start.wait()
    began = time.perf_counter()
    for worker in workers:
        worker.join()
    per_s = len(placed) / (time.perf_counter() - began)
    by_part = parts.per(before, len(placed))
    for placement in placed:
        requestor.release(placement)
    return round(per_s, 1), by_part


# -- the service ------------------------------------------------------------------------


@contextlib.contextmanager
def _replica(url: BrokerUrl, index: int) -> Iterator[str]:
    """A ``reservoir serve`` process on a free port of the loopback; its base URL."""
    import httpx

    port = _free_port()
    env = child_env()
    env["RESERVOIR_BROKER_URL"] = url.given
    env["RESERVOIR_REQUESTOR_NAME"] = f"bench-serve-{index}"
    process = subprocess.Popen(
        [sys.executable, "-m", "reservoir.cli", "serve", "--host", "127.0.0.1",
         "--port", str(port)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            if process.poll() is not None:
                tail = (process.stderr.read() if process.stderr else "").strip()[-500:]
                raise BenchError(f"reservoir serve exited with {process.returncode}: {tail}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise BenchError(f"reservoir serve on port {port} was not ready in time")
            time.sleep(0.1)
        _REPLICA_PIDS[base] = process.pid
        yield base
    finally:
        _REPLICA_PIDS.pop(base, None)
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


#: base URL -> the pid of the replica serving it, for its CPU
_REPLICA_PIDS: dict[str, int] = {}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _cpu_s(pids: Sequence[int]) -> float:
    """The CPU (user and system) these processes have used, in seconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / ticks
    return total


@dataclass
class _Service:
    latencies: dict[str, float] = field(default_factory=dict)
    per_s_one: float = 0.0
    per_s_every: float = 0.0
    cpu_ms_per_cycle: float = 0.0
    cpu_ms_per_post: float = 0.0
    cpu_ms_per_post_by_part: dict[str, float] = field(default_factory=dict)
    statuses: dict[str, dict[str, int]] = field(default_factory=dict)
    cycle_per_s: dict[str, float] = field(default_factory=dict)
    not_found_for_held: int = 0
    #: what drove the concurrent POSTs: wrk where it is installed, else httpx
    load_tool: str = "httpx"
    notes: list[str] = field(default_factory=list)


BODY: Final = {"vcpus": VCPUS, "memory_mb": MEMORY_MB}


async def _service(
    bases: list[str],
    sequential: int,
    cycles: int,
    clients: int,
    load_s: int,
    progress: Progress,
    held_ids: Callable[[], list[str]],
    parts: _Parts,
) -> _Service:
    measured = _Service()
    pids = [_REPLICA_PIDS[base] for base in bases]
    opened = [_client(base) for base in bases]
    try:
        first, other = opened[0], opened[-1]
        for _ in range(WARMUP):
            await _delete(first, await _post(first))
        # one at a time: POST then DELETE, unkeyed, then keyed
        posts, deletes = [], []
        cpu_before = _cpu_s(pids)
        for _ in range(sequential):
            request_id, took = await _timed_post(first)
            posts.append(took)
            deletes.append(await _timed_delete(first, request_id))
        measured.cpu_ms_per_cycle = round((_cpu_s(pids) - cpu_before) / sequential * 1000, 3)
        keyed = []
        for _ in range(sequential):
            request_id, took = await _timed_post(first, key=f"svc-{secrets.token_hex(8)}")
            keyed.append(took)
            await _delete(first, request_id)
        # GETs: on the replica that placed, on another, and of ids nobody holds
        placing, elsewhere, unknown = [], [], []
        for _ in range(sequential):
            request_id = await _post(first)
            placing.append(await _timed_get(first, request_id, 200))
            elsewhere.append(await _timed_get(other, request_id, 200))
            await _delete(first, request_id)
        for _ in range(UNKNOWN_GETS):
            unknown.append(await _timed_get(other, f"nobody-{secrets.token_hex(8)}", 404))
        measured.latencies = {
            **_summary("post", posts),
            **_summary("keyed_post", keyed),
            **_summary("delete", deletes),
            **_summary("get", placing, suffix="_placing"),
            **_summary("get", elsewhere, suffix="_other"),
            **_summary("get_unknown", unknown),
        }
        progress(f"{clients} clients at once on one replica, then on every replica")
        if shutil.which("wrk") is not None:
            measured.per_s_one, by_part = await _wrk_throughput(
                bases[:1], clients, load_s, opened, parts
            )
            measured.cpu_ms_per_post_by_part = by_part
            measured.cpu_ms_per_post = by_part.get("replicas", 0.0)
            measured.per_s_every, _ = await _wrk_throughput(bases, clients, load_s, opened, parts)
            measured.load_tool = "wrk"
            # wrk hangs up on the POSTs in flight when its time is up: the replicas place
            # them all the same (a client going away does not undo a placement), and
            # nobody heard their ids. Once no replica has a placement in flight, whatever
            # the nodes hold is theirs: freed as any caller would, by DELETE.
            await _until_idle(opened[: len(bases)])
            for request_id in held_ids():
                await _delete(first, request_id)
        else:
            alone = [_client(bases[0]) for _ in range(clients)]
            spread = [_client(bases[i % len(bases)]) for i in range(clients)]
            opened.extend(alone + spread)
            measured.per_s_one, measured.cpu_ms_per_post = await _throughput(
                alone, sequential * 2, pids
            )
            measured.per_s_every, _ = await _throughput(spread, sequential * 2, pids)
            measured.notes.append(
                "wrk is not installed: the concurrent POSTs were httpx clients of this "
                "process, whose own CPU (about 0.6 ms a request here) the machine's cores "
                "spend beside the service's"
            )
        for keyed_cycles in (False, True):
            label = "keyed" if keyed_cycles else "unkeyed"
            progress(f"{clients} clients at once: POST, GET, DELETE, {cycles} cycles, {label}")
            counted, per_s, not_found = await _cycles(bases, clients, cycles, keyed_cycles)
            measured.statuses[label] = dict(sorted(counted.items()))
            measured.cycle_per_s[label] = per_s
            measured.not_found_for_held += not_found
    finally:
        for client in opened:
            await client.aclose()
    return measured


def _client(base: str) -> Any:
    """An HTTP client of one connection to ``base``, as one user of the service has."""
    import httpx

    return httpx.AsyncClient(
        base_url=base, timeout=HTTP_TIMEOUT_S, limits=httpx.Limits(max_connections=1)
    )


async def _post(client: Any, key: str | None = None) -> str:
    request_id, _took = await _timed_post(client, key=key)
    return request_id


async def _timed_post(client: Any, key: str | None = None) -> tuple[str, float]:
    headers = {"Idempotency-Key": key} if key is not None else {}
    began = time.perf_counter()
    response = await client.post("/v1/reservations", json=BODY, headers=headers)
    took = time.perf_counter() - began
    if response.status_code != 201:
        raise BenchError(f"POST answered {response.status_code}: {response.text[:300]}")
    return str(response.json()["request_id"]), took


async def _delete(client: Any, request_id: str) -> None:
    await _timed_delete(client, request_id)


async def _timed_delete(client: Any, request_id: str) -> float:
    began = time.perf_counter()
    response = await client.delete(f"/v1/reservations/{request_id}")
    took = time.perf_counter() - began
    if response.status_code != 204:
        raise BenchError(
            f"DELETE {request_id} answered {response.status_code}: {response.text[:300]}"
        )
    return took


async def _timed_get(client: Any, request_id: str, expected: int) -> float:
    began = time.perf_counter()
    response = await client.get(f"/v1/reservations/{request_id}")
    took = time.perf_counter() - began
    if response.status_code != expected:
        raise BenchError(
            f"GET {request_id} answered {response.status_code} where {expected} was due: "
            f"{response.text[:300]}"
        )
    return took


async def _throughput(clients: list[Any], posts: int, pids: list[int]) -> tuple[float, float]:
    """The ``clients`` POST ``posts`` requests between them at once (placements per
    second, the replicas' CPU per POST), then DELETE them all."""
    placed: list[tuple[Any, str]] = []
    left = [posts]

    async def one(client: Any) -> None:
        while left[0] > 0:
            left[0] -= 1
            placed.append((client, await _post(client)))

    cpu_before = _cpu_s(pids)
    began = time.perf_counter()
    await asyncio.gather(*(one(client) for client in clients))
    elapsed = time.perf_counter() - began
    cpu_ms = (_cpu_s(pids) - cpu_before) / len(placed) * 1000

    async def free(client: Any, ids: list[str]) -> None:
        for request_id in ids:
            await _delete(client, request_id)

    by_client: dict[int, tuple[Any, list[str]]] = {}
    for client, request_id in placed:
        by_client.setdefault(id(client), (client, []))[1].append(request_id)
    await asyncio.gather(*(free(client, ids) for client, ids in by_client.values()))
    return round(len(placed) / elapsed, 1), round(cpu_ms, 3)


WRK_SCRIPT: Final = Path(__file__).with_name("post.lua")


async def _wrk_throughput(
    bases: list[str], clients: int, seconds: int, opened: list[Any], parts: _Parts
) -> tuple[float, dict[str, float]]:
    """``clients`` connections of wrk (a C load tool: its own CPU is a small part of what
    an HTTP client in Python spends), split over ``bases``, POST for ``seconds``;
    then every placement they made is deleted. Placements per second, and the CPU per
    POST by part, meanwhile."""
    before = parts.read()
    with tempfile.TemporaryDirectory(prefix="reservoir-wrk-") as folder:
        ids_at = str(Path(folder) / "ids")
        share = [clients // len(bases) + (i < clients % len(bases)) for i in range(len(bases))]
        ran = await asyncio.gather(
            *(
                asyncio.to_thread(_run_wrk, base, connections, seconds, f"{ids_at}-{i}", f"{i}")
                for i, (base, connections) in enumerate(zip(bases, share, strict=True))
                if connections
            )
        )
        requests = sum(r["requests"] for r in ran)
        refused = sum(r["non_2xx"] + r["errors"] for r in ran)
        if refused:
            raise BenchError(f"wrk's POSTs: {refused} of {requests} were not answered 201")
        ids = [line for path in Path(folder).glob("ids-*") for line in path.read_text().split()]
        by_part = parts.per(before, len(ids))
    took_s = max(r["duration_us"] for r in ran) / 1e6
    by_base = {base: _client(base) for base in bases}
    opened.extend(by_base.values())
    # freed on the replica that placed each (any replica would do): 16 at a time
    lanes: list[list[str]] = [ids[i :: max(clients, 1)] for i in range(max(clients, 1))]
    first = by_base[bases[0]]

    async def free(lane: list[str]) -> None:
        for request_id in lane:
            await _delete(first, request_id)

    await asyncio.gather(*(free(lane) for lane in lanes))
    return round(len(ids) / took_s, 1), by_part


async def _until_idle(replicas: list[Any]) -> None:
    """Until no replica has a placement or release in flight (``/healthz``)."""
    for _ in range(600):
        answers = [await replica.get("/healthz") for replica in replicas]
        if all(a.status_code == 200 and a.json().get("in_flight") == 0 for a in answers):
            return
        await asyncio.sleep(0.05)
    raise BenchError("the replicas still had placements in flight after 30 s")


def _run_wrk(base: str, connections: int, seconds: int, ids_at: str, tag: str) -> dict[str, int]:
    threads = max(1, min(2, connections))
    done = subprocess.run(
        ["wrk", "-t", str(threads), "-c", str(connections), "-d", f"{seconds}s",
         "--latency", "-s", str(WRK_SCRIPT), f"{base}/v1/reservations", "--", ids_at, tag],
        capture_output=True, text=True, timeout=seconds + 60, check=False,
    )  # fmt: skip
    last = done.stdout.strip().splitlines()[-1:] or [""]
    try:
        found: dict[str, int] = json.loads(last[0])
    except ValueError:
        raise BenchError(f"wrk said no summary: {done.stderr.strip()[-300:]}") from None
    return found


async def _cycles(
    bases: list[str], clients: int, cycles: int, keyed: bool
) -> tuple[Counter[str], float, int]:
    """Each client POSTs on its replica, GETs on the next, DELETEs on its own, until
    ``cycles`` are done between them: the answers by method and status, the cycles per
    second, and the 404s for ids just placed."""
    counted: Counter[str] = Counter()
    not_found = [0]
    left = [cycles]

    async def one(index: int) -> None:
        own = bases[index % len(bases)]
        next_one = bases[(index + 1) % len(bases)]
        async with _client(own) as mine, _client(next_one) as nxt:
            while left[0] > 0:
                left[0] -= 1
                key = f"cycle-{secrets.token_hex(8)}" if keyed else None
                headers = {"Idempotency-Key": key} if key else {}
                posted = await mine.post("/v1/reservations", json=BODY, headers=headers)
                counted[f"POST {posted.status_code}"] += 1
                if posted.status_code != 201:
                    continue
                request_id = posted.json()["request_id"]
                got = await nxt.get(f"/v1/reservations/{request_id}")
                counted[f"GET {got.status_code}"] += 1
                deleted = await mine.delete(f"/v1/reservations/{request_id}")
                counted[f"DELETE {deleted.status_code}"] += 1
                not_found[0] += (got.status_code == 404) + (deleted.status_code == 404)
                if deleted.status_code != 204:
                    # not freed: free it now, or the audit finds it held
                    await _free_for_sure(mine, request_id)

    began = time.perf_counter()
    await asyncio.gather(*(one(index) for index in range(clients)))
    per_s = round(cycles / (time.perf_counter() - began), 1)
    return counted, per_s, not_found[0]


async def _free_for_sure(client: Any, request_id: str) -> None:
    """DELETE until the service says it is gone (204, or 404 once a 204 was had)."""
    for _ in range(50):
        response = await client.delete(f"/v1/reservations/{request_id}")
        if response.status_code in (204, 404):
            return
        await asyncio.sleep(0.1)


# -- helpers ----------------------------------------------------------------------------


def _summary(name: str, samples: Sequence[float], *, suffix: str = "") -> dict[str, float]:
    return {
        f"{name}_p50{suffix}_ms": round(statistics.median(samples) * 1000, 3),
        f"{name}_p99{suffix}_ms": round(percentile(samples, 0.99) * 1000, 3),
    }


def _delete_exchanges(url: BrokerUrl) -> None:
    from reservoir.brokers import admin

    topology = admin(url)
    if topology is not None:
        topology.delete_reservoir_exchanges()
