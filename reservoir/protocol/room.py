"""A node's room as requestors know it: per resource class, the power of two that the
node's free amount has reached.

A roster that knows only tiers samples blind inside a tier: on a nearly full cloud most of
the top tier cannot take an 8-VCPU instance, and a requestor probes (and is declined by)
many nodes per placement. Nodes therefore tell requestors their room, coarsely, on
messages they send anyway: every status announcement and every answer to a requestor
(offer, decline, accepted, freed) carries it, so knowing it costs no message of its own.

The class of a free amount ``f`` is ``floor(log2 f)`` (-1 when nothing is free), taken
over the allocations alone, as the tier is: a reservation made and released a moment later
changes nothing. A class ``k`` says the free amount lies in ``[2**k, 2**(k+1))``, so a
shape needing ``q`` may fit only where ``k >= floor(log2 q)``, and surely does when
``k > floor(log2 q)``; anything below rules the node out for that shape. The room is only
a hint, like the tier: the node still decides from its exact state, a stale room costs one
wasted probe, and the exhaustive step asks every node before a request fails, so a room
that is stale on the low side never turns into a false "no valid host".
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["NOTHING_FREE", "RoomKey", "may_fit", "room_class", "room_key"]

#: the class of a resource with nothing free
NOTHING_FREE = -1

#: a room as a hashable value: (resource class, class) pairs, sorted; () when unknown
RoomKey = tuple[tuple[str, int], ...]


def room_class(free: int) -> int:
    """``floor(log2 free)``, or :data:`NOTHING_FREE` when nothing is free."""
    return free.bit_length() - 1 if free > 0 else NOTHING_FREE


def room_key(room: Mapping[str, int]) -> RoomKey:
    return tuple(sorted(room.items()))


def may_fit(room: Mapping[str, int], needs: Mapping[str, int]) -> bool:
    """False only when ``room`` rules out one instance needing ``needs``. An unknown room
    (empty: a node that never said) rules out nothing; a class the room does not name is a
    resource the node does not have."""
    if not room:
        return True
    for resource_class, amount in needs.items():
        if amount <= 0:
            continue
        have = room.get(resource_class)
        if have is None or have < amount.bit_length() - 1:
            return False
    return True
