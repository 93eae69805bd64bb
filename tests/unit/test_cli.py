"""The ``reservoir`` command as a user meets it: help, the demo, clear usage errors."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner

from reservoir.cli import main


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout, result.stderr


def test_help_explains_every_command() -> None:
    status, out, _ = run("--help")
    assert status == 0
    for command in ("demo", "node", "request", "free", "inspect"):
        assert command in out
    for command in ("demo", "node", "request", "free", "inspect"):
        status, out, _ = run(command, "--help")
        assert status == 0
        assert "--" in out


def test_the_demo_prints_exactly_one_json_object_and_audits_clean() -> None:
    status, out, _ = run("demo", "--nodes", "8", "--requests", "120", "--concurrency", "4",
                         "--json")  # fmt: skip
    assert status == 0
    result = json.loads(out)  # the whole of stdout is one JSON object
    for key in ("placed", "failed", "overcommitted", "leaked_reservations",
                "duplicate_placements", "p50_ms", "p99_ms", "placements_per_s",
                "messages_per_placement"):  # fmt: skip
        assert key in result
    assert result["placed"] + result["failed"] == 120
    assert (result["overcommitted"], result["leaked_reservations"],
            result["duplicate_placements"]) == (0, 0, 0)  # fmt: skip


def test_the_demo_reports_failures_when_the_cloud_is_too_small() -> None:
    status, out, _ = run("demo", "--nodes", "1", "--requests", "80", "--concurrency", "2",
                         "--json", "--seed", "3")  # fmt: skip
    result = json.loads(out)
    assert status == 0  # failing to place is not a broken invariant
    assert result["failed"] > 0
    assert result["placed"] + result["failed"] == 80
    assert result["overcommitted"] == 0


def test_the_demo_summary_is_a_table() -> None:
    status, out, _ = run("demo", "--nodes", "4", "--requests", "20")
    assert status == 0
    assert "placements per second" in out
    assert "invariants hold" in out


def test_a_node_without_an_inventory_is_a_usage_error() -> None:
    status, _, err = run("node", "--name", "n1", "--broker", "memory://")
    assert status == 2
    assert "needs an inventory" in err


def test_a_malformed_inventory_is_a_usage_error() -> None:
    status, _, err = run(
        "node", "--name", "n1", "--broker", "memory://", "--inventory", "CUSTOM_GPU"
    )
    assert status == 2
    assert "CLASS=TOTAL" in err


def test_an_unknown_resource_class_is_refused_before_anything_starts() -> None:
    status, _, err = run("request", "--broker", "memory://", "--resource", "GPUS=1")
    assert status == 2
    assert "unknown resource class GPUS" in err


def test_a_request_nobody_hears_fails_at_its_deadline_with_an_explanation_and_status_1() -> None:
    status, out, _ = run("request", "--broker", "memory://", "--vcpus", "1", "--json",
                         "--timeout", "1")  # fmt: skip
    assert status == 1
    result = json.loads(out)
    assert result["placed"] is False
    assert result["tiers_tried"] == [10, 25, 50, 75, 100]
    assert "no node answered in" in result["explanation"]


def test_group_and_policy_go_together() -> None:
    status, _, err = run("request", "--broker", "memory://", "--vcpus", "1", "--group", "g1")
    assert status == 2
    assert "--group and --policy go together" in err


def test_an_unsupported_broker_url_is_a_usage_error() -> None:
    status, _, err = run("request", "--broker", "carrier-pigeon://x", "--vcpus", "1")
    assert status == 2
    assert "no broker adapter" in err


def test_a_mistyped_scheme_is_a_usage_error_suggesting_the_right_one() -> None:
    status, _, err = run("request", "--broker", "ampq://guest:guest@127.0.0.1:5672/",
                         "--vcpus", "1")  # fmt: skip
    assert status == 2
    assert len(err.strip().splitlines()) == 1, err
    assert "did you mean amqp://?" in err and "guest:guest" not in err


@pytest.mark.parametrize(
    "command",
    [
        ("node", "--name", "n1", "--vcpus", "1"),
        ("request", "--vcpus", "1"),
        ("nodes",),
        ("audit",),
        ("free", "--request-id", "r1"),
        ("serve",),
        ("keeper",),
    ],
)
def test_a_command_that_talks_to_a_cluster_refuses_to_start_without_a_broker(
    command: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RESERVOIR_BROKER_URL", raising=False)
    status, out, err = run(*command)
    assert status == 2
    assert err.strip().splitlines() == [
        f"reservoir {command[0]}: no broker given: pass --broker URL or set "
        "RESERVOIR_BROKER_URL (amqp://user:pass@host:5672/ for RabbitMQ; memory:// for a "
        "broker inside this process only)"
    ]
    assert out == ""


def test_inspect_without_a_state_file_says_so(tmp_path: object) -> None:
    status, _, err = run("inspect", "--state-dir", str(tmp_path), "--name", "ghost")
    assert status == 2
    assert "no state file" in err


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [
        ("RESERVOIR_TTL_S", "abc", "ttl_s (RESERVOIR_TTL_S)"),
        ("RESERVOIR_SECRET", "short", "RESERVOIR_SECRET"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it_and_status_2(
    variable: str, value: str, named: str
) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "reservoir", "request", "--vcpus", "1", "--memory-mb", "1",
         "--broker", "memory://"],
        env={**os.environ, variable: value}, capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert named in done.stderr and "Traceback" not in done.stderr


def test_a_broker_on_a_closed_port_is_one_line_and_status_3() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "reservoir", "request", "--vcpus", "1", "--memory-mb", "1",
         "--broker", f"amqp://guest:guest@127.0.0.1:{port}/"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 3
    assert done.stderr.splitlines() == [
        f"reservoir request: cannot connect to amqp://guest:***@127.0.0.1:{port}/: "
        "connection refused"
    ]


def test_a_node_waiting_for_its_broker_says_why_in_celerys_words_and_when_it_tries_again() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "reservoir", "node", "--name", "n1", "--vcpus", "1",
         "--connect-attempts", "2", "--broker", f"amqp://guest:guest@127.0.0.1:{port}/"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 3
    shown = f"amqp://guest:***@127.0.0.1:{port}/"
    waited, gave_up = done.stderr.splitlines()
    # the log format of every line the process logs: time, level, logger, message
    assert re.fullmatch(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO reservoir: "
        rf"node n1: cannot connect to {re.escape(shown)}: connection refused; "
        r"retrying in \d+\.\d s \(attempt 1\)",
        waited,
    ), waited
    assert gave_up == f"reservoir node: cannot connect to {shown}: connection refused"


def test_the_whole_connection_error_is_logged_with_dash_v() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run(
        [sys.executable, "-m", "reservoir", "-v", "request", "--vcpus", "1",
         "--broker", f"amqp://guest:guest@127.0.0.1:{port}/"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 3
    assert "ConnectionRefusedError(111" in done.stderr  # pika's whole exception, at INFO
    # never connected: a retry says so, not "connection lost ... reconnecting"
    assert "reconnecting" not in done.stderr and "connection lost" not in done.stderr
    assert f"cannot connect to amqp://guest:***@127.0.0.1:{port}/: connection refused; " in (
        done.stderr
    )


def test_reservoir_version_names_the_release_its_protocol_and_the_line_it_runs_beside() -> None:
    from reservoir import __version__
    from reservoir.protocol.compatibility import RELEASE_LINES
    from reservoir.protocol.messages import PROTOCOL_VERSION

    shown = CliRunner().invoke(main, ["--version"])
    assert shown.exit_code == 0
    assert shown.output.strip() == (
        f"reservoir, version {__version__} "
        f"(protocol {PROTOCOL_VERSION}; runs beside {RELEASE_LINES[-2]})"
    )
