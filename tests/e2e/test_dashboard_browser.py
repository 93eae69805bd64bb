"""The live dashboard in a real headless browser (Debian's chromium and chromium-driver,
driven by selenium) against a real ``reservoir serve`` process with three real
``reservoir node`` processes on a real RabbitMQ: the page shows the test's nodes by tier and
in the table, and a placement made during the test in its last placements, with the node
chosen. A screenshot is saved under the test's temporary directory (its path is printed).

Skipped outside CI when no browser is installed; under CI (``CI`` set) a missing browser
fails the test (.ci/run installs chromium and chromium-driver with apt when missing)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from reservoir.testing.processes import ProcessCluster, free_port
from tests.e2e.serving import wait_until_ready

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]

RUN = uuid.uuid4().hex[:6]
NODES = tuple(f"dash-{RUN}-{letter}" for letter in "abc")


def _browser() -> Any:
    """A headless chromium through chromedriver, or a skip (a failure under CI)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        chromium = None
    if chromium is None or driver_path is None:
        message = "needs chromium, chromium-driver (apt) and selenium (the test extra)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}: .ci/run installs them")
        pytest.skip(message)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu",
                     "--disable-dev-shm-usage", "--window-size=1400,1800"):  # fmt: skip
        options.add_argument(argument)
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)


@pytest.fixture
def service(reservoir_amqp_url: str, tmp_path: Path) -> Iterator[str]:
    """The base URL of a ``reservoir serve`` before three node processes."""
    # the environment passes through: PYTHONPATH says where this tree's reservoir is
    with ProcessCluster(reservoir_amqp_url, tmp_path) as cluster:
        for i, name in enumerate(NODES):
            cluster.start_node(name, vcpus=4 * (i + 1), memory_mb=8192)
        port = free_port()
        cluster.start("serve", "serve", "--port", str(port))
        base_url = f"http://127.0.0.1:{port}"
        wait_until_ready(base_url, cluster.started[-1])
        yield base_url


def _until(what: str, check: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"the dashboard never showed {what}")
        time.sleep(0.2)  # the page polls on its own timers: look again shortly


def test_the_dashboard_shows_the_nodes_and_a_placement_made_during_the_test(
    service: str, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By

    browser = _browser()
    try:
        browser.get(f"{service}/")  # redirected to /ui/
        assert browser.current_url == f"{service}/ui/"

        def loaded_nodes() -> int:
            return int(browser.find_element(By.TAG_NAME, "body").get_attribute(
                "data-nodes-loaded") or 0)  # fmt: skip

        _until("three nodes", lambda: loaded_nodes() == 3)
        rows = browser.find_elements(By.CSS_SELECTOR, "#nodes tbody tr")
        assert sorted(r.get_attribute("data-node") for r in rows) == sorted(NODES)
        cells = browser.find_elements(By.CSS_SELECTOR, "#tiers rect[data-node]")
        # one heatmap cell per node and resource class, in its tier
        assert {c.get_attribute("data-node") for c in cells} == set(NODES)
        assert browser.find_elements(By.CSS_SELECTOR, "#tiers .tier")

        request_id = f"dash-{RUN}-web-1"
        placed = httpx.post(
            f"{service}/v1/reservations",
            json={"vcpus": 3, "memory_mb": 1024},
            headers={"Idempotency-Key": request_id},
            timeout=30.0,
        )
        assert placed.status_code == 201, placed.text
        [allocation] = placed.json()["allocations"]
        row = f'#recent tr[data-request-id="{request_id}"]'
        _until("the placement", lambda: bool(browser.find_elements(By.CSS_SELECTOR, row)), 15.0)
        shown = browser.find_element(By.CSS_SELECTOR, f"{row} td.placed-on").text
        assert shown == allocation["node"]
        assert browser.find_element(By.ID, "rate").text not in ("", "\u2013")  # drawn
        # the node's table row shows the allocation once the next ledger report is drawn
        holder = f'#nodes tr[data-node="{allocation["node"]}"] td:nth-child(4)'
        _until("the allocation on its node", lambda: browser.find_element(
            By.CSS_SELECTOR, holder).text == "1")  # fmt: skip

        screenshot = tmp_path / "dashboard.png"
        assert browser.save_screenshot(str(screenshot))
        assert screenshot.stat().st_size > 10_000
        print(f"dashboard screenshot: {screenshot}")
        console = [e for e in browser.get_log("browser") if e.get("level") == "SEVERE"]
        assert console == [], console
    finally:
        browser.quit()
