"""Build hook: with ``RESERVOIR_COMPILE=1``, compile the protocol machines and the
simulator's engine to C extensions with mypyc; otherwise (the default) a pure-Python build.

    pip install mypy && RESERVOIR_COMPILE=1 pip install --no-build-isolation .
    RESERVOIR_COMPILE=1 python setup.py build_ext --inplace      # in a checkout

The compiled modules are the same source, type-checked with mypy --strict and run by the
same tests (``.ci/run`` builds them and runs the protocol, scenario, property and
simulator tests on them). What stays interpreted is in :data:`INTERPRETED`, with why.
"""

from __future__ import annotations

import os

from setuptools import setup

#: the modules mypyc compiles: what the protocol machines and the simulator's event loop
#: run through for every message
COMPILED = [
    "reservoir/protocol/answers.py",
    "reservoir/protocol/contention.py",
    "reservoir/protocol/conversation.py",
    "reservoir/protocol/dry_run.py",
    "reservoir/protocol/finding.py",
    "reservoir/protocol/freeing.py",
    "reservoir/protocol/keeper.py",
    "reservoir/protocol/ledger.py",
    "reservoir/protocol/node.py",
    "reservoir/protocol/numa.py",
    "reservoir/protocol/policies.py",
    "reservoir/protocol/requestor.py",
    "reservoir/protocol/requestor_asking.py",
    "reservoir/protocol/requestor_deciding.py",
    "reservoir/protocol/requestor_lookups.py",
    "reservoir/protocol/requestor_settling.py",
    "reservoir/protocol/requestor_state.py",
    "reservoir/protocol/room.py",
    "reservoir/protocol/roster.py",
    "reservoir/protocol/roster_source.py",
    "reservoir/protocol/tiers.py",
    "reservoir/tools/simulator/calendar.py",
    "reservoir/tools/simulator/engine.py",
]

#: the modules of those two packages that stay interpreted, and why (a test checks that
#: every module of reservoir/protocol and reservoir/tools/simulator is in one list or the other)
INTERPRETED = {
    "reservoir/protocol/__init__.py": "re-exports only",
    "reservoir/protocol/messages.py": "msgspec structs, which a compiled class cannot be",
    "reservoir/protocol/placement.py": "PlacementRequest is a msgspec struct",
    "reservoir/protocol/effects.py": "msgspec structs, made several times per message "
    "(docs/performance.md)",
    "reservoir/protocol/timers.py": "its keys are msgspec structs (made, hashed and compared "
    "several times a placement: docs/performance.md)",
    "reservoir/protocol/filters.py": "Filter and Weigher are runtime_checkable protocols "
    "(plugins are checked against them), which a compiled class cannot be",
    "reservoir/protocol/errors.py": "a subclass of a built-in exception",
    "reservoir/protocol/audit.py": "runs once per audit, never per message",
    "reservoir/protocol/addresses.py": "called when a participant starts and per free",
    "reservoir/protocol/task_book.py": "once per change of a task, never per probe",
    "reservoir/protocol/compatibility.py": "its write plans are closures made once per kind; "
    "what it does per message is a dict lookup",
    "reservoir/protocol/task_policy.py": "once per request carrying a task, where the node "
    "restricts what tasks run",
    "reservoir/tools/simulator/__init__.py": "re-exports only",
    "reservoir/tools/simulator/baselines.py": "the baselines' own loops are a small share of a run",
    "reservoir/tools/simulator/capacity.py": "numpy does the work",
    "reservoir/tools/simulator/workload.py": "numpy does the work",
    "reservoir/tools/simulator/network.py": "its frozen dataclasses go to worker processes by "
    "pickle, which compiled frozen dataclasses do not survive",
    "reservoir/tools/simulator/memory.py": "read once per run",
    "reservoir/tools/simulator/results.py": "summarises once per run",
    "reservoir/tools/simulator/report.py": "tables and plots, once per run",
    "reservoir/tools/simulator/runner.py": "the command and its worker processes",
}

ext_modules = []
if os.environ.get("RESERVOIR_COMPILE") == "1":
    from mypyc.build import mypycify

    ext_modules = mypycify(COMPILED, opt_level="3")

setup(ext_modules=ext_modules)
