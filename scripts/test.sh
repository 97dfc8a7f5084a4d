#!/usr/bin/env bash
# Sets up (scripts/setup.sh --test) and runs the whole test suite, in BIGTRAIN_TEST_SHARDS shards side
# by side (default 4: many long tests wait on launchers, compilers and timeouts while another shard
# computes; on 2 cores, from an empty inductor cache, the suite took 852 s in 3 shards against 934 s
# in 2, and on 2026-11-28, idle, 854 s in 4 for 1,672 s of CPU: 98% of two cores, where CI had taken
# 955 s in 3; tests/lanes.py splits whole files by tests/durations.json). Extra arguments go to every shard's
# pytest, e.g. the fast lane:  bash scripts/test.sh -m "not slow"; every test, the extended lane
# (tests/extended.txt) too:  bash scripts/test.sh --extended
# Shard 1 prints as it goes; the others' output follows when they end. Exit: the first failure's code.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test || exit $?
shards=${BIGTRAIN_TEST_SHARDS:-4}
if [ "$shards" -le 1 ]; then
    exec .venv/bin/python -m pytest -q "$@"
fi
logs=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$logs"' EXIT
pids=()
for i in $(seq 2 "$shards"); do
    .venv/bin/python -m pytest -q -p no:cacheprovider --shard="$i/$shards" "$@" >"$logs/$i" 2>&1 &
    pids+=($!)
done
echo "== shard 1/$shards (shards 2-$shards print when they end)"
.venv/bin/python -m pytest -q --shard="1/$shards" "$@"
codes=($?)
for i in "${!pids[@]}"; do
    wait "${pids[$i]}"
    codes+=($?)
    echo "== shard $((i + 2))/$shards"
    cat "$logs/$((i + 2))"
done
# 5: pytest collected nothing (a selection that fell in one shard only): fine unless every shard says so.
status=5
for code in "${codes[@]}"; do
    if [ "$code" -ne 0 ] && [ "$code" -ne 5 ]; then exit "$code"; fi
    [ "$code" -eq 0 ] && status=0
done
exit "$status"
