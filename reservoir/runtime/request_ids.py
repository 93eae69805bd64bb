"""Fresh request ids: the shape of ``uuid.uuid4().hex`` (32 hex digits of a version-4
UUID), from the same source, the OS's random bytes, read for many ids at a time.

Why not ``uuid.uuid4()`` for each: it reads 16 bytes with ``os.urandom``, which lets go of
the interpreter's lock for the system call. A caller's thread that lets go of it while the
broker's IO thread is busy must wait to take it back, and that wait is a wake-up on a
cold core for every placement (docs/performance.md, "The runtime"). Read :data:`BATCH`
ids at a time, the ids are as random as before and the wait comes once in :data:`BATCH`.
A forked child starts a pool of its own, so it never hands out the ids its parent holds.
"""

from __future__ import annotations

import os
import threading
import uuid
from typing import Final

__all__ = ["BATCH", "new_request_id"]

#: ids read from the OS in one system call
BATCH: Final = 256
_ID_BYTES: Final = 16


class _Pool:
    """Random bytes read ahead, handed out 16 at a time, each once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bytes = b""
        self._at = 0

    def take(self) -> bytes:
        with self._lock:
            if self._at >= len(self._bytes):
                self._bytes = os.urandom(_ID_BYTES * BATCH)
                self._at = 0
            at = self._at
            self._at = at + _ID_BYTES
            return self._bytes[at : at + _ID_BYTES]


_pool = _Pool()


def _renew_after_fork() -> None:
    # The parent's unread bytes must not become the child's ids too, and its lock may have
    # been held by a thread the child does not have.
    global _pool
    _pool = _Pool()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_after_fork)


def new_request_id() -> str:
    """A fresh request id: ``uuid.uuid4().hex``'s shape and randomness."""
    return uuid.UUID(bytes=_pool.take(), version=4).hex
