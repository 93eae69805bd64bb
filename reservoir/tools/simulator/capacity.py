"""Exact free capacity of every node, indexed so that questions about it are O(1) in N.

This module owns :class:`FreeIndex`: each node's free VCPUs and memory (capacity minus
what is *allocated*; transient reservations are not counted), with the nodes bucketed by
(shape, free VCPUs). A handful of shapes of at most a few dozen VCPUs each makes a few
hundred buckets, so "does any node fit 8 VCPUs", "which node is least utilised" and
"which node has the most free VCPUs" scan buckets, never nodes, however large the
cluster. Memory is checked per candidate node inside a bucket; with the workload's
proportional memory (2 GiB per VCPU on both sides) the first candidate always fits.

The baselines keep their true node state here; the reservoir run mirrors its nodes'
ledgers here, to tell a false failure (some node had room) from a true one.
"""

from __future__ import annotations

from collections.abc import Sequence

from reservoir.tools.simulator.workload import NodeShape

__all__ = ["FreeIndex"]


class FreeIndex:
    """Free VCPUs and memory of every node, bucketed by (shape, free VCPUs)."""

    __slots__ = (
        "_buckets",
        "_by_most_free",
        "_by_utilisation",
        "_capacity",
        "_offset",
        "allocated_vcpus",
        "free_memory_mb",
        "free_vcpus",
        "shape_of",
        "total_vcpus",
        "vcpu_capacity",
    )

    def __init__(
        self,
        shape_of: Sequence[int],
        shapes: Sequence[NodeShape],
        *,
        allocated_vcpus: Sequence[int] | None = None,
        allocated_memory_mb: Sequence[int] | None = None,
    ) -> None:
        self._capacity = [s.vcpu_capacity for s in shapes]
        self._offset: list[int] = []
        size = 0
        for capacity in self._capacity:
            self._offset.append(size)
            size += capacity + 1
        self._buckets: list[set[int]] = [set() for _ in range(size)]
        self.shape_of = list(shape_of)
        self.vcpu_capacity = [self._capacity[s] for s in self.shape_of]
        self.free_vcpus = list(self.vcpu_capacity)
        self.free_memory_mb = [shapes[s].memory_mb for s in self.shape_of]
        if allocated_vcpus is not None:
            self.free_vcpus = [c - a for c, a in zip(self.free_vcpus, allocated_vcpus, strict=True)]
        if allocated_memory_mb is not None:
            self.free_memory_mb = [
                c - a for c, a in zip(self.free_memory_mb, allocated_memory_mb, strict=True)
            ]
        self.total_vcpus = sum(self.vcpu_capacity)
        self.allocated_vcpus = self.total_vcpus - sum(self.free_vcpus)
        for node, free in enumerate(self.free_vcpus):
            self._buckets[self._bucket(node, free)].add(node)
        # (bucket, free VCPUs) in the order each question wants them
        entries = [
            (self._offset[shape] + free, shape, free)
            for shape, capacity in enumerate(self._capacity)
            for free in range(capacity + 1)
        ]
        self._by_most_free = [
            (bucket, free) for bucket, shape, free in sorted(entries, key=lambda e: (-e[2], e[1]))
        ]
        self._by_utilisation = [
            (bucket, free)
            for bucket, shape, free in sorted(
                entries,
                key=lambda e: ((self._capacity[e[1]] - e[2]) / max(self._capacity[e[1]], 1), -e[2]),
            )
        ]

    def _bucket(self, node: int, free: int) -> int:
        shape = self.shape_of[node]
        return self._offset[shape] + min(max(free, 0), self._capacity[shape])

    def change(self, node: int, vcpus: int, memory_mb: int) -> None:
        """Node ``node`` gains ``vcpus`` and ``memory_mb`` of free room (negative: it
        allocated them)."""
        if vcpus:
            old = self.free_vcpus[node]
            new = old + vcpus
            shape = self.shape_of[node]
            offset, capacity = self._offset[shape], self._capacity[shape]
            buckets = self._buckets
            buckets[offset + min(max(old, 0), capacity)].discard(node)
            buckets[offset + min(max(new, 0), capacity)].add(node)
            self.free_vcpus[node] = new
            self.allocated_vcpus -= vcpus
        self.free_memory_mb[node] += memory_mb

    def fits(self, node: int, vcpus: int, memory_mb: int) -> bool:
        return self.free_vcpus[node] >= vcpus and self.free_memory_mb[node] >= memory_mb

    def utilisation(self, node: int) -> float:
        capacity = self.vcpu_capacity[node]
        return (capacity - self.free_vcpus[node]) / capacity if capacity else 1.0

    def _first(self, order: list[tuple[int, int]], vcpus: int, memory_mb: int) -> int | None:
        buckets = self._buckets
        free_memory = self.free_memory_mb
        for bucket, free in order:
            if free < vcpus:
                continue
            members = buckets[bucket]
            if members:
                for node in members:
                    if free_memory[node] >= memory_mb:
                        return node
        return None

    def fits_somewhere(self, vcpus: int, memory_mb: int) -> bool:
        """Whether any node has the room, now."""
        buckets = self._buckets
        free_memory = self.free_memory_mb
        for bucket, free in self._by_most_free:
            if free < vcpus:
                return False  # sorted by free VCPUs, descending: none further fits
            members = buckets[bucket]
            if members:
                for node in members:
                    if free_memory[node] >= memory_mb:
                        return True
        return False

    def least_utilised(self, vcpus: int, memory_mb: int) -> int | None:
        """A node with the room and the lowest VCPU utilisation, or None."""
        return self._first(self._by_utilisation, vcpus, memory_mb)

    def most_free(self, vcpus: int, memory_mb: int) -> int | None:
        """A node with the room and the most free VCPUs, or None."""
        return self._first(self._by_most_free, vcpus, memory_mb)

    @property
    def allocated_fraction(self) -> float:
        return self.allocated_vcpus / self.total_vcpus if self.total_vcpus else 0.0
