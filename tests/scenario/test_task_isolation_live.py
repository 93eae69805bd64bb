"""Exec tasks run unprivileged, inside the limits they asked for, and only as the node's
policy allows, with real processes over the in-process broker: the user a task runs as,
root refused unless allowed, out of memory reported with its limit (on a fake cgroup v2
tree, and for real where this host's layout has a memory controller), a task kept in its
own group whose leftovers are killed at its end, and a task the policy refuses declined
with the reason. Every test ends with the audit."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from reservoir import NodeAgent, PlacementError, Requestor, audit
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.protocol.task_policy import TaskPolicy
from reservoir.runtime.cgroups import CgroupHost
from reservoir.runtime.exec_driver import ExecDriver
from reservoir.runtime.settings import Settings
from reservoir.runtime.tasks import TaskConfig, TaskConfigError

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="switching users takes a root agent")


def a_node(broker: InProcessBroker, driver: ExecDriver) -> NodeAgent:
    return NodeAgent(broker, name="worker", vcpus=4, memory_mb=2048, task_drivers=[driver])


def audited(node: NodeAgent) -> None:
    audit([node.snapshot()]).raise_if_failed()


def stdout_of(requestor: Requestor, request_id: str) -> str:
    return b"".join(p.data for p in requestor.output(request_id)).decode()


@as_root
def test_a_root_agents_tasks_run_as_nobody_with_no_new_privileges(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    node = a_node(broker, ExecDriver(state_dir=tmp_path))
    with Requestor(broker) as requestor:
        run = requestor.run(
            ["sh", "-c", "id -u; id -g; grep NoNewPrivs /proc/self/status; pwd; echo $HOME"],
            vcpus=1,
        )
        run.wait(timeout_s=10)
        assert run.exit_code == 0
        uid, gid, privileges, cwd, home = stdout_of(requestor, run.request_id).splitlines()
    assert (uid, gid) == ("65534", "65534")
    assert privileges.split() == ["NoNewPrivs:", "1"]
    assert (cwd, home) == ("/", "/nonexistent")
    audited(node)
    node.close()


@as_root
def test_root_is_refused_unless_the_configuration_allows_it(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    with pytest.raises(TaskConfigError, match=r"tasks\.allow_root"):
        NodeAgent(broker, name="n", vcpus=1, task_config=TaskConfig(user="root"),
                  settings=Settings(state_dir=tmp_path, task_drivers=("exec",)))  # fmt: skip
    allowed = TaskConfig(user="root", allow_root=True)
    node = a_node(broker, ExecDriver(state_dir=tmp_path, config=allowed))
    with Requestor(broker) as requestor:
        run = requestor.run(["id", "-u"], vcpus=1)
        run.wait(timeout_s=10)
        assert stdout_of(requestor, run.request_id) == "0\n"
    audited(node)
    node.close()


def a_fake_v2_tree(root: Path) -> Path:
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu memory pids\n")
    (root / "cgroup.subtree_control").write_text("")
    return root


@as_root
def test_out_of_memory_on_a_unified_tree_ends_the_task_with_its_limit(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    """The kernel's side faked: the task counts itself an OOM kill in its group's
    memory.events (as the kernel would) and ends as a SIGKILL does."""
    tree = a_fake_v2_tree(tmp_path / "cgroup")
    driver = ExecDriver(state_dir=tmp_path / "exec", cgroups=CgroupHost(unified=tree),
                        config=TaskConfig(user="root", allow_root=True))  # fmt: skip
    node = a_node(broker, driver)
    with Requestor(broker) as requestor:
        # one task's group in the tree: its own
        script = f'for g in {tree}/reservoir/*/; do echo "oom_kill 1" > "$g/memory.events"; done'
        run = requestor.run(["sh", "-c", script + "; kill -KILL $$"], vcpus=2, memory_mb=64)
        (allocation,) = run.placement.result(timeout=10).allocations
        (state,) = run.wait(timeout_s=10).values()
    group = tree / "reservoir" / allocation.allocation_id.replace("/", "_")
    assert (state.state, state.exit_code) == ("exited", 137)
    assert state.reason == "out of memory (limit 64 MiB)"
    assert state.limits == "cpu=cgroup2,memory=cgroup2"
    assert (group / "memory.max").read_text() == str(64 * 1024 * 1024)
    assert (group / "cpu.max").read_text() == "200000 100000"
    assert (group / "cgroup.procs").read_text() == "0"  # it joined the group before it ran
    audited(node)
    node.close()


def host_memory_controller() -> str | None:
    """Which cgroup version limits memory on this host, for a root agent (None: none)."""
    if os.geteuid() != 0:
        return None
    host = CgroupHost.discover()
    if host.unified is not None:
        controllers = (host.unified / "cgroup.controllers").read_text().split()
        if "memory" in controllers:
            return "cgroup2"
    if "memory" in host.v1:
        return "cgroup1"
    return None


@pytest.mark.skipif(host_memory_controller() is None, reason="no memory cgroup on this host")
def test_a_task_exceeding_its_memory_on_this_host_is_killed_and_says_so(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    node = a_node(broker, ExecDriver(state_dir=tmp_path))
    with Requestor(broker) as requestor:
        run = requestor.run(["python3", "-c", "x = bytearray(256 * 1024 * 1024)"], vcpus=1,
                            memory_mb=64)  # fmt: skip
        (state,) = run.wait(timeout_s=30).values()
    assert (state.state, state.exit_code) == ("exited", 137)
    assert state.reason == "out of memory (limit 64 MiB)"
    assert f"memory={host_memory_controller()}" in state.limits
    audited(node)
    node.close()


def unified_writable() -> bool:
    host = CgroupHost.discover()
    return os.geteuid() == 0 and host.unified is not None and os.access(host.unified, os.W_OK)


@pytest.mark.skipif(not unified_writable(), reason="no cgroup v2 hierarchy a root agent writes")
def test_a_task_runs_in_a_real_v2_group_of_its_own_and_what_it_leaves_is_killed(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    token = f"left-behind-{os.getpid()}-{time.monotonic_ns()}"
    node = a_node(broker, ExecDriver(state_dir=tmp_path))
    with Requestor(broker) as requestor:
        # a process that leaves the task's process group (setsid) stays in its cgroup
        run = requestor.run(["sh", "-c", f"setsid sh -c 'sleep 60; : {token}' & "
                                         "grep '^0::' /proc/self/cgroup"], vcpus=1)  # fmt: skip
        run.wait(timeout_s=10)
        (allocation,) = run.placement.result().allocations
        group = stdout_of(requestor, run.request_id).strip()
    assert group == f"0::/reservoir/{allocation.allocation_id.replace('/', '_')}"
    deadline = time.monotonic() + 5
    while any(token in p.read_text(errors="replace") for p in _cmdlines()):
        assert time.monotonic() < deadline, "the task's leftover outlived it"
        time.sleep(0.05)
    audited(node)
    node.close()


def _cmdlines() -> list[Path]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (entry / "cmdline").exists():
            found.append(entry / "cmdline")
    return found


def test_a_task_the_nodes_policy_refuses_is_not_placed_and_the_reason_says_what(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    config = TaskConfig(policy=TaskPolicy(commands=("sh",), env=("LANG",)))
    node = NodeAgent(broker, name="worker", vcpus=4, memory_mb=2048, task_config=config,
                     settings=Settings(state_dir=tmp_path, task_drivers=("exec",)))  # fmt: skip
    with Requestor(broker) as requestor:
        refused = requestor.run(["python3", "-c", "pass"], vcpus=1, timeout_s=5, explain=False)
        with pytest.raises(PlacementError) as error:
            refused.placement.result(timeout=10)
        assert "the command 'python3' is not allowed on 1 node(s)" in str(error.value)
        env = requestor.run(["sh", "-c", "true"], env={"LD_PRELOAD": "x"}, vcpus=1, timeout_s=5)
        with pytest.raises(PlacementError, match="LD_PRELOAD may not be set"):
            env.placement.result(timeout=10)
        allowed = requestor.run(["sh", "-c", "exit 0"], env={"LANG": "C"}, vcpus=1)
        allowed.wait(timeout_s=10)
        assert allowed.exit_code == 0
    audited(node)
    node.close()


@pytest.mark.skipif(host_memory_controller() is None, reason="no memory cgroup on this host")
def test_a_task_that_ends_while_its_agent_is_away_leaves_no_control_group(
    broker: InProcessBroker, tmp_path: Path
) -> None:
    def a_durable_node() -> NodeAgent:
        return NodeAgent(broker, name="worker", vcpus=4, memory_mb=2048,
                         task_drivers=[ExecDriver(state_dir=tmp_path / "exec")],
                         settings=Settings(state_dir=tmp_path))  # fmt: skip

    node = a_durable_node()
    with Requestor(broker) as requestor:
        run = requestor.run(["sleep", "0.5"], vcpus=1, memory_mb=64)
        run.wait_started(timeout_s=10)
        (handle,) = node.tasks()
        groups = [Path(group) for group in json.loads(handle.data["cgroups"])]
        assert groups and all(group.is_dir() for group in groups)
        node.close()  # nobody to forget the task when it ends: its supervisor cleans up
        deadline = time.monotonic() + 10
        while any(group.exists() for group in groups):
            assert time.monotonic() < deadline, f"left behind: {groups}"
            time.sleep(0.05)
        node = a_durable_node()  # and tells of its end
        (state,) = run.wait(timeout_s=10).values()
        assert (state.state, state.exit_code) == ("exited", 0)
    audited(node)
    node.close()
