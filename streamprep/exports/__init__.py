"""Exports after tokenization: Parquet shards (+ TSV), blend.json, mixtures.json, then manifest.json.

Entry points: `export_run` (the job's exports step), `write_exports` (the same from explicit shard
refs) and `prepare_part` (the per-part work for one finished shard, cached beside its receipt, so the
end of the job only does what needs every record). The manifest is written last and covers every other
artifact (exports/chain.py); the caller records the SHA-256 it returns in run.json. Re-running on the
same inputs rewrites the same bytes and removes Parquet/TSV files of an earlier attempt that the new
manifest no longer lists. File formats, the bucketing / order / packing rules and the chain:
docs/exports.md.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamprep import layout, registry
from streamprep.exports import chain, manifest, order, parquet, summary
from streamprep.exports.context import WriterContext
from streamprep.exports.index import DatasetIndex, ExportError, ShardRef
from streamprep.exports.order import build_indexes
from streamprep.exports.parquet import ShardCountError
from streamprep.executor import Executor, LocalExecutor
from streamprep.layout import RunLayout
from streamprep.modes import mode_of
from streamprep.textshard import LineScan
from streamprep.tokenize import read_receipt

if TYPE_CHECKING:
    from streamprep.config import DatasetConfig, OutputConfig

__all__ = ["export_run", "write_exports", "prepare_part", "ShardRef", "ExportError", "ShardCountError", "WriterContext"]


def _split_of(datasets: Sequence[DatasetConfig], shards: list[ShardRef]) -> dict[str, str]:
    """train/valid/test per dataset: from its shards, else the config's blend split."""
    out = {d.name: d.blend_split for d in datasets}
    for ref in shards:
        out[ref.dataset] = ref.split
    return out


def prepare_part(task: Any, receipt: dict[str, Any], scan: LineScan | None = None) -> None:
    """The per-part exports work for one finished tokenization shard (`streamprep.tokenize.ShardTask` and its
    completed receipt): its summary, cached beside the receipt, and (when the task names its first ordinal and
    the order settings) its sorted run, where the exports look for it; safe in any process, as soon as the
    receipt exists. `scan`: the part's lines as its tokenizing just parsed them (`textshard.LineScan`)."""
    if mode_of(task.sft).text_exports and receipt["stats"]["num_documents"] > 0:
        ref = ShardRef.from_task(task, receipt)
        part = summary.part_summary(ref, scan)
        if task.first_ordinal is not None and task.order_seed is not None and task.length_buckets:
            order.cache_run(ref, part, task.first_ordinal, task.order_seed, task.length_buckets,
                            parquet.BYTES_PER_TOKEN, Path(task.run_dir), scan)


class WriterError(RuntimeError):
    """An output writer plug-in that raised, or did not return the run-dir-relative paths of files it wrote: a
    plug-in bug, named."""


def _files(run_dir: Path, rels: Sequence[str]) -> dict[str, tuple[int, int, int]]:
    """(inode, size, mtime) of each file at or under the run-dir-relative `rels`, the exports' scratch left out: a
    file replaced (atomically: a new inode), written in place, removed or added shows as a difference."""
    scratch = RunLayout(run_dir).exports_scratch
    out = {}
    for rel in rels:
        top = run_dir / rel
        for path in [top, *(top.rglob("*") if top.is_dir() else ())]:
            if path.is_file() and path != scratch and scratch not in path.parents:
                st = path.lstat()
                out[str(path.relative_to(run_dir))] = (st.st_ino, st.st_size, st.st_mtime_ns)
    return out


def _owner(rel: str, taken: Mapping[str, str]) -> str | None:
    """Whom a run-dir-relative path belongs to, if not to the writer plug-in at hand: an earlier writer (`taken`: path
    → its name) or the run itself (a path under `layout.OWN`)."""
    if rel in taken:
        return f"output writer {taken[rel]!r}"
    return "the run" if Path(rel).parts[0] in layout.OWN else None


def _written(entry: registry.Entry, ctx: WriterContext, taken: Mapping[str, str] | None = None) -> list[str]:
    """The files a writer says it wrote, each a run-dir-relative path to a file there: one returning None was a bare
    TypeError, one naming a file it did not write a bare FileNotFoundError, and one outside the run dir (`/etc/x`,
    `../x`) was listed and hashed in the manifest, which verify then called damaged. A plug-in's exception is
    wrapped naming it (it was a bare `RuntimeError: …`); it stays the cause, for the CLI's full-disk line.

    `taken`: path → name of each file an earlier writer returned. A path one of them or the run itself owns
    (`layout.OWN`) is refused, and a plug-in that changed any of those files, returned or not, is named: one that
    rewrote blend.json or zeroed a `.bin` shard had the run end complete (its manifest listing blend.json twice)."""
    taken = taken or {}
    where = f"output writer {entry.name!r} ({registry.module_of(entry.target)})"
    plugin = not entry.meta.get("builtin")
    guarded = [*layout.SETTLED, *taken]
    before = _files(ctx.run_dir, guarded) if plugin else {}
    try:
        out = entry.load()(ctx)
    except Exception as exc:
        if not plugin:  # streamprep's own errors (ExportError, ShardCountError) say what they are
            raise
        raise WriterError(f"{where} raised {type(exc).__name__}: {exc}") from exc
    if plugin and (after := _files(ctx.run_dir, guarded)) != before:
        rel = min(set(before) ^ set(after) | {r for r in before.keys() & after.keys() if before[r] != after[r]})
        raise WriterError(f"{where} changed {rel!r}, which belongs to {_owner(rel, taken)}: a writer writes files of "
                          f"its own only")
    if not isinstance(out, (list, tuple)) or not all(isinstance(rel, str) for rel in out):
        raise WriterError(f"{where} returned {type(out).__name__}, not a list of the run-dir-relative paths it wrote")
    root = ctx.run_dir.resolve()
    mine: set[str] = set()
    for rel in out:
        path = (ctx.run_dir / rel).resolve()
        if Path(rel).is_absolute() or not path.is_relative_to(root) or path == root:
            raise WriterError(f"{where} returned {rel!r}: not a path inside the run dir, relative to it")
        if not path.is_file():
            raise WriterError(f"{where} returned {rel!r}, which is not a file in the run dir")
        key = str(path.relative_to(root))
        if key in mine:
            raise WriterError(f"{where} returned {rel!r} twice")
        if plugin and (owner := _owner(key, taken)) is not None:
            raise WriterError(f"{where} returned {rel!r}, which belongs to {owner}: a writer writes files of its own "
                              f"only")
        mine.add(key)
    return list(out)


def export_run(run_dir: Path, tasks: list, tokenizer_info: dict[str, Any], output: OutputConfig,
               datasets: Sequence[DatasetConfig], seed: int, config_hash: str, *, workers: Executor,
               blend: bool) -> dict[str, Any]:
    """The job's exports over its tokenization tasks (all receipts complete), on the job's executor;
    `blend`: whether the run's mode writes blend.json."""
    receipts = [read_receipt(t) for t in tasks]
    # shards of a mode without text exports (SFT) are listed by their receipts only; their documents and tokens
    # still count for the manifest's datasets and mixtures.json
    refs = [ShardRef.from_task(t, r) for t, r in zip(tasks, receipts) if t.mode.text_exports]
    sft: dict[str, tuple[int, int]] = {}
    for t, r in zip(tasks, receipts):
        if not t.mode.text_exports:
            records, tokens = sft.get(t.dataset, (0, 0))
            sft[t.dataset] = (records + r["stats"]["num_documents"], tokens + r["stats"]["num_tokens"])
    summary = write_exports(run_dir, refs, output, datasets, seed, tokenizer_info, config_hash,
                            workers=workers, blend=blend, receipts=[Path(t.receipt_path) for t in tasks], sft=sft)
    empty = {d.name: sum(len(r["stats"]["dropped_empty"]) for t, r in zip(tasks, receipts) if t.dataset == d.name)
             for d in datasets}
    return {"empty_tokens": empty, "exports": summary}


def _check(shards: list[ShardRef], names: list[str]) -> None:
    """Refuse shards the exports cannot take, before anything is written (the options were validated
    with the config)."""
    unknown = sorted({r.dataset for r in shards} - set(names))
    if unknown:
        raise ExportError(f"shards of dataset(s) not in the config: {', '.join(unknown)}")
    for ref in shards:
        if ref.receipt.get("status") != "completed":
            raise ExportError(f"{ref.dataset}/{ref.part}: receipt status {ref.receipt.get('status')!r}, not completed")


def _records(idx: DatasetIndex, sft: Mapping[str, tuple[int, int]]) -> int:
    """A dataset's kept records: its text shards' and its SFT shards' documents."""
    return len(idx) + sft.get(idx.name, (0, 0))[0]


def _tokens(idx: DatasetIndex, sft: Mapping[str, tuple[int, int]]) -> int:
    """A dataset's tokens: its text shards' and its SFT shards' (every key's sequences)."""
    return idx.num_tokens + sft.get(idx.name, (0, 0))[1]


def _manifest(indexes: list, datasets: Sequence[DatasetConfig], pq_entries: list[dict[str, Any]],
              bin_entries: list[dict[str, Any]], output: OutputConfig, seed: int, tokenizer_info: dict[str, Any],
              config_hash: str, files: list[dict[str, Any]], sft: Mapping[str, tuple[int, int]]) -> dict[str, Any]:
    ds_summary = {idx.name: {"split": idx.split, "weight": d.weight, "num_records": _records(idx, sft),
                             "num_tokens": _tokens(idx, sft), "binidx_shards": len(idx.refs),
                             "empty_shards": len(idx.empty_refs),
                             "dropped_empty": sum(len(r.receipt.get("stats", {}).get("dropped_empty", []))
                                                  for r in idx.refs + idx.empty_refs)}
                  for idx, d in zip(indexes, datasets)}
    pq_cfg = output.parquet
    options = {"length_buckets": list(pq_cfg.length_buckets), "shard_size_bytes": pq_cfg.shard_size_bytes,
               "compression": pq_cfg.compression, "row_group_size": pq_cfg.row_group_size,
               "num_shards_multiple_of": output.num_shards_multiple_of,
               "bytes_per_token_estimate": parquet.BYTES_PER_TOKEN, "tail_fraction": parquet.TAIL_FRACTION}
    return manifest.build(pq_entries, bin_entries, seed=seed, config_hash=config_hash, tokenizer_info=tokenizer_info,
                          buckets=parquet.bucket_table(pq_cfg.length_buckets), options=options, datasets=ds_summary,
                          files=files)


def write_exports(run_dir: Path, shards: list[ShardRef], output: OutputConfig, datasets: Sequence[DatasetConfig],
                  seed: int, tokenizer_info: dict[str, Any], config_hash: str, *, workers: int | Executor = 1,
                  blend: bool = False, receipts: list[Path] | None = None,
                  sft: Mapping[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """Write parquet/, (with `blend`) blend.json, mixtures.json and manifest.json for the completed
    `shards`, on `workers` processes or a started pool (the bytes do not depend on it); return a summary.

    `receipts`: every receipt of the run (SFT ones too); default: those of `shards`. `sft`: dataset → (documents,
    tokens) of its SFT shards, which are not in `shards` but count in the datasets' records and tokens. The summary's
    `manifest_sha256` is the root of the hash chain, for run.json.

    Per part, on the workers: its sorted run (bucket and order key per record), the one its tokenizing worker
    made when current, else made from its summary (cached, or computed); then here the plan, a streaming merge
    of the runs (numbers only), each Parquet shard handed to the workers as it is cut; the JSON files from per-part
    and per-shard numbers.
    """
    run_dir = Path(run_dir)
    names = [d.name for d in datasets]
    _check(shards, names)
    split_of = _split_of(datasets, shards)
    order.remove_scratch(run_dir, keep_runs=True)  # an earlier attempt's merge files; current runs are reused
    try:
        with LocalExecutor(workers) if isinstance(workers, int) else nullcontext(workers) as pool:
            indexes = build_indexes([(n, split_of[n], [r for r in shards if r.dataset == n]) for n in names], pool,
                                    seed, output.parquet.length_buckets, parquet.BYTES_PER_TOKEN, run_dir)
            bin_entries = [e for idx in indexes for e in manifest.binidx_entries(run_dir, idx, seed)]
            ctx = WriterContext(run_dir, shards, indexes, datasets, output, seed, split_of, blend, pool, bin_entries,
                                dict(sft or {}))
            # the writers in registration order: the built-ins (Parquet + TSV, blend.json, mixtures.json;
            # plugins.py), then writers of your own; the manifest lists each file a writer returns under its name
            written: list[tuple[str, str]] = []
            taken: dict[str, str] = {}  # run-dir-relative path (resolved) -> the writer that returned it
            for w in registry.WRITERS.entries():
                for rel in _written(w, ctx, taken):
                    written.append((rel, w.name))
                    taken[str((run_dir / rel).resolve().relative_to(run_dir.resolve()))] = w.name
    finally:
        order.remove_scratch(run_dir)
    pq_entries = ctx.parquet
    if receipts is None:
        receipts = [RunLayout(run_dir).receipt(r.dataset, r.part) for r in shards]
    files = chain.file_entries(run_dir, chain.chained_files(run_dir, receipts) + written)
    man = _manifest(indexes, datasets, pq_entries, bin_entries, output, seed, tokenizer_info, config_hash, files,
                    ctx.sft)
    manifest_sha256 = manifest.write(run_dir, man)
    keep = {e["path"] for e in pq_entries} | {e["tsv"]["path"] for e in pq_entries}
    removed = parquet.remove_stale(run_dir, keep)
    return {
        "parquet_shards": len(pq_entries),
        "parquet_shards_by_split": {k: v["parquet_shards"] for k, v in man["splits"].items()},
        "binidx_shards": sum(len(idx.refs) for idx in indexes),
        "records": {idx.name: _records(idx, ctx.sft) for idx in indexes},
        "tokens": {idx.name: _tokens(idx, ctx.sft) for idx in indexes},
        "stale_removed": len(removed),
        "manifest_sha256": manifest_sha256,
    }
