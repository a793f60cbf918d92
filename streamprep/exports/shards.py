"""What the exports read: completed tokenization shards and a compact per-record index over them.

The index holds, per kept record, only numbers (numpy arrays): which ingest part it is in, its line's
byte offset and length there, where its tokens start in the part's `.bin` and how many there are.
Texts are read back from the ingest parts by seeking; tokens come from the memory-mapped `.bin`.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import orjson

from streamprep import binidx

LINE_SCAN_CHUNK = 8 << 20  # bytes read at a time when indexing line offsets


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


def line_offsets(path: Path) -> np.ndarray:
    """Byte offset of every line start, plus the file size at the end (len = lines + 1).

    Read in fixed-size chunks, so memory stays bounded by the chunk and the result.
    A last line without a trailing newline still counts as a line.
    """
    starts = [np.zeros(1, dtype=np.int64)]
    pos = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(LINE_SCAN_CHUNK):
            nl = np.flatnonzero(np.frombuffer(chunk, dtype=np.uint8) == 0x0A).astype(np.int64)
            starts.append(nl + pos + 1)
            pos += len(chunk)
    offs = np.concatenate(starts)
    if offs[-1] != pos:  # no trailing newline: the last line ends at EOF
        offs = np.append(offs, pos)
    return offs


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
    dtypes: list[np.dtype]        # token dtype per part

    def __len__(self) -> int:
        return len(self.n_tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.n_tokens.sum())

    def est_bytes(self, bytes_per_token: int) -> np.ndarray:
        """The packing estimate per record: `bytes_per_token × tokens + bytes of its JSON line`."""
        return self.n_tokens * bytes_per_token + self.line_bytes


def _index_part(ref: ShardRef) -> dict[str, Any]:
    if ref.prefix is None:
        raise ExportError(f"{ref.dataset}/{ref.part}: no .bin/.idx prefix")
    ds = binidx.IndexedDataset.open(ref.prefix)
    offs = line_offsets(ref.ingest_path)
    n_lines = len(offs) - 1
    dropped = np.asarray(sorted(ref.receipt.get("stats", {}).get("dropped_empty", [])), dtype=np.int64)
    if len(dropped) and (dropped[0] < 0 or dropped[-1] >= n_lines):
        raise ExportError(f"{ref.dataset}/{ref.part}: receipt drops line {int(dropped[-1])} but "
                          f"{ref.ingest_path} has {n_lines} lines")
    lines = np.delete(np.arange(n_lines, dtype=np.int64), dropped)
    if len(lines) != len(ds):
        raise ExportError(f"{ref.dataset}/{ref.part}: {ref.ingest_path} has {n_lines} lines, "
                          f"{len(dropped)} dropped as empty, but {ref.prefix}.idx has {len(ds)} sequences")
    n_tokens = ds.lengths.astype(np.int64)
    expected = ref.receipt.get("stats", {}).get("num_tokens")
    if expected is not None and int(n_tokens.sum()) != int(expected):
        raise ExportError(f"{ref.dataset}/{ref.part}: .idx holds {int(n_tokens.sum())} tokens, receipt says {expected}")
    return {"line": lines, "line_offset": offs[lines], "line_bytes": offs[lines + 1] - offs[lines],
            "token_start": ds.pointers // ds.dtype.itemsize, "n_tokens": n_tokens, "dtype": ds.dtype}


def build_index(name: str, split: str, refs: Iterable[ShardRef]) -> DatasetIndex:
    """Index one dataset's shards (sorted by part name) from their `.idx` files and ingest line offsets."""
    refs = sorted(refs, key=lambda r: r.part)
    full = [r for r in refs if r.prefix is not None]
    empty = [r for r in refs if r.prefix is None]
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("part", "line", "line_offset", "line_bytes",
                                                          "token_start", "n_tokens")}
    dtypes = []
    for i, ref in enumerate(full):
        p = _index_part(ref)
        dtypes.append(p.pop("dtype"))
        cols["part"].append(np.full(len(p["line"]), i, dtype=np.int32))
        for k, v in p.items():
            cols[k].append(v.astype(np.int64))
    arrays = {k: (np.concatenate(v) if v else np.zeros(0, dtype=np.int32 if k == "part" else np.int64))
              for k, v in cols.items()}
    return DatasetIndex(name=name, split=split, refs=full, empty_refs=empty, dtypes=dtypes, **arrays)


class RecordReader:
    """Reads texts, metas and tokens of chosen records; keeps at most `max_open` files open."""

    def __init__(self, index: DatasetIndex, max_open: int = 32):
        self.index = index
        self.max_open = max_open
        self._files: OrderedDict[int, Any] = OrderedDict()
        self._tokens: OrderedDict[int, Any] = OrderedDict()

    def _cached(self, cache: OrderedDict, key: int, opener) -> Any:
        if key in cache:
            cache.move_to_end(key)
            return cache[key]
        while len(cache) >= self.max_open:
            _, old = cache.popitem(last=False)
            if hasattr(old, "close"):
                old.close()
        cache[key] = value = opener()
        return value

    def _file(self, part: int):
        return self._cached(self._files, part, lambda: open(self.index.refs[part].ingest_path, "rb"))

    def _bin(self, part: int) -> Any:
        # plain positioned reads, not np.memmap: mapped pages stay resident and made peak RSS grow
        # with the corpus (measured: 400 MB input)
        return self._cached(self._tokens, part, lambda: open(binidx.prefix_paths(self.index.refs[part].prefix)[0], "rb"))

    def records(self, ids: np.ndarray) -> list[tuple[str, bytes]]:
        """(text, canonical meta JSON) per id, in the order of `ids`; reads each part in offset order."""
        idx = self.index
        out: list[tuple[str, bytes] | None] = [None] * len(ids)
        order = np.lexsort((idx.line_offset[ids], idx.part[ids]))
        for pos in order:
            rid = int(ids[pos])
            fh = self._file(int(idx.part[rid]))
            fh.seek(int(idx.line_offset[rid]))
            raw = fh.read(int(idx.line_bytes[rid]))
            try:
                rec = orjson.loads(raw)
                text = rec["text"]
            except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
                ref = idx.refs[int(idx.part[rid])]
                raise ExportError(f"{ref.ingest_path}: line {int(idx.line[rid]) + 1} is not a record with "
                                  f"'text': {exc}") from None
            out[pos] = (text, orjson.dumps(rec.get("meta", {}), option=orjson.OPT_SORT_KEYS))
        return out  # type: ignore[return-value]

    def tokens(self, ids: np.ndarray) -> list[np.ndarray]:
        """Token ids (EOD included, exactly as in `.bin`) per id, in the order of `ids`."""
        idx = self.index
        out = []
        for rid in ids:
            part = int(idx.part[rid])
            dtype = np.dtype(idx.dtypes[part])
            fh = self._bin(part)
            fh.seek(int(idx.token_start[rid]) * dtype.itemsize)
            out.append(np.fromfile(fh, dtype=dtype, count=int(idx.n_tokens[rid])))
        return out

    def close(self) -> None:
        for cache in (self._files, self._tokens):
            for fh in cache.values():
                fh.close()
            cache.clear()

    def __enter__(self) -> "RecordReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
