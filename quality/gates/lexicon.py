"""One pass over a doc's lower-case text shared by the word-list gates (profanity, copyright cues).

The scan reads one byte per char of the lower-case text: a text's Latin-1 view as it is (the patterns'
classes hold every byte that stands for a char they take, "F" beside "f"), else the lower-cased text with
another char "_" when the token regex counts it as a word char, else " "; its token-class bytes
(`bytes.translate`) are built only when a gate needs them. Hyperscan (SIMD
multi-pattern matching) then reports, in one pass over those bytes with a separator added at each end:
every token that is a listed word; every token made of letters, leetspeak digits and leetspeak/mask
symbols that holds a symbol; every letter beside a leetspeak digit (a token holding both, and no symbol,
has such a pair); and the ASCII copyright cues. So the profanity gate looks up only the tokens that may be
obfuscated listed words, not every token with a digit or a "!" (the pair patterns run as a second database:
with the others in one, the whole scan ran 4x slower). The result is cached on the `Doc`, so a second gate
reads it instead of scanning again.

A text with a Latin-1 view (all ASCII text, and most other web text: `quality.normalize.latin1_view`) is
scanned without `str.lower` (25 µs on a 4 000-char non-ASCII text; `str.lower` is char for char in Latin-1,
so `LATIN1_RAW` says what each byte stands for), with no per-char Python and no copy; its cue positions
are kept for the copyright gate. Other text is
lower-cased and classified by a codec error handler; past `NON_ASCII_BUDGET` extra UTF-8 bytes it is not
scanned (the handler would be called too often): its gates use their plain scans.
"""
from __future__ import annotations

import codecs
import re
from functools import lru_cache
from typing import NamedTuple

import hyperscan

from quality.gates.base import Doc
from quality import hs
from quality.hs import database

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
# The scan reads a text's Latin-1 view as it is; `LATIN1_RAW` gives the byte it stands for (bytes already
# lower-cased and classified by the codec handler stand for themselves), and `TOKEN_CLASS` its token class.
TOKEN_CLASS = bytes(CLASS[LATIN1_RAW[b]] for b in range(256))


def _byte_class(raw: bytes) -> bytes:
    """A Hyperscan class of the bytes that stand for one of `raw` (a letter: both cases)."""
    return b"[" + b"".join(b"\\x%02x" % b for b in range(256) if LATIN1_RAW[b] in raw) + b"]"


def _literal(text: str) -> bytes:
    return b"".join(_byte_class(c.encode()) for c in text)


# The patterns, over the bytes with b" " added at both ends. A separator is a byte of token class b" ".
_SEP = _byte_class(bytes(b for b in range(128) if CLASS[b] == 32))
_OBFUSCABLE = _byte_class(b"abcdefghijklmnopqrstuvwxyz013457@$*#!|")  # letters, what leetspeak/masks read
_WORD, _SYMBOL_TOKEN, _CUE = 0, 1, 2   # pattern ids: a listed word; a token with a symbol; cue i is 2 + i
_PAIRS = (_byte_class(b"abcdefghijklmnopqrstuvwxyz") + _byte_class(b"013457"),
          _byte_class(b"013457") + _byte_class(b"abcdefghijklmnopqrstuvwxyz"))


class Scan(NamedTuple):
    data: bytes                         # one byte per char of `doc.lower`: the Latin-1 view, or the handler's
    plain: int                          # tokens that are listed words
    candidates: list[int]               # sorted positions inside the tokens that may be obfuscated listed words
    copyright_cue: bool                 # a copyright cue occurs in `doc.lower`
    # Latin-1 path: (cue, start) of every copyright cue, the first "\u00a9" included, at `doc.text` positions
    # (`doc.lower`'s there); None when the positions are not known
    cues: list[tuple[str, int]] | None = None


def classes(data: bytes) -> bytes:
    """The token classes of scan bytes (the profanity gate needs them only for a text with a candidate)."""
    return data.translate(TOKEN_CLASS)


def _classify_non_ascii(err: UnicodeError) -> tuple[str, int]:
    """Codec error handler: a non-ASCII char becomes "_" when the token regex counts it as a word char."""
    assert isinstance(err, UnicodeEncodeError)
    chunk = err.object[err.start:err.end]
    return "".join("_" if _WORD_CHAR.match(c) else " " for c in chunk), err.end


codecs.register_error("streamprep.token_class", _classify_non_ascii)


@lru_cache(maxsize=None)
def _databases(words: tuple[str, ...]) -> tuple[hyperscan.Database, hyperscan.Database]:
    """The word/symbol-token/cue database and the letter-digit pair database for this word list."""
    main = [_SEP + b"(?:" + b"|".join(map(_literal, words)) + b")" + _SEP,
            _SEP + _OBFUSCABLE + b"*" + _byte_class(b"@$*#!|") + _OBFUSCABLE + b"*" + _SEP,
            *map(_literal, COPYRIGHT_CUES)]
    return database(main), database(list(_PAIRS))


def _matches(data: bytes, words: tuple[str, ...]) -> tuple[int, list[int], list[tuple[str, int]]]:
    """(listed-word tokens, candidate positions, (cue, start) of each copyright cue) in scan bytes."""
    main, pairs = _databases(words)
    padded = b" " + data + b" "
    found: list[tuple[int, int]] = []
    hs.scan(main, padded, hs.append_match, found)
    plain, candidates, cues = 0, [], []
    for pattern, end in found:  # end: just past the match in `padded`, which is `data` shifted by one
        if pattern == _WORD:
            plain += 1
        elif pattern == _SYMBOL_TOKEN:
            candidates.append(end - 3)  # the token's last char (the match ends with a separator)
        else:
            cue = COPYRIGHT_CUES[pattern - _CUE]
            cues.append((cue, end - 1 - len(cue)))
    found.clear()
    hs.scan(pairs, padded, hs.append_match, found)
    candidates += [end - 2 for _, end in found]  # the pair's second char
    candidates.sort()
    return plain, candidates, cues


def scan(doc: Doc, words: tuple[str, ...]) -> Scan | None:
    """The shared scan of `doc.lower`, computed once per doc (every caller passes the shipped list,
    sorted); None when the text is too rich in non-ASCII for it."""
    if doc.scan is not None:
        return doc.scan or None  # False: tried, not scannable
    latin = doc.latin1
    if latin is not None:
        plain, candidates, cues = _matches(latin, words)
        sign = latin.find(b"\xa9")
        if sign != -1:
            cues.append(("\u00a9", sign))
        doc.scan = Scan(latin, plain, candidates, bool(cues), cues)
        return doc.scan
    lower = doc.lower
    if lower.isascii():
        raw = lower.encode()
    elif len(lower.encode("utf-8", "surrogatepass")) - len(lower) > NON_ASCII_BUDGET:
        doc.scan = False
        return None
    else:
        raw = lower.encode("ascii", "streamprep.token_class")
    plain, candidates, cues = _matches(raw, words)
    cue = bool(cues) or (not lower.isascii() and "\u00a9" in lower)
    doc.scan = Scan(raw, plain, candidates, cue)
    return doc.scan
