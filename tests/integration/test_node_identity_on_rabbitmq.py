"""Keys per node on a real RabbitMQ: a node that signs an offer and an acceptance with its
own valid key in another node's name has both dropped and counted by the requestor, and
the placement the requestor makes is one a node really holds."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from brokers import connect
from reservoir import NodeAgent, Requestor, audit
from reservoir.broker import Broker
from reservoir.clock import SystemClock
from reservoir.protocol.messages import Accepted, AllocationInfo, Offer
from reservoir.runtime.keys import Keyring, generate, parse_keys
from reservoir.runtime.keys.nodes import add_node_key, load_node_key, write_node_key
from reservoir.runtime.settings import Settings
from reservoir.runtime.wire import Codec

pytestmark = pytest.mark.rabbitmq
pytest.importorskip("cryptography")

REQUESTOR_PRIVATE, REQUESTOR_PUBLIC = generate("requestor-1", ed25519=True)


@pytest.fixture
def broker(reservoir_amqp_url: str) -> Iterator[Broker]:
    separator = "&" if "?" in reservoir_amqp_url else "?"
    opened = connect(f"{reservoir_amqp_url}{separator}exchange=identity-{uuid.uuid4().hex[:10]}")
    yield opened
    opened.delete_exchanges()  # type: ignore[attr-defined]
    opened.close()


def wait_for(condition: Callable[[], bool], *, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("not within the deadline")
        time.sleep(0.02)


def test_a_node_forging_another_nodes_offer_and_accepted_is_dropped_and_the_placement_is_real(
    broker: Broker, tmp_path: Path
) -> None:
    keyring = tmp_path / "keyring"
    suffix = uuid.uuid4().hex[:6]
    names = {role: f"{role}-{suffix}" for role in ("victim", "mallory", "honest")}
    key_files: dict[str, Path] = {}
    for role, name in names.items():
        signing, verifying = generate(f"{role}-1", ed25519=True)
        add_node_key(keyring, name, verifying)
        key_files[role] = tmp_path / f"{role}.key"
        write_node_key(key_files[role], signing, replace=False)

    def node(role: str, vcpus: int) -> NodeAgent:
        settings = Settings(node_key=key_files[role], requestor_keys=REQUESTOR_PUBLIC)
        return NodeAgent(broker, name=names[role], vcpus=vcpus, settings=settings)

    # the victim cannot take the request: believed, the forgery would place it there
    nodes = [node("victim", 1), node("mallory", 8), node("honest", 8)]
    forger = Codec(
        keys=Keyring(
            node=(load_node_key(key_files["mallory"]),),
            requestor=parse_keys(REQUESTOR_PUBLIC, setting="test"),
        ),
        role="node",
    )
    peer = broker.open_endpoint(lambda delivery: None, name=f"reservoir.peer-{suffix}")
    clock = SystemClock()
    victim = names["victim"]
    try:
        with Requestor(
            broker, settings=Settings(node_keyring=keyring, requestor_keys=REQUESTOR_PRIVATE)
        ) as requestor:
            request_id = f"forged-{suffix}"
            future = requestor.submit(request_id=request_id, vcpus=2, timeout_s=15)
            offer = Offer(
                request_id=request_id,
                sender=victim,
                reply_to=f"reservoir.node.{victim}",
                reservation_id="forged-1",
                attempt=1,
                slots=1,
                utilisation=0.0,
                ttl_s=5.0,
            )
            accepted = Accepted(
                request_id=request_id,
                sender=victim,
                reply_to=f"reservoir.node.{victim}",
                reservation_id="forged-1",
                allocations=(AllocationInfo(allocation_id="forged-a1", resources={"VCPU": 2}),),
            )
            for forged in (offer, accepted):
                body = forger.encode(forged, clock.wall(), destination=requestor.address)
                peer.send(requestor.address, body)
            placement = future.result(timeout=20)
            wait_for(lambda: requestor.metrics.get("dropped", "impersonation") == 2)
            assert victim not in placement.nodes
        audit([n.snapshot() for n in nodes], [placement]).raise_if_failed(allow_orphans=False)
        assert nodes[0].allocations() == []
    finally:
        peer.close()
        for n in nodes:
            n.close()
