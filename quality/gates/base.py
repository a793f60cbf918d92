"""What every gate shares: the per-record working state and the one-method gate interface.

A gate answers "keep? and if not, why" (datatrove's filter shape); the runner in `quality.control`
does the counting, timing and reject bookkeeping for all of them, so a gate is only its test.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from collections.abc import Callable
from fractions import Fraction
from typing import Any, ClassVar

from quality.normalize import latin1_view


@dataclass(slots=True)
class Doc:
    """One record on its way through the gates; gates read `text` and add signals to `meta`."""

    record: Any
    raw: str = ""                 # the record's text as given (set by the schema gate)
    text: str = ""                # the normalised text every content gate looks at
    digest: bytes | None = None   # SHA-256 of `text`, set by the normalise step
    text_bytes: int | None = None  # UTF-8 bytes of `text`, set by the normalise step (it encodes them to hash)
    meta: dict[str, Any] = field(default_factory=dict)
    _lower: str | None = field(default=None, init=False, repr=False)
    _latin1: bytes | None | bool = field(default=False, init=False, repr=False)  # False: not computed yet
    scan: Any = field(default=None, init=False, repr=False)  # quality.gates.lexicon.scan's result, once computed
    # `quality.normalize.prepare(raw)`, when the schema gate computed it for a non-ASCII text (normalisation's start)
    prepared: tuple[str, bytes | None] | None = field(default=None, init=False, repr=False)

    @property
    def lower(self) -> str:
        """`text.lower()`, computed once for the gates that match case-insensitively."""
        if self._lower is None:
            self._lower = self.text.lower()
        return self._lower

    @property
    def latin1(self) -> bytes | None:
        """`quality.normalize.latin1_view(text)`, computed once for the gates that scan bytes (PII, word lists)."""
        if self._latin1 is False:
            self._latin1 = latin1_view(self.text)
        return self._latin1  # type: ignore[return-value]  # never False here


class Gate(ABC):
    """One quality check. `name` keys its stats; `failed_check` is what a reject reports."""

    name: ClassVar[str]
    failed_check: ClassVar[str]
    # True when `check` reads nothing but `doc.text` (and `doc.lower`) and writes only `doc.meta`: the same
    # normalised text then always gets the same verdict, so `QualityControl` may reuse it. Off by default.
    text_only: ClassVar[bool] = False
    # True when `check` costs less than looking its verdict up (a length test): a chain of only such gates after
    # normalisation is run again rather than remembered.
    cheap: ClassVar[bool] = False

    @abstractmethod
    def check(self, doc: Doc) -> str | None:
        """Return None to keep the record, else a short reason carrying the figure that failed."""

    def check_batch(self, docs: list[Doc]) -> list[str | None]:
        """`check` on each doc, in order. A gate that can share work across a batch overrides this; if it
        raises, the runner falls back to `check` per doc, so a bad record still costs only itself."""
        return list(map(self.check, docs))


def ratio(x: float) -> float:
    """Signals go into meta rounded to 4 decimals: small, JSON-friendly and stable."""
    return round(float(x), 4)


def most_within(max_density: float) -> Callable[[int], int]:
    """`n -> the most hits of n whose density stays within max_density` as the decimal it is written as (0.009
    of 3 000 is 27): `max_density * n` rounds (26.999999999999996), so hits compared with it rejected a density
    on its limit. Integers from here on, as cheap per doc as the product."""
    exact = Fraction(repr(float(max_density)))
    p, q = exact.numerator, exact.denominator
    return lambda n: n * p // q
