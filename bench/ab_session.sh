#!/usr/bin/env bash
# One device call that checks this tree's kernels on the GPU, then times a benchmark with the code before and
# after a change (and any prepared variants), each in its own process, back to back on the same GPU:
#   here:   bash bench/ab_session.sh --prepare [REV]          (snapshot of REV, default HEAD, in .cache/before)
#           bash bench/ab_session.sh --variant NAME PATCH     (HEAD plus a patch, in .cache/NAME)
#   device: run(command="OUT=$OUT bash bench/ab_session.sh TESTS -- BENCH ARGS...", carry=[".cache"])
# "after" is the working tree, or .cache/after when that exists (a tree with only some of the changes).
# AB_SIDES (default "before after") names the trees to time, in order: before, after, or a variant's NAME;
# AB_ROUNDS (default 1) repeats that order, so each tree is timed between the others (round r > 1 writes
# NAME_rR.json). Device time is the scarce resource: several variants in one call cost one machine start.
# TESTS: pytest paths run in the "after" tree (a snapshot has no lingls/assets: tests that load ling-nano fail
# there), or "none"; BENCH ARGS: what follows `python3` (a benchmark module and its arguments), where @OUT stands
# for $OUT/SIDE.json (e.g. -m bench.fused_step_gpu @OUT 42, or -m bench.spec_flash_gpu --stub --out @OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
snapshot() {  # snapshot REV DIR: the code a benchmark imports, without the embedded model or the results
    rm -rf "$2" && mkdir -p "$2"  # (the results are most of a snapshot's size, and the tree travels in 64 MiB)
    git archive "$1" lingls bench tests pyproject.toml | tar -x -C "$2" --exclude=lingls/assets --exclude=bench/results
}
if [ "${1:-}" = --prepare ]; then
    snapshot "${2:-HEAD}" .cache/before
    echo "snapshot of $(git rev-parse --short "${2:-HEAD}") in .cache/before"
    exit 0
fi
if [ "${1:-}" = --variant ]; then
    [ $# -eq 3 ] || { echo "usage: $0 --variant NAME PATCH" >&2; exit 2; }
    case "$2" in before|after) echo "variant name $2 is taken" >&2; exit 2 ;; esac
    patch=$(realpath "$3")
    snapshot HEAD ".cache/$2"
    # the code a benchmark runs (a variant's tests are never run); outside the repository, since a git apply
    # inside an ignored folder of it skips every path silently
    (cd ".cache/$2" && GIT_CEILING_DIRECTORIES=$PWD/.. git apply --include='lingls/*' --include='bench/*' "$patch") \
        || { echo "$3 does not apply to HEAD" >&2; rm -rf ".cache/$2"; exit 1; }
    echo "HEAD ($(git rev-parse --short HEAD)) + $3 in .cache/$2"
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
for round in $(seq 1 "${AB_ROUNDS:-1}"); do
    for side in ${AB_SIDES:-before after}; do
        dir=$PWD; [ -d .cache/$side ] && dir=$PWD/.cache/$side
        if [ "$side" != after ] && [ "$dir" = "$PWD" ]; then echo "== $side: no .cache/$side, skipped"; continue; fi
        name=$side; [ "$round" -gt 1 ] && name=${side}_r$round
        args=("${@//@OUT/$OUT/$name.json}")
        echo "== $name ($dir)"
        (cd "$dir" && PYTHONPATH=$dir timeout 280 python3 "${args[@]}" 2>&1 | tail -${AB_TAIL:-14})
    done
done
