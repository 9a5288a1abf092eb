"""Time to first token of cold prompts through the real `lingls serve`, at the prompt sizes `lingls bench prefix`
times (512, 1,536, 4,096 and 8,192 tokens), measured by its HTTP client.

One H200 cannot hold Ling-3.0-flash, so by default this serves a weightless checkpoint of ONE TP=4 RANK'S SHAPES
as a whole model at TP=1 (`rank_config`): Ling-3.0-flash's config with the attention heads and the dense, expert
and shared-expert widths divided by 4, i.e. one rank's share of every layer's arithmetic and weights (the router,
which every rank holds whole, whole too). Against a real TP=4 rank it leaves out the two all-reduces of each
layer and the vocab-sharded head (here the whole 157,184-row head and embedding). `lingls serve` loads it as any
model (random weights built on the GPU), warms up and serves; its text is noise. `--model DIR` serves another.

Per size, one streaming greedy completion of --new-tokens tokens per run, each prompt fresh random words of the
synthetic tokenizer (one token each, so nothing is reused from the prompt before); TTFT is the client's time
from sending the request to the first streamed chunk with text. A first request, not counted, goes before them.

With `--kernels-from PREFIX.json` the server runs the KDA state pass as `lingls bench prefix --tune` chose in that
result (`prefill_kda_state.COLUMNS`) instead of the tree's table: the server is started as
`python -m bench.serve_ttft --serve-with PREFIX.json -- serve ...`, which sets it and runs `lingls.cli.main`.

    python -m bench.serve_ttft [--sizes 512,1536,4096,8192] [--runs 3] [--layers 42] [--model DIR]
                               [--kernels-from PREFIX.json] --out OUT.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer

from bench.common import free_port, write_result
from bench.serve_e2e import one_run, server_metrics, start_server, stop_server


def rank_config(layers: int = 42, tp: int = 4, context: int = 16384):
    """Ling-3.0-flash's config at the shapes of one rank of `tp` (what `Parallel.split` gives a rank), no MTP
    layer, a context of `context` tokens (the server's capacity: its graphs are captured up to it)."""
    from lingls.model.config import flash_config

    cfg = flash_config(layers)
    cfg.num_attention_heads //= tp
    cfg.intermediate_size //= tp
    cfg.moe_intermediate_size //= tp
    if cfg.shared_expert_intermediate_size:
        cfg.shared_expert_intermediate_size //= tp
    cfg.num_nextn_predict_layers = 0
    cfg.max_position_embeddings = context
    return cfg


def serve_with(prefix_json: str, argv: list[str]) -> int:
    """`lingls` with the KDA state pass recorded in a `lingls bench prefix` result."""
    import json

    from lingls.cli import main as lingls_main
    from lingls.kernels import prefill_kda_state

    result = json.loads(Path(prefix_json).read_text())
    prefill_kda_state.COLUMNS = {int(n): tuple(c) for n, c in result["kda_state_columns"].items()}
    return lingls_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--serve-with"]:
        return serve_with(argv[1], argv[3:])  # --serve-with FILE -- lingls arguments
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a model directory (default: a weightless TP=4 rank-shaped one)")
    p.add_argument("--layers", type=int, default=42, help="decoder layers of the rank-shaped checkpoint")
    p.add_argument("--sizes", default="512,1536,4096,8192", help="prompt lengths in tokens (a,b,...)")
    p.add_argument("--runs", type=int, default=3, help="completions per size (the median is reported)")
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--load-timeout", type=float, default=600.0, help="seconds for the server to load and warm up")
    p.add_argument("--kernels-from", metavar="PREFIX_JSON", default=None,
                   help="serve with the KDA state pass's runs of this `lingls bench prefix` result")
    p.add_argument("--out", default="bench/results/serve_ttft.json")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    sizes = [int(x) for x in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        label = "model"
        if args.model is None:
            from lingls.model.random_checkpoint import write_weightless_checkpoint

            args.model = str(write_weightless_checkpoint(rank_config(args.layers), Path(tmp) / "rank"))
            label = (f"weightless Ling-3.0-flash, one TP=4 rank's shapes served at TP=1 ({args.layers} layers; "
                     "no all-reduce, whole vocab head)")
        tok = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
        vocab = tok.get_vocab_size()
        rng = random.Random(0)
        prompt = lambda n: tok.decode([rng.randrange(vocab) for _ in range(n)])  # noqa: E731
        args.tp, args.draft, args.draft_k, args.simulate_accept, args.draft_vocab, args.device = 1, "none", None, \
            None, None, None
        port = free_port()
        t0 = time.perf_counter()
        launcher = [sys.executable, "-m", "bench.serve_ttft", "--serve-with", args.kernels_from, "--"] \
            if args.kernels_from else None
        proc = start_server(args, port, out.with_suffix(".log"), launcher)
        load_s = time.perf_counter() - t0
        print(f"lingls serve ready in {load_s:.1f} s (load and warm-up): {label}", flush=True)
        rows = []
        try:
            one_run(port, prompt(sizes[0]), args.new_tokens, timeout=300)  # the first request, not counted
            for n in sizes:
                runs = [one_run(port, prompt(n), args.new_tokens, timeout=300) for _ in range(args.runs)]
                ttfts = [r["ttft_ms"] for r in runs if r["ttft_ms"] is not None]
                rows.append({"tokens": n, "runs": runs, "median_ttft_ms": statistics.median(ttfts) if ttfts else None,
                             "prompt_tokens_seen": [r["prompt_tokens"] for r in runs]})
                print(f"{n:6d} tokens: TTFT through lingls serve {rows[-1]['median_ttft_ms']:.1f} ms (median of "
                      f"{len(ttfts)}; server counted {runs[0]['prompt_tokens']} prompt tokens)", flush=True)
            metrics = server_metrics(port)
        finally:
            stop_server(proc)
    result = {"bench": "serve_ttft", "model": label, "layers": args.layers, "load_s": load_s, "runs": args.runs,
              "kernels_from": args.kernels_from,
              "new_tokens": args.new_tokens, "sizes": rows, **metrics, "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_result(out, result)
    print("\n| prompt tokens | TTFT through lingls serve (median) |\n|---|---|")
    for r in rows:
        print(f"| {r['tokens']:,} | {r['median_ttft_ms']:.1f} ms |")
    return 0 if rows and all(r["median_ttft_ms"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
