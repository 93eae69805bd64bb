"""The service object an ASGI app holds for its lifetime: :class:`ReservoirService`.

ONE shared :class:`~reservoir.Requestor` per process (it is thread-safe, runs any number of
concurrent requests over one reply queue and learns the offer latency that keeps tier
widening short), a cache of the placements this process answered for, and the per-process
record of idempotency key -> request body hash. :mod:`reservoir.service.lifespan` opens it
for an app's lifespan.
"""

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from reservoir.broker import Broker, BrokerError
from reservoir.protocol.audit import NodeSnapshot
from reservoir.protocol.placement import (
    Holdings,
    Placement,
    PlacementError,
    PlacementRequest,
    PlacementTimeout,
)
from reservoir.runtime.auditor import LedgerCollector
from reservoir.runtime.checked_request import CheckedRequest
from reservoir.runtime.requestor import Requestor, RequestorClosed
from reservoir.runtime.settings import Settings
from reservoir.service.activity import Activity
from reservoir.service.shapes import Problem

if TYPE_CHECKING:
    from reservoir.service.metrics import ServiceMetrics

__all__ = ["CACHE_ENTRIES", "DEFAULT_DRAIN_TIMEOUT_S", "ReservoirService"]

# the logger's name predates the service package: operators' logging configs name it
log = logging.getLogger("reservoir.serve")

T = TypeVar("T")

DEFAULT_DRAIN_TIMEOUT_S = 10.0
#: after the drain, how long the placements the closing requestor failed get to end
AFTER_CLOSE_S = 0.5
#: placements (with their keys' body hashes) a service process keeps in its cache, the
#: least recently used forgotten first: as many as its requestor remembers
CACHE_ENTRIES = 100_000
#: node listings (``GET /v1/nodes``) gathering at once, each on a thread of the service's
#: own that sleeps while the ledgers come in; more wait their turn
LEDGER_GATHERS = 8


@dataclass
class ReservoirService:
    """The shared requestor, a cache of the placements this process answered for (by
    request id), and the idempotency record.

    The nodes are the truth: :meth:`find` (``GET``) and :meth:`release` (``DELETE``) ask
    them, so any replica answers for any placement, also after a restart, and every
    placement is findable (the requestor is opened ``findable``). The cache only ends a
    find early (the nodes have reported every allocation it remembers) and keeps what the
    placing process knew (tiers tried, instances asked for); a find that shows the nodes
    no longer hold exactly it evicts it. The key -> body-hash record is per process, and
    kept for the keys in the cache and in flight: only the process that answered for a
    key can tell that a later body differs (the nodes refuse another *shape* under a key
    from any replica). Only the event loop's thread touches the dictionaries, so there is
    no lock.
    """

    requestor: Requestor
    broker: Broker
    settings: Settings
    explain: bool = True
    metrics: "ServiceMetrics | None" = None
    #: the cache: request id -> the placement this process answered with, not released
    #: and not found gone since, least recently used first
    placements: OrderedDict[str, Placement] = field(default_factory=OrderedDict)
    #: idempotency key -> fingerprint of the body first given with it
    fingerprints: dict[str, str] = field(default_factory=dict)
    #: request id -> its release in progress (a second DELETE joins it)
    freeing: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    closing: bool = False
    #: this replica's recent outcomes, for the dashboard (``GET /v1/activity``)
    activity: Activity = field(default_factory=Activity)
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    _stopping: "asyncio.Task[None] | None" = None
    #: the threads node listings wait on: their own, so that a listing's wait (up to
    #: 30 s) never holds a thread of the loop's default pool, which the other routes use
    _ledger_threads: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            max_workers=LEDGER_GATHERS, thread_name_prefix="reservoir-ledgers"
        )
    )

    @property
    def ready(self) -> bool:
        """Whether requests can be placed: not shutting down, and the broker connected.
        The in-process broker has no connection to lose and is always ready."""
        if self.closing:
            return False
        return self.broker.connected

    def check_ready(self) -> None:
        if self.closing:
            raise Problem(503, "shutting down", "the service is shutting down")
        if not self.ready:
            raise Problem(503, "broker unavailable", "the broker connection is down")

    def claim_key(self, key: str, fingerprint: str) -> None:
        """Remember the body first given with ``key``; a different one is a 422."""
        seen = self.fingerprints.setdefault(key, fingerprint)
        if seen != fingerprint:
            raise Problem(
                422,
                "idempotency key reused",
                f"request id {key!r} was given before with a different body; "
                "use a new Idempotency-Key for a different request",
                request_id=key,
            )

    async def place(
        self, spec: PlacementRequest | CheckedRequest, *, timeout_s: float | None = None
    ) -> Placement:
        """Place ``spec`` and record it, even should the caller go away (the retry with
        the same key then finds it)."""
        try:
            self.check_ready()
        except Problem:
            self.activity.failed(spec.request_id or "", 0.0, "unavailable")
            if self.metrics is not None:
                self.metrics.failures.labels("unavailable").inc()
            raise
        return await self._to_the_end(self._place(spec, timeout_s))

    async def find(self, request_id: str) -> Holdings:
        """What the nodes hold of ``request_id`` (its allocations and its tasks),
        whichever process placed it, once every holder has answered: a 503 problem (with
        Retry-After) when that is not known in time, never a "nothing" it does not know.
        Raises ``InvalidField`` for an id no node would accept."""
        self.check_ready()
        holdings = await self.requestor.holdings_async(request_id)
        if not holdings.settled:
            raise _not_known(holdings)
        cached = self.placements.get(request_id)
        if cached is not None and request_id not in self.freeing:
            found = holdings.placement
            if found is not None and _same_allocations(found, cached):
                self.placements.move_to_end(request_id)
            else:
                # released (or placed again) through another process: what is cached is
                # out of date, and the key free again here
                self._evict(request_id)
        return holdings

    async def release(self, request_id: str) -> None:
        """Free what the nodes hold of ``request_id``, whichever process placed it; 404
        when they hold nothing of it. A release of an id being released joins it."""
        self.check_ready()
        running = self.freeing.get(request_id)
        if running is None:
            # marked before the first await: a POST with this key in between must not
            # find it neither listed nor being freed, and place it again under the release
            running = self._start(self._release(request_id))
            self.freeing[request_id] = running
        await asyncio.shield(running)

    async def nodes(self, wait_s: float, expect_nodes: int | None = None) -> list[NodeSnapshot]:
        """Every live node's ledger, asked for over the broker, gathered for ``wait_s``
        (less once ``expect_nodes`` have answered)."""
        self.check_ready()

        def gather() -> list[NodeSnapshot]:
            collector = LedgerCollector(self.broker, settings=self.settings)
            try:
                collector.ask()
                return collector.collect(wait_s=wait_s, expect_nodes=expect_nodes)
            finally:
                collector.close()

        async def gathered() -> list[NodeSnapshot]:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._ledger_threads, gather)

        # a task of the service's own: the drain on shutdown waits for it too
        return await self._to_the_end(gathered())

    async def drain(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` for the placements and releases in flight; returns how
        many were still running."""
        pending = set(self._tasks)
        if pending:
            _done, pending = await asyncio.wait(pending, timeout=timeout_s)
        return len(pending)

    async def stop(self, drain_timeout_s: float) -> None:
        """Stop placing: from now on every request is a 503; the placements and releases
        in flight get ``drain_timeout_s`` to finish, then the requestor closes, failing
        what is left (a 503 each: their routes answer before the server goes) and
        releasing what it reserved for them. A server calls this as soon as it is told
        to stop, before it gives up on open connections; the lifespan's exit calls it
        too, and a second call joins the first."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop(drain_timeout_s))
        await asyncio.shield(self._stopping)

    async def _stop(self, drain_timeout_s: float) -> None:
        self.closing = True
        left = await self.drain(drain_timeout_s)
        if left:
            log.warning(
                "drain of %.1f s over with %d placement(s) still in flight: failing them",
                drain_timeout_s,
                left,
                extra={"in_flight": left},
            )
        await asyncio.to_thread(self.requestor.close)
        # the failed ones answer (503) now: a moment for their routes to do so
        await self.drain(AFTER_CLOSE_S)
        # a listing still gathering ends within its wait_s (up to 30 s): not waited for
        self._ledger_threads.shutdown(wait=False, cancel_futures=True)

    async def _place(
        self, spec: PlacementRequest | CheckedRequest, timeout_s: float | None
    ) -> Placement:
        metrics = self.metrics
        started = time.monotonic()
        if metrics is not None:
            metrics.in_flight.inc()
        outcome = "placed"
        reason = ""  # for the dashboard: why the nodes would not take it
        request_id = spec.request_id or ""
        try:
            placement = await self.requestor.reserve_async(spec, timeout_s=timeout_s)
        except PlacementTimeout:
            outcome = "timeout"
            raise
        except PlacementError as error:
            # abandoned by the shutdown, not refused by the nodes
            outcome = "unavailable" if self.closing else "not_placed"
            reason = _main_reason(error)
            request_id = error.explanation.request_id
            log.info(
                "not placed: %s",
                error.explanation,
                extra={"request_id": error.explanation.request_id},
            )
            raise
        except (RequestorClosed, BrokerError):
            outcome = "unavailable"
            raise
        except BaseException:
            outcome = "error"
            raise
        finally:
            if outcome != "placed":
                self.activity.failed(request_id, time.monotonic() - started, reason or outcome)
            if metrics is not None:
                metrics.in_flight.dec()
                metrics.placement_seconds.labels(outcome).observe(time.monotonic() - started)
                if outcome != "placed":
                    metrics.failures.labels(outcome).inc()
        self.activity.placed(
            placement.request_id, placement.elapsed_s, placement.nodes, partial=placement.partial
        )
        if metrics is not None:
            metrics.placements.labels(str(placement.partial).lower()).inc()
        log.info(
            "placed %s: %d instance(s) on %s in %.1f ms",
            placement.request_id,
            len(placement.allocations),
            ", ".join(sorted(set(placement.nodes))),
            placement.elapsed_s * 1000,
            extra={"request_id": placement.request_id},
        )
        self.placements[placement.request_id] = placement
        self.placements.move_to_end(placement.request_id)
        while len(self.placements) > CACHE_ENTRIES:
            forgotten, _ = self.placements.popitem(last=False)
            self.fingerprints.pop(forgotten, None)
        self._count_held()
        return placement

    async def _release(self, request_id: str) -> None:
        try:
            cached = self.placements.get(request_id)
            freed: set[str] = set()
            if cached is not None:
                # What this process answered with, freed straight away, no lookup first:
                # done if every holder freed exactly it.
                freed = set(await self.requestor.release_async(cached))
                if freed == {a.allocation_id for a in cached.allocations}:
                    return
            # Not placed here, or not all there any more (released through another
            # replica, or placed again elsewhere): what do the nodes hold?
            holdings = await self.requestor.holdings_async(request_id)
            if not holdings.settled:
                raise _not_known(holdings)
            found = holdings.placement
            if found is None:
                if freed:
                    return  # we freed part of what we placed; nothing else holds it
                ended = " (its tasks ended and freed it)" if holdings.tasks else ""
                raise Problem(404, "no such reservation", f"no node holds {request_id!r}{ended}")
            # FreeIncomplete: the requestor goes on freeing there; a retried DELETE frees
            # what the nodes still show
            await self.requestor.release_async(found)
        finally:
            # the key is free again: a new body under it is a new request
            self._evict(request_id)
            self.freeing.pop(request_id, None)

    def _evict(self, request_id: str) -> None:
        """Forget ``request_id`` here (the cache, its key's body, the requestor's memory):
        the nodes no longer hold what was answered for it."""
        self.placements.pop(request_id, None)
        self.fingerprints.pop(request_id, None)
        self.requestor.forget(request_id)
        self._count_held()

    def _count_held(self) -> None:
        if self.metrics is not None:
            self.metrics.held.set(len(self.placements))

    def _start(self, work: Coroutine[Any, Any, T]) -> "asyncio.Task[T]":
        """``work`` in a task of its own, which the drain on shutdown waits for."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._finished)
        return task

    async def _to_the_end(self, work: Coroutine[Any, Any, T]) -> T:
        """Await ``work`` in a task of its own that a cancelled caller does not cancel.
        (Shielding also keeps a cancelled await from cancelling the requestor's future,
        which other waiters on the same id share.)"""
        return await asyncio.shield(self._start(work))

    def _finished(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: nobody may be left to await it


def _main_reason(error: PlacementError) -> str:
    """A refusal's reason for the dashboard: what most nodes said, else the note."""
    explanation = error.explanation
    if explanation.reasons:
        label, _count = min(explanation.reasons.items(), key=lambda item: (-item[1], item[0]))
        return f"not placed: {label}"
    return f"not placed: {explanation.note}" if explanation.note else "not_placed"


def _not_known(holdings: Holdings) -> Problem:
    """The 503 of a find the nodes did not settle in time: not a "not found"."""
    why = (
        f"it is being placed by {holdings.placing}"
        if holdings.placing is not None
        else "not every node holding it answered in time"
    )
    return Problem(
        503,
        "not known yet",
        f"what the nodes hold of {holdings.request_id!r} is not known yet: {why}; ask again",
        request_id=holdings.request_id,
    )


def _same_allocations(one: Placement, other: Placement) -> bool:
    return {(a.node, a.allocation_id) for a in one.allocations} == {
        (a.node, a.allocation_id) for a in other.allocations
    }
