"""Text a tokenizer cannot take never reaches it: a lone surrogate (JSON's `"\\ud800"` is a valid escape, so any
client can send one) is read as U+FFFD, in the tokenizer itself, so that no server built on it can be broken
by such a text (issue 37, failure 1)."""

import asyncio
import os
import re
import subprocess
import sys
import time

import aiohttp
import pytest

from lingls.engine.local import EMBEDDED
from lingls.engine.tokenizer import Tokenizer

LONE = ['s = "\ud800"', "\udc00 at the start", "end \udfff", 'pair "\ud83d\ude00" and lone "\ude00"', "\ud800" * 3]


@pytest.mark.parametrize("text", LONE)
def test_tokenizer_reads_a_lone_surrogate_as_the_replacement_character(text):
    tok = Tokenizer(EMBEDDED)
    replaced = re.sub("[\ud800-\udfff]", "\ufffd", text)
    assert tok.encode(text) == tok.encode(replaced)
    assert tok.decode(tok.encode(text)) == tok.decode(tok.encode(replaced))


@pytest.fixture(scope="module")
def serve_url(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "lingls.cli", "serve", "--model", str(tiny_dir),
                                 "--device", "cpu", "--port", "0"], stderr=err, env=env)
    try:
        url = None
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            text = log.read_text()
            if (m := re.search(r"listening on (http://127\.0\.0\.1:\d+)", text)) and "model tiny ready" in text:
                url = m.group(1)
                break
            time.sleep(0.2)
        assert url, f"serve did not start: {log.read_text()}"
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def _complete(url: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
            return r.status, await r.json()


def test_serve_completes_a_prompt_holding_a_lone_surrogate(serve_url):
    async def run():
        plain = await _complete(serve_url, {"prompt": 's = "\ufffd"\n', "max_tokens": 4, "temperature": 0})
        lone = await _complete(serve_url, {"prompt": 's = "\ud800"\n', "max_tokens": 4, "temperature": 0})
        fim = await _complete(serve_url, {"prompt": "a\udc00", "suffix": "\ud800b", "max_tokens": 2})
        return plain, lone, fim

    (plain_status, plain), (lone_status, lone), (fim_status, fim) = asyncio.run(run())
    assert (plain_status, lone_status) == (200, 200), lone
    assert lone["choices"][0]["text"] == plain["choices"][0]["text"]  # the same tokens as U+FFFD gives
    assert fim_status == 200, fim
