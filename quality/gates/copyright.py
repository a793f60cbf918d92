"""Copyright notices: a text that says it is someone's property is not ours to train on."""
from __future__ import annotations

import re

from quality.gates.base import Doc, Gate
from quality.gates.lexicon import scan
from quality.gates.profanity import load_words

_NOTICE = re.compile(r"copyright|\u00a9|&copy;|\(c\)\s*(?:19|20)\d\d|all\s+rights\s+reserved", re.IGNORECASE)
_CUES = ("copyright", "\u00a9", "&copy;", "(c)", "rights")  # cheap `in` tests before the regex


class CopyrightGate(Gate):
    """Rejects on "copyright", "©", "(c) 2019" or "all rights reserved", case-insensitively."""

    text_only = True
    name = failed_check = "copyright"

    def __init__(self) -> None:
        self.words = tuple(sorted(load_words()))  # the shared scan's word list (profanity's, run before)

    def check(self, doc: Doc) -> str | None:
        found = scan(doc, self.words)  # usually already computed by the profanity gate
        if not (found.copyright_cue if found is not None else any(cue in doc.lower for cue in _CUES)):
            return None
        m = _NOTICE.search(doc.text)
        if m is None:
            return None
        return f"copyright notice {m.group()[:40]!r} at char {m.start()}"
