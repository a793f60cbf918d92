"""Text normalisation: the kept form of a text and the form its dedup digest is taken from.

Two texts differing only in Unicode composition, line endings, stray control bytes, curly quotes, Unicode
spaces or the length of a run of spaces are the same document for training, so they must hash alike (a tab
stays a tab). Code keeps its indentation and its quotes (they may sit inside string literals); prose is
collapsed and trimmed.

The per-character steps (line endings, controls, punctuation, Unicode spaces) are one table applied in
one C-level regex pass; the passes whose regex would stop at every space run go only after a plain
substring test says there is something to change, so already-clean text costs a few scans. In prose,
the curly quotes and dashes that make most web text non-ASCII go first, by `str.replace`: a text that
is ASCII after that skips the NFC check and the regex pass (two thirds of the non-ASCII C4 texts), and
so does most of the rest: a Latin-1 text is NFC, and its bytes tell at C speed whether a table key is there.
"""
from __future__ import annotations

import codecs
import re
import unicodedata
from functools import lru_cache
from operator import methodcaller
from typing import Callable

import hyperscan

from quality import hs
from quality.hs import database

# C1 controls (U+0080..U+009F) in real web text are almost always Windows-1252 bytes decoded as
# Latin-1 ("l\x92Ecole"); map them to what the writer typed instead of deleting them.
_C1 = {chr(b): bytes([b]).decode("cp1252", errors="ignore") for b in range(0x80, 0xA0)}
# Other control characters go, except \t and \n (\r becomes \n). The BOM is invisible.
_CONTROLS = [*map(chr, (*range(0x09), *range(0x0B, 0x20), *range(0x7F, 0xA0))), "\ufeff"]
_PUNCT = {
    **dict.fromkeys("\u2018\u2019\u201a\u201b\u2032", "'"),
    **dict.fromkeys("\u201c\u201d\u201e\u201f\u2033", '"'),
    **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212", "-"),
}
# The table's most frequent non-ASCII keys in web text (C4: 4 780 of them in 1 000 docs; every other key
# together: under 100), each searched by memchr-speed `in` and replaced by its ASCII form. They are starters
# that compose with nothing, as are their replacements, so replacing them before NFC gives NFC's result.
_COMMON_PUNCT = tuple((c, _PUNCT[c]) for c in "\u2019\u201c\u201d\u2013\u2014\u2018")
# In a text's Latin-1 view a char past U+00FF that no step here, nor the byte scans of the gates, treats apart
# stands as a Latin-1 char of its kind (`_standin`): a word char as "\u00aa", another as "\u00a4". Up to
# STANDIN_BUDGET of them, or one in STANDIN_SHARE chars of a longer text: web text that is not Latin-1 mostly has
# a few (an emoji, an arrow, a Greek letter; C4: all but 1 of its 1 000 texts then have a view), and the view lets
# every byte scan read it (~3x cheaper). A standin costs a lookup (~1-2 µs a run of them); a long page without a
# view costs its gates' str scans (~100 ns a char: a 54 000-char page with ~150 Greek or IPA letters, 5 ms).
WORD_STANDIN, STANDIN = "\u00aa", "\u00a4"
STANDIN_BUDGET = 64
STANDIN_SHARE = 256
STANDIN_TABLE = 1 << 16  # distinct chars past U+00FF whose standin a process remembers
STANDIN_COUNT_UPTO = 1024  # a text up to this long has its wide chars counted (at C speed) before any lookup
_UNICODE_SPACES = ["\u00a0", "\u1680", *map(chr, range(0x2000, 0x200B)), "\u202f", "\u205f", "\u3000"]
_EDGE_CUES = (" \n", "\t\n", "\n ", "\n\t")
_EDGE_LOOKS = 64  # newlines looked at one by one before four whole-text scans are cheaper
_TRAILING = re.compile("[ \t]+(?=\n)|[ \t]+$")
_TRAILING_CUES = (" \n", "\t\n")


def _char_map(prose: bool) -> dict[str, str]:
    """Every per-character step composed into one table: CR becomes LF; a control character goes (C1: its
    Windows-1252 character); for prose, curly punctuation becomes ASCII and Unicode spaces a space, also
    where a C1 byte decoded to such a character."""
    out = {c: _C1.get(c, "") for c in _CONTROLS} | {"\r": "\n"}
    if prose:
        out = {**_PUNCT, **dict.fromkeys(_UNICODE_SPACES, " "), **{c: _PUNCT.get(v, v) for c, v in out.items()}}
    return out


_PROSE_KEYS = frozenset(_char_map(prose=True))
_WORD_CHAR = re.compile(r"\w")
_ASCII_LETTER = re.compile("[a-z]", re.IGNORECASE)  # past U+00FF it takes \u0130 \u0131 \u017f \u212a
_HANGUL_JAMO = ((0x1100, 0x11FF), (0xA960, 0xA97F), (0xD7B0, 0xD7FF))  # vowels and finals compose with syllables


def _standin(char: str) -> str:
    """The Latin-1 char that `char` (past U+00FF) stands as in a view, "" when it can have none. It must be a
    char that every byte scan may read as its standin and that no step changes: no table key, space, digit
    or number; NFC alone and no mark or Hangul jamo (the chars that can compose with the one before, NFC's
    quick-check "maybe", are marks or jamo: so a view's text passes the quick check, and is NFC); not a
    control, unassigned or a surrogate; one char in lower case, not ASCII there, and no ASCII letter's under
    IGNORECASE (the copyright regex's). Its standin has the word-char class of its lower case, which the
    word lists' tokens read."""
    cat, lower, code = unicodedata.category(char), char.lower(), ord(char)
    if (cat[0] in "MZ" or (cat[0] == "C" and cat not in ("Cf", "Co")) or char in _PROSE_KEYS or char.isspace()
            or char.isnumeric() or not unicodedata.is_normalized("NFC", char)
            or any(a <= code <= b for a, b in _HANGUL_JAMO) or len(lower) != 1 or lower.isascii()
            or _ASCII_LETTER.match(char)):
        return ""
    return WORD_STANDIN if _WORD_CHAR.match(lower) else STANDIN


class _Standins(dict):
    """`str.translate`'s table of the chars past U+00FF met so far: code point -> its standin, or None (the
    char is dropped, which tells `_standins` it has none). A char is classed once (`_standin`); at most
    STANDIN_TABLE of them are kept."""

    def __missing__(self, code: int) -> str | None:
        if len(self) >= STANDIN_TABLE:
            self.clear()
        found = self[code] = _standin(chr(code)) or None
        return found


_STANDINS = _Standins()


class _NoView(Exception):
    """A text holds a char past U+00FF without a standin."""


_left = [0]  # standins the text `latin1_view` encodes may still take (threads may race on it: it bounds work only)


def _standins(err: UnicodeError) -> tuple[str, int]:
    """Codec error handler of `latin1_view`: a run of chars past U+00FF becomes their standins."""
    assert isinstance(err, UnicodeEncodeError)
    chunk = err.object[err.start:err.end]
    _left[0] -= len(chunk)
    if _left[0] < 0:  # before the lookups: a long run past the budget is neither classed nor kept in the table
        raise _NoView
    out = chunk.translate(_STANDINS)
    if len(out) != len(chunk):
        raise _NoView
    return out, err.end


codecs.register_error("streamprep.latin1_standin", _standins)


def latin1_view(text: str, standins: bool = True) -> bytes | None:
    """`text` as Latin-1 bytes, one per char, a char past U+00FF as its standin (`_standin`); None when it
    holds one without, or more than its budget (STANDIN_BUDGET, or one in STANDIN_SHARE chars). For ASCII it
    is the UTF-8, for other Latin-1 text a copy of the str's buffer: C-level byte passes over it replace
    Unicode-aware regex scans and `str.lower` (~5 ns a char on wide text). `standins=False`: None also for a
    text that needs them (code keeps its curly quotes: a second try would rarely pay)."""
    if text.isascii():
        return text.encode()
    try:
        return text.encode("latin-1")
    except UnicodeEncodeError:
        if not standins:
            return None
    budget = max(STANDIN_BUDGET, len(text) // STANDIN_SHARE)
    if len(text) <= STANDIN_COUNT_UPTO and len(text) - len(text.encode("latin-1", "ignore")) > budget:
        return None  # a short text, counted at C speed: cheaper than the handler's calls up to the budget
    _left[0] = budget
    try:
        return text.encode("latin-1", "streamprep.latin1_standin")
    except _NoView:
        return None


def _one_pass(table: dict[str, str]) -> Callable[[str], str]:
    """All of `table` in one regex scan (a scan per step costs as much as the step); CR LF is one LF.
    It runs only on a text whose Latin-1 view shows a table key (or that has no view): most text is ASCII
    or Latin-1 without any, and the regex scan cost more than the rest of normalisation."""
    pattern = re.compile("[" + "".join(map(re.escape, sorted(table))) + "]")

    def apply(text: str) -> str:
        if "\r\n" in text:
            text = text.replace("\r\n", "\n")
        return pattern.sub(lambda m: table[m.group()], text)
    return apply


_PROSE_CHARS, _CODE_CHARS = _one_pass(_char_map(prose=True)), _one_pass(_char_map(prose=False))


def _has_line_edge(text: str) -> bool:
    """Whether a newline has a space or tab beside it: the neighbours of the first newlines (texts have
    few), else the four cues searched in the whole text."""
    at = text.find("\n")
    for _ in range(_EDGE_LOOKS):
        if at == -1:
            return False
        if (at and text[at - 1] in " \t") or text[at + 1:at + 2] in (" ", "\t"):
            return True
        at = text.find("\n", at + 1)
    return at != -1 and any(cue in text for cue in _EDGE_CUES)


def _spacing_patterns(prose: bool) -> list[bytes]:
    """The flags databases' "  " and line-edge patterns (pattern ids 1 and 2): none for code, which keeps its
    spacing. Both databases take these, so a text's answers agree whether or not it has a view."""
    return [b"  ", b"[ \t]\n|\n[ \t]"] if prose else []


@lru_cache(maxsize=2)
def _flags_db(prose: bool) -> hyperscan.Database:
    keys = sorted(ord(c) for c in _char_map(prose) if ord(c) < 256)  # the standin is no key
    key_class = b"[" + b"".join(b"\\x%02x" % k for k in keys) + b"]"
    return database([key_class, *_spacing_patterns(prose)], hyperscan.HS_FLAG_SINGLEMATCH)


@lru_cache(maxsize=2)
def _utf8_flags_db(prose: bool) -> hyperscan.Database:
    """`_flags_db` for a text's UTF-8: every table key as its byte sequence (UTF-8 is self-synchronising, so a
    key's sequence occurs only where the key does), and the same ASCII spacing patterns. Without
    HS_FLAG_SINGLEMATCH: with it, hyperscan 0.9.1 missed the spacing patterns' matches after a match of the
    keys' alternation (in 131 of 30 000 random texts; tests/test_quality/test_gates.py tries 20 000)."""
    keys = b"|".join(b"".join(b"\\x%02x" % b for b in c.encode("utf-8", "surrogatepass"))
                     for c in sorted(_char_map(prose)))
    return database([b"(?:" + keys + b")", *_spacing_patterns(prose)])


def utf8_flags(text: str, prose: bool = True) -> tuple[bool, bool, bool]:
    """`view_flags`'s three answers for a text without a Latin-1 view, from one Hyperscan pass over its UTF-8
    (a C4 text without a view: ~7 µs with the encode, where the key regex, the "  " search and the edge
    check cost ~44 on its wide chars)."""
    found = [False, False, False]
    hs.scan(_utf8_flags_db(prose), text.encode("utf-8", "surrogatepass"), hs.flag_match, found)
    return found[0], found[1], found[2]


def view_flags(view: bytes, prose: bool = True) -> tuple[bool, bool, bool]:
    """(a key of the character table, "  ", `_has_line_edge`; for code, False for both) for the text whose
    Latin-1 view this is, from
    one Hyperscan pass (~2 µs on a C4 text, where a byte pass for the keys and the two substring scans
    cost ~11). Without a key the character pass leaves the text as it is, so the two spacing answers
    hold for its output; and collapsing runs of spaces keeps every line edge (a run beside a newline
    stays one space), so the edges before collapsing are those after."""
    found = [False, False, False]
    hs.scan(_flags_db(prose), view, hs.flag_match, found)
    return found[0], found[1], found[2]


_SPACES = re.compile(" *")
RUNS_FOUND = 32  # runs of spaces `_collapse_spaces` finds one by one; the rest of the text is replaced


def _collapse_spaces(text: str) -> str:
    """Every run of spaces as one space (the regex `" {2,}"` -> " ", which stops at every single space). Each of
    the first RUNS_FOUND runs is found by a C-level search and its end matched there, and the pieces are joined
    once. Replacing "  " until none is left copies the text once per halving of its longest run: 2-4 copies of a
    long page with a few runs (~350 µs on the benchmark corpus's 7 000-110 000-char pages with runs, ~90 this
    way), so it only takes the rest of a text with more runs (space-aligned columns), where it is the cheaper."""
    at = text.find("  ")
    if at == -1:
        return text
    pieces, pos = [], 0
    for _ in range(RUNS_FOUND):
        pieces.append(text[pos:at + 1])
        pos = _SPACES.match(text, at).end()
        at = text.find("  ", pos)
        if at == -1:
            pieces.append(text[pos:])
            return "".join(pieces)
    rest = text[pos:]  # it starts past a run: no run crosses the cut
    while True:
        shorter = rest.replace("  ", " ")
        if len(shorter) == len(rest):
            pieces.append(rest)
            return "".join(pieces)
        rest = shorter


_STRIP_SPACING = methodcaller("strip", " \t")


def _strip_line_edges(text: str) -> str:
    """Spaces and tabs beside every newline removed (the regex `"[ \\t]+\\n[ \\t]*|\\n[ \\t]+"` -> "\\n"),
    except before the first line and after the last, which the caller strips with the rest of the ends:
    each line stripped at C level, ~10x the regex's speed on a long text."""
    return "\n".join(map(_STRIP_SPACING, text.split("\n")))


def _common_punct(text: str) -> str:
    """`text` with the frequent curly quotes and dashes made ASCII (the table would map them alike)."""
    for char, plain in _COMMON_PUNCT:
        if char in text:
            text = text.replace(char, plain)
    return text


def _renormalize(text: str) -> str:
    """NFC again after the character pass, which only a text with a table key pays (ASCII and NFC text come
    back as they are, after CPython's quick check): a removed control char may have kept a mark from its base
    (`"e\x00\u0301"`), or a C1 byte become a letter before one (`"\x8a\u0323"`). NFC makes no table key (the
    keys' only canonical twins, U+2000/U+2001, are keys), so the pass need not run again."""
    return unicodedata.normalize("NFC", text)


def normalize_text(text: str, code: bool = False) -> str:
    """NFC; control characters out (C1 repaired as Windows-1252), then NFC again; then, for prose, curly
    quotes and dashes to ASCII, runs of spaces collapsed, lines and the text trimmed; for code, Unix newlines,
    trailing whitespace and trailing blank lines dropped, indentation left as it is.
    """
    return normalize_with_view(text, code)[0]


def prepare(text: str, code: bool = False) -> tuple[str, bytes | None]:
    """The first step of `normalize_with_view`: for prose, the frequent quotes and dashes made ASCII; and the
    Latin-1 view of the result. The schema gate computes it for a non-ASCII text and hands it on
    (`Doc.prepared`): a text with a view holds no lone surrogate (none has a standin), which spares it the
    UTF-8 encode that would prove so (~4 µs on a C4 text with a curly quote)."""
    if not code and not text.isascii():
        text = _common_punct(text)
    return text, latin1_view(text, standins=not code)


def normalize_with_view(text: str, code: bool = False,
                        prepared: tuple[str, bytes | None] | None = None) -> tuple[str, bytes | None]:
    """`normalize_text`, and the normalised text's `latin1_view` when it came for free (the text was
    already normalised but for the frequent quotes and dashes: half of C4), else None. `prepared`: what
    `prepare(text, code)` returned, when it has run."""
    text, view = prepared or prepare(text, code)
    viewed = text
    if view is None and not unicodedata.is_normalized("NFC", text):  # Latin-1 text (and its standins) is NFC
        text = unicodedata.normalize("NFC", text)
    key, double, edge = view_flags(view, not code) if view is not None else utf8_flags(text, not code)
    if code:
        if key:
            text = _renormalize(_CODE_CHARS(text))
        if text.endswith((" ", "\t")) or ("\n" in text and any(cue in text for cue in _TRAILING_CUES)):
            text = _TRAILING.sub("", text)
        text = text.rstrip("\n")
        return text, (view if text is viewed else None)
    if key:  # the spacing answers are for the text before the pass (or there are none)
        text = _renormalize(_PROSE_CHARS(text))
        double, edge = "  " in text, None
    if double:
        text = _collapse_spaces(text)
    if edge if edge is not None else _has_line_edge(text):
        text = _strip_line_edges(text)  # its first and last lines are stripped next, with the text's ends
    text = text.strip(" \t\n")
    return text, (view if text is viewed else None)
