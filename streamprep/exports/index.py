"""What the exports read: completed tokenization shards and a compact per-record index over them.

The index holds, per kept record, only numbers (numpy arrays) taken from the parts' summaries
(`exports/summary.py`): which ingest part it is in, its line's byte offset and length there, where its
tokens start in the part's `.bin`, how many there are, their sum and the SHA-256 of its text. Texts
and tokens are read back by positioned reads (`RecordReader`) only when a Parquet shard is written.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, replace
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
    receipt_path: Path | None = None  # where the receipt is; its part summary is cached beside it

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
    """Per-record numbers for one dataset, records in ingest order (part order, then line order)."""

    name: str
    split: str
    refs: list[ShardRef]          # shards with documents, in part order
    empty_refs: list[ShardRef]    # shards that ended with 0 documents
    part: np.ndarray              # int32: position in `refs`
    line: np.ndarray              # int64: line number in the ingest part
    line_offset: np.ndarray       # int64: byte offset of the line
    line_bytes: np.ndarray        # int64: bytes of the line (JSON record + newline)
    token_start: np.ndarray       # int64: first token, in elements of the part's `.bin`
    n_tokens: np.ndarray          # int64: tokens of the record (EOD included), as in `.idx`
    token_sum: np.ndarray         # int64: sum of the record's token ids
    text_sha256: np.ndarray       # uint8 (n, 32): SHA-256 of the record's UTF-8 text
    dtypes: list[np.dtype]        # token dtype per part

    COLUMNS = ("part", "line", "line_offset", "line_bytes", "token_start", "n_tokens", "token_sum", "text_sha256")

    def __len__(self) -> int:
        return len(self.n_tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.n_tokens.sum())

    def est_bytes(self, bytes_per_token: int) -> np.ndarray:
        """The packing estimate per record: `bytes_per_token × tokens + bytes of its JSON line`."""
        return self.n_tokens * bytes_per_token + self.line_bytes

    def subset(self, ids: np.ndarray) -> "DatasetIndex":
        """The records `ids`, in that order; refs without their receipts (a shard writer needs only files)."""
        cols = {k: getattr(self, k)[ids] for k in self.COLUMNS}
        return replace(self, refs=[replace(r, receipt={}) for r in self.refs], empty_refs=[], **cols)


def build_indexes(datasets: list[tuple[str, str, list[ShardRef]]],
                  summaries: Iterable[tuple[ShardRef, Any]]) -> list[DatasetIndex]:
    """One index per (name, split, shards) in `datasets`, records in part order. Columns are sized from the
    receipts' document counts and filled one part summary (`exports/summary.py`) at a time: the job holds the
    index and the summary being copied, not every summary beside the index (the same numbers twice)."""
    indexes, slots = [], {}
    for name, split, refs in datasets:
        refs = sorted(refs, key=lambda r: r.part)
        full = [r for r in refs if r.prefix is not None]
        counts = np.array([r.receipt["stats"]["num_documents"] for r in full], dtype=np.int64)
        n = int(counts.sum())
        cols = {k: np.empty((n, 32) if k == "text_sha256" else n, dtype=np.uint8 if k == "text_sha256" else np.int64)
                for k in DatasetIndex.COLUMNS if k != "part"}
        cols["part"] = np.repeat(np.arange(len(full), dtype=np.int32), counts)
        idx = DatasetIndex(name=name, split=split, refs=full, empty_refs=[r for r in refs if r.prefix is None],
                           dtypes=[None] * len(full), **cols)  # type: ignore[list-item]
        starts = np.concatenate(([0], np.cumsum(counts))).tolist()
        slots.update({(name, r.part): (idx, i, starts[i], starts[i + 1]) for i, r in enumerate(full)})
        indexes.append(idx)
    for ref, summary in summaries:
        idx, i, start, end = slots.pop((ref.dataset, ref.part))
        if len(summary.records) != end - start:
            raise ExportError(f"{ref.dataset}/{ref.part}: part summary has {len(summary.records)} records, "
                              f"its receipt {end - start} documents")
        for k in DatasetIndex.COLUMNS:
            if k != "part":
                getattr(idx, k)[start:end] = summary.records[k]
        idx.dtypes[i] = np.dtype(summary.dtype)
    if slots:
        raise ExportError(f"no part summary for {', '.join(sorted('/'.join(k) for k in slots))}")
    return indexes


class RecordReader:
    """Reads texts, metas and tokens of chosen records with positioned reads (os.pread: no seek, no
    buffer, no memory map whose pages would stay resident); keeps at most `max_open` files open."""

    def __init__(self, index: DatasetIndex, max_open: int = 32):
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
        part, fd = -1, -1
        for pos in np.lexsort((idx.line_offset[ids], idx.part[ids])).tolist():
            rid = int(ids[pos])
            if idx.part[rid] != part:
                part = int(idx.part[rid])
                fd = self._fd("text", part)
            raw = os.pread(fd, int(idx.line_bytes[rid]), int(idx.line_offset[rid]))
            rec = load_record(raw, idx.refs[part].ingest_path, int(idx.line[rid]))
            out[pos] = (rec["text"], orjson.dumps(rec.get("meta", {}), option=orjson.OPT_SORT_KEYS))
        return out  # type: ignore[return-value]

    def tokens(self, ids: np.ndarray) -> np.ndarray:
        """The token ids (EOD included, exactly as in `.bin`) of `ids` back to back, as int32."""
        idx = self.index
        counts = idx.n_tokens[ids]
        ends = np.cumsum(counts)
        out = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int32)
        part, fd, item, dtype = -1, -1, 0, None
        for pos in np.lexsort((idx.token_start[ids], idx.part[ids])).tolist():
            rid = int(ids[pos])
            if idx.part[rid] != part:
                part = int(idx.part[rid])
                fd, dtype = self._fd("bin", part), idx.dtypes[part]
                item = dtype.itemsize
            n = int(counts[pos])
            raw = os.pread(fd, n * item, int(idx.token_start[rid]) * item)
            if len(raw) != n * item:
                raise ExportError(f"{idx.refs[part].prefix}.bin: shorter than its .idx says")
            out[int(ends[pos]) - n:int(ends[pos])] = np.frombuffer(raw, dtype=dtype)
        return out

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "RecordReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
