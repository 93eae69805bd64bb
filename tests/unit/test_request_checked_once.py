"""A request is checked once on its way in, whichever door it comes through: the check is a
round trip through the wire format (``checked_request``), counted here by the decodes into
a ``PlacementRequest`` it makes. The edge makes a ``CheckedRequest``; the requestor places
it as it is, and checks once what comes to it unchecked."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest
from click.testing import CliRunner

from reservoir import PlacementError, Requestor
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.cli import main
from reservoir.protocol.messages import TaskSpec
from reservoir.protocol.placement import InvalidRequest, PlacementRequest
from reservoir.runtime.checked_request import CheckedRequest
from reservoir.service import create_app
from reservoir.testing.asgi import serving


@pytest.fixture
def broker() -> Iterator[InProcessBroker]:
    broker = InProcessBroker()
    yield broker
    broker.close()


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every check of a request made from now on: what each decoded."""
    made: list[bytes] = []
    decode = msgspec.json.decode

    def counted(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("type") is PlacementRequest:
            made.append(args[0])
        return decode(*args, **kwargs)

    monkeypatch.setattr(msgspec.json, "decode", counted)
    return made


class Shared:
    """The test's broker, as the command opens it; closing it is the test's business."""

    def __init__(self, broker: InProcessBroker) -> None:
        self._broker = broker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._broker, name)

    def close(self) -> None:
        pass


def not_placed(requestor: Requestor, *args: Any, **fields: Any) -> None:
    """Placed on a cluster of no node: the request goes in, and times out."""
    with pytest.raises(PlacementError):
        requestor.reserve(*args, timeout_s=0.2, **fields)


def test_the_librarys_keywords_are_checked_once(
    broker: InProcessBroker, checks: list[bytes]
) -> None:
    with Requestor(broker) as requestor:
        not_placed(requestor, vcpus=1, memory_mb=64)
    assert len(checks) == 1


def test_a_library_callers_own_placement_request_is_checked_once_by_the_requestor(
    broker: InProcessBroker, checks: list[bytes]
) -> None:
    with Requestor(broker) as requestor:
        not_placed(requestor, PlacementRequest(resources={"VCPU": 1}))
        assert len(checks) == 1
        with pytest.raises(InvalidRequest, match="request_id"):
            requestor.submit(PlacementRequest(resources={"VCPU": 1}, request_id="no spaces"))


def test_a_checked_request_is_placed_as_it_is(broker: InProcessBroker, checks: list[bytes]) -> None:
    checked = CheckedRequest.of(vcpus=1, memory_mb=64)
    assert len(checks) == 1
    with Requestor(broker) as requestor:
        not_placed(requestor, checked)
    assert len(checks) == 1


def test_a_checked_request_is_made_only_by_checking() -> None:
    with pytest.raises(TypeError, match=r"CheckedRequest\.of or \.check"):
        CheckedRequest(PlacementRequest(resources={"VCPU": 1}), object())
    checked = CheckedRequest.check(PlacementRequest(resources={"VCPU": 1}))
    with pytest.raises(AttributeError):
        checked.request = PlacementRequest(resources={"VCPU": 1000})  # type: ignore[misc]


def test_a_task_run_by_its_words_or_as_a_checked_request_is_checked_once(
    broker: InProcessBroker, checks: list[bytes]
) -> None:
    with Requestor(broker) as requestor:
        by_words = requestor.run(["true"], vcpus=1, timeout_s=0.2)
        with pytest.raises(PlacementError):
            by_words.placement.result(timeout=5)
        assert len(checks) == 1
        task = TaskSpec(driver="exec", command=("true",))
        by_request = requestor.run(request=CheckedRequest.of(vcpus=1, task=task), timeout_s=0.2)
        with pytest.raises(PlacementError):
            by_request.placement.result(timeout=5)
        assert len(checks) == 2
        with pytest.raises(TypeError, match="not both"):
            requestor.run(["false"], request=CheckedRequest.of(vcpus=1, task=task))


def test_reservoir_request_checks_its_options_once(
    broker: InProcessBroker, checks: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("reservoir.brokers.connect", lambda url: Shared(broker))
    done = CliRunner().invoke(
        main, ["request", "--broker", "memory://", "--vcpus", "1", "--timeout", "0.2"]
    )
    assert done.exit_code == 1, done.output  # not placed: nobody answered
    assert len(checks) == 1


def test_reservoir_run_checks_its_options_and_its_task_once(
    broker: InProcessBroker, checks: list[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("reservoir.brokers.connect", lambda url: Shared(broker))
    done = CliRunner().invoke(
        main, ["run", "--broker", "memory://", "--timeout", "0.2", "--", "true"]
    )
    assert "not placed" in done.output, done.output
    assert len(checks) == 1


def test_the_http_body_is_checked_once(broker: InProcessBroker, checks: list[bytes]) -> None:
    async def post() -> httpx.Response:
        async with serving(create_app(broker)) as client:
            return await client.post("/v1/reservations", json={"vcpus": 1, "timeout_s": 0.2})

    assert asyncio.run(post()).status_code == 409  # not placed: no node
    assert len(checks) == 1
