"""The layout's rules that import-linter cannot state (its contracts, in pyproject.toml,
hold the layers, the pure protocol, private modules and circles; ``lint-imports`` runs
them in .ci/run, and the first test here runs them with the suite)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("reservoir",)


def library_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def test_the_import_contracts_hold() -> None:
    lint_imports = shutil.which("lint-imports")
    if lint_imports is None:
        pytest.fail("lint-imports is missing: pip install -e '.[test]' brings import-linter")
    done = subprocess.run(
        [lint_imports], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout[-4000:]


def test_no_module_takes_a_private_name_from_another_package() -> None:
    # ``from reservoir.cli import _settings`` in reservoir.service was one such: a private
    # name is its module's own business, shared within the package at most
    found = []
    for path in library_files():
        module = module_of(path)
        here = package_of(module, path)
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom) or node.module is None or node.level:
                continue
            if not node.module.startswith(PACKAGES):
                continue
            source_package = node.module.rpartition(".")[0] or node.module
            same_package = source_package == here or node.module == here
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and not same_package:
                    found.append(f"{module} takes {alias.name} from {node.module}")
    assert not found, "\n".join(found)


def test_every_module_is_in_a_layer_package_or_is_a_named_foundation() -> None:
    # the top of the tree says the architecture: packages by layer, and beside them only
    # these small modules every layer stands on
    top = {p.name for p in (ROOT / "reservoir").glob("*.py")}
    assert top == {
        "__init__.py", "__main__.py", "broker.py", "clock.py", "exit_status.py", "version.py",
        "interrupt.py",  # the commands' Ctrl-C path, loaded before anything else
    }  # fmt: skip


def test_the_distribution_installs_one_top_level_package_and_brokers_is_not_one() -> None:
    # what setuptools packs (pyproject.toml's packages.find), found as it finds them
    import tomllib

    from setuptools import find_packages

    found = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = find_packages(where=str(ROOT), **found["packages"]["find"])
    assert {p.partition(".")[0] for p in packages} == {"reservoir"}
    assert "reservoir.brokers" in packages
    gone = subprocess.run(
        [sys.executable, "-c", "import brokers"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert gone.returncode == 1
    assert "No module named 'brokers'" in gone.stderr
