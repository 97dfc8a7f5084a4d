#!/usr/bin/env bash
# Every figure of docs/benchmarks.md, with the exact commands the page shows, in one go.
#
#   benchmarks/run_all.sh [OUT_DIR] [NAME ...]
#
# OUT_DIR (default runs/bench, ignored by git) gets NAME.json and NAME.txt per benchmark; NAMEs pick some
# (dp2 dp4 tp2 tp4 pp zero2 zero4 zero2-bf16 zb-h1 optim optim-quality). zb-h1 is the pipeline's zero-bubble rows alone
# (already part of pp), to refresh that figure after a change to the executor's weight pass. optim (one optimizer
# step of each, ~5 min) and optim-quality (six 300-step training runs, 2-10 min each; it also redraws
# docs/optimizers-loss.png) run only when named.
# Python: $PYTHON if set, else .venv/bin/python if there is one, else python.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
OUT=${1:-runs/bench}
shift || true
mkdir -p "$OUT"
declare -A CMD=(
  [dp2]="benchmarks/bench_data_parallel.py --ranks 2 --steps 20 --warmup 5"
  [dp4]="benchmarks/bench_data_parallel.py --ranks 4 --steps 20 --warmup 5"
  [tp2]="benchmarks/bench_tensor_parallel.py --ranks 2 --steps 20"
  [tp4]="benchmarks/bench_tensor_parallel.py --ranks 4 --steps 20"
  [pp]="benchmarks/bench_pipeline.py --ranks 2,4 --microbatches 4,8 --steps 20"
  [zero2]="benchmarks/bench_zero.py --ranks 2"
  [zero4]="benchmarks/bench_zero.py --ranks 4"
  [zero2-bf16]="benchmarks/bench_zero.py --ranks 2 --precision bf16"
  [zb-h1]="benchmarks/bench_pipeline.py --schedules zb-h1 --ranks 2,4 --microbatches 4,8 --steps 20"
  [optim]="benchmarks/bench_optimizers.py --profile"
  [optim-quality]="benchmarks/quality_optimizers.py"
)
NAMES=("$@")
[ ${#NAMES[@]} -gt 0 ] || NAMES=(dp2 dp4 tp2 tp4 pp zero2 zero4 zero2-bf16)
for name in "${NAMES[@]}"; do
  [ -n "${CMD[$name]:-}" ] || { echo "unknown benchmark $name; use one of ${!CMD[*]}" >&2; exit 2; }
  echo "== $name: $PY ${CMD[$name]} --json $OUT/$name.json"
  $PY ${CMD[$name]} --json "$OUT/$name.json" | tee "$OUT/$name.txt"
done
