"""Inline quality control for streamprep: schema, PII, profanity, copyright, language/domain gates,
normalisation and exact dedup. See docs/quality.md.

`QualityControl` and `Verdict` load on first use: their module brings the gates (Hyperscan databases, word
lists, detectors), which a process that only validates settings or keeps dedup books (the job's driver) never
runs."""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from quality import near_dedup
from quality.dedup import DedupDecision, DedupIndex
from quality.settings import (QUALITY_DEFAULTS, NearDedupSettings, QualityConfigError, QualitySettings,
                              load_quality_settings, validate_quality_config)

if TYPE_CHECKING:
    from quality.control import QualityControl, Verdict

__all__ = ["QualityControl", "Verdict", "DedupIndex", "DedupDecision", "QUALITY_DEFAULTS", "validate_quality_config",
           "QualityConfigError", "QualitySettings", "NearDedupSettings", "load_quality_settings", "near_dedup"]


def __getattr__(name: str) -> Any:
    if name in ("QualityControl", "Verdict"):
        return getattr(import_module("quality.control"), name)
    raise AttributeError(f"module 'quality' has no attribute {name!r}")
