#!/usr/bin/env bash
# Ling-3.0-flash at TP=N on N GPUs, everything in one device call (random weights at the real shapes):
#   device: OUT=... bash bench/tp_full_session.sh 4
# 1. bench.tp_gpu: the decode and verify steps T=1..16 in CUDA graphs, NCCL vs the peer all-reduce, floors;
# 2. bench.spec_flash_gpu: TPOT against forced acceptance lengths (SIMULATED), K = 8, 4;
# 3. bench.serve_e2e: a real `lingls serve --tp N` on a weightless checkpoint, 8,192-token prompt and 1,024
#    new tokens, without drafting and with the MTP drafter at K=8 with 6 and 8 of 8 drafts accepted per round
#    (SIMULATED: `--simulate-accept`; random drafts are never accepted). One run each: the cold 8k prefill takes
#    ~55 s at TP=2 (torch-op prefill).
# 4. bench.plot_tp: the step sweep's plot.
# Each under its own limit; results and logs land in $OUT (or bench/results).
set -uo pipefail
cd "$(dirname "$0")/.."
N=${1:-4}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-$PWD/bench/results}
mkdir -p "$OUT"
timeout -k 10 200 python3 -m bench.tp_gpu --tp "$N" --phases model --tokens 1,2,4,8,9,12,16 --out "$OUT" \
    > "$OUT/tp_gpu_tp$N.log" 2>&1
echo "tp_gpu exit $?"; grep -E "^\| |ok in" "$OUT/tp_gpu_tp$N.log" | tail -12
[ -f "$OUT/tp_gpu.json" ] && mv "$OUT/tp_gpu.json" "$OUT/tp_gpu_tp$N.json"
timeout -k 10 150 python3 -m bench.spec_flash_gpu --tp "$N" --ks 8,4 --budget-s 90 --out "$OUT/spec_flash_tp$N.json" \
    > "$OUT/spec_flash_tp$N.log" 2>&1
echo "spec exit $?"; grep -E "^  8   6|plain decode step \(no" "$OUT/spec_flash_tp$N.log"
CKPT=/tmp/flash_weightless
python3 -m lingls.model.random_checkpoint "$CKPT" --flash --weightless
timeout -k 10 150 python3 -m bench.serve_e2e --model "$CKPT" --tp "$N" --runs 1 --load-timeout 100 \
    --out "$OUT/serve_e2e_tp${N}_none.json" 2>&1 | tail -1
for a in 6 8; do
    timeout -k 10 150 python3 -m bench.serve_e2e --model "$CKPT" --tp "$N" --draft mtp --draft-k 8 --simulate-accept $a \
        --runs 1 --load-timeout 100 --out "$OUT/serve_e2e_tp${N}_mtp_a$a.json" 2>&1 | tail -1
done
[ -f "$OUT/tp_gpu_tp$N.json" ] && python3 -m bench.plot_tp "$OUT/tp_gpu_tp$N.png" "TP=$N=$OUT/tp_gpu_tp$N.json"
