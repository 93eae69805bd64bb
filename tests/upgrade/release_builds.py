"""The released builds these tests run beside this tree's: each release pinned to its commit
(and its tag, where the checkout has it), unpacked with ``git archive``, built into a
wheel and installed into a venv of its own. The venv borrows this interpreter's installed
packages (its dependencies; no index is needed but the build's own setuptools, which pip
fetches as it fetches any build requirement), and its own site-packages come first, so
its ``reservoir`` is the release's, never this tree's.

Release 0.1.0 is commit 73c2df5, tagged ``v0.1.0`` (docs/upgrading.md says which release
is which). A later release adds its line here when it is made.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import venv
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: release -> (its commit, its tag)
RELEASES: dict[str, tuple[str, str]] = {
    "0.1.0": ("73c2df593149f91008a55436929fb9a5fa0649a3", "v0.1.0"),
}
#: the release this tree runs beside (the one before it)
PREVIOUS = "0.1.0"


class ReleaseUnavailable(RuntimeError):
    """The checkout lacks the release's commit, or the build failed; the message says how
    to get it."""


@dataclass(frozen=True)
class ReleaseBuild:
    """A release installed in a venv of its own."""

    release: str
    commit: str
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def reservoir(self) -> Path:
        return self.venv / "bin" / "reservoir"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for the release's processes: this tree is not on their path."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(extra)
        return env

    def run(
        self, *args: str, input: str | None = None, timeout_s: float = 120.0, **env: str
    ) -> subprocess.CompletedProcess[str]:
        """Run the release's python with ``args``, out of any checkout's directory."""
        return subprocess.run(
            [str(self.python), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            cwd=self.venv,
            env=self.env(**env),
        )


def _git(*args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, check=False)


def build(release: str, workdir: Path) -> ReleaseBuild:
    """``release`` built from its commit and installed in ``workdir/venv``."""
    commit, tag = RELEASES[release]
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        raise ReleaseUnavailable("building a release needs a git checkout of reservoir")
    if _git("cat-file", "-e", f"{commit}^{{commit}}").returncode != 0:
        raise ReleaseUnavailable(
            f"the checkout lacks commit {commit[:7]} (release {release}): "
            f"git fetch origin tag {tag}, or fetch the full history"
        )
    tagged = _git("rev-parse", "-q", "--verify", f"{tag}^{{commit}}")
    if tagged.returncode == 0 and tagged.stdout.decode().strip() != commit:
        raise ReleaseUnavailable(
            f"tag {tag} points at {tagged.stdout.decode().strip()[:7]}, not {commit[:7]}: "
            f"release {release} is {commit[:7]}"
        )
    source, wheels, env_dir = workdir / "source", workdir / "wheels", workdir / "venv"
    source.mkdir(parents=True)
    archive = workdir / "source.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "archive", commit], cwd=ROOT, stdout=out, check=True)
    with tarfile.open(archive) as unpacked:
        unpacked.extractall(source, filter="data")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "--disable-pip-version-check",
         "-w", str(wheels), str(source)],
        capture_output=True, text=True, env=clean, check=False,
    )  # fmt: skip
    if built.returncode != 0:
        raise ReleaseUnavailable(f"building release {release} failed: {built.stderr[-2000:]}")
    (wheel,) = wheels.glob("*.whl")
    venv.create(env_dir, with_pip=False, system_site_packages=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install",
         "--no-deps", "-q", "--disable-pip-version-check", str(wheel)],
        check=True, capture_output=True, env=clean,
    )  # fmt: skip
    installed = ReleaseBuild(release, commit, env_dir)
    where = installed.run(
        "-c",
        "import json, reservoir, reservoir.version as v;"
        "print(json.dumps([reservoir.__file__, v.__version__]))",
    )
    file, version = json.loads(where.stdout)
    if version != release or not Path(file).is_relative_to(env_dir):
        raise ReleaseUnavailable(f"the venv runs reservoir {version} from {file}, not {release}")
    return installed
