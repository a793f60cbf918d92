"""Throughput of streamprep against the tokenizer's own limit, measured in one run on the same data.

    python benchmarks/bench_pipeline.py [--mb 100 | --short-docs 2000000] [--repeats 3] [--engines local,xenna]
                                        [--workers N] [--only abcd] [--near-dedup]

(a) raw limit: HF's `Tokenizer.encode_batch_fast` over the texts already in memory, all cores (Rust threads);
(b) streamprep's tokenization stage alone, over the ingest parts of run (c), with the backend that job's shard
    tasks load (run.json's `tokenizer_backend`: with the default `tokenizer.backend: auto`, gigatoken when it
    passed the identity check); the row names the backend that encoded;
(c) the whole `streamprep ingest` (ingest + tokenize + exports) with the quality gates off;
(d) the same with the default quality gates;
(e) with --near-dedup: the default gates plus `quality.near_dedup` (on a corpus whose copies are word-
    shuffled, so near-dedup removes no more than the real near-duplicates; (a) and (d) then use it too).
Prints MB/s (of input text), docs/s, tokens/s, peak RSS of the whole process tree, and b/a, c/a, d/a (above 1
when the job's gigatoken beats HF's limit);
(c) and (d) once per engine in --engines, with the time to the first finished shard against the time
ingest takes per part, and each engine's whole-job ratio to the first engine's; for xenna, how many shards its
stage tokenized (the rest went to the local workers), and no ratio when it tokenized none (Ray not up in time).
Each of (b)-(d) runs as its own process; medians over --repeats.

With --against REV, each run of (c), (d) and (e) is followed by the same job at git revision REV (its `streamprep/`
and `quality/` extracted from this checkout's history into a temporary folder, first on PYTHONPATH): the pairs'
ratios, REV's seconds over this checkout's, say how many times faster the job is than at REV in the same minutes
(issue 27's 2 M-document target is ≥ 5x its filing code, 50a34e7), and each pair's token bytes are compared.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson
import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import revision  # noqa: E402
from corpus import PACKAGES, REPO, SHARED, build, build_short, cache_bytecode  # noqa: E402
from streamprep.atomic import sha256_file  # noqa: E402
from streamprep.tokenizer import TokenizerInfo  # noqa: E402

PHI2 = SHARED / "tokenizers/phi-2/tokenizer.json"
GATES_OFF = {"dedup": "none", "expected_language": None, "pii_max_density": 1.0, "profanity_max_density": 1.0,
             "reject_copyright": False, "min_chars": 0, "normalize": False}


NAMES = {"a": "raw encode_batch (limit)", "b": "tokenization stage", "c": "ingest, gates off",
         "d": "ingest, default gates", "e": "ingest, gates + near-dedup"}


class TreeSampler:
    """Samples a process and its descendants every 50 ms: the peak of their summed RSS, and the last seen CPU
    seconds (user + system) of each (a process's last < 50 ms before it exits are not seen)."""

    def __init__(self, pid: int):
        self.proc, self.peak, self.cpu, self._stop = psutil.Process(pid), 0, {}, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                procs = [self.proc, *self.proc.children(recursive=True)]
            except psutil.Error:
                procs = []
            rss = 0
            for p in procs:
                try:
                    rss += p.memory_info().rss
                    t = p.cpu_times()
                    self.cpu[p.pid] = t.user + t.system
                except psutil.Error:
                    pass
            self.peak = max(self.peak, rss)
            self._stop.wait(0.05)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return self.peak


def raw_limit(corpus: Path) -> dict:
    from tokenizers import Tokenizer

    texts = [orjson.loads(line)["text"] for line in corpus.read_bytes().splitlines()]
    tok = Tokenizer.from_file(str(PHI2))
    mb = sum(len(t.encode()) for t in texts) / 1e6
    t0 = time.perf_counter()
    n_tokens = 0
    for i in range(0, len(texts), 1024):
        n_tokens += sum(len(e.ids) for e in tok.encode_batch_fast(texts[i:i + 1024], add_special_tokens=False))
    secs = time.perf_counter() - t0
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # the corpus is held in memory here
    return {"seconds": secs, "mb": mb, "docs": len(texts), "tokens": n_tokens, "peak": peak}


def first_shard(run_dir: Path) -> dict:
    """From the run log: seconds from the first line to the first `shard done` and to the first sealed part
    (the time to ingest one part, start-up included), and ingest seconds per part."""
    from datetime import datetime

    lines = [orjson.loads(x) for x in (run_dir / "logs" / "streamprep.log").read_bytes().splitlines()]
    t = [datetime.fromisoformat(x["timestamp"].replace("Z", "+00:00")).timestamp() for x in lines]
    first = next(i for i, x in enumerate(lines) if x["event"] == "shard done")
    sealed = next(i for i, x in enumerate(lines) if x["event"] == "parts sealed" and x["parts"] > 0)
    ingest = next(x for x in lines if x["event"] == "ingest done")["seconds"]
    parts = len(list((run_dir / "ingest").rglob("part-*.jsonl")))
    return {"first_shard_s": t[first] - t[0], "first_part_s": t[sealed] - t[0], "ingest_s_per_part": ingest / max(parts, 1),
            **where_tokenized(lines)}


# the xenna engine's log events when its stage tokenized nothing, and what each means
NO_STAGE = {"job done before the xenna stage was needed; not starting it": "the job was done before the stage was needed",
            "ray did not come up; the local workers tokenize every shard": "Ray did not come up",
            "not starting the xenna stage: the local workers end the remaining shards first":
                "the stage was not started (the local workers ended the shards first)"}


def where_tokenized(lines: list[dict]) -> dict:
    """From a run's log lines: its shards, how many the local workers tokenized (`tokenization done`'s
    `shards_local`), and for the xenna engine why its stage ran none (None if it ran some, or no such event)."""
    done = next(x for x in lines if x["event"] == "tokenization done")
    why = None
    for x in lines:
        if x["event"] in NO_STAGE:
            why = NO_STAGE[x["event"]] + ("; Ray never came up" if x.get("ray_up") is False else "")
    return {"shards": done["shards"], "shards_local": done.get("shards_local", done["shards"]), "no_stage": why}


def timed(argv: list[str], what: str, env: dict | None = None, cwd: Path | None = None) -> tuple[float, int]:
    """Wall seconds and peak tree RSS of one whole process; SystemExit naming `what` when it fails. The process
    runs in a session of its own, and whatever it leaves behind (an older revision's forkserver, say) is gone
    before the next run starts."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        rss = TreeSampler(proc.pid)
        _, err = proc.communicate()
        secs, peak = time.perf_counter() - t0, rss.stop()
    finally:
        reap_group(proc.pid)
    if proc.returncode:
        raise SystemExit(f"{what} failed: {err.decode()[-2000:]}")
    return secs, peak


def reap_group(pgid: int, grace: float = 10.0) -> None:
    """Wait up to `grace` seconds for process group `pgid` to be empty, then kill what is left of it."""
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_cli(cfg: dict, run_dir: Path, tree: Path | None = None) -> tuple[float, int]:
    """One `streamprep ingest` of `cfg` into `run_dir`: this checkout's, or the code extracted into `tree`. That
    folder is the process's current directory too, which `python -m` puts on the path before PYTHONPATH (so the
    repository's own packages shadowed the extracted ones when the benchmark ran from its root)."""
    cfg_path = run_dir.with_suffix(".yaml")
    cfg_path.write_text(yaml.safe_dump(cfg))
    code = tree or REPO
    return timed([sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path), "--run-dir", str(run_dir)],
                 "ingest" if tree is None else f"ingest at {tree}", {**os.environ, "PYTHONPATH": str(code)}, code)


def token_digests(run_dir: Path) -> list[str]:
    """The SHA-256 of every `.bin` of a run, in dataset and part order."""
    return [sha256_file(path) for path in sorted((run_dir / "binidx").rglob("*.bin"))]


STAGE_SCRIPT = """
import sys, json, time
from pathlib import Path
from streamprep.backends import ShardEncoder
from streamprep.tokenize import make_task, tokenize_part
run = Path(sys.argv[1]); choice = sys.argv[2]; tok_path = run / "tokenizer/tokenizer.json"
tok = ShardEncoder(choice, tok_path)
parts = sorted((run / "ingest").rglob("part-*.jsonl"))
t0 = time.perf_counter(); n = 0
for p in parts:
    task = make_task(run, p.parent.name, "train", p, tok_path, "x", 50256, "uint16", backend=choice)
    task = task.__class__(**{**task.__dict__, "prefix": str(run / "bench_stage" / p.stem)})
    n += tokenize_part(task, tok)["num_tokens"]
print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": n, "backend": tok.name}))
"""


def job_backend(run_dir: Path) -> str:
    """The backend the job's shard tasks loaded (TokenizerInfo.backend_name of run.json's `tokenizer_backend`),
    so that (b) times what the job ran rather than a fixed one."""
    record = json.loads((run_dir / "run.json").read_text()).get("tokenizer_backend", {"name": "hf"})
    return TokenizerInfo(run_dir, "", 0, None, None, backend=record).backend_name


def stage_alone(run_dir: Path) -> tuple[dict, int]:
    """(b) over run `run_dir`'s parts in a process of its own; SystemExit with its stderr when it fails."""
    proc = subprocess.Popen([sys.executable, "-c", STAGE_SCRIPT, str(run_dir), job_backend(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    rss = TreeSampler(proc.pid)
    out, err = proc.communicate()
    peak = rss.stop()
    if proc.returncode:
        raise SystemExit(f"tokenization stage (b) over {run_dir} failed (exit {proc.returncode}): "
                         f"{err.decode(errors='replace')[-2000:]}")
    return json.loads(out), peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--short-docs", type=int, default=0, help="use N short documents instead of --mb of web text")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engines", default="local", help="comma-separated: local,xenna")
    ap.add_argument("--workers", type=int, default=os.cpu_count())
    ap.add_argument("--shard-records", type=int, default=5000)
    ap.add_argument("--work", type=Path, default=Path("/tmp/streamprep-bench"))
    ap.add_argument("--only", default="abcd", help="which measurements, e.g. 'ac'")
    ap.add_argument("--near-dedup", action="store_true", help="add (e): default gates + near-dedup")
    ap.add_argument("--against", metavar="REV", help="after each run of (c)-(e), the same job at git revision REV")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as tmp:
        run(a, revision.extract(a.against, ["streamprep", "quality"], Path(tmp)) if a.against else None)


def run(a: argparse.Namespace, tree: Path | None) -> None:
    if a.near_dedup:
        a.only += "e"
    name = f"corpus_{a.mb}mb" + ("_shuffled" if a.near_dedup else "")
    corpus = build_short(a.work / f"short_{a.short_docs}.jsonl", a.short_docs) if a.short_docs \
        else build(a.work / f"{name}.jsonl", a.mb, shuffle_words=a.near_dedup)
    engines = a.engines.split(",")
    print(cache_bytecode(*(tree / p for p in PACKAGES if tree)), flush=True)
    base = {"run": {"name": "bench"}, "datasets": [{"name": "web", "path": str(corpus)}],
            "tokenizer": {"path": str(PHI2)}, "output": {"shard_records": a.shard_records},
            "execution": {"workers": a.workers}}
    keys = ["a", "b"] + [f"{k}:{e}" for e in engines for k in "cde"]
    results: dict[str, list] = {k: [] for k in keys}
    rss: dict[str, int] = {}
    pairs: dict[str, list[tuple[float, float, bool]]] = {}  # (this checkout's s, REV's s, same token bytes)
    for r in range(a.repeats):
        if "a" in a.only:
            results["a"].append(raw_limit(corpus))
        for engine in engines:
            for key, quality in (("c", GATES_OFF), ("d", {}), ("e", {"near_dedup": {"enabled": True}})):
                if key not in a.only and not (key == "c" and "b" in a.only):
                    continue
                run_dir = a.work / f"run_{key}_{engine}_{r}"
                subprocess.run(["rm", "-rf", str(run_dir)], check=True)
                cfg = {**base, "quality": quality, "execution": {**base["execution"], "engine": engine}}
                secs, peak = run_cli(cfg, run_dir)
                phases = json.loads((run_dir / "run.json").read_text())["timings"]
                kept = json.loads((run_dir / "audit" / "audit.json").read_text())["totals"]["kept"]
                results[f"{key}:{engine}"].append({"seconds": secs, "phases": phases, "kept": kept,
                                                   **first_shard(run_dir)})
                rss[f"{key}:{engine}"] = max(rss.get(f"{key}:{engine}", 0), peak)
                if key == "c" and "b" in a.only and engine == engines[0]:
                    stage, peak_b = stage_alone(run_dir)
                    results["b"].append(stage)
                    rss["b"] = max(rss.get("b", 0), peak_b)
                if tree is not None:
                    rev_dir = a.work / f"run_{key}_{engine}_{r}_at_rev"
                    subprocess.run(["rm", "-rf", str(rev_dir)], check=True)
                    rev_secs, _ = run_cli(cfg, rev_dir, tree)
                    pairs.setdefault(f"{key}:{engine}", []).append(
                        (secs, rev_secs, token_digests(run_dir) == token_digests(rev_dir)))
    report(a, corpus, results, rss, engines)
    for k, runs in pairs.items():
        ratios = [rev / ours for ours, rev, _ in runs]
        print(f"{NAMES[k[0]]} [{k[2:]}] against {a.against}: " + ", ".join(
            f"{rev:.2f} s / {ours:.2f} s = {rev / ours:.2f}x" for ours, rev, _ in runs)
              + f"; median {statistics.median(ratios):.2f}x faster than {a.against}; token bytes identical: "
              + ("yes" if all(same for *_, same in runs) else "NO"))


def report(a: argparse.Namespace, corpus: Path, results: dict[str, list], rss: dict[str, int],
           engines: list[str]) -> None:
    ref = results["a"][0] if results["a"] else raw_limit(corpus)
    mb, docs, tokens = ref["mb"], ref["docs"], ref["tokens"]
    med = {k: statistics.median(x["seconds"] for x in v) for k, v in results.items() if v}
    print(f"corpus: {corpus} ({mb:.1f} MB, {docs} docs, {tokens} tokens); engines={engines} workers={a.workers}; "
          f"median of {a.repeats}; load average {os.getloadavg()[0]:.1f}")
    print(f"{'measurement':36} {'s':>8} {'MB/s':>7} {'docs/s':>8} {'tokens/s':>10} {'peak RSS MB':>11} {'ratio':>6}")
    if results["a"]:
        rss["a"] = max(x["peak"] for x in results["a"])
    for k, secs in med.items():
        ratio = med["a"] / secs if "a" in med else float("nan")
        name = NAMES[k[0]] + (f" [{k[2:]}]" if ":" in k else "")
        if k == "b":  # the backend that encoded (auto's per-worker check may have moved it to hf)
            name += f" [{'/'.join(sorted({x['backend'] for x in results['b']}))}]"
        print(f"{name:36} {secs:8.2f} {mb / secs:7.2f} {docs / secs:8.0f} {tokens / secs:10.0f} "
              f"{rss.get(k, 0) / 1e6:11.0f} {ratio:6.2f}")
    for k, runs in results.items():
        if ":" not in k or not runs:
            continue
        phases = {p: statistics.median(x["phases"].get(p, 0.0) for x in runs) for p in runs[0]["phases"]}
        first = statistics.median(x["first_shard_s"] for x in runs)
        first_part = statistics.median(x["first_part_s"] for x in runs)
        per_part = statistics.median(x["ingest_s_per_part"] for x in runs)
        print(f"{NAMES[k[0]]} [{k[2:]}] phases (s, median): " + ", ".join(f"{p} {v:.2f}" for p, v in phases.items())
              + f"; first shard after {first:.2f} s = {first / first_part:.2f} x the first sealed part ({first_part:.2f} s)"
              + f" = {first / per_part:.2f} x ingest time per part ({per_part:.2f} s)"
              + f"; kept {runs[0]['kept']} of {docs}")
    for k, runs in results.items():
        if k.endswith(":xenna") and runs:
            print(f"{NAMES[k[0]]} [xenna]: {xenna_shards(runs)}")
    for key in "cde":
        if f"{key}:{engines[0]}" in med:
            for e in engines[1:]:
                runs = results[f"{key}:{e}"]
                if e == "xenna" and all(x["shards"] == x["shards_local"] for x in runs):
                    print(f"{NAMES[key]}: no xenna/{engines[0]} ratio: the xenna stage ran no shard "
                          f"({runs[0]['no_stage'] or 'the local workers did them all'}), so both were local jobs")
                    continue
                print(f"{NAMES[key]}: {e} whole job = {med[f'{key}:{engines[0]}'] / med[f'{key}:{e}']:.2f} x "
                      f"{engines[0]} throughput; peak tree RSS {rss[f'{key}:{e}'] / 1e9:.2f} GB vs "
                      f"{rss[f'{key}:{engines[0]}'] / 1e9:.2f} GB")


def xenna_shards(runs: list[dict]) -> str:
    """How many shards each xenna run's stage tokenized (the rest went to the local workers), or why none."""
    return "; ".join(f"run {i}: the xenna stage ran {x['shards'] - x['shards_local']} of {x['shards']} shards"
                     + (f" ({x['no_stage']})" if x["no_stage"] else "") for i, x in enumerate(runs))


if __name__ == "__main__":
    main()
