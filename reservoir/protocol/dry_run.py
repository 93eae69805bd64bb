"""The node's answer to a dry run: what it would make of a request, holding nothing.

A dry run is a :class:`~reservoir.protocol.messages.ReservationRequest` with ``dry_run``
set, published on the widest tier's topic so that every serving node hears it. Each node
runs its filters and weighers exactly as for a real request and answers with an
:class:`~reservoir.protocol.messages.Assessment` (how many instances it could take now, its
score, and, when the request asks to explain, why not), reserving nothing: its ledger is
the same after the answer as before. Pure, like the rest of the protocol.
"""

from __future__ import annotations

from collections.abc import Sequence

from reservoir.protocol.filters import Filter, NodeView, Weigher, evaluate
from reservoir.protocol.messages import Assessment, ReservationRequest

__all__ = ["assess"]


def assess(
    request: ReservationRequest,
    view: NodeView,
    filters: Sequence[Filter],
    weighers: Sequence[Weigher],
    *,
    address: str,
    tier: int,
) -> Assessment:
    """What this node would answer ``request`` with, as an assessment for its sender."""
    evaluation = evaluate(request, view, filters, weighers)
    return Assessment(
        request_id=request.request_id,
        sender=view.name,
        reply_to=address,
        slots=max(evaluation.slots, 0),
        utilisation=view.ledger.utilisation(),
        score=evaluation.score,
        tier=tier,
        busy=evaluation.busy,
        reasons=evaluation.reasons,
    )
