"""Server groups: hard and soft affinity and anti-affinity, decided on the nodes, which
know the members they host and hold."""

from __future__ import annotations

import msgspec
import pytest

from reservoir import GroupSpec, PlacementError
from reservoir.testing import Simulation


def group(policy: str, name: str = "g1") -> GroupSpec:
    return msgspec.convert({"name": name, "policy": policy}, GroupSpec)


def test_anti_affinity_puts_members_on_different_nodes_and_names_the_group_when_full(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.add_nodes(2, vcpus=4, memory_mb=8192)
    requestor = sim.add_requestor()
    pair = sim.place(requestor, vcpus=2, memory_mb=1024, count=2, group=group("anti-affinity"))
    assert sorted(pair.nodes) == ["node-0", "node-1"]
    with pytest.raises(PlacementError) as failed:
        sim.place(requestor, vcpus=2, memory_mb=1024, group=group("anti-affinity"))
    assert "anti-affinity group g1" in str(failed.value)  # even without explain=True
    other = sim.place(requestor, vcpus=2, memory_mb=1024, group=group("anti-affinity", "g2"))
    sim.finish([pair, other])


def test_affinity_keeps_every_member_on_the_first_members_node(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.add_nodes(4, vcpus=8, memory_mb=16384)
    requestor = sim.add_requestor()
    first = sim.place(requestor, vcpus=2, count=2, group=group("affinity"))
    (home,) = set(first.nodes)
    later = [sim.place(requestor, vcpus=2, group=group("affinity")) for _ in range(2)]
    assert all(p.nodes == (home,) for p in later)
    with pytest.raises(PlacementError, match=f"lives on {home}"):
        sim.place(requestor, vcpus=2, group=group("affinity"))  # home is full
    sim.finish([first, *later])


def test_an_affinity_group_too_big_for_any_node_fails(reservoir_simulation: Simulation) -> None:
    sim = reservoir_simulation
    sim.add_nodes(3, vcpus=4)
    requestor = sim.add_requestor()
    with pytest.raises(PlacementError, match="affinity group g1"):
        sim.place(requestor, vcpus=2, count=3, group=group("affinity"))


def test_soft_anti_affinity_spreads_when_it_can_and_stacks_when_it_must(
    reservoir_simulation: Simulation,
) -> None:
    sim = reservoir_simulation
    sim.add_nodes(2, vcpus=8)
    requestor = sim.add_requestor("r", policy="pack")  # pack would stack them if it could
    placements = [
        sim.place(requestor, vcpus=1, group=group("soft-anti-affinity")) for _ in range(4)
    ]
    nodes = [p.nodes[0] for p in placements]
    assert sorted(nodes[:2]) == ["node-0", "node-1"]
    assert sorted(nodes) == ["node-0", "node-0", "node-1", "node-1"]
    sim.finish(placements)


def test_soft_affinity_prefers_the_node_with_members(reservoir_simulation: Simulation) -> None:
    sim = reservoir_simulation
    sim.add_nodes(3, vcpus=8)
    requestor = sim.add_requestor()  # spread would scatter them if it could
    placements = [sim.place(requestor, vcpus=1, group=group("soft-affinity")) for _ in range(4)]
    assert len({p.nodes[0] for p in placements}) == 1
    sim.finish(placements)
