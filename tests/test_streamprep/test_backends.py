"""Tokenizer backends (streamprep/backends.py): gigatoken gives HF's ids on every shared tokenizer and corpus,
`auto` falls back to HF when gigatoken cannot load or disagrees, shards are byte-identical under both, and
gigatoken's caches stay within the memory budget."""
from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
from tokenizers import ByteLevelBPETokenizer, Tokenizer, models, pre_tokenizers, trainers

from helpers import REPO, PHI2, base_config, tree_hashes
from streamprep import backends, binidx, run_from_dict
from streamprep.config import ConfigError, config_hash, validate
from streamprep.layout import RunLayout
from streamprep.tokenize import make_task, tokenize_part
from streamprep.tokenizer import train_bpe

def _probes(tok: Path) -> int:
    """How many texts the run's identity check encodes for tokenizer `tok` before any sampled text."""
    return len(backends.PROBES) + len(backends.added_token_probes(Tokenizer.from_file(str(tok))))


PER_FILE_CHARS = 150_000  # of each shared corpus file: every corpus is covered, HF's side stays a few seconds


def _strings(obj: Any, out: list[str]) -> None:
    """Every non-empty string value of a JSON document (texts, titles, code, chat turns)."""
    if isinstance(obj, str):
        if obj:
            out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _strings(v, out)
    elif isinstance(obj, list):
        for v in obj:
            _strings(v, out)


@pytest.fixture(scope="module")
def corpus_texts(shared_data: Path) -> dict[str, list[str]]:
    """The first PER_FILE_CHARS of strings of every shared corpus file, by corpus (web, medical, ...)."""
    out: dict[str, list[str]] = {}
    for p in sorted(shared_data.rglob("*")):
        corpus = p.relative_to(shared_data).parts[0]
        if not p.is_file() or corpus == "tokenizers" or p.suffix == ".md" or p.name == "manifest.json":
            continue
        raw = (gzip.open(p).read() if p.suffix == ".gz" else p.read_bytes()).decode("utf-8")
        found: list[str] = []
        if p.suffix == ".txt":
            found = [raw[i:i + 4000] for i in range(0, min(len(raw), PER_FILE_CHARS), 4000)]
        elif ".jsonl" in p.name:
            for line in raw.split("\n"):
                if line.strip() and sum(map(len, found)) < PER_FILE_CHARS:
                    _strings(orjson.loads(line), found)
        else:
            _strings(orjson.loads(raw), found)
        taken, n = [], 0
        for t in found:
            if n >= PER_FILE_CHARS:
                break
            taken.append(t)
            n += len(t)
        out.setdefault(corpus, []).extend(taken)
    assert set(out) >= {"web", "medical", "code", "multilingual", "chat"}
    return out


@pytest.fixture(scope="module")
def tokenizer_files(shared_data: Path, corpus_texts: dict[str, list[str]],
                    tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every tokenizer in shared/data/tokenizers as a tokenizer.json (gpt2's vocab+merges converted by
    `tokenizers`), and a BPE trained by streamprep's own trainer on the corpora."""
    d = tmp_path_factory.mktemp("toks")
    gpt2 = ByteLevelBPETokenizer(str(shared_data / "tokenizers/gpt2/vocab.json"),
                                 str(shared_data / "tokenizers/gpt2/merges.txt"))
    gpt2.add_special_tokens(["<|endoftext|>"])
    gpt2.save(str(d / "gpt2.json"))
    sample = [t for texts in corpus_texts.values() for t in texts[::3]]
    train_bpe(sample, 3000, 2).save(str(d / "trained.json"))
    return {"gpt2": d / "gpt2.json", "phi-2": shared_data / PHI2,
            "phi-3-mini": shared_data / "tokenizers/phi-3-mini/tokenizer.json", "trained-bpe": d / "trained.json"}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "phi-2", "phi-3-mini", "trained-bpe"])
def test_gigatoken_ids_equal_hf_on_every_corpus(name: str, tokenizer_files: dict[str, Path],
                                                corpus_texts: dict[str, list[str]]) -> None:
    path = tokenizer_files[name]
    hf, giga = backends.HFBackend(path), backends.GigatokenBackend(path)
    assert giga.vocab_size == hf.vocab_size
    for corpus, texts in corpus_texts.items():
        texts = [*backends.PROBES, *texts]
        h_flat, h_len = hf.encode_batch(texts)
        g_flat, g_len = giga.encode_batch(texts)
        e_flat, e_len = giga.encode_each(texts)  # the run check's route: the same ids
        assert np.array_equal(e_len, g_len) and np.array_equal(e_flat, g_flat) and e_flat.dtype == np.uint32
        assert h_flat.dtype == g_flat.dtype == np.uint32 and h_len.dtype == g_len.dtype == np.int64
        assert np.array_equal(h_len, g_len), (name, corpus)
        assert np.array_equal(h_flat, g_flat), (name, corpus)
        # and equal to HF's own per-document encode (the reference itself is not mangled by the flattening)
        ref = Tokenizer.from_file(str(path))
        assert h_flat[:h_len[: 50].sum()].tolist() == [i for t in texts[:50]
                                                       for i in ref.encode(t, add_special_tokens=False).ids]
    assert backends.select("auto", path, corpus_texts["web"])["name"] == "gigatoken"


def _unloadable(tmp_path: Path) -> Path:
    """A WordLevel tokenizer: HF encodes it, gigatoken (BPE only) refuses to load it."""
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["the cat sat on the mat", "a dog ate the cat food"] * 5,
                            trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"], show_progress=False))
    tok.save(str(tmp_path / "tokenizer.json"))
    return tmp_path / "tokenizer.json"


def test_auto_falls_back_to_hf_when_gigatoken_cannot_load(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _unloadable(tmp_path)
    rec = backends.select("auto", path)
    assert rec["name"] == "hf" and rec["requested"] == "auto" and rec["version"] == backends.installed_version("hf")
    assert "gigatoken cannot load tokenizer.json" in rec["fallback_reason"] and "WordLevel" in rec["fallback_reason"]
    with pytest.raises(backends.BackendError, match="tokenizer.backend is gigatoken but gigatoken cannot load"):
        backends.select("gigatoken", path)
    assert backends.select("hf", path) == {"requested": "hf", "name": "hf", "version": rec["version"]}
    # forced gigatoken on such a tokenizer is a config error (exit 2, nothing written)
    cfg = base_config([{"name": "d", "path": str(tmp_path / "x.jsonl")}], str(path))
    (tmp_path / "x.jsonl").write_text('{"text": "the cat"}\n')
    cfg["tokenizer"].update(backend="gigatoken", eod_token="</s>")
    with pytest.raises(ConfigError, match="^config: 'tokenizer.backend': tokenizer.backend is gigatoken but"):
        validate(cfg, tmp_path)


@pytest.mark.slow
def test_config_key_is_validated_and_left_out_of_the_output_hash(tmp_path: Path, shared_data: Path) -> None:
    (tmp_path / "x.jsonl").write_text('{"text": "hello"}\n')
    cfg = base_config([{"name": "d", "path": str(tmp_path / "x.jsonl")}], str(shared_data / PHI2))
    assert validate(cfg, tmp_path)["tokenizer"]["backend"] == "auto"
    cfg["tokenizer"]["backend"] = "fast"
    with pytest.raises(ConfigError, match=r"^config: 'tokenizer.backend' must be auto, gigatoken or hf, got 'fast'$"):
        validate(cfg, tmp_path)
    hashes = set()
    for b in backends.BACKENDS:
        cfg["tokenizer"]["backend"] = b
        hashes.add(config_hash(validate(cfg, tmp_path)))
    assert len(hashes) == 1  # a run resumed under another backend is no config drift


@pytest.mark.slow
def test_a_mismatch_sends_auto_to_hf_and_stops_forced_gigatoken(tmp_path: Path, shared_data: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A gigatoken that disagrees with HF (simulated: one id off on texts with a combining acute) is caught by the
    run's check and by a worker's check; auto's shard is then written by HF, byte for byte."""
    def off_by_one(method: str) -> Any:
        real = getattr(backends.GigatokenBackend, method)

        def encode(self: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
            flat, lengths = real(self, texts)
            starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
            for i, t in enumerate(texts):
                if "\u0301" in t and lengths[i]:
                    flat = flat.copy()
                    flat[starts[i]] += 1
            return flat, lengths
        return encode

    for method in ("encode_batch", "encode_each"):  # the workers' route and the run check's
        monkeypatch.setattr(backends.GigatokenBackend, method, off_by_one(method))
    tok = shared_data / PHI2
    rec = backends.select("auto", tok)  # a probe holds U+0301
    assert rec["name"] == "hf" and rec["check"] == {"texts": _probes(tok), "identical": False}
    assert "gigatoken ids differ from hf on text" in rec["fallback_reason"]
    with pytest.raises(backends.BackendError):
        backends.select("gigatoken", tok)

    part = tmp_path / "ingest/d/part-00000.jsonl"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in ["plain", "cafe\u0301 au lait", "", "x"]))
    prefixes = {}
    for choice in ("hf", "auto"):
        task = make_task(tmp_path, "d", "train", part, tok, "sha256:x", 50256, "uint16", backend=choice)
        task = task.__class__(**{**task.__dict__, "prefix": str(tmp_path / choice / "p")})
        encoder = backends.ShardEncoder(choice, tok)
        st = tokenize_part(task, encoder)
        assert st["dropped_empty"] == [2] and st["num_documents"] == 3
        prefixes[choice] = task.prefix
        assert encoder.name == "hf"
    for ext in (".bin", ".idx"):
        assert Path(prefixes["hf"] + ext).read_bytes() == Path(prefixes["auto"] + ext).read_bytes()
    fallback = json.loads(RunLayout(tmp_path).tokenizer_backend_fallback.read_text())
    assert fallback["shard"] == "d/part-00000" and "differ" in fallback["reason"]
    task = make_task(tmp_path, "d", "train", part, tok, "sha256:x", 50256, "uint16", backend="gigatoken")
    with pytest.raises(backends.BackendError, match="tokenizer.backend is gigatoken but"):
        tokenize_part(task, backends.ShardEncoder("gigatoken", tok))


# Code points gigatoken 0.10.0 and tokenizers 0.23 split otherwise with phi-2 (a full scan found 4 657, all unassigned
# in Unicode 14.0): CJK Extension J, and single letters of Unicode 16-17 blocks.
NEWER_LETTERS = [0x324DA, 0x32300, 0x3347F, 0x11DDA, 0x18D1A, 0x18D9A, 0x18DDA, 0x1E6DA]


def test_texts_with_letters_newer_than_unicode_14_get_hf_ids_under_gigatoken(shared_data: Path) -> None:
    """gigatoken's regex classes follow a newer Unicode than HF's: a text holding such a letter was written with
    other ids than HF's (`auto`, the default, and `gigatoken`), unseen by the identity check past its sample."""
    tok = shared_data / PHI2
    table = backends._unsure_table()
    spread = np.flatnonzero(table)[::400].tolist()  # ~2 000 of the 830 000 unassigned code points
    texts = [f"x{chr(c)}'s and \u4e2d{chr(c)}\u6587 {chr(c)}1" for c in NEWER_LETTERS + spread]
    texts += ["plain ASCII", "caf\u00e9 \u2019quoted\u2019", ""]
    assert backends.unsure(texts) == list(range(len(NEWER_LETTERS) + len(spread)))
    hf, giga = backends.HFBackend(tok), backends.GigatokenBackend(tok)
    want = hf.encode_batch(texts)
    for got in (giga.encode_batch(texts), giga.encode_each(texts)):
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert giga.hf_texts == 2 * (len(texts) - 3)
    assert backends.unsure(["ascii only", "caf\u00e9", "\u2019"]) == []


# Marks with a canonical combining class in Unicode 14.0 (assigned in 10.0-14.0) that tokenizers 0.23's NFC gives
# none, one of each run of backends.NFC_GAP and its ends
NFC_GAP_MARKS = [0x07FD, 0x0898, 0x089F, 0x08CA, 0x08D3, 0x09FE, 0x0C3C, 0x0D3B, 0x0EBA, 0x1715, 0x1ABF, 0x1ACE,
                 0x1DF6, 0x1DFA, 0xA82C, 0x10D24, 0x10EAB, 0x10F46, 0x10F50, 0x10F82, 0x11070, 0x1133B, 0x1145E,
                 0x11839, 0x1193D, 0x11943, 0x119E0, 0x11A34, 0x11A47, 0x11A99, 0x11D42, 0x11D45, 0x11D97, 0x16FF0,
                 0x1E130, 0x1E2AE, 0x1E2EF]


def test_nfc_tokenizer_texts_with_marks_newer_than_hf_tables_get_hf_ids_under_gigatoken(tmp_path: Path,
                                                                                      shared_data: Path) -> None:
    """An NFC tokenizer (Qwen2's normalizer on phi-2): tokenizers' NFC tables are Unicode 9's, so it neither
    reordered marks given a combining class since nor composed U+11935 U+11930; gigatoken did, `auto` and
    `gigatoken` wrote other .bin bytes than `hf` for such a document and the identity check passed."""
    spec = json.loads((shared_data / PHI2).read_text())
    spec["normalizer"] = {"type": "NFC"}
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps(spec))
    texts = ["plain ASCII", "caf\u00e9 e\u0301 \u0628\u0618", "\U00011935\U00011930 \U00011938"]
    for c in map(chr, NFC_GAP_MARKS):
        texts += [f"a{c}\u0334 x", f"\u0628{c}\u0618 y", f"a{c}\u0316\u0301"]
    hf, giga = backends.HFBackend(tok), backends.GigatokenBackend(tok)
    want = hf.encode_batch(texts)
    for got in (giga.encode_batch(texts), giga.encode_each(texts)):
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
    assert backends.unsure(texts) == list(range(2, len(texts)))
    assert backends.select("auto", tok)["name"] == "gigatoken"  # the guard keeps gigatoken for the other texts


def _with_added(tmp_path: Path, shared_data: Path, *tokens: tuple[str, dict], normalizer: dict | None = None) -> Path:
    """phi-2's tokenizer.json with `tokens` (content, flags) added after its own, and `normalizer` if given."""
    spec = json.loads((shared_data / PHI2).read_text())
    if normalizer is not None:
        spec["normalizer"] = normalizer
    for i, (content, flags) in enumerate(tokens):
        spec["added_tokens"].append({"id": 50295 + i, "content": content, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True, **flags})
    tok = tmp_path / "tokenizer.json"
    tok.write_text(json.dumps(spec))
    return tok


@pytest.mark.parametrize("content, flags, text", [
    ("<mask>", {"lstrip": True}, "is  <mask>."),             # RoBERTa's: gigatoken 0.10.0 keeps the space
    ("\n\n", {"rstrip": True}, "ab\n\n\n\n\n\n"),     # whitespace tokens were left out of the probes
    ("\xa0", {"single_word": True, "special": False}, "1\xa0"),
])
def test_an_added_token_that_gigatoken_splits_otherwise_sends_auto_to_hf(tmp_path: Path, shared_data: Path,
                                                                          content: str, flags: dict, text: str) -> None:
    """Added tokens whose lstrip / rstrip / single_word gigatoken applies otherwise: the run's check (PROBES)
    passed, so `auto` wrote other ids than HF's. Probes now put every added token beside spaces, newlines, itself
    and words."""
    tok = _with_added(tmp_path, shared_data, (content, flags))
    hf, giga = backends.HFBackend(tok), backends.GigatokenBackend(tok)
    assert backends.mismatch(hf, giga, [text]) is not None  # the difference the check must see
    rec = backends.select("auto", tok)
    assert rec["name"] == "hf" and "gigatoken ids differ from hf" in rec["fallback_reason"]
    assert backends.select("auto", shared_data / PHI2)["name"] == "gigatoken"  # phi-2's own added tokens agree


NORMALIZED = {"normalized": True, "special": False}


@pytest.mark.parametrize("tokens, text", [
    ((("<xq", NORMALIZED), ("q>", {})), "tag <xq> here 0"),      # the end of one is the start of the other
    ((("img>", {}), ("<img", NORMALIZED)), "see <img> here"),    # three characters of both, listed the other way
])
def test_overlapping_added_tokens_of_both_normalized_flags_send_auto_to_hf(
        tmp_path: Path, shared_data: Path, tokens: tuple[tuple[str, dict], ...], text: str) -> None:
    """HF matches the not-normalized added tokens over the whole text first, then the normalized ones; gigatoken
    0.10.0 takes the leftmost longest of all: "<xq>" was HF "<x" "q>", gigatoken "<xq" ">". No probe put two
    added tokens together, so `auto` picked gigatoken and wrote other .bin bytes than `hf`."""
    tok = _with_added(tmp_path, shared_data, *tokens)
    hf, giga = backends.HFBackend(tok), backends.GigatokenBackend(tok)
    assert backends.mismatch(hf, giga, [text]) is not None  # the difference the check must see
    rec = backends.select("auto", tok)
    assert rec["name"] == "hf" and "gigatoken ids differ from hf" in rec["fallback_reason"]
    with pytest.raises(backends.BackendError, match="tokenizer.backend is gigatoken but gigatoken ids differ"):
        backends.select("gigatoken", tok)


def test_overlap_probes_are_few_and_none_for_the_shared_tokenizers(tmp_path: Path, shared_data: Path) -> None:
    """The overlap probes come only from pairs that overlap, the same ones every time; phi-2 (normalized whitespace
    runs beside a not-normalized <|endoftext|>) and phi-3 get none. More than MAX_OVERLAP_PROBES are not probed:
    `auto` uses HF and a forced gigatoken is refused, each naming why."""
    for name in (PHI2, "tokenizers/phi-3-mini/tokenizer.json"):
        assert backends.overlap_probes(Tokenizer.from_file(str(shared_data / name))) == []
    few = Tokenizer.from_file(str(_with_added(tmp_path, shared_data, ("<t1", NORMALIZED), ("1>", {}), ("12>", {}))))
    assert backends.overlap_probes(few) == ["a <t12> b<t12>", "a <t1> b<t1>"]
    many = [(f"<t{i}", NORMALIZED) for i in range(300)] + [(f"{i}>", {}) for i in range(300)]
    tok = _with_added(tmp_path, shared_data, *many)
    with pytest.raises(backends.UnprobedOverlaps, match=r"overlap in 8170 ways .* more than the 4096 the check"):
        backends.overlap_probes(Tokenizer.from_file(str(tok)))
    rec = backends.select("auto", tok)
    assert rec["name"] == "hf" and "more than the 4096 the check probes" in rec["fallback_reason"]
    with pytest.raises(backends.BackendError, match="tokenizer.backend is gigatoken but its added tokens overlap in"):
        backends.select("gigatoken", tok)


# 70 not-normalized tokens "0aa#" .. "0cr#", each run together with a normalized "#z": HF and gigatoken agree there
AGREEING_OVERLAPS = [(f"0{chr(97 + i // 26)}{chr(97 + i % 26)}#", {"special": False}) for i in range(70)]


def test_every_overlap_is_probed_so_agreeing_ones_cannot_hide_one_that_differs(tmp_path: Path,
                                                                               shared_data: Path) -> None:
    """Hunter R50 R1: overlap_probes took the first 64 overlaps in sorted order, all of them "0..#z" ones both
    backends agree on, so "<xq>" ("<xq" normalized, "q>" not) was never probed: `auto` picked gigatoken and wrote
    other .bin bytes than `hf`. Every overlap is probed now."""
    tok = _with_added(tmp_path, shared_data, *AGREEING_OVERLAPS, ("#z", NORMALIZED), ("<xq", NORMALIZED),
                      ("q>", {"special": False}))
    probes = backends.overlap_probes(Tokenizer.from_file(str(tok)))
    assert len(probes) == 71 and probes[-1] == "a <xq> b<xq>"
    hf, giga = backends.HFBackend(tok), backends.GigatokenBackend(tok)
    assert backends.mismatch(hf, giga, probes[:-1]) is None and backends.mismatch(hf, giga, probes[-1:])
    rec = backends.select("auto", tok)
    assert rec["name"] == "hf" and "gigatoken ids differ from hf on text" in rec["fallback_reason"]
    assert "'a <xq> b<xq>'" in rec["fallback_reason"]


def test_overlaps_past_the_cap_send_auto_to_hf_even_when_all_agree(tmp_path: Path, shared_data: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An overlap left unprobed is unverified, whatever the probed ones show: with the cap below the 70 (agreeing)
    overlaps `auto` uses HF, naming why; at or above it, it probes them all and picks gigatoken."""
    tok = _with_added(tmp_path, shared_data, *AGREEING_OVERLAPS, ("#z", NORMALIZED))
    monkeypatch.setattr(backends, "MAX_OVERLAP_PROBES", 70)
    rec = backends.select("auto", tok)
    assert rec["name"] == "gigatoken" and rec["check"]["texts"] == _probes(tok)
    monkeypatch.setattr(backends, "MAX_OVERLAP_PROBES", 69)
    rec = backends.select("auto", tok)
    assert rec["name"] == "hf" and rec["fallback_reason"] == ("its added tokens overlap in 70 ways (a normalized one "
                                                              "run together with one not), more than the 69 the "
                                                              "check probes")


def test_a_normalized_added_token_is_probed_in_its_normalized_form(tmp_path: Path, shared_data: Path) -> None:
    """HF matches a normalized added token by its normalized form (NFC: "e\u0301" is "\u00e9") in the normalized
    text; gigatoken 0.10.0 does not. The probes held only its content, so `auto` picked gigatoken and wrote other
    ids for "café" (precomposed) than HF's."""
    tok = _with_added(tmp_path, shared_data, ("e\u0301", NORMALIZED), normalizer={"type": "NFC"})
    hf, giga = backends.HFBackend(tok), backends.GigatokenBackend(tok)
    assert backends.mismatch(hf, giga, ["un caf\u00e9 noir 0"]) is not None
    rec = backends.select("auto", tok)
    assert rec["name"] == "hf" and "gigatoken ids differ from hf" in rec["fallback_reason"]
    with pytest.raises(backends.BackendError, match="tokenizer.backend is gigatoken but gigatoken ids differ"):
        backends.select("gigatoken", tok)


def test_a_probe_hf_cannot_encode_is_left_out_not_a_crash(tmp_path: Path, shared_data: Path) -> None:
    """tokenizers panics ("AddedVocabulary bad split", a BaseException) on an added "ab" with rstrip (beside an added
    "\x85" with lstrip) in "abababab", one of the added-token probes: the job ended with a Rust backtrace."""
    tok = _with_added(tmp_path, shared_data, ("ab", {"rstrip": True, "special": False}), ("\x85", {"lstrip": True}))
    probes = backends.added_token_probes(backends.HFBackend(tok).tokenizer)
    kept = backends._encodable(backends.HFBackend(tok), probes)
    assert 0 < len(kept) < len(probes)
    assert backends.select("auto", tok)["name"] in ("hf", "gigatoken")


SPARSE_SCRIPT = """
import sys
from streamprep import backends
print("R", backends.select("auto", sys.argv[1]).get("fallback_reason"))
try:
    backends.select("gigatoken", sys.argv[1])
except backends.BackendError as exc:
    print("R", exc)
"""


def test_the_sparse_ids_check_parses_only_a_file_with_a_large_number(shared_data: Path, monkeypatch) -> None:
    """Regression (perf): the check parsed every tokenizer.json (phi-2's: +17 MiB of peak memory in the job's process
    and the forkserver, +30 MiB on the 62.5 MB job's peak); a file with no number as large as SPARSE_IDS_SLACK has
    no id past it, and is not parsed. One with such an id still is, and is refused."""
    from streamprep import backends

    parsed: list[int] = []
    loads = orjson.loads
    monkeypatch.setattr(backends.orjson, "loads", lambda b: parsed.append(1) or loads(b))
    phi2 = (shared_data / "tokenizers/phi-2/tokenizer.json").read_bytes()
    assert backends._sparse_ids(phi2) is None and parsed == []
    spec = loads(phi2)
    spec["added_tokens"].append({**spec["added_tokens"][-1], "id": 2**31 - 1, "content": "<huge>"})
    assert backends._sparse_ids(orjson.dumps(spec)).startswith("its ids reach 2147483647 for ") and parsed == [1]


def test_a_tokenizer_whose_ids_gigatoken_cannot_hold_is_not_loaded(tmp_path: Path, shared_data: Path) -> None:
    """An added token with id 2**31-1 (HF renumbers it 50295): gigatoken sized its tables by that id and the
    process aborted on a 32 GiB allocation (SIGABRT, no exception), under `auto` and every resume alike. In a
    child process: before the fix it died."""
    tok = _with_added(tmp_path, shared_data, ("<huge>", {}))
    spec = json.loads(tok.read_text())
    spec["added_tokens"][-1]["id"] = 2**31 - 1
    tok.write_text(json.dumps(spec))
    out = subprocess.run([sys.executable, "-c", SPARSE_SCRIPT, str(tok)], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert out.returncode == 0, out.stderr[-500:]
    auto, forced = [line[2:] for line in out.stdout.splitlines() if line.startswith("R ")]
    assert auto.startswith("gigatoken cannot load tokenizer.json: BackendError: its ids reach 2147483647 for ")
    assert forced.startswith("tokenizer.backend is gigatoken but gigatoken cannot load tokenizer.json")
    assert backends._sparse_ids((shared_data / PHI2).read_bytes()) is None  # phi-2's own ids are dense


PANIC_TEXT = "ab\x85 hello world"  # tokenizers panics ("AddedVocabulary bad split") with _panicky's added tokens


def _panicky(tmp_path: Path, shared_data: Path) -> Path:
    return _with_added(tmp_path, shared_data, ("ab", {"rstrip": True, "special": False}), ("\x85", {"lstrip": True}))


@pytest.mark.parametrize("backend", ["hf", "auto"])
def test_a_document_the_tokenizer_panics_on_is_a_counted_reject_not_a_crash(backend: str, tmp_path: Path,
                                                                           shared_data: Path) -> None:
    """One such document failed the job (PanicException, a BaseException; with workers >= 2 a PicklingError naming
    no cause), on every resume. It is now dropped like a record with no tokens, listed and logged; the other
    records' ids are the same bytes as a run without it."""
    tok = _panicky(tmp_path, shared_data)
    assert backends.select("auto", tok)["name"] == "hf"  # only HF finds such documents: gigatoken must not run
    runs = {}
    for name, texts in (("with", ["first doc", PANIC_TEXT, "last doc"]), ("without", ["first doc", "last doc"])):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        cfg = base_config([{"name": "d", "path": str(data)}], str(tok))
        cfg["quality"] = {"expected_language": None, "min_chars": 1, "normalize": False}  # keeps the \x85
        cfg["tokenizer"]["backend"] = backend
        runs[name] = tmp_path / f"run_{name}"
        assert run_from_dict(cfg, run_dir=runs[name], console_log=False).status == "complete"
    stats = json.loads(next((runs["with"] / "receipts").rglob("*.json")).read_text())["stats"]
    assert stats["dropped_empty"] == [1] and stats["unencodable"] == [1] and stats["num_documents"] == 2
    assert tree_hashes(runs["with"], "binidx") == tree_hashes(runs["without"], "binidx")
    audit = json.loads((runs["with"] / "audit" / "audit.json").read_text())
    assert audit["totals"]["empty_tokens"] == 1


def test_a_panicking_batch_is_encoded_without_its_culprits(tmp_path: Path, shared_data: Path) -> None:
    encoder = backends.ShardEncoder("hf", _panicky(tmp_path, shared_data))
    flat, lengths, failed = encoder.encode_or_drop(["first doc", PANIC_TEXT, "last doc"], check="d")
    ref_flat, ref_lengths = encoder.encode_batch(["first doc", "last doc"])
    assert lengths.tolist() == [ref_lengths[0], 0, ref_lengths[1]] and flat.tolist() == ref_flat.tolist()
    assert failed == {1: "tokenizers panicked: AddedVocabulary bad split"}
    assert encoder.encode_or_drop(["first doc"])[2] == {}


def test_a_forced_gigatoken_that_failed_its_check_refuses_every_later_batch(shared_data: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker marked the dataset checked before the check raised, and (cached across tasks) encoded the job's
    next shards with gigatoken, unchecked, before the job stopped."""
    encoder = backends.ShardEncoder("gigatoken", shared_data / PHI2)
    monkeypatch.setattr(backends, "mismatch", lambda *a: "gigatoken ids differ from hf on text 5")
    with pytest.raises(backends.BackendError, match="text 5"):
        encoder.encode_batch(["a", "b"], check="d")
    monkeypatch.setattr(backends, "mismatch", lambda *a: None)  # a later sample that happens to agree
    for check in ("d", None, "other"):
        with pytest.raises(backends.BackendError, match="text 5"):
            encoder.encode_batch(["c"], check=check)


def test_a_mismatch_names_the_first_differing_id_and_its_neighbours() -> None:
    """Regression: the reason showed the first 8 ids of each side, the same on both sides when the texts part later
    (`[1, 2, ...]... vs [1, 2, ...]...`); it names the first position that differs and the ids around it now."""
    from types import SimpleNamespace

    hf, giga = SimpleNamespace(name="hf"), SimpleNamespace(name="gigatoken")
    same = np.arange(100, 105)
    a = np.arange(20)
    b = a.copy()
    b[12] = 99

    def batch(*docs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return np.concatenate(docs), np.array([len(d) for d in docs])

    assert backends._difference(hf, batch(same, a), giga, batch(same, b), ["x", "caf\u00e9"]) == (
        "gigatoken ids differ from hf on text 1 ('caf\u00e9') at id 12 (of 20 vs 20), ids 9-15: "
        "...[9, 10, 11, 12, 13, 14, 15]... vs ...[9, 10, 11, 99, 13, 14, 15]...")
    assert backends._difference(hf, batch(a[:5]), giga, batch(a[:2]), ["ab"]) == (  # one ends early
        "gigatoken ids differ from hf on text 0 ('ab') at id 2 (of 5 vs 2), ids 0-4: [0, 1, 2, 3, 4] vs [0, 1]")
    assert backends._difference(hf, batch(a), giga, batch(a.copy()), ["t"]) is None


def test_add_flat_writes_what_add_documents_writes(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 40, size=300)
    flat = rng.integers(0, 50000, size=int(lengths.sum())).astype(np.uint32)
    docs = np.split(flat, np.cumsum(lengths)[:-1])
    for eod in (None, 50256):
        a = binidx.IndexedDatasetWriter(tmp_path / f"a{eod}", np.uint16)
        a.add_documents([np.append(d, eod) if eod is not None else d for d in docs[:120]])
        a.add_documents([np.append(d, eod) if eod is not None else d for d in docs[120:]])
        a.close()
        b = binidx.IndexedDatasetWriter(tmp_path / f"b{eod}", np.uint16)
        cut = int(lengths[:120].sum())
        b.add_flat(flat[:cut], lengths[:120], eod)
        b.add_flat(flat[cut:], lengths[120:], eod)
        b.add_flat(flat[:0], lengths[:0], eod)
        b.close()
        for ext in (".bin", ".idx"):
            assert (tmp_path / f"a{eod}{ext}").read_bytes() == (tmp_path / f"b{eod}{ext}").read_bytes()
    w = binidx.IndexedDatasetWriter(tmp_path / "z", np.uint16)
    with pytest.raises(ValueError, match="zero-length"):
        w.add_flat(flat[:3], np.array([3, 0]), 1)
    with pytest.raises(ValueError, match="lengths sum to 4 but 3 tokens"):
        w.add_flat(flat[:3], np.array([3, 1]), 1)
    w.abort()


def _job(tmp_path: Path, shared_data: Path, name: str, tokenizer: str | None, backend: str) -> Path:
    datasets = [{"name": "web", "path": str(shared_data / "web/c4_en_llamafactory_demo300.jsonl")},
                {"name": "med", "path": str(shared_data / "medical/pubmedqa_abstracts.jsonl"), "max_records": 300},
                {"name": "multi", "path": str(shared_data / "multilingual/lingua_sentences_75langs.jsonl"),
                 "max_records": 1500},
                {"name": "code", "path": str(shared_data / "code/humaneval-x/humaneval_python.jsonl.gz"),
                 "text_field": "canonical_solution"}]
    cfg = base_config(datasets, tokenizer, output={"shard_records": 400})
    cfg["quality"] = {"expected_language": None, "min_chars": 1}
    cfg["tokenizer"]["backend"] = backend
    if tokenizer is None:
        cfg["tokenizer"].update(if_missing="train", train={"vocab_size": 1200, "min_frequency": 2})
    run_dir = tmp_path / name
    assert run_from_dict(cfg, run_dir=run_dir, console_log=False).status == "complete"
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("tokenizer", [PHI2, None], ids=["phi-2", "trained"])
def test_job_writes_identical_bytes_under_hf_and_gigatoken(tokenizer: str | None, tmp_path: Path,
                                                           shared_data: Path) -> None:
    from streamprep.status import format_status, run_status

    tok = str(shared_data / tokenizer) if tokenizer else None
    runs = {b: _job(tmp_path, shared_data, b, tok, b) for b in ("hf", "gigatoken")}
    outputs = ("binidx", "receipts", "parquet", "ingest")
    hashes = {b: tree_hashes(r, *outputs) for b, r in runs.items()}
    assert hashes["hf"] == hashes["gigatoken"] and any(k.endswith(".bin") for k in hashes["hf"])
    blends = {b: (r / "blend.json").read_text().replace(str(r), "RUN") for b, r in runs.items()}  # absolute prefixes
    assert blends["hf"] == blends["gigatoken"]
    assert (runs["hf"] / "tokenizer/tokenizer.json").read_bytes() == \
        (runs["gigatoken"] / "tokenizer/tokenizer.json").read_bytes()
    assert (runs["hf"] / "manifest.json").read_text().replace(str(runs["hf"]), "RUN") == \
        (runs["gigatoken"] / "manifest.json").read_text().replace(str(runs["gigatoken"]), "RUN")
    for b, run_dir in runs.items():
        record = json.loads((run_dir / "run.json").read_text())
        assert record["tokenizer_backend"] == json.loads(RunLayout(run_dir).tokenizer_backend.read_text())
        # the tokenizer's files, and so the manifest, are the same bytes whichever backend ran
        assert "backend" not in json.loads((run_dir / "tokenizer/fingerprint.json").read_text())
        assert record["tokenizer_backend"]["name"] == b == record["tokenizer_backend"]["requested"]
        assert record["tokenizer_backend"]["version"] == record["versions"]["gigatoken" if b == "gigatoken"
                                                                            else "tokenizers"]
        assert not RunLayout(run_dir).tokenizer_backend_fallback.exists()  # no worker's check failed
        st = run_status(run_dir)
        assert st["tokenizer_backend"]["name"] == b
        assert f"tokenizer backend: {b} {record['tokenizer_backend']['version']} (requested {b}" in format_status(st)
    if tokenizer is None:  # a trained tokenizer's check includes the first sampled texts
        assert json.loads((runs["gigatoken"] / "run.json").read_text())["tokenizer_backend"]["check"] == \
            {"texts": _probes(runs["gigatoken"] / "tokenizer" / "tokenizer.json") + backends.CHECK_DOCS,
             "identical": True}


def test_hf_tokenizer_is_loaded_once_for_the_same_bytes(tmp_path: Path) -> None:
    """The configured file and the run's copy of it share one load; other bytes at the same path load again."""
    path = _unloadable(tmp_path)
    copy = tmp_path / "copy" / "tokenizer.json"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    first = backends.hf_tokenizer(path)
    assert backends.hf_tokenizer(copy) is first and backends.HFBackend(copy).tokenizer is first
    path.write_bytes(path.read_bytes().replace(b'"</s>"', b'"<eos>"'))
    second = backends.hf_tokenizer(path)
    assert second is not first and second.token_to_id("<eos>") == first.token_to_id("</s>")
    with pytest.raises(Exception, match="No such file"):
        backends.hf_tokenizer(tmp_path / "missing.json")


def test_the_identity_check_and_the_shards_share_one_gigatoken_build(tmp_path: Path, shared_data: Path) -> None:
    """The worker that ran `select` encodes its shards with the gigatoken tokenizer it built there (same bytes
    at another path share it too); other bytes build a new one, whose ids are still HF's."""
    path = shared_data / PHI2
    copy = tmp_path / "tokenizer.json"
    copy.write_bytes(path.read_bytes())
    backends._built.clear()
    assert backends.select("auto", path)["name"] == "gigatoken"
    built = backends._built[next(iter(backends._built))]
    encoder = backends.ShardEncoder("auto", copy)
    assert encoder.backend is built and backends.load("gigatoken", path) is built
    other = tmp_path / "bpe.json"
    other.write_text(train_bpe(["the cat sat on the mat", "don't stop the dog"] * 20, 300, 1).to_str())
    rebuilt = backends.load("gigatoken", other)
    assert rebuilt is not built and list(backends._built.values()) == [rebuilt]
    texts = ["hello world", "don't stop"]
    assert backends.mismatch(backends.HFBackend(other), rebuilt, texts) is None


class _Loads:
    """Counts the tokenizer loads of this process (any thread): HF `tokenizers` constructors and gigatoken's."""

    def __init__(self) -> None:
        self.hf = self.gigatoken = 0
        self.constructors = [Tokenizer.from_file, Tokenizer.from_str, Tokenizer.from_buffer, Tokenizer.from_pretrained]

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "c_call" and any(arg is f for f in self.constructors):
            self.hf += 1
        elif event == "call" and frame.f_code.co_name in ("from_json", "from_sentencepiece") \
                and "gigatoken" in frame.f_code.co_filename:
            self.gigatoken += 1


@pytest.mark.slow
@pytest.mark.parametrize("backend", backends.BACKENDS)
def test_the_driver_loads_the_tokenizer_once(backend: str, tmp_path: Path, shared_data: Path) -> None:
    """A fresh `engine: local` job (tokenizing and gathering its audit on its worker processes) loads each backend
    at most once in the driver: the config check and the fingerprint share one HF load; the run's identity check
    runs on a worker, so gigatoken loads in the driver only for a forced gigatoken's config-time check (whose
    outcome the run reuses), never for `auto` or `hf`."""
    import threading

    lines = (shared_data / "web/c4_en_train00000_first1000.jsonl").read_bytes().splitlines()[:150]
    (tmp_path / "web.jsonl").write_bytes(b"\n".join(lines + lines[:30]) + b"\n")  # 30 exact copies: rejects
    cfg = base_config([{"name": "web", "path": str(tmp_path / "web.jsonl")}], str(shared_data / PHI2))
    cfg["execution"]["workers"] = 2
    cfg["tokenizer"]["backend"] = backend
    backends._loaded.clear()  # an earlier test's load of the same file does not count for this job
    loads = _Loads()
    sys.setprofile(loads)
    threading.setprofile(loads)
    try:
        result = run_from_dict(cfg, run_dir=tmp_path / "run", console_log=False)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    assert result.status == "complete"
    assert (loads.hf, loads.gigatoken) == (1, 1 if backend == "gigatoken" else 0)
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    hf = {"requested": "hf", "name": "hf", "version": record["versions"]["tokenizers"]}
    assert record["tokenizer_backend"] == (hf if backend == "hf" else {
        "requested": backend, "name": "gigatoken", "version": record["versions"]["gigatoken"],
        "check": {"texts": _probes(shared_data / PHI2), "identical": True}})
    audit = json.loads((tmp_path / "run" / "audit" / "audit.json").read_text())["datasets"]["web"]
    assert audit["lengths"]["tokens"]["rejected_sample_records"] >= 30  # a worker tokenized the rejects


def test_backend_is_not_in_the_plan_hash(tmp_path: Path, shared_data: Path) -> None:
    part = tmp_path / "p.jsonl"
    part.write_text('{"text": "a"}\n')
    plans = {make_task(tmp_path, "d", "train", part, shared_data / PHI2, "sha256:x", 1, "uint16", backend=b).plan_hash
             for b in ("hf", "gigatoken", "auto")}
    assert len(plans) == 1  # shards written under one backend are kept when resumed under another
    others = {make_task(tmp_path, "d", "train", part, shared_data / PHI2, *args).plan_hash
              for args in (("sha256:y", 1, "uint16"), ("sha256:x", 2, "uint16"), ("sha256:x", 1, "int32"))}
    assert len(others) == 3 and not others & plans  # what does change the ids or their bytes is in it


MEMORY_SCRIPT = """
import sys, numpy as np
from streamprep import backends
budget = None if sys.argv[2] == "none" else int(sys.argv[2]) << 20
b = backends.GigatokenBackend(sys.argv[1], budget_bytes=budget)
base, peak, total, rng = backends._rss(), 0, 0, np.random.default_rng(0)
while total < 32 << 20:  # documents of unique random words: every word is a new cache entry
    raw = rng.integers(97, 123, size=400_000, dtype=np.uint8)
    raw[rng.random(raw.size) < 0.13] = 32
    s = raw.tobytes().decode()
    b.encode_batch([s[i:i + 2000] for i in range(0, len(s), 2000)])
    total += len(s)
    peak = max(peak, backends._rss())
print(peak - base, b.rebuilds)
"""


@pytest.mark.slow
def test_gigatoken_memory_stays_within_the_budget(shared_data: Path) -> None:
    """32 MB of unique words: unbounded caches grow ~230 MB; with a 64 MiB budget the rebuilds keep the
    growth under the budget plus one tokenizer's rebuild residue (~50 MB measured; 64 MiB allowed)."""
    budget = 64

    def growth(arg: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, str(shared_data / PHI2), arg], cwd=REPO,
                             env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, capture_output=True,
                             text=True, check=True, timeout=300).stdout.split()
        return int(out[0]), int(out[1])

    bounded, rebuilds = growth(str(budget))
    assert rebuilds >= 2 and bounded < (budget + 64) << 20, (bounded >> 20, rebuilds)
    unbounded, _ = growth("none")
    assert unbounded > (budget + 64) << 20, unbounded >> 20  # the test would catch a missing rebuild


@pytest.mark.parametrize("setting", ["truncation", "padding"])
def test_a_tokenizer_files_truncation_or_padding_changes_no_id(tmp_path: Path, shared_data: Path,
                                                                setting: str) -> None:
    """Regression: a tokenizer.json carrying `truncation` (max_length 200) cut every document to 200 tokens under
    hf and auto, silently, and one carrying `padding` (BatchLongest) padded each batch's documents with pad ids,
    while gigatoken, which has neither, failed its identity check: the file's settings are turned off, so both
    backends give `encode(text)` (as transformers' calls, which turn them off unless asked, and Megatron's do)."""
    from streamprep.sft.chat import load_chat_tokenizer

    raw = json.loads((shared_data / PHI2).read_text(encoding="utf-8"))
    raw[setting] = {"truncation": {"direction": "Right", "max_length": 20, "strategy": "LongestFirst", "stride": 0},
                    "padding": {"strategy": "BatchLongest", "direction": "Right", "pad_to_multiple_of": None,
                                "pad_id": 50256, "pad_type_id": 0, "pad_token": "<|endoftext|>"}}[setting]
    edited = tmp_path / "tok" / "tokenizer.json"
    edited.parent.mkdir()
    edited.write_text(json.dumps(raw), encoding="utf-8")
    texts = ["a short one", " ".join(["river mountain delta"] * 40)]
    want = [e.ids for e in Tokenizer.from_file(str(shared_data / PHI2)).encode_batch(texts, add_special_tokens=False)]
    assert len(want[1]) > 20 and len(want[0]) < len(want[1])
    for backend in (backends.HFBackend(edited), backends.gigatoken_backend(edited)):
        flat, lengths = backend.encode_batch(texts)
        assert [flat[:lengths[0]].tolist(), flat[lengths[0]:].tolist()] == want, backend.name
    assert backends.select("gigatoken", edited, texts)["name"] == "gigatoken"  # its identity check passes
    chat = load_chat_tokenizer(edited)
    assert [e.ids for e in chat.backend.encode_batch(texts, add_special_tokens=False)] == want


def test_the_audit_histogram_of_rejects_leaves_out_a_text_the_tokenizer_panics_on(tmp_path: Path,
                                                                                  shared_data: Path) -> None:
    """A QC-rejected record HF cannot encode ended the job's audit with the panic."""
    from streamprep.audit.gather import _rejected_token_hist

    hist, tokenized = _rejected_token_hist(backends.HFBackend(_panicky(tmp_path, shared_data)),
                                           [{"text": "first doc"}, {"text": PANIC_TEXT}], eod=True)
    assert tokenized == 1 and sum(hist.values()) == 1
