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

from reservoir.protocol.messages import NO_FEATURES
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
    """A node as the roster knows it, as the roster hands it out (a snapshot: the roster
    keeps its own entries, :class:`_Entry`, and moves them in place)."""

    name: str
    address: str
    tier_index: int
    #: its room (:mod:`reservoir.protocol.room`), as a hashable key; () when unknown
    room: RoomKey = ()
    #: its release and the features it knows, as its status said them (empty: not said)
    release: str = ""
    features: frozenset[str] = NO_FEATURES


class _Entry:
    """A node in the roster's lists: changed in place when the node moves.

    At 100,000 nodes a roster's entries are spread over gigabytes, and every status moves
    one of them in each requestor's roster (several per placement). An entry rebuilt for
    every move (a new tuple for the member and one for its position, freeing the old
    ones wherever they lay) cost more there in cache misses than in instructions: the
    statuses took 30 % of a run's time at 100,000 nodes against 13 % at 1,000, for the
    same messages."""

    __slots__ = ("address", "features", "name", "position", "release", "room", "tier_index")

    def __init__(
        self,
        name: str,
        address: str,
        tier_index: int,
        room: RoomKey,
        release: str = "",
        features: frozenset[str] = NO_FEATURES,
    ) -> None:
        self.name = name
        self.address = address
        self.tier_index = tier_index
        self.room = room
        self.release = release
        self.features = features
        #: where it sits in its (tier, room) list
        self.position = 0

    def member(self) -> Member:
        return Member(
            self.name, self.address, self.tier_index, self.room, self.release, self.features
        )


class Roster:
    """Nodes by tier and, inside a tier, by room, for sampling. Not thread-safe: its
    requestor machine owns it.

    A tier's members sit in one list per room they last told of. The rooms seen in a tier
    are few (a class per power of two of each resource, whatever the number of nodes), so
    sampling for a shape looks at every room of a tier, keeps those where the shape may
    fit, and draws uniformly from their members: O(rooms + sample size). Each room's key
    is kept once (:meth:`_room_key`) and shared by every entry in that room."""

    def __init__(self, tiers: TierLadder, rng: Sampler) -> None:
        self._tiers = tiers
        self._rng = rng
        self._by_tier: list[dict[RoomKey, list[_Entry]]] = [{} for _ in tiers.percents]
        self._where: dict[str, _Entry] = {}
        #: (room, one instance's needs) -> may it fit: rooms and shapes are few, and every
        #: sample asked it of every room of every tier
        self._fits: dict[tuple[RoomKey, tuple[tuple[str, int], ...]], bool] = {}
        #: each room key seen, once: entries share it rather than hold a copy each
        self._keys: dict[RoomKey, RoomKey] = {}

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        """Every node listed, in the order each was first listed."""
        return list(self._where)

    def tier_sizes(self) -> tuple[int, ...]:
        return tuple(sum(map(len, rooms.values())) for rooms in self._by_tier)

    def member(self, name: str) -> Member | None:
        entry = self._where.get(name)
        return entry.member() if entry else None

    def tier_index_of(self, name: str) -> int | None:
        """The tier ``name`` is listed in (an index of the ladder), or None if unknown."""
        entry = self._where.get(name)
        return entry.tier_index if entry else None

    def update(
        self,
        name: str,
        address: str,
        tier_percent: int,
        room: Mapping[str, int] | None = None,
        *,
        release: str = "",
        features: frozenset[str] = NO_FEATURES,
    ) -> None:
        """Record ``name`` at ``tier_percent`` (a node's narrowest tier) with ``room``
        (None or empty: the room it told of before, if any), and the release and
        features its status said (a status that says none is a node that knows none:
        one of 0.1, or one writing for 0.1)."""
        # The ladder owns the rule for where a percentage falls.
        index = self._tiers.index_of_percent(tier_percent)
        entry = self._where.get(name)
        if entry is None:
            key = self._room_key(room) if room else ()
            entry = _Entry(name, address, index, key, release, features)
            self._where[name] = entry
            self._list(entry)
            return
        entry.release = release
        entry.features = features
        key = self._room_key(room) if room else entry.room
        if entry.tier_index == index and entry.room == key and entry.address == address:
            return
        self._unlist(entry)
        entry.address = address
        entry.tier_index = index
        entry.room = key
        self._list(entry)

    def note_room(self, name: str, room: Mapping[str, int]) -> None:
        """A known node told of its room (on an answer): move it to that room's list."""
        entry = self._where.get(name)
        if entry is None or not room:
            return
        key = self._room_key(room)
        # Equal, not identical: once the key cache clears, an unchanged room comes back
        # as a new key, and moving the entry would reorder its list (and the sampling).
        if entry.room != key:
            self._unlist(entry)
            entry.room = key
            self._list(entry)

    def _room_key(self, room: Mapping[str, int]) -> RoomKey:
        """The one key kept for ``room``: entries in the same room share it, so a move
        allocates nothing that outlives it. Keys are compared by equality all the same
        (equal tuples that are one object compare at once): the cache clears when full."""
        key = room_key(room)
        kept = self._keys.get(key)
        if kept is None:
            if len(self._keys) >= _FITS_KEPT:
                self._keys.clear()  # rooms are the nodes' to tell: keep it bounded
            kept = self._keys[key] = key
        return kept

    def _list(self, entry: _Entry) -> None:
        """Put ``entry`` at the end of its (tier, room) list."""
        members = self._by_tier[entry.tier_index].get(entry.room)
        if members is None:
            members = self._by_tier[entry.tier_index][entry.room] = []
        entry.position = len(members)
        members.append(entry)

    def _unlist(self, entry: _Entry) -> None:
        """Take ``entry`` out of its (tier, room) list: the last one takes its place."""
        rooms = self._by_tier[entry.tier_index]
        members = rooms[entry.room]
        last = members.pop()
        if last is not entry:
            members[entry.position] = last
            last.position = entry.position
        if not members:
            del rooms[entry.room]

    def remove(self, name: str) -> bool:
        entry = self._where.pop(name, None)
        if entry is None:
            return False
        self._unlist(entry)
        return True

    def sample(
        self,
        wanted: int,
        *,
        up_to_tier_index: int,
        exclude: Collection[str] = (),
        needs: Mapping[str, int] | None = None,
        features: frozenset[str] = NO_FEATURES,
    ) -> list[Member]:
        """Up to ``wanted`` distinct members in tiers ``0..up_to_tier_index``, none of them
        in ``exclude`` and, given ``needs`` (one instance's resources), none whose room
        rules it out, and none that does not know every one of ``features``: as many as
        possible from the emptiest tier, then the next."""
        if features:
            # Rare (a request using a feature a later release brought): the members that
            # know them are looked for among all of each tier's, O(tier) rather than
            # O(sample), and sampled from those.
            exclude = {*exclude, *(n for n, e in self._where.items() if not features <= e.features)}
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
                pool = [e for members in groups for e in members if e.name not in exclude]
                self._rng.shuffle(pool)
                chosen.extend(entry.member() for entry in pool[:missing])
                continue
            # Draw a few more than needed so that excluded members can be skipped
            # without a scan of the whole tier.
            starts = list(itertools.accumulate((len(members) for members in groups), initial=0))
            draw = min(population, missing + len(exclude))
            for position in self._rng.positions(population, draw):
                group = bisect.bisect_right(starts, position) - 1
                entry = groups[group][position - starts[group]]
                if entry.name not in exclude:
                    chosen.append(entry.member())
                    if len(chosen) == wanted:
                        break
        return chosen

    def sample_uniform(self, wanted: int, needs: Mapping[str, int] | None = None) -> list[Member]:
        """Up to ``wanted`` distinct members drawn uniformly from every tier and room (given
        ``needs``, one instance's resources, from the rooms that may take it):
        O(tiers x rooms + wanted)."""
        shape = None if needs is None else tuple(needs.items())
        groups = [
            members
            for rooms in self._by_tier
            for room, members in rooms.items()
            if shape is None or self._may_fit(room, shape)
        ]
        population = sum(map(len, groups))
        if population <= wanted:
            return [entry.member() for members in groups for entry in members]
        starts = list(itertools.accumulate((len(members) for members in groups), initial=0))
        chosen = []
        for position in self._rng.positions(population, wanted):
            group = bisect.bisect_right(starts, position) - 1
            chosen.append(groups[group][position - starts[group]].member())
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
            entry = where.get(name)
            if entry is None or not answer.room:
                continue
            if entry.room != room_key(answer.room) and self._may_fit(entry.room, shape):
                roomier.append(entry.member())
        return roomier

    def _may_fit(self, room: RoomKey, shape: tuple[tuple[str, int], ...]) -> bool:
        fits = self._fits.get((room, shape))
        if fits is None:
            if len(self._fits) >= _FITS_KEPT:
                self._fits.clear()  # shapes are the callers' to choose: keep it bounded
            fits = self._fits[room, shape] = may_fit(dict(room), dict(shape))
        return fits
