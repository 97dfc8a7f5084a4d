"""The program's entry point (the ``bigtrain`` console script and ``python -m bigtrain``).

The CLI imports torch (with its commands' parsers, all but presets, fields and config), about 3 s
of a start: a Ctrl-C then raised KeyboardInterrupt inside the import, before ``cli.main`` and its
handlers existed, and printed a traceback where everywhere else bigtrain exits 130 with one line.
This module imports nothing heavy, so the import of the CLI runs inside the handler.
"""

import sys

from bigtrain.failure import INTERRUPTED


def main() -> int:
    try:
        from bigtrain.cli import main as cli_main
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 130
    return cli_main()
