"""The host processes' side of their conversation with the bench (``node_host``,
``requestor_host``; :mod:`reservoir.tools.bench.children` is the bench's side).

This module owns the lines: a host writes one JSON object per line on stdout
(:func:`say`; nothing else is ever written there, logs go to stderr) and reads one command
per line on stdin (:class:`Commands`). It stops on a line ``stop``, on SIGTERM or SIGINT,
and when stdin closes: the bench is gone, and a host must not outlive it.
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Final

__all__ = ["Commands", "names_of", "say"]

#: how often the main thread looks up from waiting, so that signals are handled promptly
POLL_S: Final = 0.2


def say(event: str, **fields: object) -> None:
    """One line to the bench: ``{"event": event, **fields}``."""
    sys.stdout.write(json.dumps({"event": event, **fields}, sort_keys=True) + "\n")
    sys.stdout.flush()


def names_of(value: str) -> list[str]:
    """The names of a comma-separated ``--names`` (empty ones left out)."""
    return [name for name in value.split(",") if name]


class Commands:
    """The bench's commands, in order, until one says stop. Made on the main thread: it
    takes SIGTERM and SIGINT for a ``stop``, from then on. :meth:`listen` starts reading
    stdin (once the host is ready); iterating yields each command but ``stop``, and ends
    there."""

    def __init__(self) -> None:
        self._lines: queue.SimpleQueue[str] = queue.SimpleQueue()
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._lines.put("stop")  # SimpleQueue.put is reentrant: safe in a signal handler

    def listen(self, thread_name: str) -> None:
        threading.Thread(target=self._read_stdin, name=thread_name, daemon=True).start()

    def _read_stdin(self) -> None:
        for line in sys.stdin:
            self._lines.put(line.strip())
        self._lines.put("stop")  # the bench is gone: do not outlive it

    def __iter__(self) -> Iterator[str]:
        while True:
            try:
                command = self._lines.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if command == "stop":
                return
            yield command
