"""Per-part export work, done once per finished tokenization shard: what the final exports need per record.

`summarize_part(ref)` reads one shard back — its ingest part (line offsets; per kept record the SHA-256 and
the bytes of its text and the bytes of its canonical meta JSON, so a shard writer parses its lines in bulk),
its `.idx` (where each record's tokens start, how many) and its `.bin` (the sum of each record's token ids)
— and checks that they agree with each other and with the receipt; the worker that just tokenized the part
passes the ingest side as its tokenizing parsed it (`textshard.LineScan`). It depends on
nothing but the shard (not on the export options), so it can run as soon as the receipt exists, in any
process. `part_summary(ref)` caches it next to the receipt (`receipts/<dataset>/<part>.summary`,
written atomically, deterministic bytes) keyed by the receipt's content: a resume reuses it; a stale
or damaged file is recomputed.

Cache file: one line of canonical JSON (format, version, key, token dtype, SHA-256 of the payload),
then the payload: a `.npy` of one `RECORD` row per kept record, in `.idx` order.
"""
from __future__ import annotations

import hashlib
import io
import mmap
import os
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from streamprep import atomic, binidx
from streamprep.exports.index import ExportError, ShardRecords, ShardRef, ShardRows, load_record
from streamprep.textshard import LineScan

FORMAT = "streamprep-part-summary"
VERSION = 3  # 2: each record's text and canonical meta byte lengths, so a shard writer cuts its columns unparsed;
# 3: where they start in the part's columns file (`textshard.LineScan`), so a shard writer reads them unparsed
SUFFIX = ".summary"
TEXT_CHUNK = 1 << 22    # bytes of ingest lines read at a time
TOKEN_CHUNK = 1 << 22   # tokens of `.bin` read at a time
RECORD = np.dtype([("line", "<i8"), ("line_offset", "<i8"), ("line_bytes", "<i8"), ("token_start", "<i8"),
                   ("n_tokens", "<i8"), ("token_sum", "<i8"), ("text_sha256", "u1", (32,)), ("text_bytes", "<i8"),
                   ("meta_bytes", "<i8"), ("column_offset", "<i8")])


@dataclass(frozen=True)
class PartSummary:
    dtype: str           # token dtype of the part's `.bin`
    records: np.ndarray  # RECORD, one per kept record, in `.idx` order


def _scan_ingest(ref: ShardRef, dropped: set[int]) -> tuple[np.ndarray, bytes, np.ndarray, np.ndarray]:
    """`textshard.LineScan` of the ingest part, read and parsed again (a part summarized after its tokenizing
    process: on resume, or from an older cache)."""
    scan, line_no = LineScan(), 0
    with open(ref.ingest_path, "rb") as fh:
        while lines := fh.readlines(TEXT_CHUNK):
            numbers = range(line_no, line_no + len(lines))
            empty = [n in dropped for n in numbers]
            scan.add(lines, [{} if none else load_record(line, ref.ingest_path, n)
                             for line, n, none in zip(lines, numbers, empty)], empty)
            line_no += len(lines)
    return scan.columns()


def _token_sums(bin_path: Path, dtype: np.dtype, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Sum of each record's token ids (records in `.bin` order, back to back and none empty: the caller's
    `IndexedDataset.check` holds), reading about TOKEN_CHUNK tokens at a time. One `np.add.reduceat` per chunk,
    summing in int64 as it goes: a cumulative sum needed an int64 copy of the chunk, freshly paged in each time
    (~13 ns a token here, a fifth of a 250 MB job's tokenizing calls; this ~3 ns)."""
    sums = np.zeros(len(starts), dtype=np.int64)
    ends = starts + counts
    i = 0
    with open(bin_path, "rb") as fh:
        while i < len(starts):
            j = max(int(np.searchsorted(ends, starts[i] + TOKEN_CHUNK, side="right")), i + 1)
            lo, hi = int(starts[i]), int(ends[j - 1])
            fh.seek(lo * dtype.itemsize)
            sums[i:j] = np.add.reduceat(np.fromfile(fh, dtype=dtype, count=hi - lo), starts[i:j] - lo, dtype=np.int64)
            i = j
    return sums


def damaged_receipt(ref: ShardRef, what: str) -> ExportError:
    """A receipt that disagrees with its shard or part (a resume redoes such a shard: `tokenize.receipt_problem`
    checks what it can cheaply; this is the rest): the error names it and the repair, else each re-run failed alike."""
    return ExportError(f"{ref.dataset}/{ref.part}: {what}; its receipt {ref.receipt_path} is damaged: delete it and "
                       f"re-run the same `streamprep ingest` command to redo the shard")


def summarize_part(ref: ShardRef, scan: LineScan | None = None) -> PartSummary:
    """Read one shard with documents back and summarize it per record (pure: writes nothing); its ingest
    lines' side from `scan` when its tokenizing took one (same process, just now), else read again."""
    if ref.prefix is None:
        raise ExportError(f"{ref.dataset}/{ref.part}: no .bin/.idx prefix")
    ds = binidx.IndexedDataset.open(ref.prefix)
    problems = ds.check()
    if problems:
        raise ExportError(f"{ref.dataset}/{ref.part}: {problems[0]}")
    stats = ref.receipt.get("stats", {})
    dropped = np.asarray(sorted(stats.get("dropped_empty", [])), dtype=np.int64)
    lengths, digests, text_bytes, meta_bytes = scan.columns() if scan is not None else \
        _scan_ingest(ref, set(dropped.tolist()))
    n_lines = len(lengths)
    if len(dropped) and (dropped[0] < 0 or dropped[-1] >= n_lines):
        raise damaged_receipt(ref, f"it drops line {int(dropped[-1])} but {ref.ingest_path} has {n_lines} lines")
    lines = np.delete(np.arange(n_lines, dtype=np.int64), dropped)
    if len(lines) != len(ds):
        raise damaged_receipt(ref, f"{ref.ingest_path} has {n_lines} lines, {len(dropped)} dropped as empty, but "
                                   f"{ref.prefix}.idx has {len(ds)} sequences")
    n_tokens = ds.lengths.astype(np.int64)
    expected = stats.get("num_tokens")
    if expected is not None and int(n_tokens.sum()) != int(expected):
        raise damaged_receipt(ref, f".idx holds {int(n_tokens.sum())} tokens, the receipt says {expected}")
    offsets = np.zeros(n_lines + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    rec = np.zeros(len(ds), dtype=RECORD)
    rec["line"], rec["line_offset"], rec["line_bytes"] = lines, offsets[lines], lengths[lines]
    rec["token_start"], rec["n_tokens"] = ds.pointers // ds.dtype.itemsize, n_tokens
    rec["token_sum"] = _token_sums(ds.bin_path, ds.dtype, rec["token_start"], n_tokens)
    rec["text_sha256"] = np.frombuffer(digests, dtype=np.uint8).reshape(-1, 32)
    rec["text_bytes"], rec["meta_bytes"] = text_bytes, meta_bytes
    sizes = text_bytes + meta_bytes  # a record's text, then its meta, back to back in the columns file
    rec["column_offset"] = np.cumsum(sizes) - sizes
    return PartSummary(str(ds.dtype), rec)


# -- the cache beside the receipt ---------------------------------------------------------------
def cache_path(ref: ShardRef) -> Path:
    return Path(ref.receipt_path).with_suffix(SUFFIX)


def receipt_key(receipt: dict) -> str:
    """What a summary depends on: the receipt names the input's and the `.bin/.idx` files' SHA-256."""
    return hashlib.sha256(orjson.dumps(receipt, option=orjson.OPT_SORT_KEYS)).hexdigest()


def encode(summary: PartSummary, receipt: dict) -> bytes:
    buf = io.BytesIO()
    np.save(buf, summary.records, allow_pickle=False)
    payload = buf.getvalue()
    header = {"format": FORMAT, "version": VERSION, "key": receipt_key(receipt), "dtype": summary.dtype,
              "payload_sha256": hashlib.sha256(payload).hexdigest()}
    return orjson.dumps(header, option=orjson.OPT_SORT_KEYS) + b"\n" + payload


def split_header(data: bytes) -> tuple[dict[str, Any], bytes] | None:
    """(header, payload) of a cache file written as one JSON object line then its payload (a part's summary, its
    sorted run), or None when that first line is not a JSON object."""
    head, _, payload = data.partition(b"\n")
    try:
        header = orjson.loads(head)
    except orjson.JSONDecodeError:
        return None
    return (header, payload) if isinstance(header, dict) else None


def decode(data: bytes, receipt: dict) -> PartSummary | None:
    """The summary in `data` if it is intact and made for `receipt`, else None."""
    if (split := split_header(data)) is None:
        return None
    header, payload = split
    if header.get("format") != FORMAT or header.get("version") != VERSION \
            or header.get("key") != receipt_key(receipt) or header.get("payload_sha256") != hashlib.sha256(payload).hexdigest():
        return None
    records = np.load(io.BytesIO(payload), allow_pickle=False)
    return PartSummary(str(header["dtype"]), records) if records.dtype == RECORD else None


def load_cached(ref: ShardRef) -> PartSummary | None:
    """The cached summary of `ref` when its file is there, intact and current."""
    try:
        return decode(cache_path(ref).read_bytes(), ref.receipt)
    except OSError:
        return None


def cached_identity(ref: ShardRef) -> list | None:
    """[payload SHA-256, file size] of the cache file of `ref` as its header states them (one line read, the
    payload not hashed): a part's sorted run records the summary it was made from, whose rows the Parquet
    writers read; None when there is no readable cache for the current receipt."""
    path = cache_path(ref)
    try:
        with open(path, "rb") as fh:
            header = orjson.loads(fh.readline())
            size = os.fstat(fh.fileno()).st_size
    except (OSError, orjson.JSONDecodeError):
        return None
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION \
            or header.get("key") != receipt_key(ref.receipt):
        return None
    return [header.get("payload_sha256"), size]


def compute_and_cache(ref: ShardRef, scan: LineScan | None = None) -> PartSummary:
    """`summarize_part`, then its cache file."""
    summary = summarize_part(ref, scan)
    atomic.write_bytes(cache_path(ref), encode(summary, ref.receipt))
    return summary


def part_summary(ref: ShardRef, scan: LineScan | None = None) -> PartSummary:
    """The summary of one shard with documents: from its cache when usable, else computed (its ingest side from
    `scan` when given) and cached."""
    return load_cached(ref) or compute_and_cache(ref, scan)


@lru_cache(maxsize=16)
def _npy_header(prefix: bytes) -> tuple[tuple[int, ...], np.dtype]:
    """Shape and dtype of a `.npy` from its magic and header bytes. Memoized: the parts' headers differ only in
    their row counts, and a shard writer reads those of every part it touches (literal_eval is slow)."""
    fh = io.BytesIO(prefix)
    major, _ = np.lib.format.read_magic(fh)
    read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, _, dtype = read_header(fh)
    return shape, dtype


def _cached_rows(ref: ShardRef, rows: np.ndarray) -> np.ndarray:
    """RECORD rows `rows` of a part from its cache file (checked and current: this exports step made the part's
    run from it), through a map of the file closed at once, so only the pages of these rows are read and none
    stay mapped."""
    path = cache_path(ref)
    with open(path, "rb") as fh:
        fh.readline()
        magic = fh.read(8)
        size_format = "<H" if magic[6:7] == b"\x01" else "<I"  # the header's length: 2 bytes in format 1.0, else 4
        size = fh.read(struct.calcsize(size_format))
        try:
            shape, dtype = _npy_header(magic + size + fh.read(struct.unpack(size_format, size)[0]))
        except (ValueError, struct.error):
            shape, dtype = (), None
        if dtype != RECORD or len(shape) != 1 or (len(rows) and int(rows.max()) >= shape[0]):
            raise ExportError(f"{path}: part summary changed while the exports were written")
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
            payload = np.frombuffer(mapped, dtype=RECORD, count=shape[0], offset=fh.tell())
            out = payload[rows]
            del payload  # the map closes only once no array refers to it
    return out


def shard_records(rows: ShardRows) -> ShardRecords:
    """The per-record numbers of a shard's rows (in row order), read part by part from the cached summaries."""
    part, row = rows.part, rows.row
    out = np.empty(len(row), dtype=RECORD)
    order = np.lexsort((row, part))  # part by part, each in row order
    bounds = np.flatnonzero(np.diff(part[order])) + 1
    for sel in np.split(order, bounds) if len(order) else []:
        out[sel] = _cached_rows(rows.refs[int(part[sel[0]])], row[sel])
    return ShardRecords(refs=rows.refs, dtypes=rows.dtypes, part=part, row=row,
                        **{k: out[k] for k in ("line", "line_offset", "line_bytes", "token_start", "n_tokens",
                                               "token_sum", "text_sha256", "text_bytes", "meta_bytes",
                                               "column_offset")})
