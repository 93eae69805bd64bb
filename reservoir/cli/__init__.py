"""The ``reservoir`` command: one module per command, registered here.

:mod:`.group` is the group and its options (logging); :mod:`.options` holds what the
commands share (``--broker``, ``--json``, settings, the one line a bad setting or an
unreachable broker gets). Adding a command is a module here and a line below.

Every command reads ``RESERVOIR_BROKER_URL`` (and the other ``RESERVOIR_*`` settings) when
the matching option is absent. Exit statuses: :mod:`reservoir.exit_status`.
"""

from __future__ import annotations

from reservoir.cli import (
    audit,
    bench,
    bench_service,
    chaos,
    demo,
    free,
    inspect,
    keeper,
    keys,
    node,
    nodes,
    request,
    run,
    serve,
    simulate,
    versus,
)
from reservoir.cli.group import main

__all__ = ["main"]

for command in (
    demo.demo,
    node.node,
    keeper.keeper,
    request.request,
    run.run,
    run.tasks_command,
    run.logs,
    run.wait,
    free.free,
    inspect.inspect,
    nodes.nodes_command,
    audit.audit_command,
    simulate.simulate,
    bench.bench,
    bench_service.bench_service,
    chaos.chaos,
    serve.serve,
    keys.keys,
    versus.versus,
):
    main.add_command(command)
