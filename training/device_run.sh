#!/usr/bin/env bash
# The reproduce command as run on the lent GPU machine (no internet there), inside one command's time:
#   RUN_SECONDS=430 bash training/device_run.sh [reproduce arguments...]
# - installs the carried wheels (.whl/: rapidfuzz, fla-core);
# - measures training throughput (python -m bench.train_throughput: the torch scan KDA, then fla-core's chunk_kda
#   after checking it against the torch form; its kernels compile once, autotuning bounded) WHILE
#   training.reproduce builds the data; reproduce waits for the benchmark's choice (batch size, kernel), trains
#   until RUN_SECONDS minus the time the evaluation needs, evaluates and writes the card;
# - distils the block drafter for the new model (training.draft.distill) beside the evaluation, once the model
#   is saved;
# - packs /tmp/nano into $OUT as <= 15 MiB parts (the tool brings back at most 8 files of 16 MiB), whatever
#   failed or ran out of time before, and Triton's cache (compiled kernels, autotune results) as
#   $OUT/triton-cache.tgz: carry it back as TRITON_CACHE_TGZ=... and fla's kernels need no compiling next time.
#   RESUME_TAR=path/to/nano.tar.part-  (optional) unpacks an earlier run there and passes --resume to it.
set -uo pipefail
t0=$(date +%s)
run_seconds=${RUN_SECONDS:-430}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/rapidfuzz-*.whl .whl/fla_core-*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT" /tmp/nano/results "$TRITON_CACHE_DIR"
[ -n "${TRITON_CACHE_TGZ:-}" ] && tar -C "$TRITON_CACHE_DIR" -xzf "$TRITON_CACHE_TGZ"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, rapidfuzz, fla; print('torch', torch.__version__, 'rapidfuzz', rapidfuzz.__version__, 'fla', fla.__version__)"
choice=/tmp/nano/results/train_throughput.json
timeout 180 python3 -m bench.train_throughput "$choice" ${BATCHES:-32 64} >"$OUT/bench.txt" 2>&1 &
extra=()
if [ -n "${RESUME_TAR:-}" ]; then
    mkdir -p /tmp/prev && cat "$RESUME_TAR"* | tar -C /tmp/prev -xf - && extra=(--resume /tmp/prev)
fi
# the drafter: once the model is saved (generation_config.json is written last), in the time that is left
(
    while [ ! -f /tmp/nano/ling-nano/generation_config.json ]; do
        [ $(( $(date +%s) - t0 )) -gt "$run_seconds" ] && exit 1
        sleep 2
    done
    left=$(( run_seconds - 10 - ($(date +%s) - t0) ))
    timeout "$left" python3 -m training.draft.distill --target /tmp/nano/ling-nano --out /tmp/nano/ling-nano/draft \
        --fla --seconds $(( left - 45 )) --max-train-bytes 30000000
) >"$OUT/distill.txt" 2>&1 &
draft_pid=$!
timeout $(( run_seconds - 5 - ($(date +%s) - t0) )) python3 -m training.reproduce --out /tmp/nano \
    --kernel-choice "$choice" --finish-by $(( t0 + run_seconds - 5 )) "${extra[@]}" "$@" 2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}
wait "$draft_pid"
echo "reproduce exit $status, drafter exit $?, $(( $(date +%s) - t0 ))s"
tar -C /tmp/nano -cf - . | split -b 15m - "$OUT/nano.tar.part-"
tar -C "$TRITON_CACHE_DIR" -czf "$OUT/triton-cache.tgz" . && [ "$(stat -c %s "$OUT/triton-cache.tgz")" -lt 16000000 ] \
    || rm -f "$OUT/triton-cache.tgz"
ls -la "$OUT"
exit "$status"
