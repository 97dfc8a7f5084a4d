#!/usr/bin/env bash
# Sets up .venv with torch and bigtrain; `--test` adds the test tools and the peers the tests compare
# with (pytest, transformers, torchao, bitsandbytes, tiktoken: about 1.5 GB more). Safe to run again: it skips
# what is there.
# torch is installed first and pinned (BIGTRAIN_TORCH, default torch==2.13.0) when none is present,
# so that pip never resolves bigtrain's torch range to the registry's newest CUDA build (several
# GB). Where the registry is PyPI (not a local mirror of CPU wheels), torch==2.13.0 on Linux is the
# CUDA build: on a machine without a GPU set BIGTRAIN_TORCH_INDEX=https://download.pytorch.org/whl/cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${BIGTRAIN_TORCH:-torch==2.13.0}

[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
if ! .venv/bin/python - <<'PY' 2>/dev/null
import sys, torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(0 if (2, 5) <= (major, minor) < (3, 0) else 1)
PY
then
    echo "setup: installing $TORCH_SPEC"
    index=()
    [ -n "${BIGTRAIN_TORCH_INDEX:-}" ] && index=(--index-url "$BIGTRAIN_TORCH_INDEX")
    .venv/bin/pip install --quiet --disable-pip-version-check "${index[@]}" "$TORCH_SPEC"
fi
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
# pip resolves everything again even when nothing changed (12 s, before any test starts): skipped
# when this checkout's pyproject.toml, with these extras, is what .venv was last set up from.
stamp=".venv/.bigtrain-setup"
want="$(pwd) $extras $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c "import bigtrain" 2>/dev/null; then
    .venv/bin/pip install --quiet --disable-pip-version-check -e ".$extras"
    echo "$want" > "$stamp"
fi
echo "setup: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
