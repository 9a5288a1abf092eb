"""Packed safetensors (lingls.model.packed): the bytes come back exactly, and a packed checkpoint loads as the
plain one, tensor-parallel slices included; a damaged one is refused by name."""

import pytest
import torch
from safetensors.torch import save

from lingls.model import CheckpointError, load_model, save_checkpoint
from lingls.model.ling import LingForCausalLM, Parallel
from lingls.model.packed import SUFFIX, PackedHandle, pack_bytes, pack_file, unpack_bytes, unpack_file

from .conftest import randomize, small_config


@pytest.mark.parametrize("odd", [False, True])
def test_bytes_round_trip_for_every_dtype(odd):
    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(33, 17, generator=g).bfloat16(), "f": torch.randn(5, generator=g),
               "i": torch.randint(-9, 9, (7,), generator=g)}
    if odd:  # a data section of odd length: the last byte has no pair
        tensors["u"] = torch.randint(0, 255, (3,), generator=g, dtype=torch.uint8)
    raw = save(tensors)
    packed = pack_bytes(raw)
    assert unpack_bytes(packed) == raw


def test_bf16_weights_get_smaller():
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(1)).bfloat16() * 0.02
    raw = save({"w": w})
    assert len(pack_bytes(raw)) < 0.8 * len(raw)


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    model = LingForCausalLM(small_config(num_nextn_predict_layers=1))
    model.init_weights()
    randomize(model, 0)
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    save_checkpoint(model.eval(), plain)
    save_checkpoint(model, packed)
    out = pack_file(packed / "model.safetensors")
    assert out.name == "model" + SUFFIX and not (packed / "model.safetensors").exists()
    return plain, packed


def test_packed_checkpoint_loads_as_the_plain_one(checkpoint):
    plain, packed = checkpoint
    a, b = load_model(plain).state_dict(), load_model(packed).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    for rank in range(2):  # a rank's slices come from the tensors in memory as from the lazy file
        par = Parallel(rank=rank, size=2)
        a, b = load_model(plain, par=par).state_dict(), load_model(packed, par=par).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_handle_answers_safe_opens_calls(checkpoint):
    from safetensors import safe_open

    plain, packed = checkpoint
    with safe_open(str(plain / "model.safetensors"), framework="pt") as f, \
            PackedHandle(packed / ("model" + SUFFIX)) as h:
        assert sorted(h.keys()) == sorted(f.keys())
        for key in f.keys():
            assert h.get_slice(key).get_dtype() == f.get_slice(key).get_dtype()
            assert h.get_slice(key).get_shape() == f.get_slice(key).get_shape()
            assert torch.equal(h.get_tensor(key), f.get_tensor(key))
            assert torch.equal(h.get_slice(key)[:1], f.get_slice(key)[:1])


def test_unpack_file_gives_the_plain_file_back(checkpoint):
    plain, packed = checkpoint
    out = unpack_file(packed / ("model" + SUFFIX))
    assert out.read_bytes() == (plain / "model.safetensors").read_bytes()


def test_damaged_packed_file_is_refused_by_name(checkpoint):
    _, packed = checkpoint
    f = packed / ("model" + SUFFIX)
    f.write_bytes(f.read_bytes()[: 1000])
    with pytest.raises(CheckpointError, match="model.safetensors.zlib"):
        load_model(packed)
