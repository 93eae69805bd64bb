"""Fixtures for the tests of reservoir in Docker: its image, the compose deployment, and
the users' ``reservoir_amqp_url`` on a throwaway container.

- ``docker``: a :class:`Docker` (the ``docker`` CLI), once an engine answers; without one
  the test is skipped, failed under ``CI`` (.ci/run provisions one: deploy/ci/docker.sh);
- ``reservoir_image``: the reservoir image's tag: ``RESERVOIR_IMAGE`` if set (.ci/run sets
  it), else what ``deploy/ci/docker.sh reservoir-image`` builds (only when the sources
  changed since the cached one);
- ``rabbitmq_test_image``: the RabbitMQ image built from Debian's packages by
  ``deploy/ci/docker.sh rabbitmq-image`` (cached once built);
- ``compose``: the deployment of deploy/compose/compose.yaml, up and healthy, for the
  module; taken down with its volumes afterwards.

Everything these start carries ``org.reservoir.test-run=<run id>`` (see
:mod:`reservoir.testing.rabbitmq`), so .ci/run removes by that label what a crashed test
left, and each fixture checks that nothing of its own is left when it ends.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from reservoir.testing.rabbitmq import LOCAL_IMAGE_REPOSITORY, RUN_LABEL, run_id

ROOT = Path(__file__).resolve().parents[2]
DOCKER_SH = ROOT / "deploy" / "ci" / "docker.sh"
COMPOSE_FILE = ROOT / "deploy" / "compose" / "compose.yaml"
#: a compose deployment is up within seconds here; this only bounds a broken one
HEALTHY_TIMEOUT_S = 120.0


def unavailable(reason: str) -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI must run the container tests: {reason}", pytrace=False)
    pytest.skip(f"no Docker here: {reason} (deploy/ci/docker.sh provisions it)")


@dataclass(frozen=True)
class Docker:
    """The ``docker`` CLI; what it starts through :meth:`run` is labelled with the run."""

    label: str = field(default_factory=lambda: f"{RUN_LABEL}={run_id()}")

    def __call__(self, *args: str, timeout: float = 60) -> str:
        """``docker ARGS``: its stdout; fails the test, with stderr, on a non-zero exit."""
        done = subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=timeout, check=False
        )
        if done.returncode != 0:
            pytest.fail(f"docker {' '.join(args)} exited {done.returncode}: {done.stderr}")
        return done.stdout

    def run(self, image: str, *command: str, timeout: float = 120) -> str:
        """``command`` in a throwaway container of ``image`` (no network, removed at exit):
        its stdout."""
        return self(
            "run", "--rm", "--network", "none", "--label", self.label, image, *command,
            timeout=timeout,
        )  # fmt: skip

    def start(self, image: str, *command: str, options: tuple[str, ...] = ()) -> str:
        """``command`` in a detached container of ``image`` (no network): its id. The
        caller removes it (``docker rm -f``)."""
        started = self(
            "run", "-d", "--network", "none", "--label", self.label, *options, image, *command
        )
        return started.strip()

    def succeeds(self, container: str, *command: str) -> bool:
        """Whether ``command``, run in ``container``, exits 0."""
        done = subprocess.run(
            ["docker", "exec", container, *command], capture_output=True, timeout=60, check=False
        )
        return done.returncode == 0

    def logs(self, container: str) -> str:
        """What ``container`` wrote, stdout and stderr together."""
        done = subprocess.run(
            ["docker", "logs", container],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60, check=False,
        )  # fmt: skip
        return done.stdout

    def containers_of_this_run(self) -> list[str]:
        return self("ps", "-aq", "--filter", f"label={self.label}").split()


@pytest.fixture(scope="session")
def docker() -> Docker:
    if shutil.which("docker") is None:
        unavailable("the docker CLI is not on PATH")
    done = subprocess.run(["docker", "info"], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        unavailable(f"no Docker engine answers: {done.stderr.strip().splitlines()[-1:]}")
    return Docker()


def _docker_sh(*args: str) -> str:
    """deploy/ci/docker.sh ARGS (it builds only what is missing): its stdout."""
    done = subprocess.run(
        ["bash", str(DOCKER_SH), *args], capture_output=True, text=True, timeout=900, check=False
    )
    if done.returncode != 0:
        pytest.fail(f"deploy/ci/docker.sh {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip()


@pytest.fixture(scope="session")
def reservoir_image(docker: Docker) -> str:
    image = os.environ.get("RESERVOIR_IMAGE") or _docker_sh("reservoir-image")
    docker("image", "inspect", image)
    return image


@pytest.fixture(scope="session")
def rabbitmq_test_image(docker: Docker) -> str:
    _docker_sh("rabbitmq-image")
    tags = docker("images", LOCAL_IMAGE_REPOSITORY, "--format", "{{.Repository}}:{{.Tag}}")
    return tags.split()[0]


@dataclass
class Compose:
    """One compose project of deploy/compose/compose.yaml, its containers, networks and
    volumes labelled with the run (through an override file of the test's own)."""

    docker: Docker
    project: str
    files: list[Path]
    env: dict[str, str]

    def __call__(self, *args: str, timeout: float = 180) -> str:
        command = ["docker-compose", "--no-ansi", "-p", self.project]
        for file in self.files:
            command += ["-f", str(file)]
        done = subprocess.run(
            [*command, *args],
            capture_output=True, text=True, timeout=timeout, check=False, env=self.env,
        )  # fmt: skip
        if done.returncode != 0:
            pytest.fail(f"docker-compose {' '.join(args)} exited {done.returncode}: {done.stderr}")
        return done.stdout

    def port(self, service: str, port: int) -> int:
        """The loopback port ``service``'s ``port`` is published on."""
        published = self("port", service, str(port)).strip()
        host, _, number = published.rpartition(":")
        assert host == "127.0.0.1", f"{service}:{port} is published on {published}, not loopback"
        return int(number)

    def container(self, service: str) -> str:
        return self("ps", "-q", service).strip()

    def health(self) -> dict[str, str]:
        """Each container's name and health (or state, for one without a healthcheck)."""
        ids = self("ps", "-q").split()
        if not ids:
            return {}
        template = (
            "{{.Name}} {{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}"
        )
        lines = self.docker("inspect", "--format", template, *ids).splitlines()
        return dict(line.lstrip("/").split(" ", 1) for line in lines)

    def wait_healthy(self, services: int) -> None:
        deadline = time.monotonic() + HEALTHY_TIMEOUT_S
        health: dict[str, str] = {}
        while time.monotonic() < deadline:
            health = self.health()
            if len(health) == services and all(h == "healthy" for h in health.values()):
                return
            if any(h in ("unhealthy", "exited", "dead") for h in health.values()):
                break
            time.sleep(1)
        logs = self("logs", "--tail", "30")
        pytest.fail(f"the deployment is not healthy: {health}\n{logs}")


def _labelling_override(path: Path, label: str) -> Path:
    """A compose file that adds ``label`` to every service, volume and the default network
    of compose.yaml, so that .ci/run finds all of them by label."""
    key, _, value = label.partition("=")
    base = yaml.safe_load(COMPOSE_FILE.read_text())
    override = {
        "services": {name: {"labels": {key: value}} for name in base["services"]},
        "volumes": {name: {"labels": {key: value}} for name in base.get("volumes", {})},
        "networks": {"default": {"labels": {key: value}}},
    }
    path.write_text(yaml.safe_dump(override))
    return path


@pytest.fixture(scope="module")
def compose(
    docker: Docker,
    reservoir_image: str,
    rabbitmq_test_image: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Compose]:
    if shutil.which("docker-compose") is None:
        unavailable("docker-compose is not on PATH (Debian's docker-compose package)")
    override = _labelling_override(tmp_path_factory.mktemp("compose") / "labels.yaml", docker.label)
    env = {
        **os.environ,
        "RESERVOIR_IMAGE": reservoir_image,
        "RESERVOIR_RABBITMQ_IMAGE": rabbitmq_test_image,
        # empty: any free loopback port (the machine's own RabbitMQ holds 5672)
        "RESERVOIR_AMQP_PORT": "",
        "RESERVOIR_API_PORT": "",
        "RESERVOIR_API_2_PORT": "",
    }
    deployment = Compose(
        docker, f"reservoir-test-{uuid.uuid4().hex[:8]}", [COMPOSE_FILE, override], env
    )
    services = len(yaml.safe_load(COMPOSE_FILE.read_text())["services"])
    try:
        deployment("up", "-d")
        deployment.wait_healthy(services)
        yield deployment
    finally:
        deployment("down", "--volumes", "--remove-orphans", "--timeout", "10")
        left = docker(
            "ps", "-aq", "--filter", f"label=com.docker.compose.project={deployment.project}"
        )
        assert not left.split(), f"compose down left containers: {left}"
