"""What a whole job's durable writes cost: the job as it is against the same job with every fsync a no-op.

    python benchmarks/bench_durability.py [--short-docs 2000000 | --mb 62] [--gates off|default] [--workers 2]
                                          [--pairs 3] [--fsync-table]

Every file a run writes is made durable (`streamprep.atomic`: tmp + fsync + rename, then the folder's fsync), and
a worker waits for each fsync, whose cost is mostly the file's bytes reaching the disk. This runs the whole
`streamprep ingest` (local engine) alternately as it is and under `eatmydata` (LD_PRELOAD: fsync, fdatasync
and sync return at once; the Debian/Ubuntu package of that name), A B A B, and prints each pair's wall-time
ratio and their median: the share of the job that its waits for the disk and the kernel's writeback of its
bytes take. With --fsync-table, one more run with `os.fsync` timed in every process of the job (a
sitecustomize on the job's PYTHONPATH, in a temporary folder) prints the fsync calls and their seconds by
kind of file, summed over the processes. Without `eatmydata` on PATH, only the table is printed.

The streamprep run is this checkout's, whatever the current directory.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_pipeline import GATES_OFF, PHI2  # noqa: E402
from corpus import REPO, build, build_short, cache_bytecode  # noqa: E402

# Times os.fsync in each process of the job; each process rewrites its own totals file every 50 calls.
SITECUSTOMIZE = '''
import os, sys, time
from collections import defaultdict
_fsync, _totals, _calls = os.fsync, defaultdict(lambda: [0, 0.0]), [0]
def _kind(fd):
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"
    if os.path.isdir(path):
        return "folder"
    name = os.path.basename(path).split(".streamprep-tmp.")[0].lstrip(".")
    return name.rsplit(".", 1)[-1] if "." in name else name
def fsync(fd):
    t = time.perf_counter()
    try:
        return _fsync(fd)
    finally:
        entry = _totals[_kind(fd)]
        entry[0] += 1
        entry[1] += time.perf_counter() - t
        _calls[0] += 1
        if _calls[0] % 50 == 0 or entry[0] == 1:
            with open(os.path.join(OUT, f"{os.getpid()}.tsv"), "w") as fh:
                fh.writelines(f"{k}\\t{n}\\t{s}\\n" for k, (n, s) in _totals.items())
os.fsync = fsync
'''


def job(config: Path, run_dir: Path, env: dict[str, str], prefix: list[str]) -> float:
    """Seconds of one whole `streamprep ingest` of `config` into a fresh `run_dir`."""
    shutil.rmtree(run_dir, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run([*prefix, sys.executable, "-m", "streamprep", "ingest", "--config", str(config), "--run-dir",
                    str(run_dir)], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seconds = time.perf_counter() - t0
    shutil.rmtree(run_dir, ignore_errors=True)
    return seconds


def fsync_table(config: Path, run_dir: Path) -> None:
    """One run with os.fsync timed in every process; prints calls and seconds by kind of file."""
    with tempfile.TemporaryDirectory(prefix="bench-fsync-") as folder:
        out = Path(folder, "out")
        out.mkdir()
        Path(folder, "sitecustomize.py").write_text(f"OUT = {str(out)!r}\n{SITECUSTOMIZE}")
        env = {**os.environ, "PYTHONPATH": f"{folder}{os.pathsep}{REPO}"}
        seconds = job(config, run_dir, env, [])
        totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        for tsv in out.glob("*.tsv"):  # the last totals each process wrote (at most 49 calls each unseen)
            for line in tsv.read_text().splitlines():
                kind, n, s = line.split("\t")
                totals[kind][0] += int(n)
                totals[kind][1] += float(s)
    print(f"fsync by kind of file, one run ({seconds:.1f} s; summed over the job's processes):")
    for kind, (n, s) in sorted(totals.items(), key=lambda kv: -kv[1][1]):
        print(f"  {kind:>12}: {int(n):6d} calls, {s:6.2f} s ({1e3 * s / n:.2f} ms each)")
    print(f"  {'all':>12}: {int(sum(n for n, _ in totals.values())):6d} calls, "
          f"{sum(s for _, s in totals.values()):6.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = ap.add_mutually_exclusive_group()
    size.add_argument("--short-docs", type=int, default=2_000_000, help="a corpus of this many short documents")
    size.add_argument("--mb", type=int, help="a corpus of this many MB of web documents instead")
    ap.add_argument("--gates", choices=("off", "default"), default="off")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--fsync-table", action="store_true")
    ap.add_argument("--work", type=Path, default=Path("/tmp/streamprep-bench"))
    a = ap.parse_args()
    work = a.work.resolve()
    corpus = build(work / f"corpus_{a.mb}mb.jsonl", a.mb) if a.mb else \
        build_short(work / f"short_{a.short_docs}.jsonl", a.short_docs)
    config = work / "durability.yaml"
    config.write_text(yaml.safe_dump({
        "run": {"name": "bench"}, "datasets": [{"name": "web", "path": str(corpus)}], "tokenizer": {"path": str(PHI2)},
        "quality": GATES_OFF if a.gates == "off" else {}, "output": {"shard_records": 5000},
        "execution": {"engine": "local", "workers": a.workers}}))
    print(cache_bytecode(), flush=True)
    run_dir, env = work / "run_durability", {**os.environ, "PYTHONPATH": str(REPO)}
    print(f"corpus {corpus.name} ({corpus.stat().st_size / 1e6:.0f} MB), gates {a.gates}, workers {a.workers}")
    if shutil.which("eatmydata"):
        ratios = []
        for i in range(a.pairs):
            durable, no_fsync = job(config, run_dir, env, []), job(config, run_dir, env, ["eatmydata"])
            ratios.append(no_fsync / durable)
            print(f"pair {i + 1}: as it is {durable:.1f} s, fsync a no-op {no_fsync:.1f} s, ratio {ratios[-1]:.3f}")
        print(f"median ratio {statistics.median(ratios):.3f}: durable writes take "
              f"~{100 * (1 - statistics.median(ratios)):.0f} % of the job")
    else:
        print("eatmydata is not on PATH: no pairs (Debian/Ubuntu: apt-get install eatmydata)")
    if a.fsync_table:
        fsync_table(config, run_dir)


if __name__ == "__main__":
    main()
