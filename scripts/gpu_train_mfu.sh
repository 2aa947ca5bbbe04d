#!/usr/bin/env bash
# Issue 5's training MFU on `mini` (2 rows of 8704 tokens, dense warm-up and sparse phases): the loop as it is
# beside each option that may raise it, the variants named timed one after another in the same device call:
#   base        the defaults
#   accum2      --grad-accum 2: two batches a step, one optimizer step (AdamW + clipping ~38 ms, session 28)
#   kda         KESTREL_KDA_SAFE_GATE=1 KESTREL_KDA_NO_RECOMPUTE=1: fla's bounded-gate kernels and no recompute in
#               the backward (KDA was 71 ms of the 0.563 s step in session 28; both passed their GPU gradient test)
#   kda_accum2  both
# Each writes $OUT/mini_<name>.json (scripts/profile_train.py: queued steps, MFU two ways, peak memory, profile).
# On the device, from the repository root, with `.whl` carried (scripts/fetch_wheels.sh):
#   bash scripts/gpu_train_mfu.sh base accum2       two of them (~4-5 min with the committed autotuning results)
#   bash scripts/gpu_train_mfu.sh kda kda_accum2    (fla's bounded-gate kernels compile and autotune cold: minutes)
#   bash scripts/gpu_train_mfu.sh                   all four: may pass the device tool's 10 minutes a call
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
scripts/triton_cache.sh restore
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

one() {  # one NAME: the options of that variant, then its profile
    local extra=() envs=()
    case "$1" in
        base) ;;
        accum2) extra=(--grad-accum 2) ;;
        kda) envs=(KESTREL_KDA_SAFE_GATE=1 KESTREL_KDA_NO_RECOMPUTE=1) ;;
        kda_accum2) envs=(KESTREL_KDA_SAFE_GATE=1 KESTREL_KDA_NO_RECOMPUTE=1) extra=(--grad-accum 2) ;;
        *) echo "unknown variant $1 (base, accum2, kda, kda_accum2)" >&2; return 2 ;;
    esac
    echo "== $1 at ${SECONDS} s"
    env "${envs[@]}" timeout 240 python3 scripts/profile_train.py --model mini --batch-rows 2 --row-len 8704 \
        --workers 8 --phases dense,sparse --timed-steps 4 --top 30 "${extra[@]}" --out "$OUT/mini_$1.json" 2>&1 \
        | grep -E "^(setup|dense|sparse)|Error|error" | grep -v -i warn
    python3 - "$OUT/mini_$1.json" << 'EOF'
import json, sys
from pathlib import Path
if Path(sys.argv[1]).exists():
    d = json.loads(Path(sys.argv[1]).read_text())
    for phase in ("dense", "sparse"):
        p = d.get(phase)
        if p:
            print(f"   {phase}: queued {p['queued_step_s']:.3f} s, MFU {p['queued_mfu_vs_989']:.1%} "
                  f"(documents {p['attention']['queued_mfu_document_causal']:.1%}), peak {p['max_memory_gib']:.1f} GiB")
EOF
}

for name in "${@:-base accum2 kda kda_accum2}"; do
    for n in $name; do one "$n"; done
done
echo "done at ${SECONDS} s"
