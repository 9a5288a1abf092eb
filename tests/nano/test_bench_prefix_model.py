"""`lingls bench prefix --model DIR` runs on a CPU: the runner's figures with the lean step, the same keystrokes
through LocalEngine, and the JSON that performance.md quotes."""

import json

import torch

from lingls.cli import main
from lingls.engine.local import write_tiny_checkpoint


def test_model_mode_writes_runner_and_engine_latencies(tmp_path, capsys):
    model = write_tiny_checkpoint(tmp_path / "tiny")
    code = tmp_path / "typed.py"
    code.write_text("\n".join(f"def f{i}(x):\n    return x * {i} + len(str(x))" for i in range(40)) + "\n")
    out = tmp_path / "latency.json"
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "prefix", "--model", str(model), "--tokens", "96", "--keystrokes", "3",
                     "--file", str(code), "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    assert result["step"] == "cpu_step" and result["threads"] == 1
    assert len(result["edit_ttft_ms"]) == len(result["engine_line_ms"]) == len(result["tokenise_pieces_ms"]) == 3
    assert min(result["tokens_reused"]) > 0  # each keystroke reused the prompt before the line
    assert "through LocalEngine.stream" in capsys.readouterr().out
