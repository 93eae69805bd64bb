"""Structured logs (reservoir.observe.logs): JSON lines, and the request id on every line logged
while a conversation is handled, by the requestor and by the nodes."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from reservoir.observe.logs import REQUEST_ID, ConversationFilter, JsonFormatter
from reservoir.testing import Simulation


@pytest.fixture
def json_lines() -> Iterator[io.StringIO]:
    """Every reservoir record at DEBUG, as reservoir --log-format json -vv writes it."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(ConversationFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("reservoir")
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield stream
    logger.removeHandler(handler)
    logger.setLevel(previous)


def parsed(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_every_line_of_a_conversation_names_its_request_id(
    json_lines: io.StringIO, reservoir_simulation: Simulation
) -> None:
    sim = reservoir_simulation
    sim.add_node("n1", vcpus=2, memory_mb=1024)
    sim.add_node("n2", vcpus=2, memory_mb=1024)
    requestor = sim.add_requestor("r1")
    json_lines.truncate(0)
    json_lines.seek(0)
    placement = sim.place(requestor, vcpus=2, memory_mb=1, request_id="order-42")
    sim.settle()  # the spare's release, and what the nodes say of it
    # the transport's own lines (reservoir.brokers) say where bytes went, logged by
    # whichever thread flushes the outbox, not on behalf of one conversation
    lines = [
        line for line in parsed(json_lines) if not line["logger"].startswith("reservoir.brokers")
    ]
    # the requestor says it placed it; the node that took it says it moved tier
    messages = [str(line["message"]) for line in lines]
    assert any(m.startswith("placed order-42") for m in messages), messages
    assert any("now at 100% utilisation" in m for m in messages), messages
    assert lines and all(line["request_id"] == "order-42" for line in lines), lines
    assert {line["level"] for line in lines} <= {"debug", "info"}
    assert REQUEST_ID.get() is None  # nothing leaks out of the conversation
    sim.finish([placement])


def test_a_line_outside_any_conversation_has_no_request_id(json_lines: io.StringIO) -> None:
    logging.getLogger("reservoir.test").warning("hello %s", "there", extra={"shard": 3})
    [line] = parsed(json_lines)
    assert line["message"] == "hello there"
    assert line["level"] == "warning"
    assert line["logger"] == "reservoir.test"
    assert line["shard"] == 3
    assert "request_id" not in line
    assert str(line["time"]).endswith("+00:00")


def test_a_node_started_with_log_format_json_writes_only_json_lines() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    node = subprocess.Popen(
        [sys.executable, "-m", "reservoir", "--log-format", "json", "-v", "node",
         "--broker", "memory://", "--name", "j1", "--vcpus", "2"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert node.stderr is not None
    configuration = json.loads(node.stderr.readline())  # what it runs with, logged first
    assert configuration["message"].startswith("node j1: configuration")
    ready = json.loads(node.stderr.readline())
    assert ready["level"] == "info"
    assert "node j1: ready" in ready["message"]
    node.send_signal(signal.SIGTERM)
    rest = node.stderr.read()
    assert node.wait(timeout=30) == 130  # stopped by a signal
    lines = [json.loads(line) for line in rest.splitlines()]
    assert lines[-1]["message"] == "node j1: stopped"


def test_a_log_format_the_cli_does_not_know_is_one_line_and_status_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "reservoir", "--log-format", "xml", "nodes"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "--log-format" in done.stderr
    assert "Traceback" not in done.stderr


def test_in_json_the_facts_of_a_placement_are_fields_not_words_in_the_message(
    json_lines: io.StringIO, reservoir_simulation: Simulation
) -> None:
    sim = reservoir_simulation
    sim.add_node("n1", vcpus=2, memory_mb=1024)
    requestor = sim.add_requestor("r1")
    placement = sim.place(requestor, vcpus=1, memory_mb=1, request_id="order-7")
    sim.settle()
    lines = parsed(json_lines)
    [placed] = [line for line in lines if line.get("outcome") == "placed"]
    assert placed["request_id"] == "order-7"
    assert placed["node"] == "n1"
    assert isinstance(placed["elapsed_ms"], float)
    [tier] = [line for line in lines if "utilisation" in line]
    assert (tier["node"], tier["tier"], tier["utilisation"]) == ("n1", 50, 0.5)
    sim.finish([placement])


def test_a_nodes_ready_and_stopped_lines_carry_the_node_as_a_field() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    node = subprocess.Popen(
        [sys.executable, "-m", "reservoir", "--log-format", "json", "node",
         "--broker", "memory://", "--name", "j2", "--vcpus", "2"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert node.stderr is not None
    configuration = json.loads(node.stderr.readline())  # what it runs with, first
    ready = json.loads(node.stderr.readline())
    node.send_signal(signal.SIGTERM)
    stopped = json.loads(node.stderr.read().splitlines()[-1])
    assert configuration["node"] == "j2"
    assert node.wait(timeout=30) == 130
    assert (ready["node"], ready["outcome"], ready["tier"]) == ("j2", "ready", 10)
    assert (stopped["node"], stopped["outcome"]) == ("j2", "stopped")


def test_in_text_every_line_a_node_writes_has_the_one_log_format() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    node = subprocess.Popen(
        [sys.executable, "-m", "reservoir", "-v", "node", "--broker", "memory://",
         "--name", "t1", "--vcpus", "2"],
        stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    assert node.stderr is not None
    first = node.stderr.readline()
    node.send_signal(signal.SIGTERM)
    lines = [first, *node.stderr.read().splitlines()]
    assert node.wait(timeout=30) == 130
    one_format = re.compile(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) \S+: "
    )
    assert len(lines) >= 2 and all(one_format.match(line) for line in lines), lines
