#!/usr/bin/env bash
# The reproduce command as run on the lent GPU machine (no internet there): install the carried rapidfuzz
# wheel, run `python -m training.reproduce`, and pack DIR into $OUT as <= 15 MiB parts (the tool brings back
# at most 8 files of 16 MiB). Extra arguments go to training.reproduce.
# fla-core is deliberately not installed: its chunk_kda kernels autotune on first use, which took the whole
# smoke run (> 3 minutes without finishing one step); the model's torch chunked KDA trains without compiling.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/rapidfuzz-*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, rapidfuzz; print('torch', torch.__version__, 'rapidfuzz', rapidfuzz.__version__)"
timeout 45 python3 -m bench.train_throughput "$OUT/train_throughput.json" 32
timeout 510 python3 -m training.reproduce --out /tmp/nano "$@" 2>&1 | tee "$OUT/log.txt"
status=${PIPESTATUS[0]}
tar -C /tmp/nano -cf - . | split -b 15m - "$OUT/nano.tar.part-"
ls -la "$OUT"
exit "$status"
