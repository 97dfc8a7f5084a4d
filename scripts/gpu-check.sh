#!/usr/bin/env bash
# One GPU lease, at most 8 minutes on one H100, with the image's own torch (PYTHONPATH=., no install):
#   1. the GPU tests (pytest -m gpu: every ZeRO stage on cuda, parity with the reference on the
#      device, resume, offload against no offload; 25 cases, two fp8 trainings ~40 s each) <= 180 s
#   2. benchmarks/compile_fusions.py: the kernels inductor generates for one block <=  40 s
#   3. benchmarks/bench_offload.py --case gpu on llama-1b (offload.optimizer = cpu; its planner
#      layout compiles the blocks)                                                  <=  50 s
#   4. benchmarks/bench_gpu.py on llama-1b (bf16, 4 x 2048 tokens a step): transformers'
#      LlamaForCausalLM + torch.compile as the peer in the same call (20 timed steps), then eager
#      (20), compiled (compile.enabled) and, where the checkout has precision.fp8, fp8 (200 each,
#      so that fp8's loss can be compared with bf16's at the end, issue 27; rowwise), then hf-family
#      (the peer's model from a config.json, trained by bigtrain: model.family = "hf"; 20), then
#      fp8-tensorwise (20; last, so that the limit can only cut the rows least needed; rows are
#      written as they finish)                                                      <= 185 s
#   5. benchmarks/bench_document_attention.py: block-causal attention's forward and backward at
#      8192 tokens, sdpa under the dense mask against FlexAttention (model.attention)  <=  25 s
# and writes one Markdown summary, $OUT/gpu-check.md (OUT defaults to runs/gpu-check), with every
# stage's status, time and figures, next to the logs and JSON files. Each stage has its own time
# limit, its share of the 8 minutes plus what the stages before it left unused: a stage that fails
# or runs out of time is reported and the next one runs, and the whole stays within 480 s. The
# benchmark, whose rows are kept as they finish, runs last and takes what the others left (the
# tests rarely need their 180 s): the stages that keep nothing when cut finish first, with the
# tests' spare time (fusions took 31 s of its 40 on the H200's rerun; bench_offload's layout now
# compiles its blocks, which it did not when it took its 50 s there).
# Without a CUDA device it writes a summary saying so and exits 0; GPU_CHECK_SMOKE=1 then runs the
# same stages on the CPU with the tiny preset and a few steps instead, each limit times
# GPU_CHECK_SMOKE_SCALE (default 5: a CPU compiles and steps slower than the GPU the limits are
# sized for; a test of this script, its figures and times mean nothing).
# Exit status: 0 when every stage passed, 1 otherwise.
# Usage: scripts/gpu-check.sh; PYTHON=... picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
SUMMARY="$OUT/gpu-check.md"
START=$(date +%s)
gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
device=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")' 2>/dev/null)
versions=$("$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")' 2>/dev/null)

{
  echo "# bigtrain GPU check"
  echo
  echo "$(date -u '+%Y-%m-%d %H:%M UTC'), commit $commit, $device x $gpus, $versions, \`scripts/gpu-check.sh\`"
  echo
} > "$SUMMARY"

if [ "$gpus" -eq 0 ] && [ "${GPU_CHECK_SMOKE:-0}" != 1 ]; then
  echo "no CUDA device: skipped (GPU_CHECK_SMOKE=1 runs the stages on the CPU as a test of this script)" | tee -a "$SUMMARY"
  exit 0
fi
if [ "$gpus" -eq 0 ]; then  # the smoke run: the same stages, on the CPU, the tiny preset
  PRESET=tiny; CPU=(--allow-cpu); TESTS=(tests/test_compile.py -k validated); OFFLOAD_CPU=(--device cpu)
  BENCH_STEPS=(--steps 2 --loss-steps 3 --warmup 1); SCALE=${GPU_CHECK_SMOKE_SCALE:-5}
  DOC_ATTENTION=(--allow-cpu --seq 256 --heads 4 --kv-heads 2 --head-dim 16 --doc-mean 40 --steps 2)
  echo "**Smoke run on the CPU (GPU_CHECK_SMOKE=1): a test of this script; its figures mean nothing.**" >> "$SUMMARY"
  echo >> "$SUMMARY"
else
  PRESET=llama-1b; CPU=(); TESTS=(-m gpu); OFFLOAD_CPU=()
  BENCH_STEPS=(--steps 20 --loss-steps 198 --warmup 2); SCALE=1; DOC_ATTENTION=()
fi

failed=0
carry=0  # seconds the stages so far left of their limits
echo "| stage | status | seconds |" > "$OUT/stages.md"
echo "|---|---|---|" >> "$OUT/stages.md"

stage() {  # stage NAME SHARE_S COMMAND...: run within its share (plus what earlier stages left), log it, record its status
  local name=$1 limit=$(( $2 * SCALE + carry ))
  shift 2
  local t0 status
  t0=$(date +%s)
  echo "== gpu-check: $name (limit ${limit} s): $*"
  timeout --kill-after=10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  status=$?
  local took=$(( $(date +%s) - t0 ))
  carry=$(( limit > took ? limit - took : 0 ))
  if [ $status -eq 0 ]; then
    echo "| $name | passed | $took |" >> "$OUT/stages.md"
  elif [ $status -eq 124 ] || [ $status -eq 137 ]; then
    echo "| $name | **out of time** (limit $limit s) | $took |" >> "$OUT/stages.md"; failed=1
  else
    echo "| $name | **failed** (exit $status) | $took |" >> "$OUT/stages.md"; failed=1
  fi
  tail -n 3 "$OUT/$name.log"
}

stage tests 180 "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
stage fusions 40 "$PY" benchmarks/compile_fusions.py --preset "$PRESET" --batch 1 --json "$OUT/fusions.json"
stage bench_offload 50 "$PY" benchmarks/bench_offload.py --case gpu --preset "$PRESET" --global-batch 8 --steps 3 \
  --warmup 1 "${OFFLOAD_CPU[@]}" --json "$OUT/bench_offload.json"
stage doc_attention 25 "$PY" benchmarks/bench_document_attention.py "${DOC_ATTENTION[@]}" --json "$OUT/doc_attention.json"
stage bench_gpu 185 "$PY" benchmarks/bench_gpu.py "${CPU[@]}" --presets "$PRESET" --variants eager,compiled,fp8,hf-family,fp8-tensorwise \
  --peer hf-compiled "${BENCH_STEPS[@]}" --json "$OUT/bench_gpu.json"

{
  cat "$OUT/stages.md"
  echo
  echo "Total: $(( $(date +%s) - START )) s."
  echo
  echo "## GPU tests"
  echo
  echo '```'
  grep -E "passed|failed|error|skipped" "$OUT/tests.log" | tail -n 15
  echo '```'
  echo
  echo "## Training speed (benchmarks/bench_gpu.py)"
  echo
  if [ -s "$OUT/bench_gpu.json" ]; then
    "$PY" benchmarks/bench_gpu.py --report-from "$OUT/bench_gpu.json"
  else
    echo "no result (see bench_gpu.log)"
  fi
  echo
  echo "## Block-causal attention: sdpa's dense mask against FlexAttention (benchmarks/bench_document_attention.py)"
  echo
  echo '```'
  grep -E "^(device|seq|batch|documents_per_row|allowed_over_causal|max_relative_difference|sdpa_|flex_)" \
    "$OUT/doc_attention.log" || tail -n 5 "$OUT/doc_attention.log"
  echo '```'
  echo
  echo "## What inductor fused in one block (benchmarks/compile_fusions.py)"
  echo
  echo '```'
  cat "$OUT/fusions.log"
  echo '```'
  echo
  echo "## Offload (benchmarks/bench_offload.py --case gpu)"
  echo
  if [ -s "$OUT/bench_offload.json" ]; then
    "$PY" - "$OUT/bench_offload.json" <<'PYEOF'
import json, sys
r = json.load(open(sys.argv[1]))
r = r.get("gpu", r)
# bench_offload's own names (_gpu's record): the memory figures are under "measured" / "predicted"
flat = dict(r, **{f"measured {k}": v for k, v in r.get("measured", {}).items() if k != "tiers"},
            **{f"predicted {k}": v for k, v in r.get("predicted", {}).items() if k != "tiers"})
keys = ("device", "preset", "planner_layout", "build_s", "first_step_s", "median_step_s", "tokens_per_s", "mfu",
        "measured max_memory_allocated_gib", "predicted device_peak_gib", "device_peak_over_predicted",
        "measured host_peak_rss_gib", "predicted host_gib", "host_rss_over_predicted", "tiers_equal",
        "bytes_copied", "losses")
for k in keys:
    if k in flat:
        v = flat[k]
        print(f"- {k}: {v:.4g}" if isinstance(v, float) else f"- {k}: {v}")
PYEOF
  else
    echo '```'
    tail -n 5 "$OUT/bench_offload.log"
    echo '```'
  fi
} >> "$SUMMARY"
echo "gpu-check: summary in $SUMMARY ($(( $(date +%s) - START )) s)"
exit $failed
