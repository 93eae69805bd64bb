"""``pip install`` of the ``reservoir-scheduler`` wheel built from this checkout gives the
``reservoir`` command: the wheel is built as CI and the image build do (``pip wheel
--no-deps``, from a copy of the tracked files), installed into a fresh venv, and the venv's
own ``reservoir`` answers ``--version`` and imports the package from the venv, and its
hints for a missing extra name what the wheel's metadata lists for it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from reservoir.version import DISTRIBUTION, __version__, version_line

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def _copy_tracked_files(to: Path) -> None:
    """The tracked files only: building in the work tree would leave build/ there."""
    listed = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, to / name)


def test_the_wheel_installs_as_reservoir_scheduler_and_gives_the_reservoir_command(
    tmp_path: Path,
) -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to know the tracked files")
    source, wheels, env = tmp_path / "source", tmp_path / "wheels", tmp_path / "venv"
    source.mkdir()
    _copy_tracked_files(source)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
         "--disable-pip-version-check", "-w", str(wheels), str(source)],
        check=True,
    )  # fmt: skip
    (wheel,) = wheels.glob("*.whl")
    assert wheel.name.startswith(f"{DISTRIBUTION.replace('-', '_')}-{__version__}-")

    # the dependencies come from this interpreter's site-packages (no index needed); the
    # venv's own site-packages come first, so the venv's reservoir is the one imported
    venv.create(env, with_pip=False, system_site_packages=True)
    python = env / "bin" / "python"
    # not this checkout through PYTHONPATH: pip would take it for the wheel installed
    # already (and install nothing), and the command would run it rather than the wheel
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q",
         "--disable-pip-version-check", str(wheel)],
        check=True,
        env=clean,
    )  # fmt: skip
    command = env / "bin" / "reservoir"
    assert command.exists()
    shown = subprocess.run(
        [str(command), "--version"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
        env=clean,
    )
    assert shown.stdout.strip() == f"reservoir, version {version_line()}"
    where = subprocess.run(
        [str(python), "-c",
         "import importlib.metadata, reservoir;"
         f"print(reservoir.__file__); print(importlib.metadata.version({DISTRIBUTION!r}))"],
        capture_output=True, text=True, check=True, cwd=tmp_path, env=clean,
    ).stdout.split()  # fmt: skip
    assert Path(where[0]).is_relative_to(env)
    assert where[1] == __version__
    # installed from the wheel, a missing extra's hint names the packages the wheel's own
    # metadata lists for it: a command that works with no release on an index
    hint = subprocess.run(
        [str(python), "-c", "from reservoir.version import install_hint as h; print(h('signing'))"],
        capture_output=True, text=True, check=True, cwd=tmp_path, env=clean,
    ).stdout.strip()  # fmt: skip
    assert hint == "pip install 'cryptography>=38' (the signing extra)"
    # the dashboard's page ships as package data
    ui = Path(where[0]).parent / "service" / "ui"
    assert sorted(p.name for p in ui.iterdir()) == ["dashboard.css", "dashboard.js", "index.html"]
