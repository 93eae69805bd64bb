"""A task that writes much: what its output costs the node and the broker, while a reader
follows it as ``reservoir run`` does.

    python benchmarks/task_output.py [--broker amqp://guest:guest@127.0.0.1:5672/] \\
        [--bytes 1G] [--json]

Starts one ``reservoir node --driver exec`` process (a state directory and an exchange of
its own, deleted at the end), places one task that writes ``--bytes`` to its stdout as
fast as ``head -c N /dev/zero`` goes, and follows that output from this process
(``Requestor.output(request_id, follow=True)``: one ``TaskOutputQuery`` in flight, each
answer up to 32 KiB) until the task ended and everything its node kept was read.
Meanwhile, every 0.1 s, it samples the node agent's resident memory and its task
supervisor's (``/proc/<pid>/status``), and the bytes kept in the task's directory; and as
often as ``rabbitmqctl list_queues`` answers (about twice a second), the messages waiting
in the reader's reply queue and in the node's inbox. It prints the peaks (the node's peak
is its ``VmHWM``, over its whole life), the bytes read and those the node no longer kept
when the reader got to them (the two add up to what was written), and how long it took;
``--json`` prints one object. At the end, ``reservoir audit`` of the node (its exit status
is a figure too). docs/design.md, "Tasks", says what the figures showed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

DEFAULT_BROKER = "amqp://guest:guest@127.0.0.1:5672/"
MIB = 1024 * 1024


@dataclass
class Figures:
    bytes_written: int
    bytes_read: int
    bytes_skipped: int
    elapsed_s: float
    exit_code: int | None
    #: the node agent's resident memory once it was ready, and its peak over its life
    node_rss_at_start_mib: float
    node_rss_peak_mib: float
    #: the task's supervisor's highest resident memory sampled
    supervisor_rss_peak_mib: float
    #: the most messages sampled waiting in the reader's reply queue and the node's inbox
    #: (None: rabbitmqctl is not here to ask)
    reply_queue_peak: int | None
    node_queue_peak: int | None
    queue_samples: int
    #: the most bytes the task's directory held, and the node's bound on them
    kept_bytes_peak: int
    kept_bytes_bound: int
    #: ``reservoir audit --expect-nodes 1`` at the end: its exit status (0: clean)
    audit_status: int


def parse_size(text: str) -> int:
    units = {"K": 1024, "M": MIB, "G": 1024 * MIB}
    if text[-1:].upper() in units:
        return int(float(text[:-1]) * units[text[-1:].upper()])
    return int(text)


def status_kib(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` field in KiB (0 when the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def supervisors_of(node_pid: int) -> list[int]:
    """The task supervisors the node started (their parent is the node agent)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        if parent == node_pid and b"task_supervisor" in cmdline:
            found.append(int(entry.name))
    return found


def queue_depths(names: list[str]) -> dict[str, int] | None:
    """Messages waiting in the named queues, as ``rabbitmqctl`` says (None without it)."""
    if shutil.which("rabbitmqctl") is None:
        return None
    done = subprocess.run(["rabbitmqctl", "-q", "list_queues", "name", "messages"],
                          capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    depths = {}
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in names and parts[1].isdigit():
            depths[parts[0]] = int(parts[1])
    return depths


def directory_bytes(path: Path) -> int:
    total = 0
    for file in path.rglob("*"):
        with contextlib.suppress(OSError):  # rotated away while it was counted
            total += file.stat().st_size if file.is_file() else 0
    return total


def measure(broker: str, total_bytes: int) -> Figures:
    from reservoir import Requestor
    from reservoir.runtime.tasks import DEFAULT_OUTPUT_FILE_BYTES, DEFAULT_OUTPUT_FILES

    token = uuid.uuid4().hex[:8]
    separator = "&" if "?" in broker else "?"
    url = f"{broker}{separator}exchange=task-output-{token}"
    state_dir = Path(tempfile.mkdtemp(prefix="reservoir-task-output-"))
    node_name, reader_name = f"out-node-{token}", f"out-reader-{token}"
    env = {**os.environ, "RESERVOIR_BROKER_URL": url}
    node = subprocess.Popen(
        [sys.executable, "-m", "reservoir.cli", "node", "--name", node_name, "--vcpus", "2",
         "--memory-mb", "2048", "--state-dir", str(state_dir), "--driver", "exec"],
        env=env, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert node.stderr is not None
        for line in node.stderr:
            if "ready" in line:
                break
        else:
            raise RuntimeError("the node did not start")
        threading.Thread(target=lambda: [None for _ in node.stderr or ()], daemon=True).start()
        rss_at_start = status_kib(node.pid, "VmRSS")
        samples = {"supervisor": 0, "kept": 0, "reply": None, "inbox": None, "queues": 0}
        done = threading.Event()
        tasks_dir = state_dir / "tasks" / node_name

        def sample_processes() -> None:
            while not done.wait(0.1):
                for pid in supervisors_of(node.pid):
                    samples["supervisor"] = max(samples["supervisor"] or 0,
                                                status_kib(pid, "VmRSS"))  # fmt: skip
                samples["kept"] = max(samples["kept"] or 0, directory_bytes(tasks_dir))

        queues = [f"reservoir.requestor.{reader_name}", f"reservoir.node.{node_name}"]

        def sample_queues() -> None:
            while not done.is_set():
                depths = queue_depths(queues)
                if depths is None:
                    return
                samples["queues"] = (samples["queues"] or 0) + 1
                for key, queue in zip(("reply", "inbox"), queues, strict=True):
                    if queue in depths:
                        samples[key] = max(samples[key] or 0, depths[queue])

        watchers = [threading.Thread(target=sample_processes, daemon=True),
                    threading.Thread(target=sample_queues, daemon=True)]  # fmt: skip
        for watcher in watchers:
            watcher.start()
        read = skipped = 0
        started = time.monotonic()
        with Requestor(url, name=reader_name) as requestor:
            run = requestor.run(["sh", "-c", f"head -c {total_bytes} /dev/zero"], vcpus=1)
            run.placement.result(timeout=30)
            for piece in requestor.output(run.request_id, follow=True):
                read += len(piece.data)
                skipped += piece.skipped
            run.wait(timeout_s=60)
            elapsed = time.monotonic() - started
            exit_code = run.exit_code
        done.set()
        for watcher in watchers:
            watcher.join(timeout=60)
        audited = subprocess.run(
            [sys.executable, "-m", "reservoir.cli", "audit", "--expect-nodes", "1"],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        return Figures(
            bytes_written=total_bytes,
            bytes_read=read,
            bytes_skipped=skipped,
            elapsed_s=round(elapsed, 2),
            exit_code=exit_code,
            node_rss_at_start_mib=round(rss_at_start / 1024, 1),
            node_rss_peak_mib=round(status_kib(node.pid, "VmHWM") / 1024, 1),
            supervisor_rss_peak_mib=round((samples["supervisor"] or 0) / 1024, 1),
            reply_queue_peak=samples["reply"],
            node_queue_peak=samples["inbox"],
            queue_samples=samples["queues"] or 0,
            kept_bytes_peak=samples["kept"] or 0,
            # two streams, each at most so many files of so many bytes, and the exit file
            kept_bytes_bound=2 * DEFAULT_OUTPUT_FILES * DEFAULT_OUTPUT_FILE_BYTES + 4096,
            audit_status=audited.returncode,
        )
    finally:
        node.send_signal(signal.SIGTERM)
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            node.kill()
        from reservoir.brokers import connect

        with connect(url) as connection:
            connection.delete_exchanges()  # type: ignore[attr-defined]
        shutil.rmtree(state_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", default=os.environ.get("RESERVOIR_BROKER_URL", DEFAULT_BROKER))
    parser.add_argument("--bytes", default="1G", help="what the task writes (K, M, G suffixes)")
    parser.add_argument("--json", action="store_true")
    arguments = parser.parse_args()
    figures = measure(arguments.broker, parse_size(arguments.bytes))
    if arguments.json:
        print(json.dumps(asdict(figures), sort_keys=True))
        return
    for name, value in asdict(figures).items():
        print(f"{name:>26}  {value}")


if __name__ == "__main__":
    main()
