"""Profanity: share of word tokens that are on the shipped list, seeing through common obfuscations.

Tokens keep the symbols people use to disguise words ("f*ck", "sh1t", "a$$", "b!tch"), then:
1. a plain token is looked up in the word set, case-blind, but two or three capitals then a lower-case "s" are
   an acronym's plural ("PISs", participant information sheets; "ASs"), not the listed word ("piss", "ass"); a
   longer stem is the word shouted ("CUNTs", "SHITs", "MOTHERFUCKERs" count);
2. any other token with a letter is stripped of edge "!"/"|", leetspeak is mapped back to letters
   (0→o, 1→i or l, 3→e, 4→a, 5→s, 7→t, @→a, $→s, !→i, |→i or l) and looked up again, unless it is
   letters then digits only, or such a name's plural: that is how models, chips and roads are named (Galaxy A55,
   Cortex-A55, SH17, two SH17s), and such a token is not leetspeak ("a55" is no "ass"; "a55hole", "sh1t",
   "sh1ts", "5hit", "a$$" still are);
3. one still holding a mask ("*" or "#") is looked up among the masked forms of the list, where any
   run of letters after the first one may be starred out letter for letter ("f*ck", "f**k", "a**").

The scan does not build the token list (that cost more than the rest of the chain together): it reads
the shared one-byte-per-char scan of `quality.gates.lexicon`, whose Hyperscan pass counts the tokens that
are listed words and points at the few tokens that may be obfuscated ones (letters, leetspeak digits and
symbols only, with a symbol or a letter beside a digit); only those go through the obfuscation lookup, and
tokens are counted as class-run starts (numpy) only in a text with a hit. The counts are the token
list's exactly (`density_by_tokens`, the reference scan and the one for texts too rich in non-ASCII for
the shared scan).
"""
from __future__ import annotations

import re
from functools import lru_cache
from itertools import filterfalse
from importlib import resources

import numpy as np

from quality.figures import shown
from quality.gates.base import Doc, Gate, most_within, ratio
from quality.gates.lexicon import classes, scan

MEMO_TOKENS = 65_536  # candidate tokens a gate remembers (~100 B each)
_TOKEN_CHAR = r"[\w@$*#!|]"  # a token's chars: letters, digits and the symbols that disguise a word
_TOKEN = re.compile(_TOKEN_CHAR + "+")
_LEET = [str.maketrans({"0": "o", "1": first, "3": "e", "4": "a", "5": "s", "7": "t", "@": "a", "$": "s",
                        "!": "i", "|": first, "#": "*"}) for first in ("i", "l")]
_DIGITS = "0123456789"
_ACRONYM = 3  # longest stem read as an acronym before a plural "s": PIS, AS; the list's 4-letter ones are the word shouted (CUNTs, SHITs)


@lru_cache(maxsize=1)
def load_words() -> frozenset[str]:
    """The shipped list `quality/data/profanity.txt` (lower case, comments and blanks skipped)."""
    text = resources.files("quality").joinpath("data/profanity.txt").read_text("utf-8")
    return frozenset(w for w in (line.split("#", 1)[0].strip().lower() for line in text.splitlines()) if w)


def masked_forms(words: frozenset[str]) -> frozenset[str]:
    """Every word with one run of letters after the first starred out, letter for letter."""
    forms = set()
    for w in words:
        for i in range(1, len(w)):
            for j in range(i + 1, len(w) + 1):
                forms.add(w[:i] + "*" * (j - i) + w[j:])
    return frozenset(forms)


class ProfanityGate(Gate):
    """Rejects when profane tokens / word tokens exceeds `profanity_max_density`."""

    text_only = True
    name = failed_check = "profanity"

    def __init__(self, max_density: float):
        self.max_density, self._most = max_density, most_within(max_density)
        self.words = load_words()
        self.masked = masked_forms(self.words)
        self.sorted_words = tuple(sorted(self.words))
        self.lengths = range(min(map(len, self.words)), max(map(len, self.words)) + 1)
        self._memo: dict[bytes, bool] = {}  # candidate token (scan bytes) -> is_profane of its lower-case form
        # a listed word ending in "s" written as 2-3 capitals then "s" is an acronym's plural ("PISs": participant
        # information sheets; "ASs": autonomous systems), which the case-blind lookup took for the word; every
        # longer stem on the list is the word itself in capitals (CUNTs, SHITs, NIGGERs), no acronym
        stems = "|".join(sorted(w[:-1].upper() for w in self.words if w.endswith("s") and len(w) <= _ACRONYM + 1))
        self._acronym_plural = re.compile(rf"(?<!{_TOKEN_CHAR})(?:{stems})s(?!{_TOKEN_CHAR})")

    def is_profane(self, token: str) -> bool:
        """Whether one lower-case token is a listed word, plainly or obfuscated. The tables map one char to
        one, so a stripped token of no listed length is none, and one of letters only is itself."""
        if token in self.words:
            return True
        if token.isalpha() or token.isdigit():
            return False
        token = token.strip("!|")
        if len(token) not in self.lengths:
            return False
        if token.isalpha():
            return token in self.words
        # letters then digits, or their plural: a name or code (Cortex-A55, SH17, two SH17s), not leetspeak
        if token.removesuffix("s").rstrip(_DIGITS).isalpha():
            return False
        for table in _LEET:
            plain = token.translate(table)
            if plain in self.words or ("*" in plain and plain in self.masked):
                return True
        return False

    def _candidate(self, token: bytes) -> bool:
        """`is_profane` of a candidate token's lower-case form, remembered: the same few (1st, mp3, you!, 4x4)
        come back doc after doc, and the lookup is a tenth of the tables' cost. At most MEMO_TOKENS kept."""
        found = self._memo.get(token)
        if found is None:
            if len(self._memo) >= MEMO_TOKENS:
                self._memo.clear()
            found = self._memo[token] = self.is_profane(token.lower().decode())
        return found

    def _plain(self, hits: int, text: str) -> int:
        """Listed-word tokens of `text`, of the `hits` the case-blind lookup found: less its acronym plurals."""
        return hits - len(self._acronym_plural.findall(text)) if hits else 0

    def density_by_tokens(self, doc: Doc) -> tuple[int, int]:
        """(hits, tokens) from the token list: the reference scan, and the one for texts rich in non-ASCII."""
        tokens = _TOKEN.findall(doc.lower)
        limit = self._most(len(tokens))
        hits = self._plain(sum(map(self.words.__contains__, tokens)), doc.text)  # plain words, at C speed
        for token in filterfalse(str.isalpha, tokens):   # then only tokens with digits or symbols
            if hits > limit:
                break
            hits += self.is_profane(token)
        return hits, len(tokens)

    def density_by_scan(self, doc: Doc) -> tuple[int, int] | None:
        """(hits, tokens) as `density_by_tokens` gives them, from the shared scan, except that a text without
        hits reports 0 tokens (its density is 0 either way, so it is not counted); None without a scan.
        There, obfuscated tokens are looked up in text order until the hits exceed the limit, so the
        count reported is min(plain + obfuscated, the first integer above the limit) unless the plain
        hits alone exceed it; here every candidate is looked up first and the tokens counted after."""
        found = scan(doc, self.sorted_words)
        if found is None:
            return None
        data, plain = found.data, self._plain(found.plain, doc.text)
        tokens_of = classes(data) if found.candidates or plain else b""
        n = len(data)
        obfuscated = 0
        end = -1  # the end of the token last looked up: a token may hold several candidate positions
        for at in found.candidates:
            if at < end:
                continue
            start = tokens_of.rfind(b" ", 0, at) + 1
            end = tokens_of.find(b" ", at)
            end = n if end == -1 else end
            if tokens_of.find(b"z", start, end) == -1:  # a token of letters and symbols only is ASCII: its
                obfuscated += self._candidate(data[start:end])  # lower bytes are `doc.lower`'s
        if not plain + obfuscated:
            return 0, 0
        cls = np.frombuffer(tokens_of, np.uint8)  # a token starts where a separator (32) is followed by a token char
        tokens = int(np.count_nonzero((cls[:-1] == 32) & (cls[1:] != 32))) + (tokens_of[:1] != b" ")
        limit = self._most(tokens)
        return (plain if plain > limit else min(plain + obfuscated, limit + 1)), tokens

    def check(self, doc: Doc) -> str | None:
        found = self.density_by_scan(doc)
        hits, tokens = found if found is not None else self.density_by_tokens(doc)
        if not tokens:
            doc.meta["profanity_density"] = 0.0
            return None
        limit = self._most(tokens)
        density = hits / tokens
        doc.meta["profanity_density"] = ratio(density)
        if hits > limit:
            return (f"profanity density {shown(density, self.max_density)} > {self.max_density:g} "
                    f"({hits} of {tokens} tokens)")
        return None
