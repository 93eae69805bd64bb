"""``python -m reservoir.cli``: the ``reservoir`` command. Python imports this package
(every command) before this module runs, so Ctrl-C in that first moment is Python's;
``python -m reservoir`` and the ``reservoir`` script install the handler first."""

from reservoir.interrupt import install

# The guard keeps the command from running again in the worker processes that
# ``reservoir simulate --jobs`` starts (they import this module as ``__mp_main__``).
if __name__ == "__main__":
    install()
    from reservoir.cli import main

    main(prog_name="reservoir")
