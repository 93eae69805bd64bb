"""The floor under ``own_cpu_over_broker_cpu``: a placement's seven messages with no work
at all, through reservoir's own RabbitMQ adapter, on the bench's processes and
concurrency, in turns with ``reservoir bench`` itself.

    python benchmarks/message_floor.py [--broker amqp://guest:guest@127.0.0.1:5672/] \\
        [--nodes 100] [--node-processes 2] [--requestors 8] [--placements 4000] \\
        [--pairs 3] [--no-bench] [--json]

(``--sequential``, ``--work-placements`` and ``--bench-placements`` size the other runs; a
test runs it with every size small.)

``reservoir bench``'s throughput run says what a placement costs reservoir's processes
(the requestors' and the node agents') and RabbitMQ, in CPU. This script says how much of
reservoir's share the messages alone take, with the same adapter (``reservoir.brokers.connect``:
publisher confirms, ``mandatory``, the topic exchanges, an exclusive queue per endpoint,
handlers ``inline`` on the IO thread, as the driver opens them) and nothing above it:

- ``--nodes`` endpoints spread over ``--node-processes`` processes, as the bench's node
  agents are. A node answers a request with an offer and an award with an acceptance; it
  drops a release. No ledger, no decision, no codec.
- One requestor endpoint in this process, and ``--requestors`` placements in flight, as
  the bench's throughput run has. A placement sends two requests to two nodes picked at
  random, decides once both have offered (as the requestor decides a probe round when
  every probed node has answered), awards the first to offer, releases the other and
  ends when the acceptance comes:
  request, offer, award, release and accepted, seven messages, each of the size the
  protocol's own message has (:data:`SIZES`).

Three floors, each a run of its own:

- ``io``: every placement after the first few is started by the handler that read the
  previous one's acceptance, on the broker's IO thread: no thread hands anything over.
  This is the least reservoir's processes can spend on the messages through this adapter.
- ``threads``: ``--requestors`` threads, each sending its placement's requests and waiting
  for its acceptance as ``Requestor.reserve`` does (the requests handed to the IO thread,
  the caller woken by it). This adds what a synchronous caller's hand-overs cost.
- one placement at a time: the bench's sequential run without the work. From this
  thread, a round trip to an endpoint of this process (the bench's baseline, a 512-byte
  body), then a placement, each waited for: ``place_p50_over_rtt`` with nothing but the
  messages, the floor under the bench's ratio of that name.

And the work alone: ``runtime_instructions.py`` (one requestor and ``--nodes`` node agents
on the in-process broker, every step on one thread) timed at two sizes, the CPU of the
machines, the drivers and the codec per placement with no thread and no RabbitMQ
(:func:`run_work`). A floor plus the work alone is the least a runtime that makes the
placement's decisions could spend with that kind of caller; over the bench's RabbitMQ CPU
it is :func:`bound`. With the bench's own figures from the same turns, the difference
says what the rest of reservoir (the hand-overs, the timers, the metrics, the roster's
announcements) costs on top.

The two concurrent floors measure ``--placements`` placements after as many again
unmeasured (the warm-up), CPU from ``/proc`` as the bench reads it
(:class:`reservoir.tools.bench.limits.CpuMeter`). Every floor checks that every message
was confirmed and none returned, and that every placement was accepted by the node it
awarded. The runs take turns (``io``, ``threads``, the work, the sequential floor, the
bench), the order rotating by pair; the script prints every run, the medians by kind and
the bounds, or one JSON object with ``--json``. Every run uses exchanges of its own,
deleted at the end. What the bounds stand at: docs/performance.md, "The library's targets".
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import random
import resource
import statistics
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import reservoir.brokers
from reservoir import interrupt
from reservoir.broker import Delivery, Endpoint
from reservoir.brokers.amqp.threaded import AmqpBroker
from reservoir.brokers.url import BrokerUrl
from reservoir.tools.bench.limits import CpuMeter, broker_processes, own_cpu
from reservoir.tools.bench.runner import RTT_BODY_BYTES

REQUEST, OFFER, AWARD, RELEASE, ACCEPTED = b"Q", b"O", b"A", b"R", b"C"
#: a round trip's body, the bench's baseline
ECHO = b"E"

#: Body bytes of each kind: the median size of the protocol's own message, encoded by
#: ``reservoir.runtime.wire.Codec`` in ``reservoir bench --broker memory:// --nodes 100``
#: (2026-12-05): ReservationRequest 293, Offer 318, Award 277, Release 172, Accepted 370.
#: A round trip's body is the bench's (``RTT_BODY_BYTES``).
SIZES = {REQUEST: 293, OFFER: 318, AWARD: 277, RELEASE: 172, ACCEPTED: 370, ECHO: RTT_BODY_BYTES}

#: a body starts with its kind, the placement's number and the node's
_HEAD = struct.Struct(">cII")
_STALL_S = 60.0

Callers = Literal["io", "threads"]
#: the kinds of run, as reported
FLOORS: dict[Callers, str] = {
    "io": "floor, callers on the IO thread",
    "threads": "floor, callers on threads",
}
WORK = "the work alone, one thread"
WORK_WOKEN = "the work alone, woken before every step"
SEQUENTIAL = "floor, one placement at a time"
#: sequential placements and round trips not measured, first
WARM_UP = 100
BENCH = "reservoir bench (throughput run)"


def body(kind: bytes, flow: int, node: int) -> bytes:
    """A message of ``kind`` for placement ``flow`` from or to node ``node``, padded to
    the protocol's size for that kind."""
    return _HEAD.pack(kind, flow, node).ljust(SIZES[kind], b".")


def read(body: bytes) -> tuple[bytes, int, int]:
    """The kind, placement and node of a :func:`body`."""
    kind, flow, node = _HEAD.unpack_from(body)
    return kind, flow, node


@dataclass
class _Placement:
    offers: int = 0
    #: the first node to offer: the one awarded once both have
    first: int | None = None
    accepted: bool = False
    done: threading.Event | None = None


@dataclass
class Placements:
    """The requestor's side of the placements in flight, without any I/O: what to send
    next, and whether the placements went as the protocol says."""

    nodes: int
    seed: int = 0
    started: int = 0
    accepted: int = 0
    #: an acceptance from a node that was not awarded, an offer too many, an unknown
    #: placement: anything the nodes' side got wrong
    faults: list[str] = field(default_factory=list)
    _flows: dict[int, _Placement] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.nodes < 2:
            raise ValueError("a placement asks two nodes: at least 2")
        self._random = random.Random(self.seed)

    def start(self, done: threading.Event | None = None) -> list[tuple[int, bytes]]:
        """A new placement's two requests, as (node, body); ``done`` is set when it is
        accepted."""
        with self._lock:
            flow = self.started
            self.started += 1
            self._flows[flow] = _Placement(done=done)
            first, second = self._random.sample(range(self.nodes), 2)
        return [(first, body(REQUEST, flow, 0)), (second, body(REQUEST, flow, 0))]

    def offered(self, flow: int, node: int) -> list[tuple[int, bytes]]:
        """What node ``node``'s offer calls for. As the requestor decides a probe round
        once every probed node has answered: nothing after the first offer; after the
        second, the award to the first node that offered and a release to the other."""
        with self._lock:
            placement = self._flows.get(flow)
            if placement is None or placement.offers >= 2:
                self.faults.append(f"offer for placement {flow} from node {node}: unexpected")
                return []
            placement.offers += 1
            if placement.offers == 1:
                placement.first = node
                return []
            first = placement.first
            assert first is not None  # set by the first offer
            return [(first, body(AWARD, flow, 0)), (node, body(RELEASE, flow, 0))]

    def accepted_by(self, flow: int, node: int) -> threading.Event | None:
        """Placement ``flow`` accepted by ``node``; its ``done`` event, to set."""
        with self._lock:
            placement = self._flows.get(flow)
            awarded = placement is not None and placement.offers == 2 and placement.first == node
            if placement is None or placement.accepted or not awarded:
                self.faults.append(f"acceptance of placement {flow} by node {node}: unexpected")
                return None
            placement.accepted = True
            self.accepted += 1
            del self._flows[flow]
            return placement.done

    def in_flight(self) -> int:
        with self._lock:
            return len(self._flows)


def node_answer(message: bytes, node: int) -> bytes | None:
    """What node ``node`` sends back to the requestor for ``message``, if anything."""
    kind, flow, _ = read(message)
    if kind == REQUEST:
        return body(OFFER, flow, node)
    if kind == AWARD:
        return body(ACCEPTED, flow, node)
    return None


# -- the node processes ------------------------------------------------------------------


def serve_nodes(url: BrokerUrl, requestor: str, names: list[str], first: int) -> None:
    """Open an endpoint for each name, answer until stdin closes, print the broker's
    counts (what was sent, confirmed, lost) as one JSON line."""
    broker = reservoir.brokers.connect(url)
    endpoints: list[Endpoint] = []

    def handler(index: int) -> Callable[[Delivery], None]:
        def on(delivery: Delivery) -> None:
            answer = node_answer(delivery.body, first + index)
            if answer is not None:
                endpoints[index].send(requestor, answer)

        return on

    try:
        for index, name in enumerate(names):
            endpoints.append(broker.open_endpoint(handler(index), name=name, inline=True))
        print(json.dumps({"ready": len(endpoints)}), flush=True)
        sys.stdin.read()
        assert isinstance(broker, AmqpBroker)
        deadline = time.monotonic() + 5.0  # the last acceptances' confirms, if on the way
        while not _all_confirmed(broker) and time.monotonic() < deadline:
            time.sleep(0.01)
        print(json.dumps({"stats": asdict(broker.stats)}))
    finally:
        broker.close()


# -- one run of the floor ----------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One run's figures; a kind of run leaves out what it does not measure."""

    kind: str
    cpu_ms_per_placement: dict[str, float] = field(default_factory=dict)
    own_cpu_ms_per_placement: float | None = None
    own_cpu_over_broker_cpu: float | None = None
    placements_per_s: float | None = None
    messages_per_placement: float | None = None
    #: the sequential placements' p50 and the round trip's, one at a time
    place_p50_ms: float | None = None
    rtt_p50_ms: float | None = None
    place_p50_over_rtt: float | None = None
    #: by part, as the bench counts them: {"woken": ..., "preempted": ...} a placement
    switches_per_placement: dict[str, dict[str, float]] = field(default_factory=dict)


#: the figures :func:`medians` takes, where a run has them: every one but the kind and the
#: figures by part (taken part by part)
_BY_PART = ("cpu_ms_per_placement", "switches_per_placement")
_FIGURES = tuple(f.name for f in fields(Run) if f.name != "kind" and f.name not in _BY_PART)


@dataclass(frozen=True)
class _Nodes:
    url: BrokerUrl
    requestor: str
    names: list[str]
    hosts: list[subprocess.Popen[str]]


@contextlib.contextmanager
def _nodes_up(args: argparse.Namespace) -> Iterator[_Nodes]:
    """The run's exchanges and its node processes, answering the requestor's address."""
    exchange = f"reservoir.messagefloor.{uuid.uuid4().hex[:12]}"
    url = BrokerUrl.parse(args.broker).with_exchange(exchange)
    run = uuid.uuid4().hex[:8]
    names = [f"floor-{run}-node-{i:04d}" for i in range(args.nodes)]
    requestor = f"floor-{run}-requestor"
    with reservoir.brokers.own_exchange(url, name=exchange):
        hosts: list[subprocess.Popen[str]] = []
        try:
            hosts.extend(_node_processes(url, requestor, names, args.node_processes))
            yield _Nodes(url, requestor, names, hosts)
        finally:
            _stop(hosts)


def _node_processes(
    url: BrokerUrl, requestor: str, names: list[str], processes: int
) -> Iterator[subprocess.Popen[str]]:
    per = -(-len(names) // processes)
    for first in range(0, len(names), per):
        command = [sys.executable, __file__, "--serve-nodes", requestor]
        command += [",".join(names[first : first + per]), str(first), "--broker", url.given]
        host = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert host.stdout is not None
        line = host.stdout.readline()
        if not line.startswith('{"ready"'):
            host.kill()
            raise RuntimeError(f"a node process did not start: {line!r}")
        yield host


def _stop(hosts: list[subprocess.Popen[str]]) -> list[dict[str, Any]]:
    """Stop the node processes (once: later calls find them stopped); what they sent."""
    reports = []
    for host in hosts:
        assert host.stdin is not None and host.stdout is not None
        if host.stdin.closed:
            continue
        host.stdin.close()
        line = host.stdout.readline()
        host.wait(30)
        if line:
            reports.append(json.loads(line))
    return reports


class _Requestor:
    """The requestor's endpoint in this process: it answers offers, ends placements (and
    tells :attr:`on_accepted`), and hears its round trips come back."""

    def __init__(self, broker: AmqpBroker, nodes: _Nodes, placements: Placements) -> None:
        self.names = nodes.names
        self.placements = placements
        self.on_accepted: Callable[[threading.Event | None], None] = lambda done: None
        self.echoed = threading.Event()
        self.endpoint = broker.open_endpoint(self._on, name=nodes.requestor, inline=True)

    def send_all(self, messages: list[tuple[int, bytes]]) -> None:
        for node, message in messages:
            self.endpoint.send(self.names[node], message)

    def _on(self, delivery: Delivery) -> None:
        if delivery.returned:
            self.placements.faults.append("a message came back unroutable")
            return
        kind, flow, node = read(delivery.body)
        if kind == OFFER:
            self.send_all(self.placements.offered(flow, node))
        elif kind == ACCEPTED:
            self.on_accepted(self.placements.accepted_by(flow, node))
        elif kind == ECHO:
            self.echoed.set()


def run_floor(args: argparse.Namespace, callers: Callers) -> Run:
    """One floor run: ``--placements`` placements measured after as many unmeasured."""
    with _nodes_up(args) as nodes:
        placements = Placements(len(nodes.names), seed=args.seed)
        total = 2 * args.placements  # the first half is the warm-up
        marks = {args.placements: threading.Event(), total: threading.Event()}
        broker = reservoir.brokers.connect(nodes.url)
        assert isinstance(broker, AmqpBroker)
        try:
            requestor = _Requestor(broker, nodes, placements)

            def on_accepted(done: threading.Event | None) -> None:
                mark = marks.get(placements.accepted)
                if mark is not None:
                    mark.set()
                if done is not None:
                    done.set()
                elif callers == "io" and placements.started < total:
                    requestor.send_all(placements.start())

            requestor.on_accepted = on_accepted
            claimed = itertools.count()

            def caller() -> None:
                while next(claimed) < total:
                    done = threading.Event()
                    requestor.send_all(placements.start(done))
                    if not done.wait(_STALL_S):
                        placements.faults.append("a placement was not accepted in time")
                        return

            meter = CpuMeter(
                {"nodes": [host.pid for host in nodes.hosts], "broker": broker_processes(nodes.url)}
            )
            threads: list[threading.Thread] = []
            if callers == "threads":
                for _ in range(args.requestors):
                    threads.append(threading.Thread(target=caller, daemon=True))
                    threads[-1].start()
            else:
                with requestor.endpoint.batch():
                    for _ in range(args.requestors):
                        requestor.send_all(placements.start())
            if not marks[args.placements].wait(_STALL_S):
                raise RuntimeError(f"{placements.accepted} placements accepted in the warm-up")
            before, started = meter.snapshot(), time.perf_counter()
            if not marks[total].wait(_STALL_S):
                raise RuntimeError(f"{placements.accepted} of {total} placements accepted")
            after, elapsed = meter.snapshot(), time.perf_counter() - started
            for thread in threads:
                thread.join(_STALL_S)
            _settle(broker, placements)
        finally:
            broker.close()
        nodes_sent = _checked(broker, placements, nodes, f"the {callers} floor")
    cpu = CpuMeter.per_placement_ms(before, after, args.placements)
    own = own_cpu(cpu)
    return Run(
        kind=FLOORS[callers],
        cpu_ms_per_placement=cpu,
        switches_per_placement=CpuMeter.switches_per_placement(before, after, args.placements),
        own_cpu_ms_per_placement=own,
        own_cpu_over_broker_cpu=round(own / cpu["broker"], 2) if cpu.get("broker") else None,
        placements_per_s=round(args.placements / elapsed, 1),
        messages_per_placement=round((broker.stats.sent + nodes_sent) / placements.started, 2)
        if nodes_sent
        else None,
    )


def run_sequential(args: argparse.Namespace) -> Run:
    """The floor of the bench's sequential run: from this thread, a round trip to an
    endpoint of this process (the bench's baseline), then one placement, each waited for,
    ``--sequential`` times after :data:`WARM_UP`."""
    with _nodes_up(args) as nodes:
        placements = Placements(len(nodes.names), seed=args.seed)
        broker = reservoir.brokers.connect(nodes.url)
        assert isinstance(broker, AmqpBroker)
        round_trips: list[float] = []
        placed: list[float] = []
        try:
            requestor = _Requestor(broker, nodes, placements)
            requestor.on_accepted = lambda done: done.set() if done is not None else None
            echo = broker.open_endpoint(
                lambda delivery: echo.send(nodes.requestor, delivery.body), inline=True
            )
            for index in range(WARM_UP + args.sequential):
                requestor.echoed.clear()
                started = time.perf_counter()
                requestor.endpoint.send(echo.address, body(ECHO, index, 0))
                if not requestor.echoed.wait(_STALL_S):
                    raise RuntimeError("a round trip did not come back")
                echoed = time.perf_counter()
                done = threading.Event()
                requestor.send_all(placements.start(done))
                if not done.wait(_STALL_S):
                    raise RuntimeError("a placement was not accepted in time")
                if index >= WARM_UP:
                    round_trips.append(echoed - started)
                    placed.append(time.perf_counter() - echoed)
            _settle(broker, placements)
        finally:
            broker.close()
        _checked(broker, placements, nodes, "the sequential floor")
    place_p50, rtt_p50 = statistics.median(placed), statistics.median(round_trips)
    return Run(
        kind=SEQUENTIAL,
        place_p50_ms=round(1000 * place_p50, 3),
        rtt_p50_ms=round(1000 * rtt_p50, 3),
        place_p50_over_rtt=round(place_p50 / rtt_p50, 2),
    )


def _checked(broker: AmqpBroker, placements: Placements, nodes: _Nodes, what: str) -> int:
    """Stop the nodes and raise if anything went wrong on either side; the messages the
    nodes sent."""
    reports = _stop(nodes.hosts)
    problems = problems_of(placements, asdict(broker.stats), reports, len(nodes.hosts))
    if problems:
        raise RuntimeError(f"{what} went wrong: {problems[:5]}")
    return sum(report["stats"]["sent"] for report in reports)


def problems_of(
    placements: Placements,
    requestor: dict[str, int],
    reports: list[dict[str, Any]],
    processes: int,
) -> list[str]:
    """What went wrong in a run: the placements' faults, a node process that said nothing
    at the end, and any message on either side nacked, returned, refused, unconfirmed or
    sent again after a reconnect."""
    problems = list(placements.faults)
    if len(reports) != processes:
        problems.append(f"{processes - len(reports)} node process(es) said nothing")
    sides = [("the requestor", requestor)]
    sides += [("a node process", report["stats"]) for report in reports]
    for side, stats in sides:
        lost = stats["nacked"] + stats["returned"] + stats["refused"] + stats["reconnects"]
        unconfirmed = stats["sent"] - stats["confirmed"] - stats["nacked"] - stats["refused"]
        if lost or unconfirmed:
            problems.append(f"{side}'s messages: {stats}")
    return problems


def _all_confirmed(broker: AmqpBroker) -> bool:
    stats = broker.stats
    return stats.confirmed + stats.nacked + stats.refused >= stats.sent


def _settle(broker: AmqpBroker, placements: Placements) -> None:
    """Wait for the placements still in flight to end and every message to be confirmed."""
    deadline = time.monotonic() + _STALL_S
    while time.monotonic() < deadline:
        if _all_confirmed(broker) and placements.in_flight() == 0:
            return
        time.sleep(0.01)
    raise RuntimeError(f"{placements.in_flight()} placements or confirms outstanding")


# -- the work alone, in the same turns ---------------------------------------------------

#: the two sizes of the work-alone run: start-up and roll call cancel out in the difference
WORK_SIZES = (500, 3500)


def sizes_of(text: str) -> tuple[int, int]:
    """``--work-placements``: two sizes, the second larger (``SMALL,LARGE``)."""
    try:
        small, large = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: two whole numbers, SMALL,LARGE") from None
    if not 1 <= small < large:
        raise argparse.ArgumentTypeError(f"{text!r}: SMALL at least 1 and below LARGE")
    return small, large


def run_work(args: argparse.Namespace, woken_us: int = 0) -> Run:
    """The runtime's own work per placement on one thread, with no broker of RabbitMQ's and
    no thread: ``runtime_instructions.py`` (the machines, the drivers, the codec, the
    in-process broker and a virtual clock) timed at the two sizes of
    ``--work-placements``, its CPU from ``getrusage``. An overestimate of the machines' and
    codec's work by what the in-process broker and the virtual clock take (about an eighth
    of its profile: ``runtime_instructions.py --profile`` shows their share).

    With ``woken_us``, every step of a placement runs after a real sleep of that long, as
    the live runtime's handlers run after a wake-up; the sleeps' own CPU, measured here
    in the same turn (:func:`sleep_cpu_s`), is taken off."""
    script = str(Path(__file__).with_name("runtime_instructions.py"))
    seconds, steps = [], []
    sizes = args.work_placements
    for placements in sizes:
        command = [sys.executable, script, "--placements", str(placements)]
        command += ["--nodes", str(args.nodes), "--woken-us", str(woken_us)]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise RuntimeError(f"runtime_instructions.py failed: {done.stderr[-500:]}")
        seconds.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
        steps.append(json.loads(done.stdout).get("steps", 0))  # counted when woken
    sleeps_s = (steps[1] - steps[0]) * sleep_cpu_s(woken_us / 1e6) if woken_us else 0.0
    per_placement_s = (seconds[1] - seconds[0] - sleeps_s) / (sizes[1] - sizes[0])
    per_placement_ms = round(1000 * per_placement_s, 3)
    return Run(
        kind=WORK_WOKEN if woken_us else WORK,
        cpu_ms_per_placement={"this process": per_placement_ms},
        own_cpu_ms_per_placement=per_placement_ms,
    )


def sleep_cpu_s(sleep_s: float, sleeps: int = 2000) -> float:
    """The CPU seconds one ``time.sleep(sleep_s)`` costs this process, nothing else done."""
    started = time.process_time()
    for _ in range(sleeps):
        time.sleep(sleep_s)
    return (time.process_time() - started) / sleeps


# -- the bench, in the same turns --------------------------------------------------------


def run_bench(args: argparse.Namespace) -> Run:
    command = [sys.executable, "-m", "reservoir", "bench", "--broker", args.broker]
    command += ["--nodes", str(args.nodes), "--node-processes", str(args.node_processes)]
    command += ["--requestors", str(args.requestors), "--json"]
    if args.bench_placements:
        command += ["--placements", str(args.bench_placements)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"reservoir bench failed ({done.returncode}): {done.stderr[-500:]}")
    result = json.loads(done.stdout)
    if any(result["audit"].values()):
        raise RuntimeError(f"reservoir bench's audit: {result['audit']}")
    return Run(
        kind=BENCH,
        cpu_ms_per_placement=result["cpu_ms_per_placement"],
        switches_per_placement=result["switches_per_placement"],
        own_cpu_ms_per_placement=result["own_cpu_ms_per_placement"],
        own_cpu_over_broker_cpu=result["own_cpu_over_broker_cpu"],
        placements_per_s=result["placements_per_s"],
        messages_per_placement=result["throughput_messages_per_placement"],
        place_p50_ms=result["place_p50_ms"],
        rtt_p50_ms=result["rtt_p50_ms"],
        place_p50_over_rtt=result["place_p50_over_rtt"],
    )


def medians(runs: list[Run]) -> dict[str, dict[str, float]]:
    """Per kind of run, the median of each figure over the runs that have it."""
    by_kind: dict[str, list[Run]] = {}
    for run in runs:
        by_kind.setdefault(run.kind, []).append(run)
    table = {}
    for kind, same in by_kind.items():
        row: dict[str, float] = {}
        for name in _FIGURES:
            values = [getattr(r, name) for r in same if getattr(r, name) is not None]
            if values:
                row[name] = statistics.median(values)
        for part in same[0].cpu_ms_per_placement:
            row[f"{part} cpu_ms_per_placement"] = statistics.median(
                r.cpu_ms_per_placement.get(part, 0.0) for r in same
            )
        for part, counts in same[0].switches_per_placement.items():
            for count in counts:
                row[f"{part} {count}_per_placement"] = statistics.median(
                    r.switches_per_placement.get(part, {}).get(count, 0.0) for r in same
                )
        table[kind] = row
    return table


def bound(table: dict[str, dict[str, float]]) -> dict[str, float]:
    """For each floor, and each work run: the least ``own_cpu_over_broker_cpu`` the bench
    could show with that kind of caller, the floor's own CPU plus the work alone, over
    RabbitMQ's CPU in the bench's own runs (medians). Keyed by the floor's callers, with
    ", woken" for the work run woken before every step. RabbitMQ's share is the bench's
    because the ratio is the bench's: it is larger there than in the floor runs (RabbitMQ
    takes fewer messages per read from slower clients), so a quicker reservoir would, if
    anything, lower it and raise the ratio. Empty without a bench run or a work run."""
    bench = table.get(BENCH)
    broker = bench.get("broker cpu_ms_per_placement") if bench else None
    least: dict[str, float] = {}
    for work_kind, suffix in ((WORK, ""), (WORK_WOKEN, ", woken")):
        work = table.get(work_kind)
        for callers, kind in FLOORS.items():
            row = table.get(kind)
            if row and work and broker:
                own = row["own_cpu_ms_per_placement"] + work["own_cpu_ms_per_placement"]
                least[callers + suffix] = round(own / broker, 2)
    return least


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument(
        "--broker", default="amqp://guest:guest@127.0.0.1:5672/", help="a RabbitMQ on loopback"
    )
    parser.add_argument("--nodes", type=int, default=100, help="node endpoints, as the bench's")
    parser.add_argument("--node-processes", type=int, default=2, help="they are spread over")
    parser.add_argument("--requestors", type=int, default=8, help="placements in flight")
    parser.add_argument("--placements", type=int, default=4000, help="measured, per floor run")
    parser.add_argument(
        "--sequential", type=int, default=1000, help="measured, in the sequential floor run"
    )
    parser.add_argument(
        "--woken-us",
        type=int,
        default=200,
        help="the sleep before every step of the woken work run (0: no such run)",
    )
    parser.add_argument(
        "--work-placements",
        type=sizes_of,
        default=WORK_SIZES,
        metavar="SMALL,LARGE",
        help="the two sizes of the work-alone runs (default 500,3500)",
    )
    parser.add_argument(
        "--bench-placements",
        type=int,
        default=0,
        help="placements of each reservoir bench run (0: the bench's own default)",
    )
    parser.add_argument("--pairs", type=int, default=3, help="turns of every kind of run")
    parser.add_argument("--seed", type=int, default=0, help="the nodes each placement asks")
    parser.add_argument("--no-bench", action="store_true", help="the floors alone")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    # the node processes' entry: this script runs itself with it
    parser.add_argument("--serve-nodes", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    interrupt.install()  # SIGTERM unwinds as Ctrl-C does: the run's exchanges go
    if args.serve_nodes:
        requestor, names, first = args.serve_nodes
        serve_nodes(BrokerUrl.parse(args.broker), requestor, names.split(","), int(first))
        return 0
    if args.woken_us < 0:
        parser.error("--woken-us: at least 0 (0 leaves the woken work run out)")
    if args.bench_placements < 0:
        parser.error("--bench-placements: at least 0 (0: the bench's own default)")
    for name in ("nodes", "node_processes", "requestors", "placements", "sequential", "pairs"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: at least 1")
    if args.nodes < 2:
        parser.error("--nodes: at least 2 (a placement asks two)")
    if BrokerUrl.parse(args.broker).adapter != "pika":
        parser.error("--broker: an amqp:// URL (the pika adapter's, as the bench's)")
    kinds: list[Callable[[], Run]] = [
        lambda: run_floor(args, "io"),
        lambda: run_floor(args, "threads"),
        lambda: run_work(args),
        lambda: run_sequential(args),
    ]
    if args.woken_us:
        kinds.append(lambda: run_work(args, args.woken_us))
    if not args.no_bench:
        kinds.append(lambda: run_bench(args))
    runs = []
    try:
        with interrupt.interruptible():
            for pair in range(args.pairs):
                for index in range(len(kinds)):
                    run = kinds[(index + pair) % len(kinds)]()
                    runs.append(run)
                    if not args.json:
                        print(f"pair {pair + 1}: {run.kind}: {_line(run)}", file=sys.stderr)
    except KeyboardInterrupt:
        print("message_floor.py: interrupted; the run's exchanges are deleted", file=sys.stderr)
        return 130
    table = medians(runs)
    least = bound(table)
    if args.json:
        print(json.dumps({"runs": [asdict(r) for r in runs], "medians": table, "bound": least}))
    else:
        for kind, row in table.items():
            print(f"{kind}: " + ", ".join(f"{k} {v:g}" for k, v in row.items()))
        for callers, ratio in least.items():
            print(f"bound, callers on {callers}: own CPU x{ratio} of RabbitMQ's at the least")
    return 0


def _line(run: Run) -> str:
    figures = {k: v for k, v in asdict(run).items() if k != "kind" and v not in (None, {})}
    return ", ".join(f"{name} {value}" for name, value in figures.items())


if __name__ == "__main__":
    sys.exit(main())
