"""The ``reservoir`` command: one module per command, registered here.

:mod:`.group` is the group and its options (logging); :mod:`.options` holds what the
commands share (``--broker``, ``--json``, settings, the one line a bad setting or an
unreachable broker gets). Adding a command is a module here and a line below.

Every command reads ``RESERVOIR_BROKER_URL`` (and the other ``RESERVOIR_*`` settings) when
the matching option is absent. Exit statuses: :mod:`reservoir.exit_status`.
"""

from __future__ import annotations

from reservoir.cli.group import main

__all__ = ["COMMANDS", "main"]

#: every command: its name, and where it is (imported when it is run or listed)
COMMANDS = {
    "demo": "reservoir.cli.demo:demo",
    "node": "reservoir.cli.node:node",
    "keeper": "reservoir.cli.keeper:keeper",
    "request": "reservoir.cli.request:request",
    "run": "reservoir.cli.run:run",
    "tasks": "reservoir.cli.run:tasks_command",
    "logs": "reservoir.cli.run:logs",
    "wait": "reservoir.cli.run:wait",
    "free": "reservoir.cli.free:free",
    "inspect": "reservoir.cli.inspect:inspect",
    "nodes": "reservoir.cli.nodes:nodes_command",
    "audit": "reservoir.cli.audit:audit_command",
    "simulate": "reservoir.cli.simulate:simulate",
    "bench": "reservoir.cli.bench:bench",
    "bench-service": "reservoir.cli.bench_service:bench_service",
    "chaos": "reservoir.cli.chaos:chaos",
    "serve": "reservoir.cli.serve:serve",
    "keys": "reservoir.cli.keys:keys",
    "versus": "reservoir.cli.versus:versus",
}
main.lazy = COMMANDS
