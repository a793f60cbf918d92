"""Quality-gate throughput and language-detector accuracy/cost on the shared real corpora.

    python benchmarks/bench_quality.py [--data DIR] [--runs 3] [--lingua-step 1] [--clock cpu|wall] [--chain-only]
    python benchmarks/bench_quality.py --against 50a34e7 [--rounds 30] [--differ-ok 92,...]

Prints Markdown tables (medians over --runs runs, after one warm-up pass that loads the detectors):
1. the default chain on the C4 sample: µs/doc per gate (per doc reaching the gate) and for the whole chain;
2. the domain gates (medical, code) on the same docs;
3. the language gate per detector on bounded samples of the C4 docs;
4. detector accuracy on the 75-language sentences (expected en, p >= 0.9) and cost per sentence / 1 000-char doc;
5. mixed-language docs built from those sentences: how much non-English text each detector lets through.

`--against REV` times only the default chain on the C4 sample, against REV's `quality/` package (issue 27's
baseline: 50a34e7) taken from this checkout's git history and imported beside this checkout's in the same process
as `quality_base`: each round judges the 1 000 docs with a fresh chain of each, in alternating order, so both see
the same seconds of the box (on a shared host its speed swings by up to 2x within minutes, which pairs of whole
processes minutes apart do not cancel). Prints each round's µs/doc and their ratio, the median ratio, and
checks that both keep the same docs with the same `failed_check`, but for the docs `--differ-ok` names (indexes in
the file), whose verdicts the gates changed on purpose since REV: those must differ.

`--clock cpu` (the default) times the chain tables with the evaluating thread's CPU time (`time.thread_time`,
read where the chain reads its clock), so figures do not move with the load other processes put on a
shared box; `--clock wall` gives wall time, as `QualityControl.stats` reports it in a run.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import quality.control  # noqa: E402
from quality import QUALITY_DEFAULTS, QualityControl  # noqa: E402
from quality.gates.base import Doc  # noqa: E402
from quality.gates.language import LanguageGate  # noqa: E402
from quality.language import bounded_sample, make_detector, normalize_code  # noqa: E402
from quality.normalize import normalize_text  # noqa: E402
from revision import extract as extract_revision  # noqa: E402  (this script's folder, first on sys.path)

DETECTORS = ("langdetect", "cld2", "cascade")
OPEN = {"min_chars": 0, "expected_language": None, "pii_max_density": 1.0, "profanity_max_density": 1.0,
        "reject_copyright": False}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def median_of(runs: int, fn: Callable[[], Any]) -> list[Any]:
    return [fn() for _ in range(runs)]


def chain_table(docs: list[dict[str, Any]], config: dict[str, Any], runs: int, title: str,
                clock: Callable[[], float] = time.perf_counter) -> None:
    quality.control.perf_counter = clock  # the chain's own per-gate timer
    QualityControl(config).evaluate_batch(docs[:50])  # warm-up: detector profiles, word lists
    per_gate: dict[str, list[float]] = {}
    seen: dict[str, int] = {}
    totals = []
    for _ in range(runs):
        qc = QualityControl(config)
        t0 = clock()
        qc.evaluate_batch(docs)
        totals.append(clock() - t0)
        for name, g in qc.stats["gates"].items():
            if g["seen"]:
                per_gate.setdefault(name, []).append(g["seconds"] / g["seen"] * 1e6)
                seen[name] = g["seen"]
    kept = qc.stats["records"]["kept"]
    total = statistics.median(totals)
    print(f"\n### {title} ({len(docs)} docs, {kept} kept; median of {runs} runs)\n")
    print("| gate | docs reaching it | µs/doc |")
    print("|---|---:|---:|")
    for name, values in per_gate.items():
        print(f"| {name} | {seen[name]} | {statistics.median(values):.1f} |")
    print(f"| **whole chain** | {len(docs)} | **{total / len(docs) * 1e6:.1f}** ({len(docs) / total:.0f} docs/s) |")


def language_gate_costs(docs: list[dict[str, Any]], runs: int) -> None:
    texts = [normalize_text(d["text"]) for d in docs]
    sample_chars = QUALITY_DEFAULTS["language_sample_chars"]
    print(f"\n### Language gate per detector on the C4 docs ({sample_chars}-char bounded samples; "
          f"median of {runs} runs)\n")
    print("| detector | µs/doc | docs kept as en | decided by langdetect |")
    print("|---|---:|---:|---:|")
    for name in DETECTORS:
        gate = LanguageGate("en", 0.9, name, sample_chars)
        gate.check(Doc(None, text=texts[0]))  # warm-up

        def one_run() -> tuple[float, int, int]:
            t0 = time.perf_counter()
            kept = by_ld = 0
            for t in texts:
                doc = Doc(None, text=t)
                kept += gate.check(doc) is None
                by_ld += doc.meta.get("language_detector") == "langdetect"
            return (time.perf_counter() - t0) / len(texts) * 1e6, kept, by_ld

        results = median_of(runs, one_run)
        us = statistics.median(r[0] for r in results)
        print(f"| {name} | {us:.0f} | {results[0][1]}/{len(texts)} | {results[0][2]} |")


def detector_accuracy(sentences: list[dict[str, Any]], docs: list[dict[str, Any]], runs: int, step: int) -> None:
    picked = sentences[::step]
    web = [bounded_sample(normalize_text(d["text"]), 1000) for d in docs if len(d["text"]) >= 1000][:300]
    print(f"\n### Detectors on {len(picked)} labelled sentences (75 languages; expected en, p >= 0.9) "
          f"and {len(web)} 1 000-char web docs\n")
    print("| detector | English kept | others rejected | µs/sentence | µs per 1 000-char web doc |")
    print("|---|---:|---:|---:|---:|")
    for name in DETECTORS:
        det = make_detector(name)
        det.detect("warm up the detector")
        t0 = time.perf_counter()
        results = [det.detect(normalize_text(s["text"])).probs.get("en", 0.0) >= 0.9 for s in picked]
        per_sentence = (time.perf_counter() - t0) / len(picked) * 1e6
        en = [ok for ok, s in zip(results, picked) if normalize_code(s["lang"]) == "en"]
        other = [ok for ok, s in zip(results, picked) if normalize_code(s["lang"]) != "en"]

        def web_run() -> float:
            t1 = time.perf_counter()
            for text in web:
                det.detect(text)
            return (time.perf_counter() - t1) / len(web) * 1e6

        per_doc = statistics.median(median_of(runs, web_run))
        print(f"| {name} | {sum(en) / len(en):.2%} ({sum(en)}/{len(en)}) | "
              f"{1 - sum(other) / len(other):.2%} ({len(other) - sum(other)}/{len(other)}) | "
              f"{per_sentence:.0f} | {per_doc:.0f} |")


def mixed_documents(sentences: list[dict[str, Any]], per_share: int = 100) -> None:
    """Docs of ~1 000 chars whose first `share` of chars is English and the rest one other language:
    a gate that keeps a 70 %-English page at p >= 0.9 is not measuring "how much is English"."""
    by_lang: dict[str, list[str]] = {}
    for s in sentences:
        by_lang.setdefault(s["lang"], []).append(normalize_text(s["text"]))
    others = sorted(lang for lang in by_lang if lang != "en")
    english = " ".join(by_lang["en"])
    shares = (0.5, 0.7, 0.85, 0.95, 1.0)
    print(f"\n### Mixed-language docs (~1 000 chars, {per_share} per English share; kept at en p >= 0.9)\n")
    print("| detector | " + " | ".join(f"{int(x * 100)} % en" for x in shares) + " |")
    print("|---|" + "---:|" * len(shares))
    for name in DETECTORS:
        det = make_detector(name)
        cells = []
        for share in shares:
            kept = 0
            for i in range(per_share):
                n_en = int(1000 * share)
                start = (i * 997) % (len(english) - n_en)
                other = " ".join(by_lang[others[i % len(others)]])
                text = bounded_sample(english[start:], n_en) + " " + bounded_sample(other, 1000 - n_en)
                kept += det.detect(text.strip()).probs.get("en", 0.0) >= 0.9
            cells.append(f"{kept}/{per_share}")
        print(f"| {name} | " + " | ".join(cells) + " |")


def baseline_control(rev: str, into: Path) -> Any:
    """`rev`'s `quality.control`, imported as `quality_base.control`: its package is extracted from this checkout's
    git history into `into` and its own imports and data lookups renamed to `quality_base`, and the codec error
    handlers it registers too: their names are global, and a handler of one copy raising its own exception class
    inside the other's encode would be an internal error there."""
    extract_revision(rev, ["quality"], into)
    (into / "quality").rename(into / "quality_base")
    for path in (into / "quality_base").rglob("*.py"):
        source = path.read_text(encoding="utf-8")
        source = re.sub(r"\b(from|import) quality\b", r"\1 quality_base", source)
        source = re.sub(r"""(["'])streamprep\.(\w+["'])""", r"\1streamprep_base.\2", source)
        path.write_text(re.sub(r"""(["'])quality([."'])""", r"\1quality_base\2", source), encoding="utf-8")
    sys.path.insert(0, str(into))
    return importlib.import_module("quality_base.control")


def against(docs: list[dict[str, Any]], rev: str, rounds: int, clock: Callable[[], float],
            differ_ok: frozenset[int] = frozenset()) -> None:
    """The default chain of this checkout and of `rev`, interleaved round by round in this process."""
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:  # its gates read their data files later
        interleaved(docs, rev, baseline_control(rev, Path(tmp)), rounds, clock, differ_ok)


def disagreement(ours: list[tuple[bool, Any]], theirs: list[tuple[bool, Any]], rev: str,
                 differ_ok: frozenset[int] = frozenset(), shown: int = 10) -> str | None:
    """Why the two chains' (keep, failed_check) verdicts are not as expected (they differ on exactly the docs
    `differ_ok` names), naming the docs that differ and their verdicts so that --differ-ok can be set; None if they are."""
    differ = sorted(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    if set(differ) == differ_ok:
        return None
    docs = "; ".join(f"doc {i}: this checkout {ours[i]}, {rev} {theirs[i]}" for i in differ[:shown])
    return (f"the chains disagree on {len(differ)} of {len(ours)} docs (keep, failed_check): {differ}"
            + (f" ({docs}{'; ...' if len(differ) > shown else ''})" if differ else "")
            + f"; --differ-ok names {sorted(differ_ok)}")


def interleaved(docs: list[dict[str, Any]], rev: str, base: Any, rounds: int, clock: Callable[[], float],
                differ_ok: frozenset[int] = frozenset()) -> None:
    chains = (quality.control, base)
    for module in chains:  # warm-up on every doc: detector profiles, word lists, databases a rare text compiles
        module.QualityControl({}).evaluate_batch(docs)

    def judge(module: Any) -> tuple[float, list[tuple[bool, Any]]]:
        qc = module.QualityControl({})  # fresh each round: a chain recalls the verdicts of texts it judged
        t0 = clock()
        verdicts = qc.evaluate_batch(docs)
        return (clock() - t0) / len(docs) * 1e6, [(v.keep, v.meta.get("failed_check")) for v in verdicts]

    print(f"\n### Default chain on C4 ({len(docs)} docs): this checkout against {rev}'s quality/, "
          f"interleaved, {rounds} rounds\n")
    print(f"| round | this checkout µs/doc | {rev} µs/doc | ratio |")
    print("|---:|---:|---:|---:|")
    ratios = []
    for i in range(rounds):
        results = {id(m): judge(m) for m in (chains if i % 2 == 0 else chains[::-1])}
        (ours, ours_verdicts), (theirs, their_verdicts) = results[id(quality.control)], results[id(base)]
        problem = disagreement(ours_verdicts, their_verdicts, rev, differ_ok)
        if problem:
            raise SystemExit(problem)
        ratios.append(ours / theirs)
        print(f"| {i + 1} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.3f} |")
    print(f"\nratio: median **{statistics.median(ratios):.3f}** (min {min(ratios):.3f}, max {max(ratios):.3f}); "
          f"same keep and failed_check on every doc{f' but {sorted(differ_ok)} (--differ-ok)' if differ_ok else ''}. "
          f"Issue 27's target from {rev}: 0.240 (80 of 334 µs/doc)")


def main() -> None:
    default_data = Path(os.environ.get("STREAMPREP_SHARED_DATA", REPO.parent / "shared" / "data"))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=default_data, help="shared data dir (default: %(default)s)")
    ap.add_argument("--runs", type=int, default=3, help="timed runs per measurement (median reported)")
    ap.add_argument("--lingua-step", type=int, default=1, help="use every Nth labelled sentence (1 = all 17 700)")
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                    help="chain tables: the thread's CPU time (default; load-independent) or wall time")
    ap.add_argument("--chain-only", action="store_true", help="only the three chain tables")
    ap.add_argument("--against", metavar="REV", help="only the default chain, interleaved with REV's (e.g. 50a34e7)")
    ap.add_argument("--rounds", type=int, default=30, help="with --against: rounds of each chain")
    ap.add_argument("--differ-ok", default="", metavar="I,J",
                    help="with --against: the C4 docs (0-based indexes) whose verdicts changed on purpose since REV")
    args = ap.parse_args()
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter

    docs = read_jsonl(args.data / "web" / "c4_en_train00000_first1000.jsonl")
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          f"default detector: {QUALITY_DEFAULTS['language_detector']}; chain clock: {args.clock}")
    if args.against:
        against(docs, args.against, args.rounds, clock, frozenset(int(i) for i in args.differ_ok.split(",") if i))
        return
    chain_table(docs, {}, args.runs, "Default chain on C4", clock)
    chain_table(docs, {**OPEN, "domain": "medical"}, args.runs, "Medical domain gate on C4 (other gates open)", clock)
    chain_table(docs, {**OPEN, "domain": "code"}, args.runs, "Code domain gate on C4 (other gates open)", clock)
    if args.chain_only:
        return
    language_gate_costs(docs, args.runs)
    sentences = read_jsonl(args.data / "multilingual" / "lingua_sentences_75langs.jsonl")
    detector_accuracy(sentences, docs, args.runs, args.lingua_step)
    mixed_documents(sentences)


if __name__ == "__main__":
    main()
