#!/usr/bin/env bash
# The reproductions of issue 11 about NaN, resume and checkpoints, run through the real CLI: each
# prints the command, the lines bigtrain printed and the exit code (docs/reliability.md lists the
# expected ones). Runs in a temporary folder (or $1); a few minutes on 2 cores.
# Usage: scripts/reliability-repros.sh [FOLDER]
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
W=${1:-$(mktemp -d)}
mkdir -p "$W"
BT=(.venv/bin/python -m bigtrain)
T=(--preset tiny --logging.progress=false --logging.report=false --data.max_bytes=400000 --data.cache_dir="$W/cache")

show() {
    echo "\$ bigtrain ${*//$W/W}"
    "${BT[@]}" "$@" >"$W/out.txt" 2>"$W/err.txt"
    local code=$?
    # The first line bigtrain printed and its last two (a stop's message, a rejection's reasons).
    grep -h "^bigtrain:\|^  - " "$W/out.txt" "$W/err.txt" | grep -v "steps, loss\|starting 2 ranks\|ranks exited" \
        | sed "s#$W#W#g" | cut -c1-500 \
        | awk '{line[NR] = $0} END {if (NR) print line[1]; for (i = (NR > 3 ? NR - 1 : 2); i <= NR; i++) print line[i]}'
    echo "exit $code"
    echo
}

edit_manifests() {  # edit_manifests RUN PYTHON-STATEMENT-ON-m: change every checkpoint's meta.json
    .venv/bin/python - "$1" "$2" <<'PY'
import json, pathlib, sys
for meta in pathlib.Path(sys.argv[1], "checkpoints").glob("step_*/meta.json"):
    m = json.loads(meta.read_text())
    exec(sys.argv[2])
    meta.write_text(json.dumps(m))
PY
}

# NaN keeps training: now exit 3 within train.max_bad_steps, the newest checkpoint the last finite state.
show train "${T[@]}" --output-dir "$W/fp32" --optim.lr=1e6 --train.steps=40 --checkpoint.every=1
show train "${T[@]}" --output-dir "$W/bf16" --optim.lr=1e6 --train.steps=40 --checkpoint.every=1 --precision.mode=bf16
show train "${T[@]}" --output-dir "$W/fp16" --optim.lr=1e6 --train.steps=40 --checkpoint.every=1 --precision.mode=fp16
show train "${T[@]}" --output-dir "$W/init" --model.init_std=1e300
show train "${T[@]}" --output-dir "$W/rope" --model.rope_theta=1e-300
show train "${T[@]}" --output-dir "$W/dp2" --optim.lr=1e6 --train.steps=40 --parallel.dp=2 --checkpoint.every=1

# Resume loads the wrong thing or nothing.
show train "${T[@]}" --output-dir "$W/a" --train.steps=6 --checkpoint.every=2
show train --output-dir "$W/a" --resume --train.steps=8
show train --output-dir "$W/typo" --resume
show train "${T[@]}" --output-dir "$W/a" --train.steps=4 --train.seed=7
show train --output-dir "$W/a" --resume --model.n_layers=4

# Checkpoint files are trusted.
cp -r "$W/a" "$W/edited"; edit_manifests "$W/edited" 'm["step"] += 1'
show train --output-dir "$W/edited" --resume
cp -r "$W/a" "$W/nomap"; edit_manifests "$W/nomap" 'm.pop("sha256")'
show train --output-dir "$W/nomap" --resume
cp -r "$W/a" "$W/devzero"; edit_manifests "$W/devzero" 'm["sha256"]["/dev/zero"] = "0" * 64'
show train --output-dir "$W/devzero" --resume
mkdir -p "$W/stray/checkpoints/step_latest" "$W/stray/checkpoints/step_00000003.tmp-4242"
show train "${T[@]}" --output-dir "$W/stray" --train.steps=2 --checkpoint.every=1
echo "checkpoints/ now: $(ls "$W/stray/checkpoints" | tr '\n' ' ')"; echo
head -c -20 "$W/a/metrics.jsonl" >"$W/m" && mv "$W/m" "$W/a/metrics.jsonl"  # a torn last line
show report "$W/a"
show train --output-dir "$W/a" --resume --train.steps=9
