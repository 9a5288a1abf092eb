"""Safetensors files stored smaller, for the weights that ship inside the package (ling-nano and its drafter).

A bf16 number's low byte is close to noise, so a plain safetensors file of bf16 weights hardly compresses; its high
bytes (sign, exponent, top of the mantissa) do. A packed file `NAME.safetensors.zlib` is zlib over the safetensors
file with its data section split into two planes, the even bytes and then the odd bytes: ling-nano's 55.0 MB of
weights become 38.3 MB, and unpacking takes ~0.2 s. The repository travels to the GPU machine whole, within a
64 MiB limit, which the plain files no longer fit.

Reading: `open_tensors(path)` gives, for a plain file, safetensors' lazy handle, and for a packed one the same
calls (`keys`, `get_slice(key)` with `get_shape`, `get_dtype` and indexing, `get_tensor`) over tensors unpacked in
memory. Writing: `pack_file` (checked by reading it back before the plain file is removed), as `python -m
training.ship` does for a trained model; `unpack_file` writes a plain file back.
"""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load as load_bytes

SUFFIX = ".safetensors.zlib"
_DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float64: "F64",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL"}


class PackedFileError(ValueError):
    """A packed file that cannot be unpacked (truncated, or not written by `pack`)."""


def _split_data(raw: bytes) -> tuple[bytes, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return raw[: 8 + n], raw[8 + n:]


def pack_bytes(raw: bytes) -> bytes:
    """A safetensors file's bytes -> the packed form."""
    head, data = _split_data(raw)
    even = len(data) - len(data) % 2
    return zlib.compress(head + data[:even:2] + data[1:even:2] + data[even:], 9)


def unpack_bytes(packed: bytes) -> bytes:
    """The packed form -> the safetensors file's bytes (byte slicing in C: NumPy is not a dependency)."""
    try:
        raw = zlib.decompress(packed)
        head, planes = _split_data(raw)
    except (zlib.error, struct.error, ValueError) as e:
        raise PackedFileError(f"not a packed safetensors file ({e})") from None
    half = len(planes) // 2
    data = bytearray(len(planes))
    data[0: 2 * half: 2], data[1: 2 * half: 2] = planes[:half], planes[half: 2 * half]
    data[2 * half:] = planes[2 * half:]
    return head + bytes(data)


class _Slice:
    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def get_dtype(self) -> str:
        return _DTYPE_NAMES[self.tensor.dtype]

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index].clone()


class PackedHandle:
    """safe_open's reading calls over a packed file's tensors, unpacked in memory."""

    def __init__(self, path: Path):
        try:
            self.tensors = load_bytes(unpack_bytes(Path(path).read_bytes()))
        except (PackedFileError, SafetensorError) as e:
            raise PackedFileError(f"{path}: {e}") from None

    def keys(self) -> list[str]:
        return list(self.tensors)

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self.tensors[key])

    def get_tensor(self, key: str) -> torch.Tensor:
        return self.tensors[key].clone()

    def __enter__(self) -> PackedHandle:
        return self

    def __exit__(self, *exc) -> None:
        return None


def open_tensors(path: Path):
    """safetensors' lazy handle for a plain file, a PackedHandle for a packed one."""
    if path.name.endswith(SUFFIX):
        return PackedHandle(path)
    return safe_open(str(path), framework="pt")


def pack_file(path: Path) -> Path:
    """Write PATH's packed form beside it, check it reads back to the same bytes, remove PATH."""
    raw = path.read_bytes()
    out = path.with_name(path.name + ".zlib")
    out.write_bytes(pack_bytes(raw))
    if unpack_bytes(out.read_bytes()) != raw:
        out.unlink()
        raise PackedFileError(f"{out}: did not read back as {path}")
    path.unlink()
    return out


def unpack_file(path: Path) -> Path:
    out = path.with_name(path.name.removesuffix(".zlib"))
    out.write_bytes(unpack_bytes(path.read_bytes()))
    path.unlink()
    return out
