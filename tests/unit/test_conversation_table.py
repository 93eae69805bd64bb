"""The conversation's phase table holds the requestor machine to it: for every phase, each
event the table refuses there, taken by the machine's own part that takes it, is a
ProtocolBug. Each phase is reached by driving a real machine with what nodes and the
broker send; the pairs come from the table itself, so a phase or an event added later
without a way to reach or take it fails here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from reservoir.protocol.contention import IdContention
from reservoir.protocol.conversation import TRANSITIONS, Conversation, Event, Phase
from reservoir.protocol.effects import Effect, Publish, SetTimer
from reservoir.protocol.errors import ProtocolBug
from reservoir.protocol.messages import (
    AllocationInfo,
    AlreadyPlaced,
    Lookup,
    NodeStatus,
    Offer,
)
from reservoir.protocol.placement import PlacementRequest
from reservoir.protocol.requestor import RequestorMachine
from reservoir.protocol.requestor_state import RequestorConfig
from reservoir.protocol.timers import ConversationTimer, TimerKind

T0 = 100.0
TIMEOUT_S = 30.0
SHAPE = {"VCPU": 2, "MEMORY_MB": 1024}


def a_requestor(**config: Any) -> RequestorMachine:
    config.setdefault("claims", False)
    config.setdefault("roster_from", "announcements")
    return RequestorMachine(RequestorConfig(requestor_id="req", reply_to="req-inbox", **config))


def spec(**fields: Any) -> PlacementRequest:
    return PlacementRequest(resources=dict(SHAPE), **fields)


def timer(effects: list[Effect], kind: TimerKind) -> tuple[ConversationTimer, float]:
    (found,) = [
        (e.key, e.at)
        for e in effects
        if isinstance(e, SetTimer) and isinstance(e.key, ConversationTimer) and e.key.kind is kind
    ]
    return found


def offer(node: str, attempt: int = 1) -> Offer:
    return Offer(
        request_id="r1",
        sender=node,
        reply_to=f"addr-{node}",
        reservation_id=f"{node}.res.r1",
        attempt=attempt,
        slots=1,
        ttl_s=5.0,
        utilisation=0.1,
    )


# -- a real machine, driven into each phase ----------------------------------------------


def new() -> RequestorMachine:
    """place() builds its conversation in NEW and leaves NEW before it returns: the
    conversation as place() builds it, before it asks, is put in the machine's table."""
    machine = a_requestor()
    machine.state.active["r1"] = Conversation(
        request_id="r1",
        spec=spec(),
        started_at=T0,
        deadline=T0 + TIMEOUT_S,
        ttl_s=5.0,
        target=1,
        contention=IdContention(machine.config.requestor_id),
    )
    return machine


def claiming() -> RequestorMachine:
    """A caller-chosen id is claimed before anything is sent."""
    machine = a_requestor(claims=True)
    machine.place(spec(request_id="r1"), "r1", T0, TIMEOUT_S)
    return machine


def probing() -> RequestorMachine:
    """Nodes on the roster: the first round probes two of them."""
    machine = a_requestor()
    for node in ("n1", "n2", "n3"):
        status = NodeStatus(
            sender=node, reply_to=f"addr-{node}", tier=10, room={"VCPU": 64, "MEMORY_MB": 65536}
        )
        machine.handle(status, T0)
    machine.place(spec(), "r1", T0, TIMEOUT_S)
    return machine


def broadcasting() -> RequestorMachine:
    """Nobody on the roster: the exhaustive step, on the first tier's topic."""
    machine = a_requestor()
    machine.place(spec(), "r1", T0, TIMEOUT_S)
    return machine


def awarding() -> RequestorMachine:
    """An offer, and the collect window it opened closes: the award is out."""
    machine = broadcasting()
    first = machine.handle(offer("n1"), T0 + 0.01)
    key, at = timer(first, TimerKind.COLLECT)
    machine.on_timer(key, at)
    return machine


def backing_off() -> RequestorMachine:
    """The id's claim is held by another requestor: claim it again after a pause."""
    machine = claiming()
    machine.on_claim("r1", False, T0 + 0.001)
    return machine


def following() -> RequestorMachine:
    """Under the claim, the lookup finds another requestor's placement of one of the two
    instances: the conversation follows it rather than ask the nodes."""
    machine = a_requestor(claims=True)
    machine.place(spec(request_id="r1", count=2), "r1", T0, TIMEOUT_S)
    effects = machine.on_claim("r1", True, T0 + 0.001)
    held = AlreadyPlaced(
        request_id="r1",
        sender="n2",
        reply_to="addr-n2",
        allocations=(AllocationInfo(allocation_id="n2.res/0", resources=dict(SHAPE)),),
        owner="someone",
        requested_at_s=1.0,
    )
    machine.handle(held, T0 + 0.002)
    key, at = timer(effects, TimerKind.LOOKUP)
    following = machine.on_timer(key, at)
    assert [type(e.message) for e in following if isinstance(e, Publish)] == [Lookup]
    return machine


REACH: dict[Phase, Callable[[], RequestorMachine]] = {
    Phase.NEW: new,
    Phase.CLAIMING: claiming,
    Phase.PROBING: probing,
    Phase.BROADCASTING: broadcasting,
    Phase.AWARDING: awarding,
    Phase.BACKING_OFF: backing_off,
    Phase.FOLLOWING: following,
}

# -- the machine's part that takes each event ---------------------------------------------


def probe(machine: RequestorMachine, c: Conversation, effects: list[Effect]) -> None:
    machine.asking.probe_nodes(c, [("n9", "addr-n9")], T0 + 0.5, effects)


def broadcast(machine: RequestorMachine, c: Conversation, effects: list[Effect]) -> None:
    c.sampling = False
    c.contention.following = None
    machine.asking.broadcast(c, T0 + 0.5, effects)


def award(machine: RequestorMachine, c: Conversation, effects: list[Effect]) -> None:
    machine.deciding.award(c, machine.deciding.usable(c, T0 + 0.5, effects), 1, T0 + 0.5, effects)


def back_off(machine: RequestorMachine, c: Conversation, effects: list[Effect]) -> None:
    machine.deciding.back_off(c, T0 + 0.5, effects)


def follow(machine: RequestorMachine, c: Conversation, effects: list[Effect]) -> None:
    machine.asking.follow(c, T0 + 0.5, effects)


def claim(machine: RequestorMachine, c: Conversation, effects: list[Effect]) -> None:
    machine.asking.claim(c, effects)


TAKE: dict[Event, Callable[[RequestorMachine, Conversation, list[Effect]], None]] = {
    Event.PROBE: probe,
    Event.BROADCAST: broadcast,
    Event.AWARD: award,
    Event.BACK_OFF: back_off,
    Event.FOLLOW: follow,
    Event.CLAIM: claim,
}

#: the phase each event leads to
LEADS_TO = {
    Event.PROBE: Phase.PROBING,
    Event.BROADCAST: Phase.BROADCASTING,
    Event.AWARD: Phase.AWARDING,
    Event.BACK_OFF: Phase.BACKING_OFF,
    Event.FOLLOW: Phase.FOLLOWING,
    Event.CLAIM: Phase.CLAIMING,
}

REFUSED = [
    pytest.param(phase, event, id=f"{phase.name}-{event.name}")
    for phase in Phase
    for event in Event
    if event not in TRANSITIONS[phase]
]
ALLOWED = [
    pytest.param(phase, event, id=f"{phase.name}-{event.name}")
    for phase in Phase
    for event in Event
    if event in TRANSITIONS[phase]
]


def in_phase(phase: Phase) -> tuple[RequestorMachine, Conversation]:
    machine = REACH[phase]()
    c = machine.conversation("r1")
    assert c is not None and c.phase is phase
    return machine, c


@pytest.mark.parametrize("phase", list(Phase))
def test_a_real_machine_reaches_every_phase(phase: Phase) -> None:
    in_phase(phase)


def test_every_phase_refuses_some_event_but_backing_off() -> None:
    assert {p for p in Phase if TRANSITIONS[p] != frozenset(Event)} == set(Phase) - {
        Phase.BACKING_OFF
    }


@pytest.mark.parametrize(("phase", "event"), REFUSED)
def test_an_event_the_table_refuses_in_a_phase_is_a_protocol_bug(
    phase: Phase, event: Event
) -> None:
    machine, c = in_phase(phase)
    with pytest.raises(ProtocolBug, match=f"{event.value} is not allowed {phase.value}"):
        TAKE[event](machine, c, [])
    assert c.phase is phase  # nothing moved


@pytest.mark.parametrize(("phase", "event"), ALLOWED)
def test_an_event_the_table_allows_in_a_phase_leads_to_its_phase(
    phase: Phase, event: Event
) -> None:
    machine, c = in_phase(phase)
    TAKE[event](machine, c, [])
    assert c.phase is LEADS_TO[event]
