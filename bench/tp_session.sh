#!/usr/bin/env bash
# Peer all-reduce vs NCCL and Ling-3.0-flash at TP=N, in one device call on an N-GPU machine (bench.tp_gpu):
#   device: OUT=... bash bench/tp_session.sh        (from the repo root; needs torch + triton, nothing else)
#   device: OUT=... bash bench/tp_session.sh --tp 4 --tokens 1,2,4,8,9,12,16     (four GPUs)
# Each phase runs in its own pair of processes under its own limit; the whole run is capped at 400 s.
# Results: $OUT/tp_gpu.json (or bench/results/ without $OUT) and $OUT/tp_gpu.log.
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off on shared machines
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/bench/results}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
timeout 20 nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv
timeout 20 nvidia-smi topo -m
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
timeout -k 10 400 python3 -m bench.tp_gpu --out "$OUT" "$@" 2>&1 | tee "$OUT/tp_gpu.log"
echo "exit ${PIPESTATUS[0]}"
