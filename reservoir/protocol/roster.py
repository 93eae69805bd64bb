"""A requestor's roster: its soft view of which nodes exist and which tier each is in.

Nodes announce their tier (:class:`~reservoir.protocol.messages.NodeStatus`) when they
start, when they move to another tier and when they stop; a requestor that starts asks
them all once (``RollCall``). From the roster a requestor samples the few nodes it probes
for a request, emptiest tiers first. The roster is only a hint: the node still decides
from its exact state, so a stale entry costs one wasted probe, never a wrong placement.
An entry leaves the roster when its node says it is leaving or when a probe to its
address comes back unroutable (its inbox is gone).

Sampling is uniform within a tier and draws from :class:`Sampler`, a small seeded
generator of the roster's own (the protocol core reads no clock and no entropy), so a run
on a fixed seed is reproducible. Every operation is O(1) or O(sample size), whatever the
number of nodes: members of a tier sit in a list, and removal swaps the last one in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final, TypeVar

from reservoir.protocol.tiers import TierLadder

__all__ = ["Member", "Roster", "Sampler"]

_T = TypeVar("_T")
_MASK64: Final = (1 << 64) - 1


class Sampler:
    """SplitMix64 (Steele, Lea and Flood, 2014): a tiny, fast, seeded 64-bit generator.
    Good enough to spread probes uniformly; not for anything secret."""

    def __init__(self, seed: int | str) -> None:
        digest = hashlib.blake2b(str(seed).encode(), digest_size=8).digest()
        self._state = int.from_bytes(digest, "big")

    def next64(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & _MASK64
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        return z ^ (z >> 31)

    def below(self, bound: int) -> int:
        """A number in ``0..bound-1`` (the modulo bias of 64 bits is negligible here)."""
        return self.next64() % bound

    def positions(self, population: int, count: int) -> list[int]:
        """``count`` distinct positions in ``0..population-1`` in O(count) (Floyd)."""
        chosen: dict[int, None] = {}
        for top in range(population - count, population):
            pick = self.below(top + 1)
            chosen[top if pick in chosen else pick] = None
        picked = list(chosen)
        self.shuffle(picked)  # Floyd's picks a uniform set, not a uniform order
        return picked

    def shuffle(self, items: list[_T]) -> None:
        for index in range(len(items) - 1, 0, -1):
            other = self.below(index + 1)
            items[index], items[other] = items[other], items[index]


@dataclass(frozen=True, slots=True)
class Member:
    """A node as the roster knows it."""

    name: str
    address: str
    tier_index: int


class Roster:
    """Nodes by tier, for sampling. Not thread-safe: its requestor machine owns it."""

    def __init__(self, tiers: TierLadder, rng: Sampler) -> None:
        self._tiers = tiers
        self._rng = rng
        self._by_tier: list[list[Member]] = [[] for _ in tiers.percents]
        #: name -> (member, position in its tier's list)
        self._where: dict[str, tuple[Member, int]] = {}
        self._by_address: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def tier_sizes(self) -> tuple[int, ...]:
        return tuple(len(members) for members in self._by_tier)

    def member(self, name: str) -> Member | None:
        found = self._where.get(name)
        return found[0] if found else None

    def update(self, name: str, address: str, tier_percent: int) -> None:
        """Record ``name`` at ``tier_percent`` (a node's narrowest tier)."""
        # The ladder owns the rule for where a percentage falls.
        index = self._tiers.first_index_for(tier_percent / 100)
        current = self._where.get(name)
        if current is not None:
            member = current[0]
            if member.tier_index == index and member.address == address:
                return
            self.remove(name)
        member = Member(name, address, index)
        members = self._by_tier[index]
        self._where[name] = (member, len(members))
        members.append(member)
        self._by_address[address] = name

    def remove(self, name: str) -> bool:
        current = self._where.pop(name, None)
        if current is None:
            return False
        member, position = current
        members = self._by_tier[member.tier_index]
        last = members.pop()
        if last.name != name:
            members[position] = last
            self._where[last.name] = (last, position)
        if self._by_address.get(member.address) == name:
            del self._by_address[member.address]
        return True

    def remove_address(self, address: str) -> bool:
        """Forget the node whose inbox is ``address`` (a probe to it reached nobody)."""
        name = self._by_address.get(address)
        return name is not None and self.remove(name)

    def sample(
        self, wanted: int, *, up_to_tier_index: int, exclude: Collection[str] = ()
    ) -> list[Member]:
        """Up to ``wanted`` distinct members in tiers ``0..up_to_tier_index``, none of them
        in ``exclude``: as many as possible from the emptiest tier, then the next."""
        chosen: list[Member] = []
        for index in range(min(up_to_tier_index, len(self._by_tier) - 1) + 1):
            members = self._by_tier[index]
            missing = wanted - len(chosen)
            if missing <= 0:
                break
            if not members:
                continue
            if len(members) <= missing + len(exclude):
                pool = [m for m in members if m.name not in exclude]
                self._rng.shuffle(pool)
                chosen.extend(pool[:missing])
                continue
            # Draw a few more than needed so that excluded members can be skipped
            # without a scan of the whole tier.
            draw = min(len(members), missing + len(exclude))
            for position in self._rng.positions(len(members), draw):
                member = members[position]
                if member.name not in exclude:
                    chosen.append(member)
                    if len(chosen) == wanted:
                        break
        return chosen
