"""The ``exec`` task driver: the task as a subprocess of the node, under limits.

Limits come from the allocation: ``VCPU`` (or the pinned CPUs of a NUMA placement) and
``MEMORY_MB``. With a cgroup v2 unified hierarchy the agent may write to (root, with
``cgroup.controllers`` at the cgroup root), each task gets a child group
(``reservoir/<allocation>``) with ``cpu.max``, ``cpuset.cpus`` and ``memory.max``;
otherwise the task runs under ``setrlimit`` (``RLIMIT_AS`` for memory) and
``sched_setaffinity`` for pinned CPUs (a CPU count alone cannot be enforced that way).
The handle says which (``limits``), and so does the task's state.

A task outlives the agent: it runs in a session of its own under a tiny ``sh`` wrapper
that writes the command's exit code to a file in the driver's directory, so that an agent
that restarts finds a task that ended while it was away, and its exit code. A live task
is recognised by its pid and its start time (``/proc/<pid>/stat``), so a reused pid is
never mistaken for it.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Final

from reservoir.protocol.ledger import Allocation
from reservoir.protocol.messages import TaskSpec
from reservoir.runtime.tasks import TaskHandle, TaskStartError, TaskStatus

__all__ = ["ExecDriver"]

#: runs the command, then writes its exit code to the file named by $0 (atomically: a
#: reader never sees half a number) and exits with it
_WRAPPER: Final = '"$@"; code=$?; echo $code > "$0.tmp" && mv "$0.tmp" "$0"; exit $code'
_CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
#: cpu.max's period, in microseconds
_CPU_PERIOD: Final = 100_000


def _safe(allocation_id: str) -> str:
    return allocation_id.replace("/", "_")


def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot), None when there is no live
    process of that pid (a zombie counts as gone: its exit is in)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its end
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return fields[19]


class ExecDriver:
    """Runs tasks as processes of this host. ``state_dir`` holds the exit-code files."""

    name = "exec"

    def __init__(
        self, *, state_dir: Path, node: str = "", cgroup_root: Path = _CGROUP_ROOT
    ) -> None:
        self.state_dir = state_dir
        self.node = node
        state_dir.mkdir(parents=True, exist_ok=True)
        self._cgroup_root = cgroup_root
        #: processes this run of the agent started (their parent: it reaps them)
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    # -- limits ------------------------------------------------------------------------

    def _cgroup_for(self, allocation: Allocation) -> Path | None:
        """A cgroup v2 group with the allocation's limits, or None when the agent cannot
        make one here (no unified hierarchy, or not allowed)."""
        root = self._cgroup_root
        if os.geteuid() != 0 or not (root / "cgroup.controllers").exists():
            return None
        try:
            parent = root / "reservoir"
            parent.mkdir(exist_ok=True)
            wanted = "+cpu +memory +cpuset"
            (root / "cgroup.subtree_control").write_text(wanted)
            (parent / "cgroup.subtree_control").write_text(wanted)
            group = parent / _safe(allocation.allocation_id)
            group.mkdir(exist_ok=True)
            vcpus = allocation.resources.get("VCPU") or allocation.resources.get("PCPU")
            if vcpus:
                (group / "cpu.max").write_text(f"{vcpus * _CPU_PERIOD} {_CPU_PERIOD}")
            if allocation.numa is not None and allocation.numa.cpus:
                cpus = ",".join(str(cpu) for cpu in allocation.numa.cpus)
                (group / "cpuset.cpus").write_text(cpus)
            memory_mb = allocation.resources.get("MEMORY_MB")
            if memory_mb:
                (group / "memory.max").write_text(str(memory_mb * 1024 * 1024))
        except OSError:
            return None
        return group

    # -- the driver --------------------------------------------------------------------

    def start(self, allocation: Allocation, task: TaskSpec) -> TaskHandle:
        if not task.command:
            raise TaskStartError("the exec driver needs a command")
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **task.env}
        program = task.command[0]
        if shutil.which(program, path=env["PATH"]) is None:
            raise TaskStartError(f"command not found: {program}")
        if task.workdir is not None and not Path(task.workdir).is_dir():
            raise TaskStartError(f"no such working directory: {task.workdir}")
        exit_file = self.state_dir / f"{_safe(allocation.allocation_id)}.exit"
        exit_file.unlink(missing_ok=True)
        group = self._cgroup_for(allocation)
        memory_mb = allocation.resources.get("MEMORY_MB")
        pinned = tuple(allocation.numa.cpus) if allocation.numa is not None else ()

        def limit() -> None:  # in the child, before the wrapper runs
            if group is not None:
                (group / "cgroup.procs").write_text("0")
                return
            if memory_mb:
                size = memory_mb * 1024 * 1024
                resource.setrlimit(resource.RLIMIT_AS, (size, size))
            if pinned:
                os.sched_setaffinity(0, pinned)

        log_path = self.state_dir / f"{_safe(allocation.allocation_id)}.log"
        try:
            with log_path.open("ab") as log_file:
                process = subprocess.Popen(
                    ["/bin/sh", "-c", _WRAPPER, str(exit_file), *task.command],
                    env=env,
                    cwd=task.workdir,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=limit,
                )
        except (OSError, subprocess.SubprocessError) as error:
            raise TaskStartError(f"could not start {program}: {error}") from None
        started = _start_time(process.pid) or "?"
        with self._lock:
            self._children[allocation.allocation_id] = process
        if group is not None:
            limits = "cgroup"
        elif memory_mb or pinned:
            limits = "rlimit" + (",affinity" if pinned else "")
        else:
            limits = "none"
        data = {"exit_file": str(exit_file), "log": str(log_path)}
        if group is not None:
            data["cgroup"] = str(group)
        return TaskHandle(
            driver=self.name,
            allocation_id=allocation.allocation_id,
            request_id=allocation.request_id,
            ref=f"{process.pid}:{started}",
            limits=limits,
            data=data,
        )

    def status(self, handle: TaskHandle) -> TaskStatus:
        with self._lock:
            process = self._children.get(handle.allocation_id)
        if process is not None:
            code = process.poll()
            if code is None:
                return TaskStatus(running=True)
            recorded = self._recorded_exit(handle)
            if recorded is not None:
                return TaskStatus(running=False, exit_code=recorded)
            # the wrapper itself was killed (by a stop, say): a shell's convention
            signalled = -code if code < 0 else None
            return TaskStatus(
                running=False,
                exit_code=128 + signalled if signalled else code,
                reason=f"killed by signal {signalled}" if signalled else "",
            )
        pid, started = self._pid_of(handle)
        if pid is not None and _start_time(pid) == started:
            return TaskStatus(running=True)
        recorded = self._recorded_exit(handle)
        if recorded is not None:
            return TaskStatus(running=False, exit_code=recorded)
        return TaskStatus(
            running=False, reason="it ended while the node agent was away, its exit code unknown"
        )

    def reattach(self, handle: TaskHandle) -> TaskStatus:
        return self.status(handle)

    def stop(self, handle: TaskHandle, grace_s: float) -> None:
        pid, _ = self._pid_of(handle)
        if pid is None or not self.status(handle).running:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if not self.status(handle).running:
                return
            time.sleep(0.02)
        if self.status(handle).running:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)

    def forget(self, handle: TaskHandle) -> None:
        with self._lock:
            process = self._children.pop(handle.allocation_id, None)
        if process is not None:
            process.poll()  # reaped, if it was not yet
        exit_file = handle.data.get("exit_file")
        if exit_file:
            Path(exit_file).unlink(missing_ok=True)
        group = handle.data.get("cgroup")
        if group:
            with contextlib.suppress(OSError):
                Path(group).rmdir()

    # -- reading -----------------------------------------------------------------------

    @staticmethod
    def _pid_of(handle: TaskHandle) -> tuple[int | None, str]:
        pid, _, started = handle.ref.partition(":")
        return (int(pid) if pid.isdigit() else None), started

    @staticmethod
    def _recorded_exit(handle: TaskHandle) -> int | None:
        path = handle.data.get("exit_file")
        if not path:
            return None
        try:
            return int(Path(path).read_text().strip())
        except (OSError, ValueError):
            return None
