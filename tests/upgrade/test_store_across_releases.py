"""A node's state file across releases: release 0.1.0's build (in a venv of its own) and
this tree's open the same file in turn, as a node upgraded in place and rolled back does.
Every allocation and task handle either writes, the other reads whole, and neither
refuses the other's file; a file of a later schema is refused, in one line, before
anything in it changes (docs/design.md, "Upgrades: two releases at once")."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.upgrade.release_builds import ReleaseBuild

pytestmark = pytest.mark.e2e

PROBE = Path(__file__).parent / "store_probe.py"
ROOT = Path(__file__).resolve().parents[2]


def with_release(release: ReleaseBuild, *args: str) -> dict[str, Any]:
    done = release.run(str(PROBE), *args)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def with_this_tree(*args: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(PROBE), *args], capture_output=True, text=True, check=False,
        env={"PYTHONPATH": str(ROOT)}, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def schema_of(path: Path) -> str:
    db = sqlite3.connect(path)
    try:
        (version,) = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        return str(version)
    finally:
        db.close()


def test_a_node_upgraded_in_place_and_rolled_back_keeps_every_allocation_and_task(
    previous_release: ReleaseBuild, tmp_path: Path
) -> None:
    state = str(tmp_path)
    written_by_0_1 = with_release(previous_release, "put", state, "n1", "n1.a.1/0")
    assert len(written_by_0_1["allocations"]) == 1
    # upgraded: this tree reads 0.1.0's file as 0.1.0 does, and adds to it
    assert with_this_tree("load", state, "n1") == written_by_0_1
    both = with_this_tree("put", state, "n1", "n1.b.1/0")
    assert len(both["allocations"]) == len(both["tasks"]) == 2
    assert schema_of(tmp_path / "n1.sqlite3") == "3"
    # rolled back: 0.1.0 reads the file as this tree left it, its own rows and this tree's
    assert with_release(previous_release, "load", state, "n1") == both
    # and forward again, after 0.1.0 wrote to it once more
    again = with_release(previous_release, "put", state, "n1", "n1.c.1/0")
    assert with_this_tree("load", state, "n1") == again


def test_a_file_of_a_later_schema_is_refused_by_both_and_left_as_it_was(
    previous_release: ReleaseBuild, tmp_path: Path
) -> None:
    with_this_tree("put", str(tmp_path), "n1", "n1.a.1/0")
    path = tmp_path / "n1.sqlite3"
    db = sqlite3.connect(path)
    db.execute("UPDATE meta SET value = '4' WHERE key = 'schema_version'")
    db.execute("UPDATE meta SET value = '0.3.0' WHERE key = 'release'")
    db.commit()
    db.close()
    before = path.read_bytes()
    ours = with_this_tree("load", str(tmp_path), "n1")["refused"]
    assert "has schema version 4, last opened by reservoir 0.3.0" in ours
    assert "run reservoir 0.3.0 or later with this state directory" in ours
    # 0.1.0 says less (one line, both versions), as it always did
    theirs = with_release(previous_release, "load", str(tmp_path), "n1")["refused"]
    assert theirs == f"{path} has schema version 4, this reservoir reads version 3"
    assert path.read_bytes() == before and schema_of(path) == "4"
