"""Near-duplicate removal: quality and cost of `quality.near_dedup` (MinHash LSH), one run, same docs.

    python benchmarks/bench_near_dedup.py [--docs 1000] [--threshold 0.8] [--bands 14 --rows 8 --ngram 5]

1. Signature cost (µs/doc) on real C4 text: the shipped batched rensa path, rensa per document, and
   datasketch per document (if installed), all over the same word n-grams.
2. Generated near-duplicates: C4 texts, then one copy of each with a share p of words substituted
   (p = 1, 5, 10, 20, 40 %), streamed through the writer's index in source order.
3. Real data: DCLM agreement + majority (281 exact copies), C4 demo300 + train first1000.
Truth is the exact Jaccard of the word n-gram sets: a document is a true near-duplicate when an
earlier KEPT document (the index holds kept documents only) has Jaccard >= threshold with it; a reject
is correct when its reported twin does. Prints precision, recall, µs/doc in the writer and index bytes/doc.
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from quality import NearDedupSettings, load_quality_settings  # noqa: E402
from quality.near_dedup import NearDupIndex, Signer, words  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def _texts(rel: str) -> list[str]:
    return [orjson.loads(x)["text"] for x in (SHARED / rel).read_bytes().splitlines()]


def shingles(text: str, n: int) -> set:
    w = words(text)
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)} if len(w) >= n else ({tuple(w)} if w else set())


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 0.0


def signature_costs(texts: list[str], cfg: NearDedupSettings) -> dict[str, float]:
    """µs/doc of each MinHash implementation over the same texts (best of 3)."""
    from rensa import RMinHash

    n, perms, seed = cfg.ngram, cfg.num_perm, cfg.seed
    grams = lambda t: [b" ".join(g) for g in shingles(t, n)]  # noqa: E731

    def rensa_per_doc() -> None:
        for t in texts:
            m = RMinHash(perms, seed)
            m.update(grams(t))
            m.digest()

    runs = {"rensa, batched (shipped)": lambda: [Signer(cfg).signatures(texts[i:i + 512])
                                                 for i in range(0, len(texts), 512)],
            "rensa RMinHash per doc": rensa_per_doc}
    try:
        from datasketch import MinHash

        def datasketch_per_doc() -> None:
            for t in texts:
                m = MinHash(num_perm=perms, seed=seed)
                m.update_batch(grams(t))
                m.hashvalues

        runs["datasketch MinHash per doc"] = datasketch_per_doc
    except ImportError:
        pass
    out = {}
    for name, fn in runs.items():
        best = min(_timed(fn) for _ in range(3))
        out[name] = best / len(texts) * 1e6
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def stream(texts: list[str], cfg: NearDedupSettings, batch: int = 512) -> tuple[list, dict]:
    """The writer protocol over `texts` in order (every document kept unless near-duplicate):
    decisions (twin position, estimated Jaccard) or None, and cost figures."""
    sigs = Signer(cfg).signatures(texts)
    with tempfile.TemporaryDirectory() as tmp:
        index = NearDupIndex(cfg, Path(tmp) / "x.near")
        decisions: list = []
        t0 = time.perf_counter()
        with open(index.path, "ab") as log:
            for start in range(0, len(texts), batch):
                index.prepare(sigs[start:start + batch])
                for pos in range(start, min(start + batch, len(texts))):
                    twin = index.next_twin()
                    decisions.append(tuple(twin) if twin else None)
                    if twin is None:
                        index.add(pos)
                log.write(index.take_log())
                log.flush()
        secs = time.perf_counter() - t0
        rebuilt = NearDupIndex(cfg, index.path)
        t1 = time.perf_counter()
        rebuilt.load()
        load_s = time.perf_counter() - t1
        kept = len(rebuilt)
        cost = {"writer_us_per_doc": secs / len(texts) * 1e6, "index_bytes_per_kept_doc": rebuilt.nbytes() / max(kept, 1),
                "log_bytes_per_kept_doc": index.path.stat().st_size / max(kept, 1),
                "rebuild_us_per_kept_doc": load_s / max(kept, 1) * 1e6}
        index.close()
    return decisions, cost


def score(texts: list[str], decisions: list, threshold: float, n: int) -> dict:
    """Precision and recall against exact n-gram Jaccard (see the module docstring)."""
    sets = [shingles(t, n) for t in texts]
    kept = [i for i, d in enumerate(decisions) if d is None]
    tp = fp = fn = 0
    for j, d in enumerate(decisions):
        if d is not None:
            if jaccard(sets[d[0]], sets[j]) >= threshold:
                tp += 1
            else:
                fp += 1
        elif any(jaccard(sets[i], sets[j]) >= threshold for i in kept if i < j):
            fn += 1
    return {"flagged": tp + fp, "true_near_dups": tp + fn,
            "precision": tp / (tp + fp) if tp + fp else None, "recall": tp / (tp + fn) if tp + fn else None}


def edited(text: str, rate: float, rng: random.Random) -> str:
    w = text.split()
    for i in rng.sample(range(len(w)), max(1, round(rate * len(w)))):
        w[i] = rng.choice(("data", "model", "river", "table", "green", "quickly", "seven", "under"))
    return " ".join(w)


def _fmt(x: float | None) -> str:
    return "–" if x is None else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", type=int, default=1000, help="C4 originals for the generated sets")
    ap.add_argument("--threshold", type=float, default=0.8)
    ap.add_argument("--ngram", type=int, default=5)
    ap.add_argument("--bands", type=int, default=14)
    ap.add_argument("--rows", type=int, default=8)
    a = ap.parse_args()
    cfg = load_quality_settings({"near_dedup": {"enabled": True, "threshold": a.threshold, "ngram": a.ngram,
                                                "bands": a.bands, "rows": a.rows}}).near_dedup
    c4 = _texts("web/c4_en_train00000_first1000.jsonl")[:a.docs]
    print(f"near_dedup: threshold {a.threshold}, {a.ngram}-grams, {a.bands} bands x {a.rows} rows "
          f"({cfg.num_perm} permutations); C4 docs {len(c4)}, mean {np.mean([len(t) for t in c4]):.0f} chars")

    print("\n## signature cost, µs/doc (best of 3)")
    for name, us in signature_costs(c4, cfg).items():
        print(f"  {name:28} {us:8.1f}")

    print("\n## generated near-duplicates: originals, then one edited copy of each")
    print(f"  {'edit rate':>9} {'true J mean':>11} {'flagged':>8} {'precision':>9} {'recall':>7}  writer µs/doc")
    rng = random.Random(0)
    for rate in (0.01, 0.05, 0.10, 0.20, 0.40):
        copies = [edited(t, rate, rng) for t in c4]
        texts = c4 + copies
        decisions, cost = stream(texts, cfg)
        s = score(texts, decisions, a.threshold, a.ngram)
        true_j = np.mean([jaccard(shingles(x, a.ngram), shingles(y, a.ngram)) for x, y in zip(c4, copies)])
        print(f"  {rate:9.2f} {true_j:11.3f} {s['flagged']:8d} {_fmt(s['precision']):>9} {_fmt(s['recall']):>7}  "
              f"{cost['writer_us_per_doc']:.1f}   (true near-dups {s['true_near_dups']})")

    print("\n## real data")
    for label, files in (("DCLM agreement + majority", ["web/dclm_quality_agreement_data.jsonl",
                                                        "web/dclm_quality_majority_data.jsonl"]),
                         ("C4 demo300 + train first1000", ["web/c4_en_llamafactory_demo300.jsonl",
                                                           "web/c4_en_train00000_first1000.jsonl"])):
        parts = [_texts(f) for f in files]
        texts = parts[0] + parts[1]
        decisions, cost = stream(texts, cfg)
        s = score(texts, decisions, a.threshold, a.ngram)
        exact = sum(1 for t in parts[1] if t in set(parts[0]))
        cross = sum(1 for j, d in enumerate(decisions) if d is not None and j >= len(parts[0]) > d[0])
        print(f"  {label}: {len(texts)} docs, exact cross-file copies {exact}; flagged {s['flagged']} "
              f"({cross} across the two files), precision {_fmt(s['precision'])}, recall {_fmt(s['recall'])} "
              f"(true near-dups {s['true_near_dups']})")
        print(f"    writer {cost['writer_us_per_doc']:.1f} µs/doc, index {cost['index_bytes_per_kept_doc']:.0f} B/kept doc "
              f"in memory, log {cost['log_bytes_per_kept_doc']:.0f} B/kept doc on disk, rebuild "
              f"{cost['rebuild_us_per_kept_doc']:.2f} µs/kept doc")


if __name__ == "__main__":
    main()
