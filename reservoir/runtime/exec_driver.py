"""The ``exec`` task driver: the task as a process of the node, as an unprivileged user,
under limits, its output kept.

**Who.** A task runs as the user the node's configuration names (``tasks.user``); an
agent running as root defaults to ``nobody`` and refuses a user of uid 0 unless
``tasks.allow_root`` says so; an agent running as anyone else runs tasks as itself (it
cannot switch). The command runs with no new privileges (setuid programs give it none),
in ``/`` unless the request names a working directory, with ``PATH``, ``HOME``,
``USER`` and ``LOGNAME`` of that user and the request's own variables (those the node's
policy allows).

**Limits** come from the allocation: ``VCPU`` (or ``PCPU``), the pinned CPUs of a NUMA
placement, and ``MEMORY_MB``, enforced by control groups as far as the host's layout
allows (:mod:`reservoir.runtime.cgroups`), else ``RLIMIT_AS`` for memory and CPU
affinity for pinned CPUs. The handle says which (``limits``, e.g.
``cpu=cgroup2,memory=cgroup2``), and so does the task's state. Where a control group
limits the memory, a task the kernel kills for exceeding it ends with the reason ``out
of memory (limit N MiB)``.

**The supervisor.** Each task runs under a small process of its own
(:mod:`reservoir.runtime.task_supervisor`), in a session of its own, which outlives the
agent as the task does: it keeps the output (``stdout`` and ``stderr``, each at most
``output_files`` files of ``output_file_bytes``), passes a stop on with its grace, and
writes the exit code and why to a file, so that an agent that restarts finds a task that
ended while it was away, and how. A live task is recognised by its supervisor's pid and
start time (``/proc/<pid>/stat``), so a reused pid is never mistaken for it. Each task
has a directory, ``<state dir>/tasks/<node>/exec/<allocation>/``, with its output and
its exit file, kept for the retention after the task ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Final

import msgspec

from reservoir.protocol.ledger import Allocation
from reservoir.protocol.messages import TaskSpec
from reservoir.runtime import task_supervisor
from reservoir.runtime.cgroups import CgroupHost, TaskGroups, make_task_groups
from reservoir.runtime.task_output import read_output_dir
from reservoir.runtime.task_supervisor import read_exit_file
from reservoir.runtime.tasks import (
    OutputChunk,
    TaskConfig,
    TaskHandle,
    TaskStartError,
    TaskStatus,
    TaskUser,
)

__all__ = ["ExecDriver"]

#: how long a start waits for the supervisor's word that the command runs
_HANDSHAKE_S: Final = 10.0
#: after the grace, how long a stop waits for the supervisor's own SIGKILL to work
_STOP_MARGIN_S: Final = 1.0


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
    """Runs tasks as processes of this host. ``state_dir`` holds a directory per task;
    ``config`` is the node's task configuration; ``cgroups`` the host's control groups
    (found on the host by default; ``CgroupHost()`` for none)."""

    name = "exec"
    #: a task is found from its allocation id alone (its directory names its supervisor),
    #: so the agent may store a handle before the start is done (NodeAgent._start_task)
    finds_by_allocation = True

    def __init__(
        self,
        *,
        state_dir: Path,
        node: str = "",
        config: TaskConfig | None = None,
        cgroups: CgroupHost | None = None,
        user: TaskUser | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.node = node
        self.config = config if config is not None else TaskConfig()
        #: who the tasks run as (raises TaskConfigError for a user not allowed)
        self.user = user if user is not None else TaskUser.for_config(self.config)
        self.cgroups = cgroups if cgroups is not None else CgroupHost.discover()
        state_dir.mkdir(parents=True, exist_ok=True)
        #: supervisors this run of the agent started (their parent: it reaps them)
        self._children: dict[str, subprocess.Popen[bytes]] = {}
        self._lock = threading.Lock()

    # -- the driver --------------------------------------------------------------------

    def start(self, allocation: Allocation, task: TaskSpec) -> TaskHandle:
        refusal = self.config.policy.refusal(task)
        if refusal is not None:
            raise TaskStartError(f"{refusal.detail} on this node")
        if not task.command:
            raise TaskStartError("the exec driver needs a command")
        user = self.user
        node_path = os.environ.get("PATH", "/usr/bin:/bin")
        env = {
            "PATH": node_path,
            "HOME": user.home,
            "USER": user.name,
            "LOGNAME": user.name,
            **task.env,
        }
        program = task.command[0]
        if shutil.which(program, path=env["PATH"]) is None:
            raise TaskStartError(f"command not found: {program}")
        workdir = task.workdir or "/"
        if not Path(workdir).is_dir():
            raise TaskStartError(f"no such working directory: {workdir}")
        directory = self.state_dir / _safe(allocation.allocation_id)
        shutil.rmtree(directory, ignore_errors=True)  # a task's directory is its own
        directory.mkdir(parents=True, mode=0o750)
        memory_mb = allocation.resources.get("MEMORY_MB")
        vcpus = allocation.resources.get("VCPU") or allocation.resources.get("PCPU")
        pinned = tuple(allocation.numa.cpus) if allocation.numa is not None else ()
        groups = make_task_groups(
            self.cgroups, _safe(allocation.allocation_id), vcpus=vcpus, cpus=pinned,
            memory_mb=memory_mb,
        )  # fmt: skip
        limited = dict(groups.limited)
        if memory_mb and "memory" not in limited:
            limited["memory"] = "rlimit"
        if pinned and "cpuset" not in limited:
            limited["cpuset"] = "affinity"
        exit_file = directory / "exit"
        spec: dict[str, Any] = {
            "command": list(task.command),
            "env": env,
            "cwd": workdir,
            "uid": user.uid,
            "gid": user.gid,
            "groups": list(user.groups),
            "rlimit_as": memory_mb * 1024 * 1024
            if memory_mb and limited.get("memory") == "rlimit"
            else None,
            "cpus": list(pinned) if limited.get("cpuset") == "affinity" else None,
            "cgroup_join": [str(p) for p in groups.join],
            "cgroup_kill": str(groups.kill) if groups.kill else None,
            "cgroup_procs": [str(p) for p in groups.procs],
            "oom_files": [[str(path), key] for path, key in groups.oom],
            "memory_mb": memory_mb,
            "output_dir": str(directory),
            "exit_file": str(exit_file),
            "max_file_bytes": self.config.output_file_bytes,
            "max_files": self.config.output_files,
            "grace_s": task.stop_grace_s,
        }
        data = {
            "exit_file": str(exit_file),
            "output_dir": str(directory),
            "cgroups": json.dumps([str(d) for d in groups.directories]),
        }
        handle = TaskHandle(
            driver=self.name,
            allocation_id=allocation.allocation_id,
            request_id=allocation.request_id,
            ref="",
            limits=",".join(f"{what}={how}" for what, how in sorted(limited.items())) or "none",
            data=data,
        )
        process = self._supervise(spec, directory, groups, program, handle)
        with self._lock:
            self._children[allocation.allocation_id] = process
        return self._found(allocation.allocation_id) or handle

    def _supervise(
        self,
        spec: dict[str, Any],
        directory: Path,
        groups: TaskGroups,
        program: str,
        handle: TaskHandle,
    ) -> subprocess.Popen[bytes]:
        """Start the task's supervisor; it, once it says the command runs. Raises
        TaskStartError with the supervisor's reason otherwise. The handle is written into
        the task's directory as soon as the supervisor runs: an agent killed while it waits
        for the answer finds the task by its allocation."""
        log = directory / "supervisor.log"
        try:
            with log.open("ab") as errors:
                process = subprocess.Popen(
                    [sys.executable, "-I", task_supervisor.__file__],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=errors,
                    cwd="/",
                    env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                    start_new_session=True,
                )
        except OSError as error:
            groups.remove()
            raise TaskStartError(f"could not start {program}: {error}") from None
        assert process.stdin is not None and process.stdout is not None
        started = _start_time(process.pid) or "?"
        self._write_handle(
            directory, msgspec.structs.replace(handle, ref=f"{process.pid}:{started}")
        )
        try:
            process.stdin.write(json.dumps(spec).encode())
            process.stdin.close()
            ready, _, _ = select.select([process.stdout], [], [], _HANDSHAKE_S)
            line = process.stdout.readline().decode(errors="replace").strip() if ready else ""
        except OSError:
            line = ""
        finally:
            process.stdout.close()
        word, _, rest = line.partition(" ")
        if word == "started" and rest.isdigit():
            found = self._found(handle.allocation_id)
            if found is not None:  # the command's pid, for a stop whose supervisor is stuck
                data = {**found.data, "child": rest}
                self._write_handle(directory, msgspec.structs.replace(found, data=data))
            return process
        if process.poll() is None and not line:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        groups.remove()
        if word == "failed" and rest:
            raise TaskStartError(rest)
        said = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
        raise TaskStartError(
            f"the task's supervisor did not start {program}"
            + (f": {said[0][:300]}" if said else " in time")
        )

    @staticmethod
    def _write_handle(directory: Path, handle: TaskHandle) -> None:
        partial = directory / "handle.tmp"
        partial.write_bytes(msgspec.json.encode(handle))
        os.replace(partial, directory / "handle")

    def _found(self, allocation_id: str) -> TaskHandle | None:
        """The handle the task's directory holds (None: its supervisor never ran)."""
        try:
            raw = (self.state_dir / _safe(allocation_id) / "handle").read_bytes()
            return msgspec.json.decode(raw, type=TaskHandle)
        except (OSError, msgspec.ValidationError):
            return None

    def _resolved(self, handle: TaskHandle) -> TaskHandle | None:
        """``handle``, or for one stored before its start was done (no ``ref``), the one
        its task's directory holds; None when the task never ran."""
        return handle if handle.ref else self._found(handle.allocation_id)

    def status(self, handle: TaskHandle) -> TaskStatus:
        resolved = self._resolved(handle)
        if resolved is None:
            return TaskStatus(running=False)  # never started: nothing ran, nothing to say
        handle = resolved
        with self._lock:
            process = self._children.get(handle.allocation_id)
        if process is not None:
            code = process.poll()
            if code is None:
                return TaskStatus(running=True)
            return self._ended(handle, code)
        pid, started = self._pid_of(handle)
        if pid is not None and _start_time(pid) == started:
            return TaskStatus(running=True)
        return self._ended(handle, None)

    def _ended(self, handle: TaskHandle, supervisor_code: int | None) -> TaskStatus:
        recorded = self._recorded_exit(handle)
        if recorded is not None:
            code, reason = recorded
            return TaskStatus(running=False, exit_code=code, reason=reason)
        if supervisor_code is not None and supervisor_code < 0:
            # the supervisor itself was killed (the command with it): a shell's convention
            signalled = -supervisor_code
            return TaskStatus(
                running=False,
                exit_code=128 + signalled,
                reason=f"killed by {signal.Signals(signalled).name}"
                if signalled in signal.valid_signals()
                else f"killed by signal {signalled}",
            )
        if supervisor_code is not None:
            return TaskStatus(running=False, exit_code=supervisor_code)
        return TaskStatus(
            running=False,
            reason="it ended while the node agent was away, and how is not known "
            "(its supervisor was killed)",
        )

    def reattach(self, handle: TaskHandle) -> TaskStatus:
        return self.status(handle)

    def stop(self, handle: TaskHandle, grace_s: float) -> None:
        """SIGTERM to the supervisor, which passes it on to the command and kills it
        after the request's grace; if it is still there after ``grace_s``, the command's
        group is killed (the supervisor records it), and last the supervisor's."""
        resolved = self._resolved(handle)
        if resolved is None:
            return
        handle = resolved
        pid, _ = self._pid_of(handle)
        if pid is None or not self.status(handle).running:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
        if self._ended_within(handle, grace_s + _STOP_MARGIN_S):
            return
        child = handle.data.get("child", "")
        if child.isdigit():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(int(child), signal.SIGKILL)
        if self._ended_within(handle, 2.0):
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)

    def _ended_within(self, handle: TaskHandle, wait_s: float) -> bool:
        deadline = time.monotonic() + wait_s
        while self.status(handle).running:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def forget(self, handle: TaskHandle) -> None:
        """The task ended and was reported: its supervisor reaped, its control groups
        removed. Its directory (output and exit file) stays until its retention passed
        (:meth:`discard_output`)."""
        with self._lock:
            process = self._children.pop(handle.allocation_id, None)
        if process is not None:
            process.poll()  # reaped, if it was not yet
        handle = self._resolved(handle) or handle
        with contextlib.suppress(ValueError):
            for group in json.loads(handle.data.get("cgroups", "[]")):
                with contextlib.suppress(OSError):
                    Path(group).rmdir()
        # the cgroup of a handle stored by an earlier release
        old_group = handle.data.get("cgroup")
        if old_group:
            with contextlib.suppress(OSError):
                Path(old_group).rmdir()

    # -- output --------------------------------------------------------------------------

    def read_output(
        self, allocation_id: str, stream: str, offset: int, max_bytes: int
    ) -> OutputChunk | None:
        return read_output_dir(self.state_dir / _safe(allocation_id), stream, offset, max_bytes)

    def discard_output(self, allocation_id: str) -> None:
        shutil.rmtree(self.state_dir / _safe(allocation_id), ignore_errors=True)

    # -- reading -----------------------------------------------------------------------

    @staticmethod
    def _pid_of(handle: TaskHandle) -> tuple[int | None, str]:
        pid, _, started = handle.ref.partition(":")
        return (int(pid) if pid.isdigit() else None), started

    @staticmethod
    def _recorded_exit(handle: TaskHandle) -> tuple[int | None, str] | None:
        path = handle.data.get("exit_file")
        return read_exit_file(Path(path)) if path else None
