"""StopMatcher against a plain reference on random streams, and its cost per feed: bounded by the new text and
the stop strings, never by how long a stop string is beyond the text it could match."""

import random

from lingls.engine.local import StopMatcher


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """The whole text cut before the first place any stop string starts."""
    cuts = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(cuts)], True) if cuts else (text, False)


def test_random_streams_match_the_reference():
    rng = random.Random(7)
    for _ in range(2000):
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(0, 4))]
        text = "".join(rng.choice("ab\nc") for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        m, out, hit = StopMatcher(stops), [], False
        for i, piece in enumerate(pieces):
            emitted, hit = m.feed(piece, final=i == len(pieces) - 1)
            out.append(emitted)
            if hit:
                break
        assert ("".join(out), hit) == reference(text, stops), (stops, pieces)


class CountingStop(str):
    """A stop string that counts the work done on it (slices and prefix tests)."""

    calls = 0

    def __getitem__(self, index):
        CountingStop.calls += 1
        return str.__getitem__(self, index)

    def startswith(self, *args):
        CountingStop.calls += 1
        return str.startswith(self, *args)


def test_a_long_stop_string_costs_nothing_per_token_beyond_the_text():
    """A 100k-character stop string (the issue's 900 KB one took 85 s for 16 tokens): each one-token feed may
    look at the held tail only, not at every prefix of the stop string."""
    CountingStop.calls = 0
    m = StopMatcher([CountingStop("q" * 100_000)])
    for _ in range(50):
        assert m.feed("ab") == ("ab", False)
    assert CountingStop.calls <= 50 * 2, CountingStop.calls
