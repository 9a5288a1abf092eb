"""Shared checks of the kernel tests: relative error that refuses unwritten elements, and poisoned scratch."""

import pytest
import torch


def rel(a, b):
    """||a - b|| / ||b|| in fp64, after checking that a holds no NaN (the poison of unwritten elements)."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "unwritten (NaN) or non-finite elements"
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def poisoned(monkeypatch):
    """Every buffer a kernel module allocates with torch.empty(_like) starts as NaN (or -1 for integers), so a read of
    an element no kernel wrote shows up in the result."""
    real = torch.empty

    def empty(*shape, dtype=None, device=None):
        out = real(*shape, dtype=dtype, device=device)
        return out.fill_(float("nan")) if out.is_floating_point() else out.fill_(-1)

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch, "empty_like", lambda x: empty(*x.shape, dtype=x.dtype, device=x.device))
