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
from dataclasses import dataclass

from reservoir.broker import Broker
from reservoir.brokers import BrokerUrl
from reservoir.clock import Scheduler
from reservoir.protocol.messages import Assessment, Message, ReservationRequest
from reservoir.protocol.placement import PlacementRequest, checked_request, reason_label
from reservoir.runtime.asking import AskEveryNode
from reservoir.runtime.settings import Settings

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
            "name": self.node,
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


class DryRun(AskEveryNode):
    """Asks every serving node once what it would make of ``spec``; gathers the answers
    until :meth:`close`."""

    asker = "a dry run"

    def __init__(
        self,
        spec: PlacementRequest,
        broker: Broker | BrokerUrl | str | None = None,
        *,
        settings: Settings | None = None,
        scheduler: Scheduler | None = None,
    ) -> None:
        self.spec = checked_request(spec)
        self.request_id = self.spec.request_id or f"dry-run-{secrets.token_hex(8)}"
        self._answers: dict[str, Assessment] = {}
        super().__init__(
            broker,
            name=f"dry-run-{secrets.token_hex(4)}",
            settings=settings,
            scheduler=scheduler,
        )

    def collect(self, *, wait_s: float, expect_nodes: int | None = None) -> DryRunReport:
        """Wait up to ``wait_s`` for answers (less once ``expect_nodes`` have answered, or
        when the broker says no node listens) and report them."""
        self.wait_for_answers(wait_s=wait_s, expect_nodes=expect_nodes)
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

    def __enter__(self) -> DryRun:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- what is asked, what is taken ----------------------------------------------------

    def _question(self, widest_tier: int) -> Message:
        # a dry run is asked to say why not: that is the point of it
        shape = {**self.spec.shape_fields(), "explain": True}
        return ReservationRequest(
            request_id=self.request_id,
            sender=self.address,
            reply_to=self.address,
            tier=widest_tier,
            attempt=1,
            ttl_s=self.settings.ttl_s,
            dry_run=True,
            **shape,
        )

    def _take(self, message: Message) -> bool:
        if not isinstance(message, Assessment) or message.request_id != self.request_id:
            return False
        self._answers[message.sender] = message
        return True

    def _nodes_answered(self) -> int:
        return len(self._answers)
