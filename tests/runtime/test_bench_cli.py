"""The GPU benchmarks say so, and exit 2, where there is no GPU (CI)."""

import pytest
import torch

from lingls.cli import main

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")


@pytest.mark.parametrize("what", ["step", "prefix"])
def test_gpu_benchmarks_explain_themselves_without_a_gpu(what, capsys):
    assert main(["bench", what]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
