"""The optional mypyc build (setup.py): every module of the machines is either compiled or
says why not, and a test run knows which of the two it is running.

``.ci/run`` builds the compiled modules in a copy of the tree and runs the protocol,
scenario, property and simulator tests there with ``RESERVOIR_EXPECT_COMPILED=1``."""

from __future__ import annotations

import ast
import importlib
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("reservoir/protocol", "reservoir/tools/simulator")


def setup_lists() -> tuple[list[str], dict[str, str]]:
    """COMPILED and INTERPRETED as setup.py states them (read, not run: running it builds)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    found: dict[str, object] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            name, value = node.target.id, node.value
        else:
            continue
        if name in ("COMPILED", "INTERPRETED"):
            found[name] = ast.literal_eval(value)
    compiled, interpreted = found["COMPILED"], found["INTERPRETED"]
    assert isinstance(compiled, list) and isinstance(interpreted, dict)
    return compiled, interpreted


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def test_every_module_of_the_machines_is_compiled_or_says_why_not() -> None:
    compiled, interpreted = setup_lists()
    modules = {str(p.relative_to(ROOT)) for pkg in PACKAGES for p in (ROOT / pkg).glob("*.py")}
    assert set(compiled).isdisjoint(interpreted)
    assert set(compiled) | set(interpreted) == modules
    assert all(reason.strip() for reason in interpreted.values())


def test_a_run_is_on_the_compiled_modules_exactly_when_it_says_so() -> None:
    compiled, _ = setup_lists()
    is_compiled = {
        path: not str(importlib.import_module(module_name(path)).__file__).endswith(".py")
        for path in compiled
    }
    if os.environ.get("RESERVOIR_EXPECT_COMPILED") == "1":
        assert all(is_compiled.values()), [p for p, c in is_compiled.items() if not c]
    else:
        # A tree with some modules built and others not is a stale build: rebuild or clean
        # (find reservoir -name '*.so' -delete).
        assert len(set(is_compiled.values())) == 1, is_compiled
