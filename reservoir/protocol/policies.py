"""Placement policies: how a requestor picks winners among the offers it holds.

A policy sees every usable offer as a :class:`Candidate` and returns how many instances to
award to which; it never sees a node the offers did not come from. Node weighers already
scored each offer, and every policy ranks by that score first, so an operator's node-side
preference (soft affinity, say) wins over the policy's tie-breaking.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = ["POLICIES", "Candidate", "LeastUtilised", "Pack", "Policy", "Spread", "policy_named"]


@dataclass(frozen=True)
class Candidate:
    """One offer as a policy sees it."""

    reservation_id: str
    node: str
    slots: int
    utilisation: float
    score: float


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Candidate], needed: int) -> list[tuple[Candidate, int]]:
        """Pick up to ``needed`` instances' worth of slots: (candidate, slots) pairs, each
        candidate at most once and never with more slots than it offered."""
        ...


class Spread:
    """Least-utilised nodes first, one instance per node per round, so a multi-instance
    request lands on as many nodes as it can."""

    name = "spread"

    def choose(self, candidates: Sequence[Candidate], needed: int) -> list[tuple[Candidate, int]]:
        ranked = sorted(candidates, key=lambda c: (-c.score, c.utilisation, c.node))
        taken = {c.reservation_id: 0 for c in ranked}
        remaining = needed
        while remaining > 0:
            progressed = False
            for candidate in ranked:
                if remaining == 0:
                    break
                if taken[candidate.reservation_id] < candidate.slots:
                    taken[candidate.reservation_id] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:
                break
        return [(c, taken[c.reservation_id]) for c in ranked if taken[c.reservation_id]]


class Pack:
    """Fullest nodes first, each filled as far as it offered, keeping empty nodes empty."""

    name = "pack"

    def choose(self, candidates: Sequence[Candidate], needed: int) -> list[tuple[Candidate, int]]:
        ranked = sorted(candidates, key=lambda c: (-c.score, -c.utilisation, -c.slots, c.node))
        chosen: list[tuple[Candidate, int]] = []
        remaining = needed
        for candidate in ranked:
            if remaining == 0:
                break
            slots = min(candidate.slots, remaining)
            chosen.append((candidate, slots))
            remaining -= slots
        return chosen


class LeastUtilised(Spread):
    """Like spread, but puts every instance on the single least-utilised node that can
    take them all, when one can."""

    name = "least-utilised"

    def choose(self, candidates: Sequence[Candidate], needed: int) -> list[tuple[Candidate, int]]:
        whole = [c for c in candidates if c.slots >= needed]
        if whole:
            best = min(whole, key=lambda c: (-c.score, c.utilisation, c.node))
            return [(best, needed)]
        return super().choose(candidates, needed)


POLICIES: dict[str, Policy] = {p.name: p for p in (Spread(), Pack(), LeastUtilised())}


def policy_named(name: str) -> Policy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(
            f"unknown placement policy {name!r}; choose one of {', '.join(sorted(POLICIES))}"
        ) from None
