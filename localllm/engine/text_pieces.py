"""A long text cut into pieces that tokenize to the same tokens as the whole, in linear time.

llama.cpp splits a text at its special tokens before tokenizing the parts between them, and it
does so by copying the rest of the text at each special token it finds: time quadratic in the
special tokens of a text (20,000 chat messages, 730 KB, took a runner's only thread 13-25 s;
40,000, over 80 s). Since the parts between special tokens are tokenized apart anyway, cutting
the text just before a special token changes no token: each piece is tokenized alone and the
tokens joined. A piece is at least PIECE_CHARS long, so a short text is one piece, and a long
one costs a few thousand calls rather than time squared.

Special tokens that strip the whitespace before them (LSTRIP) are not cut before: the space
they would eat sits in the piece before the cut.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

PIECE_CHARS = 4096
MAX_SPECIAL_CHARS = 64  # longer "special tokens" are not markers a template writes


def markers_pattern(texts: Iterable[str]) -> re.Pattern | None:
    """A pattern matching any of `texts`, built as a trie (one branch per first character,
    then per next one), so a search tries each position in time bounded by the longest text,
    not by their number (a vocabulary may have thousands). None when there are none."""
    trie: dict = {}
    for text in texts:
        if not text or len(text) > MAX_SPECIAL_CHARS:
            continue
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}

    def branch(node: dict) -> str:
        alternatives = [re.escape(ch) + branch(child) for ch, child in sorted(node.items())
                        if ch]
        if not alternatives:
            return ""
        body = alternatives[0] if len(alternatives) == 1 else f"(?:{'|'.join(alternatives)})"
        return f"(?:{body})?" if "" in node else body

    return re.compile(branch(trie)) if trie else None


def pieces(text: str, markers: re.Pattern | None, size: int = PIECE_CHARS) -> Iterator[str]:
    """`text` in pieces of at least `size` characters (the last may be shorter), each after the
    first starting with a match of `markers`; the pieces join to `text`."""
    start = 0
    while markers is not None and len(text) - start > size:
        found = markers.search(text, start + size)
        if found is None:
            break
        yield text[start:found.start()]
        start = found.start()
    yield text[start:]
