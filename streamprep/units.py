"""Units of work: a dataset's inputs cut into pieces a QC worker reads itself, planned once per run.

A unit is one input file, or a range of a large one: an uncompressed JSONL/text file is cut into byte
ranges of about `execution.unit_mb` at newlines, a Parquet file into runs of adjacent row groups of about
`unit_mb` of data (a row group larger than that is a unit alone); any other local file
(compressed, `format: document`, special or unsupported) is one `file` unit. The worker that judges a
unit reads it: the driver never reads its records. An `hf://` dataset's data files at its pinned commit are one
`hf` unit each, planned by the source (`HFSource.units`); the worker downloads the file itself. A source
without a file list (a plug-in scheme) is one `stream` unit, read in order by the driver's reader thread
and shipped to the workers in batches.

The plan depends only on the input files and `unit_mb`, never on the worker or node count; it is
written once to the checkpoint dir (`<dataset>.plan.json`) and a resume uses the saved plan.
"""
from __future__ import annotations

import codecs
import itertools
from typing import Any, Iterator, Mapping

from streamprep.config import ConfigError
from streamprep.sources.base import BadRecord, SourceError, Unit, one_line
from streamprep.sources.local import (PARQUET_BATCH, WIDE_BOMS, LocalSource, LongLine, _compression, _listed_folder,
                                      _special, bounded_lines, broken_link, detect_format, input_filesystem, long_line,
                                      open_input, opening, opens_json_array, parquet_rows, refused)

Options = Mapping[str, Any] | None  # a dataset's `storage_options` (object stores)

CHUNKED = ("jsonl", "txt")  # uncompressed formats cut into byte ranges
PROBE_BYTES = 1 << 16  # what the planner reads at a cut point or a Parquet footer (the block of an object store)
NUMBERED = ("range", "row_group")  # kinds that start inside a file: line numbers are filled in by the driver
LINE_MARK = "\x00line\x00"  # stands for a file-global line number in a worker's reject reason
RECORD_MARK = "\x00record\x00"  # ... and for the count of the file's records before it


class _Mark:
    """Formats as LINE_MARK: the source's line-numbered reasons are written by a worker that knows only its
    range's line numbers; the writer puts the file-global number in (`global_reason`)."""

    def __format__(self, spec: str) -> str:
        return LINE_MARK


def global_reason(reason: str, before: int) -> str:
    """`reason` with the file-global numbers of an item that has `before` items of its file ahead of it."""
    return reason.replace(LINE_MARK, str(before + 1)).replace(RECORD_MARK, str(before))


def plan_dataset(files: list[str] | None, fmt: str | None, unit_bytes: int, options: Options = None) -> list[Unit]:
    """The units of one dataset entry, in dataset order. `files` None: a source without a file list (a plug-in
    scheme) is read whole, as one stream unit. A file the reader must see whole (compressed, UTF-16/32, not a
    regular file, a symlink loop, unsupported) is one `file` unit."""
    if files is None:
        return [Unit("stream", -1)]
    units: list[Unit] = []
    for i, f in enumerate(files):
        try:
            units += _plan_file(i, f, fmt, unit_bytes, options)
        except ConfigError:  # what a re-run as is meets again (`_cuts`): exit 2, not "resumable"
            raise
        except Exception as exc:  # a store that stops answering, a file gone since it was listed: resumable
            raise SourceError(f"cannot read input file {f} to plan its units: {one_line(exc)}") from exc
    return units


def _plan_file(i: int, f: str, fmt: str | None, unit_bytes: int, options: Options) -> list[Unit]:
    """File `i`'s units (`plan_dataset`)."""
    try:
        kind = fmt or detect_format(f)
    except ValueError:
        kind = None  # the reader turns it into a counted reject
    whole = _special(f) or (_listed_folder(f) if "://" in f else broken_link(f) is not None)
    size = None if whole else _size(f, options)
    if whole or kind not in CHUNKED + ("parquet",) or (kind in CHUNKED and _compression(f) is not None) \
            or refused(f, kind):  # (a .tar's ranges read its headers as lines): the reader's reject
        return [Unit("file", i, f, fmt or "")]
    if size <= unit_bytes:  # one unit, planned without reading the file
        return [Unit("range", i, f, kind, 0, size) if kind in CHUNKED else Unit("file", i, f, fmt or "")]
    if kind in CHUNKED:
        cuts = _cuts(f, kind, size, unit_bytes, options)
        return [Unit("range", i, f, kind, a, b) for a, b in cuts] if cuts else [Unit("file", i, f, fmt or "")]
    groups = _group_runs(_row_groups(f, options), unit_bytes)
    return [Unit("row_group", i, f, kind, a, b) for a, b in groups] if groups else [Unit("file", i, f, fmt or "")]


def _size(path: str, options: Options) -> int:
    fs, stripped = input_filesystem(path, options)
    return fs.size(stripped)


def _cuts(path: str, kind: str, size: int, unit_bytes: int, options: Options) -> list[tuple[int, int]]:
    """Byte ranges of about `unit_bytes`, each ending just after a newline (or at the end of the file); none for
    a file opening with a UTF-16/32 byte-order mark (its newlines are not b"\\n") or, `jsonl`, with a JSON array
    written across lines (`opens_json_array` on its first PROBE_BYTES, as a first range's reader judges it: its
    reader tells the rest, and reads a JSON Lines file opening so whole). Each cut costs one small
    read (a ranged GET of PROBE_BYTES on an object store), or as many as the line it falls in needs: the planner
    reads to its newline PROBE_BYTES at a time and holds none of it (a file with no newline is read through once).
    An http(s) file costs one more GET, of 1 byte, which tells whether its server serves ranges."""
    fs, stripped = input_filesystem(path, options)
    # no read-ahead: fsspec's default cache fetched each read's bytes and a block past them, 2 x PROBE_BYTES a cut
    with fs.open(stripped, "rb", block_size=PROBE_BYTES, cache_type="none") as fh:
        head = fh.read(PROBE_BYTES)  # once: read per mark, each mark met the next 4 bytes, so only UTF-32-LE's was
        if any(head.startswith(bom) for bom, _ in WIDE_BOMS):  # found and a UTF-16 file was cut in ranges read again
            return []  # as UTF-8
        if kind == "jsonl" and opens_json_array(head, PROBE_BYTES):
            return []
        if path.startswith(("http://", "https://")) and len(fs.cat_file(stripped, start=1, end=2)) != 1:
            # its whole file, not 1 byte: fsspec takes a whole file shorter than a range's block for that range, so
            # each range's reader would read the file's start as its own (seeking past the head read, once, failed)
            raise ConfigError(f"cannot plan the units of input file {path}: its server does not support range "
                              f"requests, which reading a file larger than execution.unit_mb "
                              f"({unit_bytes / (1 << 20):.3g} MB) in ranges needs: set unit_mb above its size "
                              f"({size} bytes), or download it and read it from disk")
        cuts, start = [], 0
        while start + unit_bytes < size:
            end = start + unit_bytes
            fh.seek(end)
            while piece := fh.read(PROBE_BYTES):  # to the end of the line the cut falls in
                newline = piece.find(b"\n")
                if newline >= 0:
                    end += newline + 1
                    break
                end += len(piece)
            if end >= size:
                break
            cuts.append((start, end))
            start = end
    return cuts + [(start, size)]


def _group_runs(sizes: list[int], unit_bytes: int) -> list[tuple[int, int]]:
    """Row groups `[a, b)` of about `unit_bytes` of data each, adjacent groups added while the run stays within it:
    a file of many small row groups is a few units, not one a group (each paid a task and the footer's parse)."""
    runs: list[tuple[int, int]] = []
    start, total = 0, 0
    for g, size in enumerate(sizes):
        if g > start and total + size > unit_bytes:
            runs.append((start, g))
            start, total = g, 0
        total += size
    return runs + [(start, len(sizes))] if sizes else []


def _row_groups(path: str, options: Options) -> list[int]:
    """The data size of each row group of a Parquet file with rows (uncompressed, as its footer gives it); none
    when it cannot be read or is empty (read as a `file` unit, its reader reports it as a reject)."""
    import pyarrow.parquet as pq  # here and in `read_unit`: a plan without Parquet files never needs it

    fs, stripped = input_filesystem(path, options)
    try:
        with fs.open(stripped, "rb", block_size=PROBE_BYTES) as fh:  # the footer only
            meta = pq.ParquetFile(fh).metadata
            return [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)] if meta.num_rows else []
    except Exception:  # pyarrow raises ArrowInvalid/OSError subclasses for bad files
        return []


def row_group_range(unit: Unit) -> range:
    """The row groups of a `row_group` unit: `[start, end)`; a plan saved before units held runs of groups (`end`
    0) names group `start` alone, and a resume keeps its plan."""
    return range(unit.start, max(unit.end, unit.start + 1))


def read_unit(unit: Unit, options: Options = None) -> Iterator[Any]:
    """A local unit's items in order: a record dict or a `BadRecord` (in a range, line-numbered reasons carry
    LINE_MARK: the driver knows how many lines of the file come before it)."""
    if unit.kind == "file":
        reader = LocalSource.reader(unit.fmt or None, options)
        for item, _ in reader.read_file(unit.file, unit.path, {"file": unit.file, "record": 0}):
            yield item
        return
    if unit.kind == "row_group":
        import pyarrow.parquet as pq  # as in `_row_groups`

        with open_input(unit.path, options) as fh:
            pf = pq.ParquetFile(fh)  # the footer parsed once for the unit's groups
            for g in row_group_range(unit):  # one at a time: a damaged group ends the unit after the ones before
                for batch in pf.read_row_group(g).to_batches(PARQUET_BATCH):
                    yield from parquet_rows(batch, unit.path, lambda r: LINE_MARK)  # the driver numbers it in the file
        return
    parse = LocalSource._parse_json if unit.fmt == "jsonl" else LocalSource._parse_text
    mark = _Mark()
    if unit.start == unit.end == 0:
        yield BadRecord(f"empty file {unit.path}", "")
        return
    with open_input(unit.path, options, start=unit.start, end=unit.end) as fh:
        remaining = unit.end - unit.start  # the range ends after a newline, or at the end of the file
        lines, whole = bounded_lines(fh), False
        if unit.start == 0:
            lead = opening(lines)  # to its first line that is not blank
            first = lead[0] if lead and type(lead[0]) is bytes else b""
            # a small UTF-16/32 file, or JSON array, planned whole without reading: its reader decodes it, parses it;
            # judged as the planner judged the file's first PROBE_BYTES (a file it cut has no range read whole)
            whole = any(first.startswith(bom) for bom, _ in WIDE_BOMS) or \
                (unit.fmt == "jsonl" and opens_json_array(b"".join(x for x in lead if type(x) is bytes), PROBE_BYTES))
            if first.startswith(codecs.BOM_UTF8):  # a UTF-8 BOM opens the file, not the record
                lead[0], remaining = first[len(codecs.BOM_UTF8):], remaining - len(codecs.BOM_UTF8)
            lines = itertools.chain(lead, lines)
        if not whole:
            for line in lines:
                remaining -= len(line)
                yield long_line(line, unit.path, mark) if type(line) is LongLine else parse(line, unit.path, mark)
                if remaining <= 0:
                    return
            return
    yield from read_unit(Unit("file", unit.file, unit.path, unit.fmt), options)
