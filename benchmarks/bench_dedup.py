"""Exact-dedup index at scale: resident bytes per kept document, µs per lookup / insert, load-from-log time.

    python benchmarks/bench_dedup.py --sizes 10000000 50000000 [--dir /tmp]

Resident bytes are measured with tracemalloc (numpy reports its buffers to it): the traced size held by the
loaded index, divided by its digest count. The old index (a Python set + a bytearray copy, loaded by a
Python loop) is measured on --old digests (default 2 M; it needs ~146 B/doc) for comparison.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's quality/, not an installed one
from quality.dedup import DIGEST_SIZE, DedupIndex, _merge_runs  # noqa: E402

PROBES = 200_000
INSERTS = 300_000


class OldDedupIndex:
    """The index before this change (set of digests + bytearray log), kept here as the baseline."""

    def __init__(self) -> None:
        self.seen: set[bytes] = set()
        self.log = bytearray()

    def add(self, digest: bytes) -> None:
        if digest not in self.seen:
            self.seen.add(digest)
            self.log += digest

    @classmethod
    def from_bytes(cls, data: bytes) -> OldDedupIndex:
        index, view = cls(), memoryview(data)
        for i in range(0, len(data), DIGEST_SIZE):
            index.add(bytes(view[i:i + DIGEST_SIZE]))
        return index


def write_log(path: Path, n: int) -> None:
    """n random 32-byte digests (distinct with overwhelming probability), written in 32 MB chunks."""
    with open(path, "wb") as fh:
        for start in range(0, n, 1 << 20):
            fh.write(os.urandom(min(1 << 20, n - start) * DIGEST_SIZE))


def measure(path: Path, n: int) -> dict[str, float]:
    tracemalloc.start()
    t0 = time.perf_counter()
    index = DedupIndex(path)
    load = time.perf_counter() - t0
    resident, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rng = random.Random(1)
    with open(path, "rb") as fh:
        present = [os.pread(fh.fileno(), DIGEST_SIZE, rng.randrange(n) * DIGEST_SIZE) for _ in range(PROBES)]
    absent = [os.urandom(DIGEST_SIZE) for _ in range(PROBES)]
    t0 = time.perf_counter()
    hits = sum(d in index for d in present)
    hit_us = (time.perf_counter() - t0) / PROBES * 1e6
    t0 = time.perf_counter()
    misses = sum(d in index for d in absent)
    miss_us = (time.perf_counter() - t0) / PROBES * 1e6
    assert hits == PROBES and misses == 0
    new = [os.urandom(DIGEST_SIZE) for _ in range(INSERTS)]
    t0 = time.perf_counter()
    for d in new:
        index.add(d)
    insert_us = (time.perf_counter() - t0) / INSERTS * 1e6
    # the rare big step: a run of n/7 digests merged into the loaded one (the last of a tier's merges);
    # amortised over the n/7 inserts that filled it
    run_keys = np.sort(np.frombuffer(os.urandom(n // 7 * 8), dtype="<u8"))
    t0 = time.perf_counter()
    _merge_runs([index._runs[0], (run_keys, np.arange(n // 7, dtype=np.uint32))])
    merge_s = time.perf_counter() - t0
    insert_us += merge_s / (n // 7) * 1e6
    return {"n": n, "load_s": load, "resident_b_per_doc": resident / n, "load_peak_b_per_doc": peak / n,
            "hit_us": hit_us, "miss_us": miss_us, "insert_us": insert_us, "merge_s": merge_s}


def measure_old(path: Path, n: int) -> dict[str, float]:
    data = path.read_bytes()[: n * DIGEST_SIZE]
    tracemalloc.start()
    t0 = time.perf_counter()
    index = OldDedupIndex.from_bytes(data)
    load = time.perf_counter() - t0
    resident, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    probes = [data[i * DIGEST_SIZE:(i + 1) * DIGEST_SIZE] for i in range(0, n, max(1, n // PROBES))]
    t0 = time.perf_counter()
    assert all(d in index.seen for d in probes)
    return {"n": n, "load_s": load, "resident_b_per_doc": resident / n,
            "hit_us": (time.perf_counter() - t0) / len(probes) * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000_000, 50_000_000])
    ap.add_argument("--old", type=int, default=2_000_000)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    print(f"load average at start: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for n in sorted(set(args.sizes + [args.old])):
            path = Path(tmp) / f"{n}.dedup"
            write_log(path, n)
            if n == args.old:
                old = measure_old(path, n)
                new = measure(path, n)
                print(f"old index n={n:,}: load {old['load_s']:.2f} s, {old['resident_b_per_doc']:.1f} B/doc, "
                      f"hit {old['hit_us']:.2f} µs | new: load {new['load_s']:.3f} s "
                      f"({old['load_s'] / new['load_s']:.0f}x faster), {new['resident_b_per_doc']:.1f} B/doc")
            if n in args.sizes:
                r = measure(path, n)
                print(f"new index n={n:,}: resident {r['resident_b_per_doc']:.2f} B/doc (load peak "
                      f"{r['load_peak_b_per_doc']:.1f}), load {r['load_s']:.2f} s, lookup hit {r['hit_us']:.2f} µs, "
                      f"miss {r['miss_us']:.2f} µs, insert {r['insert_us']:.2f} µs (amortised, incl. a {r['merge_s']:.2f} s "
                      f"merge into the loaded run per n/7 inserts)")
            path.unlink()
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
