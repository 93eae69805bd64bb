"""Host discovery and the node configuration file: a fake /sys and /proc tree with two NUMA
cells, CPUs with siblings, huge pages of two sizes, a GPU on cell 0 and a NIC with four
virtual functions on cell 1; the machine's own /sys; and the file's typos."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from reservoir.cli import main
from reservoir.protocol.ledger import Inventory
from reservoir.protocol.messages import NumaSpec, Offer, ReservationRequest
from reservoir.protocol.node import NodeConfig, NodeMachine
from reservoir.runtime.host import cpu_traits, discover, parse_cpu_list
from reservoir.runtime.node_config import (
    ConfigError,
    NodeFile,
    devices_of,
    host_inventories,
    host_topology,
    inventories_of,
    load_node_file,
)

GPU = "0000:3b:00.0"
NIC = "0000:af:00.0"
VFS = [f"0000:af:00.{i}" for i in range(1, 5)]


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def fake_host(root: Path) -> Path:
    """Two cells of four CPUs (siblings 0+4, 1+5, 2+6, 3+7: cell 0 holds 0,1,4,5), 8 and
    16 GiB, 2 MiB and 1 GiB pages, one socket per cell; a GPU on cell 0, a NIC with four
    VFs on cell 1."""
    system = root / "sys/devices/system"
    write(system / "cpu/online", "0-7")
    for cpu in range(8):
        topology = system / f"cpu/cpu{cpu}/topology"
        write(topology / "thread_siblings_list", f"{cpu % 4},{cpu % 4 + 4}")
        write(topology / "physical_package_id", str((cpu % 4) // 2))
    for cell, (cpus, memory_kb) in enumerate([("0-1,4-5", 8 * 2**20), ("2-3,6-7", 16 * 2**20)]):
        node = system / f"node/node{cell}"
        write(node / "cpulist", cpus)
        write(
            node / "meminfo",
            f"Node {cell} MemTotal:       {memory_kb} kB\nNode {cell} MemFree: 1 kB",
        )
        write(node / "hugepages/hugepages-2048kB/nr_hugepages", "512")
        write(node / "hugepages/hugepages-1048576kB/nr_hugepages", str(cell + 1))
    pci = root / "sys/bus/pci/devices"

    def device(address: str, vendor: str, product: str, klass: str, cell: int) -> Path:
        directory = pci / address
        write(directory / "vendor", f"0x{vendor}")
        write(directory / "device", f"0x{product}")
        write(directory / "class", f"0x{klass}")
        write(directory / "numa_node", str(cell))
        return directory

    device(GPU, "10de", "20b0", "030200", 0)
    nic = device(NIC, "8086", "1592", "020000", 1)
    write(nic / "sriov_totalvfs", "4")
    for index, vf in enumerate(VFS):
        device(vf, "8086", "1889", "020000", 1)
        os.symlink(f"../{vf}", nic / f"virtfn{index}")
        os.symlink(f"../{NIC}", pci / vf / "physfn")
    device("0000:00:1f.0", "8086", "a1c8", "060100", -1)  # a bridge, no NUMA cell
    write(root / "proc/cpuinfo", "processor\t: 0\nflags\t\t: fpu sse4_2 avx2 aes ht\n")
    return root


CONFIG = """
name = "compute-1"
traits = ["CUSTOM_RACK_A"]

[discovery]
enabled = true
reserved_cpus = [0, 4]
reserved_memory_mb = 1024
excluded_devices = ["0000:af:00.4"]

[[pci.alias]]
name = "gpu-a100"
vendor_id = "10de"
product_id = "20b0"

[[pci.device_spec]]
vendor_id = "10de"

[[pci.device_spec]]
vendor_id = "8086"
product_id = "1889"
alias = "nic-vf"
"""


def test_discovery_reads_cells_siblings_huge_pages_devices_and_traits(tmp_path: Path) -> None:
    host = discover(fake_host(tmp_path))
    assert [c.cpus for c in host.cells] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert [c.memory_mb for c in host.cells] == [8192, 16384]
    assert [c.socket for c in host.cells] == [0, 1]
    assert host.cells[0].hugepages == {2048: 512, 1048576: 1}
    assert host.cells[1].hugepages == {2048: 512, 1048576: 2}
    assert host.siblings[1] == (1, 5)
    by_address = {d.address: d for d in host.pci}
    assert by_address[GPU].cell == 0 and by_address[GPU].vendor_id == "10de"
    assert by_address[NIC].kind == "type-PF" and by_address[NIC].virtual_functions == tuple(VFS)
    assert by_address[NIC].sriov_totalvfs == 4
    assert all(by_address[vf].physical_function == NIC for vf in VFS)
    assert all(by_address[vf].cell == 1 and by_address[vf].kind == "type-VF" for vf in VFS)
    assert by_address["0000:00:1f.0"].cell is None
    assert cpu_traits(host.cpu_flags) == {"HW_CPU_X86_AVX2", "HW_CPU_X86_SSE42", "HW_CPU_X86_AESNI"}
    assert cpu_traits(("aes", "sve", "avx2"), "aarch64") == {
        "HW_CPU_AARCH64_AES",
        "HW_CPU_AARCH64_SVE",
    }


def test_configuration_reduces_what_discovery_found(tmp_path: Path) -> None:
    write(tmp_path / "node.toml", CONFIG)
    config = load_node_file(tmp_path / "node.toml")
    host = discover(fake_host(tmp_path / "root"))
    found = host_inventories(host, config)
    assert found.totals["PCPU"] == found.totals["VCPU"] == 6  # CPUs 0 and 4 kept for the host
    assert found.totals["MEMORY_MB"] == 24576 and found.reserved == {"MEMORY_MB": 1024}
    assert "HW_CPU_HYPERTHREADING" in found.traits
    devices = devices_of(config, host)
    assert {(d.address, d.alias, d.cell) for d in devices} == {
        (GPU, "gpu-a100", 0),
        *((vf, "nic-vf", 1) for vf in VFS[:3]),
    }  # the PF is not matched, the excluded VF is left out, the bridge has no spec
    topology = host_topology(host, config, devices)
    assert topology.cells[0].cpus == frozenset({1, 5})


def test_a_discovered_node_places_a_pinned_request_with_its_gpu(tmp_path: Path) -> None:
    write(tmp_path / "node.toml", CONFIG)
    config = load_node_file(tmp_path / "node.toml")
    host = discover(fake_host(tmp_path / "root"))
    found = host_inventories(host, config)
    node = NodeMachine(
        NodeConfig(
            name="compute-1",
            address="reservoir.node.compute-1",
            inventories=inventories_of(found.totals, {}, found.reserved),
            numa=host_topology(host, config, devices_of(config, host)),
        )
    )
    node.start(0.0)
    ask = ReservationRequest(
        request_id="r1", sender="req", reply_to="inbox", tier=100, attempt=1, ttl_s=5.0,
        resources={"PCPU": 2, "MEMORY_MB": 1024}, numa=NumaSpec(dedicated_cpus=True),
        pci={"gpu-a100": 1}, numa_policy="required",
    )  # fmt: skip
    assert any(isinstance(getattr(e, "message", None), Offer) for e in node.handle(ask, 0.0))
    reservation = node.ledger.reservation_for("r1")
    assert reservation is not None
    (placement,) = reservation.numa
    assert placement.devices == (GPU,) and placement.cells == (0,)
    assert set(placement.cpus) == {1, 5}


def test_discovery_on_this_machine_gives_a_node_that_places_a_request() -> None:
    host = discover("/")
    assert host.cpus, "the machine has online CPUs"
    assert host.memory_mb > 0
    config = NodeFile()
    found = host_inventories(host, config)
    node = NodeMachine(
        NodeConfig(
            name="here",
            address="reservoir.node.here",
            inventories=inventories_of(found.totals, {}, {}),
            traits=found.traits,
            numa=host_topology(host, config, ()),
        )
    )
    node.start(0.0)
    ask = ReservationRequest(
        request_id="r1", sender="req", reply_to="inbox", tier=100, attempt=1, ttl_s=5.0,
        resources={"PCPU": 1, "MEMORY_MB": 64}, numa=NumaSpec(dedicated_cpus=True),
    )  # fmt: skip
    assert any(isinstance(getattr(e, "message", None), Offer) for e in node.handle(ask, 0.0))
    assert node.ledger.violations() == []


def test_the_cpu_list_format_is_read() -> None:
    assert parse_cpu_list("0-2,8,10-11\n") == (0, 1, 2, 8, 10, 11)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name = 'n'\nmetrics_prot = 9100\n",
         "node.toml, line 2: metrics_prot: Object contains unknown field"),
        ("name = 'n'\n\n[discovery]\nenabled = true\nroot = 5\n",
         "node.toml, line 5: discovery.root: Expected `str`"),
        ("[[pci.device_spec]]\naddress = '0000:01:00.0'\n[[pci.device_spec]]\nvendor = '10de'\n",
         "node.toml, line 4: pci.device_spec.vendor: Object contains unknown field `vendor`"),
        ("[inventory]\nVCPU = 8\nPCPU = 'eight'\n",
         "node.toml, line 3: inventory.PCPU: Expected `int`"),
    ],
)  # fmt: skip
def test_a_typo_in_the_file_is_one_line_naming_the_file_the_line_and_the_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    write(tmp_path / "node.toml", text)
    with pytest.raises(ConfigError) as raised:
        load_node_file(tmp_path / "node.toml")
    assert expected in str(raised.value)
    assert "\n" not in str(raised.value)


def test_the_command_says_a_typo_in_one_line_and_exits_2(tmp_path: Path) -> None:
    write(tmp_path / "node.toml", "name = 'n'\nvcpu = 8\n")
    done = CliRunner().invoke(main, ["node", "--config", str(tmp_path / "node.toml")])
    assert done.exit_code == 2
    assert done.output.strip().splitlines() == [
        f"reservoir node: --config {tmp_path / 'node.toml'}, line 2: vcpu: "
        "Object contains unknown field `vcpu`"
    ]


def test_discover_print_shows_a_table_and_json(tmp_path: Path) -> None:
    write(tmp_path / "node.toml", CONFIG)
    root = fake_host(tmp_path / "root")
    args = ["node", "--config", str(tmp_path / "node.toml"), "--discover", "--root", str(root)]
    table = CliRunner().invoke(main, [*args, "--print"])
    assert table.exit_code == 0, table.output
    assert "0-1,4-5" in table.output and "type-PF (4 VFs)" in table.output
    assert f"{GPU}" in table.output and "gpu-a100" in table.output
    shown = CliRunner().invoke(main, [*args, "--print", "--json"])
    found = json.loads(shown.output)
    assert found["devices"][GPU] == "gpu-a100"
    assert found["inventory"]["PCPU"] == 6
    assert "HW_CPU_X86_AVX2" in found["traits"]
    assert [c["cell_id"] for c in found["cells"]] == [0, 1]


def test_inventories_refuse_a_ratio_for_a_class_without_a_total() -> None:
    with pytest.raises(ValueError, match="DISK_GB has no inventory"):
        inventories_of({"VCPU": 4}, {"DISK_GB": 2.0}, {})
    assert inventories_of({"VCPU": 4}, {"VCPU": 2.0}, {})["VCPU"] == Inventory(
        total=4, allocation_ratio=2.0
    )


def test_a_node_runs_with_its_file_and_discovery_and_flags_override_the_file(
    tmp_path: Path,
) -> None:
    write(tmp_path / "node.toml", CONFIG + "\n[allocation_ratio]\nVCPU = 4.0\n")
    root = fake_host(tmp_path / "root")
    process = subprocess.Popen(
        [sys.executable, "-m", "reservoir.cli", "node", "--broker", "memory://",
         "--config", str(tmp_path / "node.toml"), "--root", str(root),
         "--name", "from-flag", "--vcpus", "3"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert process.stderr is not None
    try:
        for line in process.stderr:
            if "configuration" in line:
                break
        else:
            raise AssertionError("the node never logged its configuration")
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=20)
    running = json.loads(line.split("configuration ", 1)[1])
    assert "node from-flag: configuration" in line  # --name overrides the file's name
    assert running["inventory"]["VCPU"] == {"total": 3, "reserved": 0, "allocation_ratio": 4.0}
    assert running["inventory"]["PCPU"]["total"] == 6  # discovered, CPUs 0 and 4 kept
    assert running["inventory"]["MEMORY_MB"]["reserved"] == 1024
    assert running["discovered_under"] == str(root)
    assert {d["alias"] for d in running["pci_devices"]} == {"gpu-a100", "nic-vf"}
    assert "CUSTOM_RACK_A" in running["traits"] and "HW_CPU_X86_AVX2" in running["traits"]
