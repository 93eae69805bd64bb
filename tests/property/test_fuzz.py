"""Fuzzing every handler: the codec and the wire envelope with mangled bytes, and the node
and requestor state machines with well-formed but adversarial messages (ids that collide
with live conversations, senders who are nobody, awards for reservations never made,
answers to attempts never asked, timers that are not theirs).

The properties: nothing escapes a handler (the codec raises only ``DecodeError``), no
participant stops answering (a clean placement still goes through afterwards), and the
invariants hold throughout (no overcommit, no reservation outliving its TTL).

The default run feeds well over 100,000 generated inputs (about 125,000) in about 20
seconds: each test counts what it really fed, over all of its examples, and asserts its own
share (:data:`FLOORS`, 100,000 together), so a test passes or fails alone, in any order.
``RESERVOIR_FUZZ_SLOW=1 python -m pytest tests/property/test_fuzz.py`` runs ten times as
many examples.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Callable, Hashable
from typing import Any

import msgspec.structs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reservoir.protocol.effects import Effect, Placed, Publish, Send, SetTimer
from reservoir.protocol.ledger import Inventory
from reservoir.protocol.messages import (
    AllocationInfo,
    Message,
    Offer,
    Reason,
    ReservationRequest,
    decode_message,
    encode_message,
    message_from_fields,
)
from reservoir.protocol.node import NodeConfig, NodeMachine
from reservoir.protocol.placement import PlacementRequest
from reservoir.protocol.requestor import RequestorMachine
from reservoir.protocol.requestor_state import RequestorConfig
from reservoir.protocol.timers import ConversationTimer, FreeTimer, TimerKind
from reservoir.runtime.wire import Codec, DecodeError

SLOW = os.environ.get("RESERVOIR_FUZZ_SLOW") == "1"
SCALE = 10 if SLOW else 1

FUZZ = settings(
    max_examples=60 * SCALE,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
    ],
)

#: the inputs each test must feed in the default run, 100,000 together (a run feeds about
#: 125,000): the sequences' and the floods' least sizes times their examples, and for the
#: codec a little over its least (runs feed it 20,000 to 34,000)
FLOORS = {
    "test_a_node_survives_any_sequence_of_messages_and_timers": 60 * 50,
    "test_a_requestor_survives_any_sequence_of_answers_and_timers": 60 * 50,
    "test_a_node_survives_a_flood_of_adversarial_messages": 40 * 1000,
    "test_a_requestor_survives_a_flood_of_adversarial_answers": 40 * 1000,
    "test_the_codec_refuses_mangled_bodies_with_a_reason_and_nothing_else": 14_000,
}


class Fed:
    """The inputs one test has fed its handlers, over all of hypothesis's examples."""

    def __init__(self) -> None:
        self.count = 0

    def __iadd__(self, inputs: int) -> Fed:
        self.count += inputs
        return self


def feeds(prop: Callable[..., None]) -> Callable[[], None]:
    """The test: ``prop`` (a hypothesis property taking ``fed`` first) run with a fresh
    :class:`Fed`, then the count asserted against the test's own floor in :data:`FLOORS`:
    the volume is each test's own, whatever else runs and in whatever order."""
    name = prop.__name__

    def test() -> None:
        fed = Fed()
        prop(fed=fed)
        print(f"{name}: fed {fed.count} inputs")
        assert fed.count >= FLOORS[name], f"fed {fed.count} inputs, fewer than {FLOORS[name]}"

    test.__name__ = test.__qualname__ = name
    test.__doc__ = prop.__doc__
    return test


# Small pools, so that fuzzed messages collide with the live state rather than miss it.
IDS = st.sampled_from(["r1", "r2", "r3", "x", "roster", "audit"])
NODES = st.sampled_from(["n0", "n1", "ghost", "req"])
PEERS = st.sampled_from(["req", "req-2", "evil", "n0"])
ADDRESSES = st.sampled_from(["req-inbox", "addr-n0", "reservoir.node.n0", "nowhere"])
RESERVATION_IDS = st.sampled_from(["n0.i.1", "n0.i.2", "n1.i.1", "bogus", "n0.i.999"])
ATTEMPTS = st.integers(1, 6)
SLOTS = st.integers(1, 5)
RESOURCES = st.dictionaries(
    st.sampled_from(["VCPU", "MEMORY_MB", "DISK_GB", "CUSTOM_GPU"]),
    st.integers(0, 10_000),
    max_size=3,
)
REASONS = st.lists(
    st.builds(
        Reason,
        code=st.sampled_from(["insufficient", "in_flight_elsewhere", "anti_affinity", "zz"]),
        subject=st.one_of(st.none(), PEERS),
    ),
    max_size=2,
).map(tuple)
ALLOCATIONS = st.lists(
    st.builds(AllocationInfo, allocation_id=RESERVATION_IDS.map(lambda r: r + "/0"),
              resources=RESOURCES),
    max_size=2,
).map(tuple)  # fmt: skip


def _valid(fields: dict[str, Any]) -> Message | None:
    try:
        return message_from_fields(fields)
    except ValueError:
        return None  # a shape no codec lets through (the codec fuzz covers those)


def _message(kind: str, **fields: Any) -> st.SearchStrategy[Message]:
    drawn = st.fixed_dictionaries({"kind": st.just(kind), **fields})
    return drawn.map(_valid).filter(lambda m: m is not None)  # type: ignore[return-value]


COMMON = {"request_id": IDS, "sender": PEERS}
REQUESTOR_SENT = st.one_of(
    _message("request", **COMMON, reply_to=ADDRESSES, tier=st.sampled_from([10, 50, 100]),
             attempt=ATTEMPTS, ttl_s=st.floats(0.01, 3600), resources=RESOURCES,
             count=SLOTS, probed_node=st.one_of(st.none(), NODES),
             findable=st.booleans()),
    _message("lookup", **COMMON, reply_to=ADDRESSES, following=st.booleans()),
    _message("award", **COMMON, reply_to=ADDRESSES, reservation_id=RESERVATION_IDS,
             slots=SLOTS),
    _message("release", **COMMON, reservation_id=RESERVATION_IDS),
    _message("free", **COMMON, reply_to=ADDRESSES,
             allocation_ids=st.lists(RESERVATION_IDS.map(lambda r: r + "/0"),
                                     max_size=2).map(tuple),
             reservation_id=st.one_of(st.none(), RESERVATION_IDS)),
    _message("roll_call", sender=PEERS, reply_to=ADDRESSES),
    _message("ledger_query", sender=PEERS, reply_to=ADDRESSES, audit_id=IDS),
)  # fmt: skip
NODE_SENT = st.one_of(
    _message("offer", **COMMON, reply_to=ADDRESSES, reservation_id=RESERVATION_IDS,
             attempt=ATTEMPTS, slots=SLOTS, utilisation=st.floats(0, 2),
             ttl_s=st.floats(0.01, 60), score=st.floats(-1e9, 1e9),
             group_members=st.integers(0, 3)),
    _message("decline", **COMMON, reply_to=ADDRESSES, attempt=ATTEMPTS,
             busy=st.booleans(), reasons=REASONS),
    _message("already_placed", **COMMON, reply_to=ADDRESSES, allocations=ALLOCATIONS,
             owner=st.one_of(st.none(), PEERS)),
    _message("accepted", **COMMON, reply_to=ADDRESSES, reservation_id=RESERVATION_IDS,
             allocations=ALLOCATIONS),
    _message("refused", **COMMON, reply_to=ADDRESSES, reservation_id=RESERVATION_IDS,
             reason=st.text(max_size=20)),
    _message("freed", **COMMON, reply_to=ADDRESSES,
             freed=st.lists(RESERVATION_IDS, max_size=2).map(tuple)),
    _message("status", sender=NODES, reply_to=ADDRESSES, tier=st.sampled_from([10, 50, 100]),
             leaving=st.booleans(), answering=st.booleans()),
)  # fmt: skip
ANY_MESSAGE = st.one_of(REQUESTOR_SENT, NODE_SENT)
STEPS = st.floats(0.0, 3.0)
TIMER_KEYS: st.SearchStrategy[Hashable] = st.one_of(
    st.builds(ConversationTimer, IDS, st.sampled_from(list(TimerKind)), st.integers(0, 6)),
    st.builds(FreeTimer, IDS, st.booleans()),
    st.just("expire-reservations"),
    st.text(max_size=5),
)

T0 = 1000.0
GOOD = ReservationRequest(
    request_id="clean", sender="req", reply_to="req-inbox", resources={"VCPU": 1},
    tier=100, attempt=1, ttl_s=5.0, probed_node="n0",
)  # fmt: skip


def a_node() -> NodeMachine:
    config = NodeConfig(
        name="n0",
        address="reservoir.node.n0",
        inventories={"VCPU": Inventory(8), "MEMORY_MB": Inventory(8192)},
        incarnation="i",
    )
    machine = NodeMachine(config)
    machine.start(T0)
    return machine


def assert_node_sound(machine: NodeMachine, now: float) -> None:
    assert machine.ledger.violations() == []
    for reservation in machine.ledger.reservations.values():
        assert reservation.deadline <= now + machine.config.max_ttl_s


@feeds
@FUZZ
@given(st.lists(st.tuples(st.one_of(ANY_MESSAGE, TIMER_KEYS), STEPS), min_size=50, max_size=300))
def test_a_node_survives_any_sequence_of_messages_and_timers(
    fed: Fed,
    events: list[tuple[Message | Hashable, float]],
) -> None:
    machine = a_node()
    now = T0
    # a real reservation to collide with: r1, reserved for req
    machine.handle(msgspec.structs.replace(GOOD, request_id="r1"), now)
    for event, step_s in events:
        now += step_s
        if hasattr(event, "kind"):
            machine.handle(event, now)  # type: ignore[arg-type]
        else:
            machine.on_timer(event, now)
        assert_node_sound(machine, now)
    fed += len(events)
    # and it still answers: a clean request (probed) gets an offer or a decline
    answer = [e for e in machine.handle(GOOD, now + 100) if isinstance(e, Send)]
    assert answer and answer[-1].message.kind in ("offer", "decline", "already_placed")


def a_requestor() -> RequestorMachine:
    return RequestorMachine(RequestorConfig(requestor_id="req", reply_to="req-inbox"))


def place_cleanly(machine: RequestorMachine, now: float) -> list[Effect]:
    """Place a fresh request end to end: offer, award, accept."""
    effects = machine.place(PlacementRequest(resources={"VCPU": 1}), "fresh", now, 30.0)
    asked = [
        e.message for e in effects
        if isinstance(e, Send | Publish) and isinstance(e.message, ReservationRequest)
    ]  # fmt: skip
    attempt = max(m.attempt for m in asked)
    offer = Offer(request_id="fresh", sender="n7", reply_to="addr-n7", reservation_id="n7.z.1",
                  attempt=attempt, slots=1, utilisation=0.1, ttl_s=5.0)  # fmt: skip
    effects = machine.handle(offer, now + 0.001)
    for _ in range(20):  # let the collect window (if any) run out
        if any(isinstance(e, Send) and e.message.kind == "award" for e in effects):
            break
        timers = [e for e in effects if isinstance(e, SetTimer)]
        if not timers:
            break
        first = min(timers, key=lambda t: t.at)
        effects = machine.on_timer(first.key, first.at)
        now = first.at
    from reservoir.protocol.messages import Accepted

    accepted = Accepted(
        request_id="fresh", sender="n7", reply_to="addr-n7", reservation_id="n7.z.1",
        allocations=(AllocationInfo(allocation_id="n7.z.1/0", resources={"VCPU": 1}),),
    )  # fmt: skip
    return machine.handle(accepted, now + 0.002)


@feeds
@FUZZ
@given(st.lists(st.tuples(st.one_of(ANY_MESSAGE, TIMER_KEYS), STEPS), min_size=50, max_size=300))
def test_a_requestor_survives_any_sequence_of_answers_and_timers(
    fed: Fed,
    events: list[tuple[Message | Hashable, float]],
) -> None:
    machine = a_requestor()
    now = T0
    machine.start(now)
    machine.place(PlacementRequest(resources={"VCPU": 1}, request_id="r1"), "r1", now, 30.0)
    machine.place(PlacementRequest(resources={"VCPU": 2}), "r2", now, 30.0)
    for event, step_s in events:
        now += step_s
        if hasattr(event, "kind"):
            machine.handle(event, now)  # type: ignore[arg-type]
            if event.kind in ("request", "lookup", "roll_call"):
                machine.on_unroutable(event, now)  # type: ignore[arg-type]
        else:
            machine.on_timer(event, now)
    fed += len(events)
    # and it still places
    effects = place_cleanly(machine, now + 100)
    assert any(isinstance(e, Placed) and e.request_id == "fresh" for e in effects), effects


# -- volume: many more messages per example, drawn by a generator hypothesis seeds -------
#
# The structured strategies above shrink a failure to its essence but are slow to draw;
# these draw from the same pools with a random source hypothesis seeds, much faster, so the
# default run feeds the machines tens of thousands of messages in seconds.

POOLS: dict[str, list[Any]] = {
    "request_id": ["r1", "r2", "r3", "x", "roster", "audit"],
    "sender": ["req", "req-2", "evil", "n0", "ghost"],
    "reply_to": ["req-inbox", "addr-n0", "reservoir.node.n0", "nowhere"],
    "reservation_id": ["n0.i.1", "n0.i.2", "n1.i.1", "bogus", "n0.i.999", "n7.z.1"],
}
KIND_FIELDS: dict[str, tuple[str, ...]] = {
    "request": ("reply_to", "tier", "attempt", "ttl_s", "resources", "count", "probed_node"),
    "lookup": ("reply_to", "following"),
    "award": ("reply_to", "reservation_id", "slots"),
    "release": ("reservation_id",),
    "free": ("reply_to", "allocation_ids"),
    "roll_call": ("reply_to",),
    "ledger_query": ("reply_to", "audit_id"),
    "offer": ("reply_to", "reservation_id", "attempt", "slots", "utilisation", "ttl_s"),
    "decline": ("reply_to", "attempt", "busy", "reasons"),
    "already_placed": ("reply_to", "allocations", "owner"),
    "accepted": ("reply_to", "reservation_id", "allocations"),
    "refused": ("reply_to", "reservation_id", "reason"),
    "freed": ("reply_to", "freed"),
    "status": ("reply_to", "tier", "leaving", "answering"),
}


def _field(rng: random.Random, name: str) -> Any:
    if name in POOLS:
        return rng.choice(POOLS[name])
    if name in ("attempt", "slots", "count"):
        return rng.randint(1, 6)
    if name == "tier":
        return rng.choice([10, 25, 50, 100])
    if name in ("ttl_s",):
        return rng.choice([0.01, 0.5, 5.0, 60.0, 3600.0])
    if name == "utilisation":
        return rng.random() * 2
    if name == "resources":
        return {
            rc: rng.randint(0, 9000)
            for rc in rng.sample(["VCPU", "MEMORY_MB", "CUSTOM_X"], rng.randint(0, 2))
        }
    if name in ("following", "busy", "leaving", "answering"):
        return rng.random() < 0.5
    if name == "probed_node":
        return rng.choice([None, "n0", "ghost"])
    if name == "owner":
        return rng.choice([None, "req", "evil"])
    if name == "audit_id":
        return rng.choice(["a1", "a2"])
    if name == "reason":
        return "no"
    if name == "reasons":
        code = rng.choice(["insufficient", "in_flight_elsewhere", "anti_affinity"])
        return [{"code": code, "subject": rng.choice([None, "evil", "aaa"])}]
    if name in ("allocation_ids", "freed"):
        return [rng.choice(POOLS["reservation_id"]) + "/0"]
    if name == "allocations":
        return [{"allocation_id": rng.choice(POOLS["reservation_id"]) + "/0",
                 "resources": {"VCPU": rng.randint(0, 4)}}]  # fmt: skip
    raise AssertionError(name)


def random_message(rng: random.Random) -> Message | None:
    kind = rng.choice(list(KIND_FIELDS))
    fields: dict[str, Any] = {"kind": kind, "sender": _field(rng, "sender")}
    if kind not in ("roll_call", "ledger_query", "status"):
        fields["request_id"] = _field(rng, "request_id")
    for name in KIND_FIELDS[kind]:
        fields[name] = _field(rng, name)
    return _valid(fields)


VOLUME = settings(
    max_examples=40 * SCALE,
    deadline=None,
    # the size is drawn large on purpose: each example is a flood
    suppress_health_check=[HealthCheck.large_base_example, HealthCheck.too_slow],
)


@feeds
@VOLUME
@given(st.integers(0, 2**32 - 1), st.integers(1000, 1500))
def test_a_node_survives_a_flood_of_adversarial_messages(fed: Fed, seed: int, size: int) -> None:
    rng = random.Random(seed)
    machine = a_node()
    now = T0
    machine.handle(msgspec.structs.replace(GOOD, request_id="r1"), now)
    sent = 0
    while sent < size:  # size messages fed (a draw no codec lets through is drawn again)
        now += rng.random() * 0.5
        message = random_message(rng)
        if message is None:
            continue
        machine.handle(message, now)
        sent += 1
        assert_node_sound(machine, now)
    fed += sent
    answer = [e for e in machine.handle(GOOD, now + 100) if isinstance(e, Send)]
    assert answer and answer[-1].message.kind in ("offer", "decline", "already_placed")


@feeds
@VOLUME
@given(st.integers(0, 2**32 - 1), st.integers(1000, 1500))
def test_a_requestor_survives_a_flood_of_adversarial_answers(
    fed: Fed, seed: int, size: int
) -> None:
    rng = random.Random(seed)
    machine = a_requestor()
    now = T0
    machine.start(now)
    machine.place(PlacementRequest(resources={"VCPU": 1}, request_id="r1"), "r1", now, 30.0)
    sent = 0
    while sent < size:  # size messages fed (a draw no codec lets through is drawn again)
        now += rng.random() * 0.5
        message = random_message(rng)
        if message is None:
            continue
        machine.handle(message, now)
        sent += 1
    fed += sent
    effects = place_cleanly(machine, now + 100)
    assert any(isinstance(e, Placed) and e.request_id == "fresh" for e in effects), effects


SAMPLE_BODIES = [
    encode_message(GOOD),
    encode_message(Offer(request_id="r1", sender="n0", reply_to="a", reservation_id="x",
                         attempt=1, slots=1, utilisation=0.5, ttl_s=5)),
]  # fmt: skip
SECRET = b"a-shared-secret-of-some-length"


@st.composite
def mangled(draw: st.DrawFn) -> bytes:
    """A body mangled the ways a hostile or broken sender would: random bytes, a valid
    body with bytes flipped, cut short, spliced, or with its JSON values replaced."""
    how = draw(st.sampled_from(["random", "flip", "cut", "splice", "json"]))
    base = draw(st.sampled_from(SAMPLE_BODIES))
    if how == "random":
        return draw(st.binary(max_size=300))
    if how == "flip":
        flips = draw(st.lists(st.tuples(st.integers(0, len(base) - 1), st.integers(0, 255)),
                              min_size=1, max_size=8))  # fmt: skip
        body = bytearray(base)
        for where, byte in flips:
            body[where] = byte
        return bytes(body)
    if how == "cut":
        return base[: draw(st.integers(0, len(base)))]
    if how == "splice":
        return base + draw(st.binary(max_size=40)) + base
    value = json.loads(base)
    key = draw(st.sampled_from(sorted(value)))
    value[key] = draw(
        st.one_of(st.none(), st.integers(), st.floats(allow_nan=True), st.text(max_size=10),
                  st.lists(st.integers(), max_size=3), st.dictionaries(st.text(max_size=3),
                                                                       st.integers(), max_size=2))
    )  # fmt: skip
    return json.dumps(value).encode()


@feeds
@FUZZ
@given(st.lists(mangled(), min_size=200, max_size=600), st.booleans())
def test_the_codec_refuses_mangled_bodies_with_a_reason_and_nothing_else(
    fed: Fed, bodies: list[bytes], signed: bool
) -> None:
    codec = Codec(secret=SECRET) if signed else Codec()
    sender = Codec(secret=SECRET) if signed else Codec()
    for body in bodies:
        if signed:
            # a signed envelope around the mangled body, then the envelope mangled too
            try:
                message = decode_message(body)
            except ValueError:
                candidates = [body, b"RSV2 " + body]
            else:
                sealed = sender.encode(message, T0, destination="tier.100")
                candidates = [sealed, sealed[:-3], sealed.replace(b"requestor", b"node", 1)]
        else:
            candidates = [body]
        for candidate in candidates:
            with contextlib.suppress(DecodeError):  # the one way a body may be refused
                codec.decode(candidate, T0, destination="tier.100")
            fed += 1
