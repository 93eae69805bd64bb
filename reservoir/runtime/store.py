"""Where a node agent keeps its allocations so they outlive the process.

Allocations are durable; reservations are not (a node that dies loses them, and the
requestor sees a refusal or a timeout and moves on). :class:`SqliteStore` keeps one SQLite
database per node in WAL mode with ``synchronous=FULL``: an allocation is on disk before the
node says ``Accepted``. A file that is not a reservoir state file, or belongs to another
node, is refused with :class:`StateError`, never silently reset.

Across releases (docs/design.md, "Upgrades: two releases at once"): a file of an earlier
schema is upgraded in place when opened; one of a later schema than this release reads
is refused, in one line naming both schemas, the release that last opened it and what to
do, and left as it was. A node rolled back to the release before must find its file as
that release wrote it, so a release changes nothing that release reads: 0.1.0 reads schema
3 exactly, inserts its rows by position and reads the JSON of a task and of a NUMA
placement refusing any field it does not know, so the file stays schema 3 with the same
tables and columns, and what a later release must keep besides goes in tables of its own.
The meta table's ``release`` names the last release (0.2 or later) that opened it.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Final, Protocol

import msgspec

from reservoir.protocol.ledger import Allocation
from reservoir.protocol.messages import NumaPlacement, TaskSpec
from reservoir.protocol.task_book import EndedTask
from reservoir.runtime.tasks import TaskHandle
from reservoir.version import __version__

__all__ = ["AllocationStore", "MemoryStore", "SqliteStore", "StateError"]

_APPLICATION: Final = "reservoir-node-ledger"
#: 2 added ``requested_at_s`` (which of two placements of one id stands); a version 1
#: file is upgraded in place when opened, its allocations dated 0 (older than any other);
#: 3 added the allocations' ``task`` and ``reply_to`` and the ``tasks`` table (the handles
#: of running tasks, so a restarted agent re-attaches to them). Release 0.1.0 wrote 3.
_SCHEMA_VERSION: Final = 3
#: the columns of ``allocations``, in order (0.1.0 inserts by position: none may be added
#: while a node may be rolled back to it)
_COLUMNS: Final = (
    "allocation_id, request_id, reservation_id, owner, resources, request_count, "
    "server_group, numa, requested_at_s, task, reply_to"
)
#: The ``ended_tasks`` table (the tasks that ended lately, kept for their retention) is
#: made when a file lacks it, whatever its version: a table an earlier release does not
#: know is one it never reads, so the file stays readable by it (it forgets ended tasks
#: at a restart, as it always did).
_ENDED_TASKS_TABLE: Final = (
    "CREATE TABLE IF NOT EXISTS ended_tasks ("
    "allocation_id TEXT PRIMARY KEY, ended_at_s REAL NOT NULL, record TEXT NOT NULL)"
)


class StateError(RuntimeError):
    """A node's state file cannot be used as it is; the message says why and where."""


class AllocationStore(Protocol):
    def load(self) -> list[Allocation]: ...

    def put(self, allocation: Allocation) -> None: ...

    def delete(self, allocation_id: str) -> None: ...

    def load_tasks(self) -> list[TaskHandle]: ...

    def put_task(self, handle: TaskHandle) -> None: ...

    def delete_task(self, allocation_id: str) -> None: ...

    def load_ended_tasks(self) -> list[EndedTask]: ...

    def put_ended_task(self, task: EndedTask) -> None: ...

    def delete_ended_task(self, allocation_id: str) -> None: ...

    def close(self) -> None: ...


class MemoryStore:
    """Keeps allocations for the life of the process only."""

    def __init__(self) -> None:
        self._allocations: dict[str, Allocation] = {}
        self._tasks: dict[str, TaskHandle] = {}
        self._ended: dict[str, EndedTask] = {}

    def load_tasks(self) -> list[TaskHandle]:
        return list(self._tasks.values())

    def load_ended_tasks(self) -> list[EndedTask]:
        return list(self._ended.values())

    def put_ended_task(self, task: EndedTask) -> None:
        self._ended[task.allocation_id] = task

    def delete_ended_task(self, allocation_id: str) -> None:
        self._ended.pop(allocation_id, None)

    def put_task(self, handle: TaskHandle) -> None:
        self._tasks[handle.allocation_id] = handle

    def delete_task(self, allocation_id: str) -> None:
        self._tasks.pop(allocation_id, None)

    def load(self) -> list[Allocation]:
        return list(self._allocations.values())

    def put(self, allocation: Allocation) -> None:
        self._allocations[allocation.allocation_id] = allocation

    def delete(self, allocation_id: str) -> None:
        self._allocations.pop(allocation_id, None)

    def close(self) -> None:
        pass


class SqliteStore:
    """A node's allocations in ``<state_dir>/<node>.sqlite3``."""

    def __init__(self, path: Path, *, node_name: str) -> None:
        self.path = path
        self.node_name = node_name
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        existed = path.exists() and path.stat().st_size > 0
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            if existed:
                self._check_owner()
            else:
                self._create()
            with self._lock:
                self._db.execute(_ENDED_TASKS_TABLE)
        except sqlite3.DatabaseError as error:
            self._db.close()
            raise StateError(f"{path} is not a usable reservoir state file: {error}") from None
        except BaseException:
            self._db.close()
            raise

    @classmethod
    def for_node(cls, state_dir: Path, node_name: str) -> SqliteStore:
        return cls(state_dir / f"{node_name}.sqlite3", node_name=node_name)

    def _create(self) -> None:
        with self._lock:
            self._db.executescript(
                """
                BEGIN;
                CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
                CREATE TABLE allocations (
                    allocation_id TEXT PRIMARY KEY,
                    request_id TEXT NOT NULL,
                    reservation_id TEXT NOT NULL,
                    owner TEXT NOT NULL,
                    resources TEXT NOT NULL,
                    request_count INTEGER NOT NULL,
                    server_group TEXT,
                    numa TEXT,
                    requested_at_s REAL NOT NULL DEFAULT 0,
                    task TEXT,
                    reply_to TEXT
                );
                CREATE TABLE tasks (allocation_id TEXT PRIMARY KEY, handle TEXT NOT NULL);
                COMMIT;
                """
            )
            self._db.executemany(
                "INSERT INTO meta VALUES (?, ?)",
                [
                    ("application", _APPLICATION),
                    ("schema_version", str(_SCHEMA_VERSION)),
                    ("node", self.node_name),
                    ("release", __version__),
                ],
            )

    def _check_owner(self) -> None:
        try:
            meta = dict(self._db.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.OperationalError:
            raise StateError(
                f"{self.path} is an SQLite file but not a reservoir state file "
                "(no meta table); move it away or pick another --state-dir"
            ) from None
        if meta.get("application") != _APPLICATION:
            raise StateError(
                f"{self.path} is not a reservoir state file "
                f"(application={meta.get('application')!r})"
            )
        if meta.get("node") != self.node_name:
            raise StateError(
                f"{self.path} belongs to node {meta.get('node')!r}, not {self.node_name!r}"
            )
        version = meta.get("schema_version", "")
        if not version.isdigit():
            raise StateError(f"{self.path} has no schema version this reservoir can read")
        if int(version) > _SCHEMA_VERSION:
            raise StateError(self._too_new(int(version), meta.get("release")))
        if version in ("1", "2"):
            self._upgrade_from_1()
        elif version != str(_SCHEMA_VERSION):
            raise StateError(
                f"{self.path} has schema version {version}, which no release of reservoir "
                f"wrote; this one ({__version__}) reads versions 1 to {_SCHEMA_VERSION}"
            )
        if meta.get("release") != __version__:
            with self._lock:
                self._db.execute(
                    "INSERT OR REPLACE INTO meta VALUES ('release', ?)", (__version__,)
                )

    def _too_new(self, version: int, release: str | None) -> str:
        """One line: the file is a later release's, and what to do about it."""
        by = f"reservoir {release}" if release else "a later release of reservoir"
        return (
            f"{self.path} has schema version {version}, last opened by {by}; this "
            f"reservoir ({__version__}) reads versions up to {_SCHEMA_VERSION}: run "
            f"{'reservoir ' + release + ' or later' if release else 'that release'} with "
            "this state directory (nothing in it was changed), or give this release "
            "another --state-dir, which starts with no allocation"
        )

    def _upgrade_from_1(self) -> None:
        """Schema 1 or 2 to 3 (named when there were two), once: two processes opening
        the same file at once may both get here, and the one that takes the write lock
        second finds the work done."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                (version,) = self._db.execute(
                    "SELECT value FROM meta WHERE key = 'schema_version'"
                ).fetchone()
                if version == "1":
                    self._db.execute(
                        "ALTER TABLE allocations ADD COLUMN requested_at_s REAL NOT NULL DEFAULT 0"
                    )
                if version in ("1", "2"):
                    self._db.execute("ALTER TABLE allocations ADD COLUMN task TEXT")
                    self._db.execute("ALTER TABLE allocations ADD COLUMN reply_to TEXT")
                    self._db.execute(
                        "CREATE TABLE tasks (allocation_id TEXT PRIMARY KEY, handle TEXT NOT NULL)"
                    )
                    self._db.execute("UPDATE meta SET value = '3' WHERE key = 'schema_version'")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def load(self) -> list[Allocation]:
        with self._lock:
            rows = self._db.execute(
                f"SELECT {_COLUMNS} FROM allocations ORDER BY allocation_id"
            ).fetchall()
        allocations = []
        for row in rows:
            try:
                resources = json.loads(row[4])
                if not isinstance(resources, dict):
                    raise ValueError("resources is not an object")
                numa = msgspec.json.decode(row[7], type=NumaPlacement) if row[7] else None
                allocations.append(
                    Allocation(
                        allocation_id=row[0],
                        request_id=row[1],
                        reservation_id=row[2],
                        owner=row[3],
                        resources={str(k): int(v) for k, v in resources.items()},
                        request_count=int(row[5]),
                        group=row[6],
                        numa=numa,
                        requested_at_s=float(row[8]),
                        task=msgspec.json.decode(row[9], type=TaskSpec) if row[9] else None,
                        reply_to=row[10],
                    )
                )
            except (ValueError, TypeError) as error:  # msgspec.ValidationError is a ValueError
                raise StateError(
                    f"{self.path}: allocation {row[0]!r} is corrupt: {error}"
                ) from None
        return allocations

    def put(self, allocation: Allocation) -> None:
        with self._lock:
            self._db.execute(
                f"INSERT OR REPLACE INTO allocations ({_COLUMNS}) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    allocation.allocation_id,
                    allocation.request_id,
                    allocation.reservation_id,
                    allocation.owner,
                    json.dumps(dict(allocation.resources), sort_keys=True),
                    allocation.request_count,
                    allocation.group,
                    msgspec.json.encode(allocation.numa).decode() if allocation.numa else None,
                    allocation.requested_at_s,
                    msgspec.json.encode(allocation.task).decode() if allocation.task else None,
                    allocation.reply_to,
                ),
            )

    def delete(self, allocation_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM allocations WHERE allocation_id = ?", (allocation_id,))

    def load_tasks(self) -> list[TaskHandle]:
        with self._lock:
            rows = self._db.execute("SELECT allocation_id, handle FROM tasks").fetchall()
        try:
            return [msgspec.json.decode(row[1], type=TaskHandle) for row in rows]
        except msgspec.ValidationError as error:
            raise StateError(f"{self.path}: a task handle is corrupt: {error}") from None

    def put_task(self, handle: TaskHandle) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO tasks VALUES (?, ?)",
                (handle.allocation_id, msgspec.json.encode(handle).decode()),
            )

    def delete_task(self, allocation_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM tasks WHERE allocation_id = ?", (allocation_id,))

    def load_ended_tasks(self) -> list[EndedTask]:
        with self._lock:
            rows = self._db.execute(
                "SELECT record FROM ended_tasks ORDER BY ended_at_s, allocation_id"
            ).fetchall()
        try:
            return [msgspec.json.decode(row[0], type=EndedTask) for row in rows]
        except msgspec.ValidationError as error:
            raise StateError(f"{self.path}: an ended task's record is corrupt: {error}") from None

    def put_ended_task(self, task: EndedTask) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO ended_tasks VALUES (?, ?, ?)",
                (task.allocation_id, task.ended_at_s, msgspec.json.encode(task).decode()),
            )

    def delete_ended_task(self, allocation_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM ended_tasks WHERE allocation_id = ?", (allocation_id,))

    def close(self) -> None:
        with self._lock:
            self._db.close()
