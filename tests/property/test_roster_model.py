"""The roster against a plain model of it: after any sequence of statuses, answers and
removals, it knows exactly the nodes the model knows, each in its tier and room, and a
sample only ever returns known nodes that may take the shape asked for.

The roster keeps its members in one list per (tier, room) and moves them by swapping the
last one in; this holds that bookkeeping to a dictionary of name -> (address, tier, room),
and checks after every step that its lists and its positions agree.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from reservoir.protocol.room import may_fit, room_key
from reservoir.protocol.roster import Roster, Sampler
from reservoir.protocol.tiers import DEFAULT_LADDER

NAMES = [f"node-{i}" for i in range(4)]
# few rooms and tiers, so that nodes share a (tier, room) list and move within and out of it
ROOMS = st.sampled_from([{}, {"VCPU": 0}, {"VCPU": 1}, {"VCPU": 1, "MEMORY_MB": -1}])

OPERATIONS = st.lists(
    st.one_of(
        st.tuples(
            st.just("status"),
            st.sampled_from(NAMES),
            st.sampled_from(["a", "a", "a", "b"]),  # a node restarting elsewhere, now and then
            st.sampled_from([30, 100]),
            ROOMS,
        ),
        st.tuples(st.just("answer"), st.sampled_from(NAMES), ROOMS),
        st.tuples(st.just("remove"), st.sampled_from(NAMES)),
    ),
    min_size=10,
    max_size=60,
)


def indexes_agree(roster: Roster) -> None:
    """White-box: every member sits in its (tier, room) list at the position the roster
    keeps for it, and every list holds only such members (no empty lists kept)."""
    listed = 0
    for tier_index, rooms in enumerate(roster._by_tier):
        for room, members in rooms.items():
            assert members
            for position, member in enumerate(members):
                assert (member.tier_index, member.room) == (tier_index, room)
                assert roster._where[member.name] is member and member.position == position
            listed += len(members)
    assert listed == len(roster._where)


@settings(max_examples=300, deadline=None)
@given(OPERATIONS, st.dictionaries(st.sampled_from(["VCPU", "MEMORY_MB"]), st.integers(1, 16)))
def test_the_roster_knows_what_a_plain_model_knows(
    operations: list[tuple[object, ...]], needs: dict[str, int]
) -> None:
    roster = Roster(DEFAULT_LADDER, Sampler(1))
    model: dict[str, tuple[str, int, tuple[tuple[str, int], ...]]] = {}
    for operation in operations:
        if operation[0] == "status":
            _, name, where, percent, room = operation
            assert isinstance(name, str) and isinstance(percent, int) and isinstance(room, dict)
            address = f"{where}-{name}"
            roster.update(name, address, percent, room)
            before = model.get(name)
            kept = room_key(room) if room else (before[2] if before else ())
            model[name] = (address, DEFAULT_LADDER.index_of_percent(percent), kept)
        elif operation[0] == "answer":
            _, name, room = operation
            assert isinstance(name, str) and isinstance(room, dict)
            roster.note_room(name, room)
            if name in model and room:
                address, tier, _ = model[name]
                model[name] = (address, tier, room_key(room))
        else:
            name = operation[1]
            assert isinstance(name, str)
            assert roster.remove(name) == (name in model)
            model.pop(name, None)
        indexes_agree(roster)
        everyone = roster.sample(len(NAMES), up_to_tier_index=len(DEFAULT_LADDER) - 1)
        assert sorted(m.name for m in everyone) == sorted(model)

    assert len(roster) == len(model)
    for name, (address, tier, room) in model.items():
        member = roster.member(name)
        assert member is not None
        assert (member.address, member.tier_index, member.room) == (address, tier, room)
    sizes = [0] * len(DEFAULT_LADDER)
    for _, tier, _ in model.values():
        sizes[tier] += 1
    assert roster.tier_sizes() == tuple(sizes)

    sample = roster.sample(len(NAMES), up_to_tier_index=len(DEFAULT_LADDER) - 1, needs=needs)
    names = [m.name for m in sample]
    assert len(names) == len(set(names))
    fitting = {n for n, (_, _, room) in model.items() if may_fit(dict(room), needs)}
    assert set(names) == fitting  # asked for as many as there are: every one that may fit
