"""A requestor's roster: its soft view of which nodes exist and which tier each is in.

Nodes announce their tier (:class:`~reservoir.protocol.messages.NodeStatus`) when they
start, when they move to another tier and when they stop; a requestor that starts asks
them all once (``RollCall``). From the roster a requestor samples the few nodes it probes
for a request, emptiest tiers first. The roster is only a hint: the node still decides
from its exact state, so a stale entry costs one wasted probe, never a wrong placement.
An entry leaves the roster when its node says it is leaving or when a probe to its
address comes back unroutable (its inbox is gone).

Each entry also keeps the node's room (:mod:`reservoir.protocol.room`), told on its
announcements and on every answer it sends; a request samples only nodes whose room may
take one of its instances. Sampling is uniform among those and draws from
:class:`Sampler`, a small seeded generator of the roster's own (the protocol core reads no
clock and no entropy), so a run on a fixed seed is reproducible. Every operation is O(1),
O(sample size) or O(rooms in a tier), whatever the number of nodes: members of a tier sit
in one list per room, and removal swaps the last one in.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from collections.abc import Collection, Mapping
from typing import Final, NamedTuple, Protocol, TypeVar

from reservoir.protocol.room import RoomKey, may_fit, room_key
from reservoir.protocol.tiers import TierLadder

__all__ = ["HasRoom", "Member", "Roster", "Sampler"]

_T = TypeVar("_T")
_MASK64: Final = (1 << 64) - 1
#: how many (room, shape) verdicts a roster keeps before it starts afresh
_FITS_KEPT: Final = 4096


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


class HasRoom(Protocol):
    """An answer from a node, as far as the roster reads it: the room it told of."""

    @property
    def room(self) -> Mapping[str, int]: ...


class Member(NamedTuple):
    """A node as the roster knows it (a named tuple: a roster makes one for every status
    that moves a node, several per placement, and a frozen dataclass costs 3x to build)."""

    name: str
    address: str
    tier_index: int
    #: its room (:mod:`reservoir.protocol.room`), as a hashable key; () when unknown
    room: RoomKey = ()


class Roster:
    """Nodes by tier and, inside a tier, by room, for sampling. Not thread-safe: its
    requestor machine owns it.

    A tier's members sit in one list per room they last told of. The rooms seen in a tier
    are few (a class per power of two of each resource, whatever the number of nodes), so
    sampling for a shape looks at every room of a tier, keeps those where the shape may
    fit, and draws uniformly from their members: O(rooms + sample size)."""

    def __init__(self, tiers: TierLadder, rng: Sampler) -> None:
        self._tiers = tiers
        self._rng = rng
        self._by_tier: list[dict[RoomKey, list[Member]]] = [{} for _ in tiers.percents]
        #: name -> (member, position in its tier's list for its room)
        self._where: dict[str, tuple[Member, int]] = {}
        self._by_address: dict[str, str] = {}
        #: (room, one instance's needs) -> may it fit: rooms and shapes are few, and every
        #: sample asked it of every room of every tier
        self._fits: dict[tuple[RoomKey, tuple[tuple[str, int], ...]], bool] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def tier_sizes(self) -> tuple[int, ...]:
        return tuple(sum(map(len, rooms.values())) for rooms in self._by_tier)

    def member(self, name: str) -> Member | None:
        found = self._where.get(name)
        return found[0] if found else None

    def update(
        self, name: str, address: str, tier_percent: int, room: Mapping[str, int] | None = None
    ) -> None:
        """Record ``name`` at ``tier_percent`` (a node's narrowest tier) with ``room``
        (None or empty: the room it told of before, if any)."""
        # The ladder owns the rule for where a percentage falls.
        index = self._tiers.index_of_percent(tier_percent)
        current = self._where.get(name)
        key = room_key(room) if room else (current[0].room if current else ())
        if current is not None:
            member = current[0]
            if member.tier_index == index and member.address == address:
                if member.room != key:
                    self._move(current, key)
                return
            self.remove(name)
        self._add(Member(name, address, index, key))

    def note_room(self, name: str, room: Mapping[str, int]) -> None:
        """A known node told of its room (on an answer): move it to that room's list."""
        current = self._where.get(name)
        if current is None or not room:
            return
        key = room_key(room)
        if current[0].room != key:
            self._move(current, key)

    def _move(self, current: tuple[Member, int], room: RoomKey) -> None:
        """Move a member to another room's list of its tier (the news of most statuses and
        answers: the node and its tier stay, its room changed)."""
        self._unlist(*current)
        self._add(current[0]._replace(room=room))

    def _add(self, member: Member) -> None:
        members = self._by_tier[member.tier_index].setdefault(member.room, [])
        self._where[member.name] = (member, len(members))
        members.append(member)
        self._by_address[member.address] = member.name

    def _unlist(self, member: Member, position: int) -> None:
        """Take ``member`` out of its (tier, room) list: the last one takes its place."""
        rooms = self._by_tier[member.tier_index]
        members = rooms[member.room]
        last = members.pop()
        if last.name != member.name:
            members[position] = last
            self._where[last.name] = (last, position)
        if not members:
            del rooms[member.room]

    def remove(self, name: str) -> bool:
        current = self._where.pop(name, None)
        if current is None:
            return False
        member = current[0]
        self._unlist(*current)
        if self._by_address.get(member.address) == name:
            del self._by_address[member.address]
        return True

    def remove_address(self, address: str) -> bool:
        """Forget the node whose inbox is ``address`` (a probe to it reached nobody)."""
        name = self._by_address.get(address)
        return name is not None and self.remove(name)

    def sample(
        self,
        wanted: int,
        *,
        up_to_tier_index: int,
        exclude: Collection[str] = (),
        needs: Mapping[str, int] | None = None,
    ) -> list[Member]:
        """Up to ``wanted`` distinct members in tiers ``0..up_to_tier_index``, none of them
        in ``exclude`` and, given ``needs`` (one instance's resources), none whose room
        rules it out: as many as possible from the emptiest tier, then the next."""
        chosen: list[Member] = []
        shape = None if needs is None else tuple(needs.items())
        for index in range(min(up_to_tier_index, len(self._by_tier) - 1) + 1):
            missing = wanted - len(chosen)
            if missing <= 0:
                break
            rooms = self._by_tier[index]
            if not rooms:
                continue
            if shape is None:
                groups = list(rooms.values())
            else:
                groups = [members for room, members in rooms.items() if self._may_fit(room, shape)]
            population = sum(map(len, groups))
            if not population:
                continue
            if population <= missing + len(exclude):
                pool = [m for members in groups for m in members if m.name not in exclude]
                self._rng.shuffle(pool)
                chosen.extend(pool[:missing])
                continue
            # Draw a few more than needed so that excluded members can be skipped
            # without a scan of the whole tier.
            starts = list(itertools.accumulate((len(members) for members in groups), initial=0))
            draw = min(population, missing + len(exclude))
            for position in self._rng.positions(population, draw):
                group = bisect.bisect_right(starts, position) - 1
                member = groups[group][position - starts[group]]
                if member.name not in exclude:
                    chosen.append(member)
                    if len(chosen) == wanted:
                        break
        return chosen

    def roomier_since(
        self, answers: Mapping[str, HasRoom], needs: Mapping[str, int]
    ) -> list[Member]:
        """The members among ``answers`` (name -> the answer each gave, with the room it
        told of then) whose room has changed since, to one where ``needs`` (one instance)
        may fit. O(answers): it runs once before a request fails, after the exhaustive step
        that every node answered."""
        shape = tuple(needs.items())
        where = self._where
        roomier = []
        for name, answer in answers.items():
            found = where.get(name)
            if found is None or not answer.room:
                continue
            member = found[0]
            if member.room != room_key(answer.room) and self._may_fit(member.room, shape):
                roomier.append(member)
        return roomier

    def _may_fit(self, room: RoomKey, shape: tuple[tuple[str, int], ...]) -> bool:
        fits = self._fits.get((room, shape))
        if fits is None:
            if len(self._fits) >= _FITS_KEPT:
                self._fits.clear()  # shapes are the callers' to choose: keep it bounded
            fits = self._fits[room, shape] = may_fit(dict(room), dict(shape))
        return fits
