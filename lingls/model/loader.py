"""Checkpoints: read safetensors into a LingForCausalLM (whole or one tensor-parallel rank's slice), and write them.

Reading never executes code from the model directory: config.json is parsed as data and tensors come from
safetensors files only. Names may be the official ones or the ones transformers uses in memory (packed convs and
experts, `forget_gate.*`, `e_score_correction_bias`, ...); each is mapped to one canonical official name. Rank r
of N reads only its slice of each sharded tensor (safetensors slices are read lazily from disk).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from lingls.model.config import LingConfig
from lingls.model.ling import LingForCausalLM, Parallel
from lingls.model.packed import SUFFIX as PACKED
from lingls.model.packed import PackedFileError, open_tensors

FP32_TENSORS = ("A_log", "dt_bias", "expert_bias")
WEIGHTLESS = "random_weights.json"  # marks a benchmark checkpoint without tensors (lingls.model.random_checkpoint)
_EXPERT_PARAM = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")

_RENAMES = [  # (pattern, replacement) applied in order to every checkpoint name
    (re.compile(r"^model\.embed_tokens\."), "model.word_embeddings."),
    (re.compile(r"\.self_attn\."), ".attention."),
    (re.compile(r"\.attention\.o_proj\."), ".attention.dense."),
    (re.compile(r"\.attention\.forget_gate\."), ".attention."),
    (re.compile(r"\.mlp\.gate\.e_score_correction_bias$"), ".mlp.gate.expert_bias"),
]


class CheckpointError(ValueError):
    """The model directory does not hold the tensors its config describes; the message names the tensor."""


def _is_fp32(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in FP32_TENSORS


def official_tensors(model: LingForCausalLM) -> Iterator[tuple[str, torch.Size]]:
    """(official name, shape) of every tensor a checkpoint of this (unsharded) model holds."""
    for name, p in model.named_parameters():
        m = _EXPERT_PARAM.match(name)
        if not m:
            yield name, p.shape
            continue
        prefix, kind = m.groups()
        n_exp, rows, cols = p.shape
        for e in range(n_exp):
            if kind == "gate_up_proj":
                yield f"{prefix}.{e}.gate_proj.weight", torch.Size([rows // 2, cols])
                yield f"{prefix}.{e}.up_proj.weight", torch.Size([rows // 2, cols])
            else:
                yield f"{prefix}.{e}.down_proj.weight", torch.Size([rows, cols])


class CheckpointReader:
    """Lazy access to a directory's safetensors under canonical names, with slicing on read."""

    def __init__(self, path: Path):
        self.path = path
        self._handles = {}
        self.sources: dict[str, tuple] = {}  # canonical name -> (handle, key, kind, extra)
        for f in self._files(path):
            try:  # reads the header only: names, dtypes, shapes and that the data it describes is all there
                h = self._handles[f] = open_tensors(f)
                for key in h.keys():
                    self._add(h, key)
            except (SafetensorError, PackedFileError) as e:  # truncated, or a header that is not a safetensors header
                raise CheckpointError(f"{f}: truncated, or not a safetensors file ({e})") from None

    @staticmethod
    def _files(path: Path) -> list[Path]:
        index = path / "model.safetensors.index.json"
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = sorted({path / name for name in weight_map.values()})
            except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise CheckpointError(f"{index} names shard(s) that do not exist: {', '.join(missing)}")
            return files
        files = sorted(path.glob("*.safetensors")) or sorted(path.glob("*" + PACKED))  # packed: lingls.model.packed
        if not files:
            raise CheckpointError(f"{path}: no model.safetensors, no model.safetensors.index.json, no *.safetensors "
                                  "(only safetensors checkpoints are loaded; pickled .bin files are not)")
        return files

    def _add(self, h, key: str) -> None:
        name = key
        for pattern, repl in _RENAMES:
            name = pattern.sub(repl, name)
        shape = list(h.get_slice(key).get_shape())
        if name.endswith(".attention.conv1d.weight"):  # transformers' packed q|k|v conv
            c = shape[0] // 3
            for i, which in enumerate("qkv"):
                self._put(name.replace(".conv1d.", f".{which}_conv1d."), (h, key, "rows", i * c, [c] + shape[1:]))
            return
        m = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", name)
        if m:  # transformers' packed experts [E, 2I, H] / [E, H, I]
            prefix, kind = m.groups()
            for e in range(shape[0]):
                if kind == "gate_up_proj":
                    half = shape[1] // 2
                    self._put(f"{prefix}.{e}.gate_proj.weight", (h, key, "expert", (e, 0), [half, shape[2]]))
                    self._put(f"{prefix}.{e}.up_proj.weight", (h, key, "expert", (e, half), [half, shape[2]]))
                else:
                    self._put(f"{prefix}.{e}.down_proj.weight", (h, key, "expert", (e, 0), shape[1:]))
            return
        self._put(name, (h, key, "plain", 0, shape))

    def _put(self, name: str, source: tuple) -> None:
        if name in self.sources:
            raise CheckpointError(f"tensor {name} appears twice in {self.path} "
                                  f"(as {self.sources[name][1]} and {source[1]})")
        self.sources[name] = source

    def shape(self, name: str) -> list[int]:
        return self.sources[name][4]

    def parameter_count(self) -> int:
        """How many numbers the checkpoint's tensors hold, from their headers (no data is read)."""
        return sum(math.prod(source[4]) for source in self.sources.values())

    def read(self, name: str, dim: int | None = None, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The tensor `name`, or its [start, stop) range along `dim`, read from disk."""
        h, key, kind, extra, shape = self.sources[name]
        sl = h.get_slice(key)
        index = [slice(None)] * len(shape)
        if dim is not None:
            index[dim] = slice(start, stop)
        if kind == "rows":  # rows [extra, extra + shape[0]) of the packed tensor
            r = index[0]
            lo = extra + (r.start or 0)
            hi = extra + (shape[0] if r.stop is None else r.stop)
            return sl[(slice(lo, hi), *index[1:])]
        if kind == "expert":
            e, row0 = extra
            r = index[0]
            lo = row0 + (r.start or 0)
            hi = row0 + (shape[0] if r.stop is None else r.stop)
            return sl[(e, slice(lo, hi), index[1])]
        return sl[tuple(index)]


def shard_range(full: torch.Size, local: torch.Size, par: Parallel, name: str) -> tuple[int | None, int, int | None]:
    """Which dim of `name` is split across ranks and this rank's range of it (None: replicated)."""
    diff = [d for d in range(len(full)) if full[d] != local[d]]
    if not diff:
        return None, 0, None
    (d,) = diff
    assert full[d] == local[d] * par.size, name
    return d, par.rank * local[d], (par.rank + 1) * local[d]


def random_model(cfg: LingConfig, par: Parallel | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> LingForCausalLM:
    """Rank `par.rank`'s shard of random weights, built directly on `device` (fp32 where the checkpoint is).
    Every rank seeds the same generator and draws its equally shaped shard in the same order, so the tensors
    all ranks hold whole (norms, router, embeddings) agree."""
    with torch.device("meta"):
        model = LingForCausalLM(cfg, par or Parallel()).to(dtype)
    for name, p in model.named_parameters():
        if name.rsplit(".", 1)[-1] in FP32_TENSORS:
            p.data = p.data.float()
    model = model.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
    return model.eval()


def load_model(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               par: Parallel | None = None, progress: Callable[[int, int], None] | None = None) -> LingForCausalLM:
    """Load a Ling-3.0 checkpoint directory (config.json + safetensors) as rank `par.rank`'s model; a weightless
    benchmark checkpoint (config.json + random_weights.json) gets random weights built on the device.

    `progress(bytes_loaded, bytes_total)` is called after each tensor (minutes pass on a 255 GB checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    cfg = LingConfig.from_json(path / "config.json")
    par = par or Parallel()
    if (path / WEIGHTLESS).is_file():
        try:
            seed = int(json.loads((path / WEIGHTLESS).read_text())["seed"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{path / WEIGHTLESS}: needs an integer 'seed' ({e})") from None
        if progress is not None:
            progress(0, 1)
        model = random_model(cfg, par, device, dtype, seed)
        if progress is not None:
            progress(1, 1)
        return model
    reader = CheckpointReader(path)
    mtp_prefix = f"model.layers.{cfg.num_hidden_layers}."
    if cfg.num_nextn_predict_layers and not any(n.startswith(mtp_prefix) for n in reader.sources):
        # transformers saves no MTP layer although its config counts one: load the model without it
        cfg.num_nextn_predict_layers = 0
    _check_size(cfg, reader)
    with torch.device("meta"):
        full = LingForCausalLM(cfg)
        model = LingForCausalLM(cfg, par)
    expected = dict(official_tensors(full))
    missing = [n for n in expected if n not in reader.sources]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{path}: tensor {missing[0]} is missing{more}")
    unexpected = [n for n in reader.sources if n not in expected]
    if unexpected:
        more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise CheckpointError(f"{path}: unexpected tensor {reader.sources[unexpected[0]][1]}{more} "
                              "(does config.json match the checkpoint?)")
    for name, shape in expected.items():
        if list(shape) != reader.shape(name):
            raise CheckpointError(f"{path}: tensor {name} has shape {reader.shape(name)}, "
                                  f"config.json implies {list(shape)}")

    model = model.to_empty(device=device)
    full_params = dict(full.named_parameters())
    total = sum(p.numel() * (4 if _is_fp32(n) else dtype.itemsize) for n, p in model.named_parameters())
    done = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if progress is not None:
                progress(done, total)
                done += p.numel() * (4 if _is_fp32(name) else dtype.itemsize)
            p.data = p.data.to(torch.float32 if _is_fp32(name) else dtype)
            m = _EXPERT_PARAM.match(name)
            if m:
                _load_experts(reader, m.group(1), m.group(2), p, par)
                continue
            d, lo, hi = shard_range(full_params[name].shape, p.shape, par, name)
            p.copy_(reader.read(name, d, lo, hi))
    if progress is not None:
        progress(total, total)
    return model.eval()


def _check_size(cfg: LingConfig, reader: CheckpointReader) -> None:
    """Refuse, before any model is built (even on the meta device, where each layer and each expert's tensor
    names still cost memory), a config.json that describes more parameters than the checkpoint's headers hold
    because it has more layers or experts than the checkpoint. Smaller differences are named tensor by tensor
    by the comparison that follows."""
    implied, held = cfg.parameter_count(), reader.parameter_count()
    if implied <= held:
        return
    found = {"layers": set(), "experts": set()}
    for name in reader.sources:
        if m := re.match(r"^model\.layers\.(\d+)\.(?:mlp\.experts\.(\d+)\.)?", name):
            found["layers"].add(int(m.group(1)))
            if m.group(2) is not None:
                found["experts"].add(int(m.group(2)))
    layers = cfg.num_hidden_layers + cfg.num_nextn_predict_layers
    if layers > len(found["layers"]):
        why = (f"num_hidden_layers: {cfg.num_hidden_layers} (+ {cfg.num_nextn_predict_layers} MTP), the checkpoint "
               f"has tensors of {len(found['layers'])} layers")
    elif "moe" in cfg.mlp_types and cfg.num_experts > len(found["experts"]):
        why = f"num_experts: {cfg.num_experts}, the checkpoint has {len(found['experts'])} experts per layer"
    else:
        return
    raise CheckpointError(f"{reader.path}: config.json describes {implied:,} parameters, the checkpoint holds {held:,} "
                          f"({why}); does config.json belong to this checkpoint?")


def _load_experts(reader: CheckpointReader, prefix: str, kind: str, p: torch.Tensor, par: Parallel) -> None:
    n_exp, rows, cols = p.shape
    for e in range(n_exp):
        if kind == "gate_up_proj":
            inter = rows // 2
            lo, hi = par.rank * inter, (par.rank + 1) * inter
            p[e, :inter].copy_(reader.read(f"{prefix}.{e}.gate_proj.weight", 0, lo, hi))
            p[e, inter:].copy_(reader.read(f"{prefix}.{e}.up_proj.weight", 0, lo, hi))
        else:
            lo, hi = par.rank * cols, (par.rank + 1) * cols
            p[e].copy_(reader.read(f"{prefix}.{e}.down_proj.weight", 1, lo, hi))


def official_state_dict(model: LingForCausalLM, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """The unsharded model's tensors under official names (experts unstacked), fp32 where the checkpoint is."""
    if model.par.size != 1:
        raise ValueError("official_state_dict needs the whole model (tensor-parallel size 1)")
    out = {}
    for name, p in model.named_parameters():
        t = p.detach().to("cpu")
        m = _EXPERT_PARAM.match(name)
        if m:
            prefix, kind = m.groups()
            for e in range(t.shape[0]):
                if kind == "gate_up_proj":
                    gate, up = t[e].chunk(2, dim=0)
                    out[f"{prefix}.{e}.gate_proj.weight"] = gate.to(dtype).contiguous()
                    out[f"{prefix}.{e}.up_proj.weight"] = up.to(dtype).contiguous()
                else:
                    out[f"{prefix}.{e}.down_proj.weight"] = t[e].to(dtype).contiguous()
            continue
        out[name] = t.to(torch.float32 if _is_fp32(name) else dtype).contiguous()
    return out


def write_shards(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path, max_shard_bytes: int) -> None:
    """Write (name, tensor) pairs as one model.safetensors, or as numbered shards + index when they exceed
    `max_shard_bytes` (the real checkpoint's layout), holding at most one shard in memory."""
    out_dir.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    written: list[Path] = []
    size = total = 0

    def flush() -> None:
        nonlocal size
        if not shards[-1]:
            return
        tmp = out_dir / f"shard-{len(written):05d}.tmp"
        save_file(shards[-1], str(tmp), metadata={"format": "pt"})
        written.append(tmp)
        shards.append({})
        size = 0

    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > max_shard_bytes:
            flush()
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    flush()
    if len(written) == 1:
        written[0].rename(out_dir / "model.safetensors")
        return
    weight_map = {}
    n = len(written)
    for i, tmp in enumerate(written):
        final = out_dir / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tmp.rename(final)
        with safe_open(str(final), framework="pt") as h:
            weight_map.update({k: final.name for k in h.keys()})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def save_checkpoint(model: LingForCausalLM, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                    max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json + safetensors in the official layout (what `load_model` and the real checkpoint share)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.config.save(out_dir / "config.json")
    write_shards(iter(official_state_dict(model, dtype).items()), out_dir, max_shard_bytes)
