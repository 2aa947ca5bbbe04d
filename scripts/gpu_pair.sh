#!/usr/bin/env bash
# Two gpu_suite.py processes side by side on the 2-GPU device machine (nvidia-h200-x2): twice the GPU work for the
# same device time. GPU0: pytest $TESTS_A (at most $TEST_S s), then sections $SECTIONS_A ($EXTRA_A: more flags);
# GPU1: sections $SECTIONS_B ($EXTRA_B), then pytest $TESTS_B; all within $LIMIT seconds. Everything comes back
# as one $OUT/results.tgz (a/ and b/: gpu_suite.json, suite.log, tests.log, agent.json).
# Host-bound figures (TTFT, the agent sweep) share the host's cores with the other GPU's process: measure those
# beside GPU work, not beside CPU-heavy tests. Example (device call, carry .whl and .triton-cache):
#   LIMIT=540 TESTS_A="tests/ops/test_kda.py -k fla" SECTIONS_A=cache_ttft SECTIONS_B=agent_sweep scripts/gpu_pair.sh
cd "$(dirname "$0")/.." || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1
scripts/triton_cache.sh restore
R=/tmp/r; mkdir -p $R/a $R/b
LIMIT=${LIMIT:-550}; start=$(date +%s)
left() { echo $(( LIMIT - ($(date +%s) - start) )); }
(
  export CUDA_VISIBLE_DEVICES=0
  [ -n "$TESTS_A" ] && { timeout ${TEST_S:-150} python3 -m pytest -o addopts= -q $TESTS_A > $R/a/tests.log 2>&1; echo "tests rc=$?" >> $R/a/tests.log; }
  [ -n "$SECTIONS_A" ] && { timeout $(left) python3 scripts/gpu_suite.py --sections $SECTIONS_A $EXTRA_A --out $R/a > $R/a/suite.log 2>&1; echo "a rc=$?" >> $R/a/suite.log; }
) &
(
  export CUDA_VISIBLE_DEVICES=1
  [ -n "$SECTIONS_B" ] && { timeout $(left) python3 scripts/gpu_suite.py --sections $SECTIONS_B $EXTRA_B --out $R/b > $R/b/suite.log 2>&1; echo "b rc=$?" >> $R/b/suite.log; }
  [ -n "$TESTS_B" ] && { timeout $(left) python3 -m pytest -o addopts= -q $TESTS_B > $R/b/tests.log 2>&1; echo "tests rc=$?" >> $R/b/tests.log; }
) &
wait
for f in $R/a/tests.log $R/b/tests.log; do [ -f $f ] && tail -n 4 $f; done
tail -c 2500 $R/a/suite.log; tail -c 2500 $R/b/suite.log
tar czf $OUT/results.tgz -C $R .
