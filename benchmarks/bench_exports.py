"""Exports on many short documents: their seconds and their share of the whole job, 1 vs 2 processes.

    python benchmarks/bench_exports.py [--docs 300000] [--workers 1 2] [--repeats 1]

Builds a corpus of `--docs` short real-web records (≤ 400 chars, benchmarks/corpus.py), runs the whole
`streamprep ingest` (local engine, quality gates off, phi-2) once per worker count and prints, from
run.json `timings`, the exports seconds, the job seconds and exports / job. The streamprep imported is
whatever `python -m streamprep` resolves to (set PYTHONPATH to compare two checkouts).
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
from corpus import build_short  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=300_000)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--shard-records", type=int, default=20_000)
    ap.add_argument("--work", type=Path, default=Path("/tmp/streamprep-bench"))
    a = ap.parse_args()
    corpus = build_short(a.work / f"short_{a.docs}.jsonl", a.docs)
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
