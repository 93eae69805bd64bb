"""Where a requestor's roster comes from (reservoir.protocol.roster_source), driven by hand
on a fake clock: what it asks for and when, and when it switches between a keeper's
samples and the nodes' announcements."""

from __future__ import annotations

from collections import Counter

import pytest

from reservoir.protocol.effects import Bind, Effect, Publish, Unbind
from reservoir.protocol.messages import (
    KEEPER_TOPIC,
    ROSTER_TOPIC,
    RollCall,
    RosterMember,
    RosterQuery,
    RosterSample,
)
from reservoir.protocol.requestor_state import LatencyEstimate
from reservoir.protocol.roster import Roster, Sampler
from reservoir.protocol.roster_source import RosterFrom, RosterSource, SourceConfig
from reservoir.protocol.tiers import DEFAULT_LADDER

T0 = 100.0


def a_source(
    roster_from: RosterFrom = "auto", roster: Roster | None = None, **config: object
) -> RosterSource:
    settings = SourceConfig(
        requestor_id="req",
        reply_to="req-inbox",
        roll_call_topic="tier.100",
        roster_from=roster_from,
        **config,  # type: ignore[arg-type]
    )
    roster = roster if roster is not None else Roster(DEFAULT_LADDER, Sampler("test"))
    return RosterSource(settings, roster, LatencyEstimate(), Counter())


def queries(effects: list[Effect]) -> list[RosterQuery]:
    return [
        e.message for e in effects if isinstance(e, Publish) and isinstance(e.message, RosterQuery)
    ]


def a_sample(*names: str) -> RosterSample:
    members = tuple(RosterMember(name=n, address=f"node.{n}", tier=10) for n in names)
    return RosterSample(sender="keeper", reply_to="keeper-inbox", members=members)


def following(source: RosterSource, now: float = T0) -> list[Effect]:
    """Start it, and have its queries come back unroutable (the first, and the one it asks
    again as it binds the announcements): it follows the announcements."""
    effects: list[Effect] = []
    source.start(now, effects)
    source.query_unroutable(now, effects)
    source.query_unroutable(now, effects)
    return effects


def test_with_no_setting_it_asks_a_keeper_first_and_follows_the_nodes_only_when_none_is_bound() -> (
    None
):
    source = a_source()
    started: list[Effect] = []
    source.start(T0, started)
    assert [q.wanted for q in queries(started)] == [128]
    assert source.state == "asking"
    assert not any(isinstance(e, Bind) for e in started)
    fallback: list[Effect] = []
    source.query_unroutable(T0, fallback)
    assert source.state == "announcements"
    # it binds the announcements before it asks once more (a keeper that started since
    # hears this query, or this requestor hears the keeper's news)
    assert fallback[0] == Bind(ROSTER_TOPIC)
    published = [type(e.message) for e in fallback if isinstance(e, Publish)]
    assert published == [RollCall, RosterQuery]
    again: list[Effect] = []
    source.query_unroutable(T0, again)  # no keeper then either: nothing more
    assert again == []


def test_set_to_announcements_it_never_asks_a_keeper() -> None:
    source = a_source("announcements")
    effects: list[Effect] = []
    source.start(T0, effects)
    for i in range(100):
        source.placing(T0 + i, effects)
    source.heard_keeper_up(T0 + 100, effects)
    assert queries(effects) == []
    assert source.state == "announcements"


def test_following_the_nodes_it_asks_for_a_keeper_at_most_once_per_refresh_s() -> None:
    # What noticing a keeper costs while none runs: one query per refresh_s at most,
    # whatever the placements, the nodes and the other requestors.
    source = a_source(refresh_s=10.0)
    following(source)
    effects: list[Effect] = []
    for i in range(1001):
        source.placing(T0 + i * 0.02, effects)  # 20 s of placements, 50 a second
    assert len(queries(effects)) == 2  # at 10 s and at 20 s, not at every placement


def test_a_keeper_starting_draws_one_query_and_its_answer_brings_the_requestor_back() -> None:
    source = a_source()
    following(source)
    effects: list[Effect] = []
    source.heard_keeper_up(T0 + 1, effects)
    source.heard_keeper_up(T0 + 1, effects)  # a second keeper at once: no second query
    assert len(queries(effects)) == 1
    assert source.state == "announcements"  # not until a keeper answers
    source.heard_sample(a_sample("n1"), T0 + 1.001, effects)
    assert source.state == "keepers"
    assert Unbind(ROSTER_TOPIC) in effects


def test_a_late_sample_asked_for_before_the_fallback_does_not_bring_the_requestor_back() -> None:
    # The keeper answered, then died; the next queries reached nobody, and the answer to
    # the first comes in after that: it is no news that a keeper answers now.
    source = a_source()
    following(source)
    effects: list[Effect] = []
    source.heard_sample(a_sample("n1"), T0 + 0.002, effects)
    assert source.state == "announcements"
    assert effects == []


def test_back_on_keepers_the_nodes_it_knew_go_first_as_samples_come() -> None:
    roster = Roster(DEFAULT_LADDER, Sampler("test"))
    source = a_source(roster=roster, limit=3)
    following(source)
    for name in ("a", "b", "c"):
        roster.update(name, f"node.{name}", 10)
    effects: list[Effect] = []
    source.heard_keeper_up(T0 + 1, effects)
    source.heard_sample(a_sample("b", "d"), T0 + 1, effects)
    # kept: the last sample's nodes, then the newest of the rest, up to the limit
    assert sorted(roster.names()) == ["b", "c", "d"]


def test_on_keepers_a_sample_is_asked_every_so_many_placements_or_once_it_is_old() -> None:
    source = a_source(refresh_every=4, refresh_s=10.0)
    effects: list[Effect] = []
    source.start(T0, effects)
    source.heard_sample(a_sample("n1"), T0, effects)
    placing: list[Effect] = []
    for i in range(8):
        source.placing(T0 + 0.1 * i, placing)
        if queries(placing):
            source.heard_sample(a_sample("n1"), T0 + 0.1 * i, placing)
    assert len(queries(placing)) == 2  # every 4 placements
    old: list[Effect] = []
    source.placing(T0 + 20.0, old)
    assert [q.wanted for q in queries(old)] == [128]
    assert all(e.topic == KEEPER_TOPIC for e in old if isinstance(e, Publish))


@pytest.mark.parametrize(
    "bad", [{"roster_from": "sometimes"}, {"sample": 0}, {"refresh_every": 0}, {"refresh_s": 0}]
)
def test_a_configuration_it_cannot_follow_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        a_source(**bad)  # type: ignore[arg-type]
