"""What bounds ``reservoir bench``'s throughput on the machine it runs on, measured in the
same run: the broker's bare message rate through the same adapter, and the CPU time one
placement costs in each part of the system (requestors, nodes, the broker).

Two bounds follow. ``broker_bound_placements_per_s`` is the bare message rate divided by
the messages a placement takes: no protocol work at all could place faster through this
broker and adapter. ``cpu_bound_placements_per_s`` is the machine's cores divided by the
CPU seconds a placement costs, summed over every process of the run that could be
measured: no scheduling of that work could place faster on these cores. (The in-process
broker runs every participant in one CPython process, whose Python code runs one thread at
a time: there the bound over all cores is optimistic, and the measured rate stays near one
core's worth.) A target above a bound is out of reach on this machine, whatever the
protocol does; the distance between the measured rate and the bounds says what is left
to win.

CPU times come from ``/proc`` (Linux); where a process cannot be read (a remote broker,
another OS), its part is left out and the bound says so in its ``parts``. So do the
context switches of each part's threads, which say how often the work of a placement
starts on a core that was idle or busy with another process: each time a thread waits
and is woken (a voluntary switch), and each time the kernel takes its core from it (an
involuntary one). Work run just after either costs more than the same work run back to
back (``benchmarks/message_floor.py`` prices the difference).
"""

from __future__ import annotations

import os
import resource
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from reservoir.broker import Broker, Delivery
from reservoir.brokers import BrokerUrl

__all__ = [
    "CpuMeter",
    "CpuSnapshot",
    "Switches",
    "broker_processes",
    "cpu_bound",
    "measure_message_rate",
    "own_cpu",
    "own_switches",
]

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_LOOPBACK = {"127.0.0.1", "localhost", "::1", ""}


def measure_message_rate(broker: Broker, messages: int, body_bytes: int = 300) -> float:
    """Messages per second from one endpoint to another through ``broker``, as fast as it
    takes them; the receiving handler only counts."""
    received = 0
    done = threading.Event()

    def count(delivery: Delivery) -> None:
        nonlocal received
        received += 1
        if received >= messages:
            done.set()

    sink = broker.open_endpoint(count, inline=True)
    source = broker.open_endpoint(lambda delivery: None, inline=True)
    body = b"x" * body_bytes
    try:
        started = time.perf_counter()
        for _ in range(messages):
            source.send(sink.address, body)
        if not done.wait(60.0):
            raise TimeoutError(f"the broker delivered {received} of {messages} in 60 s")
        return messages / (time.perf_counter() - started)
    finally:
        source.close()
        sink.close()


def _cpu_s_of(pid: int) -> float | None:
    """User plus system CPU seconds of one process, or None when it cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces: the fields after it start past ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_PER_S


def broker_processes(url: BrokerUrl) -> list[int]:
    """The process that listens on the broker URL's port, when the URL points at loopback
    (the broker of this machine, not some other RabbitMQ it may also run); none
    otherwise. Behind a port forwarder (a container's published port) that forwarder is
    what is found, and the broker's own CPU is not in the figures."""
    if "amqp" not in url.scheme or (url.host or "") not in _LOOPBACK:
        return []  # the in-process broker is this process; a remote one cannot be read
    port = url.port or (5671 if url.scheme.endswith("amqps") else 5672)
    inodes = _listening_inodes(port)
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            links = [os.readlink(fd) for fd in (entry / "fd").iterdir()]
        except OSError:
            continue
        if any(link.startswith("socket:[") and link[8:-1] in inodes for link in links):
            found.append(int(entry.name))
    return found


def _listening_inodes(port: int) -> set[str]:
    """Inodes of the TCP sockets listening on ``port`` (state 0A in /proc/net/tcp*)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


@dataclass(frozen=True)
class Switches:
    """Context switches of a part's threads: ``woken``, the times a thread waited and was
    woken (voluntary); ``preempted``, the times the kernel gave its core to another
    (involuntary)."""

    woken: int
    preempted: int

    def since(self, before: Switches) -> Switches:
        """The switches from ``before`` to these."""
        return Switches(self.woken - before.woken, self.preempted - before.preempted)

    def per_placement(self, placements: int) -> dict[str, float]:
        """These switches per placement (``placements`` > 0), as the bench reports them."""
        return {
            "woken": round(self.woken / placements, 2),
            "preempted": round(self.preempted / placements, 2),
        }


def _switches_of(pids: list[int]) -> Switches | None:
    """The context switches so far of every live thread of the processes ``pids``, or None
    when there are none or one cannot be read. A thread that has ended takes its count with
    it: the parts measured this way (node processes, the broker) keep their threads for
    the run; a process whose threads end (the bench's requestor hosts) reports
    :func:`own_switches` itself."""
    if not pids:
        return None
    woken = preempted = 0
    for pid in pids:
        try:
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except OSError:
            return None
        for task in tasks:
            try:
                status = (task / "status").read_text()
            except OSError:
                continue  # the thread ended since the listing
            for line in status.splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    woken += int(line.split()[1])
                elif line.startswith("nonvoluntary_ctxt_switches:"):
                    preempted += int(line.split()[1])
    return Switches(woken, preempted)


def own_switches() -> Switches:
    """This process's context switches, its ended threads' included (the kernel adds a
    thread's count to its process's as it exits)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return Switches(usage.ru_nvcsw, usage.ru_nivcsw)


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds, and context switches, so far of each measured part."""

    seconds: dict[str, float]
    switches: dict[str, Switches] = field(default_factory=dict)


@dataclass
class CpuMeter:
    """CPU seconds of the parts of a run: ``this process`` plus named groups of pids."""

    groups: dict[str, list[int]] = field(default_factory=dict)

    def snapshot(self) -> CpuSnapshot:
        # process_time() reads the kernel's nanosecond clock for this process; os.times()
        # and /proc count in 10 ms ticks, which a short run's few placements may not fill
        seconds = {"this process": time.process_time()}
        switches = {"this process": own_switches()}
        for name, pids in self.groups.items():
            readings = [_cpu_s_of(pid) for pid in pids]
            if pids and all(r is not None for r in readings):
                seconds[name] = sum(r for r in readings if r is not None)
            counted = _switches_of(pids)
            if counted is not None:
                switches[name] = counted
        return CpuSnapshot(seconds, switches)

    @staticmethod
    def per_placement_ms(
        before: CpuSnapshot, after: CpuSnapshot, placements: int, *, digits: int = 3
    ) -> dict[str, float]:
        """CPU milliseconds per placement (or per whatever ``placements`` counts) of each
        part measured at both ends."""
        if placements <= 0:
            return {}
        return {
            part: round(1000 * (after.seconds[part] - was) / placements, digits)
            for part, was in before.seconds.items()
            if part in after.seconds
        }

    @staticmethod
    def switches_per_placement(
        before: CpuSnapshot, after: CpuSnapshot, placements: int
    ) -> dict[str, dict[str, float]]:
        """Context switches per placement of each part measured at both ends: ``woken``
        and ``preempted`` (see :class:`Switches`)."""
        if placements <= 0:
            return {}
        return {
            part: after.switches[part].since(was).per_placement(placements)
            for part, was in before.switches.items()
            if part in after.switches
        }


def own_cpu(per_placement_ms: dict[str, float]) -> float:
    """The CPU of reservoir's own processes in ``per_placement_ms``: every part but the
    broker's."""
    return round(sum(ms for part, ms in per_placement_ms.items() if part != "broker"), 3)


def cpu_bound(per_placement_ms: dict[str, float], cores: int) -> float:
    """Placements per second the measured CPU cost allows on ``cores`` cores."""
    total_ms = sum(per_placement_ms.values())
    return round(cores * 1000 / total_ms, 1) if total_ms > 0 else 0.0
