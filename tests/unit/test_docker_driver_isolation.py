"""The docker task driver against a stand-in for the Docker SDK's client (the real engine's
tests are in tests/containers): what it asks the engine for (never privileged, no host
path, no new privileges, a bounded log, unless the node's configuration says otherwise),
out of memory said with its limit, and the output read from the engine while the
container exists and from the node's copy once it is gone."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import docker.errors

from reservoir.protocol.ledger import Allocation
from reservoir.protocol.messages import TaskSpec
from reservoir.runtime.docker_driver import DockerDriver
from reservoir.runtime.tasks import TaskConfig, TaskHandle


class FakeContainer:
    def __init__(self, container_id: str, state: dict[str, Any]) -> None:
        self.id = container_id
        self.attrs = {"State": state}
        self.output = {"stdout": b"out\n", "stderr": b"err\n"}
        self.removed = False

    def logs(self, *, stdout: bool, stderr: bool) -> bytes:
        return (self.output["stdout"] if stdout else b"") + (
            self.output["stderr"] if stderr else b""
        )

    def remove(self, force: bool = False) -> None:
        self.removed = True


class FakeContainers:
    def __init__(self) -> None:
        self.asked: list[dict[str, Any]] = []
        self.made: dict[str, FakeContainer] = {}

    def run(self, image: str, **options: Any) -> FakeContainer:
        self.asked.append({"image": image, **options})
        container = FakeContainer(f"c{len(self.made)}", {"Running": True})
        self.made[container.id] = container
        return container

    def get(self, container_id: str) -> FakeContainer:
        container = self.made.get(container_id)
        if container is None or container.removed:
            raise docker.errors.NotFound("gone")
        return container


class FakeClient:
    def __init__(self) -> None:
        self.containers = FakeContainers()


def an_allocation(memory_mb: int = 256) -> Allocation:
    return Allocation(
        allocation_id="n.x.1/0",
        request_id="r1",
        reservation_id="n.x.1",
        owner="req",
        resources={"VCPU": 2, "MEMORY_MB": memory_mb},
        task=TaskSpec(driver="docker", image="alpine:3", command=("true",)),
    )


def started(
    config: TaskConfig | None = None, **driver: Any
) -> tuple[FakeClient, TaskHandle, DockerDriver]:
    client = FakeClient()
    docker_driver = DockerDriver(client=client, node="n", config=config, **driver)
    allocation = an_allocation()
    assert allocation.task is not None
    return client, docker_driver.start(allocation, allocation.task), docker_driver


def test_a_container_is_never_privileged_mounts_nothing_and_keeps_a_bounded_log() -> None:
    client, _, _ = started(TaskConfig(output_file_bytes=1 << 20, output_files=3))
    (asked,) = client.containers.asked
    assert "privileged" not in asked and "volumes" not in asked
    assert asked["security_opt"] == ["no-new-privileges"]
    assert asked["log_config"] == {
        "Type": "json-file", "Config": {"max-size": str(1 << 20), "max-file": "3"}}  # fmt: skip
    assert (asked["mem_limit"], asked["memswap_limit"], asked["nano_cpus"]) == (
        "256m", "256m", 2_000_000_000)  # fmt: skip


def test_privileges_and_host_paths_only_as_the_node_is_configured() -> None:
    config = TaskConfig(docker_privileged=True, docker_volumes=("/data:/data:ro",))
    client, _, _ = started(config)
    (asked,) = client.containers.asked
    assert asked["privileged"] is True and asked["volumes"] == ["/data:/data:ro"]


def test_a_container_killed_for_its_memory_says_so_with_its_limit() -> None:
    client, handle, docker_driver = started()
    client.containers.made[handle.ref].attrs["State"] = {
        "Running": False, "ExitCode": 137, "OOMKilled": True}  # fmt: skip
    status = docker_driver.status(handle)
    assert (status.running, status.exit_code, status.reason) == (
        False, 137, "out of memory (limit 256 MiB)")  # fmt: skip


def test_its_output_is_read_from_the_engine_then_from_the_nodes_copy_once_it_is_gone(
    tmp_path: Path,
) -> None:
    client, handle, docker_driver = started(state_dir=tmp_path)
    chunk = docker_driver.read_output(handle.allocation_id, "stdout", 0, 1000)
    assert chunk is not None and (chunk.data, chunk.size) == (b"out\n", 4)
    client.containers.made[handle.ref].output["stderr"] = b"err\nmore\n"
    docker_driver.forget(handle)  # copied out, then removed
    assert client.containers.made[handle.ref].removed
    chunk = docker_driver.read_output(handle.allocation_id, "stderr", 4, 1000)
    assert chunk is not None and (chunk.data, chunk.offset, chunk.size) == (b"more\n", 4, 9)
    docker_driver.discard_output(handle.allocation_id)
    assert docker_driver.read_output(handle.allocation_id, "stderr", 0, 1000) is None
