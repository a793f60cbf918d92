"""Exports after tokenization: Parquet shards (+ TSV), blend.json, mixtures.json, then manifest.json.

One entry point, `write_exports`. The manifest is written last and covers every other artifact
(exports/chain.py); the caller records the SHA-256 it returns in run.json. Re-running it on the same
inputs rewrites the same bytes and removes Parquet/TSV files of an earlier attempt that the new
manifest no longer lists. File formats, the bucketing / shuffle / packing rules and the chain:
docs/exports.md.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from streamprep.exports.mixtures import MixtureConfigError, validate_mixtures
from streamprep.exports.shards import ExportError, ShardRef

__all__ = ["write_exports", "ShardRef", "ExportError", "ShardCountError",
           "MixtureConfigError", "validate_mixtures"]


def __getattr__(name: str) -> Any:
    # pyarrow is imported only when Parquet work (or its error type) is needed; config loading stays light.
    if name == "ShardCountError":
        from streamprep.exports.parquet import ShardCountError

        return ShardCountError
    raise AttributeError(name)


def _split_of(datasets: list[dict[str, Any]], shards: list[ShardRef]) -> dict[str, str]:
    """train/valid/test per dataset: from its shards, else the config (`blend_split`, then `split`)."""
    out = {d["name"]: d.get("blend_split") or d.get("split") or "train" for d in datasets}
    for ref in shards:
        out[ref.dataset] = ref.split
    return out


def write_exports(run_dir: Path, shards: list[ShardRef], output_cfg: dict[str, Any], datasets: list[dict[str, Any]],
                  seed: int, tokenizer_info: dict[str, Any], config_hash: str, *, blend: dict[str, Any] | None = None,
                  receipts: list[Path] | None = None) -> dict[str, Any]:
    """Write parquet/, blend.json (when given), mixtures.json and manifest.json; return a summary.

    `receipts`: every receipt of the run (SFT ones too); default: those of `shards`. The summary's
    `manifest_sha256` is the root of the hash chain, for run.json.
    """
    from streamprep import blend as blendmod
    from streamprep.exports import chain, manifest, mixtures, parquet
    from streamprep.exports.parquet import ParquetOptions
    from streamprep.exports.shards import build_index

    run_dir = Path(run_dir)
    names = [d["name"] for d in datasets]
    opts = ParquetOptions.from_output_cfg(output_cfg)
    phases = (output_cfg.get("mixtures") or {}).get("phases") or {}
    validate_mixtures(phases, names)
    unknown = sorted({r.dataset for r in shards} - set(names))
    if unknown:
        raise ExportError(f"shards of dataset(s) not in the config: {', '.join(unknown)}")
    for ref in shards:
        if ref.receipt.get("status") != "completed":
            raise ExportError(f"{ref.dataset}/{ref.part}: receipt status {ref.receipt.get('status')!r}, not completed")
    split_of = _split_of(datasets, shards)

    indexes = [build_index(n, split_of[n], [r for r in shards if r.dataset == n]) for n in names]
    plans = parquet.plan_shards(indexes, opts, seed)
    pq_entries = parquet.write_shards(run_dir, indexes, plans, opts, seed)
    bin_entries = [e for idx in indexes for e in manifest.binidx_entries(run_dir, idx, seed)]

    ds_summary = {idx.name: {"split": idx.split, "weight": float(d.get("weight", 1.0)), "num_records": len(idx),
                             "num_tokens": idx.num_tokens, "binidx_shards": len(idx.refs),
                             "empty_shards": len(idx.empty_refs),
                             "dropped_empty": sum(len(r.receipt.get("stats", {}).get("dropped_empty", []))
                                                  for r in idx.refs + idx.empty_refs)}
                  for idx, d in zip(indexes, datasets)}
    options = {"length_buckets": list(opts.length_buckets), "shard_size_bytes": opts.shard_size_bytes,
               "compression": opts.compression, "row_group_size": opts.row_group_size,
               "num_shards_multiple_of": opts.num_shards_multiple_of,
               "bytes_per_token_estimate": parquet.BYTES_PER_TOKEN, "tail_fraction": parquet.TAIL_FRACTION}
    # Parquet files, blend.json, mixtures.json, then the manifest that lists them all, then the stale cleanup.
    if blend is not None:
        blendmod.write(run_dir, blend)
    mixtures.write(run_dir, mixtures.build(manifest.sorted_shards(pq_entries, bin_entries), datasets, phases, split_of))
    if receipts is None:
        receipts = [run_dir / "receipts" / r.dataset / f"{r.part}.json" for r in shards]
    files = chain.file_entries(run_dir, chain.chained_files(run_dir, receipts))
    man = manifest.build(pq_entries, bin_entries, seed=seed, config_hash=config_hash, tokenizer_info=tokenizer_info,
                         buckets=parquet.bucket_table(opts.length_buckets), options=options, datasets=ds_summary,
                         files=files)
    manifest_sha256 = manifest.write(run_dir, man)
    keep = {e["path"] for e in pq_entries} | {e["tsv"]["path"] for e in pq_entries}
    removed = parquet.remove_stale(run_dir, keep)
    return {
        "parquet_shards": len(pq_entries),
        "parquet_shards_by_split": {k: v["parquet_shards"] for k, v in man["splits"].items()},
        "binidx_shards": len(bin_entries),
        "records": {n: s["num_records"] for n, s in ds_summary.items()},
        "tokens": {n: s["num_tokens"] for n, s in ds_summary.items()},
        "stale_removed": len(removed),
        "manifest_sha256": manifest_sha256,
    }
