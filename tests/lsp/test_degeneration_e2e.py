"""The degeneration guard through the real server path (a `lingls --stdio` process, a scripted engine streaming
what ling-nano wrote at the cursors of issue 38): the ghost text stops at the first repeat, and a completion that
is noise from its first line is no completion at all."""

from lsp_harness import complete, open_doc, serve


def partition(name: str) -> str:
    return (f"def {name}(path):\n    with open(path) as f:\n        for line in f:\n"
            '            key, _, value = line.partition("=")\n')


STACK = "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def pop(self):\n"
BRANCH = "                value = value\n            "
LOOPED_BLOCKS = ("if key in value:\n" + BRANCH + "else:\n" + BRANCH + "if key in value:\n" + BRANCH) * 3
LOOPED_CALL = '"""\n    A wrapper.\n    """\n    return _parse_args(\n        _parse_args(' + "self._parse_args(" * 9
REPEATED_METHOD = 'return self.items.pop()\n\n    def __repr__(self):\n        return "S"\n' * 2
# name: (the document before the cursor's blank line, the cursor's indentation, what the model streams, what is
# shown or None for no completion)
CASES = {
    "a line written twice": (partition("parse"), " " * 12,
                             "if key in line:\n                if key in line:\n            ", "if key in line:"),
    "a two-line block written again": (partition("load"), " " * 12, LOOPED_BLOCKS,
                                       "if key in value:\n                value = value\n            else:\n"
                                       "                value = value"),
    "a word piece looping from the first line": ("import os\nimport sys\n\ndef main():\n", " " * 4,
                                                 "def _run_run_run_run_run_run_run_run_run_run", None),
    "a call looping after a docstring": ("import os\n\ndef run():\n", " " * 4, LOOPED_CALL,
                                         '"""\n    A wrapper.\n    """'),
    "a method repeated after the body": (STACK, " " * 8, REPEATED_METHOD, "return self.items.pop()"),
}


async def test_the_guard_cuts_what_ling_nano_looped_on():
    assert len({doc for doc, *_ in CASES.values()}) == len(CASES)  # each rule matches its own document only
    script = {"rules": [[doc + indent, raw] for doc, indent, raw, _ in CASES.values()], "default": ""}
    async with serve(script) as client:
        for i, (name, (doc, indent, _, shown)) in enumerate(CASES.items()):
            uri = f"file:///work/case{i}.py"
            open_doc(client, doc + indent + "\n", uri=uri)
            items = await complete(client, doc.count("\n"), len(indent), uri=uri)
            assert [item.insert_text for item in items] == ([shown] if shown else []), name
