"""A shard task's retry removes exactly the temporary files a killed writer of that task left."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
import pytest

from streamprep import atomic
from streamprep.textshard import canonical_meta, columns_header
from streamprep.tokenize import drop_tmp_files


def test_drop_tmp_files_removes_this_tasks_temporary_files_and_nothing_else(tmp_path: Path) -> None:
    bins, receipts = tmp_path / "binidx", tmp_path / "receipts"
    bins.mkdir()
    receipts.mkdir()
    kept = [bins / "part-00007_text_document.bin", bins / "part-00070_text_document.bin",  # another task's output
            bins / ".part-00007_text_document.idx.streamprep-tmp.abc",  # not a name atomic.tmp_path makes
            bins / f".part-00070_text_document.bin{atomic.TMP_MARK}12", receipts / "part-00007.json"]
    stale = [atomic.tmp_path(bins / "part-00007_text_document.bin"),
             bins / f".part-00007_text_document.idx{atomic.TMP_MARK}9",
             receipts / f".part-00007.json{atomic.TMP_MARK}31"]
    columns = tmp_path / "parquet" / ".order" / "d" / "part-00007.columns"  # RunLayout.part_columns
    columns.parent.mkdir(parents=True)
    stale.append(atomic.tmp_path(columns))
    kept.append(columns.with_name(f".part-00070.columns{atomic.TMP_MARK}5"))
    for p in kept + stale:
        p.touch()
    task = SimpleNamespace(prefix=str(bins / "part-00007_text_document"), receipt_path=str(receipts / "part-00007.json"),
                           columns_path=columns)
    drop_tmp_files(task)  # type: ignore[arg-type]
    assert [p.exists() for p in kept] == [True] * len(kept) and not any(p.exists() for p in stale)
    nowhere = SimpleNamespace(prefix=str(tmp_path / "none/p"), receipt_path=str(tmp_path / "none/r.json"),
                              columns_path=None)
    drop_tmp_files(nowhere)  # type: ignore[arg-type]  # directories not made yet: nothing to drop, no error


def test_only_a_retried_local_task_drops_temporary_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (perf: every task scanned binidx/ and receipts/ in full, ~7 ms a task beside 8 k shards, so
    tokenizing grew with the square of the shard count): the job's start swept every temporary file, so a first
    attempt drops none; the executor's retry after a dead worker (`executor.again`) drops its own first."""
    from streamprep.engines import local
    from streamprep.executor import again

    dropped: list = []
    monkeypatch.setattr(local, "drop_tmp_files", dropped.append)
    monkeypatch.setattr(local, "run_shard", lambda task, tokenizer: {"task": task})
    monkeypatch.setattr(local._tokenizers, "get", lambda task: None)
    assert local.run_local("first") == {"task": "first"} and dropped == []  # type: ignore[arg-type]
    assert again(local.run_local)("retry") == {"task": "retry"} and dropped == ["retry"]  # type: ignore[arg-type]


@pytest.mark.parametrize("run_ordered", [True, False])
def test_a_part_summary_from_the_tokenizers_scan_is_the_one_read_back(tmp_path: Path, monkeypatch,
                                                                       run_ordered: bool) -> None:
    """A worker summarizes a part it just tokenized from the lines its tokenizing parsed (`textshard.LineScan`,
    `engines.base.run_shard`), without reading them again: the cache file is byte for byte the one
    `summarize_part` makes from the files, with a record that encodes to nothing (dropped) and metas of every
    shape; the receipt holds no scan. Its columns file holds the part's texts, metas and tokens in its run's order
    (format 2), or for a part too large to keep, texts and metas in `.idx` order (format 1)."""
    from helpers import english_docs
    from streamprep import modes
    from streamprep.engines.base import run_shard
    from streamprep.exports import ShardRef, columns, summary
    from streamprep.modes import PRETRAIN
    from streamprep.tokenize import make_task, read_receipt
    from streamprep.tokenizer import train_bpe

    docs = english_docs(40)
    tok = tmp_path / "tokenizer.json"
    tok.write_text(train_bpe(docs, 400, 2).to_str())
    part = tmp_path / "ingest" / "d" / "part-00000.jsonl"
    part.parent.mkdir(parents=True)
    metas = [{"z": 1, "a": [1.5, None]}, {}, None, {"é": "ü", "b": {"y": True, "c": "x"}}]
    lines = [orjson.dumps({"text": t, "meta": metas[i % 4]} if i % 5 else {"text": t}) for i, t in enumerate(docs)]
    lines[7] = orjson.dumps({"text": "", "meta": {"k": 2}})  # no tokens: dropped from the .idx and the summary
    part.write_bytes(b"\n".join(lines) + b"\n")
    task = replace(make_task(tmp_path, "d", "train", part, tok, "sha256:t", 0, "uint16"), first_ordinal=0,
                   order_seed=1, length_buckets=(8, 64))  # a job with Parquet exports: its columns file too
    with monkeypatch.context() as m:
        m.setattr(summary, "_scan_ingest", lambda *a: pytest.fail("the part was read again for its summary"))
        if not run_ordered:  # a part over the size kept in memory: its columns streamed in `.idx` order
            m.setattr(modes, "RUN_COLUMNS_BYTES", part.stat().st_size - 1)
        result = run_shard(task, PRETRAIN.load_tokenizer(str(tok)))
    receipt = read_receipt(task)
    assert "scan" not in result and "scan" not in receipt["stats"] and receipt["stats"]["dropped_empty"] == [7]
    ref = ShardRef.from_task(task, receipt)
    written = summary.cache_path(ref).read_bytes()
    assert written == summary.encode(summary.summarize_part(ref), receipt)
    assert summary.load_cached(ref).records["text_bytes"].tolist() == \
        [len(d.encode()) for i, d in enumerate(docs) if i != 7]
    records = [orjson.loads(line) for i, line in enumerate(lines) if i != 7]
    data = ref.columns.read_bytes()
    assert sorted(p.name for p in ref.columns.parent.iterdir()) == ["part-00000.columns", "part-00000.run"]
    if not run_ordered:
        assert data == columns_header("d", "part-00000", task.input_sha256, task.plan_hash) + \
            b"".join(r["text"].encode() + canonical_meta(r) for r in records)
        return
    run = (ref.columns.parent / "part-00000.run").read_bytes()
    run_header, payload = orjson.loads(run.split(b"\n", 1)[0]), run.split(b"\n", 1)[1]
    order = np.frombuffer(payload, dtype="<i8")[len(records):2 * len(records)]  # keys, rows, estimates
    at = columns.sections(data[:columns.HEADER_READ], "d/part-00000",
                          {"input_sha256": task.input_sha256, "plan_hash": task.plan_hash}, run_header["payload_sha256"])
    assert at is not None and sorted(order.tolist()) == list(range(len(records)))
    ordered = [records[i] for i in order.tolist()]
    tokens = np.fromfile(f"{task.prefix}.bin", dtype=np.uint16)
    assert data[at.lines:at.text] == np.array([[i for i in range(len(lines)) if i != 7][j] for j in order.tolist()],
                                              dtype="<i8").tobytes()
    assert data[at.text:at.meta] == b"".join(r["text"].encode() for r in ordered)
    assert data[at.meta:at.tokens] == b"".join(canonical_meta(r) for r in ordered)
    n_tokens = summary.load_cached(ref).records["n_tokens"]
    ends = np.cumsum(n_tokens)
    assert data[at.tokens:] == b"".join(tokens[ends[i] - n_tokens[i]:ends[i]].tobytes() for i in order.tolist())



def _shard(tmp_path: Path) -> tuple[Any, Any, dict[str, Any]]:
    """A tokenized part of 21 lines, line 5 empty: (its task, the encoder, its receipt)."""
    from helpers import english_docs
    from streamprep.modes import PRETRAIN
    from streamprep.tokenize import make_task, receipt_problem, run_task
    from streamprep.tokenizer import train_bpe

    docs = english_docs(20)
    tok = tmp_path / "tokenizer.json"
    tok.write_text(train_bpe(docs, 400, 2).to_str())
    part = tmp_path / "ingest" / "d" / "part-00000.jsonl"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in [*docs[:5], "", *docs[5:]]))
    task = make_task(tmp_path, "d", "train", part, tok, "sha256:t", 0, "uint16")
    encoder = PRETRAIN.load_tokenizer(str(tok))
    assert run_task(task, encoder)["skipped"] is False
    receipt = orjson.loads(Path(task.receipt_path).read_bytes())
    assert receipt_problem(task, receipt) is None
    assert (receipt["stats"]["num_documents"], receipt["stats"]["dropped_empty"]) == (20, [5])
    return task, encoder, receipt


def _redone(task: Any, encoder: Any, receipt: dict[str, Any], edits: dict[str, dict[str, Any]]) -> None:
    """Each edit of the receipt is a reason to redo the shard, and the redo writes the receipt back as it was."""
    from streamprep.tokenize import receipt_problem, run_task

    path = Path(task.receipt_path)
    written = path.read_bytes()
    for what, edit in edits.items():
        edited = {**receipt, **edit}
        assert receipt_problem(task, edited) is not None, what
        atomic.write_json(path, edited)
        assert run_task(task, encoder)["skipped"] is False, what
        assert path.read_bytes() == written, what
    assert run_task(task, encoder)["skipped"] is True


@pytest.mark.parametrize("changed", ["sealed_record", "part"])
def test_a_part_whose_sha256_is_not_its_sealed_records_is_refused_before_its_receipt(tmp_path: Path,
                                                                                     changed: str) -> None:
    """Regression: resumes check a sealed part's size only, so a flipped byte in its `<ds>.sealed` record (or a part
    changed at the same size) went into the receipt's `input_sha256` and manifest.json, and only `verify` saw it.
    A task whose hash a resume read back hashes its part before writing its shard: the error names the part, both
    hashes and the log; one whose part was sealed in its job is not hashed again."""
    import hashlib

    from streamprep.config import ConfigError
    from streamprep.tokenize import run_task

    task, encoder, _ = _shard(tmp_path)
    assert not task.check_input
    task = replace(task, check_input=True)
    part = Path(task.input_path)
    if changed == "part":  # not tokenized yet (a receipt of the part as sealed is its skip, its hash not read)
        part.write_bytes(part.read_bytes().replace(b"a", b"b", 1))
        Path(task.receipt_path).unlink()
    else:
        task = replace(task, input_sha256="0" * 64)
    written = Path(task.receipt_path).read_bytes() if changed != "part" else b"(none)"
    with pytest.raises(ConfigError) as refused:  # exit 2, needing a change (test_cli)
        run_task(task, encoder)
    assert str(refused.value) == (
        f"ingest/d/part-00000.jsonl: its SHA-256 is {hashlib.sha256(part.read_bytes()).hexdigest()}, not the "
        f"{task.input_sha256} its dataset's sealed log (d.sealed in the checkpoint dir) recorded as ingest sealed it: "
        f"the part or that record changed since (a damaged disk or an edit); delete the part (or d.sealed) and re-run "
        f"the same command, which ingests dataset d again, or start over with a new --run-dir")
    receipt_path = Path(task.receipt_path)
    assert (receipt_path.read_bytes() if receipt_path.exists() else b"(none)") == written  # none written


def test_a_receipt_edited_in_its_identity_has_its_shard_redone_to_the_same_bytes(tmp_path: Path) -> None:
    """Regression: a shard was skipped whenever its plan hash, input hash and files matched, whatever its receipt's
    other fields said: an EOD id, dtype, split or fingerprint edited in a receipt was kept, the exports signed it,
    and `verify` read the shard against it and failed (or passed a receipt naming the wrong EOD id)."""
    task, encoder, receipt = _shard(tmp_path)
    _redone(task, encoder, receipt, {"eod_id": {"eod_id": 1}, "dtype": {"dtype": "int32"}, "split": {"split": "valid"},
                                     "tokenizer_fingerprint": {"tokenizer_fingerprint": "sha256:u"},
                                     "dataset": {"dataset": "e"}, "part": {"part": "part-00001"}})


def test_a_receipt_whose_counts_are_not_its_shards_has_the_shard_redone(tmp_path: Path) -> None:
    """Regression: a receipt whose token or document count was edited (its files untouched) was skipped on every
    re-run, and the exports refused it each time (`ExportError: … .idx holds 3835 tokens, receipt says 3834`): a run
    that could never finish. Counts that disagree with the `.idx` or with each other now redo the shard."""
    task, encoder, receipt = _shard(tmp_path)
    stats = receipt["stats"]
    _redone(task, encoder, receipt, {
        "num_tokens": {"stats": {**stats, "num_tokens": stats["num_tokens"] - 1}},
        "num_documents": {"stats": {**stats, "num_documents": 19, "num_input_records": 20}},
        "dropped_empty": {"stats": {**stats, "dropped_empty": [5, 6]}},
        "dropped_empty out of the part": {"stats": {**stats, "dropped_empty": [21]}},
        "num_input_records": {"stats": {**stats, "num_input_records": 22}},
        "stats": {"stats": {**stats, "num_tokens": "many"}}})
