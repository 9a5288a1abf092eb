"""The training tools around the model: fla's bounded autotuning and its check, and the CPU evaluation's
stateful completer (checked against the batched evaluation it stands in for) and its confidence-gate report."""

import math

import pytest
import torch

from lingls.kernels import reference as ref
from lingls.model import LingConfig, LingForCausalLM, ling
from training import fla_kernels
from training.evaluate import Case, ModelCompleter
from training.heldout_cpu import StatefulCompleter, gated


def test_pick_configs_keeps_one_per_block_size_nearest_4_warps_2_stages():
    triton = pytest.importorskip("triton")
    configs = [triton.Config({"BK": bk}, num_warps=w, num_stages=s) for bk in (32, 64) for w in (1, 2, 4, 8)
               for s in (2, 3, 4)]
    picked = fla_kernels.pick_configs(configs, 3)
    assert len(picked) == 3
    assert [(c.kwargs["BK"], c.num_warps, c.num_stages) for c in picked[:2]] == [(32, 4, 2), (64, 4, 2)]
    assert picked[2].num_warps == 4 and picked[2].num_stages == 3
    assert fla_kernels.pick_configs(configs[:1], 3) == configs[:1]


def test_fla_check_passes_an_exact_stand_in_and_fails_a_wrong_one(monkeypatch):
    def exact(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        return ref.kda_recurrent(q, k, v, g, beta, initial_state)

    def no_decay(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel):
        return ref.kda_recurrent(q, k, v, g * 0, beta, initial_state)

    monkeypatch.setattr(ling, "_FLA", [exact])
    good = fla_kernels.check_against_torch(device="cpu", batch=1, tokens=32, heads=2, dim=16)
    assert good["ok"] and max(good["relative_errors"].values()) < 1e-4
    monkeypatch.setattr(ling, "_FLA", [no_decay])
    assert not fla_kernels.check_against_torch(device="cpu", batch=1, tokens=32, heads=2, dim=16)["ok"]


def test_enable_false_leaves_the_torch_forms(monkeypatch):
    monkeypatch.setattr(ling, "_FLA", [])
    assert fla_kernels.enable(False) is False
    assert ling.fla_chunk_kda() is None


@pytest.mark.parametrize("mode", ["spm", "prefix"])
def test_stateful_completer_matches_the_batched_one(tokenizer, mode):
    cfg = LingConfig.from_dict(dict(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
        head_dim=16, layer_group_size=3, first_k_dense_replace=1, intermediate_size=48, moe_intermediate_size=16,
        num_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=16, num_nextn_predict_layers=0))
    model = LingForCausalLM(cfg)
    model.init_weights(0.5, generator=torch.Generator().manual_seed(0))
    model.eval()
    text = "import os\n\n\ndef main(argv):\n    for name in argv:\n        print(os.path.join(name, 'x'))\n" * 6
    cases = [Case("a.py", "line_start", 1, 1, text[:n], text[n:], "") for n in (30, 300)]
    batched = ModelCompleter(model, tokenizer, "cpu", mode, max_new_tokens=6).complete_all(cases)
    completer = StatefulCompleter(model, tokenizer, "cpu", mode, max_new_tokens=6)
    stateful = completer.complete_all(cases)
    assert stateful == batched
    assert any(batched)
    assert len(completer.line_logprobs) == len(cases) and all(lp < 0 for lp in completer.line_logprobs)


def test_the_gate_report_counts_shown_right_and_wrong():
    cases = [Case("a.py", "mid_line", 1, 1, "", "", t) for t in ("a", "b", "c")]
    cases.append(Case("a.py", "arg_list", 1, 1, "", "", "d"))
    report = gated(cases, ["a", "x", "", "d"], [math.log(0.5), math.log(0.2), 0.0, math.log(0.1)], [0.3])
    lines = report["next_line"]
    assert lines["0.0"] == {"shown": 0.6667, "shown_right": 0.3333, "shown_wrong": 0.3333,
                            "exact_match_of_shown": 0.5, "edit_similarity_of_shown": 0.5}  # an empty line: not shown
    assert lines["0.3"] == {"shown": 0.3333, "shown_right": 0.3333, "shown_wrong": 0.0,
                            "exact_match_of_shown": 1.0, "edit_similarity_of_shown": 1.0}
    assert report["fim"]["0.0"]["shown_right"] == 1.0 and report["fim"]["0.3"]["shown"] == 0.0


def test_the_training_takes_the_benchmarks_final_choice_or_its_best_so_far(tmp_path):
    """`reproduce.wait_for_choice`: a finished benchmark's choice at once (also a record without `final`, as
    earlier runs wrote them); a benchmark still running (`final` false) is waited for, and when it does not finish
    in time its best form so far is taken; no file at all leaves the torch form ({})."""
    import json
    import time

    from training.reproduce import wait_for_choice

    path = tmp_path / "choice.json"
    assert wait_for_choice(path, 0.2) == {}
    path.write_text(json.dumps({"choice": {"batch": 64, "compile": True}}))
    assert wait_for_choice(path, 5.0) == {"batch": 64, "compile": True}
    path.write_text(json.dumps({"choice": {"batch": 64, "kernel_route": False}, "final": False}))
    t = time.time()
    assert wait_for_choice(path, 1.5) == {"batch": 64, "kernel_route": False}
    assert time.time() - t >= 1.5


def test_ship_packs_the_weights_and_copies_the_results(tmp_path):
    import json

    from lingls.model import load_model, save_checkpoint
    from training.card import segments
    from training.ship import MODEL_FILES, ship

    run, assets, results = tmp_path / "run", tmp_path / "assets", tmp_path / "results"
    model_dir, res = run / "ling-nano", run / "results"
    res.mkdir(parents=True)
    results.mkdir()
    cfg = LingConfig.from_dict(dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    head_dim=16, layer_group_size=2, kv_lora_rank=16, qk_nope_head_dim=8,
                                    qk_rope_head_dim=8, v_head_dim=16, intermediate_size=48,
                                    moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, n_group=2,
                                    topk_group=1))
    model = LingForCausalLM(cfg).eval()
    model.init_weights()
    save_checkpoint(model, model_dir)
    for name in MODEL_FILES[1:-1]:
        (model_dir / name).write_text("{}")
    log = [{"step": 1, "tokens": 10, "seconds": 1.0, "lr": 1e-3}, {"step": 2, "tokens": 20, "seconds": 2.0,
                                                                     "peak_lr": 2e-3, "final": True},
           {"step": 3, "tokens": 50, "seconds": 5.0, "lr": 4e-4}, {"step": 4, "tokens": 60, "seconds": 6.0,
                                                                     "final": True}]
    (res / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    (res / "nano_eval.json").write_text("{}")
    (assets / "stale").mkdir(parents=True)  # what the model before shipped goes
    ship(run, assets, results)
    assert sorted(p.name for p in assets.iterdir()) == sorted([*MODEL_FILES[:-1], "model.safetensors.zlib"])
    a, b = load_model(assets).state_dict(), load_model(model_dir).state_dict()  # the run's own file stays plain
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((results / "nano_train_log.json").read_text()) == log
    assert (results / "nano_eval.json").is_file()
    # the card's segments: the recorded peak rate, else the highest logged one
    assert segments(res / "train_log.jsonl") == [{"seconds": 2.0, "tokens": 20, "lr": 2e-3},
                                                {"seconds": 4.0, "tokens": 40, "lr": 4e-4}]
