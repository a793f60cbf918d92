"""Text normalisation: the kept form of a text and the form its dedup digest is taken from.

Two texts differing only in Unicode composition, line endings, stray control bytes, curly quotes or
spacing are the same document for training, so they must hash alike. Code keeps its indentation
and its quotes (they may sit inside string literals); prose is collapsed and trimmed.

Every step is a C-level regex pass, and passes whose regex would stop at every space run only after
a plain substring test says there is something to change, so already-clean text costs a few scans.
"""
from __future__ import annotations

import re
import unicodedata

# C1 controls (U+0080..U+009F) in real web text are almost always Windows-1252 bytes decoded as
# Latin-1 ("l\x92Ecole"); map them to what the writer typed instead of deleting them.
_C1 = {chr(b): bytes([b]).decode("cp1252", errors="ignore") for b in range(0x80, 0xA0)}
# Other control characters go, except \t and \n (\r is turned into \n first). The BOM is invisible.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff]")
_NEWLINES = re.compile("\r\n?")
_PUNCT = {
    **dict.fromkeys("\u2018\u2019\u201a\u201b\u2032", "'"),
    **dict.fromkeys("\u201c\u201d\u201e\u201f\u2033", '"'),
    **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212", "-"),
}
_PUNCT_RE = re.compile("[" + "".join(_PUNCT) + "]")
_UNICODE_SPACES = re.compile("[\u00a0\u1680\u2000-\u200a\u202f\u205f\u3000]")
_MULTI_SPACE = re.compile(" {2,}")
_LINE_EDGES = re.compile("[ \t]+\n[ \t]*|\n[ \t]+")
_EDGE_CUES = (" \n", "\t\n", "\n ", "\n\t")
_TRAILING = re.compile("[ \t]+(?=\n)|[ \t]+$")
_TRAILING_CUES = (" \n", "\t\n")


def _controls(text: str) -> str:
    return _CONTROL.sub(lambda m: _C1.get(m.group(), ""), text)


def normalize_text(text: str, code: bool = False) -> str:
    """NFC; control characters out (C1 repaired as Windows-1252); then, for prose, curly quotes and
    dashes to ASCII, runs of spaces collapsed, lines and the text trimmed; for code, Unix newlines,
    trailing whitespace and trailing blank lines dropped, indentation left as it is.
    """
    if not unicodedata.is_normalized("NFC", text):
        text = unicodedata.normalize("NFC", text)
    text = _controls(_NEWLINES.sub("\n", text))
    if code:
        if text.endswith((" ", "\t")) or any(cue in text for cue in _TRAILING_CUES):
            text = _TRAILING.sub("", text)
        return text.rstrip("\n")
    text = _PUNCT_RE.sub(lambda m: _PUNCT[m.group()], text)
    text = _UNICODE_SPACES.sub(" ", text)
    if "  " in text:
        text = _MULTI_SPACE.sub(" ", text)
    if any(cue in text for cue in _EDGE_CUES):
        text = _LINE_EDGES.sub("\n", text)
    return text.strip(" \t\n")
