"""Copyright notices: a text that says it is someone's property is not ours to train on."""
from __future__ import annotations

import re

from quality.gates.base import Doc, Gate

_NOTICE = re.compile(r"copyright|\u00a9|&copy;|\(c\)\s*(?:19|20)\d\d|all\s+rights\s+reserved", re.IGNORECASE)
_CUES = ("copyright", "\u00a9", "&copy;", "(c)", "rights")  # cheap `in` tests before the regex


class CopyrightGate(Gate):
    """Rejects on "copyright", "©", "(c) 2019" or "all rights reserved", case-insensitively."""

    name = failed_check = "copyright"

    def check(self, doc: Doc) -> str | None:
        lower = doc.lower
        if not any(cue in lower for cue in _CUES):
            return None
        m = _NOTICE.search(doc.text)
        if m is None:
            return None
        return f"copyright notice {m.group()[:40]!r} at char {m.start()}"
