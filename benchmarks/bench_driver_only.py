"""Can one driver keep up with a cluster? The driver's own work per unit, with workers that do none.

    python benchmarks/bench_driver_only.py [--units 1000 10000] [--records 100] [--slope-records 20000] [--dedup none]
                                           [--holders N]

Runs the real ingest driver (`ingest.ingest_all`: plan written to the run dir, reader, decider with exact
dedup, committer, part sealing, checkpoints with fsync) over N planned units of a declared 1 GB each, with
a fake worker runner in place of the QC pool: `judge_piece` returns a Summary of `--records` records per
unit without reading anything (90 % kept, 5 % exact copies of the previous unit's records, 5 % rejected; with
the digests' sort, which a worker sends with exact dedup and which counts as the fake workers' CPU),
`finalize_piece` and `assemble_part` return at once. No input data exists beyond one tiny file the source
fingerprints. Each N runs in a fresh child process, so its peak RSS is its own. The exact-dedup indexes live in
the dedup holders (`streamprep.holders`; `--holders`, default: the config's, one process beside two workers),
whose CPU and peak RSS are printed apart: the driver's RSS stays flat in records, a holder's grows ~16 B a kept one.

Prints per N: units/hour, the GB/s of planned input that rate feeds, the driver's CPU-s (the fake workers'
share, measured, is subtracted), and peak RSS; then the RSS ratio between the largest and the smallest N
(issue 28: >= 10 000 units/hour, i.e. >= 2.8 GB/s, RSS flat in unit count). A third run at
`--slope-records` records per unit gives the driver's cost per record decided, and so the units/hour at
a realistic 1 GB unit of ~1 KB documents (10^6 records).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np

UNIT_BYTES = 10**9   # what each planned unit declares: 1 GB
DOC_BYTES = 1000     # a kept record's text, as the fake workers report it


SPREAD = 0x9E3779B97F4A7C15  # odd: x -> x * SPREAD mod 2^64 maps distinct ids to distinct, evenly spread keys


class FakeRunner:
    """The executor's interface (`submit`, `workers`, `close`) answering at once, reading and writing nothing."""

    def __init__(self, quality: Any, mode: Any, workers: int, records: int = 100):
        from streamprep import unit_worker

        self.workers, self.records, self.spent = max(1, workers), records, 0.0
        self._uw = unit_worker
        n = records
        self.kinds = bytes(unit_worker.REJECTED if j % 20 == 19 else unit_worker.KEPT for j in range(n))
        self.kept_bytes = np.full(sum(k == unit_worker.KEPT for k in self.kinds), DOC_BYTES, np.int64)
        self.checks = ["min_chars"] * (n - len(self.kept_bytes))
        self.calls: dict[Callable[..., Any], Callable[..., Any]] = {
            unit_worker.judge_piece: self._judge, unit_worker.finalize_piece: self._finalize,
            unit_worker.assemble_part: self._assemble}

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        t0 = time.thread_time()
        fut: Future = Future()
        fut.set_result(self.calls[fn](*args))
        self.spent += time.thread_time() - t0
        return fut

    def _judge(self, name: str, text_field: str, batch: int, stage: str, unit: Any, items: Any, options: Any,
               ahead: tuple = ()) -> Any:
        """Distinct random-looking digests per record, except every 20th, a copy of the previous unit's (an exact
        duplicate)."""
        u, j = unit.file, np.arange(self.records, dtype=np.uint64)
        ids = u * self.records + j
        if u:
            copies = j % 20 == 10
            ids[copies] = (u - 1) * self.records + j[copies] - 1
        words = np.zeros((self.records, 4), np.uint64)
        # spread over the key space as SHA-256 digests are (sequential keys would keep the index's searches in cache)
        words[:, 0] = ids * np.uint64(SPREAD)
        words[:, 1] = 1  # never NO_DIGEST (all zeros)
        blob = words.tobytes()
        return self._uw.Summary(self.kinds, blob, self.kept_bytes, self.checks, None, False,
                                self._uw.digest_order(blob))  # the worker's sort

    def _finalize(self, name: str, stage: str, d: Any) -> tuple[bytes, dict[str, Any], int]:
        kept = sum(d.keep)
        rejects = b"".join(b'{"failed_check":"min_chars","reason":"short","text":"..."}\n' for _ in d.sampled)
        st = {"chars_hist_kept": {"10": kept}, "rejects_by_check": {"min_chars": d.applied - kept}}
        return rejects, st, kept * (DOC_BYTES + 60)

    def _assemble(self, path: str, slices: list[tuple[str, int, int]]) -> tuple[str, int]:
        return "0" * 64, sum(n for _, _, n in slices) * (DOC_BYTES + 60)

    def close(self) -> None:
        pass


def one(n_units: int, records: int, work: Path, dedup: str, holders: int | None) -> dict[str, Any]:
    """Run the driver over `n_units` fake units in this process; its figures."""
    from streamprep import ingest, units
    from streamprep.config import load
    from streamprep.units import Unit

    work.mkdir(parents=True, exist_ok=True)
    src = work / "in.jsonl"
    src.write_text('{"text": "never read"}\n')
    cfg = load({"run": {"name": "driver-only"}, "datasets": [{"name": "web", "path": str(src)}],
                "tokenizer": {"path": None}, "quality": {"expected_language": None, "dedup": dedup},
                "output": {"shard_records": 100_000},
                "execution": {"engine": "local", "workers": 2, "dedup_holders": holders}})
    units.plan_dataset = lambda files, *a, **k: [Unit("range", i, str(src), "jsonl", 0, UNIT_BYTES)
                                                 for i in range(n_units)]
    runners: list[FakeRunner] = []

    def runner(execution: Any, quality: Any, mode: Any) -> FakeRunner:
        runners.append(FakeRunner(quality, mode, execution.workers, records))
        return runners[-1]

    ingest.worker_executor = runner  # the seam: where ingest_all makes its executor
    run = work / "run"
    ctx = ingest.IngestContext.of(cfg, run, run / "checkpoints", asyncio.Event())
    ctx.holders = ingest.start_holders(ctx)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0, c0 = time.perf_counter(), time.process_time()
    held0 = ctx.holders.usage()
    states = asyncio.run(ingest.ingest_all(ctx))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    held = ctx.holders.usage()
    ctx.holders.close()
    inline = ctx.holders.where == "inline"  # then its CPU and RSS are the driver's own
    st = states["web"]
    assert st.done and st.consumed == n_units * records, (st.done, st.consumed)
    return {"units": n_units, "records": records, "wall": wall, "cpu": cpu - runners[0].spent,
            "fake_cpu": runners[0].spent, "rss_before_mb": rss0 / 1024,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "kept": st.kept, "rejected": st.rejected, "parts": st.part_index,
            "holder_cpu": 0.0 if inline else sum(h["cpu_s"] for h in held) - sum(h["cpu_s"] for h in held0),
            "holder_rss_mb": 0.0 if inline else max(h["peak_rss_mb"] for h in held)}


def child(n_units: int, records: int, work: Path, dedup: str, holders: int | None) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--one", str(n_units), "--records", str(records),
                          "--work", str(work), "--dedup", dedup]
                         + ([] if holders is None else ["--holders", str(holders)]),
                         capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"run of {n_units} units failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--units", type=int, nargs="+", default=[1000, 10000])
    ap.add_argument("--records", type=int, default=100, help="records per unit the fake workers report")
    ap.add_argument("--slope-records", type=int, default=20000,
                    help="records per unit of one more run (at the smallest N) for the cost per record; 0: skip "
                         "(with 2 000, the difference was below the two runs' noise)")
    ap.add_argument("--dedup", default="exact",
                    help="quality.dedup: exact (its index grows 12 B a kept record) or none")
    ap.add_argument("--holders", type=int, default=None,
                    help="execution.dedup_holders (0: the index in the driver's process, as before round 26)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, default=None)
    a = ap.parse_args()
    if a.one is not None:
        print(json.dumps(one(a.one, a.records, a.work, a.dedup, a.holders)))
        return
    with tempfile.TemporaryDirectory(prefix="driver-only-") as tmp:
        runs = [child(n, a.records, Path(tmp) / f"n{n}", a.dedup, a.holders) for n in a.units]
        slope = child(min(a.units), a.slope_records, Path(tmp) / "slope", a.dedup, a.holders) \
            if a.slope_records else None
    print(f"{'units':>7} {'rec/unit':>8} {'wall s':>7} {'units/hour':>11} {'GB/s planned':>12} {'driver CPU-s':>12} "
          f"{'CPU-ms/unit':>11} {'fake CPU-s':>10} {'RSS before MB':>13} {'peak RSS MB':>11} "
          f"{'holder CPU-s':>12} {'holder RSS MB':>13}")
    for r in runs + ([slope] if slope else []):
        per_h = r["units"] / r["wall"] * 3600
        gbs = per_h / 3600 * UNIT_BYTES / 1e9
        print(f"{r['units']:>7} {r['records']:>8} {r['wall']:>7.2f} {per_h:>11,.0f} {gbs:>12.1f} "
              f"{r['cpu']:>12.2f} {1000 * r['cpu'] / r['units']:>11.2f} {r['fake_cpu']:>10.2f} "
              f"{r['rss_before_mb']:>13.1f} {r['peak_rss_mb']:>11.1f} {r['holder_cpu']:>12.2f} "
              f"{r['holder_rss_mb']:>13.1f}")
    lo, hi = runs[0], runs[-1]
    print(f"peak RSS {hi['units']} / {lo['units']} units: {hi['peak_rss_mb'] / lo['peak_rss_mb']:.3f}x "
          f"(growth during ingest {lo['peak_rss_mb'] - lo['rss_before_mb']:.1f} -> "
          f"{hi['peak_rss_mb'] - hi['rss_before_mb']:.1f} MB)")
    if slope:
        base = next(r for r in runs if r["units"] == slope["units"])
        us = 1e6 * (slope["cpu"] - base["cpu"]) / (slope["units"] * (slope["records"] - base["records"]))
        if us <= 0:  # the extra records cost less than the two runs differ by chance: no rate can be derived
            print(f"driver CPU per record decided: {us:.2f} us, below what these two runs resolve (use more "
                  f"--slope-records)")
        else:
            unit_s = base["cpu"] / base["units"] + us  # per unit, plus 10^6 records at `us` microseconds
            print(f"driver CPU per record decided: {us:.2f} us; a 1 GB unit of 10^6 ~1 KB records costs the driver "
                  f"~{unit_s:.2f} CPU-s: {3600 / unit_s:,.0f} units/hour ({UNIT_BYTES / unit_s / 1e9:.2f} GB/s)")
        more = slope["units"] * (slope["records"] - base["records"])  # records decided more than in `base`
        held_us = 1e6 * (slope["holder_cpu"] - base["holder_cpu"]) / more
        print(f"per record decided more: the driver's peak RSS "
              f"{(slope['peak_rss_mb'] - base['peak_rss_mb']) * 2**20 / more:+.2f} B, the holders' "
              f"{(slope['holder_rss_mb'] - base['holder_rss_mb']) * 2**20 / more:+.2f} B and {held_us:.2f} us of CPU")


if __name__ == "__main__":
    main()
