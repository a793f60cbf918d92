"""Audit aggregates per dataset, kept in the checkpoint so a resumed run reports the same figures.

Histograms use fixed power-of-two bins (lengths) and fixed linear bins (densities), so merging is
addition and percentiles can be read back without keeping per-record values.

Keys a dataset's `stats` dict may hold (all plain JSON; absent = zero):
    chars_hist_kept / chars_hist_rejected        log2 bins of text length in characters
    tokens_hist_kept                             log2 bins of token counts (receipts: `tokens_hist`)
    rejects_by_check                             failed_check -> count (every rejected record once)
    duplicates_kept_by                           dataset that kept an exact duplicate's copy -> count
    near_duplicates_kept_by                      earlier dataset that kept a near-duplicate's twin -> count
                                                 (`dedup_scope: run`; twins in the same dataset are not counted)
    languages_kept / languages_rejected          language code -> count (records with a detected language)
    pii_density_hist / profanity_density_hist    linear density bins over all records (kept + rejected)
    *_density_hist_kept / *_density_hist_rejected  the same split by decision (added later; may be absent)
    *_density_zero                               how many of the records in bin 0 were exactly 0.0
Log2 bin b holds lengths [2^(b-1), 2^b); bin "0" holds 0.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np

DENSITY_BINS = 100  # densities in [0, 1] at 0.01 resolution; the last bin holds >= 0.99
DENSITY_KEYS = ("pii_density", "profanity_density")


def _log2_bin(n: int) -> str:
    return str(max(int(n), 0).bit_length())  # bin b holds [2^(b-1), 2^b); "0" holds 0


def _bump(d: dict[str, int], key: str, by: int = 1) -> None:
    d[key] = d.get(key, 0) + by


def add_record(stats: dict[str, Any], keep: bool, meta: dict[str, Any], chars: int) -> None:
    """Fold one decision into `stats` (a plain JSON dict)."""
    side = "kept" if keep else "rejected"
    _bump(stats.setdefault(f"chars_hist_{side}", {}), _log2_bin(chars))
    if not keep:
        _bump(stats.setdefault("rejects_by_check", {}), meta.get("failed_check", "unknown"))
        if meta.get("failed_check") == "duplicate" and meta.get("duplicate_of"):
            _bump(stats.setdefault("duplicates_kept_by", {}), str(meta["duplicate_of"]))
    _add_meta(stats, side, meta)


def add_kept(stats: dict[str, Any], metas: Sequence[dict[str, Any]], chars: Sequence[int]) -> None:
    """`add_record(stats, True, meta, n)` for each kept record of a batch, the lengths counted at once (the
    common case, every gate off, is one histogram update a batch instead of one call a record)."""
    if not chars:
        return
    add_log2_counts(stats.setdefault("chars_hist_kept", {}), chars)
    for meta in metas:  # None: a meta without these keys (`unit_worker.ItemColumns`)
        if meta is not None and not META_KEYS.isdisjoint(meta):
            _add_meta(stats, "kept", meta)


META_KEYS = frozenset(("language", *DENSITY_KEYS))  # what `_add_meta` reads of a record's meta


def _add_meta(stats: dict[str, Any], side: str, meta: dict[str, Any]) -> None:
    """The language and density figures of one record's meta."""
    lang = meta.get("language")
    if lang:
        _bump(stats.setdefault(f"languages_{side}", {}), str(lang))
    for key in DENSITY_KEYS:
        value = meta.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            b = str(min(max(int(float(value) * DENSITY_BINS), 0), DENSITY_BINS - 1))
            _bump(stats.setdefault(f"{key}_hist", {}), b)
            _bump(stats.setdefault(f"{key}_hist_{side}", {}), b)
            if value == 0:
                _bump(stats.setdefault(f"{key}_zero", {}), side)


def add_near_kept_by(stats: dict[str, Any], dataset: str) -> None:
    """A near-duplicate whose kept twin is in `dataset`, listed earlier (`dedup_scope: run`)."""
    _bump(stats.setdefault("near_duplicates_kept_by", {}), dataset)


def add_gates(stats: dict[str, Any], gates: dict[str, dict[str, Any]]) -> None:
    """Fold one QC batch's per-gate counters (`QualityControl.take_gate_stats`) into `stats`, as flat
    name -> count dicts (`gate_seen`, `gate_rejected`, `gate_us`) so that datasets merge like any count."""
    for name, c in gates.items():
        _bump(stats.setdefault("gate_seen", {}), name, int(c["seen"]))
        _bump(stats.setdefault("gate_rejected", {}), name, int(c["rejected"]))
        _bump(stats.setdefault("gate_us", {}), name, round(c["seconds"] * 1e6))


def add_stats(stats: dict[str, Any], other: dict[str, Any]) -> None:
    """Fold another `stats` dict (a piece's, from its worker) into `stats`: every value is a name -> count dict."""
    for key, counts in other.items():
        into = stats.setdefault(key, {})
        for name, n in counts.items():
            _bump(into, name, n)


# The built-in gates' names in the order `quality.gates.build_gates` runs them (a test holds the two together);
# plug-in gates run after them, and near-dedup's signatures are made last, of the kept texts.
CHAIN_ORDER = ("schema", "normalize", "length", "metadata", "pii", "profanity", "copyright", "language", "domain")


def gate_table(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per gate, in the order the gates ran: records seen and rejected, and µs per record it saw.
    Checkpoints sort their keys, so the run order is rebuilt from the chain itself: each gate sees what the
    one before it let through (most seen first; on a tie the gate that rejects nothing ran first, and between
    gates that reject nothing, the chain's order: by name, a run rejecting nothing listed `schema` last)."""
    seen, rejected, us = (stats.get(k) or {} for k in ("gate_seen", "gate_rejected", "gate_us"))

    def rank(name: str) -> tuple[int, str]:
        if name in CHAIN_ORDER:
            return CHAIN_ORDER.index(name), ""
        return len(CHAIN_ORDER) + (name == "near_dedup_signature"), name

    order = sorted((n for n in seen if seen[n]), key=lambda n: (-seen[n], rejected.get(n, 0), rank(n)))
    return [{"gate": n, "seen": seen[n], "rejected": int(rejected.get(n, 0)),
             "us_per_record": round(us.get(n, 0) / seen[n], 1)} for n in order]


def add_log2_counts(hist: dict[str, int], values: Sequence[int] | np.ndarray) -> None:
    """Count a whole array into log2 bins at once, the bins of `_log2_bin` (frexp's exponent of n >= 0 is its
    bit length; exact below 2^53), new bins added in the order a loop over `values` would add them."""
    bins, first, counts = np.unique(np.frexp(np.asarray(values, dtype=np.float64))[1], return_index=True,
                                    return_counts=True)
    for i in np.argsort(first, kind="stable").tolist():
        _bump(hist, str(int(bins[i])), int(counts[i]))


def add_tokens(stats: dict[str, Any], side: str, n_tokens: int) -> None:
    _bump(stats.setdefault(f"tokens_hist_{side}", {}), _log2_bin(n_tokens))


def quantile_bin(hist: dict[str, int] | None, q: float) -> str | None:
    """The key of the bin holding quantile `q` (0..1) of a histogram keyed by integer strings."""
    hist = hist or {}
    total = sum(hist.values())
    if not total:
        return None
    need, run = q * total, 0
    for b in sorted(hist, key=int):
        run += hist[b]
        if run >= need:
            return b
    return max(hist, key=int)


def percentile_from_hist(hist: dict[str, int], q: float, bins: int = DENSITY_BINS) -> float | None:
    """Upper edge of the density bin holding quantile `q` (0..1)."""
    b = quantile_bin(hist, q)
    return None if b is None else round((int(b) + 1) / bins, 4)


# ---- reading aggregates back (audit, status) ----------------------------------------------------
def merge_hists(hists: Iterable[dict[str, int] | None]) -> dict[str, int]:
    """Sum histograms bin by bin (bins are fixed, so this is exact)."""
    out: dict[str, int] = {}
    for h in hists:
        for k, v in (h or {}).items():
            _bump(out, k, int(v))
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def merge_counts(counts: Iterable[dict[str, int] | None]) -> dict[str, int]:
    """Sum name -> count dicts; the result is sorted by count (descending), then name."""
    out: dict[str, int] = {}
    for c in counts:
        for k, v in (c or {}).items():
            _bump(out, k, int(v))
    return dict(sorted(out.items(), key=lambda kv: (-kv[1], kv[0])))


def hist_total(hist: dict[str, int] | None) -> int:
    return sum((hist or {}).values())


def log2_bin_range(b: str | int) -> tuple[int, int]:
    """[lo, hi) of log2 bin `b`: "0" -> (0, 1), "1" -> (1, 2), "4" -> (8, 16)."""
    b = int(b)
    return (0, 1) if b == 0 else (1 << (b - 1), 1 << b)


def log2_hist_rows(hist: dict[str, int] | None) -> list[dict[str, int]]:
    """A log2 histogram as sorted rows {"lo", "hi", "count"} (hi exclusive), for reports."""
    rows = []
    for b, n in sorted((hist or {}).items(), key=lambda kv: int(kv[0])):
        lo, hi = log2_bin_range(b)
        rows.append({"lo": lo, "hi": hi, "count": int(n)})
    return rows


def log2_percentile(hist: dict[str, int] | None, q: float) -> int | None:
    """Upper (exclusive) edge of the log2 bin holding quantile `q`: the value is below it."""
    b = quantile_bin(hist, q)
    return None if b is None else log2_bin_range(b)[1]


def density_percentile(hist: dict[str, int] | None, q: float, zeros: int = 0) -> float | None:
    """Like `percentile_from_hist`, but 0.0 when quantile `q` falls among the `zeros` exact zeros of bin 0."""
    hist = hist or {}
    total = hist_total(hist)
    if not total:
        return None
    if zeros and q * total <= min(zeros, hist.get("0", 0)):
        return 0.0
    return percentile_from_hist(hist, q)


def density_summary(stats: dict[str, Any], key: str, side: str | None = None,
                    quantiles: tuple[float, ...] = (0.5, 0.9, 0.99)) -> dict[str, Any]:
    """{"records", "p50", "p90", "p99"} for `key` (pii_density | profanity_density) over all records,
    or one `side` (kept | rejected) when that split was recorded. Percentiles are upper bin edges
    (0.01 resolution), or 0.0 when the quantile falls among exact zeros."""
    zero = stats.get(f"{key}_zero") or {}
    if side is None:
        hist = stats.get(f"{key}_hist") or {}
        zeros = sum(zero.values())
    else:
        hist = stats.get(f"{key}_hist_{side}") or {}
        zeros = zero.get(side, 0)
    out: dict[str, Any] = {"records": hist_total(hist)}
    for q in quantiles:
        out[f"p{round(q * 100):d}"] = density_percentile(hist, q, zeros)
    return out


def merge_stats(all_stats: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """Merge several datasets' `stats` dicts into one (histograms and counts add up)."""
    all_stats = list(all_stats)
    keys = {k for s in all_stats for k in s}
    out: dict[str, Any] = {}
    for k in sorted(keys):
        parts = [s.get(k) for s in all_stats]
        if "_hist" in k:
            out[k] = merge_hists(parts)
        else:
            out[k] = merge_counts(parts)
    return out
