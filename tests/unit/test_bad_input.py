"""Bad input reaches a node or a requestor: it is dropped and counted, never raised, and
the participant keeps working."""

from __future__ import annotations

import json

import pytest

from reservoir.broker import Delivery
from reservoir.protocol.messages import Release, ReservationRequest, encode_message
from reservoir.runtime.settings import Settings
from reservoir.runtime.wire import Codec, DecodeError
from reservoir.testing import Simulation

SECRET = "a-shared-secret-of-some-length"

GOOD_REQUEST = ReservationRequest(
    request_id="r1",
    sender="req",
    reply_to="nowhere",
    resources={"VCPU": 1},
    tier=10,
    attempt=1,
    ttl_s=5.0,
)

GOOD_BODY = encode_message(GOOD_REQUEST)
BAD_BODIES = {
    "malformed": b"{not json",
    "malformed-array": b"[1, 2, 3]",
    "unknown_kind": json.dumps({"kind": "teleport", "request_id": "r", "sender": "s"}).encode(),
    "no_kind": json.dumps({"request_id": "r", "sender": "s"}).encode(),
    "invalid-types": encode_message(GOOD_REQUEST)
    .decode()
    .replace('"attempt":1', '"attempt":"x"')
    .encode(),
    "invalid-version": encode_message(GOOD_REQUEST)
    .decode()
    .replace('"version":1', '"version":99')
    .encode(),
    "invalid-negative": encode_message(GOOD_REQUEST)
    .decode()
    .replace('"VCPU":1', '"VCPU":-5')
    .encode(),
    "oversized": b'{"kind":"request","pad":"' + b"x" * 70_000 + b'"}',
    "empty": b"",
    "binary": bytes(range(256)),
}

EXPECTED_REASON = {
    "malformed": "malformed",
    "malformed-array": "malformed",
    "unknown_kind": "unknown_kind",
    "no_kind": "unknown_kind",
    "oversized": "oversized",
    "empty": "malformed",
    "binary": "malformed",
    "invalid-version": "unsupported_version",
}


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_the_codec_refuses_bad_bodies_with_a_reason(name: str) -> None:
    with pytest.raises(DecodeError) as refused:
        Codec().decode(BAD_BODIES[name], 0.0, destination="tier.10")
    assert refused.value.reason == EXPECTED_REASON.get(name, "invalid")


def test_a_field_a_later_release_added_is_no_bad_input_the_message_is_read_without_it() -> None:
    # 0.1.0 dropped such a message as invalid (docs/design.md, "Upgrades")
    later = encode_message(GOOD_REQUEST).decode().replace("{", '{"evil":{"x":[1]},', 1)
    assert Codec().decode(later.encode(), 0.0, destination="tier.10") == GOOD_REQUEST


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_bad_input_to_a_node_and_a_requestor_is_dropped_counted_and_harmless(
    reservoir_simulation: Simulation, name: str
) -> None:
    sim = reservoir_simulation
    node = sim.add_node("n1", vcpus=4, memory_mb=4096)
    requestor = sim.add_requestor()
    body = BAD_BODIES[name]
    for participant in (node, requestor):
        participant._on_delivery(Delivery(body))  # straight into the broker's callback
        participant._on_delivery(Delivery(body, returned=True))
        assert participant.metrics.total("dropped") == 2
    # and both still work
    placement = sim.place(requestor, vcpus=1, memory_mb=512)
    assert placement.nodes == ("n1",)
    sim.finish([placement])


def test_bad_bodies_sent_over_the_broker_are_dropped_too(reservoir_simulation: Simulation) -> None:
    sim = reservoir_simulation
    node = sim.add_node("n1", vcpus=4)
    attacker = sim.broker.open_endpoint(lambda delivery: None, name="attacker")
    for body in BAD_BODIES.values():
        attacker.publish("tier.10", body)
        attacker.send(node.address, body)
    sim.scheduler.run_until_idle()
    assert node.metrics.total("dropped") == 2 * len(BAD_BODIES)
    attacker.close()


def signed_simulation() -> Simulation:
    return Simulation(settings=Settings(secret=SECRET))


def test_with_a_secret_unsigned_messages_are_dropped_as_unsigned() -> None:
    sim = signed_simulation()
    node = sim.add_node("n1", vcpus=4)
    node._on_delivery(Delivery(encode_message(GOOD_REQUEST)))
    assert node.metrics.get("dropped", "unsigned") == 1
    assert node.snapshot().reservations == ()
    sim.finish()


def test_with_a_secret_a_forged_signature_is_dropped() -> None:
    sim = signed_simulation()
    node = sim.add_node("n1", vcpus=4)
    forger = Codec(secret=b"not-the-shared-secret-at-all")
    wall_s = sim.scheduler.clock.wall()
    node._on_delivery(Delivery(forger.encode(GOOD_REQUEST, wall_s, destination=node.address)))
    assert node.metrics.get("dropped", "bad_signature") == 1
    tampered = Codec(secret=SECRET.encode()).encode(GOOD_REQUEST, wall_s, destination=node.address)
    node._on_delivery(Delivery(tampered.replace(b'"VCPU":1', b'"VCPU":4')))
    assert node.metrics.get("dropped", "bad_signature") == 2
    sim.finish()


def test_with_a_secret_a_replayed_message_is_dropped() -> None:
    sim = signed_simulation()
    node = sim.add_node("n1", vcpus=4)
    codec = Codec(secret=SECRET.encode())
    release = Release(request_id="r1", sender="req", reservation_id="x")
    body = codec.encode(release, sim.scheduler.clock.wall(), destination=node.address)
    node._on_delivery(Delivery(body))
    node._on_delivery(Delivery(body))
    assert node.metrics.get("dropped", "replayed") == 1
    sim.finish()


def test_with_a_secret_a_stale_message_is_dropped() -> None:
    sim = signed_simulation()
    node = sim.add_node("n1", vcpus=4)
    codec = Codec(secret=SECRET.encode())
    body = codec.encode(GOOD_REQUEST, sim.scheduler.clock.wall() - 120, destination=node.address)
    node._on_delivery(Delivery(body))
    assert node.metrics.get("dropped", "stale") == 1
    sim.finish()


def test_signed_participants_place_normally() -> None:
    sim = signed_simulation()
    sim.add_node("n1", vcpus=4)
    requestor = sim.add_requestor()
    placement = sim.place(requestor, vcpus=2)
    assert placement.nodes == ("n1",)
    sim.finish([placement])


def test_a_handler_never_raises_even_when_the_machine_is_handed_nonsense() -> None:
    sim = Simulation()
    node = sim.add_node("n1", vcpus=4)
    # a well-formed message that makes no sense for a node: ignored, counted
    node._on_delivery(Delivery(encode_message(GOOD_REQUEST)))
    accepted_for_nobody = (
        b'{"kind":"accepted","version":1,"request_id":"zz","sender":"x","reply_to":"y",'
        b'"reservation_id":"q","allocations":[]}'
    )
    node._on_delivery(Delivery(accepted_for_nobody))
    assert node.metrics.get("ignored", "unexpected") == 1
    sim.finish()


def test_with_roles_configured_a_message_from_the_wrong_broker_user_is_dropped() -> None:
    sim = Simulation(settings=Settings(requestor_users=frozenset({"scheduler"}),
                                       node_users=frozenset({"compute"})))  # fmt: skip
    node = sim.add_node("n1", vcpus=4)
    body = encode_message(GOOD_REQUEST)
    node._on_delivery(Delivery(body, user_id="compute"))  # a node posing as a requestor
    node._on_delivery(Delivery(body, user_id=None))  # nobody vouches for the sender
    assert node.metrics.get("dropped", "untrusted_sender") == 2
    assert node.snapshot().reservations == ()
    node._on_delivery(Delivery(body, user_id="scheduler"))
    assert len(node.snapshot().reservations) == 1
    sim.finish()
