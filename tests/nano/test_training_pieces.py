"""CPU checks of the training pipeline's pieces (data split, FIM examples, baselines, n-gram, balancing)."""

import random

import pytest
import torch

from training import data
from training.baselines import NGramCompleter, repeat_previous_line
from training.evaluate import make_cases, postprocess, score
from training.fim import FimMix, build_examples, chunk_text, cut_suffix, encode_examples, line_middle, make_example
from training.ngram import NGramModel
from training.train import ExpertBalancer, PackedStream, TrainSettings, lr_at


def _tree(tmp_path, files: dict[str, str]):
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return [("site", tmp_path)]


def test_heldout_is_whole_packages_and_copies_of_them_leave_training(tmp_path, monkeypatch):
    monkeypatch.setattr(data, "HELDOUT_PACKAGE_BYTES", (100, 10_000))
    monkeypatch.setattr(data, "HELDOUT_BYTES", 3000)
    body = "def f(x):\n    return x + 1\n" * 5
    files = {f"pkg{i}/mod{j}.py": body.replace("f(x)", f"f{i}_{j}(x)") for i in range(40) for j in range(3)}
    held = data.heldout_packages([data.SourceFile(f"site/{n}", t) for n, t in files.items()], 3000)
    assert 1 <= len(held) < 40
    top = sorted(held)[0].split(":")[1]
    files["other/copy.py"] = files[f"{top}/mod0.py"] + "\n\n   \n"  # same content up to whitespace
    files["other/dup.py"] = files["pkg0/mod0.py"] if "site:pkg0" not in held else files["pkg1/mod0.py"]
    files[f"other/_vendor/{top}/mod9.py"] = "def vendored_but_edited(x):\n    return x + 2\n" * 3
    files["other/_vendor/kept.py"] = "def kept(x):\n    return x + 3\n" * 3
    files["other/big.py"] = "".join(f"X{i} = {i}\n" for i in range(2000))  # too big to be held out
    corpus = data.collect(10**9, _tree(tmp_path, files))
    train_names = {f.name for f in corpus.train}
    held_names = {f.name for f in corpus.heldout}
    assert set(corpus.stats["heldout_packages"]) == held
    # every file of a held-out package is held out, none of it trains
    assert held_names == {f"site/{n}" for n in files if f"site:{n.split('/')[0]}" in held}
    assert not held_names & train_names
    assert "site/other/copy.py" not in train_names and f"site/other/_vendor/{top}/mod9.py" not in train_names
    assert "site/other/_vendor/kept.py" in train_names
    assert corpus.stats["dropped_as_copy_of_heldout"] >= 1 and corpus.stats["dropped_as_duplicate"] >= 1
    assert corpus.stats["dropped_as_vendored_heldout_package"] == 1
    assert data.collect(10**9, _tree(tmp_path, files)).stats == corpus.stats  # deterministic


def test_files_spelling_special_tokens_are_skipped(tmp_path):
    corpus = data.collect(10**9, _tree(tmp_path, {"a.py": "x = '<|endoftext|>'\n" * 5, "b.py": "y = 2\n" * 20}))
    assert [f.name for f in corpus.train + corpus.heldout] == ["site/b.py"]


def test_chunks_keep_whole_lines():
    text = "".join(f"line {i}\n" for i in range(100))
    chunks = chunk_text(text, 50)
    assert "".join(chunks) == text and all(c.endswith("\n") and len(c) <= 50 for c in chunks)


def test_line_middle_ends_at_a_line_end():
    text = "a = 1\nbb = 2\n\nccc = 3\n"
    rng = random.Random(0)
    for _ in range(200):
        a, b = line_middle(text, rng)
        assert a < b and (b == len(text) or text[b] == "\n")  # never empty: a completion always writes something


def test_suffix_is_cut_at_whole_lines_as_the_prompt_cuts_it():
    suffix = "x)\n" + "".join(f"line {i}\n" for i in range(200))
    mix = FimMix()
    for seed in range(30):
        cut = cut_suffix(suffix, random.Random(seed), mix)
        assert suffix.startswith(cut) and cut.startswith("x)\n") and cut.endswith("\n")
        assert cut.count("\n") <= mix.suffix_lines[1] and len(cut) <= mix.suffix_chars


@pytest.mark.parametrize("seed", range(20))
def test_examples_follow_the_formats(seed):
    chunk = "import os\n\ndef main():\n    print(os.getcwd())\n"
    ex = make_example(chunk, "site/pkg/m.py", random.Random(seed), FimMix(context_rate=0.5, header_rate=0.3),
                      ("site/pkg/other.py", "X = 1\n"))
    assert ex[-1] == 0
    specials = [p for p in ex if isinstance(p, int)]
    body = specials[specials.count(4):]  # leading <|file_sep|> headers
    assert body in ([0], [1, 2, 3, 0], [2, 1, 3, 0])
    if 3 in ex:  # FIM: prefix + middle + suffix spell the chunk, or its start (the suffix keeps whole lines)
        text = {s: ex[ex.index(s) + 1] for s in (1, 2, 3)}
        joined = text[1] + text[3] + text[2]
        assert chunk.startswith(joined) and (joined == chunk or joined.endswith("\n"))
    else:
        assert ex[-2] == chunk
    if 4 in ex:
        assert ex[ex.index(4) + 1].startswith("pkg/")


def test_encoding_keeps_special_ids_and_text(tokenizer):
    files = [data.SourceFile(f"site/m{i}.py", f"def f{i}(a, b):\n    return a * {i} + b\n") for i in range(30)]
    examples = build_examples(files, seed=3)
    for ex, ids in zip(examples, encode_examples(tokenizer, examples)):
        text = "".join(p if isinstance(p, str) else f"<{p}>" for p in ex)
        decoded = "".join(tokenizer.decode([i]) if i >= 5 else f"<{i}>" for i in ids)
        assert decoded == text


def test_repeat_previous_line():
    assert repeat_previous_line("a = 1\n\n    foo(1)\n    ") == "foo(1)"
    assert repeat_previous_line("    foo(1, 2)\n    foo(") == "1, 2)"
    assert repeat_previous_line("x") == ""


def test_ngram_picks_most_frequent_continuation_and_backs_off():
    ids = torch.tensor([5, 6, 7, 5, 6, 8, 5, 6, 7, 9, 5, 6, 7])
    m = NGramModel.train(ids, 4, device="cpu")
    assert m.next_token([5, 6]) == 7
    assert m.next_token([6, 8, 5]) == 6
    assert m.next_token([1234]) == 5  # unseen: the most frequent token
    assert m.generate([9, 5], 3, lambda out: out[-1] == 9) == [6, 7, 5]


def test_ngram_completer_heals_a_cut_token(tokenizer):
    text = "    return value\n" * 50
    m = NGramModel.train(torch.tensor(tokenizer.encode(text).ids), 5, device="cpu")
    nl = {i for i in range(tokenizer.get_vocab_size()) if "\n" in tokenizer.decode([i])}
    c = NGramCompleter(m, tokenizer, nl, set(range(5)))
    assert c.complete("    return value\n    ") == "return value"
    # a cut inside " value" that leaves one partial token at the end of the context
    cut = next(k for k in range(2, 6) if tokenizer.decode(tokenizer.encode(" value"[:k]).ids[-1:]) == " value"[:k])
    assert c.complete("    return value\n    return" + " value"[:cut]) == " value"[cut:]


def test_cases_and_scores():
    files = [data.SourceFile("site/a.py", "import os\n\ndef f(x):\n    y = x + 1\n    return y\n")]
    cases = make_cases(files, 3, seed=0)
    assert {c.kind for c in cases} >= {"line_start", "mid_line"}
    for c in cases:
        line = files[0].text.split("\n")[c.line - 1]
        assert c.prefix.endswith(line[: c.column - 1]) and c.prefix + c.target + c.suffix == files[0].text
        if c.kind in ("line_start", "mid_line"):
            assert line.rstrip().endswith(c.target) and (c.suffix == "" or c.suffix.startswith("\n"))
    s = score(cases, [c.target for c in cases])
    assert s["all"]["exact_match"] == 1.0 and s["all"]["edit_similarity"] == 1.0
    assert score(cases, ["" for _ in cases])["all"]["exact_match"] == 0.0


def test_suffix_aware_cases_leave_the_typed_end_in_the_suffix():
    text = ("def area(width, height):\n    total = width * height\n    scaled = scale(total, factor=2)\n"
            "    print(total)\n    return scaled\n")
    cases = make_cases([data.SourceFile("site/g.py", text)], 0, seed=1, fim_per_kind=20)
    kinds = {c.kind for c in cases}
    assert kinds == {"block_middle", "arg_list", "line_end_typed"}
    for c in cases:
        assert c.prefix + c.target + c.suffix == text and c.target
        rest = c.suffix.split("\n", 1)[0]
        if c.kind == "arg_list":
            assert c.prefix[-1] in "([{" and rest[:1] in ")]}"
        if c.kind == "line_end_typed":
            assert rest and set(rest) <= set(")]}:,;'\"")
        if c.kind == "block_middle":
            assert rest == "" and c.prefix.endswith("\n    ")


def test_postprocessing_of_predictions_counts_degenerate_lines():
    text = "import os\n\ndef f(x):\n    y = x + 1\n    return y\n"
    cases = [c for c in make_cases([data.SourceFile("site/a.py", text)], 2, seed=0) if c.kind == "line_start"]
    shown, before, after = postprocess(cases, ["_run_run_run_run_run" for _ in cases])
    assert shown == ["" for _ in cases] and before == len(cases) and after == 0


def test_lr_schedule_warms_up_then_decays():
    s = TrainSettings(warmup=0.1, lr=1e-3, min_lr_ratio=0.1)
    assert 0 < lr_at(0.0, s) < lr_at(0.05, s) < lr_at(0.1, s) == pytest.approx(1e-3)
    assert lr_at(0.5, s) > lr_at(0.9, s) > lr_at(1.0, s) == pytest.approx(1e-4)


def test_packed_stream_windows():
    stream = torch.arange(1000)
    ps = PackedStream(stream, 10, seed=0)
    b = ps.batch(len(ps) + 5)  # crosses an epoch
    assert b.shape == (len(ps) + 5, 11) and torch.all(b[:, 1:] - b[:, :-1] == 1) and ps.epochs == 1


def test_balancer_moves_bias_towards_the_idle_experts():
    from lingls.model import LingConfig, LingForCausalLM

    cfg = LingConfig.from_dict({"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                                "head_dim": 16, "layer_group_size": 2, "first_k_dense_replace": 1,
                                "intermediate_size": 64, "moe_intermediate_size": 16, "num_experts": 8,
                                "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "kv_lora_rank": 16,
                                "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 16})
    model = LingForCausalLM(cfg)
    model.init_weights(0.02, generator=torch.Generator().manual_seed(0))
    bal = ExpertBalancer(model, rate=0.01)
    router = bal.routers[0]
    model(torch.randint(0, 64, (2, 16)))
    counts = bal.counts[0].clone()
    bal.update()
    assert torch.all((router.expert_bias > 0) == (counts < counts.mean()))
    bal.remove()


def test_the_evaluation_windows_the_suffix_in_whole_lines_as_lingls_does(tokenizer):
    from lingls.engine.protocol import FimTemplate
    from lingls.lsp.prompt import MAX_SUFFIX_LINES, TokenCounter, build_prompt
    from training.evaluate import ModelCompleter

    completer = ModelCompleter(None, tokenizer, "cpu", "spm", suffix_tokens=40)
    suffix = "x, y):\n" + "".join(f"    total_{i} = compute(value_{i})\n" for i in range(30))
    window = completer.suffix_window(suffix)
    assert suffix.startswith(window) and window.endswith("\n") and window.count("\n") >= 2
    cost = lambda text: sum(len(tokenizer.encode(x).ids) for x in text.splitlines(keepends=True))  # noqa: E731
    next_line = suffix[len(window):].split("\n")[0] + "\n"
    assert cost(window) <= 40 < cost(window + next_line)
    assert completer.suffix_window("a_line_far_longer_than_the_budget " * 20 + "\nnext\n") == ""
    short = "".join(f"{i}\n" for i in range(MAX_SUFFIX_LINES + 10))
    assert ModelCompleter(None, tokenizer, "cpu", "spm", suffix_tokens=10_000).suffix_window(short).count("\n") \
        == MAX_SUFFIX_LINES
    # the window lingls sends for the same cursor and suffix budget
    text = "def f(a, " + suffix
    counter = TokenCounter(lambda s: len(tokenizer.encode(s).ids))
    prompt = build_prompt(text, len("def f(a, "), fim=FimTemplate(order="spm"), counter=counter, budget=200)
    assert prompt.parts.suffix == ModelCompleter(None, tokenizer, "cpu", "spm", suffix_tokens=200 // 5).suffix_window(
        suffix)
