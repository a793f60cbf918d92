"""`streamprep status RUN_DIR`: where a run stands, read-only and safe while the run is in progress.

Reads run.json, the checkpoints and the receipts (all replaced atomically by the run, so a read sees a
whole old or a whole new file) and finds whether a process holds the run lock without taking it:
through /proc/locks where available; only when that cannot tell (no /proc, or a lock file left with a
holder record) does it fall back to a brief non-blocking *shared* flock test. Nothing is written.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from streamprep.checkpoints import read_checkpoint
from streamprep.config import printable, resolved_workers
from streamprep.layout import RunLayout, completed_receipt, damaged_record, read_json, run_record
from streamprep.lock import holder_if_running, read_holder
from streamprep.sources.hf import manifest_sizes


def _proc_locks_holder(lock_path: Path) -> tuple[bool, int | None]:
    """(could_tell, pid) from /proc/locks: a FLOCK entry on the lock file's device:inode."""
    try:
        st = lock_path.stat()
        text = Path("/proc/locks").read_text()
    except OSError:
        return False, None
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in text.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 18552 fe:00:2152208 0 EOF" (blocked waiters carry "->" first)
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == want and fields[3] == "WRITE":
            try:
                return True, int(fields[4])
            except ValueError:
                return True, None
    return True, None


def lock_holder(run_dir: Path) -> dict[str, Any] | None:
    """The live lock holder's {pid, host, started} or None; never blocks nor disturbs the holder."""
    path = RunLayout(run_dir).lock
    if not path.exists():
        return None
    could_tell, pid = _proc_locks_holder(path)
    record = read_holder(path)
    if could_tell and pid is not None:
        return {**record, "pid": record.get("pid") or pid}
    if could_tell and not record:
        return None  # released cleanly (the holder record is cleared on release) and nobody holds it
    # No /proc/locks, or a holder record left behind (killed run, or a filesystem /proc/locks does not
    # match): a non-blocking shared-lock probe decides; it is released at once.
    return holder_if_running(RunLayout(run_dir).lock)


def checkpoint_dir(run_dir: Path, record: dict[str, Any]) -> Path:
    """run.json's `checkpoint_dir`, or RUN_DIR/checkpoints when that path is gone (a moved run dir)."""
    return RunLayout(run_dir).checkpoints(record)


def _bytes_in(ck: dict[str, Any], sizes: list[int] | None) -> int | None:
    """Source bytes the checkpoint's position has passed: the files before its file, plus its byte offset in it
    (local files). A dataset read to its end has passed every file; one a cap (`max_records`, `size_mb`) ended
    only the units before its position, not the files it never read. None when the file sizes are not known."""
    if not sizes:
        return None
    pos = ck.get("position") or {}
    i = int(pos.get("file", 0))
    off = pos.get("offset")
    return sum(sizes[:i]) + (min(int(off), sizes[i]) if isinstance(off, int) and i < len(sizes) else 0)


def _source_sizes(run_dir: Path, ck: dict[str, Any], entry: dict[str, Any] | None) -> list[int] | None:
    """Input file sizes in read order: the dataset's input identities (local), or the hf:// manifest."""
    inputs = ck.get("inputs")
    files = (inputs if isinstance(inputs, dict) else {}).get("files")
    if isinstance(files, list) and files and all(isinstance(f, dict) for f in files):
        return [int(f.get("size") or 0) for f in files]
    sha = (ck.get("position") or {}).get("revision")
    if entry and str(entry.get("path", "")).startswith("hf://") and sha:
        return manifest_sizes(RunLayout(run_dir).hf_cache, entry, sha)
    return None


def _numbered(folder: Path, suffix: str) -> list[tuple[int, Path]]:
    """The `part-NNNNN<suffix>` files in `folder`, with their part numbers. Listed with `iterdir`, which raises on a
    folder it may not list: a glob saw it empty, and a complete run whose receipts/<ds> was `chmod 000` was COMPLETE
    with no shard tokenized."""
    found = []
    for path in folder.iterdir() if folder.is_dir() else ():
        if path.name.startswith("part-") and path.name.endswith(suffix) \
                and path.name[len("part-"):-len(suffix)].isdigit():
            found.append((int(path.name[len("part-"):-len(suffix)]), path))
    return sorted(found)


def _dataset_status(run_dir: Path, ckpt_dir: Path, name: str, record: dict[str, Any],
                    entry: dict[str, Any] | None = None) -> dict[str, Any]:
    """One dataset's counters from its saved checkpoint (the metrics endpoint's too: what a resume carries over).
    Not `tokenized` before the run's tokenizer is made (fingerprint.json, written last): a dataset with no shard is
    not done then."""
    layout = RunLayout(run_dir)
    cp = read_checkpoint(run_dir, ckpt_dir, name, record)
    ck = cp.raw
    started, done = cp.started, cp.done
    part_index, part_lines, planned = cp.part_index, cp.part_lines, cp.planned_parts
    shards_done = tokens = docs = empty = dropped = 0
    for i, path in _numbered(layout.receipts_dir / name, ".json"):
        rec = completed_receipt(path) if i < planned else None
        if rec is not None:
            st = rec.get("stats") or {}
            shards_done += 1
            tokens += int(st.get("num_tokens", 0))
            docs += int(st.get("num_documents", 0))
            empty += len(st.get("dropped_empty") or [])
            dropped += sum(int(n) for n in ((st.get("sft") or {}).get("dropped") or {}).values())
    rejected = int(ck.get("rejected", 0))
    if not started:
        stage = "pending"
    elif not done:
        stage = "ingest"
    elif shards_done < planned or not layout.tokenizer_fingerprint.is_file():
        stage = "tokenize"
    else:
        stage = "tokenized"
    return {
        "stage": stage,
        "ingest": {"started": started, "done": done, "read": int(ck.get("consumed", 0)), "kept": int(ck.get("kept", 0)),
                   "rejected": rejected, "rejects_by_check": dict((ck.get("stats") or {}).get("rejects_by_check") or {}),
                   "parts": part_index + (1 if part_lines else 0), "parts_sealed": planned, "bytes": cp.ingest_bytes,
                   "bytes_in": _bytes_in(ck, _source_sizes(run_dir, ck, entry)),
                   "updated_at": ck.get("updated_at") or None},
        "tokenize": {"shards_planned": planned, "planned_final": done, "shards_done": shards_done,
                     "shards_pending": planned - shards_done, "tokens": tokens, "documents": docs,
                     "empty_tokens": empty, "sft_dropped": dropped},
    }


def datasets_status(run_dir: Path, record: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each dataset's `_dataset_status`, by name. A checkpoint or receipt of the wrong shape (or not JSON), or a
    checkpoint missing from a complete run whose dataset ran, raises `damaged_record`: `status` and `verify` judge
    a run's records with this one check."""
    ckpt_dir = checkpoint_dir(run_dir, record)
    entries = {d["name"]: d for d in record["config"]["datasets"]}
    try:
        return {n: _dataset_status(run_dir, ckpt_dir, n, record, entries[n]) for n in entries}
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:  # a checkpoint or receipt of the wrong shape
        raise damaged_record(run_dir, exc) from None


def finished_audit(run_dir: Path, audit: Any, record: Any) -> bool:
    """Whether `audit` (audit/audit.json as read) is the finished run's own report: gathered from run.json's last
    complete attempt (its run_id and finished_at), with its audit.html. A report of a partial run (`streamprep audit`
    mid-run) or of an earlier attempt, or one a stop or kill cut short, is not: it must not stand for the run's."""
    run = audit.get("run") if isinstance(audit, dict) else None
    return (isinstance(record, dict) and record.get("status") == "complete" and isinstance(run, dict)
            and run.get("status") == "complete" and run.get("run_id") == record.get("run_id")
            and run.get("finished_at") == record.get("finished_at")
            and RunLayout(run_dir).audit_json.with_name("audit.html").is_file())


def run_state(run_dir: Path, record: dict[str, Any]) -> tuple[str, str | None, dict[str, Any] | None]:
    """(state, resumable_reason, lock holder): run.json's status judged against the run lock, since a run killed
    (kill -9, power loss) leaves run.json saying `running` with nobody holding the lock: that is `crashed`."""
    holder = lock_holder(run_dir)
    recorded = record.get("status") or "unknown"
    if holder is not None:
        return "running", None, holder
    if recorded == "complete":
        return "complete", None, None
    reason = {"interrupted": "interrupted", "failed": "failed", "running": "crashed"}.get(recorded, "partial")
    return "resumable", reason, None


def run_status(run_dir: str | Path, hub: dict[str, Any] | None = None) -> dict[str, Any]:
    """Where the run in `run_dir` stands; see docs/operations.md for the fields. Read-only.

    A running job's metrics pass `hub` (its Hub counters)."""
    run_dir = Path(run_dir)
    record = run_record(run_dir)
    ckpt_dir = checkpoint_dir(run_dir, record)
    datasets = datasets_status(run_dir, record)
    state, reason, holder = run_state(run_dir, record)
    recorded = record.get("status") or "unknown"
    stuck = holder is None and recorded == "failed" and record.get("needs_change") is True

    all_ingested = bool(datasets) and all(d["ingest"]["done"] for d in datasets.values())
    all_tokenized = all_ingested and all(d["stage"] == "tokenized" for d in datasets.values())
    layout = RunLayout(run_dir)
    exports = {"manifest": layout.manifest.is_file(), "blend": layout.blend.is_file(),
               "mixtures": layout.mixtures.is_file(),
               "audit": finished_audit(run_dir, read_json(layout.audit_json), record)}
    if not all_ingested:
        stage = "ingest"
    elif not all_tokenized:
        stage = "tokenize"
    elif not (exports["manifest"] and (exports["blend"] or not _writes_blend(record))):
        stage = "exports"
    else:
        stage = "done"

    totals = {k: sum(d["ingest"][k] for d in datasets.values())
              for k in ("read", "kept", "rejected", "bytes", "parts_sealed")}
    totals["bytes_in"] = sum(d["ingest"]["bytes_in"] or 0 for d in datasets.values())
    totals.update({k: sum(d["tokenize"][k] for d in datasets.values())
                   for k in ("shards_planned", "shards_done", "shards_pending", "tokens", "empty_tokens")})
    totals["tokenize_eta_s"] = (_tokenize_eta(run_dir, totals["shards_pending"], record.get("started_at"))
                                if holder is not None else None)
    cfg = record.get("config") or {}
    if hub is None and (saved := read_json(RunLayout(run_dir).hf_cache / "streamprep" / "hub_stats.json")):
        hub = saved if isinstance(saved, dict) else None
    workers = (cfg.get("execution") or {}).get("workers")
    return {
        "run_dir": str(run_dir.resolve()),
        "name": (cfg.get("run") or {}).get("name"),
        "run_id": record.get("run_id"),
        "config_hash": record.get("config_hash"),
        "state": state,                      # running | complete | resumable
        "resumable_reason": reason,          # interrupted | failed | crashed | partial | None
        "needs_change": stuck,               # failed on an exit-2 error: re-running as is ends the same way
        "recorded_status": recorded,         # run.json status as last written by the run
        "error": record.get("error"),
        "lock": holder,                      # {pid, host, started} while a process holds the run
        "stage": stage,                      # ingest | tokenize | exports | done (first unfinished stage)
        "created_at": record.get("created_at"),
        "started_at": record.get("started_at"),
        "updated_at": record.get("updated_at"),
        "finished_at": record.get("finished_at"),
        "timings": record.get("timings") or {},
        "checkpoint_dir": str(ckpt_dir.resolve()),  # absolute, as run_dir: not relative to the caller's cwd
        "datasets": datasets,
        "totals": totals,
        "workers": resolved_workers(workers),  # execution.workers, as the job runs it
        "hub": hub,                          # hf:// only: {retries: {cause: n}, gave_up, files, bytes}; else None
        "retries": _retries(run_dir),        # shards re-run on another node after losing theirs (all attempts)
        "outputs": exports,
        "tokenizer_backend": _backend(run_dir, record),  # {requested, name, version, check, ...} or None
    }


def _writes_blend(record: dict[str, Any]) -> bool:
    """Whether the run writes blend.json: a pretraining run does, an `sft:` run never (docs/exports.md), so its
    exports are done without one. Its config's `sft:` section decides, as `modes.mode_of` does: status does not
    import the modes, which load numpy and the SFT packages, for a read-only command."""
    return not (record.get("config") or {}).get("sft")


def _backend(run_dir: Path, record: dict[str, Any]) -> dict[str, Any] | None:
    """The tokenizer backend: run.json's record (written with the run's shards), else the one chosen with the
    tokenizer; `worker_fallback` when a shard's identity check sent a worker to HF."""
    layout = RunLayout(run_dir)
    backend = record.get("tokenizer_backend") or read_json(layout.tokenizer_backend)
    if not isinstance(backend, dict):
        return None
    fallback = read_json(layout.tokenizer_backend_fallback)
    return {**backend, "worker_fallback": fallback} if isinstance(fallback, dict) else backend


def _retries(run_dir: Path) -> int:
    """Lines of logs/retries.jsonl: one per shard the xenna engine handed to a restarted stage."""
    try:
        with open(RunLayout(run_dir).logs_dir / "retries.jsonl", "rb") as fh:
            return sum(1 for line in fh if line.strip())
    except OSError:
        return 0


def _tokenize_eta(run_dir: Path, pending: int, since: Any, recent: int = 20) -> float | None:
    """Seconds until the sealed shards are tokenized, at the rate of the last `recent` receipts written since
    `since` (run.json's `started_at`: this attempt's; None: unknown). An earlier attempt's receipts would put the
    time between the attempts into the rate (hours for a shard of a second). Parts still to be sealed by ingest are
    not counted: ingest has its own progress."""
    if not pending:
        return 0.0
    if not isinstance(since, (int, float)):
        return None
    times = sorted(t for p in RunLayout(run_dir).receipts_dir.rglob("*.json")
                   if (t := p.stat().st_mtime) >= since)[-recent:]
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return round(pending * (times[-1] - times[0]) / (len(times) - 1), 1)


# ---- human output ---------------------------------------------------------------------------------
def _n(v: int) -> str:
    return f"{v:,}"


def _mb(b: int) -> str:
    return f"{b / 1e6:.1f}"


def _when(ts: Any) -> str:
    if not isinstance(ts, (int, float)):
        return "?"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _backend_line(b: dict[str, Any]) -> str:
    line = f"tokenizer backend: {b.get('name', '?')} {b.get('version', '?')} (requested {b.get('requested', '?')}"
    check = b.get("check") or {}
    if check:
        line += f"; identity check on {check.get('texts')} texts: {'identical' if check.get('identical') else 'MISMATCH'}"
    reason = b.get("fallback_reason") or b.get("reason")
    line += f"; {reason})" if reason else ")"
    if b.get("worker_fallback"):
        wf = b["worker_fallback"]
        line += f"\n  a worker fell back to hf at shard {wf.get('shard')}: {wf.get('reason')}"
    return line


def format_status(st: dict[str, Any]) -> str:
    """A compact table of `run_status` output."""
    head = f"run {printable(st['run_dir'])}"  # a path may hold ESC or CR
    if st.get("name"):
        head += f"  (name {st['name']}, id {st.get('run_id') or '?'})"
    state = st["state"].upper()
    if st["state"] == "running":
        lock = st.get("lock") or {}
        state += f" (pid {lock.get('pid', '?')} on {lock.get('host', '?')}, since {lock.get('started', '?')})"
    elif st.get("needs_change"):
        state = "FAILED, NEEDS A CHANGE (re-running as is fails the same way)"
    elif st["state"] == "resumable":
        state += f" ({st['resumable_reason']})"
    lines = [head, f"state: {state}   stage: {st['stage']}   updated: {_when(st.get('updated_at'))}"]
    if st.get("error") and st["state"] != "complete":
        lines.append(f"last error: {printable(str(st['error']))}")  # it may name a file named with ESC or CR
    cols = ("dataset", "stage", "read", "kept", "rejected", "ingest MB", "shards", "tokens")
    rows = []
    for name, d in st["datasets"].items():
        ing, tok = d["ingest"], d["tokenize"]
        shards = f"{tok['shards_done']}/{tok['shards_planned']}" + ("" if tok["planned_final"] else "+")
        rows.append((name, d["stage"], _n(ing["read"]), _n(ing["kept"]), _n(ing["rejected"]), _mb(ing["bytes"]),
                     shards, _n(tok["tokens"])))
    t = st["totals"]
    all_final = all(d["tokenize"]["planned_final"] for d in st["datasets"].values())
    rows.append(("total", st["stage"], _n(t["read"]), _n(t["kept"]), _n(t["rejected"]), _mb(t["bytes"]),
                 f"{t['shards_done']}/{t['shards_planned']}" + ("" if all_final else "+"), _n(t["tokens"])))
    widths = [max(len(str(r[i])) for r in (cols, *rows)) for i in range(len(cols))]
    fmt = lambda r: "  ".join(str(c).ljust(w) if i < 2 else str(c).rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
    lines.append(fmt(cols))
    lines.extend(fmt(r) for r in rows[:-1])
    if len(rows) > 2:
        lines.append("  ".join("-" * w for w in widths))
        lines.append(fmt(rows[-1]))
    if t["shards_pending"]:
        eta = t.get("tokenize_eta_s")
        lines.append(f"tokenize: {t['shards_pending']} sealed part(s) pending"
                     + (f", ETA {eta:.0f} s at the recent rate" if eta is not None else ""))
    if not all_final:
        lines.append("(+ = more shards follow as ingest of that dataset seals parts)")
    if st.get("tokenizer_backend"):
        lines.append(_backend_line(st["tokenizer_backend"]))
    if st.get("retries"):
        lines.append(f"retries: {st['retries']} shard(s) re-run after losing their Ray node (logs/retries.jsonl)")
    out = st["outputs"]
    lines.append("outputs: " + "  ".join(f"{k} {'yes' if v else 'no'}" for k, v in out.items()))
    if st.get("needs_change"):
        lines.append("to go on: fix what the last error names and re-run the same command, or start over with a new "
                     "--run-dir (once the run has written output, a changed config is refused here but for the keys "
                     "only the exports read: docs/config.md, \"Resuming after a change\")")
    elif st["state"] == "resumable":
        lines.append("to resume: re-run the same `streamprep ingest --config ... --run-dir ...` command")
    elif st["state"] == "running":
        lines.append("follow it with: streamprep logs " + printable(st["run_dir"]) + " --follow")
    return "\n".join(lines)
