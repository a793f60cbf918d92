"""The normalise step: fixes the text every later gate sees and the digest dedup compares."""
from __future__ import annotations

import hashlib

from quality.gates.base import Doc, Gate
from quality.normalize import normalize_with_view


class NormalizeStep(Gate):
    """Never rejects; sets `doc.text`, `doc.digest` and the `chars` / `sha256` signals.

    The digest is always taken from the normalised text, whether or not the kept text is normalised.
    """

    name = failed_check = "normalize"

    def __init__(self, code: bool):
        self.code = code

    def check(self, doc: Doc) -> str | None:
        doc.text, view = normalize_with_view(doc.raw, self.code, doc.prepared)
        if view is not None:
            doc._latin1 = view  # what `doc.latin1` would compute again for the byte-scanning gates
        doc.meta["chars"] = len(doc.text)
        if doc.text:
            ascii_view = view is not None and doc.text.isascii()  # then the view is the UTF-8
            data = view if ascii_view else doc.text.encode("utf-8")
            digest = hashlib.sha256(data).digest()
            doc.digest, doc.text_bytes = digest, len(data)
            doc.meta["sha256"] = digest.hex()
        return None
