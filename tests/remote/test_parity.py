"""Greedy completions through `lingls serve` equal the in-process engine's, for the same prompts."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys

import pytest
import torch

from lingls.engine.local import LocalEngine
from lingls.engine.protocol import GenerateRequest
from lingls.engine.remote import RemoteEngine
from lingls.lsp.oneshot import complete_file

from .harness import ENV, REPO

PROMPTS = [  # (prefix, suffix)
    ("def add(a, b):\n    return", "\n"),
    ("import os\n\n\ndef read_file(path):\n    with open(path) as f:\n        return ",
     "\n\n\ndef main():\n    pass\n"),
    ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = ", "\n"),
    ("for i in range(10):\n    print(", ")\n"),
]
FILES = {
    "a.py": ("import os\n\n\ndef read_file(path):\n    with open(path) as f:\n        return \n\n\n"
             "def main():\n    print(read_file('a.txt'))\n", [(6, 16)]),
    "b.py": ("class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = \n\n"
             "    def norm(self):\n        return (self.x ** 2 + self.y ** 2) ** 0.5\n", [(4, 18), (7, 9)]),
}


@pytest.fixture(scope="module")
def one_thread():
    """The server runs with one thread: so does the in-process model here, for the same rounding."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def local(one_thread):
    engine = LocalEngine()
    engine.load()
    return engine


async def collect(engine, request: GenerateRequest) -> str:
    return "".join([text async for text in engine.generate(request)])


async def test_remote_engine_equals_local_engine(server, local):
    remote = await asyncio.to_thread(RemoteEngine, server.url)
    try:
        assert remote.profile == "lingls" and remote.model == "ling-nano"
        assert remote.fim == local.fim  # the client renders prompts exactly as in-process
        for prefix, suffix in PROMPTS:
            assert remote.count_tokens(prefix) == local.count_tokens(prefix)
            fim = local.tokenizer.fim  # FIM prompts, though ling-nano's card asks for left-to-right ones
            prompt = f"{fim.prefix}{prefix}{fim.suffix}{suffix}{fim.middle}"
            for max_tokens, bar in ((1, 0.0), (24, 0.0), (24, 0.05)):  # and through the confidence gate
                request = GenerateRequest(prompt, max_tokens=max_tokens, temperature=0.0, min_line_probability=bar)
                want = await collect(local, request)
                assert await collect(remote, request) == want, (prefix, max_tokens, bar)
        assert remote.stats.requests == 3 * len(PROMPTS) and remote.healthy
        assert local.stats.extra["unsure_lines"] > 0  # the gate did refuse a line somewhere
    finally:
        await remote.close()


async def test_lingls_complete_with_endpoint_equals_in_process(server, local, tmp_path):
    """`lingls complete` (the language server's core: prompt, context, post-processing) both ways."""
    for name, (text, _) in FILES.items():
        (tmp_path / name).write_text(text)
    for name, (_, cursors) in FILES.items():
        for line, col in cursors:
            path = tmp_path / name
            want = await complete_file(path, line, col, argparse.Namespace(max_tokens=32))
            got = await complete_file(path, line, col, argparse.Namespace(max_tokens=32, endpoint=server.url))
            assert got == want, (name, line, col)
    # and the command itself, in its own process
    line, col = FILES["b.py"][1][0]
    out = subprocess.run([sys.executable, "-m", "lingls.cli", "complete", f"{tmp_path / 'b.py'}:{line}:{col}",
                          "--endpoint", server.url, "--max-tokens", "32"], env=ENV, cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    want = await complete_file(tmp_path / "b.py", line, col, argparse.Namespace(max_tokens=32))
    assert (out.returncode, out.stdout) == ((0, want + "\n") if want else (1, "")), out.stderr
