"""The domain gate of `domain: medical`: enough medical vocabulary, from enough areas of medicine.

The shipped vocabulary (`quality/data/medical_terms.json`) lists terms by category (anatomy,
disease, symptom, drug, procedure, lab/measurement, clinical study). A text passes when its bounded
prefix has at least `medical_min_hits` term occurrences, a term density (hits / words) of at least
`medical_min_density` and hits in at least `medical_min_categories` categories: a health-themed
blog post may use "patients" and "treatment", a clinical abstract spans anatomy, drugs and statistics.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache
from importlib import resources

from quality.figures import shown
from quality.gates.base import Doc, Gate, ratio
from quality.language import bounded_sample

_WORD = re.compile(r"[^\W_]+")
_SPLIT = re.compile(r"[\s/-]+")


class Vocabulary:
    """Single words and multi-word terms (as word tuples) -> category."""

    def __init__(self, by_category: dict[str, list[str]]):
        self.single: dict[str, str] = {}
        self.multi: dict[tuple[str, ...], str] = {}
        for category, terms in by_category.items():
            for term in terms:
                words = tuple(_SPLIT.split(term.lower().strip()))
                if len(words) == 1:
                    self.single[words[0]] = category
                else:
                    self.multi[words] = category
        self.longest = max(map(len, self.multi), default=1)
        self.starts = {t[0] for t in self.multi}  # words that may open a multi-word term

    def _single(self, word: str) -> str | None:
        cat = self.single.get(word)
        if cat is None and len(word) > 3 and word[-1] == "s":  # plurals: "arteries", "stents"
            cat = self.single.get(word[:-3] + "y") if word.endswith("ies") else self.single.get(word[:-1])
        return cat

    def hits(self, words: list[str]) -> tuple[int, dict[str, int]]:
        """(term occurrences, occurrences per category), longest match first, left to right."""
        total = 0
        per: dict[str, int] = {}
        i, n = 0, len(words)
        while i < n:
            word, size, cat = words[i], 1, None
            if word in self.starts:
                for k in range(min(self.longest, n - i), 1, -1):
                    cat = self.multi.get(tuple(words[i:i + k]))
                    if cat is not None:
                        size = k
                        break
            if cat is None:
                cat = self._single(word)
            if cat is not None:
                total += 1
                per[cat] = per.get(cat, 0) + 1
            i += size
        return total, per


@lru_cache(maxsize=1)
def load_vocabulary() -> Vocabulary:
    raw = json.loads(resources.files("quality").joinpath("data/medical_terms.json").read_text("utf-8"))
    return Vocabulary({k: v for k, v in raw.items() if not k.startswith("_")})


class MedicalGate(Gate):
    text_only = True
    name = failed_check = "domain"

    def __init__(self, min_hits: int, min_density: float, min_categories: int, sample_chars: int):
        self.min_hits, self.min_density, self.min_categories = min_hits, min_density, min_categories
        self.sample_chars = sample_chars
        self.vocab = load_vocabulary()

    def check(self, doc: Doc) -> str | None:
        words = _WORD.findall(bounded_sample(doc.lower, self.sample_chars))
        hits, per = self.vocab.hits(words)
        density = hits / len(words) if words else 0.0
        doc.meta.update(medical_hits=hits, medical_density=ratio(density), medical_categories=len(per))
        if hits < self.min_hits:
            return f"medical terms {hits} < medical_min_hits {self.min_hits}"
        if density < self.min_density:
            return f"medical term density {shown(density, self.min_density)} < medical_min_density {self.min_density:g}"
        if len(per) < self.min_categories:
            return f"medical categories {len(per)} < medical_min_categories {self.min_categories}"
        return None
