"""A figure a reject's reason compares with its limit. Its own module, light: near-dedup's reasons use it too, and
`quality` (which the job's process imports) imports near-dedup, not the gates (Hyperscan, word lists, detectors)."""
from __future__ import annotations


def shown(x: float, limit: float) -> str:
    """`x` for a reason that compares it with the `limit` it crossed: rounded as meta has it, unless that puts it on
    the limit or past it ("p=0.9 < 0.9"); then with as many decimals as keep it on its side."""
    for digits in range(4, 18):
        r = round(float(x), digits)
        if r != limit and (r < limit) == (x < limit):
            return f"{r:g}" if digits == 4 else repr(r)
    return repr(float(x))
