"""How reservoir.testing.rabbitmq picks the RabbitMQ image and sets testcontainers up,
without an engine: the image named in the environment wins, then the newest locally built
one (by version, not by spelling), then the pinned upstream one; the reaper and the
loopback host are set unless the user set them; with no engine, the fixture skips the test,
and fails it under ``CI``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
from testcontainers.core.config import ConnectionMode, testcontainers_config

from reservoir.testing.rabbitmq import (
    IMAGE_ENV,
    RABBITMQ_IMAGE,
    amqp_url_for_tests,
    configure_testcontainers,
    rabbitmq_image,
    rabbitmqctl_command,
)


@dataclass
class FakeImage:
    tags: list[str]


@dataclass
class FakeImages:
    images: list[FakeImage] = field(default_factory=list)
    fails: bool = False

    def list(self, name: str) -> list[FakeImage]:
        if self.fails:
            raise ConnectionError("no engine")
        return [i for i in self.images if any(t.startswith(name + ":") for t in i.tags)]


@dataclass
class FakeClient:
    images: FakeImages


def client_with(*tags: str, fails: bool = False) -> FakeClient:
    return FakeClient(FakeImages([FakeImage([t]) for t in tags], fails))


@pytest.fixture(autouse=True)
def no_image_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IMAGE_ENV, raising=False)


def test_the_image_named_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(IMAGE_ENV, "rabbitmq:3.13")
    assert rabbitmq_image(client_with("reservoir/rabbitmq:3.10.8")) == "rabbitmq:3.13"


def test_the_newest_locally_built_image_is_the_default() -> None:
    client = client_with("reservoir/rabbitmq:3.9.29", "reservoir/rabbitmq:3.10.8", "other:9.9")
    assert rabbitmq_image(client) == "reservoir/rabbitmq:3.10.8"


def test_without_a_local_image_or_an_engine_the_pinned_upstream_image_is_used() -> None:
    assert rabbitmq_image(client_with("other:1.0")) == RABBITMQ_IMAGE
    assert rabbitmq_image(client_with("reservoir/rabbitmq:3.10.8", fails=True)) == RABBITMQ_IMAGE


@pytest.fixture
def fresh_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """testcontainers' global configuration as if nothing had set it, restored after."""
    for variable in (
        "TESTCONTAINERS_RYUK_DISABLED",
        "TESTCONTAINERS_HOST_OVERRIDE",
        "TC_HOST",
        "TESTCONTAINERS_CONNECTION_MODE",
        "DOCKER_HOST",
    ):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(testcontainers_config, "_ryuk_disabled", None)
    monkeypatch.setattr(testcontainers_config, "tc_host_override", None)
    monkeypatch.setattr(testcontainers_config, "connection_mode_override", None)
    monkeypatch.setattr(testcontainers_config, "tc_properties", {})


@pytest.mark.usefixtures("fresh_config")
def test_the_reaper_is_off_and_a_local_engine_is_reached_on_loopback() -> None:
    configure_testcontainers()
    assert testcontainers_config.ryuk_disabled is True
    assert testcontainers_config.tc_host_override == "127.0.0.1"
    assert testcontainers_config.connection_mode_override == ConnectionMode.docker_host


@pytest.mark.usefixtures("fresh_config")
def test_what_the_user_set_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESTCONTAINERS_RYUK_DISABLED", "false")
    monkeypatch.setenv("TESTCONTAINERS_HOST_OVERRIDE", "docker.example")
    monkeypatch.setattr(testcontainers_config, "tc_host_override", "docker.example")
    configure_testcontainers()
    assert testcontainers_config.ryuk_disabled is False
    assert testcontainers_config.tc_host_override == "docker.example"


@pytest.mark.usefixtures("fresh_config")
def test_a_remote_engine_is_not_reached_on_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DOCKER_HOST", "tcp://docker.example:2376")
    configure_testcontainers()
    assert testcontainers_config.ryuk_disabled is True
    assert testcontainers_config.tc_host_override is None
    assert testcontainers_config.connection_mode_override is None


def test_a_broker_not_started_here_is_managed_by_the_machines_rabbitmqctl() -> None:
    assert rabbitmqctl_command("amqp://guest:guest@127.0.0.1:5672/") == ["rabbitmqctl"]


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("RESERVOIR_TEST_AMQP_URL", raising=False)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv("DOCKER_HOST", f"unix://{tmp_path}/no-docker.sock")


@pytest.mark.usefixtures("no_engine")
def test_with_no_engine_the_test_is_skipped() -> None:
    with (
        pytest.raises(pytest.skip.Exception, match=r"no container of \S+ could start"),
        amqp_url_for_tests(),
    ):
        pytest.fail("a URL without an engine")


@pytest.mark.usefixtures("no_engine")
def test_with_no_engine_under_ci_the_test_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with (
        pytest.raises(pytest.fail.Exception, match="CI needs a RabbitMQ and has none"),
        amqp_url_for_tests(),
    ):
        pytest.fail("a URL without an engine")
