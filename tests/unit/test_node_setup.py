"""A node's configuration precedence, in the one place that holds it
(reservoir/runtime/node_setup.py): what discovery found, under the file, under the
environment and the flags; and the problems it finds, of the kind the command says."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from reservoir.protocol.ledger import Inventory
from reservoir.runtime.host import discover
from reservoir.runtime.node_config import NodeFile
from reservoir.runtime.node_setup import NodeFlags, NodeSetupError, node_setup
from tests.unit.test_host import fake_host

FILE = msgspec.convert(
    {
        "name": "from-file",
        "broker_url": "amqp://file/",
        "state_dir": "/var/lib/file",
        "metrics_port": 9100,
        "status_interval": 5.0,
        "traits": ["CUSTOM_FILE"],
        "inventory": {"VCPU": 8, "memory_mb": 2048},
        "allocation_ratio": {"VCPU": 4.0},
        "reserved": {"MEMORY_MB": 256},
        "discovery": {"reserved_memory_mb": 1024},
    },
    NodeFile,
)


def test_the_file_stands_where_no_flag_is_given() -> None:
    setup = node_setup(NodeFlags(), FILE, None)
    assert (setup.name, setup.broker_url) == ("from-file", "amqp://file/")
    assert setup.inventories == {
        "VCPU": Inventory(total=8, allocation_ratio=4.0),
        "MEMORY_MB": Inventory(total=2048, reserved=256),  # the file's key, upper-cased
    }
    assert (setup.state_dir, setup.metrics_port, setup.status_interval) == (
        Path("/var/lib/file"),
        9100,
        5.0,
    )
    assert setup.traits == ("CUSTOM_FILE",)


def test_flags_and_their_environment_override_the_file_class_by_class() -> None:
    flags = NodeFlags(
        name="from-flag",
        broker_url="amqp://flag/",  # --broker, or RESERVOIR_BROKER_URL read with it
        vcpus=3,
        inventory=("DISK_GB=10",),
        ratio=("VCPU=2.0",),
        traits=("CUSTOM_FLAG",),
        state_dir=Path("/srv/flag"),
        status_interval=0.5,
    )
    setup = node_setup(flags, FILE, None)
    assert (setup.name, setup.broker_url) == ("from-flag", "amqp://flag/")
    assert setup.inventories["VCPU"] == Inventory(total=3, allocation_ratio=2.0)
    assert setup.inventories["MEMORY_MB"] == Inventory(total=2048, reserved=256)
    assert setup.inventories["DISK_GB"] == Inventory(total=10)
    assert setup.traits == ("CUSTOM_FILE", "CUSTOM_FLAG")  # the flags add to the file's
    assert (setup.state_dir, setup.metrics_port, setup.status_interval) == (
        Path("/srv/flag"),
        9100,
        0.5,
    )


def test_the_file_overrides_what_discovery_found_and_the_flags_override_both(
    tmp_path: Path,
) -> None:
    host = discover(fake_host(tmp_path / "root"))
    setup = node_setup(NodeFlags(vcpus=3), FILE, host)
    assert setup.inventories["VCPU"].total == 3  # the flag over the file's 8 over the host's
    assert setup.inventories["PCPU"].total == 8  # only discovery names PCPU: its own
    assert setup.inventories["MEMORY_MB"] == Inventory(total=2048, reserved=256)
    assert "HW_CPU_HYPERTHREADING" in setup.traits
    assert setup.topology is not None and len(setup.topology.cells) == 2


def test_the_settings_take_the_layers_outcome_and_leave_task_drivers_to_the_environment() -> None:
    assert node_setup(NodeFlags(), FILE, None).settings_fields() == {
        "broker_url": "amqp://file/",
        "state_dir": Path("/var/lib/file"),
        "node_key": None,
        "task_drivers": None,  # not given: RESERVOIR_TASK_DRIVERS, else none
    }
    given = node_setup(NodeFlags(drivers=("exec",)), FILE, None).settings_fields()
    assert given["task_drivers"] == ("exec",)


@pytest.mark.parametrize(
    ("flags", "file", "kind", "words"),
    [
        (NodeFlags(), NodeFile(), "usage", "a node needs a name"),
        (NodeFlags(name="n"), NodeFile(), "no_broker", "no broker"),
        (NodeFlags(name="n", broker_url="memory://"), NodeFile(), "usage", "needs an inventory"),
        (NodeFlags(inventory=("VCPU",)), FILE, "value", "'VCPU': expected CLASS=TOTAL"),
        (NodeFlags(inventory=("VCPU=x",)), FILE, "value", "the total must be a whole number"),
        (NodeFlags(reserved=("PCPU=1",)), FILE, "value", "PCPU has no inventory"),
        (NodeFlags(hugepages=("2048=4",)), FILE, "usage", "give --numa-cells too"),
    ],
)
def test_a_configuration_that_cannot_run_is_refused_with_the_kind_the_command_says(
    flags: NodeFlags, file: NodeFile, kind: str, words: str
) -> None:
    with pytest.raises(NodeSetupError, match=words) as refused:
        node_setup(flags, file, None)
    assert refused.value.kind == kind
