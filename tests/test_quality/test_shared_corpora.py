"""The quality gates on the real shared corpora (../shared/data): outcomes, not just "runs"."""
from __future__ import annotations

import collections
import gzip
import json
import multiprocessing
import pickle
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from quality import QUALITY_DEFAULTS, QualityControl, load_quality_settings

# Gates not under test are opened, so each test measures the gate it is about.
OPEN = {"min_chars": 0, "expected_language": None, "pii_max_density": 1.0, "profanity_max_density": 1.0,
        "reject_copyright": False}
DETECTORS = ["cld2", "cascade", "langdetect"]
LANGDETECT_STEP = 6  # langdetect costs ~1.4 ms/sentence: every 6th sentence of each language keeps the test fast


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def every_nth_per_language(records: list[dict[str, Any]], step: int) -> list[dict[str, Any]]:
    """A deterministic subsample that keeps every language's share."""
    seen: collections.Counter = collections.Counter()
    out = []
    for r in records:
        if seen[r["lang"]] % step == 0:
            out.append(r)
        seen[r["lang"]] += 1
    return out


@pytest.fixture(scope="module")
def lingua(shared_data: Path) -> list[dict[str, Any]]:
    return read_jsonl(shared_data / "multilingual" / "lingua_sentences_75langs.jsonl")


@pytest.fixture(scope="module")
def c4(shared_data: Path) -> list[dict[str, Any]]:
    return read_jsonl(shared_data / "web" / "c4_en_train00000_first1000.jsonl")


@pytest.fixture(scope="module")
def humaneval(shared_data: Path) -> dict[str, list[dict[str, str]]]:
    out = {}
    for path in sorted((shared_data / "code" / "humaneval-x").glob("humaneval_*.jsonl.gz")):
        lang = path.name.split("_")[1].split(".")[0]
        out[lang] = [{"text": r.get("import", "") + r["prompt"] + r["canonical_solution"]} for r in read_jsonl(path)]
    return out


# ---- language -----------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("detector", DETECTORS)
def test_language_gate_on_75_languages(lingua: list[dict[str, Any]], detector: str) -> None:
    records = every_nth_per_language(lingua, LANGDETECT_STEP if detector == "langdetect" else 1)
    qc = QualityControl({**OPEN, "expected_language": "en", "language_detector": detector})
    kept: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    for r in records:
        v = qc.evaluate({"text": r["text"]})
        assert v.keep or v.meta["failed_check"] == "language"
        total[r["lang"]] += 1
        kept[r["lang"]] += v.keep
    en_kept = kept["en"] / total["en"]
    others = sum(total.values()) - total["en"]
    others_rejected = 1 - (sum(kept.values()) - kept["en"]) / others
    leaks = {lang: n for lang, n in sorted(kept.items()) if lang != "en" and n}
    print(f"\n{detector}{' (default)' if detector == QUALITY_DEFAULTS['language_detector'] else ''}: "
          f"en kept {kept['en']}/{total['en']} = {en_kept:.2%}; others rejected {others_rejected:.2%} of {others}; "
          f"non-English kept by language: {leaks}")
    assert en_kept >= 0.95
    assert others_rejected >= 0.97


def test_cld2_never_reports_more_than_its_ceiling(lingua: list[dict[str, Any]]) -> None:
    """The ceiling `min_language_prob` is checked against (`highest_figure`): on the 75 languages' sentences, alone
    and joined, CLD2 reports at most 0.99 for any language but those it reads from their own script, which reach 1.0."""
    from quality.language import Cld2Detector, highest_figure

    detector, texts = Cld2Detector(), [r["text"] for r in lingua]
    seen: dict[str, float] = {}
    for text in texts + [" ".join(texts[i:i + 3]) for i in range(0, len(texts), 7)]:
        for code, figure in detector.detect(text).probs.items():
            seen[code] = max(seen.get(code, 0.0), figure)
    assert all(figure <= highest_figure("cld2", code) for code, figure in seen.items()), seen
    assert seen["en"] == seen["de"] == 0.99 and seen["el"] == seen["th"] == 1.0


# ---- domains --------------------------------------------------------------------------------------------
def test_humaneval_scores_as_code(humaneval: dict[str, list[dict[str, str]]]) -> None:
    qc = QualityControl({**OPEN, "domain": "code"})
    rates = {}
    for lang, records in humaneval.items():
        verdicts = qc.evaluate_batch(records)
        assert all(v.keep or v.meta["failed_check"] == "domain" for v in verdicts)
        rates[lang] = sum(v.keep for v in verdicts) / len(verdicts)
    print("\ncode kept per language:", {k: round(v, 3) for k, v in rates.items()})
    assert set(rates) == {"cpp", "go", "java", "js", "python", "rust"}
    assert sum(rates.values()) / len(rates) >= 0.95
    assert min(rates.values()) >= 0.9


def test_c4_does_not_score_as_code(c4: list[dict[str, Any]]) -> None:
    verdicts = QualityControl({**OPEN, "domain": "code"}).evaluate_batch(c4)
    not_code = [v for v in verdicts if not v.keep and v.meta["failed_check"] == "domain"]
    assert len(not_code) / len(c4) >= 0.95
    early = sum("<=" in v.meta["reason"] for v in not_code)
    print(f"\nC4 rejected as not code: {len(not_code)}/{len(c4)} ({early} by the early exit)")


@pytest.mark.slow
def test_pubmed_is_medical_c4_is_not(shared_data: Path, c4: list[dict[str, Any]]) -> None:
    pubmed = read_jsonl(shared_data / "medical" / "pubmedqa_abstracts.jsonl")
    qc = QualityControl({**OPEN, "domain": "medical"})
    pubmed_kept = sum(v.keep for v in qc.evaluate_batch(pubmed)) / len(pubmed)
    c4_verdicts = qc.evaluate_batch(c4)
    c4_failed = sum(not v.keep and v.meta["failed_check"] == "domain" for v in c4_verdicts) / len(c4)
    print(f"\nmedical: PubMed kept {pubmed_kept:.1%}, C4 failing the domain gate {c4_failed:.1%}")
    assert pubmed_kept >= 0.9
    assert c4_failed >= 0.9
    # and with every default gate on, PubMed abstracts still pass
    assert sum(QualityControl({"domain": "medical"}).evaluate(r).keep for r in pubmed) / len(pubmed) >= 0.9


# ---- exact dedup across files -------------------------------------------------------------------------------
def test_dclm_cross_file_duplicates(shared_data: Path) -> None:
    majority = read_jsonl(shared_data / "web" / "dclm_quality_majority_data.jsonl")
    agreement = read_jsonl(shared_data / "web" / "dclm_quality_agreement_data.jsonl")
    # the data itself: every agreement text reappears verbatim in majority, which has no internal duplicates
    assert len({r["text"] for r in majority}) == len(majority) == 499
    assert {r["text"] for r in agreement} <= {r["text"] for r in majority} and len(agreement) == 281

    qc = QualityControl(OPEN)
    first = collections.Counter(qc.clean_record(dict(r))[1].get("failed_check", "kept") for r in majority)
    second = collections.Counter(qc.clean_record(dict(r))[1].get("failed_check", "kept") for r in agreement)
    assert first == {"kept": 499}
    assert second == {"duplicate": 281}
    assert len(qc.dedup) == 499 and qc.stats["rejected_by_check"] == {"duplicate": 281}


# ---- the default chain on web text, meta shape, determinism across processes -------------------------------------
def test_default_chain_on_c4(c4: list[dict[str, Any]]) -> None:
    qc = QualityControl()
    verdicts = qc.evaluate_batch(c4)
    outcome = collections.Counter(v.meta.get("failed_check", "kept") for v in verdicts)
    print("\nC4 through the default chain:", dict(outcome), "stats:", json.dumps(qc.stats["gates"]))
    assert outcome["kept"] >= 900 and "error" not in outcome
    for v in verdicts:
        assert json.loads(json.dumps(v.meta)) == v.meta
        assert v.digest is None or v.meta["sha256"] == v.digest.hex()
        if v.keep:
            assert {"chars", "pii_density", "profanity_density", "language", "language_prob"} <= v.meta.keys()
        else:
            assert v.text is None and v.meta["reason"]


def _evaluate_in_worker(config: dict[str, Any], records: list[Any]) -> list[tuple]:
    return [tuple(v) for v in QualityControl(config).evaluate_batch(records)]


@pytest.mark.slow
def test_process_pool_matches_in_process(c4: list[dict[str, Any]], lingua: list[dict[str, Any]]) -> None:
    records: list[Any] = c4[:150] + [{"text": r["text"]} for r in lingua[::120]] + [None, {"text": b"x"}]
    config = {"min_chars": 20, "language_detector": "cascade"}
    local = _evaluate_in_worker(config, records)
    assert local == _evaluate_in_worker(config, records)
    chunks = [records[i::2] for i in range(2)]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        remote = list(pool.map(_evaluate_in_worker, [config] * 2, chunks))
    assert remote[0] + remote[1] == _evaluate_in_worker(config, chunks[0]) + _evaluate_in_worker(config, chunks[1])
    assert sorted(map(repr, remote[0] + remote[1])) == sorted(map(repr, local))


@pytest.mark.parametrize("config", [{}, {"min_chars": 20, "language_detector": "cascade", "normalize": False,
                                         "near_dedup": {"enabled": True}},
                                    {**OPEN, "domain": "medical", "required_metadata": ["url"]}],
                         ids=["defaults", "cascade-near-dedup", "medical"])
def test_settings_and_dict_give_identical_verdicts(c4: list[dict[str, Any]], config: dict[str, Any]) -> None:
    """QualityControl from pickled typed settings (as pool workers and Ray actors get them) = from the raw dict."""
    records: list[Any] = c4[:60] + [None, {"text": b"x"}, {"text": "short"}]
    settings = pickle.loads(pickle.dumps(load_quality_settings(config)))
    from_settings = QualityControl(settings).evaluate_batch(records)
    from_dict = QualityControl(config).evaluate_batch(records)
    assert from_settings == from_dict
    outcomes = {v.meta.get("failed_check", "kept") for v in from_dict}
    assert "kept" in outcomes and len(outcomes) > 1  # the gates did decide something
    assert any(v.signature for v in from_dict) == settings.near_dedup.enabled
