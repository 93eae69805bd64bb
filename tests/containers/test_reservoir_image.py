"""The reservoir image (deploy/docker/Dockerfile, built offline by deploy/ci/docker.sh from
wheels): every command is there, the api extra is installed, it runs as a user of its own,
a whole demo placement runs inside it, every program the deployment files run (their
commands and exec probes) is in the image they run it in, and the Kubernetes manifests'
node agent and API, run as they say (their command, user, read-only root), pass their own
probes."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import pytest
import yaml

from reservoir import __version__
from reservoir.cli import main

if TYPE_CHECKING:
    from conftest import Docker

pytestmark = pytest.mark.docker

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def test_every_reservoir_command_is_in_the_image(docker: Docker, reservoir_image: str) -> None:
    shown = docker.run(reservoir_image, "reservoir", "--help")
    assert isinstance(main, click.Group)
    names = main.list_commands(click.Context(main))
    assert names, "reservoir lists no command"
    for name in names:
        assert f"  {name} " in shown, f"reservoir {name} is missing from the image's --help"
    assert docker.run(reservoir_image, "reservoir", "--version").split()[2] == __version__


def test_the_image_has_what_reservoir_serve_needs(docker: Docker, reservoir_image: str) -> None:
    # the api extra: serve's app and its /metrics, and the node agents' --metrics-port
    imported = docker.run(
        reservoir_image, "python3", "-c",
        "import fastapi, uvicorn, prometheus_client, reservoir.service as s; "
        "print(sorted(s.create_app('memory://').openapi()['paths']))",
    )  # fmt: skip
    for path in ("/healthz", "/readyz", "/metrics", "/v1/nodes", "/v1/reservations"):
        assert f"'{path}'" in imported


def test_the_image_runs_as_a_user_of_its_own(docker: Docker, reservoir_image: str) -> None:
    assert docker.run(reservoir_image, "id", "-un").strip() == "reservoir"


def test_a_demo_inside_the_image_places_every_request(docker: Docker, reservoir_image: str) -> None:
    shown = docker.run(reservoir_image, "reservoir", "demo", "--requests", "50", "--json")
    result = json.loads(shown)
    assert result["requests"] == 50
    assert result["placed"] == 50
    assert result["failed"] == 0
    assert result["duplicate_placements"] == 0
    assert result["overcommitted"] == 0
    assert result["leaked_reservations"] == 0


def test_the_image_tests_leave_no_container_behind(docker: Docker, reservoir_image: str) -> None:
    docker.run(reservoir_image, "true")
    assert docker.containers_of_this_run() == []


def programs_run_by_the_deployment_files() -> set[tuple[str, str]]:
    """(image, program) for every command and exec probe of compose.yaml and the
    Kubernetes manifests."""
    run: set[tuple[str, str]] = set()
    compose = yaml.safe_load((DEPLOY / "compose" / "compose.yaml").read_text())
    for service in compose["services"].values():
        test = service.get("healthcheck", {}).get("test", [])
        for argv in (service.get("command"), test[1:] if test[:1] == ["CMD"] else None):
            if argv:
                run.add((service["image"], argv[0]))
    for manifest in (DEPLOY / "kubernetes").glob("*.yaml"):
        for document in yaml.safe_load_all(manifest.read_text()):
            template: dict[str, Any] = (document or {}).get("spec", {}).get("template", {})
            spec = template.get("spec", {})
            for container in spec.get("initContainers", []) + spec.get("containers", []):
                probes = [v for k, v in container.items() if k.endswith("Probe")]
                for argv in [container.get("command")] + [
                    p["exec"]["command"] for p in probes if "exec" in p
                ]:
                    if argv:
                        run.add((container["image"], argv[0]))
    return run


def test_every_program_the_deployment_files_run_is_in_its_image(
    docker: Docker, reservoir_image: str, rabbitmq_test_image: str
) -> None:
    run = programs_run_by_the_deployment_files()
    assert ("${RESERVOIR_IMAGE:-reservoir:latest}", "reservoir") in run
    assert ("reservoir", "chown") in run  # the DaemonSet's init container
    wanted: dict[str, set[str]] = {}
    for image, program in run:
        # the RabbitMQ image built here stands in for the official one of the manifests
        local = rabbitmq_test_image if "rabbitmq" in image else reservoir_image
        wanted.setdefault(local, set()).add(program)
    for local, programs in wanted.items():
        # one container per image: a line per program found, none for one missing
        script = "; ".join(f"command -v {p} || true" for p in sorted(programs))
        found = docker.run(local, "sh", "-c", script).split()
        missing = [p for p in programs if not any(f.endswith(f"/{p}") for f in found)]
        assert not missing, f"not in {local}: {missing}"


def manifest_container(kind: str) -> dict[str, Any]:
    for manifest in (DEPLOY / "kubernetes").glob("*.yaml"):
        for document in yaml.safe_load_all(manifest.read_text()):
            if document and document["kind"] == kind:
                containers: list[dict[str, Any]] = document["spec"]["template"]["spec"][
                    "containers"
                ]
                return containers[0]
    raise AssertionError(f"no {kind} in deploy/kubernetes")


def probe_commands(container: dict[str, Any]) -> list[list[str]]:
    """Each probe of ``container`` as a command to run inside it."""
    commands = []
    for key in ("startupProbe", "livenessProbe", "readinessProbe"):
        probe = container.get(key)
        if probe is None:
            continue
        if "exec" in probe:
            commands.append(probe["exec"]["command"])
        else:
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            port = ports.get(probe["httpGet"]["port"], probe["httpGet"]["port"])
            url = f"http://127.0.0.1:{port}{probe['httpGet']['path']}"
            commands.append(
                ["python3", "-c", f"import urllib.request; urllib.request.urlopen({url!r})"]
            )
    return commands


@pytest.mark.parametrize("kind", ["DaemonSet", "Deployment"])
def test_the_manifests_agents_run_read_only_as_their_user_and_pass_their_probes(
    docker: Docker, reservoir_image: str, kind: str
) -> None:
    container = manifest_container(kind)
    command = [arg.replace("$(NODE_NAME)", "worker-1") for arg in container["command"]]
    options = ["--read-only", "--user", "10001:10001", "-e", "RESERVOIR_BROKER_URL=memory://"]
    for env in container.get("env", []):
        if "value" in env:
            options += ["-e", f"{env['name']}={env['value']}"]
    for mount in container.get("volumeMounts", []):  # the hostPath, empty and the user's
        options += ["--tmpfs", f"{mount['mountPath']}:uid=10001,gid=10001"]
    probes = probe_commands(container)
    assert len(probes) >= 2, f"{kind} has {len(probes)} probes"
    started = docker.start(reservoir_image, *command, options=tuple(options))
    try:
        deadline = time.monotonic() + 30
        passing: list[bool] = []
        while time.monotonic() < deadline:
            passing = [docker.succeeds(started, *probe) for probe in probes]
            if all(passing):
                break
            time.sleep(0.5)
        logs = docker.logs(started)
        assert all(passing), f"{kind}: probes {probes} gave {passing}; logs: {logs}"
    finally:
        docker("rm", "-f", started)
