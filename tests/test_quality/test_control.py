"""Verdict identity on every shared corpus: the QC chain's outcomes pinned, so a faster chain must decide alike.

For each corpus and each config that makes sense for it, every record's verdict is reduced to
(keep, failed_check, reason, sha256 of the kept text, digest, the meta as serialised JSON) and hashed;
the test pins that hash, the counts per `failed_check` and the per-gate counters, all computed with
the chain as it was before the gates were batched (issue 27). `evaluate_batch` (what ingest calls)
and per-record `evaluate` must agree record for record.

    PYTHONPATH=$PWD python tests/test_quality/test_control.py /tmp/qc_verdicts.json   # full per-record dump
"""
from __future__ import annotations

import collections
import gzip
import hashlib
import json
import os
import random
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from quality import QualityControl
from helpers import REPO

SHARED = Path(os.environ.get("STREAMPREP_SHARED_DATA", REPO.parent / "shared" / "data"))
BATCH = 97  # odd, so batches do not line up with anything in the data


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        for line in fh:
            yield json.loads(line)


def _perturbed(texts: list[str]) -> list[Any]:
    """C4 texts with what the gates look for spliced in (deterministically), plus hostile records:
    exercises normalisation, PII, obfuscated profanity, copyright and the schema checks on real prose."""
    rng = random.Random(27)
    inserts = ["\r\n", "\x92", "\x85", "\u2019", "\u201c", "\u2014", "\u00a0", "\u3000", "  ", "\t\n ", " \n",
               "\ufeff", "\x00", "e\u0301", "jane.doe@example.com", "(555) 123-4567", "+44 20 7946 0958",
               "4111 1111 1111 1111", "4111 1111 1111 1112", "192.168.0.1", "1.2.3.4", "fe80:0:0:0:0:0:0:1",
               "f*ck", "sh1t", "a$$", "b!tch", "FUCK", "|shit|", "@ss", "sh!t", "(c) 2019", "\u00a9",
               "All  rights reserved", "\ufdd0", "1-800-555-0199", "555-123-4567", "\u00e9t\u00e9"]
    out: list[Any] = []
    for i, text in enumerate(texts):
        words = text.split(" ")
        for _ in range(rng.choice((1, 2, 4, 8, 16))):
            words.insert(rng.randrange(len(words) + 1), rng.choice(inserts))
        out.append({"text": " ".join(words) if i % 3 else "".join(w + rng.choice(" \n\t") for w in words)})
    out += [None, [], "text", {"text": b"bytes"}, {"text": None}, {}, {"text": ""}, {"text": " \n\t "},
            {"text": "ok \ud800 surrogate" * 20}, {"text": "\x00" * 200}, {"text": "x" * 3_000_000},
            {"text": "fuck " * 50}, {"text": "f**k sh1t " * 30}, {"text": "jane@example.com " * 20},
            {"text": "Copyright 2020 " * 10}, {"text": "1234567890 " * 30}, {"text": "\u00a0" * 150},
            {"text": "\r\n".join(["Line with trailing space   "] * 10)}, {"text": "\u4e2d\u6587" * 100}]
    return out


def corpora(root: Path) -> dict[str, list[Any]]:
    """Every shared corpus as records with a `text` field."""
    out: dict[str, list[Any]] = {}
    for path in sorted((root / "web").glob("*.jsonl")):
        out[f"web/{path.name}"] = list(_jsonl(path))
    wiki = root / "web" / "wikipedia_en_llamafactory_demo30.txt"
    out[f"web/{wiki.name}"] = [{"text": line} for line in wiki.read_text("utf-8").splitlines() if line.strip()]
    out["medical/pubmedqa_abstracts.jsonl"] = list(_jsonl(root / "medical" / "pubmedqa_abstracts.jsonl"))
    for path in sorted((root / "code" / "humaneval-x").glob("*.jsonl.gz")):
        out[f"code/{path.name}"] = [{"text": r["prompt"] + r["canonical_solution"]} for r in _jsonl(path)]
    out["multilingual/lingua"] = list(_jsonl(root / "multilingual" / "lingua_sentences_75langs.jsonl"))
    chat = root / "chat"
    out["chat/glaive.messages"] = [{"text": "\n\n".join(m["content"] for m in r["messages"])}
                                   for r in _jsonl(chat / "glaive_toolcall_en_demo300.messages.jsonl")]
    sharegpt = json.loads((chat / "glaive_toolcall_en_demo300.sharegpt.json").read_text("utf-8"))
    out["chat/glaive.sharegpt"] = [{"text": "\n\n".join(t["value"] for t in r["conversations"])} for r in sharegpt]
    out["chat/hh_rlhf"] = [{"text": r[k]} for r in _jsonl(chat / "hh_rlhf_harmless_base_test.jsonl.gz")
                           for k in ("chosen", "rejected")]
    out["synthetic/perturbed_c4"] = _perturbed([r["text"] for r in out["web/c4_en_train00000_first1000.jsonl"]])
    return out


GENERAL = {}
SHORT = {"min_chars": 0}  # sentences and chat turns are short: let every gate see them
CASES: list[tuple[str, str, dict[str, Any], int]] = []  # (case id, corpus, config, record step)
for _name in ["web/c4_en_llamafactory_demo300.jsonl", "web/c4_en_train00000_first1000.jsonl",
              "web/dclm_quality_agreement_data.jsonl", "web/dclm_quality_majority_data.jsonl",
              "web/dolma_cc_en_head-0091.jsonl", "web/dolma_cc_en_head-0174.jsonl",
              "web/wikipedia_en_llamafactory_demo30.txt", "medical/pubmedqa_abstracts.jsonl",
              "multilingual/lingua", "chat/glaive.messages", "chat/glaive.sharegpt", "chat/hh_rlhf",
              "synthetic/perturbed_c4"] + [f"code/humaneval_{x}.jsonl.gz" for x in
                                           ("cpp", "go", "java", "js", "python", "rust")]:
    CASES.append((f"{_name}|general", _name, GENERAL, 1))
    CASES.append((f"{_name}|short", _name, SHORT, 1))
for _name in ["medical/pubmedqa_abstracts.jsonl", "web/c4_en_train00000_first1000.jsonl", "synthetic/perturbed_c4"]:
    CASES.append((f"{_name}|medical", _name, {"domain": "medical"}, 1))
for _name in [f"code/humaneval_{x}.jsonl.gz" for x in ("cpp", "go", "java", "js", "python", "rust")] + [
        "web/c4_en_train00000_first1000.jsonl", "synthetic/perturbed_c4"]:
    CASES.append((f"{_name}|code", _name, {"domain": "code"}, 1))
for _name in ["multilingual/lingua", "web/c4_en_train00000_first1000.jsonl", "synthetic/perturbed_c4"]:
    CASES.append((f"{_name}|cascade", _name, {**SHORT, "language_detector": "cascade"}, 7))
    CASES.append((f"{_name}|langdetect", _name, {**SHORT, "language_detector": "langdetect"}, 29))
CASES.append(("multilingual/lingua|de", "multilingual/lingua", {**SHORT, "expected_language": "de"}, 1))
CASES.append(("synthetic/perturbed_c4|strict", "synthetic/perturbed_c4",
              {"pii_max_density": 0.0, "profanity_max_density": 0.0, "normalize": False}, 1))


def verdict_row(v: Any) -> list[Any]:
    """(keep, failed_check, reason, kept-text sha256, digest hex, meta JSON in its own key order)."""
    text_sha = None if v.text is None else hashlib.sha256(v.text.encode("utf-8", "surrogatepass")).hexdigest()
    return [v.keep, v.meta.get("failed_check"), v.meta.get("reason"), text_sha,
            None if v.digest is None else v.digest.hex(), json.dumps(v.meta, ensure_ascii=False)]


def run_case(records: list[Any], config: dict[str, Any], step: int) -> tuple[list[list[Any]], dict[str, Any]]:
    """Per-record rows via `evaluate_batch` in batches of BATCH, and the chain's stats without the timings."""
    qc = QualityControl(config)
    picked = [dict(r) if isinstance(r, dict) else r for r in records[::step]]
    rows = []
    for i in range(0, len(picked), BATCH):
        rows += [verdict_row(v) for v in qc.evaluate_batch(picked[i:i + BATCH])]
    gates = {name: {k: c[k] for k in ("seen", "kept", "rejected")} for name, c in qc.stats["gates"].items()}
    return rows, {"records": qc.stats["records"], "gates": gates}


def summarise(rows: list[list[Any]], stats: dict[str, Any]) -> str:
    """One line: the sha256 over every row, outcomes per failed_check, then each gate's seen/kept/rejected."""
    by_check = collections.Counter(r[1] or "kept" for r in rows)
    blob = json.dumps(rows, ensure_ascii=False).encode("utf-8", "surrogatepass")
    checks = " ".join(f"{k}={n}" for k, n in sorted(by_check.items()))
    gates = " ".join(f"{k}={c['seen']}/{c['kept']}/{c['rejected']}" for k, c in stats["gates"].items())
    return f"{hashlib.sha256(blob).hexdigest()[:16]} | {checks} | {gates}"




@pytest.fixture(scope="module")
def all_corpora(shared_data: Path) -> dict[str, list[Any]]:
    return corpora(shared_data)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_verdicts_identical_to_the_pinned_chain(case: str, all_corpora: dict[str, list[Any]]) -> None:
    _, corpus, config, step = next(c for c in CASES if c[0] == case)
    rows, stats = run_case(all_corpora[corpus], config, step)
    assert summarise(rows, stats) == PINNED[case]


def test_batch_and_per_record_evaluate_agree(all_corpora: dict[str, list[Any]]) -> None:
    """`evaluate_batch` is what ingest calls, `evaluate` what `clean_record` builds on: same verdicts."""
    records = all_corpora["synthetic/perturbed_c4"][::3] + all_corpora["multilingual/lingua"][::50]
    one = QualityControl({"min_chars": 0})
    per_record = [verdict_row(one.evaluate(dict(r) if isinstance(r, dict) else r)) for r in records]
    batch = QualityControl({"min_chars": 0})
    batched = [verdict_row(v) for v in batch.evaluate_batch([dict(r) if isinstance(r, dict) else r for r in records])]
    assert batched == per_record
    assert one.stats["records"] == batch.stats["records"]
    assert {k: c["rejected"] for k, c in one.stats["gates"].items()} == \
        {k: c["rejected"] for k, c in batch.stats["gates"].items()}


def test_a_repeated_text_gets_the_verdict_it_got_before(all_corpora: dict[str, list[Any]]) -> None:
    """The memo of judged texts: every record seen again (in later batches, with other raw spacing that
    normalises alike) gets the verdict, meta and gate counters the gates gave it, and skips the gates."""
    from quality.gates.language import LanguageGate

    base = [r for r in all_corpora["synthetic/perturbed_c4"][::7] if isinstance(r, dict)]
    records = base + [{**r, "text": r["text"] + "  "} if isinstance(r.get("text"), str) else r for r in base] + base
    one = QualityControl({})
    per_record = [verdict_row(one.evaluate(dict(r))) for r in records]
    batch = QualityControl({})
    calls = 0
    check = LanguageGate.check

    def counted(gate: LanguageGate, doc: Any) -> str | None:
        nonlocal calls
        calls += 1
        return check(gate, doc)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LanguageGate, "check", counted)
        n = len(base)
        batched = [verdict_row(v) for part in (records[:n], records[n:2 * n], records[2 * n:])
                   for v in batch.evaluate_batch([dict(r) for r in part])]
    assert batched == per_record
    assert {k: (c["seen"], c["kept"], c["rejected"]) for k, c in one.stats["gates"].items()} == \
        {k: (c["seen"], c["kept"], c["rejected"]) for k, c in batch.stats["gates"].items()}
    reached = batch.stats["gates"]["language"]["seen"]
    assert 0 < calls == reached // 3  # the language gate judged each distinct text once


def test_the_memo_keeps_a_verdicts_meta_and_recalls_only_what_the_gates_added() -> None:
    """The memo holds each judged verdict's meta itself (no copy) with the span of keys the gates after
    normalisation added: a key the caller adds to that meta later is not recalled, and a recalled nested value
    (`pii`) is a copy."""
    qc = QualityControl({"pii_max_density": 0.5})
    text = "Write to jane.doe@example.com or call 555-867-5309 about the meeting on the fifth of May, please. " * 3
    first = qc.evaluate_batch([{"text": text}])[0]
    assert first.keep and first.meta["pii"] == {"email": 3, "phone": 3}
    remembered = dict(first.meta)
    first.meta["added_later"] = True
    again = qc.evaluate_batch([{"text": text}])[0]
    assert again.meta == remembered and again.meta["pii"] is not first.meta["pii"]


def test_a_gate_that_reads_the_record_turns_the_memo_off() -> None:
    """`required_metadata` adds a gate that reads more than the text: nothing is recalled then."""
    qc = QualityControl({"required_metadata": ["url"]})
    text = "The same sentence, said five times to be long enough to keep. " * 5
    records = [{"text": text, "url": "a"}, {"text": text}]
    assert [v.keep for v in qc.evaluate_batch(records)] == [True, False]
    assert qc._memo == {}


def test_a_chain_of_cheap_gates_after_normalisation_is_not_remembered() -> None:
    """With every gate off but the length test, a repeat is judged again (a lookup costs more than the test):
    nothing is stored, and verdicts and counters are those of `evaluate` per record."""
    off = {"min_chars": 0, "expected_language": None, "pii_max_density": 1.0, "profanity_max_density": 1.0,
           "reject_copyright": False, "dedup": "none"}
    records = [{"text": "a repeated text"}, {"text": "a repeated text"}, {"text": "   "}, {"text": "other"}]
    batch, single = QualityControl(off), QualityControl(off)
    got = batch.evaluate_batch(records)
    assert [g.name for g in batch.gates][-1] == "length" and batch._memo_from is None and batch._memo == {}
    want = [single.evaluate(r) for r in records]
    assert [(v.keep, v.meta) for v in got] == [(v.keep, v.meta) for v in want] and [v.keep for v in got] == \
        [True, True, False, True]
    counters = lambda qc: {k: {c: n for c, n in v.items() if c != "seconds"} for k, v in qc.stats["gates"].items()}
    assert counters(batch) == counters(single)
    assert QualityControl({})._memo_from is not None  # the default chain (pii, profanity, language...) remembers


@pytest.mark.parametrize("answer", ["short", "none", "long", "str", "bytes"])
def test_a_check_batch_with_a_wrong_answer_is_rechecked_doc_by_doc(answer: str) -> None:
    """Regression: a plug-in gate's `check_batch` that answered with fewer reasons than docs (or None) crashed the
    job ('NoneType' object has no attribute 'keep', zip() having cut the answer short), and one with more was
    taken as it was. Either is now re-checked doc by doc, as a `check_batch` that raises is. So is a str (or bytes)
    of one character per doc, which was taken as one reason per character: every doc rejected, reason 'x'."""
    import quality.gates as gates
    from quality.gates import Gate

    class Odd(Gate):
        name = failed_check = "odd"

        def check(self, doc: Any) -> str | None:
            return "says odd" if "odd" in doc.text else None

        def check_batch(self, docs: list[Any]) -> Any:
            return {"short": [None] * (len(docs) - 1), "none": None, "long": [None] * (len(docs) + 1),
                    "str": "x" * len(docs), "bytes": b"x" * len(docs)}[answer]

    off = {"min_chars": 0, "expected_language": None, "pii_max_density": 1.0, "profanity_max_density": 1.0,
           "reject_copyright": False, "dedup": "none"}
    records = [{"text": f"{word} text number {i}"} for i, word in enumerate(["even", "odd", "even", "odd"])]
    gates.register_gate(lambda settings, text_field: Odd())
    try:
        got = QualityControl(off).evaluate_batch(records)
    finally:
        gates.EXTRA_GATES.pop()
    assert [(v.keep, v.meta.get("reason")) for v in got] == [(True, None), (False, "says odd")] * 2


@dataclass
class Scored:
    """A gate's meta value orjson writes as {"value": ...}."""

    value: float
    _private: float = float("nan")  # not written (orjson leaves out '_' attributes): no reject for it


@dataclass(slots=True)
class Slotted:
    """The same without a __dict__."""

    value: float


class Odds(Enum):
    """orjson writes a member as its value."""

    NAN = float("nan")


NON_FINITE = "a float NaN or infinity, which a JSON line writes as null"
UNWRITABLE: dict[str, tuple[Any, str]] = {
    "numpy float32": (np.float32(0.5), "Type is not JSON serializable: numpy.float32"),
    "set": ({1}, "Type is not JSON serializable: set"),
    "bytes": (b"x", "Type is not JSON serializable: bytes"),
    "int past 64 bits": (10 ** 30, "Integer exceeds 64-bit range"),
    "tuple key": ({(1,): 2}, "Dict key must be str"),
    "lone surrogate": ("a\ud800", "str is not valid UTF-8: surrogates not allowed"),
    # orjson writes these as null: the value lost without a word
    "nan": (float("nan"), NON_FINITE), "-inf": (float("-inf"), NON_FINITE),
    "inf in a list": ({"scores": [0.5, None, float("inf")]}, NON_FINITE),
    # orjson writes a dataclass's and an Enum member's value itself (regression: their NaN was written as null)
    "nan in a dataclass": (Scored(float("nan")), NON_FINITE), "nan enum": (Odds.NAN, NON_FINITE),
    "inf in a slots dataclass": ([Slotted(float("inf"))], NON_FINITE)}


@pytest.mark.parametrize("batched", [True, False], ids=["evaluate_batch", "evaluate"])
@pytest.mark.parametrize("value", UNWRITABLE)
def test_a_plugin_gates_unwritable_meta_costs_that_record_only(value: str, batched: bool) -> None:
    """Regression: a plug-in gate that put a numpy float, a set, bytes, an int past 64 bits, a tuple key or a lone
    surrogate into doc.meta ended the job at the record's line (`TypeError: Type is not JSON serializable:
    numpy.float32`, no gate named; a re-run the same); a NaN or infinity kept its record, the value written as null.
    That record is now a reject `error` naming the gate and the key, the key dropped so that its line is written;
    the other records are judged as before."""
    import orjson

    from quality import gates
    from quality.gates import Gate

    bad, why = UNWRITABLE[value]

    class Scorer(Gate):
        name = failed_check = "scorer"

        def check(self, doc: Any) -> str | None:
            doc.meta["score"] = bad if "bad" in doc.text else 0.5
            return "says odd" if "odd" in doc.text else None

    off = {"min_chars": 0, "expected_language": None, "pii_max_density": 1.0, "profanity_max_density": 1.0,
           "reject_copyright": False, "dedup": "none"}
    records = [{"text": f"{word} text number {i}"} for i, word in enumerate(["even", "bad", "odd", "bad odd"])]
    gates.register_gate(lambda settings, text_field: Scorer())
    try:
        qc = QualityControl(off)
        got = qc.evaluate_batch(records) if batched else [qc.evaluate(r) for r in records]
    finally:
        gates.EXTRA_GATES.pop()
    error = f"scorer: internal error TypeError: meta 'score': not JSON ({why})"
    assert [(v.keep, v.meta.get("failed_check"), v.meta.get("reason"), v.meta.get("score")) for v in got] == [
        (True, None, None, 0.5), (False, "error", error, None), (False, "scorer", "says odd", 0.5),
        (False, "error", error, None)]
    assert [orjson.loads(orjson.dumps(v.meta)) == v.meta for v in got] == [True] * 4
    assert qc.stats["rejected_by_check"] == {"error": 2, "scorer": 1}


def test_a_finite_dataclass_or_enum_in_meta_is_written_as_it_is() -> None:
    """What orjson leaves out of a dataclass ('_' attributes) or writes fine is no reject: only what it writes as null."""
    from quality.gates import _unwritable

    class Finite(Enum):
        HALF = 0.5

    assert _unwritable({"s": Scored(0.5), "e": Finite.HALF, "l": [Slotted(1.0)], "n": None}) is None


@pytest.mark.parametrize("raises", [False, True], ids=["returned", "raised"])
def test_a_plugin_gates_reason_with_a_lone_surrogate_costs_that_record_only(raises: bool) -> None:
    """Regression: a reason (or a raised exception's message) with a lone surrogate ended the job when its reject
    line was written (`TypeError: str is not valid UTF-8: surrogates not allowed`); it is a reject `error` now."""
    from quality import gates
    from quality.gates import Gate

    class Odd(Gate):
        name = failed_check = "odd"

        def check(self, doc: Any) -> str | None:
            if "odd" in doc.text and raises:
                raise ValueError("odd \ud800")
            return "odd \ud800" if "odd" in doc.text else None

    off = {"min_chars": 0, "expected_language": None, "pii_max_density": 1.0, "profanity_max_density": 1.0,
           "reject_copyright": False, "dedup": "none"}
    gates.register_gate(lambda settings, text_field: Odd())
    try:
        got = QualityControl(off).evaluate_batch([{"text": "even text"}, {"text": "odd text"}])
    finally:
        gates.EXTRA_GATES.pop()
    error = "ValueError 'odd \\ud800'" if raises else "reason 'odd \\ud800': not JSON (a lone surrogate)"
    assert [(v.keep, v.meta.get("failed_check"), v.meta.get("reason")) for v in got] == [
        (True, None, None), (False, "error", f"odd: internal error TypeError: {error}")]


def test_a_plugin_gate_named_as_a_built_in_one_is_refused() -> None:
    """Regression: a plug-in gate named `pii` ran beside the built-in one, their counters merged under one name (the
    audit said `pii seen 2896` of 1499 records). Building the chain now stops, naming the plug-in."""
    import quality.gates as gates
    from quality.gates import Gate, GatePluginError

    class Pii(Gate):
        name = failed_check = "pii"

        def check(self, doc: Any) -> str | None:
            return None

    def factory(settings: Any, text_field: str) -> Gate:
        return Pii()

    gates.register_gate(factory)
    try:
        with pytest.raises(GatePluginError) as err:
            QualityControl({}).evaluate_batch([{"text": "some text " * 20}])
    finally:
        gates.EXTRA_GATES.pop()
    assert str(err.value) == (f"quality gate plug-in {__name__}.test_a_plugin_gate_named_as_a_built_in_one_is_refused"
                              f".<locals>.factory: its gate's name 'pii' is the built-in gate PiiGate's (the audit "
                              f"counts a gate's stats under its name, its rejects under its failed_check): name it "
                              f"otherwise")


CLASHES = {
    "duplicate": ("name", "'duplicate' is exact dedup's reject reason, which streamprep writes itself"),
    "near_duplicate": ("name", "'near_duplicate' is near-dedup's reject reason, which streamprep writes itself"),
    "error": ("name", "'error' is a gate's internal error's reject reason, which streamprep writes itself"),
    "parse": ("name", "'parse' is an unreadable record's reject reason, which streamprep writes itself"),
    "empty_tokens": ("name", ("'empty_tokens' is the audit's count of kept records without tokens, which "
                              "streamprep writes itself")),
    "sft:long": ("name", "'sft:long' is an SFT drop's reason (sft:…), which streamprep writes itself"),
    "": ("name", "'' is empty"),
    "mine/pii": ("failed_check", "'pii' is the built-in gate PiiGate's"),
    "mine/domain": ("failed_check", "'domain' is the built-in gate MedicalGate's"),
    "mine/": ("failed_check", "'' is empty"),
    "mine/unknown": ("failed_check", ("'unknown' is the reason of a reject without a failed_check, which "
                                      "streamprep writes itself")),
    "mine/ours": ("failed_check", ("'ours' is that of the plug-in gate 'ours' (quality gate plug-in "
                                   "test_control.test_a_plugin_gate_named_as_the_pipelines_reasons_is_refused.<locals>"
                                   ".<lambda>)")),
}


@pytest.mark.parametrize("case", CLASHES)
def test_a_plugin_gate_named_as_the_pipelines_reasons_is_refused(case: str) -> None:
    """Regression: a plug-in gate named `duplicate` (or `error`, `parse`, `empty_tokens`), or with a built-in gate's
    or another plug-in's failed_check, or an empty name, was accepted, its rejects counted as the pipeline's own
    (rejected_as_duplicate 340 of 250 duplicates; `rejected 37:  29` for ""). Building the chain now stops, naming
    the plug-in and the clash; the domain gates' `domain` is refused whichever domain the settings pick."""
    from quality import gates
    from quality.gates import Gate, GatePluginError

    name, _, failed_check = case.partition("/")

    class Clash(Gate):
        def check(self, doc: Any) -> str | None:
            return None

    clash = Clash()
    clash.name, clash.failed_check = name, failed_check if "/" in case else name  # type: ignore[misc]
    ours = Clash()
    ours.name = ours.failed_check = "ours"  # type: ignore[misc]
    gates.register_gate(lambda settings, text_field: ours)
    factory = gates.register_gate(lambda settings, text_field: clash)
    try:
        with pytest.raises(GatePluginError) as err:
            QualityControl({})
    finally:
        del gates.EXTRA_GATES[-2:]
    attr, why = CLASHES[case]
    assert str(err.value) == (f"quality gate plug-in {factory.__module__}.{factory.__qualname__}: its gate's {attr} "
                              f"{why} (the audit counts a gate's stats under its name, its rejects under its "
                              f"failed_check): name it otherwise")


def _texts(all_corpora: dict[str, list[Any]], step: int) -> list[str]:
    """Normalised texts of every corpus (every `step`-th record), plus copies with gate bait spliced in."""
    from quality.normalize import normalize_text

    rng = random.Random(11)
    bait = ["f*ck", "sh1t", "@$$", "a**", "b!tch!", "|shit|", "FUCK", "f\u00fcck", "\u00e9", "_ass", "ass_",
            "a$$hole", "f#ck", "sh!t", "2019", "!!", "cunt\u00e9", "\u00e9cunt", "\u00a9", "(c)", "rights",
            "(555) 123-4567", "+44 20 7946 0958", "4111 1111 1111 1111", "1.2.3.4", "fe80:0:0:0:0:0:0:1",
            "\u0663\u0663\u0663-\u0663\u0663\u0663-\u0663\u0663\u0663\u0663", "( 1 2 3 4", " \n", "\n\t"]
    out = []
    for recs in all_corpora.values():
        for r in recs[::step]:
            text = r.get("text") if isinstance(r, dict) else None
            if not isinstance(text, str) or len(text) > 100_000 or "\ud800" in text:
                continue
            out.append(normalize_text(text))
            out.append(normalize_text(" ".join(rng.choice(bait) if rng.random() < 0.05 else w for w in text.split(" "))))
    return out


@pytest.mark.slow
def test_fast_scans_equal_their_reference_scans(all_corpora: dict[str, list[Any]]) -> None:
    """Each shortcut against the plain scan it replaces, on real text with bait spliced in."""
    from quality.gates import pii
    from quality.gates.base import Doc
    from quality.gates.copyright import _CUES
    from quality.gates.profanity import ProfanityGate
    from quality.normalize import _EDGE_CUES, _has_line_edge, latin1_view, view_flags

    gates = [ProfanityGate(0.01), ProfanityGate(0.0)]
    scanned = 0
    for text in _texts(all_corpora, 3):
        lower = text.lower()
        for gate in gates:
            doc = Doc(None, text=text)
            fast, ref = gate.density_by_scan(doc), gate.density_by_tokens(Doc(None, text=text))
            if fast is not None:
                scanned += 1
                assert fast == ref or fast == (0, 0) and ref[0] == 0, text[:200]
            cue = doc.scan.copyright_cue if doc.scan else any(c in lower for c in _CUES)
            assert cue == any(c in lower for c in _CUES)
        assert [m.span() for m in pii._number_runs(text, latin1_view(text))] == \
            [m.span() for m in pii._NUMBER_RUN.finditer(text)]
        assert bool(pii.IPV6_RE.search(text)) <= bool(pii._IPV6_CUE.search(text))
        assert _has_line_edge(text) == ("\n" in text and any(c in text for c in _EDGE_CUES))
        view = latin1_view(text)
        assert view is None or view_flags(view)[1:] == ("  " in text, _has_line_edge(text))
        assert view is None or pii._cues(view) == (bool(pii._NUMBER_RUN.search(text)), bool(pii._IPV6_CUE.search(text)))
    assert scanned > 10_000


@pytest.mark.slow
def test_cld2_input_drops_exactly_what_the_str_class_drops() -> None:
    """The bytes test for characters pycld2 refuses agrees with the str regex on every code point."""
    from quality.language import _CLD2_UNSAFE, _UTF8_UNSAFE, cld2_input

    for cp in range(0x110000):
        if 0xD800 <= cp < 0xE000:
            continue
        c = chr(cp)
        assert (_UTF8_UNSAFE.search(c.encode()) is None) == (_CLD2_UNSAFE.search(c) is None), hex(cp)
    sample = "caf\u00e9 \x00 \x85 \ufdd0 \U0001fffe ok \x7f"
    assert cld2_input(sample) == _CLD2_UNSAFE.sub("", sample)
    assert cld2_input("plain\x01 text\x7f") == b"plain text"


def _cld2_reference(sample: str) -> Any:
    """The cld2 detector as it was: pycld2 always on `cld2_input(sample)`; its result, or the exception."""
    import pycld2

    from quality.language import Detection, cld2_input, normalize_code

    try:
        reliable, _, details = pycld2.detect(cld2_input(sample), isPlainText=True)
    except pycld2.error:
        return Detection({}, False, "cld2")
    except UnicodeEncodeError as exc:
        return repr(exc)
    probs: dict[str, float] = {}
    for _, code, percent, _ in details:
        if code != "un" and percent > 0:
            probs[normalize_code(code)] = probs.get(normalize_code(code), 0.0) + percent / 100.0
    return Detection(probs, bool(reliable and probs), "cld2")


@pytest.mark.parametrize("sample", ["plain English text about the weather today and tomorrow",
                                    "plain\x01 text\x7f about the weather", "caf\u00e9 \x00 \x85 \ufdd0 \U0001fffe ok \x7f",
                                    "ok \ud800 surrogate and more words", "\x00\x01", "", "\ufffe", "tabs\tand\r\nlines\x0c ok",
                                    "Der schnelle braune Fuchs springt \u00fcber den faulen Hund \x9f"])
def test_cld2_detector_equals_the_input_filtered_call(sample: str) -> None:
    """The str goes to pycld2 first; what it refuses takes the old filtered call: same result or exception."""
    from quality.language import Cld2Detector

    try:
        got: Any = Cld2Detector().detect(sample)
    except UnicodeEncodeError as exc:
        got = repr(exc)
    assert got == _cld2_reference(sample)


@pytest.mark.slow
def test_pycld2_refuses_every_char_cld2_input_drops() -> None:
    """Why the detector may hand pycld2 the str first: a str it accepts holds nothing `cld2_input` drops."""
    import pycld2

    from quality.language import _CLD2_UNSAFE

    text = "An ordinary English sentence about the weather and the news. "
    for cp in range(0x110000):
        if 0xD800 <= cp < 0xE000 or not _CLD2_UNSAFE.match(chr(cp)):
            continue
        for sample in (text + chr(cp) + text, chr(cp)):
            with pytest.raises(pycld2.error):
                pycld2.detect(sample, isPlainText=True)


def main(out: Path) -> None:
    """Dump every case's per-record rows and summaries (for a record-by-record diff after a change)."""
    data = corpora(SHARED)
    full: dict[str, Any] = {}
    for case, corpus, config, step in CASES:
        rows, stats = run_case(data[corpus], config, step)
        full[case] = {"summary": summarise(rows, stats), "rows": rows}
        print(case, full[case]["summary"], flush=True)
    out.write_text(json.dumps(full))


if __name__ == "__main__":
    main(Path(sys.argv[1]))


# Computed with the chain as it was before issue 27's changes (the commit adding this file). Round 41: in the
# perturbed-C4 cases two reasons read "pii density 0.01 > 0.01" (a card at 0.010005, an email at 0.01003); they now
# show the decimals that keep the figure past its limit (quality.figures.shown); same verdicts and meta.
# Round 45: in the DCLM cases two kept texts' PII meta were corrected, the same verdicts and counts: a phone in
# parentheses "(1-866-943-3427)" is matched with its "1-" (pii_density 0.0041 -> 0.0047), and "(719-440-1050)",
# missed after its "(", is found ({"phone": 1} -> 2, 0.0048 -> 0.0088).
# Round 47: international phones with a group past 4 digits are found (C4 doc 92's +60-6-2881100 and +60-6-2813366,
# 309's +30-22530-71245, 947's +971 4 4508438): doc 92 is rejected as pii (0.0168 > 0.01, and first in the code and
# medical chains), 309 in perturbed C4 as pii before copyright (0.0163; phone 2), and kept texts' pii meta gain them.
# Round 48: PubMed doc 53's two "(PISs)", participant information sheets, are an acronym's plural, not "piss": it
# is kept (it was rejected as profanity, 0.014 > 0.01).
PINNED = {
    'web/c4_en_llamafactory_demo300.jsonl|general':
        'c88a1b2c9802f03d | copyright=10 kept=276 language=3 pii=9 schema=2 | duplicate=0/0/0 schema=300/300/0 normalize=300/300/0 length=300/298/2 pii=298/289/9 profanity=289/289/0 copyright=289/279/10 language=279/276/3',
    'web/c4_en_llamafactory_demo300.jsonl|short':
        'afdf80ffaa443173 | copyright=10 kept=278 language=3 pii=9 | duplicate=0/0/0 schema=300/300/0 normalize=300/300/0 length=300/300/0 pii=300/291/9 profanity=291/291/0 copyright=291/281/10 language=281/278/3',
    'web/c4_en_train00000_first1000.jsonl|general':
        '876b8bb3b0044703 | copyright=12 kept=956 language=7 pii=19 schema=6 | duplicate=0/0/0 schema=1000/1000/0 normalize=1000/1000/0 length=1000/994/6 pii=994/975/19 profanity=975/975/0 copyright=975/963/12 language=963/956/7',
    'web/c4_en_train00000_first1000.jsonl|short':
        'd44148502dd15d34 | copyright=12 kept=961 language=8 pii=19 | duplicate=0/0/0 schema=1000/1000/0 normalize=1000/1000/0 length=1000/1000/0 pii=1000/981/19 profanity=981/981/0 copyright=981/969/12 language=969/961/8',
    'web/dclm_quality_agreement_data.jsonl|general':
        '4d6bc42dbebe0539 | copyright=14 kept=250 language=3 pii=10 profanity=1 schema=3 | duplicate=0/0/0 schema=281/281/0 normalize=281/281/0 length=281/278/3 pii=278/268/10 profanity=268/267/1 copyright=267/253/14 language=253/250/3',
    'web/dclm_quality_agreement_data.jsonl|short':
        '2c3e8b6891e212b5 | copyright=14 kept=253 language=3 pii=10 profanity=1 | duplicate=0/0/0 schema=281/281/0 normalize=281/281/0 length=281/281/0 pii=281/271/10 profanity=271/270/1 copyright=270/256/14 language=256/253/3',
    'web/dclm_quality_majority_data.jsonl|general':
        '9e7c93b69f83beed | copyright=20 kept=449 language=3 pii=21 profanity=3 schema=3 | duplicate=0/0/0 schema=499/499/0 normalize=499/499/0 length=499/496/3 pii=496/475/21 profanity=475/472/3 copyright=472/452/20 language=452/449/3',
    'web/dclm_quality_majority_data.jsonl|short':
        'dc4e941ce5c9c2a7 | copyright=20 kept=452 language=3 pii=21 profanity=3 | duplicate=0/0/0 schema=499/499/0 normalize=499/499/0 length=499/499/0 pii=499/478/21 profanity=478/475/3 copyright=475/455/20 language=455/452/3',
    'web/dolma_cc_en_head-0091.jsonl|general':
        '202e48c66d2d12c5 | kept=10 | duplicate=0/0/0 schema=10/10/0 normalize=10/10/0 length=10/10/0 pii=10/10/0 profanity=10/10/0 copyright=10/10/0 language=10/10/0',
    'web/dolma_cc_en_head-0091.jsonl|short':
        '202e48c66d2d12c5 | kept=10 | duplicate=0/0/0 schema=10/10/0 normalize=10/10/0 length=10/10/0 pii=10/10/0 profanity=10/10/0 copyright=10/10/0 language=10/10/0',
    'web/dolma_cc_en_head-0174.jsonl|general':
        '344a0358aabaf287 | kept=10 | duplicate=0/0/0 schema=10/10/0 normalize=10/10/0 length=10/10/0 pii=10/10/0 profanity=10/10/0 copyright=10/10/0 language=10/10/0',
    'web/dolma_cc_en_head-0174.jsonl|short':
        '344a0358aabaf287 | kept=10 | duplicate=0/0/0 schema=10/10/0 normalize=10/10/0 length=10/10/0 pii=10/10/0 profanity=10/10/0 copyright=10/10/0 language=10/10/0',
    'web/wikipedia_en_llamafactory_demo30.txt|general':
        'ccda8dd79cf51998 | kept=30 | duplicate=0/0/0 schema=30/30/0 normalize=30/30/0 length=30/30/0 pii=30/30/0 profanity=30/30/0 copyright=30/30/0 language=30/30/0',
    'web/wikipedia_en_llamafactory_demo30.txt|short':
        'ccda8dd79cf51998 | kept=30 | duplicate=0/0/0 schema=30/30/0 normalize=30/30/0 length=30/30/0 pii=30/30/0 profanity=30/30/0 copyright=30/30/0 language=30/30/0',
    'medical/pubmedqa_abstracts.jsonl|general':
        'e62cdcfcb6411dc3 | kept=1000 | duplicate=0/0/0 schema=1000/1000/0 normalize=1000/1000/0 length=1000/1000/0 pii=1000/1000/0 profanity=1000/1000/0 copyright=1000/1000/0 language=1000/1000/0',
    'medical/pubmedqa_abstracts.jsonl|short':
        'e62cdcfcb6411dc3 | kept=1000 | duplicate=0/0/0 schema=1000/1000/0 normalize=1000/1000/0 length=1000/1000/0 pii=1000/1000/0 profanity=1000/1000/0 copyright=1000/1000/0 language=1000/1000/0',
    'multilingual/lingua|general':
        '7637d299c65a93fe | kept=173 language=7995 pii=14 schema=9518 | duplicate=0/0/0 schema=17700/17700/0 normalize=17700/17700/0 length=17700/8182/9518 pii=8182/8168/14 profanity=8168/8168/0 copyright=8168/8168/0 language=8168/173/7995',
    'multilingual/lingua|short':
        '2f1d9c2c03fdb659 | copyright=1 kept=355 language=17324 pii=18 profanity=2 | duplicate=0/0/0 schema=17700/17700/0 normalize=17700/17700/0 length=17700/17700/0 pii=17700/17682/18 profanity=17682/17680/2 copyright=17680/17679/1 language=17679/355/17324',
    'chat/glaive.messages|general':
        '8998f3bd00543586 | kept=289 pii=11 | duplicate=0/0/0 schema=300/300/0 normalize=300/300/0 length=300/300/0 pii=300/289/11 profanity=289/289/0 copyright=289/289/0 language=289/289/0',
    'chat/glaive.messages|short':
        '8998f3bd00543586 | kept=289 pii=11 | duplicate=0/0/0 schema=300/300/0 normalize=300/300/0 length=300/300/0 pii=300/289/11 profanity=289/289/0 copyright=289/289/0 language=289/289/0',
    'chat/glaive.sharegpt|general':
        '6d4cc34d7c0b70e0 | kept=288 language=1 pii=11 | duplicate=0/0/0 schema=300/300/0 normalize=300/300/0 length=300/300/0 pii=300/289/11 profanity=289/289/0 copyright=289/289/0 language=289/288/1',
    'chat/glaive.sharegpt|short':
        '6d4cc34d7c0b70e0 | kept=288 language=1 pii=11 | duplicate=0/0/0 schema=300/300/0 normalize=300/300/0 length=300/300/0 pii=300/289/11 profanity=289/289/0 copyright=289/289/0 language=289/288/1',
    'chat/hh_rlhf|general':
        '79621fc5235a9500 | kept=4216 language=2 pii=26 profanity=207 schema=173 | duplicate=0/0/0 schema=4624/4624/0 normalize=4624/4624/0 length=4624/4451/173 pii=4451/4425/26 profanity=4425/4218/207 copyright=4218/4218/0 language=4218/4216/2',
    'chat/hh_rlhf|short':
        'fbba6453604cf874 | kept=4382 language=3 pii=26 profanity=213 | duplicate=0/0/0 schema=4624/4624/0 normalize=4624/4624/0 length=4624/4624/0 pii=4624/4598/26 profanity=4598/4385/213 copyright=4385/4385/0 language=4385/4382/3',
    'synthetic/perturbed_c4|general':
        'ab7dcfc3220a485f | copyright=122 kept=336 language=8 pii=473 profanity=66 schema=14 | duplicate=0/0/0 schema=1019/1011/8 normalize=1011/1011/0 length=1011/1005/6 pii=1005/532/473 profanity=532/466/66 copyright=466/344/122 language=344/336/8',
    'synthetic/perturbed_c4|short':
        '83daadbcf6285e78 | copyright=122 kept=336 language=8 pii=474 profanity=67 schema=12 | duplicate=0/0/0 schema=1019/1011/8 normalize=1011/1011/0 length=1011/1007/4 pii=1007/533/474 profanity=533/466/67 copyright=466/344/122 language=344/336/8',
    'code/humaneval_cpp.jsonl.gz|general':
        'f7c6a161dc55613f | kept=161 language=3 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 language=164/161/3',
    'code/humaneval_cpp.jsonl.gz|short':
        'f7c6a161dc55613f | kept=161 language=3 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 language=164/161/3',
    'code/humaneval_go.jsonl.gz|general':
        'bfc565f1f216fc92 | kept=158 language=6 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 language=164/158/6',
    'code/humaneval_go.jsonl.gz|short':
        'bfc565f1f216fc92 | kept=158 language=6 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 language=164/158/6',
    'code/humaneval_java.jsonl.gz|general':
        '9510df93bbcc0465 | kept=163 language=1 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 language=164/163/1',
    'code/humaneval_java.jsonl.gz|short':
        '9510df93bbcc0465 | kept=163 language=1 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 language=164/163/1',
    'code/humaneval_js.jsonl.gz|general':
        '7d02668745cccabd | kept=162 language=2 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 language=164/162/2',
    'code/humaneval_js.jsonl.gz|short':
        '7d02668745cccabd | kept=162 language=2 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 language=164/162/2',
    'code/humaneval_python.jsonl.gz|general':
        'fe67db191a398afe | kept=163 language=1 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 language=164/163/1',
    'code/humaneval_python.jsonl.gz|short':
        'fe67db191a398afe | kept=163 language=1 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 language=164/163/1',
    'code/humaneval_rust.jsonl.gz|general':
        '14b0bd045a7d078d | kept=157 language=3 schema=4 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/160/4 pii=160/160/0 profanity=160/160/0 copyright=160/160/0 language=160/157/3',
    'code/humaneval_rust.jsonl.gz|short':
        '0f1e8408d16d5e4e | kept=161 language=3 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 language=164/161/3',
    'medical/pubmedqa_abstracts.jsonl|medical':
        '6450716d90bad836 | domain=72 kept=928 | duplicate=0/0/0 schema=1000/1000/0 normalize=1000/1000/0 length=1000/1000/0 pii=1000/1000/0 profanity=1000/1000/0 copyright=1000/1000/0 domain=1000/928/72',
    'web/c4_en_train00000_first1000.jsonl|medical':
        '7f6228e8658f19e1 | copyright=12 domain=936 kept=27 pii=19 schema=6 | duplicate=0/0/0 schema=1000/1000/0 normalize=1000/1000/0 length=1000/994/6 pii=994/975/19 profanity=975/975/0 copyright=975/963/12 domain=963/27/936',
    'synthetic/perturbed_c4|medical':
        '742c9f402a4dd94a | copyright=122 domain=331 kept=13 pii=473 profanity=66 schema=14 | duplicate=0/0/0 schema=1019/1011/8 normalize=1011/1011/0 length=1011/1005/6 pii=1005/532/473 profanity=532/466/66 copyright=466/344/122 domain=344/13/331',
    'code/humaneval_cpp.jsonl.gz|code':
        '2244e9b6d4ad9492 | domain=3 kept=161 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 domain=164/161/3',
    'code/humaneval_go.jsonl.gz|code':
        '39fc6d9341abde25 | domain=7 kept=157 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 domain=164/157/7',
    'code/humaneval_java.jsonl.gz|code':
        'aed2178cf8d33b0b | kept=164 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 domain=164/164/0',
    'code/humaneval_js.jsonl.gz|code':
        'e579a6e604190011 | kept=164 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 domain=164/164/0',
    'code/humaneval_python.jsonl.gz|code':
        'e1ab95dfbf4ef7d0 | kept=164 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/164/0 pii=164/164/0 profanity=164/164/0 copyright=164/164/0 domain=164/164/0',
    'code/humaneval_rust.jsonl.gz|code':
        '9a0083e894ebabb8 | domain=2 kept=158 schema=4 | duplicate=0/0/0 schema=164/164/0 normalize=164/164/0 length=164/160/4 pii=160/160/0 profanity=160/160/0 copyright=160/160/0 domain=160/158/2',
    'web/c4_en_train00000_first1000.jsonl|code':
        '3da70db690985504 | copyright=12 domain=963 pii=19 schema=6 | duplicate=0/0/0 schema=1000/1000/0 normalize=1000/1000/0 length=1000/994/6 pii=994/975/19 profanity=975/975/0 copyright=975/963/12 domain=963/0/963',
    # round 40: the record of 150 NBSPs, which code normalisation keeps, is "empty after normalisation" (schema), no
    # longer judged as code (domain, score 0.25): a text of blank and format characters alone is empty
    'synthetic/perturbed_c4|code':
        '7164a7d50061c479 | copyright=122 domain=344 pii=472 profanity=67 schema=14 | duplicate=0/0/0 schema=1019/1011/8 normalize=1011/1011/0 length=1011/1005/6 pii=1005/533/472 profanity=533/466/67 copyright=466/344/122 domain=344/0/344',
    'multilingual/lingua|cascade':
        'a77bde4504bfa6ce | kept=52 language=2471 pii=5 profanity=1 | duplicate=0/0/0 schema=2529/2529/0 normalize=2529/2529/0 length=2529/2529/0 pii=2529/2524/5 profanity=2524/2523/1 copyright=2523/2523/0 language=2523/52/2471',
    'multilingual/lingua|langdetect':
        '1e92104e528f8b9a | kept=12 language=599 | duplicate=0/0/0 schema=611/611/0 normalize=611/611/0 length=611/611/0 pii=611/611/0 profanity=611/611/0 copyright=611/611/0 language=611/12/599',
    'web/c4_en_train00000_first1000.jsonl|cascade':
        'b736fee0c22fbedf | kept=140 language=1 pii=2 | duplicate=0/0/0 schema=143/143/0 normalize=143/143/0 length=143/143/0 pii=143/141/2 profanity=141/141/0 copyright=141/141/0 language=141/140/1',
    'web/c4_en_train00000_first1000.jsonl|langdetect':
        '0eaff63636c3c002 | copyright=1 kept=32 pii=2 | duplicate=0/0/0 schema=35/35/0 normalize=35/35/0 length=35/35/0 pii=35/33/2 profanity=33/33/0 copyright=33/32/1 language=32/32/0',
    'synthetic/perturbed_c4|cascade':
        '840bc3c6c1afd0e7 | copyright=19 kept=54 language=2 pii=62 profanity=7 schema=2 | duplicate=0/0/0 schema=146/144/2 normalize=144/144/0 length=144/144/0 pii=144/82/62 profanity=82/75/7 copyright=75/56/19 language=56/54/2',
    'synthetic/perturbed_c4|langdetect':
        '07f51b6b8988316c | copyright=3 kept=15 language=1 pii=16 profanity=1 | duplicate=0/0/0 schema=36/36/0 normalize=36/36/0 length=36/36/0 pii=36/20/16 profanity=20/19/1 copyright=19/16/3 language=16/15/1',
    'multilingual/lingua|de':
        '28ad22b76443ba38 | copyright=1 kept=293 language=17386 pii=18 profanity=2 | duplicate=0/0/0 schema=17700/17700/0 normalize=17700/17700/0 length=17700/17700/0 pii=17700/17682/18 profanity=17682/17680/2 copyright=17680/17679/1 language=17679/293/17386',
    'synthetic/perturbed_c4|strict':
        'd02bdd2b4ff33e65 | copyright=36 kept=143 language=5 pii=645 profanity=176 schema=14 | duplicate=0/0/0 schema=1019/1011/8 normalize=1011/1011/0 length=1011/1005/6 pii=1005/360/645 profanity=360/184/176 copyright=184/148/36 language=148/143/5',
}


@pytest.mark.slow
def test_the_chain_judges_c4_as_the_issues_baseline_did_and_faster(shared_data: Path) -> None:
    """`bench_quality.py --against 50a34e7` (issue 27's baseline chain, imported beside this one from git history):
    both keep the same C4 docs with the same failed_check, but for the docs whose verdicts the gates changed on
    purpose (round 47: doc 92's phones +60-6-2881100 and +60-6-2813366, international with a 7-digit group, are
    found: pii 0.0168 > 0.01), and this chain takes less CPU time."""
    import subprocess

    if subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", "50a34e7^{commit}"], capture_output=True).returncode:
        pytest.skip("50a34e7 (issue 27's baseline) is not in this checkout's git history (a shallow clone?)")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_quality.py"), "--data", str(shared_data),
                           "--against", "50a34e7", "--rounds", "2", "--differ-ok", "92"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    rounds = [line.split("|") for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rounds) == 2 and all(float(r[2]) < float(r[3]) for r in rounds), proc.stdout  # µs/doc: ours, theirs
    assert "same keep and failed_check on every doc but [92] (--differ-ok)" in proc.stdout


@pytest.mark.slow
def test_the_chain_against_its_own_revision_judges_alike(shared_data: Path) -> None:
    """`--against HEAD` imports a second copy of this very chain: both keep the same docs with the same
    failed_check. Regression: both copies registered their codec error handlers under one name, so one copy's
    Latin-1 standin handler raised its own exception class in the other's encode (an internal error on 103 of the
    1 000 docs)."""
    import subprocess

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_quality.py"), "--data", str(shared_data),
                           "--against", "HEAD", "--rounds", "1"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    assert "same keep and failed_check on every doc" in proc.stdout
