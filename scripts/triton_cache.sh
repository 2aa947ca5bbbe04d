#!/usr/bin/env bash
# Keep the Triton cache (compiled kernels and autotuning results) between device machines: a fresh machine
# spends ~190 s compiling and autotuning fla-core's chunked KDA kernels before the first training step.
#   scripts/triton_cache.sh restore   on the device: unpack .triton-cache/part-* (carried), or else its
#                                     autotune.tgz, or else the committed scripts/triton-autotune-h200.tgz,
#                                     into $TRITON_CACHE_DIR
#   scripts/triton_cache.sh save      on the device: pack $TRITON_CACHE_DIR into $OUT/triton-cache.part-* (15 MiB each)
#   scripts/triton_cache.sh keep DIR  here: keep the autotuning results of what a run brought back (files_at DIR)
#                                     in .triton-cache/autotune.tgz (the whole cache no longer fits the carry)
# The whole cache (88 MB compressed after the demo run) may not fit beside a run's other files; then the
# autotuning results alone (*.autotune.json: the timings of every config, a few hundred kB) travel as
# triton-autotune.tgz: with them a fresh machine compiles only each kernel's chosen config instead of
# benchmarking them all.
# Source this script's environment on the device first: export TRITON_CACHE_DIR=/tmp/tc TRITON_CACHE_AUTOTUNING=1
# (carry .triton-cache beside .whl; .triton-cache is git-ignored.)
set -uo pipefail
cd "$(dirname "$0")/.."
CACHE=${TRITON_CACHE_DIR:-/tmp/tc}
case "${1:-}" in
restore)
    mkdir -p "$CACHE"
    if ls .triton-cache/part-* > /dev/null 2>&1 && cat .triton-cache/part-* | gzip -t 2> /dev/null; then
        cat .triton-cache/part-* | tar xzf - -C "$CACHE" && echo "triton cache: $(du -sh "$CACHE" | cut -f1) restored"
    elif [ -f .triton-cache/autotune.tgz ]; then
        tar xzf .triton-cache/autotune.tgz -C "$CACHE" \
            && echo "triton cache: $(find "$CACHE" -name '*.autotune.json' | wc -l) autotuning results restored (no binaries)"
    elif [ -f scripts/triton-autotune-h200.tgz ]; then
        # committed (23 KB): the autotuning results of demo run 8 (H200, triton 3.6, 2026-12-01) and of mini's
        # training (session 27: its first step 300 s cold, 55-62 s with them); results of kernels whose source
        # changed since are simply not looked up
        tar xzf scripts/triton-autotune-h200.tgz -C "$CACHE" \
            && echo "triton cache: $(find "$CACHE" -name '*.autotune.json' | wc -l) committed autotuning results restored"
    else
        echo "triton cache: none carried (or incomplete), starting cold"
    fi
    ;;
save)
    # $OUT returns at most 8 files and 64 MiB in all: the whole cache's parts if they fit beside what is there,
    # else the autotuning results alone (one small file), if they fit
    fits() {  # fits FILES BYTES: would that much more still come back?
        [ $(( $(find "$OUT" -type f | wc -l) + $1 )) -le 8 ] \
            && [ $(( $(du -sb "$OUT" | cut -f1) + $2 )) -le $(( 64 * 1024 * 1024 - 65536 )) ]
    }
    tmp=$(mktemp -d)
    tar czf - -C "$CACHE" . | split -b 15m - "$tmp/triton-cache.part-"
    if fits "$(ls "$tmp" | wc -l)" "$(du -sb "$tmp" | cut -f1)"; then
        mv "$tmp"/triton-cache.part-* "$OUT/" && ls -la "$OUT"/triton-cache.part-*
    else
        echo "triton cache: the whole cache ($(du -sh "$tmp" | cut -f1)) does not fit beside \$OUT's files"
        (cd "$CACHE" && find . -name '*.autotune.json' -print0 > "$tmp/list")
        if [ -s "$tmp/list" ]; then
            tar czf "$tmp/triton-autotune.tgz" -C "$CACHE" --null -T "$tmp/list"
            if fits 1 "$(du -sb "$tmp/triton-autotune.tgz" | cut -f1)"; then
                mv "$tmp/triton-autotune.tgz" "$OUT/" && ls -la "$OUT/triton-autotune.tgz"
            else
                echo "triton cache: the autotuning results do not fit either"
            fi
        else
            echo "triton cache: no autotuning results to keep"
        fi
    fi
    rm -rf "$tmp"
    ;;
keep)
    [ -n "${2:-}" ] || { echo "usage: $0 keep DIR (the run's files_at)" >&2; exit 2; }
    shopt -s nullglob
    parts=("$2"/triton-cache.part-*)
    if [ -f "$2/triton-autotune.tgz" ] && ! { [ ${#parts[@]} -gt 0 ] && cat "${parts[@]}" | gzip -t 2> /dev/null; }; then
        rm -rf .triton-cache && mkdir -p .triton-cache && cp "$2/triton-autotune.tgz" .triton-cache/autotune.tgz
        ls -la .triton-cache
        exit 0
    fi
    [ ${#parts[@]} -gt 0 ] || { echo "no triton-cache parts in $2: .triton-cache left as it was" >&2; exit 1; }
    cat "${parts[@]}" | gzip -t || { echo "the parts in $2 are incomplete: .triton-cache left as it was" >&2; exit 1; }
    # The device tool carries at most 64 MiB of working tree, and the shipped demo model (36 MB) and the wheels
    # (16 MB) leave no room for the whole cache: keep its autotuning results alone. With them a fresh machine's
    # first demo training step took 15-63 s (session 10), against ~190 s cold. .triton-cache is replaced only
    # once the new archive is built and holds results.
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    mkdir "$tmp/cache"
    cat "${parts[@]}" | tar xzf - -C "$tmp/cache" || { echo "cannot unpack the parts in $2: .triton-cache left as it was" >&2; exit 1; }
    n=$(find "$tmp/cache" -name '*.autotune.json' | wc -l)
    [ "$n" -gt 0 ] || { echo "no autotuning results in $2: .triton-cache left as it was" >&2; exit 1; }
    (cd "$tmp/cache" && find . -name '*.autotune.json' -print0 | tar czf "$tmp/autotune.tgz" --null -T -) \
        || { echo "cannot pack the autotuning results: .triton-cache left as it was" >&2; exit 1; }
    rm -rf .triton-cache && mkdir -p .triton-cache && mv "$tmp/autotune.tgz" .triton-cache/autotune.tgz
    echo "triton cache: $(tar tzf .triton-cache/autotune.tgz | grep -c autotune.json) autotuning results kept"
    ;;
*)
    echo "usage: $0 restore|save|keep DIR" >&2
    exit 2
    ;;
esac
