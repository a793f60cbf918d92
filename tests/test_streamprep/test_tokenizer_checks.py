"""What the config check refuses in a tokenizer.json, and ids past len(tokenizer): a tiny BPE trained here, edited."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import base_config, english_docs
from tokenizers import Tokenizer

from streamprep import run_from_dict
from streamprep.binidx import IndexedDataset
from streamprep.config import ConfigError, validate
from streamprep.tokenizer import train_bpe

DOCS = english_docs(120, seed=3)


@pytest.fixture
def trained(tmp_path: Path) -> tuple[dict, Path]:
    """A byte-level BPE of this corpus (its tokenizer.json as a dict) and the corpus file."""
    corpus = tmp_path / "in.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    return json.loads(train_bpe(DOCS, 600, 2).to_str()), corpus


def _config(tmp_path: Path, tok: dict, corpus: Path, **output) -> dict:
    (tmp_path / "tok").mkdir(exist_ok=True)
    (tmp_path / "tok" / "tokenizer.json").write_text(json.dumps(tok))
    return base_config([{"name": "a", "path": str(corpus)}], str(tmp_path / "tok" / "tokenizer.json"),
                       output={"shard_records": 50, **output})


def test_an_id_past_65535_in_a_small_vocabulary_is_written_whole(tmp_path: Path, trained) -> None:
    """Regression: the dtype followed len(tokenizer) (601 → uint16), so an id of 70001 was written as 70001 - 65536
    = 4465, another token's id or none, and `verify` passed. Now the highest id decides, and an explicit uint16 that
    cannot hold it is a config error before anything is written."""
    tok, corpus = trained
    vocab = tok["model"]["vocab"]
    last = max(vocab, key=vocab.get)  # the last merge learned: it occurs in the corpus it was learned from
    vocab[last] = 70001
    raw = _config(tmp_path, tok, corpus)
    assert run_from_dict(raw, run_dir=tmp_path / "run", console_log=False).status == "complete"
    shards = [IndexedDataset.open(p.with_suffix("")) for p in sorted((tmp_path / "run" / "binidx" / "a").glob("*.bin"))]
    ids = np.concatenate([s.tokens() for s in shards])
    hf = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    assert ids.dtype == np.int32 and (ids == 70001).sum() == sum(e.ids.count(70001) for e in hf.encode_batch(DOCS)) > 0
    with pytest.raises(ConfigError, match=r"^config: 'output.dtype': uint16 cannot hold the tokenizer's token ids "
                                          r"\(up to 70001\); use auto or int32$"):
        validate(_config(tmp_path, tok, corpus, dtype="uint16"))


def test_a_damaged_tokenizer_config_beside_it_is_a_config_error_naming_it(tmp_path: Path, trained) -> None:
    """Regression: a truncated or non-object tokenizer_config.json was a bare JSONDecodeError / AttributeError, exit 1."""
    raw = _config(tmp_path, *trained)
    cfg_file = tmp_path / "tok" / "tokenizer_config.json"
    for text, why in (('{"eos_token": "</s', "is not JSON"), ("[]", "is a JSON array, not an object")):
        cfg_file.write_text(text)
        with pytest.raises(ConfigError, match=rf"^config: 'tokenizer.path': {cfg_file} {why}"):
            validate(raw)


def test_bpe_dropout_is_refused(tmp_path: Path, trained) -> None:
    """Regression: with `model.dropout` set, two runs of the same input wrote different shards (both exit 0)."""
    tok, corpus = trained
    tok["model"]["dropout"] = 0.3
    with pytest.raises(ConfigError, match=r"^config: 'tokenizer.path': .* sets BPE dropout 0.3, which gives other ids"):
        validate(_config(tmp_path, tok, corpus))


def test_a_tokenizer_that_loads_but_cannot_encode_text_is_a_config_error(tmp_path: Path, trained) -> None:
    """Regression: a WordLevel (or WordPiece, or BPE without byte fallback) tokenizer.json whose unk_token is not in
    its vocabulary loads, but HF raises on every word it does not know: the run failed after the whole ingest,
    `error: Exception: WordLevel error: Missing [UNK] token from the vocabulary`, exit 1, at every re-run."""
    _, corpus = trained
    words = {w: i for i, w in enumerate(sorted({w for t in DOCS for w in t.split()}))}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
           "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None, "decoder": None,
           "model": {"type": "WordLevel", "vocab": {**words, "</s>": len(words)}, "unk_token": "<unk>"}}
    raw = _config(tmp_path, tok, corpus)
    with pytest.raises(ConfigError, match=r"^config: 'tokenizer.path': .*tokenizer.json loads but cannot encode text "
                                          r"\(WordLevel error: Missing \[UNK\] token from the vocabulary\)$"):
        validate(raw)
    tok["model"]["vocab"]["<unk>"] = len(words) + 1  # the same file with its unk_token: every word has an id
    assert validate(_config(tmp_path, tok, corpus))["tokenizer"]["path"] is not None


def test_a_tokenizer_file_changed_under_a_run_is_named_in_a_warning(tmp_path: Path, trained) -> None:
    """Regression: a tokenizer.path file replaced between a kill and the resume was passed over without a word (the
    run, rightly, goes on with its own copy: every shard with the same ids)."""
    from structlog.testing import capture_logs

    from streamprep.config import TokenizerConfig
    from streamprep.tokenizer import saved_tokenizer

    raw = _config(tmp_path, *trained)
    assert run_from_dict(raw, run_dir=tmp_path / "run", console_log=False).status == "complete"
    tok_cfg = TokenizerConfig.from_dict(validate(raw)["tokenizer"])
    with capture_logs() as seen:
        copy = saved_tokenizer(tok_cfg, tmp_path / "run")
    assert copy is not None and not [e for e in seen if e["log_level"] == "warning"]
    source = tmp_path / "tok" / "tokenizer.json"
    source.write_text(source.read_text() + "\n")  # other bytes, same tokenizer
    with capture_logs() as seen:
        assert saved_tokenizer(tok_cfg, tmp_path / "run").fingerprint == copy.fingerprint
    warned = [e for e in seen if e["log_level"] == "warning"]
    assert [(e["event"][:38], e["path"], e["copy"]) for e in warned] == [
        ("tokenizer.path's file changed since th", str(source), copy.fingerprint)]


def test_a_side_file_changed_under_a_run_is_named_in_a_warning(tmp_path: Path, trained) -> None:
    """Regression: an eos_token edited in tokenizer.path's tokenizer_config.json (or a special_tokens_map.json taken
    away) between a kill and the resume was passed over without a word: only tokenizer.json was compared. The run
    goes on with its copy's EOD token, and each side file that differs is named now."""
    import hashlib

    from structlog.testing import capture_logs

    from streamprep.config import TokenizerConfig
    from streamprep.tokenizer import saved_tokenizer

    raw = _config(tmp_path, *trained)
    side = tmp_path / "tok" / "tokenizer_config.json"
    side.write_text('{"eos_token": "</s>"}')
    (tmp_path / "tok" / "special_tokens_map.json").write_text('{"eos_token": "</s>"}')
    assert run_from_dict(raw, run_dir=tmp_path / "run", console_log=False).status == "complete"
    tok_cfg = TokenizerConfig.from_dict(validate(raw)["tokenizer"])
    old = "sha256:" + hashlib.sha256(b'{"eos_token": "</s>"}').hexdigest()  # both side files' bytes at the start
    side.write_text('{"eos_token": "<pad>"}')
    (tmp_path / "tok" / "special_tokens_map.json").unlink()
    with capture_logs() as seen:
        copy = saved_tokenizer(tok_cfg, tmp_path / "run")
    assert copy is not None and copy.eod_token == "</s>"
    warned = [(e["event"][:45], e["path"], e["copy"], e["now"]) for e in seen if e["log_level"] == "warning"]
    now = "sha256:" + hashlib.sha256(side.read_bytes()).hexdigest()
    assert warned == [("tokenizer.path's side file differs from the r", str(side), old, now),
                      ("tokenizer.path's side file differs from the r",
                       str(tmp_path / "tok" / "special_tokens_map.json"), old, "missing")]


def test_a_damaged_file_of_the_runs_tokenizer_copy_is_recreated(tmp_path: Path, trained) -> None:
    """Regression: a damaged RUN_DIR/tokenizer/ file failed every resume with an error naming no file (tokenizers'
    bare `Exception: control character …`, a JSONDecodeError) or blamed 'tokenizer.path' for the run's own
    tokenizer_config.json. The copy is recreated from tokenizer.path now, as a changed or missing one is."""
    from structlog.testing import capture_logs

    from streamprep.config import TokenizerConfig
    from streamprep.tokenizer import prepare

    raw = _config(tmp_path, *trained)
    (tmp_path / "tok" / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    tok_cfg = TokenizerConfig.from_dict(validate(raw)["tokenizer"])
    run = tmp_path / "run"
    first = prepare(tok_cfg, run)
    files = {p.name: p.read_bytes() for p in sorted((run / "tokenizer").iterdir())}
    assert {"tokenizer.json", "fingerprint.json", "tokenizer_config.json"} <= set(files)
    for name, reason in (("tokenizer.json", "tokenizer.json does not match its fingerprint"),
                         ("fingerprint.json", "fingerprint.json is unreadable"),
                         ("tokenizer_config.json", "tokenizer_config.json is not a JSON object")):
        (run / "tokenizer" / name).write_text('{"bro\n')
        with capture_logs() as seen:
            assert prepare(tok_cfg, run) == first
        assert [(e["event"], e["reason"]) for e in seen if e["log_level"] == "warning"] == [
            ("tokenizer copy is changed or damaged; recreating it", reason)]
        assert {p.name: p.read_bytes() for p in sorted((run / "tokenizer").iterdir())} == files
    # a side file lost (an SFT run found no chat template at every resume), or edited to give another EOD (used,
    # without a word, for every shard written after)
    for damage, reason in ((lambda p: p.unlink(), "tokenizer_config.json is missing (tokenizer.path has one)"),
                           (lambda p: p.write_text('{"eos_token": "."}'), "its side files give EOD id ")):
        damage(run / "tokenizer" / "tokenizer_config.json")
        with capture_logs() as seen:
            assert prepare(tok_cfg, run) == first
        [warned] = [e["reason"] for e in seen if e["log_level"] == "warning"]
        assert warned.startswith(reason) and (reason.endswith("one)") or warned.endswith(f"{first.eod_id} recorded"))
        assert {p.name: p.read_bytes() for p in sorted((run / "tokenizer").iterdir())} == files


@pytest.mark.parametrize("sample_mb", [None, 0.01])
def test_a_tokenizer_trained_on_a_worker_process_is_in_the_run_log(tmp_path: Path, sample_mb: float | None) -> None:
    """Regression: with `workers: 2` the training ran in a pool process, whose log lines reach no run log: "tokenizer
    trained" and "tokenizer backend" were on the console only. The worker returns them and the job logs them, once."""
    corpus = tmp_path / "in.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    raw = base_config([{"name": "a", "path": str(corpus)}], None, output={"shard_records": 50})
    raw["execution"]["workers"] = 2
    if sample_mb is not None:
        raw["tokenizer"]["train"]["sample_mb"] = sample_mb
    assert run_from_dict(raw, run_dir=tmp_path / "run", console_log=False).status == "complete"
    events = [json.loads(line)["event"] for line in (tmp_path / "run" / "logs" / "streamprep.log").read_text().splitlines()]
    assert events.count("tokenizer trained") == 1 and events.count("tokenizer backend") >= 1
    start = "training the tokenizer on " + ("all kept text" if sample_mb is None else "a sample while ingest goes on")
    assert events.index(start) < events.index("tokenizer trained")  # the minutes it may take are not silent


def test_a_training_sample_with_no_text_is_refused_not_trained_on(tmp_path: Path) -> None:
    """Regression: with `train.sample_mb`, a run that kept no record (or a sample_mb too small to give a dataset a
    byte) trained a tokenizer on no text, the 256 bytes and special tokens alone, and completed with exit 0, where
    the same run without sample_mb stops with exit 2 ("no records were kept")."""
    corpus = tmp_path / "in.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    raw = base_config([{"name": "a", "path": str(corpus)}], None, quality={"min_chars": 1_000_000})
    raw["tokenizer"]["train"]["sample_mb"] = 0.01
    with pytest.raises(ConfigError, match=r"^no records were kept, so there is no text to train a tokenizer on"):
        run_from_dict(raw, run_dir=tmp_path / "run", console_log=False)
    assert not (tmp_path / "run" / "tokenizer" / "tokenizer.json").exists()
    raw = base_config([{"name": "a", "path": str(corpus)}], None)
    raw["tokenizer"]["train"]["sample_mb"] = 1e-7  # 0.1 byte
    with pytest.raises(ConfigError, match=r"^config: 'tokenizer.train.sample_mb': 1e-07 MB shared out by the dataset "
                                          r"weights gives no dataset a whole byte of training text; make it larger$"):
        validate(raw)


def test_a_damaged_training_report_is_written_again_by_the_resume(tmp_path: Path) -> None:
    """Regression: a damaged tokenizer/training.json (the held-out report of a sample-trained tokenizer) failed every
    re-run of `ingest` and every `audit` with `error: JSONDecodeError: unexpected character ...`, exit 1, naming no
    file. It is taken as missing: the resume writes it again, the same bytes."""
    from streamprep.audit import gather

    corpus = tmp_path / "in.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    raw = base_config([{"name": "a", "path": str(corpus)}], None, output={"shard_records": 50})
    raw["tokenizer"]["train"]["sample_mb"] = 0.01
    run = tmp_path / "run"
    assert run_from_dict(raw, run_dir=run, console_log=False).status == "complete"
    report = run / "tokenizer" / "training.json"
    good = report.read_bytes()
    for damaged in (b'{"held_out', b"[]"):
        report.write_bytes(damaged)
        assert gather.build_audit(run)[0]["tokenizer_training"] is None
        assert run_from_dict(raw, run_dir=run, console_log=False).status == "complete"
        assert report.read_bytes() == good


def test_the_trained_vocab_size_is_logged_beside_the_requested_one(tmp_path: Path) -> None:
    """Regression: 'tokenizer trained vocab_size=5000' gave train.vocab_size, though the trainer stopped short of it
    on a small text: the log gives the size trained (the tokenizer's own) and the one requested."""
    from structlog.testing import capture_logs

    from streamprep.config import TokenizerConfig
    from streamprep.tokenizer import prepare

    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    raw = base_config([{"name": "a", "path": str(tmp_path / "in.jsonl")}], None)
    raw["tokenizer"]["train"]["vocab_size"] = 5000
    tok_cfg = TokenizerConfig.from_dict(validate(raw)["tokenizer"])
    with capture_logs() as seen:
        info = prepare(tok_cfg, tmp_path / "run", DOCS)
    [trained] = [e for e in seen if e["event"] == "tokenizer trained"]
    assert trained["vocab_size"] == info.vocab_size == Tokenizer.from_file(str(info.path)).get_vocab_size() < 5000
    assert trained["requested_vocab_size"] == 5000


def test_one_long_space_free_record_trains_in_linear_time_and_ordinary_text_as_before() -> None:
    """Regression: tokenizers' BPE trainer merges a pair in a word at O(word length) per occurrence, so one
    320 000-char ACGT record among 50 short ones took 74 s to train (1.5 MB: no end in 300 s). A run of
    non-whitespace longer than TRAIN_RUN_CHARS is trained on in pieces; texts without one give the same bytes."""
    rng = np.random.default_rng(1)
    word = "".join(rng.choice(list("ACGT"), 320_000))
    t0 = time.monotonic()
    long_trained = train_bpe([*DOCS[:50], f"start {word} end"], 1000, 2).to_str()
    assert time.monotonic() - t0 < 20  # ~2 s here
    from tokenizers import ByteLevelBPETokenizer

    from streamprep.tokenizer import SPECIAL_TOKENS, TRAIN_RUN_CHARS

    pieces = [f"start {word[:TRAIN_RUN_CHARS]}"] + [word[i:i + TRAIN_RUN_CHARS] for i in
                                                     range(TRAIN_RUN_CHARS, len(word), TRAIN_RUN_CHARS)]
    pieces[-1] += " end"
    assert long_trained == train_bpe([*DOCS[:50], *pieces], 1000, 2).to_str()
    ordinary = [*DOCS, "x" * TRAIN_RUN_CHARS + " y", "a " + "z" * TRAIN_RUN_CHARS]  # runs at the cap are whole
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(ordinary, vocab_size=600, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                            show_progress=False)
    assert train_bpe(ordinary, 600, 2).to_str() == bpe._tokenizer.to_str()


def test_one_long_whitespace_run_trains_in_linear_time_in_pieces() -> None:
    """Regression: the byte-level pre-tokenizer makes a run of whitespace one word too, but only runs of
    non-whitespace were cut, so a record holding 200 000 newlines (a page padded with blank lines) took 88 s to
    train on 0.8 MB, 400 000 spaces minutes. Such a run is trained on in TRAIN_RUN_CHARS pieces as a long word is."""
    from tokenizers import ByteLevelBPETokenizer

    from streamprep.tokenizer import TRAIN_RUN_CHARS, _cut_long_words

    pre_tokenize = ByteLevelBPETokenizer().pre_tokenizer.pre_tokenize_str
    for blank in ("\n", " ", "\t"):
        record = f"start{blank * 400_000}end"
        cuts = range(5 + TRAIN_RUN_CHARS, 400_004, TRAIN_RUN_CHARS)  # the word: the run but for its last character
        pieces = [record[a:b] for a, b in zip([0, *cuts], [*cuts, len(record)])]
        cut = [0]
        assert list(_cut_long_words([record], pre_tokenize, cut)) == pieces and cut == [1]
        t0 = time.monotonic()
        trained = train_bpe([*DOCS[:50], record], 1000, 2).to_str()
        assert time.monotonic() - t0 < 20  # ~0.5 s here; minutes before
        assert trained == _trained_whole([*DOCS[:50], *pieces], 1000)


def _trained_whole(texts: list[str], vocab_size: int) -> str:
    """tokenizer.json of a byte-level BPE trained on `texts` as they are (train_bpe before long words were cut)."""
    from tokenizers import ByteLevelBPETokenizer

    from streamprep.tokenizer import SPECIAL_TOKENS

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                            show_progress=False)
    return bpe._tokenizer.to_str()


def test_a_long_run_the_pre_tokenizer_splits_into_short_words_trains_as_it_did_whole() -> None:
    """Regression: every run of non-whitespace over TRAIN_RUN_CHARS was cut, so a minified JSON blob (33 499 chars,
    words of a few chars each) or a long slash-joined path trained other merges than before the cut existed. Only a
    word (the pre-tokenizer's pre-token) over TRAIN_RUN_CHARS is cut: a word inside such a run still is."""
    from streamprep.tokenizer import TRAIN_RUN_CHARS

    blob = json.dumps({f"key{i}": [i, f"value_{i}", {"a": i * 3}] for i in range(900)}, separators=(",", ":"))
    path = "/".join(f"path{i}" for i in range(3000))
    assert len(blob) > TRAIN_RUN_CHARS and len(path) > TRAIN_RUN_CHARS and " " not in blob + path
    for extra in (blob, f"see {path} here"):
        assert train_bpe([*DOCS, extra], 800, 2).to_str() == _trained_whole([*DOCS, extra], 800)
    word = "".join(np.random.default_rng(2).choice(list("acgt"), 2 * TRAIN_RUN_CHARS + 5))
    k = blob.index(',"', 100) + 1
    run = blob[:k] + word + blob[k:]  # one run, `word` one pre-token in it (',' and '"' beside): cut twice
    at = k + TRAIN_RUN_CHARS
    pieces = [run[:at], run[at:at + TRAIN_RUN_CHARS], run[at + TRAIN_RUN_CHARS:]]
    assert train_bpe([*DOCS, run], 800, 2).to_str() == _trained_whole([*DOCS, *pieces], 800)


def test_an_eos_token_not_in_the_vocabulary_is_named_in_a_warning(tmp_path: Path, shared_data: Path) -> None:
    """tokenizer_config.json's eos_token "<|nope|>" (not in phi-3-mini's vocabulary) was replaced by <|endoftext|>
    without a word, where transformers (Megatron's preprocess_data.py) adds it as a new id and appends that."""
    import shutil

    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(shared_data / "tokenizers/phi-3-mini/tokenizer.json", tok / "tokenizer.json")
    (tok / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    (tmp_path / "d.jsonl").write_text('{"text": "hello world"}\n')
    cfg = base_config([{"name": "d", "path": str(tmp_path / "d.jsonl")}], str(tok))
    cfg["quality"] = {"expected_language": None, "min_chars": 1}
    cfg["tokenizer"]["backend"] = "hf"
    assert run_from_dict(cfg, run_dir=tmp_path / "run", console_log=False).status == "complete"
    events = [json.loads(line) for line in (tmp_path / "run/logs/streamprep.log").read_text().splitlines()]
    warned = [e for e in events if "eos_token is not in the vocabulary" in e["event"]]
    assert len(warned) == 1 and warned[0]["eos_token"] == "<|nope|>" and warned[0]["eod_token"] == "<|endoftext|>"
    assert warned[0]["eod_id"] == 32000 and warned[0]["file"].endswith("tokenizer_config.json")


def test_an_eos_token_not_in_the_vocabulary_is_named_when_no_eod_token_is_left(tmp_path: Path, trained) -> None:
    """Regression: with tokenizer_config.json's eos_token "<|nope|>" not in the vocabulary and no other EOD candidate,
    the config error said only that the tokenizer has no end-of-text token: the eos_token the user sees went unnamed."""
    tok, corpus = trained
    tok["model"]["vocab"]["<|end|>"] = tok["model"]["vocab"].pop("</s>")  # no EOD candidate left
    for added in tok["added_tokens"]:
        added["content"] = "<|end|>" if added["content"] == "</s>" else added["content"]
    raw = _config(tmp_path, tok, corpus)
    with pytest.raises(ConfigError) as plain:
        validate(raw)
    assert str(plain.value) == ("config: 'tokenizer.append_eod' is true but the tokenizer has no end-of-text token; "
                                "set 'tokenizer.eod_token'")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|nope|>"}}))
    with pytest.raises(ConfigError) as named:
        validate(raw)
    assert str(named.value) == ("config: 'tokenizer.append_eod' is true but the tokenizer has no end-of-text token "
                                "(its tokenizer_config.json's eos_token '<|nope|>' is not in the vocabulary); "
                                "set 'tokenizer.eod_token'")


def test_a_damaged_copy_is_not_recreated_from_a_tokenizer_path_that_changed(tmp_path: Path, shared_data: Path,
                                                                            capsys) -> None:
    """Regression: a resume that found the run's tokenizer copy damaged (or lacking a side file added at
    tokenizer.path since, or gone) recreated it from tokenizer.path even when that had changed since the run started:
    the run switched tokenizer or EOD id without a config change and redid its shards with it. Now that is a one-line
    config error (exit 2) naming the copy's fault and the change, and no shard is redone; recreating the copy from
    an unchanged tokenizer.path still works."""
    import shutil

    import yaml

    from streamprep.cli import main

    tok = tmp_path / "tok"
    tok.mkdir()
    shutil.copy(shared_data / "tokenizers/phi-2/tokenizer.json", tok / "tokenizer.json")
    corpus = tmp_path / "in.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS))
    cfg = base_config([{"name": "a", "path": str(corpus)}], str(tok), output={"shard_records": 50})
    cfg["tokenizer"]["backend"] = "hf"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    run = tmp_path / "run"
    argv = ["ingest", "--config", str(tmp_path / "c.yaml"), "--run-dir", str(run)]
    assert main(argv) == 0

    def shards() -> dict[str, bytes]:
        return {str(p.relative_to(run)): p.read_bytes() for d in ("receipts", "binidx")
                for p in sorted((run / d).rglob("*")) if p.is_file()}

    record = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**record, "status": "running"}))  # killed after its shards
    done = shards()
    assert len([p for p in done if p.endswith(".bin")]) == 3
    recorded = json.loads((run / "tokenizer/fingerprint.json").read_text())["fingerprint"]
    capsys.readouterr()
    head = (f"streamprep: error: config: 'tokenizer.path': the run's tokenizer copy ({run / 'tokenizer'}) cannot be "
            f"reused ")
    tail = "; restore the run's tokenizer files at tokenizer.path, or use a new run dir"
    # a tokenizer_config.json added at tokenizer.path giving another EOD ('.', 13) than the run's (<|endoftext|>)
    (tok / "tokenizer_config.json").write_text('{"eos_token": "."}')
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"{head}(tokenizer_config.json is missing (tokenizer.path has one)) and the files at {tok} give EOD id 13, "
        f"not the 50256 recorded{tail}")
    assert shards() == done
    # tokenizer.path's tokenizer.json changed, the copy's damaged; then the copy gone altogether
    (tok / "tokenizer_config.json").unlink()
    original = (tok / "tokenizer.json").read_bytes()
    (tok / "tokenizer.json").write_bytes(original + b"\n")
    now = "sha256:" + hashlib.sha256(original + b"\n").hexdigest()
    for fault, damage in (("tokenizer.json does not match its fingerprint",
                           lambda: (run / "tokenizer/tokenizer.json").write_text('{"bro\n')),
                          ("tokenizer.json is missing", lambda: shutil.rmtree(run / "tokenizer"))):
        damage()
        assert main(argv) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == (
            f"{head}({fault}) and {tok / 'tokenizer.json'} is no longer the run's tokenizer (recorded {recorded}, "
            f"now {now}){tail}")
        assert shards() == done
    # the run's file back at tokenizer.path: the copy is recreated from it, and the shards done are kept
    (tok / "tokenizer.json").write_bytes(original)
    assert main(argv) == 0
    assert json.loads((run / "tokenizer/fingerprint.json").read_text())["fingerprint"] == recorded
    assert shards() == done
