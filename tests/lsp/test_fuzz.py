"""A bounded fuzz campaign against the real `lingls --stdio` process (issue 37, item 4, the language server's half).

Hypothesis (derandomized: the same inputs on every run) drives one server per position encoding with documents
in every line ending, holding emoji, CJK and lone surrogates, through random incremental edits (didChange
ranges, several per message, whole-text replacements, positions past the end) interleaved with framing faults
(short and long Content-Length, no or non-numeric header, garbage, split writes) and bad JSON-RPC (batches, a
wrong or missing `jsonrpc`, bad ids, unknown methods, params of the wrong type). After every step a well-formed
request must be answered within ANSWER_S seconds, after exactly the errors the bad input calls for. After
each document's edits the server's text is read back through the prompt the scripted engine receives for a
completion at the document's end (the whole document fits its budget; lone surrogates reach a model as U+FFFD)
and compared with a reference model of the edits written here, independent of lingls.lsp.positions. The
server's stderr must hold no traceback, and `shutdown` + `exit` must end it with code 0.
"""

from __future__ import annotations

import itertools
import json
import queue
import re
import subprocess
import sys
import threading
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lsp_harness import server_env

ENCODINGS = ("utf-16", "utf-8", "utf-32")
EOLS = ("\n", "\r\n", "\r")
ANSWER_S = 10.0  # a well-formed request not answered within this is a hang
EXAMPLES = 50  # documents per encoding
PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS = -32700, -32600, -32601, -32602
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"
STATS = {"command": "lingls.stats", "arguments": []}
COUNTS: Counter = Counter()  # over the whole module; printed by the last test

_EOL = re.compile(r"\r\n?|\n")
_SURROGATE = re.compile("[\ud800-\udfff]")


# ---- the reference model of a document, in LSP terms ---------------------------------------------------------

def units(text: str, encoding: str) -> int:
    if encoding == "utf-32":
        return len(text)
    data = text.encode("utf-16-le" if encoding == "utf-16" else "utf-8", "surrogatepass")
    return len(data) // (2 if encoding == "utf-16" else 1)


def lines_of(text: str) -> list[tuple[int, int]]:
    """(start, end before the line ending) of each line."""
    spans, start = [], 0
    for m in _EOL.finditer(text):
        spans.append((start, m.start()))
        start = m.end()
    return spans + [(start, len(text))]


def offset_of(text: str, line: int, column: int, encoding: str) -> int:
    """The LSP's reading of a position: past the last line is the end, past a line's end is that end; inside a
    character (half an emoji in UTF-16, a byte inside 中 in UTF-8) it is that character's start."""
    spans = lines_of(text)
    if line >= len(spans):
        return len(text)
    start, end = spans[line]
    for i in range(start + 1, end + 1):
        if units(text[start:i], encoding) > column:
            return i - 1
    return end


# ---- a client speaking raw bytes to the real server ----------------------------------------------------------

class Server:
    def __init__(self, encoding: str):
        self.encoding = encoding
        self.proc = subprocess.Popen([sys.executable, "-m", "lingls.cli", "--stdio"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=server_env({"default": "x"}))
        self.inbox: queue.Queue = queue.Queue()
        self.stderr: list[bytes] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        self.ids = itertools.count(1)
        self.uris = itertools.count(1)
        init = self.request("initialize", {
            "processId": None, "rootUri": "file:///fuzz", "initializationOptions": {"contextChunks": 0},
            "capabilities": {"general": {"positionEncodings": [encoding]}}})
        assert init["result"]["capabilities"]["positionEncoding"] == encoding
        self.send({"method": "initialized", "params": {}})

    def _read_stdout(self) -> None:
        out = self.proc.stdout
        while True:
            length = None
            while (line := out.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            if not line or length is None:
                return
            self.inbox.put(json.loads(out.read(length)))

    def write(self, data: bytes) -> None:
        self.proc.stdin.write(data)
        self.proc.stdin.flush()

    def send(self, message: dict, ascii_only: bool = True, pieces: list[int] = ()) -> None:
        """Frame and write `message`; `pieces`: byte offsets where the write is split."""
        body = json.dumps({"jsonrpc": "2.0", **message}, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
        data = frame(body)
        COUNTS["messages"] += 1
        cuts = sorted({min(max(p, 0), len(data)) for p in pieces})
        for a, b in zip([0, *cuts], [*cuts, len(data)]):
            if b > a:
                self.write(data[a:b])

    def answered(self, msg_id: int) -> tuple[dict, list[dict]]:
        """The answer to `msg_id`, and the responses (to nothing the client is waiting for) before it."""
        before = []
        while True:
            try:
                message = self.inbox.get(timeout=ANSWER_S)
            except queue.Empty:
                COUNTS["hangs"] += 1
                raise AssertionError(f"no answer to request {msg_id} within {ANSWER_S} s") from None
            if "method" in message:
                continue  # the server's own notifications (logMessage)
            if message.get("id") == msg_id:
                return message, before
            before.append(message)
            COUNTS["errors answered"] += "error" in message

    def request(self, method: str, params) -> dict:
        msg_id = next(self.ids)
        self.send({"id": msg_id, "method": method, "params": params})
        answer, before = self.answered(msg_id)
        assert not before, before
        return answer

    def sync(self) -> list[dict]:
        """A well-formed request after some input: the responses the input got before its answer."""
        msg_id = next(self.ids)
        self.send({"id": msg_id, "method": "workspace/executeCommand", "params": STATS})
        answer, before = self.answered(msg_id)
        assert "result" in answer, answer
        return before

    def close(self) -> tuple[int, str]:
        answer = self.request("shutdown", None)
        assert answer.get("result", 1) is None, answer
        self.send({"method": "exit"})
        code = self.proc.wait(timeout=ANSWER_S)
        return code, b"".join(self.stderr).decode(errors="replace")


def frame(body: bytes, length: int | None = None) -> bytes:
    return b"Content-Length: %d\r\n\r\n" % (len(body) if length is None else length) + body


@pytest.fixture(scope="module", params=ENCODINGS)
def server(request):
    s = Server(request.param)
    try:
        yield s
        code, err = s.close()
        assert code == 0 and "Traceback" not in err, err
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


# ---- what is sent ---------------------------------------------------------------------------------------------

PIECES = ["a", "b", "x = 1", " ", "\t", "(", "é", "中文", "😀", "🎉x", "\ud800", "\udfff", "\ud83d", "\ude00"]


def texts(eol: str):
    """Text as the server will read it: a high and a low surrogate side by side are one character in JSON."""
    piece = st.sampled_from(PIECES) | st.just(eol) | st.sampled_from(EOLS)
    return st.lists(piece, max_size=12).map(lambda pieces: json.loads(json.dumps("".join(pieces))))


def position(data, text: str, encoding: str) -> tuple[int, int]:
    """A position in `text`: on a character boundary, or some units further (inside a character, past the
    line's end), or past the last line."""
    spans = lines_of(text)
    line = data.draw(st.integers(0, len(spans)))
    if line == len(spans):
        return line + data.draw(st.integers(0, 2)), data.draw(st.integers(0, 3))
    start, end = spans[line]
    index = data.draw(st.integers(start, end))
    return line, units(text[start:index], encoding) + data.draw(st.sampled_from([0, 0, 0, 5]))


def framing_fault(data) -> bytes:
    good = json.dumps({"jsonrpc": "2.0", "id": 10**6, "method": "workspace/executeCommand",
                       "params": STATS}).encode()
    kind = data.draw(st.sampled_from(["short", "long", "no header", "non-numeric", "garbage", "two lengths"]))
    COUNTS[f"fault: {kind}"] += 1
    if kind == "short":
        return frame(good, len(good) - data.draw(st.integers(1, len(good))))
    if kind == "long":
        return frame(good, len(good) + data.draw(st.integers(1, 5000)))
    if kind == "no header":
        return good
    if kind == "non-numeric":
        return b"Content-Length: %b\r\n\r\n" % data.draw(st.sampled_from([b"", b"x1", b"-5", b"1e3"])) + good
    if kind == "two lengths":
        return b"Content-Length: 5\r\nContent-Length: 9\r\n"
    return data.draw(st.binary(min_size=1, max_size=300) | st.sampled_from(
        [b"\r\n\r\n", b"Content-Length: 12", b"Content-Length: 99999\r\n\r\n", b"\xff\xfe\x00{}\r\n"]))


def bad_rpc(data, uri: str) -> tuple[object, list[tuple[object, int | None]]]:
    """A message and the (id, error code) answers it must get (code None: any error)."""
    i = 10**7 + data.draw(st.integers(0, 10**6))
    complete = {"textDocument": {"uri": uri}, "position": {"line": 0, "character": 0}, "context": {"triggerKind": 1}}
    kind = data.draw(st.sampled_from(["batch", "jsonrpc", "no jsonrpc", "bad id", "unknown method", "param types",
                                      "bad notification", "not an object", "bad utf-8"]))
    COUNTS[f"rpc: {kind}"] += 1
    if kind == "batch":
        n = data.draw(st.integers(1, 3))
        return [{"jsonrpc": "2.0", "id": i + k, "method": "shutdown"} for k in range(n)], \
            [(i + k, INVALID_REQUEST) for k in range(n)]
    if kind == "jsonrpc":
        version = data.draw(st.sampled_from(["1.0", 2, None, "2.0 "]))
        return {"jsonrpc": version, "id": i, "method": "shutdown"}, [(i, INVALID_REQUEST)]
    if kind == "no jsonrpc":
        return {"id": i, "method": "workspace/executeCommand", "params": STATS}, [(i, INVALID_REQUEST)]
    if kind == "bad id":
        bad = data.draw(st.sampled_from([1.5, True, None, [1], {"a": 1}]))
        return {"jsonrpc": "2.0", "id": bad, "method": "shutdown"}, [(None, INVALID_REQUEST)]
    if kind == "unknown method":
        return {"jsonrpc": "2.0", "id": i, "method": data.draw(st.sampled_from(["x/y", "", "textDocument/nope"])),
                "params": {}}, [(i, METHOD_NOT_FOUND)]
    if kind == "param types":
        broken = data.draw(st.sampled_from([{**complete, "position": "here"}, {**complete, "textDocument": 5},
                                            {**complete, "context": None}, {"position": [1, 2]}]))
        return {"jsonrpc": "2.0", "id": i, "method": "textDocument/inlineCompletion", "params": broken}, \
            [(i, INVALID_PARAMS)]
    if kind == "bad notification":  # notifications are never answered; the document must not change
        change = data.draw(st.sampled_from([{"contentChanges": "x"}, {"contentChanges": [{"range": 5, "text": "q"}]},
                                            {"contentChanges": [{"text": 5}]}]))
        return {"jsonrpc": "2.0", "method": "textDocument/didChange",
                "params": {"textDocument": {"uri": uri, "version": 1}, **change}}, []
    if kind == "not an object":
        return data.draw(st.sampled_from([1, "x", None, []])), [(None, INVALID_REQUEST)]
    return b'{"jsonrpc": "2.0", "id": %d, "method": "shutdown", "params": "\xff"}' % i, [(i, PARSE_ERROR)]


# ---- the campaign ---------------------------------------------------------------------------------------------

@settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_fuzz_edits_framing_and_json_rpc(server, data):
    enc = server.encoding
    eol = data.draw(st.sampled_from(EOLS))
    uri = f"file:///fuzz/doc{next(server.uris)}.py"
    text = data.draw(texts(eol))
    server.send({"method": "textDocument/didOpen",
                 "params": {"textDocument": {"uri": uri, "languageId": "python", "version": 1, "text": text}}})
    for version in range(2, 2 + data.draw(st.integers(1, 8))):
        step = data.draw(st.sampled_from(["edit", "edit", "edit", "framing", "rpc"]))
        expected: list = []
        if step == "edit":
            changes = []
            for _ in range(data.draw(st.integers(1, 3))):
                new = data.draw(texts(eol))
                if data.draw(st.integers(0, 9)) == 0:
                    changes.append({"text": new})
                    text = new
                    continue
                a, b = sorted([position(data, text, enc), position(data, text, enc)])
                start, end = offset_of(text, *a, enc), offset_of(text, *b, enc)
                text = text[:start] + new + text[max(start, end):]
                changes.append({"range": {"start": {"line": a[0], "character": a[1]},
                                          "end": {"line": b[0], "character": b[1]}}, "text": new})
            COUNTS["edits"] += len(changes)
            message = {"method": "textDocument/didChange",
                       "params": {"textDocument": {"uri": uri, "version": version}, "contentChanges": changes}}
            ascii_only = data.draw(st.booleans()) or _SURROGATE.search(json.dumps(changes, ensure_ascii=False))
            pieces = data.draw(st.lists(st.integers(0, 400), max_size=3))
            server.send(message, ascii_only=bool(ascii_only), pieces=pieces)
            COUNTS["split writes"] += bool(pieces)
        elif step == "framing":
            server.write(framing_fault(data))
            COUNTS["messages"] += 1
            expected = "parse errors"
        else:
            message, expected = bad_rpc(data, uri)
            server.write(frame(message if isinstance(message, bytes) else json.dumps(message).encode()))
            COUNTS["messages"] += 1
        got = [m for m in server.sync() if "error" in m]
        if expected == "parse errors":
            assert got and all(m["error"]["code"] == PARSE_ERROR for m in got), got
        else:
            assert sorted((m["id"], m["error"]["code"]) for m in got) == sorted(expected, key=repr) or (
                len(got) == len(expected) and all(m["id"] == i and c is None for m, (i, c) in zip(got, expected))), \
                (got, expected)
        assert all(m["error"]["message"] for m in got)
    assert server_text(server, uri, text) == _SURROGATE.sub("\ufffd", text)
    server.send({"method": "textDocument/didClose", "params": {"textDocument": {"uri": uri}}})


def server_text(server: Server, uri: str, text: str) -> str:
    """The document as the server holds it: the prompt for a completion at its end is the whole of it."""
    spans = lines_of(text)
    end = {"line": len(spans) - 1, "character": units(text[spans[-1][0] :], server.encoding)}
    answer = server.request("textDocument/inlineCompletion", {
        "textDocument": {"uri": uri}, "position": end, "context": {"triggerKind": 1}})
    assert "result" in answer, answer
    COUNTS["completions"] += 1
    prompt = server.request("workspace/executeCommand", STATS)["result"]["engine"]["extra"]["prompts"][-1]
    assert prompt.startswith(FIM_PREFIX) and prompt.endswith(FIM_SUFFIX + FIM_MIDDLE), prompt
    return prompt[len(FIM_PREFIX) : -len(FIM_SUFFIX + FIM_MIDDLE)]


def test_fuzz_counts():
    """The campaign's counts, for the record (run with -s to see them)."""
    print("\nlingls fuzz:", ", ".join(f"{k} {v}" for k, v in sorted(COUNTS.items())))
    assert COUNTS["hangs"] == 0
