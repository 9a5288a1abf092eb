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

from lingls.engine.tokenizer import Tokenizer

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


CLIENT_ERRORS = [  # (body, param): each a 400 naming the field, before any response starts
    ({"prompt": ""}, "prompt"),
    ({"prompt": [""]}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": "x", "max_tokens": 4095}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**12}, "max_tokens"),
    ({"prompt": "x", "max_tokens": 1e12}, "max_tokens"),
    ({"prompt": "x", "temperature": 1e308}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": -0.5}, "top_p"),
    ({"prompt": "x", "seed": 10**30}, "seed"),
    ({"prompt": "x", "stream": "yes"}, "stream"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": "x", "stop": "s" * 900_000}, "stop"),
    ({"prompt": "x", "stop": [1]}, "stop"),
    ({"prompt": "x", "suffix": 3}, "suffix"),
    ({"prompt": "x", "token_healing": "on"}, "token_healing"),
    ({"prompt": "x", "logit_bias": {"1": 5}}, "logit_bias"),
    ({"prompt": "x", "max_token": 5}, "max_token"),
]


@pytest.mark.parametrize("stream", [False, True])
async def test_client_errors_are_400_with_an_openai_error_body(server, stream):
    url, log = server
    for body, param in CLIENT_ERRORS:
        if stream and param not in ("stream", "stream_options"):
            body = dict(body, stream=True)
        async with aiohttp.ClientSession() as s:
            async with s.post(url + "/v1/completions", json=body, headers=AUTH) as r:
                assert r.status == 400 and r.content_type == "application/json", (body, r.status, await r.text())
                out = await r.json()
        assert out["error"]["type"] == "invalid_request_error" and out["error"]["message"], out
        assert set(out["error"]) == {"message", "type", "param", "code"}
        assert out["error"]["param"] == param, (body, out)
    status, out = await post(url, {"prompt": "x = ", "max_tokens": 2, "temperature": 0})
    assert status == 200 and out["usage"]["completion_tokens"] <= 2
    assert "Traceback" not in log.read_text()


async def test_bodies_that_are_not_json_objects_are_400(server):
    url, log = server
    async with aiohttp.ClientSession() as s:
        for data in [b'{"prompt": "x", "temperature": NaN}', b'{"prompt": "x", "top_p": Infinity}', b"[1, 2]",
                     b'{"prompt": "x"', b"\xff\xfe{}", b"[" * 100_000 + b"]" * 100_000,
                     b'{"prompt": "x", "n": 1' + b"0" * 5000 + b"}"]:
            async with s.post(url + "/v1/completions", data=data,
                              headers=dict(AUTH, **{"Content-Type": "application/json"})) as r:
                assert r.status == 400, (data[:40], await r.text())
                assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with s.post(url + "/v1/completions", data=b'{"prompt": "x"}',
                          headers=dict(AUTH, **{"Content-Type": "text/plain"})) as r:
            assert r.status == 415 and "application/json" in (await r.json())["error"]["message"]
        form = {"Content-Type": "application/x-www-form-urlencoded"}  # what `curl -d` sends: the body is still JSON
        async with s.post(url + "/v1/completions", data=b'{"prompt": "x", "max_tokens": 1}',
                          headers=dict(AUTH, **form)) as r:
            assert r.status == 200, await r.text()
        async with s.post(url + "/v1/completions", data=b"x" * (2 << 20), headers=AUTH) as r:
            assert r.status == 413 and (await r.json())["error"]["type"] == "invalid_request_error"
    assert "Traceback" not in log.read_text()


async def test_a_non_ascii_authorization_header_is_401(server):
    url, _ = server
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    body = b'{"prompt": "x"}'
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xe9\xff\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                 b"Connection: close\r\n\r\n%s" % (len(body), body))
    reply = await reader.read()
    writer.close()
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "invalid_api_key"


async def test_token_healing_of_a_one_token_prompt(server):
    url, _ = server
    status, out = await post(url, {"prompt": "x", "max_tokens": 2, "token_healing": True, "temperature": 0})
    assert status == 200, out
