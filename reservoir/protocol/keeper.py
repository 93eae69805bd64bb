"""A roster keeper: one participant that follows the nodes' announcements so that
requestors need not.

With announcements alone, each of the K requestors hears every node's every status: a
placement costs K roster deliveries, and a requestor's start asks every node (design.md,
"The roster"). A keeper hears the announcements once, keeps the roster, and answers a
requestor's :class:`~reservoir.protocol.messages.RosterQuery` with a
:class:`~reservoir.protocol.messages.RosterSample`: nodes drawn uniformly from its
emptiest tiers. A requestor samples its probes from that, learns from its own answers as
before, and asks again every so many placements: what a placement costs no longer grows
with K, and a requestor's start is two messages.

The keeper's roster is a hint like every roster, and the keeper holds nothing a placement
depends on: the node still decides from its exact state, so a stale sample costs probes
that decline; a sample the keeper never sends (no keeper, or one that died) costs the
requestor the fallback to following the announcements itself, until a keeper is up again
(:class:`~reservoir.protocol.messages.KeeperUp`, which the keeper publishes as it starts).
Pure, like the rest of the protocol: messages and the current time in, effects out.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from reservoir.protocol.effects import Bind, Dropped, Effect, Publish, Send
from reservoir.protocol.messages import (
    KEEPER_TOPIC,
    MAX_SAMPLE,
    MESSAGE_CLASSES,
    ROOM_TOPIC,
    ROSTER_TOPIC,
    KeeperUp,
    Message,
    NodeStatus,
    RollCall,
    RosterMember,
    RosterQuery,
    RosterSample,
)
from reservoir.protocol.roster import Roster, Sampler
from reservoir.protocol.tiers import DEFAULT_LADDER, TierLadder

__all__ = ["KeeperConfig", "KeeperMachine"]


@dataclass(frozen=True)
class KeeperConfig:
    """A keeper: its id (in the requestor role's namespace), its inbox, the ladder."""

    keeper_id: str
    reply_to: str
    tiers: TierLadder = DEFAULT_LADDER
    #: seeds the sampling (None: the keeper id), so runs are reproducible
    sample_seed: int | str | None = None


class KeeperMachine:
    """One keeper's roster and its answers. Not thread-safe: its driver serialises calls."""

    def __init__(self, config: KeeperConfig) -> None:
        self.config = config
        seed = config.sample_seed if config.sample_seed is not None else config.keeper_id
        self.roster = Roster(config.tiers, Sampler(seed))
        #: ``samples`` sent, ``members_sent``, ``statuses`` heard
        self.counters: Counter[str] = Counter()

    def start(self, now: float) -> list[Effect]:
        """Hear the announcements and the queries, ask every node once where it stands
        (O(N) per keeper start, and keepers are few), and say that a keeper is up to the
        requestors that follow the announcements for want of one (one delivery each)."""
        return [Bind(ROSTER_TOPIC), Bind(ROOM_TOPIC), Bind(KEEPER_TOPIC), *self.announce(now)]

    def announce(self, now: float) -> list[Effect]:
        """Roll-call every node and say that a keeper is up: at start, and when the
        keeper's connection comes back (nodes and requestors heard nothing of it while it
        was away, and a requestor whose query reached nobody then follows the
        announcements). The roll call goes first: the requestors' queries then come in
        behind the nodes' answers."""
        config = self.config
        call = RollCall(sender=config.keeper_id, reply_to=config.reply_to, from_keeper=True)
        up = KeeperUp(sender=config.keeper_id, reply_to=config.reply_to)
        return [
            Publish(TierLadder.topic(config.tiers.percents[-1]), call),
            Publish(ROSTER_TOPIC, up),
        ]

    def handle(self, message: Message, now: float) -> list[Effect]:
        if type(message) not in MESSAGE_CLASSES:
            return [Dropped("unexpected", f"a keeper does not take a {type(message).__name__}")]
        if message.kind == "status":
            return self._on_status(message)
        if message.kind == "roster_query":
            return [Send(message.reply_to, self.sample(message))]
        if message.kind == "keeper_up":
            return []  # another keeper (or this one) started: nothing to do
        return [Dropped("unexpected", f"a keeper does not take {message.kind!r}")]

    def on_timer(self, key: object, now: float) -> list[Effect]:
        """A keeper sets no timer (a driver's uniform call)."""
        return []

    def on_unroutable(self, message: Message, now: float) -> list[Effect]:
        """A roll call no node heard (none is up yet: they announce themselves as they
        start), a sample whose requestor is gone, or news that a keeper is up that no
        requestor needed (every one is on keepers): nothing to do."""
        return []

    def _on_status(self, status: NodeStatus) -> list[Effect]:
        self.counters["statuses"] += 1
        if status.leaving:
            self.roster.remove(status.sender)
            return []
        self.roster.update(
            status.sender,
            status.reply_to,
            status.tier,
            status.room,
            release=status.release,
            features=status.features,
        )
        if not status.room_news and not status.answering:
            # A node that does not tell keepers of its room (started after our roll call,
            # restarted, or it stopped when nobody heard): ask it, so that it does from
            # now on (one message each way, once).
            call = RollCall(
                sender=self.config.keeper_id, reply_to=self.config.reply_to, from_keeper=True
            )
            return [Send(status.reply_to, call)]
        return []

    def sample(self, query: RosterQuery) -> RosterSample:
        """Up to ``query.wanted`` nodes, drawn uniformly from the emptiest tiers."""
        tiers = self.config.tiers
        # Each requestor samples its probes emptiest first from a sample of its own.
        # Uniform over every tier, not the emptiest first, with a shape too: requestors
        # asking at once for room would all be sent to the same few emptiest nodes.
        members = self.roster.sample_uniform(
            min(query.wanted, MAX_SAMPLE), needs=query.needs or None
        )
        self.counters["samples"] += 1
        self.counters["members_sent"] += len(members)
        return RosterSample(
            sender=self.config.keeper_id,
            reply_to=self.config.reply_to,
            members=tuple(
                RosterMember(
                    name=m.name,
                    address=m.address,
                    tier=tiers.percents[m.tier_index],
                    room=dict(m.room),
                    release=m.release,
                    features=m.features,
                )
                for m in members
            ),
        )
