"""Quality gates, one small class per check, and the order they run in."""
from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Callable

import orjson

from quality.gates.base import Doc, Gate
from quality.gates.code import CodeGate
from quality.gates.copyright import CopyrightGate
from quality.gates.language import LanguageGate
from quality.gates.medical import MedicalGate
from quality.gates.pii import PiiGate
from quality.gates.profanity import ProfanityGate
from quality.gates.schema import LengthGate, MetadataGate, SchemaGate
from quality.gates.text import NormalizeStep
from quality.lines import built_in_name, pipeline_name, utf8
from quality.settings import QualitySettings

__all__ = ["Doc", "Gate", "GatePluginError", "PluginGate", "build_gates", "plugin_gates", "register_gate"]

# Gates of your own, run after the built-ins in registration order: `factory(settings, text_field)` returns the
# gate, or None where these settings leave it off. One line adds one: `register_gate(MyGate.build)`.
EXTRA_GATES: list[Callable[[QualitySettings, str], Gate | None]] = []


def register_gate(factory: Callable[[QualitySettings, str], Gate | None]) -> Callable[[QualitySettings, str], Gate | None]:
    """Add a gate factory (every QC process must import its module: streamprep's STREAMPREP_PLUGINS)."""
    EXTRA_GATES.append(factory)
    return factory


def build_gates(s: QualitySettings, text_field: str) -> list[Gate]:
    """The gates the settings enable, cheapest first. Disabled gates are left out, not
    skipped, so stats and timings show only what runs."""
    code = s.domain == "code"
    gates: list[Gate] = [
        SchemaGate(text_field, s.required_fields, s.max_chars, code),
        NormalizeStep(code=code),
        LengthGate(s.min_chars, s.max_chars),
    ]
    if s.required_metadata or s.allowed_licenses is not None:
        gates.append(MetadataGate(s.required_metadata, s.allowed_licenses))
    if s.pii_max_density < 1.0:
        gates.append(PiiGate(s.pii_max_density))
    if s.profanity_max_density < 1.0:
        gates.append(ProfanityGate(s.profanity_max_density))
    if s.reject_copyright:
        gates.append(CopyrightGate())
    if s.domain == "general" and s.expected_language is not None:
        gates.append(LanguageGate(s.expected_language, s.min_language_prob, s.language_detector,
                                  s.language_sample_chars))
    elif s.domain == "medical":
        gates.append(MedicalGate(s.medical_min_hits, s.medical_min_density, s.medical_min_categories,
                                 s.domain_sample_chars))
    elif code:
        gates.append(CodeGate(s.code_min_score, s.domain_sample_chars))
    return gates + plugin_gates(s, text_field)


BUILT_IN: tuple[type[Gate], ...] = (SchemaGate, NormalizeStep, LengthGate, MetadataGate, PiiGate, ProfanityGate,
                                     CopyrightGate, LanguageGate, MedicalGate, CodeGate)


def plugin_gates(s: QualitySettings, text_field: str) -> list[Gate]:
    """The plug-in gates these settings enable, in registration order (as `PluginGate`s); a GatePluginError for a
    factory that gives none, or a gate whose `name` or `failed_check` is empty, one the pipeline writes itself, a
    built-in gate's, or (a name) another plug-in's name, (a failed_check) another plug-in's failed_check: the
    audit would count the two as one. Streamprep calls it at start too (`unit_worker.check_gates`)."""
    names: dict[str, str] = {}
    checks: dict[str, str] = {}
    out: list[Gate] = []
    for factory in EXTRA_GATES:
        gate = _plugin_gate(factory, s, text_field)
        if gate is None:
            continue
        for attr, taken in (("name", names), ("failed_check", checks)):
            value = getattr(gate, attr)
            clash = "empty" if not value else pipeline_name(value) or built_in_name(value) or taken.get(value)
            if clash:
                raise GatePluginError(f"{_where(factory)}: its gate's {attr} {value!r} is {clash} (the audit counts "
                                      f"a gate's stats under its name, its rejects under its failed_check): name it "
                                      f"otherwise")
            taken[value] = f"that of the plug-in gate {gate.name!r} ({_where(factory)})"
        out.append(PluginGate(gate))
    return out


class GatePluginError(RuntimeError):
    """A registered gate factory that fails to give a gate: a bug to fix in the plug-in, named here."""


def _where(factory: Callable[..., Any]) -> str:
    return f"quality gate plug-in {getattr(factory, '__module__', '?')}.{getattr(factory, '__qualname__', factory)}"


def _plugin_gate(factory: Callable[[QualitySettings, str], Gate | None], s: QualitySettings,
                 text_field: str) -> Gate | None:
    where = _where(factory)
    try:
        gate = factory(s, text_field)
    except (Exception, SystemExit) as exc:  # sys.exit too: a re-run calls it again, as it raises again
        raise GatePluginError(f"{where} failed to build its gate: {type(exc).__name__}: {exc}") from exc
    if gate is not None and not isinstance(gate, Gate):
        raise GatePluginError(f"{where} returned {type(gate).__name__}, not a Gate or None")
    if gate is not None and not all(isinstance(getattr(gate, k, None), str) for k in ("name", "failed_check")):
        raise GatePluginError(f"{where}: its gate {type(gate).__name__} needs the strings `name` and `failed_check` "
                              f"(its stats and its rejects' failed_check)")
    return gate


class PluginGate(Gate):
    """A plug-in's gate as the chain runs it: after its `check` the record's meta and the reason must still be what
    the kept row and the reject line can write (orjson: no numpy scalar, set, bytes, int past 64 bits, non-string
    key, lone surrogate; nor a NaN or infinity, which it writes as null), or the record is a reject `error` (the
    runner's `NAME: internal error TypeError: meta 'KEY': …`) with those keys dropped; such a value used to end the
    job at its first line, naming no gate. The built-in gates write plain values and run unwrapped: the default
    chain pays nothing."""

    def __init__(self, gate: Gate) -> None:
        self.gate = gate
        self.name, self.failed_check = gate.name, gate.failed_check  # type: ignore[misc]  # the gate's own
        self.text_only, self.cheap = gate.text_only, gate.cheap  # type: ignore[misc]

    def check(self, doc: Doc) -> str | None:
        try:
            reason = self.gate.check(doc)
        except Exception as exc:  # the runner's reject `error` quotes it: its line must be writable too
            _unwritable(doc.meta)
            if not utf8(str(exc)):
                raise TypeError(f"{type(exc).__name__} {str(exc)!a}") from exc
            raise
        bad = _unwritable(doc.meta)
        if bad is not None:
            raise TypeError(bad)
        if type(reason) is str and not utf8(reason):
            raise TypeError(f"reason {reason!a}: not JSON (a lone surrogate)")
        return reason

    def check_batch(self, docs: list[Doc]) -> list[str | None]:
        """The gate's `check_batch`; if a doc's meta or reason is not writable, the runner's fallback (`check` doc
        by doc) finds which. A str (or bytes) answer is no list of reasons: `list` made it one reason per character,
        every doc rejected."""
        answer = self.gate.check_batch(docs)
        if isinstance(answer, (str, bytes)):
            raise TypeError(f"check_batch returned {type(answer).__name__}, not one reason per doc")
        reasons = list(answer)
        if any(_unwritable(doc.meta, drop=False) for doc in docs) or \
                not all(utf8(r) for r in reasons if type(r) is str):
            raise TypeError("a doc's meta or reason is not JSON")
        return reasons


NON_FINITE = "a float NaN or infinity, which a JSON line writes as null"


def _unwritable(meta: dict[str, Any], drop: bool = True) -> str | None:
    """None when orjson writes `meta` as it is (one call, the common case); else which keys it cannot write and why,
    those keys dropped from `meta` when `drop`. A NaN or infinity is one: orjson writes it as null, the value lost
    without a word (looked for only when the line holds a null)."""
    try:
        if b"null" not in orjson.dumps(meta) or not _non_finite(meta):
            return None
    except orjson.JSONEncodeError:
        pass
    bad: dict[Any, str] = {}
    for key, value in meta.items():
        try:
            orjson.dumps({key: value})
        except orjson.JSONEncodeError as exc:
            bad[key] = str(exc)
        else:
            if _non_finite(value):
                bad[key] = NON_FINITE
    for key in bad if drop else ():
        del meta[key]
    return "meta " + ", ".join(f"{key!r}: not JSON ({why})" for key, why in bad.items())


def _non_finite(value: Any) -> bool:
    """Whether `value` is, or holds in what orjson writes of it (a dict, list or tuple; a dataclass's attributes not
    starting with '_'; an Enum member's value), a float NaN or infinity."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, enum.Enum):
        return _non_finite(value.value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        attrs = vars(value) if hasattr(value, "__dict__") else \
            {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}  # __slots__
        value = {k: v for k, v in attrs.items() if not k.startswith("_")}
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_non_finite(v) for v in value)
