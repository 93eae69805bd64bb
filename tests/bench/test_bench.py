"""``reservoir bench`` as a user meets it: one JSON object with every figure, clear errors,
and nothing of its own left on the broker. Short runs; no timing is asserted."""

from __future__ import annotations

import json
import shutil
import subprocess
from typing import Any
from urllib.parse import urlsplit

import pika
import pika.exceptions
import pytest
from click.testing import CliRunner

from reservoir.brokers import BrokerUrl
from reservoir.cli.bench import bench
from reservoir.tools.bench.runner import (
    _baseline_moved,
    audit_ledgers,
    run_exchanges,
)

REQUIRED_KEYS = (
    "rtt_p50_ms", "rtt_p99_ms", "place_p50_ms", "place_p95_ms", "place_p99_ms",
    "place_p50_over_rtt", "place_p99_over_rtt", "placements_per_s", "messages_per_placement",
    "time_to_failure_ms", "time_to_failure_explain_ms", "nodes", "requestors",
    "requestor_mode", "node_processes", "broker",
)  # fmt: skip


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(bench, list(args))
    return result.exit_code, result.stdout, result.stderr


def short_run(broker_url: str, *extra: str) -> dict[str, Any]:
    status, out, err = run("--broker", broker_url, "--nodes", "4", "--requestors", "2",
                           "--placements", "30", "--json", *extra)  # fmt: skip
    assert status == 0, err
    result: dict[str, Any] = json.loads(out)  # the whole of stdout is one JSON object
    return result


def assert_sane(result: dict[str, Any]) -> None:
    for key in REQUIRED_KEYS:
        assert key in result, key
    for key in ("rtt_p50_ms", "rtt_p99_ms", "place_p50_ms", "place_p95_ms", "place_p99_ms",
                "place_p50_over_rtt", "place_p99_over_rtt", "placements_per_s",
                "time_to_failure_ms", "time_to_failure_explain_ms"):  # fmt: skip
        assert result[key] > 0, key
    assert result["rtt_p50_ms"] <= result["rtt_p99_ms"]
    # the baseline is taken before and after the sequential run, and the ratios pool both
    halves = (result["rtt_p50_before_ms"], result["rtt_p50_after_ms"])
    assert min(halves) > 0
    assert min(halves) - 0.002 <= result["rtt_p50_ms"] <= max(halves) + 0.002
    assert result["place_p50_ms"] <= result["place_p95_ms"] <= result["place_p99_ms"]
    assert result["messages_per_placement"] > 0
    assert result["sequential_failed"] == result["throughput_failed"] == 0
    assert result["nodes"] == 4
    assert result["requestors"] == 2
    assert result["requestor_mode"] in ("threads", "processes")
    assert result["full_cluster_placed"] == 16  # 4 nodes of 4 instances, then a failure
    assert "exhausted" in result["failure_explanation"]
    # the bounds the machine sets, measured in the same run
    assert result["broker_msgs_per_s"] > 0
    assert result["broker_bound_placements_per_s"] == pytest.approx(
        result["broker_msgs_per_s"] / result["messages_per_placement"], rel=0.01
    )
    if result["node_mode"] == "processes":
        # the round trip to a node process, and the least a placement's two of them allow
        assert 0 < result["rtt_to_nodes_p50_ms"] <= result["rtt_to_nodes_p99_ms"]
        assert result["place_floor_over_rtt"] == pytest.approx(
            2 * result["rtt_to_nodes_p50_ms"] / result["rtt_p50_ms"], rel=0.01
        )
    else:
        assert result["rtt_to_nodes_p50_ms"] is None  # no node process to reach
        assert result["place_floor_over_rtt"] is None
    cpu = result["cpu_ms_per_placement"]
    # whoever runs the throughput run's requestors: this process, or processes of their own
    # (then this one only waits, and may round to 0)
    assert cpu["this process" if result["requestor_mode"] == "threads" else "requestors"] > 0
    if result["node_mode"] == "processes":
        # the node agents' processes are measured too; /proc counts in ticks of 10 ms,
        # which the few placements of a short run may not fill
        assert cpu["nodes"] >= 0
    assert result["cpu_bound_placements_per_s"] == pytest.approx(
        result["cpu_bound_cores"] * 1000 / sum(cpu.values()), rel=0.01
    )
    # reservoir's own CPU is every part but the broker's, held against the broker's where
    # it was read; the client adapter's floor comes from the message-rate run
    own = sum(ms for part, ms in cpu.items() if part != "broker")
    assert result["own_cpu_ms_per_placement"] == pytest.approx(own, abs=0.002)
    if "broker" in cpu and cpu["broker"] > 0:
        assert result["own_cpu_over_broker_cpu"] == pytest.approx(own / cpu["broker"], rel=0.02)
    else:
        assert result["own_cpu_over_broker_cpu"] is None
    assert result["client_floor_cpu_ms_per_placement"] > 0
    # the threads' context switches by part, where the part's CPU was read: whoever runs
    # the requestors waits for every placement, a node process's IO thread for its
    # deliveries
    switches = result["switches_per_placement"]
    assert set(switches) == set(cpu)
    for counts in switches.values():
        assert counts["woken"] >= 0 and counts["preempted"] >= 0
    requestors = "this process" if result["requestor_mode"] == "threads" else "requestors"
    assert switches[requestors]["woken"] >= 1
    if result["node_mode"] == "processes":
        assert switches["nodes"]["woken"] > 0
    # the run ends with the invariant audit of every node's ledger
    assert result["audit"] == {
        "overcommitted": 0, "leaked_reservations": 0, "duplicate_placements": 0,
    }  # fmt: skip


def test_a_short_run_on_the_in_process_broker_reports_every_figure() -> None:
    result = short_run("memory://")
    assert_sane(result)
    assert result["broker"] == "memory://"
    assert result["node_mode"] == "in-process"
    assert result["node_processes"] == 0
    assert any("memory://" in note for note in result["notes"])


def test_the_summary_is_a_table_naming_the_machine() -> None:
    status, out, _ = run("--broker", "memory://", "--nodes", "2", "--requestors", "1",
                         "--placements", "10")  # fmt: skip
    assert status == 0
    assert "placements per second" in out
    assert "cores" in out


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("--broker", "memory://", "--nodes", "0"), "'--nodes'"),
        (("--broker", "memory://", "--placements", "-1"), "'--placements'"),
        (("--broker", "redis://localhost/"), "'--broker'"),
        (("--broker", "amqp://guest:guest@127.0.0.1:1/?exchange=amq.mine"), "'--broker'"),
        (("--broker", "amqp://guest:guest@127.0.0.1:1/", "--nodes", "2",
          "--node-processes", "3"), "'--node-processes'"),
        (("--broker", "memory://", "--kill-keeper"), "'--kill-keeper'"),
    ],
)  # fmt: skip
def test_a_bad_option_is_one_line_naming_it(args: tuple[str, ...], option: str) -> None:
    status, _, err = run(*args)
    assert status == 2
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1
    assert option in errors[0]
    assert "Traceback" not in err


def test_an_unreachable_broker_is_one_line_and_exit_status_3() -> None:
    status, out, err = run("--broker", "amqp://guest:secret@127.0.0.1:1/", "--nodes", "1",
                           "--node-processes", "1")  # fmt: skip
    assert status == 3
    assert out == ""
    assert len(err.strip().splitlines()) == 1
    assert "secret" not in err  # the password is masked


def test_a_named_exchange_is_only_the_prefix_of_the_runs_own_exchanges() -> None:
    url = BrokerUrl.parse("amqp://guest:guest@127.0.0.1/?heartbeat=5&exchange=team.bench")
    main, full = run_exchanges(url, "abcd")
    assert (main, full) == ("team.bench.abcd", "team.bench.abcd.full")
    assert url.with_exchange(main).given.endswith("heartbeat=5&exchange=team.bench.abcd")
    assert run_exchanges(BrokerUrl.parse("amqp://h/"), "abcd")[0] == "reservoir.bench.abcd"


# -- on RabbitMQ ---------------------------------------------------------------------------


def exchange_exists(url: str, name: str) -> bool:
    connection = pika.BlockingConnection(pika.URLParameters(url))
    try:
        connection.channel().exchange_declare(name, passive=True)
    except pika.exceptions.ChannelClosedByBroker as error:
        if error.reply_code == 404:  # NOT_FOUND
            return False
        raise
    finally:
        if connection.is_open:
            connection.close()
    return True


def names_listed_by_rabbitmqctl(what: str) -> list[str]:
    """Exchange or queue names, as the RabbitMQ on this machine lists them (nothing when
    rabbitmqctl is not here; the passive declares still check the exchanges)."""
    if shutil.which("rabbitmqctl") is None:
        return []
    done = subprocess.run(["rabbitmqctl", "-q", f"list_{what}", "name"],
                          capture_output=True, text=True, timeout=60, check=True)  # fmt: skip
    return done.stdout.split()


@pytest.mark.rabbitmq
def test_a_short_run_on_rabbitmq_reports_every_figure_and_leaves_nothing_behind(
    reservoir_amqp_broker_url: str,
) -> None:
    result = short_run(reservoir_amqp_broker_url, "--node-processes", "2")
    assert_sane(result)
    assert result["node_mode"] == "processes"
    assert result["node_processes"] == 2
    if urlsplit(reservoir_amqp_broker_url).password:
        assert urlsplit(result["broker"]).password == "***"  # masked
    main, full = result["exchanges"]
    run_id = main.rsplit(".", 1)[-1]
    assert full == f"{main}.full"
    for name in (main, f"{main}.inbox", full, f"{full}.inbox"):
        assert not exchange_exists(reservoir_amqp_broker_url, name), name
    for what in ("exchanges", "queues"):
        left = [name for name in names_listed_by_rabbitmqctl(what) if run_id in name]
        assert left == [], f"{what} left behind: {left}"


@pytest.mark.rabbitmq
def test_requestors_in_processes_of_their_own_taking_rosters_from_a_keeper(
    reservoir_amqp_broker_url: str,
) -> None:
    result = short_run(
        reservoir_amqp_broker_url, "--node-processes", "1", "--requestor-processes", "2",
        "--keepers", "1",
    )  # fmt: skip
    assert_sane(result)
    assert (result["requestor_mode"], result["requestor_processes"]) == ("processes", 2)
    assert result["keepers"] == 1
    assert result["throughput_messages_per_placement"] > 0
    assert set(result["cpu_ms_per_placement"]) >= {"requestors", "nodes"}
    assert result["audit"] == dict.fromkeys(result["audit"], 0)


def test_the_throughput_run_counts_every_message_delivered_to_any_participant() -> None:
    # Followed by every requestor, the nodes' statuses are delivered once per requestor;
    # taken from a keeper, once: the delivered count shows the difference, the sent does not.
    # 200 placements, so that the nodes' tiers change (and they say so) within the run.
    following = short_run("memory://", "--requestors", "6", "--placements", "200")
    keeping = short_run("memory://", "--requestors", "6", "--keepers", "1", "--placements", "200")
    assert keeping["keepers"] == 1 and following["keepers"] == 0
    assert (
        following["throughput_messages_per_placement"]
        > keeping["throughput_messages_per_placement"]
        >= 7
    )


def test_the_throughput_runs_message_count_leaves_the_warm_up_placements_out() -> None:
    # Six threads warm up with 20 placements each before the 30 measured ones: counted in,
    # those would make it about 30 messages a placement instead of about 7.
    result = short_run("memory://", "--requestors", "6", "--keepers", "1")
    assert result["throughput_placed"] == 30
    assert 7 <= result["throughput_messages_per_placement"] <= 9


def test_the_audit_counts_what_breaks_an_invariant() -> None:
    summaries = [
        {"overcommitted": ["n1"], "leaked_reservations": 1, "instances": {"r1": [1, 1]}},
        {"overcommitted": [], "leaked_reservations": 0, "instances": {"r1": [1, 1], "r2": [2, 2]}},
    ]
    assert audit_ledgers(summaries) == {
        "overcommitted": 1, "leaked_reservations": 1, "duplicate_placements": 1,
    }  # fmt: skip


def test_a_baseline_that_moved_between_its_halves_gets_a_note_and_a_steady_one_none() -> None:
    assert _baseline_moved(0.001, 0.0011) is None
    note = _baseline_moved(0.001, 0.002)
    assert note is not None
    assert "from 1.0 ms" in note and "to 2.0 ms" in note


def assert_the_outage_lost_nothing(result: dict[str, Any], keepers: int) -> None:
    outage = result["keeper_outage"]
    assert outage is not None
    assert outage["keepers"] == keepers
    assert outage["placed"] == outage["placements"] == 30
    assert outage["false_failures"] == 0
    # killed a third of the way through, started again at two thirds
    assert 10 <= outage["killed_after_placements"] < outage["started_again_after_placements"]
    assert 20 <= outage["started_again_after_placements"] < 30
    # every requestor on keepers at the end; with two, none ever left them
    assert outage["requestors_by_roster_source"] == {"keepers": 2}
    if keepers == 2:
        assert outage["requestors_that_fell_back"] == 0
    assert result["audit"] == dict.fromkeys(result["audit"], 0)


@pytest.mark.parametrize("keepers", [1, 2])
def test_a_keeper_killed_during_a_run_loses_no_placement(keepers: int) -> None:
    result = short_run("memory://", "--keepers", str(keepers), "--kill-keeper")
    assert_sane(result)
    assert_the_outage_lost_nothing(result, keepers)


def test_without_kill_keeper_there_is_no_outage_run() -> None:
    assert short_run("memory://", "--keepers", "1")["keeper_outage"] is None


@pytest.mark.rabbitmq
def test_one_of_two_keeper_processes_killed_during_a_run_on_rabbitmq_loses_no_placement(
    reservoir_amqp_broker_url: str,
) -> None:
    result = short_run(
        reservoir_amqp_broker_url, "--node-processes", "1", "--keepers", "2", "--kill-keeper"
    )
    assert_sane(result)
    assert_the_outage_lost_nothing(result, 2)
    assert any("in processes of their own" in note for note in result["notes"])
