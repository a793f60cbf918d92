"""What every source yields: raw records with a resume position, or a counted parse failure."""
from __future__ import annotations

import re
import reprlib
import sys
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Protocol

import orjson


@dataclass(frozen=True)
class BadRecord:
    """A source item that could not be decoded (malformed JSON, bad bytes, wrong row type).

    Ingest counts it as a reject with `failed_check = "parse"`; it never stops the job.
    """

    reason: str
    raw: str  # a bounded excerpt of what was read, for the rejects file
    check: str = "parse"  # the failed_check it is counted under


@dataclass(frozen=True)
class Unit:
    """A unit of work over a source, as `streamprep.units` plans it (defined here, beside the records, so that
    naming a unit does not load the planners' readers: pyarrow). `kind`: "range" (bytes [start, end) of a text file), "row_group" (Parquet row groups [start, end);
    `end` 0 in plans saved before: group `start` alone), "file"
    (a whole local file), "hf" (data file `file` of an `hf://` snapshot: `path` hf://datasets/<repo>@<sha>/<file>,
    `fmt` its `datasets` builder, `end` its size), or "stream" (a source without a file list, read by the
    driver; `file` -1)."""

    kind: str
    file: int
    path: str = ""
    fmt: str = ""
    start: int = 0
    end: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


REJECT_EXCERPT = 2000  # characters of a rejected record's text kept in the rejects file


def excerpt_of(rec: Any, text_field: str) -> str:
    """What a reject line shows of a record: the start of its text, or of a record with none (no such field, or not
    a string) the start of the record itself as JSON (its field's repr read "None" or "5", as a text of that would)."""
    text = rec.get(text_field) if isinstance(rec, dict) else rec
    if not isinstance(text, str):
        try:
            text = orjson.dumps(rec, default=repr, option=orjson.OPT_NON_STR_KEYS).decode()
        except TypeError:  # nested past orjson's depth limit (254)
            text = reprlib.repr(rec)
    return text[:REJECT_EXCERPT]


class SourceError(RuntimeError):
    """An input that cannot be read for a reason outside its bytes (permission, I/O error; vanished: FileGone).

    Unlike a corrupt file (a reject), this would not happen again on a clean re-run, so the job stops
    (exit 1) naming the file; re-running the command resumes from the last checkpoint.
    """


class FileGone(SourceError):
    """A planned input file not found when its bytes were read (deleted, or its object removed, since the run
    started): ingest takes the input identity again, so the job stops with the refusal a resume would give (exit 2,
    the file named as gone), not a read failure that a re-run as is cannot get past."""


def read_failure(message: str, exc: BaseException) -> SourceError:
    """The SourceError for a failed read of an input file: FileGone when the file was not found (`exc` or what it
    wraps is a FileNotFoundError)."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, FileNotFoundError):
        cause = cause.__cause__
    return (SourceError if cause is None else FileGone)(message)


class ReaderError(RuntimeError):
    """A source format plug-in's reader raised an exception that is no fault of the file's bytes nor of reading
    them (a TypeError, a KeyError: a bug in the plug-in), named with its file and record; the job stops, exit 1."""


ANSI = re.compile(r"\x1b\[[0-9;]*m")


def in_worker(exc: BaseException) -> tuple[BaseException, str]:
    """(what a Ray worker's call raised, " (in a Ray worker, pid N)") for Ray's RayTaskError, whose message is Ray's
    header (`ray::_Actor.run() (pid=…, ip=…, actor_id=…)`, in ANSI colours), then the worker's traceback, the
    cause last: its first line named no cause. (exc, "") for any other exception."""
    rx = sys.modules.get("ray.exceptions")  # Ray never imported: no Ray error
    where = ""
    while rx is not None and isinstance(exc, rx.RayTaskError) and isinstance(exc.cause, BaseException):
        pid = re.search(r"\(pid=(\d+)", str(exc))
        where = f" (in a Ray worker{f', pid {pid[1]}' if pid else ''})"
        exc = exc.cause
    return exc, where


def one_line(exc: BaseException) -> str:
    """`Type: first line of the message`, for reject reasons and one-line errors; a Ray worker's error as what it
    raised (`in_worker`)."""
    exc, where = in_worker(exc)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}{where}".strip()


def error_text(exc: BaseException) -> str:
    """`Type: message`, as the run log and run.json keep a failure; a Ray worker's error its cause first
    (`one_line`), then Ray's text with the worker's traceback, ANSI colour codes removed."""
    if in_worker(exc)[1]:
        return f"{one_line(exc)}\n{ANSI.sub('', str(exc))}"
    return f"{type(exc).__name__}: {exc}"


def input_change(old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """How the input identity `new` differs from the recorded `old`, naming the file; None if equal."""
    if old == new:
        return None
    before = {f.get("path"): f for f in old.get("files") or []}
    after = {f.get("path"): f for f in new.get("files") or []}
    for path, f in before.items():
        if path not in after:
            return f"input file {path} is gone"
        if after[path] != f:
            what = ", ".join(k for k in sorted(set(f) | set(after[path])) if f.get(k) != after[path].get(k))
            return f"input file {path} changed ({what})"
    added = [p for p in after if p not in before]
    if added:
        return f"input file {added[0]} is new"
    return "input changed (" + ", ".join(k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)) + ")"


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
