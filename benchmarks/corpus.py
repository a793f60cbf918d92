"""Build a benchmark corpus of N MB of real web text from ../shared/data, distinct per record.

Sources: the C4, DCLM and dolma samples and the Wikipedia demo file (≈ 6 MB, ≈ 1 900 documents).
Copy k of a document rotates its sentences by k, so every record is distinct text (exact dedup keeps
it) while language, length and character statistics stay those of real web text. Deterministic.
Rotated copies are near-duplicates, though; `shuffle_words=True` (for near-dedup benchmarks) also
shuffles the words inside each sentence of copy k >= 1, so copies share almost no word 5-grams while
words, lengths and language stay the same.

`cache_bytecode`, which the benchmarks that time whole jobs call first: they time them as installed code runs.
"""
from __future__ import annotations

import argparse
import compileall
import os
import random
import re
import sys
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data"
PACKAGES = ("streamprep", "quality")  # what a job imports from a checkout (or a revision's tree)
WEB_FILES = ["web/c4_en_train00000_first1000.jsonl", "web/c4_en_llamafactory_demo300.jsonl",
             "web/dclm_quality_majority_data.jsonl", "web/dolma_cc_en_head-0091.jsonl",
             "web/dolma_cc_en_head-0174.jsonl"]
SENTENCE = re.compile(r"(?<=[.!?])\s+")


def cache_bytecode(*others: Path) -> str:
    """Have the timed processes run as installed code runs, with compiled bytecode: compile this checkout's
    packages and the `others` run from source (a revision's, Megatron-LM's) now, before anything is timed, and let
    this process and the jobs it starts keep what they compile. Returns the line the benchmarks print about it.

    Why: this sandbox, like many container images, sets PYTHONDONTWRITEBYTECODE=1, so a job run from a checkout
    compiles every module of its own again in every process: here ~0.2 of the driver's ~0.6 CPU-s of imports,
    and ~2 s of Megatron-LM's start-up from its checkout. `pip install` compiles a package once, when it installs it,
    so no installed tool pays that at each run; both sides of a comparison are treated alike. A file that does not
    compile is left to be compiled where it is imported, as before."""
    was_set = os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None
    sys.dont_write_bytecode = False
    trees = [*(REPO / p for p in PACKAGES), *others]
    for tree in trees:
        compileall.compile_dir(str(tree), quiet=2)
    return (f"bytecode: cached, as installed code has it ({len(trees)} source trees compiled first"
            f"{'; PYTHONDONTWRITEBYTECODE unset for the jobs' if was_set else ''})")


def base_documents(shared: Path = SHARED) -> list[str]:
    docs: list[str] = []
    for rel in WEB_FILES:
        for line in (shared / rel).read_bytes().splitlines():
            docs.append(orjson.loads(line)["text"])
    docs += [line for line in (shared / "web/wikipedia_en_llamafactory_demo30.txt").read_text().splitlines() if line]
    return docs


def _shuffled(sentences: list[str], rng: random.Random) -> list[str]:
    out = []
    for s in sentences:
        words = s.split()
        rng.shuffle(words)
        out.append(" ".join(words))
    return out


def build(out: Path, megabytes: int, shared: Path = SHARED, shuffle_words: bool = False) -> Path:
    """Write `out` (JSONL {"text"}) of at least `megabytes` MB unless it already exists."""
    if out.exists() and out.stat().st_size >= megabytes * 1_000_000:
        return out
    docs = [SENTENCE.split(d) for d in base_documents(shared)]
    target, written, k = megabytes * 1_000_000, 0, 0
    tmp = out.with_suffix(".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "wb") as fh:
        while written < target:
            for i, sentences in enumerate(docs):
                if k and shuffle_words:
                    sentences = _shuffled(sentences, random.Random(k * 1_000_003 + i))
                r = k % len(sentences)
                line = orjson.dumps({"text": " ".join(sentences[r:] + sentences[:r]) if k else " ".join(sentences)}) + b"\n"
                fh.write(line)
                written += len(line)
                if written >= target:
                    break
            k += 1
    tmp.replace(out)
    return out


def build_short(out: Path, n_docs: int, max_chars: int = 400, shared: Path = SHARED) -> Path:
    """Write `out` with `n_docs` short records: runs of whole sentences of <= `max_chars` (one sentence if longer).

    Round k cuts every base document, rotated by k sentences, into such runs; deterministic.
    """
    if out.exists() and sum(1 for _ in open(out, "rb")) == n_docs:
        return out
    docs = [SENTENCE.split(d) for d in base_documents(shared)]
    tmp = out.with_suffix(".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    written, k = 0, 0
    with open(tmp, "wb") as fh:
        while written < n_docs:
            for sentences in docs:
                r = k % len(sentences)
                chunk: list[str] = []
                for s in sentences[r:] + sentences[:r]:
                    if chunk and sum(len(c) + 1 for c in chunk) + len(s) > max_chars:
                        fh.write(orjson.dumps({"text": " ".join(chunk)}) + b"\n")
                        written, chunk = written + 1, []
                        if written == n_docs:
                            break
                    chunk.append(s)
                if written == n_docs:
                    break
            k += 1
    tmp.replace(out)
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--out", type=Path, default=Path("/tmp/streamprep-bench/corpus_100mb.jsonl"))
    a = ap.parse_args()
    print(build(a.out, a.mb))
