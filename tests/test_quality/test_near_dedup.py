"""Near-duplicate removal (quality.near_dedup): signatures, the band index, config validation, and the
ingest writer's decisions — deterministic, worker-count independent and crash-safe (kill -9 + resume)."""
from __future__ import annotations

import asyncio
import json
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import orjson
import pytest
import yaml

from helpers import base_config, ingest_killing_a_holder, tree_hashes
from quality import QualityConfigError, QualityControl, load_quality_settings, validate_quality_config
from quality import near_dedup
from quality.near_dedup import NearDupIndex, Signer, band_hashes
from streamprep import run_from_dict
from streamprep.checkpoints import DatasetFiles
from streamprep.config import load
from streamprep.ingest import IngestContext, ingest_all

NEAR_CFG = {"enabled": True, "threshold": 0.8, "ngram": 5, "bands": 14, "rows": 8, "seed": 1}
NEAR = load_quality_settings({"near_dedup": NEAR_CFG}).near_dedup


def _c4(shared: Path, n: int) -> list[str]:
    lines = (shared / "web" / "c4_en_train00000_first1000.jsonl").read_bytes().splitlines()
    return [orjson.loads(x)["text"] for x in lines if len(orjson.loads(x)["text"]) > 600][:n]


def _edit(text: str, rate: float, rng: random.Random) -> str:
    """Replace a `rate` share of the words with a word that is not in the text."""
    words = text.split()
    for i in rng.sample(range(len(words)), max(1, round(rate * len(words)))):
        words[i] = f"zq{rng.randrange(10**6)}"
    return " ".join(words)


def _corpus(shared: Path, n: int = 60) -> tuple[list[str], dict[int, int]]:
    """`n` distinct C4 texts, plus after each of the first 20 a 1 %-edited copy; {copy position: original}."""
    rng = random.Random(5)
    texts, twins = [], {}
    for i, t in enumerate(_c4(shared, n)):
        texts.append(t)
        if i < 20:
            twins[len(texts)] = len(texts) - 1
            texts.append(_edit(t, 0.01, rng))
    return texts, twins


# ---- signatures and the index ------------------------------------------------------------------
def test_signatures_are_deterministic_and_text_only(shared_data: Path) -> None:
    texts = _c4(shared_data, 20)
    signer = Signer(NEAR)
    a = signer.signatures(texts)
    b = [signer.signatures([t])[0] for t in reversed(texts)][::-1]  # batch composition does not matter
    assert a == b and all(len(s) == 112 * 4 for s in a)
    assert signer.signatures(["", "  !!! ...", "two words"])[:2] == [None, None]
    assert signer.signatures(["Two words"]) == signer.signatures(["two, words!"])  # case and punctuation
    assert Signer(replace(NEAR, seed=2)).signatures(texts[:1]) != a[:1]


def test_the_signature_is_of_the_normalised_text_whatever_normalize_keeps(shared_data: Path) -> None:
    """Regression: with `normalize: false` the kept raw text was signed, so a copy of a kept document written with
    NBSPs or ideographic spaces for its spaces was one long word, J ~ 0: kept, a near-duplicate that `normalize:
    true` rejects. `normalize` decides which text is kept, not which records near-dedup finds (as for the digest)."""
    text = _c4(shared_data, 1)[0]
    spaced = [text, text.replace(" ", "\u00a0"), text.replace(" ", "\u3000")]
    sig = {flag: [v.signature for v in QualityControl({"near_dedup": {"enabled": True}, "normalize": flag,
                                                      "expected_language": None}).evaluate_batch(
        [{"text": t} for t in spaced])] for flag in (True, False)}
    assert sig[False] == sig[True] and sig[True][0] is not None and len(set(sig[True])) == 1


def _jaccard(a: bytes, b: bytes) -> float:
    return float(np.mean(np.frombuffer(a, "<u4") == np.frombuffer(b, "<u4")))


def test_estimated_jaccard_follows_edit_rate(shared_data: Path) -> None:
    """5-gram Jaccard after substituting a share p of words is about (1-p)^5 / (2 - (1-p)^5)."""
    rng = random.Random(1)
    texts = _c4(shared_data, 30)
    signer = Signer(NEAR)
    for rate in (0.01, 0.1):
        pairs = signer.signatures(texts + [_edit(t, rate, rng) for t in texts])
        est = np.mean([_jaccard(pairs[i], pairs[i + len(texts)]) for i in range(len(texts))])
        keep = (1 - rate) ** 5
        assert abs(est - keep / (2 - keep)) < 0.06, (rate, est)


def test_a_near_copy_in_a_script_written_without_spaces_is_found(shared_data: Path) -> None:
    """Regression: words were split at white space only, so a page of Chinese, Japanese or Thai sentences was a few
    "words" (a Japanese one, one), and a copy with 1 % of its characters changed shared no n-gram with it: estimated
    Jaccard 0, kept. Each letter of those scripts is a word now; spaced text is split as before."""
    rows = [orjson.loads(x) for x in (shared_data / "multilingual" / "lingua_sentences_75langs.jsonl").read_bytes()
            .splitlines()]
    signer, rng = Signer(NEAR), random.Random(1)
    for lang in ("zh", "ja", "th"):
        page = "".join([r["text"] for r in rows if r["lang"] == lang][:40])
        chars = list(page)
        for i in rng.sample(range(len(chars)), len(chars) // 100):
            chars[i] = "X"
        a, b = signer.signatures([page, "".join(chars)])
        assert _jaccard(a, b) >= NEAR.threshold, lang
    assert near_dedup.words("東京は首都。Tokyo's 2 cafés, 한국어") == \
        [c.encode() for c in "東京は首都"] + [b"\xe3\x80\x82tokyo", b"s", b"2", "cafés".encode(), "한국어".encode()]
    spaced = [t for t in _c4(shared_data, 300) if not near_dedup._UNSPACED.search(t)]  # split as before
    assert [near_dedup.words(t) for t in spaced] == [t.lower().encode().translate(near_dedup._PUNCT).split()
                                                     for t in spaced]


def _decide(index: NearDupIndex, sigs: list[bytes | None], batch: int) -> list[tuple[int, float] | None]:
    """Run the writer's protocol over `sigs` in batches; every document is kept unless it has a twin."""
    out: list = []
    for start in range(0, len(sigs), batch):
        index.prepare(sigs[start:start + batch])
        for pos in range(start, min(start + batch, len(sigs))):
            twin = index.next_twin()
            out.append(tuple(twin) if twin else None)
            if twin is None:
                index.add(pos)
        data = index.take_log()
        with open(index.path, "ab") as fh:
            fh.write(data)
    return out


def test_index_finds_twins_in_source_order_and_rebuilds_equal(shared_data: Path, tmp_path: Path) -> None:
    texts, twins = _corpus(shared_data)
    sigs = Signer(NEAR).signatures(texts)
    decisions = {}
    for batch in (1, 8, len(texts)):
        index = NearDupIndex(NEAR, tmp_path / f"b{batch}.near")
        decisions[batch] = _decide(index, sigs, batch)
        rebuilt = NearDupIndex(NEAR, index.path)
        rebuilt.load()
        assert len(rebuilt) == len(index) == len(texts) - len(twins)
        assert index.path.stat().st_size == len(rebuilt) * (8 + 112 * 4)
        assert rebuilt.nbytes() == index.nbytes() == 14 * 8 * len(rebuilt)  # 112 B/doc of in-memory index
        live = np.sort(np.concatenate(index.levels, axis=1), axis=1)
        assert np.array_equal(live, rebuilt.levels[0])  # the same keys, however they were merged
        assert len(index.levels) <= 4
    assert decisions[1] == decisions[8] == decisions[len(texts)]
    found = {pos: d for pos, d in enumerate(decisions[1]) if d is not None}
    assert set(found) == set(twins)
    assert all(found[pos][0] == twins[pos] and found[pos][1] >= 0.8 for pos in found)


def test_a_twin_earlier_in_the_batch_is_found_past_documents_not_kept(shared_data: Path, tmp_path: Path) -> None:
    """In one batch, a document finds its kept twin however many documents sharing its bands came between, kept
    or not (another gate rejected them): the same twins as with batches of one document, where every earlier
    one is in the sorted levels."""
    rng = random.Random(8)
    base = _c4(shared_data, 3)
    texts = [base[0], base[0], _edit(base[0], 0.01, rng), base[1], _edit(base[0], 0.01, rng),
             _edit(base[1], 0.01, rng), base[2]]
    skipped = {1, 3}  # rejected by another gate (1: as an exact copy, sharing every band): not entered
    sigs = Signer(NEAR).signatures(texts)
    found = {}
    for batch in (1, len(texts)):
        index, out = NearDupIndex(NEAR, tmp_path / f"b{batch}.near"), []
        with open(index.path, "ab") as fh:
            for start in range(0, len(sigs), batch):
                index.prepare(sigs[start:start + batch])
                for pos in range(start, min(start + batch, len(sigs))):
                    twin = index.next_twin()
                    out.append(None if twin is None else twin.source_index)
                    if twin is None and pos not in skipped:
                        index.add(pos)
                fh.write(index.take_log())
                fh.flush()  # read back by the next batch's lookups
        found[batch] = out
    assert found[1] == found[len(texts)] == [None, 0, 0, None, 0, None, None]


def test_rebuilt_index_decides_like_the_live_one(shared_data: Path, tmp_path: Path) -> None:
    """Resume semantics: the first half through a live index, the rest through one rebuilt from its log."""
    texts, _ = _corpus(shared_data)
    copies = texts[::3]
    texts = texts + copies  # exact copies of earlier documents in the second half
    sigs = Signer(NEAR).signatures(texts)
    whole = _decide(NearDupIndex(NEAR, tmp_path / "whole.near"), sigs, 16)
    first = NearDupIndex(NEAR, tmp_path / "split.near")
    head = _decide(first, sigs[:48], 16)
    again = NearDupIndex(NEAR, first.path)
    again.load()
    tail = _decide(_Offset(again, 48), sigs[48:], 16)
    assert head + tail == whole
    assert sum(d is not None for d in tail) >= len(copies)


class _Offset:
    """Adds an offset to the positions `_decide` passes as source indices (the resumed half)."""

    def __init__(self, index: NearDupIndex, offset: int):
        self.index, self.offset, self.path = index, offset, index.path

    def prepare(self, sigs):
        self.index.prepare(sigs)

    def next_twin(self):
        return self.index.next_twin()

    def add(self, pos: int) -> None:
        self.index.add(pos + self.offset)

    def take_log(self) -> bytes:
        return self.index.take_log()


@pytest.mark.parametrize("batch", [1, 3])
def test_of_equal_estimates_the_earliest_twin_is_named(tmp_path: Path, batch: int) -> None:
    """Regression: each estimate was compared with the best one's rounded value, so of two kept documents with the
    same estimate 95/112 (0.848214..., rounded down to 0.8482) the later was named, against the docs' "earliest on
    ties". A and B each differ from Q in 17 values (A in bands 0-2, B in bands 3-5: they are no twins of each other,
    95 - 17 = 78 equal values), so Q shares bands 6-13 with both."""
    rng = np.random.default_rng(3)
    q = rng.integers(0, 2**32, 112, dtype=np.uint32)
    a, b = q.copy(), q.copy()
    a[:17] ^= np.uint32(1)
    b[24:41] ^= np.uint32(1)
    index = NearDupIndex(NEAR, tmp_path / "x.near")
    assert _decide(index, [a.tobytes(), b.tobytes(), q.tobytes()], batch) == [None, None, (0, 0.8482)]
    index.close()


def test_band_hashes_spread_bands_apart() -> None:
    sig = np.zeros((1, 112), np.uint32)  # identical rows in every band still give distinct band keys
    assert len(set(band_hashes(sig, 14, 8)[0].tolist())) == 14


# ---- config ------------------------------------------------------------------------------------
def test_a_seed_or_ngram_past_64_bits_is_a_config_error_not_a_crash_of_the_signer() -> None:
    """Regression: `near_dedup.seed: 2**64` and `ngram: 2**63` were taken, and every `evaluate_batch` then raised
    OverflowError (rensa's u64 seed, the signer's int64 counts), where evaluate never raises; the largest that work
    are taken."""
    for sub, key, hi in [({"seed": 2**64}, "near_dedup.seed", 2**64 - 1), ({"ngram": 2**63}, "near_dedup.ngram",
                                                                          2**63 - 1)]:
        with pytest.raises(QualityConfigError, match=rf"^{key}: must be an integer in \[\d, {hi}\], got "):
            QualityControl({"near_dedup": {"enabled": True, **sub}})
    text = {"text": "a few words of a text to sign, more than five of them"}
    for sub in ({"seed": 2**64 - 1}, {"ngram": 2**63 - 1}):
        qc = QualityControl({"expected_language": None, "min_chars": 0, "near_dedup": {"enabled": True, **sub}})
        assert qc.evaluate_batch([text])[0].signature is not None


def test_default_is_off_and_validation_names_the_key() -> None:
    cfg = validate_quality_config({})
    assert cfg["near_dedup"]["enabled"] is False and cfg["near_dedup"]["num_perm"] == 112
    assert validate_quality_config(cfg) == cfg
    assert validate_quality_config({"near_dedup": {"bands": 20, "rows": 5}})["near_dedup"]["num_perm"] == 100
    assert QualityControl({}).signer is None
    bad = [({"threshold": 0}, "near_dedup.threshold"), ({"threshold": float("nan")}, "near_dedup.threshold"),
           ({"threshold": 1.5}, "near_dedup.threshold"), ({"bands": 0}, "near_dedup.bands"),
           ({"rows": 2.5}, "near_dedup.rows"), ({"num_perm": 100}, "near_dedup.num_perm"),
           ({"enabled": "yes"}, "near_dedup.enabled"), ({"band": 3}, "near_dedup.band"),
           ({"bands": 200, "rows": 8}, "near_dedup.bands")]
    for sub, key in bad:
        with pytest.raises(QualityConfigError) as exc:
            validate_quality_config({"near_dedup": sub})
        assert exc.value.key == key, sub
    with pytest.raises(QualityConfigError) as exc:
        validate_quality_config({"near_dedup": True})
    assert exc.value.key == "near_dedup"
    # regressions: num_perm 112.0 and true (bands = rows = 1) were taken where every other count refuses them; and
    # threshold 1.5 said "in [0, 1]", then 0 "> 0"
    for num_perm in (112.0, True):
        with pytest.raises(QualityConfigError, match=r"^near_dedup\.num_perm: must be an integer >= 1, got "):
            validate_quality_config({"near_dedup": {"bands": 1, "rows": 1, "num_perm": num_perm}})
    for threshold in (0, 1.5):
        with pytest.raises(QualityConfigError, match=r"^near_dedup\.threshold: must be a number in \(0, 1\], got "):
            validate_quality_config({"near_dedup": {"threshold": threshold}})


# ---- ingest ------------------------------------------------------------------------------------
def _dataset(tmp: Path, texts: list[str], name: str = "web") -> dict:
    path = tmp / f"{name}.jsonl"
    path.write_text("".join(json.dumps({"text": t, "id": f"d{i}"}) + "\n" for i, t in enumerate(texts)))
    return {"name": name, "path": str(path)}


def _cfg(tmp: Path, texts: list[str], workers: int = 1, **execution) -> dict:
    cfg = base_config([_dataset(tmp, texts)], None, output={"shard_records": 25})
    cfg["quality"] = {"expected_language": None, "min_chars": 20, "near_dedup": NEAR_CFG}
    cfg["execution"].update(workers=workers, batch_records=16, **execution)
    return cfg


def _lines(path: Path) -> list[dict]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines()]


@pytest.mark.slow
def test_ingest_rejects_near_duplicates_naming_the_kept_twin(shared_data: Path, tmp_path: Path) -> None:
    texts, twins = _corpus(shared_data)
    texts.append(texts[0])  # an exact copy stays an exact-duplicate reject
    one, two = tmp_path / "w1", tmp_path / "w2"
    run_from_dict(_cfg(tmp_path, texts, 1), run_dir=one, console_log=False)
    run_from_dict(_cfg(tmp_path, texts, 2), run_dir=two, console_log=False)
    compared = ("ingest", "rejects", "checkpoints")
    h1, h2 = tree_hashes(one, *compared), tree_hashes(two, *compared)
    assert {k: v for k, v in h1.items() if k.endswith((".jsonl", ".near", ".dedup"))} == \
        {k: v for k, v in h2.items() if k.endswith((".jsonl", ".near", ".dedup"))}

    rejects = _lines(one / "rejects" / "web.jsonl")
    near = {r["source"]["index"]: r for r in rejects if r["failed_check"] == "near_duplicate"}
    assert set(near) == set(twins)
    for pos, r in near.items():
        assert r["meta"]["near_duplicate_of"] == {"dataset": "web", "index": twins[pos]}
        assert 0.8 <= r["meta"]["jaccard"] <= 1.0 and "estimated Jaccard" in r["reason"]
    assert [r["source"]["index"] for r in rejects if r["failed_check"] == "duplicate"] == [len(texts) - 1]
    kept = [x for p in sorted((one / "ingest" / "web").glob("part-*.jsonl")) for x in _lines(p)]
    rejected = {r["source"]["index"] for r in rejects}  # the sample holds every reject here
    assert [k["meta"]["source"]["index"] for k in kept] == [i for i in range(len(texts)) if i not in rejected]
    assert not any({"jaccard", "near_duplicate_of", "signature"} & set(k["meta"]) for k in kept)
    ck = json.loads((one / "checkpoints" / "web.json").read_text())
    assert ck["near_dedup_bytes"] == len(kept) * (8 + 112 * 4) == (one / "checkpoints" / "web.near").stat().st_size
    audit = json.loads((one / "audit" / "audit.json").read_text())
    dups = audit["datasets"]["web"]["duplicates"]
    assert dups["rejected_as_duplicate"] == 1 and dups["rejected_as_near_duplicate"] == len(twins)
    pair = dups["near_duplicate_examples"][0]
    assert pair["twin"]["text"] == texts[twins[pair["index"]]][:len(pair["twin"]["text"])]


@pytest.mark.slow
@pytest.mark.parametrize("case", ["log_longer", "log_shorter", "part_shorter"])
def test_near_log_repair_resumes_to_identical_outputs(shared_data: Path, tmp_path: Path, case: str) -> None:
    """A longer log is truncated, a shorter one or a damaged sealed part restarts the dataset."""
    texts, _ = _corpus(shared_data)
    cfg = _cfg(tmp_path, texts)  # 25 records per part, batches of 16: parts roll mid-batch
    ref = tmp_path / "ref"
    run_from_dict(cfg, run_dir=ref, console_log=False)
    run_dir = tmp_path / case
    run_from_dict(cfg, run_dir=run_dir, console_log=False)
    files = DatasetFiles(run_dir, run_dir / "checkpoints", "web")
    ck = json.loads(files.checkpoint.read_text())
    assert ck["near_dedup_bytes"] == ck["kept"] * 456
    data = files.near_dedup.read_bytes()
    if case == "log_longer":
        files.near_dedup.write_bytes(data + b"\x01" * 460)
    elif case == "log_shorter":
        files.near_dedup.write_bytes(data[:-10])
    else:
        part = files.part(ck["part_index"] - 1)
        part.write_bytes(part.read_bytes()[:100])
    (run_dir / "run.json").write_text((run_dir / "run.json").read_text().replace('"complete"', '"interrupted"'))
    files.checkpoint.write_text(files.checkpoint.read_text().replace('"done":true', '"done":false'))
    run_from_dict(cfg, run_dir=run_dir, console_log=False)
    assert tree_hashes(run_dir, "ingest", "rejects") == tree_hashes(ref, "ingest", "rejects")
    assert files.near_dedup.read_bytes() == data == (ref / "checkpoints" / "web.near").read_bytes()


def _kill_after_checkpoints(cfg: dict, tmp_path: Path, dataset: str, rng: random.Random,
                            max_delay: float) -> tuple[Path, list[str], list[int]]:
    """Five CLI runs of `cfg` into TMP/killed, each SIGKILLed a random moment (up to `max_delay` s) after
    `dataset`'s checkpoint moved on; returns the run dir, the command (to finish the run with) and the records
    consumed per the checkpoint just before each kill."""
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path), "--run-dir", str(run_dir)]
    ckpt = run_dir / "checkpoints" / f"{dataset}.json"
    killed_at: list[int] = []
    for _ in range(5):
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        start = json.loads(ckpt.read_text())["consumed"] if ckpt.exists() else 0
        while proc.poll() is None and (not ckpt.exists() or json.loads(ckpt.read_text())["consumed"] <= start):
            time.sleep(0.005)
        time.sleep(rng.uniform(0, max_delay))
        state = json.loads(ckpt.read_text())
        if proc.poll() is None and not state["done"]:
            proc.send_signal(signal.SIGKILL)
            killed_at.append(state["consumed"])
        proc.wait(timeout=120)
    return run_dir, cmd, killed_at


@pytest.mark.slow
def test_kill_9_during_ingest_then_resume_is_byte_identical(shared_data: Path, tmp_path: Path) -> None:
    """SIGKILL the CLI at random moments of ingest, resume each time: outputs and the .near log end
    byte-identical to an uninterrupted run."""
    texts, _ = _corpus(shared_data, 200)
    texts = texts * 3  # later copies are exact duplicates: a longer ingest with many checkpoints
    cfg = _cfg(tmp_path, texts, unit_mb=0.02)  # units of ~20 kB: many checkpoints to kill between
    ref = tmp_path / "ref"
    run_from_dict(cfg, run_dir=ref, console_log=False)
    run_dir, cmd, killed_at = _kill_after_checkpoints(cfg, tmp_path, "web", random.Random(9), 0.05)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(killed_at) >= 3 and len(set(killed_at)) >= 2, killed_at
    compared = ("ingest", "rejects")
    assert tree_hashes(run_dir, *compared) == tree_hashes(ref, *compared)
    near = "checkpoints/web.near"
    assert (run_dir / near).read_bytes() == (ref / near).read_bytes()


def test_rebuild_reads_the_log_in_chunks(shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sigs = Signer(NEAR).signatures(_c4(shared_data, 40))
    index = NearDupIndex(NEAR, tmp_path / "x.near")
    _decide(index, sigs, 40)
    whole = NearDupIndex(NEAR, index.path)
    whole.load()
    monkeypatch.setattr(NearDupIndex, "LOAD_CHUNK", 7)
    chunked = NearDupIndex(NEAR, index.path)
    chunked.load()
    assert len(chunked) == len(whole) == 40 and np.array_equal(chunked.levels[0], whole.levels[0])


# ---- dedup_scope: run --------------------------------------------------------------------------
def _two_datasets(shared: Path, tmp: Path, scope: str, workers: int = 1, copies: int = 1) -> dict:
    """Dataset a: 40 C4 texts. Dataset b: 1 %-edited copies of a's first 20, 20 other C4 texts and a 1 %-edited
    copy of its own first new text (b#20). `copies` repeats each file's texts (later rounds are exact duplicates)
    for a longer ingest."""
    rng = random.Random(3)
    c4 = _c4(shared, 60)
    a = c4[:40]
    b = [_edit(t, 0.01, rng) for t in a[:20]] + c4[40:60] + [_edit(c4[40], 0.01, rng)]
    cfg = base_config([_dataset(tmp, a * copies, "a"), _dataset(tmp, b * copies, "b")], None,
                      output={"shard_records": 25, "max_rejects_per_check": None})
    cfg["quality"] = {"expected_language": None, "min_chars": 20, "pii_max_density": 1.0, "profanity_max_density": 1.0,
                      "reject_copyright": False, "near_dedup": NEAR_CFG, "dedup_scope": scope}  # only dedup rejects
    cfg["execution"].update(workers=workers, batch_records=16, unit_mb=0.01)  # ~10 kB units
    return cfg


def _near_rejects(run: Path, name: str) -> dict[int, tuple[str, int]]:
    """Near-duplicate rejects of dataset `name`: its index -> (the twin's dataset, the twin's index)."""
    return {r["source"]["index"]: (r["meta"]["near_duplicate_of"]["dataset"], r["meta"]["near_duplicate_of"]["index"])
            for r in _lines(run / "rejects" / f"{name}.jsonl") if r["failed_check"] == "near_duplicate"}


@pytest.mark.slow
def test_run_scope_rejects_near_copies_of_an_earlier_dataset(shared_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    run_from_dict(_two_datasets(shared_data, tmp_path, "run"), run_dir=run, console_log=False)
    ck = {n: json.loads((run / "checkpoints" / f"{n}.json").read_text()) for n in "ab"}
    assert [(ck[n]["kept"], ck[n]["rejected"]) for n in "ab"] == [(40, 0), (20, 21)]
    assert _near_rejects(run, "b") == {**{i: ("a", i) for i in range(20)}, 40: ("b", 20)}
    reasons = [r["reason"] for r in _lines(run / "rejects" / "b.jsonl")]
    assert reasons[0].startswith("near duplicate of a#0 (estimated Jaccard ") and \
        reasons[-1].startswith("near duplicate of b#20 (")
    kept_b = [x["meta"]["source"]["index"] for p in sorted((run / "ingest" / "b").glob("part-*.jsonl"))
              for x in _lines(p)]
    assert kept_b == list(range(20, 40))
    assert ck["b"]["stats"]["near_duplicates_kept_by"] == {"a": 20}
    dups = json.loads((run / "audit" / "audit.json").read_text())["datasets"]["b"]["duplicates"]
    assert dups["rejected_as_near_duplicate"] == 21 and dups["near_kept_by"] == {"a": 20, "b": 1}
    pair = next(p for p in dups["near_duplicate_examples"] if p["twin"]["dataset"] == "a")
    a_texts = [x["text"] for x in _lines(run / "ingest" / "a" / "part-00000.jsonl")]
    assert pair["twin"]["text"] == a_texts[pair["twin"]["index"]][:len(pair["twin"]["text"])]
    # per dataset, b's near copies of a are kept; only its own near copy goes
    own = tmp_path / "own"
    run_from_dict(_two_datasets(shared_data, tmp_path, "dataset"), run_dir=own, console_log=False)
    ck = {n: json.loads((own / "checkpoints" / f"{n}.json").read_text()) for n in "ab"}
    assert [(ck[n]["kept"], ck[n]["rejected"]) for n in "ab"] == [(40, 0), (40, 1)]
    assert _near_rejects(own, "b") == {40: ("b", 20)} and "near_duplicates_kept_by" not in ck["b"]["stats"]
    assert "near_kept_by" not in json.loads((own / "audit" / "audit.json").read_text())["datasets"]["b"]["duplicates"]
    # a is unaffected by the scope; with two workers, the run scope writes the same bytes
    assert tree_hashes(own, "ingest/a") == tree_hashes(run, "ingest/a")
    two = tmp_path / "two"
    run_from_dict(_two_datasets(shared_data, tmp_path, "run", workers=2), run_dir=two, console_log=False)
    assert tree_hashes(two, "ingest", "rejects") == tree_hashes(run, "ingest", "rejects")


@pytest.mark.slow
def test_run_scope_kill_9_while_the_later_dataset_decides_resumes_byte_identical(shared_data: Path,
                                                                                 tmp_path: Path) -> None:
    """SIGKILL the CLI while dataset b decides against a's near index (a done, b under way), resume each time:
    the outputs and both .near logs end byte-identical to an uninterrupted run; a resume rebuilds a's index
    from its log."""
    cfg = _two_datasets(shared_data, tmp_path, "run", copies=4)
    ref = tmp_path / "ref"
    run_from_dict(cfg, run_dir=ref, console_log=False)
    ref_b = json.loads((ref / "checkpoints" / "b.json").read_text())
    assert (ref_b["kept"], ref_b["rejected"]) == (20, 41 * 4 - 20)
    run_dir, cmd, killed_at = _kill_after_checkpoints(cfg, tmp_path, "b", random.Random(4), 0.03)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert len(killed_at) >= 3 and len(set(killed_at)) >= 2, killed_at
    assert tree_hashes(run_dir, "ingest", "rejects") == tree_hashes(ref, "ingest", "rejects")
    for n in "ab":
        assert (run_dir / f"checkpoints/{n}.near").read_bytes() == (ref / f"checkpoints/{n}.near").read_bytes()


@pytest.mark.slow
async def test_a_holder_process_keeps_the_near_indexes_and_is_replaced_when_killed(
        shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With two workers the near-dedup indexes live in holder 0's process, which walks the pieces: the job's
    process never builds one. kill -9 of that holder while b decides against a's index: a new one reads both .near
    logs back to their last flush and is sent the walks since, and ingest ends with the bytes and logs of one
    process doing it all."""
    ref = tmp_path / "ref"
    await ingest_all(IngestContext.of(load(_two_datasets(shared_data, tmp_path, "run", copies=4)), ref,
                                      ref / "checkpoints", asyncio.Event()))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a NearDupIndex was built in the job's process")

    monkeypatch.setattr(near_dedup.NearDupIndex, "__init__", refuse)
    raw = _two_datasets(shared_data, tmp_path, "run", workers=2, copies=4)
    raw["execution"]["dedup_holders"] = 2
    run = tmp_path / "run"
    assert await ingest_killing_a_holder(load(raw), run, "b", 40, holder=0) == 1
    assert tree_hashes(run, "ingest", "rejects") == tree_hashes(ref, "ingest", "rejects")
    for n in "ab":
        assert (run / f"checkpoints/{n}.near").read_bytes() == (ref / f"checkpoints/{n}.near").read_bytes()


def test_a_twin_just_past_the_threshold_is_not_shown_below_it(tmp_path: Path) -> None:
    """Regression: a twin's estimated Jaccard was rounded to 4 decimals whatever the threshold it reached: 92 of 112
    equal values (0.821428…) past a threshold of 0.82142 read 'estimated Jaccard 0.8214', below it. As the other
    gates' figures on their limit (docs/quality.md), it keeps the decimals that keep it past the threshold."""
    from quality.near_dedup import NearDupIndex, reject_meta
    from quality.settings import NearDedupSettings

    near = NearDedupSettings(enabled=True, threshold=0.82142, ngram=5, bands=28, rows=4, seed=1, num_perm=112)
    index = NearDupIndex(near, tmp_path / "t.near")
    kept = np.arange(112, dtype="<u4")
    alike = kept.copy()
    alike[92:] += 1000  # 92 of 112 equal: the first 23 bands equal, so a candidate
    index.prepare([kept.tobytes(), alike.tobytes()])
    assert index.next_twin() is None
    index.add(7)
    twin = index.next_twin()
    assert twin is not None and twin.source_index == 7 and twin.jaccard == 0.82143
    assert reject_meta({}, "d", twin)["reason"] == "near duplicate of d#7 (estimated Jaccard 0.82143)"
