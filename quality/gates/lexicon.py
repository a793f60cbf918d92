"""One pass over a doc's lower-case text shared by the word-list gates (profanity, copyright cues).

The text becomes one byte per char of its lower-case form (ASCII as is; another char "_" when the token
regex counts it as a word char, else " ") and its token-class bytes (`bytes.translate`). One Aho-Corasick
pass (ahocorasick-rs, overlapping matches) finds the listed profane words and the ASCII copyright cues
together; the result is cached on the `Doc`, so a second gate reads it instead of scanning again.

A text with a Latin-1 view (all ASCII text, and most other web text: `quality.normalize.latin1_view`)
gets its bytes from one `bytes.translate` of that view: `str.lower` is char for char
there, so the table lower-cases and classifies at once, with no `str.lower` (25 µs on a 4 000-char
non-ASCII text) and no per-char Python; its cue positions are kept for the copyright gate. Other text is
lower-cased and classified by a codec error handler; past `NON_ASCII_BUDGET` extra UTF-8 bytes it is not
scanned (the handler would be called too often): its gates use their plain scans.
"""
from __future__ import annotations

import codecs
import re
from functools import lru_cache
from typing import NamedTuple

import ahocorasick_rs

from quality.gates.base import Doc

_WORD_CHAR = re.compile(r"\w")
_TOKEN_ASCII = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_@$*#!|")
_OBFUSCATION = frozenset(b"0134 57@$!|#*") - {32}  # what the leetspeak tables and masks read
# Class bytes: b" " separates tokens; in a token, b"a" is a letter, b"x" a leetspeak/mask symbol and
# b"z" anything else (2, 6, 8, 9, _, a non-ASCII word char): a token holding a "z" is never profane.
CLASS = bytes(32 if c not in _TOKEN_ASCII else 97 if 97 <= c <= 122 else 120 if c in _OBFUSCATION else 122
              for c in range(128)) + b" " * 128
NON_ASCII_BUDGET = 64  # extra UTF-8 bytes past which the handler calls cost more than the plain scans
COPYRIGHT_CUES = ("copyright", "&copy;", "(c)", "rights")  # ASCII; "\u00a9" is tested on the str
# Latin-1 byte -> the byte the scan has for that char's lower-case form (str.lower keeps Latin-1 in Latin-1,
# one char for one, and non-ASCII non-ASCII).
LATIN1_RAW = bytes(ord(chr(b).lower()) if b < 128 else ord("_" if _WORD_CHAR.match(chr(b).lower()) else " ")
                   for b in range(256))


def _classify_non_ascii(err: UnicodeError) -> tuple[str, int]:
    """Codec error handler: a non-ASCII char becomes "_" when the token regex counts it as a word char."""
    assert isinstance(err, UnicodeEncodeError)
    chunk = err.object[err.start:err.end]
    return "".join("_" if _WORD_CHAR.match(c) else " " for c in chunk), err.end


codecs.register_error("streamprep.token_class", _classify_non_ascii)


class Scan(NamedTuple):
    raw: bytes                          # one byte per char of `doc.lower`
    classes: bytes                      # its token classes
    words: list[tuple[int, int, int]]   # (word index, start, end) of every listed-word match, overlapping
    copyright_cue: bool                 # a copyright cue occurs in `doc.lower`
    # Latin-1 path: (cue, start) of every copyright cue, the first "\u00a9" included, at `doc.text` positions
    # (`doc.lower`'s there); None when the positions are not known
    cues: list[tuple[str, int]] | None = None


@lru_cache(maxsize=None)
def _automaton(words: tuple[str, ...]) -> ahocorasick_rs.BytesAhoCorasick:
    return ahocorasick_rs.BytesAhoCorasick([w.encode() for w in (*words, *COPYRIGHT_CUES)])


def scan(doc: Doc, words: tuple[str, ...]) -> Scan | None:
    """The shared scan of `doc.lower`, computed once per doc (every caller passes the shipped list,
    sorted); None when the text is too rich in non-ASCII for it."""
    if doc.scan is not None:
        return doc.scan or None  # False: tried, not scannable
    latin = doc.latin1
    if latin is not None:
        raw = latin.translate(LATIN1_RAW)
        found = _automaton(words).find_matches_as_indexes(raw, overlapping=True)
        n = len(words)
        cues = [(COPYRIGHT_CUES[i - n], start) for i, start, _ in found if i >= n]
        sign = latin.find(b"\xa9")
        if sign != -1:
            cues.append(("\u00a9", sign))
        doc.scan = Scan(raw, raw.translate(CLASS), [m for m in found if m[0] < n] if cues else found, bool(cues), cues)
        return doc.scan
    lower = doc.lower
    if lower.isascii():
        raw = lower.encode()
    elif len(lower.encode("utf-8", "surrogatepass")) - len(lower) > NON_ASCII_BUDGET:
        doc.scan = False
        return None
    else:
        raw = lower.encode("ascii", "streamprep.token_class")
    found = _automaton(words).find_matches_as_indexes(raw, overlapping=True)
    n = len(words)
    cue = any(i >= n for i, _, _ in found) or (not lower.isascii() and "\u00a9" in lower)
    doc.scan = Scan(raw, raw.translate(CLASS), [m for m in found if m[0] < n] if cue else found, cue)
    return doc.scan
