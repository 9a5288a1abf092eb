#!/usr/bin/env bash
# The reproduce command as run on the lent GPU machine (no internet there), inside one command's time:
#   RUN_SECONDS=430 bash training/device_run.sh [reproduce arguments...]
# - installs the carried wheels (.whl/: rapidfuzz, fla-core);
# - measures training throughput (python -m bench.train_throughput --compiled-only: fla-core's chunk_kda
#   after checking it against the torch form; its kernels compile once, autotuning bounded) WHILE
#   training.reproduce builds the data; reproduce waits for the benchmark's choice (batch size, kernel), trains
#   until RUN_SECONDS minus the time the evaluation needs, evaluates and writes the card;
# - distils the block drafter for the new model (training.draft.distill) in the time left after the evaluation
#   (DRAFT_SECONDS, default 60, are kept for it) and re-renders the card with it;
# - packs /tmp/nano into $OUT as <= 15 MiB parts (the tool brings back at most 8 files of 16 MiB), whatever
#   failed or ran out of time before, and Triton's cache (compiled kernels, autotune results) as
#   $OUT/triton-cache.tgz: carry it back as TRITON_CACHE_TGZ=... and fla's kernels need no compiling next time.
#   RESUME_TAR=path/to/nano.tar.part- or run.tar.xz (optional) unpacks an earlier run and trains on from it
#   (--resume); with --eval-only among the arguments, unpacks it as this run's own directory and only evaluates
#   (and distils). RESUME_TAR=shipped trains on from the model the tree ships (nothing more to carry: its state
#   is in bench/results/nano_eval.json, its log bench/results/nano_train_log.json, as training.ship wrote them).
#   TorchInductor's cache (the compiled layers) comes back as $OUT/inductor-cache.tgz: INDUCTOR_CACHE_TGZ=...
#   CHOICE=path/to/train_throughput.json (optional) takes an earlier run's choice (batch, kernel, compiled
#   layers) instead of running the throughput benchmark again.
set -uo pipefail
t0=$(date +%s)
run_seconds=${RUN_SECONDS:-430}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/rapidfuzz-*.whl .whl/fla_core-*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/triton-cache \
    TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
# lingls' prefill kernels are inference-only (no backward; the router's wants fp32 logits, autocast gives bf16):
# the throughput bench, training, evaluation and distillation run the model's torch forms (training.train.torch_ops_only)
export LINGLS_KERNELS=0
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT" /tmp/nano/results "$TRITON_CACHE_DIR" "$TORCHINDUCTOR_CACHE_DIR"
[ -n "${TRITON_CACHE_TGZ:-}" ] && tar -C "$TRITON_CACHE_DIR" -xzf "$TRITON_CACHE_TGZ"
[ -n "${INDUCTOR_CACHE_TGZ:-}" ] && tar -C "$TORCHINDUCTOR_CACHE_DIR" -xzf "$INDUCTOR_CACHE_TGZ"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, rapidfuzz, fla; print('torch', torch.__version__, 'rapidfuzz', rapidfuzz.__version__, 'fla', fla.__version__)"
choice=/tmp/nano/results/train_throughput.json
if [ -n "${CHOICE:-}" ]; then
    cp "$CHOICE" "$choice"
else
    # the compiled forms only, at batch 64 (the eager forms never win, batch 128 gained 3% over 64, and each
    # compiled form compiles for ~40-55 s on its first step); a cut benchmark leaves its best form so far
    timeout "${BENCH_SECONDS:-240}" python3 -m bench.train_throughput "$choice" ${BATCHES:-64} --compiled-only \
        >"$OUT/bench.txt" 2>&1 &
fi
extra=()
into=/tmp/prev
case " $* " in *" --eval-only "*) into=/tmp/nano ;; esac  # evaluate the carried run's model, no training
if [ "${RESUME_TAR:-}" = shipped ]; then  # the model the tree ships: its packed weights, its state and log in bench/results
    mkdir -p /tmp/prev/results && cp -r lingls/assets/ling-nano /tmp/prev/ling-nano && python3 -c "
import json
json.dump(json.load(open('bench/results/nano_eval.json'))['training']['state'], open('/tmp/prev/results/train_state.json', 'w'))
with open('/tmp/prev/results/train_log.jsonl', 'w') as f:
    f.writelines(json.dumps(r) + '\\n' for r in json.load(open('bench/results/nano_train_log.json')))
" || { echo "the shipped model cannot be resumed"; exit 1; }
    extra=(--resume /tmp/prev)
elif [ -n "${RESUME_TAR:-}" ]; then  # split parts (PREFIX*) or one .tar.xz; a run that cannot resume stops here
    mkdir -p "$into"
    case "$RESUME_TAR" in
        *.xz) xz -dc "$RESUME_TAR" ;;
        *) cat "$RESUME_TAR"* ;;
    esac | tar -C "$into" -xf - || { echo "RESUME_TAR=$RESUME_TAR could not be unpacked"; exit 1; }
    [ "$into" = /tmp/prev ] && extra=(--resume /tmp/prev)
fi
draft_seconds=${DRAFT_SECONDS:-60}
after_train=$(( 130 + draft_seconds + 40 ))
train_only=0
case " $* " in *" --train-only "*) train_only=1; after_train=25 ;; esac  # save and pack: no evaluation, no drafter
timeout $(( run_seconds - 5 - ($(date +%s) - t0) )) python3 -m training.reproduce --out /tmp/nano \
    --kernel-choice "$choice" --finish-by $(( t0 + run_seconds - 5 )) --after-train $after_train \
    "${extra[@]}" "$@" 2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}
# the drafter for the model just saved, in the time that is left (after the evaluation: beside it, both crawled)
left=$(( run_seconds - 10 - ($(date +%s) - t0) ))
if [ "$train_only" = 0 ] && [ -f /tmp/nano/ling-nano/generation_config.json ] && [ "$left" -gt 60 ]; then
    timeout "$left" python3 -m training.draft.distill --target /tmp/nano/ling-nano --out /tmp/nano/ling-nano/draft \
        --fla --seconds $(( left - 40 )) --max-train-bytes 30000000 >"$OUT/distill.txt" 2>&1
    echo "drafter exit $?"
    [ -f /tmp/nano/results/nano_eval.json ] && python3 -m training.card /tmp/nano  # the card with the drafter
fi
echo "reproduce exit $status, $(( $(date +%s) - t0 ))s"
tar -C /tmp/nano -cf - . | split -b 15m - "$OUT/nano.tar.part-"
cp -f "$choice" "$OUT/train_throughput.json" 2>/dev/null
# the caches only where they fit what comes back (8 files, 64 MiB): the run's parts come first
for cache in triton:"$TRITON_CACHE_DIR" inductor:"$TORCHINDUCTOR_CACHE_DIR"; do
    tgz="/tmp/${cache%%:*}-cache.tgz"
    tar -C "${cache#*:}" -czf "$tgz" . || continue
    if [ "$(stat -c %s "$tgz")" -lt 16000000 ] && [ "$(ls "$OUT" | wc -l)" -lt 8 ] \
        && [ $(( $(du -sb "$OUT" | cut -f1) + $(stat -c %s "$tgz") )) -lt 66000000 ]; then
        mv "$tgz" "$OUT/"
    fi
done
ls -la "$OUT"
exit "$status"
