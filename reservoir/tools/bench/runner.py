"""``reservoir bench``: how fast placement is on a broker, as ratios to that broker's own
round trip measured in the same run.

This module owns the command and everything one run does, in order:

1. **round trip**: two endpoints of one ``reservoir.brokers.connect(url)`` broker bounce a
   :data:`RTT_BODY_BYTES`-byte body, one at a time (the baseline);
2. **nodes**: ``--nodes`` node agents spread over ``--node-processes`` processes
   (:mod:`reservoir.tools.bench.node_host`, several agents per broker connection), plus a small
   cluster of :data:`FULL_NODES` nodes of its own; on ``memory://`` they run in this
   process, since an in-process broker cannot be shared across processes;
3. **sequential latency**: one requestor places ``--placements`` single-instance requests
   one after the other;
4. **throughput**: ``--requestors`` requestors, one thread each, place ``--placements``
   requests between them as fast as they can;
5. **messages per placement**: every participant's ``sent`` counters over the sequential
   run (node processes report theirs on request);
6. **time to a clear failure**: the small cluster is filled until a placement fails, then
   a request that cannot fit is timed, with and without ``explain``.

With ``--keepers A`` the requestors take their rosters from A roster keepers (in this
process on ``memory://``, else ``reservoir keeper`` processes); with ``--kill-keeper``
too, a **keeper outage** run follows the throughput run: as many requestors place
``--placements`` requests at once, the first keeper is killed a third of the way through
(SIGKILL for a process) and started again two thirds through; every failure there is a
false one (the nodes have room for every placement), and the run says where each
requestor's roster came from at its end.

A run talks only to exchanges of its own (``reservoir.bench.<hex>`` and
``reservoir.bench.<hex>.full``, with their ``.inbox`` exchanges), so it never reaches real
nodes, and deletes them at the end; ``?exchange=NAME`` on the URL makes ``NAME`` their
prefix instead (NAME itself is never declared nor deleted). Nodes hold every placement
of the run (nothing is freed while measuring). Progress goes to stderr; stdout gets the
table, or with ``--json`` exactly one JSON object.
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
import queue
import secrets
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Protocol

from reservoir.broker import Broker, Delivery, Endpoint
from reservoir.brokers import BrokerUrl
from reservoir.clock import SystemClock, ThreadScheduler
from reservoir.protocol.placement import PlacementError
from reservoir.runtime.backoff import quietly_connecting
from reservoir.runtime.node_agent import NodeAgent
from reservoir.runtime.plugins import load_filters, load_weighers
from reservoir.runtime.requestor import Requestor
from reservoir.runtime.settings import Settings
from reservoir.tools.bench.children import ProcessNodes, ProcessRequestors
from reservoir.tools.bench.errors import BenchError
from reservoir.tools.bench.keepers import InProcessKeepers, Keepers, ProcessKeepers
from reservoir.tools.bench.limits import (
    CpuMeter,
    CpuSnapshot,
    broker_processes,
    cpu_bound,
    measure_message_rate,
    own_cpu,
)
from reservoir.tools.bench.node_host import counters_of, echo_back, ledger_summary, node_inventories
from reservoir.tools.bench.placing import (
    FLAVOUR_MEMORY_MB,
    PLACE_TIMEOUT_S,
    READY_TIMEOUT_S,
    WARMUP_PLACEMENTS,
    place_in_threads,
    place_one,
    place_timed,
    wait_for_roster,
)

__all__ = ["RTT_BODY_BYTES", "BenchError", "BenchResult", "run_bench", "slots_per_node"]

#: the size of the body the round trip bounces (a probe or an offer is 400-500 bytes);
#: public, since benchmarks/message_floor.py times the same round trip beside its floors
RTT_BODY_BYTES: Final = 512
#: round trips before the measured ones, and the most measured
RTT_WARMUP: Final = 100
MAX_RTT_SAMPLES: Final = 2000
#: messages sent back to back to measure the broker's bare rate (reservoir.tools.bench.limits)
RATE_MESSAGES: Final = 20_000
#: VCPUs are overcommitted 4:1, as clouds do
VCPU_ALLOCATION_RATIO: Final = 4.0
#: how long the message counts must stay still before a run's messages are taken as counted
QUIET_S: Final = 0.05
#: nodes hold this many times the run's placements between them
CAPACITY_HEADROOM: Final = 3
#: the small cluster filled for the failure measurement: nodes, and instances each holds
FULL_NODES: Final = 4
FULL_NODE_SLOTS: Final = 4
#: failing requests timed with and without explain; the median is reported
FAILURE_SAMPLES: Final = 3
#: the longest a failing request may take before it counts as a timeout
FAILURE_TIMEOUT_S: Final = 10.0
EXCHANGE_PREFIX: Final = "reservoir.bench"
#: schemes whose brokers are RabbitMQ (the targets for RabbitMQ apply)
RABBITMQ_SCHEMES: Final = ("amqp", "amqps", "kombu+amqp", "kombu+amqps", "kombu+pyamqp")


Progress = Callable[[str], None]


@dataclass(frozen=True)
class Target:
    """A figure the project wants this command to show, and whether the run met it."""

    figure: str
    bound: float
    at_most: bool
    stated_for: str

    def met_by(self, value: float) -> bool:
        return value <= self.bound if self.at_most else value >= self.bound

    def label(self) -> str:
        return f"{'<=' if self.at_most else '>='} {self.bound:g}"


RABBITMQ_TARGETS: Final = (
    Target("place_p50_over_rtt", 3, True, "RabbitMQ, 50 nodes"),
    Target("place_p99_over_rtt", 10, True, "RabbitMQ, 50 nodes"),
    Target("placements_per_s", 1000, False, "RabbitMQ, 100 nodes, 8 requestors"),
    Target("own_cpu_over_broker_cpu", 1, True, "RabbitMQ, 100 nodes, 8 requestors"),
    Target("time_to_failure_ms", 1000, True, "any broker"),
    Target("messages_per_placement", 12, True, "any broker"),
)
MEMORY_TARGETS: Final = (
    Target("own_cpu_ms_per_placement", 0.2, True, "memory://"),
    Target("time_to_failure_ms", 1000, True, "any broker"),
    Target("messages_per_placement", 12, True, "any broker"),
)


@dataclass
class BenchResult:
    """What one run measured. Times in milliseconds unless the name says otherwise."""

    broker: str
    exchanges: list[str]
    nodes: int
    node_processes: int
    node_mode: str
    requestors: int
    requestor_mode: str
    #: processes the throughput run's requestors ran in (0: threads of this one)
    requestor_processes: int
    #: roster keepers every requestor took its roster from (0: the announcements)
    keepers: int
    placements: int
    rtt_samples: int
    rtt_p50_ms: float
    rtt_p99_ms: float
    #: the round trip's p50 in each half of its samples: before the sequential run and
    #: after it (the figures above pool both)
    rtt_p50_before_ms: float
    rtt_p50_after_ms: float
    #: the same round trip to an echo in a node process (through that process's shared
    #: connection), taking turns with the one above; None when the nodes run in this process
    rtt_to_nodes_p50_ms: float | None
    rtt_to_nodes_p99_ms: float | None
    #: the least ``place_p50_over_rtt`` can be: a placement's two round trips to node
    #: processes (probe and offer, award and acceptance) with no work at either end
    place_floor_over_rtt: float | None
    place_p50_ms: float
    place_p95_ms: float
    place_p99_ms: float
    place_p50_over_rtt: float
    place_p99_over_rtt: float
    place_p99_over_rtt_p50: float
    sequential_failed: int
    placements_per_s: float
    throughput_placed: int
    throughput_failed: int
    throughput_p50_ms: float
    throughput_p99_ms: float
    #: every message delivered during the throughput run (to nodes, requestors and
    #: keepers) per placement: what grows with the requestors when each follows the
    #: announcements (``messages_per_placement`` counts what the sequential run sent)
    throughput_messages_per_placement: float
    messages_per_placement: float
    messages_per_placement_by_kind: dict[str, float]
    exhaustive_steps: int
    full_cluster_nodes: int
    full_cluster_placed: int
    time_to_failure_ms: float
    time_to_failure_explain_ms: float
    failure_explanation: str
    #: the broker's bare message rate through the same adapter, and the placement rate it
    #: allows at this run's messages per placement (see reservoir.tools.bench.limits)
    broker_msgs_per_s: float
    broker_bound_placements_per_s: float
    #: CPU per placement in the throughput run, by part, and the rate it allows
    cpu_ms_per_placement: dict[str, float]
    #: the same, summed over reservoir's own processes (every part but the broker), and
    #: over the broker's share where the broker was measured (None where it was not)
    own_cpu_ms_per_placement: float
    own_cpu_over_broker_cpu: float | None
    #: context switches per placement in the throughput run, by part: how often a thread
    #: was woken from a wait (``woken``) and how often it lost its core (``preempted``)
    switches_per_placement: dict[str, dict[str, float]]
    #: what this process spent per message in the message-rate run (one endpoint sending
    #: to another, pipelined: the client adapter's work, sending and receiving, and no
    #: protocol), times the messages a placement takes: the CPU that reservoir's own
    #: processes cannot go below with this adapter; and the broker's, likewise
    client_floor_cpu_ms_per_placement: float
    broker_floor_cpu_ms_per_placement: float | None
    cpu_bound_cores: int
    cpu_bound_placements_per_s: float
    machine: dict[str, Any]
    elapsed_s: float
    #: the invariant audit of every node's ledger at the end of the run
    audit: dict[str, int] = field(default_factory=dict)
    targets: dict[str, dict[str, Any]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: with ``--kill-keeper``: the keeper outage run (see the module docstring), else None
    keeper_outage: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def audit_ledgers(summaries: list[dict[str, Any]]) -> dict[str, int]:
    """The invariant audit over ledger summaries from every node host: overcommitted
    nodes, reservations leaked past their TTL, request ids holding more instances than
    they asked for. All 0 when the protocol kept its rules."""
    held: dict[str, list[int]] = {}
    for summary in summaries:
        for request_id, (count, asked) in summary["instances"].items():
            total = held.setdefault(request_id, [0, asked])
            total[0] += count
    return {
        "overcommitted": sum(len(s["overcommitted"]) for s in summaries),
        "leaked_reservations": sum(s["leaked_reservations"] for s in summaries),
        "duplicate_placements": sum(1 for count, asked in held.values() if count > asked),
    }


# -- the broker URL ---------------------------------------------------------------------


def run_exchanges(url: BrokerUrl, run_id: str) -> tuple[str, str]:
    """The two exchanges of a run: the main cluster's and the full cluster's, named after
    the URL's ``?exchange=`` (a prefix here) or :data:`EXCHANGE_PREFIX`."""
    prefix = url.exchange if url.exchange_given else EXCHANGE_PREFIX
    main = f"{prefix}.{run_id}"
    return main, f"{main}.full"


def bench_url(url: str | BrokerUrl) -> BrokerUrl:
    """``url`` parsed, when the bench can run on it: raises
    :class:`~reservoir.broker.UnsupportedBroker` for a scheme no adapter serves and
    ``ValueError`` for a prefix that makes no valid exchange name."""
    parsed = BrokerUrl.parse(url)
    if parsed.adapter != "memory":
        for name in run_exchanges(parsed, "0" * 8):
            parsed.with_exchange(name)  # checks the name
    return parsed


# -- measuring ----------------------------------------------------------------------------


def percentile(samples: Sequence[float], fraction: float) -> float:
    """The ``fraction`` quantile of ``samples``, interpolated between closest ranks."""
    if not samples:
        return 0.0
    ordered = sorted(samples)
    position = fraction * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _ratio(numerator: float, denominator: float) -> float:
    return round(numerator / denominator, 2) if denominator > 0 else 0.0


#: a baseline whose p50 moved more than this between its two halves gets a note
BASELINE_MOVED_RATIO: Final = 1.25


def _baseline_moved(before: float, after: float) -> str | None:
    """A note when the baseline's p50 (seconds) moved much between its halves, else None."""
    if min(before, after) <= 0 or max(before, after) / min(before, after) <= BASELINE_MOVED_RATIO:
        return None
    return (
        f"the round trip's p50 moved from {_ms(before)} ms before the sequential run to "
        f"{_ms(after)} ms after it (the machine's load changed): the ratios pool both; "
        "compare them across several runs"
    )


def measure_round_trips(
    broker: Broker, samples: int, elsewhere: Sequence[str] = ()
) -> list[list[float]]:
    """Seconds per round trip to each echo, one list per echo: first an echo endpoint on
    ``broker`` itself, then each address in ``elsewhere`` (a node process's,
    :func:`reservoir.tools.bench.node_host.echo_back`). Endpoint A sends a body to the echo, which
    sends it back to the address on the body's first line. One round trip at a time,
    taking turns between the echoes so that each sees the same moments of the machine,
    after :data:`RTT_WARMUP` unmeasured ones each. Every endpoint is opened ``inline``, as
    the participants' are: the baseline is the best round trip the adapter offers."""
    replies: queue.SimpleQueue[bytes] = queue.SimpleQueue()
    back = broker.open_endpoint(lambda delivery: replies.put(delivery.body), inline=True)
    body = back.address.encode() + b"\n"
    body += b"x" * max(0, RTT_BODY_BYTES - len(body))
    local: Endpoint | None = None

    def echo(delivery: Delivery) -> None:
        if local is not None:
            echo_back(local, delivery)

    local = broker.open_endpoint(echo, inline=True)
    addresses = [local.address, *elsewhere]
    seconds: list[list[float]] = [[] for _ in addresses]
    try:
        for index in range(RTT_WARMUP + samples):
            for address, measured in zip(addresses, seconds, strict=True):
                started = time.perf_counter()
                back.send(address, body)
                try:
                    replies.get(timeout=10.0)
                except queue.Empty:
                    raise BenchError(
                        "a round trip through the broker took more than 10 s"
                    ) from None
                if index >= RTT_WARMUP:
                    measured.append(time.perf_counter() - started)
    finally:
        local.close()
        back.close()
    return seconds


# -- nodes --------------------------------------------------------------------------------


class NodeHost(Protocol):
    """Where a set of node agents runs: in this process, or in processes of their own."""

    def wait_ready(self, timeout_s: float) -> None: ...

    def sent(self) -> Counter[str]:
        """Messages the nodes have sent so far, by kind."""
        ...

    def received(self) -> Counter[str]:
        """Messages the nodes have received so far, by kind."""
        ...

    def stop(self) -> Counter[str]:
        """Stop every node; what they sent in all, by kind."""
        ...

    def ledgers(self) -> list[dict[str, Any]]:
        """Each process's :func:`~reservoir.tools.bench.node_host.ledger_summary`."""
        ...

    @property
    def echoes(self) -> list[str]:
        """The round-trip echo of each node process (none when they run in this one)."""
        ...


class InProcessNodes:
    """Node agents on a broker of this process, sharing one timer thread."""

    def __init__(
        self,
        broker: Broker,
        names: Sequence[str],
        *,
        vcpus: int,
        memory_mb: int,
        vcpu_ratio: float,
        settings: Settings,
    ) -> None:
        self._timers = ThreadScheduler(SystemClock(), name="bench-node-timers")
        filters, weighers = load_filters(settings.filters), load_weighers(settings.weighers)
        inventories = node_inventories(vcpus, memory_mb, vcpu_ratio)
        self._agents: list[NodeAgent] = []
        try:
            for name in names:
                self._agents.append(
                    NodeAgent(
                        broker,
                        name=name,
                        inventories=inventories,
                        settings=settings,
                        scheduler=self._timers,
                        filters=filters,
                        weighers=weighers,
                    )
                )
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout_s: float) -> None:
        return  # started in the constructor

    @property
    def echoes(self) -> list[str]:
        return []

    def sent(self) -> Counter[str]:
        return Counter(counters_of(self._agents, "sent"))

    def received(self) -> Counter[str]:
        return Counter(counters_of(self._agents, "received"))

    def ledgers(self) -> list[dict[str, Any]]:
        return [ledger_summary(self._agents)]

    def stop(self) -> Counter[str]:
        sent = self.sent()
        for agent in self._agents:
            agent.close()
        self._timers.close()
        return sent


# -- requestors -----------------------------------------------------------------------------


@dataclass
class _Sequential:
    latencies_s: list[float]
    failed: int
    sent: Counter[str]
    exhaustive_steps: int


def _run_sequential(requestor: Requestor, nodes: NodeHost, placements: int) -> _Sequential:
    for _ in range(WARMUP_PLACEMENTS):
        place_one(requestor)
    nodes_before = nodes.sent()
    requestor_before = Counter(requestor.metrics.by_label("sent"))
    steps_before = requestor.machine.counters["exhaustive_steps"]
    latencies_s, failed = place_timed(requestor, placements)
    sent = Counter(requestor.metrics.by_label("sent")) - requestor_before
    sent.update(nodes.sent() - nodes_before)
    steps = requestor.machine.counters["exhaustive_steps"] - steps_before
    return _Sequential(latencies_s, failed, sent, steps)


@dataclass
class _Throughput:
    placed: int
    failed: int
    elapsed_s: float
    latencies_s: list[float]
    cpu_ms_per_placement: dict[str, float]
    switches_per_placement: dict[str, dict[str, float]]
    #: every message delivered during the run, to whichever participant, by kind
    received: Counter[str] = field(default_factory=Counter)


@dataclass
class _Begun:
    """Where the throughput run's counts start: taken as its threads are let go."""

    at: float = 0.0
    cpu: CpuSnapshot | None = None
    received: Counter[str] = field(default_factory=Counter)


def _run_threads(
    requestors: Sequence[Requestor],
    placements: int,
    meter: CpuMeter,
    received: Callable[[], Counter[str]],
) -> _Throughput:
    """Each requestor places its share in a thread of its own, all starting together once
    each has made its warm-up placements; the CPU and the messages (``received()``, every
    participant's so far) are counted from then on."""
    begun = _Begun()

    def begin() -> None:
        # Run once every thread has warmed up, before any measured placement starts:
        # the warm-ups' last messages are in.
        begun.received = _once_quiet(received)
        begun.cpu = meter.snapshot()
        begun.at = time.perf_counter()

    latencies_s, failed = place_in_threads(
        requestors, placements, warm_up=WARMUP_PLACEMENTS, begin=begin
    )
    elapsed_s = time.perf_counter() - begun.at
    assert begun.cpu is not None, "the threads began"
    ended = meter.snapshot()
    cpu = CpuMeter.per_placement_ms(begun.cpu, ended, len(latencies_s))
    switches = CpuMeter.switches_per_placement(begun.cpu, ended, len(latencies_s))
    messages = _once_quiet(received) - begun.received
    return _Throughput(len(latencies_s), failed, elapsed_s, latencies_s, cpu, switches, messages)


def _once_quiet(
    count: Callable[[], Counter[str]], quiet_s: float = QUIET_S, limit_s: float = 2.0
) -> Counter[str]:
    """``count()`` once it has not moved for ``quiet_s`` (``limit_s`` at the most): the
    messages of the last placements, still arriving as their callers return (a spare's
    release, a node's status), belong to the run."""
    deadline = time.monotonic() + limit_s
    counted = count()
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        again = count()
        if again == counted:
            break
        counted = again
    return counted


@dataclass
class _Failure:
    filled: int
    plain_s: list[float]
    explained_s: list[float]
    explanation: str


def _time_failures(requestor: Requestor, capacity: int) -> _Failure:
    """Fill the small cluster until a placement fails, then time requests that cannot fit."""
    filled = 0
    for _ in range(capacity + FULL_NODES):
        try:
            place_one(requestor, timeout_s=FAILURE_TIMEOUT_S)
        except PlacementError:
            break
        filled += 1
    else:
        raise BenchError(f"the full cluster took {filled} placements and never filled up")
    timings: dict[bool, list[float]] = {False: [], True: []}
    explanation = ""
    for explain in (False, True):
        for _ in range(FAILURE_SAMPLES):
            started = time.perf_counter()
            try:
                place_one(requestor, explain=explain, timeout_s=FAILURE_TIMEOUT_S)
            except PlacementError as error:
                timings[explain].append(time.perf_counter() - started)
                if explain:
                    explanation = str(error.explanation)
            else:
                raise BenchError("a request fitted on the cluster that was full")
    return _Failure(filled, timings[False], timings[True], explanation)


# -- one run --------------------------------------------------------------------------------


def _say_nothing(message: str) -> None:
    return


def slots_per_node(nodes: int, requestors: int, placements: int, outage: int = 0) -> int:
    """Instances each node can hold: every placement of the run (``outage`` more for the
    keeper outage run, by as many requestors again), CAPACITY_HEADROOM times over (so
    nothing needs freeing while measuring, and nodes stay in the lower tiers)."""
    total = WARMUP_PLACEMENTS * (1 + requestors) + 2 * placements
    if outage:
        total += WARMUP_PLACEMENTS * requestors + outage
    slots = math.ceil(CAPACITY_HEADROOM * total / nodes)
    return max(16, math.ceil(slots / VCPU_ALLOCATION_RATIO) * int(VCPU_ALLOCATION_RATIO))


def _machine() -> dict[str, Any]:
    return {
        "cores": os.cpu_count() or 0,
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(terse=True),
    }


def _delete_exchanges(url: BrokerUrl) -> None:
    """Delete the run's own exchanges (nothing to do on memory://)."""
    from reservoir.brokers import admin

    topology = admin(url)
    if topology is not None:
        topology.delete_reservoir_exchanges()


@contextlib.contextmanager
def _broker(url: BrokerUrl, *, own_exchanges: bool) -> Iterator[Broker]:
    from reservoir.brokers import connect

    broker = connect(url)
    try:
        yield broker
    finally:
        broker.close()
        if own_exchanges:
            _delete_exchanges(url)


def run_bench(
    *,
    broker_url: str | BrokerUrl,
    nodes: int = 50,
    requestors: int = 8,
    node_processes: int = 2,
    placements: int = 2000,
    requestor_processes: int = 0,
    keepers: int = 0,
    kill_keeper: bool = False,
    progress: Progress = _say_nothing,
) -> BenchResult:
    """One run of the bench; see the module docstring. ``requestor_processes`` > 0 puts
    the throughput run's requestors in that many processes of their own; ``keepers`` > 0
    starts roster keepers, which every requestor takes its roster from; ``kill_keeper``
    adds the keeper outage run. Raises :class:`BrokerError` when the broker cannot be used
    and :class:`BenchError` when the run cannot be carried out."""
    if kill_keeper and not keepers:
        raise BenchError("a keeper outage needs keepers: give --keepers 1 or more")
    url = bench_url(broker_url)
    run_started = time.perf_counter()
    plan = _plan(
        url, nodes, requestors, node_processes, placements, requestor_processes, keepers,
        kill_keeper,
    )  # fmt: skip
    with contextlib.ExitStack() as stack:
        with quietly_connecting():
            broker = stack.enter_context(_broker(plan.main_url, own_exchanges=plan.owns_exchanges))
        full_broker = stack.enter_context(_broker(plan.full_url, own_exchanges=plan.owns_exchanges))
        host, full_host = _start_nodes(plan, broker, full_broker, stack, progress)
        opened = _Requestors(plan.run_id, stack)
        _start_keepers(plan, broker, opened, progress)
        measured = _measure(plan, broker, full_broker, host, full_host, opened, progress)
    result = _result(plan, measured, time.perf_counter() - run_started)
    result.targets = _targets(plan, result)
    result.keeper_outage = measured.outage
    return result


@dataclass
class _Plan:
    """What a run is made of, decided before anything starts: its brokers' URLs and
    exchanges, the clusters' sizes and names, the settings every participant shares."""

    url: BrokerUrl
    run_id: str
    in_process: bool
    main_url: BrokerUrl
    full_url: BrokerUrl
    exchanges: list[str]
    nodes: int
    node_processes: int
    requestors: int
    placements: int
    requestor_processes: int
    keepers: int
    kill_keeper: bool
    slots: int
    names: list[str]
    full_names: list[str]
    settings: Settings
    full_settings: Settings
    notes: list[str]

    @property
    def owns_exchanges(self) -> bool:
        return not self.in_process

    @property
    def vcpus(self) -> int:
        return self.slots // int(VCPU_ALLOCATION_RATIO)

    @property
    def memory_mb(self) -> int:
        return self.slots * FLAVOUR_MEMORY_MB


def _plan(
    url: BrokerUrl,
    nodes: int,
    requestors: int,
    node_processes: int,
    placements: int,
    requestor_processes: int = 0,
    keepers: int = 0,
    kill_keeper: bool = False,
) -> _Plan:
    """The run's exchanges (its own, on a real broker), sizes and names."""
    in_process = url.adapter == "memory"
    run_id = secrets.token_hex(4)
    notes: list[str] = []
    if in_process:
        main_url = full_url = url
        exchanges: list[str] = []
        node_processes = 0
        notes.append(
            "memory:// cannot be shared across processes: the node agents ran in this "
            "process, on its broker's one delivery thread"
        )
    else:
        main_exchange, full_exchange = run_exchanges(url, run_id)
        main_url = url.with_exchange(main_exchange)
        full_url = url.with_exchange(full_exchange)
        exchanges = [main_exchange, full_exchange]
        node_processes = min(node_processes, nodes)
    if in_process and requestor_processes:
        requestor_processes = 0
        notes.append("memory:// cannot be shared across processes: the requestors were threads")
    requestor_processes = min(requestor_processes, requestors)
    if requestor_processes:
        notes.append(
            f"the {requestors} requestors of the throughput run were spread over "
            f"{requestor_processes} processes, each sharing its own broker connection"
        )
    else:
        notes.append(
            f"the {requestors} requestors of the throughput run were threads of this process, "
            "sharing its broker connection"
        )
    if keepers:
        where = "in this process" if in_process else "in processes of their own"
        notes.append(f"every requestor took its roster from {keepers} keeper(s) ({where})")
    # Without keepers, the announcements alone: not a query every 10 s that finds none.
    roster_from = "auto" if keepers else "announcements"
    outage = placements if kill_keeper else 0
    return _Plan(
        url=url,
        run_id=run_id,
        in_process=in_process,
        main_url=main_url,
        full_url=full_url,
        exchanges=exchanges,
        nodes=nodes,
        node_processes=node_processes,
        requestors=requestors,
        placements=placements,
        requestor_processes=requestor_processes,
        keepers=keepers,
        kill_keeper=kill_keeper,
        slots=slots_per_node(nodes, requestors, placements, outage),
        names=[f"bench-{run_id}-node-{index:04d}" for index in range(nodes)],
        full_names=[f"bench-{run_id}-full-{index}" for index in range(FULL_NODES)],
        settings=Settings(broker_url=main_url, roster_from=roster_from),
        full_settings=Settings(broker_url=full_url),
        notes=notes,
    )


def _start_nodes(
    plan: _Plan,
    broker: Broker,
    full_broker: Broker,
    stack: contextlib.ExitStack,
    progress: Progress,
) -> tuple[NodeHost, NodeHost]:
    """The measured cluster and the small one that is filled up, started and ready:
    in this process on memory://, else in processes of their own."""
    where = "this process" if plan.in_process else f"{plan.node_processes} processes"
    progress(f"starting {plan.nodes} node agents in {where} ({plan.slots} instances each)")
    host: NodeHost
    full_host: NodeHost
    full_memory_mb = FULL_NODE_SLOTS * FLAVOUR_MEMORY_MB
    if plan.in_process:
        host = InProcessNodes(
            broker, plan.names, vcpus=plan.vcpus, memory_mb=plan.memory_mb,
            vcpu_ratio=VCPU_ALLOCATION_RATIO, settings=plan.settings,
        )  # fmt: skip
        stack.callback(host.stop)
        full_host = InProcessNodes(
            full_broker, plan.full_names, vcpus=FULL_NODE_SLOTS, memory_mb=full_memory_mb,
            vcpu_ratio=1.0, settings=plan.full_settings,
        )  # fmt: skip
        stack.callback(full_host.stop)
    else:
        host = ProcessNodes(
            plan.main_url, plan.names, plan.node_processes, vcpus=plan.vcpus,
            memory_mb=plan.memory_mb, vcpu_ratio=VCPU_ALLOCATION_RATIO,
        )  # fmt: skip
        stack.callback(host.stop)
        full_host = ProcessNodes(
            plan.full_url, plan.full_names, 1, vcpus=FULL_NODE_SLOTS, memory_mb=full_memory_mb,
            vcpu_ratio=1.0,
        )  # fmt: skip
        stack.callback(full_host.stop)
    host.wait_ready(READY_TIMEOUT_S)
    full_host.wait_ready(READY_TIMEOUT_S)
    if isinstance(host, ProcessNodes):
        progress(f"node processes: {', '.join(map(str, host.pids))}")
    return host, full_host


class _Requestors:
    """The run's requestors (and keepers), on one timer thread, closed with the run's
    stack."""

    def __init__(self, run_id: str, stack: contextlib.ExitStack) -> None:
        self.run_id = run_id
        self.stack = stack
        self.keepers: Keepers | None = None
        self.timers = ThreadScheduler(SystemClock(), name="bench-requestor-timers")
        stack.callback(self.timers.close)
        self.opened: list[Requestor] = []
        stack.callback(self.close)

    def open(self, on: Broker, name: str, settings: Settings) -> Requestor:
        requestor = Requestor(
            on, name=f"bench-{self.run_id}-{name}", settings=settings, scheduler=self.timers
        )
        self.opened.append(requestor)
        return requestor

    def close(self) -> None:
        for requestor in self.opened:
            requestor.close()
        if self.keepers is not None:
            self.keepers.stop()

    def received(self) -> Counter[str]:
        """What the run's requestors in this process and its keepers have received so
        far, by kind."""
        total: Counter[str] = Counter()
        for requestor in self.opened:
            total.update(requestor.metrics.by_label("received"))
        if self.keepers is not None:
            total.update(self.keepers.received())
        return total


def _start_keepers(plan: _Plan, broker: Broker, opened: _Requestors, progress: Progress) -> None:
    """The run's roster keepers, once they know every node of the measured cluster."""
    if not plan.keepers:
        return
    where = "in this process" if plan.in_process else "as processes of their own"
    progress(f"starting {plan.keepers} roster keeper(s) {where}")
    names = [f"bench-{plan.run_id}-keeper-{index}" for index in range(plan.keepers)]
    if plan.in_process:
        opened.keepers = InProcessKeepers(broker, names, plan.settings, opened.timers)
    else:
        opened.keepers = ProcessKeepers(plan.main_url, names)
    opened.keepers.wait_ready(plan.nodes, READY_TIMEOUT_S)


@dataclass
class _Baseline:
    """The broker's own round trip, before and after the sequential run, and its rate."""

    rtt_s: list[float]
    rtt_to_nodes: list[list[float]]
    rtt_p50_before: float
    rtt_p50_after: float
    broker_msgs_per_s: float
    #: CPU milliseconds per message of the message-rate run, by part
    cpu_ms_per_message: dict[str, float]


@dataclass
class _Measured:
    baseline: _Baseline
    sequential: _Sequential
    throughput: _Throughput
    failure: _Failure
    audit: dict[str, int]
    outage: dict[str, Any] | None = None


def _measure(
    plan: _Plan,
    broker: Broker,
    full_broker: Broker,
    host: NodeHost,
    full_host: NodeHost,
    opened: _Requestors,
    progress: Progress,
) -> _Measured:
    """The run, in order: the round trip and the broker's rate, the sequential
    placements, the round trip again, the throughput, the full cluster's failures, the
    audit (the module docstring says why each)."""
    sequential_requestor = opened.open(broker, "sequential", plan.settings)
    wait_for_roster(sequential_requestor, plan.nodes, READY_TIMEOUT_S)
    rtt_samples = max(100, min(plan.placements, MAX_RTT_SAMPLES)) // 2
    node_echo = host.echoes[:1]
    progress(
        f"round trip: {rtt_samples} sequential {RTT_BODY_BYTES}-byte round trips within "
        "this process" + (", taking turns with as many to a node process" if node_echo else "")
    )
    rtt_before = measure_round_trips(broker, rtt_samples, node_echo)
    progress(f"message rate: {RATE_MESSAGES} messages through the broker, pipelined")
    rate_meter = CpuMeter({"broker": broker_processes(plan.url)})
    rate_cpu_before = rate_meter.snapshot()
    broker_msgs_per_s = measure_message_rate(broker, RATE_MESSAGES)
    rate_cpu = CpuMeter.per_placement_ms(
        rate_cpu_before, rate_meter.snapshot(), RATE_MESSAGES, digits=5
    )

    progress(f"sequential: {plan.placements} placements, one at a time")
    sequential = _run_sequential(sequential_requestor, host, plan.placements)
    # The baseline again, so that a moment's load on a shared machine on either side of
    # the sequential run does not decide the ratios alone: they use both, pooled.
    progress(f"round trip again: {rtt_samples} more, after the sequential run")
    rtt_after = measure_round_trips(broker, rtt_samples, node_echo)
    baseline = _Baseline(
        rtt_s=rtt_before[0] + rtt_after[0],
        rtt_to_nodes=[b + a for b, a in zip(rtt_before[1:], rtt_after[1:], strict=True)],
        rtt_p50_before=percentile(rtt_before[0], 0.50),
        rtt_p50_after=percentile(rtt_after[0], 0.50),
        broker_msgs_per_s=broker_msgs_per_s,
        cpu_ms_per_message=rate_cpu,
    )
    moved = _baseline_moved(baseline.rtt_p50_before, baseline.rtt_p50_after)
    if moved:
        plan.notes.append(moved)

    throughput = _throughput(plan, broker, host, opened, progress)
    outage = _keeper_outage(plan, broker, opened, progress) if plan.kill_keeper else None

    progress(f"failure: filling {FULL_NODES} nodes of {FULL_NODE_SLOTS} instances each")
    full_requestor = opened.open(full_broker, "full", plan.full_settings)
    wait_for_roster(full_requestor, FULL_NODES, READY_TIMEOUT_S)
    failure = _time_failures(full_requestor, FULL_NODES * FULL_NODE_SLOTS)
    progress("auditing the nodes' ledgers")
    audit = audit_ledgers(host.ledgers() + full_host.ledgers())
    progress("stopping the nodes and removing the run's exchanges")
    return _Measured(baseline, sequential, throughput, failure, audit, outage)


def _throughput(
    plan: _Plan, broker: Broker, host: NodeHost, opened: _Requestors, progress: Progress
) -> _Throughput:
    """The concurrent run: ``plan.requestors`` requestors at once, threads of this
    process or spread over processes of their own; every message delivered meanwhile
    (to nodes, requestors and keepers) is counted."""
    where = f"{plan.requestor_processes} processes" if plan.requestor_processes else "threads"
    progress(f"throughput: {plan.placements} placements by {plan.requestors} requestors ({where})")
    node_pids = host.pids if isinstance(host, ProcessNodes) else []
    if plan.requestor_processes:
        names = [f"bench-{plan.run_id}-throughput-{index}" for index in range(plan.requestors)]
        hosts = ProcessRequestors(
            plan.main_url, names, plan.requestor_processes, plan.placements,
            nodes=plan.nodes, roster_from=plan.settings.roster_from,
        )  # fmt: skip
        opened.stack.callback(hosts.stop)
        hosts.wait_ready(READY_TIMEOUT_S)
        meter = CpuMeter(
            {"nodes": node_pids, "requestors": hosts.pids, "broker": broker_processes(plan.url)}
        )
        before = host.received() + opened.received()
        cpu_before = meter.snapshot()
        started = time.perf_counter()
        latencies_s, failed, received, switched = hosts.place(PLACE_TIMEOUT_S * plan.placements)
        elapsed_s = time.perf_counter() - started
        cpu_after = meter.snapshot()
        cpu = CpuMeter.per_placement_ms(cpu_before, cpu_after, len(latencies_s))
        switches = CpuMeter.switches_per_placement(cpu_before, cpu_after, len(latencies_s))
        if latencies_s:  # the hosts' own count: /proc has lost their placing threads
            switches["requestors"] = switched.per_placement(len(latencies_s))
        received.update(host.received() + opened.received() - before)
        return _Throughput(
            len(latencies_s), failed, elapsed_s, latencies_s, cpu, switches, received
        )
    concurrent_requestors = [
        opened.open(broker, f"throughput-{index}", plan.settings)
        for index in range(plan.requestors)
    ]
    for requestor in concurrent_requestors:
        wait_for_roster(requestor, plan.nodes, READY_TIMEOUT_S)
    meter = CpuMeter({"nodes": node_pids, "broker": broker_processes(plan.url)})
    return _run_threads(
        concurrent_requestors,
        plan.placements,
        meter,
        received=lambda: host.received() + opened.received(),
    )


class _Placed:
    """Placements made so far by a run's threads, and a wait until there are so many."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = threading.Condition()

    def tick(self) -> None:
        with self._changed:
            self.count += 1
            self._changed.notify_all()

    def wait_for(self, count: int, timeout_s: float, running: threading.Thread) -> None:
        """Until ``count`` placements are made; :class:`BenchError` if ``running`` (the
        placing) ended first or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self.count < count:
                if not running.is_alive():
                    raise BenchError(f"the placements stopped after {self.count}")
                if time.monotonic() > deadline:
                    raise BenchError(f"{self.count} of {count} placements in {timeout_s:.0f} s")
                self._changed.wait(0.1)


def _keeper_outage(
    plan: _Plan, broker: Broker, opened: _Requestors, progress: Progress
) -> dict[str, Any]:
    """The keeper outage run: ``plan.requestors`` requestors of this process place
    ``plan.placements`` requests at once; the first keeper is killed once a third are
    made and started again at two thirds (placements go on meanwhile, and while it
    learns the nodes again). The nodes have room for every placement: each failure is a
    false one."""
    keepers = opened.keepers
    assert keepers is not None, "a keeper outage needs keepers (run_bench checks)"
    killed = keepers.names[0]
    progress(
        f"keeper outage: {plan.placements} placements by {plan.requestors} requestors "
        f"(threads); {killed} killed a third of the way through, started again at two thirds"
    )
    requestors = [
        opened.open(broker, f"outage-{index}", plan.settings) for index in range(plan.requestors)
    ]
    for requestor in requestors:
        wait_for_roster(requestor, plan.nodes, READY_TIMEOUT_S)
    placed = _Placed()
    outcome: dict[str, Any] = {}

    def place() -> None:
        try:
            outcome["latencies_s"], outcome["failed"] = place_in_threads(
                requestors, plan.placements, warm_up=WARMUP_PLACEMENTS, on_placed=placed.tick
            )
        except BaseException as error:  # handed to the waiting thread, which raises it
            outcome["error"] = error

    placing = threading.Thread(target=place, name="bench-outage", daemon=True)
    placing.start()
    timeout_s = PLACE_TIMEOUT_S * plan.placements
    third = plan.placements // 3
    placed.wait_for(third, timeout_s, placing)
    keepers.kill(0)
    killed_after, killed_at = placed.count, time.perf_counter()
    placed.wait_for(2 * third, timeout_s, placing)
    keepers.start(0)
    started_after, started_at = placed.count, time.perf_counter()
    keepers.wait_ready(plan.nodes, READY_TIMEOUT_S)
    ready_after, ready_at = placed.count, time.perf_counter()
    placing.join(timeout_s)
    if placing.is_alive():
        raise BenchError(f"the keeper outage run's placements did not end in {timeout_s:.0f} s")
    if "error" in outcome:
        raise outcome["error"]
    latencies_s: list[float] = outcome["latencies_s"]
    sources = Counter(r.machine.roster_source.state for r in requestors)
    return {
        "keepers": plan.keepers,
        "killed": killed,
        "requestors": len(requestors),
        "placements": plan.placements,
        "placed": len(latencies_s),
        # the nodes had room for every placement of the run: each failure is a false one
        "false_failures": outcome["failed"],
        "p50_ms": _ms(percentile(latencies_s, 0.50)),
        "p99_ms": _ms(percentile(latencies_s, 0.99)),
        "killed_after_placements": killed_after,
        "started_again_after_placements": started_after,
        "knew_the_nodes_again_after_placements": ready_after,
        "keeper_down_s": round(started_at - killed_at, 3),
        "keeper_learning_s": round(ready_at - started_at, 3),
        # where each requestor's roster came from at the end: "keepers" for every one
        "requestors_by_roster_source": dict(sorted(sources.items())),
        "requestors_that_fell_back": sum(1 for r in requestors if r.machine.counters["no_keeper"]),
        "requestors_back_on_keepers": sum(
            1 for r in requestors if r.machine.counters["back_on_keepers"]
        ),
        "samples_from_the_restarted_keeper": keepers.samples(0),
    }


def _result(plan: _Plan, measured: _Measured, elapsed_s: float) -> BenchResult:
    """The figures of the run, each derived from what was measured."""
    baseline, sequential = measured.baseline, measured.sequential
    throughput, failure = measured.throughput, measured.failure
    rtt_p50, rtt_p99 = percentile(baseline.rtt_s, 0.50), percentile(baseline.rtt_s, 0.99)
    to_nodes = baseline.rtt_to_nodes
    to_nodes_p50 = percentile(to_nodes[0], 0.50) if to_nodes else None
    to_nodes_p99 = percentile(to_nodes[0], 0.99) if to_nodes else None
    place_p50 = percentile(sequential.latencies_s, 0.50)
    place_p99 = percentile(sequential.latencies_s, 0.99)
    placed = len(sequential.latencies_s)
    messages = sum(sequential.sent.values())
    messages_per_placement = round(messages / placed, 2) if placed else 0.0
    cores = os.cpu_count() or 1
    return BenchResult(
        broker=plan.url.display,
        exchanges=plan.exchanges,
        nodes=plan.nodes,
        node_processes=plan.node_processes,
        node_mode="in-process" if plan.in_process else "processes",
        requestors=plan.requestors,
        requestor_mode="processes" if plan.requestor_processes else "threads",
        requestor_processes=plan.requestor_processes,
        keepers=plan.keepers,
        placements=plan.placements,
        rtt_samples=len(baseline.rtt_s),
        rtt_p50_ms=_ms(rtt_p50),
        rtt_p99_ms=_ms(rtt_p99),
        rtt_p50_before_ms=_ms(baseline.rtt_p50_before),
        rtt_p50_after_ms=_ms(baseline.rtt_p50_after),
        rtt_to_nodes_p50_ms=None if to_nodes_p50 is None else _ms(to_nodes_p50),
        rtt_to_nodes_p99_ms=None if to_nodes_p99 is None else _ms(to_nodes_p99),
        place_floor_over_rtt=None if to_nodes_p50 is None else _ratio(2 * to_nodes_p50, rtt_p50),
        place_p50_ms=_ms(place_p50),
        place_p95_ms=_ms(percentile(sequential.latencies_s, 0.95)),
        place_p99_ms=_ms(place_p99),
        place_p50_over_rtt=_ratio(place_p50, rtt_p50),
        place_p99_over_rtt=_ratio(place_p99, rtt_p99),
        place_p99_over_rtt_p50=_ratio(place_p99, rtt_p50),
        sequential_failed=sequential.failed,
        placements_per_s=round(throughput.placed / throughput.elapsed_s, 1)
        if throughput.elapsed_s > 0
        else 0.0,
        throughput_placed=throughput.placed,
        throughput_failed=throughput.failed,
        throughput_p50_ms=_ms(percentile(throughput.latencies_s, 0.50)),
        throughput_p99_ms=_ms(percentile(throughput.latencies_s, 0.99)),
        throughput_messages_per_placement=round(
            sum(throughput.received.values()) / throughput.placed, 2
        )
        if throughput.placed
        else 0.0,
        messages_per_placement=messages_per_placement,
        messages_per_placement_by_kind={
            kind: round(count / placed, 2) for kind, count in sorted(sequential.sent.items())
        }
        if placed
        else {},
        exhaustive_steps=sequential.exhaustive_steps,
        full_cluster_nodes=FULL_NODES,
        full_cluster_placed=failure.filled,
        time_to_failure_ms=_ms(statistics.median(failure.plain_s)),
        time_to_failure_explain_ms=_ms(statistics.median(failure.explained_s)),
        broker_msgs_per_s=round(baseline.broker_msgs_per_s, 1),
        broker_bound_placements_per_s=round(baseline.broker_msgs_per_s / messages_per_placement, 1)
        if messages_per_placement
        else 0.0,
        cpu_ms_per_placement=throughput.cpu_ms_per_placement,
        switches_per_placement=throughput.switches_per_placement,
        own_cpu_ms_per_placement=own_cpu(throughput.cpu_ms_per_placement),
        own_cpu_over_broker_cpu=_ratio(
            own_cpu(throughput.cpu_ms_per_placement), throughput.cpu_ms_per_placement["broker"]
        )
        if "broker" in throughput.cpu_ms_per_placement
        else None,
        client_floor_cpu_ms_per_placement=round(
            baseline.cpu_ms_per_message.get("this process", 0.0) * messages_per_placement, 3
        ),
        broker_floor_cpu_ms_per_placement=round(
            baseline.cpu_ms_per_message["broker"] * messages_per_placement, 3
        )
        if "broker" in baseline.cpu_ms_per_message
        else None,
        cpu_bound_cores=cores,
        cpu_bound_placements_per_s=cpu_bound(throughput.cpu_ms_per_placement, cores),
        failure_explanation=failure.explanation,
        machine=_machine(),
        elapsed_s=round(elapsed_s, 1),
        audit=measured.audit,
        notes=plan.notes,
    )


def _targets(plan: _Plan, result: BenchResult) -> dict[str, dict[str, Any]]:
    """Each target that applies to the run's broker, and whether the run met it."""
    targets: tuple[Target, ...] = ()
    if plan.in_process:
        targets = MEMORY_TARGETS
    elif plan.url.scheme in RABBITMQ_SCHEMES:
        targets = RABBITMQ_TARGETS
    figures = result.as_json()
    return {
        t.figure: {
            "target": t.label(),
            "stated_for": t.stated_for,
            # a figure this run could not measure (no broker process to read) is not met
            "met": figures[t.figure] is not None and t.met_by(float(figures[t.figure])),
        }
        for t in targets
    }
