"""The ``docker`` task driver: the task as a container, through the Docker SDK for Python
(the ``docker`` extra).

Limits come from the allocation: ``nano_cpus`` from its VCPUs (or PCPUs), ``cpuset_cpus``
from the pinned CPUs of a NUMA placement, ``mem_limit`` from ``MEMORY_MB``. Every container
is labelled with the request id, the allocation id and the node
(``org.reservoir.request-id``, ``org.reservoir.allocation-id``, ``org.reservoir.node``) so
that a restarted agent, or an operator, finds it again; the agent keeps its id as the
handle. A stop is ``docker stop`` with the request's grace (SIGTERM, then SIGKILL).

**Isolation.** A container is never privileged and mounts nothing of the host unless the
node's configuration says so (``tasks.docker.privileged``, ``tasks.docker.volumes``), and
runs with ``no-new-privileges``. The node's policy (``tasks.images``) is checked before
the node offers. A container the kernel killed for exceeding its memory ends with the
reason ``out of memory (limit N MiB)``.

**Output.** The engine keeps each container's output in its ``json-file`` log, bounded as
the node keeps an exec task's (``max-file`` files of ``max-size``); it is read from there
while the container exists, and copied to the task's directory
(``<state dir>/tasks/<node>/docker/<allocation>/``) before the container is removed, for
the retention. Offsets count from the oldest byte the engine still has, so they hold
until the engine's log rotates (a container that wrote more than the bound): a reader
following it then sees nothing more of it, and ``reservoir logs`` without ``-f`` shows
what is kept. (Copying the output out of the engine as it comes would lift this; the
exec driver's supervisor does the equivalent.)
"""

from __future__ import annotations

import contextlib
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from reservoir.protocol.ledger import Allocation
from reservoir.protocol.messages import TaskSpec
from reservoir.runtime.task_output import MAX_READ_BYTES, read_output_dir, write_output_dir
from reservoir.runtime.task_supervisor import OUTPUT_STREAMS
from reservoir.runtime.tasks import (
    OutputChunk,
    TaskConfig,
    TaskDriverError,
    TaskHandle,
    TaskStartError,
    TaskStatus,
)
from reservoir.version import install_hint

__all__ = ["LABEL_ALLOCATION", "LABEL_NODE", "LABEL_REQUEST", "DockerDriver"]

LABEL_REQUEST: Final = "org.reservoir.request-id"
LABEL_ALLOCATION: Final = "org.reservoir.allocation-id"
LABEL_NODE: Final = "org.reservoir.node"


class DockerDriver:
    """Runs tasks as containers of the engine ``client`` reaches (default: the one the
    environment names, ``DOCKER_HOST`` or the local socket). ``labels`` are added to
    every container it starts (a test run's, say); ``state_dir`` keeps the output of the
    containers that ended (none kept without it)."""

    name = "docker"
    #: the engine is asked for a waiting reader's output at most this often
    output_poll_s = 1.0
    #: a container is found by its allocation's label: the agent may store a handle
    #: before the start is done (NodeAgent._start_task)
    finds_by_allocation = True

    def __init__(
        self,
        *,
        state_dir: Path | None = None,
        node: str = "",
        client: Any = None,
        labels: Mapping[str, str] | None = None,
        config: TaskConfig | None = None,
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
        self.config = config if config is not None else TaskConfig()
        self.state_dir = state_dir
        #: allocation id -> its container's id, for reading its output
        self._containers: dict[str, str] = {}

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
            limits["memswap_limit"] = f"{memory_mb}m"  # no swap beyond it
        config = self.config
        if config.docker_privileged:
            limits["privileged"] = True
        else:
            limits["security_opt"] = ["no-new-privileges"]
        if config.docker_volumes:
            limits["volumes"] = list(config.docker_volumes)
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
                log_config={
                    "Type": "json-file",
                    "Config": {
                        "max-size": str(config.output_file_bytes),
                        "max-file": str(config.output_files),
                    },
                },
                **limits,
            )
        except self._errors.ImageNotFound:
            raise TaskStartError(f"no such image: {task.image}") from None
        except self._errors.DockerException as error:
            raise TaskStartError(f"the engine refused the container: {error}") from None
        self._containers[allocation.allocation_id] = container.id
        return TaskHandle(
            driver=self.name,
            allocation_id=allocation.allocation_id,
            request_id=allocation.request_id,
            ref=container.id,
            limits="docker",
            data={"memory_mb": str(memory_mb)} if memory_mb else {},
        )

    def _ref(self, handle: TaskHandle) -> str | None:
        """The container's id: the handle's, or for one stored before its start was done,
        the container labelled with its allocation (None: none was made)."""
        if handle.ref:
            return handle.ref
        found = self._client.containers.list(
            all=True, filters={"label": f"{LABEL_ALLOCATION}={handle.allocation_id}"}
        )
        return str(found[0].id) if found else None

    def status(self, handle: TaskHandle) -> TaskStatus:
        ref = self._ref(handle)
        if ref is None:
            return TaskStatus(running=False)  # never started: nothing ran, nothing to say
        try:
            container = self._client.containers.get(ref)
        except self._errors.NotFound:
            return TaskStatus(running=False, reason="the container is gone")
        state = container.attrs.get("State", {})
        if state.get("Running") or state.get("Status") in ("created", "restarting"):
            return TaskStatus(running=True)
        reason = state.get("Error") or ""
        if state.get("OOMKilled"):
            limit = handle.data.get("memory_mb")
            reason = "out of memory" + (f" (limit {limit} MiB)" if limit else "")
        return TaskStatus(running=False, exit_code=state.get("ExitCode"), reason=reason)

    def reattach(self, handle: TaskHandle) -> TaskStatus:
        ref = self._ref(handle)
        if ref is not None:
            self._containers[handle.allocation_id] = ref
        return self.status(handle)

    def stop(self, handle: TaskHandle, grace_s: float) -> None:
        ref = self._ref(handle)
        if ref is not None:
            with contextlib.suppress(self._errors.NotFound):
                self._client.containers.get(ref).stop(timeout=math.ceil(grace_s))

    def forget(self, handle: TaskHandle) -> None:
        """The task ended and was reported: its output copied out of the engine (for the
        retention), then its container removed."""
        ref = self._ref(handle)
        try:
            if ref is None:
                raise self._errors.NotFound("no container")
            container = self._client.containers.get(ref)
        except self._errors.NotFound:
            self._containers.pop(handle.allocation_id, None)
            return
        if self.state_dir is not None:
            directory = self.state_dir / handle.allocation_id.replace("/", "_")
            for stream in OUTPUT_STREAMS:
                with contextlib.suppress(self._errors.DockerException, OSError):
                    write_output_dir(directory, stream, self._logs(container, stream))
        self._containers.pop(handle.allocation_id, None)
        with contextlib.suppress(self._errors.NotFound):
            container.remove(force=True)

    # -- output ------------------------------------------------------------------------

    @staticmethod
    def _logs(container: Any, stream: str) -> bytes:
        data = container.logs(stdout=stream == "stdout", stderr=stream == "stderr")
        return data if isinstance(data, bytes) else b""

    def read_output(
        self, allocation_id: str, stream: str, offset: int, max_bytes: int
    ) -> OutputChunk | None:
        container_id = self._containers.get(allocation_id)
        if container_id is not None:
            try:
                data = self._logs(self._client.containers.get(container_id), stream)
            except self._errors.DockerException:
                data = None
            if data is not None:
                if offset > len(data):
                    # The engine's log rotated under the reader: the bytes it has now do not
                    # follow its offset. Nothing more is said to it (docs/design.md).
                    return OutputChunk(offset=offset, size=offset)
                part = data[offset : offset + min(max_bytes, MAX_READ_BYTES)]
                return OutputChunk(offset=offset, data=part, size=len(data))
        if self.state_dir is None:
            return None
        return read_output_dir(
            self.state_dir / allocation_id.replace("/", "_"), stream, offset, max_bytes
        )

    def discard_output(self, allocation_id: str) -> None:
        if self.state_dir is not None:
            shutil.rmtree(self.state_dir / allocation_id.replace("/", "_"), ignore_errors=True)

    def containers(self) -> list[Any]:
        """The containers this node's driver started (by the node label)."""
        return list(
            self._client.containers.list(all=True, filters={"label": f"{LABEL_NODE}={self.node}"})
        )
