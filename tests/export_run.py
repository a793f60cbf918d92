"""A small tokenized run dir (real text from ../shared/data, the real phi-2 tokenizer) laid out exactly as the
tokenize stage lays it out: what the exports and verify tests export and check."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson
from tokenizers import Tokenizer

from streamprep import atomic
from streamprep.binidx import IndexedDatasetWriter
from streamprep.config import DatasetConfig, OutputConfig, dataset, section
from streamprep.exports import ShardRef, write_exports

EOD = 50256  # phi-2 <|endoftext|>
BUCKETS = [32, 64, 128, 256, 512, 1024]
SHARD_SIZE = 16_384
DATASETS = [  # name, split, weight, source file, records, records per part
    ("c4", "train", 2.0, "web/c4_en_train00000_first1000.jsonl", 300, 100),
    ("lingua", "train", 1.0, "multilingual/lingua_sentences_75langs.jsonl", 240, 120),
    ("dclm", "valid", 1.0, "web/dclm_quality_agreement_data.jsonl", 60, 60),
]
EMPTY_AT = {("c4", 1): [0, 17]}   # (dataset, part) -> lines whose text is empty (tokenize to nothing)
ALL_EMPTY_PART = ("lingua", 2)    # an extra part whose every record is empty: no .bin/.idx, receipt only


def _texts(shared: Path, rel: str, n: int) -> list[str]:
    out = []
    with open(shared / rel, "rb") as fh:
        for line in fh:
            text = orjson.loads(line).get("text")
            if isinstance(text, str) and text.strip():
                out.append(text)
            if len(out) == n:
                break
    return out


def _write_part(run: Path, tok: Tokenizer, name: str, split: str, part_no: int, texts: list[str],
                first_index: int) -> ShardRef:
    part = f"part-{part_no:05d}"
    ingest = run / "ingest" / name / f"{part}.jsonl"
    lines = [orjson.dumps({"text": t, "meta": {"lang": "x", "source": {"dataset": name, "index": first_index + i}}})
             + b"\n" for i, t in enumerate(texts)]
    atomic.write_bytes(ingest, b"".join(lines))
    arrays, dropped = [], []
    for i, enc in enumerate(tok.encode_batch(texts, add_special_tokens=False)):
        if not enc.ids:
            dropped.append(i)
            continue
        arrays.append(np.array(enc.ids + [EOD], dtype=np.uint16))
    prefix = run / "binidx" / name / f"{part}_text_document"
    files = {}
    if arrays:
        w = IndexedDatasetWriter(prefix, np.uint16)
        w.add_documents(arrays)
        w.close()
        for kind in ("bin", "idx"):
            p = Path(f"{prefix}.{kind}")
            files[kind] = {"path": str(p.relative_to(run)), "bytes": p.stat().st_size, "sha256": atomic.sha256_file(p)}
    receipt = {"status": "completed", "dataset": name, "split": split, "part": part, "plan_hash": "test",
               "input_sha256": atomic.sha256_file(ingest), "tokenizer_fingerprint": "sha256:phi2", "eod_id": EOD,
               "dtype": "uint16", "files": files,
               "stats": {"num_documents": len(arrays), "num_tokens": int(sum(len(a) for a in arrays)),
                         "dropped_empty": dropped}}
    receipt_path = run / "receipts" / name / f"{part}.json"
    atomic.write_json(receipt_path, receipt)
    return ShardRef(name, split, part, ingest, prefix if arrays else None, receipt, receipt_path)


def build_run(run: Path, shared: Path) -> list[ShardRef]:
    tok = Tokenizer.from_file(str(shared / "tokenizers" / "phi-2" / "tokenizer.json"))
    refs = []
    for name, split, _w, rel, n, per_part in DATASETS:
        texts = _texts(shared, rel, n)
        index = 0
        for part_no, start in enumerate(range(0, n, per_part)):
            chunk = list(texts[start:start + per_part])
            for line in EMPTY_AT.get((name, part_no), []):
                chunk[line] = ""
            refs.append(_write_part(run, tok, name, split, part_no, chunk, index))
            index += len(chunk)
        if name == ALL_EMPTY_PART[0]:
            refs.append(_write_part(run, tok, name, split, ALL_EMPTY_PART[1], ["", ""], index))
    return refs


def datasets_cfg() -> list[DatasetConfig]:
    return [dataset({"name": n, "path": "-", "weight": w}, blend_split=s) for n, s, w, *_ in DATASETS]


def output_cfg(**over) -> OutputConfig:
    cfg = {"parquet": {"length_buckets": BUCKETS, "shard_size_bytes": SHARD_SIZE, "compression": "snappy",
                       "row_group_size": 7},
           "mixtures": {"phases": {}}, "num_shards_multiple_of": 1}
    for k, v in over.items():
        if k in cfg["parquet"]:
            cfg["parquet"][k] = v
        else:
            cfg[k] = v
    return section("output", cfg)


TOKENIZER_INFO = {"fingerprint": "sha256:phi2", "vocab_size": 50295, "eod_id": EOD}


def export(run: Path, refs: list[ShardRef], seed: int = 1234, workers: int = 1, **over) -> dict:
    return write_exports(run, refs, output_cfg(**over), datasets_cfg(), seed, TOKENIZER_INFO, "cfghash0123",
                         workers=workers)


def relocate(refs: list[ShardRef], old: Path, new: Path) -> list[ShardRef]:
    def move(p: Path | None) -> Path | None:
        return None if p is None else new / p.relative_to(old)
    return [ShardRef(r.dataset, r.split, r.part, move(r.ingest_path), move(r.prefix), r.receipt, move(r.receipt_path))
            for r in refs]


def parquet_entries(run: Path) -> list[dict]:
    return [s for s in atomic.read_json(run / "manifest.json")["shards"] if s["kind"] == "parquet"]
