"""A short chaos run in the default suite: real node and requestor processes on the real
RabbitMQ, every kind of fault injected, and the verdict of the audit, the nodes' ledgers
and the callers' record. The long run (``reservoir chaos`` with its defaults: 30 nodes,
8 requestors, 10,000 placements) is opt-in: ``--run-slow``."""

from __future__ import annotations

import pytest

from reservoir.tools.chaos.harness import FAULT_KINDS, run_chaos

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]


def test_a_short_chaos_run_meets_every_fault_and_every_count_is_zero(
    reservoir_amqp_broker_url: str,
) -> None:
    result = run_chaos(
        broker_url=reservoir_amqp_broker_url,
        seconds=9.0,  # the first five faults are every kind once, all in by 6.4 s
        seed=2026,
        nodes=6,
        requestors=3,
        placements=100_000,  # more than 9 s can place: the clock ends the placing
        interval_s=0.8,
        progress=print,
    )
    summary = result.as_json()
    assert result.ok, summary
    assert set(result.faults) == set(FAULT_KINDS), summary
    assert result.placements >= 50, summary
    assert result.nodes_answering == 6
    # every third placement carries a task: those held at the end were checked to run,
    # and no task of the run runs for a placement not held
    assert result.tasks_checked > 0, summary


@pytest.mark.slow
# Placing stops after at most 600 s (the harness's default), then reservations must expire
# and the audits run: 390-440 s when measured, past the suite's default of 300.
@pytest.mark.timeout(900)
def test_the_acceptance_chaos_run(reservoir_amqp_broker_url: str) -> None:
    result = run_chaos(broker_url=reservoir_amqp_broker_url, progress=print)
    summary = result.as_json()
    assert result.ok, summary
    assert result.placements >= 10_000, summary
