"""Output shards: per domain, per shard, one `.bin/.idx` per (key, kind) and a `meta.json`.

    <out_dir>/[<domain>/]<name>_s<NNNN>_<key>_sequence.bin/.idx    token ids (output.dtype)
    <out_dir>/[<domain>/]<name>_s<NNNN>_<key>_<mask_key>.bin/.idx  loss mask, uint8 0/1, same lengths
    <out_dir>/[<domain>/]<name>_s<NNNN>_<key>_value.bin/.idx       raw numbers (output.value_dtype)
    <out_dir>/[<domain>/]<name>_s<NNNN>.meta.json

Document i of every file of a shard is the same input record. A document holds one sequence, or one
per list element for `list_field` keys (Megatron document indices group them).
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import numpy as np

from streamprep import atomic, binidx

FORMAT = "streamprep.sft/1"
MISSING_DOMAIN = "_none"
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


def domain_dir(value: Any) -> str:
    """A directory name for a domain value; values that need changing get a short hash to stay distinct, and so do
    values that are not strings (7 is not "7", True is not "True"), the string "_none" (not a missing value) and
    names with capitals: "Math" and "math" are one folder on a case-insensitive file system, where the second's
    shard files replaced the first's (dataset names and output keys are distinct ignoring case for that reason)."""
    if value is None:
        return MISSING_DOMAIN
    text = value if isinstance(value, str) else str(value)
    safe = _SAFE.sub("_", text)[:80].lstrip(".") or "_"
    if safe != text or not isinstance(value, str) or text == MISSING_DOMAIN or safe != safe.lower():
        named = text if isinstance(value, str) else f"{type(value).__name__}:{text}"
        safe += "-" + hashlib.sha256(named.encode("utf-8")).hexdigest()[:8]
    return safe


class Shard:
    """The open files of one shard; writers open on the first document."""

    def __init__(self, out_dir: Path, name: str, index: int, domain: str | None, plan: dict[str, dict[str, Any]],
                 dtypes: dict[str, np.dtype], header: dict[str, Any]):
        self.dir, self.index, self.domain, self.plan, self.dtypes, self.header = out_dir, index, domain, plan, dtypes, header
        self.stem = f"{name}_s{index:04d}"
        self.writers: dict[tuple[str, str], binidx.IndexedDatasetWriter] = {}
        self.documents = 0
        self.tokens = 0
        self.counts: dict[str, dict[str, int]] = {k: {"sequences": 0, "tokens": 0, "trained_tokens": 0, "values": 0}
                                                  for k in plan}

    def prefix(self, key: str, kind: str) -> str:
        return f"{self.stem}_{key}_{kind}"

    def _writer(self, key: str, kind: str, dtype: np.dtype) -> binidx.IndexedDatasetWriter:
        w = self.writers.get((key, kind))
        if w is None:
            w = self.writers[(key, kind)] = binidx.IndexedDatasetWriter(self.dir / self.prefix(key, kind), dtype)
        return w

    def add(self, record: dict[str, dict[str, list[np.ndarray]]]) -> None:
        for key, lay in self.plan.items():
            parts = record[key]
            c = self.counts[key]
            if lay["sequence"]:
                seqs = parts["sequence"]
                self._writer(key, "sequence", self.dtypes["sequence"]).add_document(seqs)
                c["sequences"] += len(seqs)
                n = sum(len(s) for s in seqs)
                c["tokens"] += n
                self.tokens += n
            if lay["mask"]:
                masks = parts["mask"]
                self._writer(key, lay["mask"], self.dtypes["mask"]).add_document(masks)
                c["trained_tokens"] += int(sum(int(m.sum()) for m in masks))
            if lay["value"]:
                vals = parts["value"]
                self._writer(key, "value", self.dtypes["value"]).add_document(vals)
                c["values"] += sum(len(v) for v in vals)
        self.documents += 1

    def close(self) -> dict[str, Any]:
        """Close every file (atomically, `.bin` then `.idx`), then write the meta; returns the meta."""
        for w in self.writers.values():
            w.close()
        keys: dict[str, Any] = {}
        for key, lay in self.plan.items():
            c = self.counts[key]
            entry: dict[str, Any] = {"list_field": lay["list"]}   # not null: one sequence per list element
            if lay["sequence"]:
                entry["sequence"] = {"prefix": self.prefix(key, "sequence"), "dtype": str(self.dtypes["sequence"]),
                                     "sequences": c["sequences"], "tokens": c["tokens"]}
            if lay["mask"]:
                entry["loss_mask"] = {"prefix": self.prefix(key, lay["mask"]), "name": lay["mask"],
                                      "dtype": str(self.dtypes["mask"]), "trained_tokens": c["trained_tokens"]}
            if lay["value"]:
                entry["value"] = {"prefix": self.prefix(key, "value"), "dtype": str(self.dtypes["value"]),
                                  "values": c["values"]}
            keys[key] = entry
        meta = {**self.header, "format": FORMAT, "domain": self.domain, "shard": self.index,
                "documents": self.documents, "tokens": self.tokens,
                "trained_tokens": (sum(self.counts[k]["trained_tokens"] for k, lay in self.plan.items() if lay["mask"])
                                   if any(lay["mask"] for lay in self.plan.values()) else None),
                "keys": keys}
        atomic.write_json(self.meta_path, meta)
        return meta

    def suspend(self) -> None:
        """Close the open files (see `binidx.IndexedDatasetWriter.suspend`); the next document reopens them."""
        for w in self.writers.values():
            w.suspend()

    def abort(self) -> None:
        for w in self.writers.values():
            w.abort()

    @property
    def meta_path(self) -> Path:
        return self.dir / f"{self.stem}.meta.json"

    def files(self) -> list[Path]:
        out = [self.meta_path]
        for w in self.writers.values():
            out += [w.bin_path, w.idx_path]
        return out
