#!/usr/bin/env bash
# Everything the runtime needs a GPU for, in one device call: GPU tests, `lingls bench step`, `lingls bench prefix`.
#   here:   bash bench/gpu_session.sh --prepare   (snapshot of HEAD + wheels under .cache/, both git-ignored)
#   device: run(command="bash bench/gpu_session.sh", carry=[".cache/runtime-snap", ".cache/runtime-wheels"])
# Results land in $OUT (the device tool's folder) or bench/results; copy step.json/png and prefix.json from there.
set -uo pipefail
cd "$(dirname "$0")/.."
SNAP=.cache/runtime-snap WHEELS=.cache/runtime-wheels
if [ "${1:-}" = --prepare ]; then
    rm -rf "$SNAP" && mkdir -p "$SNAP" "$WHEELS"
    git archive HEAD lingls tests/__init__.py tests/runtime pyproject.toml | tar -x -C "$SNAP"
    ls "$WHEELS"/fla_core-0.6.0-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp -d "$WHEELS" fla-core==0.6.0
    ls "$WHEELS"/transformers-5.23.0-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp -d "$WHEELS" transformers==5.23.0
    echo "snapshot of $(git rev-parse --short HEAD) in $SNAP; wheels: $(ls $WHEELS)"
    exit 0
fi
# Phases: tests step prefix peers (default: all). LINGLS_FLA=1 also installs fla-core for chunked prefill
# (its Triton autotuning takes minutes on a fresh machine; without it prefill uses the torch chunked form).
PHASES=${*:-tests step prefix peers}
# NVLink multicast stays off on shared machines
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/bench/results}
mkdir -p "$OUT"
WHL=$(ls "$WHEELS"/transformers-*.whl 2>/dev/null; [ "${LINGLS_FLA:-0}" = 1 ] && ls "$WHEELS"/fla_core-*.whl)
if [ -n "$WHL" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL \
        && export PYTHONPATH=/tmp/site
fi
SRC=$PWD
[ -d "$SNAP/lingls" ] && SRC=$PWD/$SNAP
export PYTHONPATH=$SRC${PYTHONPATH:+:$PYTHONPATH}
cd "$SRC"
if [ "${LINGLS_FLA:-0}" = 1 ]; then
# fla's chunk_kda serves long prefills when it computes what the torch chunked form computes; else drop it
python3 - <<'PY' || { echo "fla chunk_kda disagrees or fails: prefill uses the torch form"; rm -rf /tmp/site/fla /tmp/site/fla_core*; }
import torch
from fla.ops.kda import chunk_kda
from lingls.kernels import reference as ref
g = torch.Generator(device="cuda").manual_seed(0)
T, H, D = 192, 4, 128
q = ref.l2_normalize(torch.randn(1, T, H, D, device="cuda", generator=g)) * D ** -0.5
k = ref.l2_normalize(torch.randn(1, T, H, D, device="cuda", generator=g))
v = torch.randn(1, T, H, D, device="cuda", generator=g)
gate = -5 * torch.rand(1, T, H, D, device="cuda", generator=g)
beta = torch.rand(1, T, H, device="cuda", generator=g)
s0 = torch.randn(1, H, D, D, device="cuda", generator=g)
o, s = chunk_kda(q=q, k=k, v=v, g=gate, beta=beta, scale=1.0, initial_state=s0, output_final_state=True,
                 use_qk_l2norm_in_kernel=False)
o_ref, s_ref = ref.kda_chunked(q, k, v, gate, beta, s0)
err = max(((o - o_ref).norm() / o_ref.norm()).item(), ((s - s_ref).norm() / s_ref.norm()).item())
print(f"fla chunk_kda vs torch chunked form: rel. err {err:.2e}")
assert err < 1e-2
PY
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv
python3 -c "import torch, lingls; print('torch', torch.__version__, 'lingls from', lingls.__file__)"
for phase in $PHASES; do
    case $phase in
    tests)  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/runtime/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" ;;
    step)   timeout 150 python3 -m lingls.cli bench step --mode shard --profile ${STEP_ARGS:-} --out "$OUT/step.json" --plot 2>&1 | tee "$OUT/step.log" ;;
    prefix) timeout 300 python3 -m lingls.cli bench prefix --out "$OUT/prefix.json" 2>&1 | tee "$OUT/prefix.log" ;;
    peers)  timeout 150 python3 -m lingls.cli bench step --mode peers --peer-layers 6 --out "$OUT/step_peers.json" 2>&1 | tee "$OUT/peers.log" ;;
    esac
done
