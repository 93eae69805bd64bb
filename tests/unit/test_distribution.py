"""reservoir is distributed as ``reservoir-scheduler`` (the PyPI project ``reservoir`` is
someone else's): pyproject.toml, every ``pip install`` line of the docs, the deployment files
and the error hints all name the one distribution reservoir.version owns."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from reservoir.version import DISTRIBUTION, __version__, install_hint

ROOT = Path(__file__).resolve().parents[2]

#: where a user or an operator reads an install command
DOCUMENTED = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
    *sorted((ROOT / "deploy").rglob("*.md")),
    ROOT / "deploy" / "docker" / "Dockerfile",
    *sorted((ROOT / "reservoir").rglob("*.py")),
    *sorted((ROOT / "examples").rglob("*.py")),
]

#: a distribution named with extras, as in pip install 'name[extra]'
NAMED_WITH_EXTRAS = re.compile(r"(?<![\w./-])([A-Za-z][\w.-]*)\[([a-z,]+)\]")


def test_pyproject_names_the_distribution_reservoir_version_owns() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION == "reservoir-scheduler"
    assert project["version"] == __version__


def test_the_hints_name_the_distribution_with_the_extra() -> None:
    assert install_hint("api") == "pip install 'reservoir-scheduler[api]'"


def test_every_install_with_extras_in_docs_and_code_names_the_distribution() -> None:
    extras = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    )
    wrong = []
    for path in DOCUMENTED:
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            for name, wanted in NAMED_WITH_EXTRAS.findall(line):
                # reservoir[...] or reservoir-anything[...]; others' packages are theirs
                ours = name == "reservoir" or name.startswith("reservoir-")
                if ours and (name != DISTRIBUTION or not set(wanted.split(",")) <= extras):
                    wrong.append(f"{path.relative_to(ROOT)}:{line_no}: {name}[{wanted}]")
    assert wrong == []


def test_no_pip_install_names_the_bare_reservoir_project() -> None:
    # the package to install right after pip install and its options
    bare = re.compile(r"pip install (?:-[-\w=]+ )*['\"]?reservoir(?![\w.-])")
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in DOCUMENTED
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if bare.search(line)
    ]
    assert found == []


def test_the_version_option_reads_the_release_without_asking_for_a_distribution() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "reservoir", "--version"],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    ).stdout
    assert shown.strip() == f"reservoir, version {__version__}"


@pytest.mark.parametrize("path", ["README.md", "docs/getting-started.md"])
def test_the_quick_start_installs_the_distribution(path: str) -> None:
    page = ROOT / path
    if not page.exists():
        pytest.fail(f"{path} is missing")
    assert f"pip install '{DISTRIBUTION}" in page.read_text() or f"pip install {DISTRIBUTION}" in (
        page.read_text()
    )


def test_the_image_installs_the_distributions_wheel_by_its_name() -> None:
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    wheel = DISTRIBUTION.replace("-", "_")  # a wheel's file name normalises the name
    assert f"/tmp/wheels/project/{wheel}-*.whl" in dockerfile
