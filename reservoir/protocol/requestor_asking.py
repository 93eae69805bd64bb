"""Asking: how a requestor puts a request to the nodes, and how long it waits for them.

Every way a conversation asks goes through :class:`Asking`: **probe** a few nodes sampled
from the roster, each alone (more, twice as many, each round); while a roster keeper may
know nodes with room, **wait for its sample** before asking every node; else the
exhaustive step, **broadcast** on the conversation's tier topic; after a pause, **retry**
(the busy nodes alone, or from the roster again). It also asks about the request id:
**claim** it from the broker, **look it up** (``Lookup`` on its bucket topic) before a
decision, and **follow** another requestor's placement of it. Each enters its event in
the conversation's table (:mod:`reservoir.protocol.conversation`) and arms the timer that
bounds the wait; what the answers lead to is :mod:`~reservoir.protocol.requestor_deciding`'s.
"""

from __future__ import annotations

import bisect
import math
from typing import Final

import msgspec.structs

from reservoir.protocol.contention import ClaimState
from reservoir.protocol.conversation import Conversation, Event, Phase
from reservoir.protocol.effects import Claim, Effect, Publish, Send
from reservoir.protocol.messages import Lookup, ReservationRequest, lookup_topic
from reservoir.protocol.requestor_state import RequestorState
from reservoir.protocol.tiers import TierLadder
from reservoir.protocol.timers import TimerKind

__all__ = ["Asking"]

#: latency samples before the widening wait follows the estimate instead of its maximum
_LATENCY_SAMPLES_TRUSTED: Final = 8


class Asking:
    """The requestor's ways of asking, over the machine's shared state."""

    def __init__(self, state: RequestorState) -> None:
        self.state = state
        self.config = state.config

    # -- how long to wait --------------------------------------------------------------

    def widen_wait_s(self) -> float:
        """How long a tier is given for a first offer: the observed latency's
        ``mean + 4 * variation`` once it is known, the longest wait until then."""
        estimate = self.state.latency
        config = self.config
        if estimate.mean_s is None or estimate.samples < _LATENCY_SAMPLES_TRUSTED:
            return config.max_widen_s
        wait = estimate.mean_s + 4 * estimate.variation_s
        return min(max(wait, config.min_widen_s), config.max_widen_s)

    def lookup_wait_s(self) -> float:
        return min(self.widen_wait_s(), self.config.max_lookup_s)

    # -- asking the nodes --------------------------------------------------------------

    def broadcast(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Ask again: probe sampled nodes while sampling rounds remain, else broadcast on
        the conversation's tier (following another requestor's placement: look it up)."""
        config = self.config
        if c.contention.following is not None:
            self.follow(c, now, effects)
            return
        if c.sampling:
            if c.probe_round < config.probe_rounds:
                wanted = max(config.min_probes, math.ceil(config.probe_factor * c.needed()))
                members = self.state.roster.sample(
                    wanted * 2**c.probe_round,
                    up_to_tier_index=len(config.tiers) - 1,
                    exclude=c.probed,
                    needs=c.spec.resources,
                    features=c.needs,
                )
                if members:
                    c.probe_round += 1
                    self.state.counters["probe_rounds"] += 1
                    self.probe_nodes(c, [(m.name, m.address) for m in members], now, effects)
                    return
                if (
                    self.state.roster_source.may_wait_for_room()
                    and c.sample_waits < config.keeper_shape_rounds
                ):
                    # Before asking every node, ask a keeper for nodes we have not seen.
                    self.wait_for_sample(c, now, effects)
                    return
            # Sampling found too little (or nothing to sample): ask every node, tier by
            # tier, so that no node where the request fits goes unasked.
            c.sampling = False
            c.exhaustive = True
            self.state.counters["exhaustive_steps"] += 1
        c.enter(Event.BROADCAST)
        c.new_attempt(now, effects)
        tier = config.tiers.percents[c.tier_index]
        effects.append(Publish(TierLadder.topic(tier), self.request(c, tier)))
        # Before the last tier's verdict (failure) the wait is longer than the one that
        # only decides to look wider: a slow moment of the network or of a busy process
        # must not fail a request that offers were already on their way to.
        wait_s = self.widen_wait_s()
        if c.tier_index == len(config.tiers) - 1:
            wait_s = min(max(wait_s * config.verdict_factor, config.min_verdict_s),
                         config.max_widen_s)  # fmt: skip
        c.set_timer(TimerKind.WIDEN, now + wait_s, effects)

    def wait_for_sample(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Sampling found too little: ask a keeper for nodes whose room may fit and
        sample again once it answers, rather than ask every node at once."""
        self.state.counters["sample_waits"] += 1
        wanted = self.config.keeper_shape_sample * 2**c.sample_waits
        c.sample_waits += 1
        self.state.roster_source.ask_for_room(c.spec.resources, wanted, now, effects)
        c.enter(Event.BACK_OFF)
        # The keepers' answer (or the news that none is bound) ends the wait; the timer
        # only stands for a keeper that is bound and does not answer.
        self.state.awaiting_sample.add(c.request_id)
        c.set_timer(TimerKind.RETRY, now + self.widen_wait_s(), effects)

    def resume_awaiting_sample(self, now: float, effects: list[Effect]) -> None:
        """Placements that waited for a keeper's nodes with room sample again now, on
        the news (a sample, or that no keeper is bound), not when their timer runs out."""
        waiting = sorted(self.state.awaiting_sample)
        self.state.awaiting_sample.clear()
        for request_id in waiting:
            c = self.state.active.get(request_id)
            if c is not None and c.phase is Phase.BACKING_OFF and TimerKind.RETRY in c.armed:
                c.cancel_timer(TimerKind.RETRY, effects)
                self.retry(c, now, effects)

    def retry(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Ask again after backing off: the busy nodes alone, or from the roster."""
        self.state.awaiting_sample.discard(c.request_id)
        c.start_pass()
        busy = list(c.busy_nodes.items())
        c.busy_nodes.clear()
        if busy and not c.contention.defers_to_others():
            # Only the busy nodes were short, of room others' reservations held: ask
            # them again, alone, rather than the whole tier.
            self.state.counters["busy_retries"] += 1
            self.probe_nodes(c, busy, now, effects)
        else:
            self.broadcast(c, now, effects)

    def request(self, c: Conversation, tier: int) -> ReservationRequest:
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

    def probe_nodes(
        self,
        c: Conversation,
        nodes: list[tuple[str, str]],
        now: float,
        effects: list[Effect],
    ) -> None:
        """Send the request to each of ``nodes`` (name, address) alone, as one attempt
        that is decided the moment every one of them has answered."""
        c.enter(Event.PROBE)
        c.new_attempt(now, effects)
        tiers = (self.state.roster.tier_index_of(name) for name, _ in nodes)
        widest = max((t for t in tiers if t is not None), default=0)
        request = self.request(c, self.config.tiers.percents[widest])
        for name, address in nodes:
            c.probed.add(name)
            c.expected.add(name)
            effects.append(Send(address, msgspec.structs.replace(request, probed_node=name)))
        self.state.counters["probes"] += len(nodes)
        # Every probed node answers, and a probe to a node that is gone comes back: this
        # wait only covers a lost answer, so it is the longest one. A short one would
        # give up on a busy moment's answers and ask more nodes, adding to the load.
        c.set_timer(TimerKind.WIDEN, now + self.config.max_widen_s, effects)

    # -- asking about the id -----------------------------------------------------------

    def claim(self, c: Conversation, effects: list[Effect]) -> None:
        """Ask the broker for the id's claim (then look it up, then ask the nodes)."""
        c.contention.claim = ClaimState.ASKED
        c.enter(Event.CLAIM)
        effects.append(Claim(c.request_id))

    def look_up(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Ask the nodes of the id's lookup bucket whether anyone holds it already; decide
        nothing until every holder could have answered."""
        self.send_lookup(c, now, effects, following=False)

    def follow(self, c: Conversation, now: float, effects: list[Effect]) -> None:
        """Ask the id's lookup bucket again what is placed of the id, contending for
        nothing."""
        c.enter(Event.FOLLOW)
        self.send_lookup(c, now, effects, following=True)

    def send_lookup(
        self, c: Conversation, now: float, effects: list[Effect], *, following: bool
    ) -> None:
        lookup = Lookup(
            request_id=c.request_id,
            sender=self.config.requestor_id,
            reply_to=self.config.reply_to,
            following=following,
        )
        effects.append(Publish(lookup_topic(c.request_id), lookup))
        until = now + self.lookup_wait_s()
        c.contention.lookup_sent(c.attempt, until, following=following)
        c.set_timer(TimerKind.LOOKUP, until, effects)
