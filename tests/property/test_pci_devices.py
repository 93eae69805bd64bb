"""Property: however requests for PCI devices race, with every NUMA affinity policy, no
device is ever held by two instances and a ``required`` device always sits on one of its
instance's cells; every example ends with the invariant audit, which checks devices too."""

from __future__ import annotations

import concurrent.futures
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reservoir.brokers.inprocess import Faults
from reservoir.protocol.messages import NumaSpec
from reservoir.protocol.numa import NumaCell, NumaTopology, PciDevice
from reservoir.protocol.placement import Placement, PlacementError
from reservoir.testing import Simulation

POLICIES = ("required", "preferred", "legacy", "socket")


def random_topology(rng: random.Random, node: int) -> NumaTopology:
    """Two to four cells of 4 CPUs and 8 GiB, two cells per socket, and a few GPUs and NIC
    functions on random cells (some with no cell at all)."""
    cells = rng.randint(2, 4)
    devices = []
    for index in range(rng.randint(1, 6)):
        alias = rng.choice(["gpu", "nic"])
        cell = rng.choice([*range(cells), None])
        devices.append(PciDevice(f"0000:{node:02x}:{index:02x}.0", alias, cell=cell))
    return NumaTopology(
        tuple(
            NumaCell(i, frozenset(range(4 * i, 4 * i + 4)), 8192, socket=i // 2)
            for i in range(cells)
        ),
        devices=tuple(devices),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**32 - 1),
    node_count=st.integers(1, 4),
    requestor_count=st.integers(1, 3),
    request_count=st.integers(1, 16),
    duplicate=st.sampled_from([0.0, 0.2]),
)
def test_devices_are_never_shared_and_required_affinity_always_holds(
    seed: int, node_count: int, requestor_count: int, request_count: int, duplicate: float
) -> None:
    rng = random.Random(seed)
    sim = Simulation(faults=Faults(duplicate=duplicate, delay_s=(0.0, 0.005), seed=seed))
    topologies = {}
    for i in range(node_count):
        topology = topologies[f"n{i}"] = random_topology(rng, i)
        cpus = 4 * len(topology.cells)
        sim.add_node(
            f"n{i}", inventories={"PCPU": cpus, "MEMORY_MB": 8192 * len(topology.cells)},
            numa=topology,
        )  # fmt: skip
    requestors = [sim.add_requestor(f"r{i}") for i in range(requestor_count)]
    futures: list[concurrent.futures.Future[Placement]] = []
    policy_of: dict[concurrent.futures.Future[Placement], str | None] = {}
    for _ in range(request_count):
        sim.advance(rng.choice([0.0, 0.0, 0.001, 0.01]))
        policy = rng.choice([*POLICIES, None])
        pci = {rng.choice(["gpu", "nic"]): rng.choice([1, 1, 2])}
        numa = rng.choice([NumaSpec(nodes=1, dedicated_cpus=True), NumaSpec(nodes=2), None])
        future = rng.choice(requestors).submit(
            resources={"PCPU": rng.choice([2, 4]), "MEMORY_MB": 1024},
            numa=numa,
            pci=pci,
            numa_policy=policy,
            count=rng.choice([1, 1, 2]),
            timeout_s=30.0,
        )
        futures.append(future)
        policy_of[future] = policy if numa is not None else None
    assert sim.run_until_done(futures, timeout_s=600)

    placed: list[Placement] = []
    for future in futures:
        try:
            placement = future.result(timeout=0)
        except PlacementError:
            continue
        placed.append(placement)
        for allocation in placement.allocations:
            assert allocation.numa is not None and allocation.numa.devices
            if policy_of[future] == "required":
                cell_of = {d.address: d.cell for d in topologies[allocation.node].devices}
                for address in allocation.numa.devices:
                    assert cell_of[address] in allocation.numa.cells
    for name, node in sim.nodes.items():
        held = [d for a in node.allocations() if a.numa for d in a.numa.devices]
        assert len(held) == len(set(held)), name
    # settles and audits every ledger (devices held twice or not the node's included)
    sim.finish(placed)
