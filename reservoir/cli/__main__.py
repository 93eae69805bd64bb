"""``python -m reservoir.cli``: the ``reservoir`` command."""

from reservoir.cli import main

# The guard keeps the command from running again in the worker processes that
# ``reservoir simulate --jobs`` starts (they import this module as ``__mp_main__``).
if __name__ == "__main__":
    main(prog_name="reservoir")
