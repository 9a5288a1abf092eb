"""Loading: official and transformers names, shards, dtypes, tensor-parallel slices, and clear errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lingls.model import CheckpointError, load_model, save_checkpoint
from lingls.model.ling import LingForCausalLM, Parallel
from lingls.model.loader import official_state_dict
from lingls.model.random_checkpoint import write_random_checkpoint

from .conftest import randomize, small_config


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


@pytest.fixture
def model():
    torch.manual_seed(0)
    m = LingForCausalLM(small_config(num_nextn_predict_layers=1))
    m.init_weights()
    randomize(m, 0)
    return m.eval()


def ids():
    return torch.randint(0, 96, (25,), generator=torch.Generator().manual_seed(1))


def test_save_then_load_in_shards_with_index(tmp_path, model):
    save_checkpoint(model, tmp_path, dtype=torch.float32, max_shard_bytes=40_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert "model.layers.4.eh_proj.weight" in index["weight_map"]  # the MTP layer, official name
    assert "model.layers.2.mlp.experts.7.down_proj.weight" in index["weight_map"]
    loaded = load_model(tmp_path)
    assert (loaded.logits(ids()) - model.logits(ids())).abs().max().item() == 0.0


def test_bf16_load_keeps_decay_and_bias_in_fp32(tmp_path, model):
    save_checkpoint(model, tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    assert tensors["model.layers.0.attention.A_log"].dtype == torch.float32
    assert tensors["model.layers.2.mlp.gate.expert_bias"].dtype == torch.float32
    assert tensors["model.layers.0.attention.q_proj.weight"].dtype == torch.bfloat16
    loaded = load_model(tmp_path, dtype=torch.bfloat16)
    params = dict(loaded.named_parameters())
    assert params["model.layers.0.attention.dt_bias"].dtype == torch.float32
    assert params["model.layers.0.attention.q_proj.weight"].dtype == torch.bfloat16


def test_transformers_in_memory_names_are_accepted(tmp_path, model):
    """Packed convs and experts, forget_gate.*, self_attn, o_proj, embed_tokens, e_score_correction_bias."""
    official = official_state_dict(model, torch.float32)
    renamed = {}
    for name, t in official.items():
        if any(f".{w}_conv1d." in name for w in "kv"):
            continue
        if ".q_conv1d." in name:
            parts = [official[name.replace(".q_conv1d.", f".{w}_conv1d.")] for w in "qkv"]
            renamed[name.replace(".q_conv1d.", ".conv1d.")] = torch.cat(parts)
            continue
        if ".mlp.experts." in name:
            continue
        new = (name.replace("model.word_embeddings.", "model.embed_tokens.").replace(".attention.", ".self_attn.")
               .replace(".self_attn.dense.", ".self_attn.o_proj.").replace("expert_bias", "e_score_correction_bias"))
        for leaf in (".f_proj.", ".A_log", ".dt_bias"):
            new = new.replace(f".self_attn{leaf}", f".self_attn.forget_gate{leaf}")
        renamed[new] = t
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "experts"):
            renamed[f"model.layers.{i}.mlp.experts.gate_up_proj"] = layer.mlp.experts.gate_up_proj.clone()
            renamed[f"model.layers.{i}.mlp.experts.down_proj"] = layer.mlp.experts.down_proj.clone()
    save_file(renamed, tmp_path / "model.safetensors")
    model.config.save(tmp_path / "config.json")
    loaded = load_model(tmp_path)
    assert (loaded.logits(ids()) - model.logits(ids())).abs().max().item() == 0.0


@pytest.mark.parametrize("size", [2, 4])
def test_tensor_parallel_slices_are_the_right_parts(tmp_path, model, size):
    save_checkpoint(model, tmp_path, dtype=torch.float32)
    shards = [load_model(tmp_path, par=Parallel(rank=r, size=size)) for r in range(size)]
    full = dict(model.named_parameters())
    for name, p in shards[0].named_parameters():
        parts = [dict(s.named_parameters())[name] for s in shards]
        if p.shape == full[name].shape:
            assert all(torch.equal(q, full[name]) for q in parts), name
        elif name.endswith("experts.gate_up_proj"):  # each rank stacks its gate rows, then its up rows
            gates, ups = zip(*(q.chunk(2, dim=1) for q in parts))
            assert torch.equal(torch.cat(gates + ups, 1), full[name]), name
        else:
            dim = next(d for d in range(p.dim()) if p.shape[d] != full[name].shape[d])
            assert torch.equal(torch.cat(parts, dim), full[name]), name


def test_random_checkpoint_generator_writes_the_official_layout(tmp_path):
    cfg = small_config(num_nextn_predict_layers=1)
    write_random_checkpoint(cfg, tmp_path, seed=3, max_shard_bytes=30_000)
    assert (tmp_path / "model.safetensors.index.json").exists()
    m = load_model(tmp_path, dtype=torch.bfloat16)
    assert torch.isfinite(m.logits(ids())).all()


def _broken(tmp_path, model, edit):
    save_checkpoint(model, tmp_path, dtype=torch.float32)
    tensors = load_file(tmp_path / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")


def test_missing_tensor_is_named(tmp_path, model):
    _broken(tmp_path, model, lambda t: t.pop("model.layers.1.attention.kv_b_proj.weight"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.attention\.kv_b_proj\.weight is missing"):
        load_model(tmp_path)


def test_unexpected_tensor_is_named(tmp_path, model):
    _broken(tmp_path, model, lambda t: t.__setitem__("model.layers.0.attention.surprise", torch.zeros(2)))
    with pytest.raises(CheckpointError, match="unexpected tensor model.layers.0.attention.surprise"):
        load_model(tmp_path)


def test_misshaped_tensor_is_named(tmp_path, model):
    _broken(tmp_path, model, lambda t: t.__setitem__("lm_head.weight", torch.zeros(95, 32)))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight has shape \[95, 32\]"):
        load_model(tmp_path)


def test_directory_without_safetensors_is_refused_and_no_code_runs(tmp_path, model):
    model.config.save(tmp_path / "config.json")
    torch.save({}, tmp_path / "pytorch_model.bin")
    (tmp_path / "modeling_ling.py").write_text("raise SystemExit('code from the model directory ran')\n")
    with pytest.raises(CheckpointError, match="only safetensors"):
        load_model(tmp_path)


def test_index_naming_a_missing_shard(tmp_path, model):
    save_checkpoint(model, tmp_path, dtype=torch.float32, max_shard_bytes=40_000)
    next(tmp_path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="do not exist"):
        load_model(tmp_path)


def test_progress_is_reported_up_to_the_total(tmp_path, model):
    save_checkpoint(model, tmp_path, dtype=torch.float32)
    seen = []
    load_model(tmp_path, progress=lambda done, total: seen.append((done, total)))
    assert seen[0][0] == 0 and seen[-1][0] == seen[-1][1] > 0
    assert all(a[0] <= b[0] for a, b in zip(seen, seen[1:]))


def test_weightless_checkpoint_builds_the_same_random_shards_on_every_rank(tmp_path):
    """A benchmark checkpoint without tensors: each rank's shard is `random_model`'s, the tensors every rank holds
    whole agree across ranks, and its synthetic tokenizer covers the vocabulary word by word."""
    from lingls.engine.local import check_model_dir
    from lingls.engine.tokenizer import Tokenizer
    from lingls.model.loader import random_model
    from lingls.model.random_checkpoint import write_weightless_checkpoint

    cfg = small_config(num_nextn_predict_layers=1)
    d = write_weightless_checkpoint(cfg, tmp_path / "wl", seed=3)
    check_model_dir(d)
    whole = load_model(d)
    want = random_model(cfg, seed=3, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), want.state_dict().values()))
    ranks = [dict(load_model(d, par=Parallel(r, 2)).named_parameters()) for r in range(2)]
    for name, p in ranks[0].items():
        if p.shape == dict(whole.named_parameters())[name].shape:  # held whole by every rank
            assert torch.equal(p, ranks[1][name]), name
    tok = Tokenizer(d)
    assert tok.vocab_size == cfg.vocab_size and tok.encode("t5 t95 t0") == [5, 95, 0]


@pytest.mark.parametrize("damage", ["truncated", "empty", "header_length", "header_dtype"])
def test_a_broken_safetensors_file_is_a_checkpoint_error_naming_it(tmp_path, model, damage):
    save_checkpoint(model, tmp_path, dtype=torch.float32)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    header = int.from_bytes(data[:8], "little")
    data = {"truncated": data[: len(data) // 2], "empty": b"",
            "header_length": (1 << 60).to_bytes(8, "little") + data[8:],
            "header_dtype": data[:8] + data[8:8 + header].replace(b'"F32"', b'"XYZ"', 1) + data[8 + header:]}[damage]
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated, or not a safetensors file"):
        load_model(tmp_path)


@pytest.mark.parametrize("change, key", [({"num_hidden_layers": 200, "layer_group_size": 2}, "num_hidden_layers: 200"),
                                         ({"num_experts": 4096, "n_group": 8}, "num_experts: 4096")])
def test_a_config_larger_than_its_checkpoint_is_refused_before_any_model_is_built(tmp_path, model, monkeypatch,
                                                                                   change, key):
    import lingls.model.loader as loader

    save_checkpoint(model, tmp_path, dtype=torch.float32)
    raw = json.loads((tmp_path / "config.json").read_text())
    if "num_hidden_layers" in change:
        raw.pop("layer_types"), raw.pop("mlp_layer_types")
    raw.update(change)
    (tmp_path / "config.json").write_text(json.dumps(raw))

    def no_model(*args, **kwargs):
        raise AssertionError("a model was built for a config its checkpoint does not hold")

    monkeypatch.setattr(loader, "LingForCausalLM", no_model)
    with pytest.raises(CheckpointError, match=f"{key}.*does config.json belong to this checkpoint"):
        load_model(tmp_path)
