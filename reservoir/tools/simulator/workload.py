"""The workload every system of a run sees: node shapes, request sizes, arrivals, lifetimes.

This module owns *what happens*, never *how it is placed*:

- **nodes**: a mix of 32, 48 and 64 VCPU nodes with 2 GiB of memory per VCPU, drawn
  uniformly;
- **requests**: one instance each, of 1, 2, 4 or 8 VCPUs (weights 40/30/20/10 %) with
  2 GiB per VCPU;
- **arrivals**: a Poisson process whose rate is set by the *offered load*
  ``rho = arrival_rate * mean_lifetime * mean_vcpus / total_vcpus``, so at ``rho = 0.95``
  the steady-state demand is 95 % of the cluster's VCPUs;
- **lifetimes**: exponential with mean ``mean_lifetime_s``; the instance is then freed.

One seed makes every system see the identical sequence of arrivals, sizes and lifetimes;
the offered loads share the same underlying draws too (only the arrival rate scales), so
the loads differ by the load alone.

**Pre-filling.** A cluster that starts empty needs several mean lifetimes of arrivals
before it reaches its steady state (at 100,000 nodes and ``rho = 0.95``, about a million
instances live at once), which would dwarf the measured requests. So by default the
cluster starts *pre-filled* at its steady state: an M/G/inf system holds Poisson(arrival
rate * mean lifetime) instances with independent sizes, and, lifetimes being
exponential, their remaining lifetimes are exponential with the same mean. They are placed
in rounds on the least utilised nodes, one per node per round (the balanced state a
spreading scheduler converges to); one that fits nowhere is dropped and counted. Every
system starts from the same pre-filled cluster. ``prefill=False`` starts empty instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = [
    "FLAVOURS",
    "FLAVOUR_WEIGHTS",
    "MEMORY_MB_PER_VCPU",
    "NODE_SHAPES",
    "Cluster",
    "Flavour",
    "NodeShape",
    "Workload",
    "make_cluster",
    "make_workload",
]

MEMORY_MB_PER_VCPU: Final = 2048


@dataclass(frozen=True, slots=True)
class NodeShape:
    vcpus: int
    memory_mb: int
    cpu_allocation_ratio: float = 1.0

    @property
    def vcpu_capacity(self) -> int:
        """Schedulable VCPUs, as ``reservoir.protocol.ledger.Inventory.capacity`` has it."""
        return math.floor(self.vcpus * self.cpu_allocation_ratio + 1e-9)


@dataclass(frozen=True, slots=True)
class Flavour:
    name: str
    vcpus: int
    memory_mb: int


NODE_SHAPES: Final = tuple(NodeShape(v, v * MEMORY_MB_PER_VCPU) for v in (32, 48, 64))
FLAVOURS: Final = tuple(Flavour(f"{v}vcpu", v, v * MEMORY_MB_PER_VCPU) for v in (1, 2, 4, 8))
FLAVOUR_WEIGHTS: Final = (0.4, 0.3, 0.2, 0.1)


@dataclass(frozen=True)
class Cluster:
    """The nodes: ``shape_of[i]`` indexes ``shapes`` for node ``i``."""

    shapes: tuple[NodeShape, ...]
    shape_of: list[int]

    @property
    def nodes(self) -> int:
        return len(self.shape_of)

    @property
    def total_vcpus(self) -> int:
        capacity = [s.vcpu_capacity for s in self.shapes]
        return sum(capacity[s] for s in self.shape_of)


def make_cluster(nodes: int, seed: int, shapes: tuple[NodeShape, ...] = NODE_SHAPES) -> Cluster:
    if nodes < 1:
        raise ValueError("a cluster needs at least one node")
    rng = np.random.default_rng([seed, 0])
    return Cluster(shapes=shapes, shape_of=rng.integers(0, len(shapes), nodes).tolist())


@dataclass(frozen=True)
class Workload:
    """Arrivals (times in seconds of virtual time, flavour index, lifetime) and the
    pre-filled instances (node index, flavour index, departure time), sorted by time."""

    offered_load: float
    arrival_rate_per_s: float
    mean_lifetime_s: float
    flavours: tuple[Flavour, ...]
    #: arrivals start here; the systems get the time before it to start up
    start_s: float
    arrival_s: list[float]
    flavour_of: list[int]
    lifetime_s: list[float]
    prefill_node: list[int]
    prefill_flavour: list[int]
    prefill_depart_s: list[float]
    #: pre-filled instances that fit nowhere (fragmentation at a high load)
    prefill_dropped: int

    @property
    def requests(self) -> int:
        return len(self.arrival_s)

    def prefill_usage(self, nodes: int) -> tuple[list[int], list[int]]:
        """VCPUs and memory the pre-filled instances take on each of ``nodes`` nodes."""
        vcpus = np.asarray([f.vcpus for f in self.flavours])
        memory_mb = np.asarray([f.memory_mb for f in self.flavours])
        where = np.asarray(self.prefill_node, dtype=np.int64)
        kinds = np.asarray(self.prefill_flavour, dtype=np.int64)
        used_vcpus = np.bincount(where, weights=vcpus[kinds], minlength=nodes)
        used_memory_mb = np.bincount(where, weights=memory_mb[kinds], minlength=nodes)
        return used_vcpus.astype(np.int64).tolist(), used_memory_mb.astype(np.int64).tolist()

    @property
    def end_s(self) -> float:
        """The last arrival (or the start when there is none)."""
        return self.arrival_s[-1] if self.arrival_s else self.start_s


def _spread(cluster: Cluster, sizes: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.int64], int]:
    """Place instances of ``sizes`` VCPUs in rounds, each pairing the next instances with
    the least utilised eighth of the nodes (one instance per node per round): the balanced
    state a spreading scheduler converges to, in a few hundred vectorised steps rather
    than a Python loop per instance. An instance its node cannot take gets a second
    chance on the roomiest nodes, then is dropped. Returns each instance's node (-1:
    dropped) and the number dropped."""
    capacity = np.asarray(
        [cluster.shapes[s].vcpu_capacity for s in cluster.shape_of], dtype=np.int64
    )
    free = capacity.copy()
    where = np.full(len(sizes), -1, dtype=np.int64)
    waiting = np.arange(len(sizes))
    batch_size = max(1, free.size // 8)
    dropped = 0
    while waiting.size:
        emptiest = np.argsort(free / np.maximum(capacity, 1) * -1.0, kind="stable")
        batch, waiting = waiting[:batch_size], waiting[batch_size:]
        hosts = emptiest[: batch.size]
        fits = sizes[batch] <= free[hosts]
        where[batch[fits]] = hosts[fits]
        free[hosts[fits]] -= sizes[batch[fits]]  # hosts are distinct within a round
        missed = batch[~fits]
        if missed.size:
            # a second chance on the nodes with the most free VCPUs, largest first; one
            # that fits none of those is dropped, so every round settles its batch
            missed = missed[np.argsort(-sizes[missed], kind="stable")]
            roomiest = np.argsort(-free, kind="stable")[: missed.size]
            fits = sizes[missed] <= free[roomiest]
            where[missed[fits]] = roomiest[fits]
            free[roomiest[fits]] -= sizes[missed[fits]]
            dropped += int((~fits).sum())
    return where, dropped


def mean_vcpus(
    flavours: tuple[Flavour, ...] = FLAVOURS, weights: tuple[float, ...] = FLAVOUR_WEIGHTS
) -> float:
    return sum(f.vcpus * w for f, w in zip(flavours, weights, strict=True)) / sum(weights)


def make_workload(
    cluster: Cluster,
    *,
    offered_load: float,
    requests: int,
    seed: int,
    mean_lifetime_s: float = 3600.0,
    prefill: bool = True,
    start_s: float = 1.0,
    flavours: tuple[Flavour, ...] = FLAVOURS,
    weights: tuple[float, ...] = FLAVOUR_WEIGHTS,
) -> Workload:
    """The arrivals and pre-filled instances for one offered load (see the module text)."""
    if offered_load <= 0:
        raise ValueError("the offered load must be positive")
    if mean_lifetime_s <= 0:
        raise ValueError("the mean lifetime must be positive")
    probabilities = np.asarray(weights, dtype=float) / sum(weights)
    rate_per_s = (
        offered_load * cluster.total_vcpus / (mean_lifetime_s * mean_vcpus(flavours, weights))
    )
    # The same draws for every load: only the rate scales the gaps.
    draws = np.random.default_rng([seed, 1])
    gaps = draws.standard_exponential(requests) / rate_per_s
    flavour_of = draws.choice(len(flavours), size=requests, p=probabilities)
    lifetimes = draws.standard_exponential(requests) * mean_lifetime_s
    arrival_s = start_s + np.cumsum(gaps)

    nodes: list[int] = []
    kinds: list[int] = []
    departs: list[float] = []
    dropped = 0
    if prefill:
        fill = np.random.default_rng([seed, 2, round(offered_load * 1_000_000)])
        count = int(fill.poisson(rate_per_s * mean_lifetime_s))
        chosen = fill.choice(len(flavours), size=count, p=probabilities)
        remaining = start_s + fill.standard_exponential(count) * mean_lifetime_s
        where, dropped = _spread(cluster, np.asarray([f.vcpus for f in flavours])[chosen])
        placed = np.flatnonzero(where >= 0)
        order = placed[np.argsort(remaining[placed], kind="stable")]
        departs = remaining[order].tolist()
        nodes = where[order].tolist()
        kinds = chosen[order].tolist()
    return Workload(
        offered_load=offered_load,
        arrival_rate_per_s=rate_per_s,
        mean_lifetime_s=mean_lifetime_s,
        flavours=flavours,
        start_s=start_s,
        arrival_s=arrival_s.tolist(),
        flavour_of=flavour_of.tolist(),
        lifetime_s=lifetimes.tolist(),
        prefill_node=nodes,
        prefill_flavour=kinds,
        prefill_depart_s=departs,
        prefill_dropped=dropped,
    )
