"""`lingls bench remote` runs end to end (a tiny run against the shared server)."""

import json

from lingls.bench.remote import main


def test_bench_remote_smoke(server, tmp_path, capsys):
    out = tmp_path / "remote.json"
    assert main(["--endpoint", server.url, "--prompts", "2", "--rounds", "2", "--max-tokens", "2",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["hop_ms"]["empty_request"]["p50"] == result["hop_ms"]["empty_request"]["p50"]  # not NaN
    assert result["remote_stats"]["requests"] == 2 * 2 * 3 and result["remote_stats"]["outages"] == 0
    assert "HTTP hop on loopback" in capsys.readouterr().out
