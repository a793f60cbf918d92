"""The text shard core: one ingest part of pretraining text → `.bin/.idx`, through the run's tokenizer backend.

Pure and process-local (no receipt: streamprep/tokenize.py writes it); `modes.Mode.tokenize` calls it for a
pretraining shard. Below tokenize.py and modes.py in the flow, so neither imports the other for it.
"""
from __future__ import annotations

import hashlib
import time
from array import array
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from itertools import chain
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np
import orjson

from streamprep import atomic, backends, binidx, logs, stats
from streamprep.layout import RunLayout

log = logs.get("tokenize")
# Records per `encode_batch_fast` call, at most ENCODE_BYTES of lines: thousands of short documents in one call
# cost ~10-20 % more CPU than the same text in calls of 1 024 (sixth round: `git show c594e76:docs/performance.md`).
ENCODE_BATCH = 1024
ENCODE_BYTES = 1 << 22


def canonical_meta(rec: dict[str, Any]) -> bytes:
    """A record's `meta` as the Parquet `meta` column holds it: compact JSON, keys sorted ({} when absent)."""
    return orjson.dumps(rec.get("meta", {}), option=orjson.OPT_SORT_KEYS)


COLUMNS_FORMAT, COLUMNS_VERSION = "streamprep-part-columns", 1
# Parts of at most this many bytes of ingest lines keep their texts and metas in memory while they are tokenized,
# for a columns file in their run's order (format 2, `exports.columns`); larger ones stream format 1 as they go.
# What format 2 saves is per record (~3.5 µs in the exports), what it costs is memory per byte (the kept texts and
# metas, and the `.bin`, until the file is written in chunks): parts of many short records (5 000 lines of ~3 KB).
RUN_COLUMNS_BYTES = 16 << 20


def columns_header(dataset: str, part: str, input_sha256: str, plan_hash: str) -> bytes:
    """The first line of a part's columns file: what its bytes depend on (the part's input and the shard's plan,
    which decides the records dropped as empty)."""
    return orjson.dumps({"format": COLUMNS_FORMAT, "version": COLUMNS_VERSION, "part": f"{dataset}/{part}",
                         "input_sha256": input_sha256, "plan_hash": plan_hash}, option=orjson.OPT_SORT_KEYS) + b"\n"


class LineScan:
    """What a part's summary (`exports.summary`) needs of its ingest lines: every line's byte length and, per
    record with tokens (in order), the SHA-256 of its UTF-8 text and the byte lengths of that text and of its
    canonical meta. `tokenize_part` takes it from the lines it parses anyway, so the summary of a part just
    tokenized reads and parses nothing again (~5 µs a record). With `columns` (an open file) it also writes each
    such record's text and canonical meta there, back to back: the Parquet writers cut their text and meta
    columns from it instead of parsing the lines again (`exports.index.RecordReader`). With `keep`, it keeps
    them, each back to back (`texts`, `metas`), for the run-ordered columns file written once the part's run is
    known."""

    def __init__(self, columns: BinaryIO | None = None, keep: bool = False) -> None:
        self.line_bytes, self.text_bytes, self.meta_bytes = array("q"), array("q"), array("q")
        self.digests = bytearray()
        self.columns_out = columns
        self.texts: bytearray | None = bytearray() if keep else None
        self.metas: bytearray | None = bytearray() if keep else None

    def add(self, lines: list[bytes], recs: list[dict[str, Any]], empty: list[bool]) -> None:
        """A batch of lines, their records, and which of them have no tokens (not in the `.idx`)."""
        self.line_bytes.extend(map(len, lines))
        if any(empty):
            recs = [rec for rec, none in zip(recs, empty) if not none]
        texts = [rec["text"].encode("utf-8") for rec in recs]
        metas = list(map(canonical_meta, recs))
        self.digests += b"".join([hashlib.sha256(text).digest() for text in texts])
        self.text_bytes.extend(map(len, texts))
        self.meta_bytes.extend(map(len, metas))
        if self.columns_out is not None:
            self.columns_out.write(b"".join(chain.from_iterable(zip(texts, metas))))
        if self.texts is not None and self.metas is not None:
            self.texts += b"".join(texts)
            self.metas += b"".join(metas)

    def columns(self) -> tuple[np.ndarray, bytes, np.ndarray, np.ndarray]:
        """(line byte lengths, the records' text digests back to back, text bytes, canonical meta bytes)."""
        return (np.frombuffer(self.line_bytes, dtype=np.int64), bytes(self.digests),
                np.frombuffer(self.text_bytes, dtype=np.int64), np.frombuffer(self.meta_bytes, dtype=np.int64))


@contextmanager
def columns_file(path: Path | None, header: bytes) -> Iterator[BinaryIO | None]:
    """An open columns file for `LineScan` (None for no `path`), committed atomically when the block ends without
    an error, else removed. A columns file is a cache of the exports: a part without one is parsed again."""
    if path is None:
        yield None
        return
    with atomic.writing(path, buffering=1 << 20) as fh:
        fh.write(header)
        yield fh


def _line_batches(fh: BinaryIO) -> Iterator[list[bytes]]:
    """The part's lines, at most ENCODE_BATCH records and about ENCODE_BYTES at a time."""
    while lines := fh.readlines(ENCODE_BYTES):
        for i in range(0, len(lines), ENCODE_BATCH):
            yield lines[i:i + ENCODE_BATCH]


Encoded = tuple[list[bytes], list[dict[str, Any]], np.ndarray, np.ndarray, dict[int, str]]


def _encoded_batches(fh: BinaryIO, encoder: backends.ShardEncoder, dataset: str, ahead: ThreadPoolExecutor
                     ) -> Iterator[Encoded]:
    """(lines, their records, flat ids, ids per record, {index: reason} of the records HF cannot encode, which get
    no ids) of the part, one backend call per line batch; the first batch may be checked against HF
    (backends.ShardEncoder). The next batch is parsed and encoded in `ahead`
    (both Rust encoders release the GIL) while the caller writes this one."""
    batches = _line_batches(fh)
    first = True

    def encode_next() -> Encoded | None:
        nonlocal first
        lines = next(batches, None)
        if lines is None:
            return None
        recs = [orjson.loads(line) for line in lines]
        flat, lengths, failed = encoder.encode_or_drop([rec["text"] for rec in recs], check=dataset if first else None)
        first = False
        return lines, recs, flat, lengths, failed

    pending = ahead.submit(encode_next)
    while (encoded := pending.result()) is not None:
        pending = ahead.submit(encode_next)
        yield encoded


def tokenize_part(task: Any, encoder: backends.ShardEncoder, scan: LineScan | None = None) -> dict[str, Any]:
    """Encode one ingest part into `.bin/.idx`: each batch's ids reach the writer as one flat buffer + lengths.
    Records that encode to nothing are dropped and listed by line number (`dropped_empty`), and so are the records
    HF `tokenizers` cannot encode (it panics), also listed in `unencodable` (only when there are any) and logged.
    `scan` takes the parsed lines."""
    dtype = np.dtype(task.dtype)
    top_id, limit = max(encoder.vocab_size - 1, task.eod_id or 0), int(np.iinfo(dtype).max)
    if top_id > limit:  # checked once for the vocabulary, and below per batch: ids can have gaps past len(tokenizer)
        raise ValueError(f"token id {top_id} does not fit {task.dtype}")
    writer = binidx.IndexedDatasetWriter(task.prefix, dtype)
    dropped: list[int] = []
    unencodable: list[int] = []
    n_tokens = 0
    hist: dict[str, int] = {}
    eod = 0 if task.eod_id is None else 1
    t0 = time.perf_counter()
    try:
        with open(task.input_path, "rb") as fh, ThreadPoolExecutor(1, thread_name_prefix="encode") as ahead:
            line_no = 0
            for lines, recs, flat, lengths, failed in _encoded_batches(fh, encoder, task.dataset, ahead):
                if limit < 1 << 31 and flat.size and (top := int(flat.max())) > limit:  # a .bin must never wrap an id
                    raise ValueError(f"token id {top} does not fit {task.dtype}")
                for i, reason in failed.items():
                    log.warning("a record the tokenizer cannot encode is dropped", dataset=task.dataset,
                                part=task.part, line=line_no + i, reason=reason)
                    unencodable.append(line_no + i)
                empty = lengths == 0
                if scan is not None:
                    scan.add(lines, recs, empty.tolist())
                if empty.any():
                    dropped.extend((line_no + np.flatnonzero(empty)).tolist())
                    lengths = lengths[~empty]
                writer.add_flat(flat, lengths, task.eod_id)
                n_tokens += int(lengths.sum()) + eod * len(lengths)
                stats.add_log2_counts(hist, lengths + eod)
                line_no += len(empty)
        num_docs = writer.num_documents
        if num_docs:
            writer.close()
        else:
            writer.abort()
    except BaseException:
        writer.abort()
        raise
    if encoder.fallback_reason is not None:
        _record_fallback(task, encoder)
    out = {"num_documents": num_docs, "num_tokens": n_tokens, "num_input_records": line_no,
           "dropped_empty": dropped, "tokens_hist": hist, "seconds": round(time.perf_counter() - t0, 4)}
    return {**out, "unencodable": unencodable} if unencodable else out


def _record_fallback(task: Any, encoder: backends.ShardEncoder) -> None:
    """A worker that fell back to HF on its identity check says so in the run's bookkeeping (status shows it)."""
    path = RunLayout(Path(task.run_dir)).tokenizer_backend_fallback
    if not path.exists():
        atomic.write_json(path, {"shard": f"{task.dataset}/{task.part}", "reason": encoder.fallback_reason,
                                 "name": "hf", "version": backends.installed_version("hf")})
