"""Quality audit of a run: audit/audit.json, a self-contained audit/audit.html and a short text summary.

Figures come from what the run already keeps — the checkpoints' `stats` (streamprep.stats), the
receipts and the bounded rejects sample — so an audit costs a few file reads, works on a partial run
(it covers what has been processed so far) and never changes the run's outputs. Counts add up by
construction and are checked (`checks` in the JSON):

    read = kept + rejected                       (per dataset; rejected = sum of QC rejects_by_check)
    tokenized documents = kept - empty_tokens    (once every part of the dataset is tokenized)

`empty_tokens` are records QC kept that encoded to no tokens and were dropped at tokenization; they
appear under `rejects_by_check` next to the QC reasons, marked as dropped after QC.
"""
from __future__ import annotations

import html
import json
import time
from pathlib import Path
from typing import Any

import orjson

from streamprep import atomic, stats
from streamprep.tokenizer import training_report
from streamprep.layout import (Checkpoint, NotARunDir, RunLayout, checkpoint_file, completed_receipt, part_name,
                               read_json as _read_json)

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


def _load_tokenizer(run_dir: Path) -> Any:
    path = RunLayout(run_dir).tokenizer_json
    if not path.is_file():
        return None
    try:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(path))
    except Exception:  # a report must not fail on an unreadable tokenizer; the histogram is then omitted
        return None


def _empty_examples(run_dir: Path, name: str, receipts: list[tuple[int, dict]], k: int) -> list[dict[str, Any]]:
    """A few records dropped at tokenization, read back from their ingest parts."""
    out: list[dict[str, Any]] = []
    for i, rec in receipts:
        wanted = set((rec.get("stats") or {}).get("dropped_empty") or [])
        if not wanted:
            continue
        part = RunLayout(run_dir).ingest_part(name, i)
        try:
            with open(part, "rb") as fh:
                for line_no, line in enumerate(fh):
                    if line_no in wanted:
                        doc = orjson.loads(line)
                        meta = doc.get("meta") or {}
                        out.append({"failed_check": EMPTY_TOKENS, "reason": "encodes to no tokens (kept by QC)",
                                    "source": meta.get("source") or {"dataset": name, "part": part_name(i),
                                                                     "line": line_no},
                                    "text": doc.get("text", "")})
                        if len(out) >= k:
                            return out
        except (OSError, orjson.JSONDecodeError):
            continue
    return out


def _dataset_audit(run_dir: Path, ckpt_dir: Path, name: str, tokenizer: Any) -> tuple[dict[str, Any], dict[str, list]]:
    cp = Checkpoint.load(checkpoint_file(ckpt_dir, name))
    ck = cp.raw
    st: dict[str, Any] = ck.get("stats") or {}
    read, kept, rejected = int(ck.get("consumed", 0)), int(ck.get("kept", 0)), int(ck.get("rejected", 0))
    done, planned = cp.done, cp.planned_parts

    receipts: list[tuple[int, dict]] = []
    for i in range(planned):
        rec = completed_receipt(RunLayout(run_dir).receipt(name, i))
        if rec is not None:
            receipts.append((i, rec))
    rstats = [r.get("stats") or {} for _, r in receipts]
    tokenized_complete = done and len(receipts) == planned
    empty = sum(len(s.get("dropped_empty") or []) for s in rstats)
    docs = sum(int(s.get("num_documents", 0)) for s in rstats)
    tokens = sum(int(s.get("num_tokens", 0)) for s in rstats)
    input_records = sum(int(s.get("num_input_records", 0)) for s in rstats)
    tokens_hist_kept = stats.merge_hists(s.get("tokens_hist") for s in rstats)
    eod = any(r.get("eod_id") is not None for _, r in receipts)

    qc_rejects = dict(sorted((st.get("rejects_by_check") or {}).items(), key=lambda kv: (-kv[1], kv[0])))
    rejects_by_check = dict(qc_rejects)
    if empty:
        rejects_by_check[EMPTY_TOKENS] = empty

    # examples and the rejected token-length sample, from the bounded rejects sample
    sample = _rejects_sample(RunLayout(run_dir).rejects(name), int(ck.get("rejects_bytes", 0)))
    examples: dict[str, list] = {}
    for rec in sample:
        bucket = examples.setdefault(str(rec.get("failed_check", "unknown")), [])
        if len(bucket) < EXAMPLES_PER_REASON:
            bucket.append(rec)
    if empty:
        examples[EMPTY_TOKENS] = _empty_examples(run_dir, name, receipts, EXAMPLES_PER_REASON)
    tokens_hist_rejected: dict[str, int] = {}
    tokenized_sample = 0
    if tokenizer is not None and sample:
        texts = [r["text"] for r in sample[:MAX_TOKENIZED_REJECTS] if isinstance(r.get("text"), str)]
        for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
            stats.add_tokens(tokens_hist_rejected, "r", len(enc.ids) + (1 if eod else 0))
        tokens_hist_rejected = tokens_hist_rejected.get("tokens_hist_r", {})
        tokenized_sample = len(texts)

    langs_kept = stats.merge_counts([st.get("languages_kept")])
    langs_rej = stats.merge_counts([st.get("languages_rejected")])
    chars_kept, chars_rej = st.get("chars_hist_kept") or {}, st.get("chars_hist_rejected") or {}
    dup = int(qc_rejects.get("duplicate", 0))
    near = int(qc_rejects.get("near_duplicate", 0))

    checks = {
        "read_eq_kept_plus_rejected": read == kept + rejected,
        "rejected_eq_sum_of_qc_reasons": rejected == sum(qc_rejects.values()),
        "chars_hist_counts_match": stats.hist_total(chars_kept) == kept and stats.hist_total(chars_rej) == rejected,
        "tokenized_eq_kept_minus_empty": (docs == kept - empty and input_records == kept) if tokenized_complete else None,
        "tokens_hist_counts_match": (stats.hist_total(tokens_hist_kept) == docs) if tokenized_complete else None,
    }
    out = {
        "ingest_done": done,
        "tokenization_complete": tokenized_complete,
        "records": {"read": read, "kept": kept, "rejected": rejected, "empty_tokens": empty,
                    "tokenized_documents": docs, "trainable": kept - empty,
                    "keep_rate": round(kept / read, 4) if read else None},
        "rejects_by_check": rejects_by_check,
        "gates": stats.gate_table(st),  # what each gate did and cost on this run's data, in run order
        "rejects_after_qc": [EMPTY_TOKENS] if empty else [],
        "rejects_sampled": dict(ck.get("rejects_sampled") or {}),
        "duplicates": {"rejected_as_duplicate": dup, "rate_of_read": round(dup / read, 4) if read else None,
                       "unique_kept_digests": int(ck.get("dedup_count", 0)),
                       # which dataset kept the copy: this one, or (dedup_scope: run) one listed earlier
                       "kept_by": dict(sorted((st.get("duplicates_kept_by") or {}).items())),
                       "exact_duplicate_examples": _exact_pairs(sample, EXAMPLES_PER_REASON),
                       "rejected_as_near_duplicate": near,
                       "near_rate_of_read": round(near / read, 4) if read else None,
                       "near_duplicate_examples": _near_pairs(run_dir, sample, EXAMPLES_PER_REASON) if near else []},
        "languages": {"kept": langs_kept, "rejected": langs_rej,
                      "undetected": read - sum(langs_kept.values()) - sum(langs_rej.values())},
        "lengths": {
            "chars": {"kept": stats.log2_hist_rows(chars_kept), "rejected": stats.log2_hist_rows(chars_rej),
                      "kept_p50_below": stats.log2_percentile(chars_kept, 0.5),
                      "kept_p90_below": stats.log2_percentile(chars_kept, 0.9),
                      "rejected_p50_below": stats.log2_percentile(chars_rej, 0.5)},
            "tokens": {"kept": stats.log2_hist_rows(tokens_hist_kept),
                       "rejected_sample": stats.log2_hist_rows(tokens_hist_rejected),
                       "rejected_sample_records": tokenized_sample,
                       "kept_p50_below": stats.log2_percentile(tokens_hist_kept, 0.5),
                       "kept_p90_below": stats.log2_percentile(tokens_hist_kept, 0.9),
                       "includes_eod": eod},
        },
        "density": {key.removesuffix("_density"): {"all": stats.density_summary(st, key),
                                                   "kept": stats.density_summary(st, key, "kept"),
                                                   "rejected": stats.density_summary(st, key, "rejected")}
                    for key in stats.DENSITY_KEYS},
        "tokens": tokens,
        "shards": {"planned": planned, "done": len(receipts), "planned_final": done,
                   "empty": sum(1 for s in rstats if not s.get("num_documents"))},
        "checks": checks,
        "_hists": {"chars_kept": chars_kept, "chars_rejected": chars_rej, "tokens_kept": tokens_hist_kept,
                   "tokens_rejected_sample": tokens_hist_rejected},
        "_stats": st,
    }
    return out, examples


def build_audit(run_dir: str | Path, timings: dict[str, float] | None = None) -> tuple[dict[str, Any], dict]:
    """(audit dict, examples per dataset per reason). Read-only."""
    run_dir = Path(run_dir)
    record = _read_json(RunLayout(run_dir).run_json)
    if not isinstance(record, dict):
        raise NotARunDir(f"{run_dir}: not a streamprep run directory (no readable run.json)")
    ckpt_dir = RunLayout(run_dir).checkpoints(record)
    cfg = record.get("config") or {}
    names = [d["name"] for d in cfg.get("datasets", []) if isinstance(d, dict)]
    if not names and ckpt_dir.is_dir():
        names = sorted(p.stem for p in ckpt_dir.glob("*.json"))
    tokenizer = _load_tokenizer(run_dir)
    datasets, examples = {}, {}
    for n in names:
        datasets[n], examples[n] = _dataset_audit(run_dir, ckpt_dir, n, tokenizer)

    def total(key: str) -> int:
        return sum(d["records"][key] for d in datasets.values())

    read, kept, rejected, empty = total("read"), total("kept"), total("rejected"), total("empty_tokens")
    tokens = sum(d["tokens"] for d in datasets.values())
    merged = stats.merge_stats(d["_stats"] for d in datasets.values())
    timings = dict(timings if timings is not None else (record.get("timings") or {}))
    ingest_s, tok_s = timings.get("ingest"), timings.get("tokenize")
    ingest_bytes = sum(p.stat().st_size for p in RunLayout(run_dir).ingest_root.rglob("part-*.jsonl")) \
        if RunLayout(run_dir).ingest_root.is_dir() else 0
    throughput = {
        "ingest_records_per_s": round(read / ingest_s, 1) if ingest_s else None,
        "ingest_mb_written_per_s": round(ingest_bytes / 1e6 / ingest_s, 3) if ingest_s else None,
        "tokenize_tokens_per_s": round(tokens / tok_s, 1) if tok_s else None,
    }
    all_checks = [v for d in datasets.values() for v in d["checks"].values() if v is not None]
    audit = {
        "version": VERSION,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "run": {"run_dir": str(run_dir.resolve()), "name": (cfg.get("run") or {}).get("name"),
                "run_id": record.get("run_id"), "status": record.get("status"), "config_hash": record.get("config_hash"),
                "started_at": record.get("started_at"), "finished_at": record.get("finished_at")},
        "complete": bool(datasets) and all(d["tokenization_complete"] for d in datasets.values()),
        "totals": {"datasets": len(datasets), "read": read, "kept": kept, "rejected": rejected, "empty_tokens": empty,
                   "tokenized_documents": total("tokenized_documents"), "trainable": kept - empty, "tokens": tokens,
                   "ingest_bytes": ingest_bytes,
                   "rejects_by_check": stats.merge_counts(d["rejects_by_check"] for d in datasets.values()),
                   "languages_kept": stats.merge_counts([merged.get("languages_kept")]),
                   "density": {key.removesuffix("_density"): stats.density_summary(merged, key)
                               for key in stats.DENSITY_KEYS}},
        "tokens_share": {n: round(d["tokens"] / tokens, 4) if tokens else None for n, d in datasets.items()},
        "timings": timings,
        "timings_note": "seconds of the last invocation of the run (a resumed run reports its own time)",
        "throughput": throughput,
        "tokenizer_training": training_report(run_dir),  # held-out bytes/token of a sample-trained tokenizer
        "checks": {"ok": all(all_checks), "failed": [f"{n}: {k}" for n, d in datasets.items()
                                                     for k, v in d["checks"].items() if v is False]},
        "datasets": datasets,
    }
    return audit, examples


def _public(audit: dict[str, Any]) -> dict[str, Any]:
    out = dict(audit)
    out["datasets"] = {n: {k: v for k, v in d.items() if not k.startswith("_")} for n, d in audit["datasets"].items()}
    return out


# ---- text summary --------------------------------------------------------------------------------------
def _pct(a: int, b: int) -> str:
    return f"{100 * a / b:.1f}%" if b else "-"


def summary_text(audit: dict[str, Any], html_path: str | Path | None = None) -> str:
    t = audit["totals"]
    lines = [f"audit: {t['datasets']} dataset(s) · read {t['read']:,} · kept {t['kept']:,} ({_pct(t['kept'], t['read'])})"
             f" · rejected {t['rejected']:,} · empty_tokens {t['empty_tokens']:,} · tokens {t['tokens']:,}"
             + ("" if audit["complete"] else "  [partial run]")]
    width = max((len(n) for n in audit["datasets"]), default=0)
    for n, d in audit["datasets"].items():
        r = d["records"]
        after = d.get("rejects_after_qc") or []
        ordered = sorted(d["rejects_by_check"].items(), key=lambda kv: (kv[0] in after, -kv[1], kv[0]))
        top = ", ".join(f"{k} {v:,}" for k, v in ordered[:4])
        more = len(ordered) - 4
        top += f", +{more} more" if more > 0 else ""
        lines.append(f"  {n.ljust(width)}  read {r['read']:,}  kept {r['kept']:,} ({_pct(r['kept'], r['read'])})  "
                     f"rejected {r['rejected']:,}" + (f": {top}" if top else "") + f"  tokens {d['tokens']:,}")
    if audit["checks"]["ok"]:
        lines.append("  counts add up: read = kept + rejected; tokenized = kept - empty_tokens")
    else:
        lines.append("  WARNING: counts do not add up: " + "; ".join(audit["checks"]["failed"]))
    if (tt := audit.get("tokenizer_training")) and tt.get("bytes_per_token"):
        lines.append(f"  tokenizer trained on a {tt['sample_mb']} MB sample: {tt['bytes_per_token']} bytes/token "
                     f"on {tt['held_out_documents']:,} held-out documents")
    if html_path:
        lines.append(f"  report: {html_path}")
    return "\n".join(lines)


def summary_from_file(run_dir: str | Path) -> str | None:
    """The summary of an existing audit/audit.json (None when there is none)."""
    path = RunLayout(run_dir).audit_json
    audit = _read_json(path)
    if not isinstance(audit, dict) or audit.get("version") != VERSION:
        return None
    return summary_text(audit, path.with_name("audit.html"))


def write_audit(run_dir: str | Path, timings: dict[str, float] | None = None) -> str:
    """Write audit/audit.json and audit/audit.html for `run_dir`; return the short text summary.

    `timings` overrides run.json's (the pipeline passes its live timings before run.json is final)."""
    run_dir = Path(run_dir)
    audit, examples = build_audit(run_dir, timings)
    out_dir = RunLayout(run_dir).audit_dir
    public = _public(audit)
    atomic.write_bytes(out_dir / "audit.json", atomic.dumps_json(public))
    atomic.write_bytes(out_dir / "audit.html", render_html(audit, examples).encode("utf-8"))
    return summary_text(public, out_dir / "audit.html")


# ---- HTML ----------------------------------------------------------------------------------------------
def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.4g}"
    return str(v)


def _color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def svg_hbars(items: list[tuple[str, int, str]], width: int = 560, label_w: int | None = None) -> str:
    """Horizontal bars: (label, value, colour) per row, value printed after the bar."""
    if not items:
        return '<p class="muted">none</p>'
    if label_w is None:  # room for the longest label (~7 px per character at 12 px), within limits
        label_w = min(260, max(80, 14 + 7 * max(len(str(lbl)) for lbl, _, _ in items)))
    row, top = 22, 4
    h = top + row * len(items) + 4
    vmax = max(v for _, v, _ in items) or 1
    bar_w = width - label_w - 70
    parts = [f'<svg class="chart" role="img" width="{width}" height="{h}" viewBox="0 0 {width} {h}">']
    for i, (label, value, color) in enumerate(items):
        y = top + i * row
        w = max(1, round(bar_w * value / vmax)) if value else 0
        parts.append(f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end" class="lbl">{esc(label)}</text>'
                     f'<rect x="{label_w}" y="{y + 3}" width="{w}" height="{row - 6}" fill="{color}">'
                     f'<title>{esc(label)}: {value:,}</title></rect>'
                     f'<text x="{label_w + w + 5}" y="{y + 15}" class="val">{value:,}</text>')
    parts.append("</svg>")
    return "".join(parts)


def _bin_label(b: str) -> str:
    """Full range of a log2 bin, for tooltips: "512–1,023"."""
    lo, hi = stats.log2_bin_range(b)
    return f"{lo:,}" if hi - lo <= 1 else f"{lo:,}–{hi - 1:,}"


def _short(n: int) -> str:
    """Axis tick for a bin's lower edge (a power of two): 512, 1k, 2k, …, 1M."""
    if n >= 1 << 20:
        return f"{n >> 20}M"
    if n >= 1 << 10:
        return f"{n >> 10}k"
    return str(n)


def svg_hist(series: list[tuple[str, dict[str, int], str]], width: int = 560, height: int = 190) -> str:
    """Grouped bars over log2 bins; each series as a share of its own total (tooltips give counts)."""
    series = [(name, h, c) for name, h, c in series if stats.hist_total(h)]
    if not series:
        return '<p class="muted">no data</p>'
    bins = sorted({int(b) for _, h, _ in series for b in h})
    bins = list(range(bins[0], bins[-1] + 1))
    left, bottom, top = 38, 34, 18
    plot_w, plot_h = width - left - 8, height - bottom - top
    shares = [{b: h.get(str(b), 0) / stats.hist_total(h) for b in bins} for _, h, _ in series]
    smax = max(max(s.values()) for s in shares) or 1
    group = plot_w / len(bins)
    bw = max(2.0, (group - 4) / len(series))
    parts = [f'<svg class="chart" role="img" width="{width}" height="{height}" viewBox="0 0 {width} {height}">',
             f'<line x1="{left}" y1="{top + plot_h}" x2="{width - 8}" y2="{top + plot_h}" class="axis"/>']
    for frac in (0.5, 1.0):
        y = top + plot_h - plot_h * frac
        parts.append(f'<line x1="{left}" y1="{y:.1f}" x2="{width - 8}" y2="{y:.1f}" class="grid"/>'
                     f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" class="tick">{100 * smax * frac:.0f}%</text>')
    step = max(1, len(bins) // 10)
    for j, b in enumerate(bins):
        x0 = left + j * group + 2
        for k, ((name, h, color), sh) in enumerate(zip(series, shares)):
            v = sh[b]
            bh = plot_h * v / smax
            if bh:
                parts.append(f'<rect x="{x0 + k * bw:.1f}" y="{top + plot_h - bh:.1f}" width="{bw - 1:.1f}" '
                             f'height="{bh:.1f}" fill="{color}"><title>{esc(name)} {esc(_bin_label(str(b)))}: '
                             f'{h.get(str(b), 0):,} ({100 * v:.1f}%)</title></rect>')
        if j % step == 0:
            parts.append(f'<text x="{x0 + group / 2 - 2:.1f}" y="{top + plot_h + 14}" text-anchor="middle" '
                         f'class="tick">{esc(_short(stats.log2_bin_range(b)[0]))}</text>')
    lx = left
    for name, h, color in series:
        label = f"{name} (n={stats.hist_total(h):,})"
        parts.append(f'<rect x="{lx}" y="{height - 12}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{lx + 14}" y="{height - 3}" class="tick">{esc(label)}</text>')
        lx += 24 + 7 * len(label)
    parts.append("</svg>")
    return "".join(parts)


def svg_shares(rows: list[tuple[str, dict[str, int]]], width: int = 560, top_n: int = 6) -> str:
    """One 100% stacked bar per row (e.g. kept / rejected), the `top_n` most common keys + other."""
    rows = [(name, c) for name, c in rows if sum(c.values())]
    if not rows:
        return '<p class="muted">no language information</p>'
    allc = stats.merge_counts(c for _, c in rows)
    keys = list(allc)[:top_n]
    colors = {k: _color(i) for i, k in enumerate(keys)}
    colors["other"] = "#bdc3c7"
    label_w, row = 80, 26
    bar_w = width - label_w - 8
    h = row * len(rows) + 26
    parts = [f'<svg class="chart" role="img" width="{width}" height="{h}" viewBox="0 0 {width} {h}">']
    for i, (name, c) in enumerate(rows):
        total = sum(c.values())
        segs = [(k, c.get(k, 0)) for k in keys] + [("other", total - sum(c.get(k, 0) for k in keys))]
        x, y = float(label_w), i * row + 2
        parts.append(f'<text x="{label_w - 6}" y="{y + 15}" text-anchor="end" class="lbl">{esc(name)}</text>')
        for k, v in segs:
            if not v:
                continue
            w = bar_w * v / total
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 6}" fill="{colors[k]}">'
                         f'<title>{esc(name)} {esc(k)}: {v:,} ({100 * v / total:.1f}%)</title></rect>')
            if w > 34:
                parts.append(f'<text x="{x + 4:.1f}" y="{y + 14}" class="inbar">{esc(k)} {100 * v / total:.0f}%</text>')
            x += w
    lx, ly = label_w, row * len(rows) + 14
    for k in [*keys, "other"]:
        parts.append(f'<rect x="{lx}" y="{ly - 9}" width="10" height="10" fill="{colors[k]}"/>'
                     f'<text x="{lx + 14}" y="{ly}" class="tick">{esc(k)}</text>')
        lx += 24 + 7 * len(k)
    parts.append("</svg>")
    return "".join(parts)


CSS = """
*{box-sizing:border-box}body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
margin:0;background:#f4f6f8;color:#1f2d3d}main{max-width:1120px;margin:0 auto;padding:20px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:18px;margin:28px 0 10px;border-bottom:2px solid #d8dee4;padding-bottom:4px}
h3{font-size:15px;margin:14px 0 6px}.muted{color:#6b7785}.cards{display:flex;flex-wrap:wrap;gap:10px;margin:14px 0}
.card{background:#fff;border:1px solid #d8dee4;border-radius:6px;padding:10px 14px;min-width:130px}
.card b{display:block;font-size:20px}.card span{color:#6b7785;font-size:12px;text-transform:uppercase}
table{border-collapse:collapse;background:#fff;margin:6px 0 10px}th,td{border:1px solid #d8dee4;padding:4px 8px;text-align:right}
th:first-child,td:first-child{text-align:left}th{background:#eef1f4}
.grid2{display:grid;grid-template-columns:1fr 1fr;gap:14px}.panel{background:#fff;border:1px solid #d8dee4;border-radius:6px;padding:10px 12px}
.ok{color:#1e8449;font-weight:600}.bad{color:#c0392b;font-weight:600}
svg.chart{display:block;max-width:100%;height:auto}svg .lbl{font-size:12px;fill:#1f2d3d}svg .val,svg .tick{font-size:11px;fill:#4b5966}
svg .inbar{font-size:11px;fill:#fff}svg .axis{stroke:#8795a1}svg .grid{stroke:#e3e8ec}
details{background:#fff;border:1px solid #d8dee4;border-radius:6px;margin:6px 0;padding:6px 10px}summary{cursor:pointer;font-weight:600}
pre{white-space:pre-wrap;word-break:break-word;background:#f7f9fa;border:1px solid #e3e8ec;padding:6px 8px;margin:6px 0;font-size:12px;max-height:240px;overflow:auto}
.ex{border-top:1px dashed #d8dee4;padding-top:6px;margin-top:6px}.tag{display:inline-block;background:#eef1f4;border-radius:4px;padding:0 6px;font-size:12px;margin-right:4px}
"""


def _reason_color(reason: str) -> str:
    return {"parse": "#8e44ad", "duplicate": "#e67e22", EMPTY_TOKENS: "#7f8c8d"}.get(reason, "#c0392b")


def _card(label: str, value: Any) -> str:
    return f'<div class="card"><span>{esc(label)}</span><b>{esc(_fmt(value))}</b></div>'


def _table(head: list[str], rows: list[list[Any]]) -> str:
    h = "".join(f"<th>{esc(c)}</th>" for c in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def _check_cell(v: bool | None) -> str:
    return '<span class="muted">n/a (not tokenized yet)</span>' if v is None else (
        '<span class="ok">ok</span>' if v else '<span class="bad">MISMATCH</span>')


def _example_html(rec: dict[str, Any]) -> str:
    text = rec.get("text")
    text = text if isinstance(text, str) else json.dumps(text, ensure_ascii=False)
    shown = text[:EXAMPLE_CHARS] + ("…" if len(text) > EXAMPLE_CHARS else "")
    src = rec.get("source") or {}
    tags = "".join(f'<span class="tag">{esc(k)}: {esc(v)}</span>' for k, v in src.items()) if isinstance(src, dict) else ""
    meta = rec.get("meta")
    meta_s = json.dumps({k: v for k, v in meta.items() if k not in ("failed_check", "reason")}, ensure_ascii=False,
                        sort_keys=True) if isinstance(meta, dict) else ""
    return (f'<div class="ex"><div><b>reason:</b> {esc(rec.get("reason") or "–")}</div><div>{tags}</div>'
            + (f'<div class="muted">meta: {esc(meta_s[:400])}</div>' if meta_s and meta_s != "{}" else "")
            + f"<pre>{esc(shown)}</pre></div>")


def _near_pairs_html(pairs: list[dict[str, Any]]) -> str:
    """Near-duplicate rejects side by side with their kept twins."""
    if not pairs:
        return ""
    rows = []
    for p in pairs:
        twin = p["twin"]
        rows.append(f'<div class="grid2"><div class="ex"><div><b>rejected</b> {esc(p["dataset"])}#{esc(p["index"])}'
                    f' · estimated Jaccard {esc(p["jaccard"])}</div><pre>{esc(p["text"])}</pre></div>'
                    f'<div class="ex"><div><b>kept twin</b> {esc(twin.get("dataset"))}#{esc(twin.get("index"))}</div>'
                    f'<pre>{esc(twin["text"] if twin["text"] is not None else "(not found in the ingest parts)")}'
                    "</pre></div></div>")
    return "<h3>Near-duplicate pairs</h3>" + "".join(rows)


def render_html(audit: dict[str, Any], examples: dict[str, dict[str, list]]) -> str:
    """One self-contained page: inline CSS and SVG, no scripts, no external resources."""
    t, run = audit["totals"], audit["run"]
    title = f"streamprep audit — {run.get('name') or Path(run['run_dir']).name}"
    out = ['<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
           '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; style-src \'unsafe-inline\'; '
           'img-src data:">',
           '<meta name="viewport" content="width=device-width, initial-scale=1">',
           f"<title>{esc(title)}</title><style>{CSS}</style></head><body><main>",
           f"<h1>{esc(title)}</h1>",
           f'<div class="muted">run dir {esc(run["run_dir"])} · run id {esc(run.get("run_id") or "?")} · status '
           f'{esc(run.get("status") or "?")} · generated {esc(audit["generated_at"])}'
           + ("" if audit["complete"] else " · <b>partial run: figures cover what has been processed so far</b>")
           + "</div>",
           '<div class="cards">', _card("datasets", t["datasets"]), _card("records read", t["read"]),
           _card("kept", t["kept"]), _card("rejected", t["rejected"]), _card("empty tokens", t["empty_tokens"]),
           _card("tokens", t["tokens"]), "</div>"]
    ok = audit["checks"]["ok"]
    out.append(f'<p>Counts: <span class="{"ok" if ok else "bad"}">{"add up" if ok else "DO NOT ADD UP"}</span> — '
               "read = kept + rejected per dataset; tokenized documents = kept − empty_tokens once tokenized."
               + (" Failed: " + esc("; ".join(audit["checks"]["failed"])) if not ok else "") + "</p>")

    rows = []
    for n, d in audit["datasets"].items():
        r = d["records"]
        rows.append([esc(n), _fmt(r["read"]), _fmt(r["kept"]), _fmt(r["rejected"]),
                     esc(f"{100 * r['keep_rate']:.1f}%") if r["keep_rate"] is not None else "–",
                     _fmt(r["empty_tokens"]), _fmt(r["tokenized_documents"]), _fmt(d["tokens"]),
                     esc(f"{d['shards']['done']}/{d['shards']['planned']}"),
                     _fmt(d["duplicates"]["rejected_as_duplicate"]),
                     _fmt(d["duplicates"].get("rejected_as_near_duplicate", 0)),
                     _fmt(d["density"]["pii"]["all"]["p99"]), _fmt(d["density"]["profanity"]["all"]["p99"])])
    out += ["<h2>Datasets</h2>",
            _table(["dataset", "read", "kept", "rejected", "keep rate", "empty tokens", "tokenized docs", "tokens",
                    "shards", "duplicates", "near duplicates", "PII p99", "profanity p99"], rows)]

    tot_items = [(k, v, _reason_color(k)) for k, v in t["rejects_by_check"].items()]
    out += ['<div class="grid2"><div class="panel"><h3>Reject reasons, all datasets</h3>', svg_hbars(tot_items),
            "</div>", '<div class="panel"><h3>Tokens per dataset</h3>',
            svg_hbars([(n, d["tokens"], _color(i)) for i, (n, d) in enumerate(audit["datasets"].items())]),
            "</div></div>"]

    for n, d in audit["datasets"].items():
        r, hs = d["records"], d["_hists"]
        out.append(f'<h2 id="ds-{esc(n)}">Dataset {esc(n)}</h2>')
        out.append(f'<div class="muted">read {_fmt(r["read"])} = kept {_fmt(r["kept"])} + rejected '
                   f'{_fmt(r["rejected"])}; tokenized documents {_fmt(r["tokenized_documents"])} = kept − empty_tokens '
                   f'{_fmt(r["empty_tokens"])}' + ("" if d["tokenization_complete"] else " (tokenization not complete)")
                   + "</div>")
        items = [(k + (" (after QC)" if k in d["rejects_after_qc"] else ""), v, _reason_color(k))
                 for k, v in d["rejects_by_check"].items()]
        lang = d["languages"]
        out += ['<div class="grid2"><div class="panel"><h3>Reject reasons</h3>', svg_hbars(items), "</div>",
                '<div class="panel"><h3>Language shares</h3>',
                svg_shares([("kept", lang["kept"]), ("rejected", lang["rejected"])]),
                f'<div class="muted">no language detected: {_fmt(lang["undetected"])} record(s)</div></div>',
                '<div class="panel"><h3>Length in characters</h3>',
                svg_hist([("kept", hs["chars_kept"], "#2e86de"), ("rejected", hs["chars_rejected"], "#e55039")]),
                "</div>",
                '<div class="panel"><h3>Length in tokens</h3>',
                svg_hist([("kept", hs["tokens_kept"], "#2e86de"),
                          ("rejected (sample)", hs["tokens_rejected_sample"], "#e55039")]),
                '<div class="muted">rejected: the rejects sample, excerpts of up to 2,000 characters</div></div>',
                "</div>"]
        dens_rows = []
        for key, v in d["density"].items():
            for side in ("all", "kept", "rejected"):
                s = v[side]
                if s["records"]:
                    dens_rows.append([esc(f"{key} ({side})"), _fmt(s["records"]), _fmt(s["p50"]), _fmt(s["p90"]),
                                      _fmt(s["p99"])])
        out += ["<h3>PII / profanity density percentiles</h3>",
                _table(["density", "records", "p50", "p90", "p99"], dens_rows) if dens_rows
                else '<p class="muted">no density figures recorded</p>',
                '<p class="muted">upper edge of the 0.01-wide bin holding the percentile (0 when it falls on exact zeros)</p>']
        if d.get("gates"):
            out.append("<h3>Quality gates on this run's data</h3>" + _table(
                ["gate", "records seen", "rejected", "µs per record"],
                [[esc(x["gate"]), _fmt(x["seen"]), _fmt(x["rejected"]), _fmt(x["us_per_record"])] for x in d["gates"]]))
        out.append("<h3>Checks</h3>" + _table(["check", "result"], [[esc(k), _check_cell(v)]
                                                                    for k, v in d["checks"].items()]))
        kept_by = d["duplicates"].get("kept_by") or {}
        if kept_by:
            out.append("<h3>Exact duplicates, by the dataset that kept the copy</h3>"
                       + _table(["kept by", "duplicates rejected here"], [[esc(k), _fmt(v)] for k, v in kept_by.items()])
                       + "".join(f'<div class="ex"><div><b>rejected</b> {esc(x["dataset"])}#{esc(x["index"])} · '
                                 f'identical text kept by {esc(x["kept_by"])}</div><pre>{esc(x["text"])}</pre></div>'
                                 for x in d["duplicates"].get("exact_duplicate_examples") or []))
        out.append(_near_pairs_html(d["duplicates"].get("near_duplicate_examples") or []))
        exs = examples.get(n) or {}
        if exs:
            out.append("<h3>Example rejected records</h3>")
            for reason in sorted(exs, key=lambda k: -d["rejects_by_check"].get(k, 0)):
                recs = exs[reason]
                count = d["rejects_by_check"].get(reason, len(recs))
                out.append(f"<details><summary>{esc(reason)} — {_fmt(count)} record(s), "
                           f"{len(recs)} example(s)</summary>" + "".join(_example_html(x) for x in recs) + "</details>")

    tm = audit["timings"]
    if tm:
        out += ["<h2>Timings and throughput</h2>",
                _table(["stage", "seconds"], [[esc(k), _fmt(v)] for k, v in tm.items()]),
                _table(["throughput", "value"], [[esc(k), _fmt(v)] for k, v in audit["throughput"].items()]),
                f'<p class="muted">{esc(audit["timings_note"])}</p>']
    if tt := audit.get("tokenizer_training"):
        out += ["<h2>Tokenizer training sample</h2>",
                _table(["held-out measurement", "value"], [[esc(k), _fmt(v)] for k, v in tt.items()])]
    out.append("</main></body></html>\n")
    return "\n".join(out)
