"""Each participant's Prometheus metrics, kept by prometheus_client itself (the
``prometheus`` extra); without prometheus_client every call here is a no-op.

A :class:`Metrics` belongs to one participant (a node agent, a requestor, an auditor) and
lives in a :class:`~prometheus_client.CollectorRegistry`: its own by default, so that the
50 nodes of ``reservoir demo`` or the participants of a test never collide in the global
registry; or a registry it is given (``reservoir serve`` gives its requestor the
service's, so ``/metrics`` shows both). Several participants may share a registry: the
metric families are made once per registry, and every series carries the participant's
name (``participant``, or ``node`` for a node's state).

What this module owns:

- the message counters the driver counts into (``inc``): ``reservoir_messages_sent_total``
  and ``..._received_total`` by kind, ``..._returned_total`` (our own, unroutable),
  ``..._dropped_total`` (refused by the codec) and ``..._ignored_total`` (late, duplicate,
  expired: a state machine's ``Dropped`` effects) by reason, and
  ``reservoir_transport_errors_total``. They are counted in a plain dict under a lock of
  the participant's own and reported as counter families when Prometheus scrapes: on the
  hot path prometheus_client's own ``Counter.inc`` (a child per label, a lock and a value
  object per increment) cost about 6 % of a placement's instructions (callgrind, in-process
  simulation), the dict a fraction of that;
- the requestor's outcomes (:meth:`Metrics.placed`, :meth:`Metrics.failed`): the placement
  latency histogram ``reservoir_placement_seconds{outcome}``, offers per request
  ``reservoir_placement_offers``, ``reservoir_tier_widenings_total`` and
  ``reservoir_placement_failures_total{reason}``;
- scrape-time sources (:meth:`Metrics.add_source`): what a participant reports about its
  state when Prometheus scrapes (a node's utilisation, tier and reservations; a
  requestor's in-flight count), read then and never between scrapes.

The counters are also read back (``get``, ``total``, ``by_label``, ``snapshot``) by tests,
``reservoir demo`` and ``reservoir bench``; without prometheus_client they read as zero
and :attr:`Metrics.enabled` is False.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import Metric

    from reservoir.protocol.ledger import ResourceUsage
    from reservoir.protocol.placement import Placement, PlacementError

try:
    import prometheus_client
    import prometheus_client.core
except ImportError:  # the core package runs without the prometheus extra
    prometheus_client = None  # type: ignore[assignment]

__all__ = [
    "AVAILABLE",
    "OFFER_BUCKETS",
    "PLACEMENT_BUCKETS_S",
    "Metrics",
    "build_info",
    "default_participant",
    "failure_reason",
    "resource_families",
]

#: whether prometheus_client is installed (the ``prometheus`` or ``api`` extra)
AVAILABLE: Final = prometheus_client is not None

#: placement latency buckets, seconds: a warm placement takes a few milliseconds, one
#: that widens up to a few seconds, one that times out the request timeout (30 s)
PLACEMENT_BUCKETS_S: Final = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
#: offers a request received: a probe round asks two nodes per instance
OFFER_BUCKETS: Final = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64, 128)

#: driver counter name -> (metric name, help, label)
_MESSAGE_COUNTERS: Final = {
    "sent": ("reservoir_messages_sent", "Messages sent, by kind", "kind"),
    "received": ("reservoir_messages_received", "Messages received, by kind", "kind"),
    "returned": (
        "reservoir_messages_returned",
        "Own messages the broker handed back as unroutable, by kind",
        "kind",
    ),
    "dropped": (
        "reservoir_messages_dropped",
        "Messages refused as bad input (malformed, oversized, unsigned, replayed, ...)",
        "reason",
    ),
    "ignored": (
        "reservoir_messages_ignored",
        "Late, duplicate or stray messages and expired reservations, by reason",
        "reason",
    ),
    "transport_errors": (
        "reservoir_transport_errors",
        "Messages or binds the broker refused, by kind",
        "kind",
    ),
}

#: failure reasons of ``reservoir_placement_failures_total``
FAILURE_REASONS: Final = ("timeout", "no_answer", "not_placed", "conflict", "closed")


def failure_reason(error: PlacementError) -> str:
    """Why a request failed, as a bounded label: ``timeout`` (out of time), ``closed``
    (the requestor closed under it), ``conflict`` (its id is placed with another shape),
    ``no_answer`` (no node answered at all) or ``not_placed`` (nodes answered; none could
    take it)."""
    from reservoir.protocol.placement import PlacementTimeout

    explanation = error.explanation
    if isinstance(error, PlacementTimeout):
        return "timeout"
    if explanation.note == "the requestor closed":
        return "closed"
    if "with another shape" in explanation.note:
        return "conflict"
    if not (explanation.offers_received or explanation.declines_received or explanation.found):
        return "no_answer"
    return "not_placed"


#: resource classes counted in a base unit of their own: class -> (metric, bytes per unit)
_IN_BYTES: Final = {
    "MEMORY_MB": ("reservoir_node_memory_bytes", 1024 * 1024),
    "DISK_GB": ("reservoir_node_disk_bytes", 1024 * 1024 * 1024),
}
#: the ``state`` label of the resource families: capacity (what can be allocated: total
#: less host-reserved, times the allocation ratio), allocated, and held by live
#: reservations ("reserved" keeps Placement's meaning, host-reserved capacity)
RESOURCE_STATES: Final = ("capacity", "allocated", "held")


def resource_families(node: str, usages: Mapping[str, ResourceUsage]) -> Iterator[Metric]:
    """A node's usage per resource class, one unit per family (Prometheus naming): memory
    and disk in bytes (``reservoir_node_memory_bytes``, ``reservoir_node_disk_bytes``),
    every other class in its own units (``reservoir_node_resource_units{class}``: VCPUs,
    GPUs, ...), each by ``state``."""
    assert prometheus_client is not None
    gauge = prometheus_client.core.GaugeMetricFamily
    units = gauge(
        "reservoir_node_resource_units",
        "Per resource class counted in units (VCPU, GPUs, ...): capacity, allocated, "
        "held by live reservations",
        labels=["node", "class", "state"],
    )
    in_bytes = {
        rc: gauge(metric, f"{rc} in bytes: capacity, allocated, held by live reservations",
                  labels=["node", "state"])
        for rc, (metric, _scale) in _IN_BYTES.items()
    }  # fmt: skip
    for rc, usage in usages.items():
        values = (usage.capacity, usage.allocated, usage.reserved)
        for state, value in zip(RESOURCE_STATES, values, strict=True):
            if rc in _IN_BYTES:
                in_bytes[rc].add_metric([node, state], value * _IN_BYTES[rc][1])
            else:
                units.add_metric([node, rc, state], value)
    yield units
    yield from in_bytes.values()


def default_participant(role: str) -> str:
    """The ``participant`` label of a requestor not named by settings
    (``RESERVOIR_REQUESTOR_NAME``): the host name and the process's role, so that a
    restart keeps counting into the same series (a second one in the same registry gets
    ``-2``: see :meth:`_Families.claim`)."""
    import socket

    return f"{socket.gethostname()}/{role}"


def build_info(registry: CollectorRegistry) -> None:
    """``reservoir_build_info{version, python}`` 1 in ``registry`` (once)."""
    if prometheus_client is None or getattr(registry, "_reservoir_build_info", False):
        return
    import platform

    from reservoir.version import __version__

    info = prometheus_client.Gauge(
        "reservoir_build_info",
        "reservoir's version and the Python it runs on (always 1)",
        ["version", "python"],
        registry=registry,
    )
    info.labels(__version__, platform.python_version()).set(1)
    registry._reservoir_build_info = True  # type: ignore[attr-defined]


class _Families:
    """The metric families of one registry, made on first use and shared by every
    participant counting into it; and the one collector that merges the participants'
    scrape-time sources (two nodes' ``reservoir_node_utilisation`` are one family)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self._made: dict[str, Any] = {}
        self._lock = threading.Lock()
        #: participant key -> a weak reference to its source (a participant that is
        #: never closed must not be kept alive by a registry that outlives it)
        self._sources: dict[int, Callable[[], Callable[[], Iterable[Metric]] | None]] = {}
        self._participants: set[str] = set()
        registry.register(_Merged(self))

    def claim(self, participant: str) -> str:
        """``participant``, or ``participant-2``, ``-3``, ... when another participant of
        this registry has it: each participant's series stay its own (two sources with
        one label set would make an exposition Prometheus refuses)."""
        with self._lock:
            claimed, n = participant, 1
            while claimed in self._participants:
                n += 1
                claimed = f"{participant}-{n}"
            self._participants.add(claimed)
            return claimed

    def get(self, key: str, make: Callable[[CollectorRegistry], Any]) -> Any:
        family = self._made.get(key)
        if family is None:
            with self._lock:
                family = self._made.get(key)
                if family is None:
                    family = self._made[key] = make(self.registry)
        return family

    def add_source(self, key: int, source: Callable[[], Iterable[Metric]]) -> None:
        reference: Callable[[], Callable[[], Iterable[Metric]] | None] = (
            weakref.WeakMethod(source) if hasattr(source, "__self__") else lambda: source
        )
        with self._lock:
            self._sources[key] = reference

    def remove_source(self, key: int) -> None:
        with self._lock:
            self._sources.pop(key, None)

    def collect_sources(self) -> Iterator[Metric]:
        with self._lock:
            sources = list(self._sources.values())
        merged: dict[str, Metric] = {}
        for reference in sources:
            source = reference()
            if source is None:
                continue
            for family in source():
                known = merged.get(family.name)
                if known is None:
                    merged[family.name] = family
                else:
                    known.samples.extend(family.samples)
        yield from merged.values()


class _Merged:
    """A collector yielding the scrape-time sources of a registry's participants."""

    def __init__(self, families: _Families) -> None:
        self._families = weakref.ref(families)

    def collect(self) -> Iterator[Metric]:
        families = self._families()
        if families is not None:
            yield from families.collect_sources()


_REGISTRIES_LOCK = threading.Lock()


def _families_of(registry: CollectorRegistry) -> _Families:
    # Kept on the registry itself, so that they go when it goes.
    with _REGISTRIES_LOCK:
        families: _Families | None = getattr(registry, "_reservoir_families", None)
        if families is None:
            families = _Families(registry)
            registry._reservoir_families = families  # type: ignore[attr-defined]
        return families


class Metrics:
    """One participant's metrics, in ``registry`` (a new one of its own by default)."""

    def __init__(self, participant: str = "", *, registry: CollectorRegistry | None = None) -> None:
        self.participant = participant
        #: (counter name, label) -> count, reported at scrape time (_message_families)
        self._counts: dict[tuple[str, str | None], int] = {}
        self._count_lock = threading.Lock()
        self._bind_lock = threading.Lock()
        self.registry: CollectorRegistry | None = None
        self._families: _Families | None = None
        self._outcomes: Any = None
        if prometheus_client is None:
            return
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self._families = _families_of(self.registry)
        self.participant = self._families.claim(participant)
        self._families.add_source(id(self._counts), self._message_families)

    @property
    def enabled(self) -> bool:
        """Whether anything is counted (prometheus_client is installed)."""
        return self._families is not None

    # -- counting (the driver's hot path) ----------------------------------------------

    def inc(self, name: str, label: str | None = None, amount: int = 1) -> None:
        """Count ``amount`` under the driver's counter ``name`` (``sent``, ``dropped``,
        ...) and its kind or reason."""
        if self._families is None:
            return
        key = (name, label)
        with self._count_lock:
            self._counts[key] = self._counts.get(key, 0) + amount

    def _message_families(self) -> Iterator[Metric]:
        assert prometheus_client is not None
        with self._count_lock:
            counts = list(self._counts.items())
        families: dict[str, Any] = {}
        for (name, label), value in sorted(counts, key=lambda item: (item[0][0], item[0][1] or "")):
            metric, documentation, label_name = _MESSAGE_COUNTERS.get(
                name, (f"reservoir_{name}", f"reservoir {name} events", "label")
            )
            family = families.get(name)
            if family is None:
                family = families[name] = prometheus_client.core.CounterMetricFamily(
                    metric, documentation, labels=["participant", label_name]
                )
            family.add_metric([self.participant, "" if label is None else label], value)
        yield from families.values()

    # -- a requestor's outcomes --------------------------------------------------------

    def placed(self, placement: Placement) -> None:
        """A request was placed: its latency, offers and widenings."""
        outcomes = self._outcomes or self._bind_outcomes()
        if outcomes is None:
            return
        outcomes.seconds_placed.observe(placement.elapsed_s)
        outcomes.offers.observe(placement.offers_received)
        if len(placement.tiers_tried) > 1:
            outcomes.widenings.inc(len(placement.tiers_tried) - 1)

    def failed(self, error: PlacementError, elapsed_s: float) -> None:
        """A request failed: its latency, offers and widenings, and why."""
        outcomes = self._outcomes or self._bind_outcomes()
        if outcomes is None:
            return
        explanation = error.explanation
        outcomes.seconds_failed.observe(elapsed_s)
        outcomes.offers.observe(explanation.offers_received)
        if len(explanation.tiers_tried) > 1:
            outcomes.widenings.inc(len(explanation.tiers_tried) - 1)
        outcomes.failures[failure_reason(error)].inc()

    def _bind_outcomes(self) -> _Outcomes | None:
        if self._families is None:
            return None
        with self._bind_lock:
            if self._outcomes is None:
                self._outcomes = _Outcomes(self._families, self.participant)
            outcomes: _Outcomes = self._outcomes
            return outcomes

    # -- scrape-time sources -----------------------------------------------------------

    def add_source(self, source: Callable[[], Iterable[Metric]]) -> None:
        """Have ``source`` report metric families (gauges of the participant's state) each
        time the registry is collected, until :meth:`remove_source`."""
        if self._families is not None:
            self._families.add_source(id(self), source)

    def remove_source(self) -> None:
        """Stop reporting the participant's state (its message counts stay reported)."""
        if self._families is not None:
            self._families.remove_source(id(self))

    # -- reading back ------------------------------------------------------------------

    def snapshot(self) -> dict[str, int]:
        """Every message counter of this participant: ``name`` or ``name:label`` -> count."""
        with self._count_lock:
            counts = list(self._counts.items())
        return {name if label is None else f"{name}:{label}": v for (name, label), v in counts}

    def get(self, name: str, label: str | None = None) -> int:
        return self._counts.get((name, label), 0)

    def total(self, name: str) -> int:
        """The counter summed over all its labels."""
        return sum(self.by_label(name).values()) + self.get(name)

    def by_label(self, name: str) -> dict[str, int]:
        with self._count_lock:
            counts = list(self._counts.items())
        return {label: v for (counter, label), v in counts if counter == name and label is not None}


class _Outcomes:
    """A requestor's outcome metrics, every child bound once."""

    def __init__(self, families: _Families, participant: str) -> None:
        assert prometheus_client is not None
        client = prometheus_client

        def seconds(registry: CollectorRegistry) -> Any:
            return client.Histogram(
                "reservoir_placement_seconds",
                "Time from placing a request to its outcome (placed or failed)",
                ["participant", "outcome"],
                buckets=PLACEMENT_BUCKETS_S,
                registry=registry,
            )

        def offers(registry: CollectorRegistry) -> Any:
            return client.Histogram(
                "reservoir_placement_offers",
                "Offers a request received before its outcome",
                ["participant"],
                buckets=OFFER_BUCKETS,
                registry=registry,
            )

        def widenings(registry: CollectorRegistry) -> Any:
            return client.Counter(
                "reservoir_tier_widenings",
                "Times a request widened to the next tier",
                ["participant"],
                registry=registry,
            )

        def failures(registry: CollectorRegistry) -> Any:
            return client.Counter(
                "reservoir_placement_failures",
                "Requests not placed, by reason: timeout, no_answer (no node answered), "
                "not_placed (nodes answered, none could take it), conflict (the id is "
                "placed with another shape), closed (the requestor closed)",
                ["participant", "reason"],
                registry=registry,
            )

        histogram = families.get("placement_seconds", seconds)
        self.seconds_placed = histogram.labels(participant, "placed")
        self.seconds_failed = histogram.labels(participant, "failed")
        self.offers = families.get("placement_offers", offers).labels(participant)
        self.widenings = families.get("tier_widenings", widenings).labels(participant)
        family = families.get("placement_failures", failures)
        self.failures = {reason: family.labels(participant, reason) for reason in FAILURE_REASONS}
