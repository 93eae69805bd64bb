"""A node speaks only for itself: with a key per node and a node keyring, a message a node
signs in another node's name is dropped and counted, the placement a requestor makes is
one a node really stored, keys roll over with no restart of anyone but the node, and the
settings say plainly what is wrong with a per-node setup."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import pytest

from reservoir.protocol.messages import Accepted, AllocationInfo, Freed, Offer
from reservoir.runtime.keys import KeyConfigError, Keyring, generate, parse_keys
from reservoir.runtime.keys.nodes import (
    NodeKeyFile,
    NodeKeyring,
    add_node_key,
    load_node_key,
    retire_node_key,
    write_node_key,
)
from reservoir.runtime.settings import Settings
from reservoir.runtime.wire import Codec, DecodeError
from reservoir.testing import Simulation

pytest.importorskip("cryptography")

WALL_S = 1_700_000_000.0
REQUESTOR_PRIVATE, REQUESTOR_PUBLIC = generate("requestor-1", ed25519=True)


class NodeKeys:
    """A keyring directory and a key file per node, as `reservoir keys add-node` makes them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.keyring = root / "keyring"
        self.keyring.mkdir()

    def add_key(self, node: str, key_id: str) -> Path:
        signing, verifying = generate(key_id, ed25519=True)
        add_node_key(self.keyring, node, verifying)
        path = self.root / f"{key_id}.key"
        write_node_key(path, signing, replace=False)
        return path

    def node_settings(self, key_file: Path) -> Settings:
        return Settings(node_key=key_file, requestor_keys=REQUESTOR_PUBLIC)

    def requestor_settings(self) -> Settings:
        return Settings(node_keyring=self.keyring, requestor_keys=REQUESTOR_PRIVATE)


@pytest.fixture
def node_keys(tmp_path: Path) -> NodeKeys:
    return NodeKeys(tmp_path)


def node_codec(key_file: Path) -> Codec:
    """What a node signs with: its own key, first in the node role."""
    own = load_node_key(key_file)
    requestor = parse_keys(REQUESTOR_PUBLIC, setting="test")
    return Codec(keys=Keyring(node=(own,), requestor=requestor), role="node")


def offer_from(sender: str, request_id: str = "r1") -> Offer:
    return Offer(
        request_id=request_id,
        sender=sender,
        reply_to=f"reservoir.node.{sender}",
        reservation_id="forged-1",
        attempt=1,
        slots=1,
        utilisation=0.0,
        ttl_s=5.0,
    )


def accepted_from(sender: str, request_id: str = "r1") -> Accepted:
    allocation = AllocationInfo(allocation_id="forged-a1", resources={"VCPU": 2})
    return Accepted(
        request_id=request_id,
        sender=sender,
        reply_to=f"reservoir.node.{sender}",
        reservation_id="forged-1",
        allocations=(allocation,),
    )


def dropped(counters: Mapping[str, int]) -> int:
    """Messages dropped for any reason (counters are ``dropped:<reason>``)."""
    return sum(n for key, n in counters.items() if key.startswith("dropped:"))


def refusal(codec: Codec, body: bytes, wall_s: float = WALL_S) -> DecodeError:
    with pytest.raises(DecodeError) as refused:
        codec.decode(body, wall_s, destination="reservoir.requestor.web")
    return refused.value


# -- what a requestor believes ------------------------------------------------------------


def test_an_offer_accepted_or_freed_signed_with_another_nodes_key_is_impersonation(
    node_keys: NodeKeys,
) -> None:
    node_keys.add_key("victim", "victim-1")
    mallory = node_codec(node_keys.add_key("mallory", "mallory-1"))
    requestor = node_keys.requestor_settings().codec("requestor")
    freed = Freed(request_id="r1", sender="victim", reply_to="reservoir.node.victim")
    for forged in (offer_from("victim"), accepted_from("victim"), freed):
        body = mallory.encode(forged, WALL_S, destination="reservoir.requestor.web")
        error = refusal(requestor, body)
        assert error.reason == "impersonation"
        assert error.sender == "victim"
        assert "node 'mallory'" in error.detail
    # the same messages in mallory's own name are believed: only the claim was false
    for honest in (offer_from("mallory"), accepted_from("mallory")):
        body = mallory.encode(honest, WALL_S, destination="reservoir.requestor.web")
        assert requestor.decode(body, WALL_S, destination="reservoir.requestor.web") == honest


def test_with_one_key_for_every_node_the_same_forgery_was_believed() -> None:
    # Why keys per node: with the role's shared key, any node speaks for any other.
    private, public = generate("nodes-1", ed25519=True)
    nodes = Keyring(
        node=parse_keys(private, setting="n"), requestor=parse_keys(REQUESTOR_PUBLIC, setting="r")
    )
    requestors = Keyring(
        node=parse_keys(public, setting="n"), requestor=parse_keys(REQUESTOR_PRIVATE, setting="r")
    )
    forged = Codec(keys=nodes, role="node").encode(
        offer_from("victim"), WALL_S, destination="reservoir.requestor.web"
    )
    decoded = Codec(keys=requestors, role="requestor").decode(
        forged, WALL_S, destination="reservoir.requestor.web"
    )
    assert decoded.sender == "victim"


def test_a_node_missing_from_the_keyring_is_an_unknown_key(node_keys: NodeKeys) -> None:
    stranger = node_codec(node_keys.add_key("stranger", "stranger-1"))
    (node_keys.keyring / "stranger.pub").unlink()
    node_keys.add_key("someone", "someone-1")  # the keyring itself is not empty
    requestor = node_keys.requestor_settings().codec("requestor")
    body = stranger.encode(offer_from("stranger"), WALL_S, destination="reservoir.requestor.web")
    error = refusal(requestor, body)
    assert error.reason == "unknown_key"
    assert "node 'stranger' has no key 'stranger-1'" in error.detail


def test_a_key_id_another_node_also_uses_but_a_wrong_signature_is_no_impersonation(
    node_keys: NodeKeys,
) -> None:
    # Key ids are chosen per node; a forger naming another node's id without its private
    # key has forged nothing that verifies, and is told apart from a real node's key.
    node_keys.add_key("victim", "shared-id")
    node_keys.add_key("other", "other-1")
    impostor_private, _ = generate("shared-id", ed25519=True)
    impostor = Codec(
        keys=Keyring(
            node=parse_keys(impostor_private, setting="n"),
            requestor=parse_keys(REQUESTOR_PUBLIC, setting="r"),
        ),
        role="node",
    )
    requestor = node_keys.requestor_settings().codec("requestor")
    body = impostor.encode(offer_from("victim"), WALL_S, destination="reservoir.requestor.web")
    assert refusal(requestor, body).reason == "bad_signature"
    body = impostor.encode(offer_from("other"), WALL_S, destination="reservoir.requestor.web")
    assert refusal(requestor, body).reason == "unknown_key"


def test_a_node_forging_another_nodes_offer_and_accepted_is_dropped_and_counted_and_the_placement_is_real(  # noqa: E501
    node_keys: NodeKeys, caplog: pytest.LogCaptureFixture
) -> None:
    sim = Simulation(settings=node_keys.requestor_settings())
    # the victim cannot take the request; a believed forgery would place it there anyway
    sim.add_node(
        "victim", vcpus=1, settings=node_keys.node_settings(node_keys.add_key("victim", "v1"))
    )
    mallory_key = node_keys.add_key("mallory", "m1")
    sim.add_node("mallory", vcpus=8, settings=node_keys.node_settings(mallory_key))
    sim.add_node(
        "honest", vcpus=8, settings=node_keys.node_settings(node_keys.add_key("honest", "h1"))
    )
    requestor = sim.add_requestor("web")
    forger = node_codec(mallory_key)  # mallory's own valid key, another node's name
    peer = sim.broker.open_endpoint(lambda delivery: None, name="reservoir.node.mallory-peer")

    with caplog.at_level(logging.WARNING, logger="reservoir.driver"):
        future = requestor.submit(request_id="r-forged", vcpus=2)
        for forged in (offer_from("victim", "r-forged"), accepted_from("victim", "r-forged")):
            wall_s = sim.scheduler.clock.wall()
            peer.send(
                requestor.address, forger.encode(forged, wall_s, destination=requestor.address)
            )
        assert sim.run_until_done([future])
    placement = future.result(timeout=0)
    peer.close()

    assert requestor.metrics.get("dropped", "impersonation") == 2
    warnings = [
        r.getMessage()
        for r in caplog.records
        if "impersonation" in r.getMessage() and r.name == "reservoir.driver"
    ]
    assert len(warnings) == 1  # one line per sender and interval, not one per message
    assert "'victim'" in warnings[0]
    assert "node 'mallory'" in warnings[0]
    # and the node whose name was used is told, once, that someone else signs as it
    (told,) = [r.getMessage() for r in caplog.records if r.name == "reservoir.node_agent"]
    assert told.startswith(
        "node victim: requestor reservoir.requestor.web refused a message sent in this node's "
        "name with another key than this node's: impersonation (signed with the key 'm1' of "
        "node 'mallory', claims to be 'victim'); someone else signs as victim"
    )
    assert "victim" not in placement.nodes
    assert sim.nodes["victim"].allocations() == []
    sim.finish([placement], allow_orphans=False)  # the placement is what the nodes hold


def test_a_roster_keeper_and_its_requestors_place_on_nodes_with_keys_of_their_own(
    node_keys: NodeKeys,
) -> None:
    settings = Settings(
        node_keyring=node_keys.keyring, requestor_keys=REQUESTOR_PRIVATE, roster_from="keeper"
    )
    sim = Simulation(settings=settings)
    for name in ("n1", "n2"):
        sim.add_node(name, vcpus=4, settings=node_keys.node_settings(node_keys.add_key(name, name)))
    keeper = sim.add_keeper()
    placements = [sim.place(sim.add_requestor(), vcpus=2) for _ in range(3)]
    assert all(p.nodes for p in placements)
    assert dropped(sim.counters()) == 0
    assert keeper.metrics.total("dropped") == 0
    # the keeper believed both nodes' statuses, and the requestors asked it
    assert keeper.metrics.get("received", "status") >= 2
    assert keeper.metrics.get("received", "roster_query") >= 3
    sim.finish(placements, allow_orphans=False)


def test_unsigned_clusters_place_as_before() -> None:
    sim = Simulation()
    sim.add_nodes(2, vcpus=4)
    placement = sim.place(sim.add_requestor(), vcpus=2)
    assert placement.nodes
    assert dropped(sim.counters()) == 0
    sim.finish([placement], allow_orphans=False)


# -- rolling a node's key over -------------------------------------------------------------


def test_a_nodes_key_rolls_over_with_no_restart_of_any_requestor(node_keys: NodeKeys) -> None:
    old_key = node_keys.add_key("n1", "n1-old")
    sim = Simulation(settings=node_keys.requestor_settings())
    sim.add_node("n1", vcpus=8, settings=node_keys.node_settings(old_key))
    requestor = sim.add_requestor("web")
    first = sim.place(requestor, vcpus=1)
    assert first.nodes == ("n1",)

    # 1. the new public key joins the old one in the keyring; requestors look again
    new_key = node_keys.add_key("n1", "n1-new")
    sim.advance(NodeKeyring(node_keys.keyring).recheck_s)
    # 2. the node alone restarts with its new key (its allocations stay in its store)
    store = sim.nodes["n1"].store
    sim.restart_node("n1", vcpus=8, settings=node_keys.node_settings(new_key), store=store)
    second = sim.place(requestor, vcpus=1)
    assert second.nodes == ("n1",)
    # 3. the old key is retired: what it signs is no longer believed, within the recheck
    retire_node_key(node_keys.keyring, "n1", "n1-old")
    sim.advance(NodeKeyring(node_keys.keyring).recheck_s)
    stale = node_codec(old_key).encode(
        offer_from("n1"), sim.scheduler.clock.wall(), destination=requestor.address
    )
    sim.broker.open_endpoint(lambda delivery: None, name="old-key-peer").send(
        requestor.address, stale
    )
    third = sim.place(requestor, vcpus=1)
    assert third.nodes == ("n1",)
    assert requestor.metrics.get("dropped", "unknown_key") == 1
    assert requestor.metrics.get("dropped", "impersonation") == 0
    sim.finish([first, second, third], allow_orphans=False)


def test_a_nodes_key_file_replaced_in_place_is_signed_with_and_nobody_restarts(
    node_keys: NodeKeys, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = node_keys.add_key("n1", "n1-old")
    sim = Simulation(settings=node_keys.requestor_settings())
    node = sim.add_node("n1", vcpus=8, settings=node_keys.node_settings(key_file))
    requestor = sim.add_requestor("web")
    first = sim.place(requestor, vcpus=1)

    new_file = node_keys.add_key("n1", "n1-new")  # the keyring lists both
    sim.advance(2.0)  # every requestor has looked again
    os.replace(new_file, key_file)  # the node's key file, replaced whole
    retire_node_key(node_keys.keyring, "n1", "n1-old")
    sim.advance(2.0)
    with caplog.at_level(logging.INFO, logger="reservoir.keys"):
        second = sim.place(requestor, vcpus=1)
    assert second.nodes == ("n1",)  # signed with the new key: the old one is retired
    assert sim.nodes["n1"] is node
    assert requestor.metrics.total("dropped") == 0
    assert "now signing with key 'n1-new' (was 'n1-old')" in caplog.text
    sim.finish([first, second], allow_orphans=False)


def test_a_node_key_file_gone_bad_keeps_the_key_in_use(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "n1.key"
    write_node_key(path, generate("n1-a", ed25519=True)[0], replace=False)
    own = NodeKeyFile(path, recheck_s=1.0)
    path.write_text("nonsense\n")
    with caplog.at_level(logging.WARNING, logger="reservoir.keys"):
        own.recheck(5.0)
        own.recheck(7.0)
    assert [k.key_id for k in own.in_use()] == ["n1-a"]
    assert len(caplog.records) == 1  # said once, not every recheck
    assert "still signing with key 'n1-a'" in caplog.text
    write_node_key(path, generate("n1-a", ed25519=True)[0], replace=True)
    with caplog.at_level(logging.WARNING, logger="reservoir.keys"):
        own.recheck(10.0)
    assert "a different key under the same id 'n1-a'" in caplog.text
    assert [k.key_id for k in own.in_use()] == ["n1-a"]


def test_the_keyring_is_read_again_only_after_its_recheck_interval(node_keys: NodeKeys) -> None:
    node_keys.add_key("n1", "n1-a")
    keyring = NodeKeyring(node_keys.keyring, recheck_s=2.0)
    assert keyring.find("n1", "n1-a", 0.0) is not None
    node_keys.add_key("n2", "n2-a")
    assert keyring.find("n2", "n2-a", 1.0) is None  # not looked at again yet
    assert keyring.find("n2", "n2-a", 2.0) is not None
    (node_keys.keyring / "n2.pub").unlink()
    assert keyring.find("n2", "n2-a", 4.0) is None  # removing the file retires the node


def test_a_keyring_file_gone_bad_keeps_the_keys_it_had_and_says_so(
    node_keys: NodeKeys, caplog: pytest.LogCaptureFixture
) -> None:
    node_keys.add_key("n1", "n1-a")
    keyring = NodeKeyring(node_keys.keyring, recheck_s=1.0)
    (node_keys.keyring / "n1.pub").write_text("n1-a:ed25519-public:not-base64!\n")
    (node_keys.keyring / "n2.pub").write_text("n2-a:ed25519-public:not-base64!\n")  # new, bad
    with caplog.at_level(logging.WARNING, logger="reservoir.keys"):
        assert keyring.find("n1", "n1-a", 5.0) is not None
        assert keyring.find("n1", "n1-a", 10.0) is not None
        assert keyring.find("n2", "n2-a", 15.0) is None
    warnings = sorted(r.getMessage() for r in caplog.records)
    assert len(warnings) == 2  # once per file and change, not once per recheck
    assert "n1.pub, key 1: not base64; keeping the keys it had" in warnings[0]
    assert "n2.pub, key 1: not base64; node 'n2' has no keys until it is fixed" in warnings[1]


# -- settings ------------------------------------------------------------------------------


def test_per_node_keys_and_keys_every_node_shares_are_not_mixed(node_keys: NodeKeys) -> None:
    key_file = node_keys.add_key("n1", "n1-a")
    private, _ = generate("nodes", ed25519=True)
    with pytest.raises(ValueError, match=r"RESERVOIR_NODE_KEYS .* both set"):
        Settings(node_key=key_file, node_keys=private, requestor_keys=REQUESTOR_PUBLIC)
    with pytest.raises(ValueError, match="RESERVOIR_REQUESTOR_KEYS is not set"):
        Settings(node_keyring=node_keys.keyring)


def test_a_node_key_must_be_one_ed25519_private_key(node_keys: NodeKeys, tmp_path: Path) -> None:
    hmac_file = tmp_path / "hmac.key"
    hmac_file.write_text("n1:" + "s" * 32 + "\n")
    os.chmod(hmac_file, 0o600)
    with pytest.raises(KeyConfigError, match="must be an Ed25519 private key"):
        load_node_key(hmac_file)
    two = tmp_path / "two.key"
    two.write_text(generate("a", ed25519=True)[0] + "\n" + generate("b", ed25519=True)[0] + "\n")
    os.chmod(two, 0o600)
    with pytest.raises(KeyConfigError, match="holds 2 keys"):
        load_node_key(two)


def test_a_keyring_holding_a_private_key_is_refused_at_start(node_keys: NodeKeys) -> None:
    (node_keys.keyring / "n1.pub").write_text(generate("n1-a", ed25519=True)[0] + "\n")
    with pytest.raises(ValueError, match=r"RESERVOIR_NODE_KEYRING .*n1\.pub.*public keys only"):
        node_keys.requestor_settings()


def test_a_node_with_only_the_keyring_is_told_it_needs_a_key_of_its_own(
    node_keys: NodeKeys,
) -> None:
    node_keys.add_key("n1", "n1-a")
    with pytest.raises(ValueError, match="a node needs a key of its own"):
        node_keys.requestor_settings().codec("node")
