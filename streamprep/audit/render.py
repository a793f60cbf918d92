"""Rendering half of the audit: the text summary and the self-contained HTML page (inline CSS + SVG)."""
from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

from streamprep import stats
from streamprep.config import printable
from streamprep.audit.gather import EMPTY_TOKENS, EXAMPLE_CHARS, PALETTE


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
        if dropped := r.get("sft_dropped"):  # kept by QC, dropped by the SFT shards (docs/sft.md)
            lines.append(f"  {' ' * width}  dropped by its SFT shards: "
                         + ", ".join(f"{k} {v:,}" for k, v in sorted(dropped.items(), key=lambda kv: (-kv[1], kv[0]))))
        if unrendered := r.get("sft_messages_not_rendered"):  # a role the template leaves out (docs/sft.md)
            lines.append(f"  {' ' * width}  messages its chat template did not render (neither trained nor in the "
                         f"sequences; sft role_map?): {unrendered:,}")
    if audit["checks"]["ok"]:
        # only what was checked: the tokenized count once every part of a dataset is tokenized (a partial run's
        # line said it of datasets that kept 200 records and had tokenized 150)
        tokenized = [d for d in audit["datasets"].values()
                     if d["checks"].get("tokenized_eq_kept_minus_empty") is not None]
        sft = any(d["records"].get("sft_dropped") for d in tokenized)
        some = f" (datasets fully tokenized: {len(tokenized)} of {len(audit['datasets'])})" \
            if len(tokenized) < len(audit["datasets"]) else ""
        lines.append("  counts add up: read = kept + rejected"
                     + (f"; tokenized = kept - empty_tokens{' - dropped by the SFT shards' if sft else ''}{some}"
                        if tokenized else ""))
    else:
        lines.append("  WARNING: counts do not add up: " + "; ".join(audit["checks"]["failed"]))
    if (tt := audit.get("tokenizer_training")) and tt.get("bytes_per_token"):
        lines.append(f"  tokenizer trained on a {tt['sample_mb']} MB sample: {tt['bytes_per_token']} bytes/token "
                     f"on {tt['held_out_documents']:,} held-out documents")
    if html_path:
        lines.append(f"  report: {printable(str(html_path))}")  # the terminal's: a run dir may hold ESC or CR
    return "\n".join(lines)



# ---- HTML ----------------------------------------------------------------------------------------------
# Characters an input may hold that HTML escaping leaves as they are: C0/C1 controls but tab and newline (NUL is a
# parse error; ESC, BEL...) and the bidi overrides and isolates (U+202E turns the tags after it around). Shown as
# escapes, as `repr` writes them.
_HIDDEN = {c: repr(chr(c))[1:-1] for c in (*range(0x20), *range(0x7f, 0xa0), *range(0x202a, 0x202f),
                                           *range(0x2066, 0x206a)) if chr(c) not in "\t\n"}


def esc(value: Any) -> str:
    return html.escape(str(value).translate(_HIDDEN), quote=True)


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


def _head(audit: dict[str, Any]) -> list[str]:
    """Page head, title, run line, cards and the counts check."""
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
    return out


def _overview(audit: dict[str, Any]) -> list[str]:
    """The all-datasets table and the two summary charts."""
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
    tot_items = [(k, v, _reason_color(k)) for k, v in audit["totals"]["rejects_by_check"].items()]
    return ["<h2>Datasets</h2>",
            _table(["dataset", "read", "kept", "rejected", "keep rate", "empty tokens", "tokenized docs", "tokens",
                    "shards", "duplicates", "near duplicates", "PII p99", "profanity p99"], rows),
            '<div class="grid2"><div class="panel"><h3>Reject reasons, all datasets</h3>', svg_hbars(tot_items),
            "</div>", '<div class="panel"><h3>Tokens per dataset</h3>',
            svg_hbars([(n, d["tokens"], _color(i)) for i, (n, d) in enumerate(audit["datasets"].items())]),
            "</div></div>"]


def _dataset_charts(n: str, d: dict[str, Any]) -> list[str]:
    """A dataset's heading, its count identity and its four charts."""
    r, hs = d["records"], d["_hists"]
    out = [f'<h2 id="ds-{esc(n)}">Dataset {esc(n)}</h2>',
           f'<div class="muted">read {_fmt(r["read"])} = kept {_fmt(r["kept"])} + rejected '
           f'{_fmt(r["rejected"])}; tokenized documents {_fmt(r["tokenized_documents"])} = kept − empty_tokens '
           f'{_fmt(r["empty_tokens"])}' + (f' − dropped by the SFT shards {_fmt(sum(r["sft_dropped"].values()))} ('
                                          + esc(", ".join(f"{k} {v}" for k, v in sorted(r["sft_dropped"].items())))
                                          + ")" if r.get("sft_dropped") else "")
           + ("" if d["tokenization_complete"] else " (tokenization not complete)")
           + "</div>"]
    items = [(k + (" (after QC)" if k in d["rejects_after_qc"] else ""), v, _reason_color(k))
             for k, v in d["rejects_by_check"].items()]
    lang = d["languages"]
    return out + ['<div class="grid2"><div class="panel"><h3>Reject reasons</h3>', svg_hbars(items), "</div>",
                  '<div class="panel"><h3>Language shares</h3>',
                  svg_shares([("kept", lang["kept"]), ("rejected", lang["rejected"])]),
                  f'<div class="muted">no language: {_fmt(lang["undetected"])} record(s) (rejected before the language '
                  "gate, no language gate, or none detected)</div></div>",
                  '<div class="panel"><h3>Length in characters</h3>',
                  svg_hist([("kept", hs["chars_kept"], "#2e86de"), ("rejected", hs["chars_rejected"], "#e55039")]),
                  "</div>",
                  '<div class="panel"><h3>Length in tokens</h3>',
                  svg_hist([("kept", hs["tokens_kept"], "#2e86de"),
                            ("rejected (sample)", hs["tokens_rejected_sample"], "#e55039")]),
                  '<div class="muted">rejected: the rejects sample, excerpts of up to 2,000 characters</div></div>',
                  "</div>"]


def _dataset_tables(d: dict[str, Any]) -> list[str]:
    """A dataset's density percentiles, gate costs and checks."""
    dens_rows = []
    for key, v in d["density"].items():
        for side in ("all", "kept", "rejected"):
            s = v[side]
            if s["records"]:
                dens_rows.append([esc(f"{key} ({side})"), _fmt(s["records"]), _fmt(s["p50"]), _fmt(s["p90"]),
                                  _fmt(s["p99"])])
    out = ["<h3>PII / profanity density percentiles</h3>",
           _table(["density", "records", "p50", "p90", "p99"], dens_rows) if dens_rows
           else '<p class="muted">no density figures recorded</p>',
           '<p class="muted">upper edge of the 0.01-wide bin holding the percentile (0 when it falls on exact zeros)</p>']
    if d.get("gates"):
        out.append("<h3>Quality gates on this run's data</h3>" + _table(
            ["gate", "records seen", "rejected", "µs per record"],
            [[esc(x["gate"]), _fmt(x["seen"]), _fmt(x["rejected"]), _fmt(x["us_per_record"])] for x in d["gates"]]))
    out.append("<h3>Checks</h3>" + _table(["check", "result"], [[esc(k), _check_cell(v)]
                                                                for k, v in d["checks"].items()]))
    return out


def _dataset_examples(d: dict[str, Any], exs: dict[str, list]) -> list[str]:
    """A dataset's duplicate pairs and example rejected records."""
    out = []
    kept_by = d["duplicates"].get("kept_by") or {}
    if kept_by:
        out.append("<h3>Exact duplicates, by the dataset that kept the copy</h3>"
                   + _table(["kept by", "duplicates rejected here"], [[esc(k), _fmt(v)] for k, v in kept_by.items()])
                   + "".join(f'<div class="ex"><div><b>rejected</b> {esc(x["dataset"])}#{esc(x["index"])} · '
                             f'identical text kept by {esc(x["kept_by"])}</div><pre>{esc(x["text"])}</pre></div>'
                             for x in d["duplicates"].get("exact_duplicate_examples") or []))
    near_by = d["duplicates"].get("near_kept_by") or {}
    if near_by:
        out.append("<h3>Near-duplicates, by the dataset that kept the twin</h3>"
                   + _table(["kept by", "near-duplicates rejected here"],
                            [[esc(k), _fmt(v)] for k, v in near_by.items()]))
    out.append(_near_pairs_html(d["duplicates"].get("near_duplicate_examples") or []))
    if exs:
        out.append("<h3>Example rejected records</h3>")
        counts = {**d["rejects_by_check"], **{f"sft:{k}": v for k, v in (d["records"].get("sft_dropped") or {}).items()}}
        for reason in sorted(exs, key=lambda k: -counts.get(k, 0)):
            recs = exs[reason]
            count = counts.get(reason, len(recs))
            out.append(f"<details><summary>{esc(reason)} — {_fmt(count)} record(s), "
                       f"{len(recs)} example(s)</summary>" + "".join(_example_html(x) for x in recs) + "</details>")
    return out


def _footer(audit: dict[str, Any]) -> list[str]:
    """Timings, throughput and the tokenizer-training measurement."""
    out = []
    tm = audit["timings"]
    if tm:
        out += ["<h2>Timings and throughput</h2>",
                _table(["stage", "seconds"], [[esc(k), _fmt(v)] for k, v in tm.items()]),
                _table(["throughput", "value"], [[esc(k), _fmt(v)] for k, v in audit["throughput"].items()]),
                f'<p class="muted">{esc(audit["timings_note"])}</p>']
    if tt := audit.get("tokenizer_training"):
        out += ["<h2>Tokenizer training sample</h2>",
                _table(["held-out measurement", "value"], [[esc(k), _fmt(v)] for k, v in tt.items()])]
    return out


def render_html(audit: dict[str, Any], examples: dict[str, dict[str, list]]) -> str:
    """One self-contained page: inline CSS and SVG, no scripts, no external resources."""
    out = _head(audit) + _overview(audit)
    for n, d in audit["datasets"].items():
        out += _dataset_charts(n, d) + _dataset_tables(d) + _dataset_examples(d, examples.get(n) or {})
    out += _footer(audit)
    out.append("</main></body></html>\n")
    return "\n".join(out)
