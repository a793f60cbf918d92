"""Copyright notices: a text that says it is someone's property is not ours to train on."""
from __future__ import annotations

import re

from quality.gates.base import Doc, Gate
from quality.gates.lexicon import scan
from quality.gates.profanity import load_words

_NOTICE = re.compile(r"copyright|\u00a9|&copy;|\(c\)\s*(?:19|20)\d\d|all\s+rights\s+reserved", re.IGNORECASE)
_CUES = ("copyright", "\u00a9", "&copy;", "(c)", "rights")  # cheap `in` tests before the regex


def notice_starts(text: str, cues: list[tuple[str, int]]) -> list[int]:
    """Every position where `_NOTICE` can match in a Latin-1 `text`, sorted, from its cue positions: a notice
    starts at its cue, except "all rights reserved", which starts at the "all" before the whitespace run
    ending at "rights". In Latin-1 text, IGNORECASE only folds ASCII letters, so every match has its cue."""
    starts = set()
    for cue, at in cues:
        if cue == "rights":
            ws = at
            while ws and text[ws - 1].isspace():  # what the regex's \s matches, in str patterns
                ws -= 1
            if ws < at and ws >= 3:
                starts.add(ws - 3)
        else:
            starts.add(at)
    return sorted(starts)


class CopyrightGate(Gate):
    """Rejects on "copyright", "©", "(c) 2019" or "all rights reserved", case-insensitively.

    The regex is tried only where the shared scan saw a cue (IGNORECASE search costs ~30 ns a char: 100 µs
    on a text with "rights" in it and no notice); without cue positions it searches the whole text."""

    text_only = True
    name = failed_check = "copyright"

    def __init__(self) -> None:
        self.words = tuple(sorted(load_words()))  # the shared scan's word list (profanity's, run before)

    def check(self, doc: Doc) -> str | None:
        found = scan(doc, self.words)  # usually already computed by the profanity gate
        if found is None:
            if not any(cue in doc.lower for cue in _CUES):
                return None
            m = _NOTICE.search(doc.text)
        elif not found.copyright_cue:
            return None
        elif found.cues is None:
            m = _NOTICE.search(doc.text)
        else:
            m = None
            for start in notice_starts(doc.text, found.cues):  # the first that matches is the leftmost match
                m = _NOTICE.match(doc.text, start)
                if m is not None:
                    break
        if m is None:
            return None
        return f"copyright notice {m.group()[:40]!r} at char {m.start()}"
