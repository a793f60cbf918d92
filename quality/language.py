"""Language detectors behind one interface, with language codes normalised across them.

- `cld2`: pycld2 (model compiled in, offline, ~20 µs per sentence). Its figure is the share of the
  text's bytes in each language, so a half-English page scores ~0.5 for English.
- `langdetect`: the n-gram Bayesian detector, seeded so that results are deterministic. Its figure
  is a posterior probability that saturates (a 70 %-English page often scores > 0.99).
- `cascade`: CLD2 decides whenever it calls its own result reliable; only the texts CLD2 is unsure
  about (short, ambiguous, mostly names or numbers) go to langdetect.

Measured accuracy and costs are in docs/quality.md.
"""
from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from langdetect.detector_factory import DetectorFactory

# Detector codes that differ from the ISO 639-1 base code: CLD2 uses old codes for Hebrew,
# Indonesian, Yiddish and Javanese; both detectors split Chinese by script; "nb" is Norwegian.
_ALIASES = {"iw": "he", "in": "id", "ji": "yi", "jw": "jv", "nb": "no"}
# pycld2 raises on control characters and Unicode non-characters; they carry no language anyway.
_CLD2_UNSAFE = re.compile(
    "[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\ufdd0-\ufdef"
    + "".join(chr(plane << 16 | 0xFFFE) + chr(plane << 16 | 0xFFFF) for plane in range(17))
    + "]"
)
# The same characters as UTF-8 bytes: the check runs on the bytes pycld2 is given anyway, at C speed.
_ASCII_UNSAFE = bytes([*range(0x00, 0x09), 0x0B, *range(0x0E, 0x20), 0x7F])
_UTF8_UNSAFE = re.compile(
    rb"[\x00-\x08\x0b\x0e-\x1f\x7f]|\xc2[\x80-\x9f]|\xef\xb7[\x90-\xaf]|\xef\xbf[\xbe\xbf]"
    rb"|[\xf0-\xf4][\x8f\x9f\xaf\xbf]\xbf[\xbe\xbf]"
)

_UNSAFE_LEADS = (b"\xc2", b"\xef", b"\xf0", b"\xf1", b"\xf2", b"\xf3", b"\xf4")  # C1, U+FDD0.., U+FFFE..


def cld2_input(sample: str) -> bytes | str:
    """`sample` without the characters pycld2 refuses, as the UTF-8 bytes pycld2 would encode it to.
    ASCII: one `bytes.translate`; other text: memchr tests for the lead bytes such chars start with, a
    bytes regex only when one is there, and the str regex only when that finds a refused char."""
    if sample.isascii():
        return sample.encode().translate(None, _ASCII_UNSAFE)
    try:
        data = sample.encode()
    except UnicodeEncodeError:  # a lone surrogate: pycld2 reports it as an error, as before
        return _CLD2_UNSAFE.sub("", sample)
    if len(data.translate(None, _ASCII_UNSAFE)) == len(data) and not any(lead in data for lead in _UNSAFE_LEADS):
        return data  # memchr-speed tests: no ASCII control, no lead byte any refused char starts with
    return data if _UTF8_UNSAFE.search(data) is None else _CLD2_UNSAFE.sub("", sample)


@lru_cache(maxsize=1024)
def normalize_code(code: str) -> str:
    """One code per language: "zh-cn", "zh-Hant", "ZH" -> "zh"; "iw" -> "he"; "nb" -> "no"."""
    base = code.strip().lower().replace("_", "-").split("-", 1)[0]
    return _ALIASES.get(base, base)


def bounded_sample(text: str, limit: int) -> str:
    """A deterministic prefix of at most `limit` chars, cut at the last whitespace when there is one
    in its second half (texts without spaces, such as Chinese, are cut hard)."""
    if len(text) <= limit:
        return text
    cut = max(text.rfind(" ", 0, limit + 1), text.rfind("\n", 0, limit + 1))
    return text[:cut] if cut > limit // 2 else text[:limit]


class Detection(NamedTuple):
    probs: dict[str, float]  # normalised code -> probability (langdetect) or text share (CLD2); empty: undecidable
    reliable: bool
    source: str              # the detector whose figures these are


class Detector(Protocol):
    name: str

    def detect(self, sample: str) -> Detection: ...


@lru_cache(maxsize=1)
def _pycld2() -> ModuleType:
    """The pycld2 module, imported on first use (an import statement per call costs more than a cache hit)."""
    import pycld2

    return pycld2


class Cld2Detector:
    name = "cld2"

    def detect(self, sample: str) -> Detection:
        """pycld2 takes the str as it is first (its UTF-8 is the str's own buffer for ASCII): it refuses every
        char `cld2_input` drops (tested on all code points), so a str it accepts is the bytes `cld2_input`
        gives; only a refused one pays for `cld2_input` (2.9 µs a C4 sample) and a second call."""
        pycld2 = _pycld2()
        try:
            try:
                reliable, _, details = pycld2.detect(sample, True)  # isPlainText, positional: no kwargs dict
            except (pycld2.error, UnicodeEncodeError):
                reliable, _, details = pycld2.detect(cld2_input(sample), True)
        except pycld2.error:
            return Detection({}, False, self.name)
        percents: dict[str, int] = {}  # whole percents, summed before dividing: 0.72 + 0.18 is 0.8999999999999999
        for _, code, percent, _ in details:
            if code != "un" and percent > 0:
                key = normalize_code(code)
                percents[key] = percents.get(key, 0) + percent
        probs = {k: p / 100 for k, p in percents.items()}
        return Detection(probs, bool(reliable and probs), self.name)


@lru_cache(maxsize=1)
def _langdetect_factory() -> DetectorFactory:
    """Profiles load once per process (~0.5 s); our own factory, seeded 0, leaves langdetect's global alone."""
    from langdetect.detector_factory import PROFILES_DIRECTORY, DetectorFactory

    factory = DetectorFactory()
    factory.load_profile(PROFILES_DIRECTORY)
    factory.set_seed(0)  # the per-factory form of `DetectorFactory.seed = 0`: same text, same answer
    return factory


class LangdetectDetector:
    name = "langdetect"

    def detect(self, sample: str) -> Detection:
        from langdetect.lang_detect_exception import LangDetectException

        detector = _langdetect_factory().create()
        detector.append(sample)
        try:
            found = detector.get_probabilities()
        except LangDetectException:  # no usable features (digits, symbols, empty)
            return Detection({}, False, self.name)
        probs: dict[str, float] = {}
        for lang in found:
            key = normalize_code(lang.lang)
            probs[key] = probs.get(key, 0.0) + lang.prob
        return Detection(probs, bool(probs), self.name)


class CascadeDetector:
    name = "cascade"

    def __init__(self) -> None:
        self.cld2, self.langdetect = Cld2Detector(), LangdetectDetector()

    def detect(self, sample: str) -> Detection:
        first = self.cld2.detect(sample)
        return first if first.reliable else self.langdetect.detect(sample)


DETECTORS: dict[str, type] = {"cld2": Cld2Detector, "langdetect": LangdetectDetector, "cascade": CascadeDetector}


@lru_cache(maxsize=None)
def detectable(detector: str) -> frozenset[str]:
    """The normalised codes `detector` can report (`expected_language` outside them rejects every record): CLD2's
    detected languages but its script-only X_* entries, langdetect's profiles (read by name, langdetect not
    imported), both for the cascade."""
    codes: set[str] = set()
    if detector in ("cld2", "cascade"):
        pycld2 = _pycld2()
        named = set(pycld2.DETECTED_LANGUAGES)
        codes |= {normalize_code(code) for name, code in pycld2.LANGUAGES  # X_*: a script, not a language
                  if name in named and not name.startswith("X_")}
    if detector in ("langdetect", "cascade"):
        spec = importlib.util.find_spec("langdetect")
        profiles = Path(next(iter(spec.submodule_search_locations)), "profiles") if spec else None
        codes |= {normalize_code(p.name) for p in profiles.iterdir()} if profiles and profiles.is_dir() else set()
    return frozenset(codes)


# CLD2 gives each of these languages every byte of its own script (its RTypeOne scripts: Greek, Thai, ...), so a text
# wholly in that script scores 100 %. Every other language's bytes are counted in chunks that start past the space
# CLD2 puts before each script run, a byte the text's count includes: whole percents rounded down, 99 % at most.
_CLD2_WHOLE_SCRIPT = ("GREEK", "ARMENIAN", "SYRIAC", "DHIVEHI", "PUNJABI", "GUJARATI", "ORIYA", "TAMIL", "TELUGU",
                      "KANNADA", "MALAYALAM", "SINHALESE", "THAI", "LAOTHIAN", "BURMESE", "GEORGIAN", "CHEROKEE",
                      "INUKTITUT", "KHMER", "MONGOLIAN", "TAGALOG", "LIMBU")


@lru_cache(maxsize=None)
def highest_figure(detector: str, code: str) -> float:
    """The most `detector` can report for the normalised `code`: 0.99 from CLD2 but for a language it reads from
    its own script alone; 1.0 otherwise (langdetect's posterior, and so the cascade's, reaches 0.99999...)."""
    if detector != "cld2":
        return 1.0
    whole = {normalize_code(c) for name, c in _pycld2().LANGUAGES if name in _CLD2_WHOLE_SCRIPT}
    return 1.0 if code in whole else 0.99


def make_detector(name: str) -> Detector:
    return DETECTORS[name]()
