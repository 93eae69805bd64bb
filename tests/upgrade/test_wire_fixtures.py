"""The golden wire fixtures: every message kind as release 0.1.0 writes it
(``wire/0.1.0/<kind>.<minimal|full>.json``, from ``wire_examples.py``), kept here.

This tree must read each of them and write it back as 0.1.0 wrote it; and what it writes
for 0.1 (``compatible_with`` 0.1, the default), 0.1.0's own decoder, run in the venv of
0.1.0's build, must take, meaning what this tree meant. Every field and kind 0.1.0 does
not know must be declared (``compatibility.ADDED``, ``ADDED_KINDS``), since what is
written for it leaves them out. A change the policy forbids (a field removed, renamed,
made required, given another default or narrower bounds, a kind renamed, a new field
written for 0.1) fails here (docs/design.md, "Upgrades: two releases at once")."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import msgspec
import msgspec.structs
import pytest

from reservoir.protocol import messages
from reservoir.protocol.compatibility import ADDED, ADDED_KINDS, Unwritable
from reservoir.protocol.messages import (
    Message,
    NodeStatus,
    ReservationRequest,
    RosterMember,
)
from reservoir.runtime.wire import Codec
from tests.upgrade import wire_probe
from tests.upgrade.release_builds import PREVIOUS, ReleaseBuild
from tests.upgrade.wire_examples import EXAMPLES, VARIANTS

HERE = Path(__file__).parent
FIXTURES = HERE / "wire" / PREVIOUS

#: what to set each field this tree added to, to show what it writes for 0.1 without it
ADDED_SAMPLES: dict[tuple[type, str], Any] = {
    (NodeStatus, "release"): "0.2.0",
    (NodeStatus, "features"): frozenset({"gpu-sharing"}),
    (RosterMember, "release"): "0.2.0",
    (RosterMember, "features"): frozenset({"gpu-sharing"}),
    (ReservationRequest, "needs"): frozenset({"gpu-sharing"}),
}


def fixture_names() -> list[str]:
    return [f"{kind}.{variant}" for kind in sorted(EXAMPLES) for variant in VARIANTS]


def fixture(name: str) -> bytes:
    return (FIXTURES / f"{name}.json").read_bytes().rstrip(b"\n")


def read(body: bytes) -> Message:
    """As a participant of this tree reads a body off the broker."""
    return Codec().decode(body, 0.0, destination=None, check_replay=False)


def written_for_0_1(message: Message) -> bytes:
    """As a participant of this tree, writing for 0.1 (the default), writes it."""
    return Codec(compatible_with="0.1").encode(message, 0.0, destination="anywhere")


def with_added(value: Any, *, essential: bool) -> Any:
    """``value`` (a message, or a part of one) with every field this tree added since
    0.1.0 set to its sample: the advisory ones, or the essential ones too."""
    if isinstance(value, tuple):
        return tuple(with_added(v, essential=essential) for v in value)
    if isinstance(value, dict):
        return {k: with_added(v, essential=essential) for k, v in value.items()}
    if not isinstance(value, msgspec.Struct):
        return value
    changes = {
        name: with_added(getattr(value, name), essential=essential)
        for name in value.__struct_fields__
    }
    for name, added in ADDED.get(type(value), {}).items():
        if essential or not added.essential:
            changes[name] = ADDED_SAMPLES[type(value), name]
    return msgspec.structs.replace(value, **changes)


def machine_messages() -> list[Message]:
    """What this tree's machines build in a conversation, a roll call, a keeper's answer
    and a free: as they build them, not as a test would (an empty set that is not the
    field's default object is written ``[]``, which 0.1.0 refuses)."""
    from reservoir.protocol.effects import Publish, Send
    from reservoir.protocol.keeper import KeeperConfig, KeeperMachine
    from reservoir.protocol.ledger import Inventory
    from reservoir.protocol.messages import RollCall, RosterQuery
    from reservoir.protocol.node import NodeConfig, NodeMachine
    from reservoir.protocol.placement import PlacementRequest
    from reservoir.protocol.requestor import RequestorMachine
    from reservoir.protocol.requestor_state import RequestorConfig

    def said(effects: list[Any]) -> list[Message]:
        return [e.message for e in effects if isinstance(e, Send | Publish)]

    built: list[Message] = []
    inventories = {"VCPU": Inventory(total=8)}
    node = NodeMachine(
        NodeConfig(name="n1", address="reservoir.node.n1", inventories=inventories, release="0.2")
    )
    built += said(node.start(0.0))
    requestor = RequestorMachine(RequestorConfig(requestor_id="r", reply_to="r-inbox"))
    built += said(requestor.start(0.0))
    for message in said(node.handle(RollCall(sender="r", reply_to="r-inbox"), 0.0)):
        built.append(message)
        requestor.handle(message, 0.0)
    keeper = KeeperMachine(KeeperConfig(keeper_id="k", reply_to="k-inbox"))
    built += said(keeper.start(0.0))
    keeper.handle(built[0], 0.0)
    built += said(keeper.handle(RosterQuery(sender="r", reply_to="r-inbox", wanted=4), 0.0))
    asked = said(requestor.place(PlacementRequest(resources={"VCPU": 1}), "job-1", 0.0, 30.0))
    built += asked
    for request in asked:
        for answer in said(node.handle(request, 0.0)):
            built.append(answer)
            for award in said(requestor.handle(answer, 0.01)):
                built.append(award)
                built += said(node.handle(award, 0.01))
    return built


def ask_release(release: ReleaseBuild, *args: str, bodies: list[bytes] | None = None) -> Any:
    stdin = json.dumps([base64.b64encode(b).decode() for b in bodies or []])
    done = release.run(str(HERE / "wire_probe.py"), *args, input=stdin)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# -- this tree and the fixtures (no build of 0.1.0 needed) --------------------------------


def test_every_kind_0_1_0_writes_is_kept_with_its_required_fields_and_with_all() -> None:
    kept = sorted(p.name.removesuffix(".json") for p in FIXTURES.glob("*.json"))
    assert kept == sorted(fixture_names())
    for kind, (minimal, full) in EXAMPLES.items():
        assert minimal["kind"] == full["kind"] == kind


@pytest.mark.parametrize("name", fixture_names())
def test_this_release_reads_each_message_0_1_0_writes_and_writes_it_back_as_0_1_0_did(
    name: str,
) -> None:
    body = fixture(name)
    message = read(body)
    assert message.kind == name.split(".")[0]
    assert json.loads(written_for_0_1(message)) == json.loads(body)


def test_every_field_this_release_added_has_a_sample_here() -> None:
    declared = {(cls, name) for cls, fields in ADDED.items() for name in fields}
    assert declared == set(ADDED_SAMPLES)


def test_what_the_machines_build_written_for_0_1_holds_no_field_0_1_0_does_not_know() -> None:
    known = {kind: set(full) for kind, (_, full) in EXAMPLES.items()}
    built = machine_messages()
    assert {"status", "request", "offer", "award", "accepted", "roster_sample"} <= {
        m.kind for m in built
    }
    for message in built:
        written = json.loads(written_for_0_1(message))
        assert set(written) - {"version"} <= known[message.kind], written
        for member in written.get("members", []):
            assert set(member) <= {"name", "address", "tier", "room"}, member


def test_an_essential_field_is_never_written_for_0_1_it_is_an_error_to_try() -> None:
    for name in fixture_names():
        message = read(fixture(name))
        if any(added.essential for added in ADDED.get(type(message), {}).values()):
            with pytest.raises(Unwritable):
                written_for_0_1(with_added(message, essential=True))


# -- with 0.1.0's own build ----------------------------------------------------------------


@pytest.mark.e2e
def test_the_fixtures_are_what_0_1_0_writes_and_every_field_of_it_is_in_a_full_one(
    previous_release: ReleaseBuild, tmp_path: Path
) -> None:
    done = previous_release.run(str(HERE / "wire_examples.py"), str(tmp_path))
    assert done.returncode == 0, done.stderr
    for name in fixture_names():
        assert (tmp_path / f"{name}.json").read_bytes() == (FIXTURES / f"{name}.json").read_bytes()
    described = ask_release(previous_release, "fields")
    assert sorted(EXAMPLES) == described["kinds"]
    in_parts = set().union(*(_keys(full) for _, full in EXAMPLES.values()))
    for name, fields in described["fields"].items():
        cls = getattr(messages, name)
        if hasattr(cls, "kind"):
            (full,) = [f for kind, (_, f) in EXAMPLES.items() if kind == cls.kind]
            lacking = set(fields) - {"kind", "version"} - set(full)
        else:  # a part of messages (a reason, an allocation...): somewhere in one
            lacking = set(fields) - in_parts
        assert not lacking, f"{name}: no full example sets {sorted(lacking)}"


def _keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value).union(*(_keys(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_keys(v) for v in value))
    return set()


@pytest.mark.e2e
def test_0_1_0_reads_what_this_release_writes_for_it_and_takes_it_to_mean_the_same(
    previous_release: ReleaseBuild,
) -> None:
    written = []
    for name in fixture_names():
        message = read(fixture(name))
        written.append(written_for_0_1(message))
        # with everything this release adds that may go to 0.1 (left out for it)
        written.append(written_for_0_1(with_added(message, essential=False)))
    written += [written_for_0_1(message) for message in machine_messages()]
    answers = ask_release(previous_release, "decode", bodies=written)
    for body, answer in zip(written, answers, strict=True):
        assert answer["ok"], f"0.1.0 refused {body!r}: {answer}"
        assert json.loads(answer["json"]) == json.loads(body)


@pytest.mark.e2e
def test_written_for_0_2_what_this_release_adds_is_refused_by_0_1_0_hence_the_default(
    previous_release: ReleaseBuild,
) -> None:
    status = with_added(read(fixture("status.minimal")), essential=False)
    body = Codec(compatible_with="0.2").encode(status, 0.0, destination="roster")
    (answer,) = ask_release(previous_release, "decode", bodies=[body])
    assert answer == {
        "ok": False,
        "reason": "invalid",
        "detail": "message: Object contains unknown field `release`",
    }


@pytest.mark.e2e
def test_every_field_and_kind_0_1_0_does_not_know_is_declared_and_none_it_knows_is_gone(
    previous_release: ReleaseBuild,
) -> None:
    described = ask_release(previous_release, "fields")
    theirs: dict[str, list[str]] = described["fields"]
    ours: dict[str, list[str]] = wire_probe.fields()["fields"]  # asked of this tree
    assert set(theirs) <= set(ours), "a struct 0.1.0 has is gone"
    for name, fields in theirs.items():
        assert set(fields) <= set(ours[name]), f"{name} lost a field 0.1.0 has"
        added = set(ours[name]) - set(fields)
        assert added == set(ADDED.get(getattr(messages, name), {})), f"{name}: fields added"
    kinds = set(wire_probe.fields()["kinds"])
    assert set(described["kinds"]) <= kinds, "a kind 0.1.0 has is gone"
    assert kinds - set(described["kinds"]) == set(ADDED_KINDS)
