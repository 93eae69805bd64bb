"""The node's side of the protocol, as a state machine with no I/O.

Everything that decides a node's answers lives here: the node's ledger, which tier topics it
listens to, and how it answers each message. Its driver feeds it messages and timer firings
with the current time and carries out the returned effects in order.

How a node answers (one conversation per request id):

    request  -> already holds allocations for the id  : AlreadyPlaced
                already holds a reservation for the id : the same Offer again
                the filters allow k >= 1 instances     : reserve k until now + ttl, Offer
                they allow none                        : Decline when probed (sent to this
                                                         node alone), when asked to explain
                                                         or when only others' reservations
                                                         stand in the way (busy); else silence
    lookup   -> holds allocations, or remembers tasks, : AlreadyPlaced (with the
                of the id                                placement's instances, the tasks)
                holds another requestor's reservation  : in_flight_elsewhere, to both (to
                                                         the asker alone when it follows)
    roll call-> NodeStatus to the caller
    (start, rejoined) -> NodeStatus on the roster topic; holding allocations of caller-
                chosen ids, a second one naming their lookup buckets (``rejoined_buckets``)
    ledger query -> the whole ledger to the auditor, in parts of at most 50 entries
    award    -> live reservation of the sender         : allocations stored, Accepted
                reservation already turned into allocations : the same Accepted again
                otherwise (expired, unknown)           : Refused
    release  -> drop the reservation (unknown: dropped, logged at debug)
    dry run  -> an Assessment of the request, nothing reserved (protocol/dry_run.py)
    free     -> free the allocations named, Freed (idempotent)
    timer    -> reservations whose deadline has come are dropped

After every change the node re-binds if its allocations moved it across a tier boundary
(live reservations do not count there: they come and go within seconds),
and then announces its new tier on the roster topic (requestors sample whom to probe from
what nodes announce). It also binds the lookup topic (``lookup.<hash of the id>``) of every
findable request id it holds a reservation, an allocation or a remembered task of, before
it offers, so that a ``Lookup`` for the id reaches it and no node that holds nothing of it
(and comes back unroutable when no node holds anything of it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgspec.structs

from reservoir.protocol.compatibility import KNOWN_FEATURES, release_traits
from reservoir.protocol.dry_run import assess
from reservoir.protocol.effects import (
    Bind,
    CancelTimer,
    DeleteAllocation,
    Dropped,
    Effect,
    ForgetTask,
    Publish,
    RememberTask,
    Send,
    SetTimer,
    StartTask,
    StopTask,
    StoreAllocation,
    Unbind,
)
from reservoir.protocol.filters import (
    DEFAULT_FILTERS,
    DEFAULT_WEIGHERS,
    Evaluation,
    Filter,
    NodeView,
    Weigher,
    evaluate,
)
from reservoir.protocol.ledger import Allocation, Inventory, Ledger, Reservation
from reservoir.protocol.messages import (
    IN_FLIGHT_ELSEWHERE,
    MESSAGE_CLASSES,
    REJOINED_TOPIC,
    ROOM_TOPIC,
    ROSTER_TOPIC,
    Accepted,
    AlreadyPlaced,
    Assessment,
    Award,
    Decline,
    Free,
    Freed,
    HeldAllocation,
    HeldReservation,
    LedgerQuery,
    LedgerReport,
    Lookup,
    Message,
    NodeStatus,
    Offer,
    Reason,
    Refused,
    Release,
    ReservationRequest,
    ResourceTally,
    RollCall,
    TaskQuery,
    TaskState,
    bucket_bitmap,
    lookup_bucket,
    lookup_topic,
)
from reservoir.protocol.numa import NumaTopology
from reservoir.protocol.room import NOTHING_FREE
from reservoir.protocol.task_book import ENDED_STATES, EndedTask, TaskBook
from reservoir.protocol.task_policy import TASK_NOT_ALLOWED, TaskPolicy
from reservoir.protocol.tiers import DEFAULT_LADDER, TierLadder

__all__ = [
    "EXPIRY_TIMER",
    "OVERCOMMITTED",
    "TASK_DRIVER_MISSING",
    "UNKNOWN_FEATURE",
    "NodeConfig",
    "NodeMachine",
]

#: Decline reason: the request's task names a task driver this node does not offer.
TASK_DRIVER_MISSING: Final = "task_driver"
#: Decline reason: the request needs a feature this node's release does not know
#: (``ReservationRequest.needs``); always sent, with its reason, whether asked or not.
UNKNOWN_FEATURE: Final = "feature"
#: Reasons a node always gives, explain or not: the requestor needs them to decide well.
GROUP_REASONS: Final = frozenset({"anti_affinity", "affinity"})
#: Reasons a node gives in every decline it sends, explain or not: no other node's room
#: changes them, and the caller cannot guess them (its task's driver or policy)
TASK_REASONS: Final = frozenset({TASK_DRIVER_MISSING, TASK_NOT_ALLOWED})
#: Decline reason: the node holds more than its inventory (restarted with a smaller one
#: over its stored allocations) and takes nothing new until what it holds fits again.
OVERCOMMITTED: Final = "overcommitted"

#: Allocations plus reservations per LedgerReport part: 50 entries stay well inside the
#: default 64 KiB message limit even with 200-character ids.
LEDGER_REPORT_ENTRIES: Final = 50

#: The node keeps one timer, for its earliest reservation deadline.
EXPIRY_TIMER: Final = "expire-reservations"


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node is, apart from what it holds."""

    name: str
    #: where requestors send awards, releases and frees for this node
    address: str
    inventories: Mapping[str, Inventory]
    traits: frozenset[str] = frozenset()
    tiers: TierLadder = DEFAULT_LADDER
    #: unique per start of the node's process, so ids never repeat across restarts
    incarnation: str = "0"
    filters: Sequence[Filter] = DEFAULT_FILTERS
    weighers: Sequence[Weigher] = DEFAULT_WEIGHERS
    #: a request's ttl_s is honoured up to this bound
    max_ttl_s: float = 60.0
    #: the node's NUMA cells, if it describes them
    numa: NumaTopology | None = None
    #: the configuration it runs with, as its operator would read it (JSON-able): told
    #: to whoever asks for its ledger
    configuration: Mapping[str, Any] = field(default_factory=dict)
    #: the task drivers the node offers: a request whose task names another is not offered
    task_drivers: frozenset[str] = frozenset()
    #: the node's release (said in its status, and as its release traits); empty: none
    release: str = ""
    #: the features it knows: a request needing another is declined (reason ``feature``)
    features: frozenset[str] = KNOWN_FEATURES
    #: what a task may run here: a request whose task it refuses is not offered
    task_policy: TaskPolicy = field(default_factory=TaskPolicy)


class NodeMachine:
    """One node's protocol state. Not thread-safe: its driver serialises calls."""

    def __init__(
        self,
        config: NodeConfig,
        allocations: Sequence[Allocation] = (),
        ended_tasks: Sequence[EndedTask] = (),
    ) -> None:
        """``ended_tasks``: the tasks that ended lately, as the node's store kept them."""
        self.config = config
        self.ledger = Ledger.with_allocations(config.inventories, allocations)
        self.ledger.devices = (
            config.numa.device_addresses() if config.numa is not None else frozenset()
        )
        self.view = NodeView(
            name=config.name,
            # its release line's traits, so that a request may ask for (or keep off) the
            # nodes of a release line: nodes of 0.1 have none and decline as for any trait
            traits=config.traits | release_traits(config.release),
            ledger=self.ledger,
            numa=config.numa,
        )
        self.bound_topics: frozenset[str] = frozenset()
        #: the room when the allocations last changed (to tell when it grows)
        self._room_before: dict[str, int] | None = None
        #: request id -> its lookup topic, bound while something of the id is held here
        self._lookup_topics: dict[str, str] = {}
        self.stopping = False
        #: a keeper roll-called this node: it publishes every change of room for keepers
        self._keepers_listen = False
        self._last_status: NodeStatus | None = None
        self._last_status_room: dict[str, int] | None = None
        self._sequence = 0
        self._expiry_at: float | None = None
        #: what became of reservations (``reserved``, ``awarded``, ``released``,
        #: ``expired``, ``withdrawn``) and ``dry_runs`` answered, for the driver to publish
        self.counters: Counter[str] = Counter()
        #: the tasks of the node's allocations, live and lately ended
        self.tasks = TaskBook(ended_tasks)

    # -- observing ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self.config.name

    def utilisation(self) -> float:
        return self.ledger.utilisation()

    def tier(self) -> int:
        return self.config.tiers.tier_for(self.ledger.allocated_share())

    def overcommitted(self) -> list[str]:
        """How the node holds more than its inventory (empty when it does not): then it
        takes no new request (see :data:`OVERCOMMITTED`)."""
        return self.ledger.violations()

    # -- driving -----------------------------------------------------------------------

    def start(self, now: float) -> list[Effect]:
        """Bind the tier topics for the node's present utilisation, and announce what it
        came back holding (see :meth:`rejoined`)."""
        effects: list[Effect] = []
        self._expire(now, effects)
        self._let_go_of_tasks(effects)  # beyond what is kept, from the store
        self._sync_lookups(effects)
        self._retier(effects)
        self._announce_holdings(effects)
        self._schedule_expiry(effects)
        return effects

    def rejoined(self, now: float) -> list[Effect]:
        """The node's connection to the broker is back (its driver saw it reconnect):
        while it was away, requestors could neither probe it nor find what it holds with
        a lookup. Announce it again, with the lookup buckets of the caller-chosen ids it
        holds, so that a requestor that placed one of them again meanwhile frees the
        earlier placement (design.md, "Lookups")."""
        effects: list[Effect] = []
        if self.stopping or not self.bound_topics:
            return effects  # not started, or stopped: nothing to announce
        self._expire(now, effects)
        # The plain status first, as at a start: a requestor of an earlier release refuses
        # the one naming buckets (an unknown field) and still learns the node is back.
        effects.append(Publish(ROSTER_TOPIC, self._status()))
        self._announce_holdings(effects)
        self._schedule_expiry(effects)
        return effects

    def on_unroutable(self, message: Message, now: float) -> list[Effect]:
        """What the node published reached nobody. A status nobody hears means no keeper
        listens any more: stop announcing every change of room until one roll-calls the
        node again (its tier changes are still announced, for requestors)."""
        if message.kind == "status":
            self._keepers_listen = False
        effects: list[Effect] = [
            Dropped("returned", f"{message.kind} for {message.request_id} reached nobody")
        ]
        if message.kind == "offer":
            # Its requestor's inbox is gone (it finished, found the id placed elsewhere,
            # and exited before this offer came): nobody can award the reservation, so it
            # goes now rather than at its deadline.
            reservation = self.ledger.reservations.get(message.reservation_id)
            if reservation is not None:
                self.ledger.pop_reservation(message.reservation_id)
                self.counters["released"] += 1
                self._sync_lookups(effects)
                self._retier(effects)
                self._schedule_expiry(effects)
        return effects

    def stop(self, now: float) -> list[Effect]:
        """Stop hearing requests, withdraw every live reservation, and tell requestors
        the node is leaving."""
        self.stopping = True
        effects: list[Effect] = [Unbind(topic) for topic in sorted(self.bound_topics)]
        effects.extend(Unbind(topic) for topic in sorted(self._lookup_topics.values()))
        self._lookup_topics.clear()
        if self.bound_topics:
            effects.append(Publish(ROSTER_TOPIC, self._status(leaving=True)))
        self.bound_topics = frozenset()
        for reservation in list(self.ledger.reservations.values()):
            self.ledger.pop_reservation(reservation.reservation_id)
            self.counters["withdrawn"] += 1
            effects.append(
                self._refused(
                    reservation.reply_to,
                    reservation.request_id,
                    reservation.reservation_id,
                    "the node is shutting down",
                )
            )
        if self._expiry_at is not None:
            effects.append(CancelTimer(EXPIRY_TIMER))
            self._expiry_at = None
        return effects

    def handle(self, message: Message, now: float) -> list[Effect]:
        effects: list[Effect] = []
        self._expire(now, effects)
        # Dispatched through a table of the classes a node takes: one dict lookup for any
        # kind, where isinstance tests would run one per kind before the right one
        handler = _HANDLERS.get(type(message))
        if handler is not None:
            handler(self, message, now, effects)
        elif type(message) in MESSAGE_CLASSES:
            effects.append(Dropped("unexpected", f"a node does not take {message.kind!r}"))
        else:
            effects.append(
                Dropped("unexpected", f"a node does not take a {type(message).__name__}")
            )
        self._sync_lookups(effects)
        self._retier(effects)
        self._schedule_expiry(effects)
        return effects

    def on_timer(self, key: object, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if key == EXPIRY_TIMER:
            self._expiry_at = None
        self._expire(now, effects)
        self._sync_lookups(effects)
        self._retier(effects)
        self._schedule_expiry(effects)
        return effects

    def free_local(self, allocation_ids: Sequence[str]) -> list[Effect]:
        """Free allocations on the operator's word (no requestor involved)."""
        effects: list[Effect] = []
        for allocation_id in allocation_ids:
            if self.ledger.remove_allocation(allocation_id) is not None:
                effects.append(DeleteAllocation(allocation_id))
                self._stop_task(allocation_id, "freed by the operator", effects)
        self._sync_lookups(effects)
        self._retier(effects)
        return effects

    def task_changed(
        self,
        allocation_id: str,
        state: str,
        now: float,
        *,
        exit_code: int | None = None,
        reason: str = "",
        limits: str | None = None,
        wall_s: float = 0.0,
    ) -> list[Effect]:
        """The driver of an allocation's task saw it change: ``started`` (or ``running``,
        re-attached after a restart), ``exited`` with ``exit_code``, ``failed`` to start
        with ``reason``, or ``stopped``. The placing requestor hears of it; a task that
        ended frees its allocation, as a ``Free`` would, unless the request kept it, and
        is remembered (``RememberTask``) as of ``wall_s`` (the wall clock)."""
        effects: list[Effect] = []
        self._expire(now, effects)
        allocation = self.ledger.allocations.get(allocation_id)
        task = self.tasks.get(allocation_id)
        if task is None:
            if allocation is None or allocation.task is None:
                effects.append(
                    Dropped("unknown_task", f"{state} for {allocation_id}, not a task held here")
                )
                return effects
            task = self.tasks.starting(allocation)  # held across a restart of the agent
        if state == "exited" and task.stopping:
            state = "stopped"  # it ended because it was asked to
        if task.stopping and state in ENDED_STATES:
            reason = f"{task.stop_reason} ({reason})" if reason else task.stop_reason
        was_ended = task.ended
        if state in ENDED_STATES and not was_ended:
            task.ended_at_s = wall_s
        report = self.tasks.change(task, state, exit_code=exit_code, reason=reason, limits=limits)
        if state in ENDED_STATES and allocation is not None and not task.keep_allocation:
            self.ledger.remove_allocation(allocation_id)
            effects.append(DeleteAllocation(allocation_id))
        if task.ended:
            effects.append(RememberTask(EndedTask.of(task)))
            self._let_go_of_tasks(effects)
        if task.reply_to is not None:
            effects.append(Send(task.reply_to, self._task_message(report)))
        self._sync_lookups(effects)
        self._retier(effects)
        return effects

    def forget_ended_tasks(self, before_s: float) -> list[Effect]:
        """Forget the tasks that ended before ``before_s`` (wall clock): their retention
        passed. Their records and output go (``ForgetTask``), and with the last task of a
        findable id, the binding of its lookup topic."""
        effects: list[Effect] = []
        self.tasks.forget_ended(before_s)
        self._let_go_of_tasks(effects)
        self._sync_lookups(effects)
        return effects

    def _let_go_of_tasks(self, effects: list[Effect]) -> None:
        for task in self.tasks.drain_let_go():
            effects.append(ForgetTask(task.allocation_id, task.driver))

    def task_violations(self) -> list[str]:
        """What is wrong with the node's tasks: one running without a live allocation, or
        an allocation whose task ended still held although the request did not keep it."""
        problems = []
        for task in self.tasks.live():
            if not task.stopping and task.allocation_id not in self.ledger.allocations:
                problems.append(f"task of {task.allocation_id} runs without its allocation")
        for task in self.tasks.ended():
            if not task.keep_allocation and task.allocation_id in self.ledger.allocations:
                problems.append(
                    f"the task of {task.allocation_id} ended ({task.state}) "
                    "and its allocation is still held"
                )
        return problems

    def _stop_task(self, allocation_id: str, why: str, effects: list[Effect]) -> None:
        task = self.tasks.get(allocation_id)
        if task is not None and not task.ended and not task.stopping:
            task.stopping = True
            task.stop_reason = why
            effects.append(StopTask(allocation_id, task.driver, task.stop_grace_s))

    def _on_task_query(self, query: TaskQuery, now: float, effects: list[Effect]) -> None:
        tasks = self.tasks.all() if query.every else self.tasks.of_request(query.request_id)
        for task in tasks:
            effects.append(Send(query.reply_to, self._task_message(task.report(), answering=True)))

    def _task_message(self, report: TaskState, *, answering: bool = False) -> TaskState:
        return msgspec.structs.replace(
            report, sender=self.name, reply_to=self.config.address, answering=answering
        )

    def ledger_report(self, query: LedgerQuery, now: float) -> list[LedgerReport]:
        """The whole ledger, as the parts of a report answering ``query``."""
        tallies = {
            rc: ResourceTally(
                capacity=u.capacity,
                allocated=u.allocated,
                reserved=u.reserved,
                total=u.total,
                host_reserved=u.host_reserved,
                allocation_ratio=u.allocation_ratio,
            )
            for rc, u in self.ledger.usages().items()
        }
        entries: list[HeldAllocation | HeldReservation] = [
            HeldAllocation(
                allocation_id=a.allocation_id,
                request_id=a.request_id,
                reservation_id=a.reservation_id,
                owner=a.owner,
                resources=dict(a.resources),
                request_count=a.request_count,
            )
            for a in self.ledger.allocations.values()
        ]
        entries += [
            HeldReservation(
                reservation_id=r.reservation_id,
                request_id=r.request_id,
                owner=r.owner,
                slots=r.slots,
                per_instance=dict(r.per_instance),
                expires_in_s=r.deadline - now,
            )
            for r in self.ledger.reservations.values()
        ]
        chunks = [
            entries[start : start + LEDGER_REPORT_ENTRIES]
            for start in range(0, len(entries), LEDGER_REPORT_ENTRIES)
        ] or [[]]
        return [
            LedgerReport(
                sender=self.name,
                reply_to=self.config.address,
                audit_id=query.audit_id,
                incarnation=self.config.incarnation,
                part=index,
                parts=len(chunks),
                tier=self.tier(),
                tallies=tallies,
                allocations=tuple(e for e in chunk if isinstance(e, HeldAllocation)),
                reservations=tuple(e for e in chunk if isinstance(e, HeldReservation)),
                violations=(*self.ledger.violations(), *self.task_violations()),
                configuration=dict(self.config.configuration) if index == 0 else {},
            )
            for index, chunk in enumerate(chunks)
        ]

    def _announce_holdings(self, effects: list[Effect]) -> None:
        """Publish a status naming the lookup buckets of the caller-chosen ids this node
        holds allocations of, if any."""
        buckets = {
            lookup_bucket(a.request_id) for a in self.ledger.allocations.values() if a.findable
        }
        if buckets and not self.stopping:
            status = msgspec.structs.replace(
                self._status(), rejoined_buckets=bucket_bitmap(buckets)
            )
            # on a topic of its own: every requestor hears it, whether or not it follows
            # the roster's announcements (a keeper's requestors do not)
            effects.append(Publish(REJOINED_TOPIC, status))

    def _status(self, *, leaving: bool = False, answering: bool = False) -> NodeStatus:
        tier, room = self.tier(), self.ledger.room()
        cached = self._last_status
        # Every requestor's roll call asks the same question: while the room (a new dict
        # whenever the allocations change) and the tier stand, the answer is the same
        # immutable message.
        if (
            cached is not None
            and self._last_status_room is room
            and cached.tier == tier
            and cached.leaving == leaving
            and cached.answering == answering
            and cached.room_news == self._keepers_listen
        ):
            return cached
        self._last_status_room = room
        status = self._last_status = NodeStatus(
            sender=self.name,
            reply_to=self.config.address,
            tier=tier,
            leaving=leaving,
            answering=answering,
            room=room,
            room_news=self._keepers_listen,
            release=self.config.release,
            features=self.config.features,
        )
        return status

    # -- messages ----------------------------------------------------------------------

    def _on_roll_call(self, roll_call: RollCall, now: float, effects: list[Effect]) -> None:
        self._keepers_listen = self._keepers_listen or roll_call.from_keeper
        if not self.stopping:
            effects.append(Send(roll_call.reply_to, self._status(answering=True)))

    def _on_ledger_query(self, query: LedgerQuery, now: float, effects: list[Effect]) -> None:
        effects.extend(Send(query.reply_to, r) for r in self.ledger_report(query, now))

    def _on_lookup(self, lookup: Lookup, now: float, effects: list[Effect]) -> None:
        placed = self._already_placed(
            lookup.request_id, lookup.reply_to, effects, with_tasks=lookup.following
        )
        if placed:
            return
        held = self.ledger.reservation_for(lookup.request_id)
        if held is None or held.owner == lookup.sender:
            return
        if lookup.following:
            # It contends for nothing: it is only told that the id is being placed.
            effects.append(
                self._in_flight_elsewhere(held.request_id, held.owner, lookup.reply_to, 1)
            )
        else:
            effects.extend(self._contended(held, lookup.sender, lookup.reply_to, 1))

    def _already_placed(
        self, request_id: str, reply_to: str, effects: list[Effect], *, with_tasks: bool = False
    ) -> bool:
        """Answer ``AlreadyPlaced`` when allocations of ``request_id`` are held here (or,
        ``with_tasks``, when tasks of it are remembered); whether it did."""
        placed = self.ledger.allocations_for(request_id)
        tasks = self.tasks.of_request(request_id) if with_tasks else []
        if placed or tasks:
            effects.append(
                Send(
                    reply_to,
                    AlreadyPlaced(
                        request_id=request_id,
                        sender=self.name,
                        reply_to=self.config.address,
                        allocations=tuple(a.info() for a in placed),
                        owner=placed[0].owner if placed else None,
                        requested_at_s=placed[0].requested_at_s if placed else 0.0,
                        # the allocations of one placement agree; an award of a smaller
                        # remainder (min_count) carries the smaller, final figure
                        instances=min(
                            [a.request_count for a in placed] + [t.instances for t in tasks],
                            default=0,
                        ),
                        tasks=tuple(task.summary() for task in tasks),
                    ),
                )
            )
        return bool(placed or tasks)

    def _contended(
        self, held: Reservation, newcomer: str, newcomer_reply_to: str, attempt: int
    ) -> list[Effect]:
        """The same id from a second requestor. Never reserve twice; tell each of the two
        that the other is placing it, so the one whose id sorts later stands back (each
        may not hear of the other any other way: their broadcasts may reach different
        nodes)."""
        if newcomer < held.owner:
            # The newcomer takes precedence: the holder's award, should it come before the
            # holder hears of the newcomer, is refused rather than honoured.
            held.superseded_by = newcomer
        return [
            self._in_flight_elsewhere(held.request_id, held.owner, newcomer_reply_to, attempt),
            self._in_flight_elsewhere(held.request_id, newcomer, held.reply_to, attempt),
        ]

    def _in_flight_elsewhere(
        self, request_id: str, placed_by: str, reply_to: str, attempt: int
    ) -> Send:
        return Send(
            reply_to,
            Decline(
                request_id=request_id,
                sender=self.name,
                reply_to=self.config.address,
                attempt=attempt,
                reasons=(
                    Reason(
                        code=IN_FLIGHT_ELSEWHERE,
                        subject=placed_by,
                        detail=f"also being placed by {placed_by}",
                    ),
                ),
            ),
        )

    def _on_request(self, request: ReservationRequest, now: float, effects: list[Effect]) -> None:
        unknown = request.needs - self.config.features if request.needs else None
        if unknown:
            # A later release's request this node cannot serve rightly: say so, always
            # and in words, rather than serve it without what it needs or stay silent
            # (a requestor would wait for an answer that cannot come).
            self.counters["unknown_features"] += 1
            reason = self._unknown_features(unknown)
            answer: Assessment | Decline
            if request.dry_run:
                answer = Assessment(
                    request_id=request.request_id,
                    sender=self.name,
                    reply_to=self.config.address,
                    slots=0,
                    utilisation=self.ledger.utilisation(),
                    tier=self.tier(),
                    reasons=(reason,),
                )
            else:
                answer = self._decline(request, reasons=(reason,))
            effects.append(Send(request.reply_to, answer))
            return
        if request.dry_run:
            self.counters["dry_runs"] += 1
            answer = assess(
                request,
                self.view,
                self.config.filters,
                self.config.weighers,
                address=self.config.address,
                tier=self.tier(),
            )
            effects.append(Send(request.reply_to, answer))
            return
        if self.stopping:
            effects.append(Dropped("stopping", f"request {request.request_id}"))
            if request.probed_node:  # the requestor waits for our answer: don't make it wait
                effects.append(Send(request.reply_to, self._decline(request)))
            return
        if self._already_placed(request.request_id, request.reply_to, effects):
            return
        held = self.ledger.reservation_for(request.request_id)
        if held is not None:
            if held.owner == request.sender:
                # A duplicate, or the same request widened to a tier we also hear: the
                # reservation we already hold is our whole answer.
                effects.append(Send(request.reply_to, self._offer(held, request, now)))
            else:
                effects.extend(
                    self._contended(held, request.sender, request.reply_to, request.attempt)
                )
            return
        if self.ledger.overcommitted():
            # Holding more than it has (stored allocations over a smaller inventory), the
            # node must not add to it, whatever class a request asks for: it refuses
            # every new request until frees bring it back within its inventory.
            self.counters["refused_overcommitted"] += 1
            if request.probed_node or request.declines_wanted or request.explain:
                reason = Reason(code=OVERCOMMITTED, detail="; ".join(self.overcommitted())[:500])
                reasons = (reason,) if request.explain else ()
                effects.append(Send(request.reply_to, self._decline(request, reasons=reasons)))
            return
        refused = self._task_refusal(request)
        if refused is not None:
            evaluation = Evaluation(slots=0, reasons=(refused,), busy=False, score=0.0, numa=None)
        else:
            evaluation = evaluate(request, self.view, self.config.filters, self.config.weighers)
        if evaluation.slots <= 0:
            # Silence is the answer, except when it would mislead: when asked to explain,
            # when waiting may help (busy), and when the server group is why or lives
            # here (an affinity requestor must know where its group is, even if full).
            members = self._group_members(request)
            group_reasons = tuple(r for r in evaluation.reasons if r.code in GROUP_REASONS)
            told = tuple(
                r for r in evaluation.reasons if r.code in GROUP_REASONS or r.code in TASK_REASONS
            )
            if (
                request.probed_node
                or request.declines_wanted
                or request.explain
                or evaluation.busy
                or members
                or group_reasons
            ):
                decline = self._decline(
                    request,
                    busy=evaluation.busy,
                    reasons=evaluation.reasons if request.explain else told,
                    group_members=members,
                )
                effects.append(Send(request.reply_to, decline))
            return
        self._sequence += 1
        reservation = Reservation(
            reservation_id=f"{self.name}.{self.config.incarnation}.{self._sequence}",
            request_id=request.request_id,
            owner=request.sender,
            reply_to=request.reply_to,
            slots=evaluation.slots,
            per_instance=dict(request.resources),
            deadline=now + min(request.ttl_s, self.config.max_ttl_s),
            request_count=request.count,
            group=request.group.name if request.group else None,
            numa=evaluation.numa or (),
            findable=request.findable,
            findable_when_placed=request.findable_when_placed,
            task=request.task,
        )
        members_before = self._group_members(request)
        self.ledger.add_reservation(reservation)
        self.counters["reserved"] += 1
        self._expire_by(reservation.deadline, effects)
        # Findable by a Lookup for the id before anyone hears of the offer: another
        # requestor placing the id finds this reservation. (Findable only once placed,
        # it is bound when awarded, before the Accepted: see _on_award.)
        self._sync_lookups(effects)
        effects.append(
            Send(
                request.reply_to,
                self._offer(
                    reservation, request, now, score=evaluation.score, group_members=members_before
                ),
            )
        )

    def _unknown_features(self, unknown: frozenset[str]) -> Reason:
        names = ", ".join(sorted(unknown))
        release = f"release ({self.config.release})" if self.config.release else "release"
        return Reason(
            code=UNKNOWN_FEATURE,
            subject=min(unknown),
            detail=(
                f"this node's {release} does not know {names}: "
                "the request needs a node of a later release"
            )[:500],
        )

    def _decline(
        self,
        request: ReservationRequest,
        *,
        reasons: tuple[Reason, ...] = (),
        busy: bool = False,
        group_members: int = 0,
    ) -> Decline:
        return Decline(
            request_id=request.request_id,
            sender=self.name,
            reply_to=self.config.address,
            attempt=request.attempt,
            busy=busy,
            reasons=reasons,
            group_members=group_members,
            room=self.ledger.room(),
        )

    def _offer(
        self,
        reservation: Reservation,
        request: ReservationRequest,
        now: float,
        *,
        score: float = 0.0,
        group_members: int | None = None,
    ) -> Offer:
        if group_members is None:
            group_members = max(self._group_members(request) - reservation.slots, 0)
        return Offer(
            request_id=request.request_id,
            sender=self.name,
            reply_to=self.config.address,
            reservation_id=reservation.reservation_id,
            attempt=request.attempt,
            slots=reservation.slots,
            utilisation=self.ledger.utilisation(),
            score=score,
            ttl_s=reservation.deadline - now,
            group_members=group_members,
            room=self.ledger.room(),
        )

    def _task_refusal(self, request: ReservationRequest) -> Reason | None:
        """Why this node cannot run the request's task: no such driver here, or its
        policy refuses what the task would run (None: it can, or there is no task)."""
        task = request.task
        if task is None:
            return None
        if task.driver not in self.config.task_drivers:
            return Reason(
                code=TASK_DRIVER_MISSING,
                subject=task.driver,
                detail=f"the node offers no {task.driver!r} task driver",
            )
        return self.config.task_policy.refusal(task)

    def _group_members(self, request: ReservationRequest) -> int:
        return self.ledger.group_members(request.group.name) if request.group else 0

    def _on_award(self, award: Award, now: float, effects: list[Effect]) -> None:
        reservation = self.ledger.reservations.get(award.reservation_id)
        if reservation is None:
            done = self.ledger.allocations_from(award.reservation_id)
            if done and done[0].owner == award.sender:
                # A re-sent award (our Accepted was lost or slow): say it again.
                effects.append(self._accepted(award.reply_to, award.reservation_id, done))
            else:
                effects.append(
                    self._refused(
                        award.reply_to,
                        award.request_id,
                        award.reservation_id,
                        "the reservation expired or never existed",
                    )
                )
            return
        if reservation.superseded_by is not None and reservation.owner == award.sender:
            self.ledger.pop_reservation(reservation.reservation_id)
            self.counters["withdrawn"] += 1
            effects.append(
                self._refused(
                    award.reply_to,
                    award.request_id,
                    award.reservation_id,
                    f"superseded: {reservation.superseded_by} is placing the same request id",
                )
            )
            return
        if reservation.owner != award.sender or reservation.request_id != award.request_id:
            effects.append(
                Dropped(
                    "foreign_award",
                    f"award for {award.reservation_id} "
                    f"from {award.sender}, owned by {reservation.owner}",
                )
            )
            return
        self.ledger.pop_reservation(reservation.reservation_id)
        self.counters["awarded"] += 1
        slots = min(award.slots, reservation.slots)
        allocations = []
        for index in range(slots):
            allocation = Allocation(
                allocation_id=f"{reservation.reservation_id}/{index}",
                request_id=reservation.request_id,
                reservation_id=reservation.reservation_id,
                owner=reservation.owner,
                resources=dict(reservation.per_instance),
                # the placement's instances when the award says (a min_count placement
                # may have fewer than the request's count), else the request's count
                request_count=award.instances or reservation.request_count,
                group=reservation.group,
                numa=reservation.numa[index] if index < len(reservation.numa) else None,
                findable=reservation.findable or reservation.findable_when_placed,
                requested_at_s=award.requested_at_s,
                task=reservation.task,
                reply_to=reservation.reply_to if reservation.task is not None else None,
            )
            self.ledger.add_allocation(allocation)
            allocations.append(allocation)
            effects.append(StoreAllocation(allocation))
        # Found by a Lookup for the id before the requestor hears it is placed: what is
        # sent after a bind leaves once the binding is in place.
        self._sync_lookups(effects)
        effects.append(self._accepted(award.reply_to, reservation.reservation_id, allocations))
        # The work starts once the allocation is stored and Accepted is on its way.
        for allocation in allocations:
            if allocation.task is not None:
                self.tasks.starting(allocation)
                effects.append(StartTask(allocation))

    def _refused(self, reply_to: str, request_id: str, reservation_id: str, reason: str) -> Send:
        return Send(
            reply_to,
            Refused(
                request_id=request_id,
                sender=self.name,
                reply_to=self.config.address,
                reservation_id=reservation_id,
                reason=reason,
            ),
        )

    def _accepted(
        self, reply_to: str, reservation_id: str, allocations: Sequence[Allocation]
    ) -> Send:
        first = allocations[0]
        return Send(
            reply_to,
            Accepted(
                request_id=first.request_id,
                sender=self.name,
                reply_to=self.config.address,
                reservation_id=reservation_id,
                allocations=tuple(a.info() for a in allocations),
                room=self.ledger.room(),
            ),
        )

    def _on_release(self, release: Release, now: float, effects: list[Effect]) -> None:
        reservation = self.ledger.reservations.get(release.reservation_id)
        if reservation is None:
            effects.append(Dropped("late_release", f"no reservation {release.reservation_id}"))
        elif reservation.owner != release.sender:
            effects.append(
                Dropped(
                    "foreign_release",
                    f"release of {release.reservation_id} "
                    f"from {release.sender}, owned by {reservation.owner}",
                )
            )
        else:
            self.ledger.pop_reservation(release.reservation_id)
            self.counters["released"] += 1

    def _on_free(self, free: Free, now: float, effects: list[Effect]) -> None:
        reservation: Reservation | None = None
        if free.allocation_ids:
            wanted = [self.ledger.allocations.get(a) for a in free.allocation_ids]
            allocations = [a for a in wanted if a is not None]
        elif free.reservation_id is not None:
            # What came of one award the requestor gave up on, whether or not it happened.
            allocations = self.ledger.allocations_from(free.reservation_id)
            reservation = self.ledger.reservations.get(free.reservation_id)
        else:
            # Everything the request holds here: how a failed request lets go of all.
            allocations = self.ledger.allocations_for(free.request_id)
            reservation = self.ledger.reservation_for(free.request_id)
        if reservation is not None and reservation.owner == free.sender:
            self.ledger.pop_reservation(reservation.reservation_id)
            self.counters["released"] += 1
        freed = []
        for allocation in allocations:
            if allocation.request_id != free.request_id:
                effects.append(
                    Dropped(
                        "foreign_free",
                        f"{allocation.allocation_id} belongs to "
                        f"{allocation.request_id}, not {free.request_id}",
                    )
                )
                continue
            self.ledger.remove_allocation(allocation.allocation_id)
            effects.append(DeleteAllocation(allocation.allocation_id))
            self._stop_task(allocation.allocation_id, "released", effects)
            freed.append(allocation.allocation_id)
        effects.append(
            Send(
                free.reply_to,
                Freed(
                    request_id=free.request_id,
                    sender=self.name,
                    reply_to=self.config.address,
                    allocation_ids=free.allocation_ids,
                    reservation_id=free.reservation_id,
                    freed=tuple(freed),
                    room=self.ledger.room(),
                ),
            )
        )

    # -- housekeeping ------------------------------------------------------------------

    def _expire(self, now: float, effects: list[Effect]) -> None:
        if self._expiry_at is not None and now < self._expiry_at:
            return  # the earliest deadline is still ahead: nothing to scan for
        if not self.ledger.reservations:
            return  # nothing held: most messages to a node come while it holds nothing
        for reservation in self.ledger.expired(now):
            self.ledger.pop_reservation(reservation.reservation_id)
            self.counters["expired"] += 1
            effects.append(
                Dropped(
                    "expired",
                    f"reservation {reservation.reservation_id} "
                    f"for {reservation.request_id} reached its deadline",
                )
            )

    def _retier(self, effects: list[Effect]) -> None:
        """Follow the allocations: bind the tier topics they call for, and tell requestors
        (a status on the roster topic) when the tier changed, or when the room grew while
        the node is in the last tier."""
        if self.stopping:
            return
        room, before = self.ledger.room(), self._room_before
        if room is before:
            # The ledger builds a new room whenever the allocations change, and only
            # then: the same one means the same allocations, so the same tier and topics.
            # Most messages (probes, releases) change no allocation.
            return
        self._room_before = room
        wanted = self.config.tiers.topics_for(self.ledger.allocated_share())
        if wanted == self.bound_topics:
            # On a nearly full cloud every node sits in the last tier, and a requestor
            # samples it by room: room freed there (by a Free another requestor sent) is
            # news to all of them, or they would only find it in an exhaustive step.
            # Room shrinking is not announced: the decline of the one probe that finds it
            # out tells that requestor. Below the last tier the tier itself says enough.
            if _grew(before, room) and self._in_last_tier():
                effects.append(Publish(ROSTER_TOPIC, self._status()))
            elif self._keepers_listen and room != before:
                # Keepers hear every change of room, so that the samples they hand out
                # are as fresh as a requestor following every announcement would be.
                effects.append(Publish(ROOM_TOPIC, self._status()))
            return
        # Bind before unbinding so the node is never deaf to every tier at once.
        effects.extend(Bind(topic) for topic in sorted(wanted - self.bound_topics))
        effects.extend(Unbind(topic) for topic in sorted(self.bound_topics - wanted))
        self.bound_topics = wanted
        # The tier topics change exactly when the narrowest tier does: tell requestors.
        effects.append(Publish(ROSTER_TOPIC, self._status()))

    def _in_last_tier(self) -> bool:
        return self.tier() == self.config.tiers.percents[-1]

    def _sync_lookups(self, effects: list[Effect]) -> None:
        """Bind the lookup topic of every findable request id something of which is held
        here (a reservation, an allocation, a task remembered), unbind the others."""
        touched = self.ledger.drain_touched()
        forgotten = self.tasks.drain_forgotten()
        if forgotten:
            touched = touched | forgotten
        if not touched or self.stopping:
            return
        for request_id in sorted(touched) if len(touched) > 1 else touched:
            held = self.ledger.holds_findable(request_id) or self.tasks.remembers_findable(
                request_id
            )
            topic = self._lookup_topics.get(request_id)
            if held and topic is None:
                topic = self._lookup_topics[request_id] = lookup_topic(request_id)
                effects.append(Bind(topic))
            elif not held and topic is not None:
                del self._lookup_topics[request_id]
                effects.append(Unbind(topic))

    def _schedule_expiry(self, effects: list[Effect]) -> None:
        """Have the expiry timer due no later than the earliest reservation deadline.

        A timer already due sooner is kept, even when the reservation it was set for is
        gone: it fires, finds nothing, and the next one is set for what is live then.
        Most reservations end within milliseconds (awarded or released), and moving the
        timer for each of them cost two timer operations per probe, each waking the
        driver's timer thread; now it moves only when a reservation expires sooner than
        any before it, and fires at most once per TTL when nothing expires."""
        if self._expiry_at is not None:
            # Due no later than every deadline: each reservation moves it as it is made
            # (``_expire_by``), and deadlines never move. Unset, no reservation is live but
            # after the timer fired: then this finds the next deadline.
            return
        deadline = self.ledger.next_deadline()
        if deadline is not None:
            self._expire_by(deadline, effects)

    def _expire_by(self, deadline: float, effects: list[Effect]) -> None:
        """Have the expiry timer due by ``deadline``, a reservation's."""
        if self._expiry_at is None or deadline < self._expiry_at:
            self._expiry_at = deadline
            effects.append(SetTimer(EXPIRY_TIMER, deadline))


#: the node's handler of each message class it takes: one dict lookup per message,
#: whatever its kind
_HANDLERS: Final[dict[type[Message], Callable[[NodeMachine, Any, float, list[Effect]], None]]] = {
    ReservationRequest: NodeMachine._on_request,
    Award: NodeMachine._on_award,
    Release: NodeMachine._on_release,
    Free: NodeMachine._on_free,
    Lookup: NodeMachine._on_lookup,
    RollCall: NodeMachine._on_roll_call,
    LedgerQuery: NodeMachine._on_ledger_query,
    TaskQuery: NodeMachine._on_task_query,
}


def _grew(before: dict[str, int] | None, room: dict[str, int]) -> bool:
    """Whether some resource class has a larger room than before."""
    return before is not None and any(
        room.get(rc, NOTHING_FREE) > was for rc, was in before.items()
    )
