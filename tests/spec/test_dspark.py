"""DSpark (`lingls.model.dspark`, `speculative.DSparkRuntime`) against a plain reference written from the formulas
of docs/dspark.md, on random checkpoints in the published layout (MHA and GQA, B = 8, non-unit q/k norms, the
confidence head and the embed_tokens / lm_head copies present, sharded with an index and `model.`-prefixed)."""

from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from lingls.model.config import flash_config
from lingls.model.dspark import IGNORED_COPIES, DSparkConfig, DSparkConfigError, checkpoint_tensors, load_dspark
from lingls.model.random_checkpoint import main as random_checkpoint_main
from lingls.runtime.runner import ModelRunner, Sampling
from lingls.runtime.spec.round import DSparkRuntime, Speculator, attach, make_drafter
from training.draft.distill import teacher

from ..kernels.test_kda import compile_for_sm90
from ..runtime.test_runner import no_host_reads
from .conftest import dspark_dir, plain, random_model

B = 8
KERNELS = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" or importlib.util.find_spec("triton") is None,
                             reason="the kernels' CPU check needs Triton's interpreter (TRITON_INTERPRET=1)")
PROMPT = [5, 6, 7, 8, 5, 6, 7, 900, 901, 5, 6, 7, 1000, 1001, 1002, 5, 6, 7]


# ---- the plain reference ------------------------------------------------------------------------------------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rot(x, pos, theta):
    """NeoX RoPE: x [T, H, D] at positions pos [T]; the first half of each head rotates with the second."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    ang = pos.double()[:, None, None] * inv
    c, s = ang.cos().float(), ang.sin().float()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, b * c + a * s], -1)


def reference(w: dict, cfg: DSparkConfig, embed, lm_head, feats, anchor: int):
    """The block logits [B, V] of [anchor, mask x (B-1)] at positions P..P+B-1 over context features feats
    [P, n * hidden], and the greedy drafts (Markov head, left to right from the anchor), from the checkpoint's
    tensors `w` by name."""
    eps, h, kvh, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    p = feats.shape[0]
    ctx = _rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    x = embed[[anchor] + [cfg.mask_token_id] * (cfg.block_size - 1)].clone()
    pos_ctx, pos_blk = torch.arange(p), torch.arange(p, p + cfg.block_size)
    for i in range(cfg.num_hidden_layers):
        lw = {n.split(".", 2)[2]: t for n, t in w.items() if n.startswith(f"layers.{i}.")}
        qn, kn = lw["self_attn.q_norm.weight"], lw["self_attn.k_norm.weight"]

        def norm(t, wt):
            return _rms(t, wt, eps)
        u = _rms(x, lw["input_layernorm.weight"], eps)
        q = _rot(norm((u @ lw["self_attn.q_proj.weight"].T).view(-1, h, d), qn), pos_blk, cfg.rope_theta)

        def keys(rows, pos):
            return _rot(norm((rows @ lw["self_attn.k_proj.weight"].T).view(-1, kvh, d), kn), pos, cfg.rope_theta)

        k = torch.cat([keys(ctx, pos_ctx), keys(u, pos_blk)]).repeat_interleave(h // kvh, 1)
        v = torch.cat([ctx, u]) @ lw["self_attn.v_proj.weight"].T
        v = v.view(-1, kvh, d).repeat_interleave(h // kvh, 1)
        att = (torch.einsum("bhd,shd->hbs", q, k) / math.sqrt(d)).softmax(-1)
        x = x + torch.einsum("hbs,shd->bhd", att, v).reshape(cfg.block_size, h * d) @ lw["self_attn.o_proj.weight"].T
        u = _rms(x, lw["post_attention_layernorm.weight"], eps)
        gate, up = u @ lw["mlp.gate_proj.weight"].T, u @ lw["mlp.up_proj.weight"].T
        x = x + (torch.nn.functional.silu(gate) * up) @ lw["mlp.down_proj.weight"].T
    logits = _rms(x, w["norm.weight"], eps) @ lm_head.T
    prev, drafts = anchor, []
    for i in range(cfg.block_size):
        prev = int((logits[i] + w["markov_head.markov_w2.weight"] @ w["markov_head.markov_w1.weight"][prev]).argmax())
        drafts.append(prev)
    return logits, drafts


def read_tensors(path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update({n.removeprefix("model."): t.float() for n, t in load_file(str(f)).items()})
    return out


# ---- fixtures -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny):
    """MHA and GQA checkpoints for the tiny target; the GQA one sharded (index) with `model.` names."""
    root = tmp_path_factory.mktemp("dspark")
    gqa = root / "gqa"
    cfg = DSparkConfig.for_target(tiny.config, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, intermediate_size=96, markov_rank=16)
    from lingls.model.random_checkpoint import write_random_dspark

    write_random_dspark(cfg, gqa, dtype=torch.float32, std=0.2, prefix="model.", max_shard_bytes=200_000)
    mha = dspark_dir(tiny, root / "mha", num_attention_heads=2, num_key_value_heads=2, head_dim=32)
    return {"mha": mha, "gqa": gqa}


def runtime(model, path, k=B, capacity=128, kernels=None):
    runner = ModelRunner(model, capacity=capacity)
    return DSparkRuntime(model, load_dspark(path, model.config), k, capacity, runner, kernels=kernels)


def features(model, ids, layers):
    with torch.no_grad():
        return teacher(model, torch.tensor([ids]), layers)[0][0]


def check_against_reference(model, path, w, cfg, kernels=None):
    p = len(PROMPT)
    feats = features(model, PROMPT, cfg.target_layer_ids)
    anchor = 321
    want_logits, want_drafts = reference(w, cfg, model.model.word_embeddings.weight.detach(),
                                         model.lm_head.weight.detach(), feats, anchor)
    rt = runtime(model, path, kernels=kernels)
    with torch.no_grad():
        # context rows past P (rejected drafts of an earlier round) hold noise: they must be masked
        rt.prefill(None, torch.randn(4, feats.shape[1]) * 5, None, torch.arange(p, p + 4), p)
        rt.prefill(None, feats, None, torch.arange(p), 0)
        cur, pos = torch.tensor([anchor]), torch.tensor([p])
        got = rt.block_logits(cur, pos, kv_len=p + 4)
        drafts, q = rt.propose(cur, pos, p + 4)
    assert q is None
    assert (got - want_logits).abs().max() < 1e-4 * max(1.0, want_logits.abs().max())
    assert drafts.tolist() == want_drafts
    for k in (1, 3):  # K < B: the first K drafts of the full block
        short = runtime(model, path, k=k, kernels=kernels)
        short.prefill(None, feats, None, torch.arange(p), 0)
        with torch.no_grad():
            assert short.propose(cur, pos, p + 4)[0].tolist() == want_drafts[:k]
    return rt, feats


# ---- the math -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["mha", "gqa"])
def test_block_logits_and_greedy_drafts_equal_the_reference(tiny, dirs, variant):
    path = dirs[variant]
    cfg = DSparkConfig.from_dict(json.loads((path / "config.json").read_text()))
    w = read_tensors(path)
    assert (variant == "gqa") == (cfg.num_key_value_heads < cfg.num_attention_heads)
    assert all(not torch.allclose(w[f"layers.0.self_attn.{n}_norm.weight"], torch.ones(cfg.head_dim)) for n in "qk")
    assert set(IGNORED_COPIES) <= set(w) and "confidence_head.proj.weight" in w
    check_against_reference(tiny, path, w, cfg)


@KERNELS
def test_the_kernels_round_equals_the_references(tmp_path):
    """The CUDA wiring (`lingls.kernels.dspark`'s q/k norm + RoPE + cache write, split-sequence attention and
    Markov choice; gemv; norm) under Triton's interpreter against the same round on the references: context
    rows absorbed, block logits, greedy drafts; and the Markov choice's tensor-parallel exchange message."""
    from lingls.kernels.dspark import markov_choose

    model = random_model(256, seed=3)
    path = dspark_dir(model, tmp_path / "d", num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    prompt = [t % 256 for t in PROMPT]
    feats = features(model, prompt, load_dspark(path, model.config).config.target_layer_ids)
    p = len(prompt)
    cur, pos = torch.tensor([201]), torch.tensor([p - 3])  # 3 rows of stale context past pos: masked
    got = {}
    for kernels in (False, True):
        rt = runtime(model, path, capacity=64, kernels=kernels)
        with torch.no_grad():
            rt.prefill(None, feats[:9], None, torch.arange(9), 0)
            rt.accept(None, feats[9:], None, None, torch.arange(9, p), p)
            ctx = rt.ctx_k[:, :p].clone(), rt.ctx_v[:, :p].clone()
            logits = rt.block_logits(cur, pos, 32)
            drafts, _ = rt.propose(cur, pos, 32)
        got[kernels] = (ctx, logits, drafts.clone())
    (ck, cv), logits, drafts = got[True]
    (rk, rv), want, want_drafts = got[False]
    assert (ck - rk).abs().max() < 1e-4 and (cv - rv).abs().max() < 1e-4
    assert (logits - want).abs().max() < 1e-4 * max(1.0, want.abs().max())
    assert drafts.tolist() == want_drafts.tolist()
    w1, w2 = rt.markov_w1, rt.markov_w2
    row = want[2:3]
    msg = markov_choose(row[:, 128:].contiguous(), drafts[1:2], w1, w2[128:].contiguous(), rank=1, ranks=2)
    local = row[:, 128:] + (w1[drafts[1]] @ w2[128:].t())
    assert msg[0, 0, 0] == 0 and msg[1, 0, 0] == 0
    assert int(msg[1, 1, 0]) == int(local.argmax()) + 128 and abs(float(msg[0, 1, 0]) - float(local.max())) < 1e-5


def test_every_tensor_is_used_except_the_ignored_ones(tiny, dirs):
    """Perturbing any loaded tensor but the confidence head changes the round's corrected logits; the loaded
    tensors are the file's."""
    path = dirs["gqa"]
    w = read_tensors(path)
    rt = runtime(tiny, path)
    p = len(PROMPT)
    feats = features(tiny, PROMPT, rt.drafter.config.target_layer_ids)
    prev = torch.tensor([321, 3, 4, 5, 6, 7, 8, 9])

    def corrected():
        with torch.no_grad():
            rt.prefill(None, feats, None, torch.arange(p), 0)
            return rt.block_logits(prev[:1], torch.tensor([p]), p) + rt.drafter.markov_bias(prev)

    base = corrected()
    params = dict(rt.drafter.named_parameters())
    assert set(params) | set(IGNORED_COPIES) == set(w)
    for name, t in params.items():
        assert torch.equal(t, w[name]), name
        if name.startswith("confidence_head."):
            continue
        with torch.no_grad():
            saved = t.clone()
            t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
            changed = not torch.allclose(corrected(), base, atol=1e-6)
            t.copy_(saved)
        assert changed, f"{name} does not affect the drafts"
    c = rt.drafter.confidence(torch.randn(3, tiny.config.hidden_size), torch.tensor([1, 2, 3]))
    assert c.shape == (3,) and bool(((c > 0) & (c < 1)).all())


def test_the_confidence_head_and_the_copies_are_optional(tiny, dirs, tmp_path):
    """Without the confidence head (config disabled) and without the embed/lm_head copies: the same drafts."""
    src = dirs["mha"]
    raw = json.loads((src / "config.json").read_text())
    raw["dflash_config"]["enable_confidence_head"] = False
    w = {n: t for n, t in read_tensors(src).items() if n not in IGNORED_COPIES and not n.startswith("confidence")}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(w, str(tmp_path / "model.safetensors"))
    cfg = DSparkConfig.from_dict(raw)
    check_against_reference(tiny, tmp_path, w, cfg)
    with_head = load_dspark(src, tiny.config).state_dict()
    without = load_dspark(tmp_path, tiny.config).state_dict()
    assert all(torch.equal(t, with_head[n]) for n, t in without.items())


def test_sampled_drafts_follow_the_corrected_distribution(tiny, dirs):
    """At temperature > 0 each draft is drawn from q_i = target_probs(logits_i + markov(d_{i-1})), the q handed
    to the rejection rule: over many seeds the first draft's frequencies match q_0, and every q_i is that
    formula at the sampled previous draft."""
    path = dirs["gqa"]
    rt = runtime(tiny, path, k=2)
    p = len(PROMPT)
    rt.prefill(None, features(tiny, PROMPT, rt.drafter.config.target_layer_ids), None, torch.arange(p), 0)
    cur, pos = torch.tensor([321]), torch.tensor([p])
    runner = rt.runner
    runner.temperature.fill_(1.5)
    runner.top_p.fill_(1.0)
    counts = torch.zeros(tiny.config.vocab_size)
    seeds = 800
    with torch.no_grad():
        logits = rt.block_logits(cur, pos, p)
        for s in range(seeds):
            runner.seed.fill_(s)
            drafts, q = rt.propose(cur, pos, p, greedy=False)
            counts[drafts[0]] += 1
            if s < 3:
                prev = torch.cat([cur, drafts[:-1]])
                want = ((logits[:2] + rt.drafter.markov_bias(prev)) / 1.5).softmax(-1)
                assert (q - want).abs().max() < 1e-5
    q0 = q[0]
    top = q0.argsort(descending=True)[:3]  # the likely tokens' frequencies within 5 sigma of q_0
    sigma = (q0[top] * (1 - q0[top]) / seeds).sqrt()
    assert ((counts[top] / seeds - q0[top]).abs() < 5 * sigma + 1e-3).all()


# ---- the runtime --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [None, 3])
@pytest.mark.parametrize("which", ["tiny", "nano"])
def test_speculative_greedy_equals_plain_greedy(nano, tiny, block_dirs, which, k):
    """k None: K = the block size (8), a 9-token verify window; k 3: the first 3 drafts of each block."""
    model = {"nano": nano, "tiny": tiny}[which]
    want = plain(model, PROMPT, 24 + 2 * (B + 1))
    for draft in (str(block_dirs[which]), f"lookup+{block_dirs[which]}"):
        runner = ModelRunner(model, capacity=256, prefill_chunk=8)
        spec = attach(runner, draft, k=k)
        assert spec.k == (k or B)
        assert list(runner.generate(PROMPT, 24)) == want[:24]
        assert spec.stats.rounds > 0


class PartlyRightDSpark(DSparkRuntime):
    """The DSpark round, its drafts then replaced by the plain greedy continuation for the first (pos % 4) slots
    and wrong after them: rounds accept 0..3 drafts, so the context rows of rejected positions get rewritten."""

    def __init__(self, model, path, want, start):
        super().__init__(model, load_dspark(path, model.config), B, 256, ModelRunner(model, capacity=256))
        table = torch.zeros(start + len(want) + B + 2, dtype=torch.long)
        table[start:start + len(want)] = torch.tensor(want)
        self.table, self.vocab_size = table, model.config.vocab_size

    def propose(self, cur, pos, kv_len, greedy=True):
        drafts, q = super().propose(cur, pos, kv_len, greedy)
        right = self.table.gather(0, (pos + 1 + self.slots).clamp(max=self.table.shape[0] - 1))
        return torch.where(self.slots < pos % 4, right, (right + 1) % self.vocab_size), q


def test_incremental_context_kv_equals_recomputation(tiny, dirs):
    """After a speculative generation (prefill in chunks, rounds accepting 0..3 drafts), the context KV rows of
    every consumed position equal the rows recomputed from one full forward over the consumed tokens."""
    want = plain(tiny, PROMPT, 30 + 2 * (B + 1))
    runner = ModelRunner(tiny, capacity=256, prefill_chunk=7)
    rt = PartlyRightDSpark(tiny, dirs["gqa"], want, len(PROMPT))
    spec = Speculator(runner, rt)
    assert list(runner.generate(PROMPT, 30)) == want[:30]
    assert 0 < spec.stats.accepted < spec.stats.drafted
    tokens = runner.cache.tokens
    with torch.no_grad():
        feats = features(tiny, tokens, rt.drafter.config.target_layer_ids)
        want_k, want_v = rt.drafter.context_kv(feats, torch.arange(len(tokens)))
    n = len(tokens)
    assert (rt.ctx_k[:, :n] - want_k).abs().max() < 1e-4
    assert (rt.ctx_v[:, :n] - want_v).abs().max() < 1e-4


def test_the_round_reads_nothing_from_the_device(tiny, block_dirs):
    runner = ModelRunner(tiny, capacity=256, prefill_chunk=16)
    attach(runner, f"lookup+{block_dirs['tiny']}", k=4)
    for sampling in (Sampling(), Sampling(temperature=0.8, top_p=0.9, seed=3)):
        runner.prefill(PROMPT, sampling)
        with no_host_reads():
            assert len(list(runner.decode(12, sampling.greedy))) == 12


def test_sampled_speculation_with_dspark_is_reproducible(tiny, block_dirs):
    s = Sampling(temperature=0.9, top_p=0.95, seed=5)
    outs = []
    for _ in range(2):
        runner = ModelRunner(tiny, capacity=256)
        attach(runner, str(block_dirs["tiny"]), k=4)
        outs.append(list(runner.generate(PROMPT, 20, s)))
    assert outs[0] == outs[1] and len(outs[0]) == 20


def test_speculative_sampling_with_dspark_samples_the_target_distribution():
    """A small-vocabulary target and a DSpark drafter sampling its own q: the first two tokens over many
    seeds follow the target's joint distribution (the rejection rule with the drafter's q)."""
    from .conftest import random_model
    from .test_sampling import chi_square_p

    v = 4
    model = random_model(v, seed=3, std=0.25)
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        path = dspark_dir(model, Path(tmp) / "d", block_size=4, std=0.5, markov_rank=4)
        runner = ModelRunner(model, capacity=64)
        spec = attach(runner, str(path), k=2)
    prompt = [1, 2, 3]
    with torch.no_grad():
        p1 = torch.softmax(model.logits(torch.tensor(prompt))[-1], -1)
        p2 = torch.stack([torch.softmax(model.logits(torch.tensor(prompt + [t]))[-1], -1) for t in range(v)])
    joint = (p1[:, None] * p2).flatten()
    counts = torch.zeros(v * v, dtype=torch.long)
    for s in range(500):
        a, b = runner.generate(prompt, 2, Sampling(temperature=1.0, top_p=1.0, seed=s))
        counts[a * v + b] += 1
    assert 0 < spec.stats.accepted < spec.stats.drafted
    assert chi_square_p(counts, joint) > 1e-3


# ---- loading and refusals -----------------------------------------------------------------------------------
def test_the_published_widths_make_the_cards_parameter_count():
    """At Ling-3.0-flash's widths (meta device): backbone + fc + norms + Markov + confidence head = 558,925,825;
    with the embed_tokens and lm_head copies (157184 x 2560 each) the card's 1,363,707,905."""
    cfg = DSparkConfig.for_target(flash_config(42))
    shapes = dict(checkpoint_tensors(cfg))
    total = sum(s.numel() for s in shapes.values())
    module = sum(s.numel() for n, s in shapes.items() if n not in IGNORED_COPIES)
    assert (module, total) == (558_925_825, 1_363_707_905)
    assert cfg.target_layer_ids == [1, 11, 23, 29, 35] and shapes["fc.weight"] == (2560, 12800)
    assert shapes["confidence_head.proj.weight"] == (1, 2816)
    assert shapes["markov_head.markov_w1.weight"] == shapes["markov_head.markov_w2.weight"] == (157184, 256)


def test_random_checkpoint_cli_writes_the_layout(tmp_path, tiny):
    from lingls.model import save_checkpoint

    target = tmp_path / "target"
    save_checkpoint(tiny, target, dtype=torch.float32)
    out = tmp_path / "draft"
    assert random_checkpoint_main([str(out), "--dspark", "--target", str(target), "--small", "--shard-gb", "0.0002",
                                   "--prefix", "model."]) == 0
    assert (out / "model.safetensors.index.json").is_file()
    names = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert all(n.startswith("model.") for n in names) and "model.lm_head.weight" in names
    d = load_dspark(out, tiny.config)
    assert d.config.block_size == B and d.confidence_head is not None
    weightless = tmp_path / "weightless"
    assert random_checkpoint_main([str(weightless), "--dspark", "--target", str(target), "--weightless"]) == 0
    assert not list(weightless.glob("*.safetensors"))
    w = load_dspark(weightless, tiny.config)
    assert w.config.num_attention_heads == 32 and w.config.intermediate_size == 6144  # the published widths


def _refused(tmp_path, tiny, src, edit=None, tensors=None) -> str:
    raw = json.loads((src / "config.json").read_text())
    if edit:
        edit(raw)
    bad = tmp_path / "bad"
    bad.mkdir(exist_ok=True)
    (bad / "config.json").write_text(json.dumps(raw))
    w = read_tensors(src)
    if tensors:
        tensors(w)
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(DSparkConfigError) as e:
        load_dspark(bad, tiny.config)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def _set(key, value, under="dflash_config"):
    def edit(raw):
        (raw[under] if under else raw)[key] = value
    return edit


@pytest.mark.parametrize("edit,names", [
    (_set("markov_head_type", "gated"), "markov_head_type"),
    (_set("attention_mode", "sliding"), "attention_mode"),
    (_set("layer_types", ["full_attention", "sliding_attention"], None), "layer_types"),
    (_set("use_sliding_window", True, None), "use_sliding_window"),
    (_set("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, None), "rope_scaling"),
    (_set("rope_parameters", {"rope_type": "yarn", "rope_theta": 1e6}, None), "rope_scaling"),
    (_set("speculators_config", {"algorithm": "dflash"}, None), "speculators"),
    (_set("architectures", ["DFlashDraftModel"], None), "architectures"),
    (_set("mask_token_id", 10**6), "mask_token_id"),
    (_set("mask_token_id", -1), "mask_token_id"),
    (_set("target_layer_ids", [0, 99]), "target_layer_ids"),
    (_set("hidden_size", 96, None), "hidden_size"),
    (_set("projector_type", "eagle3"), "projector_type"),
])
def test_refusals_name_the_key(tmp_path, tiny, dirs, edit, names):
    assert names in _refused(tmp_path, tiny, dirs["mha"], edit)


def test_refusals_of_tensors(tmp_path, tiny, dirs):
    src = dirs["mha"]
    assert "layers.1.self_attn.k_norm.weight is missing" in _refused(
        tmp_path, tiny, src, tensors=lambda w: w.pop("layers.1.self_attn.k_norm.weight"))
    assert "lm_head.weight has shape" in _refused(
        tmp_path, tiny, src, tensors=lambda w: w.update({"lm_head.weight": torch.zeros(3, 3)}))
    assert "unexpected tensor" in _refused(tmp_path, tiny, src,
                                           tensors=lambda w: w.update({"extra.weight": torch.zeros(1)}))


def test_top_level_keys_and_rope_parameters_are_read(tmp_path, tiny, dirs):
    """The drafter keys at the top level instead of under dflash_config, rope_theta under rope_parameters."""
    src = dirs["mha"]
    raw = json.loads((src / "config.json").read_text())
    raw.update(raw.pop("dflash_config"))
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw.pop("rope_theta")}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    save_file(read_tensors(src), str(tmp_path / "model.safetensors"))
    a, b = load_dspark(tmp_path, tiny.config), load_dspark(src, tiny.config)
    assert a.config == b.config


def test_draft_strings_that_are_not_drafters_are_refused(tiny, tmp_path):
    runner = ModelRunner(tiny, capacity=64)
    with pytest.raises(ValueError, match="not none, mtp, lookup or a drafter directory"):
        make_drafter(str(tmp_path), runner)
    with pytest.raises(ValueError, match="combine as lookup"):
        make_drafter("mtp+lookup", runner)


# ---- tensor parallelism -------------------------------------------------------------------------------------
def _tp_rank(rank: int, size: int, rendezvous: str, target_dir: str, draft_dir: str, feats_path: str, out: str):
    import os

    import torch.distributed as dist

    from lingls.model import load_model
    from lingls.serve.tensor_parallel import make_parallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=size)

    model = load_model(target_dir, par=make_parallel(rank, size))  # the runtime's collectives, on gloo
    got = _round_outputs(model, draft_dir, torch.load(feats_path))
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as tests/model/test_tensor_parallel.py: no interpreter teardown in the worker


def _round_outputs(model, draft_dir, feats) -> dict:
    """Block logits (gathered), greedy drafts, and sampled drafts with their q, of one round."""
    rt = DSparkRuntime(model, load_dspark(draft_dir, model.config, par=model.par), B, 64,
                       ModelRunner(model, capacity=64))
    p = feats.shape[0]
    cur, pos = torch.tensor([321]), torch.tensor([p])
    with torch.no_grad():
        rt.prefill(None, feats, None, torch.arange(p), 0)
        logits = model.par.all_gather_last(rt.block_logits(cur, pos, p))
        greedy, _ = rt.propose(cur, pos, p)
        rt.runner.temperature.fill_(1.3)
        rt.runner.seed.fill_(7)
        sampled, q = rt.propose(cur, pos, p, greedy=False)
    return {"logits": logits, "greedy": greedy, "sampled": sampled, "q": q}


def test_tensor_parallel_shards_draft_as_the_whole_drafter(tmp_path, tiny, dirs):
    """Two gloo ranks, each with its shard of the target (vocabulary) and of the drafter (heads, MLP, Markov
    head): the same block logits, greedy drafts and sampled drafts as the unsharded drafter."""
    import torch.multiprocessing as mp

    from lingls.model import save_checkpoint

    save_checkpoint(tiny, tmp_path / "target", dtype=torch.float32)
    draft = dirs["gqa"]
    layers = DSparkConfig.from_dict(json.loads((draft / "config.json").read_text())).target_layer_ids
    feats = features(tiny, PROMPT, layers)
    torch.save(feats, tmp_path / "feats.pt")
    out = tmp_path / "rank0.pt"
    mp.spawn(_tp_rank, args=(2, str(tmp_path / "rendezvous"), str(tmp_path / "target"), str(draft),
                             str(tmp_path / "feats.pt"), str(out)), nprocs=2, join=True)
    got, want = torch.load(out), _round_outputs(tiny, draft, feats)
    assert (got["logits"] - want["logits"]).abs().max() < 1e-4
    assert torch.equal(got["greedy"], want["greedy"]) and torch.equal(got["sampled"], want["sampled"])
    assert (got["q"] - want["q"]).abs().max() < 1e-5


def test_the_round_kernels_compile_for_h200_without_spills():
    """`lingls.kernels.dspark` at the TP=4 rank's shapes of Ling-3.0-flash-DSpark (8 heads x 128, rank 256,
    39,296 vocabulary rows), compiled for sm_90 here: what the interpreter does not type-check."""
    lines = compile_for_sm90("""
        from lingls.kernels import dspark
        build(dspark._qk_rope_kernel, dict(qkv_ptr="*bf16", qn_ptr="*bf16", kn_ptr="*bf16", freq_ptr="*fp32",
              pos_ptr="*i64", q_ptr="*bf16", ck_ptr="*bf16", cv_ptr="*bf16", eps="fp32"),
              dict(H=8, KVH=8, D=128), 1, divisible=("s_qkv", "s_cache"))
        build(dspark._qk_rope_kernel, dict(qkv_ptr="*bf16", qn_ptr="*bf16", kn_ptr="*bf16", freq_ptr="*fp32",
              pos_ptr="*i64", q_ptr="*bf16", ck_ptr="*bf16", cv_ptr="*bf16", eps="fp32"),
              dict(H=0, KVH=8, D=128), 1, divisible=("s_qkv", "s_cache"))
        for heads, split in ((8, 5), (0, 8)):  # the round's block; a verify's context rows
            build(dspark._qkv_rope_kernel, dict(x_desc="tensordesc<bf16[16, 128]>",
                  w_desc="tensordesc<bf16[128, 128]>", qn_ptr="*bf16", kn_ptr="*bf16", freq_ptr="*fp32",
                  pos_ptr="*i64", q_ptr="*bf16", ck_ptr="*bf16", cv_ptr="*bf16", part_ptr="*fp32", cnt_ptr="*i32",
                  eps="fp32"), dict(H=heads, KVH=8, D=128, BLOCK_K=128, K_ITERS=4, SPLIT=split, USE_PDL=1,
                  F32_DOT=False), 4, True, divisible=("K_PER", "s_cache"))
        build(dspark._attend_kernel, dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", pos_ptr="*i64",
              po_ptr="*fp32", pml_ptr="*fp32", scale_log2="fp32", then0_ptr="*bf16", then1_ptr="*bf16",
              then2_ptr="*bf16"), dict(B=8, H=8, G=1, D=128, ROWS=16, BLOCK_N=64, TILES=4, THEN0=256, THEN1=512,
              THEN2=256, F32_DOT=False), 4, divisible=("s_kv",))
        build(dspark._merge_kernel, dict(po_ptr="*fp32", pml_ptr="*fp32", o_ptr="*bf16"),
              dict(B=8, H=8, G=1, D=128, ROWS=16, SPLITS=33, SPLITS_PAD=64), 1)
        build(dspark._markov_choose_kernel, dict(logits_ptr="*bf16", prev_ptr="*i64", w1_ptr="*bf16",
              w2_ptr="*bf16", part_ptr="*i64", cnt_ptr="*i32", out_ptr="*i64", prev_out_ptr="*i64", offset="i64"),
              dict(R=256, BLOCK=64, NB=614, NB_PAD=1024, RANKS=1, PREV_MSG=False), 4)
        build(dspark._markov_choose_kernel, dict(logits_ptr="*bf16", prev_ptr="*fp32", w1_ptr="*bf16",
              w2_ptr="*bf16", part_ptr="*i64", cnt_ptr="*i32", out_ptr="*fp32", prev_out_ptr="*i64", offset="i64"),
              dict(R=256, BLOCK=64, NB=614, NB_PAD=1024, RANKS=4, PREV_MSG=True), 4)
    """)
    assert len(lines) == 8
    # the rope kernels' stack is libdevice's sin/cos range reduction for large angles, not spilled registers
    assert all("STACK:0" in line for line in lines if not line.startswith(("_qk_rope", "_qkv_rope"))), lines
    assert all("LOCAL:0" in line for line in lines), lines
