"""How much of a job's CPU the driver process spends, and how the job scales from 1 to 2 workers.

    python benchmarks/bench_driver.py --mb 62 [--gates default|off] [--repeats 1] [--marginal-mb 250] [--unit-mb 4]

Runs `streamprep ingest` (`engine: local`) with `workers: 1` and `workers: 2` on the same corpus and
samples every process of the job's tree every 50 ms (psutil CPU times; a process's last < 50 ms before it
exits are not seen). Prints per run: wall seconds, the driver's CPU seconds and its share of the tree's (for
`workers: 2`: with `workers: 1` the worker is a thread in the driver, whose CPU is then the job's),
the driver's CPU-s per input GB and how many cores of this box's per-core rate one driver could feed
(the tree's CPU-s per GB over the driver's), the 2-worker speed-up, each run's phases from its log (start-up
before the first line, ingest, the tokenizing left after it, exports and audit, exit) and the speed-up `workers: 2`
would reach if only ingest ran twice as fast (the bound the other phases set). Issue 28's targets: driver share
≤ 3 % with the default gates, `workers: 2` ≥ 1.8x `workers: 1`. With --marginal-mb, `workers: 2` runs
again on a corpus of that size and the driver's and the tree's CPU-s per GB are printed for the megabytes
between the two (the driver's fixed start-up, ~0.3 CPU-s of imports, the tokenizer's load and check and the
audit, drops out): what one driver costs per GB of a long job, and how many cores of work it can keep fed.

Before the jobs, the default QC chain judges the corpus's first 1 000 records in a process pinned to each CPU in
turn, twice: the two cores' speeds on this kind of work at the time (on a shared host they differ, by up to 2×
for minutes at a time, which bounds what `workers: 2` can gain then).

The job runs this checkout's code, whatever the current directory and PYTHONPATH (`python -m` would put the
current directory first): to compare two revisions, run each one's copy of this script.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import orjson
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import GATES_OFF, PHI2, TreeSampler  # noqa: E402
from corpus import REPO, build, cache_bytecode  # noqa: E402


def run(corpus: Path, work: Path, workers: int, quality: dict, unit_mb: float | None = None) -> dict:
    run_dir = work / f"run_w{workers}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    cfg = {"run": {"name": "bench"}, "datasets": [{"name": "web", "path": str(corpus)}],
           "tokenizer": {"path": str(PHI2)}, "quality": quality, "output": {"shard_records": 5000},
           "execution": {"engine": "local", "workers": workers, **({"unit_mb": unit_mb} if unit_mb else {})}}
    cfg_path = run_dir.with_suffix(".yaml")
    cfg_path.write_text(yaml.safe_dump(cfg))
    t0, started = time.perf_counter(), time.time()
    proc = subprocess.Popen([sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path), "--run-dir",
                             str(run_dir)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sampler = TreeSampler(proc.pid)
    _, err = proc.communicate()
    sampler.stop()
    driver, tree = sampler.cpu.get(proc.pid, 0.0), sum(sampler.cpu.values())
    if proc.returncode:
        raise SystemExit(f"ingest failed: {err.decode()[-2000:]}")
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "driver": driver, "tree": tree, **phases(run_dir, started, seconds)}


# A child's work for `core_speeds`: the default QC chain over the corpus's first 1 000 records, best of 3 passes.
CHAIN_PROBE = """
import itertools, sys, time, orjson
from quality import QualityControl, load_quality_settings
records = [orjson.loads(line) for line in itertools.islice(open(sys.argv[1], "rb"), 1000)]
passes = []
for _ in range(3):  # a new QualityControl each pass: one would recall the verdicts of texts it judged
    qc, t = QualityControl(load_quality_settings({})), time.process_time()
    qc.evaluate_batch(records)
    passes.append(time.process_time() - t)
print(min(passes) / len(records) * 1e6)
"""


def core_speeds(corpus: Path, rounds: int = 2) -> dict[int, list[float]]:
    """µs a record of the default QC chain in a process pinned to each CPU, `rounds` times in turn."""
    cpus, out = sorted(os.sched_getaffinity(0)), {}
    for _ in range(rounds):
        for cpu in cpus:
            proc = subprocess.run([sys.executable, "-c", CHAIN_PROBE, str(corpus)], cwd=REPO, capture_output=True,
                                  text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)},
                                  preexec_fn=lambda cpu=cpu: os.sched_setaffinity(0, {cpu}))
            out.setdefault(cpu, []).append(float(proc.stdout))
    return out


# (phase, the log event it ends at): the job's steps in order, timed from the process's start
PHASES = (("start", None), ("ingest", "ingest done"), ("tail", "tokenization done"), ("exports", "run complete"))


def phases(run_dir: Path, started: float, seconds: float) -> dict[str, float]:
    """Seconds of each phase of the job, from its log's timestamps: `start` until the first line (imports, config,
    tokenizer), `ingest`, `tail` (tokenizing after ingest), `exports` (with the audit), `exit` (after the last line)."""
    lines = [orjson.loads(x) for x in (run_dir / "logs" / "streamprep.log").read_bytes().splitlines()]
    stamps = [(e["event"], _seconds(e) - started) for e in lines]
    at = dict(stamps)  # an event's last line
    ends = [min(t for _, t in stamps)] + [at[event] for _, event in PHASES[1:]]
    out = dict(zip((name for name, _ in PHASES), [ends[0]] + [b - a for a, b in zip(ends, ends[1:])]))
    return {**out, "exit": seconds - ends[-1]}


def _seconds(event: dict) -> float:
    """A log line's time, in seconds since the epoch."""
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def share_line(workers: int, m: dict, gb: float) -> str:
    """One run's CPU line. With `workers: 1` the job's worker is a thread in the driver's process (the executor's
    one ThreadPoolExecutor thread), so the driver's CPU is the job's and a driver share says nothing."""
    if workers == 1:
        return (f"workers 1: {m['seconds']:.2f} s wall; {m['tree']:.2f} CPU-s, {m['driver']:.2f} of them in the "
                f"driver's process, whose thread is the job's one worker (no driver share: see workers 2)")
    return (f"workers {workers}: {m['seconds']:.2f} s wall; driver {m['driver']:.2f} of {m['tree']:.2f} CPU-s "
            f"({100 * m['driver'] / m['tree']:.1f} %); driver {m['driver'] / gb:.1f} CPU-s per input GB; "
            f"one driver feeds ~{m['tree'] / m['driver']:.0f} cores at this rate")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=62)
    ap.add_argument("--gates", choices=("default", "off"), default="default")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/streamprep-bench"))
    ap.add_argument("--marginal-mb", type=int, default=0, help="a second, larger corpus for the marginal rates")
    ap.add_argument("--unit-mb", type=float, default=None, help="execution.unit_mb (default: the config default)")
    a = ap.parse_args()
    a.work = a.work.resolve()  # the job runs in the checkout
    a.work.mkdir(parents=True, exist_ok=True)
    corpus = build(a.work / f"corpus_{a.mb}mb.jsonl", a.mb)
    gb = corpus.stat().st_size / 1e9
    quality = GATES_OFF if a.gates == "off" else {}
    print(cache_bytecode(), flush=True)
    speeds = core_speeds(corpus)
    runs = {w: [run(corpus, a.work, w, quality, a.unit_mb) for _ in range(a.repeats)] for w in (1, 2)}
    print(f"corpus {corpus.stat().st_size / 1e6:.1f} MB, gates {a.gates}, unit_mb {a.unit_mb or 'default'}, "
          f"median of {a.repeats}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("default QC chain, µs a record, pinned to each CPU in turn (before the jobs): " +
          "; ".join(f"CPU {cpu} {' / '.join(f'{v:.0f}' for v in vs)}" for cpu, vs in speeds.items()))
    med = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items()}
    for w, m in med.items():
        print(share_line(w, m, gb))
    print(f"workers 2 / workers 1 speed-up: {med[1]['seconds'] / med[2]['seconds']:.2f}x")
    names = [name for name, _ in PHASES] + ["exit"]
    for w, m in med.items():
        print(f"workers {w} phases (s): " + ", ".join(f"{n} {m[n]:.2f}" for n in names))
    one = med[1]
    print(f"bound for workers 2 if only ingest ran twice as fast: {one['seconds'] / (one['seconds'] - one['ingest'] / 2):.2f}x "
          f"(the other phases, {one['seconds'] - one['ingest']:.2f} s of workers 1's job, as they are)")
    if a.marginal_mb:
        big = build(a.work / f"corpus_{a.marginal_mb}mb.jsonl", a.marginal_mb)
        rs = [run(big, a.work, 2, quality, a.unit_mb) for _ in range(a.repeats)]
        m = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        d_gb = big.stat().st_size / 1e9 - gb
        driver, tree = (m["driver"] - med[2]["driver"]) / d_gb, (m["tree"] - med[2]["tree"]) / d_gb
        print(f"workers 2 at {big.stat().st_size / 1e6:.1f} MB: {m['seconds']:.2f} s wall; driver {m['driver']:.2f} "
              f"of {m['tree']:.2f} CPU-s ({100 * m['driver'] / m['tree']:.1f} %)")
        print(f"marginal, the {d_gb * 1e3:.0f} MB between: driver {driver:.1f} CPU-s per GB, tree {tree:.1f} CPU-s per "
              f"GB (driver {100 * driver / tree:.1f} %); one driver feeds ~{tree / max(driver, 1e-9):.0f} cores")


if __name__ == "__main__":
    main()
