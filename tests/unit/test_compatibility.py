"""Two releases at once (docs/design.md, "Upgrades: two releases at once"), as the machines
and the codec see it, with no broker: what is written for a reader of 0.1, what a node
does with a request needing a feature it does not know, which nodes a requestor asks for
one, and the release traits. A node "of a later release" here is a machine told of a
feature this tree does not have, as a later release would be; 0.1.0's own decoder reads
what is written for it in tests/upgrade/test_wire_fixtures.py."""

from __future__ import annotations

from typing import Any

import pytest

from reservoir.protocol.compatibility import (
    ADDED,
    KNOWN_FEATURES,
    RELEASE_LINES,
    Feature,
    Unwritable,
    backport,
    line_of,
    needed_by,
    release_traits,
    said_features,
    said_release,
)
from reservoir.protocol.effects import Effect, Failed, Placed, Publish, Send, SetTimer
from reservoir.protocol.keeper import KeeperConfig, KeeperMachine
from reservoir.protocol.ledger import Inventory
from reservoir.protocol.messages import (
    Assessment,
    Decline,
    NodeStatus,
    Offer,
    ReservationRequest,
    RollCall,
    RosterMember,
    RosterQuery,
    RosterSample,
    decode_message,
    encode_message,
)
from reservoir.protocol.node import UNKNOWN_FEATURE, NodeConfig, NodeMachine
from reservoir.protocol.placement import PlacementError, PlacementRequest
from reservoir.protocol.requestor import RequestorMachine
from reservoir.protocol.requestor_state import RequestorConfig
from reservoir.runtime.settings import Settings
from reservoir.runtime.wire import Codec

T0 = 1000.0

#: a feature a later release brought, which this tree does not know: a request with a
#: hint "gpu-sharing" uses it
SHARING = Feature("gpu-sharing", "0.3", "GPU sharing", lambda shape: "gpu-sharing" in shape.hints)
LATER = {"gpu-sharing": SHARING}


def a_node(name: str = "n1", **config: Any) -> NodeMachine:
    node = NodeMachine(
        NodeConfig(
            name=name,
            address=f"reservoir.node.{name}",
            inventories={"VCPU": Inventory(total=8), "MEMORY_MB": Inventory(total=8192)},
            **config,
        )
    )
    node.start(T0)
    return node


def a_request(**fields: Any) -> ReservationRequest:
    values: dict[str, Any] = {
        "request_id": "r1",
        "sender": "req",
        "reply_to": "req-inbox",
        "resources": {"VCPU": 1},
        "tier": 10,
        "attempt": 1,
        "ttl_s": 5.0,
    }
    values.update(fields)
    return ReservationRequest(**values)


def answers(effects: list[Effect]) -> list[Any]:
    return [e.message for e in effects if isinstance(e, Send)]


def test_a_release_line_is_its_first_two_numbers_and_anything_else_is_no_release() -> None:
    assert line_of("0.2.0.dev0") == "0.2"
    assert line_of("0.10.3") == "0.10"
    assert line_of("1.0") == "1.0"
    with pytest.raises(ValueError, match="is not a release"):
        line_of("latest")


def test_a_node_has_a_trait_per_release_line_from_0_2_to_its_own_and_0_1_has_none() -> None:
    assert release_traits("0.2.0.dev0") == {"RESERVOIR_RELEASE_0_2"}
    # "0.2 or later" stays true of every later line, whatever lines a build knows
    assert release_traits("0.4.1") == {
        "RESERVOIR_RELEASE_0_2", "RESERVOIR_RELEASE_0_3", "RESERVOIR_RELEASE_0_4"
    }  # fmt: skip
    assert release_traits("0.1.0") == frozenset()
    assert release_traits("") == frozenset()


def test_a_nodes_configuration_names_its_release_and_features_and_0_1_0s_names_neither(
    reservoir_simulation: Any,
) -> None:
    from reservoir.runtime.auditor import LedgerCollector
    from reservoir.version import __version__

    reservoir_simulation.add_node("n1", vcpus=2)
    collector = LedgerCollector(reservoir_simulation.broker)
    collector.ask()
    reservoir_simulation.scheduler.run_until_idle()
    (snapshot,) = collector.collect(wait_s=1, expect_nodes=1)
    collector.close()
    assert said_release(snapshot.configuration) == __version__
    assert said_features(snapshot.configuration) == KNOWN_FEATURES
    assert (said_release({"vcpus": 8}), said_features({"vcpus": 8})) == ("0.1.0", frozenset())
    assert said_features({"features": ["gpu-sharing", 3]}) == {"gpu-sharing"}


# -- written for 0.1 ----------------------------------------------------------------------


def test_written_for_0_1_a_status_leaves_out_the_release_and_features_0_1_refuses() -> None:
    status = NodeStatus(
        sender="n1", reply_to="a", tier=10, release="0.2.0", features=frozenset({"x"})
    )
    assert encode_message(backport(status, "0.1")) == encode_message(
        NodeStatus(sender="n1", reply_to="a", tier=10)
    )
    assert backport(status, "0.2") is status


def test_written_for_0_1_a_keepers_sample_leaves_them_out_of_every_member() -> None:
    member = RosterMember(name="n1", address="a", tier=10, release="0.2.0")
    sample = RosterSample(sender="k", reply_to="k-inbox", members=(member, member))
    written = backport(sample, "0.1")
    assert [m.release for m in written.members] == ["", ""]
    assert written.members[0].tier == 10
    plain = RosterSample(sender="k", reply_to="k-inbox", members=(RosterMember(
        name="n1", address="a", tier=10),))  # fmt: skip
    assert backport(plain, "0.1") is plain  # nothing to leave out: the message itself


def test_a_request_needing_a_feature_cannot_be_written_for_0_1_it_is_a_bug_to_try() -> None:
    with pytest.raises(Unwritable, match=r"needs \(added in 0\.2\) cannot be written"):
        backport(a_request(needs=frozenset({"gpu-sharing"})), "0.1")
    plain = a_request()
    assert backport(plain, "0.1") is plain


def test_every_field_added_since_0_1_has_a_default_left_out_of_the_json() -> None:
    for cls, fields in ADDED.items():
        defaults = {f for f in cls.__struct_fields__ if f not in _required(cls)}
        assert set(fields) <= defaults, cls


def _required(cls: type) -> set[str]:
    import msgspec.structs

    return {f.name for f in msgspec.structs.fields(cls) if f.required}


def test_a_codec_writes_for_the_line_its_settings_name_and_refuses_any_other() -> None:
    status = NodeStatus(sender="n1", reply_to="a", tier=10, release="0.2.0")
    for_0_1 = Settings(compatible_with="0.1").codec().encode(status, 0.0, destination="roster")
    for_0_2 = Settings(compatible_with="0.2").codec().encode(status, 0.0, destination="roster")
    assert b"release" not in for_0_1
    assert decode_message(for_0_2) == status
    assert Settings().compatible_with == RELEASE_LINES[-2]  # the line before, by default
    with pytest.raises(ValueError, match=r"runs beside 0\.1 and 0\.2 only"):
        Codec(compatible_with="0.0")
    with pytest.raises(ValueError, match=r"'0\.3' is no release line this release runs beside"):
        Settings(compatible_with="0.3")


# -- a node and a request needing a feature it does not know -------------------------------


def test_a_node_says_its_release_and_features_in_its_status() -> None:
    node = a_node(release="0.2.0.dev0", features=frozenset({"gpu-sharing"}))
    (status,) = answers(node.handle(RollCall(sender="req", reply_to="req-inbox"), T0))
    assert status.release == "0.2.0.dev0"
    assert status.features == {"gpu-sharing"}


@pytest.mark.parametrize(
    "asked",
    [{"probed_node": "n1"}, {"declines_wanted": True}, {"explain": True}, {}],
    ids=["probed", "exhaustive step", "explain", "plain broadcast"],
)
def test_a_node_declines_a_feature_it_does_not_know_always_and_with_the_reason(
    asked: dict[str, Any],
) -> None:
    node = a_node(release="0.2.0")
    request = a_request(needs=frozenset({"gpu-sharing"}), **asked)
    (decline,) = answers(node.handle(request, T0))
    assert isinstance(decline, Decline)
    (reason,) = decline.reasons
    assert reason.code == UNKNOWN_FEATURE == "feature"
    assert reason.subject == "gpu-sharing"
    assert reason.detail == (
        "this node's release (0.2.0) does not know gpu-sharing: the request needs a node "
        "of a later release"
    )
    assert not node.ledger.reservations  # nothing reserved for it


def test_a_node_that_knows_the_feature_offers() -> None:
    node = a_node(features=frozenset({"gpu-sharing"}))
    (offer,) = answers(node.handle(a_request(needs=frozenset({"gpu-sharing"})), T0))
    assert isinstance(offer, Offer)


def test_a_dry_run_needing_an_unknown_feature_is_assessed_as_no_room_with_the_reason() -> None:
    node = a_node()
    request = a_request(needs=frozenset({"gpu-sharing"}), dry_run=True)
    (assessment,) = answers(node.handle(request, T0))
    assert isinstance(assessment, Assessment)
    assert assessment.slots == 0
    assert [r.code for r in assessment.reasons] == ["feature"]


def test_a_request_requiring_a_release_trait_is_declined_by_a_node_of_0_1_taken_by_one_of_0_2(
) -> None:  # fmt: skip
    canary = a_request(required_traits=frozenset({"RESERVOIR_RELEASE_0_2"}), probed_node="x")
    (declined,) = answers(a_node("old").handle(canary, T0))  # a node of 0.1 says no release
    assert isinstance(declined, Decline)
    (offered,) = answers(a_node("new", release="0.2.0").handle(canary, T0))
    assert isinstance(offered, Offer)
    kept_off = a_request(forbidden_traits=frozenset({"RESERVOIR_RELEASE_0_2"}), probed_node="x")
    assert isinstance(answers(a_node("old").handle(kept_off, T0))[0], Offer)


# -- a requestor asking for a feature ------------------------------------------------------


def a_requestor(**config: Any) -> RequestorMachine:
    config.setdefault("roster_from", "announcements")
    config.setdefault("claims", False)
    config.setdefault("features", LATER)
    return RequestorMachine(RequestorConfig(requestor_id="req", reply_to="req-inbox", **config))


def status(name: str, **fields: Any) -> NodeStatus:
    return NodeStatus(sender=name, reply_to=f"reservoir.node.{name}", tier=10, **fields)


def sharing() -> PlacementRequest:
    return PlacementRequest(resources={"VCPU": 1}, hints={"gpu-sharing": True})


def test_a_request_using_a_feature_names_it_in_needs_and_a_plain_one_needs_nothing() -> None:
    assert needed_by(sharing(), LATER) == {"gpu-sharing"}
    answering = Feature("task-output", "0.3", "task output")  # a kind nodes answer
    assert needed_by(sharing(), {**LATER, "task-output": answering}) == {"gpu-sharing"}
    assert needed_by(PlacementRequest(resources={"VCPU": 1}), LATER) == frozenset()
    assert needed_by(sharing()) == frozenset()  # this tree knows no such feature


def test_writing_for_0_1_a_request_needing_a_feature_fails_at_once_saying_what_to_do() -> None:
    machine = a_requestor(compatible_with="0.1")
    effects = machine.start(T0) + machine.place(sharing(), "r1", T0, 30.0)
    (failed,) = [e for e in effects if isinstance(e, Failed | Placed)]
    assert isinstance(failed, Failed) and isinstance(failed.error, PlacementError)
    assert failed.error.explanation.note == (
        "the request uses GPU sharing (since 0.3), which nodes of 0.1 cannot read, and this "
        "requestor writes for 0.1 (RESERVOIR_COMPATIBLE_WITH): set it to 0.3 once every "
        "node, keeper and requestor runs 0.3 or later"
    )
    assert not any(isinstance(e.message, ReservationRequest) for e in _sends(effects))


def _sends(effects: list[Effect]) -> list[Send | Publish]:
    return [e for e in effects if isinstance(e, Send | Publish)]


def test_a_request_needing_a_feature_is_probed_only_on_nodes_that_say_they_know_it() -> None:
    machine = a_requestor(compatible_with="0.2")
    machine.start(T0)
    for name in ("old-1", "old-2", "old-3"):
        machine.handle(status(name), T0)  # 0.1, or a node writing for 0.1: says nothing
    machine.handle(status("plain", release="0.2.0"), T0)  # of 0.2, without the feature
    machine.handle(status("new", release="0.3.0", features=frozenset({"gpu-sharing"})), T0)
    effects = machine.place(sharing(), "r1", T0, 30.0)
    probes = [e for e in _sends(effects) if isinstance(e.message, ReservationRequest)]
    assert [p.message.probed_node for p in probes] == ["new"]
    assert probes[0].message.needs == {"gpu-sharing"}
    # a plain request is probed anywhere, and names nothing
    plain = machine.place(PlacementRequest(resources={"VCPU": 1}), "r2", T0, 30.0)
    probes = [e.message for e in _sends(plain) if isinstance(e.message, ReservationRequest)]
    assert len(probes) == 2 and all(not p.needs for p in probes)


def test_a_node_that_rolls_back_to_0_1_loses_its_features_in_the_roster() -> None:
    machine = a_requestor(compatible_with="0.2")
    machine.start(T0)
    machine.handle(status("n1", release="0.3.0", features=frozenset({"gpu-sharing"})), T0)
    machine.handle(status("n1"), T0 + 1)  # started again on 0.1
    member = machine.roster.member("n1")
    assert member is not None and member.release == "" and member.features == frozenset()


def test_the_features_nodes_declined_are_the_failures_reason() -> None:
    machine = a_requestor(compatible_with="0.2")
    machine.start(T0)
    effects = machine.place(sharing(), "r1", T0, 30.0)  # no node known: every tier is asked
    (request,) = [e.message for e in effects if isinstance(e, Publish)
                  and isinstance(e.message, ReservationRequest)]  # fmt: skip
    assert request.needs == {"gpu-sharing"}
    for name in ("n1", "n2"):  # two nodes of 0.2, hearing the first tier, do not know it
        (decline,) = answers(a_node(name, release="0.2.0").handle(request, T0))
        machine.handle(decline, T0 + 0.01)
    for _ in range(5):
        (key,) = [e.key for e in effects if isinstance(e, SetTimer) and e.key.kind == "widen"]
        effects = machine.on_timer(key, T0 + 10.0)
    (failed,) = [e for e in effects if isinstance(e, Failed)]
    assert failed.error.explanation.reasons == {"the node's release does not know gpu-sharing": 2}
    assert "the node's release does not know gpu-sharing on 2 node(s)" in str(failed.error)


# -- a keeper passes on what nodes said ----------------------------------------------------


def test_a_keeper_passes_each_nodes_release_and_features_on_in_its_samples() -> None:
    keeper = KeeperMachine(KeeperConfig(keeper_id="k", reply_to="k-inbox"))
    keeper.start(T0)
    keeper.handle(status("n1", release="0.2.0", features=frozenset({"gpu-sharing"}),
                         answering=True), T0)  # fmt: skip
    keeper.handle(status("n2", answering=True), T0)
    (sample,) = answers(
        keeper.handle(RosterQuery(sender="req", reply_to="req-inbox", wanted=8), T0)
    )
    said = {m.name: (m.release, m.features) for m in sample.members}
    assert said == {"n1": ("0.2.0", {"gpu-sharing"}), "n2": ("", frozenset())}
    requestor = a_requestor(roster_from="auto", compatible_with="0.2")
    requestor.start(T0)
    requestor.handle(sample, T0)
    member = requestor.roster.member("n1")
    assert member is not None and member.features == {"gpu-sharing"}
