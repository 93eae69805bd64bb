"""Control groups for the exec driver's tasks: what this host's layout lets a node agent
enforce, and the groups it makes for one task.

Hosts come in three layouts, read from ``/proc/self/mountinfo`` (:meth:`CgroupHost.discover`):

- **unified** (cgroup v2 only, at ``/sys/fs/cgroup``): a group per task under
  ``reservoir/`` with ``memory.max``, ``cpu.max`` and ``cpuset.cpus``, as far as the
  hierarchy offers those controllers; the kernel's OOM kills are counted in
  ``memory.events``;
- **hybrid** (the v1 controllers, and an empty v2 hierarchy at
  ``/sys/fs/cgroup/unified``): a v2 group per task all the same (every process of the
  task is found and killed at its end, ``cgroup.kill``), and from the v1 hierarchies a
  ``memory`` group (``memory.limit_in_bytes``, OOM kills counted in
  ``memory.oom_control``) and a ``cpu`` group (``cpu.cfs_quota_us``) under the agent's
  own group;
- **legacy** (v1 only): the v1 groups alone.

Where a limit has no controller (no cgroup at all, a controller missing, or an agent that
may not write there), the driver falls back to ``RLIMIT_AS`` for memory and CPU
affinity for pinned CPUs; a CPU count alone is then not enforced. What each task got is
in :attr:`TaskGroups.limited`, and so in the task's ``limits``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

__all__ = ["CPU_PERIOD_US", "CgroupHost", "TaskGroups", "make_task_groups"]

#: the period of a task's CPU quota, in microseconds (its VCPUs times this per period)
CPU_PERIOD_US: Final = 100_000
#: the v2 controllers a task's group is given, where the hierarchy has them
_V2_WANTED: Final = ("cpu", "memory", "cpuset")
#: the v1 hierarchies used, where mounted
_V1_WANTED: Final = ("memory", "cpu")
#: the directory under which the groups of tasks are made
PARENT: Final = "reservoir"


@dataclass(frozen=True)
class CgroupHost:
    """Where this host's control groups are, as a node agent may use them."""

    #: the cgroup v2 hierarchy's root (None: not mounted)
    unified: Path | None = None
    #: v1 controller -> the agent's own group in that controller's hierarchy
    v1: Mapping[str, Path] = field(default_factory=dict)

    @classmethod
    def discover(cls, mountinfo: str | None = None, own: str | None = None) -> CgroupHost:
        """This host's layout, from ``/proc/self/mountinfo`` and ``/proc/self/cgroup``
        (given as text in tests)."""
        try:
            if mountinfo is None:
                mountinfo = Path("/proc/self/mountinfo").read_text()
            if own is None:
                own = Path("/proc/self/cgroup").read_text()
        except OSError:
            return cls()
        own_paths: dict[str, str] = {}
        for line in own.splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3:
                for controller in parts[1].split(","):
                    own_paths[controller] = parts[2]
        unified: Path | None = None
        v1: dict[str, Path] = {}
        for line in mountinfo.splitlines():
            before, _, after = line.partition(" - ")
            fields, tail = before.split(), after.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            root, mount_point, fs_type, options = fields[3], fields[4], tail[0], tail[2]
            if fs_type == "cgroup2":
                unified = Path(_unescaped(mount_point))
            elif fs_type == "cgroup":
                for controller in options.split(","):
                    if controller in _V1_WANTED and controller in own_paths:
                        inside = own_paths[controller]
                        if inside == root or inside.startswith(root.rstrip("/") + "/"):
                            relative = inside[len(root.rstrip("/")) :].lstrip("/")
                            v1[controller] = Path(_unescaped(mount_point)) / relative
        return cls(unified=unified, v1=v1)

    def describe(self) -> str:
        """The layout in a few words, for the node's log."""
        parts = []
        if self.unified is not None:
            controllers = _controllers(self.unified / "cgroup.controllers")
            usable = [c for c in _V2_WANTED if c in controllers]
            parts.append(f"cgroup v2 at {self.unified} ({', '.join(usable) or 'no controller'})")
        if self.v1:
            parts.append(
                "cgroup v1 " + ", ".join(f"{c} at {p}" for c, p in sorted(self.v1.items()))
            )
        return "; ".join(parts) or "no control groups"


@dataclass(frozen=True)
class TaskGroups:
    """The control groups made for one task, and how the task's processes use them."""

    #: the groups made, removed once the task is forgotten
    directories: tuple[Path, ...] = ()
    #: ``cgroup.procs`` files the task's process writes itself into before it runs
    join: tuple[Path, ...] = ()
    #: the v2 group's ``cgroup.kill`` (kills every process in it at once)
    kill: Path | None = None
    #: the v1 groups' ``cgroup.procs``, read to kill what is left at the end
    procs: tuple[Path, ...] = ()
    #: files counting the kernel's OOM kills in the task's memory group, and the key
    oom: tuple[tuple[Path, str], ...] = ()
    #: limit -> what enforces it: ``memory``, ``cpu``, ``cpuset`` -> ``cgroup2``/``cgroup1``
    limited: Mapping[str, str] = field(default_factory=dict)

    def remove(self) -> None:
        """Remove the groups (once their processes are gone; a group still in use stays)."""
        for directory in self.directories:
            with contextlib.suppress(OSError):
                directory.rmdir()


def _unescaped(path: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal
    return (
        path.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
    )


def _controllers(path: Path) -> set[str]:
    try:
        return {word.lstrip("+") for word in path.read_text().split()}
    except OSError:
        return set()


def _enable(subtree_control: Path, controllers: Sequence[str]) -> None:
    """Ask for ``controllers`` in a group's children (all at once, else one by one: one
    the kernel refuses must not cost the others)."""
    if not controllers or set(controllers) <= _controllers(subtree_control):
        return
    try:
        subtree_control.write_text(" ".join(f"+{c}" for c in controllers))
    except OSError:
        for controller in controllers:
            with contextlib.suppress(OSError):
                subtree_control.write_text(f"+{controller}")


def make_task_groups(
    host: CgroupHost,
    name: str,
    *,
    vcpus: int | None = None,
    cpus: tuple[int, ...] = (),
    memory_mb: int | None = None,
) -> TaskGroups:
    """The groups of the task ``name`` with its limits, as far as ``host`` allows; what
    cannot be made (no permission, no controller) is left out, never an error."""
    directories: list[Path] = []
    join: list[Path] = []
    procs: list[Path] = []
    oom: list[tuple[Path, str]] = []
    limited: dict[str, str] = {}
    kill: Path | None = None
    root = host.unified
    if root is not None and os.access(root, os.W_OK):
        try:
            parent = root / PARENT
            parent.mkdir(exist_ok=True)
            offered = [c for c in _V2_WANTED if c in _controllers(root / "cgroup.controllers")]
            _enable(root / "cgroup.subtree_control", offered)
            _enable(parent / "cgroup.subtree_control", offered)
            enabled = _controllers(parent / "cgroup.subtree_control")
            group = parent / name
            group.mkdir(exist_ok=True)
            directories.append(group)
            join.append(group / "cgroup.procs")
            if (group / "cgroup.kill").exists():
                kill = group / "cgroup.kill"
            else:
                procs.append(group / "cgroup.procs")
            if memory_mb and "memory" in enabled:
                (group / "memory.max").write_text(str(memory_mb * 1024 * 1024))
                with contextlib.suppress(OSError):
                    (group / "memory.swap.max").write_text("0")
                oom.append((group / "memory.events", "oom_kill"))
                limited["memory"] = "cgroup2"
            if vcpus and "cpu" in enabled:
                (group / "cpu.max").write_text(f"{vcpus * CPU_PERIOD_US} {CPU_PERIOD_US}")
                limited["cpu"] = "cgroup2"
            if cpus and "cpuset" in enabled:
                (group / "cpuset.cpus").write_text(",".join(str(cpu) for cpu in cpus))
                limited["cpuset"] = "cgroup2"
        except OSError:
            pass  # what was made is used; the rest falls back
    for controller, own in sorted(host.v1.items()):
        wanted = (memory_mb and controller == "memory" and "memory" not in limited) or (
            vcpus and controller == "cpu" and "cpu" not in limited
        )
        if not wanted or not os.access(own, os.W_OK):
            continue
        try:
            group = own / PARENT / name
            group.mkdir(parents=True, exist_ok=True)
            directories.append(group)
            if controller == "memory" and memory_mb:
                limit = str(memory_mb * 1024 * 1024)
                (group / "memory.limit_in_bytes").write_text(limit)
                with contextlib.suppress(OSError):  # swap accounting may be off
                    (group / "memory.memsw.limit_in_bytes").write_text(limit)
                oom.append((group / "memory.oom_control", "oom_kill"))
            elif controller == "cpu" and vcpus:
                (group / "cpu.cfs_period_us").write_text(str(CPU_PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(vcpus * CPU_PERIOD_US))
            join.append(group / "cgroup.procs")
            procs.append(group / "cgroup.procs")
            limited[controller] = "cgroup1"
        except OSError:
            continue
    # the parents (reservoir/) are left: other tasks use them
    return TaskGroups(
        directories=tuple(directories),
        join=tuple(join),
        kill=kill,
        procs=tuple(procs),
        oom=tuple(oom),
        limited=limited,
    )
