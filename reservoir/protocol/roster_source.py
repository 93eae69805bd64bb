"""Where a requestor's roster comes from: a roster keeper's samples, or the nodes'
announcements, and the switches between the two as keepers come and go.

A requestor's :class:`~reservoir.protocol.roster.Roster` is filled one of two ways
(design.md, "Many requestors: roster keepers"):

- **announcements**: it binds the ``roster`` topic, hears every node's every status and
  roll-calls every node once (O(N) per start, and each status reaches every such
  requestor: what a placement costs grows with their number);
- **keepers**: it asks a keeper for a sample (:class:`~reservoir.protocol.messages.RosterQuery`
  on the ``keeper`` topic) when it starts, every so many placements and when its sample is
  old, and keeps the nodes sampled, at most ``limit`` of them (the least recently sampled
  go first).

With ``roster_from = "auto"`` (the default) a requestor takes samples while a keeper
answers and follows the announcements while none does, switching both ways:

- to the announcements when a query comes back unroutable (no keeper is bound); it asks
  once more as it starts hearing them, for a keeper that started in between;
- back to keepers when a keeper answers a query asked while following them. It asks when
  a keeper says it started (:class:`~reservoir.protocol.messages.KeeperUp` on ``roster``,
  which a requestor following the announcements hears: one delivery per keeper start),
  and, in case it missed that (its connection was down), at a placement once ``refresh_s``
  has passed since it last asked: at most one query per ``refresh_s`` whatever the nodes
  and the requestors. On switching it unbinds ``roster`` and keeps the nodes it knows,
  as the oldest of its sample.

No placement waits for any of this: a placement goes out on the roster as it is (an empty
one asks every node of a tier, as a requestor does before its roll call is answered).
Pure, like the rest of the protocol: the current time in, effects out.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal, Protocol

from reservoir.protocol.effects import Bind, Effect, Publish, Unbind
from reservoir.protocol.messages import (
    KEEPER_TOPIC,
    MAX_SAMPLE,
    ROSTER_TOPIC,
    NodeStatus,
    RollCall,
    RosterQuery,
    RosterSample,
)
from reservoir.protocol.roster import Roster

__all__ = ["ROSTER_FROM", "Latency", "RosterFrom", "RosterSource", "SourceConfig"]

#: ``auto``: a keeper's samples while one answers, the announcements while none does;
#: ``announcements``: never a keeper; ``keeper``: the name ``auto`` had before it switched
#: back to keepers (kept so that a setting written for it still works, and means ``auto``)
RosterFrom = Literal["auto", "announcements", "keeper"]
ROSTER_FROM: Final[tuple[RosterFrom, ...]] = ("auto", "announcements", "keeper")

#: latency samples the roster's round trips give a new requestor (a roll call's answers,
#: a keeper's sample): after that, placements' own answers time the network
_LATENCY_SAMPLES: Final = 8


class Latency(Protocol):
    """Where the round trips the roster times go (the requestor's latency estimate)."""

    samples: int

    def add(self, sample_s: float) -> None: ...


@dataclass(frozen=True)
class SourceConfig:
    """Whose roster, where from, and how often a keeper is asked. Defaults follow
    docs/design.md."""

    requestor_id: str
    reply_to: str
    #: the widest tier's topic, where a roll call reaches every node
    roll_call_topic: str
    roster_from: RosterFrom = "auto"
    #: nodes asked for per sample, placements between two samples, the age of a sample
    #: that is refreshed at the next placement (and, following the announcements, how
    #: often a placement asks whether a keeper is back), and the most nodes kept
    sample: int = 128
    refresh_every: int = 32
    refresh_s: float = 10.0
    limit: int = 1024
    #: a query still unanswered after this long is asked again, not waited for
    ask_again_s: float = 2.0

    def __post_init__(self) -> None:
        if self.roster_from not in ROSTER_FROM:
            raise ValueError(f"roster_from is one of {', '.join(ROSTER_FROM)}")
        if not 1 <= self.sample <= MAX_SAMPLE:
            raise ValueError(f"sample: a sample asks for 1 to {MAX_SAMPLE} nodes")
        if self.refresh_every < 1 or self.limit < 1:
            raise ValueError("refresh_every and limit are at least 1")
        if self.refresh_s <= 0 or self.ask_again_s <= 0:
            raise ValueError("refresh_s and ask_again_s are positive")


class RosterSource:
    """One requestor's roster source. Not thread-safe: its requestor machine owns it.

    Counters (in the requestor's): ``samples_asked``, ``no_keeper`` (switched to the
    announcements), ``back_on_keepers`` (switched back), ``keeper_up`` (heard a keeper
    start while following the announcements)."""

    def __init__(
        self, config: SourceConfig, roster: Roster, latency: Latency, counters: Counter[str]
    ) -> None:
        self.config = config
        self._roster = roster
        self._latency = latency
        self._counters = counters
        self._uses_keepers = config.roster_from != "announcements"
        #: whether the ``roster`` topic is bound and every node was roll-called
        self._following = False
        self._roll_called_at: float | None = None
        #: when the query on its way went out (None: none outstanding), and when any last did
        self._asked_at: float | None = None
        self._last_asked_at = -math.inf
        #: placements since the last sample asked for, and when the last one came
        self._since_sample = 0
        self._sample_at = -math.inf
        #: the nodes kept from keepers' samples, the least recently sampled first
        self._sampled: OrderedDict[str, None] = OrderedDict()

    # -- observing ---------------------------------------------------------------------

    @property
    def state(self) -> Literal["keepers", "announcements", "asking"]:
        """``keepers``: the roster comes from a keeper's samples; ``announcements``: from
        following the announcements; ``asking``: started, no keeper has answered yet."""
        if self._following:
            return "announcements"
        return "keepers" if self._sample_at > -math.inf else "asking"

    @property
    def follows_announcements(self) -> bool:
        return self._following

    def may_wait_for_room(self) -> bool:
        """Whether a placement whose sampling found too little may ask a keeper for
        nodes with room before it asks every node: only on keepers' samples (following
        the announcements, the roster is every node already; with no sample yet, the
        placement goes out on what there is)."""
        return self.state == "keepers"

    # -- events ------------------------------------------------------------------------

    def start(self, now: float, effects: list[Effect]) -> None:
        """Fill the roster: ask a keeper, or follow the announcements."""
        if self._uses_keepers:
            self._ask(now, effects)
        else:
            self._follow(now, effects)

    def placing(self, now: float, effects: list[Effect]) -> None:
        """A placement starts: refresh an old sample (asked now, answered while the
        placement goes on), or, following the announcements, ask now and then whether a
        keeper is back."""
        if not self._uses_keepers:
            return
        config = self.config
        if self._following:
            if now - self._last_asked_at >= config.refresh_s:
                self._ask(now, effects)
            return
        self._since_sample += 1
        stale = now - self._sample_at >= config.refresh_s
        if stale or self._since_sample >= config.refresh_every:
            self._ask(now, effects)

    def ask_for_room(
        self, needs: Mapping[str, int], wanted: int, now: float, effects: list[Effect]
    ) -> None:
        """Ask for up to ``wanted`` nodes whose room may take an instance needing
        ``needs`` (asked whatever else is on its way)."""
        self._ask(now, effects, needs=needs, wanted=wanted)

    def heard_status(self, status: NodeStatus, now: float) -> None:
        """A node's status (following the announcements): its answer to our roll call
        times the network for a new requestor."""
        if status.answering and self._roll_called_at is not None:
            if self._latency.samples < _LATENCY_SAMPLES:
                self._latency.add(now - self._roll_called_at)
            else:
                self._roll_called_at = None

    def heard_keeper_up(self, now: float, effects: list[Effect]) -> None:
        """A keeper started: ask it for a sample (its answer brings us back to keepers)."""
        if self._uses_keepers and self._following:
            self._counters["keeper_up"] += 1
            self._ask(now, effects)

    def heard_sample(self, sample: RosterSample, now: float, effects: list[Effect]) -> None:
        """A keeper's sample: into the roster, the least recently sampled nodes out past
        the limit. An answer to a query asked while following the announcements brings
        the requestor back to keepers."""
        asked = self._asked_at
        if asked is not None and self._latency.samples < _LATENCY_SAMPLES:
            # a new requestor's first latency samples, as a roll call's answers would be
            self._latency.add(now - asked)
        if self._following:
            if asked is None:
                return  # a late answer to a query from before we followed: no news of now
            self._back_on_keepers(effects)
        self._asked_at = None
        self._sample_at = now
        roster, sampled = self._roster, self._sampled
        for member in sample.members:
            roster.update(
                member.name,
                member.address,
                member.tier,
                member.room,
                release=member.release,
                features=member.features,
            )
            sampled.pop(member.name, None)
            sampled[member.name] = None
        while len(sampled) > self.config.limit:
            name, _ = sampled.popitem(last=False)
            roster.remove(name)

    def query_unroutable(self, now: float, effects: list[Effect]) -> None:
        """A query reached no keeper: none is bound. Follow the announcements (if not
        already), as every requestor does without keepers."""
        self._asked_at = None
        if not self._following:
            self._counters["no_keeper"] += 1
            self._follow(now, effects)
            # Once more, now that we hear the announcements: a keeper that bound its topic
            # after our first query and said it was up before our bind of ``roster`` went
            # unheard. It binds before it says so, and we bind before we ask: either this
            # query reaches it, or its news reaches us.
            self._ask(now, effects)

    # -- switching ---------------------------------------------------------------------

    def _follow(self, now: float, effects: list[Effect]) -> None:
        """Hear every node's statuses, and roll-call them all: O(N) once."""
        config = self.config
        self._following = True
        self._roll_called_at = now
        effects.append(Bind(ROSTER_TOPIC))
        call = RollCall(sender=config.requestor_id, reply_to=config.reply_to)
        effects.append(Publish(config.roll_call_topic, call))

    def _back_on_keepers(self, effects: list[Effect]) -> None:
        """Stop hearing the announcements. The nodes known from them stay, as the least
        recently sampled: samples replace them as they come."""
        self._counters["back_on_keepers"] += 1
        self._following = False
        self._roll_called_at = None
        self._since_sample = 0
        effects.append(Unbind(ROSTER_TOPIC))
        kept: OrderedDict[str, None] = OrderedDict.fromkeys(
            name for name in self._roster.names() if name not in self._sampled
        )
        kept.update(self._sampled)
        self._sampled = kept

    def _ask(
        self,
        now: float,
        effects: list[Effect],
        needs: Mapping[str, int] | None = None,
        wanted: int | None = None,
    ) -> None:
        """Ask the keepers for a sample, unless one was asked for lately and is on its
        way; with ``needs``, for nodes whose room may take such an instance."""
        config = self.config
        asked = self._asked_at
        if needs is None and asked is not None and now - asked < config.ask_again_s:
            return
        self._asked_at = self._last_asked_at = now
        self._since_sample = 0
        self._counters["samples_asked"] += 1
        query = RosterQuery(
            sender=config.requestor_id,
            reply_to=config.reply_to,
            wanted=min(MAX_SAMPLE, wanted or config.sample),
            needs=dict(needs or {}),
        )
        effects.append(Publish(KEEPER_TOPIC, query))
