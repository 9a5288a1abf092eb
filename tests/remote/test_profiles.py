"""What each profile sends, and the `fim` setting (no server needed: the engines point at a closed port)."""

import pytest

from lingls.engine.protocol import EngineError, FimParts, FimTemplate, GenerateRequest
from lingls.engine.remote import RemoteEngine, parse_fim

from .harness import free_port

REQUEST = GenerateRequest("<rendered>", max_tokens=7, seed=3,
                          parts=FimParts("def f():\n    ", "\n", (("util.py", "X = 1"),)))


def engine(**kw) -> RemoteEngine:
    return RemoteEngine(f"http://127.0.0.1:{free_port()}/v1/completions", **kw)


def test_fim_setting():
    assert parse_fim(None) is None and parse_fim("auto") is None
    assert parse_fim("none") == "none" and parse_fim(" suffix ") == "suffix"
    assert parse_fim("<a>,<b>,<c>") == FimTemplate("<a>", "<b>", "<c>", None)
    assert parse_fim("<a>,<b>,<c>,<s>,<e>") == FimTemplate("<a>", "<b>", "<c>", "<s>", ("<e>",))
    with pytest.raises(EngineError, match="PREFIX,SUFFIX,MIDDLE"):
        parse_fim("<a>,<b>")


def test_llama_cpp_gets_infill_with_context():
    path, body = engine(profile="llama.cpp")._body(REQUEST)
    assert path == "/infill"
    assert (body["input_prefix"], body["input_suffix"], body["n_predict"]) == ("def f():\n    ", "\n", 7)
    assert body["input_extra"] == [{"filename": "util.py", "text": "X = 1"}] and body["cache_prompt"]


def test_openai_prompt_client_side_or_suffix():
    tokens = engine(profile="openai", fim=FimTemplate(), model="m")
    assert tokens.fim == FimTemplate() and tokens._body(REQUEST) == ("/v1/completions", {
        "temperature": 0.0, "top_p": 1.0, "stream": True, "seed": 3, "prompt": "<rendered>", "max_tokens": 7,
        "stream_options": {"include_usage": True}, "model": "m"})
    server_side = engine(profile="openai", fim="suffix")
    assert server_side.fim is None  # the language server then sends the parts, not a template
    _, body = server_side._body(REQUEST)
    assert (body["prompt"], body["suffix"]) == ("def f():\n    ", "\n")


def test_down_at_construction_and_bad_settings():
    e = engine()
    assert not e.healthy and e.base.startswith("http://127.0.0.1:")
    with pytest.raises(EngineError, match="not an http"):
        RemoteEngine("127.0.0.1:30000")
    with pytest.raises(EngineError, match="unknown server profile"):
        engine(profile="tgi")
    with pytest.raises(EngineError, match="LINGLS_READ_TIMEOUT"):
        RemoteEngine.from_env("http://127.0.0.1:1", None, None, {"LINGLS_READ_TIMEOUT": "soon"})
