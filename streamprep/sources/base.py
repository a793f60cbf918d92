"""What every source yields: raw records with a resume position, or a counted parse failure."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Protocol


@dataclass(frozen=True)
class BadRecord:
    """A source item that could not be decoded (malformed JSON, bad bytes, wrong row type).

    Ingest counts it as a reject with `failed_check = "parse"`; it never stops the job.
    """

    reason: str
    raw: str  # a bounded excerpt of what was read, for the rejects file
    check: str = "parse"  # the failed_check it is counted under


class Source(Protocol):
    """A stream of records from one dataset entry of the config.

    `iter_records(start)` is a blocking iterator (ingest runs it in an executor). It yields
    `(item, position)` where `item` is a dict (or a `BadRecord`) and `position` is a JSON-able
    dict from which `iter_records(position)` continues with the *next* item. `start=None` means
    from the beginning. Positions are what checkpoints store, so they must be deterministic.
    """

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the input (files with sizes/mtimes, or repo + revision), for drift checks."""
        ...

    def iter_records(self, start: dict[str, Any] | None = None) -> Iterator[tuple[dict[str, Any] | BadRecord, dict[str, Any]]]:
        ...
