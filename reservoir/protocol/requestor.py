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
Its parts share one state (:mod:`reservoir.protocol.requestor_state`, with the
configuration): asking the nodes (:mod:`reservoir.protocol.requestor_asking`: probes,
broadcasts, retries, the id's claim and lookups), deciding on their answers
(:mod:`reservoir.protocol.requestor_deciding`: collecting, awarding, widening, backing
off), settling (:mod:`reservoir.protocol.requestor_settling`: accepted allocations, a
placement, a failure) and the id's claim and lookups' outcomes
(:mod:`reservoir.protocol.requestor_lookups`). This module holds the machine's surface:
placing, freeing, and every event in, each handed to the part it concerns.

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

from collections import Counter
from collections.abc import Hashable

from reservoir.protocol.compatibility import line_key, needed_by, reads_features
from reservoir.protocol.contention import ClaimState, IdContention
from reservoir.protocol.conversation import Conversation, Phase
from reservoir.protocol.effects import Bind, Dropped, Effect, Failed, FreeCompleted, Placed
from reservoir.protocol.freeing import FreeTarget
from reservoir.protocol.messages import (
    MESSAGE_CLASSES,
    REJOINED_TOPIC,
    Lookup,
    Message,
    NodeStatus,
    ReservationRequest,
    RollCall,
    RosterQuery,
    RosterSample,
)
from reservoir.protocol.placement import Placement, PlacementError, PlacementRequest
from reservoir.protocol.requestor_asking import Asking
from reservoir.protocol.requestor_deciding import Deciding
from reservoir.protocol.requestor_lookups import Lookups
from reservoir.protocol.requestor_settling import Settling, refusal, shape_mismatch
from reservoir.protocol.requestor_state import RequestorConfig, RequestorState
from reservoir.protocol.roster import Roster
from reservoir.protocol.roster_source import RosterSource
from reservoir.protocol.timers import PER_ATTEMPT, ConversationTimer, FreeTimer, TimerKind

__all__ = ["RequestorMachine"]


class RequestorMachine:
    """Every conversation of one requestor. Not thread-safe: its driver serialises calls.

    Its parts, each over the one :attr:`state`: :attr:`asking`, :attr:`deciding`,
    :attr:`settling` and :attr:`lookups`."""

    def __init__(self, config: RequestorConfig) -> None:
        self.config = config
        self.state = state = RequestorState(config)
        self.roster: Roster = state.roster
        #: how often each way of asking ran: ``probes`` (messages), ``probe_rounds``,
        #: ``exhaustive_steps`` (broadcasts after sampling found too little, or with
        #: nothing to sample from), ``busy_retries``
        self.counters: Counter[str] = state.counters
        self.latency = state.latency
        #: where the roster comes from: a keeper's samples or the announcements
        self.roster_source: RosterSource = state.roster_source
        self.asking = Asking(state)
        self.settling = Settling(state)
        self.deciding = Deciding(state, self.asking, self.settling)
        self.lookups = Lookups(state, self.asking, self.deciding)

    # -- observing ---------------------------------------------------------------------

    def in_flight(self) -> int:
        return len(self.state.active)

    def is_active(self, request_id: str) -> bool:
        return request_id in self.state.active

    def conversation(self, request_id: str) -> Conversation | None:
        """The conversation placing ``request_id``, while it is in flight."""
        return self.state.active.get(request_id)

    def placement_of(self, request_id: str) -> Placement | None:
        return self.state.finished.get(request_id)

    def held_reservations(self) -> int:
        """Offers held (not yet awarded or released) across every conversation."""
        return sum(len(c.pool) for c in self.state.active.values())

    def forget(self, request_id: str) -> None:
        """Forget the placement remembered under ``request_id`` (the nodes no longer hold
        it: it was freed through another requestor), so that placing the id again asks
        the nodes rather than answering from memory. In flight: nothing to forget."""
        self.state.finished.pop(request_id, None)

    # -- driving -----------------------------------------------------------------------

    def start(self, now: float) -> list[Effect]:
        """Hear of nodes that are back, and fill the roster: from a keeper (one query),
        or from the announcements, asking every node once where it stands."""
        effects: list[Effect] = [Bind(REJOINED_TOPIC)]
        self.roster_source.start(now, effects)
        return effects

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
        state = self.state
        if request_id in state.active:
            return effects  # in flight: the caller joins it
        if state.frees.for_caller(request_id):
            raise ValueError(f"request {request_id} is being freed; place it again afterwards")
        # Tidying up after an earlier failed attempt stops here: whatever it left behind,
        # the nodes report as AlreadyPlaced and the new conversation adopts it.
        state.frees.stop_tidying(request_id, effects)
        previous = state.finished.get(request_id)
        if previous is not None:
            mismatch = shape_mismatch(request_id, spec, previous.allocations)
            if mismatch:
                effects.append(
                    Failed(request_id, PlacementError(refusal(request_id, spec, mismatch)))
                )
            else:
                effects.append(Placed(request_id, previous))
            return effects
        needs = needed_by(spec, self.config.features)
        if needs and not reads_features(self.config.compatible_with):
            note = self._unreadable(needs)
            effects.append(Failed(request_id, PlacementError(refusal(request_id, spec, note))))
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
        state.active[request_id] = conversation
        conversation.set_timer(TimerKind.DEADLINE, conversation.deadline, effects)
        self.roster_source.placing(now, effects)
        if conversation.contention.looks_up and self.config.claims:
            self.asking.claim(conversation, effects)  # then looked up, then asked
        else:
            self.asking.broadcast(conversation, now, effects)
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
        self.lookups.on_claim(request_id, held, now, effects)
        return effects

    def claims_lost(self) -> None:
        """The broker connection went and came back: every claim held went with it, and
        another requestor may hold one now. The conversations go on looking their ids up
        before every decision."""
        self.lookups.claims_lost()

    @property
    def claims_held(self) -> int:
        """Conversations holding their id's claim: while there are some, the driver tells
        the machine when the broker connection was renewed (:meth:`claims_lost`)."""
        return self.state.claims_held

    def free(self, placement: Placement, now: float) -> list[Effect]:
        """Free every allocation of ``placement`` (its instances were deleted)."""
        effects: list[Effect] = []
        request_id = placement.request_id
        self.state.finished.pop(request_id, None)
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
        self.state.frees.free(request_id, targets, now, effects, notify=True)
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
        self.state.finished.pop(request_id, None)
        target = FreeTarget(address, node, tuple(sorted(allocation_ids)))
        self.state.frees.free(request_id, [target], now, effects, notify=True)
        return effects

    def abandon(self, now: float) -> list[Effect]:
        """Give up on everything in flight (the requestor is closing): each conversation
        fails and lets go of what it holds."""
        effects: list[Effect] = []
        for conversation in list(self.state.active.values()):
            conversation.note = "the requestor closed"
            self.settling.fail(conversation, now, effects, timed_out=False)
        return effects

    def handle(self, message: Message, now: float) -> list[Effect]:
        effects: list[Effect] = []
        deciding = self.deciding
        # Dispatched on the wire's discriminator, not by isinstance: a status, the message
        # a requestor hears most (every node's announcements), would go through a test per
        # kind before its branch (docs/performance.md, "`reservoir simulate`: the machines per
        # arrival").
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
            deciding.on_offer(message, now, effects)
        elif message.kind == "decline":
            self.roster.note_room(message.sender, message.room)
            self._heard_answer(message.request_id)
            deciding.on_decline(message, now, effects)
        elif message.kind == "accepted":
            self.roster.note_room(message.sender, message.room)
            self._heard_answer(message.request_id)
            self.settling.on_accepted(
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
            self.settling.on_accepted(
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
            deciding.on_refused(message, now, effects)
        elif message.kind == "freed":
            self.roster.note_room(message.sender, message.room)
            self.state.frees.on_freed(message, effects)
        elif message.kind == "roster_sample":
            self._on_sample(message, now, effects)
        elif message.kind == "keeper_up":
            self.roster_source.heard_keeper_up(now, effects)
        else:
            effects.append(Dropped("unexpected", f"a requestor does not take {message.kind!r}"))
        return effects

    def _heard_answer(self, request_id: str) -> Conversation | None:
        """A node answered a request: the path to the nodes works (see
        :meth:`Deciding.widen <reservoir.protocol.requestor_deciding.Deciding.widen>`)."""
        conversation = self.state.active.get(request_id)
        if conversation is not None:
            conversation.heard_answer()
        return conversation

    def _on_sample(self, sample: RosterSample, now: float, effects: list[Effect]) -> None:
        """A keeper's sample: into the roster; placements waiting for one go on."""
        self.roster_source.heard_sample(sample, now, effects)
        self.asking.resume_awaiting_sample(now, effects)

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
            self.lookups.look_up_again(message.rejoined_buckets, effects)

    def on_unroutable(self, message: Message, now: float) -> list[Effect]:
        """Our publish reached no node: nobody is at that tier, so widen at once."""
        effects: list[Effect] = []
        conversation = self.state.active.get(message.request_id)
        if isinstance(message, Lookup) and conversation is not None:
            self.lookups.unroutable(conversation, now, effects)  # nobody holds the id
            return effects
        if isinstance(message, RollCall):
            return effects  # no node is up yet: they announce themselves as they start
        if isinstance(message, RosterQuery):
            # No keeper is bound: keep a roster of our own, as without keepers, and
            # whoever waited for a keeper's nodes asks every node now.
            self.roster_source.query_unroutable(now, effects)
            self.asking.resume_awaiting_sample(now, effects)
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
            self.deciding.heard_from(
                conversation, message.probed_node, message.attempt, now, effects
            )
        else:
            self.deciding.nobody_came(conversation, now, effects)
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
            self.deciding.answered(c, attempt, now, effects)
            self.deciding.heard_from(c, sender, attempt, now, effects)
        return effects

    def on_timer(self, key: Hashable, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if type(key) is FreeTimer:
            self.state.frees.on_timer(key, now, effects)
            return effects
        if type(key) is not ConversationTimer:
            return effects
        c = self.state.active.get(key.request_id)
        if c is None:
            return effects  # over
        kind = key.kind
        if c.armed.get(kind) == key:
            del c.armed[kind]  # fired: nothing left to cancel
        if kind in PER_ATTEMPT and key.attempt != c.attempt:
            return effects  # an earlier attempt's
        if kind is TimerKind.DEADLINE:
            c.note = f"timed out; {c.note}" if c.note else "timed out"
            self.settling.fail(c, now, effects, timed_out=True)
        elif kind is TimerKind.COLLECT:
            self.deciding.decide(c, now, effects)
        elif kind is TimerKind.WIDEN:
            self.deciding.nobody_came(c, now, effects)
        elif kind is TimerKind.AWARD:
            self.deciding.chase_awards(c, now, effects)
        elif kind is TimerKind.LOOKUP:
            self.lookups.lookup_over(c, now, effects)
        elif kind is TimerKind.RETRY and c.phase is Phase.BACKING_OFF:
            if c.contention.claim is ClaimState.REFUSED:
                self.asking.claim(c, effects)
            else:
                self.asking.retry(c, now, effects)
        return effects
