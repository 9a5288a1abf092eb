"""LSP columns <-> Python string indices, in the negotiated position encoding.

An LSP column counts UTF-16 code units by default, bytes under `utf-8` and code points under `utf-32`; a
Python `str` is indexed by code points. Emoji are one code point but two UTF-16 units and four bytes; CJK is
one unit but three bytes. A string from JSON may also hold a lone surrogate (an invalid UTF-16 escape): it
counts as one UTF-16 unit and, as WTF-8 would encode it, three bytes.
"""

from __future__ import annotations

UTF8 = "utf-8"
UTF16 = "utf-16"
UTF32 = "utf-32"
ENCODINGS = (UTF8, UTF16, UTF32)

_CODEC = {UTF8: ("utf-8", 1), UTF16: ("utf-16-le", 2)}


def _width(ch: str, encoding: str) -> int:
    cp = ord(ch)
    if encoding == UTF16:
        return 2 if cp > 0xFFFF else 1
    if encoding == UTF8:
        return 1 if cp < 0x80 else 2 if cp < 0x800 else 3 if cp < 0x10000 else 4
    return 1


def column_to_index(line: str, column: int, encoding: str = UTF16) -> int:
    """Index into `line` (without its line ending) for an LSP column.

    A column past the end clamps to the end; a column that falls inside a character (half of a surrogate
    pair, the middle of a UTF-8 sequence) snaps back to the start of that character.
    """
    if column <= 0:
        return 0
    if encoding == UTF32 or line.isascii():
        return min(column, len(line))
    used = 0
    for index, ch in enumerate(line):
        if used >= column:
            return index
        used += _width(ch, encoding)
        if used > column:
            return index
    return len(line)


def index_to_column(line: str, index: int, encoding: str = UTF16) -> int:
    """LSP column of the code point at `index` in `line`."""
    head = line[:index]
    if encoding == UTF32 or head.isascii():
        return len(head)
    codec, unit = _CODEC[encoding]
    return len(head.encode(codec, "surrogatepass")) // unit


def length_in(text: str, encoding: str = UTF16) -> int:
    """Length of `text` in the encoding's units."""
    return index_to_column(text, len(text), encoding)
