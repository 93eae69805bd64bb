"""``reservoir chaos``: real node and requestor processes on a real RabbitMQ, broken on
purpose on a seeded schedule, then audited.

One run, in order:

1. **Isolation.** The run gets a vhost of its own (``rabbitmqctl add_vhost``, removed at
   the end), so closing "every connection at once from the broker side" closes only the
   run's; where rabbitmqctl cannot manage the broker, it runs on an exchange of its own in
   the given vhost and skips that one fault (and says so).
2. **Participants.** ``--nodes`` ``reservoir node`` processes (durable state in SQLite)
   and ``--requestors`` requestor processes (:mod:`reservoir.tools.chaos.worker`), all talking to
   RabbitMQ through a loopback :class:`~reservoir.testing.tcp_proxy.TcpProxy`.
3. **Faults**, from :func:`fault_schedule` (seeded, printed as each is injected): node
   processes killed with SIGKILL and restarted after a pause (at most a tenth of the
   nodes down at once), requestor processes killed mid-conversation and restarted (they
   resume from their record), every connection cut at the proxy, the proxy stalled (bytes
   stop, sockets stay open) and restored, every connection closed from the broker side.
4. **The end**, once the requestors placed ``--placements`` between them (or
   ``--seconds`` ran out): faults stop, everything down comes back, the requestors settle
   and exit, reservations are given a TTL to expire, and then the verdict comes from
   three places: the cluster-wide audit over the broker
   (:func:`reservoir.runtime.auditor.audit_cluster`) against the callers' record, the same checks
   over the nodes' SQLite ledgers, and the callers' own record (no caller hung past its
   deadline, no request that fitted failed: the shapes keep the cluster far from full,
   so every failure is a false one).

The run prints one line per fault to stderr and, with ``--json``, one JSON object to
stdout. Exit status 0 when every count but ``placements`` and ``faults_injected`` is 0.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from reservoir.brokers import BrokerUrl
from reservoir.protocol.audit import NodeSnapshot
from reservoir.protocol.ledger import Inventory, Ledger
from reservoir.runtime.auditor import audit_cluster, check
from reservoir.runtime.store import SqliteStore
from reservoir.testing.tcp_proxy import TcpProxy
from reservoir.tools.chaos.record import judge, read_events
from reservoir.tools.chaos.worker import SHAPES

__all__ = ["FAULT_KINDS", "ChaosResult", "Fault", "fault_schedule", "run_chaos"]

FAULT_KINDS: Final = ("kill_node", "kill_requestor", "cut", "stall", "broker_close")

NODE_VCPUS: Final = 16
NODE_MEMORY_MB: Final = 32768
#: placements each requestor keeps before freeing its oldest, at most
LIVE_PER_REQUESTOR: Final = 20
#: the share of the cluster's VCPUs the requestors may hold between them: far from full
#: even with a tenth of the nodes down and frees in flight, so that a request that fails
#: is one that fitted (a false failure)
MAX_HELD_SHARE: Final = 0.4


def live_per_requestor(nodes: int, requestors: int) -> int:
    """How many placements each requestor keeps, so the cluster stays far from full."""
    largest_vcpus = max(shape["vcpus"] for shape in SHAPES)
    room = int(MAX_HELD_SHARE * nodes * NODE_VCPUS / (requestors * largest_vcpus))
    return max(1, min(LIVE_PER_REQUESTOR, room))


REQUEST_TIMEOUT_S: Final = 30.0
#: after the last fault: a reservation's TTL plus the audit's grace, so that what a
#: killed requestor reserved has expired by the time the nodes are asked
SETTLE_S: Final = 6.5
READY_TIMEOUT_S: Final = 60.0

#: the findings of a run, each of which must be empty
#: how long the run's task processes get to agree with the held placements at the end
TASKS_AGREE_S: Final = 15.0
COUNTED: Final = (
    "task_problems",
    "overcommitted",
    "duplicate_placements",
    "leaked_reservations",
    "orphans",
    "hung_callers",
    "false_failures",
    "unconfirmed_frees",
    "crashed_processes",
)


@dataclass(frozen=True)
class Fault:
    """One fault of a schedule: what, on whom, when (seconds into the run), how long."""

    at_s: float
    kind: str
    #: a node's or requestor's name for kills, None for faults of the whole path
    target: str | None = None
    #: how long a killed process stays down, or the proxy stalled
    duration_s: float = 0.0

    def describe(self) -> str:
        what = {
            "kill_node": f"kill -9 node {self.target}, restart after {self.duration_s:.1f} s",
            "kill_requestor": (
                f"kill -9 requestor {self.target}, restart after {self.duration_s:.1f} s"
            ),
            "cut": "cut every connection at the proxy",
            "stall": f"stall every connection for {self.duration_s:.1f} s",
            "broker_close": "close every connection from the broker side",
        }[self.kind]
        return f"+{self.at_s:6.2f}s {what}"


def fault_schedule(
    seed: int,
    *,
    seconds: float,
    nodes: Sequence[str],
    requestors: Sequence[str],
    interval_s: float = 1.5,
    kinds: Sequence[str] = FAULT_KINDS,
) -> list[Fault]:
    """The faults of a run, from ``seed`` alone: the same seed, the same schedule.

    One fault every ``interval_s`` on average (uniformly 0.5x..1.5x apart), the first
    after two intervals; the first ``len(kinds)`` faults are every kind once, in a drawn
    order (so even a short run meets each), then kinds are drawn evenly. A node kill is
    drawn only while fewer than a tenth of the nodes (at least one) are down, else it
    becomes a cut.
    """
    rng = random.Random(seed)
    max_down = max(1, len(nodes) // 10)
    down_until: dict[str, float] = {}
    schedule: list[Fault] = []
    first_round = rng.sample(list(kinds), len(kinds))
    at_s = 2 * interval_s
    while at_s < seconds:
        kind = first_round.pop(0) if first_round else rng.choice(list(kinds))
        if kind == "kill_node":
            up = [n for n in nodes if down_until.get(n, 0.0) <= at_s]
            if len(nodes) - len(up) >= max_down or not up:
                kind = "cut"
            else:
                target = rng.choice(up)
                duration_s = round(rng.uniform(0.5, 3.0), 2)
                down_until[target] = at_s + duration_s
                schedule.append(Fault(round(at_s, 2), kind, target, duration_s))
        elif kind == "kill_requestor":
            target = rng.choice(list(requestors))
            schedule.append(Fault(round(at_s, 2), kind, target, round(rng.uniform(0.2, 1.0), 2)))
        elif kind == "stall":
            schedule.append(Fault(round(at_s, 2), kind, None, round(rng.uniform(0.5, 3.0), 2)))
        if kind in ("cut", "broker_close"):
            schedule.append(Fault(round(at_s, 2), kind))
        at_s += interval_s * rng.uniform(0.5, 1.5)
    return schedule


# -- the broker side -----------------------------------------------------------------------


def _rabbitmqctl(*args: str) -> str:
    done = subprocess.run(
        ["rabbitmqctl", "-q", *args], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)}: {(done.stderr or done.stdout).strip()}")
    return done.stdout


def _rabbitmqctl_manages(port: int) -> bool:
    """Whether the local rabbitmqctl manages the RabbitMQ listening on ``port``."""
    if shutil.which("rabbitmqctl") is None:
        return False
    try:
        listeners = _rabbitmqctl("status", "--formatter", "json")
    except (RuntimeError, subprocess.TimeoutExpired):
        return False
    with contextlib.suppress(ValueError, KeyError, TypeError):
        status = json.loads(listeners)
        return any(int(item["port"]) == port for item in status["listeners"])
    return False


@dataclass
class _Isolation:
    """Where the run lives on the broker, and how to remove it."""

    url: str
    vhost: str | None
    own_vhost: bool
    exchange: str | None

    def describe(self) -> str:
        return f"vhost {self.vhost}" if self.own_vhost else f"exchange {self.exchange}"

    def remove(self, direct_url: str) -> None:
        if self.own_vhost and self.vhost is not None:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _rabbitmqctl("delete_vhost", self.vhost)
        elif self.exchange is not None:
            from reservoir.brokers import connect

            with contextlib.suppress(Exception), connect(direct_url) as broker:
                broker.delete_exchanges()  # type: ignore[attr-defined]


def _isolate(url: str, run_id: str) -> _Isolation:
    parts = urllib.parse.urlsplit(url)
    if _rabbitmqctl_manages(parts.port or 5672):
        vhost = f"reservoir-chaos-{run_id}"
        user = urllib.parse.unquote(parts.username or "guest")
        _rabbitmqctl("add_vhost", vhost)
        try:
            _rabbitmqctl("set_permissions", "-p", vhost, user, ".*", ".*", ".*")
        except BaseException:
            # a vhost half set up is still ours: never leave it behind
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _rabbitmqctl("delete_vhost", vhost)
            raise
        own = parts._replace(path="/" + urllib.parse.quote(vhost, safe=""))
        return _Isolation(urllib.parse.urlunsplit(own), vhost, True, None)
    exchange = f"reservoir.chaos.{run_id}"
    return _Isolation(BrokerUrl.parse(url).with_exchange(exchange).given, None, False, exchange)


def _through(url: str, port: int) -> str:
    parts = urllib.parse.urlsplit(url)
    credentials = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{credentials}127.0.0.1:{port}"))


# -- processes -----------------------------------------------------------------------------


@dataclass
class _Process:
    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    restart_at: float | None = None
    #: exits it made on its own with a non-zero status (a crash, not one of our kills)
    crashes: int = 0
    finished: bool = False

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            self.argv, env=self.env, stdout=log, stderr=log, stdin=subprocess.DEVNULL
        )
        log.close()
        self.restart_at = None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def terminate(self, timeout_s: float) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()


def _wait_ready(nodes: Sequence[_Process], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = list(nodes)
    while waiting:
        waiting = [
            n
            for n in waiting
            if ": ready on " not in n.log_path.read_text(encoding="utf-8", errors="replace")
        ]
        for node in waiting:
            if not node.alive():
                tail = node.log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
                raise RuntimeError(f"node {node.name} exited before it was ready:\n{tail}")
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"nodes not ready after {timeout_s:.0f} s: {waiting[0].name} ...")
        time.sleep(0.1)


# -- the run -------------------------------------------------------------------------------


@dataclass
class ChaosResult:
    seed: int
    placements: int
    faults_injected: int
    faults: dict[str, int]
    faults_skipped: dict[str, str]
    overcommitted: list[str]
    duplicate_placements: list[str]
    leaked_reservations: list[str]
    orphans: list[str]
    hung_callers: list[str]
    false_failures: list[str]
    unconfirmed_frees: list[str]
    crashed_processes: list[str]
    #: task processes of the run without a held placement (orphaned work), and held
    #: placements with a task whose process is gone (work lost)
    task_problems: list[str]
    #: held placements carrying a task at the end, their processes checked
    tasks_checked: int
    nodes_answering: int
    frees: int
    seconds: float
    isolation: str
    schedule: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(not getattr(self, name) for name in COUNTED)

    def as_json(self) -> dict[str, Any]:
        counts = {name: len(getattr(self, name)) for name in COUNTED}
        details = {name: getattr(self, name)[:20] for name in COUNTED if getattr(self, name)}
        return {
            "ok": self.ok,
            "seed": self.seed,
            "placements": self.placements,
            "faults_injected": self.faults_injected,
            "faults": self.faults,
            "faults_skipped": self.faults_skipped,
            **counts,
            "nodes_answering": self.nodes_answering,
            "tasks_checked": self.tasks_checked,
            "frees": self.frees,
            "seconds": round(self.seconds, 1),
            "isolation": self.isolation,
            "details": details,
        }


def run_chaos(
    *,
    broker_url: str,
    seconds: float = 600.0,
    seed: int | None = None,
    nodes: int = 30,
    requestors: int = 8,
    placements: int = 10_000,
    interval_s: float = 1.5,
    work_dir: Path | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> ChaosResult:
    """One chaos run (see the module docstring). ``seconds`` bounds the placing phase."""
    seed = seed if seed is not None else secrets.randbelow(2**31)
    scheme = broker_url.split("://", 1)[0].lower()
    if scheme not in ("amqp", "kombu+amqp", "kombu+pyamqp"):
        raise ValueError("chaos runs on RabbitMQ: give an amqp:// or kombu+amqp:// URL")
    run = _prepare(
        broker_url, seed, seconds, nodes, requestors, placements, interval_s, work_dir, progress
    )
    result: ChaosResult | None = None
    try:
        _start_nodes(run)
        placing_s = _place_under_faults(run, seconds)
        _settle(run, placing_s)
        result = _verdict(run, placing_s)
        _say_what_the_records_say_of_orphans(run, result)
        return result
    finally:
        _tear_down(run, result)


@dataclass
class _Run:
    """One chaos run's parts: where it works, how it is isolated, its processes, the
    schedule of faults and what was injected so far."""

    seed: int
    root: Path
    own_dir: bool
    isolation: _Isolation
    proxy: TcpProxy
    node_names: list[str]
    worker_names: list[str]
    node_procs: dict[str, _Process]
    worker_procs: dict[str, _Process]
    schedule: list[Fault]
    skipped: dict[str, str]
    state_dir: Path
    placements: int
    progress: Callable[[str], None]
    #: in the command of every task the run's placements carry
    task_token: str
    injected: Counter[str] = field(default_factory=Counter)
    applied: list[str] = field(default_factory=list)
    background: list[threading.Thread] = field(default_factory=list)

    @property
    def everyone(self) -> dict[str, _Process]:
        return {**self.node_procs, **self.worker_procs}


def _prepare(
    broker_url: str,
    seed: int,
    seconds: float,
    nodes: int,
    requestors: int,
    placements: int,
    interval_s: float,
    work_dir: Path | None,
    progress: Callable[[str], None],
) -> _Run:
    """The run's directory, its vhost (or exchange) of its own, the proxy every process
    talks through, the fault schedule drawn from the seed, and the processes to start."""
    run_id = f"{seed}-{secrets.token_hex(3)}"
    parts = urllib.parse.urlsplit(broker_url)
    proxy = TcpProxy(parts.port or 5672, upstream_host=parts.hostname or "127.0.0.1")
    root = Path(tempfile.mkdtemp(prefix="reservoir-chaos-")) if work_dir is None else work_dir
    root.mkdir(parents=True, exist_ok=True)
    isolation = _isolate(broker_url, run_id)
    progress(f"chaos: seed {seed} (replay the schedule with --seed {seed}); work in {root}")
    node_names = [f"chaos-node-{i}" for i in range(nodes)]
    worker_names = [f"chaos-req-{i}" for i in range(requestors)]
    schedule = fault_schedule(
        seed,
        seconds=seconds,
        nodes=node_names,
        requestors=worker_names,
        interval_s=interval_s,
        kinds=FAULT_KINDS if isolation.own_vhost else FAULT_KINDS[:-1],
    )
    skipped = (
        {}
        if isolation.own_vhost
        else {"broker_close": "rabbitmqctl cannot manage this broker: no vhost of the run's own"}
    )
    participant_url = _through(isolation.url, proxy.port)
    env = {**os.environ, "RESERVOIR_BROKER_URL": participant_url}
    env.pop("RESERVOIR_STATE_DIR", None)
    state_dir = root / "nodes"
    state_dir.mkdir(exist_ok=True)
    share = math.ceil(placements / requestors)
    live = live_per_requestor(nodes, requestors)
    task_token = f"reservoir-chaos-task-{run_id}"
    return _Run(
        seed=seed,
        root=root,
        own_dir=work_dir is None,
        isolation=isolation,
        proxy=proxy,
        node_names=node_names,
        worker_names=worker_names,
        node_procs={name: _node_process(name, state_dir, root, env) for name in node_names},
        worker_procs={
            name: _worker_process(
                name, index, seed, participant_url, share, live, root, env, task_token
            )
            for index, name in enumerate(worker_names)
        },
        task_token=task_token,
        schedule=list(schedule),
        skipped=skipped,
        state_dir=state_dir,
        placements=placements,
        progress=progress,
    )


def _node_process(name: str, state_dir: Path, root: Path, env: dict[str, str]) -> _Process:
    """A ``reservoir node`` process with a durable ledger in the run's state directory."""
    return _Process(
        name,
        [sys.executable, "-m", "reservoir.cli", "node", "--name", name,
         "--vcpus", str(NODE_VCPUS), "--memory-mb", str(NODE_MEMORY_MB),
         "--state-dir", str(state_dir), "--status-interval", "5", "--driver", "exec"],
        root / f"{name}.log",
        env,
    )  # fmt: skip


def _worker_process(
    name: str,
    index: int,
    seed: int,
    url: str,
    share: int,
    live: int,
    root: Path,
    env: dict[str, str],
    task_token: str,
) -> _Process:
    """A requestor process placing ``share`` placements, keeping its record; every third
    carries a task (:func:`reservoir.tools.chaos.worker.task_for`)."""
    return _Process(
        name,
        [sys.executable, "-m", "reservoir.tools.chaos.worker", "--broker", url,
         "--name", name, "--record", str(root / f"{name}.record.jsonl"),
         "--placements", str(share), "--live", str(live),
         "--timeout", str(REQUEST_TIMEOUT_S), "--seed", str(seed + index),
         "--task-token", task_token],
        root / f"{name}.log",
        env,
    )  # fmt: skip


def _start_nodes(run: _Run) -> None:
    for node in run.node_procs.values():
        node.start()
    _wait_ready(list(run.node_procs.values()), READY_TIMEOUT_S)
    run.progress(
        f"chaos: {len(run.node_procs)} nodes ready; {len(run.worker_procs)} requestors place "
        f"{run.placements}"
    )


def _place_under_faults(run: _Run, seconds: float) -> float:
    """Start the requestors and inject the schedule's faults until they are done placing
    or ``seconds`` are up; processes that exit by themselves are counted and restarted.
    Returns how long the placing went on."""
    for worker in run.worker_procs.values():
        worker.start()
    started = time.monotonic()
    pending = list(run.schedule)
    stall_ends: float | None = None
    while True:
        now_s = time.monotonic() - started
        _supervise(run, now_s)
        if stall_ends is not None and now_s >= stall_ends:
            run.proxy.restore()
            stall_ends = None
        if all(w.finished for w in run.worker_procs.values()):
            break
        if now_s > seconds:
            run.progress(f"chaos: {seconds:.0f} s are up: stopping the requestors")
            break
        while pending and pending[0].at_s <= now_s:
            stall_ends = _inject(run, pending.pop(0), now_s, stall_ends)
        time.sleep(0.05)
    return time.monotonic() - started


def _supervise(run: _Run, now_s: float) -> None:
    """Restart what a fault killed once its time is up, and what died by itself (a
    requestor that finished placing exits 0 and is done)."""
    for proc in run.everyone.values():
        if proc.restart_at is not None and now_s >= proc.restart_at:
            proc.start()
        elif proc.restart_at is None and not proc.finished and not proc.alive():
            assert proc.process is not None
            if proc.name in run.worker_procs and proc.process.returncode == 0:
                proc.finished = True
            else:
                proc.crashes += 1
                run.progress(f"chaos: {proc.name} exited by itself ({proc.process.returncode})")
                proc.start()


def _inject(run: _Run, fault: Fault, now_s: float, stall_ends: float | None) -> float | None:
    """Carry out one fault of the schedule; returns when a stall (if any) ends."""
    if fault.kind == "kill_requestor" and run.worker_procs[str(fault.target)].finished:
        return stall_ends  # it is done placing: nothing left to interrupt
    run.progress(f"chaos: {fault.describe()}")
    run.applied.append(fault.describe())
    run.injected[fault.kind] += 1
    if fault.kind in ("kill_node", "kill_requestor"):
        proc = run.everyone[str(fault.target)]
        proc.kill()
        proc.restart_at = now_s + fault.duration_s
    elif fault.kind == "cut":
        run.proxy.cut()
    elif fault.kind == "stall":
        run.proxy.stall()
        return now_s + fault.duration_s
    elif fault.kind == "broker_close":
        assert run.isolation.vhost is not None
        thread = threading.Thread(target=_close_all, args=(run.isolation.vhost,), daemon=True)
        thread.start()
        run.background.append(thread)
    return stall_ends


def _settle(run: _Run, placing_s: float) -> None:
    """The end: no more faults; everything comes back, requestors settle and exit, and
    reservations get their time to expire."""
    run.proxy.restore()
    for thread in run.background:
        thread.join(timeout=60)
    for proc in run.everyone.values():
        if not proc.finished and not proc.alive():
            proc.start()
    _wait_ready(list(run.node_procs.values()), READY_TIMEOUT_S)
    for worker in run.worker_procs.values():
        worker.terminate(timeout_s=180)
        if worker.process is not None and worker.process.returncode not in (0, None):
            worker.crashes += 1
    run.progress(f"chaos: placing over after {placing_s:.0f} s; letting reservations expire")
    time.sleep(SETTLE_S)


def _verdict(run: _Run, placing_s: float) -> ChaosResult:
    """The three verdicts side by side: the callers' record, the cluster-wide audit
    against it, and the same checks over the nodes' SQLite ledgers."""
    verdict = judge(
        {name: read_events(run.root / f"{name}.record.jsonl") for name in run.worker_names}
    )
    nodes = len(run.node_names)
    task_problems, tasks_checked = _task_problems(run, verdict.held)
    found = audit_cluster(
        run.isolation.url, placements=verdict.held, expect_nodes=nodes, wait_s=15.0
    )
    for node in run.node_procs.values():
        node.terminate(timeout_s=30)
    durable = _durable_audit(run.state_dir, run.node_names, verdict.held)
    crashed = [
        f"{p.name}: exited by itself {p.crashes} time(s)"
        for p in run.everyone.values()
        if p.crashes
    ]
    missing = [] if len(found.nodes) == nodes else [
        f"{nodes - len(found.nodes)} node(s) did not answer the audit"
    ]  # fmt: skip
    isolation = run.isolation
    return ChaosResult(
        seed=run.seed,
        placements=verdict.placements,
        faults_injected=sum(run.injected.values()),
        faults=dict(run.injected),
        faults_skipped=run.skipped,
        overcommitted=_union(found.report.overcommitted, durable.overcommitted),
        duplicate_placements=_union(
            found.report.duplicate_placements, durable.duplicate_placements
        ),
        leaked_reservations=list(found.report.leaked_reservations),
        orphans=_union(found.orphans, durable.orphans) + missing,
        hung_callers=list(verdict.hung),
        false_failures=list(verdict.failures),
        unconfirmed_frees=list(verdict.unconfirmed_frees),
        crashed_processes=crashed,
        task_problems=task_problems,
        tasks_checked=tasks_checked,
        nodes_answering=len(found.nodes),
        frees=verdict.frees,
        seconds=placing_s,
        isolation=(
            f"vhost {isolation.vhost}" if isolation.own_vhost else f"exchange {isolation.exchange}"
        ),
        schedule=run.applied,
    )


def _say_what_the_records_say_of_orphans(run: _Run, result: ChaosResult) -> None:
    """What the callers' records say of each orphaned id: the place to start."""
    for orphan in result.orphans:
        request_id = orphan.split(" of ", 1)[1].split(":", 1)[0] if " of " in orphan else ""
        for name in run.worker_names:
            for event in read_events(run.root / f"{name}.record.jsonl"):
                if request_id and event.get("id") == request_id:
                    run.progress(f"chaos: {name} record of {request_id}: {event}")


def _task_processes(token: str) -> dict[str, int]:
    """The run's live task processes: request id -> pid (their command names both)."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            words = (entry / "cmdline").read_bytes().rstrip(b"\0").split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        command = b" ".join(words).decode(errors="replace")
        if f": {token} " in command and words[0] == b"sh" and state != "Z":
            found[command.rsplit(" ", 1)[1]] = int(entry.name)
    return found


def _task_problems(run: _Run, held: Sequence[Any]) -> tuple[list[str], int]:
    """Every held placement that carries a task has its task running, and no task runs
    for a placement not held: after the faults (nodes killed with their tasks running)
    no work is orphaned or lost. Stops are asynchronous (a grace of 1 s): asked until
    they agree, for a while."""
    from reservoir.tools.chaos.worker import task_for

    wanted = {p.request_id for p in held if task_for(p.request_id, run.task_token)}
    deadline = time.monotonic() + TASKS_AGREE_S
    while True:
        running = set(_task_processes(run.task_token))
        if running == wanted or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    problems = [f"a task runs for {r}, a placement not held" for r in sorted(running - wanted)]
    problems += [f"the task of held placement {r} is not running" for r in sorted(wanted - running)]
    return problems, len(wanted)


def _tear_down(run: _Run, result: ChaosResult | None) -> None:
    """Kill what is left (the tasks too: they outlive their nodes), close the proxy,
    remove the run's vhost; keep the evidence of a failed verdict (or a run that broke)."""
    for proc in run.everyone.values():
        proc.kill()
    for pid in _task_processes(run.task_token).values():
        # the command's process group, the shell and its sleep (its supervisor then ends)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    run.proxy.close()
    run.isolation.remove(run.isolation.url)
    if run.own_dir and result is not None and result.ok:
        shutil.rmtree(run.root, ignore_errors=True)
    else:
        run.progress(f"chaos: kept the run's logs, records and ledgers in {run.root}")


def _close_all(vhost: str) -> None:
    with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
        _rabbitmqctl("close_all_connections", "--vhost", vhost, "reservoir chaos")


def _union(*groups: Sequence[str]) -> list[str]:
    seen: dict[str, None] = {}
    for group in groups:
        for item in group:
            seen.setdefault(item, None)
    return list(seen)


@dataclass(frozen=True)
class _DurableFindings:
    overcommitted: tuple[str, ...]
    duplicate_placements: tuple[str, ...]
    orphans: tuple[str, ...]


def _durable_audit(state_dir: Path, names: Sequence[str], held: Sequence[Any]) -> _DurableFindings:
    """The same checks over what the stopped nodes keep in SQLite."""
    inventories = {"VCPU": Inventory(NODE_VCPUS), "MEMORY_MB": Inventory(NODE_MEMORY_MB)}
    snapshots: list[NodeSnapshot] = []
    for name in names:
        store = SqliteStore.for_node(state_dir, name)
        try:
            ledger = Ledger.with_allocations(inventories, store.load())
        finally:
            store.close()
        snapshots.append(NodeSnapshot.of(name, ledger, taken_at=0.0, tier=0))
    found = check(snapshots, held)
    return _DurableFindings(
        tuple(f"durable {v}" for v in found.report.overcommitted),
        tuple(f"durable {d}" for d in found.report.duplicate_placements),
        tuple(f"durable {o}" for o in found.orphans),
    )
