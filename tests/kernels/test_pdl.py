"""Where the kernels let the next one launch under programmatic dependent launch (lingls.kernels.pdl)."""

import pytest

pytest.importorskip("triton")  # GPU-only dependency: the PTX check compiles for sm_90 without a GPU

from lingls.kernels import pdl  # noqa: E402
from tests.kernels.test_kda import compile_for_sm90  # noqa: E402


def test_policy_triggers_early_only_where_it_is_safe_and_measured(monkeypatch):
    assert pdl.mode(False, "gemv", 1) == pdl.OFF
    assert pdl.mode(True, "gemv", 1) == pdl.EARLY
    assert pdl.mode(True, "gemv", 9) == pdl.LATE  # verify steps: EARLY was slower on the H200
    monkeypatch.setattr(pdl, "EARLY_KINDS", pdl.EARLY_KINDS | {"route", "gate_up"})
    # whatever a policy says: their successors read the routing (or x) before waiting
    assert pdl.mode(True, "route", 1) == pdl.LATE and pdl.mode(True, "gate_up", 1) == pdl.LATE
    monkeypatch.setattr(pdl, "EARLY_KINDS", set())
    assert pdl.mode(True, "gemv", 1) == pdl.LATE


def test_early_lets_the_next_kernel_launch_before_the_wait():
    """The PTX order of `griddepcontrol.launch_dependents` and `griddepcontrol.wait` in the RMSNorm kernel."""
    lines = compile_for_sm90("""
        from triton.compiler import ASTSource
        from lingls.kernels import norm
        fn = norm._add_rms_norm_kernel
        for use_pdl in (1, 2):
            consts = dict(BLOCK=256, HAS_RESIDUAL=True, USE_PDL=use_pdl)
            sig = {n: "constexpr" if n in consts else ("*bf16" if n.endswith("_ptr") else
                                                       "fp32" if n == "eps" else "i32") for n in fn.arg_names}
            cx = {(fn.arg_names.index(n),): v for n, v in consts.items()}
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                               options=dict(num_warps=8, launch_pdl=True))
            order = [w for line in k.asm["ptx"].splitlines() for w in ("launch_dependents", "wait")
                     if f"griddepcontrol.{w}" in line]
            print(use_pdl, " ".join(order))
    """)
    assert lines == ["1 wait launch_dependents", "2 launch_dependents wait"]
