"""Real ``reservoir`` processes for end-to-end tests: nodes, ``serve``, ``keeper`` and the
one-shot commands, each ``python -m reservoir`` in a child process of its own, on a real
broker.

- :class:`ReservoirProcess`: a long-running command (``node``, ``serve``, ``keeper``) whose
  stderr is kept a line at a time, to wait for what it says (``ready``, ``stopped``);
- :func:`run_reservoir`: a one-shot command (``request``, ``audit``, ``free``, ...) run to
  its end;
- :class:`ProcessCluster`: node processes and commands sharing one broker URL (give it the
  ``reservoir_amqp_url`` fixture's, an exchange of the test's own) and one state
  directory; :meth:`ProcessCluster.close` stops whatever is still running.

The children run ``sys.executable -m reservoir`` with the environment given (by default
this process's, with ``RESERVOIR_BROKER_URL`` set), so they run the reservoir this test
imports when ``PYTHONPATH`` says where it is.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

__all__ = [
    "NODE_READY",
    "READY_TIMEOUT_S",
    "ProcessCluster",
    "ReservoirProcess",
    "free_port",
    "run_reservoir",
]

#: how long :meth:`ReservoirProcess.wait_for` waits by default: a node is ready in about a
#: second; only a broken start waits this long
READY_TIMEOUT_S = 30.0
#: what ``reservoir node`` says once it is ready (``node <name>: ready on <broker>; ...``);
#: "ready" alone would match its "already connected" while another holds its name
NODE_READY = ": ready on "


def run_reservoir(
    *args: str, env: Mapping[str, str], timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """``reservoir <args>`` run to its end; its exit status, stdout and stderr as text (a
    failing command is returned, not raised: tests assert on what it said)."""
    return subprocess.run(
        [sys.executable, "-m", "reservoir", *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


class ReservoirProcess:
    """``reservoir <args>`` running in a child process; everything it writes on stderr is
    kept in :attr:`said`, and :meth:`wait_for` reads it a line at a time."""

    def __init__(self, name: str, args: list[str], env: Mapping[str, str]) -> None:
        self.name = name
        self.args = args
        #: every line written on stderr so far
        self.said: list[str] = []
        self._unread: queue.Queue[str] = queue.Queue()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "reservoir", *args],
            env=dict(env),
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
        )
        self._pump = threading.Thread(target=self._read, name=f"stderr of {name}", daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.said.append(line)
            self._unread.put(line)

    def wait_for(self, text: str, timeout_s: float = READY_TIMEOUT_S) -> str:
        """The next line on stderr holding ``text`` (lines before it are passed over).
        Raises :class:`AssertionError`, with all the process said, if it never says it
        within ``timeout_s`` or ends without saying it."""
        deadline = time.monotonic() + timeout_s
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self._unread.get(timeout=min(remaining, 0.2))
            except queue.Empty:
                if not self._pump.is_alive() and self._unread.empty():
                    break  # stderr closed and every line read: it will say nothing more
                continue
            if text in line:
                return line
        raise AssertionError(f"{self.name} never said {text!r}: {''.join(self.said)}")

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def terminate(self, timeout_s: float = 30.0) -> int:
        """Stop it with SIGTERM, as an operator or a supervisor would; its exit status."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)

    def kill(self) -> None:
        """SIGKILL it if it still runs, and reap it."""
        if self.running:
            self.process.kill()
        self.process.wait(timeout=10)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a child to listen on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


class ProcessCluster:
    """Node processes and commands on one broker ``url``, with one ``state_dir``.

    ``env``: the children's environment; by default this process's with
    ``RESERVOIR_BROKER_URL`` set to ``url``. ``state_dir``: where the nodes keep their
    ledgers (``--state-dir``); None starts them without one. Every process started is in
    :attr:`started` and :meth:`close` stops those still running; the nodes are in
    :attr:`nodes` too."""

    def __init__(
        self, url: str, state_dir: Path | None = None, env: Mapping[str, str] | None = None
    ) -> None:
        self.url = url
        self.state_dir = state_dir
        self.env: dict[str, str] = (
            dict(env) if env is not None else {**os.environ, "RESERVOIR_BROKER_URL": url}
        )
        self.nodes: dict[str, ReservoirProcess] = {}
        self.started: list[ReservoirProcess] = []

    def start(
        self, name: str, *args: str, env: Mapping[str, str] | None = None
    ) -> ReservoirProcess:
        """Start ``reservoir <args>`` (``serve``, ``keeper``, ...) without waiting for it."""
        child = ReservoirProcess(name, list(args), self.env if env is None else env)
        self.started.append(child)
        return child

    def start_node(
        self,
        name: str,
        *args: str,
        vcpus: int = 8,
        memory_mb: int = 16384,
        env: Mapping[str, str] | None = None,
        ready: str = NODE_READY,
    ) -> ReservoirProcess:
        """Start ``reservoir node --name <name>`` of that size, its state in
        :attr:`state_dir`, with further options ``args``; returns once it says it is ready
        (:data:`NODE_READY`, or the ``ready`` text given)."""
        where = [] if self.state_dir is None else ["--state-dir", str(self.state_dir)]
        size = ["--vcpus", str(vcpus), "--memory-mb", str(memory_mb)]
        node = self.start(name, "node", "--name", name, *size, *where, *args, env=env)
        node.wait_for(ready)
        self.nodes[name] = node
        return node

    def run(
        self, *args: str, env: Mapping[str, str] | None = None, timeout_s: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """``reservoir <args>`` run to its end (see :func:`run_reservoir`)."""
        return run_reservoir(*args, env=self.env if env is None else env, timeout_s=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every process started that still runs: SIGTERM to all of them, then SIGKILL
        to whichever has not ended within ``timeout_s``."""
        running = [child for child in self.started if child.running]
        for child in running:
            child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in running:
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.kill()

    def __enter__(self) -> ProcessCluster:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
