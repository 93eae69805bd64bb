"""A task's output and its end, in real time over the in-process broker, with real exec
tasks: both streams read in order, a follower that sees output as it is written and ends
when the task does, a bounded amount kept on the node (what a late reader missed is
said), ended tasks and their output kept across a restart of the agent and forgotten
once their retention passed, and a requestor that attaches to a task placed by another.
Every test ends with the audit."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from reservoir import NodeAgent, Requestor, audit
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.runtime import node_agent
from reservoir.runtime.requestor import NoSuchTask
from reservoir.runtime.settings import Settings
from reservoir.runtime.tasks import TaskConfig


def a_node(broker: InProcessBroker, state_dir: Path, config: TaskConfig | None = None) -> NodeAgent:
    settings = Settings(state_dir=state_dir, task_drivers=("exec",))
    return NodeAgent(broker, name="worker", vcpus=4, memory_mb=2048, settings=settings,
                     task_config=config)  # fmt: skip


def audited(node: NodeAgent) -> None:
    audit([node.snapshot()]).raise_if_failed()


def read(requestor: Requestor, request_id: str, stream: str = "stdout", **options: object) -> bytes:
    return b"".join(p.data for p in requestor.output(request_id, stream=stream, **options))  # type: ignore[arg-type]


def test_both_streams_of_a_task_are_read_each_in_the_order_it_was_written(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    node = a_node(broker, tmp_path)
    with Requestor(broker) as requestor:
        run = requestor.run(["sh", "-c", "echo out; echo err >&2; echo more; exit 3"], vcpus=1)
        run.wait(timeout_s=10)
        assert run.exit_code == 3
        assert read(requestor, run.request_id) == b"out\nmore\n"
        assert read(requestor, run.request_id, "stderr") == b"err\n"
    audited(node)
    node.close()


def test_a_follower_sees_output_as_it_is_written_and_ends_when_the_task_does(
    broker: InProcessBroker, tmp_path: Path, task_files: Path
) -> None:
    node = a_node(broker, tmp_path)
    go_on = task_files / "go-on"
    # bounded: a test that fails leaves no task waiting for ever
    wait = f"i=0; while [ ! -e {go_on} ] && [ $i -lt 600 ]; do i=$((i+1)); sleep 0.02; done"
    script = f"echo first; {wait}; echo second; exit 4"
    with Requestor(broker) as requestor:
        run = requestor.run(["sh", "-c", script], vcpus=1)
        run.placement.result(timeout=10)
        pieces = requestor.output(run.request_id, follow=True)
        assert next(pieces).data == b"first\n"  # while the task waits: shown as written
        assert not run.finished
        go_on.touch()
        assert b"".join(p.data for p in pieces) == b"second\n"  # and it ends with the task
        (state,) = run.wait(timeout_s=10).values()
        assert (state.state, state.exit_code) == ("exited", 4)
    audited(node)
    node.close()


def test_a_task_writing_much_keeps_the_nodes_bound_and_a_late_reader_is_told_what_it_missed(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    config = TaskConfig(output_file_bytes=64 * 1024, output_files=2)
    node = a_node(broker, tmp_path, config)
    written = 5_000_000
    with Requestor(broker) as requestor:
        run = requestor.run(
            ["sh", "-c", f"head -c {written} /dev/zero | tr '\\0' x; echo; echo END"], vcpus=1
        )
        run.wait(timeout_s=30)
        assert run.exit_code == 0
        (allocation,) = run.placement.result().allocations
        kept = tmp_path / "tasks" / "worker" / "exec" / allocation.allocation_id.replace("/", "_")
        files = sorted(kept.glob("stdout.*"))
        assert len(files) == 2 and sum(f.stat().st_size for f in files) <= 2 * 64 * 1024
        pieces = list(requestor.output(run.request_id))
        total = written + len(b"\nEND\n")
        assert pieces[0].skipped == total - sum(len(p.data) for p in pieces)
        assert b"".join(p.data for p in pieces).endswith(b"xx\nEND\n")
    audited(node)
    node.close()


def test_ended_tasks_and_their_output_outlive_a_restart_of_the_agent(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    node = a_node(broker, tmp_path)
    with Requestor(broker) as requestor:
        run = requestor.run(["sh", "-c", "echo kept; exit 5"], vcpus=1)
        run.wait(timeout_s=10)
    node.close()
    node = a_node(broker, tmp_path)
    # another requestor, which knows nothing of it, finds it by id on the restarted node
    with Requestor(broker) as other:
        holdings = other.holdings_future(run.request_id).result(timeout=10)
        assert [(t.state, t.exit_code) for t in holdings.tasks] == [("exited", 5)]
        assert read(other, run.request_id) == b"kept\n"
        assert other.attach(run.request_id).exit_code == 5
    audited(node)
    node.close()


def test_a_task_whose_retention_passed_is_forgotten_with_its_output(
    broker: InProcessBroker, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(node_agent, "RETENTION_SWEEP_S", 0.05)
    node = a_node(broker, tmp_path, TaskConfig(retention_s=0.2))
    with Requestor(broker) as requestor:
        run = requestor.run(["sh", "-c", "echo gone-soon"], vcpus=1)
        run.wait(timeout_s=10)
        (allocation,) = run.placement.result().allocations
        kept = tmp_path / "tasks" / "worker" / "exec" / allocation.allocation_id.replace("/", "_")
        deadline = time.monotonic() + 10
        while kept.exists():
            assert time.monotonic() < deadline, "the output outlived its retention"
            time.sleep(0.05)
    with Requestor(broker) as other, pytest.raises(NoSuchTask):
        other.task_locations(run.request_id)  # nothing of the id is bound any more
    assert node.store.load_ended_tasks() == []
    audited(node)
    node.close()


def test_a_requestor_attached_to_anothers_task_hears_its_end(
    broker: InProcessBroker, tmp_path: Path, task_files: Path
) -> None:
    node = a_node(broker, tmp_path)
    go_on = task_files / "go-on"
    with Requestor(broker) as placing, Requestor(broker) as watching:
        # bounded: a test that fails leaves no task waiting for ever
        wait = f"i=0; while [ ! -e {go_on} ] && [ $i -lt 600 ]; do i=$((i+1)); sleep 0.02; done"
        run = placing.run(["sh", "-c", f"{wait}; exit 6"],
                          vcpus=1)  # fmt: skip
        run.wait_started(timeout_s=10)
        attached = watching.attach(run.request_id)
        assert not attached.finished
        ended = threading.Timer(0.3, go_on.touch)
        ended.start()
        started_at = time.monotonic()
        (state,) = attached.wait(timeout_s=10).values()
        # told by the node as it ended (its answer was held), not at the next check
        assert time.monotonic() - started_at < 3.0
        assert (state.state, state.exit_code, attached.exit_code) == ("exited", 6, 6)
        with pytest.raises(NoSuchTask):
            watching.attach("no-such-request-here")
    audited(node)
    node.close()


def test_a_reader_accepting_smaller_messages_asks_for_chunks_that_fit_them(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    node = a_node(broker, tmp_path)
    with Requestor(broker, settings=Settings(max_message_bytes=8192)) as requestor:
        run = requestor.run(["sh", "-c", "head -c 50000 /dev/zero | tr '\\0' y"], vcpus=1)
        run.wait(timeout_s=10)
        pieces = list(requestor.output(run.request_id))
    assert b"".join(p.data for p in pieces) == b"y" * 50000
    assert max(len(p.data) for p in pieces) <= (8192 - 4096) * 3 // 4
    audited(node)
    node.close()
