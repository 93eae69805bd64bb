"""Tasks in real time over the in-process broker: real processes started by the exec
driver, node agents with SQLite state closed and opened again (tasks outlive their
agent), and a driver object handed to an embedded agent. Every test ends with the audit."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from reservoir import NodeAgent, Requestor, audit
from reservoir.broker import Delivery
from reservoir.brokers.inprocess import Faults, InProcessBroker
from reservoir.protocol.ledger import Allocation
from reservoir.protocol.messages import TaskSpec, TaskState, decode_message
from reservoir.runtime.cgroups import CgroupHost
from reservoir.runtime.exec_driver import ExecDriver
from reservoir.runtime.settings import Settings
from reservoir.runtime.store import SqliteStore
from reservoir.runtime.task_run import TaskRunTimeout
from reservoir.runtime.tasks import TaskHandle, TaskStatus


def a_node(broker: InProcessBroker, state_dir: Path, vcpus: int = 2) -> NodeAgent:
    settings = Settings(state_dir=state_dir, task_drivers=("exec",))
    return NodeAgent(broker, name="worker", vcpus=vcpus, memory_mb=2048, settings=settings)


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def audited(*nodes: NodeAgent) -> None:
    audit([n.snapshot() for n in nodes]).raise_if_failed()


def eventually(check: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "never happened"
        time.sleep(0.02)


def test_a_task_exiting_3_is_told_with_its_code_and_its_room_goes_to_the_next_request(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    node = a_node(broker, tmp_path)
    with Requestor(broker) as requestor:
        run = requestor.run(["sh", "-c", "exit 3"], vcpus=2, memory_mb=256)
        final = run.wait(timeout_s=10)
        assert [s.state for s in run.history] == ["started", "exited"]
        assert run.exit_code == 3
        (state,) = final.values()
        # by a control group where the host has one, else as RLIMIT_AS
        assert "memory=" in state.limits
        assert node.allocations() == []
        # all of the node's VCPUs again: only placed if the task's room was freed
        after = requestor.reserve(vcpus=2, timeout_s=5)
        assert after.nodes == ("worker",)
        requestor.release(after)
    audited(node)
    node.close()


def news_of_tasks(delivery: Delivery) -> bool:
    """A node telling its placing requestor of a task's change (not answering a query)."""
    message = decode_message(delivery.body)
    return isinstance(message, TaskState) and not message.answering


def test_a_task_whose_news_is_lost_is_heard_when_the_waiting_caller_asks_its_node(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    node = a_node(broker, tmp_path)
    # every change the node tells of is lost, as while the requestor was reconnecting
    broker.faults = Faults(loss=1.0, applies_to=news_of_tasks)
    with Requestor(broker, settings=Settings(task_check_s=0.2)) as requestor:
        run = requestor.run(["sh", "-c", "exit 4"], vcpus=1, memory_mb=256)
        final = run.wait(timeout_s=10)
        # all that was heard, the end included, were the node's answers to the caller's asks
        assert run.history[-1].state == "exited"
        assert all(s.answering for s in run.history)
        assert run.exit_code == 4
        (state,) = final.values()
        assert state.exit_code == 4
        eventually(lambda: node.allocations() == [])
    audited(node)
    node.close()


def test_a_waiting_caller_asks_again_while_the_node_is_out_of_reach(
    broker: InProcessBroker, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    node = a_node(broker, tmp_path)
    with Requestor(broker, settings=Settings(task_check_s=0.2)) as requestor:
        run = requestor.run(["sleep", "0.5"], vcpus=1, memory_mb=256)
        run.wait_started(timeout_s=10)
        broker.faults = Faults(loss=1.0)  # nothing gets through: neither news nor answers
        with pytest.raises(TaskRunTimeout):  # the task ends meanwhile; the asks are lost
            run.wait(timeout_s=1.0)
        assert not run.finished
        # the caller is told once that its asks go unanswered
        silences = [r for r in caplog.records if "still asking" in r.getMessage()]
        assert len(silences) == 1, caplog.text
        broker.faults = None
        final = run.wait(timeout_s=10)  # heard at the next ask
        assert [s.state for s in final.values()] == ["exited"]
        assert run.exit_code == 0
        eventually(lambda: node.allocations() == [])
    audited(node)
    node.close()


def test_a_released_task_is_stopped_and_its_process_is_gone(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    node = a_node(broker, tmp_path)
    with Requestor(broker) as requestor:
        run = requestor.run(["sleep", "60"], vcpus=1, stop_grace_s=2)
        run.wait_started(timeout_s=10)
        (handle,) = node.tasks()
        pid = int(handle.ref.split(":")[0])
        assert alive(pid)
        requestor.release(run.placement.result())
        (state,) = run.wait(timeout_s=10).values()
        assert (state.state, state.exit_code) == ("stopped", 143)
        assert state.reason.startswith("released")
        assert not alive(pid)
        assert node.allocations() == [] and node.tasks() == []
    audited(node)
    node.close()


def test_a_task_that_cannot_start_fails_with_the_reason_and_frees_its_room(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    node = a_node(broker, tmp_path)
    with Requestor(broker) as requestor:
        run = requestor.run(["no-such-program-here"], vcpus=1)
        (state,) = run.wait(timeout_s=10).values()
        assert (state.state, state.reason) == ("failed", "command not found: no-such-program-here")
        assert run.exit_code is None
        assert node.allocations() == []
    audited(node)
    node.close()


def test_a_restarted_agent_reattaches_reports_what_ended_meanwhile_and_stops_orphans(
    broker: InProcessBroker, tmp_path: Path, task_files: Path
) -> None:
    node = a_node(broker, tmp_path, vcpus=3)
    marker = task_files / "go-on"
    with Requestor(broker) as requestor:
        ending = requestor.run(["sh", "-c", "sleep 0.3; exit 7"], vcpus=1)
        # bounded: a test that fails leaves no task waiting for ever
        wait = f"i=0; while [ ! -e {marker} ] && [ $i -lt 600 ]; do i=$((i+1)); sleep 0.05; done"
        waiting = requestor.run(["sh", "-c", f"{wait}"],
                                vcpus=1)  # fmt: skip
        orphan = requestor.run(["sleep", "60"], vcpus=1)
        for run in (ending, waiting, orphan):
            run.wait_started(timeout_s=10)
        pids = {h.allocation_id: int(h.ref.split(":")[0]) for h in node.tasks()}
        node.close()  # the tasks go on without their agent
        assert all(alive(pid) for pid in pids.values())
        # while it is away, the orphan's allocation goes (as an operator's free would)
        (orphan_allocation,) = [a.allocation_id for a in orphan.placement.result().allocations]
        store = SqliteStore.for_node(tmp_path, "worker")
        store.delete(orphan_allocation)
        store.close()
        time.sleep(0.5)  # the first task ends while nobody watches

        node = a_node(broker, tmp_path, vcpus=3)
        (ended,) = ending.wait(timeout_s=10).values()
        assert (ended.state, ended.exit_code) == ("exited", 7)
        eventually(lambda: not alive(pids[orphan_allocation]))
        assert [h.allocation_id for h in node.tasks()] == [
            a.allocation_id for a in waiting.placement.result().allocations
        ]
        marker.touch()
        (done,) = waiting.wait(timeout_s=10).values()
        assert (done.state, done.exit_code) == ("exited", 0)
        assert node.allocations() == []
    audited(node)
    node.close()


class RecordingDriver:
    """A user's own compute agent: told of each award and release with the allocation."""

    name = "mine"

    def __init__(self) -> None:
        self.started: list[tuple[Allocation, TaskSpec]] = []
        self.stopped: list[str] = []

    def start(self, allocation: Allocation, task: TaskSpec) -> TaskHandle:
        self.started.append((allocation, task))
        return TaskHandle(driver=self.name, allocation_id=allocation.allocation_id,
                          request_id=allocation.request_id, ref="vm-1", limits="mine")  # fmt: skip

    def status(self, handle: TaskHandle) -> TaskStatus:
        return TaskStatus(running=handle.allocation_id not in self.stopped, exit_code=0)

    def stop(self, handle: TaskHandle, grace_s: float) -> None:
        self.stopped.append(handle.allocation_id)

    def reattach(self, handle: TaskHandle) -> TaskStatus:
        return self.status(handle)

    def forget(self, handle: TaskHandle) -> None:
        pass


def test_an_embedded_agent_hears_of_each_award_and_release_through_its_driver(
    broker: InProcessBroker,
) -> None:
    mine = RecordingDriver()
    node = NodeAgent(broker, name="embedded", vcpus=4, task_drivers=[mine])
    with Requestor(broker) as requestor:
        run = requestor.run(driver="mine", vcpus=2, keep_allocation=True)
        run.wait_started(timeout_s=10)
        ((allocation, task),) = mine.started
        assert allocation.resources == {"VCPU": 2} and task.driver == "mine"
        requestor.release(run.placement.result())
        eventually(lambda: mine.stopped == [allocation.allocation_id])
        (state,) = run.wait(timeout_s=10).values()
        assert state.state == "stopped"
        assert node.allocations() == []
    audited(node)
    node.close()


def test_without_control_groups_memory_is_an_rlimit_in_the_task_process(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    driver = ExecDriver(state_dir=tmp_path / "exec", cgroups=CgroupHost())
    node = NodeAgent(broker, name="worker", vcpus=2, memory_mb=2048, task_drivers=[driver],
                     settings=Settings(state_dir=tmp_path))  # fmt: skip
    with Requestor(broker) as requestor:
        run = requestor.run(["sh", "-c", "ulimit -v"], vcpus=1, memory_mb=300)
        (state,) = run.wait(timeout_s=10).values()
        assert run.exit_code == 0 and state.limits == "memory=rlimit"
        said = b"".join(piece.data for piece in requestor.output(run.request_id))
    assert said.strip() == str(300 * 1024).encode()  # KiB, as ulimit -v says it
    audited(node)
    node.close()


def test_a_task_released_after_its_agent_restarted_says_how_it_ended(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    node = a_node(broker, tmp_path)
    with Requestor(broker) as requestor:
        run = requestor.run(["sleep", "60"], vcpus=1, stop_grace_s=1)
        run.wait_started(timeout_s=10)
        node.close()
        node = a_node(broker, tmp_path)  # re-attached: not its process's parent any more
        requestor.release(run.placement.result())
        (state,) = run.wait(timeout_s=15).values()
        assert (state.state, state.exit_code, state.reason) == (
            "stopped", 143, "released (killed by SIGTERM)")  # fmt: skip
        assert node.allocations() == []
    audited(node)
    node.close()


def test_a_task_whose_agent_died_while_starting_it_is_found_and_stopped_when_not_held(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    """As an agent killed after its driver started a task and before it stored the
    handle: the store holds only the handle written before the start (no ref yet), and
    the allocation was freed meanwhile. The restarted agent finds the task by its
    allocation and stops it."""
    task = TaskSpec(driver="exec", command=("sleep", "60"))
    allocation = Allocation(allocation_id="worker.x.1/0", request_id="r1",
                            reservation_id="worker.x.1", owner="req", resources={"VCPU": 1},
                            task=task)  # fmt: skip
    store = SqliteStore.for_node(tmp_path, "worker")
    store.put_task(TaskHandle(driver="exec", allocation_id=allocation.allocation_id,
                              request_id="r1", ref=""))  # fmt: skip
    store.close()
    started = ExecDriver(state_dir=tmp_path / "tasks" / "worker" / "exec").start(allocation, task)
    command = int(started.data["child"])
    assert alive(command)
    node = a_node(broker, tmp_path)
    eventually(lambda: not alive(command))
    assert node.store.load_tasks() == [] and node.tasks() == []
    audited(node)
    node.close()
