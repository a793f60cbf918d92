"""A part's texts, metas and tokens in its run's order: the columns file of format version 2.

Why: a Parquet shard is a range of its bucket's key order, and the merge keeps each part's run order, so the
records one row group takes from a part are a contiguous range of that part's run, but scattered in `.idx`
order. Laid out in run order, they are read with one positioned read per (row group, part) and column where
the `.idx`-ordered files (format 1, `textshard.columns_file`) took two reads a record: on 2 M short documents
the writers' reads and the Python that put each record in row order were ~12 % of the job's CPU
(docs/performance.md, round 28).

Written by the worker that tokenized the part, right after its run (`order.cache_run`), from the texts and
metas its `textshard.LineScan` kept and the `.bin` it just wrote; only for parts of at most
`textshard.RUN_COLUMNS_BYTES` of ingest lines, which it holds in memory until then. Larger parts keep format 1
(their records are few and long, so a read each costs little beside their bytes).

Layout (`parquet/.order/<dataset>/<part>.columns`, scratch like the runs): one line of canonical JSON (`format`,
`version` 2, `part`, the part's `input_sha256` and `plan_hash` as in format 1, `run`: the payload SHA-256 of the
run whose order it follows, `n` records, the sections' byte sizes `text`, `meta`, `tokens`); then a table of `n`
rows in `.idx` order (`TABLE`: the record's position in the run, where its text, its meta and its tokens start
in their sections); then in run order each record's ingest line number (int64: what a reader checks a range
against), the texts, the canonical metas, and the tokens (the `.bin`'s values and dtype, EOD included). A reader
uses a file only when its header names the part's receipt and the run the exports use (a run remade for another
first ordinal has another order).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import orjson
import pyarrow as pa

from streamprep import atomic
from streamprep.textshard import COLUMNS_FORMAT

VERSION = 2
TABLE = np.dtype([("pos", "<i8"), ("text", "<i8"), ("meta", "<i8"), ("tokens", "<i8")])
LINE = np.dtype("<i8")  # the lines section: each record's ingest line, in run order
HEADER_READ = 4096  # bytes read to find the header line (a few hundred bytes)
CHUNK_BYTES = 4 << 20  # values put in run order at a time when a file is written


class Sections(NamedTuple):
    """Where a format-2 file's parts start (file offsets)."""

    table: int
    lines: int
    text: int
    meta: int
    tokens: int


def take(data: Any, sizes: np.ndarray, positions: np.ndarray) -> pa.Buffer:
    """Values of `sizes[i]` bytes each, back to back in `data` (any buffer), taken at `positions` and joined: by
    Arrow's `take` (a copy per value in C++; a Python slice per value cost ~6x more), in an Arrow buffer."""
    if not len(positions):
        return pa.py_buffer(b"")
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if int(offsets[-1]) != memoryview(data).nbytes:
        raise ValueError(f"{memoryview(data).nbytes} bytes of values, but their sizes add up to {int(offsets[-1])}")
    values = pa.Array.from_buffers(pa.large_binary(), len(sizes), [None, pa.py_buffer(offsets), pa.py_buffer(data)])
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    taken = values.take(pa.Array.from_buffers(pa.int64(), len(positions), [None, pa.py_buffer(positions)]))
    bounds = np.frombuffer(taken.buffers()[1], dtype=np.int64, count=len(taken) + 1, offset=8 * taken.offset)
    return taken.buffers()[2][int(bounds[0]):int(bounds[-1])]


def _starts(sizes: np.ndarray) -> np.ndarray:
    return np.cumsum(sizes) - sizes


def encode(part: str, keys: dict[str, Any], run_sha256: str, order: np.ndarray, texts: bytes, metas: bytes,
           tokens: np.ndarray, records: np.ndarray) -> Iterator[Any]:
    """The file of one part (`part`: "<dataset>/<part>") whose records, in `.idx` order, have these texts and metas
    (each back to back), tokens (the `.bin`'s values) and summary rows (`records`: `summary.RECORD`, whose
    `text_bytes` and `meta_bytes` cut `texts` and `metas`); `order`: the run, i.e. the `.idx` row at each run
    position; `keys`: the receipt's `input_sha256` and `plan_hash`. Pure: the same inputs give the same bytes,
    as buffers to write one after the other, the values in chunks of about CHUNK_BYTES (so what the file costs in
    memory beyond its inputs is a chunk, not another copy of them)."""
    sizes = [(texts, records["text_bytes"]), (metas, records["meta_bytes"]),
             (tokens, records["n_tokens"] * tokens.dtype.itemsize)]  # tokens: `.idx` order, back to back
    table = np.zeros(len(order), dtype=TABLE)
    table["pos"][order] = np.arange(len(order))
    for name, (_, size) in zip(("text", "meta", "tokens"), sizes):
        table[name][order] = _starts(size[order])
    header = {"format": COLUMNS_FORMAT, "version": VERSION, "part": part, **keys, "run": run_sha256, "n": len(order),
              **{name: int(size.sum()) for name, (_, size) in zip(("text", "meta", "tokens"), sizes)}}
    yield orjson.dumps(header, option=orjson.OPT_SORT_KEYS) + b"\n"
    yield table.tobytes()
    yield np.ascontiguousarray(records["line"][order], dtype="<i8").tobytes()
    for data, size in sizes:
        ends = np.cumsum(size[order])
        cuts = np.searchsorted(ends, np.arange(CHUNK_BYTES, int(ends[-1]) if len(ends) else 0, CHUNK_BYTES))
        for chunk in np.split(order, np.unique(cuts[cuts < len(order)])):
            yield take(data, size, chunk)


def write(path: Path, *args: Any) -> None:
    """`encode(*args)` written atomically to `path`."""
    with atomic.writing(path) as fh:
        for piece in encode(*args):
            fh.write(piece)


def sections(head: bytes, part: str, keys: dict[str, Any], run_sha256: str | None) -> Sections | None:
    """Where the sections of a format-2 file start, given its first bytes, when it was made for this part, receipt
    (`keys`) and run; else None (another format, another run, or not a header at all)."""
    end = head.find(b"\n")
    if end == -1 or run_sha256 is None:
        return None
    try:
        header = orjson.loads(head[:end])
    except orjson.JSONDecodeError:
        return None
    expect = {"format": COLUMNS_FORMAT, "version": VERSION, "part": part, **keys, "run": run_sha256}
    if not isinstance(header, dict) or any(header.get(k) != v for k, v in expect.items()):
        return None
    try:
        table, n = end + 1, int(header["n"])
        lines = table + n * TABLE.itemsize
        text = lines + n * LINE.itemsize
        meta = text + int(header["text"])
        return Sections(table, lines, text, meta, meta + int(header["meta"]))
    except (KeyError, TypeError, ValueError):
        return None


def _starts_of(entries: np.ndarray) -> np.ndarray:
    """(text, meta, tokens) section offsets of table rows, int64 (n, 3)."""
    return np.stack([entries[k] for k in ("text", "meta", "tokens")], axis=1)


def record_offsets(index: Any, ids: np.ndarray, sections: list[Any],
                   read: Callable[[np.ndarray, np.ndarray, np.ndarray], bytes]) -> np.ndarray:
    """Where the text, the meta and the tokens of each of `ids` start in its part's file: int64 (len(ids), 3).
    `index`: the shard's `exports.index.ShardRecords`, whose parts of `ids` all have a format-2 file (`sections`:
    per part, its `Sections`); `read(rows, offsets, sizes)`: those bytes of the files of `rows`' parts, back to back.

    A row group's records of one part are a range of the part's run, in run order (module doc), so each part's
    group is placed from its first record's table row and checked against the run's line numbers there, one read
    each; if any group is not such a range (a reader given other rows), every record's table row is read."""
    order = np.argsort(index.part[ids], kind="stable")
    rows = ids[order]
    parts = index.part[rows]
    first = np.flatnonzero(np.concatenate([[True], parts[1:] != parts[:-1]]))
    count = np.diff(np.append(first, len(rows)))
    group = np.repeat(np.arange(len(first)), count)
    at = np.array([sections[p] for p in parts[first].tolist()], dtype=np.int64).reshape(len(first), 5)

    def table(of: np.ndarray, tables: np.ndarray) -> np.ndarray:
        where = tables + index.row[of] * TABLE.itemsize
        return np.frombuffer(read(of, where, np.full(len(of), TABLE.itemsize, dtype=np.int64)), dtype=TABLE)
    entries = table(rows[first], at[:, 0])
    in_run = (at[:, 2] - at[:, 1]) // LINE.itemsize - entries["pos"]  # records from there to the run's end
    sizes = np.stack([index.text_bytes[rows], index.meta_bytes[rows], index.n_tokens[rows] * index.itemsizes(rows)],
                     axis=1)
    if (count <= in_run).all() and np.array_equal(index.line[rows], np.frombuffer(
            read(rows[first], at[:, 1] + entries["pos"] * LINE.itemsize, count * LINE.itemsize), dtype=LINE)):
        within = np.cumsum(sizes, axis=0) - sizes  # after the group's first record, its sizes add up
        starts = within - within[first][group] + _starts_of(entries)[group]
    else:
        starts = _starts_of(table(rows, at[group, 0]))
    out = np.empty_like(starts)
    out[order] = starts + at[group, 2:]
    return out
