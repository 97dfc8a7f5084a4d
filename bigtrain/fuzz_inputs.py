"""``python -m bigtrain.fuzz_inputs N SEED [--timeout S] [--quiet]``: the input fuzzer
(:mod:`bigtrain.check.fuzz_inputs`) against the real command line.

The fuzzer drives :func:`bigtrain.cli.main`, and the CLI runs ``bigtrain check``: this entry point,
above both packages, hands the fuzzer the CLI, so ``bigtrain.check`` never imports ``bigtrain.cli``
(no cycle between the two).
"""

import sys

import bigtrain.cli as cli
from bigtrain.check.fuzz_inputs import main

if __name__ == "__main__":
    sys.exit(main(cli, sys.argv[1:]))
