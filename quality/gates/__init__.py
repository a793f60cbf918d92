"""Quality gates, one small class per check, and the order they run in."""
from __future__ import annotations

from typing import Any

from quality.gates.base import Doc, Gate
from quality.gates.code import CodeGate
from quality.gates.copyright import CopyrightGate
from quality.gates.language import LanguageGate
from quality.gates.medical import MedicalGate
from quality.gates.pii import PiiGate
from quality.gates.profanity import ProfanityGate
from quality.gates.schema import LengthGate, MetadataGate, SchemaGate
from quality.gates.text import NormalizeStep

__all__ = ["Doc", "Gate", "build_gates"]


def build_gates(cfg: dict[str, Any], text_field: str) -> list[Gate]:
    """The gates a validated config enables, cheapest first. Disabled gates are left out, not
    skipped, so stats and timings show only what runs."""
    code = cfg["domain"] == "code"
    gates: list[Gate] = [
        SchemaGate(text_field, cfg["required_fields"], cfg["max_chars"]),
        NormalizeStep(code=code),
        LengthGate(cfg["min_chars"], cfg["max_chars"]),
    ]
    if cfg["required_metadata"] or cfg["allowed_licenses"] is not None:
        gates.append(MetadataGate(cfg["required_metadata"], cfg["allowed_licenses"]))
    if cfg["pii_max_density"] < 1.0:
        gates.append(PiiGate(cfg["pii_max_density"]))
    if cfg["profanity_max_density"] < 1.0:
        gates.append(ProfanityGate(cfg["profanity_max_density"]))
    if cfg["reject_copyright"]:
        gates.append(CopyrightGate())
    if cfg["domain"] == "general" and cfg["expected_language"] is not None:
        gates.append(LanguageGate(cfg["expected_language"], cfg["min_language_prob"], cfg["language_detector"],
                                  cfg["language_sample_chars"]))
    elif cfg["domain"] == "medical":
        gates.append(MedicalGate(cfg["medical_min_hits"], cfg["medical_min_density"], cfg["medical_min_categories"],
                                 cfg["domain_sample_chars"]))
    elif code:
        gates.append(CodeGate(cfg["code_min_score"], cfg["domain_sample_chars"]))
    return gates
