"""``reservoir simulate``: the protocol machines in virtual time, and the baselines beside them.

Small clusters and short runs (well under a second each): what these check is that the
engine carries out the machines' effects faithfully (a clean audit, under loss too), that a
seed fixes a run, that the baselines behave as their definitions say, and that the command
speaks the way the other commands do.
"""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from reservoir.cli import main
from reservoir.protocol.audit import AuditReport
from reservoir.tools.simulator import SimulationConfig, parse_latency_ms, runner, simulate
from reservoir.tools.simulator.baselines import BaselineRun
from reservoir.tools.simulator.capacity import FreeIndex
from reservoir.tools.simulator.engine import ReservoirRun
from reservoir.tools.simulator.network import LatencyModel
from reservoir.tools.simulator.workload import make_cluster, make_workload

ONE_MS = LatencyModel("fixed", 1.0)


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def reservoir_run(
    nodes: int, requests: int, load: float, *, loss: float = 0.0, lifetime_s: float = 600.0
) -> ReservoirRun:
    cluster = make_cluster(nodes, seed=1)
    workload = make_workload(
        cluster, offered_load=load, requests=requests, seed=1, mean_lifetime_s=lifetime_s
    )
    return ReservoirRun(cluster, workload, latency=ONE_MS, loss=loss, seed=1)


def without_wall_time(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in row.items() if k != "wall_s"} for row in rows]


def test_a_small_run_ends_with_a_clean_audit() -> None:
    simulation = reservoir_run(nodes=60, requests=1500, load=0.9)
    result = simulation.run()
    assert simulation.audit_report.ok, simulation.audit_report
    assert result.audit_ok is True
    assert result.placed + result.failed == 1500
    assert result.placed > 1400
    assert result.deliveries_by_kind["accepted"] >= result.placed
    assert result.messages == sum(result.deliveries_by_kind.values())


def test_a_lossy_network_still_ends_with_a_clean_audit() -> None:
    simulation = reservoir_run(nodes=40, requests=600, load=0.8, loss=0.05)
    result = simulation.run()
    assert result.lost > 0
    assert simulation.audit_report.ok, simulation.audit_report
    assert result.placed + result.failed == 600


def test_the_same_seed_gives_identical_results() -> None:
    config = SimulationConfig(
        nodes=50,
        requests=400,
        loads=(0.9,),
        latency=parse_latency_ms("lognormal:1,0.5"),
        loss=0.01,
        mean_lifetime_s=120.0,
        seed=7,
    )
    first, second = simulate(config), simulate(config)
    assert without_wall_time(first.rows()) == without_wall_time(second.rows())
    other = simulate(SimulationConfig(**{**config.__dict__, "seed": 8}))
    assert without_wall_time(other.rows()) != without_wall_time(first.rows())


def test_runs_in_worker_processes_give_the_rows_of_runs_in_this_one() -> None:
    config = SimulationConfig(
        nodes=40, requests=300, loads=(0.5, 0.9), mean_lifetime_s=120.0, seed=5
    )
    progress: dict[str, int] = {}

    def count(label: str, n: int) -> None:
        progress[label] = progress.get(label, 0) + n

    here, in_workers = simulate(config), simulate(config, count, jobs=2)
    assert without_wall_time(in_workers.rows()) == without_wall_time(here.rows())
    assert in_workers.invariants_hold  # every reservoir run's audit, in the workers too
    assert progress == {
        f"{system} at load {load:g}": 300 for load in (0.5, 0.9) for system in config.systems
    }


#: a reservoir run of many minutes: long enough that waiting for it would show
LONG_RUN = SimulationConfig(nodes=20_000, requests=1_000_000, loads=(0.95,), seed=5)


# A regression waits for the long run: the 60 s limit fails it well before it ends.
@pytest.mark.timeout(60)
def test_one_runs_error_stops_the_other_workers_at_once() -> None:
    pairs = [(0.95, "reservoir"), (0.95, "no-such-system")]
    with pytest.raises(ValueError, match="no-such-system"):
        runner._in_workers(LONG_RUN, pairs, None, jobs=2)
    assert multiprocessing.active_children() == []


def test_every_system_sees_the_same_arrivals_and_sizes() -> None:
    cluster = make_cluster(30, seed=3)
    low = make_workload(cluster, offered_load=0.5, requests=200, seed=3)
    high = make_workload(cluster, offered_load=0.95, requests=200, seed=3)
    assert low.flavour_of == high.flavour_of  # only the arrival rate differs
    assert low.lifetime_s == high.lifetime_s
    assert high.arrival_rate_per_s == pytest.approx(low.arrival_rate_per_s * 0.95 / 0.5)
    assert high.end_s < low.end_s


def test_the_omniscient_baseline_places_everything_at_low_load_without_false_failures() -> None:
    cluster = make_cluster(100, seed=2)
    for load, everything in ((0.5, True), (1.0, False)):
        workload = make_workload(
            cluster, offered_load=load, requests=3000, seed=2, mean_lifetime_s=60.0
        )
        result = BaselineRun("omniscient", cluster, workload, latency=ONE_MS).run()
        assert result.false_failures == 0
        assert result.reschedules == 0
        assert (result.placed == 3000) is everything


def test_the_nova_baseline_reschedules_more_at_high_load_than_at_low_load() -> None:
    cluster = make_cluster(100, seed=4)
    reschedules = {}
    for load in (0.5, 0.95):
        workload = make_workload(
            cluster, offered_load=load, requests=4000, seed=4, mean_lifetime_s=60.0
        )
        result = BaselineRun("nova", cluster, workload, latency=ONE_MS, schedulers=8).run()
        reschedules[load] = result.reschedules / result.placed
        assert result.state_messages > 0
    assert reschedules[0.95] > reschedules[0.5]


def test_the_free_index_answers_without_scanning_nodes() -> None:
    cluster = make_cluster(10, seed=0)
    index = FreeIndex(cluster.shape_of, cluster.shapes)
    for node in range(10):
        index.change(node, -index.free_vcpus[node] + 1, -index.free_memory_mb[node] + 2048)
    assert index.fits_somewhere(1, 2048)
    assert not index.fits_somewhere(2, 4096)
    index.change(3, 5, 5 * 2048)
    assert index.most_free(4, 8192) == 3
    assert index.least_utilised(1, 2048) == 3
    assert index.allocated_fraction == pytest.approx((index.total_vcpus - 15) / index.total_vcpus)


def test_latencies_are_given_as_a_small_set_of_distributions() -> None:
    assert parse_latency_ms("5").fixed_s == 0.005
    assert parse_latency_ms("uniform:1,3").mean_s == pytest.approx(0.002)
    assert parse_latency_ms("lognormal:2,0").mean_s == pytest.approx(0.002)
    for bad in ("fast", "uniform:3,1", "lognormal:2", "fixed:0", "gamma:1,2"):
        with pytest.raises(ValueError, match=r"\w"):
            parse_latency_ms(bad)


def test_the_json_output_is_one_object_with_the_required_keys() -> None:
    status, out, _ = run("simulate", "--nodes", "30", "--requests", "200",
                         "--loads", "0.5,0.9", "--lifetime-s", "300", "--json")  # fmt: skip
    assert status == 0
    result = json.loads(out)  # the whole of stdout is one JSON object
    for key in ("rows", "elapsed_s", "nodes", "requests", "seed"):
        assert key in result
    assert (result["nodes"], result["requests"], result["seed"]) == (30, 200, 0)
    assert len(result["rows"]) == 2 * 4
    for row in result["rows"]:
        for key in ("system", "offered_load", "success_rate", "false_failures", "p50_ms",
                    "p99_ms", "reschedules_per_placement", "messages_per_placement",
                    "reserved_fraction", "fill_at_first_failure"):  # fmt: skip
            assert key in row
    assert {row["system"] for row in result["rows"]} == {
        "reservoir", "nova", "sampling", "omniscient"
    }  # fmt: skip
    assert all(row["audit_ok"] for row in result["rows"] if row["system"] == "reservoir")


def test_the_json_output_names_the_build_its_timings_come_from() -> None:
    status, out, _ = run("simulate", "--nodes", "20", "--requests", "50", "--loads", "0.8",
                         "--systems", "omniscient", "--json")  # fmt: skip
    assert status == 0
    # .ci/run runs this file again on the mypyc build, saying so in the environment
    expected = "compiled" if os.environ.get("RESERVOIR_EXPECT_COMPILED") == "1" else "interpreted"
    assert json.loads(out)["build"] == expected


def test_the_output_directory_gets_a_markdown_table_and_plots(tmp_path: Path) -> None:
    status, out, _ = run("simulate", "--nodes", "20", "--requests", "100", "--loads", "0.8",
                         "--systems", "reservoir,omniscient",
                         "--output", str(tmp_path))  # fmt: skip
    assert status == 0
    report = (tmp_path / "results.md").read_text()
    assert "| system |" in report
    assert "omniscient" in report
    assert "without byte serialisation" in report
    assert "build." in report  # the timing says which build it came from
    assert list(tmp_path.glob("*.png"))
    assert "reservoir" in out  # the table on stdout


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--loads", "0.5,x"),
        ("--loads", "0"),
        ("--systems", "reservoir,slurm"),
        ("--latency-ms", "uniform:5"),
        ("--loss", "0.9"),
        ("--nodes", "0"),
    ],
)
def test_a_bad_option_is_one_clear_line_naming_it(option: str, value: str) -> None:
    status, out, err = run("simulate", option, value)
    assert status == 2
    assert option in err
    assert "Traceback" not in out + err


def test_the_help_says_messages_are_not_serialised() -> None:
    status, out, _ = run("simulate", "--help")
    assert status == 0
    assert "without byte serialisation" in " ".join(out.split())


def test_a_broken_invariant_makes_the_command_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_audit(*args: Any, **kwargs: Any) -> AuditReport:
        return AuditReport(("node-0: VCPU: allocated 33 + reserved 0 > capacity 32",), (), (), ())

    monkeypatch.setattr("reservoir.tools.simulator.engine.audit", broken_audit)
    status, out, _ = run("simulate", "--nodes", "10", "--requests", "20",
                         "--loads", "0.5", "--systems", "reservoir", "--json")  # fmt: skip
    assert status == 2
    assert json.loads(out)["rows"][0]["overcommitted"] == 1


@pytest.mark.parametrize(
    ("cores", "memory_gib", "config", "expected"),
    [
        # three long runs on two cores: a worker each, and one for the baselines
        (2, 64, SimulationConfig(nodes=1000), 4),
        # ... as far as memory holds them (3.6 GiB a run at 100,000 nodes and a million
        # arrivals, 12.2 GiB with ten million)
        (2, 20, SimulationConfig(nodes=100_000, requests=1_000_000), 4),
        (2, 12, SimulationConfig(nodes=100_000, requests=1_000_000), 3),
        (2, 20, SimulationConfig(nodes=100_000, requests=10_000_000), 2),
        # never fewer than the cores
        (2, 1, SimulationConfig(nodes=100_000), 2),
        # no more long runs than cores: the cores
        (8, 64, SimulationConfig(nodes=1000), 8),
        # the baselines alone are short: the cores
        (2, 64, SimulationConfig(systems=("nova", "sampling")), 2),
        (2, 64, SimulationConfig(systems=("reservoir",)), 3),
    ],
)
def test_the_default_jobs_give_each_long_run_a_worker_as_memory_allows(
    monkeypatch: pytest.MonkeyPatch,
    cores: int,
    memory_gib: int,
    config: SimulationConfig,
    expected: int,
) -> None:
    monkeypatch.setattr(runner, "cores", lambda: cores)
    monkeypatch.setattr(runner, "available_memory_bytes", lambda: memory_gib * 2**30)
    assert runner.default_jobs(config) == expected


def keeper_run(requestors: int, keepers: int, restarts_per_s: float = 0.0) -> ReservoirRun:
    cluster = make_cluster(80, seed=1)
    workload = make_workload(
        cluster, offered_load=0.9, requests=1200, seed=1, mean_lifetime_s=600.0
    )
    return ReservoirRun(
        cluster, workload, latency=ONE_MS, seed=1, requestors=requestors, keepers=keepers,
        requestor_restarts_per_s=restarts_per_s,
    )  # fmt: skip


def test_with_a_keeper_the_roster_costs_the_same_with_one_requestor_and_with_many() -> None:
    rows = {(k, keepers): keeper_run(k, keepers).run().row() for k in (1, 32) for keepers in (0, 1)}
    for row in rows.values():
        assert row["audit_ok"] is True and row["false_failures"] == 0
    # announcements: every status reaches every requestor
    assert (
        rows[32, 0]["roster_messages_per_placement"]
        > 10 * rows[1, 0]["roster_messages_per_placement"]
    )
    # a keeper: about the same whatever the requestors
    assert rows[32, 1]["messages_per_placement"] <= 1.5 * rows[1, 1]["messages_per_placement"]
    assert rows[32, 1]["success_rate"] >= rows[32, 0]["success_rate"] - 0.01


def test_a_requestors_start_costs_two_messages_a_keeper_and_two_per_node_without() -> None:
    assert keeper_run(4, 1).run().row()["requestor_start_messages"] == 2
    assert keeper_run(4, 2).run().row()["requestor_start_messages"] == 4  # 2 per keeper
    assert keeper_run(4, 0).run().row()["requestor_start_messages"] == 2 * 80


def test_the_default_simulation_runs_two_keepers_as_the_recommended_deployment_does() -> None:
    assert SimulationConfig().keepers == 2
    status, out, _ = run("simulate", "--nodes", "20", "--requests", "50", "--loads", "0.8",
                         "--systems", "reservoir", "--jobs", "1")  # fmt: skip
    assert status == 0, out
    assert "8 requestor(s) and 2 keeper(s)" in out


def test_with_the_default_two_keepers_the_roster_costs_the_same_with_one_requestor_or_many() -> (
    None
):
    one, many = (keeper_run(k, SimulationConfig().keepers).run().row() for k in (1, 32))
    for row in (one, many):
        assert row["audit_ok"] is True and row["false_failures"] == 0
    assert many["messages_per_placement"] <= 1.5 * one["messages_per_placement"]


def test_requestors_restarting_through_the_run_lose_no_placement() -> None:
    steady = keeper_run(8, 1).run().row()
    simulation = keeper_run(8, 1, restarts_per_s=0.5)
    churned = simulation.run().row()
    assert churned["requestor_restarts"] > 100
    assert simulation.audit_report.ok, simulation.audit_report
    assert churned["false_failures"] == 0
    assert churned["placed"] >= steady["placed"] - 2
