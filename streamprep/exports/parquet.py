"""Parquet shards bucketed by token count, in a keyed random order, packed by size (rules in docs/exports.md).

Planned (numbers only) and written at once: a shard goes to a writer as soon as it is cut. For each dataset, in
config order:

1. bucket every record by its token count (EOD included): bucket b holds
   `bounds[b-1] < n_tokens <= bounds[b]`, bucket 0 starts at 1, bucket `len(bounds)` is the overflow;
2. within bucket b the records are in the order of their keys `order.order_keys(seed, b, ordinal)` (ordinal:
   the record's position in the dataset, ingest order); each part sorts its own records (its run), and the
   plan merges the parts' runs by streaming, so no process holds every record of a dataset;
3. the ordered records are cut greedily into shards of estimated size <= `shard_size_bytes`
   (estimate per record: 4 bytes/token + the bytes of its JSON line in the ingest part); a record
   larger than the limit gets a shard of its own; a last shard estimated below 25% of the limit is
   merged into the one before it (which may then reach 1.25 × the limit) unless that one is a lone
   oversized record. The merged order of a (dataset, bucket) is written to a scratch file as it streams, and a
   shard is a range of positions in it: the plan holds no record ids.

Then `num_shards_multiple_of: H`: within each split, while the shard count is not a multiple of H,
the shard with the largest estimate (first in order on ties, at least 2 records) is cut in two at
its estimated-byte midpoint. Fewer records in a split than the next multiple needs → `ShardCountError`.

Names: `parquet/shard_b{bucket:02d}_s{index:05d}.parquet`; `index` counts the shards of one bucket
across all datasets in config order (so names are unique, and a dataset's shards in a bucket are
consecutive). Rows keep the key order.
"""
from __future__ import annotations

import contextlib

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from streamprep import atomic
from streamprep.config import INT32_MAX, ConfigError, OutputConfig, ParquetConfig
from streamprep.exports.context import WriterContext
from streamprep.exports.index import DatasetIndex, ExportError, RecordReader, ShardRecords, ShardRows
from streamprep.exports.order import BucketOrder, write_order
from streamprep.executor import Executor
from streamprep.exports.summary import shard_records
from streamprep.layout import RunLayout

ROW_GROUP_BYTES = 8 << 20  # a row group also ends at ~8 MiB (estimated), so memory is bounded in bytes too
BYTES_PER_TOKEN = 4
TAIL_FRACTION = 0.25
SHARD_FILE = re.compile(r"^shard_b\d{2,}_s\d{5,}\.(parquet|tsv)\Z")
TSV_HEADER = "row\tn_tokens\ttoken_sum\ttext_sha256\n"
SCHEMA = pa.schema([("text", pa.string()), ("tokens", pa.list_(pa.int32())),
                    ("n_tokens", pa.int32()), ("meta", pa.string())])
# Min/max statistics only for the numeric columns' leaves (filters on n_tokens keep theirs): a string column's are
# whole documents, copied into the footer and every page header, which made shards larger than their estimate.
STATISTICS_COLUMNS = ["tokens.list.element", "n_tokens"]


COMPRESSIONS = ("snappy", "gzip", "brotli", "zstd", "lz4", "lz4_raw", "none")
MAX_LENGTH_BUCKETS = 99  # bounds: their buckets, the overflow's too, are named in formats.md's 2 digits (b00-b99),
# so that the manifest's shards, "sorted by shard_id", are in bucket order (100 bounds named one b100, between b10 and b11)


def check_options(cfg: dict[str, Any]) -> None:
    """Config validation (registry.CHECKS) of `output.parquet`: what the writer would refuse only after
    tokenization. The codec name is lower-cased in place."""
    pq_cfg = cfg["output"]["parquet"]
    buckets = pq_cfg["length_buckets"]
    if (not buckets or len(buckets) > MAX_LENGTH_BUCKETS
            or any(not isinstance(b, int) or isinstance(b, bool) or not 0 < b <= INT32_MAX for b in buckets)
            or buckets != sorted(set(buckets))):  # after the type test: a nested list is unhashable
        raise ConfigError(f"config: 'output.parquet.length_buckets' must be 1-{MAX_LENGTH_BUCKETS} increasing "
                          f"integers in [1, {INT32_MAX}], got {buckets!r:.80}")
    pq_cfg["compression"] = codec = pq_cfg["compression"].lower()
    if codec not in COMPRESSIONS or not (codec == "none" or pa.Codec.is_available(codec)):
        raise ConfigError(f"config: 'output.parquet.compression' must be one of {', '.join(COMPRESSIONS)} "
                          f"(available in this pyarrow), got {codec!r:.40}")


class ShardCountError(ExportError, ConfigError):
    """`output.num_shards_multiple_of` cannot be met without empty shards: a run that cannot go on as configured,
    whatever re-running it (exit 2); lowering the key resumes it."""


def bucket_table(bounds: Sequence[int]) -> list[dict[str, Any]]:
    """[{id, min_tokens, max_tokens}] including the overflow bucket (max_tokens null)."""
    out, lo = [], 1
    for i, hi in enumerate(bounds):
        out.append({"id": i, "min_tokens": lo, "max_tokens": int(hi)})
        lo = int(hi) + 1
    out.append({"id": len(bounds), "min_tokens": lo, "max_tokens": None})
    return out


Cut = tuple[int, int, int]  # [start, end) positions in the stream, estimated bytes of one shard


def iter_cuts(blocks: Iterable[np.ndarray], limit: int, tail_fraction: float = TAIL_FRACTION) -> Iterator[Cut]:
    """Greedy cuts of records streamed in order as blocks of estimated sizes into shards of total <= limit: a
    shard is (start, end, estimate) in stream positions. Holds one block at a time, and gives each cut once the
    next is made (only the last two may still join), so a shard can be written while the records after it are
    still being merged.

    A record bigger than `limit` alone makes a shard. A last shard below `tail_fraction × limit` joins the
    shard before it, unless that one is a lone record bigger than `limit`.
    """
    held: Cut | None = None  # the last cut made, given out once another follows it
    first = total = offset = 0  # the open shard's first position and estimate; the block's first position
    for est in blocks:
        cs = np.cumsum(np.asarray(est, dtype=np.int64))
        pos, size = 0, len(cs)
        while pos < size:
            base = int(cs[pos - 1]) if pos else 0
            empty = first == offset + pos
            j = max(int(np.searchsorted(cs, base + limit - total, side="right")), pos + empty)
            total += int(cs[j - 1]) - base if j > pos else 0
            if j >= size:
                break
            if held is not None:
                yield held
            held = (first, offset + j, total)  # record j does not fit
            first, total, pos = offset + j, 0, j
        offset += size
    tail = (first, offset, total) if offset > first else None
    if held is not None and tail is not None and tail[2] < tail_fraction * limit and held[2] <= limit:
        yield held[0], tail[1], held[2] + tail[2]  # never grow a lone oversized record's shard
        return
    yield from (cut for cut in (held, tail) if cut is not None)


def pack(est: np.ndarray, limit: int, tail_fraction: float = TAIL_FRACTION) -> list[tuple[int, int]]:
    """`iter_cuts` over one in-memory list of sizes: [start, end) cuts."""
    return [(start, end) for start, end, _ in iter_cuts([est], limit, tail_fraction)]


@dataclass
class ShardPlan:
    """One Parquet shard to write: positions [start, stop) of its (dataset, bucket)'s order."""

    dataset: str
    split: str
    bucket: int
    order: BucketOrder
    start: int
    stop: int
    est_bytes: int
    index: int = -1
    entry: dict[str, Any] = field(default_factory=dict)

    @property
    def num_records(self) -> int:
        return self.stop - self.start

    @property
    def shard_id(self) -> str:
        return f"b{self.bucket:02d}_s{self.index:05d}"

    @property
    def rel_path(self) -> str:
        return f"parquet/shard_{self.shard_id}.parquet"


def _split_in_two(plan: ShardPlan) -> tuple[ShardPlan, ShardPlan]:
    cs = np.cumsum(plan.order.read(plan.start, plan.stop)[2])
    k = int(np.searchsorted(cs, cs[-1] / 2, side="left")) + 1
    k = min(max(k, 1), plan.num_records - 1)
    a = ShardPlan(plan.dataset, plan.split, plan.bucket, plan.order, plan.start, plan.start + k, int(cs[k - 1]))
    b = ShardPlan(plan.dataset, plan.split, plan.bucket, plan.order, plan.start + k, plan.stop, int(cs[-1] - cs[k - 1]))
    return a, b


def _make_multiple(plans: list[ShardPlan], split: str, multiple: int) -> list[ShardPlan]:
    """Split shards of one split (deterministically) until their count is a multiple of `multiple`."""
    count = len(plans)
    if multiple <= 1 or count % multiple == 0:
        return plans
    target = -(-count // multiple) * multiple
    records = sum(p.num_records for p in plans)
    if records < target:
        raise ShardCountError(
            f"'output.num_shards_multiple_of' = {multiple}: split {split!r} has {records} record(s) in "
            f"{count} Parquet shard(s); {target} non-empty shards would be needed (one source and one length "
            f"bucket per shard). Lower it (1 disables it) or add data.")
    plans = list(plans)
    while len(plans) < target:
        best = max((i for i, p in enumerate(plans) if p.num_records >= 2),
                   key=lambda i: (plans[i].est_bytes, -i))
        plans[best:best + 1] = _split_in_two(plans[best])
    return plans


def plan_shards(indexes: list[DatasetIndex], output: OutputConfig) -> list[ShardPlan]:
    """All Parquet shards, numbered, in write order (bucket-major numbering; see the module doc). The keys
    (seed included) are in the indexes' runs; each (dataset, bucket)'s order is written beside them."""
    return list(iter_shards(indexes, output))


def iter_shards(indexes: list[DatasetIndex], output: OutputConfig) -> Iterator[ShardPlan]:
    """`plan_shards`, one shard at a time: without `num_shards_multiple_of` each as soon as it is cut, so its
    writer starts while the driver merges the records after it (the merge is ~0.4 µs a record on the driver,
    the writing ~5 µs a record on the workers); with it, once every split's count is known."""
    if output.num_shards_multiple_of <= 1:
        yield from _numbered(_cut(indexes, output))  # already in dataset, bucket, position order
        return
    by_split: dict[str, list[ShardPlan]] = {}
    for p in _cut(indexes, output):
        by_split.setdefault(p.split, []).append(p)
    adjusted = [p for split in sorted(by_split)
                for p in _make_multiple(by_split[split], split, output.num_shards_multiple_of)]
    # Order: dataset (config order), then bucket, then position; halves of a split shard stay adjacent.
    order = {name: i for i, name in enumerate(idx.name for idx in indexes)}
    adjusted.sort(key=lambda p: (order[p.dataset], p.bucket))  # stable: keeps positions within a group
    yield from _numbered(adjusted)


def _cut(indexes: list[DatasetIndex], output: OutputConfig) -> Iterator[ShardPlan]:
    """Every dataset's shards (config order), bucket by bucket, in the order of their (dataset, bucket)'s merge."""
    for idx in indexes:
        for b in range(len(output.parquet.length_buckets) + 1):
            order, blocks = write_order(idx.runs, b)
            for start, stop, est in iter_cuts(blocks, output.parquet.shard_size_bytes):
                yield ShardPlan(idx.name, idx.split, b, order, start, stop, est)


def _numbered(plans: Iterable[ShardPlan]) -> Iterator[ShardPlan]:
    """`plans` (in write order) with their index: the count of the shards before them in their bucket."""
    counters: dict[int, int] = {}
    for p in plans:
        p.index = counters.get(p.bucket, 0)
        counters[p.bucket] = p.index + 1
        yield p


def _row_groups(sizes: np.ndarray, max_rows: int) -> list[tuple[int, int]]:
    """Row-group bounds: at most `max_rows` records and about ROW_GROUP_BYTES of estimated bytes."""
    bounds, start, acc = [], 0, 0
    for i, size in enumerate(sizes.tolist()):
        if i > start and (i - start >= max_rows or acc + size > ROW_GROUP_BYTES):
            bounds.append((start, i))
            start, acc = i, 0
        acc += size
    if start < len(sizes):
        bounds.append((start, len(sizes)))
    return bounds


def _ints(values: np.ndarray, dtype: type = np.int32) -> pa.Array:
    """An Arrow integer array of `dtype` over `values` (no copy; unlike pa.array(ndarray), does not import
    pandas, ~0.5 s)."""
    data = np.ascontiguousarray(values, dtype)
    return pa.Array.from_buffers(pa.from_numpy_dtype(data.dtype), len(data), [None, pa.py_buffer(data)])


def _utf8(data: bytes, lengths: np.ndarray) -> pa.Array:
    """A string Arrow array of UTF-8 values given back to back, with their byte lengths, built from two buffers:
    pa.array(list) imports pandas in every worker process (~0.3 s each, at the very end of the job)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if offsets[-1] > np.iinfo(np.int32).max:
        raise ExportError(f"a Parquet row group of {int(offsets[-1])} text bytes does not fit a string column")
    if offsets[-1] != len(data):
        raise ExportError(f"{len(data)} bytes of strings, but their lengths add up to {int(offsets[-1])}")
    return pa.StringArray.from_buffers(len(lengths), pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data))


def _fixed_width(data: Any, count: int, width: int) -> pa.Array:
    """A string Arrow array of `count` values of `width` bytes each, back to back in `data`."""
    offsets = np.arange(0, count * width + 1, width, dtype=np.int32)
    return pa.StringArray.from_buffers(count, pa.py_buffer(offsets), pa.py_buffer(data))


def _tsv_rows(index: ShardRecords, start: int, end: int) -> bytes:
    """TSV lines of rows start..end of a shard (`index` holds its rows), from the per-part summaries. Formatted by
    Arrow kernels (integers to decimal text, one join per line), not by Python per row; the separators are arrays
    because a scalar argument imports pandas."""
    import pyarrow.compute as pc  # here, not at the top, as `pq` in `_write_one`: the job's driver imports this module

    count = end - start
    digests = np.empty((count, 65), dtype=np.uint8)  # hex digest, then the line's end
    digests[:, :64] = np.frombuffer(index.text_sha256[start:end].tobytes().hex().encode(), np.uint8).reshape(count, 64)
    digests[:, 64] = ord("\n")
    numbers = [pc.cast(_ints(v, np.int64), pa.string())
               for v in (np.arange(start, end), index.n_tokens[start:end], index.token_sum[start:end])]
    lines = pc.binary_join_element_wise(*numbers, _fixed_width(digests, count, 65),
                                        _fixed_width(b"\t" * count, count, 1))
    offsets = np.frombuffer(lines.buffers()[1], dtype=np.int32, count=count + 1, offset=4 * lines.offset)
    return lines.buffers()[2].slice(int(offsets[0]), int(offsets[-1] - offsets[0])).to_pybytes()


def _write_one(job: tuple[Path, ShardPlan, ShardRows, ParquetConfig]) -> dict[str, Any]:
    """Write one planned shard + TSV; `rows` are exactly its records, in row order."""
    import pyarrow.parquet as pq  # here, as `pc` in `_tsv_rows`: the job's driver imports this module

    run_dir, plan, rows, opts = job
    records = shard_records(rows)
    final = run_dir / plan.rel_path
    tsv_final = final.with_suffix(".tsv")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp, tsv_tmp = atomic.tmp_path(final), atomic.tmp_path(tsv_final)
    compression = None if opts.compression == "none" else opts.compression
    with atomic.naming(final), open(tmp, "wb", opener=atomic.nofollow):
        pass  # made here: pyarrow's error opening it (a read-only folder) named only the temporary file, in its text
    writer = None
    try:  # a full disk's error names the shard or its TSV (also the TSV's closing flush's); no temporary file stays
        with atomic.naming(final):
            writer = pq.ParquetWriter(str(tmp), SCHEMA, compression=compression,
                                      write_statistics=STATISTICS_COLUMNS)
        with atomic.naming(tsv_final), open(tsv_tmp, "wb") as tsv, RecordReader(records) as reader:
            tsv.write(TSV_HEADER.encode())
            for start, end in _row_groups(records.est_bytes(BYTES_PER_TOKEN), opts.row_group_size):
                ids = np.arange(start, end)
                texts, metas = reader.columns(ids)
                lengths = records.n_tokens[start:end].astype(np.int32)
                offsets = np.zeros(len(ids) + 1, dtype=np.int32)
                np.cumsum(lengths, out=offsets[1:])
                table = pa.Table.from_arrays([
                    _utf8(texts, records.text_bytes[start:end]),
                    pa.ListArray.from_arrays(_ints(offsets), _ints(reader.tokens(ids))),
                    _ints(lengths),
                    _utf8(metas, records.meta_bytes[start:end]),
                ], schema=SCHEMA)
                with atomic.naming(final):
                    writer.write_table(table, row_group_size=opts.row_group_size)
                with atomic.naming(tsv_final):
                    tsv.write(_tsv_rows(records, start, end))
            with atomic.naming(tsv_final):
                tsv.flush()
        with atomic.naming(final):
            writer.close()
        writer = None
        atomic.commit(tmp, final)
        atomic.commit(tsv_tmp, tsv_final)
    except BaseException:
        if writer is not None:
            with contextlib.suppress(Exception):  # its close fails on a full disk too: the first error is the one
                writer.close()
        tmp.unlink(missing_ok=True)
        tsv_tmp.unlink(missing_ok=True)
        raise
    return {
        "kind": "parquet", "shard_id": plan.shard_id, "path": plan.rel_path, "bucket": plan.bucket,
        "source": plan.dataset, "split": plan.split, "num_records": plan.num_records,
        "num_tokens": records.num_tokens, "est_bytes": plan.est_bytes,
        "file_sha256": atomic.sha256_file(final), "size_bytes": final.stat().st_size,
        "tsv": {"path": str(tsv_final.relative_to(run_dir)), "file_sha256": atomic.sha256_file(tsv_final),
                "size_bytes": tsv_final.stat().st_size},
    }


def write_shards(run_dir: Path, indexes: list[DatasetIndex], plans: Iterable[ShardPlan], opts: ParquetConfig,
                 seed: int, workers: Executor) -> list[dict[str, Any]]:
    """Write every planned shard (+ TSV) atomically, on `workers`, each as `plans` gives it; manifest entries in
    plan order.

    Each shard is written from its own rows, read back from the part summaries by the worker, so the bytes
    do not depend on the pool and the job process holds no more than the plan.
    """
    by_name = {idx.name: idx for idx in indexes}
    given: list[ShardPlan] = []

    def jobs() -> Iterator[tuple[Path, ShardPlan, ShardRows, ParquetConfig]]:
        for plan in plans:
            given.append(plan)
            part, row, _ = plan.order.read(plan.start, plan.stop)
            yield run_dir, plan, by_name[plan.dataset].rows_of(part, row), opts
    for i, entry in enumerate(workers.map(_write_one, jobs())):  # results in job order: `given[i]` is there
        given[i].entry = {**entry, "seed": seed}
    return [p.entry for p in given]


def export(ctx: WriterContext) -> list[str]:
    """The "parquet" writer: the shards + TSV on the export workers, each handed out as the plan cuts it. They are
    the manifest's Parquet shards (`ctx.parquet`), not files of its `files` list, so it returns none."""
    plans = iter_shards(ctx.indexes, ctx.output)
    ctx.parquet.extend(write_shards(ctx.run_dir, ctx.indexes, plans, ctx.output.parquet, ctx.seed, ctx.workers))
    return []


def remove_stale(run_dir: Path, keep: set[str]) -> list[str]:
    """Delete shard files in parquet/ not in `keep` (relative paths) and leftover temporaries."""
    folder = RunLayout(run_dir).parquet_dir
    removed = []
    if not folder.is_dir():
        return removed
    for p in sorted(folder.iterdir()):
        rel = f"parquet/{p.name}"
        stale_tmp = p.name.startswith(".shard_b") and atomic.is_tmp_name(p.name)
        if p.is_file() and (stale_tmp or (SHARD_FILE.match(p.name) and rel not in keep)):
            p.unlink()
            removed.append(rel)
    if removed:
        atomic.fsync_dir(folder)
    return removed
