"""Per-role signing: a node's key cannot sign what a requestor sends and the other way
round; keys roll over with two valid at once; replays, stale, oversized and re-addressed
messages are refused; keys come from settings, environment or a file; a participant that
drops messages for a signature reason says so once a minute, not once a message."""

from __future__ import annotations

import json
import logging
import secrets
from pathlib import Path

import msgspec.structs
import pytest

from reservoir.broker import Delivery
from reservoir.protocol.messages import (
    NODE_KINDS,
    REQUESTOR_KINDS,
    Accepted,
    AlreadyPlaced,
    Assessment,
    Award,
    Decline,
    Free,
    Freed,
    KeeperUp,
    LedgerQuery,
    Lookup,
    Message,
    NodeStatus,
    Offer,
    Refused,
    Release,
    ReservationRequest,
    RollCall,
    RosterMember,
    RosterQuery,
    RosterSample,
    TaskOutput,
    TaskOutputQuery,
    TaskQuery,
    TaskState,
    Untrusted,
    encode_message,
)
from reservoir.runtime.keys import Key, Keyring, generate, parse_keys
from reservoir.runtime.settings import Settings
from reservoir.runtime.wire import Codec, DecodeError, DropWarnings
from reservoir.testing import Simulation

NODE_SECRET = "node-secret-0123456789"
REQUESTOR_SECRET = "requestor-secret-0123456789"
NODE_KEYS = f"n1:{NODE_SECRET}"
REQUESTOR_KEYS = f"r1:{REQUESTOR_SECRET}"
WALL_S = 1_700_000_000.0

AWARD = Award(request_id="r1", sender="req", reply_to="req", reservation_id="x", slots=1)
OFFER = Offer(
    request_id="r1",
    sender="n1",
    reply_to="req",
    reservation_id="x",
    attempt=1,
    slots=1,
    utilisation=0.1,
    ttl_s=5.0,
)
REQUEST = ReservationRequest(
    request_id="r1",
    sender="req",
    reply_to="req",
    resources={"VCPU": 1},
    tier=10,
    attempt=1,
    ttl_s=5.0,
)


#: one message of every kind but the ledger report (whose parts need a whole ledger)
EVERY_KIND: dict[str, Message] = {
    m.kind: m
    for m in [
        REQUEST,
        AWARD,
        OFFER,
        Lookup(request_id="r1", sender="req", reply_to="req"),
        Release(request_id="r1", sender="req", reservation_id="x"),
        Free(request_id="r1", sender="req", reply_to="req"),
        RollCall(sender="req", reply_to="req"),
        RosterQuery(sender="req", reply_to="req", wanted=4, needs={"VCPU": 1}),
        RosterSample(
            sender="keeper",
            reply_to="keeper",
            members=(RosterMember(name="n1", address="node.n1", tier=10, room={"VCPU": 3}),),
        ),
        KeeperUp(sender="keeper", reply_to="keeper"),
        LedgerQuery(sender="req", reply_to="req", audit_id="a1"),
        Decline(request_id="r1", sender="n1", reply_to="req", attempt=1),
        Assessment(request_id="r1", sender="n1", reply_to="req", slots=0, utilisation=0, tier=10),
        AlreadyPlaced(request_id="r1", sender="n1", reply_to="req", allocations=()),
        Accepted(request_id="r1", sender="n1", reply_to="req", reservation_id="x", allocations=()),
        Refused(request_id="r1", sender="n1", reply_to="req", reservation_id="x", reason="gone"),
        Freed(request_id="r1", sender="n1", reply_to="req"),
        NodeStatus(sender="n1", reply_to="node.n1", tier=10),
        TaskState(request_id="r1", sender="n1", reply_to="req", allocation_id="a", state="exited"),
        TaskQuery(request_id="r1", sender="req", reply_to="req"),
        TaskOutputQuery(request_id="r1", sender="req", reply_to="req", allocation_id="a"),
        TaskOutput(
            request_id="r1", sender="n1", reply_to="node.n1", allocation_id="a", data=b"\x00out"
        ),
        Untrusted(
            request_id="untrusted", sender="req", reason="unknown_key", key_id="k", detail="a"
        ),
    ]
}


def keyring(node: str = NODE_KEYS, requestor: str = REQUESTOR_KEYS) -> Keyring:
    return Keyring(
        node=parse_keys(node, setting="node"), requestor=parse_keys(requestor, setting="req")
    )


def refusal(codec: Codec, body: bytes, destination: str | None = "node.n1") -> str:
    with pytest.raises(DecodeError) as refused:
        codec.decode(body, WALL_S, destination=destination)
    return refused.value.reason


def envelope(role: str, key: Key, message: Message, *, destination: str, sender: str) -> bytes:
    """A message signed by hand, claiming whatever role and sender a forger likes."""
    body = encode_message(message)
    header = f"RSV2 {role} {key.key_id} {WALL_S:.6f} {secrets.token_hex(12)} {destination} {sender}"
    signature = key.sign(header.encode() + b"\n" + body)
    return header.encode() + b" " + signature + b"\n" + body


# -- role separation ---------------------------------------------------------------------


def test_an_award_signed_with_a_node_key_is_refused_as_the_wrong_role() -> None:
    node_key = parse_keys(NODE_KEYS, setting="x")[0]
    receiver = Codec(keys=keyring(), role="node")
    # claiming to be a node's message: the signature holds, but nodes do not send awards
    as_node = envelope("node", node_key, AWARD, destination="node.n1", sender="req")
    assert refusal(receiver, as_node) == "wrong_role"
    # claiming to be a requestor's, under the node key's id
    as_requestor = envelope("requestor", node_key, AWARD, destination="node.n1", sender="req")
    assert refusal(receiver, as_requestor) == "wrong_role"
    # and a node's own codec will not sign one at all
    with pytest.raises(ValueError, match="does not send 'award'"):
        Codec(keys=keyring(), role="node").encode(AWARD, WALL_S, destination="node.n1")


@pytest.mark.parametrize("kind", sorted(EVERY_KIND))
def test_no_kind_is_taken_when_signed_with_the_other_roles_key(kind: str) -> None:
    message = EVERY_KIND[kind]
    mine, theirs = ("node", "requestor") if kind in NODE_KINDS else ("requestor", "node")
    assert kind in (NODE_KINDS if mine == "node" else REQUESTOR_KINDS)
    wrong_key = keyring().of(theirs)[0]  # type: ignore[arg-type]
    receiver = Codec(keys=keyring(), role=theirs)  # type: ignore[arg-type]
    for claimed in ("node", "requestor"):
        forged = envelope(claimed, wrong_key, message, destination="d", sender=message.sender)
        assert refusal(receiver, forged, destination="d") == "wrong_role"
    right_key = keyring().of(mine)[0]  # type: ignore[arg-type]
    genuine = envelope(mine, right_key, message, destination="d", sender=message.sender)
    assert receiver.decode(genuine, WALL_S, destination="d") == message


def test_every_kind_but_the_ledger_report_is_in_that_test() -> None:
    assert set(EVERY_KIND) == (NODE_KINDS | REQUESTOR_KINDS) - {"ledger_report"}


def test_an_award_signed_with_a_node_secret_under_a_requestor_key_id_does_not_verify() -> None:
    node_secret_as_r1 = parse_keys(f"r1:{NODE_SECRET}", setting="x")[0]
    forged = envelope("requestor", node_secret_as_r1, AWARD, destination="node.n1", sender="req")
    assert refusal(Codec(keys=keyring(), role="node"), forged) == "bad_signature"


def test_an_offer_signed_with_a_requestor_key_is_refused_as_the_wrong_role() -> None:
    requestor_key = parse_keys(REQUESTOR_KEYS, setting="x")[0]
    receiver = Codec(keys=keyring(), role="requestor")
    forged = envelope("requestor", requestor_key, OFFER, destination="req", sender="n1")
    assert refusal(receiver, forged, destination="req") == "wrong_role"
    with pytest.raises(ValueError, match="does not send 'offer'"):
        Codec(keys=keyring(), role="requestor").encode(OFFER, WALL_S, destination="req")


def test_each_role_signs_with_its_own_key_and_the_other_verifies_it() -> None:
    node, requestor = Codec(keys=keyring(), role="node"), Codec(keys=keyring(), role="requestor")
    award = requestor.encode(AWARD, WALL_S, destination="node.n1")
    assert award.startswith(b"RSV2 requestor r1 ")
    assert node.decode(award, WALL_S, destination="node.n1") == AWARD
    offer = node.encode(OFFER, WALL_S, destination="req")
    assert offer.startswith(b"RSV2 node n1 ")
    assert requestor.decode(offer, WALL_S, destination="req") == OFFER


def test_the_old_shared_secret_still_works_and_means_one_key_for_both_roles() -> None:
    shared = Codec(secret=b"a-shared-secret-of-some-length")
    award = shared.encode(AWARD, WALL_S, destination="node.n1")
    assert shared.decode(award, WALL_S, destination="node.n1") == AWARD
    keys = Settings(secret="a-shared-secret-of-some-length").keyring()
    assert keys is not None and keys.shared and keys.node == keys.requestor


# -- rotation ----------------------------------------------------------------------------


def test_during_a_rollover_both_keys_verify_and_the_first_one_signs() -> None:
    old_sender = Codec(keys=keyring(requestor=REQUESTOR_KEYS), role="requestor")
    new_sender = Codec(keys=keyring(requestor=f"r2:{'n' * 20},{REQUESTOR_KEYS}"), role="requestor")
    node = Codec(keys=keyring(requestor=f"r2:{'n' * 20},{REQUESTOR_KEYS}"), role="node")
    from_old = old_sender.encode(AWARD, WALL_S, destination="node.n1")
    from_new = new_sender.encode(AWARD, WALL_S, destination="node.n1")
    assert from_new.startswith(b"RSV2 requestor r2 ")
    assert node.decode(from_old, WALL_S, destination="node.n1") == AWARD
    assert node.decode(from_new, WALL_S, destination="node.n1") == AWARD


def test_a_key_id_nobody_configured_is_refused_as_unknown() -> None:
    stranger = Codec(keys=keyring(requestor=f"r9:{REQUESTOR_SECRET}"), role="requestor")
    body = stranger.encode(AWARD, WALL_S, destination="node.n1")
    assert refusal(Codec(keys=keyring(), role="node"), body) == "unknown_key"


# -- replay, freshness, size, tampering ----------------------------------------------------


def test_a_replayed_message_is_refused_and_a_stale_one_too() -> None:
    sender, receiver = Codec(keys=keyring(), role="node"), Codec(keys=keyring(), role="requestor")
    offer = sender.encode(OFFER, WALL_S, destination="req")
    receiver.decode(offer, WALL_S, destination="req")
    assert refusal(receiver, offer, destination="req") == "replayed"
    old = sender.encode(OFFER, WALL_S - 31, destination="req")
    assert refusal(receiver, old, destination="req") == "stale"
    from_the_future = sender.encode(OFFER, WALL_S + 31, destination="req")
    assert refusal(receiver, from_the_future, destination="req") == "stale"


def test_the_replay_cache_is_bounded_and_never_lets_a_forgotten_id_back_in() -> None:
    sender = Codec(keys=keyring(), role="node")
    receiver = Codec(keys=keyring(), role="requestor", replay_cache_entries=3)
    bodies = [sender.encode(OFFER, WALL_S + i / 10, destination="req") for i in range(5)]
    for body in bodies:
        receiver.decode(body, WALL_S + 1, destination="req")
    assert receiver.replay_cache_size() == 3
    # the first two are no longer remembered: refused anyway, as too old to tell
    assert refusal(receiver, bodies[0], destination="req") == "stale"
    assert refusal(receiver, bodies[4], destination="req") == "replayed"


def test_an_oversized_signed_message_is_refused_before_anything_else() -> None:
    codec = Codec(keys=keyring(), role="node", max_bytes=1024)
    assert refusal(codec, b"RSV2 " + b"x" * 2000) == "oversized"


def test_a_message_moved_to_another_routing_key_or_inbox_is_refused() -> None:
    sender, receiver = Codec(keys=keyring(), role="requestor"), Codec(keys=keyring(), role="node")
    request = sender.encode(REQUEST, WALL_S, destination="tier.10")
    assert refusal(receiver, request, destination="tier.100") == "wrong_destination"
    award = sender.encode(AWARD, WALL_S, destination="node.n1")
    assert refusal(receiver, award, destination="node.n2") == "wrong_destination"
    # rewriting the destination in the envelope breaks the signature
    rewritten = award.replace(b" node.n1 ", b" node.n2 ", 1)
    assert refusal(receiver, rewritten, destination="node.n2") == "bad_signature"


def test_a_tampered_sender_or_body_is_refused() -> None:
    sender, receiver = Codec(keys=keyring(), role="requestor"), Codec(keys=keyring(), role="node")
    award = sender.encode(AWARD, WALL_S, destination="node.n1")
    assert refusal(receiver, award.replace(b" req ", b" boss ", 1)) == "bad_signature"
    assert refusal(receiver, award.replace(b'"slots":1', b'"slots":9')) == "bad_signature"
    # a signature that holds over a sender other than the message's own
    key = parse_keys(REQUESTOR_KEYS, setting="x")[0]
    mismatched = envelope("requestor", key, AWARD, destination="node.n1", sender="boss")
    assert refusal(receiver, mismatched) == "wrong_sender"


def test_unsigned_old_and_garbled_envelopes_are_refused() -> None:
    receiver = Codec(keys=keyring(), role="node")
    assert refusal(receiver, encode_message(AWARD)) == "unsigned"
    assert refusal(receiver, b"RSV1.1.2.nonce.mac.{}") == "bad_envelope"
    assert refusal(receiver, b"RSV2 node n1 1.0\n{}") == "bad_envelope"
    assert refusal(receiver, b"RSV2 boss n1 1.0 n d s sig\n{}") == "bad_envelope"
    signed = Codec(keys=keyring(), role="requestor").encode(AWARD, WALL_S, destination="x")
    assert refusal(Codec(), signed, destination="x") == "unexpected_signature"


def test_our_own_returned_message_decodes_whatever_it_was_addressed_to() -> None:
    codec = Codec(keys=keyring(), role="requestor")
    body = codec.encode(REQUEST, WALL_S, destination="tier.10")
    assert codec.decode(body, WALL_S, destination=None, check_replay=False) == REQUEST
    assert codec.decode(body, WALL_S, destination=None, check_replay=False) == REQUEST


# -- Ed25519: a node cannot sign an award at all --------------------------------------------


def test_with_ed25519_a_node_holding_only_requestor_public_keys_cannot_forge_an_award() -> None:
    pytest.importorskip("cryptography")
    node_private, node_public = generate("n1", ed25519=True)
    requestor_private, requestor_public = generate("r1", ed25519=True)
    on_nodes = keyring(node=node_private, requestor=requestor_public)
    on_requestors = keyring(node=node_public, requestor=requestor_private)
    node, requestor = Codec(keys=on_nodes, role="node"), Codec(keys=on_requestors, role="requestor")
    award = requestor.encode(AWARD, WALL_S, destination="node.n1")
    assert node.decode(award, WALL_S, destination="node.n1") == AWARD
    offer = node.encode(OFFER, WALL_S, destination="req")
    assert requestor.decode(offer, WALL_S, destination="req") == OFFER
    # everything the node holds, used to make an award, is refused
    with pytest.raises(ValueError, match=r"current \(first\) key cannot sign"):
        Codec(keys=on_nodes, role="requestor")
    with pytest.raises(ValueError, match="public key"):
        on_nodes.requestor[0].sign(b"anything")
    forged = envelope("node", on_nodes.node[0], AWARD, destination="node.n1", sender="req")
    assert refusal(node, forged) == "wrong_role"


def test_a_participant_whose_own_current_key_is_public_only_fails_at_start() -> None:
    pytest.importorskip("cryptography")
    _, node_public = generate("n1", ed25519=True)
    settings = Settings(node_keys=node_public, requestor_keys=REQUESTOR_KEYS)
    with pytest.raises(ValueError, match="node role's current"):
        Simulation(settings=settings).add_node("n1", vcpus=4)


def test_signed_participants_place_with_per_role_keys_hmac_and_ed25519() -> None:
    pytest.importorskip("cryptography")
    node_private, node_public = generate("n1", ed25519=True)
    requestor_private, requestor_public = generate("r1", ed25519=True)
    for on_nodes, on_requestors in [
        (Settings(node_keys=NODE_KEYS, requestor_keys=REQUESTOR_KEYS),) * 2,
        (
            Settings(node_keys=node_private, requestor_keys=requestor_public),
            Settings(node_keys=node_public, requestor_keys=requestor_private),
        ),
    ]:
        sim = Simulation(settings=on_nodes)
        sim.add_node("n1", vcpus=4)
        requestor = sim.add_requestor(settings=on_requestors)
        placement = sim.place(requestor, vcpus=2)
        assert placement.nodes == ("n1",)
        sim.finish([placement])


# -- where keys come from ------------------------------------------------------------------


def test_keys_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # spaces and a trailing comma are allowed
    monkeypatch.setenv("RESERVOIR_NODE_KEYS", f"n2:{'b' * 16}, {NODE_KEYS},")
    monkeypatch.setenv("RESERVOIR_REQUESTOR_KEYS", REQUESTOR_KEYS)
    keys = Settings().keyring()
    assert keys is not None
    assert [k.key_id for k in keys.node] == ["n2", "n1"]
    assert [k.key_id for k in keys.requestor] == ["r1"]


def test_keys_come_from_a_json_or_toml_file(tmp_path: Path) -> None:
    as_json = tmp_path / "keys.json"
    as_json.write_text(json.dumps({"node": [NODE_KEYS], "requestor": [REQUESTOR_KEYS]}))
    as_toml = tmp_path / "keys.toml"
    as_toml.write_text(f'node = ["{NODE_KEYS}"]\nrequestor = ["{REQUESTOR_KEYS}"]\n')
    for path in (as_json, as_toml):
        keys = Settings(keys_file=path).keyring()
        assert keys is not None and keys.node[0].key_id == "n1"
        assert keys.requestor[0].key_id == "r1"


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"node_keys": "n1:short", "requestor_keys": REQUESTOR_KEYS}, "RESERVOIR_NODE_KEYS"),
        ({"node_keys": NODE_KEYS}, "RESERVOIR_REQUESTOR_KEYS is not set"),
        ({"secret": "x" * 20, "node_keys": NODE_KEYS}, "RESERVOIR_SECRET"),
        ({"secret": "short"}, "RESERVOIR_SECRET"),
        ({"node_keys": "no-colon", "requestor_keys": REQUESTOR_KEYS}, "RESERVOIR_NODE_KEYS"),
        ({"node_keys": f"bad id:{NODE_SECRET}", "requestor_keys": REQUESTOR_KEYS}, "key id"),
        ({"node_keys": f"{NODE_KEYS},{NODE_KEYS}", "requestor_keys": REQUESTOR_KEYS}, "twice"),
        ({"keys_file": "/nonexistent/keys.json"}, "RESERVOIR_KEYS_FILE"),
    ],
)
def test_unusable_keys_fail_when_the_settings_are_made_naming_the_setting(
    settings: dict[str, str], named: str
) -> None:
    with pytest.raises(ValueError, match=named) as failed:
        Settings(**settings)  # type: ignore[arg-type]
    shown = str(failed.value)
    assert "short" not in shown and NODE_SECRET not in shown  # no secret echoed


def test_a_key_never_shows_its_secret() -> None:
    key = parse_keys(NODE_KEYS, setting="x")[0]
    assert NODE_SECRET not in repr(key)
    assert NODE_SECRET not in repr(Settings(node_keys=NODE_KEYS, requestor_keys=REQUESTOR_KEYS))


# -- the rate-limited warning --------------------------------------------------------------


def test_a_node_dropping_bad_signatures_warns_once_a_minute_per_reason_and_sender(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sim = Simulation(settings=Settings(node_keys=NODE_KEYS, requestor_keys=REQUESTOR_KEYS))
    node = sim.add_node("n1", vcpus=4)
    wrong_key = Codec(keys=keyring(requestor=f"r1:{'w' * 20}"), role="requestor")

    def forged(sender: str) -> Delivery:
        award = msgspec.structs.replace(AWARD, sender=sender)
        wall_s = sim.scheduler.clock.wall()
        return Delivery(wrong_key.encode(award, wall_s, destination=node.address))

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

    with caplog.at_level(logging.WARNING, logger="reservoir.driver"):
        for _ in range(5):
            node._on_delivery(forged("misconfigured-requestor"))
        assert len(warnings()) == 1
        assert "'misconfigured-requestor'" in warnings()[0]
        assert "bad_signature" in warnings()[0]
        node._on_delivery(forged("another-requestor"))  # another sender: its own warning
        assert len(warnings()) == 2
        sim.advance(59.0)
        node._on_delivery(forged("misconfigured-requestor"))
        assert len(warnings()) == 2
        sim.advance(1.0)
        node._on_delivery(forged("misconfigured-requestor"))
        assert len(warnings()) == 3
        assert "5 more like it" in warnings()[2]
    assert node.metrics.get("dropped", "bad_signature") == 8
    sim.finish()


def test_drop_warnings_forget_the_oldest_senders_rather_than_grow() -> None:
    warned = DropWarnings(logging.getLogger("test"), interval_s=60.0, max_entries=2)
    errors = [DecodeError("bad_signature", "x", sender=f"s{i}") for i in range(3)]
    assert all(warned.dropped("n1", error, 0.0) for error in errors)
    assert warned.dropped("n1", errors[0], 1.0)  # forgotten, so warned about afresh
    assert not warned.dropped("n1", errors[2], 1.0)
    # a reason that is not about signatures is only counted, never warned about
    assert not warned.dropped("n1", DecodeError("malformed", "x"), 0.0)


def test_drop_warnings_stop_after_so_many_an_interval_however_many_senders_a_forger_invents(
    caplog: pytest.LogCaptureFixture,
) -> None:
    warned = DropWarnings(logging.getLogger("test.cap"), interval_s=60.0, max_warnings=3)
    with caplog.at_level(logging.WARNING, logger="test.cap"):
        for i in range(100):
            warned.dropped("n1", DecodeError("bad_signature", "x", sender=f"s{i}"), 0.0)
        assert len(caplog.records) == 4  # three, and one saying it stops
        assert "no more warnings" in caplog.records[-1].getMessage()
        warned.dropped("n1", DecodeError("bad_signature", "x", sender="late"), 60.0)
        assert len(caplog.records) == 5


def test_an_unsigned_message_is_warned_about_under_the_sender_it_claims(
    caplog: pytest.LogCaptureFixture,
) -> None:
    sim = Simulation(settings=Settings(node_keys=NODE_KEYS, requestor_keys=REQUESTOR_KEYS))
    node = sim.add_node("n1", vcpus=4)
    with caplog.at_level(logging.WARNING, logger="reservoir.driver"):
        node._on_delivery(Delivery(encode_message(REQUEST)))  # a keyless requestor
    assert node.metrics.get("dropped", "unsigned") == 1
    assert "from 'req': unsigned" in caplog.records[0].getMessage()
    sim.finish()


def test_a_keys_file_others_can_read_is_warned_about(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"node": [NODE_KEYS], "requestor": [REQUESTOR_KEYS]}))
    path.chmod(0o600)
    with caplog.at_level(logging.WARNING, logger="reservoir.keys"):
        Keyring.from_file(path)
        assert caplog.records == []
        path.chmod(0o644)
        Keyring.from_file(path)
    assert "chmod 600" in caplog.records[0].getMessage()
