#!/usr/bin/env bash
# Runs N hostile or clumsy inputs (configs, data files, output folders, environment leftovers, flags)
# drawn with SEED through the real CLI entry; each must exit 2 naming its field, with no traceback,
# nothing started and no file left. Exit 1 on any other outcome. Usage: scripts/fuzz-inputs.sh N SEED [--quiet]
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 N SEED [--timeout S] [--quiet]" >&2; exit 2; }
[ -x .venv/bin/python ] || bash scripts/setup.sh
exec .venv/bin/python -m bigtrain.fuzz_inputs "$@"
