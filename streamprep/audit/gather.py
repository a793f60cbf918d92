"""Gathering half of the audit: read the run (through streamprep.layout) into a plain dict report.

Nothing here formats text or HTML; streamprep.audit.render does that.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import orjson

from streamprep import stats
from streamprep import backends
from streamprep.checkpoints import read_checkpoint
from streamprep.layout import (RunLayout, completed_receipt, damaged_record, part_name, read_json as _read_json,
                               run_record)
from streamprep.status import run_state
from streamprep.tokenizer import training_report


VERSION = 1
EXAMPLES_PER_REASON = 3
EXAMPLE_CHARS = 600
MAX_TOKENIZED_REJECTS = 5000   # rejected records tokenized for the token-length histogram (from the sample)
EMPTY_TOKENS = "empty_tokens"
PALETTE = ("#2e86de", "#e67e22", "#27ae60", "#8e44ad", "#c0392b", "#16a085", "#d35400", "#7f8c8d", "#2c3e50")


# ---- gathering ---------------------------------------------------------------------------------------
def _rejects_sample(path: Path, limit_bytes: int) -> list[dict[str, Any]]:
    """The rejects sample lines the checkpoint covers (a run may be appending past that point)."""
    if not limit_bytes or not path.is_file():
        return []
    with open(path, "rb") as fh:
        data = fh.read(limit_bytes)
    out = []
    for line in data.splitlines():
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


def _exact_pairs(sample: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """Up to `k` exact-duplicate rejects from the sample, each with the dataset that kept its (identical,
    normalised) text — an earlier-listed one for cross-dataset copies under `dedup_scope: run`."""
    return [{"dataset": (r.get("source") or {}).get("dataset"), "index": (r.get("source") or {}).get("index"),
             "kept_by": (r.get("meta") or {}).get("duplicate_of"), "text": str(r.get("text") or "")[:EXAMPLE_CHARS]}
            for r in sample if r.get("failed_check") == "duplicate"][:k]


def _near_pairs(run_dir: Path, sample: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """Up to `k` near-duplicate rejects from the sample, each with its kept twin's text, found by scanning
    the twin dataset's parts in order until every wanted `meta.source.index` is seen."""
    pairs = [r for r in sample if r.get("failed_check") == "near_duplicate"
             and isinstance((r.get("meta") or {}).get("near_duplicate_of"), dict)][:k]
    wanted: dict[str, set[int]] = {}
    for r in pairs:
        twin = r["meta"]["near_duplicate_of"]
        wanted.setdefault(str(twin.get("dataset")), set()).add(twin.get("index"))
    found: dict[tuple[str, int], str] = {}
    for ds, indices in wanted.items():
        for part in sorted(RunLayout(run_dir).ingest_dir(ds).glob("part-*.jsonl")):
            with open(part, "rb") as fh:
                for line in fh:
                    hit = next((i for i in indices if b'"index":%d' % i in line), None)
                    if hit is None:
                        continue
                    rec = orjson.loads(line)
                    if (rec.get("meta") or {}).get("source", {}).get("index") == hit:
                        found[(ds, hit)] = rec.get("text") or ""
                        indices = indices - {hit}
                    if not indices:
                        break
            if not indices:
                break
    out = []
    for r in pairs:
        twin = r["meta"]["near_duplicate_of"]
        text = found.get((str(twin.get("dataset")), twin.get("index")))
        out.append({"dataset": (r.get("source") or {}).get("dataset"), "index": (r.get("source") or {}).get("index"),
                    "jaccard": r["meta"].get("jaccard"), "text": str(r.get("text") or "")[:EXAMPLE_CHARS],
                    "twin": {**twin, "text": text[:EXAMPLE_CHARS] if text is not None else None}})
    return out


def _load_encoder(run_dir: Path) -> backends.Backend | None:
    """The backend the run tokenized with (run.json), over the run's tokenizer copy: gigatoken's ids are HF's
    (the run's identity check), so the histogram is the same at a twentieth of HF's CPU."""
    layout = RunLayout(run_dir)
    if not layout.tokenizer_json.is_file():
        return None
    record = _read_json(layout.run_json)
    name = ((record if isinstance(record, dict) else {}).get("tokenizer_backend") or {}).get("name")
    for candidate in dict.fromkeys(("gigatoken", "hf") if name == "gigatoken" else ("hf",)):
        try:
            return backends.load(candidate, layout.tokenizer_json)
        except Exception:  # a report must not fail on an unreadable tokenizer: HF next, or no histogram
            continue
    return None


def _dropped_examples(run_dir: Path, name: str, receipts: list[tuple[int, dict]], k: int) -> dict[str, list]:
    """Up to `k` records of each reason the tokenize stage dropped after QC kept them, read back from their ingest
    parts: `empty_tokens`, and an SFT run's shard drops as `sft:<reason>` (their receipts list the part's line)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for i, rec in receipts:
        st = rec.get("stats") or {}
        why = {int(line): (EMPTY_TOKENS, "encodes to no tokens (kept by QC)") for line in st.get("dropped_empty") or []}
        why.update({int(line): (EMPTY_TOKENS, "the tokenizer cannot encode it (HF tokenizers panics; kept by QC)")
                    for line in st.get("unencodable") or []})
        for d in (st.get("sft") or {}).get("dropped_records") or []:
            why.setdefault(int(d["line"]), (f"sft:{d['reason']}", f"dropped by the SFT shards: {d['detail']}"))
        taken = {key: len(shown) for key, shown in out.items()}
        wanted: dict[int, tuple[str, str]] = {}
        for line, (key, reason) in sorted(why.items()):
            if taken.get(key, 0) < k:
                taken[key] = taken.get(key, 0) + 1
                wanted[line] = (key, reason)
        if not wanted:
            continue
        part = RunLayout(run_dir).ingest_part(name, i)
        try:
            with open(part, "rb") as fh:
                for line_no, line in enumerate(fh):
                    if line_no in wanted:
                        doc = orjson.loads(line)
                        meta = doc.get("meta") or {}
                        key, reason = wanted[line_no]
                        out.setdefault(key, []).append(
                            {"failed_check": key, "reason": reason, "text": doc.get("text", ""),
                             "source": meta.get("source") or {"dataset": name, "part": part_name(i), "line": line_no}})
        except (OSError, orjson.JSONDecodeError):
            continue
    return out


def _completed_receipts(run_dir: Path, name: str, planned: int) -> list[tuple[int, dict]]:
    """(part index, receipt) of every planned part whose shard is complete."""
    out = []
    for i in range(planned):
        rec = completed_receipt(RunLayout(run_dir).receipt(name, i))
        if rec is not None:
            out.append((i, rec))
    return out


def _examples_by_reason(sample: list[dict[str, Any]]) -> dict[str, list]:
    """The first EXAMPLES_PER_REASON sampled rejects of each reason."""
    examples: dict[str, list] = {}
    for rec in sample:
        bucket = examples.setdefault(str(rec.get("failed_check", "unknown")), [])
        if len(bucket) < EXAMPLES_PER_REASON:
            bucket.append(rec)
    return examples


def _rejected_token_hist(encoder: backends.Backend | None, sample: list[dict[str, Any]],
                         eod: bool) -> tuple[dict[str, int], int]:
    """Token-length histogram of (up to MAX_TOKENIZED_REJECTS) sampled rejects, and how many were tokenized."""
    if encoder is None or not sample:
        return {}, 0
    texts = [r["text"] for r in sample[:MAX_TOKENIZED_REJECTS] if isinstance(r.get("text"), str)]
    try:
        lengths = encoder.encode_batch(texts)[1].tolist()
    except BaseException as exc:  # noqa: BLE001 - a tokenizers panic (on a text it cannot encode): left out
        if not backends.is_panic(exc):
            raise
        lengths = [n for t in texts if (n := _length_or_none(encoder, t)) is not None]
    hist: dict[str, Any] = {}
    for n in lengths:
        stats.add_tokens(hist, "r", n + (1 if eod else 0))
    return hist.get("tokens_hist_r", {}), len(lengths)


def _length_or_none(encoder: backends.Backend, text: str) -> int | None:
    """`text`'s id count, None when the tokenizer panics on it."""
    try:
        return int(encoder.encode_batch([text])[1][0])
    except BaseException as exc:  # noqa: BLE001
        if not backends.is_panic(exc):
            raise
        return None


def _duplicates(run_dir: Path, name: str, ck: dict[str, Any], st: dict[str, Any], qc_rejects: dict[str, int],
                sample: list[dict[str, Any]], read: int, exact: bool) -> dict[str, Any]:
    """`exact`: the run deduplicated exactly; without it no digest is kept, and the count is null, not 0."""
    dup = int(qc_rejects.get("duplicate", 0))
    near = int(qc_rejects.get("near_duplicate", 0))
    return {"rejected_as_duplicate": dup, "rate_of_read": round(dup / read, 4) if read else None,
            "unique_kept_digests": int(ck.get("dedup_count", 0)) if exact else None,
            # which dataset kept the copy: this one, or (dedup_scope: run) one listed earlier
            "kept_by": dict(sorted((st.get("duplicates_kept_by") or {}).items())),
            "exact_duplicate_examples": _exact_pairs(sample, EXAMPLES_PER_REASON),
            "rejected_as_near_duplicate": near,
            "near_rate_of_read": round(near / read, 4) if read else None,
            "near_duplicate_examples": _near_pairs(run_dir, sample, EXAMPLES_PER_REASON) if near else [],
            **_near_kept_by(name, st, near)}


def _near_kept_by(name: str, st: dict[str, Any], near: int) -> dict[str, Any]:
    """`near_kept_by`, when (`dedup_scope: run`) earlier datasets kept some near-duplicates' twins: the dataset
    that kept the twin -> near-duplicates rejected here (absent otherwise, so other runs' audits are unchanged)."""
    earlier = {str(k): int(v) for k, v in (st.get("near_duplicates_kept_by") or {}).items()}
    if not earlier:
        return {}
    here = near - sum(earlier.values())
    return {"near_kept_by": dict(sorted({**earlier, **({name: here} if here else {})}.items()))}


def _lengths(chars_kept: dict[str, int], chars_rej: dict[str, int], tokens_kept: dict[str, int],
             tokens_rej: dict[str, int], tokenized_sample: int, eod: bool) -> dict[str, Any]:
    return {
        "chars": {"kept": stats.log2_hist_rows(chars_kept), "rejected": stats.log2_hist_rows(chars_rej),
                  "kept_p50_below": stats.log2_percentile(chars_kept, 0.5),
                  "kept_p90_below": stats.log2_percentile(chars_kept, 0.9),
                  "rejected_p50_below": stats.log2_percentile(chars_rej, 0.5)},
        "tokens": {"kept": stats.log2_hist_rows(tokens_kept),
                   "rejected_sample": stats.log2_hist_rows(tokens_rej),
                   "rejected_sample_records": tokenized_sample,
                   "kept_p50_below": stats.log2_percentile(tokens_kept, 0.5),
                   "kept_p90_below": stats.log2_percentile(tokens_kept, 0.9),
                   "includes_eod": eod},
    }


def sft_dropped(rstats: list[dict[str, Any]]) -> dict[str, int]:
    """The records an SFT run's shards dropped, by reason (`no_trained_tokens`, `overlong`, ...: docs/sft.md): kept
    by QC, in no shard. Empty for a pretraining run."""
    return stats.merge_counts((s.get("sft") or {}).get("dropped") for s in rstats)


def _tokenized_checks(complete: bool, rstats: list[dict[str, Any]], kept: int, empty: int, docs: int,
                      dropped: dict[str, int], tokens_hist_kept: dict[str, int]) -> dict[str, bool | None]:
    """The checks that hold once every part of the dataset is tokenized (None before). An SFT run's documents are
    the kept records less the ones its shards dropped (`dropped`), and it keeps no token-length histogram (None)."""
    input_records = sum(int(s.get("num_input_records", 0)) for s in rstats)
    sft = any(s.get("sft") is not None for s in rstats)
    return {"tokenized_eq_kept_minus_empty": (docs == kept - empty - sum(dropped.values()) and input_records == kept)
            if complete else None,
            "tokens_hist_counts_match": (stats.hist_total(tokens_hist_kept) == docs) if complete and not sft else None}


def _density(st: dict[str, Any]) -> dict[str, Any]:
    """PII / profanity density percentiles over all, kept and rejected records."""
    return {key.removesuffix("_density"): {"all": stats.density_summary(st, key),
                                           "kept": stats.density_summary(st, key, "kept"),
                                           "rejected": stats.density_summary(st, key, "rejected")}
            for key in stats.DENSITY_KEYS}


def _dataset_audit(run_dir: Path, ckpt_dir: Path, name: str, record: dict[str, Any],
                   encoder: backends.Backend | None) -> tuple[dict[str, Any], dict[str, list]]:
    cp = read_checkpoint(run_dir, ckpt_dir, name, record)
    ck = cp.raw
    st: dict[str, Any] = ck.get("stats") or {}
    read, kept, rejected = int(ck.get("consumed", 0)), int(ck.get("kept", 0)), int(ck.get("rejected", 0))
    done, planned = cp.done, cp.planned_parts

    receipts = _completed_receipts(run_dir, name, planned)
    rstats = [r.get("stats") or {} for _, r in receipts]
    tokenized_complete = done and len(receipts) == planned
    empty = sum(len(s.get("dropped_empty") or []) for s in rstats)
    dropped = sft_dropped(rstats)
    unrendered = sum(int(((s.get("sft") or {}).get("diagnostics") or {}).get("messages_not_rendered", 0))
                     for s in rstats)  # messages a chat template left out: neither trained nor present
    docs = sum(int(s.get("num_documents", 0)) for s in rstats)
    tokens = sum(int(s.get("num_tokens", 0)) for s in rstats)
    tokens_hist_kept = stats.merge_hists(s.get("tokens_hist") for s in rstats)
    eod = any(r.get("eod_id") is not None for _, r in receipts)

    qc_rejects = dict(sorted((st.get("rejects_by_check") or {}).items(), key=lambda kv: (-kv[1], kv[0])))
    rejects_by_check = dict(qc_rejects)
    if empty:
        rejects_by_check[EMPTY_TOKENS] = empty

    # examples and the rejected token-length sample, from the bounded rejects sample
    sample = _rejects_sample(RunLayout(run_dir).rejects(name), int(ck.get("rejects_bytes", 0)))
    examples = {**_examples_by_reason(sample), **_dropped_examples(run_dir, name, receipts, EXAMPLES_PER_REASON)}
    tokens_hist_rejected, tokenized_sample = _rejected_token_hist(encoder, sample, eod)

    langs_kept, langs_rej = (stats.merge_counts([st.get(k)]) for k in ("languages_kept", "languages_rejected"))
    chars_kept, chars_rej = st.get("chars_hist_kept") or {}, st.get("chars_hist_rejected") or {}

    checks = {
        "read_eq_kept_plus_rejected": read == kept + rejected,
        "rejected_eq_sum_of_qc_reasons": rejected == sum(qc_rejects.values()),
        "chars_hist_counts_match": stats.hist_total(chars_kept) == kept and stats.hist_total(chars_rej) == rejected,
        **_tokenized_checks(tokenized_complete, rstats, kept, empty, docs, dropped, tokens_hist_kept),
    }
    out = {
        "ingest_done": done,
        "tokenization_complete": tokenized_complete,
        "records": {"read": read, "kept": kept, "rejected": rejected, "empty_tokens": empty,
                    "tokenized_documents": docs,
                    "trainable": kept - empty - sum(dropped.values()),  # what reaches the shards (operations.md)
                    "keep_rate": round(kept / read, 4) if read else None,
                    **({"sft_dropped": dropped} if dropped else {}),
                    **({"sft_messages_not_rendered": unrendered} if unrendered else {})},
        "rejects_by_check": rejects_by_check,
        "gates": stats.gate_table(st),  # what each gate did and cost on this run's data, in run order
        "rejects_after_qc": [EMPTY_TOKENS] if empty else [],
        "rejects_sampled": dict(ck.get("rejects_sampled") or {}),
        "duplicates": _duplicates(run_dir, name, ck, st, qc_rejects, sample, read,
                                  record["config"]["quality"]["dedup"] != "none"),
        "languages": {"kept": langs_kept, "rejected": langs_rej,
                      "undetected": read - sum(langs_kept.values()) - sum(langs_rej.values())},
        "lengths": _lengths(chars_kept, chars_rej, tokens_hist_kept, tokens_hist_rejected, tokenized_sample, eod),
        "density": _density(st),
        "tokens": tokens,
        "shards": {"planned": planned, "done": len(receipts), "planned_final": done,
                   "empty": sum(1 for s in rstats if not s.get("num_documents"))},
        "checks": checks,
        "_hists": {"chars_kept": chars_kept, "chars_rejected": chars_rej, "tokens_kept": tokens_hist_kept,
                   "tokens_rejected_sample": tokens_hist_rejected},
        "_stats": st,
    }
    return out, examples


def build_audit(run_dir: str | Path) -> tuple[dict[str, Any], dict]:
    """(audit dict, examples per dataset per reason). Read-only."""
    run_dir = Path(run_dir)
    record = run_record(run_dir)
    ckpt_dir = RunLayout(run_dir).checkpoints(record)
    cfg = record["config"]
    names = [d["name"] for d in cfg["datasets"]]
    encoder = _load_encoder(run_dir)
    datasets, examples = {}, {}
    try:
        for n in names:
            datasets[n], examples[n] = _dataset_audit(run_dir, ckpt_dir, n, record, encoder)
    except (ValueError, TypeError, AttributeError, OverflowError) as exc:  # a checkpoint or receipt of the wrong shape
        raise damaged_record(run_dir, exc) from None

    def total(key: str) -> int:
        return sum(d["records"][key] for d in datasets.values())

    read, kept, rejected, empty = total("read"), total("kept"), total("rejected"), total("empty_tokens")
    tokens = sum(d["tokens"] for d in datasets.values())
    merged = stats.merge_stats(d["_stats"] for d in datasets.values())
    timings = dict(record.get("timings") or {})
    ingest_s = timings.get("ingest")
    work = record.get("tokenize_work") or {}  # tokenizing runs during ingest: its own seconds, not a stage's
    ingest_bytes = sum(p.stat().st_size for p in RunLayout(run_dir).ingest_root.rglob("part-*.jsonl")) \
        if RunLayout(run_dir).ingest_root.is_dir() else 0
    throughput = {
        "ingest_records_per_s": round(read / ingest_s, 1) if ingest_s else None,
        "ingest_mb_written_per_s": round(ingest_bytes / 1e6 / ingest_s, 3) if ingest_s else None,
        "tokenize_tokens_per_s": round(work["tokens"] / work["seconds"], 1) if work.get("seconds") else None,
    }
    all_checks = [v for d in datasets.values() for v in d["checks"].values() if v is not None]
    # run.json's status, but `crashed` when it says running and nobody holds the run lock (as `streamprep status`)
    crashed = run_state(run_dir, record)[1] == "crashed"
    audit = {
        "version": VERSION,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "run": {"run_dir": str(run_dir.resolve()), "name": (cfg.get("run") or {}).get("name"),
                "run_id": record.get("run_id"), "status": "crashed" if crashed else record.get("status"), "config_hash": record.get("config_hash"),
                "started_at": record.get("started_at"), "finished_at": record.get("finished_at")},
        "complete": bool(datasets) and all(d["tokenization_complete"] for d in datasets.values()),
        "totals": {"datasets": len(datasets), "read": read, "kept": kept, "rejected": rejected, "empty_tokens": empty,
                   "tokenized_documents": total("tokenized_documents"), "trainable": total("trainable"), "tokens": tokens,
                   "ingest_bytes": ingest_bytes,
                   "rejects_by_check": stats.merge_counts(d["rejects_by_check"] for d in datasets.values()),
                   "languages_kept": stats.merge_counts([merged.get("languages_kept")]),
                   "density": {key.removesuffix("_density"): stats.density_summary(merged, key)
                               for key in stats.DENSITY_KEYS}},
        "tokens_share": {n: round(d["tokens"] / tokens, 4) if tokens else None for n, d in datasets.items()},
        "timings": timings,
        "timings_note": "seconds per stage, summed over every attempt of the run (a resumed run includes the time "
                        "of the attempts before it, except the part of a stage a kill -9 cut short)",
        "throughput": throughput,
        "tokenizer_training": training_report(run_dir),  # held-out bytes/token of a sample-trained tokenizer
        "checks": {"ok": all(all_checks), "failed": [f"{n}: {k}" for n, d in datasets.items()
                                                     for k, v in d["checks"].items() if v is False]},
        "datasets": datasets,
    }
    return audit, examples


def public_audit(audit: dict[str, Any]) -> dict[str, Any]:
    out = dict(audit)
    out["datasets"] = {n: {k: v for k, v in d.items() if not k.startswith("_")} for n, d in audit["datasets"].items()}
    return out

