#!/usr/bin/env bash
# Keep the Triton cache (compiled kernels and autotuning results) between device machines: a fresh machine
# spends ~190 s compiling and autotuning fla-core's chunked KDA kernels before the first training step.
#   scripts/triton_cache.sh restore   on the device: unpack .triton-cache/part-* (carried) into $TRITON_CACHE_DIR
#   scripts/triton_cache.sh save      on the device: pack $TRITON_CACHE_DIR into $OUT/triton-cache.part-* (15 MiB each)
#   scripts/triton_cache.sh keep DIR  here: copy the parts a run brought back (files_at DIR) into .triton-cache/
# Source this script's environment on the device first: export TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1
# (carry .triton-cache beside .whl; .triton-cache is git-ignored.)
set -uo pipefail
cd "$(dirname "$0")/.."
CACHE=${TRITON_CACHE_DIR:-/tmp/tc}
case "$1" in
restore)
    mkdir -p "$CACHE"
    if ls .triton-cache/part-* > /dev/null 2>&1; then
        cat .triton-cache/part-* | tar xzf - -C "$CACHE" && echo "triton cache: $(du -sh "$CACHE" | cut -f1) restored"
    else
        echo "triton cache: none carried, starting cold"
    fi
    ;;
save)
    tar czf - -C "$CACHE" . | split -b 15m - "$OUT/triton-cache.part-"
    ls -la "$OUT"/triton-cache.part-*
    ;;
keep)
    rm -rf .triton-cache && mkdir -p .triton-cache
    for f in "$2"/triton-cache.part-*; do cp "$f" ".triton-cache/part-${f##*.part-}"; done
    ls -la .triton-cache
    ;;
*)
    echo "usage: $0 restore|save|keep DIR" >&2
    exit 2
    ;;
esac
