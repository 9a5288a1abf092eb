"""Test-wide setup. Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors: the switch must be
set before any kernel module is imported, so it lives here, at the root of the test tree."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
