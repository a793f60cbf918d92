"""streamprep beside Megatron-LM's fast preprocessor (`tools/preprocess_data_fast.py`, gigatoken), same corpus.

    python benchmarks/bench_megatron.py --megatron DIR [--mb 62.5,250] [--repeats 1] [--workers 2] [--only mcdhg]

DIR is a Megatron-LM checkout (or set MEGATRON_LM) at the commit that ships the fast tool:
    git clone https://github.com/NVIDIA/Megatron-LM && cd Megatron-LM && git checkout d98e8a6
(the tool came with 889c909, PR #6514 "add gigatoken support for hf tokenizers"). Its `megatron/` package
runs from source (DIR is put first on PYTHONPATH). It needs `transformers`, `gigatoken`, `awkward`, torch,
and `triton` importable (imported, never used on CPU: `pip install triton`); it declares Python >= 3.12,
and on 3.11 the only 3.12 name it uses, `typing.override`, is backported from typing_extensions before the
tool runs unchanged. If the tool's imports still fail (or no DIR is given), the benchmark runs a
re-creation of its two steps instead and labels every line with it: gigatoken `encode_files` over the JSONL
field through the same transformers tokenizer, then one batched write with EOD after each document
(PR #6514's `IndexedDatasetBuilder.add_documents`, applied to the installed megatron-core's builder).

Runs, each a whole process timed from outside (wall seconds, peak RSS of the process tree):
  m  Megatron fast: `--tokenizer-type HuggingFaceTokenizer --use-gigatoken --append-eod --json-keys text`
  c  streamprep ingest, `engine: local`, every quality gate off (bench_pipeline's GATES_OFF), --workers
  d  streamprep ingest, `engine: local`, default gates, --workers
and the raw limits over the texts already in RAM (in this process, encode time only):
  h  HF tokenizers `encode_batch_fast`, batches of 1024
  g  gigatoken `encode_batch` over the whole list
Prints seconds per corpus size (median of --repeats), the marginal rate between the smallest and the largest
size (MB of JSONL per second), each streamprep run's ratio to Megatron (Megatron wall / streamprep wall: >= 1.0
means as fast), and peak RSS. Then checks that Megatron's one `.bin` equals streamprep's gates-off
`binidx/<dataset>/part-*_text_document.bin` concatenated in part order, and the document lengths of the
`.idx` files too; exits 1 when they differ.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_pipeline import GATES_OFF, PHI2, raw_limit, run_cli, timed  # noqa: E402
from corpus import build, cache_bytecode  # noqa: E402

from streamprep.binidx import IndexedDataset  # noqa: E402

TOOL = "tools/preprocess_data_fast.py"
# Runs the tool file unchanged as __main__; on Python < 3.12 first backports typing.override (a no-op marker).
LAUNCH = """
import runpy, sys, typing
if not hasattr(typing, "override"):
    from typing_extensions import override
    typing.override = override
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""
# The re-creation: the tool's two steps as Megatron-LM d98e8a6 runs them (tools/preprocess_data_fast.py,
# HuggingFaceTokenizer(use_gigatoken=True).encode_files, IndexedDatasetBuilder.add_documents).
RECREATE = """
import sys
import awkward as ak
import gigatoken as gt
import numpy
from transformers import AutoTokenizer
inp, prefix, tok_dir, key = sys.argv[1:5]
hf = AutoTokenizer.from_pretrained(tok_dir)
docs = gt.Tokenizer(hf).as_hf().tokenizer.encode_files(gt.JsonlFileSource([inp], field=key), parallel=True)
eod = hf.convert_tokens_to_ids(hf.eos_token)
bin_path, idx_path = f"{prefix}_{key}_document.bin", f"{prefix}_{key}_document.idx"
try:
    from megatron.core.datasets import indexed_dataset
    builder = indexed_dataset.IndexedDatasetBuilder(bin_path, dtype=indexed_dataset.DType.optimal_dtype(len(hf)))
except ImportError:
    builder = None
dtype = builder.dtype if builder is not None else (numpy.uint16 if len(hf) < 65500 else numpy.int32)
lengths_all = []
with (builder.data_file if builder is not None else open(bin_path, "wb")) as out:
    for start in range(0, len(docs), 1_000_000):  # add_documents(docs, eod_token=eod), chunk_size 1_000_000
        chunk = docs[start:start + 1_000_000]
        flat = numpy.asarray(ak.flatten(chunk), dtype=dtype)
        lengths = numpy.asarray(ak.num(chunk, axis=1))
        flat = numpy.insert(flat, numpy.cumsum(lengths), eod).astype(dtype, copy=False)
        lengths = lengths + 1
        out.write(flat.tobytes(order="C"))
        if builder is not None:
            offset = len(builder.sequence_lengths)
            builder.sequence_lengths.extend(lengths.tolist())
            builder.document_indices.extend((offset + numpy.arange(1, len(lengths) + 1)).tolist())
        lengths_all.append(lengths)
if builder is not None:
    builder.finalize(idx_path)
else:
    from streamprep.binidx import index_bytes
    with open(idx_path, "wb") as fh:
        fh.write(index_bytes(numpy.concatenate(lengths_all), numpy.dtype(dtype)))
"""
NAMES = {"m": "Megatron fast (gigatoken)", "c": "streamprep local, gates off", "d": "streamprep local, default gates",
         "h": "HF encode_batch_fast, in RAM", "g": "gigatoken encode_batch, in RAM"}


def tag(mb: float) -> str:
    """A file-name tag for a corpus size without a dot (run_cli derives a .yaml name with with_suffix)."""
    return f"{mb:g}mb".replace(".", "p")


class Megatron:
    """How the Megatron side runs here: the checkout's tool from source, or the labelled re-creation."""

    def __init__(self, checkout: Path | None, work: Path):
        self.checkout, self.mode, self.reason = checkout, "re-creation", "no Megatron-LM checkout given"
        if checkout is not None:
            if not (checkout / TOOL).is_file():
                raise SystemExit(f"--megatron: {checkout / TOOL} not found (need a Megatron-LM checkout with the fast tool)")
            probe = work / "probe.jsonl"
            probe.write_bytes(orjson.dumps({"text": "A probe document."}) + b"\n")
            proc = subprocess.run(self.command(probe, work / "probe", "source"), env=self.env(),
                                  capture_output=True, text=True)
            if proc.returncode == 0:
                self.mode, self.reason = "source", ""
            else:
                lines = [x for x in proc.stderr.splitlines() if x.strip()]
                self.reason = f"the tool failed from source: {lines[-1] if lines else f'exit {proc.returncode}'}"

    def env(self) -> dict[str, str]:
        paths = [str(self.checkout)] if self.checkout else []
        return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)}

    def command(self, corpus: Path, prefix: Path, mode: str | None = None) -> list[str]:
        if (mode or self.mode) == "source":
            return [sys.executable, "-c", LAUNCH, str(self.checkout / TOOL), "--input", str(corpus),
                    "--output-prefix", str(prefix), "--json-keys", "text", "--tokenizer-type", "HuggingFaceTokenizer",
                    "--tokenizer-model", str(PHI2.parent), "--use-gigatoken", "--append-eod"]
        return [sys.executable, "-c", RECREATE, str(corpus), str(prefix), str(PHI2.parent), "text"]

    def label(self) -> str:
        if self.mode == "source":
            return f"Megatron-LM from source: {self.checkout / TOOL}"
        return f"RE-CREATION of Megatron-LM's {TOOL} (two steps, see --help): {self.reason}"

    def run(self, corpus: Path, prefix: Path) -> tuple[float, int]:
        for p in prefix.parent.glob(prefix.name + "_*"):
            p.unlink()
        return timed(self.command(corpus, prefix), f"Megatron ({self.mode})", self.env())


def gigatoken_limit(corpus: Path) -> dict:
    """gigatoken `encode_batch` over the texts already in memory (its Rust thread pool, all cores)."""
    import gigatoken as gt

    texts = [orjson.loads(line)["text"] for line in corpus.read_bytes().splitlines()]
    tok = gt.Tokenizer(str(PHI2))  # a resolved local path: a Hub-like string would be downloaded
    t0 = time.perf_counter()
    ids = tok.encode_batch(texts)
    secs = time.perf_counter() - t0
    import awkward as ak

    return {"seconds": secs, "tokens": int(ak.sum(ak.num(ids, axis=1)))}


def streamprep_parts(run_dir: Path) -> list[Path]:
    """The gates-off run's `.bin` parts in part order (one dataset: the corpus)."""
    parts = sorted((run_dir / "binidx").glob("*/part-*_text_document.bin"))
    if not parts:
        raise SystemExit(f"{run_dir / 'binidx'}: no part-*_text_document.bin")
    return parts


def identical(megatron_prefix: Path, run_dir: Path) -> tuple[bool, str]:
    """Megatron's `.bin` against streamprep's parts concatenated, byte for byte, and the per-document lengths."""
    parts = streamprep_parts(run_dir)
    ours = [IndexedDataset.open(str(p)[:-4]) for p in parts]
    theirs = IndexedDataset.open(megatron_prefix)
    for ds in [theirs, *ours]:
        if ds.check():
            return False, "; ".join(ds.check())
    if {ds.dtype for ds in ours} != {theirs.dtype}:
        return False, f"dtype {theirs.dtype} vs {[str(ds.dtype) for ds in ours]}"
    our_lengths = np.concatenate([ds.lengths for ds in ours])
    if not np.array_equal(our_lengths, theirs.lengths):
        n = min(len(our_lengths), len(theirs.lengths))
        diff = np.flatnonzero(our_lengths[:n] != theirs.lengths[:n])
        return False, (f"document lengths differ: {len(theirs.lengths)} vs {len(our_lengths)} documents, "
                       f"first difference at document {int(diff[0]) if len(diff) else n}")
    pos, chunk = 0, 1 << 24
    with open(theirs.bin_path, "rb") as fh:
        for p in parts:
            with open(p, "rb") as part:
                while block := part.read(chunk):
                    other = fh.read(len(block))
                    if other != block:
                        n = min(len(other), len(block))
                        first = next((i for i in range(n) if other[i] != block[i]), n)
                        return False, f"token bytes differ at byte {pos + first} (part {p.name})"
                    pos += len(block)
        if fh.read(1):
            return False, f"Megatron's .bin is longer than streamprep's {pos} bytes"
    return True, f"{pos} bytes, {len(our_lengths)} documents in {len(parts)} parts"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--megatron", type=Path, default=os.environ.get("MEGATRON_LM"),
                    help="Megatron-LM checkout (default $MEGATRON_LM); without one, the re-creation runs")
    ap.add_argument("--mb", default="62.5,250", help="comma-separated corpus sizes in MB (two or more for a rate)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--shard-records", type=int, default=5000,
                    help="streamprep output.shard_records (bench_pipeline's 5000; the config default of 100 000 "
                         "leaves a 250 MB corpus in one part, tokenized by one worker)")
    ap.add_argument("--only", default="mcdhg", help="which runs, e.g. 'mc'")
    ap.add_argument("--work", type=Path, default=Path("/tmp/streamprep-megabench"))
    a = ap.parse_args()
    sizes = sorted(float(x) for x in a.mb.split(","))
    a.work.mkdir(parents=True, exist_ok=True)
    checkout = [a.megatron.resolve() / p for p in ("megatron", "tools")] if a.megatron and "m" in a.only else []
    print(cache_bytecode(*checkout), flush=True)
    megatron = Megatron(a.megatron.resolve() if a.megatron else None, a.work) if "m" in a.only else None
    if megatron:
        print(megatron.label(), flush=True)
    corpora = {mb: build(a.work / f"corpus_{tag(mb)}.jsonl", mb) for mb in sizes}
    secs: dict[tuple[str, float], list[float]] = {}
    rss: dict[tuple[str, float], int] = {}
    phases: dict[tuple[str, float], dict] = {}
    checks: dict[float, tuple[bool, str]] = {}
    failed: list[str] = []
    for r in range(a.repeats):
        for mb, corpus in corpora.items():
            for key in a.only:
                run = a.work / f"{key}_{tag(mb)}_{r}"
                if key == "m":
                    t, peak = megatron.run(corpus, run)
                elif key in "cd":
                    subprocess.run(["rm", "-rf", str(run)], check=True)
                    cfg = {"run": {"name": "megabench"}, "datasets": [{"name": "web", "path": str(corpus)}],
                           "tokenizer": {"path": str(PHI2)}, "quality": GATES_OFF if key == "c" else {},
                           "output": {"shard_records": a.shard_records},
                           "execution": {"engine": "local", "workers": a.workers}}
                    try:
                        t, peak = run_cli(cfg, run)
                    except SystemExit as e:  # one failed run is reported, the others still measured
                        lines = str(e).strip().splitlines()
                        why = next((x for x in reversed(lines) if "error:" in x), lines[-1] if lines else "")
                        failed.append(f"{NAMES[key]} {mb:g} MB: {why.strip()}")
                        print(f"  {failed[-1]}", flush=True)
                        t, peak = float("nan"), 0
                    else:
                        phases.setdefault((key, mb), json.loads((run / "run.json").read_text())["timings"])
                elif key == "h":
                    t, peak = raw_limit(corpus)["seconds"], 0
                elif key == "g":
                    t, peak = gigatoken_limit(corpus)["seconds"], 0
                else:
                    raise SystemExit(f"--only: unknown run {key!r} (choose from {''.join(NAMES)})")
                secs.setdefault((key, mb), []).append(t)
                rss[(key, mb)] = max(rss.get((key, mb), 0), peak)
                print(f"  {NAMES[key]:34} {mb:g} MB  run {r + 1}: {t:.2f} s", flush=True)
            if r == 0 and "m" in a.only and "c" in a.only and (a.work / f"c_{tag(mb)}_0" / "run.json").exists():
                checks[mb] = identical(a.work / f"m_{tag(mb)}_0_text_document", a.work / f"c_{tag(mb)}_0")
    report(a, megatron, sizes, corpora, secs, rss, phases, checks)
    for line in failed:
        print(f"FAILED: {line}")
    if failed or not all(ok for ok, _ in checks.values()):
        sys.exit(1)


def report(a: argparse.Namespace, megatron: Megatron | None, sizes: list[float], corpora: dict[float, Path],
           secs: dict, rss: dict, phases: dict, checks: dict) -> None:
    med = {k: statistics.median(v) for k, v in secs.items()}
    mbytes = {mb: corpora[mb].stat().st_size / 1e6 for mb in sizes}
    print("\ncorpora: " + ", ".join(f"{corpora[mb].name} ({mbytes[mb]:.1f} MB)" for mb in sizes)
          + f"; phi-2; workers={a.workers}; shard_records={a.shard_records}; median of {a.repeats}; load average {os.getloadavg()[0]:.1f}")
    if megatron:
        print(megatron.label())
    lo, hi = sizes[0], sizes[-1]
    head = "".join(f"{f'{mb:g} MB s':>11}" for mb in sizes)
    ratios = "".join(f"{f'x Meg {mb:g}':>11}" for mb in sizes)
    print(f"{'run':40}{head}{'marginal MB/s':>14}{ratios}{'peak RSS MB':>12}")
    for key in a.only:
        row = "".join(f"{med[(key, mb)]:11.2f}" for mb in sizes)
        rate = (mbytes[hi] - mbytes[lo]) / (med[(key, hi)] - med[(key, lo)]) if hi > lo else float("nan")
        rate_s = f"{rate:14.1f}" if rate > 0 else f"{'-' if hi == lo else '(noise)':>14}"
        if key in "cd" and "m" in a.only:
            row_r = "".join(f"{med[('m', mb)] / med[(key, mb)]:11.2f}" for mb in sizes)
        else:
            row_r = "".join(f"{'':>11}" for _ in sizes)
        peak = max(rss[(key, mb)] for mb in sizes)
        peak_s = f"{peak / 1e6:12.0f}" if peak else f"{'(in RAM)':>12}"
        label = NAMES[key] + (" [re-creation]" if key == "m" and megatron and megatron.mode != "source" else "")
        print(f"{label:40}{row}{rate_s}{row_r}{peak_s}")
    for (key, mb), p in sorted(phases.items()):
        print(f"{NAMES[key]} {mb:g} MB phases (s): " + ", ".join(f"{k} {v:.2f}" for k, v in p.items()))
    for mb, (ok, detail) in checks.items():
        print(f"token bytes identical, Megatron vs streamprep gates off, {mb:g} MB: {'yes' if ok else 'NO'} ({detail})")


if __name__ == "__main__":
    main()
