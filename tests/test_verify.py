"""`verify_run`: a clean run has no problems; each kind of damage is named by the file it hits."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from streamprep import atomic
from streamprep.verify import verify_run
from test_exports import base_run, export, parquet_entries, relocate  # noqa: F401  (fixture re-used)


@pytest.fixture()
def exported(base_run, tmp_path: Path) -> Path:  # noqa: F811
    src, refs = base_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    export(run, relocate(refs, src, run))
    return run


def _named(problems: list[str], rel: str) -> list[str]:
    return [p for p in problems if rel in p]


def test_clean_run_has_no_problems(exported):
    assert verify_run(exported) == []


def test_megatron_cache_folder_is_tolerated(exported):
    cache = exported / "binidx" / "c4" / "part-00000_text_document" / "cache" / "GPTDataset_indices"
    cache.mkdir(parents=True)
    (cache / "abc-GPTDataset-train-document_index.npy").write_bytes(b"\x93NUMPY")
    (cache / "abc-GPTDataset-train-description.txt").write_text("x")
    assert verify_run(exported) == []


def test_flipped_byte_in_bin(exported):
    path = exported / "binidx" / "c4" / "part-00001_text_document.bin"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    problems = verify_run(exported)
    assert _named(problems, "binidx/c4/part-00001_text_document.bin: SHA-256 mismatch")
    assert all("part-00001_text_document.bin" in p for p in problems), problems


def test_truncated_idx(exported):
    path = exported / "binidx" / "lingua" / "part-00000_text_document.idx"
    path.write_bytes(path.read_bytes()[:-20])
    problems = verify_run(exported)
    rel = "binidx/lingua/part-00000_text_document.idx"
    assert _named(problems, f"{rel}: ") and any("bytes" in p for p in _named(problems, rel))
    assert any("cannot read" in p for p in _named(problems, rel))


def test_bin_shorter_than_idx_says(exported):
    path = exported / "binidx" / "dclm" / "part-00000_text_document.bin"
    path.write_bytes(path.read_bytes()[:-2])
    problems = verify_run(exported)
    assert any("part-00000_text_document.bin" in p and "index says" in p for p in problems), problems


def test_truncated_parquet(exported):
    entry = parquet_entries(exported)[3]
    path = exported / entry["path"]
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    problems = verify_run(exported)
    named = _named(problems, entry["path"])
    assert any("SHA-256" in p for p in named) and any("cannot read" in p for p in named), problems


def test_edited_tsv(exported):
    entry = parquet_entries(exported)[0]
    tsv = exported / entry["tsv"]["path"]
    lines = tsv.read_text().splitlines(keepends=True)
    fields = lines[1].split("\t")
    fields[1] = str(int(fields[1]) + 1)
    lines[1] = "\t".join(fields)
    tsv.write_text("".join(lines))
    problems = verify_run(exported)
    named = _named(problems, entry["tsv"]["path"])
    assert any("SHA-256" in p for p in named) and any("row 0 does not match" in p for p in named), problems


def test_tsv_missing_rows_and_missing_files(exported):
    entries = parquet_entries(exported)
    tsv = exported / entries[0]["tsv"]["path"]
    tsv.write_text("".join(tsv.read_text().splitlines(keepends=True)[:-1]))
    (exported / entries[1]["path"]).unlink()
    problems = verify_run(exported)
    assert any(entries[0]["tsv"]["path"] in p and "rows, manifest.json says" in p for p in problems)
    assert any(entries[1]["path"] in p and "missing" in p for p in problems)


def test_stale_file_and_receipt_mismatch(exported):
    (exported / "parquet" / "shard_b09_s00000.parquet").write_bytes(b"old")
    receipt = exported / "receipts" / "c4" / "part-00002.json"
    rec = atomic.read_json(receipt)
    rec["stats"]["num_tokens"] += 1
    atomic.write_json(receipt, rec)
    problems = verify_run(exported)
    assert any("parquet/shard_b09_s00000.parquet: not listed" in p for p in problems)
    assert any("binidx/c4/part-00002_text_document.idx" in p and "tokens" in p for p in problems)


def test_missing_manifest(tmp_path):
    assert verify_run(tmp_path) == ["manifest.json: missing (exports not written yet?)"]


def test_malformed_receipt_and_manifest_entry_reported_not_raised(exported):
    receipt = exported / "receipts" / "dclm" / "part-00000.json"
    rec = atomic.read_json(receipt)
    del rec["files"]["bin"]["path"]
    atomic.write_json(receipt, rec)
    man = atomic.read_json(exported / "manifest.json")
    del man["shards"][0]["path"]
    atomic.write_json(exported / "manifest.json", man)
    problems = verify_run(exported)
    assert any(p.startswith("receipts/dclm/part-00000.json: malformed receipt") for p in problems), problems
    assert any(p.startswith("manifest.json: shards[0] is malformed") for p in problems), problems
