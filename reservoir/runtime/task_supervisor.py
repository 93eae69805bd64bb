"""The exec driver's supervisor: one small process per task, between the node agent and
the task's command, that outlives the agent as the task does.

The driver starts it (in a session of its own) as a script, by path and with ``-I``, so
that it imports nothing but the standard library: a few milliseconds and a few MiB per
task. It reads what to run as JSON on its stdin, then:

- starts the command in a process group of its own, after joining the task's control
  groups, setting its rlimits and CPU affinity, and dropping to the task's user (in that
  order: only root may join a group or change user), with no new privileges;
- answers the driver on its stdout with one line, ``started <pid>`` or ``failed
  <reason>`` (so that a command that cannot be run is a task that failed to start, not
  one that exited), then lets go of stdin and stdout;
- copies the command's stdout and stderr, read through pipes, to files of bounded size
  (:class:`RotatingOutput`: at most ``max_files`` files of ``max_file_bytes`` per
  stream, the oldest deleted): a task writing gigabytes fills the pipe while the disk
  is slow and never more than the files' bound;
- on SIGTERM (the agent's stop), passes it on to the command's group and sends SIGKILL
  after the grace; once the command ended, kills what is left of its group and control
  groups, reads whether the kernel killed it for memory, and removes the groups;
- writes why it ended into a file beside the exit file, then the exit code into the exit
  file (a bare number, or nothing when unknown, as release 0.1.0 wrote and reads it: a
  node rolled back to it reads the codes of tasks that ended meanwhile), each
  atomically, and exits with the code.

The agent (a restarted one too) learns of the end from the exit file, and reads the
output from the files (:mod:`reservoir.runtime.task_output`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

__all__ = [
    "OUTPUT_STREAMS",
    "RotatingOutput",
    "output_file_name",
    "output_files",
    "read_exit_file",
    "reason_file",
    "write_exit_file",
]

#: the streams of a task's output, as files and on the wire
OUTPUT_STREAMS: Final = ("stdout", "stderr")
#: a stream's file is named after the offset of its first byte in the whole stream
_OFFSET_DIGITS: Final = 16
_FILE_NAME = re.compile(r"^(stdout|stderr)\.(\d{16})\Z")
#: what is read from a pipe at once (the most the supervisor holds of the output)
_READ_BYTES: Final = 64 * 1024
#: once the command ended and its group was killed, how long output from processes that
#: left the group (a daemon that called setsid) is still read
_DRAIN_AFTER_END_S: Final = 1.0
#: prctl(2)'s PR_SET_NO_NEW_PRIVS: execve never grants more (setuid binaries included)
_PR_SET_NO_NEW_PRIVS: Final = 38


def output_file_name(stream: str, start: int) -> str:
    """The name of ``stream``'s file whose first byte is byte ``start`` of the stream."""
    return f"{stream}.{start:0{_OFFSET_DIGITS}d}"


def output_files(directory: Path, stream: str) -> list[tuple[int, Path]]:
    """``stream``'s files in ``directory``, oldest first, with the offset each starts at."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        match = _FILE_NAME.match(name)
        if match is not None and match.group(1) == stream:
            found.append((int(match.group(2)), directory / name))
    found.sort()
    return found


class RotatingOutput:
    """One stream of a task's output as files of at most ``max_file_bytes``, at most
    ``max_files`` of them: when the newest is full the next one starts, and the oldest
    goes. Every file is named after the offset of its first byte, so a reader knows which
    bytes are still there."""

    def __init__(self, directory: Path, stream: str, max_file_bytes: int, max_files: int) -> None:
        if max_file_bytes < 1 or max_files < 1:
            raise ValueError("an output needs at least one file of at least one byte")
        self._directory = directory
        self._stream = stream
        self._max_file_bytes = max_file_bytes
        self._max_files = max_files
        #: bytes written to the stream in all (the offset of the next one)
        self.total = 0
        self._fd: int | None = None
        self._file_bytes = 0
        self._open_next()  # an empty stream has a file: a reader finds it, with 0 bytes

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._file_bytes >= self._max_file_bytes:
                self._open_next()
            assert self._fd is not None
            room = self._max_file_bytes - self._file_bytes
            written = os.write(self._fd, view[:room])
            self._file_bytes += written
            self.total += written
            view = view[written:]

    def _open_next(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        path = self._directory / output_file_name(self._stream, self.total)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o640)
        self._file_bytes = 0
        files = output_files(self._directory, self._stream)
        for _, old in files[: max(0, len(files) - self._max_files)]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_exit_file(path: Path) -> tuple[int | None, str] | None:
    """What an exit file says (the exit code, None when unknown) and why the task ended
    (from the file beside it, :func:`reason_file`), or None when there is none (yet)."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    try:
        reason = reason_file(path).read_text()
    except OSError:
        reason = ""
    return (int(text) if text.lstrip("-").isdigit() else None), reason


def reason_file(exit_file: Path) -> Path:
    """Where why a task ended is written, beside its exit file (which holds the code
    alone: release 0.1.0 reads it as a bare number)."""
    return exit_file.with_name(exit_file.name + ".why")


def write_exit_file(path: Path, exit_code: int | None, reason: str) -> None:
    for target, text in (
        (reason_file(path), reason),  # first: once the code is there, so is why
        (path, "" if exit_code is None else str(exit_code)),
    ):
        partial = target.with_name(target.name + ".tmp")
        partial.write_text(text)
        os.replace(partial, target)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _oom_kills(files: Sequence[Sequence[str]]) -> int:
    """The OOM kills counted in ``files`` (each a path and the key of its count:
    ``memory.events``' ``oom_kill`` in cgroup v2, ``memory.oom_control``'s in v1)."""
    kills = 0
    for path, key in files:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                kills += int(value)
    return kills


def _kill_groups(spec: dict[str, Any], pgid: int) -> None:
    """Kill whatever is left of the task: its process group, and its control groups
    (processes that left the group but not the control group)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    kill = spec.get("cgroup_kill")
    if kill:
        with contextlib.suppress(OSError):
            Path(kill).write_text("1")
    for procs in spec.get("cgroup_procs", ()):
        for _ in range(10):  # a process may fork while it is being killed
            try:
                pids = [int(p) for p in Path(procs).read_text().split()]
            except (OSError, ValueError):
                break
            # never a group of its own (0, -n) nor itself: it is in no task group
            pids = [pid for pid in pids if pid > 0 and pid != os.getpid()]
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.01)


def _no_new_privileges() -> Any:
    """A call that asks the kernel never to grant the calling process more privileges
    (None where there is no prctl): made before the fork, called in the child."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _remove_groups(spec: dict[str, Any]) -> None:
    """Remove the task's control groups once their processes are gone (a group being
    emptied by a kill refuses, a moment): done here, so that a task whose agent is gone
    leaves no group behind (the agent's forget finds them removed)."""
    groups = [Path(procs).parent for procs in spec.get("cgroup_join", ())]
    for _ in range(50):
        left = []
        for group in groups:
            try:
                group.rmdir()
            except FileNotFoundError:
                pass
            except OSError:
                left.append(group)
        if not left:
            return
        groups = left
        time.sleep(0.01)


def _child_setup(spec: dict[str, Any], no_new_privileges: Any) -> None:
    """In the command's process, before it runs: what only root can do first."""
    for procs in spec.get("cgroup_join", ()):
        with open(procs, "w") as file:
            file.write("0")
    memory = spec.get("rlimit_as")
    if memory:
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpus = spec.get("cpus")
    if cpus:
        os.sched_setaffinity(0, cpus)
    uid, gid = spec.get("uid"), spec.get("gid")
    if gid is not None:
        os.setgroups(spec.get("groups") or [gid])
        os.setgid(gid)
    if uid is not None:
        os.setuid(uid)
    if no_new_privileges is not None:
        no_new_privileges()


def _answer(line: str) -> None:
    """The one line the driver waits for, then stdin and stdout let go of: the agent may
    go away, and a write to its closed pipe must never kill the task."""
    with contextlib.suppress(OSError):
        os.write(1, (line + "\n").encode())
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)


def supervise(spec: dict[str, Any]) -> int:
    """Run the task ``spec`` describes to its end; its exit code."""
    directory = Path(spec["output_dir"])
    exit_file = Path(spec["exit_file"])
    outputs = {
        stream: RotatingOutput(directory, stream, spec["max_file_bytes"], spec["max_files"])
        for stream in OUTPUT_STREAMS
    }
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_read, False)
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    stop_asked = False

    def on_sigterm(signum: int, frame: object) -> None:
        nonlocal stop_asked
        stop_asked = True

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)  # wakes the select
    no_new_privileges = _no_new_privileges()
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    program = spec["command"][0]
    try:
        child = subprocess.Popen(
            spec["command"],
            env=spec["env"],
            cwd=spec.get("cwd"),
            stdin=subprocess.DEVNULL,
            stdout=out_write,
            stderr=err_write,
            process_group=0,
            preexec_fn=lambda: _child_setup(spec, no_new_privileges),
        )
    except subprocess.SubprocessError as error:  # the setup before exec failed
        write_exit_file(exit_file, None, f"could not start {program}: {error}")
        _answer(f"failed could not prepare {program}: {error}")
        return 127
    except OSError as error:
        reason = f"could not start {program}: {error.strerror or error}"
        if error.filename is not None and error.filename != program:
            reason += f" ({error.filename})"
        write_exit_file(exit_file, None, reason)
        _answer(f"failed {reason}")
        return 127
    finally:
        os.close(out_write)
        os.close(err_write)
    _answer(f"started {child.pid}")

    selector = selectors.DefaultSelector()
    selector.register(wakeup_read, selectors.EVENT_READ, None)
    selector.register(out_read, selectors.EVENT_READ, "stdout")
    selector.register(err_read, selectors.EVENT_READ, "stderr")
    open_pipes = 2
    grace_s = float(spec.get("grace_s", 10.0))
    term_sent_at: float | None = None
    killed_after_grace = False
    ended_at: float | None = None
    while True:
        now = time.monotonic()
        waits = []
        if term_sent_at is not None and not killed_after_grace and ended_at is None:
            waits.append(term_sent_at + grace_s - now)
        if ended_at is not None:
            waits.append(ended_at + _DRAIN_AFTER_END_S - now)
        for key, _ in selector.select(max(0.0, min(waits)) if waits else None):
            if key.data is None:
                with contextlib.suppress(BlockingIOError):
                    os.read(wakeup_read, 512)
                continue
            data = os.read(key.fd, _READ_BYTES)
            if data:
                outputs[key.data].write(data)
            else:
                selector.unregister(key.fd)
                os.close(key.fd)
                open_pipes -= 1
        now = time.monotonic()
        if stop_asked and term_sent_at is None and ended_at is None:
            term_sent_at = now
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGTERM)
        if (
            term_sent_at is not None
            and not killed_after_grace
            and ended_at is None
            and now >= term_sent_at + grace_s
        ):
            killed_after_grace = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.pid, signal.SIGKILL)
        if ended_at is None and child.poll() is not None:
            ended_at = now
            _kill_groups(spec, child.pid)  # the command ended: so does what it left
        if ended_at is not None and (open_pipes == 0 or now >= ended_at + _DRAIN_AFTER_END_S):
            break
    for stream in outputs.values():
        stream.close()
    oom_kills = _oom_kills(spec.get("oom_files", ()))  # read before the groups go
    _remove_groups(spec)
    code = child.returncode
    exit_code = code if code >= 0 else 128 - code
    reason = ""
    if code < 0:
        reason = f"killed by {_signal_name(-code)}"
        if killed_after_grace:
            reason += f" after the {grace_s:g} s grace"
    if oom_kills:
        limit = spec.get("memory_mb")
        reason = "out of memory" + (f" (limit {limit} MiB)" if limit else "")
    write_exit_file(exit_file, exit_code, reason)
    return exit_code & 0xFF


def main() -> int:
    spec = json.loads(sys.stdin.buffer.read())
    return supervise(spec)


if __name__ == "__main__":
    sys.exit(main())
