"""Inline quality control for streamprep: schema, PII, profanity, copyright, language/domain gates,
normalisation and exact dedup. See docs/quality.md."""
from quality.control import QualityControl, Verdict
from quality import near_dedup
from quality.dedup import DedupDecision, DedupIndex
from quality.settings import (QUALITY_DEFAULTS, NearDedupSettings, QualityConfigError, QualitySettings,
                              load_quality_settings, validate_quality_config)

__all__ = ["QualityControl", "Verdict", "DedupIndex", "DedupDecision", "QUALITY_DEFAULTS", "validate_quality_config",
           "QualityConfigError", "QualitySettings", "NearDedupSettings", "load_quality_settings", "near_dedup"]
