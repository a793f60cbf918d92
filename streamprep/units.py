"""Units of work: a dataset's inputs cut into pieces a QC worker reads itself, planned once per run.

A unit is one input file, or a range of a large one: an uncompressed JSONL/text file is cut into byte
ranges of about `execution.unit_mb` at newlines, a Parquet file into single row groups; any other local file
(compressed, `format: document`, special or unsupported) is one `file` unit. The worker that judges a
unit reads it: the driver never reads its records. An `hf://` dataset is one `stream` unit, read in
order by the driver's reader thread (it owns the pinned snapshot's bounded download window) and shipped
to the workers in batches.

The plan depends only on the input files and `unit_mb`, never on the worker or node count; it is
written once to the checkpoint dir (`<dataset>.plan.json`) and a resume uses the saved plan.
"""
from __future__ import annotations

import codecs
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import fsspec
import pyarrow.parquet as pq

from streamprep.sources.base import BadRecord
from streamprep.sources.local import LocalSource, _compression, _special, detect_format

CHUNKED = ("jsonl", "txt")  # uncompressed formats cut into byte ranges
NUMBERED = ("range", "row_group")  # kinds that start inside a file: line numbers are filled in by the driver
LINE_MARK = "\x00line\x00"  # stands for a file-global line number in a worker's reject reason
RECORD_MARK = "\x00record\x00"  # ... and for the count of the file's records before it


@dataclass(frozen=True)
class Unit:
    """`kind`: "range" (bytes [start, end) of a text file), "row_group" (Parquet row group `start`), "file"
    (a whole local file), or "stream" (the whole `hf://` dataset, read by the driver; `file` -1)."""

    kind: str
    file: int
    path: str = ""
    fmt: str = ""
    start: int = 0
    end: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _Mark:
    """Formats as LINE_MARK: the source's line-numbered reasons are written by a worker that knows only its
    range's line numbers; the writer puts the file-global number in (`global_reason`)."""

    def __format__(self, spec: str) -> str:
        return LINE_MARK


def global_reason(reason: str, before: int) -> str:
    """`reason` with the file-global numbers of an item that has `before` items of its file ahead of it."""
    return reason.replace(LINE_MARK, str(before + 1)).replace(RECORD_MARK, str(before))


def plan_dataset(files: list[str] | None, fmt: str | None, unit_bytes: int) -> list[Unit]:
    """The units of one dataset entry, in dataset order. `files` None: a source without a file list (`hf://`)
    is read whole, as one stream unit."""
    if files is None:
        return [Unit("stream", -1)]
    units: list[Unit] = []
    for i, f in enumerate(files):
        try:
            kind = fmt or detect_format(f)
        except ValueError:
            kind = None  # the reader turns it into a counted reject
        if kind in CHUNKED and _compression(f) is None and not _special(f):
            units += [Unit("range", i, f, kind, a, b) for a, b in _cuts(f, unit_bytes)]
        elif kind == "parquet" and not _special(f):
            groups = _row_groups(f)
            units += [Unit("row_group", i, f, kind, g) for g in range(groups)] if groups else [Unit("file", i, f)]
        else:
            units.append(Unit("file", i, f, fmt or ""))
    return units


def _cuts(path: str, unit_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of about `unit_bytes`, each ending just after a newline (or at the end of the file).
    An empty file is one empty range, so its worker reports it as a counted reject."""
    fs, stripped = fsspec.core.url_to_fs(path)
    size = fs.size(stripped)
    with fs.open(stripped, "rb") as fh:
        cuts, start = [], 0
        while start + unit_bytes < size:
            fh.seek(start + unit_bytes)
            fh.readline()  # to the end of the line the cut falls in
            end = fh.tell()
            if end >= size:
                break
            cuts.append((start, end))
            start = end
    return cuts + [(start, size)]


def _row_groups(path: str) -> int:
    """Row groups of a Parquet file with rows; 0 when it cannot be read or is empty (read as a `file` unit,
    its reader reports it as a reject)."""
    try:
        with fsspec.open(path, "rb") as fh:
            meta = pq.ParquetFile(fh).metadata
            return meta.num_row_groups if meta.num_rows else 0
    except Exception:  # pyarrow raises ArrowInvalid/OSError subclasses for bad files
        return 0


def read_unit(unit: Unit) -> Iterator[Any]:
    """A local unit's items in order: a record dict or a `BadRecord` (in a range, line-numbered reasons carry
    LINE_MARK: the driver knows how many lines of the file come before it)."""
    if unit.kind == "file":
        for item, _ in LocalSource.read_file(unit.file, unit.path, unit.fmt or None, {"file": unit.file, "record": 0}):
            yield item
        return
    if unit.kind == "row_group":
        with fsspec.open(unit.path, "rb") as fh:
            pf = pq.ParquetFile(fh)
            for batch in pf.read_row_group(unit.start).to_batches(1024):
                yield from batch.to_pylist()
        return
    parse = LocalSource._parse_json if unit.fmt == "jsonl" else LocalSource._parse_text
    mark = _Mark()
    if unit.start == unit.end == 0:
        yield BadRecord(f"empty file {unit.path}", "")
        return
    with fsspec.open(unit.path, "rb") as fh:
        fh.seek(unit.start)
        remaining = unit.end - unit.start  # the range ends after a newline, or at the end of the file
        first = unit.start == 0
        for line in fh:
            remaining -= len(line)
            if first and line.startswith(codecs.BOM_UTF8):  # a UTF-8 BOM opens the file, not the record
                line = line[len(codecs.BOM_UTF8):]
            first = False
            yield parse(line, unit.path, mark)
            if remaining <= 0:
                return
