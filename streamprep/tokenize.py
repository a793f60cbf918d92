"""Tokenization shards: the plan (one task per completed ingest part), the run of one task, receipts.

The pure core of a pretraining shard is `textshard.tokenize_part` (re-exported here): it reads one ingest part,
encodes it in batches with the run's tokenizer backend (streamprep/backends.py) and writes `.bin/.idx` from
flat id buffers; it returns stats and writes no receipt; the run's mode chooses it (modes.py). The executing stage owns receipts: a receipt is written (atomically) only after both files are in place, and a
shard is skipped on re-run only when its receipt names the same plan hash and input hash, its own fields name the task
(dataset, split, part, tokenizer fingerprint, EOD id, dtype), its files still match, and a text shard's counts agree
with its `.idx`.
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from streamprep import atomic, binidx
from streamprep.config import ConfigError
from streamprep.layout import RunLayout, read_json
from streamprep.modes import Mode, mode_of
from streamprep.textshard import tokenize_part

PROCESS_ONLY = ("seconds", "scan")  # stats a mode's `tokenize` returns that stay in the worker, not in the receipt
STAT_COUNTS = ("num_documents", "num_tokens", "num_input_records")  # a text shard's receipt counts, checked on re-run

__all__ = ["ShardTask", "TokenizerCache", "make_task", "plan_hash", "read_receipt", "receipt_problem", "run_task",
           "token_dtype", "tokenize_part", "write_receipt"]


@dataclass(frozen=True)
class ShardTask:
    """One unit of tokenization work; plain data so it pickles cheaply to Ray workers."""

    dataset: str
    split: str
    part: str            # "part-00000"
    input_path: str      # RUN_DIR/ingest/<ds>/part-00000.jsonl
    prefix: str          # RUN_DIR/binidx/<ds>/part-00000_text_document
    receipt_path: str    # RUN_DIR/receipts/<ds>/part-00000.json
    run_dir: str
    plan_hash: str
    input_sha256: str
    tokenizer_path: str
    tokenizer_fingerprint: str
    eod_id: int | None   # appended to every document when not None
    dtype: str           # "uint16" | "int32"
    sft: dict[str, Any] | None = None  # the validated `sft:` section: masks/sequences instead of plain text
    backend: str = "hf"  # TokenizerInfo.backend_name: hf | gigatoken | auto; not in the plan hash (same ids)
    # The exports' row order of the part (exports/order.py), so its worker makes the part's sorted run too; none of
    # it is in the plan hash (the shard's bytes do not depend on it). None / (): the exports make the run.
    first_ordinal: int | None = None     # its first record's ordinal in the dataset (lines of the parts before it)
    order_seed: int | None = None        # run.seed
    length_buckets: tuple[int, ...] = ()  # output.parquet.length_buckets
    # its `input_sha256` was read back from the sealed log (a resume), not taken as ingest sealed the part in this
    # job: the part is hashed against it before it is tokenized (tokenize._check_input)
    check_input: bool = False

    @property
    def mode(self) -> Mode:
        return mode_of(self.sft)

    @property
    def columns_path(self) -> Path | None:
        """Where its tokenizing writes the part's columns file for the Parquet writers: only in a job with Parquet
        exports (the task names their bucket bounds)."""
        return RunLayout(Path(self.run_dir)).part_columns(self.dataset, self.part) if self.length_buckets else None


def token_dtype(output_dtype: str, vocab_size: int) -> str:
    return str(binidx.optimal_dtype(vocab_size)) if output_dtype == "auto" else output_dtype


def plan_hash(dataset: str, part: str, tokenizer_fingerprint: str, eod_id: int | None, dtype: str,
              sft: dict[str, Any] | None = None) -> str:
    """What decides a shard's bytes besides its input; library versions deliberately left out."""
    key = {"dataset": dataset, "part": part, "tokenizer": tokenizer_fingerprint, "eod_id": eod_id, "dtype": dtype}
    key.update(mode_of(sft).plan_key())
    return hashlib.sha256(orjson.dumps(key, option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def make_task(run_dir: Path, dataset: str, split: str, part_path: Path, tokenizer_path: Path,
              tokenizer_fingerprint: str, eod_id: int | None, dtype: str,
              sft: dict[str, Any] | None = None, backend: str = "hf", input_sha256: str | None = None) -> ShardTask:
    """The task of one sealed part; `input_sha256` is the part's hash when ingest knows it (else it is read)."""
    part = part_path.stem
    layout = RunLayout(run_dir)
    prefix = mode_of(sft).shard_prefix(layout, dataset, part)
    return ShardTask(
        dataset=dataset, split=split, part=part, input_path=str(part_path), prefix=str(prefix),
        receipt_path=str(layout.receipt(dataset, part)), run_dir=str(run_dir),
        plan_hash=plan_hash(dataset, part, tokenizer_fingerprint, eod_id, dtype, sft),
        input_sha256=input_sha256 or atomic.sha256_file(part_path), tokenizer_path=str(tokenizer_path),
        tokenizer_fingerprint=tokenizer_fingerprint, eod_id=eod_id, dtype=dtype, sft=sft, backend=backend)


def read_receipt(task: ShardTask) -> dict[str, Any] | None:
    return read_json(Path(task.receipt_path))


def receipt_problem(task: ShardTask, receipt: dict[str, Any] | None, check_hashes: bool = True) -> str | None:
    """Why this shard must be (re)done, or None when its receipt and files are complete and current."""
    if receipt is None:
        return "no receipt"
    files = receipt.get("files", {}) if isinstance(receipt, dict) else None
    if not isinstance(files, dict) or not all(isinstance(e, dict) and isinstance(e.get("path"), str)
                                              for e in files.values()):
        return "a receipt of the wrong shape"  # damaged: the shard is done again, its receipt rewritten
    if receipt.get("status") != "completed":
        return f"receipt status {receipt.get('status')!r}"
    if receipt.get("plan_hash") != task.plan_hash or receipt.get("input_sha256") != task.input_sha256:
        return "plan or input changed"
    changed = [k for k, v in _identity(task).items() if receipt.get(k) != v]
    if changed:  # a receipt edited by hand: kept, `verify` read that dtype/EOD/split against the shard and failed
        return f"receipt's {changed[0]} is not the task's"
    for entry in receipt.get("files", {}).values():
        path = Path(task.run_dir) / entry["path"]
        if not path.is_file() or path.stat().st_size != entry["bytes"]:
            return f"{entry['path']} missing or wrong size"
        if check_hashes and atomic.sha256_file(path) != entry["sha256"]:
            return f"{entry['path']} checksum mismatch"
    return _counts_problem(task, receipt) if check_hashes and task.mode.text_exports else None


def _counts_problem(task: ShardTask, receipt: dict[str, Any]) -> str | None:
    """A text shard's receipt whose counts disagree with its `.idx` (read after its hash matched: a small file) or
    with each other. The exports trust them and refused them (ExportError) at every re-run, the shard being skipped:
    a run that could never finish. Such a receipt is damaged: its shard is done again."""
    stats = receipt.get("stats")
    if not isinstance(stats, dict) or not all(isinstance(stats.get(k), int) for k in STAT_COUNTS) \
            or not isinstance(stats.get("dropped_empty"), list):
        return "receipt stats of the wrong shape"
    dropped, n_lines = stats["dropped_empty"], stats["num_input_records"]
    if not all(isinstance(i, int) for i in dropped) or dropped != sorted(set(dropped)) \
            or (dropped and (dropped[0] < 0 or dropped[-1] >= n_lines)) \
            or n_lines != stats["num_documents"] + len(dropped):
        return "receipt's dropped_empty and num_input_records are not its documents' lines"
    idx = receipt["files"].get("idx")
    if idx is None:
        return "receipt's num_documents without its files" if stats["num_documents"] else None
    try:
        ds = binidx.IndexedDataset.open(Path(task.run_dir) / idx["path"][:-len(".idx")])
    except ValueError as exc:
        return f"{idx['path']} unreadable ({exc})"
    if len(ds) != stats["num_documents"] or int(ds.lengths.astype(np.int64).sum()) != stats["num_tokens"]:
        return f"receipt's num_documents or num_tokens is not its {idx['path']}'s"
    return None


def _identity(task: ShardTask) -> dict[str, Any]:
    """The fields of a receipt that name its task (the plan hash covers most of them, but not as the receipt's
    readers see them: the exports and `verify` read these fields)."""
    return {"dataset": task.dataset, "split": task.split, "part": task.part,
            "tokenizer_fingerprint": task.tokenizer_fingerprint, "eod_id": task.eod_id, "dtype": task.dtype}


def write_receipt(task: ShardTask, shard_stats: dict[str, Any], outputs: dict[str, Path]) -> dict[str, Any]:
    """Record a completed shard (after its files are durable). 0 documents: no files, listed as empty."""
    run_dir = Path(task.run_dir)
    files = {kind: {"path": str(path.relative_to(run_dir)), "bytes": path.stat().st_size,
                    "sha256": atomic.sha256_file(path)} for kind, path in outputs.items()}
    receipt = {"status": "completed", **_identity(task), "plan_hash": task.plan_hash, "input_sha256": task.input_sha256,
               "stats": {k: v for k, v in shard_stats.items() if k not in PROCESS_ONLY}, "files": files}
    atomic.write_json(task.receipt_path, receipt)
    return receipt


class TokenizerCache:
    """The tokenizer a task names, loaded once per worker and reloaded only when its fingerprint changes.

    Long-lived engines start before a trained tokenizer exists, so loading waits for the first task."""

    def __init__(self) -> None:
        self._key: tuple[str, str, str] | None = None
        self._tokenizer: Any = None

    def get(self, task: ShardTask) -> Any:
        key = (task.tokenizer_path, task.tokenizer_fingerprint, task.backend)
        if key != self._key:
            self._tokenizer = task.mode.load_tokenizer(task.tokenizer_path, task.backend)
            self._key = key
        return self._tokenizer


def drop_tmp_files(task: ShardTask) -> None:
    """Temporary files of `task`'s outputs that a writer killed mid-way left (with its process or node); a retry,
    never run beside a live first attempt, removes them and writes its own. Only a retry runs it (the job's
    start swept every temporary file): it scans each output folder, ~7 ms a call beside 8 k shards, so a call
    per task made tokenizing grow with the square of the shard count."""
    for target in (Path(task.prefix), Path(task.receipt_path), task.columns_path):
        if target is None:
            continue
        head = f".{target.name}"
        try:
            with os.scandir(target.parent) as entries:
                stale = [e.path for e in entries if e.name.startswith(head) and atomic.is_tmp_name(e.name)]
        except FileNotFoundError:  # nothing written there yet
            continue
        for path in stale:
            Path(path).unlink(missing_ok=True)


def _check_input(task: ShardTask) -> None:
    """The part is the one ingest sealed: its SHA-256 is the one the sealed log recorded (`task.input_sha256`),
    which the receipt, its columns file and manifest.json repeat. A resume checks only the parts' sizes, so a
    sealed-log record or a part changed since had the receipt sign the wrong SHA-256, or a changed part, and only
    `verify` saw it. Checked for a part whose hash a resume read back (`check_input`) and whose shard is written
    (the tokenizing reads it next, from the page cache); not for one sealed in this job (hashed as it was written:
    hashing it again cost as much CPU as a fast tokenizer), nor for a shard skipped on its receipt. A ConfigError
    (exit 2, run.json's `needs_change`): a re-run as is fails the same way, while removing the part (or the sealed
    log) has the checkpoint restart the dataset, which a plain ValueError left unsaid (exit 1, "resumable")."""
    sha = atomic.sha256_file(task.input_path)
    if sha != task.input_sha256:
        part = Path(task.input_path)
        raise ConfigError(f"{part.relative_to(task.run_dir) if part.is_relative_to(task.run_dir) else part}: its "
                          f"SHA-256 is {sha}, not the {task.input_sha256} its dataset's sealed log "
                          f"({task.dataset}.sealed in the checkpoint dir) recorded as ingest sealed it: the part or "
                          f"that record changed since (a damaged disk or an edit); delete the part (or "
                          f"{task.dataset}.sealed) and re-run the same command, which ingests dataset {task.dataset} "
                          f"again, or start over with a new --run-dir")


def run_task(task: ShardTask, tokenizer: Any) -> dict[str, Any]:
    """The whole unit of work a stage runs: skip if current, else tokenize and write the receipt. A result's
    `scan` (the part's lines as its tokenizing saw them, for its summary) stays in the worker: `run_shard`."""
    if receipt_problem(task, read_receipt(task)) is None:
        return {"task": asdict(task), "skipped": True}
    if task.check_input:
        _check_input(task)
    shard_stats, outputs = task.mode.tokenize(task, tokenizer)
    write_receipt(task, shard_stats, outputs)
    return {"task": asdict(task), "skipped": False, "seconds": shard_stats["seconds"],
            "tokens": shard_stats.get("num_tokens", 0), "scan": shard_stats.get("scan")}

