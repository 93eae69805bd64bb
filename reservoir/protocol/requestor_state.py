"""What every part of the requestor machine reads: its configuration
(:class:`RequestorConfig`), the offer latency it times (:class:`LatencyEstimate`), and the
state the parts share (:class:`RequestorState`): the conversations in flight, the ones
finished, the roster and where it comes from, the frees under way.

The parts (:mod:`~reservoir.protocol.requestor_asking`,
:mod:`~reservoir.protocol.requestor_deciding`, :mod:`~reservoir.protocol.requestor_settling`,
:mod:`~reservoir.protocol.requestor_lookups`) each hold the one :class:`RequestorState` of
their :class:`~reservoir.protocol.requestor.RequestorMachine`: what one part changes, the
others see.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

from reservoir.protocol.answers import AnsweredIds
from reservoir.protocol.compatibility import FEATURES, RELEASE_LINES, Feature
from reservoir.protocol.conversation import Conversation
from reservoir.protocol.freeing import Freeing
from reservoir.protocol.placement import Placement
from reservoir.protocol.policies import Policy, Spread
from reservoir.protocol.roster import Roster, Sampler
from reservoir.protocol.roster_source import RosterFrom, RosterSource, SourceConfig
from reservoir.protocol.tiers import DEFAULT_LADDER, TierLadder

__all__ = ["LatencyEstimate", "RequestorConfig", "RequestorState"]


@dataclass(frozen=True)
class RequestorConfig:
    """Who the requestor is and how patient it is. Defaults follow docs/design.md."""

    requestor_id: str
    #: where nodes send offers and answers
    reply_to: str
    tiers: TierLadder = DEFAULT_LADDER
    policy: Policy = field(default_factory=Spread)
    #: how long nodes hold a reservation for us
    ttl_s: float = 5.0
    #: the longest wait for a first offer before widening ("a couple of seconds")
    max_widen_s: float = 2.0
    #: the shortest wait for a first offer before widening
    min_widen_s: float = 0.05
    #: the longest a caller-chosen request id waits for holders to say "already placed"
    max_lookup_s: float = 0.5
    #: at the last tier, wait this many times the widening wait, and at least
    #: ``min_verdict_s``, before failing for want of offers
    verdict_factor: float = 3.0
    min_verdict_s: float = 0.25
    #: after an attempt's first offer, wait this many times its latency for the others
    collect_factor: float = 1.0
    min_collect_s: float = 0.002
    max_collect_s: float = 0.25
    #: never award an offer with less than this left of its reservation
    award_margin_s: float = 0.25
    #: re-send an unanswered award after this long
    award_retry_s: float = 0.5
    #: when every tier is tried and nodes said "busy", broadcast again after this long,
    #: doubling each round up to ``max_busy_retry_s``
    busy_retry_s: float = 0.05
    max_busy_retry_s: float = 1.0
    #: when every tier is tried and no node answered at all (no offer, not even a
    #: decline), start over after this long, doubling up to ``max_unheard_retry_s``,
    #: until the caller's deadline: the path to the nodes is down for a moment
    unheard_retry_s: float = 0.25
    max_unheard_retry_s: float = 2.0
    #: offered slots kept (not released) beyond the winners until they accept
    spare_slots: int = 1
    #: re-send an unanswered free after this long, this many times (then a caller hears
    #: which nodes did not confirm); tidying goes on, backing off to ``max_free_retry_s``
    free_retry_s: float = 1.0
    free_attempts: int = 5
    max_free_retry_s: float = 30.0
    #: how many finished request ids to remember for idempotent retries
    remember_finished: int = 100_000
    #: nodes probed per instance wanted in the first round, and at least ``min_probes``
    probe_factor: float = 2.0
    min_probes: int = 2
    #: sampling rounds (each asks twice as many nodes as the last) before the exhaustive
    #: broadcast; 0 always broadcasts, as the protocol did before sampling
    probe_rounds: int = 20
    #: seeds the roster's sampling (None: the requestor id), so runs are reproducible
    sample_seed: int | str | None = None
    #: where the roster comes from (design.md, "Many requestors: roster keepers"):
    #: ``auto``, a roster keeper's samples while one answers and every node's statuses
    #: while none does, switching both ways as keepers come and go; ``announcements``,
    #: every node's statuses and a roll call of every node at start (K deliveries per
    #: status, N answers per start), never a keeper; ``keeper``, the same as ``auto``
    #: (its earlier name). :mod:`reservoir.protocol.roster_source` does the switching
    roster_from: RosterFrom = "auto"
    #: with a keeper: nodes asked for per sample, placements between two samples, and
    #: the most nodes the roster keeps (the least recently sampled go first)
    keeper_sample: int = 128
    keeper_refresh_every: int = 32
    #: with a keeper: nodes asked for when the sample had none that may fit a request
    #: (twice as many each time), and how often before the exhaustive step
    keeper_shape_sample: int = 16
    keeper_shape_rounds: int = 4
    #: with a keeper: a sample older than this is refreshed at the next placement; with
    #: none (``auto``), a placement asks again whether one is back after this long
    keeper_refresh_s: float = 10.0
    roster_limit: int = 1024
    #: every placement findable by its id (``Lookup``), generated ids too, not only the
    #: caller-chosen ones: what a service answering GET/DELETE from the nodes needs. It
    #: adds no lookup before placing a generated id; a node binds the id's lookup topic
    #: once it has offered, and accepts an award once the binding is in place
    #: (``findable_when_placed``, docs/design.md "Finding a placement from any replica")
    findable: bool = False
    #: claim a caller-chosen id before placing it (:mod:`~reservoir.protocol.contention`):
    #: while the claim holds, no decision waits for a lookup's answers; False (or a broker
    #: that cannot claim) looks the id up before every decision instead
    claims: bool = True
    #: the oldest release line the requests must be read by (the ``compatible_with``
    #: setting): a request using a feature that line's nodes cannot read is refused at once
    compatible_with: str = RELEASE_LINES[-2]
    #: the features this requestor knows, by name (its release's)
    features: Mapping[str, Feature] = field(default_factory=lambda: FEATURES)


class LatencyEstimate:
    """Smoothed offer latency and its variation, as TCP estimates round-trip time (RFC
    6298): the wait for a first offer is ``mean + 4 * variation``."""

    def __init__(self) -> None:
        self.mean_s: float | None = None
        self.variation_s = 0.0
        self.samples = 0

    def add(self, sample_s: float) -> None:
        self.samples += 1
        if self.mean_s is None:
            self.mean_s, self.variation_s = sample_s, sample_s / 2
            return
        self.variation_s = 0.75 * self.variation_s + 0.25 * abs(self.mean_s - sample_s)
        self.mean_s = 0.875 * self.mean_s + 0.125 * sample_s


class RequestorState:
    """The state every part of one requestor machine reads and changes."""

    def __init__(self, config: RequestorConfig) -> None:
        self.config = config
        seed = config.sample_seed if config.sample_seed is not None else config.requestor_id
        self.roster = Roster(config.tiers, Sampler(seed))
        #: how often each way of asking ran: ``probes`` (messages), ``probe_rounds``,
        #: ``exhaustive_steps`` (broadcasts after sampling found too little, or with
        #: nothing to sample from), ``busy_retries``
        self.counters: Counter[str] = Counter()
        self.latency = LatencyEstimate()
        #: where the roster comes from: a keeper's samples or the announcements
        self.roster_source = RosterSource(
            SourceConfig(
                requestor_id=config.requestor_id,
                reply_to=config.reply_to,
                roll_call_topic=TierLadder.topic(config.tiers.percents[-1]),
                roster_from=config.roster_from,
                sample=config.keeper_sample,
                refresh_every=config.keeper_refresh_every,
                refresh_s=config.keeper_refresh_s,
                limit=config.roster_limit,
                ask_again_s=config.max_widen_s,
            ),
            self.roster,
            self.latency,
            self.counters,
        )
        #: conversations whose sampling found too little, waiting for a keeper's nodes
        #: with room: each goes on as a sample comes (or as the query reaches no keeper)
        self.awaiting_sample: set[str] = set()
        #: the conversations in flight, by request id
        self.active: dict[str, Conversation] = {}
        #: conversations holding their id's claim (ClaimState.HELD)
        self.claims_held = 0
        #: the request ids finished (the latest ``remember_finished``): their placement,
        #: or None for a failure
        self.finished: OrderedDict[str, Placement | None] = OrderedDict()
        #: the caller-chosen ids placed here, and when their placements were asked for:
        #: what to look up again when a node comes back holding ids of their buckets
        self.answers = AnsweredIds(config.remember_finished)
        self.frees = Freeing(
            sender=config.requestor_id,
            reply_to=config.reply_to,
            retry_s=config.free_retry_s,
            attempts=config.free_attempts,
            max_retry_s=config.max_free_retry_s,
        )
