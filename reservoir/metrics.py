"""Counters a participant keeps about itself: messages in and out by kind, and messages
dropped by reason. Thread-safe, dependency-free; ``reservoir.prometheus`` can export them.
"""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["Metrics"]


class Metrics:
    """Named counters with an optional single label, e.g. ``dropped{reason=stale}``."""

    def __init__(self) -> None:
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def inc(self, name: str, label: str | None = None, amount: int = 1) -> None:
        key = name if label is None else f"{name}:{label}"
        with self._lock:
            self._counts[key] += amount

    def get(self, name: str, label: str | None = None) -> int:
        key = name if label is None else f"{name}:{label}"
        with self._lock:
            return self._counts[key]

    def total(self, name: str) -> int:
        """The counter summed over all its labels."""
        prefix = name + ":"
        with self._lock:
            return sum(v for k, v in self._counts.items() if k == name or k.startswith(prefix))

    def by_label(self, name: str) -> dict[str, int]:
        prefix = name + ":"
        with self._lock:
            return {k[len(prefix) :]: v for k, v in self._counts.items() if k.startswith(prefix)}

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
