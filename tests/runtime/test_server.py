"""`lingls serve` end to end: the real command in a subprocess on a random tiny model, over HTTP."""

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time

import aiohttp
import pytest

from lingls.runtime.tokenizer import Tokenizer

from .conftest import reference_greedy

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "lingls.cli", "serve", "--model", str(tiny_dir),
                                 "--device", "cpu", "--port", "0", "--api-key", KEY], stderr=err, env=env)
    try:
        url = None
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", log.read_text())
            if m and "model tiny ready" in log.read_text():
                url = m.group(1)
                break
            time.sleep(0.2)
        assert url, f"serve did not start: {log.read_text()}"
        yield url, log
    finally:
        proc.terminate()
        proc.wait(timeout=30)


async def post(url, body, headers=AUTH):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json=body, headers=headers) as r:
            return r.status, await r.json()


async def stream(url, body):
    chunks = []
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/completions", json=dict(body, stream=True), headers=AUTH) as r:
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async for line in r.content:
                line = line.decode().strip()
                if line.startswith("data: "):
                    chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    return [json.loads(c) for c in chunks[:-1]]


async def metric(url, name):
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics", headers=AUTH) as r:
            text = await r.text()
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


async def test_greedy_completion_equals_the_model_core(server, tiny_dir, tiny_model):
    url, _ = server
    tok = Tokenizer(tiny_dir)
    prompt = "import os\ndef main():\n"
    status, out = await post(url, {"prompt": prompt, "max_tokens": 10, "temperature": 0})
    assert status == 200, out
    want = reference_greedy(tiny_model, tok.encode(prompt), 10)
    cut = next((i for i, t in enumerate(want) if t in tok.eos_ids), len(want))
    assert out["choices"][0]["text"] == tok.decode(want[:cut])
    assert out["usage"]["prompt_tokens"] == len(tok.encode(prompt))
    assert out["object"] == "text_completion" and out["model"] == "tiny"


async def test_streaming_gives_the_same_text(server):
    url, _ = server
    body = {"prompt": "class A:\n", "max_tokens": 12, "temperature": 0.7, "seed": 4}
    _, whole = await post(url, body)
    parts = await stream(url, body)
    assert "".join(p["choices"][0]["text"] for p in parts) == whole["choices"][0]["text"]
    assert parts[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


async def test_suffix_applies_the_fim_template(server):
    url, _ = server
    _, a = await post(url, {"prompt": "x = ", "suffix": "\nprint(x)", "max_tokens": 6, "temperature": 0})
    _, b = await post(url, {"prompt": "<|fim_prefix|>x = <|fim_suffix|>\nprint(x)<|fim_middle|>", "max_tokens": 6,
                            "temperature": 0})
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


async def test_disconnect_stops_the_generation(server):
    url, _ = server
    before = await metric(url, "lingls_cancelled_total")
    async with aiohttp.ClientSession() as s:
        r = await s.post(url + "/v1/completions", headers=AUTH,
                         json={"prompt": "for i in", "max_tokens": 3000, "stream": True, "temperature": 1.0})
        await r.content.readline()
        r.close()  # drop the connection mid-stream
    for _ in range(50):
        if await metric(url, "lingls_cancelled_total") > before:
            break
        await asyncio.sleep(0.1)
    assert await metric(url, "lingls_cancelled_total") == before + 1
    generated = await metric(url, "lingls_generated_tokens_total")
    await asyncio.sleep(0.5)
    assert await metric(url, "lingls_generated_tokens_total") == generated


async def test_a_new_request_preempts_the_running_one(server):
    url, _ = server
    first = asyncio.create_task(post(url, {"prompt": "def f():", "max_tokens": 3000, "temperature": 1.0}))
    await asyncio.sleep(1.5)
    status, second = await post(url, {"prompt": "y = ", "max_tokens": 3, "temperature": 0})
    assert status == 200 and second["choices"][0]["finish_reason"] in ("length", "stop")
    _, out = await first
    assert out["choices"][0]["finish_reason"] == "preempted"
    assert out["usage"]["completion_tokens"] < 3000
    assert await metric(url, "lingls_preempted_total") >= 1


async def test_stop_strings_and_prefix_reuse_metrics(server):
    url, _ = server
    body = {"prompt": "a = 1\nb = 2\n" * 20, "max_tokens": 20, "temperature": 0}
    _, free = await post(url, body)
    text = free["choices"][0]["text"]
    _, again = await post(url, body)
    assert again["choices"][0]["text"] == text
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert await metric(url, "lingls_prefix_tokens_saved_total") > 0
    if len(text) > 3:
        _, cut = await post(url, dict(body, stop=[text[2:4]]))
        assert cut["choices"][0]["text"] == text[:text.index(text[2:4])]


async def test_auth_health_models_and_bad_requests(server):
    url, _ = server
    status, out = await post(url, {"prompt": "x"}, headers={})
    assert status == 401 and "API key" in out["error"]["message"]
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/health") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        async with s.get(url + "/v1/models", headers=AUTH) as r:
            assert (await r.json())["data"][0]["id"] == "tiny"
        async with s.get(url + "/metrics", headers=AUTH) as r:
            text = await r.text()
            assert "lingls_ttft_seconds_count" in text and "lingls_requests_total" in text
    for body, what in [({"prompt": 3}, "prompt"), ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
                       ({"prompt": "x", "n": 2}, "n:"), ({"prompt": "x", "top_p": 2}, "top_p")]:
        status, out = await post(url, body)
        assert status == 400 and what in out["error"]["message"]


def test_serve_fails_clearly_on_a_missing_model(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lingls.cli", "serve", "--model", str(tmp_path / "none")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_serve_fails_with_one_line_on_a_truncated_checkpoint(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    r = subprocess.run([sys.executable, "-m", "lingls.cli", "serve", "--model", str(broken), "--device", "cpu",
                        "--port", "0"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if "model.safetensors" in line]
    assert len(errors) == 1 and "truncated, or not a safetensors file" in errors[0], r.stderr
