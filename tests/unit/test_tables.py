"""``reservoir nodes`` and ``reservoir request --dry-run`` as operators expect listings
(issue 33, defect 8): tables with headers and units, the inventory columns (total,
host-reserved, allocation ratio, used, free), ``-f table|json|yaml|csv|value`` and
``-c COLUMN`` from one shared formatter, the field names of the HTTP API, and live
reservations never called "reserved" (which keeps Placement's meaning)."""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from reservoir import NodeAgent
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.cli import main
from reservoir.protocol.ledger import Inventory
from reservoir.runtime import dry_run
from reservoir.runtime.auditor import LedgerCollector, node_fields


@pytest.fixture
def cluster(broker: InProcessBroker, monkeypatch: pytest.MonkeyPatch) -> Iterator[InProcessBroker]:
    """Two live nodes, one with host-reserved VCPUs and an allocation ratio, one
    allocation placed; the commands' broker is this one."""
    nodes = [
        NodeAgent(
            broker,
            name="tab-a",
            inventories={
                "VCPU": Inventory(total=8, reserved=2, allocation_ratio=4.0),
                "MEMORY_MB": Inventory(total=16384, reserved=512),
            },
        ),
        NodeAgent(broker, name="tab-b", vcpus=4, memory_mb=8192),
    ]
    from reservoir import Requestor

    with Requestor(broker) as requestor:
        requestor.reserve(vcpus=3, memory_mb=1024, request_id="tab-1")

    def ledgers(settings: Any, wait_s: float, expect_nodes: int | None = None) -> Any:
        collector = LedgerCollector(broker)
        try:
            collector.ask()
            return collector.collect(wait_s=5, expect_nodes=2)
        finally:
            collector.close()

    real_dry_run = dry_run.DryRun
    monkeypatch.setattr("reservoir.cli.nodes.ledgers", ledgers)
    monkeypatch.setattr(
        dry_run,
        "DryRun",
        lambda spec, _url, settings: real_dry_run(spec, broker, settings=settings),
    )
    yield broker
    for node in nodes:
        node.close()


def nodes(*args: str) -> str:
    result = CliRunner().invoke(main, ["nodes", "--broker", "memory://", *args])
    assert result.exit_code == 0, result.output
    return result.output


def test_the_inventory_of_every_node_travels_in_its_ledger_report(cluster: InProcessBroker) -> None:
    collector = LedgerCollector(cluster)
    collector.ask()
    snapshots = {s.name: s for s in collector.collect(wait_s=5, expect_nodes=2)}
    collector.close()
    vcpu = node_fields(snapshots["tab-a"])["usage"]["VCPU"]
    used = vcpu.pop("used")
    assert vcpu == {
        "total": 8,
        "reserved": 2,  # host-reserved, as Placement means it
        "allocation_ratio": 4.0,
        "capacity": 24,
        "held": 0,  # live reservations
        "free": 24 - used,
    }
    # the one allocation of 3 VCPUs is on one of the two
    other = node_fields(snapshots["tab-b"])["usage"]["VCPU"]
    assert sorted([used, other["used"]]) == [0, 3]


def test_every_node_row_names_the_release_the_node_runs(cluster: InProcessBroker) -> None:
    from reservoir.version import __version__

    rows = json.loads(nodes("-f", "json"))
    assert {row["release"] for row in rows} == {__version__}
    assert "release" in nodes().splitlines()[0]


def test_a_node_that_names_no_release_is_of_0_1_0_the_one_release_that_did_not() -> None:
    from reservoir.protocol.audit import NodeSnapshot

    quiet = NodeSnapshot(name="old", taken_at=0.0, utilisation=0.0, tier=10, usages={},
                         allocations=(), reservations=(), violations=(),
                         configuration={"vcpus": 8})  # fmt: skip
    assert node_fields(quiet)["release"] == "0.1.0"


def test_the_nodes_table_has_headers_with_units_and_the_inventory_columns(
    cluster: InProcessBroker,
) -> None:
    out = nodes()
    header = out.splitlines()[0]
    for heading in ("node", "class", "unit", "total", "host-reserved", "alloc. ratio",
                    "capacity", "used", "held (reservations)", "free", "tier %",
                    "utilisation %"):  # fmt: skip
        assert heading in header, header
    assert "MiB" in out
    assert "/" not in out  # no "4097/65536" cells
    assert len(out.splitlines()) == 1 + 4  # a row per node and class


def test_every_format_lists_the_same_rows_in_the_http_field_names(
    cluster: InProcessBroker,
) -> None:
    rows = json.loads(nodes("-f", "json"))
    assert rows == yaml.safe_load(nodes("-f", "yaml"))
    by = {(r["name"], r["class"]): r for r in rows}
    assert set(by) == {("tab-a", "VCPU"), ("tab-a", "MEMORY_MB"),
                       ("tab-b", "VCPU"), ("tab-b", "MEMORY_MB")}  # fmt: skip
    assert by["tab-a", "VCPU"]["reserved"] == 2
    assert by["tab-a", "MEMORY_MB"]["capacity"] == 16384 - 512
    assert sum(r["used"] for r in rows if r["class"] == "VCPU") == 3
    assert "node" not in rows[0]
    parsed = list(csv.DictReader(io.StringIO(nodes("-f", "csv"))))
    assert [(r["name"], r["class"], int(r["used"])) for r in parsed] == [
        (r["name"], r["class"], r["used"]) for r in rows
    ]
    # the HTTP API's shape uses the same names (reservoir.service.shapes.NodeOut)
    from reservoir.service.shapes import UsageOut

    assert set(UsageOut.model_fields) == set(rows[0]) & set(UsageOut.model_fields)
    assert set(UsageOut.model_fields) <= set(rows[0])


def test_columns_are_picked_with_c_for_every_format(cluster: InProcessBroker) -> None:
    values = nodes("-f", "value", "-c", "name", "-c", "class", "-c", "free").splitlines()
    assert sorted(values) == sorted(
        f"{r['name']} {r['class']} {r['free']}" for r in json.loads(nodes("-f", "json"))
    )
    picked = json.loads(nodes("-f", "json", "-c", "name", "-c", "held"))
    assert all(set(row) == {"name", "held"} for row in picked)
    table = nodes("-c", "name", "-c", "free")
    assert table.splitlines()[0].split() == ["node", "free"]


def test_an_unknown_column_is_one_line_naming_the_option(cluster: InProcessBroker) -> None:
    result = CliRunner().invoke(main, ["nodes", "--broker", "memory://", "-c", "cpus"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1
    assert "-c/--column: no column 'cpus'" in result.output


def test_a_dry_run_is_listed_in_the_same_formats(cluster: InProcessBroker) -> None:
    asked = ["request", "--broker", "memory://", "--vcpus", "2", "--memory-mb", "512",
             "--dry-run", "--timeout", "0.5"]  # fmt: skip
    table = CliRunner().invoke(main, asked)
    assert table.exit_code == 0, table.output
    lines = table.output.splitlines()
    assert lines[0].startswith("dry run of 1 instance(s)")
    assert "instances it could take" in lines[1] and "utilisation %" in lines[1]
    rows = json.loads(CliRunner().invoke(main, [*asked, "-f", "json"]).output)
    assert sorted(r["name"] for r in rows) == ["tab-a", "tab-b"]
    report = json.loads(CliRunner().invoke(main, [*asked, "--json"]).output)
    assert sorted(n["name"] for n in report["nodes"]) == ["tab-a", "tab-b"]
    values = CliRunner().invoke(main, [*asked, "-f", "value", "-c", "name", "-c", "slots"])
    assert sorted(values.output.split()) == sorted(
        [str(r[k]) for r in rows for k in ("name", "slots")]
    )
