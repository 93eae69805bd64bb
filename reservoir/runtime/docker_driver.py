"""The ``docker`` task driver: the task as a container, through the Docker SDK for Python
(the ``docker`` extra).

Limits come from the allocation: ``nano_cpus`` from its VCPUs (or PCPUs), ``cpuset_cpus``
from the pinned CPUs of a NUMA placement, ``mem_limit`` from ``MEMORY_MB``. Every container
is labelled with the request id, the allocation id and the node
(``org.reservoir.request-id``, ``org.reservoir.allocation-id``, ``org.reservoir.node``) so
that a restarted agent, or an operator, finds it again; the agent keeps its id as the
handle. A stop is ``docker stop`` with the request's grace (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from reservoir.protocol.ledger import Allocation
from reservoir.protocol.messages import TaskSpec
from reservoir.runtime.tasks import TaskDriverError, TaskHandle, TaskStartError, TaskStatus
from reservoir.version import install_hint

__all__ = ["LABEL_ALLOCATION", "LABEL_NODE", "LABEL_REQUEST", "DockerDriver"]

LABEL_REQUEST: Final = "org.reservoir.request-id"
LABEL_ALLOCATION: Final = "org.reservoir.allocation-id"
LABEL_NODE: Final = "org.reservoir.node"


class DockerDriver:
    """Runs tasks as containers of the engine ``client`` reaches (default: the one the
    environment names, ``DOCKER_HOST`` or the local socket). ``labels`` are added to
    every container it starts (a test run's, say)."""

    name = "docker"

    def __init__(
        self,
        *,
        state_dir: Path | None = None,
        node: str = "",
        client: Any = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        try:
            import docker
        except ImportError:
            raise TaskDriverError(
                f"the docker task driver needs the Docker SDK: {install_hint('docker')}"
            ) from None
        self._errors = docker.errors
        self._client = client if client is not None else docker.from_env()
        self.node = node
        self._labels = dict(labels or {})

    def start(self, allocation: Allocation, task: TaskSpec) -> TaskHandle:
        if task.image is None:
            raise TaskStartError("the docker driver needs an image")
        limits: dict[str, Any] = {}
        cpus = allocation.resources.get("VCPU") or allocation.resources.get("PCPU")
        if cpus:
            limits["nano_cpus"] = cpus * 1_000_000_000
        if allocation.numa is not None and allocation.numa.cpus:
            limits["cpuset_cpus"] = ",".join(str(cpu) for cpu in allocation.numa.cpus)
        memory_mb = allocation.resources.get("MEMORY_MB")
        if memory_mb:
            limits["mem_limit"] = f"{memory_mb}m"
        labels = {
            **self._labels,
            LABEL_REQUEST: allocation.request_id,
            LABEL_ALLOCATION: allocation.allocation_id,
            LABEL_NODE: self.node,
        }
        try:
            container = self._client.containers.run(
                task.image,
                command=list(task.command) or None,
                environment=dict(task.env),
                working_dir=task.workdir,
                labels=labels,
                detach=True,
                **limits,
            )
        except self._errors.ImageNotFound:
            raise TaskStartError(f"no such image: {task.image}") from None
        except self._errors.DockerException as error:
            raise TaskStartError(f"the engine refused the container: {error}") from None
        return TaskHandle(
            driver=self.name,
            allocation_id=allocation.allocation_id,
            request_id=allocation.request_id,
            ref=container.id,
            limits="docker",
        )

    def status(self, handle: TaskHandle) -> TaskStatus:
        try:
            container = self._client.containers.get(handle.ref)
        except self._errors.NotFound:
            return TaskStatus(running=False, reason="the container is gone")
        state = container.attrs.get("State", {})
        if state.get("Running") or state.get("Status") in ("created", "restarting"):
            return TaskStatus(running=True)
        reason = state.get("Error") or ("out of memory" if state.get("OOMKilled") else "")
        return TaskStatus(running=False, exit_code=state.get("ExitCode"), reason=reason)

    def reattach(self, handle: TaskHandle) -> TaskStatus:
        return self.status(handle)

    def stop(self, handle: TaskHandle, grace_s: float) -> None:
        with contextlib.suppress(self._errors.NotFound):
            self._client.containers.get(handle.ref).stop(timeout=math.ceil(grace_s))

    def forget(self, handle: TaskHandle) -> None:
        with contextlib.suppress(self._errors.NotFound):
            self._client.containers.get(handle.ref).remove(force=True)

    def containers(self) -> list[Any]:
        """The containers this node's driver started (by the node label)."""
        return list(
            self._client.containers.list(all=True, filters={"label": f"{LABEL_NODE}={self.node}"})
        )
