"""The messages and their checks: what a caller's request must be before it is placed,
what a message must be before a machine sees it, and what goes on the wire."""

from __future__ import annotations

import json

import pytest

from reservoir.protocol.messages import (
    GroupSpec,
    NumaSpec,
    Offer,
    Release,
    ReservationRequest,
    decode_message,
    encode_message,
)
from reservoir.protocol.placement import InvalidRequest, PlacementRequest, checked_request
from reservoir.runtime.wire import Codec, DecodeError
from reservoir.testing import Simulation

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
        ({"request_id": "has space"}, "request_id: Expected an id"),
        ({"group": GroupSpec(name="g", policy="sideways")}, "group.policy: Invalid enum value"),  # type: ignore[arg-type]
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
        (
            encode_message(REQUEST).replace(b'"reply_to":"req"', b'"reply_to":"r q"'),
            "invalid",
            "reply_to: Expected an id",
        ),
        (
            b'{"kind":"accepted","version":1,"request_id":"r1","sender":"n1","reply_to":"a",'
            b'"reservation_id":"q","allocations":[{"allocation_id":"x y","resources":{}}]}',
            "invalid",
            "allocations[0].allocation_id: Expected an id",
        ),
        (
            b'{"kind":"status","version":1,"sender":"n1","reply_to":"a","tier":10,'
            b'"room":{"vcpu":3}}',
            "invalid",
            "room: unknown resource class vcpu",
        ),
        # Python's "$" matches before a final newline; the checks must not
        (
            b'{"kind":"status","version":1,"sender":"n1","reply_to":"a","tier":10,'
            b'"room":{"CUSTOM_A\\n":3}}',
            "invalid",
            "room: unknown resource class CUSTOM_A",
        ),
        (
            encode_message(REQUEST).replace(b'"ttl_s"', b'"required_traits":["HW_X\\n"],"ttl_s"'),
            "invalid",
            "required_traits[0]: Expected `str` matching regex",
        ),
        (
            encode_message(REQUEST).replace(
                b'"ttl_s"', b'"hints":{"a":' + b"[" * 5000 + b"]" * 5000 + b'},"ttl_s"'
            ),
            "malformed",
            "nested too deep",
        ),
        (encode_message(REQUEST).replace(b'"r1"', b'"r\xff"'), "malformed", "not a JSON object"),
    ],
    ids=lambda value: value[:24].decode("ascii", "replace") if isinstance(value, bytes) else value,
)
def test_the_codec_says_why_it_refuses_a_body_and_where(
    body: bytes, reason: str, detail: str
) -> None:
    with pytest.raises(DecodeError) as refused:
        Codec().decode(body, 0.0, destination="tier.10")
    assert refused.value.reason == reason
    assert refused.value.detail.startswith(detail)


ALLOCATION = {"allocation_id": "res-1/0", "resources": {"VCPU": 1}}
HELD = {
    "allocation_id": "res-1/0",
    "request_id": "r1",
    "reservation_id": "res-1",
    "owner": "req",
    "resources": {"VCPU": 1},
    "request_count": 1,
}
#: one message of each shape that holds ids: at the top, optional, in a tuple, nested
WITH_IDS = [
    {**json.loads(encode_message(REQUEST)), "probed_node": "n1", "group": {
        "name": "g1", "policy": "anti-affinity"}},
    {"kind": "accepted", "version": 1, "request_id": "r1", "sender": "n1", "reply_to": "n1",
     "reservation_id": "res-1", "allocations": [ALLOCATION]},
    {"kind": "freed", "version": 1, "request_id": "r1", "sender": "n1", "reply_to": "n1",
     "allocation_ids": ["res-1/0"], "freed": ["res-1/0"]},
    {"kind": "ledger_report", "version": 1, "sender": "n1", "reply_to": "n1", "audit_id": "a",
     "incarnation": "i", "part": 0, "parts": 1, "tier": 10,
     "tallies": {"VCPU": {"capacity": 4, "allocated": 1, "reserved": 0}},
     "allocations": [HELD]},
]  # fmt: skip


def _id_paths(value: object, at: str = "") -> list[str]:
    """The dotted paths of every string in ``value`` that is an id in these samples."""
    not_ids = {"kind", "policy"}
    if isinstance(value, dict):
        return [p for k, v in value.items() if k not in not_ids and k not in ("resources",
                "tallies") for p in _id_paths(v, f"{at}{k}.")]  # fmt: skip
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _id_paths(v, f"{at[:-1]}[{i}].")]
    return [at[:-1]] if isinstance(value, str) else []


def _replaced(value: object, path: str, new: str) -> object:
    if not path:
        return new
    head, _, rest = path.partition(".")
    name, _, index = head.partition("[")
    if isinstance(value, dict):
        inner = value[name]
        if index:
            items = list(inner)
            items[int(index[:-1])] = _replaced(items[int(index[:-1])], rest, new)
            return {**value, name: items}
        return {**value, name: _replaced(inner, rest, new)}
    raise AssertionError(path)


@pytest.mark.parametrize("sample", WITH_IDS, ids=[s["kind"] for s in WITH_IDS])
def test_every_id_of_a_message_is_checked_wherever_it_sits_and_the_refusal_names_it(
    sample: dict[str, object],
) -> None:
    codec = Codec()
    assert codec.decode(json.dumps(sample).encode(), 0.0, destination=None, check_replay=False)
    paths = _id_paths(sample)
    assert len(paths) >= 4
    for path in paths:
        for bad in ("has space", "", "x" * 201, "a\x00b", "\x00"):
            body = json.dumps(_replaced(sample, path, bad)).encode()
            with pytest.raises(DecodeError) as refused:
                codec.decode(body, 0.0, destination=None, check_replay=False)
            assert refused.value.reason == "invalid"
            assert refused.value.detail.startswith(f"{path}: "), (path, refused.value.detail)
