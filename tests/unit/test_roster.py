"""The requestor's roster: nodes by tier, sampled emptiest tier first, on a seeded sampler."""

from __future__ import annotations

from collections import Counter

from reservoir.protocol.roster import Roster, Sampler
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
    assert roster.remove_address("addr-2")
    assert roster.tier_sizes() == (0, 0, 1, 0, 0)
    assert roster.remove("n1") and not roster.remove("n1")
    assert len(roster) == 0 and roster.sample(3, up_to_tier_index=4) == []
