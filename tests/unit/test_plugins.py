"""Operators extend the node with filters and weighers found through entry points; the
built-in checks are found the same way."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from typing import Any

import pytest

from reservoir import PlacementError
from reservoir.protocol.filters import NodeView, Verdict
from reservoir.protocol.messages import Reason, ReservationRequest
from reservoir.runtime.plugins import PluginError, load_filters, load_weighers
from reservoir.runtime.settings import Settings
from reservoir.testing import Simulation


class NeedsSsd:
    """An operator's check: reads the request's free-form hints."""

    name = "needs_ssd"

    def check(self, request: ReservationRequest, node: NodeView, max_slots: int) -> Verdict:
        if request.hints.get("disk") == "ssd" and "STORAGE_DISK_SSD" not in node.traits:
            return Verdict(0, (Reason(code="needs_ssd", detail="the request wants an SSD"),))
        return Verdict(max_slots)


class PreferEven:
    """An operator's weigher: prefers nodes whose name ends in an even digit."""

    name = "prefer_even"
    multiplier = 10.0

    def weigh(self, request: ReservationRequest, node: NodeView, slots: int) -> float:
        return 1.0 if int(node.name[-1]) % 2 == 0 else 0.0


def fake_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    here = __name__
    extra = {
        "reservoir.filters": [EntryPoint("needs_ssd", f"{here}:NeedsSsd", "reservoir.filters")],
        "reservoir.weighers": [
            EntryPoint("prefer_even", f"{here}:PreferEven", "reservoir.weighers")
        ],
    }

    def entry_points(*, group: str) -> list[EntryPoint]:
        return extra.get(group, [])

    monkeypatch.setattr("reservoir.runtime.plugins.entry_points", entry_points)


def test_the_built_in_checks_come_first_in_a_fixed_order() -> None:
    names = [f.name for f in load_filters()]
    assert names[:4] == ["traits", "resources", "server_group", "numa"]
    assert next(w.name for w in load_weighers()) == "soft_server_group"


def test_an_operators_filter_is_discovered_and_reads_the_hints(
    monkeypatch: pytest.MonkeyPatch, reservoir_simulation: Simulation
) -> None:
    fake_entry_points(monkeypatch)
    assert [f.name for f in load_filters()][-1] == "needs_ssd"
    sim = reservoir_simulation
    sim.add_node("hdd0", vcpus=8)
    sim.add_node("ssd1", vcpus=8, traits=["STORAGE_DISK_SSD"])
    requestor = sim.add_requestor()
    for _ in range(3):
        placement = sim.place(requestor, vcpus=1, hints={"disk": "ssd"})
        assert placement.nodes == ("ssd1",)
    with pytest.raises(PlacementError) as failed:
        sim.place(requestor, vcpus=16, hints={"disk": "ssd"}, explain=True)
    assert failed.value.explanation.reasons == {
        "VCPU larger than one instance may take": 2,
        "needs_ssd": 1,
    }


def test_an_operators_weigher_shapes_the_offers_score(
    monkeypatch: pytest.MonkeyPatch, reservoir_simulation: Simulation
) -> None:
    fake_entry_points(monkeypatch)
    sim = reservoir_simulation
    for i in range(1, 5):
        sim.add_node(f"n{i}", vcpus=64)
    # Weighers rank the offers of the nodes asked: ask all four.
    requestor = sim.add_requestor(settings=Settings(probe_factor=4.0))
    nodes = {sim.place(requestor, vcpus=1).nodes[0] for _ in range(6)}
    assert nodes <= {"n2", "n4"}


def test_settings_choose_and_order_the_filters(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_entry_points(monkeypatch)
    settings = Settings(filters=("needs_ssd", "resources"))
    assert [f.name for f in load_filters(settings.filters)] == ["needs_ssd", "resources"]


def test_an_unknown_or_broken_plugin_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PluginError, match="no filter named 'nope'"):
        load_filters(["nope"])

    def broken(*, group: str) -> list[Any]:
        return [EntryPoint("broken", "no.such.module:Thing", group)]

    monkeypatch.setattr("reservoir.runtime.plugins.entry_points", broken)
    with pytest.raises(PluginError, match="'broken' failed to load"):
        load_filters()


def test_the_entry_points_register_exactly_the_built_in_filters_and_weighers() -> None:
    import tomllib
    from pathlib import Path

    from reservoir.protocol.filters import BUILT_IN_FILTERS, BUILT_IN_WEIGHERS

    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    groups = tomllib.loads(pyproject.read_text())["project"]["entry-points"]
    for group, built_in in (
        ("reservoir.filters", BUILT_IN_FILTERS),
        ("reservoir.weighers", BUILT_IN_WEIGHERS),
    ):
        expected = {
            name: f"{kind.__module__}:{kind.__qualname__}" for name, kind in built_in.items()
        }
        assert groups[group] == expected
