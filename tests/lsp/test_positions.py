import pytest

from lingls.lsp.documents import Document, PositionError
from lingls.lsp.positions import UTF8, UTF16, UTF32, column_to_index, index_to_column, length_in

LINE = 'x = "a😀中b"'  # 😀: 2 UTF-16 units, 4 bytes; 中: 1 unit, 3 bytes


@pytest.mark.parametrize("encoding, widths", [(UTF16, (1, 2, 1, 1)), (UTF8, (1, 4, 3, 1)), (UTF32, (1, 1, 1, 1))])
def test_columns_round_trip_over_emoji_and_cjk(encoding, widths):
    start = LINE.index("a")
    column = index_to_column(LINE, start, encoding)
    assert column == start  # ASCII before
    for i, width in enumerate(widths):
        assert column_to_index(LINE, column, encoding) == start + i
        assert index_to_column(LINE, start + i, encoding) == column
        column += width
    assert length_in(LINE, encoding) == index_to_column(LINE, len(LINE), encoding)


def test_column_inside_a_character_snaps_to_its_start():
    emoji = LINE.index("😀")
    assert column_to_index(LINE, emoji + 1, UTF16) == emoji  # between the surrogates
    assert column_to_index(LINE, emoji + 2, UTF8) == emoji  # inside the 4 bytes


def test_column_past_the_end_clamps():
    assert column_to_index(LINE, 999, UTF16) == len(LINE)
    assert column_to_index("abc", 999, UTF8) == 3


def test_lone_surrogate_counts_as_one_unit():
    line = "a\ud800b"
    assert index_to_column(line, 3, UTF16) == 3
    assert index_to_column(line, 3, UTF8) == 5
    assert column_to_index(line, 2, UTF16) == 2


def test_document_offsets_and_positions():
    doc = Document("u", "a😀\r\nb\rc\nd")
    assert doc.line_count() == 4
    assert doc.offset_at(0, 3, UTF16) == 2
    assert doc.offset_at(1, 1) == doc.text.index("b") + 1
    assert doc.offset_at(3, 1) == len(doc.text)
    assert doc.position_at(doc.text.index("c"), UTF16) == (2, 0)
    assert doc.position_at(2, UTF8) == (0, 5)


def test_document_strict_positions():
    doc = Document("u", "ab\ncd")
    with pytest.raises(PositionError):
        doc.offset_at(5, 0, strict=True)
    with pytest.raises(PositionError):
        doc.offset_at(0, 3, strict=True)
    assert doc.offset_at(0, 2, strict=True) == 2
    assert doc.offset_at(5, 0) == len(doc.text)  # lenient for edits


def test_incremental_changes_in_utf16_and_utf8():
    doc = Document("u", "😀x\nline2\n")
    doc.apply_change("Y", (0, 2), (0, 3), UTF16)  # replace x after the emoji
    assert doc.text == "😀Y\nline2\n"
    doc.apply_change("中", (1, 0), (1, 4), UTF8)
    assert doc.text == "😀Y\n中2\n"
    doc.apply_change("new", None, None)
    assert doc.text == "new" and doc.line_count() == 1


def test_window_around_a_line():
    doc = Document("u", "\n".join(str(i) for i in range(100)))
    first, lines = doc.window(50, size=10)
    assert first == 45 and lines == [str(i) for i in range(45, 55)]
    first, lines = doc.window(99, size=10)
    assert first == 90 and len(lines) == 10


def test_line_table_follows_random_edits():
    import random

    rng = random.Random(7)
    doc = Document("u", "alpha\nbeta\r\ngamma\n\ndelta 😀\n")
    doc.line_starts()
    pieces = ["", "x", "\n", "ab\ncd", "\n\n", "\r\n", "中", "😀\n"]
    for _ in range(400):
        lines = doc.line_count()
        l1 = rng.randrange(lines + 1)
        l2 = min(lines, l1 + rng.randrange(3))
        start = (l1, rng.randrange(8))
        end = max(start, (l2, rng.randrange(8)))
        doc.apply_change(rng.choice(pieces), start, end, UTF16)
        assert doc.line_starts() == Document("v", doc.text).line_starts()
