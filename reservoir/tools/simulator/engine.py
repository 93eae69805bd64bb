"""The discrete-event engine that drives reservoir's own protocol machines in virtual time.

This module owns the reservoir side of ``reservoir simulate``: one queue of events ``(time,
sequence, code, participant, payload)`` (a heap, with the events due in a later second
waiting in :class:`~reservoir.tools.simulator.calendar.LaterSeconds`), no threads, no sleeps, no
real clock. It instantiates :class:`~reservoir.protocol.node.NodeMachine` and
:class:`~reservoir.protocol.requestor.RequestorMachine` directly (the runtime
``NodeAgent``/``Requestor`` classes, with their locks, codecs and schedulers, are far too
heavy for 100,000 nodes) and carries out their effects in order:

- ``Publish(topic, message)`` routes through a :class:`reservoir.brokers.routing.BindingTable`
  (topic-exchange semantics) to every bound participant, in participant order;
  ``Send(address, message)`` goes to the participant with that address. A publish or send
  that reaches nobody comes back to its sender as unroutable, one latency later: a
  requestor's machine hears it (``on_unroutable``), a node's is only counted.
- ``Bind``/``Unbind`` change the binding table; ``SetTimer``/``CancelTimer`` keep one
  generation per (participant, key), so a replaced or cancelled timer's firing is ignored.
- ``StoreAllocation``/``DeleteAllocation`` need nothing: the node's ledger is the state.
- ``Placed``/``Failed``/``FreeCompleted`` are outcomes for the workload driver below;
  ``Dropped`` is counted by reason.

**Messages are handed over as the msgspec structs themselves, without byte
serialisation** (no codec, no signing, no size check): the simulation measures the
protocol, not the wire. Every delivery (one message handed to one participant) is counted
by kind. Each delivery draws its own latency and loss from a seeded ``random.Random``;
with a fixed latency and no loss, the deliveries of one publish share one heap entry.

The workload driver places each arrival through a requestor (round robin) with
``machine.place``, frees each placed instance when its lifetime ends with
``machine.free``, and at the end lets every TTL run out (the request timeout plus three
TTLs plus a second, with no new arrivals) and audits every node's ledger with
:func:`reservoir.protocol.audit.audit`.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Final, NamedTuple

from reservoir.brokers.routing import BindingTable
from reservoir.protocol.addresses import node_address, requestor_address
from reservoir.protocol.audit import Claim, NodeSnapshot, audit
from reservoir.protocol.effects import (
    Bind,
    CancelTimer,
    DeleteAllocation,
    Dropped,
    Effect,
    Failed,
    FreeCompleted,
    Placed,
    Publish,
    Send,
    SetTimer,
    StoreAllocation,
    Unbind,
)
from reservoir.protocol.keeper import KeeperConfig, KeeperMachine
from reservoir.protocol.ledger import Allocation, Inventory
from reservoir.protocol.messages import Message
from reservoir.protocol.node import NodeConfig, NodeMachine
from reservoir.protocol.placement import PlacedAllocation, Placement, PlacementRequest
from reservoir.protocol.requestor import RequestorMachine
from reservoir.protocol.requestor_state import RequestorConfig
from reservoir.tools.simulator.calendar import LaterSeconds
from reservoir.tools.simulator.capacity import FreeIndex
from reservoir.tools.simulator.memory import collector_paused, roster_bytes_per_entry
from reservoir.tools.simulator.network import LatencyModel
from reservoir.tools.simulator.results import ROSTER_KINDS, RunResult
from reservoir.tools.simulator.workload import Cluster, Workload

__all__ = ["ReservoirRun", "broadcasts_of", "node_address", "requestor_address"]

# event codes
_DELIVER: Final = 0
_DELIVER_MANY: Final = 1
_TIMER: Final = 2
_UNROUTABLE: Final = 3
_ARRIVE: Final = 4
_DEPART: Final = 5
_PREFILL_DEPART: Final = 6
_SPILL: Final = 7  # a second's later events go into the heap (calendar.LaterSeconds)
_RESTART: Final = 8  # a requestor is replaced by a new one (a rolling deploy)

#: how long after a requestor's start its cost is counted (answers take a round trip)
START_WINDOW_S: Final = 2.0

#: how often (in arrivals) the progress callback hears of the run
PROGRESS_EVERY: Final = 500

Progress = Callable[[int], None]


def broadcasts_of(machines: Sequence[RequestorMachine], publishes_by_kind: dict[str, int]) -> int:
    """How often requestors fell back to broadcasting a request (the exhaustive step)
    rather than probing nodes sampled from their rosters. Read from the machines' own
    ``counters["exhaustive_steps"]`` when they keep one; otherwise counted as the
    ``Publish`` effects of ``ReservationRequest`` messages (every tier widened to then
    counts once). Every report goes through this one function."""
    counted = 0
    for machine in machines:
        counters = getattr(machine, "counters", None)
        if not isinstance(counters, Mapping):
            return publishes_by_kind.get("request", 0)
        counted += int(counters.get("exhaustive_steps", 0))
    return counted


def _prefill_request_id(j: int) -> str:
    """The request id of the steady state's ``j``-th instance (its reservation's too)."""
    return f"pre-{j}"


def _prefill_allocation_id(j: int) -> str:
    return f"pre-{j}/0"


class _ClaimedAllocation(NamedTuple):
    allocation_id: str


class _PrefillClaim(NamedTuple):
    """A steady-state instance as the audit sees its placement (a :class:`Claim`)."""

    request_id: str
    allocations: tuple[_ClaimedAllocation, ...]


class _Node:
    __slots__ = (
        "address",
        "allocated_vcpus",
        "index",
        "machine",
        "memory_mb",
        "name",
        "reserved_vcpus",
        "timers",
    )
    is_node = True

    def __init__(self, index: int, name: str, machine: NodeMachine) -> None:
        self.index = index
        self.name = name
        self.address = machine.config.address
        self.machine = machine
        self.timers: dict[Hashable, int] = {}
        usage = machine.ledger.usage("VCPU")
        self.allocated_vcpus = usage.allocated
        self.reserved_vcpus = usage.reserved
        #: the memory its allocations may take (a simulated node's inventory never changes)
        self.memory_mb = machine.ledger.usage("MEMORY_MB").capacity


class _Requestor:
    __slots__ = ("address", "index", "machine", "name", "timers")
    is_node = False

    def __init__(self, index: int, name: str, machine: RequestorMachine) -> None:
        self.index = index
        self.name = name
        self.address = machine.config.reply_to
        self.machine = machine
        self.timers: dict[Hashable, int] = {}


class _Keeper:
    __slots__ = ("address", "index", "machine", "name", "timers")
    is_node = False

    def __init__(self, index: int, name: str, machine: KeeperMachine) -> None:
        self.index = index
        self.name = name
        self.address = machine.config.reply_to
        self.machine = machine
        self.timers: dict[Hashable, int] = {}


_Participant = _Node | _Requestor | _Keeper


def _requestor_config(name: str, seed: int, keepers: int) -> RequestorConfig:
    """A requestor's configuration; its roster's sampling is seeded from the run's seed
    when the configuration has a seed for it, so runs stay reproducible and ``--seed``
    changes them. With keepers, it takes its roster from them as a requestor does by
    default (``auto``); with none, it follows the announcements and never asks for one."""
    config = RequestorConfig(
        requestor_id=name,
        reply_to=requestor_address(name),
        roster_from="auto" if keepers else "announcements",
    )
    if "sample_seed" in {f.name for f in dataclasses.fields(RequestorConfig)}:
        seeded: dict[str, Any] = {"sample_seed": f"{seed}:{name}"}
        config = dataclasses.replace(config, **seeded)
    return config


class ReservoirRun:
    """One run of reservoir's protocol on one workload. Build it, then :meth:`run`."""

    def __init__(
        self,
        cluster: Cluster,
        workload: Workload,
        *,
        latency: LatencyModel,
        loss: float = 0.0,
        requestors: int = 8,
        keepers: int = 0,
        requestor_restarts_per_s: float = 0.0,
        seed: int = 0,
        timeout_s: float = 30.0,
        progress: Progress | None = None,
    ) -> None:
        if requestors < 1:
            raise ValueError("at least one requestor is needed")
        if keepers < 0:
            raise ValueError("keepers cannot be negative")
        if requestor_restarts_per_s < 0:
            raise ValueError("requestor restarts per second cannot be negative")
        self.keepers = keepers
        self._restarts_per_s = requestor_restarts_per_s
        self._seed = seed
        #: requestors replaced by new ones: they finish what they had in flight
        self._retired: list[_Requestor] = []
        self.cluster = cluster
        self.workload = workload
        self.timeout_s = timeout_s
        self._progress = progress
        self._rng = random.Random(seed * 7919 + 1)
        self._draw = latency.sampler(self._rng)
        self._fixed_s = latency.fixed_s
        self._loss = loss
        self._heap: list[tuple[float, int, int, Any, Any]] = []
        self._sequence = 0
        self.now = 0.0
        self._later = LaterSeconds(
            self._heap, lambda second: (float(second), -1, _SPILL, None, second)
        )
        self.table = BindingTable()
        self._by_address: dict[str, _Participant] = {}
        self._participants: list[_Participant] = []
        self._position: dict[str, int] = {}
        # counters
        self.deliveries: dict[str, int] = {}
        self.publishes: dict[str, int] = {}
        self.sends: dict[str, int] = {}
        self.unroutable: dict[str, int] = {}
        self.dropped: dict[str, int] = {}
        self.lost = 0
        self.events = 0
        self.result = RunResult(
            system="reservoir",
            offered_load=workload.offered_load,
            nodes=cluster.nodes,
            requests=workload.requests,
        )
        # reservations, time-averaged over the arrival window
        self._reserved_total = 0
        self._reserved_area = 0.0
        self._reserved_since = workload.start_s
        self._window = (workload.start_s, workload.end_s)
        # the workload's bookkeeping
        self._specs = [
            PlacementRequest(resources={"VCPU": f.vcpus, "MEMORY_MB": f.memory_mb})
            for f in workload.flavours
        ]
        self._pending: dict[str, int] = {}
        self._live: dict[str, Placement] = {}
        #: pre-filled instances freed so far (they depart in order)
        self._prefilled_done = 0
        used_vcpus, used_memory_mb = workload.prefill_usage(cluster.nodes)
        self.free_index = FreeIndex(
            cluster.shape_of,
            cluster.shapes,
            allocated_vcpus=used_vcpus,
            allocated_memory_mb=used_memory_mb,
        )
        with collector_paused():
            self._build(requestors, seed)

    # -- building ----------------------------------------------------------------------

    def _add(self, participant: _Participant) -> None:
        self._by_address[participant.address] = participant
        self._position[participant.address] = len(self._participants)
        self._participants.append(participant)

    def _build(self, requestors: int, seed: int) -> None:
        cluster, workload = self.cluster, self.workload
        inventories = [
            {
                "VCPU": Inventory(total=shape.vcpus, allocation_ratio=shape.cpu_allocation_ratio),
                "MEMORY_MB": Inventory(total=shape.memory_mb),
            }
            for shape in cluster.shapes
        ]
        requestor_names = [f"requestor-{k}" for k in range(requestors)]
        prefilled: list[list[Allocation]] = [[] for _ in range(cluster.nodes)]
        # One resources mapping per flavour, shared by its steady-state instances (nothing
        # changes an allocation's resources): 1.75 million dicts fewer at 100,000 nodes.
        shared_resources = [
            {"VCPU": flavour.vcpus, "MEMORY_MB": flavour.memory_mb} for flavour in workload.flavours
        ]
        #: the steady state's allocations as the engine placed them, by instance, until they
        #: depart: what its frees and the final audit's claims name (the same strings the
        #: nodes hold, not a second copy of 3.5 million ids)
        self._prefilled: list[Allocation | None] = []
        for j, (where, kind) in enumerate(
            zip(workload.prefill_node, workload.prefill_flavour, strict=True)
        ):
            request_id = _prefill_request_id(j)  # one string for both ids
            allocation = Allocation(
                allocation_id=_prefill_allocation_id(j),
                request_id=request_id,
                reservation_id=request_id,
                owner=requestor_names[j % requestors],
                resources=shared_resources[kind],
                # like the arrivals' ids, the steady state's are the requestors' own, so
                # no Lookup looks for them (a node binds no lookup bucket for them)
                findable=False,
            )
            self._prefilled.append(allocation)
            prefilled[where].append(allocation)
        self._nodes: list[_Node] = []
        for i, shape in enumerate(cluster.shape_of):
            name = f"node-{i}"
            config = NodeConfig(
                name=name, address=node_address(name), inventories=inventories[shape]
            )
            node = _Node(i, name, NodeMachine(config, allocations=prefilled[i]))
            self._nodes.append(node)
            self._add(node)
        self.result.prefilled = len(workload.prefill_node)
        self._keepers: list[_Keeper] = []
        for k in range(self.keepers):
            name = f"keeper-{k}"
            keeper = KeeperMachine(
                KeeperConfig(keeper_id=name, reply_to=requestor_address(name),
                             sample_seed=f"{seed}:{name}")
            )  # fmt: skip
            self._keepers.append(_Keeper(len(self._participants), name, keeper))
            self._add(self._keepers[-1])
        self._requestors: list[_Requestor] = []
        for name in requestor_names:
            machine = RequestorMachine(_requestor_config(name, seed, self.keepers))
            requestor = _Requestor(len(self._participants), name, machine)
            self._requestors.append(requestor)
            self._add(requestor)

    # -- the event loop ----------------------------------------------------------------

    def _push(self, at: float, code: int, who: Any, payload: Any) -> None:
        self._sequence += 1
        self._later.push((at, self._sequence, code, who, payload), self.now)

    def run(self) -> RunResult:
        with collector_paused():
            return self._run()

    def _run(self) -> RunResult:
        started = time.perf_counter()
        workload = self.workload
        if self._keepers:
            # Keepers, then nodes, whose first announcements fill the keepers' rosters;
            # requestors once that is done, each asking a keeper for a sample.
            for keeper in self._keepers:
                self._apply(keeper, keeper.machine.start(0.0), 0.0)
            for node in self._nodes:
                self._apply(node, node.machine.start(0.0), 0.0)
            self._loop(min(workload.start_s, 0.5))
            for requestor in self._requestors:
                self._apply(requestor, requestor.machine.start(self.now), self.now)
        else:
            # Requestors first: each node's first announcement, one publish on the roster
            # topic, then reaches every requestor, where requestors starting after the
            # nodes would each roll-call all of them (K x N answers, one by one).
            for requestor in self._requestors:
                self._apply(requestor, requestor.machine.start(0.0), 0.0)
            for node in self._nodes:
                self._apply(node, node.machine.start(0.0), 0.0)
        # start-up (roll calls, first announcements) is not what the run measures
        self._loop(workload.start_s)
        self.deliveries.clear()
        self.publishes.clear()
        self.sends.clear()
        self.unroutable.clear()
        self.dropped.clear()
        self.lost = 0
        self._broadcasts_before = broadcasts_of(
            [r.machine for r in self._requestors], self.publishes
        )
        if workload.requests:
            self._push(workload.arrival_s[0], _ARRIVE, None, 0)
        if workload.prefill_depart_s:
            self._push(workload.prefill_depart_s[0], _PREFILL_DEPART, None, 0)
        if self._restarts_per_s > 0:
            self._push(self._next_restart_s(workload.start_s), _RESTART, None, 0)
        ttl_s = self._requestors[0].machine.config.ttl_s
        end_s = workload.end_s + self.timeout_s + 3 * ttl_s + 1.0
        self._loop(end_s)
        end_s = self._measure_a_start(end_s)
        self._finish(end_s, started)
        return self.result

    # -- requestors coming and going -----------------------------------------------------

    def _new_requestor(self, name: str, now: float) -> _Requestor:
        machine = RequestorMachine(_requestor_config(name, self._seed, self.keepers))
        requestor = _Requestor(len(self._participants), name, machine)
        self._add(requestor)
        self._apply(requestor, machine.start(now), now)
        return requestor

    def _next_restart_s(self, after_s: float) -> float:
        return after_s + self._rng.expovariate(self._restarts_per_s)

    def _restart(self, n: int, now: float) -> None:
        """A rolling deploy's step: one requestor makes way for a new one, which takes its
        share of the arrivals; the old one finishes what it has in flight."""
        k = self._rng.randrange(len(self._requestors))
        old = self._requestors[k]
        self._retired.append(old)
        # It hears no more announcements (its process is on its way out); what it has
        # in flight is answered at its address, and it frees what it placed.
        self.table.unbind_all(old.address)
        self._requestors[k] = self._new_requestor(f"{old.name.split('.')[0]}.r{n + 1}", now)
        next_s = self._next_restart_s(now)
        if next_s <= self.workload.end_s:
            self._push(next_s, _RESTART, None, n + 1)

    def _measure_a_start(self, end_s: float) -> float:
        """Start one more requestor once the run is over and count what the start costs
        (every delivery of the next :data:`START_WINDOW_S`: nothing else is in flight),
        leaving the run's own counts as they were. Returns the new end of the run."""
        counts = (self.deliveries, self.publishes, self.sends, self.unroutable, self.dropped)
        kept = [dict(count) for count in counts]
        before = sum(self.deliveries.values())
        self._new_requestor("requestor-started-last", end_s)
        self._loop(end_s + START_WINDOW_S)
        self.result.start_messages = sum(self.deliveries.values()) - before
        for count, was in zip(counts, kept, strict=True):
            count.clear()
            count.update(was)
        return end_s + START_WINDOW_S

    def _loop(self, until_s: float) -> None:
        heap = self._heap
        pop = heapq.heappop
        deliveries = self.deliveries
        apply = self._apply
        observe = self._observe
        events = 0
        while heap and heap[0][0] <= until_s:
            at, sequence, code, who, payload = pop(heap)
            self.now = at
            events += 1
            if code == _DELIVER:
                kind = payload.kind
                deliveries[kind] = deliveries.get(kind, 0) + 1
                effects = who.machine.handle(payload, at)
            elif code == _DELIVER_MANY:
                kind = payload.kind
                deliveries[kind] = deliveries.get(kind, 0) + len(who)
                for target in who:
                    effects = target.machine.handle(payload, at)
                    if effects:
                        apply(target, effects, at)
                    if target.is_node:
                        observe(target, at)
                continue
            elif code == _TIMER:
                if who.timers.get(payload) != sequence:
                    continue  # replaced or cancelled
                del who.timers[payload]
                effects = who.machine.on_timer(payload, at)
            elif code == _UNROUTABLE:
                effects = who.machine.on_unroutable(payload, at)
            elif code == _ARRIVE:
                self._arrive(payload, at)
                continue
            elif code == _DEPART:
                apply(who, who.machine.free(payload, at), at)
                continue
            elif code == _SPILL:
                self._later.spill(payload)
                events -= 1  # a marker, not an event of the run
                continue
            elif code == _RESTART:
                self._restart(payload, at)
                continue
            else:
                self._prefill_depart(payload, at)
                continue
            if effects:
                apply(who, effects, at)
            if who.is_node:
                observe(who, at)
        self.events += events

    def _transmit(self, target: _Participant, message: Message, now: float) -> None:
        if self._loss and self._rng.random() < self._loss:
            self.lost += 1
            return
        self._sequence += 1
        heapq.heappush(self._heap, (now + self._draw(), self._sequence, _DELIVER, target, message))

    def _bounce(self, sender: _Participant, message: Message, now: float) -> None:
        kind = message.kind
        self.unroutable[kind] = self.unroutable.get(kind, 0) + 1
        if not sender.is_node:
            self._push(now + self._draw(), _UNROUTABLE, sender, message)

    def _apply(self, who: _Participant, effects: list[Effect], now: float) -> None:
        for effect in effects:
            cls = type(effect)
            if cls is Send:
                message = effect.message  # type: ignore[union-attr]
                kind = message.kind
                self.sends[kind] = self.sends.get(kind, 0) + 1
                target = self._by_address.get(effect.address)  # type: ignore[union-attr]
                if target is None:
                    self._bounce(who, message, now)
                else:
                    self._transmit(target, message, now)
            elif cls is SetTimer:
                key = effect.key  # type: ignore[union-attr]
                self._push(max(effect.at, now), _TIMER, who, key)  # type: ignore[union-attr]
                who.timers[key] = self._sequence  # the generation its firing must match
            elif cls is CancelTimer:
                who.timers.pop(effect.key, None)  # type: ignore[union-attr]
            elif cls is Publish:
                self._publish(who, effect, now)  # type: ignore[arg-type]
            elif cls is Dropped:
                reason = effect.reason  # type: ignore[union-attr]
                self.dropped[reason] = self.dropped.get(reason, 0) + 1
            elif cls is Bind:
                self.table.bind(who.address, effect.topic)  # type: ignore[union-attr]
            elif cls is Unbind:
                self.table.unbind(who.address, effect.topic)  # type: ignore[union-attr]
            elif cls is StoreAllocation or cls is DeleteAllocation:
                pass  # the node's ledger is the state
            elif cls is Placed:
                self._placed(who, effect, now)  # type: ignore[arg-type]
            elif cls is Failed:
                self._failed(effect, now)  # type: ignore[arg-type]
            elif cls is FreeCompleted:
                pass
            else:  # an effect this engine does not know yet: count it, never crash
                reason = f"unknown effect {cls.__name__}"
                self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def _publish(self, who: _Participant, effect: Publish, now: float) -> None:
        message = effect.message
        kind = message.kind
        self.publishes[kind] = self.publishes.get(kind, 0) + 1
        reached = self.table.route(effect.topic)
        if not reached:
            self._bounce(who, message, now)
            return
        # in participant order, not the set's (salted-hash) order: reproducible runs
        position = self._position
        participants = self._participants
        targets = [participants[p] for p in sorted([position[a] for a in reached])]
        if self._loss:
            random_ = self._rng.random
            loss = self._loss
            kept = [t for t in targets if random_() >= loss]
            self.lost += len(targets) - len(kept)
            targets = kept
        if self._fixed_s is not None:
            if targets:
                self._push(now + self._fixed_s, _DELIVER_MANY, targets, message)
            return
        draw = self._draw
        heap = self._heap
        for target in targets:
            self._sequence += 1
            heapq.heappush(heap, (now + draw(), self._sequence, _DELIVER, target, message))

    def _observe(self, node: _Node, now: float) -> None:
        """Follow the node's ledger: reservations held (time-averaged) and allocations
        (for the false-failure check and the fill at the first failure)."""
        ledger = node.machine.ledger
        reserved = ledger.reserved("VCPU")  # after nearly every message: no usage object
        if reserved != node.reserved_vcpus:
            self._advance_reserved(now)
            self._reserved_total += reserved - node.reserved_vcpus
            node.reserved_vcpus = reserved
        allocated = ledger.allocated("VCPU")
        if allocated != node.allocated_vcpus:
            index = self.free_index
            i = node.index
            # the free memory from its two parts (``usage`` would build a record for it)
            free_memory_mb = node.memory_mb - ledger.allocated("MEMORY_MB")
            index.change(
                i,
                node.allocated_vcpus - allocated,
                free_memory_mb - index.free_memory_mb[i],
            )
            node.allocated_vcpus = allocated

    def _advance_reserved(self, now: float) -> None:
        """Add the VCPUs reserved since the last change, times how long, to the area
        (only the part inside the arrival window counts)."""
        low, high = self._window
        since = max(self._reserved_since, low)
        until = min(now, high)
        if until > since:
            self._reserved_area += self._reserved_total * (until - since)
        self._reserved_since = now

    # -- the workload ------------------------------------------------------------------

    def _arrive(self, i: int, now: float) -> None:
        workload = self.workload
        requestor = self._requestors[i % len(self._requestors)]
        request_id = f"req-{i}"
        self._pending[request_id] = i
        spec = self._specs[workload.flavour_of[i]]
        self._apply(
            requestor,
            requestor.machine.place(spec, request_id, now, self.timeout_s, requested_at_s=now),
            now,
        )
        if i + 1 < workload.requests:
            self._push(workload.arrival_s[i + 1], _ARRIVE, None, i + 1)
        if self._progress is not None and (i + 1) % PROGRESS_EVERY == 0:
            self._progress(PROGRESS_EVERY)

    def _placed(self, requestor: _Participant, effect: Placed, now: float) -> None:
        i = self._pending.pop(effect.request_id, None)
        if i is None:
            return  # a repeat answer for an id placed before: not a new placement
        result = self.result
        result.placed += 1
        result.latencies_s.append(now - self.workload.arrival_s[i])
        placement = effect.placement
        depart_s = now + self.workload.lifetime_s[i]
        if depart_s <= self.workload.end_s:
            self._push(depart_s, _DEPART, requestor, placement)
        else:
            self._live[placement.request_id] = placement

    def _failed(self, effect: Failed, now: float) -> None:
        i = self._pending.pop(effect.request_id, None)
        if i is None:
            return
        flavour = self.workload.flavours[self.workload.flavour_of[i]]
        index = self.free_index
        self.result.record_failure(
            index.fits_somewhere(flavour.vcpus, flavour.memory_mb), index.allocated_fraction
        )

    def _prefill_placement(self, j: int) -> Placement:
        workload = self.workload
        node = self._nodes[workload.prefill_node[j]]
        allocation = self._prefilled[j]
        assert allocation is not None, "a steady-state instance departs once"
        return Placement(
            request_id=allocation.request_id,
            allocations=(
                PlacedAllocation(
                    node=node.name,
                    address=node.address,
                    allocation_id=allocation.allocation_id,
                    resources=dict(allocation.resources),
                ),
            ),
            requested=1,
        )

    def _prefill_depart(self, j: int, now: float) -> None:
        workload = self.workload
        if now <= workload.end_s:
            requestor = self._requestors[j % len(self._requestors)]
            self._apply(requestor, requestor.machine.free(self._prefill_placement(j), now), now)
            self._prefilled[j] = None
            self._prefilled_done = j + 1
            if j + 1 < len(workload.prefill_depart_s):
                self._push(workload.prefill_depart_s[j + 1], _PREFILL_DEPART, None, j + 1)

    # -- the end -----------------------------------------------------------------------

    def _finish(self, end_s: float, started: float) -> None:
        workload = self.workload
        result = self.result
        low, high = self._window
        self._advance_reserved(max(high, self._reserved_since))
        span = high - low
        total = self.free_index.total_vcpus
        result.reserved_fraction = self._reserved_area / (span * total) if span > 0 else 0.0
        # requests still undecided (none, unless the timeout outlasts the settling time)
        for request_id in list(self._pending):
            i = self._pending.pop(request_id)
            flavour = workload.flavours[workload.flavour_of[i]]
            self.result.record_failure(
                self.free_index.fits_somewhere(flavour.vcpus, flavour.memory_mb),
                self.free_index.allocated_fraction,
            )
        live: list[Claim] = list(self._live.values())
        # The steady state's instances still running: what the audit reads of their
        # placements, without building a Placement for each of a million of them.
        live += [
            _PrefillClaim(a.request_id, (_ClaimedAllocation(a.allocation_id),))
            for a in self._prefilled[self._prefilled_done :]
            if a is not None  # never None: the departed are before ``_prefilled_done``
        ]
        report = audit(
            (
                NodeSnapshot.of(node.name, node.machine.ledger, end_s, node.machine.tier())
                for node in self._nodes
            ),
            live,
        )
        result.audit = {
            "overcommitted": len(report.overcommitted),
            "leaked_reservations": len(report.leaked_reservations),
            "duplicate_placements": len(report.duplicate_placements),
            "orphaned_allocations": len(report.orphaned_allocations),
        }
        self.audit_report = report
        result.deliveries_by_kind = dict(self.deliveries)
        rosters = [len(r.machine.roster) for r in (*self._requestors, *self._retired)]
        result.roster_entries = max(rosters)
        result.roster_bytes = result.roster_entries * roster_bytes_per_entry()
        result.roster_messages = sum(
            count for kind, count in self.deliveries.items() if kind in ROSTER_KINDS
        )
        result.restarts = len(self._retired)
        result.publishes_by_kind = dict(self.publishes)
        result.sends_by_kind = dict(self.sends)
        result.messages = sum(self.deliveries.values())
        result.dropped_by_reason = dict(self.dropped)
        result.unroutable_by_kind = dict(self.unroutable)
        result.reschedules = self.deliveries.get("refused", 0)
        machines = [r.machine for r in (*self._requestors, *self._retired)]
        result.broadcasts = broadcasts_of(machines, self.publishes) - self._broadcasts_before
        result.tier_broadcasts = self.publishes.get("request", 0)
        result.probes = self.sends.get("request", 0)
        result.lost = self.lost
        result.events = self.events
        result.virtual_s = end_s
        result.wall_s = time.perf_counter() - started
        if self._progress is not None:
            self._progress(workload.requests % PROGRESS_EVERY)
