"""The dashboard's parts that need no browser: the per-replica ring of recent outcomes
(:mod:`reservoir.service.activity`) on a fake clock, and the routes (``/``, ``/ui/``, its
assets, ``/v1/activity``) of the ``reservoir serve`` app against an in-process cluster."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from reservoir import NodeAgent, audit
from reservoir.brokers.inprocess import InProcessBroker
from reservoir.clock import FakeClock
from reservoir.service import ReservoirService, create_app
from reservoir.service.activity import MAX_BUCKETS, Activity, percentile
from reservoir.service.dashboard import ASSETS
from reservoir.testing.asgi import serving


def test_the_ring_summarises_rate_percentiles_failures_and_the_last_placements() -> None:
    clock = FakeClock()
    activity = Activity(now=clock.now)
    for i in range(100):
        activity.placed(f"r{i}", elapsed_s=(i + 1) / 1000, nodes=["a", "b"] if i % 2 else ["a"])
        clock.advance(0.5)  # 100 placements over 50 s
    activity.failed("late", 2.0, "timeout")
    activity.failed("big", 0.1, "not placed: VCPU exhausted")
    activity.failed("big2", 0.1, "not placed: VCPU exhausted")

    summary = activity.summary(window_s=300, bucket_s=10)

    assert summary["scope"] == "replica"
    assert summary["placed"] == 100 and summary["attempts"] == 103
    assert summary["placements_per_s"] == pytest.approx(100 / 50)  # it has seen 50 s only
    assert summary["p50_s"] == 0.05 and summary["p99_s"] == 0.099
    assert summary["failures"] == {"not placed: VCPU exhausted": 2, "timeout": 1}
    assert sum(summary["placed_per_bucket"]) == 100
    assert len(summary["placed_per_bucket"]) == 30
    # placed at ages 50, 49.5, ..., 0.5 s: ten-second buckets, the oldest one placement
    assert summary["placed_per_bucket"][-6:] == [1, 20, 20, 20, 20, 19]
    assert [r["request_id"] for r in summary["recent"][:4]] == ["big2", "big", "late", "r99"]
    assert summary["recent"][3]["nodes"] == ["a", "b"]


def test_what_left_the_window_is_not_counted_and_the_ring_is_bounded() -> None:
    clock = FakeClock()
    activity = Activity(capacity=10, now=clock.now)
    for i in range(25):
        activity.placed(f"r{i}", 0.01, ["a"])
    assert len(activity.outcomes) == 10
    clock.advance(301)
    activity.placed("now", 0.02, ["b"])
    summary = activity.summary(window_s=300)
    assert summary["placed"] == 1 and summary["p50_s"] == 0.02
    assert summary["placements_per_s"] == round(1 / 60, 3)


def test_a_summary_has_at_most_max_buckets_whatever_it_is_asked_for() -> None:
    clock = FakeClock()
    activity = Activity(now=clock.now)
    activity.placed("r", 0.01, ["a"])
    finest = activity.summary(window_s=3600, bucket_s=1)
    assert len(finest["placed_per_bucket"]) == MAX_BUCKETS == 3600
    for window_s, bucket_s in [(300, 5e-324), (300, 1e-300), (300, 1e-11), (300, 1e-5),
                               (300, 0.5), (300, 0), (300, float("nan")), (3601, 10),
                               (float("inf"), 10), (10, 60)]:  # fmt: skip
        with pytest.raises(ValueError, match=r"window_s|bucket_s"):
            activity.summary(window_s=window_s, bucket_s=bucket_s)


def test_percentile_is_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([1.0], 0.99) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0


def test_the_app_serves_the_page_its_assets_and_this_replicas_activity(
    broker: InProcessBroker,
) -> None:
    nodes = [NodeAgent(broker, name=f"dash-{i}", vcpus=4, memory_mb=4096) for i in range(2)]
    app = create_app(broker)

    async def scenario() -> None:
        async with serving(app) as client:
            service = app.state.reservoir
            assert isinstance(service, ReservoirService)
            root = await client.get("/", follow_redirects=False)
            assert root.status_code == 307 and root.headers["location"] == "/ui/"
            page = await client.get("/ui/")
            assert page.status_code == 200
            assert page.headers["content-type"].startswith("text/html")
            # everything the page loads is one of its own assets, by a relative name
            loaded = re.findall(r'(?:src|href)="([^"#]+)"', page.text)
            assets = [name for name in loaded if not name.startswith(("..", "data:"))]
            assert sorted(assets) == sorted(n for n in ASSETS if n != "index.html")
            assert not any("://" in name for name in loaded)
            for name in assets:
                asset = await client.get(f"/ui/{name}")
                assert asset.status_code == 200 and asset.headers["content-type"] == ASSETS[name]
                assert "http://" not in asset.text.replace("http://www.w3.org/2000/svg", "")
                assert "https://" not in asset.text
            missing = await client.get("/ui/secrets.txt")
            assert missing.status_code == 404
            long_name = await client.get("/ui/" + "x" * 10_000)
            assert long_name.status_code == 404 and len(long_name.content) < 1000

            placed = await client.post("/v1/reservations", json={"vcpus": 1, "memory_mb": 256})
            assert placed.status_code == 201
            refused = await client.post("/v1/reservations", json={"vcpus": 64, "memory_mb": 1})
            assert refused.status_code == 409
            seen = (await client.get("/v1/activity")).json()
            assert seen["placed"] == 1 and seen["attempts"] == 2
            [reason] = seen["failures"]
            assert reason.startswith("not placed")
            newest, oldest = seen["recent"]
            assert oldest["request_id"] == placed.json()["request_id"]
            assert oldest["nodes"] == [placed.json()["allocations"][0]["node"]]
            assert newest["result"] == reason
            bad = await client.get("/v1/activity", params={"window_s": 10, "bucket_s": 60})
            assert bad.status_code == 422 and "bucket_s" in bad.text
            await bad_spans_are_422_problems_naming_the_parameter(client)
            audit(
                [n.snapshot() for n in nodes], list(service.placements.values())
            ).raise_if_failed()

    try:
        asyncio.run(scenario())
    finally:
        for node in nodes:
            node.close()


async def bad_spans_are_422_problems_naming_the_parameter(client: httpx.AsyncClient) -> None:
    """Each a 422 problem naming the parameter, at once (a tiny bucket once overflowed into
    a 500, or built a 60 MB body over seconds)."""
    for parameter, value in [
        ("bucket_s", "5e-324"),
        ("bucket_s", "1e-300"),
        ("bucket_s", "1e-11"),
        ("bucket_s", "1e-5"),
        ("bucket_s", "0.5"),
        ("bucket_s", "nan"),
        ("bucket_s", "-inf"),
        ("window_s", "1e999"),
        ("window_s", "0"),
        ("window_s", "many"),
    ]:
        answer = await client.get("/v1/activity", params={parameter: value})
        assert answer.status_code == 422, (parameter, value, answer.text[:200])
        assert answer.headers["content-type"] == "application/problem+json"
        [error] = answer.json()["errors"]
        assert error["field"] == f"query.{parameter}", (value, error)
        assert len(answer.content) < 1000
