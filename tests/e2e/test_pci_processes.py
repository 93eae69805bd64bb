"""End to end on RabbitMQ: two ``reservoir node --config`` processes whose files describe
PCI devices on NUMA cells; ``reservoir request --pci ... --numa-policy required`` places on
the node and cell that hold the device, and a request no cell can satisfy is refused with
the reason; ``reservoir audit`` then finds every invariant holding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reservoir.testing import ProcessCluster
from reservoir.testing.processes import NODE_READY

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


def test_a_gpu_request_lands_on_the_node_and_cell_holding_the_gpu(
    reservoir_process_cluster: ProcessCluster, tmp_path: Path
) -> None:
    cluster = reservoir_process_cluster
    devices = {
        # the A100 on cell 1 of gpu-node (its alias from [[pci.alias]]); a NIC on nic-node
        "gpu-node": ("0000:af:00.0", "10de", "20b0", 1, ""),
        "nic-node": ("0000:3b:00.0", "8086", "1592", 0, "nic"),
    }
    for name, (address, vendor, product, cell, alias) in devices.items():
        config = tmp_path / f"{name}.toml"
        config.write_text(
            NODE_FILE.format(
                name=name,
                url=cluster.url,
                state_dir=tmp_path,
                address=address,
                vendor=vendor,
                product=product,
                cell=cell,
                alias=alias,
            )
        )
        # the broker's URL from the file alone
        node_env = {k: v for k, v in cluster.env.items() if k != "RESERVOIR_BROKER_URL"}
        node = cluster.start(name, "node", "--config", str(config), env=node_env)
        node.wait_for(NODE_READY)
        configuration = next(line for line in node.said if "configuration" in line)
        assert address in configuration  # the configuration it runs with is logged
    ask = [
        "request",
        "--json",
        "--timeout",
        "10",
        "--resource",
        "PCPU=2",
        "--memory-mb",
        "1024",
        "--numa-nodes",
        "1",
        "--pinned",
        "--numa-policy",
        "required",
    ]
    two = cluster.run(*ask, "--pci", "gpu-a100:2")
    assert two.returncode == 1, two.stderr
    refused = json.loads(two.stdout)
    assert refused["placed"] is False
    assert (
        "no free gpu-a100 on the NUMA cell of 2 free dedicated CPUs (numa_policy required)"
        in refused["reasons"]
    ), refused
    assert "the node has no PCI device with alias gpu-a100" in refused["reasons"]

    one = cluster.run(*ask, "--pci", "gpu-a100:1")
    assert one.returncode == 0, one.stderr
    (allocation,) = json.loads(one.stdout)["allocations"]
    assert allocation["node"] == "gpu-node"
    assert allocation["numa"]["devices"] == ["0000:af:00.0"]
    assert allocation["numa"]["cells"] == [1]
    assert set(allocation["numa"]["cpus"]) <= {4, 5, 6, 7}  # cell 1's CPUs

    again = cluster.run(*ask, "--pci", "gpu-a100:1")
    assert again.returncode == 1  # the one A100 is held
    listed = cluster.run("nodes", "--configuration", "--json", "--expect-nodes", "2")
    configurations = {n["name"]: n["configuration"] for n in json.loads(listed.stdout)}
    assert configurations["gpu-node"]["pci_devices"] == [
        {"address": "0000:af:00.0", "alias": "gpu-a100", "cell": 1}
    ]
    assert configurations["nic-node"]["config_file"] == str(tmp_path / "nic-node.toml")
    audited = cluster.run("audit", "--expect-nodes", "2")
    assert audited.returncode == 0, audited.stdout + audited.stderr
