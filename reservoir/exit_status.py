"""The exit statuses of every ``reservoir`` command, owned here so they agree.

A script around the commands tells "not placed" from "broker down" by these numbers, so
each has one definition; docs/cli.md, "Exit status", lists them.
"""

from __future__ import annotations

from typing import Final

EXIT_NOT_PLACED: Final = 1
#: ``reservoir logs`` and ``reservoir wait``: no node holds a task of the request id
EXIT_NOT_FOUND: Final = 1
#: a usage error: an option or argument a command cannot take
EXIT_USAGE: Final = 2
#: a run that could not be carried out, or whose invariant audit or checks failed; the
#: same number as a usage error, as docs/cli.md's "Exit status" line says
EXIT_RUN_FAILED: Final = 2
#: the broker is unreachable; also ``logs`` and ``wait`` when a node does not answer (what
#: it holds is not known)
EXIT_BROKER: Final = 3
#: ``reservoir run``: the task never started (its node said why), or its exit code is
#: unknown (it ended while its node agent was away); as ``docker run`` says it
EXIT_TASK_NOT_RUN: Final = 125
#: stopped by Ctrl-C or SIGTERM: 128 + SIGINT, as a shell reports it
EXIT_INTERRUPTED: Final = 130
