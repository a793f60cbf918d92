"""Exports on many short documents: their seconds and their share of the whole job, 1 vs 2 processes; or the
memory of the exports' plan at millions of records.

    python benchmarks/bench_exports.py [--docs 300000] [--workers 1 2] [--repeats 1]
    python benchmarks/bench_exports.py --plan 1000000 10000000 [--workers 1 2] [--part-records 100000]

Job mode: builds a corpus of `--docs` short real-web records (≤ 400 chars, benchmarks/corpus.py), runs the
whole `streamprep ingest` (local engine, quality gates off, phi-2) once per worker count and prints, from
run.json `timings`, the exports seconds, the job seconds and exports / job.

Plan mode (`--plan N ...`): writes synthetic part summaries and receipts for one dataset of N records (token
counts spread over every length bucket; no text, no `.bin`: the plan reads neither), then, in a fresh process
per (N, workers), times the index and the Parquet plan (`plan_shards`, no shard written) and prints the job
process's peak traced memory (tracemalloc: Python objects and numpy buffers) and its peak RSS growth over the
step. Works on the tree before the keyed order too (one `random.Random(seed + b).shuffle` per bucket).

The streamprep imported is whatever PYTHONPATH resolves to (set it to compare two checkouts).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import GATES_OFF, PHI2  # noqa: E402
from corpus import build_short, cache_bytecode  # noqa: E402


def run_job(corpus: Path, run_dir: Path, workers: int, shard_records: int) -> dict[str, float]:
    cfg = {"run": {"name": "bench"}, "datasets": [{"name": "web", "path": str(corpus)}],
           "tokenizer": {"path": str(PHI2)}, "quality": GATES_OFF, "output": {"shard_records": shard_records},
           "execution": {"engine": "local", "workers": workers}}
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cfg_path = run_dir.with_suffix(".yaml")
    cfg_path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path),
                           "--run-dir", str(run_dir)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"ingest failed: {proc.stderr.decode()[-2000:]}")
    timings = json.loads((run_dir / "run.json").read_text())["timings"]
    return {"job": wall, **timings}


def synthetic_run(run_dir: Path, n: int, part_records: int) -> None:
    """Receipts and part summaries of one dataset "web" of `n` records (deterministic), nothing else."""
    import numpy as np

    from streamprep import atomic
    from streamprep.exports import summary

    if (run_dir / "done").exists():
        return
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    rng = np.random.default_rng(0)
    for p, start in enumerate(range(0, n, part_records)):
        m = min(part_records, n - start)
        rec = np.zeros(m, dtype=summary.RECORD)
        rec["n_tokens"] = np.minimum(rng.lognormal(5.5, 1.2, m).astype(np.int64) + 1, 20_000)
        rec["line_bytes"] = rec["n_tokens"] * 4 + 60
        rec["line"] = np.arange(m)
        receipt = {"status": "completed", "dataset": "web", "part": f"part-{p:05d}",
                   "stats": {"num_documents": m, "num_tokens": int(rec["n_tokens"].sum()), "dropped_empty": []}}
        path = run_dir / "receipts" / "web" / f"part-{p:05d}.json"
        atomic.write_json(path, receipt)
        atomic.write_bytes(path.with_suffix(".summary"), summary.encode(summary.PartSummary("uint16", rec), receipt))
    (run_dir / "done").touch()


def plan_child(run_dir: Path, workers: int) -> None:
    """Index + plan over `run_dir`'s parts in this process, measured; prints one JSON line."""
    import resource
    import tracemalloc

    from streamprep import atomic
    from streamprep.config import section
    from streamprep.exports import parquet, summary
    from streamprep.exports.index import ShardRef
    from streamprep.executor import LocalExecutor

    refs = []
    for path in sorted((run_dir / "receipts" / "web").glob("*.json")):
        refs.append(ShardRef("web", "train", path.stem, run_dir / "ingest" / f"{path.stem}.jsonl",
                             run_dir / "binidx" / f"{path.stem}_text_document", atomic.read_json(path), path))
    output = section("output", {})
    datasets = [("web", "train", refs)]
    with LocalExecutor(workers) as pool:
        pool.warm()
        with open("/proc/self/status") as fh:
            rss0 = next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:"))  # KiB
        tracemalloc.start()
        t0 = time.perf_counter()
        if hasattr(parquet, "shuffled"):  # the tree before the keyed order
            from streamprep.exports.index import build_indexes
            indexes = build_indexes(datasets, summary.iter_summaries(refs, pool))
            plans = parquet.plan_shards(indexes, output, 1234)
        else:
            from streamprep.exports.order import build_indexes
            indexes = build_indexes(datasets, pool, 1234, output.parquet.length_buckets, parquet.BYTES_PER_TOKEN,
                                    run_dir)
            plans = parquet.plan_shards(indexes, output)
        seconds = time.perf_counter() - t0
        if not hasattr(parquet, "shuffled"):
            from streamprep.exports.order import remove_scratch
            remove_scratch(run_dir)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"records": len(indexes[0]), "parts": len(refs), "shards": len(plans), "seconds": seconds,
                      "traced_peak": peak, "rss_growth": (rss - rss0) * 1024, "rss_peak": rss * 1024}))


def plan_mode(sizes: list[int], workers: list[int], part_records: int, work: Path) -> None:
    print(f"{'records':>10} {'parts':>6} {'workers':>7} {'shards':>6} {'plan s':>7} {'traced peak':>12} "
          f"{'B/record':>8} {'RSS growth':>11} {'RSS peak':>9}")
    for n in sizes:
        run_dir = work / f"plan_{n}_{part_records}"
        synthetic_run(run_dir, n, part_records)
        for w in workers:
            out = subprocess.run([sys.executable, __file__, "--plan-child", str(run_dir), "--workers", str(w)],
                                 check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            print(f"{r['records']:>10} {r['parts']:>6} {w:>7} {r['shards']:>6} {r['seconds']:7.2f} "
                  f"{r['traced_peak'] / 2**20:9.1f} MiB {r['traced_peak'] / r['records']:8.2f} "
                  f"{r['rss_growth'] / 2**20:7.1f} MiB {r['rss_peak'] / 2**20:5.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plan", type=int, nargs="+", metavar="N", help="plan mode: record counts")
    ap.add_argument("--plan-child", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--part-records", type=int, default=100_000)
    ap.add_argument("--docs", type=int, default=300_000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--shard-records", type=int, default=20_000)
    ap.add_argument("--work", type=Path, default=Path("/tmp/streamprep-bench"))
    a = ap.parse_args()
    if a.plan_child:
        return plan_child(a.plan_child, a.workers[0])
    if a.plan:
        return plan_mode(a.plan, a.workers, a.part_records, a.work)
    corpus = build_short(a.work / f"short_{a.docs}.jsonl", a.docs)
    print(cache_bytecode(), flush=True)
    print(f"corpus: {corpus} ({corpus.stat().st_size / 1e6:.1f} MB, {a.docs} docs); "
          f"shard_records={a.shard_records}; median of {a.repeats}")
    print(f"{'workers':>7} {'job s':>8} {'exports s':>10} {'exports/job':>11}  phases")
    for w in a.workers:
        runs = [run_job(corpus, a.work / f"exports_w{w}_{r}", w, a.shard_records) for r in range(a.repeats)]
        med = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
        phases = ", ".join(f"{k} {v:.2f}" for k, v in med.items() if k != "job")
        print(f"{w:>7} {med['job']:8.2f} {med['exports']:10.2f} {med['exports'] / med['job']:11.3f}  {phases}")


if __name__ == "__main__":
    main()
