"""``python -m reservoir``: the ``reservoir`` command, for where the script is not on PATH."""

from reservoir.cli import main

main(prog_name="reservoir")
