"""The docker task driver on a real engine (.ci/run provisions one): a container started
with the allocation's CPU and memory limits (read back from the engine), its exit freeing
the allocation, and a restarted agent re-attaching to a running container.

No image can be pulled: the tasks run in an image built here, FROM scratch with a static
binary when a C compiler is at hand, else from the reservoir image deploy/ci/docker.sh
builds (its entrypoint cleared). Everything carries the run's label, for .ci/run's clean-up.
"""

from __future__ import annotations

import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from reservoir import NodeAgent, Requestor, audit
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.runtime.docker_driver import LABEL_ALLOCATION, LABEL_NODE, DockerDriver
from reservoir.testing.rabbitmq import RUN_LABEL, run_id

pytestmark = pytest.mark.docker

#: writes "out" to stdout and "err" to stderr, sleeps argv[2] seconds, then exits argv[1]
PROGRAM = r"""
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv) {
    write(1, "out\n", 4);
    write(2, "err\n", 4);
    if (argc > 2) sleep(atoi(argv[2]));
    return argc > 1 ? atoi(argv[1]) : 0;
}
"""


@pytest.fixture(scope="module")
def task_image(
    docker: Any, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[tuple[str, list[str]]]:
    """The image's tag, and the command prefix that runs the program in it."""
    context = tmp_path_factory.mktemp("task-image")
    tag = f"reservoir-test-task:{uuid.uuid4().hex[:8]}"
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is not None:
        (context / "task.c").write_text(PROGRAM)
        subprocess.run([compiler, "-static", "-O2", "-o", str(context / "task"),
                        str(context / "task.c")], check=True)  # fmt: skip
        (context / "Dockerfile").write_text("FROM scratch\nCOPY task /task\n")
        prefix = ["/task"]
    else:
        base = request.getfixturevalue("reservoir_image")
        (context / "Dockerfile").write_text(f"FROM {base}\nENTRYPOINT []\n")
        prefix = ["sh", "-c", 'echo out; echo err >&2; sleep "${2:-0}"; exit "$1"', "task"]
    docker("build", "--label", f"{RUN_LABEL}={run_id()}", "-t", tag, str(context), timeout=300)
    yield tag, prefix
    docker("image", "rm", "-f", tag)


@pytest.fixture
def driver(docker: Any) -> Iterator[DockerDriver]:
    driver = DockerDriver(node="docker-node", labels={RUN_LABEL: run_id()})
    yield driver
    for container in driver.containers():
        container.remove(force=True)


def test_a_container_gets_the_allocations_limits_and_its_exit_frees_the_allocation(
    task_image: tuple[str, list[str]], driver: DockerDriver
) -> None:
    image, prefix = task_image
    broker = InProcessBroker()
    node = NodeAgent(broker, name="docker-node", vcpus=4, memory_mb=4096, task_drivers=[driver])
    with Requestor(broker) as requestor:
        run = requestor.run([*prefix, "4", "1"], driver="docker", image=image, vcpus=2,
                            memory_mb=256)  # fmt: skip
        run.wait_started(timeout_s=60)
        (container,) = driver.containers()
        host = container.attrs["HostConfig"]
        assert host["NanoCpus"] == 2_000_000_000
        assert host["Memory"] == 256 * 1024 * 1024
        assert container.labels[LABEL_NODE] == "docker-node"
        (state,) = run.wait(timeout_s=60).values()
        assert (state.state, state.exit_code, state.limits) == ("exited", 4, "docker")
        assert run.exit_code == 4
        assert node.allocations() == []
    audit([node.snapshot()]).raise_if_failed()
    node.close()
    broker.close()


def test_a_restarted_agent_reattaches_to_its_running_container(
    task_image: tuple[str, list[str]], driver: DockerDriver, tmp_path: Path
) -> None:
    from reservoir.runtime.settings import Settings

    image, prefix = task_image
    broker = InProcessBroker()
    settings = Settings(state_dir=tmp_path)

    def a_node() -> NodeAgent:
        return NodeAgent(broker, name="docker-node", vcpus=4, memory_mb=4096,
                         settings=settings, task_drivers=[driver])  # fmt: skip

    node = a_node()
    with Requestor(broker) as requestor:
        run = requestor.run([*prefix, "9", "3"], driver="docker", image=image, vcpus=1)
        run.wait_started(timeout_s=60)
        node.close()  # the container goes on without its agent
        (container,) = driver.containers()
        container.reload()
        assert container.status == "running"
        node = a_node()
        assert [h.ref for h in node.tasks()] == [container.id]
        assert container.labels[LABEL_ALLOCATION] == node.tasks()[0].allocation_id
        (state,) = run.wait(timeout_s=60).values()
        assert (state.state, state.exit_code) == ("exited", 9)
        deadline = time.monotonic() + 10
        while driver.containers() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert driver.containers() == []  # forgotten once reported: removed
        assert node.allocations() == []
    audit([node.snapshot()]).raise_if_failed()
    node.close()
    broker.close()


def test_a_containers_output_is_read_and_it_runs_unprivileged_with_a_bounded_log(
    task_image: tuple[str, list[str]], docker: Any, tmp_path: Path
) -> None:
    image, prefix = task_image
    driver = DockerDriver(node="docker-node", labels={RUN_LABEL: run_id()},
                          state_dir=tmp_path / "docker")  # fmt: skip
    broker = InProcessBroker()
    node = NodeAgent(broker, name="docker-node", vcpus=4, memory_mb=4096, task_drivers=[driver])
    try:
        with Requestor(broker) as requestor:
            run = requestor.run([*prefix, "0", "1"], driver="docker", image=image, vcpus=1)
            run.wait_started(timeout_s=60)
            (container,) = driver.containers()
            host = container.attrs["HostConfig"]
            assert not host["Privileged"] and not host.get("Binds")
            assert "no-new-privileges" in host["SecurityOpt"]
            assert host["LogConfig"]["Type"] == "json-file"
            assert host["LogConfig"]["Config"]["max-file"] == "2"
            # read from the engine while it runs, to its end when followed
            followed = b"".join(p.data for p in requestor.output(run.request_id, follow=True))
            assert followed == b"out\n"
            run.wait(timeout_s=60)
            # and from the node's copy once the container was removed
            deadline = time.monotonic() + 10
            while driver.containers() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert driver.containers() == []
            stderr = b"".join(p.data for p in requestor.output(run.request_id, stream="stderr"))
            assert stderr == b"err\n"
        audit([node.snapshot()]).raise_if_failed()
    finally:
        node.close()
        broker.close()
        for container in driver.containers():
            container.remove(force=True)
