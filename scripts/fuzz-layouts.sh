#!/usr/bin/env bash
# Samples N layouts with SEED from the whole composition space (a share of them DLRMs); each must be
# rejected before launch (field named) or train like the independent reference. Exit 1 on any
# divergence, crash or hang.
# Usage: scripts/fuzz-layouts.sh N SEED [--max-world 8] [--steps 3] [--dlrm-share 0.2] [--resume-share 0.25] [--int8-share 0.2]
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: $0 N SEED [--max-world W] [--steps K] [--dlrm-share F] [--resume-share R] [--int8-share G]" >&2; exit 2; }
[ -x .venv/bin/python ] || bash scripts/setup.sh
exec .venv/bin/python -m bigtrain.check.fuzz "$@"
