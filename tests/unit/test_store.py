"""The durable node ledger: allocations survive the node agent, bad files are refused."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from reservoir import SqliteStore, StateError
from reservoir.protocol.ledger import Allocation
from reservoir.protocol.messages import NumaPlacement
from reservoir.protocol.task_book import EndedTask
from reservoir.testing import Simulation


def an_allocation(allocation_id: str = "n1.x.1/0", **fields: object) -> Allocation:
    values: dict[str, object] = {
        "allocation_id": allocation_id, "request_id": "r1", "reservation_id": "n1.x.1",
        "owner": "req", "resources": {"VCPU": 2, "MEMORY_MB": 1024},
    }  # fmt: skip
    values.update(fields)
    return Allocation(**values)  # type: ignore[arg-type]


def test_allocations_come_back_after_reopening(tmp_path: Path) -> None:
    store = SqliteStore.for_node(tmp_path, "n1")
    numa = NumaPlacement(cells=(0,), cpus=(2, 3), memory_mb_per_cell=(1024,))
    kept = [
        an_allocation(),
        an_allocation("n1.x.2/0", group="web", numa=numa, requested_at_s=1_700_000_123.25),
    ]
    for allocation in kept:
        store.put(allocation)
    store.put(an_allocation("n1.x.3/0"))
    store.delete("n1.x.3/0")
    store.close()
    assert SqliteStore.for_node(tmp_path, "n1").load() == kept


VERSION_1_SCHEMA = """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE allocations (
        allocation_id TEXT PRIMARY KEY, request_id TEXT NOT NULL,
        reservation_id TEXT NOT NULL, owner TEXT NOT NULL, resources TEXT NOT NULL,
        request_count INTEGER NOT NULL, server_group TEXT, numa TEXT
    );
    INSERT INTO meta VALUES ('application', 'reservoir-node-ledger'),
        ('schema_version', '1'), ('node', 'n1');
    INSERT INTO allocations VALUES
        ('n1.x.1/0', 'r1', 'n1.x.1', 'req', '{"MEMORY_MB": 1024, "VCPU": 2}', 1, NULL, NULL);
"""


def test_a_version_1_file_is_upgraded_and_its_allocations_dated_older_than_any(
    tmp_path: Path,
) -> None:
    db = sqlite3.connect(tmp_path / "n1.sqlite3")
    db.executescript(VERSION_1_SCHEMA)
    db.close()
    store = SqliteStore.for_node(tmp_path, "n1")
    assert store.load() == [an_allocation(requested_at_s=0.0)]
    store.put(an_allocation("n1.x.2/0", requested_at_s=5.5))
    store.close()
    again = SqliteStore.for_node(tmp_path, "n1")
    assert [a.requested_at_s for a in again.load()] == [0.0, 5.5]
    version = sqlite3.connect(tmp_path / "n1.sqlite3").execute(
        "SELECT value FROM meta WHERE key = 'schema_version'"
    )
    assert version.fetchone() == ("3",)


def test_another_nodes_version_1_file_is_refused_before_it_is_upgraded(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "n1.sqlite3")
    db.executescript(VERSION_1_SCHEMA)
    db.close()
    (tmp_path / "n1.sqlite3").rename(tmp_path / "n2.sqlite3")
    with pytest.raises(StateError, match="belongs to node 'n1', not 'n2'"):
        SqliteStore.for_node(tmp_path, "n2")
    version = sqlite3.connect(tmp_path / "n2.sqlite3").execute(
        "SELECT value FROM meta WHERE key = 'schema_version'"
    )
    assert version.fetchone() == ("1",)


def test_a_version_1_file_upgraded_by_another_process_meanwhile_is_not_upgraded_twice(
    tmp_path: Path,
) -> None:
    db = sqlite3.connect(tmp_path / "n1.sqlite3")
    db.executescript(VERSION_1_SCHEMA)
    db.close()
    early = SqliteStore.for_node(tmp_path, "n1")  # read version 1, upgraded it
    late = SqliteStore.for_node(tmp_path, "n1")  # as if it had read 1 before that
    late._upgrade_from_1()
    assert late.load() == early.load() == [an_allocation(requested_at_s=0.0)]
    early.close()
    late.close()


def a_later_releases_file(tmp_path: Path, **meta: str) -> Path:
    """A state file as a later release would leave it: a schema this one does not read."""
    SqliteStore.for_node(tmp_path, "n1").put(an_allocation())
    path = tmp_path / "n1.sqlite3"
    db = sqlite3.connect(path)
    for key, value in meta.items():
        db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))
    db.commit()
    db.close()
    return path


def contents(path: Path) -> list[tuple[object, ...]]:
    db = sqlite3.connect(path)
    try:
        return [*db.execute("SELECT * FROM meta ORDER BY key"),
                *db.execute("SELECT * FROM allocations")]  # fmt: skip
    finally:
        db.close()


def test_a_later_releases_file_is_refused_in_one_line_naming_both_and_what_to_do(
    tmp_path: Path,
) -> None:
    from reservoir.version import __version__

    path = a_later_releases_file(tmp_path, schema_version="4", release="0.3.1")
    before = contents(path)
    with pytest.raises(StateError) as refused:
        SqliteStore.for_node(tmp_path, "n1")
    said = str(refused.value)
    assert "\n" not in said
    assert said == (
        f"{path} has schema version 4, last opened by reservoir 0.3.1; this reservoir "
        f"({__version__}) reads versions up to 3: run reservoir 0.3.1 or later with this "
        "state directory (nothing in it was changed), or give this release another "
        "--state-dir, which starts with no allocation"
    )
    assert contents(path) == before


def test_a_later_file_that_names_no_release_is_refused_all_the_same(tmp_path: Path) -> None:
    path = a_later_releases_file(tmp_path, schema_version="7")
    sqlite3.connect(path).execute("DELETE FROM meta WHERE key = 'release'").connection.commit()
    with pytest.raises(StateError, match=r"last opened by a later release of reservoir; .* run "
                       r"that release with this state directory"):  # fmt: skip
        SqliteStore.for_node(tmp_path, "n1")


def test_the_file_names_the_last_release_that_opened_it(tmp_path: Path) -> None:
    from reservoir.version import __version__

    path = a_later_releases_file(tmp_path, release="0.1.9")  # schema 3: this one reads it
    SqliteStore.for_node(tmp_path, "n1").close()
    assert ("release", __version__) in contents(path)


def test_the_file_is_in_wal_mode(tmp_path: Path) -> None:
    SqliteStore.for_node(tmp_path, "n1").close()
    mode = sqlite3.connect(tmp_path / "n1.sqlite3").execute("PRAGMA journal_mode").fetchone()
    assert mode == ("wal",)


def test_another_nodes_state_file_is_refused(tmp_path: Path) -> None:
    SqliteStore.for_node(tmp_path, "n1").close()
    (tmp_path / "n1.sqlite3").rename(tmp_path / "n2.sqlite3")
    with pytest.raises(StateError, match="belongs to node 'n1', not 'n2'"):
        SqliteStore.for_node(tmp_path, "n2")


def test_a_file_that_is_not_sqlite_is_refused_not_reset(tmp_path: Path) -> None:
    path = tmp_path / "n1.sqlite3"
    path.write_bytes(b"this is not a database, and it must survive" * 100)
    before = path.read_bytes()
    with pytest.raises(StateError, match="not a usable reservoir state file"):
        SqliteStore.for_node(tmp_path, "n1")
    assert path.read_bytes() == before


def test_a_foreign_sqlite_file_is_refused(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "n1.sqlite3")
    db.execute("CREATE TABLE something_else (x INTEGER)")
    db.commit()
    db.close()
    with pytest.raises(StateError, match="not a reservoir state file"):
        SqliteStore.for_node(tmp_path, "n1")


def test_a_corrupt_row_is_refused_with_its_id(tmp_path: Path) -> None:
    store = SqliteStore.for_node(tmp_path, "n1")
    store.put(an_allocation())
    store.close()
    db = sqlite3.connect(tmp_path / "n1.sqlite3")
    db.execute("UPDATE allocations SET resources = 'not json'")
    db.commit()
    db.close()
    with pytest.raises(StateError, match=r"allocation 'n1.x.1/0' is corrupt"):
        SqliteStore.for_node(tmp_path, "n1").load()


def test_a_restarted_node_keeps_its_allocations_and_its_tier(
    tmp_path: Path, reservoir_simulation: Simulation
) -> None:
    sim = reservoir_simulation
    node = sim.add_node("n1", vcpus=10, store=SqliteStore.for_node(tmp_path, "n1"))
    requestor = sim.add_requestor()
    placements = [sim.place(requestor, vcpus=3) for _ in range(2)]
    before = sorted(a.allocation_id for a in node.allocations())
    assert node.tier() == 75
    restarted = sim.restart_node("n1", vcpus=10, store=SqliteStore.for_node(tmp_path, "n1"))
    assert sorted(a.allocation_id for a in restarted.allocations()) == before
    assert restarted.tier() == 75
    # the restarted node still answers for what it holds (to a requestor that has never
    # heard of the request), and frees it
    again = sim.place(sim.add_requestor("fresh"), vcpus=3, request_id=placements[0].request_id)
    assert again.allocations == placements[0].allocations
    done = requestor.release_future(placements[1])
    assert sim.run_until_done([done])
    assert len(restarted.allocations()) == 1
    sim.finish([placements[0]])


def test_ended_tasks_come_back_after_reopening_oldest_first(tmp_path: Path) -> None:
    store = SqliteStore.for_node(tmp_path, "n1")
    later = EndedTask(allocation_id="n1.x.2/0", request_id="r2", driver="exec", state="stopped",
                      exit_code=143, reason="released (SIGTERM)", ended_at_s=20.0)  # fmt: skip
    earlier = EndedTask(allocation_id="n1.x.1/0", request_id="r1", driver="exec", state="exited",
                        exit_code=3, ended_at_s=10.0)  # fmt: skip
    store.put_ended_task(later)
    store.put_ended_task(earlier)
    store.put_ended_task(EndedTask(allocation_id="n1.x.3/0", request_id="r3", driver="exec",
                                   state="failed", ended_at_s=30.0))  # fmt: skip
    store.delete_ended_task("n1.x.3/0")
    store.close()
    assert SqliteStore.for_node(tmp_path, "n1").load_ended_tasks() == [earlier, later]


def test_a_version_3_file_of_an_earlier_release_gains_the_ended_tasks_table_and_stays_at_3(
    tmp_path: Path,
) -> None:
    path = tmp_path / "n1.sqlite3"
    store = SqliteStore.for_node(tmp_path, "n1")
    store.put(an_allocation())
    store.close()
    db = sqlite3.connect(path)
    db.execute("DROP TABLE ended_tasks")  # as an earlier release made it
    db.commit()
    db.close()
    store = SqliteStore.for_node(tmp_path, "n1")
    assert store.load_ended_tasks() == []
    assert store.load() == [an_allocation()]
    store.close()
    db = sqlite3.connect(path)
    version = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    db.close()
    # an earlier release reads the file still: same version, a table it never reads
    assert version == ("3",) and "ended_tasks" in tables
