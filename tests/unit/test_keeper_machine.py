"""The keeper machine alone: what it asks of nodes and what it answers requestors."""

from __future__ import annotations

from reservoir.protocol.effects import Send
from reservoir.protocol.keeper import KeeperConfig, KeeperMachine
from reservoir.protocol.messages import NodeStatus, RollCall, RosterQuery

T0 = 100.0


def a_keeper() -> KeeperMachine:
    return KeeperMachine(KeeperConfig(keeper_id="k", reply_to="reservoir.requestor.k"))


def status(name: str, *, room_news: bool, tier: int = 10, vcpus: int = 5) -> NodeStatus:
    return NodeStatus(
        sender=name, reply_to=f"reservoir.node.{name}", tier=tier, room={"VCPU": vcpus},
        room_news=room_news,
    )  # fmt: skip


def roll_calls(effects: list[object]) -> list[str]:
    return [e.address for e in effects if isinstance(e, Send) and isinstance(e.message, RollCall)]


def test_a_node_that_does_not_tell_keepers_of_its_room_is_roll_called_even_when_known() -> None:
    keeper = a_keeper()
    assert roll_calls(keeper.handle(status("n1", room_news=False), T0)) == ["reservoir.node.n1"]
    assert roll_calls(keeper.handle(status("n1", room_news=True), T0)) == []
    # killed and restarted (no leaving status): known, but it tells of its room no more
    assert roll_calls(keeper.handle(status("n1", room_news=False), T0)) == ["reservoir.node.n1"]
    assert len(keeper.roster) == 1


def test_a_sample_is_drawn_from_every_tier_and_only_from_rooms_that_may_fit() -> None:
    keeper = a_keeper()
    for i in range(10):
        keeper.handle(status(f"small-{i}", room_news=True, tier=100, vcpus=1), T0)
    keeper.handle(status("big", room_news=True, tier=75, vcpus=16), T0)
    query = RosterQuery(sender="r", reply_to="reservoir.requestor.r", wanted=4)
    anything = keeper.sample(query)
    assert len(anything.members) == 4
    needing = RosterQuery(sender="r", reply_to="reservoir.requestor.r", wanted=4, needs={"VCPU": 8})
    assert [m.name for m in keeper.sample(needing).members] == ["big"]
