"""Profanity: share of word tokens that are on the shipped list, seeing through common obfuscations.

Tokens keep the symbols people use to disguise words ("f*ck", "sh1t", "a$$", "b!tch"), then:
1. a plain token is looked up in the word set;
2. any other token with a letter is stripped of edge "!"/"|", leetspeak is mapped back to letters
   (0→o, 1→i or l, 3→e, 4→a, 5→s, 7→t, @→a, $→s, !→i, |→i or l) and looked up again;
3. one still holding a mask ("*" or "#") is looked up among the masked forms of the list, where any
   run of letters after the first one may be starred out letter for letter ("f*ck", "f**k", "a**").
"""
from __future__ import annotations

import re
from functools import lru_cache
from itertools import filterfalse
from importlib import resources

from quality.gates.base import Doc, Gate, ratio

_TOKEN = re.compile(r"[\w@$*#!|]+")
_LEET = [str.maketrans({"0": "o", "1": first, "3": "e", "4": "a", "5": "s", "7": "t", "@": "a", "$": "s",
                        "!": "i", "|": first, "#": "*"}) for first in ("i", "l")]


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

    name = failed_check = "profanity"

    def __init__(self, max_density: float):
        self.max_density = max_density
        self.words = load_words()
        self.masked = masked_forms(self.words)

    def is_profane(self, token: str) -> bool:
        """Whether one lower-case token is a listed word, plainly or obfuscated."""
        if token in self.words:
            return True
        if token.isalpha() or token.isdigit():
            return False
        token = token.strip("!|")
        for table in _LEET:
            plain = token.translate(table)
            if plain in self.words or ("*" in plain and plain in self.masked):
                return True
        return False

    def check(self, doc: Doc) -> str | None:
        tokens = _TOKEN.findall(doc.lower)
        if not tokens:
            doc.meta["profanity_density"] = 0.0
            return None
        limit = self.max_density * len(tokens)
        hits = sum(map(self.words.__contains__, tokens))  # plain words, at C speed
        for token in filterfalse(str.isalpha, tokens):   # then only tokens with digits or symbols
            if hits > limit:
                break
            hits += self.is_profane(token)
        density = hits / len(tokens)
        doc.meta["profanity_density"] = ratio(density)
        if hits > limit:
            return f"profanity density {ratio(density):g} > {self.max_density:g} ({hits} of {len(tokens)} tokens)"
        return None
