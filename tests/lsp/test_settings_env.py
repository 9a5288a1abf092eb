"""Where the starting settings come from: defaults < LINGLS_* environment < command line (< the editor's)."""

from types import SimpleNamespace

from lingls.lsp.settings import Settings, from_cli


def args(**given):
    return SimpleNamespace(**{"endpoint": None, "model": None, "device": None, **given})


def test_environment_sets_the_endpoint():
    s = from_cli(args(), {"LINGLS_ENDPOINT": "http://gpu-box:30000", "LINGLS_DEVICE": "cpu"})
    assert s.endpoint == "http://gpu-box:30000" and s.device == "cpu" and s.model is None


def test_command_line_wins_over_the_environment_and_the_editor_over_both():
    s = from_cli(args(endpoint="http://cli:1"), {"LINGLS_ENDPOINT": "http://env:2"})
    assert s.endpoint == "http://cli:1"
    merged, warnings = s.merged({"lingls": {"endpoint": "http://editor:3"}})
    assert merged.endpoint == "http://editor:3" and not warnings


def test_empty_environment_keeps_the_defaults():
    assert from_cli(args(), {"LINGLS_ENDPOINT": ""}) == Settings()
