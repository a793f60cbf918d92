"""What the exports read: completed tokenization shards, per dataset an index of its parts for the plan,
and the full per-record numbers of one Parquet shard's rows when that shard is written.

`DatasetIndex` holds per part only a few numbers (where its records start in the dataset, its tokens, its
token dtype, its sorted run: `exports/order.py`), so the job's memory grows with the parts, not the records.
Everything per record (its line's byte offset and bytes, where its tokens start in the part's `.bin`, how
many, their sum, the SHA-256 and bytes of its text, the bytes of its canonical meta) stays in the parts' summaries on disk (`exports/summary.py`) and is
read back for just the rows of the shard being written (`ShardRecords`). Texts and tokens are read by
positioned reads (`RecordReader`).
"""
from __future__ import annotations

import os
import resource
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import repeat
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import orjson

from streamprep import binidx
from streamprep.textshard import canonical_meta, columns_header

COLUMNS_KEY = ("input_sha256", "plan_hash")  # the receipt's fields a part's columns file is made for


class ExportError(ValueError):
    """The exports cannot be written as configured, or their inputs disagree with each other."""


@dataclass(frozen=True)
class ShardRef:
    """One completed tokenization shard, as the pipeline hands it to the exports."""

    dataset: str         # dataset name
    split: str           # train | valid | test
    part: str            # "part-00000"
    ingest_path: Path    # RUN_DIR/ingest/<dataset>/part-00000.jsonl
    prefix: Path | None  # RUN_DIR/binidx/<dataset>/part-00000_text_document (None when 0 documents)
    receipt: dict        # the receipt JSON (status, stats, files, ...)
    receipt_path: Path   # where the receipt is; its part summary is cached beside it
    columns: Path | None = None  # where its tokenizing may have left its texts and metas (ShardTask.columns_path)

    @classmethod
    def from_task(cls, task: Any, receipt: dict) -> "ShardRef":
        """The ref of a tokenization task (`streamprep.tokenize.ShardTask`) and its completed receipt."""
        has_docs = receipt["stats"]["num_documents"] > 0
        return cls(dataset=task.dataset, split=task.split, part=task.part, ingest_path=Path(task.input_path),
                   prefix=Path(task.prefix) if has_docs else None, receipt=receipt,
                   receipt_path=Path(task.receipt_path), columns=task.columns_path)


def load_record(raw: bytes, path: Path, line_no: int) -> dict[str, Any]:
    """One ingest line as a record with a string `text`, or ExportError naming the file and line (1-based)."""
    try:
        rec = orjson.loads(raw)
        if not isinstance(rec["text"], str):
            raise TypeError(f"'text' is {type(rec['text']).__name__}")
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise ExportError(f"{path}: line {line_no + 1} is not a record with 'text': {exc}") from None
    return rec


@dataclass
class DatasetIndex:
    """One dataset's parts and per part what the plan and the manifest need (its records' count and tokens, its
    token dtype, its sorted run: `exports/order.py`); record `i` of part `p` is record `starts[p] + i` of the
    dataset (ingest order: part order, then line order). Nothing per record: those numbers stay in the runs."""

    name: str
    split: str
    refs: list[ShardRef]          # shards with documents, in part order
    empty_refs: list[ShardRef]    # shards that ended with 0 documents
    starts: np.ndarray            # int64 (len(refs) + 1): the first record of each part, then the record count
    part_tokens: np.ndarray       # int64 per part: its tokens (EOD included), as in `.idx`
    dtypes: list[np.dtype]        # token dtype per part
    runs: list[Any]               # `order.PartRun` per part

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def num_tokens(self) -> int:
        return int(self.part_tokens.sum())

    def part_slice(self, part: int) -> slice:
        return slice(int(self.starts[part]), int(self.starts[part + 1]))

    @cached_property
    def file_refs(self) -> list[ShardRef]:
        """`refs` without their receipts, but for what a part's columns file must name: what a shard writer is
        sent (it reads only files)."""
        return [replace(r, receipt={k: r.receipt.get(k) for k in COLUMNS_KEY}) for r in self.refs]

    def rows_of(self, part: np.ndarray, row: np.ndarray) -> "ShardRows":
        """What a shard writer needs to read records back, given as (position in `refs`, row in that part) in
        row order: where each lies, and the parts it reads (not every part of the dataset: what a job carries
        grows with what it reads)."""
        part = np.asarray(part, np.int64)
        used = np.unique(part)
        return ShardRows([self.file_refs[i] for i in used.tolist()], [self.dtypes[i] for i in used.tolist()],
                         np.searchsorted(used, part).astype(np.int32), np.asarray(row, np.int64))


@dataclass(frozen=True)
class ShardRows:
    """One Parquet shard's records as (part, row) with where those parts' summaries are: small to send to a
    writer process, which reads the rest (`summary.shard_records`)."""

    refs: list[ShardRef]       # the parts the shard reads (without their receipts: only files are read)
    dtypes: list[np.dtype]     # token dtype per part in `refs`
    part: np.ndarray           # int32 per record, in row order: position in `refs`
    row: np.ndarray            # int64 per record: its row in that part


@dataclass
class ShardRecords:
    """Per-record numbers of one shard's rows, in row order, read from the part summaries."""

    refs: list[ShardRef]          # the parts its rows lie in
    dtypes: list[np.dtype]        # token dtype per part in `refs`
    part: np.ndarray              # int32: position in `refs`
    line: np.ndarray              # int64: line number in the ingest part
    line_offset: np.ndarray       # int64: byte offset of the line
    line_bytes: np.ndarray        # int64: bytes of the line (JSON record + newline)
    token_start: np.ndarray       # int64: first token, in elements of the part's `.bin`
    n_tokens: np.ndarray          # int64: tokens of the record (EOD included), as in `.idx`
    token_sum: np.ndarray         # int64: sum of the record's token ids
    text_sha256: np.ndarray       # uint8 (n, 32): SHA-256 of the record's UTF-8 text
    text_bytes: np.ndarray        # int64: bytes of the record's UTF-8 text
    meta_bytes: np.ndarray        # int64: bytes of its canonical meta JSON (`canonical_meta`)
    column_offset: np.ndarray     # int64: where its text, then its meta, start in the part's columns file payload

    @property
    def num_tokens(self) -> int:
        return int(self.n_tokens.sum())

    def est_bytes(self, bytes_per_token: int) -> np.ndarray:
        return self.n_tokens * bytes_per_token + self.line_bytes


def open_files_budget() -> int:
    """How many files a RecordReader keeps open: a row group reads its parts in the same order every time, so
    a budget below the parts of a shard (two files each) reopens every file for every row group. An eighth of
    the process's soft limit on open files, between 32 and 1024."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1024 if soft == resource.RLIM_INFINITY else max(32, min(1024, soft // 8))


def inverse_permutation(order: np.ndarray) -> np.ndarray:
    """The inverse of a permutation: where each position went."""
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return inverse


class RecordReader:
    """Reads texts, metas and tokens of chosen records with positioned reads (os.pread: no seek, no
    buffer, no memory map whose pages would stay resident); keeps at most `max_open` files open."""

    def __init__(self, index: ShardRecords, max_open: int | None = None):
        self.index = index
        self.max_open = max_open or open_files_budget()
        self._fds: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._bases: np.ndarray | None = None

    def _path(self, kind: str, part: int) -> Path:
        ref = self.index.refs[part]
        if kind == "text":
            return ref.ingest_path
        return ref.columns if kind == "columns" else binidx.prefix_paths(ref.prefix)[0]

    def _fd(self, kind: str, part: int) -> int:
        key = (kind, part)
        if key in self._fds:
            self._fds.move_to_end(key)
            return self._fds[key]
        while len(self._fds) >= self.max_open:
            os.close(self._fds.popitem(last=False)[1])
        self._fds[key] = fd = os.open(self._path(kind, part), os.O_RDONLY)
        return fd

    def _columns_base(self, part: int) -> int:
        """Where the payload of the part's columns file starts, when its tokenizing left one made for this shard
        (its header names the receipt's input and plan), else -1."""
        ref = self.index.refs[part]
        key = [ref.receipt.get(k) for k in COLUMNS_KEY]
        if ref.columns is None or None in key:
            return -1
        header = columns_header(ref.dataset, ref.part, *key)
        try:
            return len(header) if os.pread(self._fd("columns", part), len(header), 0) == header else -1
        except FileNotFoundError:
            return -1

    def _read(self, kind: str, rows: np.ndarray, offsets: np.ndarray, sizes: np.ndarray
              ) -> Iterator[tuple[int, list[bytes]]]:
        """(part, its chunks) part by part: `sizes[i]` bytes at `offsets[i]` of the `kind` file of record `rows[i]`
        (rows grouped by part); one positioned read per record, but no Python statement per record."""
        parts = self.index.part[rows]
        bounds = (np.flatnonzero(np.diff(parts)) + 1).tolist()
        for lo, hi in zip([0] + bounds, bounds + [len(rows)]):
            part = int(parts[lo])
            chunks = list(map(os.pread, repeat(self._fd(kind, part), hi - lo), sizes[lo:hi].tolist(),
                              offsets[lo:hi].tolist()))
            if sum(map(len, chunks)) != int(sizes[lo:hi].sum()):
                raise ExportError(f"{self._path(kind, part)}: shorter than its part summary says")
            yield part, chunks

    def columns(self, ids: np.ndarray) -> tuple[bytes, bytes]:
        """The UTF-8 texts and the canonical metas (`canonical_meta`) of `ids`, each back to back in the order of
        `ids` (their lengths: the index's `text_bytes` and `meta_bytes`): cut from the parts' columns files when
        every part has one, else parsed from the ingest lines."""
        if self._bases is None:
            self._bases = np.array([self._columns_base(p) for p in range(len(self.index.refs))], dtype=np.int64)
        return self._cut(ids) if (self._bases >= 0).all() else self._parse(ids)

    def _cut(self, ids: np.ndarray) -> tuple[bytes, bytes]:
        """`columns` from the columns files: one positioned read per record (its text, then its meta), in offset
        order, then each cut in two at its text's length."""
        idx = self.index
        order = np.lexsort((idx.column_offset[ids], idx.part[ids]))
        rows = ids[order]
        offsets = idx.column_offset[rows] + self._bases[idx.part[rows]]
        sizes = idx.text_bytes[rows] + idx.meta_bytes[rows]
        chunks = [chunk for _, part_chunks in self._read("columns", rows, offsets, sizes) for chunk in part_chunks]
        chunks = list(map(chunks.__getitem__, inverse_permutation(order).tolist()))  # in the order of `ids`
        cuts = idx.text_bytes[ids].tolist()
        return b"".join([c[:t] for c, t in zip(chunks, cuts)]), b"".join([c[t:] for c, t in zip(chunks, cuts)])

    def _parse(self, ids: np.ndarray) -> tuple[bytes, bytes]:
        """`columns` from the ingest lines, read part by part in offset order and parsed by one orjson call, so
        the Python work per record is only its read."""
        idx = self.index
        order = np.lexsort((idx.line_offset[ids], idx.part[ids]))
        rows = ids[order]
        lines = [line for _, chunks in self._read("text", rows, idx.line_offset[rows], idx.line_bytes[rows])
                 for line in chunks]
        lines = list(map(lines.__getitem__, inverse_permutation(order).tolist()))  # in the order of `ids`
        try:
            recs = orjson.loads(b"[" + b",".join(lines) + b"]")
            text = "".join([rec["text"] for rec in recs]).encode()
            metas = orjson.dumps([rec.get("meta", {}) for rec in recs], option=orjson.OPT_SORT_KEYS)
        except (orjson.JSONDecodeError, orjson.JSONEncodeError, KeyError, TypeError, AttributeError):
            # a bad line (named by load_record), or one at orjson's nesting limit only once in a list
            recs = [load_record(line, idx.refs[p].ingest_path, n)
                    for line, p, n in zip(lines, idx.part[ids].tolist(), idx.line[ids].tolist())]
            text = b"".join([rec["text"].encode() for rec in recs])
            metas = b"[" + b",".join([canonical_meta(rec) for rec in recs]) + b"]"
        commas = np.cumsum(idx.meta_bytes[ids] + 1)  # after "[", each meta then its comma (the last one's: "]")
        listed = np.frombuffer(metas, dtype=np.uint8)
        if (len(text) != int(idx.text_bytes[ids].sum()) or len(listed) != int(commas[-1]) + 1
                or listed[commas[:-1]].tobytes() != b"," * (len(ids) - 1)):
            raise ExportError("ingest lines do not match their part summaries (changed after they were made)")
        return text, np.delete(listed, np.r_[0, commas]).tobytes()

    def tokens(self, ids: np.ndarray) -> np.ndarray:
        """The token ids (EOD included, exactly as in `.bin`) of `ids` back to back, as int32; read part by part in
        `.bin` order, then put in the order of `ids` by one gather."""
        idx = self.index
        counts = idx.n_tokens[ids]
        order = np.lexsort((idx.token_start[ids], idx.part[ids]))
        rows = ids[order]
        itemsize = np.array([dtype.itemsize for dtype in idx.dtypes], dtype=np.int64)[idx.part[rows]]
        pieces = []
        for part, chunks in self._read("bin", rows, idx.token_start[rows] * itemsize, idx.n_tokens[rows] * itemsize):
            pieces.append(np.frombuffer(b"".join(chunks), dtype=idx.dtypes[part]))
        read = np.concatenate(pieces).astype(np.int32, copy=False)
        starts = np.cumsum(counts[order]) - counts[order]  # where each record's tokens start in `read` ...
        out_starts = np.cumsum(counts) - counts            # ... and in the result
        return read[np.repeat(starts[inverse_permutation(order)] - out_starts, counts) + np.arange(int(counts.sum()))]

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "RecordReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
