"""The utilisation tier ladder and its topics.

A request is first broadcast to the nodes that are nearly empty, then to ever fuller ones.
Tiers are cumulative: a node at 7 % hears ``tier.10``, ``tier.25`` and every wider tier; a
node at 60 % hears only ``tier.75`` and ``tier.100``. So the first tier's topic reaches the
emptiest nodes and the last one reaches every node.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

__all__ = ["DEFAULT_LADDER", "DEFAULT_TIERS", "TOPIC_PREFIX", "TierLadder"]

DEFAULT_TIERS: Final = (10, 25, 50, 75, 100)
TOPIC_PREFIX: Final = "tier"


@dataclass(frozen=True)
class TierLadder:
    """Ascending utilisation percentages; the last must be 100 so every node hears it."""

    percents: tuple[int, ...] = DEFAULT_TIERS
    _topics_from: tuple[frozenset[str], ...] = field(init=False, repr=False, compare=False)
    _index_of_percent: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.percents:
            raise ValueError("the tier ladder needs at least one tier")
        if list(self.percents) != sorted(set(self.percents)):
            raise ValueError(f"tiers must be strictly ascending, got {self.percents}")
        if self.percents[0] < 1 or self.percents[-1] != 100:
            raise ValueError(f"tiers must lie in 1..100 and end at 100, got {self.percents}")
        # A node asks for its topics after every change: work them out once.
        topics = tuple(
            frozenset(self.topic(p) for p in self.percents[index:])
            for index in range(len(self.percents))
        )
        object.__setattr__(self, "_topics_from", topics)
        # Requestors place every node status they hear by its tier percentage (1..100).
        indexes = tuple(self.first_index_for(p / 100) for p in range(101))
        object.__setattr__(self, "_index_of_percent", indexes)

    @classmethod
    def of(cls, percents: Iterable[int]) -> TierLadder:
        return cls(tuple(percents))

    def __len__(self) -> int:
        return len(self.percents)

    @staticmethod
    def topic(percent: int) -> str:
        return f"{TOPIC_PREFIX}.{percent}"

    def first_index_for(self, utilisation: float) -> int:
        """Index of the narrowest tier a node at ``utilisation`` (0..1) belongs to.

        A node at exactly 10 % still counts as "at or below 10 %". A node past 100 % (an
        inventory shrunk under existing allocations) stays in the last tier so that it
        can still be found, e.g. to free allocations.
        """
        percent = utilisation * 100.0
        for index, bound in enumerate(self.percents):
            # A small epsilon keeps float noise (0.1 + 0.2) from pushing a node up a tier.
            if percent <= bound + 1e-9:
                return index
        return len(self.percents) - 1

    def index_of_percent(self, percent: int) -> int:
        """:meth:`first_index_for` of a whole percentage, as a node's status tells it."""
        if 0 <= percent <= 100:
            return self._index_of_percent[percent]
        return self.first_index_for(percent / 100)

    def topics_for(self, utilisation: float) -> frozenset[str]:
        """Every tier topic a node at ``utilisation`` listens to (cumulative)."""
        return self._topics_from[self.first_index_for(utilisation)]

    def tier_for(self, utilisation: float) -> int:
        """The narrowest tier, as a percentage, that a node at ``utilisation`` belongs to."""
        return self.percents[self.first_index_for(utilisation)]


#: the default ladder, shared: it is frozen, and building one works out every topic set
#: and every percentage's tier (a simulation of 100,000 nodes built 100,000 of them)
DEFAULT_LADDER: Final = TierLadder()
