"""`lingls complete PATH:LINE:COL`: print the completion at a cursor, the way the language server would.

The same core as the server (session.Core: prompt, generation, post-processing), without LSP. It answers as an
editor's Invoked request (no confidence gate), or with `--typing` as an automatic one while typing (the gate at
minLineProbability: an unlikely line is not shown). LINE and COL are 1-based like
compiler messages; COL counts characters (code points). Exit status: 0 with a completion, 1 without one (the
reason, if any, on stderr), 2 for a malformed location or a missing file.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from lingls.lsp.positions import UTF32
from lingls.lsp.session import Core
from lingls.lsp.settings import from_cli

# File suffix -> LSP language id, for the post-processing rules (unknown: generic rules).
LANGUAGE_IDS = {
    ".py": "python", ".pyi": "python", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp",
    ".rs": "rust", ".go": "go", ".java": "java", ".js": "javascript", ".jsx": "javascriptreact",
    ".ts": "typescript", ".tsx": "typescriptreact", ".rb": "ruby", ".sh": "shellscript", ".lua": "lua",
    ".kt": "kotlin", ".swift": "swift", ".cs": "csharp", ".php": "php", ".scala": "scala", ".sql": "sql",
}


class _Stderr:
    def log(self, level: str, message: str) -> None:
        if level in ("error", "warning"):
            print(message, file=sys.stderr)

    def show(self, level: str, message: str) -> None:
        pass  # already printed by log()

    def loading(self, what: str) -> None:
        pass

    def loaded(self, outcome: str) -> None:
        pass


def parse_location(location: str) -> tuple[str, int, int]:
    path, line, col = location.rsplit(":", 2)
    if int(line) < 1 or int(col) < 1:
        raise ValueError("LINE and COL start at 1")
    return path, int(line), int(col)


async def complete_file(path: Path, line: int, col: int, args: Any) -> str | None:
    """The completion at 1-based (line, col) of the file at `path`, or None."""
    settings = from_cli(args)
    if not getattr(args, "typing", False):  # asked for, as an Invoked request: whatever its probability
        settings = replace(settings, min_line_probability=0.0)
    core = Core(_Stderr(), settings)
    core.initialize(None, UTF32, path.parent.resolve().as_uri())
    uri = path.resolve().as_uri()
    core.open(uri, LANGUAGE_IDS.get(path.suffix, ""), 0, path.read_text(encoding="utf-8", errors="replace"))
    try:
        items = await core.complete(uri, line - 1, col - 1)
    finally:
        await core.shutdown()
    return items[0].text if items else None


def main(args: Any) -> int:
    try:
        path, line, col = parse_location(args.location)
    except ValueError:
        print(f"lingls complete: expected PATH:LINE:COL (1-based), got {args.location!r}", file=sys.stderr)
        return 2
    if not Path(path).is_file():
        print(f"lingls complete: no such file: {path}", file=sys.stderr)
        return 2
    text = asyncio.run(complete_file(Path(path), line, col, args))
    if text is None:
        return 1
    print(text)
    return 0
