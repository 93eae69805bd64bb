"""The messages and their checks: what a caller's request must be before it is placed,
what a message must be before a machine sees it, and what goes on the wire."""

from __future__ import annotations

import json

import pytest

from reservoir.protocol.messages import (
    NumaSpec,
    Offer,
    Release,
    ReservationRequest,
    decode_message,
    encode_message,
)
from reservoir.protocol.placement import InvalidRequest, PlacementRequest, checked_request
from reservoir.testing import Simulation
from reservoir.wire import Codec, DecodeError

REQUEST = ReservationRequest(
    request_id="r1",
    sender="req",
    reply_to="req",
    tier=10,
    attempt=1,
    ttl_s=5.0,
    resources={"VCPU": 2},
)


def test_building_a_request_checks_how_its_fields_fit_together() -> None:
    with pytest.raises(ValueError, match="positive amount"):
        PlacementRequest(resources={"VCPU": 0})
    with pytest.raises(ValueError, match="min_count cannot exceed count"):
        PlacementRequest(resources={"VCPU": 1}, count=2, min_count=3)
    with pytest.raises(ValueError, match="unknown resource class GPUS"):
        PlacementRequest(resources={"GPUS": 1})
    with pytest.raises(ValueError, match="both required and forbidden"):
        PlacementRequest(
            resources={"VCPU": 1},
            required_traits=frozenset({"HW_GPU"}),
            forbidden_traits=frozenset({"HW_GPU"}),
        )


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"count": 0}, "count: Expected `int` >= 1"),
        ({"count": 10_001}, "count: Expected `int` <= 10000"),
        ({"request_id": "has space"}, "request_id: Expected `str` matching regex"),
        ({"required_traits": frozenset({"lower_case"})}, "required_traits[0]: Expected `str`"),
        ({"numa": NumaSpec(nodes=17)}, "numa.nodes: Expected `int` <= 16"),
        ({"hints": {"when": object()}}, "hints: not JSON"),
    ],
)
def test_a_request_is_checked_field_by_field_before_it_is_placed_and_the_error_names_the_field(
    fields: dict[str, object], named: str
) -> None:
    request = PlacementRequest(resources={"VCPU": 1}, **fields)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest) as refused:
        checked_request(request)
    assert str(refused.value).startswith(named)


def test_a_requestor_refuses_a_bad_request_before_anything_is_sent() -> None:
    sim = Simulation()
    sim.add_node("n1", vcpus=4)
    requestor = sim.add_requestor()
    sent_before = sim.broker.stats.sent
    with pytest.raises(InvalidRequest, match="count"):
        requestor.submit(vcpus=1, count=0)
    assert sim.broker.stats.sent == sent_before
    placement = sim.place(requestor, vcpus=1)
    assert placement.nodes == ("n1",)
    sim.finish([placement])


def test_a_checked_request_is_the_same_request() -> None:
    request = PlacementRequest(resources={"VCPU": 1}, request_id="mine", hints={"zone": "a"})
    assert checked_request(request) == request


def test_the_protocol_version_is_always_on_the_wire_and_unset_options_are_not() -> None:
    body = json.loads(encode_message(Release(request_id="r1", sender="req", reservation_id="x")))
    assert body["version"] == 1
    request = json.loads(encode_message(REQUEST))
    assert request["version"] == 1
    for unset in ("probed_node", "dry_run", "declines_wanted", "traceparent", "hints"):
        assert unset not in request


def test_a_message_decodes_to_what_was_encoded() -> None:
    offer = Offer(
        request_id="r1",
        sender="n1",
        reply_to="n1",
        reservation_id="res",
        attempt=1,
        slots=2,
        utilisation=0.5,
        ttl_s=5.0,
        room={"VCPU": 3},
    )
    for message in (offer, REQUEST):
        assert decode_message(encode_message(message)) == message


@pytest.mark.parametrize(
    ("body", "reason", "detail"),
    [
        (b'{"kind":"offer"', "malformed", "not a JSON object"),
        (b"[1]", "malformed", "not a JSON object"),
        (b'{"kind":"teleport"}', "unknown_kind", "kind: Invalid value 'teleport'"),
        (b'{"request_id":"r"}', "unknown_kind", "kind: Object missing required field `kind`"),
        (
            encode_message(REQUEST).replace(b'"attempt":1', b'"attempt":0'),
            "invalid",
            "attempt: Expected `int` >= 1",
        ),
        (
            encode_message(REQUEST).replace(b'"VCPU":2', b'"VCPU":-1'),
            "invalid",
            "resources[...]: Expected `int` >= 0",
        ),
    ],
)
def test_the_codec_says_why_it_refuses_a_body_and_where(
    body: bytes, reason: str, detail: str
) -> None:
    with pytest.raises(DecodeError) as refused:
        Codec().decode(body, 0.0, destination="tier.10")
    assert refused.value.reason == reason
    assert refused.value.detail.startswith(detail)
