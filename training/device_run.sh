#!/usr/bin/env bash
# The reproduce command as run on the lent GPU machine (no internet there): install the carried rapidfuzz
# wheel, measure training throughput by batch size (python -m bench.train_throughput) and train at the fastest, run
# `python -m training.reproduce`, and pack DIR into $OUT as <= 15 MiB parts (the tool brings back at most 8
# files of 16 MiB). Extra arguments go to training.reproduce (--train-seconds, --resume DIR, ...).
# fla-core is deliberately not installed: its chunk_kda kernels autotune on first use, which took the whole
# smoke run (> 3 minutes without finishing one step); the model's torch chunked KDA trains without compiling.
#   RESUME_TAR=path/to/nano.tar.part-  (optional) unpacks an earlier run there and passes --resume to it.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/rapidfuzz-*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, rapidfuzz; print('torch', torch.__version__, 'rapidfuzz', rapidfuzz.__version__)"
batch=$(timeout 90 python3 -m bench.train_throughput "$OUT/train_throughput.json" ${BATCHES:-32 64} | tee "$OUT/bench.txt" | tail -1)
case "$batch" in ''|*[!0-9]*) batch=32 ;; esac
echo "training batch: $batch"
extra=()
if [ -n "${RESUME_TAR:-}" ]; then
    mkdir -p /tmp/prev && cat "$RESUME_TAR"* | tar -C /tmp/prev -xf - && extra=(--resume /tmp/prev)
fi
timeout "${REPRODUCE_TIMEOUT:-480}" python3 -m training.reproduce --out /tmp/nano --batch-size "$batch" "${extra[@]}" "$@" \
    2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}
tar -C /tmp/nano -cf - . | split -b 15m - "$OUT/nano.tar.part-"
ls -la "$OUT"
exit "$status"
