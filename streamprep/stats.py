"""Audit aggregates per dataset, kept in the checkpoint so a resumed run reports the same figures.

Histograms use fixed power-of-two bins (lengths) and fixed linear bins (densities), so merging is
addition and percentiles can be read back without keeping per-record values.
"""
from __future__ import annotations

from typing import Any

DENSITY_BINS = 100  # densities in [0, 1] at 0.01 resolution; the last bin holds >= 0.99


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
    lang = meta.get("language")
    if lang:
        _bump(stats.setdefault(f"languages_{side}", {}), str(lang))
    for key in ("pii_density", "profanity_density"):
        value = meta.get(key)
        if isinstance(value, (int, float)):
            b = min(int(float(value) * DENSITY_BINS), DENSITY_BINS - 1)
            _bump(stats.setdefault(f"{key}_hist", {}), str(b))


def add_tokens(stats: dict[str, Any], side: str, n_tokens: int) -> None:
    _bump(stats.setdefault(f"tokens_hist_{side}", {}), _log2_bin(n_tokens))


def percentile_from_hist(hist: dict[str, int], q: float, bins: int = DENSITY_BINS) -> float | None:
    """Upper edge of the density bin holding quantile `q` (0..1)."""
    total = sum(hist.values())
    if not total:
        return None
    need, run = q * total, 0
    for b in sorted(hist, key=int):
        run += hist[b]
        if run >= need:
            return round((int(b) + 1) / bins, 4)
    return 1.0
