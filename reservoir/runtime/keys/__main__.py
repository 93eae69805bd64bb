"""``python -m reservoir.runtime.keys`` is gone: ``reservoir keys`` makes keys now. This
says so in one line (a package's ``__main__``, so Python's runpy warning does not precede
it) rather than doing nothing."""

from __future__ import annotations

import sys

from reservoir.exit_status import EXIT_USAGE

sys.stderr.write(
    "python -m reservoir.runtime.keys is gone: use `reservoir keys generate --id ID "
    "[--ed25519]` (and `reservoir keys --help` for keys per node)\n"
)
sys.exit(EXIT_USAGE)
