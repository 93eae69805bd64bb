"""Every script in benchmarks/ in a short run, as a user runs it (``python
benchmarks/NAME.py``): each runs to its end on small sizes and prints what it measures. The
figures of so short a run mean nothing and are not checked; that the run ends, that its
audit (where it has one) is clean and that it reports every part it promises, are. Those
on RabbitMQ run against the broker under test, on exchanges of their own.

The index of the scripts is docs/benchmarks.md, "The scripts in benchmarks/": the last
test holds it, the directory and this module to each other."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.unit.test_rabbitmq_hops import BROKER, a_placement, a_round_trip, capture

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
INDEX = ROOT / "docs" / "benchmarks.md"
#: the kinds of message a placement sends, each timed by codec.py
PLACEMENT_KINDS = ("probe", "offer", "decline", "award", "accepted", "release", "status")


def run_script(name: str, *args: str, timeout_s: float = 120) -> str:
    """``python benchmarks/<name>.py ARGS`` with this tree first on the path; its stdout,
    once it has exited 0."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *sys.path])}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, f"{name}.py exited {done.returncode}: {done.stderr[-3000:]}"
    return done.stdout


def test_codec_times_each_message_of_a_placement_and_the_seven_together() -> None:
    out = run_script("codec", "--rounds", "50")

    rows = {line.split()[0] for line in out.splitlines() if line.strip()}
    assert rows >= {*PLACEMENT_KINDS, "placement"}
    assert "as multiples of json.loads" in out


def test_runtime_instructions_places_and_audits_on_one_thread() -> None:
    result = json.loads(run_script("runtime_instructions", "--placements", "20", "--nodes", "4"))

    assert result["placements"] == 20
    assert result["messages"] >= 7 * 20


def test_runtime_instructions_profiles_the_same_run() -> None:
    out = run_script("runtime_instructions", "--placements", "20", "--nodes", "4", "--profile", "5")

    assert "self us/placement" in out
    assert len(out.splitlines()) == 1 + 1 + 5  # the run's line, the heading, five functions


def test_pause_cost_measures_every_pause_both_ways() -> None:
    out = run_script(
        "pause_cost", "--pauses-us", "0,50", "--calls", "20", "--rounds", "1", "--json"
    )

    result = json.loads(out)
    assert len(result["runs"]) == 4
    assert {way: set(pauses) for way, pauses in result["medians_us"].items()} == {
        "sleeping": {"0", "50"},
        "spinning": {"0", "50"},
    }


def test_rabbitmq_hops_reads_a_capture_file(tmp_path: Path) -> None:
    pcap = tmp_path / "run.pcap"
    segments = a_placement("r1", 0) + a_placement("r2", 2000) + a_round_trip(5000)
    pcap.write_bytes(capture(segments))

    result = json.loads(run_script("rabbitmq_hops", str(pcap), "--port", str(BROKER), "--json"))

    assert result["count"]["request"] == 2
    assert set(result["p50_us"]) >= {"request", "offer", "award", "accepted", "round trip"}


@pytest.mark.rabbitmq
def test_adapter_speed_holds_each_client_against_raw_pika(amqp_url: str) -> None:
    out = run_script(
        "adapter_speed", "--url", amqp_url, "--round-trips", "20", "--messages", "200",
        "--repeats", "1", "--json",
    )  # fmt: skip

    result = json.loads(out)
    assert set(result["ratios_to_raw_pika"]) >= {"pika adapter", "kombu adapter", "raw py-amqp"}
    assert set(result["kombu_adapter_to_raw_py_amqp"]) == {"p50_ratio", "rate_ratio"}


@pytest.mark.rabbitmq
def test_adapter_instructions_runs_the_pika_adapters_round_trips(amqp_url: str) -> None:
    result = json.loads(
        run_script("adapter_instructions", "--url", amqp_url, "--round-trips", "20")
    )

    assert result["round_trips"] == 20
    assert result["p50_us"] > 0


@pytest.mark.rabbitmq
def test_exchange_type_prices_a_topic_exchange_against_a_direct_one(amqp_url: str) -> None:
    out = run_script(
        "exchange_type", "--url", amqp_url, "--messages", "100", "--rounds", "2",
        "--bindings", "5", "--destinations", "3",
    )  # fmt: skip

    assert len(re.findall(r"^round \d: (topic|direct) ", out, re.M)) == 4
    assert "median RabbitMQ CPU per message: topic" in out


@pytest.mark.rabbitmq
def test_message_floor_runs_every_kind_of_run_and_its_bounds(amqp_url: str) -> None:
    out = run_script(
        "message_floor", "--broker", amqp_url, "--nodes", "4", "--node-processes", "1",
        "--requestors", "2", "--placements", "20", "--sequential", "20", "--woken-us", "50",
        "--work-placements", "10,30", "--bench-placements", "40", "--pairs", "1", "--json",
    )  # fmt: skip

    result = json.loads(out)
    assert set(result["medians"]) == {
        "floor, callers on the IO thread",
        "floor, callers on threads",
        "floor, one placement at a time",
        "the work alone, one thread",
        "the work alone, woken before every step",
        "reservoir bench (throughput run)",
    }
    assert set(result["bound"]) == {"io", "threads", "io, woken", "threads, woken"}


@pytest.mark.rabbitmq
def test_placement_timeline_splits_every_hop_at_the_socket(amqp_url: str) -> None:
    out = run_script(
        "placement_timeline", "--broker", amqp_url, "--nodes", "4", "--placements", "60", "--json"
    )

    result = json.loads(out)
    assert result["placements"] > 0
    hops = [label for label in result["p50_us"] if label.startswith("hop: ") and ": " in label[5:]]
    # every hop in three parts: its hooks on the driver, the endpoint and the socket took
    assert len(hops) == 4 * 3
    assert result["round_trip_hop_written_to_read_us"] is not None


@pytest.mark.rabbitmq
def test_task_output_follows_a_task_that_writes_and_audits_its_node(amqp_url: str) -> None:
    figures = json.loads(run_script("task_output", "--broker", amqp_url, "--bytes", "2M", "--json"))

    assert figures["exit_code"] == 0 and figures["audit_status"] == 0
    assert figures["bytes_read"] + figures["bytes_skipped"] == figures["bytes_written"]


def test_the_index_lists_every_script_in_benchmarks_and_each_has_a_short_run_here() -> None:
    scripts = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    page = INDEX.read_text()
    section = page.split("## The scripts in `benchmarks/`", 1)[1].split("\n## ", 1)[0]
    indexed = sorted(re.findall(r"^\| `(\w+)\.py` \|", section, re.M))
    short_run = [s for s in scripts if any(test.startswith(f"test_{s}_") for test in globals())]

    assert indexed == scripts
    assert short_run == scripts
