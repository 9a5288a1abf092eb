"""The rooms of lingls keep to docs/architecture.md: what each may import, no import circles, no private names
taken across modules, and the language server starting without torch. Read from the source (every import, the
ones inside functions too), so it runs in a second on any machine."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lingls"

# room -> the rooms its modules may import (besides its own); a room is lingls/<name>/, or a top-level module
MAY_IMPORT = {
    "lsp": {"engine"},  # engine.protocol at import time; the engines themselves lazily (lsp/engines.py)
    "engine": {"runtime", "model"},
    "serve": {"engine", "runtime", "model", "kernels"},
    "runtime": {"model", "kernels"},
    "model": {"kernels"},
    "kernels": set(),
    "bench": {"lsp", "engine", "serve", "runtime", "model", "kernels"},
    "cli": {"lsp", "engine", "serve", "runtime", "model", "kernels", "bench"},
    "assets": set(),
}
# where `from module import _name` across modules is refused: everywhere (a helper another module needs is public)
NO_PRIVATE_IMPORTS = set(MAY_IMPORT)


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def room(module: str) -> str:
    """lingls.runtime.spec.round -> runtime; lingls.cli -> cli; lingls -> '' (the package: its version)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def imports(module: str) -> list[tuple[str, list[str], int]]:
    """(imported lingls module, names taken from it, line) for every import statement of `module`, wherever it is.
    `from pkg import sub` counts as importing the submodule when `sub` is one."""
    tree = ast.parse(MODULES[module].read_text())
    package = module if MODULES[module].name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "lingls"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "lingls":
                continue
            names = [a.name for a in node.names]
            subs = [n for n in names if f"{base}.{n}" in MODULES]
            found += [(f"{base}.{n}", [], node.lineno) for n in subs]
            rest = [n for n in names if n not in subs]
            if rest or not subs:
                found.append((base, rest, node.lineno))
    return found


def test_each_room_imports_only_what_it_may():
    wrong = []
    for module in MODULES:
        mine = room(module)
        for target, _, line in imports(module):
            theirs = room(target)
            if theirs and theirs != mine and theirs not in MAY_IMPORT[mine]:
                wrong.append(f"{module}:{line} imports {target} ({mine} may import {sorted(MAY_IMPORT[mine])})")
    assert wrong == []


def test_no_import_circles():
    """No module reaches itself through imports (lazy ones included: a circle is a knot either way)."""
    graph = {m: sorted({t for t, _, _ in imports(m) if t in MODULES and t != m}) for m in MODULES}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


def test_no_private_names_imported_across_modules():
    taken = [f"{module}:{line} takes {names} from {target}"
             for module in MODULES if room(module) in NO_PRIVATE_IMPORTS
             for target, names, line in imports(module)
             if target != module and any(n.startswith("_") and not n.startswith("__") for n in names)]
    assert taken == []


@pytest.mark.parametrize("entry", ["lingls.cli", "lingls.lsp.server", "lingls.lsp.session", "lingls.lsp.oneshot",
                                   "lingls.engine", "lingls.engine.protocol"])
def test_the_language_server_starts_without_torch(entry):
    code = f"import sys, {entry}; assert 'torch' not in sys.modules, 'torch was imported'"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
