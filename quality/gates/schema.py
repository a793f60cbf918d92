"""Structural gates: is there a usable text at all, and does the record carry the metadata the run requires."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from quality.gates.base import Doc, Gate
from quality.normalize import prepare

_MISSING = object()
# What a text may hold and still show nothing: white space (the line and paragraph separators U+2028/9 among it),
# every format character (Unicode category Cf: zero-width spaces and joiners, the soft hyphen, bidi marks, the BOM,
# interlinear annotation marks, tags, …) but the prepended concatenation marks (U+0600-0605, U+06DD, …, shown as
# signs), and the blank-looking letters: the Hangul fillers and the braille blank. A text of these alone is
# empty, as one of spaces is (tested against unicodedata over every code point).
_BLANK = "".join(chr(c) for lo, hi in (
    (0x09, 0x0D), (0x1C, 0x20), (0x85, 0x85), (0xA0, 0xA0), (0xAD, 0xAD), (0x61C, 0x61C), (0x115F, 0x1160),
    (0x1680, 0x1680), (0x180E, 0x180E), (0x2000, 0x200F), (0x2028, 0x202F), (0x205F, 0x2064), (0x2066, 0x206F),
    (0x2800, 0x2800), (0x3000, 0x3000), (0x3164, 0x3164), (0xFEFF, 0xFEFF), (0xFFA0, 0xFFA0), (0xFFF9, 0xFFFB),
    (0x13430, 0x13438), (0x1BCA0, 0x1BCA3), (0x1D173, 0x1D17A), (0xE0001, 0xE0001), (0xE0020, 0xE007F))
    for c in range(lo, hi + 1))


def _kind(value: Any) -> str:
    return "None" if value is None else type(value).__name__


class SchemaGate(Gate):
    """Record is a mapping with a valid `str` text no longer than `max_chars`, and the required fields.

    Runs before normalisation, so `max_chars` also bounds the work done on absurd inputs.
    """

    name = failed_check = "schema"

    def __init__(self, text_field: str, required_fields: Sequence[str], max_chars: int, code: bool = False):
        self.text_field = text_field
        self.required = [f for f in required_fields if f not in ("text", text_field)]  # "text" means text_field
        self.max_chars = max_chars
        self.code = code  # the normalise step's mode, whose first step this gate runs (`prepare`)

    def check(self, doc: Doc) -> str | None:
        record = doc.record
        if type(record) is not dict and not isinstance(record, Mapping):  # the ABC check costs more than the gate
            return f"schema: record is {_kind(record)}, not a mapping"
        text = record.get(self.text_field, _MISSING)
        if text is _MISSING:
            return f"schema: no '{self.text_field}' field"
        if not isinstance(text, str):
            return f"schema: {self.text_field} is {_kind(text)}"
        for key in self.required:
            if record.get(key) is None:
                return f"schema: required field '{key}' missing"
        if len(text) > self.max_chars:
            return f"schema: {len(text)} chars > max_chars {self.max_chars}"
        if not text.isascii():
            doc.prepared = prepare(text, self.code)  # with a Latin-1 view, no lone surrogate: else look for one
            if doc.prepared[1] is None:
                try:
                    text.encode()  # C speed; fails exactly at the first lone surrogate
                except UnicodeEncodeError as exc:
                    return f"schema: {self.text_field} has an unpaired surrogate at char {exc.start}"
        doc.raw = text
        return None


class LengthGate(Gate):
    """`min_chars` / `max_chars` on the normalised text; an empty text is never kept."""

    text_only = cheap = True
    name = "length"
    failed_check = "schema"

    def __init__(self, min_chars: int, max_chars: int):
        self.min_chars, self.max_chars = min_chars, max_chars

    def check(self, doc: Doc) -> str | None:
        n = len(doc.text)
        if n == 0 or not doc.text.strip(_BLANK):  # strip stops at the first visible character: ~0.1 µs
            return "schema: text is empty after normalisation"
        if n < self.min_chars:
            return f"schema: {n} chars < min_chars {self.min_chars}"
        if n > self.max_chars:
            return f"schema: {n} chars > max_chars {self.max_chars}"
        return None


def _lookup(record: Mapping, key: str) -> Any:
    """`record["metadata"][key]`, else `record["meta"][key]`, else `record[key]`."""
    for holder in ("metadata", "meta"):
        inner = record.get(holder)
        if isinstance(inner, Mapping) and inner.get(key) is not None:
            return inner[key]
    return record.get(key)


class MetadataGate(Gate):
    """`required_metadata` keys present; the licence, when `allowed_licenses` is set, in that list."""

    name = failed_check = "metadata"

    def __init__(self, required: Sequence[str], allowed_licenses: Sequence[str] | None):
        self.required = required
        self.allowed = None if allowed_licenses is None else {x.strip().lower() for x in allowed_licenses}

    def check(self, doc: Doc) -> str | None:
        for key in self.required:
            if _lookup(doc.record, key) is None:
                return f"metadata: missing '{key}'"
        if self.allowed is not None:
            lic = _lookup(doc.record, "license")
            if lic is None:
                lic = _lookup(doc.record, "licence")
            if lic is None:
                return "metadata: no license"
            if not isinstance(lic, str) or lic.strip().lower() not in self.allowed:
                return f"metadata: license {str(lic)[:60]!r} not in allowed_licenses"
            doc.meta["license"] = lic.strip()
        return None
