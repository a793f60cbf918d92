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
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from streamprep import binidx
from streamprep.exports import columns
from streamprep.exports.columns import take
from streamprep.textshard import canonical_meta, columns_header

COLUMNS_KEY = ("input_sha256", "plan_hash")  # the receipt's fields a part's columns file is made for
PARSE, IDX_ORDER, RUN_ORDER = 0, 1, 2  # where a part's texts and metas come from (`RecordReader._columns_source`)


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
        """`refs` without their receipts, but for what a part's columns file must name (with the SHA-256 of the run
        the exports use, under "run"): what a shard writer is sent (it reads only files)."""
        return [replace(r, receipt={**{k: r.receipt.get(k) for k in COLUMNS_KEY}, "run": run.sha256})
                for r, run in zip(self.refs, self.runs)]

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
    row: np.ndarray               # int64: its row in that part's summary (`.idx` order)
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

    def itemsizes(self, ids: np.ndarray) -> np.ndarray:
        """Bytes a token of each of `ids` takes in its part's `.bin` (the part's dtype), int64."""
        return np.array([dtype.itemsize for dtype in self.dtypes], dtype=np.int64)[self.part[ids]]


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
        self._kind: np.ndarray | None = None              # per part: PARSE, IDX_ORDER or RUN_ORDER
        self._sources: list[Any] = []                      # per part: what `_columns_source` found
        self._bases = np.zeros(0, dtype=np.int64)          # per part: its format-1 file's payload start (else 0)
        self._places: tuple[bytes, np.ndarray] | None = None  # the last `_run_offsets`

    def _file(self, kind: str, part: int) -> str:
        """"text" (the ingest part), "columns" or "bin"; "tokens" is the columns file of a part with a format-2 one,
        else the `.bin`."""
        if kind == "tokens":
            return "columns" if self._kinds()[part] == RUN_ORDER else "bin"
        return kind

    def _path(self, kind: str, part: int) -> Path:
        ref, kind = self.index.refs[part], self._file(kind, part)
        if kind == "text":
            return ref.ingest_path
        return ref.columns if kind == "columns" else binidx.prefix_paths(ref.prefix)[0]

    def _fd(self, kind: str, part: int) -> int:
        key = (self._file(kind, part), part)
        if key in self._fds:
            self._fds.move_to_end(key)
            return self._fds[key]
        while len(self._fds) >= self.max_open:
            os.close(self._fds.popitem(last=False)[1])
        self._fds[key] = fd = os.open(self._path(kind, part), os.O_RDONLY)
        return fd

    def _columns_source(self, part: int) -> tuple[int, int | columns.Sections | None]:
        """How the part's texts and metas are read: (RUN_ORDER, where its format-2 file's sections start) when its
        tokenizing left one made for this shard and the exports' run, (IDX_ORDER, where its format-1 file's payload
        starts) for one of those (its header names the receipt's input and plan), else (PARSE, None)."""
        ref = self.index.refs[part]
        keys = {k: ref.receipt.get(k) for k in COLUMNS_KEY}
        if ref.columns is None or None in keys.values():
            return PARSE, None
        try:
            head = os.pread(self._fd("columns", part), columns.HEADER_READ, 0)
        except FileNotFoundError:
            return PARSE, None
        v1 = columns_header(ref.dataset, ref.part, *keys.values())
        if head.startswith(v1):
            return IDX_ORDER, len(v1)
        found = columns.sections(head, f"{ref.dataset}/{ref.part}", keys, ref.receipt.get("run"))
        return (PARSE, None) if found is None else (RUN_ORDER, found)

    def _kinds(self) -> np.ndarray:
        """PARSE, IDX_ORDER or RUN_ORDER per part (`_columns_source`, asked once)."""
        if self._kind is None:
            found = [self._columns_source(p) for p in range(len(self.index.refs))]
            self._kind = np.array([kind for kind, _ in found], dtype=np.int8)
            self._sources = [source for _, source in found]
            self._bases = np.array([s if k == IDX_ORDER else 0 for k, s in found], dtype=np.int64)
        return self._kind

    def _read(self, kind: str, rows: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> bytes:
        """`sizes[i]` bytes at `offsets[i]` of the `kind` file of record `rows[i]`'s part, for every i, back to back
        (rows grouped by part): one positioned read per run of records back to back in a file (one per record
        where none are), and no Python statement per record."""
        if not len(rows):
            return b""
        parts = self.index.part[rows]
        new = np.ones(len(rows), dtype=bool)  # where a record does not follow the one before in the same file
        new[1:] = (parts[1:] != parts[:-1]) | (offsets[1:] != offsets[:-1] + sizes[:-1])
        starts = np.flatnonzero(new)
        spans = np.add.reduceat(sizes, starts)
        blocks = [os.pread(self._fd(kind, part), span, at)
                  for part, span, at in zip(parts[starts].tolist(), spans.tolist(), offsets[starts].tolist())]
        if sum(map(len, blocks)) != int(spans.sum()):
            short = next(i for i, block in enumerate(blocks) if len(block) != spans[i])
            raise ExportError(f"{self._path(kind, int(parts[starts[short]]))}: shorter than its part summary says")
        return b"".join(blocks)

    def columns(self, ids: np.ndarray) -> tuple[bytes, bytes]:
        """The UTF-8 texts and the canonical metas (`canonical_meta`) of `ids`, each back to back in the order of
        `ids` (their lengths: the index's `text_bytes` and `meta_bytes`): each part's from its columns file when it
        has a current one (`_columns_source`), else parsed from its ingest lines."""
        kinds = self._kinds()[self.index.part[ids]]
        read = (self._parse, self._cut, self._cut_run)
        if (kinds == kinds[0]).all():
            return read[int(kinds[0])](ids)
        order = np.argsort(kinds, kind="stable")  # each kind's records read together, then put in the order of `ids`
        bounds = np.flatnonzero(np.diff(kinds[order])) + 1
        got = [read[int(kinds[sel[0]])](ids[sel]) for sel in np.split(order, bounds)]
        inverse, rows = inverse_permutation(order), ids[order]
        return (take(b"".join(text for text, _ in got), self.index.text_bytes[rows], inverse).to_pybytes(),
                take(b"".join(meta for _, meta in got), self.index.meta_bytes[rows], inverse).to_pybytes())

    def _cut(self, ids: np.ndarray) -> tuple[bytes, bytes]:
        """`columns` from format-1 columns files: one positioned read per record (its text, then its meta), in
        offset order, then each cut in two at its text's length."""
        idx = self.index
        order = np.lexsort((idx.column_offset[ids], idx.part[ids]))
        rows = ids[order]
        offsets = idx.column_offset[rows] + self._bases[idx.part[rows]]  # `columns` asked `_kinds` first
        sizes = idx.text_bytes[rows] + idx.meta_bytes[rows]
        data = self._read("columns", rows, offsets, sizes)
        halves = np.stack([idx.text_bytes[rows], idx.meta_bytes[rows]], axis=1).ravel()  # each record cut in two
        inverse = inverse_permutation(order) * 2
        return take(data, halves, inverse).to_pybytes(), take(data, halves, inverse + 1).to_pybytes()

    def _run_offsets(self, ids: np.ndarray) -> np.ndarray:
        """`columns.record_offsets` of `ids` (of parts with format-2 files), remembered for the row group's `tokens`."""
        key = ids.tobytes()
        if self._places is None or self._places[0] != key:
            self._places = (key, columns.record_offsets(self.index, ids, self._sources,
                                                        lambda *where: self._read("columns", *where)))
        return self._places[1]

    def _gather(self, ids: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> bytes:
        """`sizes[i]` bytes at `offsets[i]` of the columns file of `ids[i]`'s part, in the order of `ids`, back to
        back; read in file order."""
        order = np.lexsort((offsets, self.index.part[ids]))
        return take(self._read("columns", ids[order], offsets[order], sizes[order]), sizes[order],
                    inverse_permutation(order)).to_pybytes()

    def _cut_run(self, ids: np.ndarray) -> tuple[bytes, bytes]:
        """`columns` from format-2 files: per part, the row group's texts, then its metas, each one range."""
        at = self._run_offsets(ids)
        return (self._gather(ids, at[:, 0], self.index.text_bytes[ids]),
                self._gather(ids, at[:, 1], self.index.meta_bytes[ids]))

    def _parse(self, ids: np.ndarray) -> tuple[bytes, bytes]:
        """`columns` from the ingest lines, read part by part in offset order and parsed by one orjson call, so
        the Python work per record is only its read."""
        idx = self.index
        order = np.lexsort((idx.line_offset[ids], idx.part[ids]))
        rows = ids[order]
        data = self._read("text", rows, idx.line_offset[rows], idx.line_bytes[rows])
        ends = np.cumsum(idx.line_bytes[rows])
        lines = list(map(data.__getitem__, map(slice, (ends - idx.line_bytes[rows]).tolist(), ends.tolist())))
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
        file order (a part's format-2 columns file, else its `.bin`), then put in the order of `ids` by one gather."""
        idx = self.index
        counts = idx.n_tokens[ids]
        itemsize = idx.itemsizes(ids)
        offsets = idx.token_start[ids] * itemsize
        run = self._kinds()[idx.part[ids]] == RUN_ORDER
        if run.any():
            offsets[run] = self._run_offsets(ids[run])[:, 2]
        order = np.lexsort((offsets, idx.part[ids]))
        rows = ids[order]
        nbytes = counts[order] * itemsize[order]
        data = self._read("tokens", rows, offsets[order], nbytes)
        parts = idx.part[rows]
        dtypes = {idx.dtypes[part] for part in np.unique(parts).tolist()}
        if len(dtypes) == 1:
            read = np.frombuffer(data, dtype=dtypes.pop())
        else:  # each part's tokens in its own dtype
            ends = np.cumsum(nbytes).tolist()
            first = np.flatnonzero(np.concatenate([[True], parts[1:] != parts[:-1]])).tolist()
            read = np.concatenate([np.frombuffer(data[ends[lo] - nbytes[lo]:ends[hi - 1]], dtype=idx.dtypes[parts[lo]])
                                   for lo, hi in zip(first, first[1:] + [len(rows)])])
        read = read.astype(np.int32, copy=False)
        return np.frombuffer(take(read, counts[order] * 4, inverse_permutation(order)), dtype=np.int32)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "RecordReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
