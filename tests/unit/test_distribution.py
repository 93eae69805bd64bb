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

from reservoir.version import DISTRIBUTION, __version__, install_hint, version_line

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


def extras() -> dict[str, list[str]]:
    extras: dict[str, list[str]] = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    return extras


def test_each_hint_names_the_packages_of_its_extra_which_install_however_reservoir_was() -> None:
    # not 'reservoir-scheduler[api]', which no index has until a release is published
    assert install_hint("api") == (
        "pip install 'fastapi>=0.110' 'uvicorn>=0.29' \"uvloop>=0.19; sys_platform != 'win32'\" "
        "'httptools>=0.6' 'prometheus-client>=0.20' 'httpx>=0.27' (the api extra)"
    )
    for extra, packages in extras().items():
        assert install_hint(extra) == (
            f"pip install {' '.join(repr(p) for p in packages)} (the {extra} extra)"
        )


def test_every_hint_in_the_code_names_an_extra_there_is() -> None:
    named = re.compile(r"install_hint\(['\"]([^'\"]+)['\"]\)")
    hinted = {
        extra
        for path in sorted((ROOT / "reservoir").rglob("*.py"))
        for extra in named.findall(path.read_text())
    }
    assert hinted, "no install_hint call found"
    assert hinted <= set(extras()), hinted - set(extras())


@pytest.mark.parametrize("path", ["README.md", "docs/getting-started.md"])
def test_the_install_instructions_list_every_extra_and_install_from_a_checkout(path: str) -> None:
    page = (ROOT / path).read_text()
    assert "python -m pip install '.[api]'" in page
    assert "python -m pip wheel --no-deps -w dist ." in page
    listed = page[page.index("The extras: ") :].split("\n\n", 1)[0]
    missing = [extra for extra in extras() if f"`{extra}`" not in listed]
    assert missing == []


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
    assert shown.strip() == f"reservoir, version {version_line()}"
    assert version_line().startswith(f"{__version__} (protocol ")


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
