"""The language gate of `domain: general`: the expected language must reach `min_language_prob`."""
from __future__ import annotations

from quality.figures import shown
from quality.gates.base import Doc, Gate, ratio
from quality.language import bounded_sample, make_detector

ROUNDED_KEPT = 4096  # top figures whose `ratio` a gate keeps


class LanguageGate(Gate):
    """Detects the language of a bounded prefix; records the top language and its figure."""

    text_only = True
    name = failed_check = "language"

    def __init__(self, expected: str, min_prob: float, detector: str, sample_chars: int):
        self.expected, self.min_prob, self.sample_chars = expected, min_prob, sample_chars
        self.detector = make_detector(detector)
        self._rounded: dict[float, float] = {}  # ratio() of the top figures seen (CLD2's: sums of whole percents)

    def check(self, doc: Doc) -> str | None:
        sample = bounded_sample(doc.text, self.sample_chars)
        found = self.detector.detect(sample)
        if not found.probs:
            return f"language: undetectable ({found.source}, {len(sample)}-char sample)"
        probs, meta = found.probs, doc.meta
        # the first of the highest, as max over the items gives it (most samples have one language)
        top = max(probs, key=probs.__getitem__) if len(probs) > 1 else next(iter(probs))
        top_p = probs[top]
        rounded = self._rounded.get(top_p)
        if rounded is None:  # `round` to 4 places costs ~5x the lookup; langdetect's figures are not few
            if len(self._rounded) >= ROUNDED_KEPT:
                self._rounded.clear()
            rounded = self._rounded[top_p] = ratio(top_p)
        meta["language"], meta["language_prob"], meta["language_detector"] = top, rounded, found.source
        p = probs.get(self.expected, 0.0)
        if p >= self.min_prob:
            return None
        if top == self.expected:
            return f"language {top} p={shown(p, self.min_prob)} < {self.min_prob:g}"
        return f"language {top} p={ratio(top_p):g}, {self.expected} p={shown(p, self.min_prob)} < {self.min_prob:g}"
