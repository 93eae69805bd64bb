"""The public surface is deliberate: pinned names, and a protocol core that stays pure."""

from __future__ import annotations

import ast
from pathlib import Path

import reservoir

PROTOCOL = Path(reservoir.__file__).parent / "protocol"

PUBLIC_NAMES = {
    "Allocation", "AuditFailed", "AuditReport", "Broker", "BrokerError", "Clock", "Delivery",
    "Endpoint", "Explanation", "FakeClock", "FindIncomplete", "FreeIncomplete", "GroupSpec",
    "CheckedRequest", "Holdings", "Inventory",
    "NodeAgent", "NodeSnapshot", "NumaCell", "NumaSpec", "NumaTopology", "PciDevice",
    "PlacedAllocation",
    "Placement",
    "PlacementError", "PlacementRequest", "PlacementTimeout", "Requestor", "RequestorClosed",
    "RosterKeeper",
    "Scheduler", "Settings", "SqliteStore", "StateError", "SystemClock", "ThreadScheduler",
    "TierLadder", "UnsupportedBroker", "VirtualScheduler", "audit",
}  # fmt: skip


def test_the_public_names_are_exactly_the_pinned_ones() -> None:
    assert set(reservoir.__all__) == PUBLIC_NAMES
    for name in reservoir.__all__:
        assert getattr(reservoir, name) is not None


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def calls_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        f"{node.func.value.id}.{node.func.attr}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
    }


def test_the_protocol_core_imports_no_broker_library_and_nothing_that_does_io() -> None:
    forbidden = {
        "pika", "kombu", "amqp", "brokers", "socket", "threading", "asyncio", "time",
        "datetime", "select", "selectors", "subprocess", "sqlite3", "random", "secrets",
        "uuid", "os", "logging", "concurrent", "reservoir.broker", "reservoir.clock",
        "reservoir.runtime", "reservoir.observe", "reservoir.service", "reservoir.tools",
    }  # fmt: skip
    files = sorted(PROTOCOL.glob("*.py"))
    assert len(files) >= 8
    for path in files:
        imported = imports_of(path)
        roots = {name.split(".")[0] for name in imported}
        bad = (imported | roots) & forbidden
        assert not bad, f"{path.name} imports {sorted(bad)}"
        outside = {n for n in imported if n.startswith("reservoir.")} - {
            n for n in imported if n.startswith("reservoir.protocol")
        }
        assert not outside, f"{path.name} reaches outside the core: {sorted(outside)}"


def test_the_protocol_core_reads_no_clock_and_sleeps_nowhere() -> None:
    for path in sorted(PROTOCOL.glob("*.py")):
        calls = calls_of(path)
        assert not {c for c in calls if c.split(".")[0] in {"time", "datetime", "os"}}, path


def test_the_purity_check_would_catch_a_clock_read(tmp_path: Path) -> None:
    impure = tmp_path / "impure.py"
    impure.write_text("import time\n\ndef now():\n    return time.monotonic()\n")
    assert "time" in imports_of(impure)
    assert "time.monotonic" in calls_of(impure)
