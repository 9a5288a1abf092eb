"""One inline completion from a language server over stdio, as an editor asks for it, with the standard library
only (it runs in a fresh venv that holds lingls and nothing else):

    python3 stdio_complete.py [--timeout S] -- lingls --stdio

initialize, initialized, didOpen of a small Python file, textDocument/inlineCompletion at its end (invoked),
shutdown, exit. Prints the completion and exits 0 when the first item's text is not empty and the server exits
by itself with status 0 afterwards; otherwise prints what went wrong (with the server's error messages) and
exits 1.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

SOURCE = "def add(a, b):\n    return "
URI = "file:///smoke/add.py"


class Client:
    """JSON-RPC over the server's stdin/stdout with LSP's Content-Length framing; a reader thread collects what
    the server sends."""

    def __init__(self, command: list[str]):
        self.proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.messages: list[dict] = []
        self.handled = 0  # messages[:handled] are dealt with: server requests answered, responses filed
        self.responses: dict[int, dict] = {}
        self.cond = threading.Condition()
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        out = self.proc.stdout
        while True:
            length = None
            while (line := out.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode("ascii").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if not line or length is None:
                break
            message = json.loads(out.read(length))
            with self.cond:
                self.messages.append(message)
                self.cond.notify_all()
        with self.cond:
            self.messages.append({"eof": True})
            self.cond.notify_all()

    def send(self, payload: dict) -> None:
        body = json.dumps({"jsonrpc": "2.0", **payload}).encode()
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        self.proc.stdin.flush()

    def request(self, method: str, params, deadline: float):
        self.next_id += 1
        rid = self.next_id
        self.send({"id": rid, "method": method, "params": params})
        with self.cond:
            while rid not in self.responses:
                for message in self.messages[self.handled:]:
                    if message.get("eof"):
                        raise RuntimeError(f"the server closed its stdout before answering {method}")
                    if "method" in message and "id" in message:  # a request of the server's: answer it plainly
                        self.send({"id": message["id"], "result": None})
                    elif "method" not in message:
                        self.responses[message.get("id")] = message
                    self.handled += 1
                if rid not in self.responses and not self.cond.wait(max(0.0, deadline - time.monotonic())):
                    raise TimeoutError(f"no answer to {method} in time")
        response = self.responses.pop(rid)
        if "error" in response:
            raise RuntimeError(f"{method} failed: {response['error']}")
        return response.get("result")

    def shown(self) -> list[str]:
        """The messages the server showed or logged (window/showMessage, window/logMessage)."""
        return [m["params"]["message"] for m in self.messages
                if m.get("method") in ("window/showMessage", "window/logMessage")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds for the whole exchange")
    parser.add_argument("command", nargs="+", help="the language server's command line (after --)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.timeout
    client = Client(args.command)
    try:
        client.request("initialize", {"processId": None, "rootUri": None, "capabilities": {
            "textDocument": {"inlineCompletion": {"dynamicRegistration": False}}}}, deadline)
        client.send({"method": "initialized", "params": {}})
        client.send({"method": "textDocument/didOpen", "params": {"textDocument": {
            "uri": URI, "languageId": "python", "version": 1, "text": SOURCE}}})
        lines = SOURCE.split("\n")
        result = client.request("textDocument/inlineCompletion", {
            "textDocument": {"uri": URI}, "position": {"line": len(lines) - 1, "character": len(lines[-1])},
            "context": {"triggerKind": 1}}, deadline)
        client.request("shutdown", None, deadline)
        client.send({"method": "exit"})
        rc = client.proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except (RuntimeError, TimeoutError, subprocess.TimeoutExpired, OSError) as e:
        print(f"stdio completion failed: {e}", file=sys.stderr)
        for text in client.shown():
            print(f"  server said: {text}", file=sys.stderr)
        return 1
    finally:
        if client.proc.poll() is None:
            client.proc.kill()
            client.proc.wait()
    items = result.get("items", []) if isinstance(result, dict) else (result or [])
    text = items[0].get("insertText") if items else None
    if isinstance(text, dict):  # a snippet string
        text = text.get("value")
    if not text or not text.strip():
        print(f"stdio completion failed: no completion text in {result!r}", file=sys.stderr)
        for shown in client.shown():
            print(f"  server said: {shown}", file=sys.stderr)
        return 1
    if rc != 0:
        print(f"stdio completion failed: the server exited with status {rc} after shutdown and exit", file=sys.stderr)
        return 1
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
