"""The fused KDA step and commit against their references (Triton's interpreter on CPU, the real kernel on GPU).

Every check draws fresh random inputs, poisons outputs with NaN first, and compares with ||a-b||/||b||: fp32
math to 1e-5. With bf16 inputs the reference runs on the same values upcast to fp32, so the state (fp32 in
both) still matches to 1e-5 and only the bf16 rounding of the output is left (1e-2).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")  # GPU-only dependency: these tests run its interpreter on CPU

from lingls.kernels import by_width_and_tokens, kda
from tests.kernels.conftest import rel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LB = -5.0



def make(t, h, d, dtype, gen, fused=False):
    """Random step inputs; with fused=True q, k, v, f, z, b are strided views of one [T, 5C+H] GEMV output."""
    c = h * d

    def r(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=gen) * scale).to(DEV, dt)

    if fused:
        buf = r(t, 5 * c + h)
        q, k, v, f, z, b = buf.split([c, c, c, c, c, h], dim=1)
    else:
        q, k, v, f, z, b = r(t, c), r(t, c), r(t, c), r(t, c), r(t, c), r(t, h)
    return dict(q=q, k=k, v=v, f=f, b=b, z=z, conv_state=r(3, c, 3), conv_weight=r(3, c, 4, scale=0.5),
                a_log=r(h, scale=0.5, dt=torch.float32), dt_bias=r(c, dt=torch.float32),
                norm_weight=r(d, scale=0.5) + 1, state=r(h, d, d, scale=0.3, dt=torch.float32))


def upcast(inp):
    """fp32 copies (the reference's inputs); the kernel mutates its own."""
    return {n: None if x is None else x.float().clone() for n, x in inp.items()}


def run_kernel(inp, **kw):
    mutable = {n: inp[n].clone() for n in ("conv_state", "state")}
    out_dtype = inp["q"].dtype if inp["norm_weight"] is not None else torch.float32
    out = torch.full(inp["q"].shape, float("nan"), device=DEV, dtype=out_dtype)
    kda.fused_kda_step(**{**inp, **mutable}, lower_bound=LB, out=out, **kw)
    return out, mutable


def assert_workspace_clean(h, d):
    assert (kda._workspace(torch.device(DEV), h, d)[1] == 0).all(), "arrival counters not reset"


@pytest.mark.parametrize("t,h,d,block_v,dtype,fused", [
    (1, 2, 16, 8, torch.float32, False),
    (9, 4, 32, 16, torch.bfloat16, False),
    (16, 8, 16, 16, torch.float32, False),
    (5, 2, 64, 32, torch.bfloat16, True),
    (9, 2, 128, 64, torch.float32, False),  # flash's head size, two programs per head (a tuning candidate)
])
def test_step_matches_reference(t, h, d, block_v, dtype, fused):
    gen = torch.Generator().manual_seed(1000 * t + 10 * h + d)
    inp = make(t, h, d, dtype, gen, fused)
    out, new = run_kernel(inp, block_v=block_v)
    ref_in = upcast(inp)
    ref_out = kda.kda_step_reference(**ref_in, lower_bound=LB)
    assert out.dtype == dtype
    assert rel(out, ref_out) < (1e-5 if dtype == torch.float32 else 1e-2)
    assert rel(new["state"], ref_in["state"]) < 1e-5
    assert torch.equal(new["conv_state"].float(), ref_in["conv_state"])  # copies of inputs: exact
    assert_workspace_clean(h, d)


@pytest.mark.parametrize("t", [1, 9])
def test_launch_settings_from_configs_compute_the_same_step(t, monkeypatch):
    """What bench/tune_gpu.py pins in CONFIGS (value columns per program, warps; per heads per rank) changes nothing
    computed."""
    monkeypatch.setattr(kda, "CONFIGS", {2: {1: (8, 2), 16: (4, 1)}, 8: {1: (16, 4), 16: (16, 4)}})  # 2 heads
    inp = make(t, 2, 16, torch.float32, torch.Generator().manual_seed(t), False)
    out, new = run_kernel(inp)
    ref_in = upcast(inp)
    assert rel(out, kda.kda_step_reference(**ref_in, lower_bound=LB)) < 1e-5
    assert rel(new["state"], ref_in["state"]) < 1e-5


def test_raw_output_without_norm():
    gen = torch.Generator().manual_seed(7)
    inp = {**make(4, 2, 32, torch.float32, gen), "norm_weight": None, "z": None}
    out, new = run_kernel(inp, block_v=8)
    ref_in = upcast(inp)
    ref_out = kda.kda_step_reference(**ref_in, lower_bound=LB)
    assert out.dtype == torch.float32
    assert rel(out, ref_out) < 1e-5 and rel(new["state"], ref_in["state"]) < 1e-5


def test_consecutive_steps_carry_state():
    """Two launches on one state (T=1 then T=3): in-place updates and the counter reset between launches."""
    gen = torch.Generator().manual_seed(11)
    first, second = make(1, 2, 16, torch.float32, gen), make(3, 2, 16, torch.float32, gen)
    for name in ("conv_state", "state", "conv_weight", "a_log", "dt_bias", "norm_weight"):
        second[name] = first[name]
    live = {n: first[n].clone() for n in ("conv_state", "state")}
    outs = [kda.fused_kda_step(**{**x, **live}, lower_bound=LB, block_v=8) for x in (first, second)]
    ref_live = {n: first[n].clone() for n in ("conv_state", "state")}
    ref_outs = [kda.kda_step_reference(**{**x, **ref_live}, lower_bound=LB) for x in (first, second)]
    for o, r in zip(outs, ref_outs):
        assert rel(o, r) < 1e-5
    assert rel(live["state"], ref_live["state"]) < 1e-5
    assert torch.equal(live["conv_state"], ref_live["conv_state"])


def test_staged_verify_then_commit_equals_accepted_prefix():
    t, h, d = 9, 2, 32
    gen = torch.Generator().manual_seed(21)
    inp = make(t, h, d, torch.bfloat16, gen)
    c = h * d
    stage = (torch.full((t, h, kda.STAGE_ROWS, d), float("nan"), device=DEV),
             torch.full((t, 3, c), float("nan"), device=DEV, dtype=torch.bfloat16))
    out, live = run_kernel(inp, block_v=16, stage=stage)
    assert torch.equal(live["state"], inp["state"]) and torch.equal(live["conv_state"], inp["conv_state"])
    ref_in = upcast(inp)
    ref_stage = (torch.empty(t, h, kda.STAGE_ROWS, d, device=DEV), torch.empty(t, 3, c, device=DEV))
    ref_out = kda.kda_step_reference(**ref_in, lower_bound=LB, stage=ref_stage)
    assert rel(out, ref_out) < 1e-2
    assert torch.isfinite(stage[0]).all()  # every input row written, beta's row too
    assert rel(stage[0], ref_stage[0]) < 1e-5
    assert torch.equal(stage[1].float(), ref_stage[1])

    for accepted in (0, int(torch.randint(1, t - 1, (1,), generator=gen)), t - 1):  # none, some, all accepted
        index = torch.tensor([accepted], device=DEV, dtype=torch.int32)
        state, conv = live["state"].clone()[None], live["conv_state"].clone()[None]
        kda.fused_commit(index, state, stage[0][None], conv, stage[1][None])
        prefix = {n: (x[: accepted + 1] if n in ("q", "k", "v", "f", "b", "z") else x) for n, x in upcast(inp).items()}
        kda.kda_step_reference(**prefix, lower_bound=LB)  # only the accepted tokens, on the old live state
        assert rel(state[0], prefix["state"]) < 1e-5
        assert torch.equal(conv[0].float(), prefix["conv_state"])


def staged_inputs(gen, layers, t, h, d):
    """Recurrence inputs as a staged step leaves them: unit keys, log decay in (-5, 0), values, beta in (0, 1)."""
    k = torch.nn.functional.normalize(torch.randn(layers, t, h, d, generator=gen), dim=-1)
    g = -5 * torch.rand(layers, t, h, d, generator=gen)
    v = torch.randn(layers, t, h, d, generator=gen)
    beta = torch.rand(layers, t, h, 1, generator=gen).expand(layers, t, h, d)
    return torch.stack([k, g, v, beta], dim=3).contiguous()


def test_commit_replays_every_layer_in_one_launch():
    """The commit's replay (kernel and reference) is the recurrence over the accepted prefix, for every layer
    at once; the conv windows are the inputs up to the accepted position, the live window's newer slots where
    it reaches back before the step."""
    layers, t, h, d = 3, 5, 2, 32
    gen = torch.Generator().manual_seed(31)
    staged = staged_inputs(gen, layers, t, h, d).to(DEV)
    staged_conv = torch.randn(layers, t, 3, h * d, generator=gen).to(DEV, torch.bfloat16)
    start = (torch.randn(layers, h, d, d, generator=gen) * 0.3).to(DEV)
    start_conv = torch.randn(layers, 3, h * d, 3, generator=gen).to(DEV, torch.bfloat16)
    inputs = torch.cat([start_conv, staged_conv.permute(0, 2, 3, 1)], dim=-1)  # inputs -3 .. t-1 per channel
    for accepted in (0, 1, 3):
        index = torch.tensor(accepted, device=DEV)
        live, live_conv = start.clone(), start_conv.clone()
        kda.fused_commit(index, live, staged, live_conv, staged_conv, block_v=16)
        assert torch.equal(live_conv, inputs[..., accepted + 1: accepted + 4])
        ref_live, ref_conv = start.clone(), start_conv.clone()
        kda.commit_reference(index, ref_live, staged, ref_conv, staged_conv)
        assert rel(live, ref_live) < 1e-5 and torch.equal(ref_conv, live_conv)
    want = start.clone()  # the definition of the last (3 accepted), position by position
    for i in range(4):
        k, g, v, beta = staged[:, i].unbind(2)
        want = want * g.exp()[..., None]
        err = (v - torch.einsum("lhkv,lhk->lhv", want, k)) * beta
        want = want + k[..., None] * err[:, :, None, :]
    assert rel(ref_live, want) < 1e-5


def test_commit_refuses_a_stage_of_the_wrong_layout():
    state, conv = torch.zeros(2, 2, 8, 8), torch.zeros(2, 3, 16, 3)
    with pytest.raises(ValueError, match="stage_state"):
        kda.commit_reference(torch.tensor(0), state, torch.zeros(2, 3, 2, 8, 8), conv, torch.zeros(2, 3, 3, 16))
    with pytest.raises(ValueError, match="stage_conv"):
        kda.commit_reference(torch.tensor(0), state, torch.zeros(2, 3, 2, kda.STAGE_ROWS, 8), conv,
                             torch.zeros(2, 4, 3, 16))


def test_dispatch_uses_reference_off_gpu():
    gen = torch.Generator().manual_seed(41)
    inp = {n: x.cpu() for n, x in make(2, 2, 8, torch.float32, gen).items()}
    mirror = {n: x.clone() for n, x in inp.items()}
    out = kda.kda_step(**inp, lower_bound=LB)
    assert torch.equal(out, kda.kda_step_reference(**mirror, lower_bound=LB))
    assert torch.equal(inp["state"], mirror["state"])


def test_bad_shapes_are_named():
    gen = torch.Generator().manual_seed(51)
    inp = make(2, 2, 16, torch.float32, gen)
    with pytest.raises(ValueError, match="1..64"):
        kda.fused_kda_step(**{**inp, **{n: inp[n].repeat(40, 1) for n in "qkvfzb"}}, lower_bound=LB)
    with pytest.raises(ValueError, match="block_v"):
        kda.fused_kda_step(**inp, lower_bound=LB, block_v=3)
    with pytest.raises(ValueError, match="b must be"):
        kda.fused_kda_step(**{**inp, "b": inp["b"][:, :1]}, lower_bound=LB)
    with pytest.raises(ValueError, match="needs z"):
        kda.fused_kda_step(**{**inp, "z": None}, lower_bound=LB)


SM90_PRELUDE = """
import os, re, subprocess, tempfile, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

def build(fn, types, consts, num_warps=4, pdl=False, divisible=()):
    # as the JIT specializes a launch: pointers (torch's allocations are 16-byte aligned) and the integer
    # arguments named in `divisible` (sizes and strides that are multiples of 16 at the model's shapes) get
    # tt.divisibility 16, without which loads stay scalar and loops unpipelined
    consts = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **consts}
    sig = {n: types.get(n) or ("constexpr" if n in consts else "i32") for n in fn.arg_names}
    cx = {(fn.arg_names.index(n),): v for n, v in consts.items()}
    div = [n for n in fn.arg_names if sig[n].startswith("*") or n in divisible]
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in div}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=num_warps, launch_pdl=pdl))
    path = tempfile.mktemp(suffix=".cubin")
    open(path, "wb").write(k.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    code = [line for line in sass.splitlines() if re.match(r"\\s+/\\*[0-9a-f]{4,}\\*/", line)]
    print(fn.__name__, consts, [line.strip() for line in usage.splitlines() if "REG:" in line][0],
          f"SASS:{len(code)} BAR:{sum(' BAR.' in line for line in code)} SMEM:{k.metadata.shared}")
"""


def compile_for_sm90(body: str) -> list[str]:
    """Compile kernels for the H200 (sm_90) without a GPU, in a process without TRITON_INTERPRET: the
    interpreter does not type-check, so this is what catches code only the GPU compiler rejects. Returns
    one line per kernel: resource usage (registers, stack = spills), then its SASS instruction count, CTA
    barriers and shared memory in bytes (`pytest tests/kernels -k compile -s` prints them: a cheap screen
    before spending device time)."""
    ptxas = os.path.join(os.path.dirname(pytest.importorskip("triton").__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton wheel has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", SM90_PRELUDE + textwrap.dedent(body)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    print(run.stdout, end="")  # shown with -s
    return run.stdout.strip().splitlines()


def test_kernels_compile_for_h200_without_spills():
    lines = compile_for_sm90("""
        from lingls.kernels import kda
        ptrs = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", f_ptr="*bf16", b_ptr="*bf16", z_ptr="*bf16",
                    conv_ptr="*bf16", conv_w_ptr="*bf16", a_log_ptr="*fp32", dt_bias_ptr="*fp32",
                    norm_w_ptr="*bf16", state_ptr="*fp32", o_acc_ptr="*fp32", count_ptr="*i32",
                    stage_state_ptr="*fp32", q_scale="fp32", lower_bound="fp32", eps="fp32")
        for t, stage, norm, pdl in ((1, False, True, True), (9, True, True, True), (16, True, True, False),
                                    (4, False, False, False)):
            types = dict(ptrs, out_ptr="*bf16" if norm else "*fp32", stage_conv_ptr="*bf16" if stage else "*fp32")
            for heads in (8, 16):  # the shipped settings of the TP=4 and TP=2 shards
                bv, warps = kda.config_for(t, heads)
                consts = dict(T=t, H=heads, D=128, BV=bv, BT=triton.next_power_of_2(t), STAGE=stage, NORM=norm,
                              USE_PDL=pdl)
                build(kda._kda_step_kernel, types, consts, warps, pdl, divisible=("s_out",))
        build(kda._commit_kernel, dict(index_ptr="*i64", state_ptr="*fp32", stage_ptr="*fp32", live_conv="*bf16",
              staged_conv="*bf16"), dict(H=8, D=128, BV=16, T_STAGE=9, BLOCK=1024, USE_PDL=True), 4, True)
    """)
    assert len(lines) == 9
    for line in lines:
        assert "STACK:0 " in line and "LOCAL:0 " in line, line  # the shipped settings must not spill


def test_launch_settings_are_kept_per_width():
    """Tuned settings per heads (or expert rows) per rank, then per token count; an untuned width takes the
    nearest tuned one (TP=2 and TP=4 shards of one model launch differently)."""
    table = {8: {1: "tp4 decode", 16: "tp4 verify"}, 16: {1: "tp2 decode", 16: "tp2 verify"}}
    assert by_width_and_tokens(table, 8, 1) == "tp4 decode" and by_width_and_tokens(table, 16, 9) == "tp2 verify"
    assert by_width_and_tokens(table, 11, 1) == "tp4 decode" and by_width_and_tokens(table, 32, 40) == "tp2 verify"
