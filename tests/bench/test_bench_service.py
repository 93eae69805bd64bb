"""``reservoir bench-service`` as a user meets it: one JSON object with the service's and
the library's figures side by side, every answer of the concurrent cycles counted, the
audit at the end, clear errors. A short run; no timing is asserted."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from reservoir.cli.bench_service import bench_service

pytestmark = [pytest.mark.rabbitmq]


def test_a_short_run_measures_the_service_beside_the_library_and_audits_the_nodes(
    reservoir_amqp_broker_url: str,
) -> None:
    result = CliRunner().invoke(
        bench_service,
        ["--broker", reservoir_amqp_broker_url, "--nodes", "3", "--node-processes", "1",
         "--replicas", "2", "--clients", "4", "--sequential", "10", "--cycles", "24",
         "--load-seconds", "1", "--json"],
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    found = json.loads(result.stdout)
    for figure in ("reserve_p50_ms", "keyed_reserve_p50_ms", "release_p50_ms"):
        assert found["library"][figure] > 0
    for figure in ("post_p50_ms", "keyed_post_p50_ms", "delete_p50_ms", "get_p50_placing_ms",
                   "get_p50_other_ms", "get_unknown_p50_ms"):  # fmt: skip
        assert found["http"][figure] > 0
    assert found["library_per_s"] > 0 and found["post_per_s_one_replica"] > 0
    assert found["serve_cpu_ms_per_cycle"] > 0 and found["library_cpu_ms_per_cycle"] > 0
    # every cycle answered as it should, on both replicas, keyed or not
    for label in ("unkeyed", "keyed"):
        assert found["cycle_statuses"][label] == {"DELETE 204": 24, "GET 200": 24, "POST 201": 24}
    assert found["not_found_for_held"] == 0 and found["held_at_end"] == 0
    assert found["audit"] == {
        "overcommitted": 0,
        "leaked_reservations": 0,
        "duplicate_placements": 0,
    }
    assert set(found["targets"]) >= {"post_p50_over_library", "get_p50_other_ms", "held_at_end"}
    assert found["load_tool"] == ("wrk" if shutil.which("wrk") else "httpx")


def test_memory_is_refused_in_one_line() -> None:
    result = CliRunner().invoke(bench_service, ["--broker", "memory://"])
    assert result.exit_code == 2
    assert "give a RabbitMQ URL" in result.stderr
    assert "Traceback" not in result.stderr
