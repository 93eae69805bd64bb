"""Long runs, opt in with ``--run-slow``: many more hypothesis examples on bigger
clusters, and a real-time soak of the embedded runtime."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reservoir.tools.demo import run_demo

from . import test_invariants as base

pytestmark = pytest.mark.slow

SOAK = settings(max_examples=1000, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow])  # fmt: skip


@SOAK
@given(
    network=base.faults,
    node_count=st.integers(2, 40),
    requestor_count=st.integers(1, 8),
    request_count=st.integers(1, 120),
    workload_seed=st.integers(0, 2**32 - 1),
)
def test_soak_invariants_hold_whatever_the_network_does(
    network: object,
    node_count: int,
    requestor_count: int,
    request_count: int,
    workload_seed: int,
) -> None:
    base.test_invariants_hold_whatever_the_network_does.hypothesis.inner_test(  # type: ignore[attr-defined]
        network, node_count, requestor_count, request_count, workload_seed
    )


@SOAK
@given(
    seed=st.integers(0, 2**32 - 1),
    requestor_count=st.integers(2, 6),
    duplicate=st.sampled_from([0.0, 0.2]),
    delay_s=st.sampled_from([(0.0, 0.0), (0.0, 0.002), (0.0, 0.02)]),
)
def test_soak_requestors_sharing_ids_place_each_once(
    seed: int, requestor_count: int, duplicate: float, delay_s: tuple[float, float]
) -> None:
    base.test_requestors_given_the_same_ids_at_once_place_each_id_once.hypothesis.inner_test(  # type: ignore[attr-defined]
        seed, requestor_count, duplicate, delay_s
    )


def test_a_long_real_time_demo_keeps_every_invariant() -> None:
    # about half the cloud: every request fits, however they race
    result = run_demo(nodes=100, requests=5_000, concurrency=16, seed=7)
    assert result.invariants_hold
    assert result.failed == 0
