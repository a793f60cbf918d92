"""The Parquet row order: a keyed sort made part by part and merged by streaming (rule in docs/exports.md).

Record `i` of a dataset (its position among the dataset's kept records in ingest order: parts by name, lines
in order, from 0) in length bucket `b` gets the sort key `order_keys(seed, b, i)`: output `i` of a SplitMix64
generator whose state starts at the first 8 bytes (little-endian) of a BLAKE2b of `seed` and `b`. SplitMix64's
outputs are a bijection of the counter, so keys never tie inside a (dataset, bucket), and the key of a record
depends only on (seed, bucket, its ordinal): each part computes its own records' keys as soon as the ordinal
of its first record is known (a prefix sum of the receipts' document counts).

`encode_run` makes a part's *run*: its records sorted by (bucket, key) with their rows and packing estimates,
in a file whose header names every input its bytes depend on. The worker that tokenized the part writes it
(`cache_run`, from `exports.prepare_part`; its task carries the part's first ordinal, the seed and the bucket
bounds); at the end `make_run` (on the export workers, one part at a time) reuses it when `load_run` finds it
current, else makes it from the part's summary. `merged` streams one (dataset, bucket)
in key order out of all its parts' runs with bounded buffers; `write_order` writes that stream to the
bucket's order file (part, row, estimate per record) while the plan cuts it into shards, so a shard is a range
of positions in it. The job process thus holds per part a few numbers and bounded buffers, never a
per-record array of a whole dataset. All these files are scratch (`parquet/.order/`), removed when an exports
step ends.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, NamedTuple, Sequence

import numpy as np
import orjson

from streamprep import atomic, binidx, logs
from streamprep.exports import columns, summary
from streamprep.exports.index import COLUMNS_KEY, DatasetIndex, ExportError, ShardRef
from streamprep.layout import COLUMNS_SUFFIX, RunLayout
from streamprep.textshard import LineScan

log = logs.get("exports")

FORMAT = "streamprep-order-run"
VERSION = 2                  # 2: the header names the inputs, so a run made by a tokenizing worker is reused
RUN_SUFFIX = ".run"          # parquet/.order/<dataset>/<part>.run (RunLayout.exports_scratch)
MERGE_BYTES = 4 << 20        # the merge's buffers over all parts of one dataset ...
MIN_CHUNK = 256              # ... but at least this many records a part (32 B each)
FAN_IN = 512                 # parts merged at once; more are merged in groups first (scratch files)
GAMMA = np.uint64(0x9E3779B97F4A7C15)
MIX1 = np.uint64(0xBF58476D1CE4E5B9)
MIX2 = np.uint64(0x94D049BB133111EB)
MAX_KEY = np.iinfo(np.uint64).max


def bucket_of(n_tokens: np.ndarray, bounds: Sequence[int]) -> np.ndarray:
    """Bucket index per record: b with bounds[b-1] < n <= bounds[b]; len(bounds) for the overflow."""
    return np.searchsorted(np.asarray(bounds, dtype=np.int64), np.asarray(n_tokens, dtype=np.int64), side="left")


def bucket_state(seed: int, bucket: int) -> np.uint64:
    """The SplitMix64 start state of one bucket: BLAKE2b-64 of "streamprep-parquet-order:<seed>:<bucket>"."""
    digest = hashlib.blake2b(f"streamprep-parquet-order:{seed}:{bucket}".encode(), digest_size=8).digest()
    return np.uint64(int.from_bytes(digest, "little"))


def _splitmix(state: np.ndarray, ordinals: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = state + (ordinals.astype(np.uint64) + np.uint64(1)) * GAMMA
        z = (z ^ (z >> np.uint64(30))) * MIX1
        z = (z ^ (z >> np.uint64(27))) * MIX2
    return z ^ (z >> np.uint64(31))


def order_keys(seed: int, buckets: np.ndarray, ordinals: np.ndarray) -> np.ndarray:
    """uint64 sort key per record from its bucket and its ordinal in the dataset (wrapping uint64 arithmetic)."""
    buckets = np.asarray(buckets, dtype=np.int64)
    states = np.array([bucket_state(seed, b) for b in range(int(buckets.max(initial=-1)) + 1)], dtype=np.uint64)
    return _splitmix(states[buckets], np.asarray(ordinals, dtype=np.int64))


# -- one part's run ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PartRun:
    """What the job keeps of one part: where its run is and how many records each bucket has there."""

    path: Path
    offsets: np.ndarray   # int64 (buckets + 1): bucket b's records are [offsets[b], offsets[b + 1]) of the run
    data_offset: int      # bytes before the columns: keys (uint64), rows (int64), estimates (int64), n each
    num_tokens: int
    dtype: str            # token dtype of the part's `.bin`
    summary: str          # "cached", "computed" (none was there) or "recomputed" (one was stale or damaged)
    reused: bool          # the run its tokenizing worker cached (else made by the exports)
    sha256: str           # its payload's SHA-256: what a run-ordered columns file names (`exports.columns`)

    @property
    def n(self) -> int:
        return int(self.offsets[-1])


def scratch_dir(run_dir: Path) -> Path:
    return RunLayout(run_dir).exports_scratch


def remove_scratch(run_dir: Path, keep_runs: bool = False) -> None:
    """Remove the exports' scratch; with `keep_runs`, all but the parts' runs and columns (self-checking, reused
    when current: `load_run`, `RecordReader`), e.g. the merge files of an interrupted attempt."""
    folder = scratch_dir(run_dir)
    if not keep_runs:
        shutil.rmtree(folder, ignore_errors=True)
        return
    for path in sorted(folder.glob("*/*")) if folder.is_dir() else []:  # <dataset>/<file or merge folder>
        if path.is_dir():
            shutil.rmtree(path)
        elif path.suffix not in (RUN_SUFFIX, COLUMNS_SUFFIX):
            path.unlink()


def run_path(run_dir: Path, dataset: str, part: str) -> Path:
    return scratch_dir(run_dir) / dataset / f"{part}{RUN_SUFFIX}"


def _identity(ref: ShardRef, first: int, seed: int, bounds: Sequence[int], bpt: int) -> dict[str, Any]:
    """What a run's bytes depend on: the shard (its receipt's hash, as the summary's key), the ordinal of its
    first record, the seed, the bucket bounds and the bytes-per-token estimate."""
    return {"format": FORMAT, "version": VERSION, "part": f"{ref.dataset}/{ref.part}",
            "key": summary.receipt_key(ref.receipt), "first": int(first), "seed": int(seed),
            "bounds": [int(b) for b in bounds], "bpt": int(bpt)}


class EncodedRun(NamedTuple):
    data: bytes           # the run file: header line, then the columns
    offsets: np.ndarray   # as PartRun.offsets
    order: np.ndarray     # the `.idx` row at each position of the run
    sha256: str           # the payload's SHA-256


def encode_run(ref: ShardRef, part: summary.PartSummary, first: int, seed: int, bounds: Sequence[int],
               bpt: int) -> EncodedRun:
    """A part's run: its records sorted by (bucket, key), with their rows and packing estimates. Pure: the same
    inputs give the same bytes."""
    recs = part.records
    n_tokens = recs["n_tokens"]
    est = n_tokens * bpt + recs["line_bytes"]
    buckets = bucket_of(n_tokens, bounds)
    keys = order_keys(seed, buckets, np.arange(first, first + len(recs), dtype=np.int64))
    order = np.lexsort((keys, buckets))
    offsets = np.zeros(len(bounds) + 2, dtype=np.int64)
    np.cumsum(np.bincount(buckets, minlength=len(bounds) + 1), out=offsets[1:])
    payload = b"".join(np.ascontiguousarray(c).tobytes() for c in (keys[order], order.astype(np.int64), est[order]))
    sha256 = hashlib.sha256(payload).hexdigest()
    header = {**_identity(ref, first, seed, bounds, bpt), "offsets": offsets.tolist(),
              "num_tokens": int(n_tokens.sum()), "dtype": part.dtype, "summary": summary.cached_identity(ref),
              "payload_sha256": sha256}
    return EncodedRun(orjson.dumps(header, option=orjson.OPT_SORT_KEYS) + b"\n" + payload, offsets, order, sha256)


def cache_run(ref: ShardRef, part: summary.PartSummary, first: int, seed: int, bounds: Sequence[int], bpt: int,
              run_dir: Path, scan: LineScan | None = None) -> None:
    """Write a part's run where the exports look for it (a tokenizing worker, right after the part's summary
    is cached). `first` is the ordinal of the part's first record when no earlier record of the dataset
    tokenized to nothing; the exports check it against the receipts and remake the run when it differs.
    When `scan` kept the part's texts and metas, its columns file follows, in the run's order."""
    run = encode_run(ref, part, first, seed, bounds, bpt)
    atomic.write_bytes(run_path(run_dir, ref.dataset, ref.part), run.data)
    if scan is not None and scan.texts is not None and scan.metas is not None and ref.columns is not None:
        tokens = np.fromfile(binidx.prefix_paths(ref.prefix)[0], dtype=part.dtype)
        columns.write(ref.columns, f"{ref.dataset}/{ref.part}", {k: ref.receipt.get(k) for k in COLUMNS_KEY},
                      run.sha256, run.order, scan.texts, scan.metas, tokens, part.records)


def load_run(path: Path, ref: ShardRef, first: int, expected: int, seed: int, bounds: Sequence[int],
             bpt: int) -> PartRun | None:
    """The run at `path` when it is intact and made for exactly these inputs, with its part's summary cache
    still the one it was made from (the Parquet writers read rows from it), else None."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if (split := summary.split_header(data)) is None:
        return None
    header, payload = split
    expect = _identity(ref, first, seed, bounds, bpt)
    if any(header.get(k) != v for k, v in expect.items()):
        return None
    offsets = np.asarray(header.get("offsets", []), dtype=np.int64)
    if len(offsets) != len(bounds) + 2 or int(offsets[-1]) != expected or len(payload) != 24 * expected \
            or header.get("payload_sha256") != hashlib.sha256(payload).hexdigest() \
            or header.get("summary") is None or header.get("summary") != summary.cached_identity(ref):
        return None
    return PartRun(path, offsets, len(data) - len(payload), int(header["num_tokens"]), str(header["dtype"]), "cached",
                   True, header["payload_sha256"])


def make_run(job: tuple[ShardRef, int, int, int, Sequence[int], int, Path]) -> PartRun:
    """One part's run (an export worker's task): the one its tokenizing worker cached when it is current, else
    made here from its summary (cached, or computed and cached) and written to `path`. `first`: the dataset
    ordinal of its first record; `expected`: its receipt's document count."""
    ref, first, expected, seed, bounds, bpt, path = job
    reused = load_run(path, ref, first, expected, seed, bounds, bpt)
    if reused is not None:
        return reused
    cached = summary.load_cached(ref)
    state = "cached"
    if cached is None:
        state = "recomputed" if summary.cache_path(ref).exists() else "computed"
        cached = summary.compute_and_cache(ref)
    if len(cached.records) != expected:
        raise summary.damaged_receipt(ref, f"its part summary has {len(cached.records)} records, its receipt "
                                           f"{expected} documents")
    run = encode_run(ref, cached, first, seed, bounds, bpt)
    atomic.write_bytes(path, run.data)
    return PartRun(path, run.offsets, run.data.index(b"\n") + 1, int(cached.records["n_tokens"].sum()), cached.dtype,
                   state, False, run.sha256)


# -- streaming over all parts ----------------------------------------------------------------------
COLUMNS = 4  # a sorted file's columns, n values of 8 bytes each: key, row, estimate, part (a part's run: no part)


@dataclass(frozen=True)
class _Sorted:
    """Records [start, end) of a file of columns sorted by key: one bucket of a part's run (`part` >= 0: every
    record is of that part), or a merged group of them (`_spill`, `part` = -1: a part column)."""

    path: Path
    n: int       # values per column
    base: int    # byte offset of the first column
    start: int
    end: int
    part: int

    @classmethod
    def of_run(cls, run: PartRun, bucket: int, part: int) -> "_Sorted":
        return cls(run.path, run.n, run.data_offset, int(run.offsets[bucket]), int(run.offsets[bucket + 1]), part)

    def read(self, start: int, stop: int) -> list[np.ndarray]:
        """[keys, rows, estimates, parts] of records [start, stop)."""
        size, out = 8 * (stop - start), []
        with open(self.path, "rb") as fh:  # opened per chunk: an abandoned merge leaves no descriptor open
            for column, dtype in enumerate((np.uint64, np.int64, np.int64) if self.part >= 0 else
                                           (np.uint64, np.int64, np.int64, np.int64)):
                raw = os.pread(fh.fileno(), size, self.base + 8 * (column * self.n + start))
                if len(raw) != size:
                    raise ExportError(f"{self.path}: order run shorter than its header says")
                out.append(np.frombuffer(raw, dtype=dtype))
        if self.part >= 0:
            out.append(np.full(stop - start, self.part, dtype=np.int64))
        return out


class _Cursor:
    """One sorted source, its buffer topped up to `chunk` records whenever it falls below half of that."""

    def __init__(self, src: _Sorted, chunk: int):
        self.src, self.chunk, self.pos = src, chunk, src.start
        self.cols = [np.empty(0, dtype=np.uint64)] + [np.empty(0, dtype=np.int64)] * (COLUMNS - 1)
        self.top_up()

    @property
    def more(self) -> bool:
        """Records left in the file beyond the buffer."""
        return self.pos < self.src.end

    def top_up(self) -> None:
        if not self.more or 2 * len(self.cols[0]) >= self.chunk:
            return
        stop = min(self.pos + self.chunk - len(self.cols[0]), self.src.end)
        self.cols = [np.concatenate((old, new)) for old, new in zip(self.cols, self.src.read(self.pos, stop))]
        self.pos = stop


def chunk_size(sources: int) -> int:
    """Records buffered per source while merging: MERGE_BYTES over all sources, at least MIN_CHUNK each."""
    return max(MIN_CHUNK, MERGE_BYTES // (8 * COLUMNS * max(sources, 1)))


def _merge(sources: list[_Sorted]) -> Iterator[list[np.ndarray]]:
    """[keys, rows, estimates, parts] in key order, block by block.

    Each round takes from every buffer the keys up to the smallest last key among the buffers that still
    have records on disk (nothing later can sort before it), sorts them and yields them, then tops the
    buffers up. The keys are uniform, so a round takes most of every buffer: the rounds are about the
    chunks a source has. Memory: `chunk_size` records a source, and one round's output."""
    chunk = chunk_size(len(sources))
    cursors = [c for c in (_Cursor(src, chunk) for src in sources) if len(c.cols[0])]
    while cursors:
        waiting = [c.cols[0][-1] for c in cursors if c.more]
        bound = min(waiting) if waiting else MAX_KEY
        taken: list[list[np.ndarray]] = [[] for _ in range(COLUMNS)]
        for c in cursors:
            j = int(c.cols[0].searchsorted(bound, side="right"))
            if j:
                for out, col in zip(taken, c.cols):
                    out.append(col[:j])
                c.cols = [col[j:] for col in c.cols]
                c.top_up()
        keys = np.concatenate(taken[0])
        order = np.argsort(keys, kind="stable")
        yield [keys[order]] + [np.concatenate(t)[order] for t in taken[1:]]
        cursors = [c for c in cursors if len(c.cols[0])]


def _spill(sources: list[_Sorted], path: Path) -> _Sorted:
    """Merge `sources` into one sorted file (the COLUMNS, one after the other) at `path`."""
    n = sum(src.end - src.start for src in sources)
    pos = 0
    with atomic.naming(path), open(path, "wb") as fh:
        for cols in _merge(sources):
            for column, values in enumerate(cols):
                os.pwrite(fh.fileno(), values.tobytes(), 8 * (column * n + pos))
            pos += len(cols[0])
    return _Sorted(path, n, 0, 0, n, -1)


def merged(runs: list[PartRun], bucket: int) -> Iterator[list[np.ndarray]]:
    """[keys, rows, estimates, parts (positions in `runs`)] of one bucket of one dataset in key order, block by
    block, from the parts' sorted runs.

    Up to FAN_IN parts are merged at once; more are first merged FAN_IN at a time into scratch files (and
    so on), so the buffers stay within max(MERGE_BYTES, FAN_IN × MIN_CHUNK × 32 B) whatever the parts and
    records."""
    sources = [src for src in (_Sorted.of_run(r, bucket, i) for i, r in enumerate(runs)) if src.end > src.start]
    level = 0
    while len(sources) > FAN_IN:
        folder = runs[0].path.parent / f".merge-b{bucket}-l{level}"
        folder.mkdir(exist_ok=True)
        sources = [_spill(sources[i:i + FAN_IN], folder / f"{i // FAN_IN}")
                   for i in range(0, len(sources), FAN_IN)]
        level += 1
    yield from _merge(sources)


@dataclass(frozen=True)
class BucketOrder:
    """One (dataset, bucket) in key order, as a file of three columns of `n` int64: part (position in the
    dataset's parts with documents), row in that part, estimate. A shard is a range of positions in it."""

    path: Path
    n: int

    def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(parts, rows, estimates) of positions [start, stop)."""
        size, out = 8 * (stop - start), []
        with open(self.path, "rb") as fh:
            for column in range(3):
                raw = os.pread(fh.fileno(), size, 8 * (column * self.n + start))
                if len(raw) != size:
                    raise ExportError(f"{self.path}: bucket order shorter than planned")
                out.append(np.frombuffer(raw, dtype=np.int64))
        return out[0], out[1], out[2]


def write_order(runs: list[PartRun], bucket: int) -> tuple[BucketOrder, Iterator[np.ndarray]]:
    """The (dataset, bucket)'s order file, and the estimates in its order, block by block: the file is written
    as the blocks are consumed (complete once they are all)."""
    n = sum(int(r.offsets[bucket + 1] - r.offsets[bucket]) for r in runs)
    order = BucketOrder(runs[0].path.parent / f"b{bucket}.order", n) if runs else BucketOrder(Path(), 0)

    def blocks() -> Iterator[np.ndarray]:
        if not n:
            return
        pos = 0
        with open(order.path, "wb") as fh:
            for _, rows, est, parts in merged(runs, bucket):
                with atomic.naming(order.path):
                    for column, values in enumerate((parts, rows, est)):
                        os.pwrite(fh.fileno(), values.tobytes(), 8 * (column * n + pos))
                pos += len(rows)
                yield est
    return order, blocks()


def runs_for(refs: list[ShardRef], starts: np.ndarray, seed: int, bounds: Sequence[int], bpt: int,
             run_dir: Path) -> list[tuple[Any, ...]]:
    """The `make_run` jobs of one dataset's parts (with documents, in part order)."""
    return [(r, int(starts[i]), int(starts[i + 1] - starts[i]), seed, list(bounds), bpt,
             run_path(run_dir, r.dataset, r.part)) for i, r in enumerate(refs)]


def build_indexes(datasets: list[tuple[str, str, list[ShardRef]]], workers: Any, seed: int,
                  bounds: Sequence[int], bytes_per_token: int, run_dir: Path) -> list[DatasetIndex]:
    """One index per (name, split, shards) in `datasets`. Part ordinals come from the receipts' document counts;
    each part's sorted run (the one its tokenizing worker cached when current, else made from its summary,
    cached or computed) is checked or made on `workers`, which hand back a few numbers per part: the job
    process reads no summary."""
    indexes, jobs = [], []
    for name, split, refs in datasets:
        refs = sorted(refs, key=lambda r: r.part)
        full = [r for r in refs if r.prefix is not None]
        starts = np.zeros(len(full) + 1, dtype=np.int64)
        np.cumsum([r.receipt["stats"]["num_documents"] for r in full], out=starts[1:])
        indexes.append(DatasetIndex(name=name, split=split, refs=full, empty_refs=[r for r in refs if r.prefix is None],
                                    starts=starts, part_tokens=np.zeros(len(full), dtype=np.int64),
                                    dtypes=[], runs=[]))
        jobs += runs_for(full, starts, seed, bounds, bytes_per_token, run_dir)
    owners = [idx for idx in indexes for _ in idx.refs]
    states: dict[str, int] = {}
    reused = 0
    for idx, job, run in zip(owners, jobs, workers.map(make_run, jobs)):
        reused += run.reused
        idx.part_tokens[len(idx.runs)] = run.num_tokens
        idx.dtypes.append(np.dtype(run.dtype))
        idx.runs.append(run)
        states[run.summary] = states.get(run.summary, 0) + 1
        if run.summary == "recomputed":
            log.warning("part summary unusable (stale or damaged); recomputed", file=str(summary.cache_path(job[0])))
    if reused < len(jobs):
        log.info("part runs made by the exports", parts=len(jobs) - reused, reused=reused)
    if states.get("computed") or states.get("recomputed"):
        log.info("part summaries computed", parts=states.get("computed", 0) + states.get("recomputed", 0),
                 reused=states.get("cached", 0))
    return indexes
