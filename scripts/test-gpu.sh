#!/usr/bin/env bash
# The GPU lane. On one CUDA device: the tests marked `gpu` (pytest -m gpu): single-rank trainer
# steps of every ZeRO stage in fp32/bf16/fp16 on cuda, with every tensor handed to a collective and
# every bookkeeping tensor checked for its device (tests/device_watch.py); fp32 and bf16 runs
# against the independent reference computing on the same GPU in the same precision (loss within
# 1e-5 / 1e-3, every weight within 1e-5 / 1e-2 relative); a checkpoint resumed on the GPU; offload's
# host step and copies (tests/test_offload.py) against the run without offload. With two
# or more GPUs, also `bigtrain check` of 2-rank layouts over NCCL (dp=2 ZeRO-3 bf16, dp=2 buckets,
# tp=2, pp=2), the only runs here that put the asynchronous collectives on NCCL's streams.
# Without a CUDA device it prints "no CUDA device: skipped" and exits 0.
# Usage: scripts/test-gpu.sh [pytest arguments]; PYTHON=... picks the interpreter (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${PYTHON:-}" ]; then
    [ -x .venv/bin/python ] || bash scripts/setup.sh --test
    PYTHON=.venv/bin/python
fi
gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
if [ "$gpus" -eq 0 ]; then
    echo "test-gpu: no CUDA device: skipped"
    exit 0
fi
"$PYTHON" -c 'import torch; print(f"test-gpu: {torch.cuda.get_device_name(0)} x {torch.cuda.device_count()}, torch {torch.__version__}, CUDA {torch.version.cuda}")'
"$PYTHON" -m pytest -q -m gpu "$@"
if [ "$gpus" -lt 2 ]; then
    echo "test-gpu: one GPU: the 2-rank NCCL checks need two (skipped)"
    exit 0
fi
for layout in "--parallel.dp=2 --parallel.zero=3 --precision.mode=bf16" "--parallel.dp=2" \
              "--parallel.tp=2 --parallel.sequence_parallel=true" \
              "--parallel.pp=2 --model.tie_embeddings=true --train.micro_batch=2"; do
    echo "test-gpu: bigtrain check $layout (2 ranks, NCCL)"
    # shellcheck disable=SC2086 # the layout is a list of overrides
    "$PYTHON" -m bigtrain check --preset tiny --steps 4 --train.device=cuda $layout
done
echo "test-gpu: all passed"
