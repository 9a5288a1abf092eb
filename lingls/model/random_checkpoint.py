"""Random Ling-3.0 checkpoints in the official layout, at any config (Ling-3.0-flash shapes included).

The real checkpoint cannot be downloaded here, so tests and benchmarks load these instead: the same tensor
names, shapes and dtypes (bf16 matrices; fp32 A_log, dt_bias, expert_bias), written tensor by tensor into
safetensors shards with an index, as the real one is. Nothing is built in memory beyond one shard.

A *weightless* checkpoint (`--weightless`) is for serving benchmarks at sizes no disk here holds (all 42
layers of Ling-3.0-flash are 250 GB): config.json, `random_weights.json` (the seed) and a synthetic tokenizer
whose tokens are the words t0 .. t{vocab-1}. `load_model` builds each rank's shard of random weights straight
on its device (`loader.random_model`); `lingls serve --model DIR --tp N` then runs end to end. Its text is noise.

A DSpark drafter checkpoint for a target (`--dspark --target DIR`) in the published layout
(`lingls.model.dspark`): config.json with `dflash_config`, the backbone, Markov and confidence heads, and the
embed_tokens / lm_head copies the real one stores; by default at the published widths (5 layers, 32 x 128
heads, 6144, rank 256: 1,363,707,905 parameters for Ling-3.0-flash), `--small` for tests.

    python -m lingls.model.random_checkpoint OUT_DIR --flash --layers 4
    python -m lingls.model.random_checkpoint OUT_DIR --flash --weightless
    python -m lingls.model.random_checkpoint DRAFT_DIR --dspark --target OUT_DIR [--weightless]
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Iterator

import torch

from lingls.model.config import LingConfig, flash_config, tiny_config
from lingls.model.dspark import DSparkConfig, checkpoint_tensors
from lingls.model.ling import LingForCausalLM
from lingls.model.loader import FP32_TENSORS, WEIGHTLESS, official_tensors, write_shards


def random_tensor(name: str, shape: torch.Size, dtype: torch.dtype, gen: torch.Generator, std: float) -> torch.Tensor:
    """A plausible value for tensor `name`: norms near 1, KDA decay parameters in their trained ranges."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "A_log":
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    if leaf == "dt_bias":
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
        return dt + torch.log(-torch.expm1(-dt))
    if leaf == "expert_bias":
        return torch.randn(shape, generator=gen) * 0.01
    if len(shape) == 1:
        return (1.0 + 0.1 * torch.randn(shape, generator=gen)).to(dtype)
    return (torch.randn(shape, generator=gen) * std).to(dtype)


def random_tensors(cfg: LingConfig, dtype: torch.dtype, seed: int, std: float) -> Iterator[tuple[str, torch.Tensor]]:
    with torch.device("meta"):
        layout = LingForCausalLM(cfg)
    gen = torch.Generator().manual_seed(seed)
    for name, shape in official_tensors(layout):
        fp32 = name.rsplit(".", 1)[-1] in FP32_TENSORS
        yield name, random_tensor(name, shape, torch.float32 if fp32 else dtype, gen, std)


def write_random_checkpoint(cfg: LingConfig, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                            std: float = 0.02, max_shard_bytes: int = 5 * 2**30) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(out_dir / "config.json")
    write_shards(random_tensors(cfg, dtype, seed, std), out_dir, max_shard_bytes)
    return out_dir


def write_weightless_checkpoint(cfg: LingConfig, out_dir: str | Path, seed: int = 0) -> Path:
    """config.json, random_weights.json and a synthetic word-level tokenizer (t0 .. t{V-1}, no special tokens)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg.save(out_dir / "config.json")
    (out_dir / WEIGHTLESS).write_text(json.dumps({"seed": seed, "note": "random weights, built at load time; "
                                                   "for benchmarks: the model's text is noise"}, indent=1) + "\n")
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps({"completion_prompt": "prefix"}) + "\n")
    return out_dir


SMALL_DSPARK = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=96, markov_rank=16)  # GQA, tiny: for tests


def write_random_dspark(cfg: DSparkConfig, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                        std: float = 0.02, max_shard_bytes: int = 5 * 2**30, prefix: str = "",
                        weightless: bool = False) -> Path:
    """A random DSpark drafter checkpoint of `cfg` (DSparkConfig.for_target): every tensor of the published layout
    (norms near but not at 1, the confidence head and the embed_tokens / lm_head copies included), names under
    `prefix` (the published checkpoint may use "model."); weightless: config.json and random_weights.json only."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    if weightless:
        (out_dir / WEIGHTLESS).write_text(json.dumps({"seed": seed, "note": "random weights, built at load time; "
                                                       "for benchmarks: the drafts are noise"}, indent=1) + "\n")
        return out_dir
    gen = torch.Generator().manual_seed(seed)
    tensors = ((prefix + name, random_tensor(name, shape, dtype, gen, std)) for name, shape in checkpoint_tensors(cfg))
    write_shards(tensors, out_dir, max_shard_bytes)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    shape = p.add_mutually_exclusive_group(required=True)
    shape.add_argument("--dspark", action="store_true", help="a DSpark drafter for the model in --target")
    shape.add_argument("--flash", action="store_true", help="Ling-3.0-flash shapes")
    shape.add_argument("--tiny", action="store_true", help="Ling-3.0-tiny shapes")
    shape.add_argument("--config", metavar="JSON", help="any config.json")
    p.add_argument("--layers", type=int, help="number of decoder layers (keeps the layer pattern)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-gb", type=float, default=5.0)
    p.add_argument("--weightless", action="store_true",
                   help="no tensors on disk: random weights built at load time, a synthetic tokenizer (benchmarks)")
    p.add_argument("--target", metavar="DIR", help="--dspark: the target model directory (its config.json)")
    p.add_argument("--small", action="store_true", help="--dspark: tiny widths (tests) instead of the published ones")
    p.add_argument("--block-size", type=int, default=8, help="--dspark: drafts per block")
    p.add_argument("--prefix", default="", help='--dspark: tensor name prefix (e.g. "model.")')
    a = p.parse_args(argv)
    if a.dspark:
        if not a.target:
            p.error("--dspark needs --target DIR")
        target = LingConfig.from_json(Path(a.target) / "config.json")
        cfg = DSparkConfig.for_target(target, block_size=a.block_size, **(SMALL_DSPARK if a.small else {}))
        write_random_dspark(cfg, a.out_dir, seed=a.seed, max_shard_bytes=int(a.shard_gb * 2**30), prefix=a.prefix,
                            weightless=a.weightless)
        print(f"wrote {a.out_dir}")
        return 0
    if a.config:
        raw = json.loads(Path(a.config).read_text())
        if a.layers:
            raw["num_hidden_layers"] = a.layers
            raw.pop("layer_types", None), raw.pop("mlp_layer_types", None)
        cfg = LingConfig.from_dict(raw)
    elif a.flash:
        cfg = flash_config(a.layers or 42)
    else:
        cfg = tiny_config(a.layers or 24)
    if a.weightless:
        write_weightless_checkpoint(cfg, a.out_dir, seed=a.seed)
    else:
        write_random_checkpoint(cfg, a.out_dir, seed=a.seed, max_shard_bytes=int(a.shard_gb * 2**30))
    print(f"wrote {a.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
