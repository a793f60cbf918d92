"""The language gate of `domain: general`: the expected language must reach `min_language_prob`."""
from __future__ import annotations

from quality.gates.base import Doc, Gate, ratio
from quality.language import bounded_sample, make_detector


class LanguageGate(Gate):
    """Detects the language of a bounded prefix; records the top language and its figure."""

    text_only = True
    name = failed_check = "language"

    def __init__(self, expected: str, min_prob: float, detector: str, sample_chars: int):
        self.expected, self.min_prob, self.sample_chars = expected, min_prob, sample_chars
        self.detector = make_detector(detector)

    def check(self, doc: Doc) -> str | None:
        sample = bounded_sample(doc.text, self.sample_chars)
        found = self.detector.detect(sample)
        if not found.probs:
            return f"language: undetectable ({found.source}, {len(sample)}-char sample)"
        probs, meta = found.probs, doc.meta
        top = max(probs, key=probs.__getitem__)  # the first of the highest, as max over the items gives it
        top_p = probs[top]
        meta["language"], meta["language_prob"], meta["language_detector"] = top, ratio(top_p), found.source
        p = probs.get(self.expected, 0.0)
        if p >= self.min_prob:
            return None
        if top == self.expected:
            return f"language {top} p={ratio(p):g} < {self.min_prob:g}"
        return f"language {top} p={ratio(top_p):g}, {self.expected} p={ratio(p):g} < {self.min_prob:g}"
