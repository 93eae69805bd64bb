"""The schedulers reservoir is compared with, on the same workload and the same network.

This module owns three baselines, each a small discrete-event model in virtual time with
the same node shapes, arrivals, sizes, lifetimes and latency model as the reservoir run:

- **nova**: Nova's scheduler. ``schedulers`` scheduler processes, each with its own
  host-state cache, refreshed from the nodes' true state every ``refresh_s`` (the periodic
  update; the refreshes are staggered over the period). A request goes to a scheduler
  (round robin), which picks the host with the most free VCPUs that fits *in its cache*
  (the RAM/CPU weighers' spread), decrements its own copy
  (``HostState.consume_from_instance``) and answers; the build goes to the node, which
  *claims* against its true state. A failed claim goes back and is rescheduled on the same
  scheduler without the hosts tried, up to ``max_attempts`` (3, Nova's default) in all,
  then fails (NoValidHost). Legs: request to the scheduler, its answer, the build to the
  node, the claim's result; each state report of a refresh counts one message per node.
- **sampling** (Sparrow's power of d choices): probe ``probes`` random nodes (2), pick the
  least utilised one that fits by what the probes reported, claim it. No probed node
  fitting, or a failed claim, samples again, up to ``max_attempts`` in all. Both probes
  read the nodes' state when the later of the two arrives. Legs: request to the
  scheduler, ``probes`` probes and their answers, the claim and its result.
- **omniscient**: Nova's pipeline with a perfect, instantaneous view of every node: the
  least utilised node that fits is chosen and allocated at once, so a claim never fails
  and a request fails only when no node fits. It defines false failures for the others.

Every system frees an instance when its lifetime ends (two messages: the delete and its
confirmation) and, at every failure, checks with the exact node state whether some node
had room (a false failure). At 100,000 nodes nothing here does O(N) Python work per
placement: the true state lives in a :class:`~reservoir.tools.simulator.capacity.FreeIndex`
(buckets by free VCPUs) and, for Nova, in numpy arrays each scheduler's cache is a copy
of (a refresh is one vectorised copy; a pick two ``argmax`` over blocks of sqrt N). Departures
and refreshes wait for their second of virtual time out of the event heap
(:class:`~reservoir.tools.simulator.calendar.LaterSeconds`).
"""

from __future__ import annotations

import heapq
import math
import random
import time
from collections.abc import Callable
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt

from reservoir.tools.simulator.calendar import LaterSeconds
from reservoir.tools.simulator.capacity import FreeIndex
from reservoir.tools.simulator.memory import collector_paused
from reservoir.tools.simulator.network import LatencyModel, Legs
from reservoir.tools.simulator.results import RunResult
from reservoir.tools.simulator.workload import Cluster, Workload

__all__ = ["BASELINES", "Baseline", "BaselineRun"]

Baseline = Literal["nova", "sampling", "omniscient"]
BASELINES: Final[tuple[Baseline, ...]] = ("nova", "sampling", "omniscient")

# event codes
_ARRIVE: Final = 0
_DEPART: Final = 1
_PREFILL_DEPART: Final = 2
_SCHEDULE: Final = 3
_PROBE: Final = 4
_CLAIM: Final = 5
_REFRESH: Final = 6
_FAIL: Final = 7
_SPILL: Final = 8  # a second's later events go into the heap (calendar.LaterSeconds)

#: messages per freed instance: the delete and its confirmation
FREE_MESSAGES: Final = 2
PROGRESS_EVERY: Final = 500

Progress = Callable[[int], None]
IntArray = npt.NDArray[np.int32]


class _HostCache:
    """One Nova scheduler's host-state cache: free VCPUs and memory per node, with the
    maximum of every block of ``block`` nodes kept, so the host with the most free VCPUs
    is found in O(sqrt N) (two small ``argmax``) rather than O(N), and consuming from one
    host updates one block."""

    __slots__ = ("_block", "_block_max", "_blocks", "memory_mb", "vcpus")

    def __init__(self, vcpus: IntArray, memory_mb: IntArray) -> None:
        nodes = vcpus.size
        self._block = max(1, math.isqrt(nodes))
        self._blocks = -(-nodes // self._block)
        # padded with -1: never the most free, never fitting
        self.vcpus: IntArray = np.full(self._blocks * self._block, -1, dtype=np.int32)
        self.memory_mb: IntArray = np.full(self._blocks * self._block, -1, dtype=np.int32)
        self._block_max: IntArray = np.empty(self._blocks, dtype=np.int32)
        self.refresh(vcpus, memory_mb)

    def refresh(self, vcpus: IntArray, memory_mb: IntArray) -> None:
        """Replace the whole picture with the nodes' true state."""
        self.vcpus[: vcpus.size] = vcpus
        self.memory_mb[: memory_mb.size] = memory_mb
        np.max(self.vcpus.reshape(self._blocks, self._block), axis=1, out=self._block_max)

    def most_free(self) -> int:
        block = int(self._block_max.argmax())
        start = block * self._block
        return start + int(self.vcpus[start : start + self._block].argmax())

    def consume(self, node: int, vcpus: int, memory_mb: int) -> None:
        """``HostState.consume_from_instance``: this scheduler's copy only."""
        self.vcpus[node] -= vcpus
        self.memory_mb[node] -= memory_mb
        block = node // self._block
        start = block * self._block
        self._block_max[block] = self.vcpus[start : start + self._block].max()


class BaselineRun:
    """One run of one baseline on one workload. Build it, then :meth:`run`."""

    def __init__(
        self,
        system: Baseline,
        cluster: Cluster,
        workload: Workload,
        *,
        latency: LatencyModel,
        loss: float = 0.0,
        schedulers: int = 8,
        refresh_s: float = 1.0,
        probes: int = 2,
        max_attempts: int = 3,
        seed: int = 0,
        settle_s: float = 46.0,
        progress: Progress | None = None,
    ) -> None:
        if system not in BASELINES:
            raise ValueError(f"unknown baseline {system!r}; choose one of {', '.join(BASELINES)}")
        if schedulers < 1 or refresh_s <= 0 or probes < 1 or max_attempts < 1:
            raise ValueError("schedulers, probes and attempts must be >= 1, refresh_s > 0")
        self.system = system
        self.cluster = cluster
        self.workload = workload
        self.schedulers = schedulers
        self.refresh_s = refresh_s
        self.probes = min(probes, cluster.nodes)
        self.max_attempts = max_attempts
        self.settle_s = settle_s
        self._progress = progress
        self._rng = random.Random(seed * 7919 + 2)
        self._legs = Legs(latency, loss, self._rng)
        self._heap: list[tuple[float, int, int, Any]] = []
        self._sequence = 0
        #: the virtual time of the event being handled
        self._now = 0.0
        self._later = LaterSeconds(self._heap, lambda second: (float(second), -1, _SPILL, second))
        used_vcpus, used_memory_mb = workload.prefill_usage(cluster.nodes)
        self.state = FreeIndex(
            cluster.shape_of,
            cluster.shapes,
            allocated_vcpus=used_vcpus,
            allocated_memory_mb=used_memory_mb,
        )
        self.result = RunResult(
            system=system,
            offered_load=workload.offered_load,
            nodes=cluster.nodes,
            requests=workload.requests,
        )
        self._free_messages = 0
        self._events = 0
        self.result.prefilled = len(workload.prefill_node)
        self._vcpus = [f.vcpus for f in workload.flavours]
        self._memory_mb = [f.memory_mb for f in workload.flavours]
        if system == "nova":
            self._true_vcpus: IntArray = np.array(self.state.free_vcpus, dtype=np.int32)
            self._true_memory_mb: IntArray = np.array(self.state.free_memory_mb, dtype=np.int32)
            self._caches = [
                _HostCache(self._true_vcpus, self._true_memory_mb) for _ in range(schedulers)
            ]

    def _push(self, at: float, code: int, payload: Any) -> None:
        self._sequence += 1
        self._later.push((at, self._sequence, code, payload), self._now)

    # -- the true state ----------------------------------------------------------------

    def _take(self, node: int, vcpus: int, memory_mb: int) -> bool:
        """The node claims against its true state."""
        state = self.state
        if not state.fits(node, vcpus, memory_mb):
            return False
        state.change(node, -vcpus, -memory_mb)
        if self.system == "nova":
            self._true_vcpus[node] -= vcpus
            self._true_memory_mb[node] -= memory_mb
        return True

    def _give_back(self, node: int, vcpus: int, memory_mb: int) -> None:
        self.state.change(node, vcpus, memory_mb)
        if self.system == "nova":
            self._true_vcpus[node] += vcpus
            self._true_memory_mb[node] += memory_mb
        self._free_messages += FREE_MESSAGES

    def _placed(self, i: int, node: int, claimed_at: float) -> None:
        """Node ``node`` claimed request ``i`` at ``claimed_at``; the result travels back."""
        done_at = claimed_at + self._legs()
        result = self.result
        result.placed += 1
        result.latencies_s.append(done_at - self.workload.arrival_s[i])
        depart_s = claimed_at + self.workload.lifetime_s[i]
        if depart_s <= self.workload.end_s:
            self._push(depart_s, _DEPART, (node, self.workload.flavour_of[i]))

    def _fail(self, i: int) -> None:
        kind = self.workload.flavour_of[i]
        state = self.state
        self.result.record_failure(
            state.fits_somewhere(self._vcpus[kind], self._memory_mb[kind]),
            state.allocated_fraction,
        )

    # -- nova --------------------------------------------------------------------------

    def _nova_pick(self, scheduler: int, vcpus: int, memory_mb: int, tried: tuple[int, ...]) -> int:
        """The host with the most free VCPUs that fits in this scheduler's cache, or -1."""
        cache = self._caches[scheduler]
        best = cache.most_free()
        if cache.vcpus[best] < vcpus:
            return -1
        if cache.memory_mb[best] >= memory_mb and best not in tried:
            return best
        weights = np.where(cache.memory_mb >= memory_mb, cache.vcpus, -1)
        if tried:
            weights[list(tried)] = -1
        best = int(weights.argmax())
        return best if weights[best] >= vcpus else -1

    def _nova_schedule(self, request: tuple[int, int, tuple[int, ...]], now: float) -> None:
        i, attempt, tried = request
        kind = self.workload.flavour_of[i]
        vcpus, memory_mb = self._vcpus[kind], self._memory_mb[kind]
        scheduler = i % self.schedulers
        host = self._nova_pick(scheduler, vcpus, memory_mb, tried)
        answered_at = now + self._legs()
        if host < 0:
            self._push(answered_at, _FAIL, i)  # NoValidHost, once the answer is back
            return
        self._caches[scheduler].consume(host, vcpus, memory_mb)
        self._push(answered_at + self._legs(), _CLAIM, (i, attempt, tried, host))

    def _refresh(self, scheduler: int, now: float) -> None:
        self._caches[scheduler].refresh(self._true_vcpus, self._true_memory_mb)
        self.result.state_messages += self.cluster.nodes
        self._push(now + self.refresh_s, _REFRESH, scheduler)

    # -- sampling ----------------------------------------------------------------------

    def _sample(self, request: tuple[int, int, tuple[int, ...]], now: float) -> None:
        """Send the probes: they read the nodes when the later one arrives."""
        i, attempt, tried = request
        legs = self._legs
        chosen = self._rng.sample(range(self.cluster.nodes), self.probes)
        out_s = max(legs() for _ in chosen)
        self._push(now + out_s, _PROBE, (i, attempt, tried, chosen))

    def _probed(self, request: tuple[int, int, tuple[int, ...], list[int]], now: float) -> None:
        i, attempt, tried, chosen = request
        kind = self.workload.flavour_of[i]
        vcpus, memory_mb = self._vcpus[kind], self._memory_mb[kind]
        state = self.state
        fitting = [n for n in chosen if state.fits(n, vcpus, memory_mb)]
        decided_at = now + max(self._legs() for _ in chosen)
        if not fitting:
            self._retry_or_fail(i, attempt, tried, decided_at, resample=True)
            return
        host = min(fitting, key=state.utilisation)
        self._push(decided_at + self._legs(), _CLAIM, (i, attempt, tried, host))

    def _retry_or_fail(
        self, i: int, attempt: int, tried: tuple[int, ...], at: float, *, resample: bool
    ) -> None:
        if attempt >= self.max_attempts:
            self._push(at, _FAIL, i)
            return
        self.result.reschedules += 1
        request = (i, attempt + 1, tried)
        if resample:  # the scheduler samples again at once
            self._sample(request, at)
        else:  # the failed claim's result travels back, then the request is re-sent
            self._push(at + self._legs(), _SCHEDULE, request)

    # -- omniscient --------------------------------------------------------------------

    def _omniscient(self, i: int, now: float) -> None:
        kind = self.workload.flavour_of[i]
        vcpus, memory_mb = self._vcpus[kind], self._memory_mb[kind]
        host = self.state.least_utilised(vcpus, memory_mb)
        if host is None:
            self._fail(i)  # by construction, no node had room: never a false failure
            return
        self._take(host, vcpus, memory_mb)
        answered_at = now + self._legs()
        self._placed(i, host, answered_at + self._legs())

    # -- the loop ----------------------------------------------------------------------

    def run(self) -> RunResult:
        with collector_paused():
            return self._run()

    def _run(self) -> RunResult:
        started = time.perf_counter()
        workload = self.workload
        if workload.requests:
            self._push(workload.arrival_s[0], _ARRIVE, 0)
        if workload.prefill_depart_s:
            self._push(workload.prefill_depart_s[0], _PREFILL_DEPART, 0)
        if self.system == "nova":
            for scheduler in range(self.schedulers):
                offset_s = self.refresh_s * scheduler / self.schedulers
                self._push(offset_s, _REFRESH, scheduler)
        end_s = workload.end_s + self.settle_s
        self._loop(end_s)
        result = self.result
        result.messages = self._legs.messages + result.state_messages + self._free_messages
        result.lost = self._legs.lost
        result.events = self._events
        result.virtual_s = end_s
        result.wall_s = time.perf_counter() - started
        if self._progress is not None:
            self._progress(workload.requests % PROGRESS_EVERY)
        return result

    def _loop(self, until_s: float) -> None:
        heap = self._heap
        pop = heapq.heappop
        workload = self.workload
        system = self.system
        progress = self._progress
        later = self._later
        events = 0
        while heap and heap[0][0] <= until_s:
            now, _, code, payload = pop(heap)
            if code == _SPILL:
                later.spill(payload)
                continue
            self._now = now
            events += 1
            if code == _ARRIVE:
                i = payload
                if i + 1 < workload.requests:
                    self._push(workload.arrival_s[i + 1], _ARRIVE, i + 1)
                if progress is not None and (i + 1) % PROGRESS_EVERY == 0:
                    progress(PROGRESS_EVERY)
                if system == "omniscient":
                    self._omniscient(i, now + self._legs())
                elif system == "nova":
                    self._push(now + self._legs(), _SCHEDULE, (i, 1, ()))
                else:
                    self._sample((i, 1, ()), now + self._legs())
            elif code == _SCHEDULE:
                self._nova_schedule(payload, now)
            elif code == _CLAIM:
                i, attempt, tried, host = payload
                kind = workload.flavour_of[i]
                if self._take(host, self._vcpus[kind], self._memory_mb[kind]):
                    self._placed(i, host, now)
                else:
                    back_at = now + self._legs()
                    self._retry_or_fail(
                        i, attempt, (*tried, host), back_at, resample=system == "sampling"
                    )
            elif code == _PROBE:
                self._probed(payload, now)
            elif code == _DEPART:
                node, kind = payload
                self._give_back(node, self._vcpus[kind], self._memory_mb[kind])
            elif code == _REFRESH:
                self._refresh(payload, now)
            elif code == _FAIL:
                self._fail(payload)
            else:  # _PREFILL_DEPART
                j = payload
                if now <= workload.end_s:
                    kind = workload.prefill_flavour[j]
                    self._give_back(
                        workload.prefill_node[j], self._vcpus[kind], self._memory_mb[kind]
                    )
                    if j + 1 < len(workload.prefill_depart_s):
                        self._push(workload.prefill_depart_s[j + 1], _PREFILL_DEPART, j + 1)
        self._events += events
