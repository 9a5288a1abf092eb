#!/usr/bin/env bash
# One device call that checks this tree's kernels on the GPU, then times a benchmark with the code before and
# after a change, each in its own process, back to back on the same GPU:
#   here:   bash bench/ab_session.sh --prepare [REV]   (snapshot of REV, default HEAD, in .cache/before)
#   device: run(command="OUT=$OUT bash bench/ab_session.sh TESTS -- BENCH ARGS...", carry=[".cache/before"])
# "after" is the working tree, or .cache/after when that exists (a tree with only some of the changes).
# TESTS: pytest paths run in the "after" tree (a snapshot has no lingls/assets: tests that load ling-nano fail
# there), or "none"; BENCH ARGS: a bench script and its arguments, where @OUT stands for $OUT/before.json or
# $OUT/after.json (e.g. bench/fused_step_gpu.py @OUT 42, or bench/spec_flash_gpu.py --stub --out @OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = --prepare ]; then
    rm -rf .cache/before && mkdir -p .cache/before
    git archive "${2:-HEAD}" lingls bench tests pyproject.toml | tar -x -C .cache/before --exclude=lingls/assets
    echo "snapshot of $(git rev-parse --short "${2:-HEAD}") in .cache/before"
    exit 0
fi
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/bench/results}
mkdir -p "$OUT"
tests=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do tests+=("$1"); shift; done
shift
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
after=$PWD; [ -d .cache/after ] && after=$PWD/.cache/after
if [ "${tests[0]:-none}" != none ]; then
    (cd "$after" && PYTHONPATH=$after timeout 240 python3 -m pytest -q -p no:cacheprovider -x "${tests[@]}" 2>&1 \
        | tail -8)
fi
for side in before after; do
    dir=$PWD; [ -d .cache/$side ] && dir=$PWD/.cache/$side
    args=("${@//@OUT/$OUT/$side.json}")
    echo "== $side ($dir)"
    (cd "$dir" && PYTHONPATH=$dir timeout 280 python3 "${args[@]}" 2>&1 | tail -${AB_TAIL:-14})
done
