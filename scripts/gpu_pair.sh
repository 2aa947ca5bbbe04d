#!/usr/bin/env bash
# Two gpu_suite.py processes side by side on the 2-GPU device machine (nvidia-h200-x2): twice the GPU work for the
# same device time. GPU0: pytest $TESTS_A (until $TEST_S s after the start), then sections $SECTIONS_A ($EXTRA_A: more flags);
# GPU1: sections $SECTIONS_B ($EXTRA_B), then pytest $TESTS_B; everything within $LIMIT seconds of the start,
# set-up included. All comes back as one $OUT/results.tgz (a/ and b/: gpu_suite.json, suite.log, tests.log,
# agent.json; serve-PORT.log of every server). $TESTS_*, $SECTIONS_* and $EXTRA_* split on spaces (no argument may contain one).
# Each suite's servers take a free port of their own. Host-bound figures (TTFT, the agent sweep) share the host's
# cores with the other GPU's process: measure those beside GPU work, not beside CPU-heavy tests.
# Example (a device call carrying .whl and .triton-cache):
#   LIMIT=540 TESTS_A="tests/ops/test_kda.py -k fla" SECTIONS_A=cache_ttft SECTIONS_B=agent_sweep scripts/gpu_pair.sh
start=$(date +%s)
LIMIT=${LIMIT:-550}
cd "$(dirname "$0")/.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH="/tmp/site:$PWD" TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1
scripts/triton_cache.sh restore
R=/tmp/r
mkdir -p "$R/a" "$R/b"
left() { echo $((LIMIT - ($(date +%s) - start))); }
# bounded CMD...: CMD within the seconds left (nothing when none are); a killed suite takes its servers along
bounded() {
    local l
    l=$(left)
    if ((l <= 0)); then
        echo "no time left for: $*"
        return 124
    fi
    timeout --kill-after=10 "$l" "$@"
}
(
    export CUDA_VISIBLE_DEVICES=0
    if [ -n "$TESTS_A" ]; then
        LIMIT=$((LIMIT < ${TEST_S:-150} ? LIMIT : ${TEST_S:-150})) bounded python3 -m pytest -o addopts= -q $TESTS_A \
            > "$R/a/tests.log" 2>&1
        echo "tests rc=$?" >> "$R/a/tests.log"
    fi
    if [ -n "$SECTIONS_A" ]; then
        bounded python3 scripts/gpu_suite.py --sections $SECTIONS_A $EXTRA_A --out "$R/a" > "$R/a/suite.log" 2>&1
        echo "a rc=$?" >> "$R/a/suite.log"
    fi
) &
(
    export CUDA_VISIBLE_DEVICES=1
    if [ -n "$SECTIONS_B" ]; then
        bounded python3 scripts/gpu_suite.py --sections $SECTIONS_B $EXTRA_B --out "$R/b" > "$R/b/suite.log" 2>&1
        echo "b rc=$?" >> "$R/b/suite.log"
    fi
    if [ -n "$TESTS_B" ]; then
        bounded python3 -m pytest -o addopts= -q $TESTS_B > "$R/b/tests.log" 2>&1
        echo "tests rc=$?" >> "$R/b/tests.log"
    fi
) &
wait
pkill -f "kestrel.serve.cli serve" 2> /dev/null  # a server left behind by a suite that ran out of time
for f in "$R/a/tests.log" "$R/b/tests.log"; do [ -f "$f" ] && tail -n 4 "$f"; done
tail -c 2500 "$R/a/suite.log" 2> /dev/null
tail -c 2500 "$R/b/suite.log" 2> /dev/null
cp /tmp/serve-*.log "$R/" 2> /dev/null  # the servers' own logs (start-up, warm-up, errors)
tar czf "$OUT/results.tgz" -C "$R" .
