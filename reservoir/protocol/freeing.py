"""Freeing: the requestor's machine for ``Free`` messages, re-sent until nodes confirm.

A placement is freed when its instances are deleted (a caller waits: ``notify``), and a
requestor tidies up after itself too, with nobody waiting: a failed all-or-nothing request,
an award it gave up on, a surplus acceptance. Each is a :class:`FreeJob` of ``Free``
messages, one per node, re-sent until the node answers ``Freed``: every ``retry_s`` for
the first ``attempts`` tries, then (tidying) twice as long each time, up to
``max_retry_s``:

    free(targets)      -> Free to each new target; a retry timer (the first time)
    Freed from a target-> it is done; the last one done -> FreeCompleted (notify) and the
                          timer is cancelled
    retry timer        -> Free again to every target still pending; at ``attempts``:
                          FreeCompleted listing the nodes that never answered (notify),
                          whose frees then go on as tidying; a Dropped note (tidying, once)

Tidying never gives up while the requestor runs: an allocation nobody frees is capacity
lost on its node for good (nodes expire reservations, never allocations), and a node that
did not answer is usually only unreachable for a while (its inbox comes back with it, its
ledger is durable). Giving up after five seconds left allocations behind after longer
outages. The cost of a node that never comes back is one ``Free`` every ``max_retry_s``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from reservoir.protocol.effects import CancelTimer, Dropped, Effect, FreeCompleted, Send, SetTimer
from reservoir.protocol.messages import Free, Freed
from reservoir.protocol.timers import FreeTimer

__all__ = ["FreeJob", "FreeTarget", "Freeing"]


@dataclass(frozen=True)
class FreeTarget:
    """One ``Free`` to one node: named allocations, one reservation's worth, or (neither
    given) everything the request holds there."""

    address: str
    node: str
    allocation_ids: tuple[str, ...] = ()
    reservation_id: str | None = None


@dataclass
class FreeJob:
    """Frees of one request, re-sent until each node confirms."""

    request_id: str
    notify: bool
    pending: set[FreeTarget] = field(default_factory=set)
    freed: list[str] = field(default_factory=list)
    attempts: int = 0


class Freeing:
    """Every free job of one requestor. Not thread-safe: its requestor machine owns it."""

    def __init__(
        self,
        *,
        sender: str,
        reply_to: str,
        retry_s: float,
        attempts: int,
        max_retry_s: float = 30.0,
    ) -> None:
        self._sender = sender
        self._reply_to = reply_to
        self._retry_s = retry_s
        self._attempts = attempts
        self._max_retry_s = max(max_retry_s, retry_s)
        #: (request id, notify) -> the frees of that request awaiting confirmation
        self._jobs: dict[tuple[str, bool], FreeJob] = {}

    def for_caller(self, request_id: str) -> bool:
        """Whether a caller is waiting for ``request_id`` to be freed."""
        return (request_id, True) in self._jobs

    def stop_tidying(self, request_id: str, effects: list[Effect]) -> None:
        """Stop tidying up after an earlier attempt of ``request_id``: it is being placed
        again, and whatever it left behind will be adopted (nodes say AlreadyPlaced)."""
        if self._jobs.pop((request_id, False), None) is not None:
            effects.append(CancelTimer(FreeTimer(request_id, False)))

    def free(
        self,
        request_id: str,
        targets: Iterable[FreeTarget],
        now: float,
        effects: list[Effect],
        *,
        notify: bool = False,
    ) -> None:
        """Send each target its Free and keep re-sending until the node confirms."""
        job = self._jobs.setdefault((request_id, notify), FreeJob(request_id, notify))
        new = [t for t in targets if t not in job.pending]
        job.pending.update(new)
        effects.extend(self._message(request_id, t) for t in new)
        if job.attempts == 0:
            job.attempts = 1
            effects.append(SetTimer(FreeTimer(request_id, notify), now + self._retry_s))

    def on_timer(self, key: FreeTimer, now: float, effects: list[Effect]) -> None:
        job = self._jobs.get((key.request_id, key.notify))
        if job is None:
            return
        if job.attempts == self._attempts:
            missing = tuple(sorted({t.node for t in job.pending}))
            if job.notify:
                # The caller hears which nodes did not confirm; their frees go on without
                # it, as tidying.
                del self._jobs[(job.request_id, job.notify)]
                effects.append(FreeCompleted(job.request_id, tuple(job.freed), missing))
                self.free(job.request_id, job.pending, now, effects)
                return
            effects.append(
                Dropped(
                    "free_unconfirmed",
                    f"{job.request_id} on {', '.join(missing)}: still trying, less often",
                )
            )
        job.attempts += 1
        effects.extend(
            self._message(job.request_id, t) for t in sorted(job.pending, key=lambda t: t.address)
        )
        effects.append(SetTimer(key, now + self._retry_delay_s(job.attempts)))

    def _retry_delay_s(self, attempts: int) -> float:
        """``retry_s`` for the first ``attempts`` tries, then doubling, up to the cap."""
        beyond = attempts - self._attempts
        if beyond <= 0:
            return self._retry_s
        return min(self._retry_s * 2.0 ** min(beyond, 32), self._max_retry_s)

    def on_freed(self, freed: Freed, effects: list[Effect]) -> None:
        target_key = (freed.allocation_ids, freed.reservation_id)
        for notify in (True, False):
            job = self._jobs.get((freed.request_id, notify))
            if job is None:
                continue
            target = next(
                (
                    t
                    for t in job.pending
                    if t.address == freed.reply_to
                    and (t.allocation_ids, t.reservation_id) == target_key
                ),
                None,
            )
            if target is None:
                continue
            job.pending.discard(target)
            job.freed.extend(freed.freed)
            if not job.pending:
                del self._jobs[(freed.request_id, notify)]
                effects.append(CancelTimer(FreeTimer(freed.request_id, notify)))
                if notify:
                    effects.append(FreeCompleted(freed.request_id, tuple(job.freed), ()))
            return
        effects.append(Dropped("late_freed", f"{freed.request_id} from {freed.sender}"))

    def _message(self, request_id: str, target: FreeTarget) -> Send:
        return Send(
            target.address,
            Free(
                request_id=request_id,
                sender=self._sender,
                reply_to=self._reply_to,
                allocation_ids=target.allocation_ids,
                reservation_id=target.reservation_id,
            ),
        )
