#!/usr/bin/env bash
# Issue 5's training MFU on `mini` (rows of 8704 tokens, 2 a batch unless the variant says otherwise; dense warm-up
# and sparse phases): the loop as it is
# beside each option that may raise it, the variants named timed one after another in the same device call:
#   base        the defaults
#   accum2      --grad-accum 2: two batches a step, one optimizer step (session 29: 1.012 s a step of two batches
#               against 0.579 s a step of one)
#   accum4      --grad-accum 4 (the same memory as 2: each batch's activations go with its backward)
#   rows3       --batch-rows 3: half as much GPU work again for the same host work a step (session 30: the host
#               sets the pace at 2 rows, the GPU idle 14-25% of a step; 3 rows: x1.20-1.24, 124 GiB at the peak)
#   rows3_accum2  both: at 3 rows the GPU sets the pace (busy 94-98%), so AdamW's ~32 ms a step, paid once for
#               two batches, is GPU time saved (at 2 rows accumulation saved none: the host's time a batch stays;
#               session 31: 26.0% / 24.9%, then out of memory in its profile; session 32, with the grouped
#               experts' saving: 25.3% / 23.9%, 120 GiB, the host setting the sparse pace)
#   rows4       --batch-rows 4: fits since the grouped experts keep x, not its gathered rows, for their backward
#               (3 rows peak at 106 GiB, 124 before). Session 32, three machines: 25.2-25.7% dense, 24.3-25.5%
#               sparse, 130 GiB; session 33, with `combine_down` (the experts' down-projection and combine keep
#               h [M, I], not y [M, Din]), two machines: 25.9-26.0% in both phases, 110 GiB: mini's setting
#   rows4_accum2  both (session 33: 26.7% / 26.6%, 122 GiB)
#   rows5       --batch-rows 5, which fits since `combine_down` (session 33: 26.2-26.4% on two machines, 128 GiB)
#   kda_recompute         KESTREL_KDA_SAFE_GATE=0 KESTREL_KDA_NO_RECOMPUTE=0: fla's general-gate kernels, and the
#                         backward recomputing the forward's intermediates (the defaults before session 29, whose
#                         measurement made both on the default: 0.579 -> 0.511 s)
#   kda_recompute_accum2  both
# Each writes $OUT/mini_<name>.json (scripts/profile_train.py: queued steps, MFU two ways, peak memory, profile).
# On the device, from the repository root, with `.whl` and `.whl-train` carried (scripts/fetch_wheels.sh):
#   bash scripts/gpu_train_mfu.sh base accum2       two of them (~4-5 min with the committed autotuning results)
#   bash scripts/gpu_train_mfu.sh                   rows4, rows3 (~6 min on a fresh machine: the first compiles
#                                                   cold for ~100 s)
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(ls .whl-train/*.whl 2> /dev/null) > /dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
scripts/triton_cache.sh restore
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"

one() {  # one NAME: the options of that variant, then its profile
    local extra=() envs=() rows=2 limit=240  # seconds; two batches a step take longer
    case "$1" in
        base) ;;
        rows3) rows=3 ;;
        rows3_accum2) rows=3 extra=(--grad-accum 2) limit=300 ;;
        rows4) rows=4 ;;
        rows4_accum2) rows=4 extra=(--grad-accum 2) limit=330 ;;
        rows5) rows=5 ;;
        accum2) extra=(--grad-accum 2) ;;
        accum4) extra=(--grad-accum 4) ;;
        kda_recompute) envs=(KESTREL_KDA_SAFE_GATE=0 KESTREL_KDA_NO_RECOMPUTE=0) ;;
        kda_recompute_accum2) envs=(KESTREL_KDA_SAFE_GATE=0 KESTREL_KDA_NO_RECOMPUTE=0) extra=(--grad-accum 2) ;;
        *) echo "unknown variant $1 (see the list above this script's code)" >&2; return 2 ;;
    esac
    echo "== $1 at ${SECONDS} s"
    env "${envs[@]}" timeout $limit python3 scripts/profile_train.py --model mini --batch-rows $rows --row-len 8704 \
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
                  f"(documents {p['attention']['queued_mfu_document_causal']:.1%}), peak {p['max_memory_gib']:.1f} GiB, "
                  f"GPU busy {p['gpu_busy']['busy_fraction']:.1%}")
EOF
}

for name in "${@:-rows4 rows3}"; do
    for n in $name; do one "$n"; done
done
echo "done at ${SECONDS} s"
