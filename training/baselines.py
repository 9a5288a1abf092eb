"""The two baselines ling-nano is measured against, on the same next-line cases.

- repeat-previous-line: the completion is the previous non-blank line, minus what the user already typed on
  the current line when the previous line starts with it (otherwise from the cursor's column on).
- token n-gram: greedy continuation of the tokens left of the cursor by an n-gram model trained on the
  training files (training.ngram), up to the end of the line. The cursor often cuts a token short (after
  indentation, inside a word), so it first tries "token healing": continue from the context without its last
  token and keep the result if it re-spells that token's text; otherwise it continues from the whole context.
"""

from __future__ import annotations

from training.ngram import NGramModel


def current_line_typed(prefix: str) -> str:
    return prefix[prefix.rfind("\n") + 1:]


def repeat_previous_line(prefix: str) -> str:
    typed = current_line_typed(prefix)
    before = prefix[: len(prefix) - len(typed)].rstrip("\n").split("\n")
    previous = next((line for line in reversed(before) if line.strip()), "")
    if previous.startswith(typed):
        return previous[len(typed):]
    return previous[len(typed):] if len(previous) > len(typed) else ""


class NGramCompleter:
    def __init__(self, model: NGramModel, tok, newline_ids: set[int], stop_ids: set[int], context_chars: int = 400):
        self.model, self.tok = model, tok
        self.newline_ids, self.stop_ids = newline_ids, stop_ids
        self.context_chars = context_chars

    def complete(self, prefix: str, max_tokens: int = 48) -> str:
        ctx = self.tok.encode(prefix[-self.context_chars:], add_special_tokens=False).ids
        if len(ctx) > 1:
            tail = self.tok.decode(ctx[-1:])
            healed = self._continue(ctx[:-1], max_tokens + 1, skip=len(tail))
            if healed.startswith(tail):
                return first_line(healed[len(tail):])
        return first_line(self._continue(ctx, max_tokens, skip=0))

    def _continue(self, ctx: list[int], max_tokens: int, skip: int) -> str:
        """Greedy text until a newline past the first `skip` characters, or a special token."""

        def stop(ids: list[int]) -> bool:
            if ids[-1] in self.stop_ids:
                return True
            return ids[-1] in self.newline_ids and "\n" in self.tok.decode(ids)[skip:]

        out = self.model.generate(ctx, max_tokens, stop)
        return self.tok.decode([t for t in out if t not in self.stop_ids])


def first_line(text: str) -> str:
    return text.split("\n", 1)[0]
