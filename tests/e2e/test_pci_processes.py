"""End to end on RabbitMQ: two ``reservoir node --config`` processes whose files describe
PCI devices on NUMA cells; ``reservoir request --pci ... --numa-policy required`` places on
the node and cell that hold the device, and a request no cell can satisfy is refused with
the reason; ``reservoir audit`` then finds every invariant holding."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from reservoir.brokers import connect

pytestmark = [pytest.mark.rabbitmq, pytest.mark.e2e]

NODE_FILE = """
name = "{name}"
broker_url = "{url}"
state_dir = "{state_dir}"
status_interval = 0.2

[inventory]
PCPU = 8
MEMORY_MB = 16384

[numa]
cells = 2

[[pci.alias]]
name = "gpu-a100"
vendor_id = "10de"
product_id = "20b0"

[[pci.device_spec]]
address = "{address}"
vendor_id = "{vendor}"
product_id = "{product}"
alias = "{alias}"
numa_cell = {cell}
"""


def reservoir(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "reservoir.cli", *args],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


def start_node(config: Path, env: dict[str, str]) -> tuple[subprocess.Popen[str], list[str]]:
    process = subprocess.Popen(
        [sys.executable, "-m", "reservoir.cli", "node", "--config", str(config)],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    said: list[str] = []
    deadline = time.monotonic() + 20
    while not any("ready" in line for line in said):
        assert time.monotonic() < deadline, f"{config} never got ready: {said}"
        with contextlib.suppress(queue.Empty):
            said.append(lines.get(timeout=max(deadline - time.monotonic(), 0.01)))
    return process, said


@pytest.fixture
def env(reservoir_amqp_broker_url: str) -> Iterator[dict[str, str]]:
    exchange = f"e2e-pci-{uuid.uuid4().hex[:10]}"
    separator = "&" if "?" in reservoir_amqp_broker_url else "?"
    url = f"{reservoir_amqp_broker_url}{separator}exchange={exchange}"
    yield {**os.environ, "RESERVOIR_BROKER_URL": url}
    with connect(url) as broker:
        broker.delete_exchanges()  # type: ignore[attr-defined]


def test_a_gpu_request_lands_on_the_node_and_cell_holding_the_gpu(
    env: dict[str, str], tmp_path: Path
) -> None:
    devices = {
        # the A100 on cell 1 of gpu-node (its alias from [[pci.alias]]); a NIC on nic-node
        "gpu-node": ("0000:af:00.0", "10de", "20b0", 1, ""),
        "nic-node": ("0000:3b:00.0", "8086", "1592", 0, "nic"),
    }
    processes: list[subprocess.Popen[str]] = []
    try:
        for name, (address, vendor, product, cell, alias) in devices.items():
            config = tmp_path / f"{name}.toml"
            config.write_text(
                NODE_FILE.format(name=name, url=env["RESERVOIR_BROKER_URL"], state_dir=tmp_path,
                                 address=address, vendor=vendor, product=product, cell=cell,
                                 alias=alias)
            )  # fmt: skip
            # the broker's URL from the file alone
            node_env = {k: v for k, v in env.items() if k != "RESERVOIR_BROKER_URL"}
            process, said = start_node(config, node_env)
            processes.append(process)
            configuration = next(line for line in said if "configuration" in line)
            assert address in configuration  # the configuration it runs with is logged
        ask = ["request", "--json", "--timeout", "10", "--resource", "PCPU=2",
               "--memory-mb", "1024", "--numa-nodes", "1", "--pinned",
               "--numa-policy", "required"]  # fmt: skip
        two = reservoir(*ask, "--pci", "gpu-a100:2", env=env)
        assert two.returncode == 1, two.stderr
        refused = json.loads(two.stdout)
        assert refused["placed"] is False
        assert (
            "no free gpu-a100 on the NUMA cell of 2 free dedicated CPUs (numa_policy required)"
            in refused["reasons"]
        ), refused
        assert "the node has no PCI device with alias gpu-a100" in refused["reasons"]

        one = reservoir(*ask, "--pci", "gpu-a100:1", env=env)
        assert one.returncode == 0, one.stderr
        (allocation,) = json.loads(one.stdout)["allocations"]
        assert allocation["node"] == "gpu-node"
        assert allocation["numa"]["devices"] == ["0000:af:00.0"]
        assert allocation["numa"]["cells"] == [1]
        assert set(allocation["numa"]["cpus"]) <= {4, 5, 6, 7}  # cell 1's CPUs

        again = reservoir(*ask, "--pci", "gpu-a100:1", env=env)
        assert again.returncode == 1  # the one A100 is held
        listed = reservoir("nodes", "--configuration", "--json", "--expect-nodes", "2", env=env)
        configurations = {n["name"]: n["configuration"] for n in json.loads(listed.stdout)}
        assert configurations["gpu-node"]["pci_devices"] == [
            {"address": "0000:af:00.0", "alias": "gpu-a100", "cell": 1}
        ]
        assert configurations["nic-node"]["config_file"] == str(tmp_path / "nic-node.toml")
        audited = reservoir("audit", "--expect-nodes", "2", env=env)
        assert audited.returncode == 0, audited.stdout + audited.stderr
    finally:
        for process in processes:
            process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
