"""bench.serve_e2e against the real `lingls serve` on a weightless checkpoint (CPU here; the same command
measures Ling-3.0-flash's shapes on GPUs): every run streams the tokens asked for and is timed."""

import json

import pytest

from bench import serve_e2e
from lingls.model.random_checkpoint import write_weightless_checkpoint
from tests.model.conftest import small_config


@pytest.mark.parametrize("tp,draft,accept", [(1, "none", None), (2, "mtp", 1)])
def test_end_to_end_latency_through_lingls_serve(tmp_path, tp, draft, accept):
    """Plain at TP=1; at TP=2 the MTP drafter on both ranks with SIMULATED acceptance (1 of 2 drafts a round)."""
    model = write_weightless_checkpoint(small_config(num_nextn_predict_layers=1), tmp_path / "wl")
    out = tmp_path / "e2e.json"
    simulate = ["--draft-k", "2", "--simulate-accept", str(accept)] if accept is not None else []
    rc = serve_e2e.main(["--model", str(model), "--device", "cpu", "--tp", str(tp), "--draft", draft, *simulate,
                         "--prompt-tokens", "40", "--new-tokens", "6", "--runs", "2", "--load-timeout", "120",
                         "--out", str(out)])
    result = json.loads(out.read_text())
    assert rc == 0 and len(result["runs"]) == 2
    for run in result["runs"]:
        assert run["prompt_tokens"] == 40 and run["completion_tokens"] == 6 and run["finish_reason"] == "length"
        assert run["ttft_ms"] > 0 and run["tpot_ms"] > 0
    assert result["server_tpot_mean_ms"] > 0
    if accept is not None:  # every round: the accepted drafts + the target's own token
        assert result["simulated_accept"] == accept and result["server_accept_length"] == accept + 1
