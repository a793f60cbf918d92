"""The `quality:` config section: defaults and validation, so a bad value fails at load time naming its key."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from quality.language import DETECTORS as DETECTOR_CLASSES
from quality.language import detectable, highest_figure, normalize_code

DOMAINS = ("general", "medical", "code")
DETECTORS = tuple(DETECTOR_CLASSES)
DEDUP_MODES = ("exact", "none")
DEDUP_SCOPES = ("dataset", "run")

QUALITY_DEFAULTS: dict[str, Any] = {
    "domain": "general",
    "expected_language": "en",
    "min_language_prob": 0.9,
    "language_detector": "cld2",
    "language_sample_chars": 1500,
    "min_chars": 100,
    "max_chars": 2_000_000,
    "required_fields": ["text"],
    "required_metadata": [],
    "allowed_licenses": None,
    "pii_max_density": 0.01,
    "profanity_max_density": 0.01,
    "reject_copyright": True,
    "dedup": "exact",
    "dedup_scope": "dataset",
    "normalize": True,
    "domain_sample_chars": 4000,
    "medical_min_hits": 8,
    "medical_min_density": 0.04,
    "medical_min_categories": 2,
    "code_min_score": 0.43,
    "near_dedup": {"enabled": False, "threshold": 0.8, "ngram": 5, "bands": 14, "rows": 8, "num_perm": 112,
                   "seed": 1},
}


class QualityConfigError(ValueError):
    """A bad `quality:` value; `.key` names the offending key, str(e) is one line."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(key: str, v: Any, lo: float, hi: float) -> float:
    if not (_is_int(v) or isinstance(v, float)) or not lo <= v <= hi:
        raise QualityConfigError(key, f"must be a number in [{lo:g}, {hi:g}], got {v!r}")
    return float(v)


def _count(key: str, v: Any, lo: int, hi: int | None = None) -> int:
    if not _is_int(v) or v < lo or hi is not None and v > hi:
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise QualityConfigError(key, f"must be an integer {bounds}, got {v!r}")
    return v


def _as_read(v: Any) -> str:
    """`v` as an error shows it: a boolean where text is due (or in a list of names) was most likely an unquoted
    YAML 1.1 word, `no` (Norwegian's code) or `off`, which "got False" alone did not say."""
    if isinstance(v, bool) or isinstance(v, (list, tuple)) and any(isinstance(x, bool) for x in v):
        return f"{v!r} (YAML reads an unquoted yes/no/on/off as a boolean: quote it)"
    return repr(v)


def _choice(key: str, v: Any, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise QualityConfigError(key, f"must be one of {', '.join(choices)}, got {_as_read(v)}")
    return v


def _flag(key: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise QualityConfigError(key, f"must be true or false, got {v!r}")
    return v


def _names(key: str, v: Any, nullable: bool = False) -> list[str] | None:
    if v is None and nullable:
        return None
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) and x.strip() for x in v):
        what = "a list of non-blank strings" + (" or null" if nullable else "")
        raise QualityConfigError(key, f"must be {what}, got {_as_read(v)}")
    return list(v)


def _licenses(key: str, v: Any) -> list[str] | None:
    """`_names`, nullable; an empty list would reject every record (none is in it), so it is an error."""
    if isinstance(v, (list, tuple)) and not v:
        raise QualityConfigError(key, f"must be a non-empty list or null (an empty list rejects every record), "
                                      f"got {v!r}")
    return _names(key, v, nullable=True)


def _language(key: str, v: Any) -> str | None:
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip():
        raise QualityConfigError(key, f"must be a language code such as 'en', or null, got {_as_read(v)}")
    return normalize_code(v)


def _near_dedup(key: str, v: Any) -> dict[str, Any]:
    """MinHash-LSH parameters; `num_perm`, when given (not null), must equal bands x rows: it is derived."""
    defaults = QUALITY_DEFAULTS["near_dedup"]
    if not isinstance(v, Mapping):
        raise QualityConfigError(key, f"must be a mapping, got {v!r:.60}")
    for sub in v:
        if sub not in defaults:
            raise QualityConfigError(f"{key}.{sub}", "unknown key")
    given = {**defaults, **v}
    out = {"enabled": _flag(f"{key}.enabled", given["enabled"]),
           "threshold": given["threshold"],
           # past these the signer's int64 counts and rensa's u64 seed overflowed: evaluate_batch raised
           "ngram": _count(f"{key}.ngram", given["ngram"], 1, 2**63 - 1),
           "bands": _count(f"{key}.bands", given["bands"], 1),
           "rows": _count(f"{key}.rows", given["rows"], 1),
           "seed": _count(f"{key}.seed", given["seed"], 0, 2**64 - 1)}
    t = out["threshold"]  # one message for both ends ("in [0, 1]" first, "> 0" next, read as two rules)
    if not (_is_int(t) or isinstance(t, float)) or not 0 < t <= 1:
        raise QualityConfigError(f"{key}.threshold", f"must be a number in (0, 1], got {t!r}")
    out["threshold"] = float(t)
    out["num_perm"] = out["bands"] * out["rows"]
    if v.get("num_perm") is not None:  # an integer as every count is: 112.0 and true were taken
        _count(f"{key}.num_perm", v["num_perm"], 1)
    if v.get("num_perm") is not None and v["num_perm"] != out["num_perm"]:
        raise QualityConfigError(f"{key}.num_perm", f"must equal bands x rows = {out['num_perm']}, "
                                                    f"got {v['num_perm']!r}")
    if out["num_perm"] > 1024:
        raise QualityConfigError(f"{key}.bands", f"bands x rows must be <= 1024, got {out['num_perm']}")
    return out


_CHECKS = {
    "domain": lambda k, v: _choice(k, v, DOMAINS),
    "expected_language": _language,
    "min_language_prob": lambda k, v: _number(k, v, 0.0, 1.0),
    "language_detector": lambda k, v: _choice(k, v, DETECTORS),
    "language_sample_chars": lambda k, v: _count(k, v, 20),
    "min_chars": lambda k, v: _count(k, v, 0),
    "max_chars": lambda k, v: _count(k, v, 1),
    "required_fields": _names,
    "required_metadata": _names,
    "allowed_licenses": _licenses,
    "pii_max_density": lambda k, v: _number(k, v, 0.0, 1.0),
    "profanity_max_density": lambda k, v: _number(k, v, 0.0, 1.0),
    "reject_copyright": _flag,
    "dedup": lambda k, v: _choice(k, v, DEDUP_MODES),
    "dedup_scope": lambda k, v: _choice(k, v, DEDUP_SCOPES),
    "normalize": _flag,
    "domain_sample_chars": lambda k, v: _count(k, v, 100),
    "medical_min_hits": lambda k, v: _count(k, v, 0),
    "medical_min_density": lambda k, v: _number(k, v, 0.0, 1.0),
    "medical_min_categories": lambda k, v: _count(k, v, 0),
    "code_min_score": lambda k, v: _number(k, v, 0.0, 1.0),
    "near_dedup": _near_dedup,
}
assert _CHECKS.keys() == QUALITY_DEFAULTS.keys()


def validate_quality_config(section: Mapping[str, Any] | None) -> dict[str, Any]:
    """Return a new dict with every key filled, or raise QualityConfigError naming the first bad key.

    Idempotent: validating an already validated section returns an equal dict.
    """
    if section is None:
        section = {}
    if not isinstance(section, Mapping):
        raise QualityConfigError("quality", f"section must be a mapping, got {type(section).__name__}")
    for key in section:
        if key not in QUALITY_DEFAULTS:
            raise QualityConfigError(str(key), "unknown key")
    out: dict[str, Any] = {}
    for key, default in QUALITY_DEFAULTS.items():
        value = section.get(key, default)
        out[key] = _CHECKS[key](key, value)
    if out["max_chars"] < out["min_chars"]:
        if "max_chars" not in section:  # the user set min_chars only: name it, and where the bound comes from
            raise QualityConfigError("min_chars", f"must be <= max_chars ({out['max_chars']}, its default), "
                                                  f"got {out['min_chars']}; raise max_chars too")
        raise QualityConfigError("max_chars", f"must be >= min_chars ({out['min_chars']}), got {out['max_chars']}")
    lang, detector = out["expected_language"], out["language_detector"]
    if out["domain"] == "general" and lang is not None and lang not in detectable(detector):
        others = [d for d in DETECTORS if d != detector and lang in detectable(d)]  # it told cld2 users to use cld2
        hint = f"language_detector: {' or '.join(others)} reports it" if others else \
            "no detector reports it; a typo? codes are ISO 639-1, such as en, de, zh"
        raise QualityConfigError("expected_language", f"{lang!r} is not a language the {detector} detector reports "
                                                      f"({hint}): every record would be rejected")
    top = highest_figure(detector, lang) if out["domain"] == "general" and lang is not None else 1.0
    if out["min_language_prob"] > top:
        raise QualityConfigError("min_language_prob", f"must be <= {top:g}, the most the {detector} detector reports "
                                                      f"for {lang!r}, got {out['min_language_prob']:g}: every record "
                                                      f"would be rejected")
    return out


@dataclass(frozen=True)
class NearDedupSettings:
    """The validated `quality.near_dedup` section. Fields in the order validate_quality_config emits them
    (`num_perm`, derived, comes last) so `to_dict` reproduces its dict exactly."""

    enabled: bool
    threshold: float
    ngram: int
    bands: int
    rows: int
    seed: int
    num_perm: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class QualitySettings:
    """The validated `quality:` section, typed and frozen (picklable: it goes to QC workers and Ray actors).

    Built only from validate_quality_config's output, so QUALITY_DEFAULTS stays the one place for defaults.
    """

    domain: str
    expected_language: str | None
    min_language_prob: float
    language_detector: str
    language_sample_chars: int
    min_chars: int
    max_chars: int
    required_fields: tuple[str, ...]
    required_metadata: tuple[str, ...]
    allowed_licenses: tuple[str, ...] | None
    pii_max_density: float
    profanity_max_density: float
    reject_copyright: bool
    dedup: str
    dedup_scope: str
    normalize: bool
    domain_sample_chars: int
    medical_min_hits: int
    medical_min_density: float
    medical_min_categories: int
    code_min_score: float
    near_dedup: NearDedupSettings

    @classmethod
    def from_dict(cls, validated: Mapping[str, Any]) -> QualitySettings:
        """From validate_quality_config's output (or a frozen copy of it); does not validate again."""
        values = {f.name: validated[f.name] for f in fields(cls)}
        for key, value in values.items():
            if isinstance(value, (list, tuple)):
                values[key] = tuple(value)
        values["near_dedup"] = NearDedupSettings(**values["near_dedup"])
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Exactly the dict validate_quality_config returned (key order, lists): config hashes depend on it."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        out["near_dedup"] = self.near_dedup.to_dict()
        return out


assert tuple(f.name for f in fields(QualitySettings)) == tuple(QUALITY_DEFAULTS)
assert {f.name for f in fields(NearDedupSettings)} == set(QUALITY_DEFAULTS["near_dedup"])


def load_quality_settings(section: Mapping[str, Any] | None) -> QualitySettings:
    """Validate a raw `quality:` section and type it; raises QualityConfigError like validate_quality_config."""
    return QualitySettings.from_dict(validate_quality_config(section))
