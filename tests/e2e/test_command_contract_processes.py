"""The commands' contract, as a user meets it: real ``reservoir`` processes on a real
RabbitMQ. Nothing says "done" that did not happen (a free of a node that holds nothing,
an audit of no node), what was asked for is what is printed (``-f``/``-c`` on a real
placement), and what goes wrong is said in one line."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reservoir.testing import ProcessCluster, ReservoirProcess

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]


class Cluster(ProcessCluster):
    """Nodes of one size, and the commands, on the test's own exchange."""

    def start_node(  # type: ignore[override]
        self, name: str, *args: str, env: dict[str, str] | None = None
    ) -> ReservoirProcess:
        return super().start_node(name, *args, vcpus=4, memory_mb=8192, env=env)

    def place(self, *args: str) -> dict[str, Any]:
        done = self.run("request", "--json", "--timeout", "20", *args)
        assert done.returncode == 0, done.stdout + done.stderr
        placed: dict[str, Any] = json.loads(done.stdout)
        return placed

    def audit(self, *, allocations: int) -> None:
        """The invariants hold on every node started, holding this many allocations."""
        done = self.run("audit", "--json", "--expect-nodes", str(len(self.nodes)), "--wait", "10")
        assert done.returncode == 0, done.stdout + done.stderr
        assert json.loads(done.stdout)["allocations"] == allocations


@pytest.fixture
def cluster(reservoir_amqp_url: str) -> Iterator[Cluster]:
    """Nodes and commands on the test's own exchange (the plugin's fixture makes it), with
    no other ``RESERVOIR_`` setting of the test run's environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESERVOIR_")}
    env["RESERVOIR_BROKER_URL"] = reservoir_amqp_url
    with Cluster(reservoir_amqp_url, env=env) as cluster:
        yield cluster


def one_line(done: subprocess.CompletedProcess[str]) -> str:
    """The one line a failing command wrote on stderr (and no traceback)."""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


# -- 1. reservoir free --node says what the node freed -----------------------------------


def test_free_on_a_node_that_holds_nothing_of_the_request_says_so_and_exits_1(
    cluster: Cluster,
) -> None:
    cluster.start_node("n1")
    cluster.start_node("n2")
    placed = cluster.place("--vcpus", "1", "--memory-mb", "512", "--request-id", "chosen-1")
    (holder,) = {a["node"] for a in placed["allocations"]}
    other = "n1" if holder == "n2" else "n2"

    wrong = cluster.run("free", "--request-id", "chosen-1", "--node", other)
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert wrong.stdout == ""  # no "freed"
    assert one_line(wrong) == (
        f"reservoir free: {other} holds nothing of chosen-1; it is held on {holder} "
        "(give that --node, or none to free it wherever it is held)"
    )
    cluster.audit(allocations=1)  # still held

    unknown = cluster.run("free", "--request-id", "chosen-1", "--node", holder,
                          "--allocation", "no-such-allocation")  # fmt: skip
    assert unknown.returncode == 1
    assert one_line(unknown) == (
        f"reservoir free: {holder} holds no allocation no-such-allocation of chosen-1"
    )

    right = cluster.run("free", "--request-id", "chosen-1", "--node", holder)
    assert right.returncode == 0, right.stderr
    assert right.stdout == f"freed 1 allocation(s) of chosen-1 on {holder}\n"
    cluster.audit(allocations=0)

    again = cluster.run("free", "--request-id", "chosen-1", "--node", holder)
    assert again.returncode == 1
    assert one_line(again) == f"reservoir free: {holder} holds nothing of chosen-1"


def test_free_of_a_generated_id_on_the_wrong_node_frees_nothing_and_exits_1(
    cluster: Cluster,
) -> None:
    cluster.start_node("n1")
    cluster.start_node("n2")
    placed = cluster.place("--vcpus", "1", "--memory-mb", "512")
    request_id = placed["request_id"]
    (holder,) = {a["node"] for a in placed["allocations"]}
    other = "n1" if holder == "n2" else "n2"
    wrong = cluster.run("free", "--request-id", request_id, "--node", other)
    assert wrong.returncode == 1
    assert f"{other} holds nothing of {request_id}; it is held on {holder}" in one_line(wrong)
    # without --node: wherever it is held
    anywhere = cluster.run("free", "--request-id", request_id)
    assert anywhere.returncode == 0, anywhere.stderr
    assert anywhere.stdout == f"freed 1 allocation(s) of {request_id} on {holder}\n"
    cluster.audit(allocations=0)


# -- 2. reservoir audit of no node is no pass --------------------------------------------


def test_an_audit_that_no_node_answers_fails_in_one_line(cluster: Cluster) -> None:
    nobody = cluster.run("audit", "--wait", "0.5")
    assert nobody.returncode == 2, nobody.stdout + nobody.stderr
    assert one_line(nobody) == (
        "reservoir audit: no node answered within 0.5 s: nothing was audited "
        "(give --expect-nodes 0 if no node should be running)"
    )
    assert "invariants hold" not in nobody.stdout
    as_json = cluster.run("audit", "--wait", "0.5", "--json")
    assert as_json.returncode == 2
    assert json.loads(as_json.stdout)["ok"] is False
    # said to expect none, an empty cluster passes
    expected_empty = cluster.run("audit", "--wait", "0.5", "--expect-nodes", "0")
    assert expected_empty.returncode == 0, expected_empty.stderr
    assert "invariants hold" in expected_empty.stdout
    # and with a node, the audit is what it was
    cluster.start_node("n1")
    cluster.audit(allocations=0)


# -- 5. the formats asked for are the formats given --------------------------------------


def test_a_real_placement_is_printed_in_the_format_and_columns_asked_for(cluster: Cluster) -> None:
    cluster.start_node("n1")
    ask = ("request", "--timeout", "20", "--vcpus", "1", "--memory-mb", "512")

    as_json = cluster.run(*ask, "-f", "json")
    assert as_json.returncode == 0, as_json.stderr
    (row,) = json.loads(as_json.stdout)  # the whole of stdout is the JSON
    assert row["node"] == "n1"
    assert row["resources"] == {"MEMORY_MB": 512, "VCPU": 1}
    assert set(row) == {
        "request_id", "node", "allocation_id", "resources", "numa_cells", "pci_devices"
    }  # fmt: skip

    as_csv = cluster.run(*ask, "-f", "csv", "-c", "node")
    assert as_csv.returncode == 0, as_csv.stderr
    assert as_csv.stdout == "node\nn1\n"

    as_values = cluster.run(*ask, "-f", "value", "-c", "node", "-c", "allocation_id")
    assert as_values.returncode == 0, as_values.stderr
    ((node, allocation_id),) = [line.split() for line in as_values.stdout.splitlines()]
    assert node == "n1" and allocation_id.startswith("n1.")

    as_yaml = cluster.run(*ask, "-f", "yaml", "-c", "resources")
    assert as_yaml.stdout == '- resources: {"MEMORY_MB": 512, "VCPU": 1}\n', as_yaml.stdout

    unknown = cluster.run(*ask, "-f", "csv", "-c", "nodes")
    assert unknown.returncode == 2
    assert "-c/--column: no column 'nodes'" in one_line(unknown)
    cluster.audit(allocations=4)  # the unknown column placed nothing

    failed = cluster.run("request", "--timeout", "5", "--vcpus", "64", "-f", "json")
    assert failed.returncode == 1
    assert json.loads(failed.stdout) == []
    assert one_line(failed).startswith("not placed: ")


def test_tasks_are_listed_under_a_header_row(cluster: Cluster) -> None:
    cluster.start_node("n1", "--driver", "exec")
    run = cluster.run("run", "--detach", "--timeout", "20", "--vcpus", "1", "--", "sleep", "60")
    assert run.returncode == 0, run.stderr
    request_id = run.stdout.strip()
    listed = cluster.run("tasks", "--request-id", request_id, "--wait", "2")
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split() == ["node", "request", "allocation", "state", "exit", "code", "reason"]
    assert row.split()[:2] == ["n1", request_id] and row.split()[3] == "running"
    as_csv = cluster.run("tasks", "--request-id", request_id, "--wait", "2", "-f", "csv",
                         "-c", "node", "-c", "state")  # fmt: skip
    assert as_csv.stdout == "node,state\nn1,running\n"
    freed = cluster.run("free", "--request-id", request_id)
    assert freed.returncode == 0, freed.stderr
    cluster.audit(allocations=0)


def test_a_nodes_configuration_is_shown_whole(cluster: Cluster) -> None:
    cluster.start_node("n1", "--trait", "CUSTOM_LONG_TRAIT_NAME_THAT_WOULD_NOT_FIT", "--inventory",
                       "CUSTOM_GPU=2", "--reserved", "MEMORY_MB=512")  # fmt: skip
    shown = cluster.run("nodes", "--configuration", "--expect-nodes", "1")
    assert shown.returncode == 0, shown.stderr
    assert "…" not in shown.stdout
    text = " ".join(shown.stdout.split())  # the table wraps long lines
    assert "traits: CUSTOM_LONG_TRAIT_NAME_THAT_WOULD_NOT_FIT" in text
    assert "MEMORY_MB (allocation_ratio 1.0, reserved 512, total 8192)" in text
    assert "metrics_port: -" in text
    as_csv = cluster.run("nodes", "--configuration", "--expect-nodes", "1", "-f", "csv")
    name, configuration = next(csv.reader(io.StringIO(as_csv.stdout.splitlines()[1])))
    assert name == "n1"
    assert json.loads(configuration)["inventory"]["CUSTOM_GPU"]["total"] == 2
    cluster.audit(allocations=0)


# -- 4. a node with another node's key is told, and slows nobody ------------------------


def test_a_node_started_with_another_nodes_key_is_told_and_requests_do_not_wait_for_it(
    cluster: Cluster, tmp_path: Path
) -> None:
    pytest.importorskip("cryptography")
    keyring = tmp_path / "keyring"
    made = cluster.run("keys", "generate", "--id", "requestors-1", "--ed25519")
    assert made.returncode == 0, made.stderr
    requestor_private, requestor_public = (line.split()[1] for line in made.stdout.splitlines())
    for name in ("n1", "n2"):
        key_file = str(tmp_path / f"{name}.key")
        added = cluster.run("keys", "add-node", name, "--keyring", str(keyring),
                            "--key-file", key_file, "--id", f"{name}-a")  # fmt: skip
        assert added.returncode == 0, added.stderr
    on_nodes = {**cluster.env, "RESERVOIR_REQUESTOR_KEYS": requestor_public}
    on_requestors = {**cluster.env, "RESERVOIR_REQUESTOR_KEYS": requestor_private,
                     "RESERVOIR_NODE_KEYRING": str(keyring)}  # fmt: skip

    # given the keyring too, a node refuses to start with another node's key
    refused = cluster.run("node", "--name", "n2", "--vcpus", "4", "--node-key",
                          str(tmp_path / "n1.key"),
                          env={**on_nodes, "RESERVOIR_NODE_KEYRING": str(keyring)})  # fmt: skip
    assert refused.returncode == 2
    assert one_line(refused) == (
        f"reservoir node: node n2: its key 'n1-a' is node n1's in the node keyring "
        f"({keyring / 'n1.pub'}), not n2's: requestors would refuse every message of n2 as "
        "impersonation (give it a key of its own: reservoir keys add-node n2)"
    )

    # without it, it starts; the first requestor that refuses its offer tells it
    cluster.start_node("n1", "--node-key", str(tmp_path / "n1.key"), env=on_nodes)
    miskeyed = cluster.start_node("n2", "--node-key", str(tmp_path / "n1.key"), env=on_nodes)
    placements = []
    for _ in range(3):
        done = cluster.run("request", "--json", "--timeout", "20", "--vcpus", "1",
                           "--memory-mb", "512", env=on_requestors)  # fmt: skip
        assert done.returncode == 0, done.stderr
        placements.append(json.loads(done.stdout))
        # each requestor says what it dropped, and from whom, once
        (warning,) = [line for line in done.stderr.splitlines() if "impersonation" in line]
        assert (
            "dropped a message from 'n2': impersonation (signed with the key 'n1-a' of node "
            "'n1', claims to be 'n2')" in warning
        )
    assert [a["node"] for p in placements for a in p["allocations"]] == ["n1", "n1", "n1"]
    # n2 is in the emptiest tier each time, and its offers are refused: no request waits
    # the widening wait (2 s) for them, at any tier (each waited one more, before)
    widening_wait_s = 2.0
    assert [p["elapsed_s"] < widening_wait_s for p in placements] == [True] * 3, placements
    told = miskeyed.wait_for("refuses this node's messages")
    assert (
        "node n2: requestor reservoir.requestor." in told
        and "refuses this node's messages: impersonation (signed with the key 'n1-a' of node "
        "'n1', claims to be 'n2'); this node signs with key 'n1-a'"
        in told
    ), told
    audited = cluster.run("audit", "--json", "--expect-nodes", "1", env=on_requestors)
    assert audited.returncode == 0, audited.stdout + audited.stderr
    assert json.loads(audited.stdout)["allocations"] == 3


# -- 8. -vv is reservoir's debug; the client library's is asked for apart ----------------


def client_library_lines(stderr: str) -> list[str]:
    """Lines logged by the AMQP client libraries' own loggers (pika, kombu, amqp)."""
    return [
        line
        for line in stderr.splitlines()
        if re.search(r" (DEBUG|INFO|WARNING|ERROR) (pika|kombu|amqp)[.:]", line)
    ]


def test_dash_vv_is_reservoirs_debug_without_a_line_of_the_client_librarys(
    cluster: Cluster,
) -> None:
    cluster.start_node("n1")
    ask = ("request", "--timeout", "20", "--vcpus", "1", "--memory-mb", "512")
    debug = cluster.run("-vv", *ask)
    assert debug.returncode == 0, debug.stderr
    assert client_library_lines(debug.stderr) == []
    placed = [line for line in debug.stderr.splitlines() if " DEBUG reservoir.requestor: " in line]
    assert any("placed " in line for line in placed), debug.stderr
    asked = cluster.run("-vvv", *ask)
    assert asked.returncode == 0, asked.stderr
    assert len(client_library_lines(asked.stderr)) > 10
    cluster.audit(allocations=2)


# -- the sweep: the same two smells in the other commands --------------------------------


def test_free_on_a_node_that_is_not_there_says_so_rather_than_did_not_confirm(
    cluster: Cluster,
) -> None:
    cluster.start_node("n1")
    done = cluster.run("free", "--request-id", "r1", "--node", "n9")
    assert done.returncode == 1
    assert one_line(done) == (
        "reservoir free: no node named n9 answers on this broker (is it running, and is the "
        "name right?); nothing was freed"
    )


def test_free_of_one_allocation_without_a_node_frees_it_where_it_is_and_only_it(
    cluster: Cluster,
) -> None:
    cluster.start_node("n1")
    cluster.start_node("n2")
    pair = cluster.place("--vcpus", "1", "--memory-mb", "512", "--count", "2",
                         "--group", "g", "--policy", "anti-affinity")  # fmt: skip
    first, _ = pair["allocations"]
    done = cluster.run("free", "--request-id", pair["request_id"],
                       "--allocation", first["allocation_id"])  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"freed 1 allocation(s) of {pair['request_id']} on {first['node']}\n"
    cluster.audit(allocations=1)
    gone = cluster.run("free", "--request-id", pair["request_id"],
                       "--allocation", first["allocation_id"])  # fmt: skip
    assert gone.returncode == 1
    assert one_line(gone) == (
        f"reservoir free: no node answering holds allocation {first['allocation_id']} of "
        f"{pair['request_id']}"
    )
    assert cluster.run("free", "--request-id", pair["request_id"]).returncode == 0
    cluster.audit(allocations=0)


def test_nodes_fewer_than_expected_is_a_failure_after_the_listing(cluster: Cluster) -> None:
    cluster.start_node("n1")
    done = cluster.run("nodes", "--expect-nodes", "2", "--wait", "1", "-f", "value",
                       "-c", "name", "-c", "class")  # fmt: skip
    assert done.returncode == 2
    assert done.stdout.splitlines() == ["n1 MEMORY_MB", "n1 VCPU"]
    assert one_line(done) == "reservoir nodes: expected 2 node(s), 1 answered within 1 s"


def test_tasks_with_none_to_tell_of_says_what_it_knows(cluster: Cluster) -> None:
    cluster.start_node("n1", "--driver", "exec")
    done = cluster.run("tasks", "--wait", "0.5")
    assert done.returncode == 0, done.stderr
    assert done.stdout == "no tasks: no node answered with one within 0.5 s\n"
