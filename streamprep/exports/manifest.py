"""manifest.json (formats.md §4): every Parquet shard and every `.bin/.idx` shard, with hashes,
and (under `files`) the other artifacts of the hash chain (exports/chain.py).

No timestamps and canonical JSON, so the same inputs, seed and library versions give the same bytes.
"""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pyarrow

from streamprep import atomic
from streamprep.version import __version__
from streamprep.exports.index import DatasetIndex, ExportError
from streamprep.layout import RunLayout

FORMAT = "streamprep-manifest"
VERSION = 1


def binidx_entries(run_dir: Path, index: DatasetIndex, seed: int) -> list[dict[str, Any]]:
    """One entry per `.bin/.idx` shard with documents; hashes from its receipt, sizes checked on disk."""
    out = []
    for part_no, ref in enumerate(index.refs):
        files = ref.receipt.get("files") or {}
        if set(files) != {"bin", "idx"}:
            raise ExportError(f"receipt of {ref.dataset}/{ref.part} lists files {sorted(files)}, expected bin and idx")
        listed = {}
        for kind in ("bin", "idx"):
            f = files[kind]
            path = run_dir / f["path"]
            if not path.is_file() or path.stat().st_size != f["bytes"]:
                raise ExportError(f"{f['path']}: missing or not {f['bytes']} bytes as its receipt says")
            listed[kind] = {"path": f["path"], "file_sha256": f["sha256"], "size_bytes": f["bytes"]}
        rows = index.part_slice(part_no)
        out.append({
            "kind": "binidx", "shard_id": f"binidx/{ref.dataset}/{ref.part}",
            "path": str(Path(ref.prefix).relative_to(run_dir)), "bucket": None,
            "source": ref.dataset, "split": index.split,
            "num_records": rows.stop - rows.start, "num_tokens": int(index.part_tokens[part_no]),
            "dtype": str(index.dtypes[part_no]),
            # the data file's hash and size at top level (as for Parquet); both files under "files"
            "file_sha256": listed["bin"]["file_sha256"], "size_bytes": listed["bin"]["size_bytes"],
            "files": listed, "seed": seed,
        })
    return out


def sorted_shards(parquet: list[dict[str, Any]], binidx: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The manifest's `shards` order (mixtures.json is built from it before the manifest is written)."""
    return sorted(parquet + binidx, key=lambda s: s["shard_id"])


def build(parquet: list[dict[str, Any]], binidx: list[dict[str, Any]], *, seed: int, config_hash: str,
          tokenizer_info: dict[str, Any], buckets: list[dict[str, Any]], options: dict[str, Any],
          datasets: list[dict[str, Any]], files: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest; `files` are the other artifacts it covers (exports/chain.py)."""
    shards = sorted_shards(parquet, binidx)
    splits: dict[str, dict[str, int]] = {}
    for s in parquet:
        agg = splits.setdefault(s["split"], {"parquet_shards": 0, "num_records": 0, "num_tokens": 0})
        agg["parquet_shards"] += 1
        agg["num_records"] += s["num_records"]
        agg["num_tokens"] += s["num_tokens"]
    return {
        "format": FORMAT, "version": VERSION, "run_id": config_hash, "config_hash": config_hash, "seed": seed,
        "tokenizer": dict(tokenizer_info),
        "writer": {"streamprep": __version__, "pyarrow": pyarrow.__version__},
        "buckets": buckets, "parquet": options, "datasets": datasets, "splits": splits, "shards": shards,
        "files": files,
    }


def write(run_dir: Path, manifest: dict[str, Any]) -> str:
    """Write manifest.json atomically; return the SHA-256 of its bytes (recorded in run.json)."""
    data = atomic.dumps_json(manifest)
    atomic.write_bytes(RunLayout(run_dir).manifest, data)
    return hashlib.sha256(data).hexdigest()
