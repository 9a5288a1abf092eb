"""Completion on held-out files: ling-nano against the two baselines, on the same cases.

A case is a cursor in a held-out file and the text the user would want inserted there (never more than the rest
of one line). Next-line kinds (the rest of the line is the expected completion):
- line_start: the cursor after the line's indentation (where an editor leaves it after Enter); the expected
  completion is the whole code of the line.
- mid_line: the cursor at a random column inside the line's code; the expected completion is the rest of it.
Suffix-aware (fill-in-the-middle) kinds, where code after the cursor says what belongs there:
- block_middle: line_start on a line in the middle of an indented block (the block goes on after it).
- arg_list: the cursor just after an opening bracket whose closing bracket is already on the line; expected: the
  text between them.
- line_end_typed: the line's closing punctuation (`):`, `)`, `]`, ...) is already typed; the cursor at a random
  column before it; expected: the text between the cursor and that end.
The text after the cursor is the suffix (the model sees it in a FIM prompt; the baselines don't use it). Every
predictor's raw line goes through lingls' own post-processing (lingls.lsp.postprocess.clean, one-line rules: the
degeneration guard, and the end that repeats the text after the cursor dropped), as a user would see it.
Metrics per predictor and kind: exact match (after stripping trailing whitespace) and edit similarity
(rapidfuzz's normalised Indel similarity, 0-1); degenerate raw lines (a repeated line or a looping unit, what
the guard removes) are counted before and after post-processing.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch
from rapidfuzz import fuzz

from lingls.engine.healing import Candidates, heal, strip_tail
from lingls.lsp.postprocess import PYTHON, Site, clean, is_degenerate
from lingls.lsp.prompt import MAX_SUFFIX_LINES
from training.baselines import first_line
from training.fim import SPECIAL_ID
from training.tokenizer import FIM_MIDDLE, FIM_PREFIX, FIM_SUFFIX, SPECIAL_TOKENS

NEXT_LINE_KINDS = ("line_start", "mid_line")
FIM_KINDS = ("block_middle", "arg_list", "line_end_typed")
KINDS = NEXT_LINE_KINDS + FIM_KINDS
_CLOSERS = ")]}:,;'\""


@dataclass(frozen=True)
class Case:
    name: str
    kind: str
    line: int  # 1-based
    column: int  # 1-based, in characters
    prefix: str
    suffix: str
    target: str


def make_cases(files, per_kind: int, seed: int, max_line_chars: int = 120,
               fim_per_kind: int | None = None) -> list[Case]:
    """`per_kind` next-line cases of each kind and `fim_per_kind` (default: the same) of each suffix-aware kind,
    sampled (seeded) from the non-blank code lines of the files."""
    rng = random.Random(seed)
    spots = []  # (file index, line index, char offset of line start)
    for fi, f in enumerate(files):
        offset = 0
        for li, line in enumerate(f.text.split("\n")):
            code = line.strip()
            if li > 0 and 2 <= len(code) and len(line) <= max_line_chars and not code.startswith("#"):
                spots.append((fi, li, offset))
            offset += len(line) + 1
    lines = [f.text.split("\n") for f in files]
    cases = []
    for kind in KINDS:
        want = per_kind if kind in NEXT_LINE_KINDS else (per_kind if fim_per_kind is None else fim_per_kind)
        made = 0
        for fi, li, start in rng.sample(spots, len(spots)):
            if made >= want:
                break
            line = lines[fi][li]
            span = _span(kind, line, lines[fi], li, rng)
            if span is None:
                continue
            a, b = span
            text = files[fi].text
            cases.append(Case(files[fi].name, kind, li + 1, a + 1, text[: start + a], text[start + b:], line[a:b]))
            made += 1
    return cases


def _span(kind: str, line: str, lines: list[str], li: int, rng: random.Random) -> tuple[int, int] | None:
    """(cursor column, end column) of the expected completion on `line` for a case of `kind`, or None when the
    line does not offer one."""
    body = line.rstrip()
    indent = len(line) - len(line.lstrip())
    if kind == "line_start":
        return indent, len(body)
    if kind == "mid_line":
        return (rng.randint(indent + 1, len(body) - 1), len(body)) if len(body) - indent >= 2 else None
    if kind == "block_middle":
        nxt = next((x for x in lines[li + 1: li + 6] if x.strip()), "")
        prev = lines[li - 1] if li > 0 else ""
        same = lambda x: len(x) - len(x.lstrip()) == indent  # noqa: E731
        if indent >= 4 and prev.strip() and same(prev) and nxt and same(nxt):
            return indent, len(body)
        return None
    if kind == "arg_list":
        opens = [i for i, ch in enumerate(body) if ch in "([{" and i >= indent]
        rng.shuffle(opens)
        for i in opens:
            j = _matching(body, i)
            if j is not None and 2 <= j - i - 1 <= 60 and body[i + 1:j].strip() == body[i + 1:j]:
                return i + 1, j
        return None
    if kind == "line_end_typed":
        end = len(body)
        while end > indent and body[end - 1] in _CLOSERS:
            end -= 1
        if end == len(body) or end - indent < 3:
            return None
        return rng.randint(indent, end - 1), end
    raise ValueError(f"unknown case kind {kind!r}")


def _matching(text: str, i: int) -> int | None:
    """Index of the bracket closing the one at `i` on the same line (ignoring brackets in strings), or None."""
    pairs = {"(": ")", "[": "]", "{": "}"}
    depth, quote = 0, None
    for j in range(i, len(text)):
        ch = text[j]
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in pairs:
            depth += 1
        elif ch in pairs.values():
            depth -= 1
            if depth == 0:
                return j if ch == pairs[text[i]] else None
    return None


def site_of(case: Case) -> Site:
    """The post-processing site of a case's cursor, as the language server builds it."""
    line_prefix = case.prefix[case.prefix.rfind("\n") + 1:]
    line_suffix = case.suffix.split("\n", 1)[0]
    above = case.prefix[: len(case.prefix) - len(line_prefix)].rstrip("\n").split("\n")
    prev_line = next((x for x in reversed(above) if x.strip()), "")
    next_line = next((x for x in case.suffix.split("\n")[1:33] if x.strip()), "")
    return Site(line_prefix, line_suffix, next_line, PYTHON, prev_line=prev_line)


def postprocess(cases: list[Case], raw: list[str]) -> tuple[list[str], int, int]:
    """(what lingls would show for each raw line, degenerate raw lines, degenerate shown lines)."""
    shown, before, after = [], 0, 0
    for c, r in zip(cases, raw):
        site = site_of(c)
        before += is_degenerate(r, site)
        text = clean(r, site, SPECIAL_TOKENS, final=True, block=False).text
        after += is_degenerate(text, site)
        shown.append(text)
    return shown, before, after


def score(cases: list[Case], predictions: list[str]) -> dict:
    """{kind: {exact_match, edit_similarity, n}} plus 'next_line' (line_start and mid_line), 'fim' (the
    suffix-aware kinds) and 'all'."""
    out = {}
    groups = {"next_line": NEXT_LINE_KINDS, "fim": FIM_KINDS, "all": KINDS}
    for kind in (*KINDS, *groups):
        pairs = [(c, p) for c, p in zip(cases, predictions) if c.kind in groups.get(kind, (kind,))]
        if not pairs:
            continue
        em = sum(p.rstrip() == c.target.rstrip() for c, p in pairs) / len(pairs)
        es = sum(fuzz.ratio(p.rstrip(), c.target.rstrip()) / 100 for c, p in pairs) / len(pairs)
        out[kind] = {"exact_match": round(em, 4), "edit_similarity": round(es, 4), "n": len(pairs)}
    return out


def newline_token_ids(tok) -> set[int]:
    """Ids whose text contains a newline: generating one ends a one-line completion."""
    return {i for i in range(tok.get_vocab_size()) if "\n" in tok.decode([i], skip_special_tokens=False)
            and tok.id_to_token(i) not in SPECIAL_TOKENS}


PROMPT_MODES = ("psm", "spm", "prefix")
MODE_NAMES = {"psm": "PSM", "spm": "SPM", "prefix": "prefix only"}  # FIM orders, and left to right without suffix


class ModelCompleter:
    """Greedy one-line completion with a LingForCausalLM, many cases at a time, with token healing.

    With token healing (lingls.engine.healing, as lingls completes): the prompt drops the tail (the prefix's last
    token, or the half-typed word at the cursor), the generated tokens must agree with it until one covers it,
    and the completion is what comes after it.
    Prompts are right-padded in one buffer; each step runs the full causal forward over the live rows (a causal
    model's logits at a row's last real token ignore the padding after it) and drops rows that finished.
    Lengths are rounded up to a multiple of 64 so the kernels see few distinct shapes.
    """

    def __init__(self, model, tok, device: str, mode: str = "psm", prefix_tokens: int = 768,
                 suffix_tokens: int = 256, max_new_tokens: int = 40, batch: int = 256, whole_word: bool = True):
        if mode not in PROMPT_MODES:
            raise ValueError(f"mode must be one of {PROMPT_MODES}")
        self.model, self.tok, self.device, self.mode = model, tok, device, mode
        self.prefix_tokens, self.suffix_tokens = prefix_tokens, suffix_tokens
        self.max_new, self.batch = max_new_tokens, batch
        self.whole_word = whole_word  # heal the half-typed word at the cursor, not only its last token
        self.texts = [tok.decode([i], skip_special_tokens=False) for i in range(tok.get_vocab_size())]
        self.candidates = Candidates(self.texts, set(range(len(SPECIAL_TOKENS))))

    def prompt(self, prefix: str, suffix: str) -> tuple[list[int], str]:
        """(prompt ids, healed tail text)."""
        pre = self.tok.encode(prefix, add_special_tokens=False).ids[-self.prefix_tokens - 1:] if prefix else []
        pre, tail = heal(pre, self.texts, set(), None, self.whole_word) if len(pre) > 1 else (pre, "")
        suf = self.tok.encode(self.suffix_window(suffix), add_special_tokens=False).ids if suffix else []
        p, s, m = SPECIAL_ID[FIM_PREFIX], SPECIAL_ID[FIM_SUFFIX], SPECIAL_ID[FIM_MIDDLE]
        if self.mode == "psm":
            return [p, *pre, s, *suf, m], tail
        if self.mode == "spm":
            return [s, *suf, p, *pre, m], tail
        return pre, tail

    def suffix_window(self, suffix: str) -> str:
        """The suffix's first whole lines, as many as fit suffix_tokens (at most MAX_SUFFIX_LINES), the way
        lingls.lsp.prompt windows it: a suffix cut inside a line (at a token count) is unlike both what lingls
        sends and what training showed (examples are whole lines, fim.chunk_text)."""
        end, used = 0, 0
        for _ in range(MAX_SUFFIX_LINES):
            if end >= len(suffix):
                break
            nl = suffix.find("\n", end)
            stop = len(suffix) if nl < 0 else nl + 1
            cost = len(self.tok.encode(suffix[end:stop], add_special_tokens=False).ids)
            if used + cost > self.suffix_tokens:
                break
            used, end = used + cost, stop
        return suffix[:end]

    @torch.no_grad()
    def complete_all(self, cases: list[Case]) -> list[str]:
        out: list[str] = [""] * len(cases)
        order = sorted(range(len(cases)), key=lambda i: len(cases[i].prefix[-4000:]))
        for start in range(0, len(order), self.batch):
            idx = order[start:start + self.batch]
            prompts = [self.prompt(cases[i].prefix, cases[i].suffix) for i in idx]
            for i, text in zip(idx, self._generate(prompts)):
                out[i] = first_line(text)
        return out

    def _generate(self, prompts: list[tuple[list[int], str]]) -> list[str]:
        """The completions past each prompt's tail (up to the first newline after it, or a special token)."""
        dev = self.device
        lens = torch.tensor([len(p) for p, _ in prompts])
        width = int(lens.max()) + self.max_new
        buf = torch.zeros(len(prompts), width, dtype=torch.long)
        for r, (p, _) in enumerate(prompts):
            buf[r, : len(p)] = torch.tensor(p)
        buf, lens = buf.to(dev), lens.to(dev)
        live = list(range(len(prompts)))
        generated: list[list[int]] = [[] for _ in prompts]
        texts = [""] * len(prompts)
        rest = [tail for _, tail in prompts]  # what of each tail the next token must agree with
        anything = torch.ones_like(self.candidates.ordinary)
        for step in range(self.max_new):
            if not live:
                break
            rows = torch.tensor(live, device=dev)
            t = min(width, -(-int(lens[rows].max()) // 64) * 64)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=buf.is_cuda):  # the shipped weights are bf16
                h = self.model.hidden(buf[rows, :t])
                logits = self.model.head(h[torch.arange(len(live), device=dev), lens[rows] - 1]).float()
            # as lingls heals: the first token agrees with the tail, and after a chosen start of it the next
            # one with the rest (and the first is never a special token)
            if step == 0 or any(rest[r] for r in live):
                free = self.candidates.ordinary if step == 0 else anything
                agree = torch.stack([self.candidates.mask(rest[r]) if rest[r] else free for r in live])
                logits = logits.masked_fill(~agree.to(dev), float("-inf"))
            nxt = logits.argmax(-1)
            buf[rows, lens[rows]] = nxt
            lens[rows] += 1
            still = []
            for r, token in zip(live, nxt.tolist()):
                if token < len(SPECIAL_TOKENS):
                    continue
                generated[r].append(token)
                piece = self.texts[token]
                rest[r] = rest[r][len(piece):] if len(piece) < len(rest[r]) and rest[r].startswith(piece) else ""
                texts[r] = strip_tail(self.tok.decode(generated[r]), prompts[r][1])
                if "\n" not in texts[r]:
                    still.append(r)
            live = still
        return texts


def summary_table(results: dict) -> str:
    """Markdown table: predictor x kind, exact match and edit similarity."""
    rows = ["| predictor | kind | cases | exact match | edit similarity |", "|---|---|---|---|---|"]
    for name, by_kind in results.items():
        for kind, m in by_kind.items():
            rows.append(f"| {name} | {kind} | {m['n']} | {m['exact_match']:.3f} | {m['edit_similarity']:.3f} |")
    return "\n".join(rows)


def case_record(case: Case, predictions: dict[str, str]) -> dict:
    d = asdict(case)
    d["prefix"] = d["prefix"][-200:]
    d["suffix"] = d["suffix"][:100]
    return {**d, "predictions": predictions}
