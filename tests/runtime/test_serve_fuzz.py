"""A bounded fuzz campaign against the real `lingls serve` (embedded ling-nano, CPU, 127.0.0.1, a free port):
random bad requests (invalid, truncated or over-nested JSON, NaN and Infinity, numbers beyond any range, wrong
types, unknown fields, wrong content types, bad API keys, bodies sent slowly in
pieces or never finished) mixed with random valid small requests, over raw sockets.

Every bad request must get a 4xx with an OpenAI-style JSON error body (never a 5xx, a dropped connection or a
traceback in the server's log), every valid one a completion, each within HANG_S; the server must answer
/health, prompts holding lone surrogates (valid JSON escapes, served as U+FFFD) and a completion afterwards, and exit
cleanly on SIGTERM. Hypothesis draws the cases derandomized (the same cases every run). Run with -s to see the
counts."""

from __future__ import annotations

import collections
import json
import signal
import socket
import subprocess
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..remote.harness import ENV, REPO, free_port

KEY = "fuzz-key"
HANG_S = 20.0  # a request not answered by then counts as a hang (a valid one takes well under a second)
EXAMPLES_PER_KIND = 8
EXAMPLES_OF = {"wrong_value": 30}  # one field of 13 at a time: more cases

counts: collections.Counter = collections.Counter()


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "serve.log"
    port = free_port()
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "lingls.cli", "serve", "--device", "cpu", "--host", "127.0.0.1",
                                 "--port", str(port), "--api-key", KEY], stderr=err, env=ENV, cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if exchange(port, "GET", "/health", b"", auth=False).status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail(f"lingls serve did not start: {log.read_text()}")
        yield proc, port, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


class Reply:
    def __init__(self, raw: bytes):
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        self.status = int(lines[0].split()[1]) if lines[0].startswith(("HTTP/1.1 ", "HTTP/1.0 ")) else None
        self.headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        if self.headers.get("transfer-encoding") == "chunked":
            self.body = _dechunk(self.body)

    def json(self):
        return json.loads(self.body)


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, data = data.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        if n == 0:
            break
        out, data = out + data[:n], data[n + 2:]
    return out


def exchange(port: int, method: str, path: str, body: bytes, content_type: str | None = "application/json",
             auth: bool | bytes = True, pieces: int = 1, pause: float = 0.0, length: int | None = None) -> Reply:
    """One request on its own connection (Connection: close), the body sent in `pieces` with `pause` between;
    `length` other than len(body) declares a body that never fully comes (the client then stops sending)."""
    head = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close",
            f"Content-Length: {len(body) if length is None else length}"]
    if content_type is not None:
        head.append(f"Content-Type: {content_type}")
    head = "\r\n".join(head).encode() + b"\r\n"
    if auth is True:
        head += f"Authorization: Bearer {KEY}\r\n".encode()
    elif auth:
        head += b"Authorization: " + auth + b"\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=HANG_S) as sock:
        try:
            sock.sendall(head + b"\r\n")
            step = max(1, -(-len(body) // pieces))
            for i in range(0, len(body), step):
                if i:
                    time.sleep(pause)
                sock.sendall(body[i:i + step])
            if length is not None and length != len(body):
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered (and closed) before the whole body came: its answer is still there to read
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    return Reply(raw)


# ---- the cases ------------------------------------------------------------------------------------------------
short_text = st.text(st.characters(codec="utf-8", categories=("L", "N", "P", "Zs")), min_size=1, max_size=12)
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                        st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
json_value = st.recursive(json_scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                               st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                          max_leaves=6)


@st.composite
def valid_request(draw) -> dict:
    body = {"prompt": draw(short_text), "max_tokens": draw(st.integers(0, 3))}
    if draw(st.booleans()):
        body["temperature"] = draw(st.floats(0, 2))
    if draw(st.booleans()):
        body["top_p"] = draw(st.floats(0, 1))
    if draw(st.booleans()):
        body["seed"] = draw(st.integers(-2**63, 2**63 - 1))
    if draw(st.booleans()):
        body["stop"] = draw(st.lists(short_text, max_size=4))
    if draw(st.booleans()):
        body["suffix"] = draw(st.text(max_size=8))
    if draw(st.booleans()):
        body["stream"] = True
        if draw(st.booleans()):
            body["stream_options"] = {"include_usage": draw(st.booleans())}
    if draw(st.booleans()):
        body["token_healing"] = draw(st.booleans())
    if draw(st.booleans()):
        body["min_line_probability"] = draw(st.floats(0, 0.999))
    return body


# values each field must refuse: wrong types, or numbers out of its range
WRONG = {
    "prompt": st.one_of(st.just(""), st.just([]), st.integers(),
                        st.dictionaries(st.text(max_size=3), json_scalar, max_size=2),
                        st.lists(st.integers(-10, -1), min_size=1, max_size=3),
                        st.lists(st.text(), min_size=2, max_size=3)),
    "max_tokens": st.one_of(st.integers(max_value=-1), st.integers(min_value=5000), st.floats(), st.text(),
                            st.booleans()),
    "temperature": st.one_of(st.floats(min_value=2.0, exclude_min=True), st.floats(max_value=0.0, exclude_max=True),
                             st.text(), st.booleans(), st.lists(json_scalar, max_size=2)),
    "top_p": st.one_of(st.floats(min_value=1.0, exclude_min=True), st.floats(max_value=0.0, exclude_max=True),
                       st.text()),
    "seed": st.one_of(st.integers(min_value=2**63), st.integers(max_value=-2**63 - 1), st.floats(), st.text()),
    "stop": st.one_of(st.integers(), st.lists(st.text(max_size=3), min_size=5, max_size=7),
                      st.text(min_size=1025, max_size=1030), st.lists(st.integers(), min_size=1, max_size=2)),
    "stream": st.one_of(st.integers(), st.text(), st.lists(json_scalar, max_size=2)),
    "stream_options": st.one_of(st.integers(), st.text(), st.lists(json_scalar, max_size=2),
                                st.dictionaries(st.text(min_size=1, max_size=4).filter(lambda k: k != "include_usage"),
                                                json_scalar, min_size=1, max_size=2)),
    "suffix": st.one_of(st.integers(), st.lists(json_scalar, max_size=2), st.booleans()),
    "token_healing": st.one_of(st.integers(), st.text(), st.lists(json_scalar, max_size=2)),
    "min_line_probability": st.one_of(st.floats(min_value=0.999, exclude_min=True), st.floats(max_value=0.0,
                                      exclude_max=True), st.text(), st.booleans()),
    "n": st.integers(2, 10**6), "echo": st.just(True), "logprobs": st.integers(1, 5),
    "model": st.one_of(st.integers(), st.lists(json_scalar, max_size=2)),
}
FIELDS = {"prompt", "suffix", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options",
          "token_healing", "min_line_probability", "model", "user", "n", "best_of", "echo", "logprobs",
          "presence_penalty", "frequency_penalty", "logit_bias"}


def _text(body: dict) -> bytes:
    return json.dumps(body).encode()


KINDS = ["wrong_value", "extra_field", "invalid_json", "truncated_json", "constant", "huge_number", "deep",
         "not_object", "content_type", "bad_key", "malformed_http", "not_utf8"]


@st.composite
def bad_request(draw, kind: str) -> dict:
    """exchange()'s keyword arguments for a request of this kind, which must be refused with a 4xx."""
    valid = draw(valid_request())
    body = _text(valid)
    args: dict = {}
    if kind == "wrong_value":
        key = draw(st.sampled_from(sorted(WRONG)))
        if key == "stream_options":
            valid["stream"] = True
        valid[key] = draw(WRONG[key])
        body = _text(valid)
    elif kind == "extra_field":
        valid[draw(st.text(min_size=1, max_size=10).filter(lambda k: k not in FIELDS))] = draw(json_value)
        body = _text(valid)
    elif kind == "invalid_json":
        body = draw(st.sampled_from([b"", b"{", b"}", b"{'prompt': 'x'}", b'{"prompt": "x",}', b'{"prompt" "x"}',
                                     b"prompt=x", b"nul", b'{"prompt": "x"} trailing', b'"\\x"']))
    elif kind == "truncated_json":
        body = body[: draw(st.integers(0, len(body) - 1))]
    elif kind == "constant":
        key = draw(st.sampled_from(["temperature", "top_p", "max_tokens", "seed"]))
        body = body[:-1] + f', "{key}": {draw(st.sampled_from(["NaN", "Infinity", "-Infinity"]))}}}'.encode()
    elif kind == "huge_number":
        key = draw(st.sampled_from(["temperature", "top_p", "max_tokens", "seed", "n"]))
        number = draw(st.sampled_from(["1e400", "-1e400", "1e308", "9" * 5000, "-" + "9" * 30, "1" + "0" * 20]))
        body = body[:-1] + f', "{key}": {number}}}'.encode()
    elif kind == "deep":
        depth = draw(st.sampled_from([10_000, 100_000]))
        body = body[:-1] + b', "x": ' + b"[" * depth + b"]" * depth + b"}"
    elif kind == "not_object":
        body = json.dumps(draw(st.one_of(json_scalar, st.lists(json_value, max_size=3)))).encode()
    elif kind == "content_type":
        args["content_type"] = draw(st.sampled_from(["text/plain", "multipart/form-data; boundary=x",
                                                     "text/html; charset=utf-8"]))
    elif kind == "bad_key":
        args["auth"] = draw(st.sampled_from([b"", b"Bearer", b"Bearer wrong", b"Basic Zm9vOmJhcg==", b"Bearer \xe9\xff",
                                             b"Bearer \xc3\xa9", ("Bearer " + KEY + "x").encode()]))
    elif kind == "malformed_http":  # refused by aiohttp's parser before any handler: a plain-text 400
        args["auth"] = draw(st.sampled_from([b"Bearer fuzz-key\x7f", b"Bearer \x01", b"Bearer fuzz-key\x00"]))
    elif kind == "not_utf8":
        body = body[:-1] + b', "user": "\xff\xfe"}'
    if draw(st.integers(0, 4)) == 0:  # sometimes slowly, in pieces
        args.update(pieces=draw(st.integers(2, 4)), pause=0.05)
    return dict(args, body=body)


def check_refused(reply: Reply, kind: str) -> None:
    assert reply.status is not None, f"{kind}: the connection was dropped"
    assert 400 <= reply.status < 500, f"{kind}: HTTP {reply.status} {reply.body[:200]!r}"
    if kind == "malformed_http":
        return
    error = reply.json()["error"]
    assert error["type"] in ("invalid_request_error", "authentication_error") and error["message"], error
    assert set(error) == {"message", "type", "param", "code"}


def check_completed(reply: Reply, body: dict) -> None:
    assert reply.status == 200, f"HTTP {reply.status} {reply.body[:300]!r} for {body}"
    if body.get("stream"):
        assert reply.body.rstrip().endswith(b"data: [DONE]"), reply.body[-200:]
    else:
        assert reply.json()["choices"][0]["finish_reason"] in ("stop", "length")


def timed(port: int, **kwargs) -> Reply:
    t0 = time.monotonic()
    try:
        reply = exchange(port, "POST", "/v1/completions", **kwargs)
    except socket.timeout:
        counts["hangs"] += 1
        raise
    except ConnectionError:
        counts["dropped"] += 1
        raise
    counts["tried"] += 1
    counts["max_latency_ms"] = max(counts["max_latency_ms"], int((time.monotonic() - t0) * 1000))
    if reply.status is None:
        counts["dropped"] += 1
    else:
        counts[f"{reply.status // 100}xx"] += 1
    return reply


def test_serve_refuses_every_bad_request_and_serves_the_rest(serve):
    proc, port, log = serve

    for kind in KINDS:  # each kind of bad request, each followed by a valid one

        @settings(derandomize=True, max_examples=EXAMPLES_OF.get(kind, EXAMPLES_PER_KIND), deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(bad_request(kind), valid_request())
        def bad_then_valid(bad, valid):
            check_refused(timed(port, **bad), kind)
            counts[f"bad:{kind}"] += 1
            check_completed(timed(port, body=_text(valid)), valid)

        bad_then_valid()

    # lone surrogates are valid JSON escapes, and an editor's document can hold one: text that carries them is
    # served (the tokenizer reads each as U+FFFD), not refused, so one odd file cannot stop completions
    for key in ("prompt", "suffix", "stop", "user"):
        for escape in ("\\ud800", "x\\udbff", "\\udc00y"):
            body = f'{{"prompt": "s = 1", "max_tokens": 2, "{key}": "{escape}"}}'.encode()
            check_completed(timed(port, body=body), {})
            counts["lone_surrogate"] += 1

    # bodies that never fully arrive: the client gives up; the server must neither crash nor stop answering
    for declared, sent in [(100, b'{"prompt": "x"'), (10, b""), (1 << 20, b"{" * 1000)]:
        exchange(port, "POST", "/v1/completions", sent, length=declared)
        counts["incomplete"] += 1
        check_completed(timed(port, body=b'{"prompt": "x = ", "max_tokens": 2}'), {})

    assert exchange(port, "GET", "/health", b"", auth=False).status == 200
    check_completed(timed(port, body=b'{"prompt": "def f():", "max_tokens": 3, "temperature": 0}'), {})
    print("\nserve fuzz:", dict(sorted(counts.items())))
    assert counts["5xx"] == 0 and counts["hangs"] == 0 and counts["dropped"] == 0

    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert proc.returncode == 0
    text = log.read_text()
    assert "Traceback" not in text and "Error handling request" not in text, text[-3000:]
