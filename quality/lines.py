"""What the pipeline's JSON lines can hold, and the reject reasons it writes itself: a leaf that the gates and
streamprep's readers and workers share (the job's driver imports it without loading the gates)."""
from __future__ import annotations

from typing import Any

# The reject reasons (failed_check) and per-gate stats names the pipeline writes itself, not a gate, and where: a
# plug-in gate so named had its counts merged with them (a gate `duplicate` counted as exact duplicates, one `error`
# as internal errors). tests/test_streamprep/test_plugins.py pins them against the code that writes them.
PIPELINE_CHECKS = {
    "parse": "an unreadable record's reject reason",  # streamprep.sources.base.BadRecord
    "duplicate": "exact dedup's reject reason",  # quality.control, streamprep.unit_worker
    "near_duplicate": "near-dedup's reject reason",  # quality.near_dedup.reject_meta
    "near_dedup_signature": "near-dedup signing's stats name",  # quality.control
    "error": "a gate's internal error's reject reason",  # quality.control
    "unknown": "the reason of a reject without a failed_check",  # streamprep.stats, streamprep.unit_worker
    "empty_tokens": "the audit's count of kept records without tokens",  # streamprep.audit.gather
}
PIPELINE_PREFIX = "sft:"  # the SFT shards' drops, `sft:<reason>` beside the rejects (streamprep.audit)
# The built-in gates' names and failed_checks, each with the first gate of `quality.gates.BUILT_IN` that has it (a
# test holds the two together; here the driver checks a reader's BadRecord without loading the gates).
BUILT_IN_NAMES = {"schema": "SchemaGate", "normalize": "NormalizeStep", "length": "LengthGate",
                  "metadata": "MetadataGate", "pii": "PiiGate", "profanity": "ProfanityGate",
                  "copyright": "CopyrightGate", "language": "LanguageGate", "domain": "MedicalGate"}


def pipeline_name(value: str) -> str | None:
    """Why `value` is a name streamprep writes itself, else None: a plug-in gate's name or failed_check, or a
    reader's BadRecord's `check` (but `parse`, its default), must not be one (the audit would count the two as one)."""
    if value in PIPELINE_CHECKS:
        return f"{PIPELINE_CHECKS[value]}, which streamprep writes itself"
    if value.startswith(PIPELINE_PREFIX):
        return f"an SFT drop's reason ({PIPELINE_PREFIX}…), which streamprep writes itself"
    return None


def built_in_name(value: str) -> str | None:
    """Whose `value` is, when it is a built-in gate's name or failed_check, else None: a plug-in gate or a reader's
    BadRecord `check` so named would be counted as that gate."""
    owner = BUILT_IN_NAMES.get(value)
    return None if owner is None else f"the built-in gate {owner}'s"


def utf8(text: str) -> bool:
    """False for a string with a lone surrogate, which no UTF-8 line can hold."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def escaped(value: Any) -> Any:
    """`value` with each string in it (a dict's keys too, in lists and dicts) that holds a lone surrogate written
    with that surrogate as `\\udXXX`, so that a JSON line can hold it: a reader's `json.loads` gives one for a
    `"\\ud800"` escape, and orjson refuses to write it. Anything else is returned as it is."""
    if isinstance(value, str):
        return value if utf8(value) else value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, dict):
        return {escaped(k): escaped(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [escaped(v) for v in value]
    return value
