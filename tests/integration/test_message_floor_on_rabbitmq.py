"""benchmarks/message_floor.py on a real RabbitMQ: both floors carry every placement's
seven messages between real processes, and leave no exchange behind."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from types import ModuleType

import pytest

from tests.integration.conftest import Rabbitmqctl


@pytest.fixture(scope="module")
def floor(benchmark_script: Callable[[str], ModuleType]) -> ModuleType:
    return benchmark_script("message_floor")


@pytest.mark.parametrize("callers", ["io", "threads"])
def test_a_floor_run_carries_seven_messages_a_placement_between_processes(
    floor: ModuleType, amqp_url: str, callers: str
) -> None:
    args = argparse.Namespace(
        broker=amqp_url, nodes=6, node_processes=2, requestors=3, placements=40, seed=1
    )

    run = floor.run_floor(args, callers)

    assert run.messages_per_placement == 7.0
    assert set(run.cpu_ms_per_placement) >= {"this process", "nodes"}
    assert run.placements_per_s > 0


def test_the_sequential_floor_times_placements_against_round_trips(
    floor: ModuleType, amqp_url: str
) -> None:
    args = argparse.Namespace(broker=amqp_url, nodes=4, node_processes=2, sequential=30, seed=1)

    run = floor.run_sequential(args)

    # a placement is four hops one after another (request, offer, award, accepted), a
    # round trip two
    assert run.place_p50_ms > run.rtt_p50_ms > 0
    # the ratio is of the unrounded medians, the milliseconds are rounded to the microsecond
    assert run.place_p50_over_rtt == pytest.approx(run.place_p50_ms / run.rtt_p50_ms, abs=0.01)


def test_a_floor_run_leaves_no_exchange_of_its_own(
    floor: ModuleType, amqp_url: str, rabbitmqctl: Rabbitmqctl
) -> None:
    args = argparse.Namespace(
        broker=amqp_url, nodes=2, node_processes=1, requestors=1, placements=5, seed=1
    )

    floor.run_floor(args, "io")

    assert "reservoir.messagefloor." not in rabbitmqctl("list_exchanges", "name")
