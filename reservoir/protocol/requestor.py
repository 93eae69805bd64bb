"""The requestor's side of the protocol, as a state machine with no I/O.

One :class:`RequestorMachine` runs any number of concurrent conversations, one per request
id. Its driver calls :meth:`~RequestorMachine.start` once, then
:meth:`~RequestorMachine.place`, :meth:`~RequestorMachine.handle`,
:meth:`~RequestorMachine.on_unroutable` and :meth:`~RequestorMachine.on_timer` with the
current time and carries out the effects. It keeps a :class:`~reservoir.protocol.roster.Roster`
of the nodes and their tiers, from a roster keeper's samples or what nodes announce
(:mod:`reservoir.protocol.roster_source`). A conversation:

1. **probe** a few nodes sampled from the roster, emptiest tiers first
   (``max(min_probes, ceil(probe_factor * count))`` of them), each with the request sent
   to it alone; every probed node answers (an offer or a compact decline), so the
   requestor decides the moment all have answered. Not enough offers: probe again, twice
   as many nodes not asked yet, up to ``probe_rounds`` rounds. Then, or at once when the
   roster is empty or the request needs an affinity group's host, the **exhaustive
   step**: **broadcast** the request on the first tier's topic, so no node that could
   take it is left unasked (sampling never causes a false failure);
2. **collect** offers: the first offer of an attempt opens a short window (as long again as
   that offer took, within bounds) for the others; a probe round closes early once every
   probed node has answered;
3. **decide** when the window closes: enough slots offered -> **award** the winners chosen
   by the policy, keep the best spare, **release** the rest; not enough -> **widen** to the
   next tier, keeping what is held (tiers are cumulative, so nodes that already offered
   hear the request again and repeat the same offer). Nobody answering at all widens too:
   at once when the broker says no node is bound to the tier, otherwise after a wait that
   the observed offer latency sets (``max_widen_s`` at most);
4. **accept**: each winner answers ``Accepted`` (done when all have) or ``Refused`` (award
   the spare, or broadcast again); an award with no answer is re-sent, and given up (with a
   ``Free`` to make sure nothing stays behind) once the reservation must have expired;
5. past the last tier: retry shortly if nodes said they were only busy with others'
   reservations, take a partial placement if ``min_count`` allows, start over after a
   pause if no node answered this pass (an outage is no verdict), otherwise **fail** with
   an explanation and release everything held.

The machine is put together from smaller ones, a module each: a conversation's state and
the table of its phases (:mod:`reservoir.protocol.conversation`), the request id's
contention with other requestors (:mod:`reservoir.protocol.contention`), the frees re-sent
until nodes confirm (:mod:`reservoir.protocol.freeing`), the roster
(:mod:`reservoir.protocol.roster`) and typed timer keys (:mod:`reservoir.protocol.timers`).
This module holds what ties them together: probing, broadcasting, deciding, accepting.

The request id is an idempotency key: placing an id that is in flight joins it, placing an
id that was placed returns that placement, and a node that already holds allocations for
the id says so (``AlreadyPlaced``), so even a restarted requestor never places twice. A
caller-chosen id is also looked up (``Lookup`` on the id's bucket topic) before each
decision, *after* the offers it would award were made: two requestors placing one id at
once each hold reservations before they look, so at least one finds the other's. A holder
that was away during the lookup is found when it is back: its status names the buckets of
what it holds, the caller-chosen ids placed here in those buckets are looked up again,
and of two placements of one id the one asked for later stands (``requested_at_s``; the
earlier one is freed, or, when ours is the earlier, ours is forgotten).
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, OrderedDict
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

import msgspec.structs

from reservoir.protocol.answers import AnsweredIds
from reservoir.protocol.compatibility import (
    FEATURES,
    RELEASE_LINES,
    Feature,
    line_key,
    needed_by,
    reads_features,
)
from reservoir.protocol.contention import ClaimState, IdContention, LookupOutcome
from reservoir.protocol.conversation import Awarded, Conversation, Event, Held, Phase
from reservoir.protocol.effects import (
    Bind,
    CancelTimer,
    Claim,
    Dropped,
    Effect,
    Failed,
    FreeCompleted,
    Placed,
    Publish,
    Send,
    SetTimer,
    Unclaim,
)
from reservoir.protocol.freeing import Freeing, FreeTarget
from reservoir.protocol.messages import (
    MESSAGE_CLASSES,
    REJOINED_TOPIC,
    AllocationInfo,
    Award,
    Decline,
    Lookup,
    Message,
    NodeStatus,
    Offer,
    Refused,
    Release,
    ReservationRequest,
    RollCall,
    RosterQuery,
    RosterSample,
    buckets_in,
    lookup_bucket,
    lookup_topic,
)
from reservoir.protocol.node import IN_FLIGHT_ELSEWHERE
from reservoir.protocol.placement import (
    Explanation,
    PlacedAllocation,
    Placement,
    PlacementError,
    PlacementRequest,
    PlacementTimeout,
    reason_label,
)
from reservoir.protocol.policies import Policy, Spread
from reservoir.protocol.roster import Roster, Sampler
from reservoir.protocol.roster_source import RosterFrom, RosterSource, SourceConfig
from reservoir.protocol.tiers import DEFAULT_LADDER, TierLadder
from reservoir.protocol.timers import PER_ATTEMPT, ConversationTimer, FreeTimer, TimerKind

__all__ = ["LatencyEstimate", "RequestorConfig", "RequestorMachine"]

#: latency samples before the widening wait follows the estimate instead of its maximum
_LATENCY_SAMPLES_TRUSTED: Final = 8
#: another requestor's reservation of an id is taken to live this long past a TTL from
#: when a node last reported it (timers fire late; a node's clock runs its own way)
_CONTENTION_MARGIN_S: Final = 1.0


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


class RequestorMachine:
    """Every conversation of one requestor. Not thread-safe: its driver serialises calls."""

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
        self._awaiting_sample: set[str] = set()
        self._active: dict[str, Conversation] = {}
        #: conversations holding their id's claim (ClaimState.HELD)
        self._claims_held = 0
        self._finished: OrderedDict[str, Placement | None] = OrderedDict()
        #: the caller-chosen ids placed here, and when their placements were asked for:
        #: what to look up again when a node comes back holding ids of their buckets
        self._answers = AnsweredIds(config.remember_finished)
        self._frees = Freeing(
            sender=config.requestor_id,
            reply_to=config.reply_to,
            retry_s=config.free_retry_s,
            attempts=config.free_attempts,
            max_retry_s=config.max_free_retry_s,
        )

    # -- observing ---------------------------------------------------------------------

    def in_flight(self) -> int:
        return len(self._active)

    def is_active(self, request_id: str) -> bool:
        return request_id in self._active

    def placement_of(self, request_id: str) -> Placement | None:
        return self._finished.get(request_id)

    def held_reservations(self) -> int:
        """Offers held (not yet awarded or released) across every conversation."""
        return sum(len(c.pool) for c in self._active.values())

    def forget(self, request_id: str) -> None:
        """Forget the placement remembered under ``request_id`` (the nodes no longer hold
        it: it was freed through another requestor), so that placing the id again asks
        the nodes rather than answering from memory. In flight: nothing to forget."""
        self._finished.pop(request_id, None)

    # -- driving -----------------------------------------------------------------------

    def start(self, now: float) -> list[Effect]:
        """Hear of nodes that are back, and fill the roster: from a keeper (one query),
        or from the announcements, asking every node once where it stands."""
        effects: list[Effect] = [Bind(REJOINED_TOPIC)]
        self.roster_source.start(now, effects)
        return effects

    def _on_sample(self, sample: RosterSample, now: float, effects: list[Effect]) -> None:
        """A keeper's sample: into the roster; placements waiting for one go on."""
        self.roster_source.heard_sample(sample, now, effects)
        self._resume_awaiting_sample(now, effects)

    def _resume_awaiting_sample(self, now: float, effects: list[Effect]) -> None:
        """Placements that waited for a keeper's nodes with room sample again now, on
        the news (a sample, or that no keeper is bound), not when their timer runs out."""
        waiting, self._awaiting_sample = self._awaiting_sample, set()
        for request_id in sorted(waiting):
            c = self._active.get(request_id)
            if c is not None and c.phase is Phase.BACKING_OFF and TimerKind.RETRY in c.armed:
                self._cancel_timer(c, TimerKind.RETRY, effects)
                self._retry(c, now, effects)

    def place(
        self,
        spec: PlacementRequest,
        request_id: str,
        now: float,
        timeout_s: float,
        *,
        traceparent: str | None = None,
        requested_at_s: float = 0.0,
    ) -> list[Effect]:
        """Start placing ``spec`` under ``request_id`` (joining or answering from memory
        when the id is known). ``traceparent`` goes with every request and award sent for
        it, so the nodes' spans join the caller's trace. ``requested_at_s`` is the wall
        clock now (seconds since the epoch; ``now`` is monotonic): it goes with every
        award, and should one id be placed twice, the placement asked for later stands."""
        effects: list[Effect] = []
        if request_id in self._active:
            return effects  # in flight: the caller joins it
        if self._frees.for_caller(request_id):
            raise ValueError(f"request {request_id} is being freed; place it again afterwards")
        # Tidying up after an earlier failed attempt stops here: whatever it left behind,
        # the nodes report as AlreadyPlaced and the new conversation adopts it.
        self._frees.stop_tidying(request_id, effects)
        previous = self._finished.get(request_id)
        if previous is not None:
            mismatch = _shape_mismatch(request_id, spec, previous.allocations)
            if mismatch:
                effects.append(
                    Failed(request_id, PlacementError(_refusal(request_id, spec, mismatch)))
                )
            else:
                effects.append(Placed(request_id, previous))
            return effects
        needs = needed_by(spec, self.config.features)
        if needs and not reads_features(self.config.compatible_with):
            note = self._unreadable(needs)
            effects.append(Failed(request_id, PlacementError(_refusal(request_id, spec, note))))
            return effects
        conversation = Conversation(
            request_id=request_id,
            spec=spec,
            started_at=now,
            deadline=now + timeout_s,
            ttl_s=self.config.ttl_s,
            target=spec.count,
            # A caller-chosen id may be placed, before or meanwhile, by another requestor,
            # on a node in any tier: every decision first looks it up.
            contention=IdContention(self.config.requestor_id, spec.request_id is not None),
            traceparent=traceparent,
            requested_at_s=requested_at_s,
            needs=needs,
        )
        # An affinity member belongs (or, soft, prefers to be) on the node that already
        # hosts its group, which may sit in any tier: only the widest tier reaches it.
        if spec.group is not None and spec.group.policy in ("affinity", "soft-affinity"):
            conversation.tier_index = len(self.config.tiers) - 1
        else:
            conversation.sampling = self.config.probe_rounds > 0
        self._active[request_id] = conversation
        self._set_timer(conversation, TimerKind.DEADLINE, conversation.deadline, effects)
        self.roster_source.placing(now, effects)
        if conversation.contention.looks_up and self.config.claims:
            self._claim(conversation, effects)  # then looked up, then asked
        else:
            self._broadcast(conversation, now, effects)
        return effects

    def _unreadable(self, needs: frozenset[str]) -> str:
        """Why a request needing ``needs`` is not placed while this requestor writes for
        a release line whose nodes cannot read a request that names what it needs."""
        features = [self.config.features[name] for name in sorted(needs)]
        line = max((f.line for f in features), key=line_key)
        what = ", ".join(f"{f.what} (since {f.line})" for f in features)
        return (
            f"the request uses {what}, which nodes of {self.config.compatible_with} cannot "
            f"read, and this requestor writes for {self.config.compatible_with} "
            f"(RESERVOIR_COMPATIBLE_WITH): set it to {line} once every node, keeper and "
            f"requestor runs {line} or later"
        )

    def on_claim(self, request_id: str, held: bool | None, now: float) -> list[Effect]:
        """The broker's answer to a conversation's :class:`Claim`: ``held``, refused
        (False: another requestor holds it), or None (the broker cannot claim, or the
        connection went meanwhile). Held, the id is looked up before any node is asked;
        refused, claimed again after a pause; None, placed as without claims."""
        effects: list[Effect] = []
        c = self._active.get(request_id)
        if c is None or c.contention.claim is not ClaimState.ASKED:
            if held:
                effects.append(Unclaim(request_id))  # over meanwhile: nobody needs it
            return effects
        if held is None:
            c.contention.claim = ClaimState.NONE
            self._broadcast(c, now, effects)
        elif held:
            c.contention.claim = ClaimState.HELD
            self._claims_held += 1
            # Nobody else can start placing the id now; has anyone placed it before, or
            # is a requestor that lost its claim still at it? Asked before any node holds
            # anything of ours, so that an unroutable answer means "nobody".
            self._send_lookup(c, now, effects, following=False)
        else:
            c.contention.claim = ClaimState.REFUSED
            c.note = "the same request id is being placed by another requestor"
            self._back_off(c, now, effects)
        return effects

    def claims_lost(self) -> None:
        """The broker connection went and came back: every claim held went with it, and
        another requestor may hold one now. The conversations go on looking their ids up
        before every decision."""
        for c in self._active.values():
            if c.contention.claim is ClaimState.HELD:
                c.contention.claim_lost()
        self._claims_held = 0

    @property
    def claims_held(self) -> int:
        """Conversations holding their id's claim: while there are some, the driver tells
        the machine when the broker connection was renewed (:meth:`claims_lost`)."""
        return self._claims_held

    def _claim(self, c: Conversation, effects: list[Effect]) -> None:
        c.contention.claim = ClaimState.ASKED
        c.enter(Event.CLAIM)
        effects.append(Claim(c.request_id))

    def free(self, placement: Placement, now: float) -> list[Effect]:
        """Free every allocation of ``placement`` (its instances were deleted)."""
        effects: list[Effect] = []
        request_id = placement.request_id
        self._finished.pop(request_id, None)
        by_address: dict[tuple[str, str], list[str]] = {}
        for allocation in placement.allocations:
            by_address.setdefault((allocation.address, allocation.node), []).append(
                allocation.allocation_id
            )
        if not by_address:
            effects.append(FreeCompleted(request_id, (), ()))
            return effects
        targets = [
            FreeTarget(address, node, tuple(sorted(ids)))
            for (address, node), ids in sorted(by_address.items())
        ]
        self._frees.free(request_id, targets, now, effects, notify=True)
        return effects

    def free_on_node(
        self,
        request_id: str,
        node: str,
        address: str,
        allocation_ids: tuple[str, ...],
        now: float,
    ) -> list[Effect]:
        """Free a request's allocations on one node: those named, or (none named) all it
        holds there. For operators who know the request and the node, not the placement."""
        effects: list[Effect] = []
        self._finished.pop(request_id, None)
        target = FreeTarget(address, node, tuple(sorted(allocation_ids)))
        self._frees.free(request_id, [target], now, effects, notify=True)
        return effects

    def abandon(self, now: float) -> list[Effect]:
        """Give up on everything in flight (the requestor is closing): each conversation
        fails and lets go of what it holds."""
        effects: list[Effect] = []
        for conversation in list(self._active.values()):
            conversation.note = "the requestor closed"
            self._fail(conversation, now, effects, timed_out=False)
        return effects

    def handle(self, message: Message, now: float) -> list[Effect]:
        effects: list[Effect] = []
        # Dispatched on the wire's discriminator, not by isinstance: a status, the message
        # a requestor hears most (every node's announcements), would go through a test per
        # kind before its branch (docs/performance.md, under reservoir simulate).
        if type(message) not in MESSAGE_CLASSES:
            effects.append(
                Dropped("unexpected", f"a requestor does not take a {type(message).__name__}")
            )
        elif message.kind == "status":
            self._on_status(message, now, effects)
        elif message.kind == "offer":
            # Every answer tells of the node's room: the roster's news at no cost.
            self.roster.note_room(message.sender, message.room)
            self._heard_answer(message.request_id)
            self._on_offer(message, now, effects)
        elif message.kind == "decline":
            self.roster.note_room(message.sender, message.room)
            self._heard_answer(message.request_id)
            self._on_decline(message, now, effects)
        elif message.kind == "accepted":
            self.roster.note_room(message.sender, message.room)
            self._heard_answer(message.request_id)
            self._on_accepted(
                message.request_id,
                message.sender,
                message.reply_to,
                message.allocations,
                now,
                effects,
                reservation_id=message.reservation_id,
                requested_at_s=None,
            )
        elif message.kind == "already_placed":
            c = self._heard_answer(message.request_id)
            if c is not None:  # a probed node's whole answer, whatever comes of it
                c.expected.discard(message.sender)
            self._on_accepted(
                message.request_id,
                message.sender,
                message.reply_to,
                message.allocations,
                now,
                effects,
                reservation_id=None,
                owner=message.owner,
                requested_at_s=message.requested_at_s,
            )
        elif message.kind == "refused":
            self._heard_answer(message.request_id)
            self._on_refused(message, now, effects)
        elif message.kind == "freed":
            self.roster.note_room(message.sender, message.room)
            self._frees.on_freed(message, effects)
        elif message.kind == "roster_sample":
            self._on_sample(message, now, effects)
        elif message.kind == "keeper_up":
            self.roster_source.heard_keeper_up(now, effects)
        else:
            effects.append(Dropped("unexpected", f"a requestor does not take {message.kind!r}"))
        return effects

    def _heard_answer(self, request_id: str) -> Conversation | None:
        """A node answered a request: the path to the nodes works (see ``_widen``)."""
        conversation = self._active.get(request_id)
        if conversation is not None:
            conversation.heard_answer()
        return conversation

    def _on_status(self, message: NodeStatus, now: float, effects: list[Effect]) -> None:
        # The first answers to the roll call time the network: without them a new
        # requestor would wait the longest widening wait at every silent tier.
        self.roster_source.heard_status(message, now)
        if message.leaving:
            self.roster.remove(message.sender)
        else:
            self.roster.update(
                message.sender,
                message.reply_to,
                message.tier,
                message.room,
                release=message.release,
                features=message.features,
            )
        if message.rejoined_buckets:
            self._look_up_again(message.rejoined_buckets, effects)

    def _look_up_again(self, bitmap: bytes, effects: list[Effect]) -> None:
        """A node is back holding caller-chosen ids of these buckets. While it was away, a
        lookup could not find them: one of them may have been placed again, by us. Look
        up each id we placed there (freed since or not), and each one in flight (its own
        lookup may be behind it); a node holding an earlier placement of it answers
        ``AlreadyPlaced``, and ``_on_accepted`` frees that or adopts it."""
        buckets = set(buckets_in(bitmap))
        ids = self._answers.in_buckets(buckets)
        ids.update(
            request_id
            for request_id, c in self._active.items()
            if c.contention.looks_up and lookup_bucket(request_id) in buckets
        )
        for request_id in sorted(ids):
            self.counters["lookups_again"] += 1
            lookup = Lookup(
                request_id=request_id,
                sender=self.config.requestor_id,
                reply_to=self.config.reply_to,
                following=True,
            )
            effects.append(Publish(lookup_topic(request_id), lookup))

    def on_unroutable(self, message: Message, now: float) -> list[Effect]:
        """Our publish reached no node: nobody is at that tier, so widen at once."""
        effects: list[Effect] = []
        conversation = self._active.get(message.request_id)
        if isinstance(message, Lookup) and conversation is not None:
            if conversation.phase is Phase.CLAIMING:
                # asked under the claim, before any node held anything of ours
                conversation.contention.clear = conversation.contention.claim is ClaimState.HELD
            self._lookup_over(conversation, now, effects)  # no node at all: nobody holds it
            return effects
        if isinstance(message, RollCall):
            return effects  # no node is up yet: they announce themselves as they start
        if isinstance(message, RosterQuery):
            # No keeper is bound: keep a roster of our own, as without keepers, and
            # whoever waited for a keeper's nodes asks every node now.
            self.roster_source.query_unroutable(now, effects)
            self._resume_awaiting_sample(now, effects)
            return effects
        if not isinstance(message, ReservationRequest):
            effects.append(Dropped("unroutable", f"{message.kind} for {message.request_id}"))
            return effects
        if message.probed_node is not None:
            # The node's inbox is gone: it stopped, or died without saying so.
            self.roster.remove(message.probed_node)
        if conversation is None or message.attempt != conversation.attempt:
            effects.append(
                Dropped("late_unroutable", f"attempt {message.attempt} of {message.request_id}")
            )
            return effects
        if message.probed_node is not None:
            self._heard_from(conversation, message.probed_node, message.attempt, now, effects)
        else:
            self._nobody_came(conversation, now, effects)
        return effects

    def on_refused_answer(
        self, request_id: str, sender: str, attempt: int, now: float
    ) -> list[Effect]:
        """An offer or decline the driver refused for the key that signed it (another
        node's: a node started with the wrong key). Nothing in it is believed, but a node
        answered: the tier is decided as soon as its other answers are in, rather than
        waited out to the widening wait for an offer that will never be usable."""
        effects: list[Effect] = []
        c = self._heard_answer(request_id)
        if c is not None:
            if not c.note:
                c.note = f"an answer signed in the name of {sender} was refused (its key)"
            self._answered(c, attempt, now, effects)
            self._heard_from(c, sender, attempt, now, effects)
        return effects

    def on_timer(self, key: Hashable, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if type(key) is FreeTimer:
            self._frees.on_timer(key, now, effects)
            return effects
        if type(key) is not ConversationTimer:
            return effects
        c = self._active.get(key.request_id)
        if c is None:
            return effects  # over
        kind = key.kind
        if c.armed.get(kind) == key:
            del c.armed[kind]  # fired: nothing left to cancel
        if kind in PER_ATTEMPT and key.attempt != c.attempt:
            return effects  # an earlier attempt's
        if kind is TimerKind.DEADLINE:
            c.note = f"timed out; {c.note}" if c.note else "timed out"
            self._fail(c, now, effects, timed_out=True)
        elif kind is TimerKind.COLLECT:
            self._decide(c, now, effects)
        elif kind is TimerKind.WIDEN:
            self._nobody_came(c, now, effects)
        elif kind is TimerKind.AWARD:
            self._chase_awards(c, now, effects)
        elif kind is TimerKind.LOOKUP:
            self._lookup_over(c, now, effects)
        elif kind is TimerKind.RETRY and c.phase is Phase.BACKING_OFF:
            if c.contention.claim is ClaimState.REFUSED:
                self._claim(c, effects)
            else:
                self._retry(c, now, effects)
        return effects

    def _retry(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Ask again after backing off: the busy nodes alone, or from the roster."""
        self._awaiting_sample.discard(c.request_id)
        c.start_pass()
        busy = list(c.busy_nodes.items())
        c.busy_nodes.clear()
        if busy and not c.contention.defers_to_others():
            # Only the busy nodes were short, of room others' reservations held: ask
            # them again, alone, rather than the whole tier.
            self.counters["busy_retries"] += 1
            self._probe_nodes(c, busy, now, effects)
        else:
            self._broadcast(c, now, effects)

    # -- broadcasting and collecting ---------------------------------------------------

    def _broadcast(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Ask again: probe sampled nodes while sampling rounds remain, else broadcast on
        the conversation's tier (following another requestor's placement: look it up)."""
        config = self.config
        if c.contention.following is not None:
            self._follow(c, now, effects)
            return
        if c.sampling:
            if c.probe_round < config.probe_rounds:
                wanted = max(config.min_probes, math.ceil(config.probe_factor * c.needed()))
                members = self.roster.sample(
                    wanted * 2**c.probe_round,
                    up_to_tier_index=len(config.tiers) - 1,
                    exclude=c.probed,
                    needs=c.spec.resources,
                    features=c.needs,
                )
                if members:
                    c.probe_round += 1
                    self.counters["probe_rounds"] += 1
                    self._probe_nodes(c, [(m.name, m.address) for m in members], now, effects)
                    return
                if (
                    self.roster_source.may_wait_for_room()
                    and c.sample_waits < config.keeper_shape_rounds
                ):
                    # Before asking every node, ask a keeper for nodes we have not seen.
                    self._wait_for_sample(c, now, effects)
                    return
            # Sampling found too little (or nothing to sample): ask every node, tier by
            # tier, so that no node where the request fits goes unasked.
            c.sampling = False
            c.exhaustive = True
            self.counters["exhaustive_steps"] += 1
        c.enter(Event.BROADCAST)
        self._new_attempt(c, now, effects)
        tier = config.tiers.percents[c.tier_index]
        effects.append(Publish(TierLadder.topic(tier), self._request(c, tier)))
        # Before the last tier's verdict (failure) the wait is longer than the one that
        # only decides to look wider: a slow moment of the network or of a busy process
        # must not fail a request that offers were already on their way to.
        wait_s = self._widen_wait_s()
        if c.tier_index == len(config.tiers) - 1:
            wait_s = min(max(wait_s * config.verdict_factor, config.min_verdict_s),
                         config.max_widen_s)  # fmt: skip
        self._set_timer(c, TimerKind.WIDEN, now + wait_s, effects)

    def _wait_for_sample(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Sampling found too little: ask a keeper for nodes whose room may fit and
        sample again once it answers, rather than ask every node at once."""
        self.counters["sample_waits"] += 1
        wanted = self.config.keeper_shape_sample * 2**c.sample_waits
        c.sample_waits += 1
        self.roster_source.ask_for_room(c.spec.resources, wanted, now, effects)
        c.enter(Event.BACK_OFF)
        # The keepers' answer (or the news that none is bound) ends the wait; the timer
        # only stands for a keeper that is bound and does not answer.
        self._awaiting_sample.add(c.request_id)
        self._set_timer(c, TimerKind.RETRY, now + self._widen_wait_s(), effects)

    def _request(self, c: Conversation, tier: int) -> ReservationRequest:
        if tier not in c.tiers_tried:
            # in the ladder's order, as a broadcast widens, whichever asked first (a probe
            # round asks up to the widest tier of the nodes it samples)
            bisect.insort(c.tiers_tried, tier)
        return ReservationRequest(
            request_id=c.request_id,
            sender=self.config.requestor_id,
            reply_to=self.config.reply_to,
            tier=tier,
            attempt=c.attempt,
            ttl_s=c.ttl_s,
            findable=c.contention.looks_up,
            # a task's output and end are asked for by id, from anywhere (reservoir logs)
            findable_when_placed=(self.config.findable or c.spec.task is not None)
            and not c.contention.looks_up,
            declines_wanted=c.exhaustive,
            traceparent=c.traceparent,
            needs=c.needs,
            **c.spec.shape_fields(),
        )

    def _new_attempt(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        self._cancel_timer(c, TimerKind.COLLECT, effects)
        self._cancel_timer(c, TimerKind.WIDEN, effects)
        c.attempt += 1
        c.collect_timer_set = False
        c.broadcast_at = now
        c.expected.clear()

    def _set_timer(
        self, c: Conversation, kind: TimerKind, at: float, effects: list[Effect]
    ) -> None:
        key = c.armed[kind] = self._timer(c, kind)
        effects.append(SetTimer(key, at))

    @staticmethod
    def _cancel_timer(c: Conversation, kind: TimerKind, effects: list[Effect]) -> None:
        """Cancel the conversation's timer of ``kind``, if one is armed. Only armed timers
        are cancelled: a conversation cancels its collect and widen timers at every
        attempt and all six kinds when it ends, and a cancel for a timer never set was
        an effect (and a driver operation) for nothing, ten of them per placement."""
        key = c.armed.pop(kind, None)
        if key is not None:
            effects.append(CancelTimer(key))

    @staticmethod
    def _timer(c: Conversation, kind: TimerKind) -> ConversationTimer:
        attempt = c.attempt if kind in PER_ATTEMPT else 0
        return ConversationTimer(c.request_id, kind, attempt)

    def _probe_nodes(
        self,
        c: Conversation,
        nodes: list[tuple[str, str]],
        now: float,
        effects: list[Effect],
    ) -> None:
        """Send the request to each of ``nodes`` (name, address) alone, as one attempt
        that is decided the moment every one of them has answered."""
        c.enter(Event.PROBE)
        self._new_attempt(c, now, effects)
        tiers = (self.roster.tier_index_of(name) for name, _ in nodes)
        widest = max((t for t in tiers if t is not None), default=0)
        request = self._request(c, self.config.tiers.percents[widest])
        for name, address in nodes:
            c.probed.add(name)
            c.expected.add(name)
            effects.append(Send(address, msgspec.structs.replace(request, probed_node=name)))
        self.counters["probes"] += len(nodes)
        # Every probed node answers, and a probe to a node that is gone comes back: this
        # wait only covers a lost answer, so it is the longest one. A short one would
        # give up on a busy moment's answers and ask more nodes, adding to the load.
        self._set_timer(c, TimerKind.WIDEN, now + self.config.max_widen_s, effects)

    def _heard_from(
        self, c: Conversation, node: str, attempt: int, now: float, effects: list[Effect]
    ) -> None:
        """A probed node answered (or its probe came back): once all have, decide."""
        if attempt != c.attempt or node not in c.expected:
            return
        c.expected.discard(node)
        if not c.expected and c.collecting:
            self._cancel_timer(c, TimerKind.COLLECT, effects)
            self._nobody_came(c, now, effects)

    def _look_up(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Ask the nodes of the id's lookup bucket whether anyone holds it already; decide
        nothing until every holder could have answered."""
        self._send_lookup(c, now, effects, following=False)

    def _follow(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Ask the id's lookup bucket again what is placed of the id, contending for
        nothing."""
        c.enter(Event.FOLLOW)
        self._send_lookup(c, now, effects, following=True)

    def _send_lookup(
        self, c: Conversation, now: float, effects: list[Effect], *, following: bool
    ) -> None:
        lookup = Lookup(
            request_id=c.request_id,
            sender=self.config.requestor_id,
            reply_to=self.config.reply_to,
            following=following,
        )
        effects.append(Publish(lookup_topic(c.request_id), lookup))
        until = now + self._lookup_wait_s()
        c.contention.lookup_sent(c.attempt, until, following=following)
        self._set_timer(c, TimerKind.LOOKUP, until, effects)

    def _lookup_wait_s(self) -> float:
        return min(self._widen_wait_s(), self.config.max_lookup_s)

    def _lookup_over(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        outcome = c.contention.lookup_over()
        if c.phase is Phase.CLAIMING:
            # The lookup under the claim is over: ask the nodes (or follow the placement
            # it found, whose holders answered "already placed").
            self._broadcast(c, now, effects)
            return
        if outcome is LookupOutcome.OWNER_GONE:
            # Nobody holds any of it any more: the owner failed and let go. Place it
            # ourselves, from scratch.
            for allocation_id in c.contention.adopted:
                c.placed.pop(allocation_id, None)
            c.contention.adopted.clear()
            c.start_pass()
            self._broadcast(c, now, effects)
        elif outcome is LookupOutcome.DECIDE:
            self._decide(c, now, effects)

    def _widen_wait_s(self) -> float:
        estimate = self.latency
        config = self.config
        if estimate.mean_s is None or estimate.samples < _LATENCY_SAMPLES_TRUSTED:
            return config.max_widen_s
        wait = estimate.mean_s + 4 * estimate.variation_s
        return min(max(wait, config.min_widen_s), config.max_widen_s)

    def _on_offer(self, offer: Offer, now: float, effects: list[Effect]) -> None:
        c = self._active.get(offer.request_id)
        if c is None:
            # Late: the request is decided or unknown. Let the node go at once rather than
            # make it wait out the reservation.
            effects.append(
                Send(
                    offer.reply_to,
                    Release(
                        request_id=offer.request_id,
                        sender=self.config.requestor_id,
                        reservation_id=offer.reservation_id,
                    ),
                )
            )
            effects.append(Dropped("late_offer", f"{offer.reservation_id} for {offer.request_id}"))
            return
        self._answered(c, offer.attempt, now, effects)
        if offer.reservation_id in c.seen:
            effects.append(Dropped("duplicate_offer", offer.reservation_id))
            self._heard_from(c, offer.sender, offer.attempt, now, effects)
            return
        c.seen.add(offer.reservation_id)
        c.offers_received += 1
        if offer.group_members:
            c.group_hosts[offer.sender] = offer.group_members
        c.pool[offer.reservation_id] = Held(
            offer, usable_until=now + offer.ttl_s - self.config.award_margin_s
        )
        if not c.collecting:
            # Between awards and acceptances, or backing off: use it if there is a gap to
            # fill, else let it go.
            if c.needed() > 0:
                self._decide(c, now, effects)
            else:
                self._release_surplus(c, effects, keep_spares=True)
            return
        self._heard_from(c, offer.sender, offer.attempt, now, effects)

    def _answered(self, c: Conversation, attempt: int, now: float, effects: list[Effect]) -> None:
        """The first answer to a broadcast, offer or decline, even a repeat of an offer we
        hold (a node that heard an earlier tier hears this one too), opens the collect
        window: the other nodes of the tier answer within about as long again. A probe
        round needs no window (it is decided when every probed node has answered); its
        first answer is only timed."""
        if attempt != c.attempt or c.collect_timer_set or not c.collecting:
            return
        latency_s = now - c.broadcast_at
        self.latency.add(latency_s)
        c.collect_timer_set = True
        if c.phase is Phase.PROBING:
            return
        window_s = max(latency_s, self.latency.mean_s or 0.0) * self.config.collect_factor
        window_s = min(max(window_s, self.config.min_collect_s), self.config.max_collect_s)
        self._set_timer(c, TimerKind.COLLECT, now + window_s, effects)

    def _on_decline(self, decline: Decline, now: float, effects: list[Effect]) -> None:
        c = self._active.get(decline.request_id)
        if c is None:
            effects.append(Dropped("late_decline", decline.request_id))
            return
        self._answered(c, decline.attempt, now, effects)
        c.declines[decline.sender] = decline
        if decline.busy:
            c.busy_nodes[decline.sender] = decline.reply_to
        if decline.group_members:
            c.group_hosts[decline.sender] = decline.group_members
        for reason in decline.reasons:
            # Another requestor is placing the same id. Exactly one of us must go on: the
            # one whose id sorts first. The other stands back, then asks again and hears
            # "AlreadyPlaced" (or, if the first failed, places it itself).
            if reason.code == IN_FLIGHT_ELSEWHERE:
                # its reservation lives a TTL at most (ours and theirs are alike)
                alive_until = now + c.ttl_s + _CONTENTION_MARGIN_S
                c.contention.in_flight_elsewhere(reason.subject or "", alive_until=alive_until)
        self._heard_from(c, decline.sender, decline.attempt, now, effects)

    def _nobody_came(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """The tier's wait ran out, the broker said nobody is bound to it, or every
        probed node has answered."""
        if not c.collecting:
            return
        if self._usable(c, now, effects):
            self._decide(c, now, effects)
        else:
            self._widen(c, now, effects)

    def _usable(self, c: Conversation, now: float, effects: list[Effect]) -> list[Held]:
        """Offers still worth awarding; the ones about to expire are released."""
        usable = []
        for reservation_id, held in list(c.pool.items()):
            if held.usable_until <= now:
                del c.pool[reservation_id]
                effects.append(self._release(c, held.offer))
            else:
                usable.append(held)
        return usable

    # -- deciding ----------------------------------------------------------------------

    def _decide(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        if c.phase is Phase.CLAIMING:
            return  # nothing is decided before the lookup under the claim is over
        if c.contention.looking_up():
            c.contention.decision_due = True  # holders of an earlier placement may yet answer
            return
        own = bool(c.awards) or bool(c.placed.keys() - c.contention.adopted)
        needed = c.needed()
        if not own and needed > 0 and c.contention.defers_to_others():
            # Nothing of our own is awarded or placed, and another requestor has
            # precedence or owns part of the placement already: let it finish first.
            self._stand_back(c, now, effects)
            return
        usable = self._usable(c, now, effects)
        if needed <= 0:
            self._release_surplus(c, effects, keep_spares=bool(c.awards))
            self._maybe_complete(c, now, effects)
            return
        candidates, why_not = self._eligible(c, usable)
        if sum(h.offer.slots for h in candidates) >= needed:
            if c.contention.must_look_up(c.attempt):
                self._look_up(c, now, effects)  # then decide again
                return
            self._award(c, candidates, needed, now, effects)
        elif c.collecting:
            if why_not:
                c.note = why_not
            self._widen(c, now, effects)
        elif c.phase is Phase.AWARDING:
            # A refusal (or an award given up) left a gap and nothing held can fill it:
            # ask again.
            c.start_pass()
            self._broadcast(c, now, effects)
        # BACKING_OFF, FOLLOWING: the retry timer or the lookup asks again

    def _eligible(self, c: Conversation, usable: list[Held]) -> tuple[list[Held], str]:
        """Hard affinity narrows the offers to the node that hosts the group, if any
        node said it does; with no host yet, to offers that can take every instance."""
        group = c.spec.group
        if group is None or group.policy != "affinity":
            return usable, ""
        if c.group_hosts or c.placed:
            hosts = set(c.group_hosts) | {p.node for p in c.placed.values()}
            eligible = [h for h in usable if h.offer.sender in hosts]
            why = f"affinity group {group.name} lives on {', '.join(sorted(hosts))}"
            return eligible, "" if eligible else why + ", which cannot take more"
        needed = c.needed()
        return [h for h in usable if h.offer.slots >= needed], ""

    def _award(
        self,
        c: Conversation,
        candidates: list[Held],
        needed: int,
        now: float,
        effects: list[Effect],
    ) -> None:
        by_id = {h.offer.reservation_id: h for h in candidates}
        choice = self.config.policy.choose([h.candidate() for h in candidates], needed)
        if c.spec.group is not None and c.spec.group.policy == "affinity" and len(choice) > 1:
            # All of an affinity request's instances go to one node.
            best = next(h for h in candidates if h.offer.slots >= needed)
            choice = [(best.candidate(), needed)]
        for candidate, slots in choice:
            held = by_id[candidate.reservation_id]
            del c.pool[candidate.reservation_id]
            c.awards[candidate.reservation_id] = Awarded(held.offer, slots, now, now)
            effects.append(self._award_message(c, held.offer, slots))
        c.enter(Event.AWARD)
        self._cancel_timer(c, TimerKind.COLLECT, effects)
        self._cancel_timer(c, TimerKind.WIDEN, effects)
        self._set_timer(c, TimerKind.AWARD, now + self.config.award_retry_s, effects)
        self._release_surplus(c, effects, keep_spares=True)

    def _award_message(self, c: Conversation, offer: Offer, slots: int) -> Send:
        return Send(
            offer.reply_to,
            Award(
                request_id=c.request_id,
                sender=self.config.requestor_id,
                reply_to=self.config.reply_to,
                reservation_id=offer.reservation_id,
                slots=slots,
                traceparent=c.traceparent,
                requested_at_s=c.requested_at_s,
                # the placement's size, so that whoever finds the id knows when every
                # holder has answered (it only shrinks: min_count lowers it at the end)
                instances=c.target,
            ),
        )

    def _release(self, c: Conversation, offer: Offer) -> Send:
        return Send(
            offer.reply_to,
            Release(
                request_id=c.request_id,
                sender=self.config.requestor_id,
                reservation_id=offer.reservation_id,
            ),
        )

    def _release_surplus(self, c: Conversation, effects: list[Effect], keep_spares: bool) -> None:
        """Release held offers, keeping the best ``spare_slots`` worth while awards are
        unanswered (a refusal can then be covered without a new broadcast)."""
        keep: set[str] = set()
        if keep_spares and self.config.spare_slots > 0:
            ranked = self.config.policy.choose(
                [h.candidate() for h in c.pool.values()], self.config.spare_slots
            )
            keep = {candidate.reservation_id for candidate, _ in ranked}
        for reservation_id, held in list(c.pool.items()):
            if reservation_id not in keep:
                del c.pool[reservation_id]
                effects.append(self._release(c, held.offer))

    def _stand_back(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Another requestor with precedence is placing this id: let go of what we hold
        and ask again after a pause."""
        c.note = c.contention.stand_back()
        for held in c.pool.values():
            effects.append(self._release(c, held.offer))
        c.pool.clear()
        self._back_off(c, now, effects)

    def _back_off(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        c.enter(Event.BACK_OFF)
        backoff_s = min(self.config.busy_retry_s * 2**c.busy_rounds, self.config.max_busy_retry_s)
        c.busy_rounds += 1
        self._cancel_timer(c, TimerKind.COLLECT, effects)
        self._cancel_timer(c, TimerKind.WIDEN, effects)
        self._set_timer(c, TimerKind.RETRY, now + backoff_s, effects)

    def _widen(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        if c.sampling:
            self._broadcast(c, now, effects)  # the next sampling round, or every node
            return
        if c.tier_index + 1 < len(self.config.tiers):
            c.tier_index += 1
            self._broadcast(c, now, effects)
            return
        if c.contention.yield_to and now < c.deadline:
            self._stand_back(c, now, effects)
            return
        have = len(c.placed) + c.awarded_slots()
        held = sum(h.offer.slots for h in self._eligible(c, self._usable(c, now, effects))[0])
        if c.busy_nodes and now + self.config.busy_retry_s < c.deadline:
            # Every tier is tried, but some nodes only lacked room that other requests'
            # reservations hold: those free up within a TTL, so ask again shortly.
            self._back_off(c, now, effects)
            return
        minimum = c.spec.min_count
        if minimum is not None and have + held >= minimum:
            c.target = have + held
            if held:
                self._decide(c, now, effects)
            else:
                self._maybe_complete(c, now, effects)
            return
        # Fail only once holders of an earlier placement could have said "placed".
        if c.contention.looking_up():
            c.contention.decision_due = True
            return
        if c.contention.must_look_up(c.attempt):
            self._look_up(c, now, effects)
            return
        if c.contention.contended(now) and now + self.config.max_busy_retry_s < c.deadline:
            # Another requestor's reservation of this id may still become its placement
            # (which we then adopt) or expire (and leave the room to us): no verdict yet.
            # Its requestor may also be dead (killed mid-conversation): then only the TTL
            # settles it. Found by the chaos runs.
            c.note = c.note or "the same request id is being placed by another requestor"
            self._back_off(c, now, effects)
            return
        if not c.heard_in_pass() and now + self._unheard_backoff_s(c) < c.deadline:
            # Not one node answered this pass, not even to decline: this is no verdict on
            # the request, the path to the nodes is down (our connection or theirs lost,
            # the broker restarting, nodes restarting). Failing now would fail a request
            # that fits because of a moment's outage, and would leave behind whatever
            # became of an allocation we did not hear of (a dead predecessor's late
            # award, adopted once the nodes are heard again): start over shortly, until
            # the deadline. Answers to earlier passes do not count: they are no verdict
            # on this one.
            self._start_over(c, now, effects)
            return
        grown = [] if c.rooms_rechecked else self.roster.roomier_since(c.declines, c.spec.resources)
        if c.needs:
            grown = [m for m in grown if c.needs <= m.features]
        if grown:
            # A node that declined has told of more room since (an instance it held
            # ended while the tiers were asked): ask it alone before failing, or the
            # verdict "no valid host" would be out of date when it is given. Once per
            # conversation, so a node that keeps changing cannot hold the verdict off.
            c.rooms_rechecked = True
            self.counters["room_rechecks"] += 1
            self._probe_nodes(c, [(m.name, m.address) for m in grown], now, effects)
            return
        self._fail(c, now, effects, timed_out=False)

    def _unheard_backoff_s(self, c: Conversation) -> float:
        config = self.config
        return min(config.unheard_retry_s * 2.0**c.unheard_rounds, config.max_unheard_retry_s)

    def _start_over(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Ask from the first tier again after a pause (sampling from the roster again)."""
        backoff_s = self._unheard_backoff_s(c)
        c.unheard_rounds += 1
        self.counters["unheard_retries"] += 1
        c.note = f"no node answered in {c.unheard_rounds} round(s) over every tier"
        affinity = c.spec.group is not None and c.spec.group.policy in ("affinity", "soft-affinity")
        c.tier_index = len(self.config.tiers) - 1 if affinity else 0
        c.sampling = not affinity and self.config.probe_rounds > 0
        c.probe_round = 0
        c.probed.clear()
        c.enter(Event.BACK_OFF)
        self._cancel_timer(c, TimerKind.COLLECT, effects)
        self._cancel_timer(c, TimerKind.WIDEN, effects)
        self._set_timer(c, TimerKind.RETRY, now + backoff_s, effects)

    # -- accepting ---------------------------------------------------------------------

    def _on_accepted(
        self,
        request_id: str,
        node: str,
        address: str,
        allocations: Iterable[AllocationInfo],
        now: float,
        effects: list[Effect],
        *,
        reservation_id: str | None,
        owner: str | None = None,
        requested_at_s: float | None,
    ) -> None:
        """Allocations a node reports: accepted after our award (``reservation_id``), or
        found already placed (``requested_at_s``: when their placement was asked for;
        None for our own award's)."""
        allocations = tuple(allocations)
        ours = reservation_id is not None or owner == self.config.requestor_id
        c = self._active.get(request_id)
        if c is None:
            placement = self._finished.get(request_id)
            known = {a.allocation_id for a in placement.allocations} if placement else set()
            stray = tuple(a.allocation_id for a in allocations if a.allocation_id not in known)
            # Another placement of an id we placed (freed since or not), asked for before
            # ours: the id was placed twice (its holder away when we looked it up), and our
            # caller holds ours.
            at_s = self._answers.requested_at_s(request_id)
            superseded = later = False
            if requested_at_s is not None and at_s is not None:
                superseded, later = requested_at_s < at_s, requested_at_s > at_s
            # Ours but asked for later than our answer: part of a placement that stands
            # now (another requestor may have adopted it), not ours to free.
            if stray and (superseded or (ours and not later)):
                # Allocations for a request that failed, or that is placed without them,
                # or superseded: free them so nothing stays allocated that nobody holds.
                self._frees.free(request_id, [FreeTarget(address, node, stray)], now, effects)
                if not ours:
                    self.counters["superseded_frees"] += 1
                effects.append(
                    Dropped(
                        "late_accept",
                        f"freeing {len(stray)} allocation(s) of {request_id} on {node}",
                    )
                )
            elif stray and later and placement is not None:
                # A later placement of an id we answered for: it stands, and its caller
                # holds it. Forget ours, so that a retry here looks the id up and adopts
                # it (the requestor that placed it frees ours, as the branch above).
                self._finished.pop(request_id, None)
                self.counters["superseded_placements"] += 1
                effects.append(Dropped("superseded", f"{request_id} placed again on {node}"))
            else:
                effects.append(Dropped("duplicate_accept", f"{request_id} on {node}"))
            return
        if reservation_id is not None:
            award = c.awards.get(reservation_id)
            if award is not None and award.offer.sender != node:
                effects.append(Dropped("foreign_accept", f"{reservation_id} from {node}"))
                return
            c.awards.pop(reservation_id, None)
        abandoned = reservation_id is not None and reservation_id in c.abandoned
        surplus = []
        for info in allocations:
            if info.allocation_id in c.placed:
                continue
            if abandoned or len(c.placed) >= c.target:
                surplus.append(info.allocation_id)
                continue
            if reservation_id is None:
                # Placed already; if another requestor holds (part of) this placement, it
                # finishes it and we follow until it is whole.
                c.contention.placed_already(info.allocation_id, owner, ours)
            stamp_s = c.requested_at_s if requested_at_s is None else requested_at_s
            c.placed_at_s = max(c.placed_at_s, stamp_s) if c.placed else stamp_s
            c.placed[info.allocation_id] = PlacedAllocation(
                node=node,
                address=address,
                allocation_id=info.allocation_id,
                resources=dict(info.resources),
                numa=info.numa,
            )
        if surplus and not abandoned:  # an abandoned award is being freed already
            target = FreeTarget(address, node, tuple(surplus))
            self._frees.free(request_id, [target], now, effects)
        self._maybe_complete(c, now, effects)

    def _on_refused(self, refused: Refused, now: float, effects: list[Effect]) -> None:
        c = self._active.get(refused.request_id)
        if c is None:
            effects.append(Dropped("late_refusal", refused.reservation_id))
            return
        if c.pool.pop(refused.reservation_id, None) is not None:
            return  # a withdrawn offer (the node is stopping): simply not a candidate
        award = c.awards.get(refused.reservation_id)
        if award is None or award.offer.sender != refused.sender:
            effects.append(Dropped("late_refusal", refused.reservation_id))
            return
        del c.awards[refused.reservation_id]
        c.note = f"{refused.sender} refused: {refused.reason}"
        self._decide(c, now, effects)

    def _chase_awards(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Re-send unanswered awards; give up on one once its reservation must be gone."""
        give_up_after_s = c.ttl_s + self.config.award_retry_s
        gap = False
        for reservation_id, award in list(c.awards.items()):
            if now - award.first_sent_at >= give_up_after_s:
                del c.awards[reservation_id]
                c.abandoned.add(reservation_id)
                gap = True
                # The node may yet have allocated: freeing that reservation's allocations
                # (until the node confirms) makes sure nothing of it stays behind there.
                target = FreeTarget(
                    award.offer.reply_to, award.offer.sender, reservation_id=reservation_id
                )
                self._frees.free(c.request_id, [target], now, effects)
                c.note = f"{award.offer.sender} never answered its award"
            elif now - award.last_sent_at >= self.config.award_retry_s:
                award.last_sent_at = now
                effects.append(self._award_message(c, award.offer, award.slots))
        if c.awards:
            self._set_timer(c, TimerKind.AWARD, now + self.config.award_retry_s, effects)
        if gap:
            self._decide(c, now, effects)

    def _maybe_complete(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        if c.awards or len(c.placed) < c.target:
            return
        adopted = [a for a in c.placed.values() if a.allocation_id in c.contention.adopted]
        mismatch = _shape_mismatch(c.request_id, c.spec, adopted)
        if mismatch:
            # The id was placed before with another shape: that placement is the caller's
            # earlier one, not ours to free, and not the answer to this request.
            for allocation in adopted:
                del c.placed[allocation.allocation_id]
            c.note = mismatch
            self._fail(c, now, effects, timed_out=False)
            return
        self._release_surplus(c, effects, keep_spares=False)
        placement = Placement(
            request_id=c.request_id,
            allocations=tuple(sorted(c.placed.values(), key=lambda a: a.allocation_id)),
            requested=c.spec.count,
            tiers_tried=tuple(c.tiers_tried),
            attempts=c.attempt,
            elapsed_s=now - c.started_at,
            offers_received=c.offers_received,
            requested_at_s=c.placed_at_s,
        )
        self._finish(c, placement, effects)
        effects.append(Placed(c.request_id, placement))

    # -- failing -----------------------------------------------------------------------

    def _fail(self, c: Conversation, now: float, effects: list[Effect], *, timed_out: bool) -> None:
        for held in c.pool.values():
            effects.append(self._release(c, held.offer))
        c.pool.clear()
        # All or nothing: whatever was allocated or awarded goes back.
        targets = {FreeTarget(a.offer.reply_to, a.offer.sender) for a in c.awards.values()}
        targets |= {FreeTarget(a.address, a.node) for a in c.placed.values()}
        if targets:
            self._frees.free(c.request_id, sorted(targets, key=lambda t: t.address), now, effects)
        found = len(c.placed) + c.awarded_slots()
        c.awards.clear()
        c.placed.clear()
        reasons: dict[str, int] = {}
        for decline in c.declines.values():
            for label in {reason_label(r) for r in decline.reasons}:
                reasons[label] = reasons.get(label, 0) + 1
        explanation = Explanation(
            request_id=c.request_id,
            wanted=c.spec.wanted_slots,
            found=found,
            tiers_tried=tuple(c.tiers_tried),
            offers_received=c.offers_received,
            declines_received=len(c.declines),
            busy_nodes=len(c.busy_nodes),
            reasons=reasons,
            note=c.note,
            elapsed_s=now - c.started_at,
        )
        error = PlacementTimeout(explanation) if timed_out else PlacementError(explanation)
        self._finish(c, None, effects)
        effects.append(Failed(c.request_id, error))

    def _finish(self, c: Conversation, outcome: Placement | None, effects: list[Effect]) -> None:
        del self._active[c.request_id]
        if c.contention.claim is ClaimState.HELD:
            # Placed (its allocations bound, so the next claimer's lookup finds them) or
            # failed (what it held is being freed): the id is free to claim.
            self._claims_held -= 1
            effects.append(Unclaim(c.request_id))
        effects.extend(CancelTimer(key) for key in c.armed.values())
        c.armed.clear()
        self._finished[c.request_id] = outcome
        self._finished.move_to_end(c.request_id)
        if c.contention.looks_up and outcome is not None:
            # A failure is no answer to compare with: a placement found later may be one
            # a live requestor handed out, and a failure never superseded it.
            self._answers.answered(c.request_id, outcome.requested_at_s)
        while len(self._finished) > self.config.remember_finished:
            self._finished.popitem(last=False)


def _shape_mismatch(
    request_id: str, spec: PlacementRequest, held: Iterable[PlacedAllocation]
) -> str:
    """Why allocations already placed under ``request_id`` cannot be the answer to
    ``spec`` (empty when they can): the id is the idempotency key of one request, and the
    same key with another shape is a caller's mistake to report, not to paper over."""
    held = list(held)
    if not held:
        return ""
    wanted = {rc: amount for rc, amount in spec.resources.items() if amount}
    shapes = {tuple(sorted((rc, n) for rc, n in a.resources.items() if n)) for a in held}
    if shapes != {tuple(sorted(wanted.items()))} or len(held) > spec.count:
        holds = "; ".join(", ".join(f"{rc}={n}" for rc, n in shape) for shape in sorted(shapes))
        asks = ", ".join(f"{rc}={n}" for rc, n in sorted(wanted.items()))
        return (
            f"request id {request_id} is already placed with another shape ({len(held)} "
            f"instance(s) of {holds}; this request asks {spec.count} of {asks}): "
            "use another request id"
        )
    return ""


def _refusal(request_id: str, spec: PlacementRequest, note: str) -> Explanation:
    return Explanation(
        request_id=request_id,
        wanted=spec.wanted_slots,
        found=0,
        tiers_tried=(),
        offers_received=0,
        note=note,
    )
