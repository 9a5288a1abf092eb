"""Where Triton is absent (torch's CPU wheels, macOS), every module of lingls imports, and the embedded model
completes with a drafter on its reference path, as it does without drafting."""

import subprocess
import sys
import textwrap

CHECK = textwrap.dedent("""
    import asyncio, importlib, pkgutil, sys

    class NoTriton:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "triton":
                raise ModuleNotFoundError(f"No module named {name!r}")

    sys.meta_path.insert(0, NoTriton())
    import lingls
    for module in pkgutil.walk_packages(lingls.__path__, "lingls."):
        importlib.import_module(module.name)
    assert "triton" not in sys.modules

    from lingls.engine.protocol import GenerateRequest
    from lingls.engine.local import EMBEDDED, LocalEngine

    PROMPT = "x = [1, 2, 3]\\ny = [1, 2, 3]\\nz = [1, 2, 3]\\nw = [1, 2"

    async def complete(draft):
        engine = LocalEngine(str(EMBEDDED), device="cpu", draft=draft, draft_k=3)
        try:
            text = "".join([t async for t in engine.generate(GenerateRequest(PROMPT, max_tokens=8, heal=False))])
            return text, engine.runner.spec
        finally:
            await engine.close()

    async def main():
        drafted, spec = await complete("lookup")
        plain, _ = await complete("none")
        assert drafted and drafted == plain, (drafted, plain)
        assert spec.stats.rounds > 0
        print("completed:", repr(drafted))

    asyncio.run(main())
""")


def test_every_module_imports_and_a_drafter_completes_without_triton():
    run = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "completed:" in run.stdout
