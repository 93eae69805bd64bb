"""The requestor's roster: nodes by tier, sampled emptiest tier first, on a seeded sampler."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from reservoir.protocol.messages import Message, decode_message
from reservoir.protocol.room import NOTHING_FREE, may_fit, room_class
from reservoir.protocol.roster import _FITS_KEPT, Roster, Sampler
from reservoir.protocol.tiers import TierLadder


def a_roster(seed: int = 0) -> Roster:
    return Roster(TierLadder(), Sampler(seed))


def test_a_sample_comes_from_the_emptiest_tier_first() -> None:
    roster = a_roster()
    for i in range(10):
        roster.update(f"empty-{i}", f"addr-empty-{i}", 10)
        roster.update(f"half-{i}", f"addr-half-{i}", 50)
    names = {m.name for m in roster.sample(4, up_to_tier_index=4)}
    assert len(names) == 4 and all(n.startswith("empty-") for n in names)


def test_a_sample_spills_into_the_next_tier_when_the_emptiest_is_too_small() -> None:
    roster = a_roster()
    roster.update("a", "addr-a", 10)
    roster.update("b", "addr-b", 75)
    roster.update("c", "addr-c", 100)
    assert [m.name for m in roster.sample(2, up_to_tier_index=4)] == ["a", "b"]
    assert [m.name for m in roster.sample(2, up_to_tier_index=0)] == ["a"]


def test_a_sample_never_repeats_a_node_nor_includes_an_excluded_one() -> None:
    roster = a_roster()
    for i in range(50):
        roster.update(f"n{i}", f"addr-{i}", 10)
    excluded = {f"n{i}" for i in range(45)}
    for _ in range(100):
        names = [m.name for m in roster.sample(5, up_to_tier_index=4, exclude=excluded)]
        assert sorted(names) == [f"n{i}" for i in range(45, 50)]


def test_sampling_is_uniform_within_a_tier() -> None:
    roster = a_roster()
    for i in range(10):
        roster.update(f"n{i}", f"addr-{i}", 25)
    seen = Counter(m.name for _ in range(5000) for m in roster.sample(2, up_to_tier_index=4))
    assert len(seen) == 10
    assert max(seen.values()) < 1.2 * min(seen.values())


def test_the_same_seed_samples_the_same_nodes() -> None:
    def run(seed: int) -> list[str]:
        roster = a_roster(seed)
        for i in range(1000):
            roster.update(f"n{i}", f"addr-{i}", 10)
        return [m.name for _ in range(20) for m in roster.sample(3, up_to_tier_index=4)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_a_node_moves_between_tiers_and_leaves() -> None:
    roster = a_roster()
    roster.update("n1", "addr-1", 10)
    roster.update("n2", "addr-2", 10)
    roster.update("n1", "addr-1", 50)
    assert roster.tier_sizes() == (1, 0, 1, 0, 0)
    assert roster.remove("n2")
    assert roster.tier_sizes() == (0, 0, 1, 0, 0)
    assert roster.remove("n1") and not roster.remove("n1")
    assert len(roster) == 0 and roster.sample(3, up_to_tier_index=4) == []


def test_a_sample_for_a_shape_leaves_out_nodes_whose_room_rules_it_out() -> None:
    roster = a_roster()
    for i in range(20):
        roster.update(f"full-{i}", f"addr-full-{i}", 100, {"VCPU": 1, "MEMORY_MB": 14})
    roster.update("roomy", "addr-roomy", 100, {"VCPU": 3, "MEMORY_MB": 14})
    roster.update("silent", "addr-silent", 100)  # never told its room: may fit
    for _ in range(20):
        names = {m.name for m in roster.sample(5, up_to_tier_index=4, needs={"VCPU": 8})}
        assert names == {"roomy", "silent"}
    assert len(roster.sample(5, up_to_tier_index=4, needs={"VCPU": 2})) == 5
    assert [m.name for m in roster.sample(5, up_to_tier_index=4, needs={"CUSTOM_GPU": 1})] == [
        "silent"  # the others have no such resource at all
    ]


def test_an_answer_moves_a_node_to_the_room_it_tells_of() -> None:
    roster = a_roster()
    roster.update("n", "addr-n", 100, {"VCPU": 1})
    assert roster.sample(1, up_to_tier_index=4, needs={"VCPU": 4}) == []
    roster.note_room("n", {"VCPU": 2})
    assert [m.name for m in roster.sample(1, up_to_tier_index=4, needs={"VCPU": 4})] == ["n"]
    roster.note_room("stranger", {"VCPU": 9})  # only known nodes are moved
    assert len(roster) == 1
    roster.update("n", "addr-n", 75)  # a status without a room keeps the last one told
    member = roster.member("n")
    assert member is not None and member.room == (("VCPU", 2),)
    assert roster.remove("n") and roster.tier_sizes() == (0, 0, 0, 0, 0)


def test_a_shape_may_fit_only_where_its_power_of_two_is_reached() -> None:
    assert may_fit({"VCPU": 3}, {"VCPU": 8})  # 8..15 free
    assert may_fit({"VCPU": 3}, {"VCPU": 15})  # perhaps: the node decides
    assert not may_fit({"VCPU": 2}, {"VCPU": 8})  # 4..7 free
    assert not may_fit({"VCPU": NOTHING_FREE}, {"VCPU": 1})
    assert may_fit({"VCPU": 0}, {"VCPU": 1, "MEMORY_MB": 0})  # 1 free; no memory asked
    assert may_fit({}, {"VCPU": 1000})  # unknown room rules nothing out
    assert [room_class(f) for f in (0, 1, 2, 3, 4, 1023, 1024)] == [-1, 0, 1, 1, 2, 9, 10]


def test_a_status_whose_room_names_no_resource_class_or_too_many_is_refused() -> None:
    def status(room: dict[str, int]) -> Message:
        fields = {"kind": "status", "sender": "n", "reply_to": "addr-n", "tier": 10}
        return decode_message(json.dumps({**fields, "room": room}).encode())

    assert status({"VCPU": 3, "CUSTOM_GPU": 0}).room == {"VCPU": 3, "CUSTOM_GPU": 0}
    for bad in ({"vcpu": 3}, {"VCPU": -2}, {"VCPU": 54}, {f"CUSTOM_{i}": 1 for i in range(65)}):
        with pytest.raises(ValueError, match="room"):  # msgspec's, or InvalidField
            status(bad)


def test_a_node_telling_the_same_room_again_keeps_its_place_after_the_room_cache_clears() -> None:
    roster = a_roster()
    for name in ("n0", "n1", "n2"):
        roster.update(name, f"addr-{name}", 100, {"VCPU": 3})
    # another node tells of more distinct rooms than the roster keeps keys for
    for k in range(_FITS_KEPT + 10):
        roster.update("churn", "addr-churn", 25, {"VCPU": k % 60, "MEMORY_MB": k // 60})
    roster.note_room("n0", {"VCPU": 3})
    roster.update("n1", "addr-n1", 100, {"VCPU": 3})
    last_tier = len(TierLadder()) - 1
    listed = [m.name for m in roster.sample(3, up_to_tier_index=last_tier, exclude={"churn"})]
    again = a_roster()
    for name in ("n0", "n1", "n2"):
        again.update(name, f"addr-{name}", 100, {"VCPU": 3})
    # the same seed, the same lists in the same order: the same sample
    assert listed == [m.name for m in again.sample(3, up_to_tier_index=last_tier)]
