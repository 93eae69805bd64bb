"""The reservoir image (deploy/docker/Dockerfile, built offline by deploy/ci/docker.sh from
wheels): every command is there, the api extra is installed, it runs as a user of its own,
and a whole demo placement runs inside it."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import click
import pytest

from reservoir import __version__
from reservoir.cli import main

if TYPE_CHECKING:
    from conftest import Docker

pytestmark = pytest.mark.docker


def test_every_reservoir_command_is_in_the_image(docker: Docker, reservoir_image: str) -> None:
    shown = docker.run(reservoir_image, "reservoir", "--help")
    assert isinstance(main, click.Group)
    for name in main.commands:
        assert f"  {name} " in shown, f"reservoir {name} is missing from the image's --help"
    assert docker.run(reservoir_image, "reservoir", "--version").split()[-1] == __version__


def test_the_image_has_what_reservoir_serve_needs(docker: Docker, reservoir_image: str) -> None:
    # the api extra: serve's app and its /metrics, and the node agents' --metrics-port
    imported = docker.run(
        reservoir_image, "python3", "-c",
        "import fastapi, uvicorn, prometheus_client, reservoir.serve as s; "
        "print(sorted(r.path for r in s.create_app('memory://').routes))",
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
