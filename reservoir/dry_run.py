"""``reservoir request --dry-run``: which nodes would take a request, and why the others
would not, holding nothing.

:class:`DryRun` is an endpoint of its own (named like a requestor's inbox, so it runs with
requestor credentials) that publishes the request once, with ``dry_run`` set, on the
widest tier's topic, and gathers the nodes' :class:`~reservoir.protocol.messages.Assessment`
answers. Nodes evaluate it with the same filters and weighers as a real request and
reserve nothing (see :mod:`reservoir.protocol.dry_run`), so a dry run leaves every ledger
as it found it. It costs one message per serving node: an operator's question, not a way
to place.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass

from reservoir.broker import Broker
from reservoir.clock import Scheduler
from reservoir.driver import Driver
from reservoir.protocol.effects import Dropped, Effect, Publish
from reservoir.protocol.messages import Assessment, Message, ReservationRequest
from reservoir.protocol.placement import PlacementRequest, reason_label
from reservoir.settings import Settings

__all__ = ["DryRun", "DryRunReport", "NodeAnswer"]


@dataclass(frozen=True)
class NodeAnswer:
    """One node's assessment: how many instances it could take now, and why not."""

    node: str
    slots: int
    utilisation: float
    score: float
    tier: int
    busy: bool
    #: short phrases, e.g. ``VCPU exhausted (short by 2)``
    reasons: tuple[str, ...]

    @classmethod
    def of(cls, answer: Assessment) -> NodeAnswer:
        reasons = tuple(
            reason_label(r) + (f" (short by {r.shortfall})" if r.shortfall else "")
            for r in answer.reasons
        )
        return cls(
            node=answer.sender,
            slots=answer.slots,
            utilisation=answer.utilisation,
            score=answer.score,
            tier=answer.tier,
            busy=answer.busy,
            reasons=reasons,
        )

    def as_json(self) -> dict[str, object]:
        return {
            "node": self.node,
            "slots": self.slots,
            "utilisation": round(self.utilisation, 4),
            "score": round(self.score, 4),
            "tier": self.tier,
            "busy": self.busy,
            "reasons": list(self.reasons),
        }


@dataclass(frozen=True)
class DryRunReport:
    """What the nodes that answered would make of a request."""

    request_id: str
    #: instances that would satisfy the request (``min_count``, else ``count``)
    wanted: int
    #: every answer, nodes that could take some first (most room, then best score)
    answers: tuple[NodeAnswer, ...]
    #: the broker said no node listens at all
    nobody: bool = False

    @property
    def takers(self) -> tuple[NodeAnswer, ...]:
        return tuple(a for a in self.answers if a.slots > 0)

    @property
    def room(self) -> int:
        """Instances the nodes could take between them, now (an upper bound: a real
        placement races other requests for the same room)."""
        return sum(a.slots for a in self.answers)

    @property
    def would_place(self) -> bool:
        return self.room >= self.wanted

    def as_json(self) -> dict[str, object]:
        return {
            "dry_run": True,
            "request_id": self.request_id,
            "wanted": self.wanted,
            "room": self.room,
            "would_place": self.would_place,
            "nodes_answering": len(self.answers),
            "nodes": [a.as_json() for a in self.answers],
        }


class DryRun(Driver):
    """Asks every serving node once what it would make of ``spec``; gathers the answers
    until :meth:`close`."""

    def __init__(
        self,
        spec: PlacementRequest,
        broker: Broker | str | None = None,
        *,
        settings: Settings | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        settings = settings if settings is not None else Settings()
        self.spec = spec
        self.request_id = spec.request_id or f"dry-run-{secrets.token_hex(8)}"
        self._answers: dict[str, Assessment] = {}
        self._nobody = False
        self._changed = threading.Condition()
        name = f"dry-run-{secrets.token_hex(4)}"
        super().__init__(
            broker=broker,
            settings=settings,
            scheduler=scheduler,
            metrics=None,
            endpoint_name=f"reservoir.requestor.{name}",
            role="requestor",
        )

    def ask(self) -> None:
        """Publish the request, marked a dry run, to every node that serves."""
        ladder = self.settings.ladder
        widest = ladder.percents[-1]
        # a dry run is asked to say why not: that is the point of it
        shape = {**self.spec.shape_fields(), "explain": True}
        request = ReservationRequest(
            request_id=self.request_id,
            sender=self.address,
            reply_to=self.address,
            tier=widest,
            attempt=1,
            ttl_s=self.settings.ttl_s,
            dry_run=True,
            **shape,
        )
        self._run(lambda now: [Publish(ladder.topic(widest), request)])

    def collect(self, *, wait_s: float, expect_nodes: int | None = None) -> DryRunReport:
        """Wait up to ``wait_s`` for answers (less once ``expect_nodes`` have answered, or
        when the broker says no node listens) and report them."""
        deadline = time.monotonic() + wait_s
        with self._changed:
            while not self._nobody:
                if expect_nodes is not None and len(self._answers) >= expect_nodes:
                    break
                left_s = deadline - time.monotonic()
                if left_s <= 0:
                    break
                self._changed.wait(left_s)
        return self.report()

    def report(self) -> DryRunReport:
        """The answers so far."""
        with self._changed:
            answers = [NodeAnswer.of(a) for a in self._answers.values()]
            nobody = self._nobody
        answers.sort(key=lambda a: (-a.slots, -a.score, a.node))
        return DryRunReport(
            request_id=self.request_id,
            wanted=self.spec.wanted_slots,
            answers=tuple(answers),
            nobody=nobody,
        )

    def close(self) -> None:
        if self._closed:
            return
        with self._lock:
            self._closed = True
            self._cancel_all_timers()
        self._let_go()

    def __enter__(self) -> DryRun:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- driver hooks ------------------------------------------------------------------

    def _handle_message(self, message: Message, now: float) -> list[Effect]:
        if not isinstance(message, Assessment) or message.request_id != self.request_id:
            return [Dropped("unexpected", f"a dry run does not take this {message.kind!r}")]
        with self._changed:
            self._answers[message.sender] = message
            self._changed.notify_all()
        return []

    def _handle_returned(self, message: Message, now: float) -> list[Effect]:
        with self._changed:
            self._nobody = True
            self._changed.notify_all()
        return []

    def _handle_timer(self, key: Hashable, now: float) -> list[Effect]:
        return []
