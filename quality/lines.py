"""What the pipeline's JSON lines can hold: a leaf that the gates and streamprep's workers share (the job's driver
imports it without loading the gates)."""
from __future__ import annotations

from typing import Any


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
