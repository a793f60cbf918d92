"""What the exports read: completed tokenization shards, a slim per-record index over them for the plan,
and the full per-record numbers of one Parquet shard's rows when that shard is written.

`DatasetIndex` holds, per kept record, only what the plan needs (its token count and the bytes of its
ingest line: 12 bytes), so the job's memory grows by that, not by the whole per-record summary. Everything
else per record (its line's byte offset, where its tokens start in the part's `.bin`, their sum, the
SHA-256 of its text) stays in the parts' summaries on disk (`exports/summary.py`) and is read back for
just the rows of the shard being written (`ShardRecords`). Texts and tokens are read by positioned reads
(`RecordReader`).
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import orjson

from streamprep import binidx


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

    @classmethod
    def from_task(cls, task: Any, receipt: dict) -> "ShardRef":
        """The ref of a tokenization task (`streamprep.tokenize.ShardTask`) and its completed receipt."""
        has_docs = receipt["stats"]["num_documents"] > 0
        return cls(dataset=task.dataset, split=task.split, part=task.part, ingest_path=Path(task.input_path),
                   prefix=Path(task.prefix) if has_docs else None, receipt=receipt,
                   receipt_path=Path(task.receipt_path))


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
    """What the Parquet plan needs per record of one dataset, records in ingest order (part order, then line
    order); record `i` of part `p` is id `starts[p] + i`."""

    name: str
    split: str
    refs: list[ShardRef]          # shards with documents, in part order
    empty_refs: list[ShardRef]    # shards that ended with 0 documents
    starts: np.ndarray            # int64 (len(refs) + 1): the first id of each part, then the record count
    n_tokens: np.ndarray          # int32: tokens of the record (EOD included), as in `.idx`
    line_bytes: np.ndarray        # int64: bytes of its ingest line (JSON record + newline)
    dtypes: list[np.dtype]        # token dtype per part

    def __len__(self) -> int:
        return len(self.n_tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.n_tokens.sum(dtype=np.int64))

    def part_slice(self, part: int) -> slice:
        return slice(int(self.starts[part]), int(self.starts[part + 1]))

    def est_bytes(self, bytes_per_token: int) -> np.ndarray:
        """The packing estimate per record: `bytes_per_token × tokens + bytes of its JSON line`."""
        return self.n_tokens.astype(np.int64) * bytes_per_token + self.line_bytes

    @cached_property
    def file_refs(self) -> list[ShardRef]:
        """`refs` without their receipts: what a shard writer is sent (it reads only files)."""
        return [replace(r, receipt={}) for r in self.refs]

    def rows_of(self, ids: np.ndarray) -> "ShardRows":
        """What a shard writer needs to read the records `ids` (in row order) back: where each lies, and the
        parts it reads (not every part of the dataset: what a job carries grows with what it reads)."""
        ids = np.asarray(ids, np.int64)
        part = np.searchsorted(self.starts, ids, side="right") - 1
        used = np.unique(part)
        return ShardRows([self.file_refs[i] for i in used.tolist()], [self.dtypes[i] for i in used.tolist()],
                         np.searchsorted(used, part).astype(np.int32), ids - self.starts[part])


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

    @property
    def num_tokens(self) -> int:
        return int(self.n_tokens.sum())

    def est_bytes(self, bytes_per_token: int) -> np.ndarray:
        return self.n_tokens * bytes_per_token + self.line_bytes


def build_indexes(datasets: list[tuple[str, str, list[ShardRef]]],
                  summaries: Iterable[tuple[ShardRef, Any]]) -> list[DatasetIndex]:
    """One index per (name, split, shards) in `datasets`, records in part order. Columns are sized from the
    receipts' document counts and filled one part summary (`exports/summary.py`) at a time: the job holds the
    slim index and the summary being copied, never every summary."""
    indexes, slots = [], {}
    for name, split, refs in datasets:
        refs = sorted(refs, key=lambda r: r.part)
        full = [r for r in refs if r.prefix is not None]
        starts = np.zeros(len(full) + 1, dtype=np.int64)
        np.cumsum([r.receipt["stats"]["num_documents"] for r in full], out=starts[1:])
        n = int(starts[-1])
        idx = DatasetIndex(name=name, split=split, refs=full, empty_refs=[r for r in refs if r.prefix is None],
                           starts=starts, n_tokens=np.empty(n, dtype=np.int32), line_bytes=np.empty(n, dtype=np.int64),
                           dtypes=[None] * len(full))  # type: ignore[list-item]
        slots.update({(name, r.part): (idx, i) for i, r in enumerate(full)})
        indexes.append(idx)
    for ref, summary in summaries:
        idx, i = slots.pop((ref.dataset, ref.part))
        rows = idx.part_slice(i)
        if len(summary.records) != rows.stop - rows.start:
            raise ExportError(f"{ref.dataset}/{ref.part}: part summary has {len(summary.records)} records, "
                              f"its receipt {rows.stop - rows.start} documents")
        idx.n_tokens[rows] = summary.records["n_tokens"]
        idx.line_bytes[rows] = summary.records["line_bytes"]
        idx.dtypes[i] = np.dtype(summary.dtype)
    if slots:
        raise ExportError(f"no part summary for {', '.join(sorted('/'.join(k) for k in slots))}")
    return indexes


class RecordReader:
    """Reads texts, metas and tokens of chosen records with positioned reads (os.pread: no seek, no
    buffer, no memory map whose pages would stay resident); keeps at most `max_open` files open."""

    def __init__(self, index: ShardRecords, max_open: int = 32):
        self.index = index
        self.max_open = max_open
        self._fds: OrderedDict[tuple[str, int], int] = OrderedDict()

    def _fd(self, kind: str, part: int) -> int:
        key = (kind, part)
        if key in self._fds:
            self._fds.move_to_end(key)
            return self._fds[key]
        while len(self._fds) >= self.max_open:
            os.close(self._fds.popitem(last=False)[1])
        ref = self.index.refs[part]
        path = ref.ingest_path if kind == "text" else binidx.prefix_paths(ref.prefix)[0]
        self._fds[key] = fd = os.open(path, os.O_RDONLY)
        return fd

    def records(self, ids: np.ndarray) -> list[tuple[str, bytes]]:
        """(text, canonical meta JSON) per id, in the order of `ids`; reads each part in offset order."""
        idx = self.index
        out: list[tuple[str, bytes] | None] = [None] * len(ids)
        order = np.lexsort((idx.line_offset[ids], idx.part[ids]))
        rows = ids[order]
        part, fd, path = -1, -1, None
        for pos, p, offset, size, line in zip(order.tolist(), idx.part[rows].tolist(), idx.line_offset[rows].tolist(),
                                               idx.line_bytes[rows].tolist(), idx.line[rows].tolist()):
            if p != part:
                part, fd, path = p, self._fd("text", p), idx.refs[p].ingest_path
            rec = load_record(os.pread(fd, size, offset), path, line)
            out[pos] = (rec["text"], orjson.dumps(rec.get("meta", {}), option=orjson.OPT_SORT_KEYS))
        return out  # type: ignore[return-value]

    def tokens(self, ids: np.ndarray) -> np.ndarray:
        """The token ids (EOD included, exactly as in `.bin`) of `ids` back to back, as int32."""
        idx = self.index
        counts = idx.n_tokens[ids]
        ends = np.cumsum(counts)
        out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int32)
        order = np.lexsort((idx.token_start[ids], idx.part[ids]))
        rows = ids[order]
        part, fd, item, dtype = -1, -1, 0, None
        for p, start, n, end in zip(idx.part[rows].tolist(), idx.token_start[rows].tolist(), counts[order].tolist(),
                                    ends[order].tolist()):
            if p != part:
                part, fd, dtype = p, self._fd("bin", p), idx.dtypes[p]
                item = dtype.itemsize
            raw = os.pread(fd, n * item, start * item)
            if len(raw) != n * item:
                raise ExportError(f"{idx.refs[part].prefix}.bin: shorter than its .idx says")
            out[end - n:end] = np.frombuffer(raw, dtype=dtype)
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "RecordReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
