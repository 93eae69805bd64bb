"""Control groups for exec tasks on fake trees: the three host layouts read from
``/proc/self/mountinfo``, and the groups and limits a task gets on a unified (v2) tree and
on a hybrid one (v1 memory and cpu beside an empty v2 hierarchy)."""

from __future__ import annotations

from pathlib import Path

from reservoir.runtime.cgroups import CPU_PERIOD_US, CgroupHost, make_task_groups

UNIFIED = """\
25 30 0:22 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
"""
HYBRID = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 31 0:33 / /sys/fs/cgroup/devices rw,relatime - cgroup cgroup rw,devices
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
LEGACY = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 /docker/abc /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
"""
OWN = """\
4:memory:/docker/abc/agent
2:cpu,cpuacct:/agent
0::/
"""


def test_a_unified_host_has_its_v2_root_and_no_v1_hierarchy() -> None:
    host = CgroupHost.discover(UNIFIED, "0::/system.slice/reservoir-node.service\n")
    assert host == CgroupHost(unified=Path("/sys/fs/cgroup"), v1={})


def test_a_hybrid_host_has_the_v2_hierarchy_and_the_agents_own_v1_groups() -> None:
    host = CgroupHost.discover(HYBRID, OWN)
    assert host.unified == Path("/sys/fs/cgroup/unified")
    # the agent's own group in each hierarchy, under which its tasks' groups are made
    assert host.v1 == {
        "memory": Path("/sys/fs/cgroup/memory/docker/abc/agent"),
        "cpu": Path("/sys/fs/cgroup/cpu/agent"),
    }


def test_a_legacy_host_mounted_at_a_subtree_places_the_agents_groups_inside_it() -> None:
    host = CgroupHost.discover(LEGACY, OWN)
    assert host.unified is None
    # the memory hierarchy is mounted at /docker/abc: the agent's group is below it
    assert host.v1 == {
        "memory": Path("/sys/fs/cgroup/memory/agent"),
        "cpu": Path("/sys/fs/cgroup/cpu,cpuacct/agent"),
    }


def a_v2_tree(root: Path, controllers: str) -> Path:
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("")
    return root


def test_a_task_on_a_unified_tree_gets_memory_cpu_and_cpuset_limits_in_its_own_group(
    tmp_path: Path,
) -> None:
    root = a_v2_tree(tmp_path / "cgroup", "cpuset cpu io memory pids")
    groups = make_task_groups(
        CgroupHost(unified=root), "node-a.x.1_0", vcpus=2, cpus=(4, 5), memory_mb=256
    )
    group = root / "reservoir" / "node-a.x.1_0"
    assert (group / "memory.max").read_text() == str(256 * 1024 * 1024)
    assert (group / "cpu.max").read_text() == f"{2 * CPU_PERIOD_US} {CPU_PERIOD_US}"
    assert (group / "cpuset.cpus").read_text() == "4,5"
    assert dict(groups.limited) == {"memory": "cgroup2", "cpu": "cgroup2", "cpuset": "cgroup2"}
    # the task joins the group, and the kernel's OOM kills are read from it
    assert groups.join == (group / "cgroup.procs",)
    assert groups.oom == ((group / "memory.events", "oom_kill"),)
    assert set((root / "cgroup.subtree_control").read_text().split()) == {
        "+cpu", "+memory", "+cpuset"}  # fmt: skip


def test_a_controller_the_tree_lacks_is_left_to_the_fallback(tmp_path: Path) -> None:
    root = a_v2_tree(tmp_path / "cgroup", "cpu pids")
    groups = make_task_groups(CgroupHost(unified=root), "t", vcpus=1, memory_mb=64)
    assert dict(groups.limited) == {"cpu": "cgroup2"}  # memory: RLIMIT_AS in the driver
    assert groups.oom == ()
    assert not (root / "reservoir" / "t" / "memory.max").exists()


def test_a_hybrid_tree_limits_memory_and_cpu_in_v1_and_keeps_the_task_in_a_v2_group(
    tmp_path: Path,
) -> None:
    unified = a_v2_tree(tmp_path / "unified", "hugetlb")
    memory, cpu = tmp_path / "memory" / "agent", tmp_path / "cpu" / "agent"
    memory.mkdir(parents=True)
    cpu.mkdir(parents=True)
    host = CgroupHost(unified=unified, v1={"memory": memory, "cpu": cpu})
    groups = make_task_groups(host, "t", vcpus=3, memory_mb=64)
    in_memory, in_cpu = memory / "reservoir" / "t", cpu / "reservoir" / "t"
    assert (in_memory / "memory.limit_in_bytes").read_text() == str(64 * 1024 * 1024)
    assert (in_cpu / "cpu.cfs_quota_us").read_text() == str(3 * CPU_PERIOD_US)
    assert (in_cpu / "cpu.cfs_period_us").read_text() == str(CPU_PERIOD_US)
    assert dict(groups.limited) == {"memory": "cgroup1", "cpu": "cgroup1"}
    assert groups.join == (
        unified / "reservoir" / "t" / "cgroup.procs",
        in_cpu / "cgroup.procs",
        in_memory / "cgroup.procs",
    )
    assert groups.oom == ((in_memory / "memory.oom_control", "oom_kill"),)
    for directory in groups.directories:  # the kernel's files go with a group; these not
        for file in directory.iterdir():
            file.unlink()
    groups.remove()
    assert not in_memory.exists() and not in_cpu.exists()
    assert not (unified / "reservoir" / "t").exists()


def test_no_control_groups_make_no_group(tmp_path: Path) -> None:
    groups = make_task_groups(CgroupHost(), "t", vcpus=1, memory_mb=64)
    assert (groups.join, dict(groups.limited)) == ((), {})
