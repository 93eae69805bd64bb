"""``reservoir versus placement`` as a user meets it: both systems measured side by side
in one JSON object, Nova's ranking of candidates, clear errors, and nothing it started
left running. A short run (a few nodes, a few dozen placements); no timing is asserted."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from reservoir.cli.versus import versus
from reservoir.tools.bench.children import child_env
from reservoir.tools.versus_placement.scheduler import PlacementClient, ranked
from reservoir.tools.versus_placement.services import missing, start_placement


def needs_the_incumbent() -> None:
    """Skip when Placement or MariaDB's server is not here; under CI (.ci/run installs
    both) that is a failure."""
    lacking = missing()
    if lacking:
        reason = "the incumbent cannot run here: missing " + ", ".join(lacking)
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


def candidates(free: dict[str, tuple[int, int]]) -> dict[str, Any]:
    """An /allocation_candidates answer: provider -> (free VCPUs, free MB), in this order."""
    return {
        "allocation_requests": [
            {"allocations": {p: {"resources": {"VCPU": 1}}}} for p in free
        ],
        "provider_summaries": {
            p: {"resources": {"VCPU": {"capacity": 64, "used": 64 - v},
                              "MEMORY_MB": {"capacity": 65536, "used": 65536 - m}}}
            for p, (v, m) in free.items()
        },
    }  # fmt: skip


def test_candidates_are_ranked_most_free_memory_first_as_novas_ram_weigher_does() -> None:
    answer = candidates({"a": (8, 1024), "b": (8, 8192), "c": (8, 4096)})
    assert ranked(answer) == ["b", "c", "a"]


def test_free_vcpus_count_as_much_as_free_memory_after_normalising() -> None:
    # b: most memory, least CPU (1 + 0); c: second on both (0.5 + 0.5 = 1); a: most CPU
    # and least memory (0 + 1): equal weights keep Placement's order, as Nova's sort does
    answer = candidates({"a": (16, 1024), "b": (0, 9216), "c": (8, 5120)})
    assert ranked(answer) == ["a", "b", "c"]
    assert ranked(candidates({"x": (4, 4096), "y": (4, 4096)})) == ["x", "y"]
    assert ranked({"allocation_requests": [], "provider_summaries": {}}) == []


def test_an_in_process_broker_is_refused_with_a_one_line_error() -> None:
    result = CliRunner().invoke(versus, ["placement", "--broker", "memory://"])
    assert result.exit_code == 2
    assert "Invalid value for '--broker'" in result.stderr
    assert "Traceback" not in result.output


def test_only_placement_is_an_incumbent() -> None:
    result = CliRunner().invoke(versus, ["slurm", "--broker", "amqp://guest:guest@h/"])
    assert result.exit_code == 2
    assert "'slurm' is not 'placement'" in result.stderr


def ours(pattern: str) -> set[str]:
    return {str(p) for p in Path(tempfile.gettempdir()).glob(pattern)}


#: what names the processes a run starts: MariaDB's datadir, gunicorn's app, a scheduler
STARTED_BY_A_RUN = (
    "reservoir-versus-placement-",
    "placement.wsgi.api",
    "versus_placement.scheduler",
)


def running_ones() -> set[tuple[int, str]]:
    """(pid, command line) of the running processes a run of the command starts."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if any(mark in line for mark in STARTED_BY_A_RUN):
                found.add((int(entry.name), line))
    return found


@pytest.mark.rabbitmq
def test_a_short_run_measures_both_side_by_side_and_leaves_nothing_behind(
    reservoir_amqp_broker_url: str,
) -> None:
    needs_the_incumbent()
    before = ours("reservoir-versus-placement-*")
    running_before = running_ones()
    result = CliRunner().invoke(
        versus,
        ["placement", "--broker", reservoir_amqp_broker_url, "--nodes", "6", "--requestors", "2",
         "--placements", "30", "--incumbent-placements", "12", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    report = json.loads(result.stdout)  # the whole of stdout is one JSON object
    (size,) = report["sizes"]
    assert size["nodes"] == 6
    reservoir, placement = size["reservoir"], size["placement"]
    assert reservoir["placed"] == 30 and reservoir["refused"] == 0
    assert placement["placed"] + placement["refused"] == 12
    assert placement["refused"] == 0  # 6 providers of 16+ instances: room for all 12
    for side in (reservoir, placement):
        assert side["placements_per_s"] > 0
        assert 0 < side["p50_ms"] <= side["p99_ms"]
        # the 90 % fill: 6 nodes of 5 instances, 4 each first, then 3 single instances
        assert side["fill_placed"] + side["false_failures_at_90"] == 3
        assert side["cpu_ms_total"] == pytest.approx(sum(side["cpu_ms_per_placement"].values()))
    assert reservoir["audit"] == {
        "overcommitted": 0, "leaked_reservations": 0, "duplicate_placements": 0,
    }  # fmt: skip
    assert set(reservoir["cpu_ms_per_placement"]) >= {"nodes", "requestors"}
    parts = placement["cpu_ms_per_placement"]
    assert parts["placement (gunicorn)"] > 0 and parts["schedulers"] > 0
    assert "mariadb" in parts
    assert set(placement["retries"]) == {"same_provider", "next_candidate"}
    # a scheduler is refused only when every candidate it was given filled up meanwhile:
    # 2 schedulers cannot fill 3 free nodes between one query and its last claim
    assert placement["false_failures_at_90"] == 0
    # every 409 was followed by a try again on the same provider or by the next candidate
    # (none was refused for want of one)
    for run in ("", "fill_"):
        conflicts, retries = placement[f"{run}conflicts"], placement[f"{run}retries"]
        assert sum(conflicts.values()) == retries["same_provider"] + retries["next_candidate"]
    assert size["ratio"]["placements_per_s"] == pytest.approx(
        reservoir["placements_per_s"] / placement["placements_per_s"], rel=0.05
    )
    assert any("filters on host state" in line for line in report["left_out"])
    # everything it started is gone: its temporary directories and what ran in them
    started = ours("reservoir-versus-placement-*") - before
    assert started == set()
    assert running_ones() - running_before == set()
    if shutil.which("rabbitmqctl"):
        listed = subprocess.run(["rabbitmqctl", "-q", "list_exchanges", "name"],
                                capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
        assert [n for n in listed.stdout.split() if n.startswith("reservoir.versus.")] == []


def serve_until_interrupted(seen: list[tuple[Path, set[tuple[int, str]]]]) -> None:
    """Start Placement and its database, check it answers, note what runs, then Ctrl-C
    (or SIGTERM, which the command turns into the same KeyboardInterrupt)."""
    before = running_ones()
    with contextlib.ExitStack() as stack:
        service = start_placement(stack, lambda message: None)
        client = PlacementClient(service.url)
        status, _ = client.call("GET", "/resource_providers")
        client.close()
        assert status == 200
        seen.append((service.workdir, running_ones() - before))
        raise KeyboardInterrupt


def test_placement_and_its_database_are_gone_when_a_run_is_interrupted() -> None:
    needs_the_incumbent()
    running_before = running_ones()
    seen: list[tuple[Path, set[tuple[int, str]]]] = []
    with pytest.raises(KeyboardInterrupt):
        serve_until_interrupted(seen)
    ((workdir, started),) = seen
    assert len(started) == 1 + 1 + 2  # mariadbd, gunicorn and its two workers
    assert running_ones() - running_before == set()
    assert not workdir.exists()


@pytest.mark.rabbitmq
def test_sigterm_mid_run_exits_130_and_stops_the_schedulers_placement_and_mariadb(
    reservoir_amqp_broker_url: str,
) -> None:
    needs_the_incumbent()
    running_before = running_ones()
    before = ours("reservoir-versus-placement-*")
    command = subprocess.Popen(
        [sys.executable, "-m", "reservoir", "versus", "placement",
         "--broker", reservoir_amqp_broker_url, "--nodes", "2", "--requestors", "2",
         "--placements", "10", "--incumbent-placements", "100000"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=child_env(),
    )  # fmt: skip
    assert command.stderr is not None
    try:
        for line in command.stderr:
            if "claims by 2 scheduler processes" in line:
                break
        else:
            pytest.fail(f"it never got to Placement's claims (status {command.wait()})")
        time.sleep(1.0)  # the schedulers are claiming
        assert any("versus_placement.scheduler" in c for _, c in running_ones() - running_before)
        command.send_signal(signal.SIGTERM)
        assert command.wait(60) == 130
    finally:
        if command.poll() is None:
            command.kill()
            command.wait()
    assert running_ones() - running_before == set()
    assert ours("reservoir-versus-placement-*") - before == set()
