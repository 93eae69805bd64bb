"""``python -m reservoir`` and the ``reservoir`` script (``[project.scripts]``): the
``reservoir`` command."""

from reservoir.interrupt import install


def run() -> None:
    """The interruption handler first (see :mod:`reservoir.interrupt`), then the commands."""
    install()
    from reservoir.cli import main

    main(prog_name="reservoir")


# The guard keeps the command from running again in the worker processes that
# ``reservoir simulate --jobs`` starts (they import this module as ``__mp_main__``).
if __name__ == "__main__":
    run()
