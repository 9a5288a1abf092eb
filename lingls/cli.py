"""The `lingls` command: the language server (default), `serve`, `complete`, `draft-vocab`, `bench`.

Each subcommand's work lives in its room; this module only parses arguments and imports the room lazily, so
`lingls --help` and the language server start without importing torch.
"""

from __future__ import annotations

import argparse
import sys
import warnings

from lingls import __version__


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", help="model directory (default: the embedded ling-nano)")
    p.add_argument("--device", default=None,
                   help="torch device for an in-process model (default: cuda if present, else cpu)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lingls",
        description="Inline code completion language server backed by a batch-1 Ling-3.0 runtime.",
    )
    parser.add_argument("--version", action="version", version=f"lingls {__version__}")
    transport = parser.add_mutually_exclusive_group()
    transport.add_argument("--stdio", action="store_true", help="run the language server over stdin/stdout (default)")
    transport.add_argument("--tcp", action="store_true", help="run the language server on a TCP port")
    parser.add_argument("--host", default="127.0.0.1", help="--tcp: address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=2087, help="--tcp: port (default 2087)")
    parser.add_argument("--endpoint", metavar="URL",
                        help="use a remote /v1/completions server instead of an in-process model")
    parser.add_argument("--log-file", metavar="PATH", help="write the server log to this file")
    _add_model_args(parser)

    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="serve a Ling-3.0 model over an OpenAI-compatible HTTP API (batch 1)")
    _add_model_args(serve)
    serve.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: one process per GPU")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=30000)
    serve.add_argument("--api-key", default=None, help="require this bearer token on every request")
    serve.add_argument("--draft", default="none",
                       help="speculative drafter: none, mtp, lookup, a drafter directory (a DSpark checkpoint such "
                            "as Ling-3.0-flash-DSpark), or lookup+DRAFTER")
    serve.add_argument("--draft-k", type=int, default=None,
                       help="drafted tokens per round (default: a DSpark drafter's block size; "
                            "else 2 on CPU, 4 on GPU)")
    serve.add_argument("--draft-vocab", metavar="FILE", default=None,
                       help="the MTP drafter's head scores only these token ids (a JSON list, most frequent first; "
                            "make one with `lingls draft-vocab`): less to read per drafted token")
    serve.add_argument("--simulate-accept", type=int, default=None, metavar="N",
                       help="benchmarks only: every speculative round accepts N drafts whatever they are (the text "
                            "is NOT the model's); times real acceptance lengths on random-weight checkpoints")
    serve.add_argument("--dtype", default=None, help="weight dtype (default: bfloat16 on GPU, float32 on CPU)")

    complete = sub.add_parser("complete", help="print the completion at PATH:LINE:COL (1-based)")
    complete.add_argument("location", metavar="PATH:LINE:COL")
    _add_model_args(complete)
    complete.add_argument("--endpoint", metavar="URL", help="ask a remote /v1/completions server")
    complete.add_argument("--max-tokens", type=int, default=64)
    complete.add_argument("--typing", action="store_true",
                          help="answer as a suggestion shown while typing (an automatic request): a line the model "
                               "gives less than minLineProbability (0.02) is not shown; without it, as one you ask "
                               "for (Invoked), whatever its probability")

    vocab = sub.add_parser("draft-vocab", help="write a --draft-vocab file: the most frequent token ids of source "
                           "files, by the model's tokenizer")
    vocab.add_argument("sources", nargs="+", help="files or directories of code like the code you complete")
    vocab.add_argument("--model", metavar="DIR", help="model directory (default: the embedded ling-nano)")
    vocab.add_argument("--size", type=int, default=32768, help="ids to keep (default 32768)")
    vocab.add_argument("--out", required=True, metavar="FILE", help="the JSON file to write")

    bench = sub.add_parser("bench", help="benchmarks (results go to bench/results/)")
    bench.add_argument("what", choices=["step", "prefix", "lsp", "spec", "remote"])
    bench.add_argument("rest", nargs=argparse.REMAINDER,
                       help="options of that benchmark (see lingls bench WHAT --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # torch warns on import where NumPy is absent (torch's CPU wheels do not bring it); lingls does not use it
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    if args.command == "serve":
        from lingls.serve.http_server import main as serve_main

        return serve_main(args) or 0
    if args.command == "complete":
        from lingls.lsp.oneshot import main as complete_main

        return complete_main(args) or 0
    if args.command == "draft-vocab":
        from lingls.engine.count_vocab import main as draft_vocab_main

        return draft_vocab_main(args)
    if args.command == "bench":
        import importlib

        if hasattr(sys.stdout, "reconfigure"):  # each result line out as it is printed: into a file or a pipe
            sys.stdout.reconfigure(line_buffering=True)  # a run cut off by a time limit still leaves its lines
        module = importlib.import_module(f"lingls.bench.{args.what}")
        return module.main(args.rest) or 0
    from lingls.lsp.server import main as lsp_main

    return lsp_main(args) or 0


if __name__ == "__main__":
    sys.exit(main())
