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

from collections.abc import Mapping, Sequence
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Final, Protocol, runtime_checkable

import msgspec

from reservoir.protocol.ledger import Allocation
from reservoir.protocol.messages import TaskSpec
from reservoir.runtime.plugins import installed_entry_points

__all__ = [
    "BUILT_IN_TASK_DRIVERS",
    "TASK_DRIVER_GROUP",
    "TaskDriver",
    "TaskDriverError",
    "TaskHandle",
    "TaskStartError",
    "TaskStatus",
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


def load_task_drivers(names: Sequence[str], *, state_dir: Path, node: str) -> dict[str, TaskDriver]:
    """The drivers named, from the ``reservoir.task_drivers`` entry points, each made
    with the directory where it may keep files (exit codes, logs) and the node's name."""
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
            driver = found[name].load()(state_dir=state_dir / name, node=node)
        except TaskDriverError:
            raise
        except Exception as error:  # a plugin may fail in any way: say which
            raise TaskDriverError(f"task driver {name!r} failed to load: {error}") from error
        if not isinstance(driver, TaskDriver):
            raise TaskDriverError(f"task driver {name!r} does not have the TaskDriver interface")
        drivers[name] = driver
    return drivers


def drivers_by_name(
    drivers: Mapping[str, TaskDriver] | Sequence[TaskDriver],
) -> dict[str, TaskDriver]:
    """Drivers given as objects (each named by its ``name``) or by name."""
    if isinstance(drivers, Mapping):
        return dict(drivers)
    return {driver.name: driver for driver in drivers}


__all__ += ["drivers_by_name"]
