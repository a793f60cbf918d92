"""`streamprep verify`: walk the hash chain run.json → manifest.json → every artifact, and re-check it.

`verify_run(run_dir)` returns a list of problems (one line each, naming the file); empty means sound.
Checked: manifest.json's SHA-256 against run.json; SHA-256 and size of every file manifest.json lists
(shards, and under `files` blend.json, mixtures.json, tokenizer/ and receipts/, see exports/chain.py)
and of every file a receipt lists; each ingest part against its receipt's `input_sha256`; each `.idx` against
its `.bin` (header, size, dtype, pointers, document indices, record/token counts); each SFT shard's files
against its meta.json (documents, mask lengths and values, counts); every Parquet shard
against the manifest (rows, tokens, length bucket) and against its TSV (per row: n_tokens, token sum,
text SHA-256); that Parquet and `.bin/.idx` hold the same records per source; that mixtures.json names
only listed shards; and that no unlisted file lies in parquet/, binidx/, sft/, receipts/, tokenizer/ or
ingest/. Megatron's index cache (`PREFIX/cache/...`, written beside the data by GPTDataset), the
exports' per-part summary caches (`receipts/<ds>/*.summary`, self-checking: keyed by their receipt's
hash, recomputed when stale) and hidden temporaries are ignored; so are audit/, logs/ and rejects/ (reports, not
read by a trainer or a later stage). The checkpoints are judged as `status` judges them (status.datasets_status):
one damaged, or missing while its dataset ran, passed here while `status` and `audit` refused the run, and a re-run
restarts its dataset; and each sealed-log record against its part's receipt's `input_sha256`.
"""
from __future__ import annotations

import functools
import hashlib
import math
import os
import posixpath
from pathlib import Path
from typing import Any, Callable

import numpy as np

from streamprep import atomic, binidx, layout
from streamprep.exports import chain, summary
from streamprep.layout import NotARunDir, run_record
from streamprep.modes import receipt_mode_name
from streamprep.status import checkpoint_dir, datasets_status

TSV_HEADER = ["row", "n_tokens", "token_sum", "text_sha256"]
# how the problem of a file or folder it may not read goes on after its path (`_Checker.cannot_read`, CLOSED)
REFUSED = ": cannot read: PermissionError: "
# the problem of a folder of the run it may not list or enter, after its path
CLOSED = f"{REFUSED}a folder it may not list or enter; make it readable and searchable"


class _Checker:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.problems: list[str] = []
        self._hashes: dict[Path, str] = {}
        self._checked: set[tuple[str, int | None, str | None]] = set()

    def add(self, msg: str) -> None:
        if msg not in self.problems:  # a file checked via both a receipt and the manifest is named once
            self.problems.append(msg)

    def sha(self, path: Path) -> str:
        if path not in self._hashes:
            self._hashes[path] = atomic.sha256_file(path)
        return self._hashes[path]

    def file(self, rel: str, size: int | None, sha: str | None, what: str) -> bool:
        """Existence, size and hash of one listed file; True when it exists (and, hashed, could be read).

        A file listed twice with the same size and hash (receipt and manifest) is reported once.
        """
        path = self.run_dir / rel
        if self.closed(rel):
            return False
        if (rel, size, sha) in self._checked:
            return path.is_file()
        self._checked.add((rel, size, sha))
        if not path.is_file():
            self.add(f"{rel}: missing (listed in {what})")
            return False
        actual = path.stat().st_size
        if size is not None and actual != size:
            self.add(f"{rel}: {actual} bytes, {what} says {size}")
        if sha is None:
            return True
        # read in `guarded`: a file it may not read was a raw PermissionError, and the other files went unchecked
        if (got := self.guarded(rel, lambda: self.sha(path))) is None:
            return False
        if got != sha:
            self.add(f"{rel}: SHA-256 mismatch ({what} says {_differing(sha, got)})")
        return True

    def guarded(self, rel: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - every unreadable file is a problem to report, not a crash
            self.cannot_read(rel, exc)
            return None

    def closed(self, rel: str) -> bool:
        """Whether a folder of the run on the way to `rel` may not be entered, or `rel`, a folder, listed
        (`layout.closed_folder`): that folder is then one problem, named once, and nothing in it is looked at. A file
        in it cannot even be looked at: the first one ended `verify` with a raw PermissionError, exit 1."""
        folder = layout.closed_folder(self.run_dir / rel, self.run_dir)
        if folder is not None:
            self.add(f"{_rel(self.run_dir, folder)}{CLOSED}")
        return folder is not None

    def cannot_read(self, rel: str, exc: Exception) -> None:
        """The problem of `rel`, which `exc` kept from being read: its first line, without the run dir."""
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        first = first.replace(f"{self.run_dir}/", "")
        self.add(f"{rel}: cannot read: {type(exc).__name__}: {first[:200]}")


def _json_object(c: _Checker, rel: str, missing: str | None = None) -> dict[str, Any] | None:
    """The JSON object at `rel`, or None after reporting why not (absent only when `missing` says why)."""
    path = c.run_dir / rel
    if c.closed(rel):
        return None
    if path.is_dir():  # not ours to remove (docs/operations.md): was "missing (exports not written yet?)"
        c.add(f"{rel}: missing (a folder is in its place: remove it, then re-run the same `streamprep ingest` command)")
        return None
    if missing is not None and not path.is_file():
        c.add(f"{rel}: missing{missing}")
        return None
    obj = c.guarded(rel, lambda: atomic.read_json(path))
    if obj is not None and not isinstance(obj, dict):
        c.add(f"{rel}: not a JSON object")
        return None
    return obj


def _rel(run_dir: Path, path: Path) -> str:
    try:
        return str(path.relative_to(run_dir))
    except ValueError:
        return str(path)


def _check_binidx(c: _Checker, prefix_rel: str, num_records: int | None, num_tokens: int | None,
                  dtype: str | None, what: str) -> None:
    if c.closed(prefix_rel + ".idx"):
        return
    ds = c.guarded(prefix_rel + ".idx", lambda: binidx.IndexedDataset.open(c.run_dir / prefix_rel))
    if ds is None:
        return
    if not ds.bin_path.is_file():
        c.add(f"{prefix_rel}.bin: missing beside its .idx")
        return
    for p in ds.check():
        c.add(p.replace(str(c.run_dir) + "/", "", 1) if p.startswith(str(c.run_dir)) else p)
    if dtype is not None and str(ds.dtype) != dtype:
        c.add(f"{prefix_rel}.idx: token dtype {ds.dtype}, {what} says {dtype}")
    if num_records is not None and len(ds) != num_records:
        c.add(f"{prefix_rel}.idx: {len(ds)} sequences, {what} says {num_records} records")
    if num_tokens is not None and int(ds.lengths.astype(np.int64).sum()) != num_tokens:
        c.add(f"{prefix_rel}.idx: {int(ds.lengths.astype(np.int64).sum())} tokens, {what} says {num_tokens}")


def _differing(said: str, actual: str) -> str:
    """'SAID…, file is ACTUAL…' with prefixes long enough to differ (12 hex digits, or up to 4 past the first
    that differs: two equal 12-digit prefixes read as no mismatch at all)."""
    n = max(12, next((i for i, (a, b) in enumerate(zip(said, actual)) if a != b), len(said)) + 4)
    return f"{said[:n]}…, file is {actual[:n]}…"


def _check_receipt(c: _Checker, rel: str, rec: dict[str, Any], fingerprint: str | None, listed: set[str]) -> None:
    if rec.get("status") != "completed":
        c.add(f"{rel}: status {rec.get('status')!r}, not completed")
        return
    if fingerprint and rec.get("tokenizer_fingerprint") not in (None, fingerprint):
        c.add(f"{rel}: tokenizer fingerprint {rec.get('tokenizer_fingerprint')} differs from the manifest's")
    files = rec.get("files") or {}
    stats = rec.get("stats") or {}
    part = f"ingest/{rec['dataset']}/{rec['part']}.jsonl"
    listed.add(part)
    c.file(part, None, rec.get("input_sha256"), f"{rel} input_sha256")
    for f in files.values():
        listed.add(f["path"])
        c.file(f["path"], f.get("bytes"), f.get("sha256"), rel)
    if receipt_mode_name(rec) == "sft":
        _check_sft(c, rel, {f["path"] for f in files.values()})
    elif set(files) == {"bin", "idx"}:
        prefix = files["idx"]["path"][:-len(".idx")]
        if files["bin"]["path"] != prefix + ".bin":
            c.add(f"{rel}: bin and idx paths do not share a prefix")
        elif not c.closed(files["idx"]["path"]) and (c.run_dir / files["idx"]["path"]).is_file():
            _check_binidx(c, prefix, stats.get("num_documents"), stats.get("num_tokens"), rec.get("dtype"), rel)
    elif files:
        c.add(f"{rel}: lists files {sorted(files)}, expected bin and idx")

    elif stats.get("num_documents", 0):
        c.add(f"{rel}: {stats['num_documents']} documents but no files")


def _check_sft(c: _Checker, rel: str, paths: set[str]) -> None:
    """SFT shards: every .idx sound against its .bin, and each shard's files against its meta.json."""
    for idx in sorted(p for p in paths if p.endswith(".idx")):
        prefix = idx[:-len(".idx")]
        if prefix + ".bin" not in paths:
            c.add(f"{rel}: lists {idx} without its .bin")
            continue
        _check_binidx(c, prefix, None, None, None, rel)
    for meta in sorted(p for p in paths if p.endswith(".meta.json")):
        obj = _json_object(c, meta) if not c.closed(meta) and (c.run_dir / meta).is_file() else None  # a missing one is reported already
        if obj is not None:
            try:
                _check_sft_shard(c, meta, obj, paths)
            except (KeyError, TypeError, AttributeError, ValueError) as exc:
                c.add(f"{meta}: malformed meta.json ({type(exc).__name__}: {exc})")


def _check_sft_shard(c: _Checker, meta_rel: str, meta: dict[str, Any], paths: set[str]) -> None:
    """One SFT shard's files against what its meta.json says of them: a trainer pairs document i of every file
    and token j of a sequence with token j of its loss mask, whatever the mask is named (`mask_key`)."""
    for key, entry in meta["keys"].items():
        files: dict[str, tuple[str, binidx.IndexedDataset]] = {}
        for kind in ("sequence", "loss_mask", "value"):
            if kind not in entry:
                continue
            prefix = posixpath.join(posixpath.dirname(meta_rel), entry[kind]["prefix"])
            if prefix + ".idx" not in paths:
                c.add(f"{meta_rel}: names {prefix}.idx for {key!r}, which its receipt does not list")
                continue
            ds = c.guarded(prefix + ".idx", lambda p=prefix: binidx.IndexedDataset.open(c.run_dir / p))
            if ds is None or not ds.bin_path.is_file():
                continue
            files[kind] = (prefix, ds)
            if str(ds.dtype) != entry[kind]["dtype"]:
                c.add(f"{prefix}.idx: dtype {ds.dtype}, {meta_rel} says {entry[kind]['dtype']}")
            if len(ds.doc_indices) - 1 != meta["documents"]:
                c.add(f"{prefix}.idx: {len(ds.doc_indices) - 1} documents, {meta_rel} says {meta['documents']}")
        if "sequence" in files:
            prefix, seq = files["sequence"]
            tokens = int(seq.lengths.astype(np.int64).sum())
            if (len(seq), tokens) != (entry["sequence"]["sequences"], entry["sequence"]["tokens"]):
                c.add(f"{prefix}.idx: {len(seq)} sequences of {tokens} tokens, {meta_rel} says "
                      f"{entry['sequence']['sequences']} of {entry['sequence']['tokens']}")
        if "loss_mask" in files:
            prefix, mask = files["loss_mask"]
            if "sequence" in files and not (np.array_equal(files["sequence"][1].lengths, mask.lengths)
                                            and np.array_equal(files["sequence"][1].doc_indices, mask.doc_indices)):
                c.add(f"{prefix}: loss mask lengths differ from the sequence lengths ({files['sequence'][0]})")
            values = c.guarded(prefix + ".bin", mask.tokens)  # uint8 0/1 (`mask_dtype: bool` is stored so too)
            trained = int(values.sum(dtype=np.int64)) if values is not None else entry["loss_mask"]["trained_tokens"]
            if values is not None and len(values) and int(values.max()) > 1:
                c.add(f"{prefix}.bin: loss mask holds values other than 0 and 1")
            elif trained != entry["loss_mask"]["trained_tokens"]:
                c.add(f"{prefix}.bin: {trained} trained tokens, {meta_rel} says {entry['loss_mask']['trained_tokens']}")
        if "value" in files:
            prefix, value = files["value"]
            count = int(value.lengths.astype(np.int64).sum())
            if count != entry["value"]["values"]:
                c.add(f"{prefix}.idx: {count} values, {meta_rel} says {entry['value']['values']}")


def _check_receipts(c: _Checker, fingerprint: str | None, signed: dict[str, tuple[Any, Any]]) -> set[str]:
    """Every receipt's files; returns the relative paths of the .bin/.idx they list. A receipt whose bytes differ
    from what manifest.json signed (`signed`: path -> (SHA-256, size)) is that one problem (`_check_files` names
    it): its hashes are not held against the files it lists, which were reported damaged with the receipt's digits."""
    listed: set[str] = set()
    folder = c.run_dir / layout.RECEIPTS
    for path in sorted(folder.rglob("*.json")) if folder.is_dir() and _open_folders(c, layout.RECEIPTS, None) else []:
        rel = _rel(c.run_dir, path)
        rec = _json_object(c, rel)
        if rec is None:
            continue
        try:
            if rel in signed and c.guarded(rel, functools.partial(chain.digest, c.run_dir, rel)) != signed[rel]:
                listed.update([f"ingest/{rec['dataset']}/{rec['part']}.jsonl",
                               *(f["path"] for f in (rec.get("files") or {}).values())])
                continue
            _check_receipt(c, rel, rec, fingerprint, listed)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            c.add(f"{rel}: malformed receipt ({type(exc).__name__}: {exc})")
    return listed


def _read_tsv(c: _Checker, rel: str) -> list[list[str]] | None:
    path = c.run_dir / rel
    if not path.is_file():
        return None
    lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if not lines or lines[0].split("\t") != TSV_HEADER:
        c.add(f"{rel}: header is not {chr(9).join(TSV_HEADER)!r}")
        return None
    rows = [ln.split("\t") for ln in lines[1:]]
    for i, r in enumerate(rows):
        if len(r) != 4 or r[0] != str(i):
            c.add(f"{rel}: line {i + 2} is not row {i} with 4 fields")
            return None
    return rows


def _bucket_range(buckets: list[dict[str, Any]], b: int) -> tuple[int, float]:
    for entry in buckets:
        if entry.get("id") == b:
            hi = entry.get("max_tokens")
            return int(entry.get("min_tokens", 1)), (math.inf if hi is None else int(hi))
    return 1, math.inf


def _check_parquet(c: _Checker, entry: dict[str, Any], buckets: list[dict[str, Any]]) -> tuple[int, int] | None:
    import pyarrow.parquet as pq

    rel = entry["path"]
    ok = c.file(rel, entry.get("size_bytes"), entry.get("file_sha256"), layout.MANIFEST)
    tsv_entry = entry.get("tsv") or {}
    tsv_rows = None
    if tsv_entry.get("path"):
        if c.file(tsv_entry["path"], tsv_entry.get("size_bytes"), tsv_entry.get("file_sha256"), layout.MANIFEST):
            tsv_rows = _read_tsv(c, tsv_entry["path"])
            if tsv_rows is not None and len(tsv_rows) != entry.get("num_records"):
                c.add(f"{tsv_entry['path']}: {len(tsv_rows)} rows, manifest.json says {entry.get('num_records')}")
    else:
        c.add(f"{rel}: manifest.json lists no TSV beside it")
    if not ok:
        return None
    pf = c.guarded(rel, lambda: pq.ParquetFile(c.run_dir / rel))
    if pf is None:
        return None
    if pf.metadata.num_rows != entry.get("num_records"):
        c.add(f"{rel}: {pf.metadata.num_rows} rows, manifest.json says {entry.get('num_records')}")
    lo, hi = _bucket_range(buckets, entry.get("bucket"))

    def scan() -> tuple[int, int]:
        row, tokens, bad_bucket, bad_tsv = 0, 0, 0, None
        for batch in pf.iter_batches(batch_size=4096, columns=["text", "tokens", "n_tokens"]):
            texts = batch.column(0).to_pylist()
            lists = batch.column(1)
            offs = lists.offsets.to_numpy()
            values = lists.values.to_numpy(zero_copy_only=False).astype(np.int64)
            n_tok = batch.column(2).to_numpy(zero_copy_only=False)
            lengths = np.diff(offs)
            if (lengths != n_tok).any():
                c.add(f"{rel}: n_tokens disagrees with the tokens list near row {row}")
            bad_bucket += int(((n_tok < lo) | (n_tok > hi)).sum())
            sums = np.add.reduceat(values, offs[:-1]) if len(values) else np.zeros(len(texts), np.int64)
            sums = np.where(lengths > 0, sums, 0)
            if tsv_rows is not None and bad_tsv is None:
                for i, text in enumerate(texts):
                    r = row + i
                    if r >= len(tsv_rows):
                        bad_tsv = r
                        break
                    sha = hashlib.sha256((text or "").encode("utf-8")).hexdigest()
                    if tsv_rows[r][1:] != [str(int(n_tok[i])), str(int(sums[i])), sha]:
                        bad_tsv = r
                        break
            row += len(texts)
            tokens += int(n_tok.sum(dtype=np.int64))
        if bad_bucket:
            c.add(f"{rel}: {bad_bucket} row(s) outside bucket {entry.get('bucket')} ({lo}..{hi} tokens)")
        if bad_tsv is not None:
            c.add(f"{tsv_entry['path']}: row {bad_tsv} does not match {rel}")
        if tokens != entry.get("num_tokens"):
            c.add(f"{rel}: {tokens} tokens, manifest.json says {entry.get('num_tokens')}")
        return row, tokens

    return c.guarded(rel, scan)


UNLISTED_SCAN = ((layout.PARQUET, "*"), (layout.BINIDX, "*/*"), (layout.SFT, "**/*"), (layout.RECEIPTS, "**/*"),
                 (layout.TOKENIZER, "**/*"), (layout.INGEST, "*/*"))
TOKENIZED = (layout.INGEST, layout.BINIDX, layout.SFT)  # <top>/<ds>/part-NNNNN…: a part and what its receipt lists


def _open_folders(c: _Checker, top: str, depth: int | None) -> bool:
    """Whether `top` may be listed; each folder it holds (not hidden, to `depth` levels of folders listed in all, None:
    every level) that may not be listed or entered is named (`_Checker.closed`): a glob passes over one in silence,
    and its files went unchecked, or were called stale for want of the receipts in it."""
    if c.closed(top):
        return False
    for root, dirs, _ in os.walk(c.run_dir / top):
        level = len(Path(root).relative_to(c.run_dir / top).parts) + 1
        dirs[:] = [d for d in dirs if not d.startswith(".") and (depth is None or level < depth)
                   and not c.closed(_rel(c.run_dir, Path(root) / d))]
    return True


def _receipt_unread(c: _Checker, rel: str, listed: set[str]) -> bool:
    """Whether `rel` is a part's file (an ingest part, a shard) whose receipt, the file that lists it, it could not go
    by: one it may not read (or in a folder it may not enter or list), or one manifest.json lists that is missing or
    named above as damaged. Then it cannot be told stale, and it was, with the advice to delete it: the part's data,
    which the receipt lists once readable, or once the same `streamprep ingest` command has written it again."""
    parts = Path(rel).parts
    if len(parts) < 3 or parts[0] not in TOKENIZED or not parts[2].startswith("part-"):
        return False
    receipt = layout.RunLayout(c.run_dir).receipt(parts[1], parts[2][:len(layout.part_name(0))])
    signed = _rel(c.run_dir, receipt)
    return c.closed(signed) or (os.path.lexists(receipt) and not os.access(receipt, os.R_OK)) or (
        signed in listed and any(p.startswith(f"{signed}: ") for p in c.problems))


def _check_unlisted(c: _Checker, listed: set[str]) -> None:
    # Our files sit at parquet/<file>, binidx/<dataset>/<file>, ingest/<dataset>/<file>; deeper under
    # binidx/ is Megatron's PREFIX/cache/GPTDataset_indices/..., not ours. Hidden names are temporaries.
    for top, pattern in UNLISTED_SCAN:
        folder = c.run_dir / top
        depth = None if "**" in pattern else pattern.count("/") + 1
        for path in sorted(folder.glob(pattern)) if folder.is_dir() and _open_folders(c, top, depth) else []:
            rel = _rel(c.run_dir, path)
            if path.is_file() and not any(part.startswith(".") for part in path.relative_to(folder).parts) \
                    and path.suffix != summary.SUFFIX and rel not in listed and not _receipt_unread(c, rel, listed):
                c.add(f"{rel}: not listed in manifest.json or any receipt (stale file?)")


def _check_mixtures(c: _Checker, shard_ids: set[str], listed: set[str]) -> None:
    if layout.MIXTURES in listed and not (c.run_dir / layout.MIXTURES).is_file():
        return  # manifest.json lists it: `_check_files` named it missing (a second line said it again)
    mix = _json_object(c, layout.MIXTURES, missing="")
    if mix is None:
        return
    for name, src in (mix.get("sources") or {}).items():
        for sid in list(src.get("shards", [])) + list(src.get("binidx", [])):
            if sid not in shard_ids:
                c.add(f"mixtures.json: source {name!r} names shard {sid!r}, which manifest.json does not list")
    for phase in mix.get("phases") or []:
        weights = phase.get("weights") or {}
        if weights and abs(math.fsum(weights.values()) - 1.0) > 1e-9:
            c.add(f"mixtures.json: phase {phase.get('name')!r} weights do not sum to 1")


def _check_entry(c: _Checker, entry: dict[str, Any], buckets: list[dict[str, Any]], listed: set[str],
                 shard_ids: set[str], per_source: dict[str, dict[str, list[int]]]) -> None:
    shard_ids.add(entry.get("shard_id"))
    agg = per_source.setdefault(entry.get("source"), {"parquet": [0, 0], "binidx": [0, 0]})
    if entry.get("kind") == "parquet":
        listed.add(entry["path"])
        listed.add((entry.get("tsv") or {}).get("path", ""))
        _check_parquet(c, entry, buckets)
        agg["parquet"][0] += entry.get("num_records", 0)
        agg["parquet"][1] += entry.get("num_tokens", 0)
    elif entry.get("kind") == "binidx":
        files = entry.get("files") or {}
        for kind in ("bin", "idx"):
            f = files.get(kind)
            if f is None:
                c.add(f"manifest.json: {entry.get('shard_id')} lists no .{kind} file")
                continue
            listed.add(f["path"])
            c.file(f["path"], f.get("size_bytes"), f.get("file_sha256"), layout.MANIFEST)
        if not c.closed(entry["path"] + ".idx") and (c.run_dir / (entry["path"] + ".idx")).is_file():
            _check_binidx(c, entry["path"], entry.get("num_records"), entry.get("num_tokens"),
                          entry.get("dtype"), layout.MANIFEST)
        agg["binidx"][0] += entry.get("num_records", 0)
        agg["binidx"][1] += entry.get("num_tokens", 0)
    else:
        c.add(f"manifest.json: shard {entry.get('shard_id')!r} has unknown kind {entry.get('kind')!r}")


NOT_COMPLETE = "run.json: status "   # how the one line about an unfinished run starts (commands/verify.py)


def _check_root(c: _Checker) -> bool:
    """run.json: a completed run recording manifest.json's SHA-256 (the root of the chain). False for a run that has
    not finished: its receipts, tokenizer and parts are not listed yet, and each was reported as a stale file for the
    user to delete (run.json among them), which killed a live job and threw away a crashed one's receipts."""
    record = _json_object(c, layout.RUN_JSON, missing=" (it records manifest.json's SHA-256, the root of the hash chain)")
    if record is None:
        return True
    if record.get("status") != "complete":
        if record.get("status") == "failed" and record.get("needs_change") is True:  # exit 2: a re-run ends the same
            c.add(f"{NOT_COMPLETE}'failed', not complete: it stopped on an error re-running as is cannot get past "
                  f"(`streamprep status` shows it); fix what it names and re-run, or start over with a new --run-dir")
            return False
        c.add(f"{NOT_COMPLETE}{record.get('status')!r}, not complete: the run is under way or stopped before its end "
              f"(`streamprep status` says which); verify checks a finished run: re-run the same `streamprep ingest` "
              f"command to finish it")
        return False
    if not record.get("manifest_sha256"):
        c.add("run.json: records no manifest_sha256 (written before the hash chain existed?)")
    elif not isinstance(record["manifest_sha256"], str):
        c.add("run.json: manifest_sha256 is not a SHA-256 string")
    elif (c.run_dir / layout.MANIFEST).is_file():
        c.file(layout.MANIFEST, None, record["manifest_sha256"], layout.RUN_JSON)
    return True


def _check_files(c: _Checker, entries: Any, listed: set[str], receipts: bool = True) -> None:
    """manifest.json `files`: blend.json, mixtures.json, tokenizer/ and receipts/ (exports/chain.py); the receipts
    not when the manifest is itself damaged (`receipts` False): each was checked against its own hashes."""
    if not isinstance(entries, list) or not entries:
        c.add("manifest.json: lists no `files` (blend.json, mixtures.json, tokenizer/, receipts/ are unprotected)")
        return
    for entry in entries:
        rel = entry["path"]
        listed.add(rel)
        if not receipts and rel.startswith(f"{layout.RECEIPTS}/"):
            continue
        if bool(entry.get("run_dir_relative")) != (rel in chain.RUN_DIR_RELATIVE):
            c.add(f"manifest.json: {rel} has the wrong run_dir_relative flag")
        if c.closed(rel):
            continue
        if not (c.run_dir / rel).is_file():
            c.add(f"{rel}: missing (listed in manifest.json)")
            continue
        got = c.guarded(rel, lambda: chain.digest(c.run_dir, rel))
        if got is None:
            continue
        sha, size = got
        moved = chain.moved_from(c.run_dir, rel, entry.get("sha256")) if rel in chain.RUN_DIR_RELATIVE else None
        if moved is not None:
            c.add(f"{rel}: names its shards under {moved}, not this run dir (copied or moved since): re-running the "
                  f"same `streamprep ingest` command here rewrites it")
        elif size != entry.get("size_bytes") or sha != entry.get("sha256"):
            shown = _differing(str(entry.get("sha256")), sha).split("…, file is ")
            c.add(f"{rel}: content differs from manifest.json ({size} bytes, SHA-256 {shown[1]}; "
                  f"manifest.json says {entry.get('size_bytes')} bytes, {shown[0]}…)")


def _check_checkpoints(c: _Checker, signed: dict[str, tuple[Any, Any]]) -> None:
    """The datasets' checkpoints (and receipts' shapes) as `status` reads them, its one line if it refuses them,
    unless a receipt's own check above named the damage (one problem, not two lines for one file); then their
    sealed logs' records (`_check_sealed`)."""
    try:
        record = run_record(c.run_dir)
    except NotARunDir:  # no run.json, or one without its config: reported above, and nothing names the datasets
        return
    try:
        datasets_status(c.run_dir, record)
    except NotARunDir as exc:
        if not any(p.startswith(f"{layout.RECEIPTS}/") for p in c.problems):
            c.add(str(exc))
        return
    except OSError as exc:  # a checkpoint, sealed log or receipt it may not read: one problem, the rest still checked
        if exc.filename is None:
            raise
        if not c.closed(rel := _rel(c.run_dir, Path(os.fsdecode(exc.filename)))):
            c.cannot_read(rel, exc)
        return
    _check_sealed(c, record, signed)


def _check_sealed(c: _Checker, record: dict[str, Any], signed: dict[str, tuple[Any, Any]]) -> None:
    """Each sealed-log record's SHA-256 against its part's receipt's `input_sha256` (which the part is checked
    against): a flipped byte in a record passed as "all files match", and the resume that hashes that part
    (`tokenize._check_input`) then failed blaming the intact part. A receipt that differs from what manifest.json
    signed (`signed`) is that problem, not the log's."""
    ckpt_dir = layout.CheckpointLayout(checkpoint_dir(c.run_dir, record))
    run = layout.RunLayout(c.run_dir)
    for name in (d["name"] for d in record["config"]["datasets"]):
        ckpt = layout.Checkpoint.load(ckpt_dir.checkpoint(name))
        # the file holding the records: an earlier streamprep's checkpoint lists them itself (no sealed log until a
        # resume moves the list into one): the line named the log, which did not exist, and the re-run did nothing
        held = _rel(c.run_dir, ckpt_dir.checkpoint(name) if ckpt.listed else ckpt_dir.sealed_log(name))
        where = " in its `sealed` list" if ckpt.listed else ""
        for i, (sha, _size) in enumerate(ckpt.raw.get("sealed") or []):
            rel = _rel(c.run_dir, run.receipt(name, i))
            rec = layout.read_json(c.run_dir / rel)
            said = rec.get("input_sha256") if isinstance(rec, dict) else None
            if not isinstance(said, str) or said == sha or (
                    rel in signed and c.guarded(rel, functools.partial(chain.digest, c.run_dir, rel)) != signed[rel]):
                continue
            shown = _differing(sha, said).split("…, file is ")
            c.add(f"{held}: the record of {layout.part_name(i)}{where} says SHA-256 {shown[0]}…, its receipt {rel} "
                  f"says {shown[1]} (the part is checked against the receipt): delete {held} and re-run the same "
                  f"`streamprep ingest` command, which ingests dataset {name} again")


def verify_run(run_dir: str | Path) -> list[str]:
    """All problems found in the run directory's outputs; an empty list means every check passed."""
    c = _Checker(Path(run_dir))
    if not _check_root(c):
        return c.problems
    finished = not c.problems and (c.run_dir / layout.RUN_JSON).is_file()  # run.json says complete, names the root
    man = _json_object(c, layout.MANIFEST, missing=" (run.json says the run is complete: re-run the same `streamprep "
                       "ingest` command to write it again)" if finished else " (exports not written yet?)")
    if man is not None and man.get("format") != "streamprep-manifest":
        c.add("manifest.json: not a streamprep manifest")
        man = None
    shapes = {"tokenizer": dict, "files": list, "shards": list, "buckets": list}
    for key, kind in shapes.items() if man is not None else ():
        if man.get(key) is not None and not isinstance(man[key], kind):  # each is read as its kind below
            c.add(f"manifest.json: `{key}` is not a {'JSON object' if kind is dict else 'list'}")
            man = {**man, key: None}
    fingerprint = ((man or {}).get("tokenizer") or {}).get("fingerprint")
    # a manifest run.json's hash refuses is no judge of the receipts: each is checked against its own hashes then
    trusted = not any(p.startswith(f"{layout.MANIFEST}: ") for p in c.problems)
    entries = (man or {}).get("files") if trusted else None
    signed = {e["path"]: (e.get("sha256"), e.get("size_bytes")) for e in entries
              if isinstance(e, dict) and isinstance(e.get("path"), str)} if isinstance(entries, list) else {}
    listed = _check_receipts(c, fingerprint, signed)
    _check_checkpoints(c, signed)

    if man is not None:
        try:
            _check_files(c, man.get("files"), listed, receipts=trusted)
        except (KeyError, TypeError, AttributeError) as exc:
            c.add(f"manifest.json: `files` is malformed ({type(exc).__name__}: {exc})")
        buckets = man.get("buckets") or []
        per_source: dict[str, dict[str, list[int]]] = {}
        shard_ids: set[str] = set()
        for n, entry in enumerate(man.get("shards") or []):
            try:
                _check_entry(c, entry, buckets, listed, shard_ids, per_source)
            except (KeyError, TypeError, AttributeError, ValueError) as exc:
                c.add(f"manifest.json: shards[{n}] is malformed ({type(exc).__name__}: {exc})")
        for source, agg in sorted(per_source.items(), key=lambda kv: str(kv[0])):
            if agg["parquet"] != agg["binidx"]:
                c.add(f"manifest.json: source {source!r} has {agg['parquet'][0]} records / {agg['parquet'][1]} tokens "
                      f"in Parquet but {agg['binidx'][0]} / {agg['binidx'][1]} in .bin/.idx")
        try:
            _check_mixtures(c, shard_ids, listed)
        except (KeyError, TypeError, AttributeError, ValueError) as exc:  # an edit of the wrong shape: was a crash
            c.add(f"mixtures.json: is malformed ({type(exc).__name__}: {exc})")
        _check_unlisted(c, listed)  # (without a manifest every Parquet shard, receipt and tokenizer file was "stale")
    return c.problems

