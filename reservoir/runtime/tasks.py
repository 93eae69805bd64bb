"""Task drivers: how a node agent runs the work a request carries (its ``task``).

A driver starts an allocation's task with the allocation's exact resources, says whether
it still runs, stops it, and finds it again after the node agent restarted (the agent
keeps each :class:`TaskHandle` in its store). Drivers are found through the
``reservoir.task_drivers`` entry point group (reservoir registers ``exec`` and
``docker`` there), and an operator names the ones a node offers (``--driver``,
``RESERVOIR_TASK_DRIVERS``); an embedded :class:`~reservoir.runtime.node_agent.NodeAgent`
may be handed driver objects directly, and so hears of every award and release of a
request naming one of them.
"""

from __future__ import annotations

import inspect
import os
import pwd
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Final, Protocol, runtime_checkable

import msgspec

from reservoir.protocol.ledger import Allocation
from reservoir.protocol.messages import TaskSpec
from reservoir.protocol.task_policy import TaskPolicy
from reservoir.runtime.plugins import installed_entry_points

__all__ = [
    "BUILT_IN_TASK_DRIVERS",
    "TASK_DRIVER_GROUP",
    "OutputChunk",
    "TaskConfig",
    "TaskConfigError",
    "TaskDriver",
    "TaskDriverError",
    "TaskHandle",
    "TaskOutputSource",
    "TaskStartError",
    "TaskStatus",
    "TaskUser",
    "load_task_drivers",
]

TASK_DRIVER_GROUP: Final = "reservoir.task_drivers"
#: the built-in drivers, found even where the package's entry points are not installed
#: (a source checkout): the same objects the entry points name
BUILT_IN_TASK_DRIVERS: Final[Mapping[str, str]] = {
    "exec": "reservoir.runtime.exec_driver:ExecDriver",
    "docker": "reservoir.runtime.docker_driver:DockerDriver",
}


class TaskHandle(msgspec.Struct, frozen=True, kw_only=True):
    """What a driver needs to find a task again, kept by the node agent in its store."""

    driver: str
    allocation_id: str
    request_id: str
    #: the driver's own reference: ``<pid>:<start time>`` for exec, a container id
    ref: str
    #: which limits the driver applied (``cgroup``, ``rlimit``, ``docker``...)
    limits: str = ""
    #: anything else the driver keeps (an exit-code file, a cgroup path)
    data: dict[str, str] = msgspec.field(default_factory=dict)


class TaskStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Whether a task runs; if not, its exit code (None: unknown) and why."""

    running: bool
    exit_code: int | None = None
    reason: str = ""


class TaskStartError(RuntimeError):
    """The task could not be started; the message says why (it is reported as the
    ``failed`` task's reason)."""


class TaskDriverError(RuntimeError):
    """A task driver could not be found or set up."""


class TaskConfigError(TaskDriverError):
    """The node's task configuration cannot be used (a user that does not exist, root not
    allowed): the message names the setting."""


#: the user an agent running as root starts exec tasks as, unless configured otherwise
DEFAULT_TASK_USER: Final = "nobody"
#: a stream's output kept per task by default: this many files of this many bytes
DEFAULT_OUTPUT_FILE_BYTES: Final = 8 * 1024 * 1024
DEFAULT_OUTPUT_FILES: Final = 2
#: how long the output and the state of an ended task are kept by default
DEFAULT_RETENTION_S: Final = 24 * 3600.0


@dataclass(frozen=True)
class TaskConfig:
    """How a node runs tasks: its ``[tasks]`` configuration (docs/design.md, "Tasks")."""

    #: who exec tasks run as (a name or a number); None: ``nobody`` when the agent runs
    #: as root, else the agent's own user (it cannot switch)
    user: str | None = None
    #: exec tasks may run as root (a ``user`` of uid 0 is refused without it)
    allow_root: bool = False
    #: what a task may run, by glob (None: anything)
    policy: TaskPolicy = field(default_factory=TaskPolicy)
    #: each stream of a task's output is kept in at most this many files of this size
    output_file_bytes: int = DEFAULT_OUTPUT_FILE_BYTES
    output_files: int = DEFAULT_OUTPUT_FILES
    #: an ended task's output and state are kept this long (seconds)
    retention_s: float = DEFAULT_RETENTION_S
    #: docker containers run privileged (never unless configured)
    docker_privileged: bool = False
    #: host paths mounted into every container (``/host:/in/container[:ro]``), none unless
    #: configured
    docker_volumes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.output_file_bytes < 1024:
            raise TaskConfigError("tasks.output.max_file_kb: at least 1 KiB")
        if self.output_files < 1:
            raise TaskConfigError("tasks.output.max_files: at least 1")
        if not self.retention_s >= 0:
            raise TaskConfigError("tasks.output.retention_h: 0 or more")


@dataclass(frozen=True)
class TaskUser:
    """The user exec tasks run as: ``uid`` None means the agent's own (no switch)."""

    name: str
    uid: int | None
    gid: int | None
    groups: tuple[int, ...] = ()
    home: str = "/"

    @classmethod
    def for_config(cls, config: TaskConfig, *, euid: int | None = None) -> TaskUser:
        """The user ``config`` names, checked against who the agent runs as (``euid``,
        default: this process's); raises :class:`TaskConfigError` in words."""
        euid = os.geteuid() if euid is None else euid
        wanted = config.user
        if euid != 0:
            own = _passwd(str(euid))
            if wanted is not None:
                entry = _passwd(wanted)
                if entry is None or entry.pw_uid != euid:
                    raise TaskConfigError(
                        f"tasks.user {wanted!r}: the node agent runs as uid {euid} and cannot "
                        "start tasks as another user; run it as root, or leave tasks.user unset"
                    )
            name = own.pw_name if own is not None else str(euid)
            return cls(name=name, uid=None, gid=None, home=own.pw_dir if own else "/")
        entry = _passwd(wanted or DEFAULT_TASK_USER)
        if entry is None:
            raise TaskConfigError(
                f"tasks.user {wanted or DEFAULT_TASK_USER!r}: no such user on this host"
                + ("" if wanted else "; name the user exec tasks run as in tasks.user")
            )
        if entry.pw_uid == 0 and not config.allow_root:
            raise TaskConfigError(
                f"tasks.user {entry.pw_name!r} is root: exec tasks would run as root; "
                "set tasks.allow_root = true to allow it"
            )
        try:
            groups = tuple(os.getgrouplist(entry.pw_name, entry.pw_gid))
        except OSError:
            groups = (entry.pw_gid,)
        return cls(
            name=entry.pw_name,
            uid=entry.pw_uid,
            gid=entry.pw_gid,
            groups=groups,
            home=entry.pw_dir,
        )


def _passwd(user: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwuid(int(user)) if user.isdigit() else pwd.getpwnam(user)
    except KeyError:
        return None


class OutputChunk(msgspec.Struct, frozen=True, kw_only=True):
    """Bytes of one stream of a task's output, from ``offset`` on. ``skipped``: bytes
    before ``offset`` that were asked for but are no longer kept (rotated away);
    ``size``: the stream's length so far (its end, once the task ended)."""

    offset: int
    data: bytes = b""
    skipped: int = 0
    size: int = 0


@runtime_checkable
class TaskOutputSource(Protocol):
    """A driver that keeps its tasks' output (optional: a driver without it has none)."""

    def read_output(
        self, allocation_id: str, stream: str, offset: int, max_bytes: int
    ) -> OutputChunk | None:
        """Up to ``max_bytes`` of ``stream`` from ``offset`` on; None when no output of
        the allocation is kept here (unknown, or its retention passed)."""
        ...

    def discard_output(self, allocation_id: str) -> None:
        """The task's retention passed: delete what is kept of its output."""
        ...


@runtime_checkable
class TaskDriver(Protocol):
    """One way of running tasks. Every method may block (the agent calls them from a
    thread of its own, never under its machine's lock)."""

    name: str

    def start(self, allocation: Allocation, task: TaskSpec) -> TaskHandle:
        """Start ``task`` within ``allocation``'s resources; raise
        :class:`TaskStartError` when it cannot be started."""
        ...

    def status(self, handle: TaskHandle) -> TaskStatus:
        """Whether the task runs, or how it ended."""
        ...

    def stop(self, handle: TaskHandle, grace_s: float) -> None:
        """Ask the task to stop (SIGTERM); kill it (SIGKILL) after ``grace_s``."""
        ...

    def reattach(self, handle: TaskHandle) -> TaskStatus:
        """Find a task started by an earlier run of the agent; its status."""
        ...

    def forget(self, handle: TaskHandle) -> None:
        """The task ended and was reported: let go of what the driver kept for it."""
        ...


def load_task_drivers(
    names: Sequence[str], *, state_dir: Path, node: str, config: TaskConfig | None = None
) -> dict[str, TaskDriver]:
    """The drivers named, from the ``reservoir.task_drivers`` entry points, each made
    with the directory where it may keep files (exit codes, output) and the node's name,
    and the node's task configuration when it takes one (a ``config`` keyword)."""
    found: dict[str, EntryPoint] = {
        name: EntryPoint(name=name, value=value, group=TASK_DRIVER_GROUP)
        for name, value in BUILT_IN_TASK_DRIVERS.items()
    }
    found.update((ep.name, ep) for ep in installed_entry_points(TASK_DRIVER_GROUP))
    drivers: dict[str, TaskDriver] = {}
    for name in names:
        if name not in found:
            known = ", ".join(sorted(found)) or "none installed"
            raise TaskDriverError(f"no task driver named {name!r}; known: {known}")
        try:
            factory = found[name].load()
            options: dict[str, object] = {"state_dir": state_dir / name, "node": node}
            if config is not None and _takes_config(factory):
                options["config"] = config
            driver = factory(**options)
        except TaskDriverError:
            raise
        except Exception as error:  # a plugin may fail in any way: say which
            raise TaskDriverError(f"task driver {name!r} failed to load: {error}") from error
        if not isinstance(driver, TaskDriver):
            raise TaskDriverError(f"task driver {name!r} does not have the TaskDriver interface")
        drivers[name] = driver
    return drivers


def _takes_config(factory: object) -> bool:
    try:
        return "config" in inspect.signature(factory).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


def drivers_by_name(
    drivers: Mapping[str, TaskDriver] | Sequence[TaskDriver],
) -> dict[str, TaskDriver]:
    """Drivers given as objects (each named by its ``name``) or by name."""
    if isinstance(drivers, Mapping):
        return dict(drivers)
    return {driver.name: driver for driver in drivers}


__all__ += ["drivers_by_name"]
