"""`verify_run`: a clean run has no problems; each kind of damage is named by the file it hits."""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import pytest

from streamprep import atomic
from streamprep.verify import verify_run
from export_run import export, parquet_entries, relocate
from helpers import REPO


@pytest.fixture()
def exported(base_run, tmp_path: Path) -> Path:  # noqa: F811
    src, refs = base_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    summary = export(run, relocate(refs, src, run))
    atomic.write_json(run / "run.json", {"status": "complete", "manifest_sha256": summary["manifest_sha256"]})
    return run


def _named(problems: list[str], rel: str) -> list[str]:
    return [p for p in problems if rel in p]


@pytest.mark.slow
def test_clean_run_has_no_problems(exported):
    assert verify_run(exported) == []


def test_json_files_of_the_wrong_shape_are_each_reported_once(exported):
    """mixtures.json as a JSON list used to pass its own checks silently; an unreadable run.json was reported
    twice (cannot read + not a JSON object)."""
    (exported / "mixtures.json").write_text("[]")
    (exported / "run.json").write_text("{not json")
    problems = verify_run(exported)
    assert "mixtures.json: not a JSON object" in problems
    assert [p for p in problems if p.startswith("run.json:")] == [p for p in problems if "run.json: cannot read" in p]
    assert len([p for p in problems if p.startswith("run.json:")]) == 1


def test_manifest_and_run_json_fields_of_the_wrong_type_are_problems_not_a_crash(exported):
    """Regression: a manifest whose sections were numbers, or a run.json whose manifest_sha256 was a list, made
    `verify` fail with a bare AttributeError/TypeError (exit 1) instead of listing the problems."""
    man = atomic.read_json(exported / "manifest.json")
    atomic.write_json(exported / "manifest.json", {**man, "tokenizer": 5, "files": 5, "shards": 5, "buckets": 5})
    atomic.write_json(exported / "run.json", {**atomic.read_json(exported / "run.json"), "manifest_sha256": ["x"]})
    problems = verify_run(exported)
    assert problems[:5] == ["run.json: manifest_sha256 is not a SHA-256 string",
                            "manifest.json: `tokenizer` is not a JSON object", "manifest.json: `files` is not a list",
                            "manifest.json: `shards` is not a list", "manifest.json: `buckets` is not a list"]


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


def test_a_file_it_may_not_read_is_one_problem_and_the_other_files_are_still_checked(exported, monkeypatch):
    """Regression: a shard it may not read (`chmod 000`) ended `verify` with a raw PermissionError, exit 1, and a
    byte changed in another shard was never reported: the hash was read outside `guarded`. Each is a problem now;
    an unreadable Parquet shard is named once, not again by its row scan. (Simulated: root reads through
    permission bits.)"""
    import errno

    flipped = exported / "binidx/c4/part-00001_text_document.bin"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    parquet = parquet_entries(exported)[0]["path"]
    refused, sha256_file = {exported / "binidx/c4/part-00000_text_document.bin", exported / parquet}, \
        atomic.sha256_file

    def sha(path: Any, *args: Any) -> str:
        if Path(path) in refused:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return sha256_file(path, *args)
    monkeypatch.setattr(atomic, "sha256_file", sha)
    problems = verify_run(exported)
    for rel in ("binidx/c4/part-00000_text_document.bin", parquet):
        assert _named(problems, rel) == [f"{rel}: cannot read: PermissionError: [Errno 13] Permission denied: '{rel}'"]
    assert _named(problems, "binidx/c4/part-00001_text_document.bin: SHA-256 mismatch"), problems


@pytest.mark.parametrize("closed", ["receipts/c4", "binidx/c4", "ingest/c4", "parquet"])
def test_a_folder_it_may_not_enter_or_list_is_one_problem_and_the_rest_is_checked(exported, closed):
    """Regression: a folder of the run made `chmod 000` ended `verify` with a raw "PermissionError: [Errno 13]
    Permission denied: …" at the first file in it, exit 1, the rest unchecked. The folder is one problem, naming it
    (not each file in it "missing", nor, its receipts unseen, the ingest parts "stale"), and a byte changed
    elsewhere is still found. (Real permissions: `streamprep_obeying_permissions` drops root's override.)"""
    from helpers import streamprep_obeying_permissions

    flipped = exported / "binidx/lingua/part-00000_text_document.bin"
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    (exported / closed).chmod(0)
    try:
        proc = streamprep_obeying_permissions(["verify", str(exported)])
    finally:
        (exported / closed).chmod(0o755)
    out = proc.stdout.splitlines()
    assert proc.returncode == 1 and proc.stderr == "", proc.stderr
    assert f"{closed}: cannot read: PermissionError: a folder it may not list or enter; make it readable and " \
           f"searchable" in out, out
    assert [p for p in out if p.startswith(f"{closed}/") or "stale file" in p or ": missing" in p] == [], out
    assert any(p.startswith("binidx/lingua/part-00000_text_document.bin: SHA-256 mismatch") for p in out), out


def test_a_part_whose_receipt_it_may_not_read_is_not_stale_and_the_advice_is_to_make_it_readable(exported):
    """Regression: a receipt made `chmod 000` was a problem, and so was its part, "ingest/c4/part-00001.jsonl: not
    listed in manifest.json or any receipt (stale file?)", under "to repair: delete each damaged file named above":
    following it deleted the part's data. The part is not called stale, and the advice for what it cannot read is
    to make it readable; a damaged file elsewhere is still to delete. (Real permissions:
    `streamprep_obeying_permissions` drops root's override.)"""
    from helpers import streamprep_obeying_permissions

    receipt, part = exported / "receipts/c4/part-00001.json", "ingest/c4/part-00001.jsonl"
    assert (exported / part).is_file()
    receipt.chmod(0)
    try:
        proc = streamprep_obeying_permissions(["verify", str(exported)])
        out = proc.stdout.splitlines()
        assert proc.returncode == 1 and not _named(out, part), out
        assert out[-2:] == ["to repair: make each file or folder named above that it cannot read readable (a folder "
                            "searchable too), then re-run `streamprep verify`", "streamprep: verify: 1 problem(s)"]
        flipped = exported / "binidx/lingua/part-00000_text_document.bin"
        flipped.write_bytes(flipped.read_bytes()[:-1] + bytes([flipped.read_bytes()[-1] ^ 1]))
        out = streamprep_obeying_permissions(["verify", str(exported)]).stdout.splitlines()
        assert out[-3:-1] == [
            "to repair: make each file or folder named above that it cannot read readable (a folder searchable too), "
            "then re-run `streamprep verify`",
            "to repair the rest: delete each other damaged file named above, then re-run the same `streamprep "
            "ingest` command; it rewrites what is missing to the same bytes"], out
    finally:
        receipt.chmod(0o644)


def test_truncated_idx(exported):
    path = exported / "binidx" / "lingua" / "part-00000_text_document.idx"
    path.write_bytes(path.read_bytes()[:-20])
    problems = verify_run(exported)
    rel = "binidx/lingua/part-00000_text_document.idx"
    assert _named(problems, f"{rel}: ") and any("bytes" in p for p in _named(problems, rel))
    assert any("cannot read" in p for p in _named(problems, rel))


@pytest.mark.slow
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
    # the receipt is what changed: it is named against manifest.json, not its intact .idx against the receipt
    assert any(p.startswith("receipts/c4/part-00002.json: content differs from manifest.json") for p in problems)
    assert not any("binidx/c4/part-00002_text_document.idx" in p for p in problems), problems


def test_missing_manifest(tmp_path):
    assert verify_run(tmp_path) == [
        "run.json: missing (it records manifest.json's SHA-256, the root of the hash chain)",
        "manifest.json: missing (exports not written yet?)"]


def test_a_complete_run_without_its_manifest_is_that_one_problem(exported):
    """Regression: with manifest.json gone, every Parquet shard, receipt and tokenizer file was also "not listed ...
    (stale file?)", 47 lines for one missing file."""
    (exported / "manifest.json").unlink()
    assert [p for p in verify_run(exported) if "manifest.json" not in p.split(":")[0]] == []
    # regression: "(exports not written yet?)", for a run whose run.json says its exports were written
    assert verify_run(exported) == [("manifest.json: missing (run.json says the run is complete: re-run the same "
                                     "`streamprep ingest` command to write it again)")]
    (exported / "manifest.json").mkdir()  # regression: the same "not written yet?", for a folder not ours to remove
    assert verify_run(exported) == [("manifest.json: missing (a folder is in its place: remove it, then re-run the "
                                     "same `streamprep ingest` command)")]


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


# -- the hash chain on a real pipeline run: run.json → manifest.json → every artifact ---------------------
Edit = Callable[[Path], None]


def _json_edit(fn: Callable[[Any], None]) -> Edit:
    """An edit that keeps the file valid JSON (the kind a checksum-less reader would accept)."""
    def edit(path: Path) -> None:
        obj = atomic.read_json(path)
        fn(obj)
        atomic.write_json(path, obj)
    return edit


def _flip(offset: float) -> Edit:
    def edit(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[int(len(data) * offset)] ^= 0x01
        path.write_bytes(bytes(data))
    return edit


def _swap_shard_id(man: dict) -> None:
    a, b = man["shards"][0], man["shards"][-1]
    a["shard_id"], b["shard_id"] = b["shard_id"], a["shard_id"]


def _swap_mixture_shard(mix: dict) -> None:  # a valid id of the other source: the manifest still lists it
    mix["sources"]["c4"]["shards"][0] = mix["sources"]["dclm"]["shards"][0]


def _set(*keys: str | int, value: Any = None, add: Any = None) -> Edit:
    def fn(obj: Any) -> None:
        for k in keys[:-1]:
            obj = obj[k]
        obj[keys[-1]] = value if add is None else obj[keys[-1]] + add
    return _json_edit(fn)


@pytest.fixture(scope="module")
def pipeline_run(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from helpers import PHI2, base_config

    from streamprep import run_from_dict

    run_dir = tmp_path_factory.mktemp("chain") / "run"
    cfg = base_config([{"name": "c4", "path": str(shared_data / "web/c4_en_train00000_first1000.jsonl"),
                        "weight": 0.394},
                       {"name": "dclm", "path": str(shared_data / "web/dclm_quality_*.jsonl")}],
                      str(shared_data / PHI2), output={"shard_records": 300})
    run_from_dict(cfg, run_dir=run_dir, console_log=False)
    return run_dir


@pytest.fixture()
def chain_run(pipeline_run: Path):
    """The module's run, restored after the test (copying it would move blend.json's absolute prefixes)."""
    saved: dict[Path, bytes | None] = {}

    def touch(rel: str, edit: Edit | None = None, data: bytes | None = None) -> Path:
        path = pipeline_run / rel
        saved.setdefault(path, path.read_bytes() if path.exists() else None)
        if edit is not None:
            edit(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data or b"")
        return path

    yield pipeline_run, touch
    for path, data in saved.items():
        if data is None:
            path.unlink()
        else:
            path.write_bytes(data)
    assert verify_run(pipeline_run) == []


@pytest.mark.slow
def test_real_run_verifies_and_records_the_chain(chain_run):
    run, _ = chain_run
    record, man = atomic.read_json(run / "run.json"), atomic.read_json(run / "manifest.json")
    assert record["manifest_sha256"] == atomic.sha256_file(run / "manifest.json")
    roles = {e["path"]: e["role"] for e in man["files"]}
    receipts = sorted(str(p.relative_to(run)) for p in (run / "receipts").rglob("*.json"))
    assert [p for p, r in roles.items() if r == "receipt"] == receipts and len(receipts) == 6
    assert {p for p, r in roles.items() if r != "receipt"} == {
        "blend.json", "mixtures.json", "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
        "tokenizer/fingerprint.json"}
    assert verify_run(run) == []
    assert subprocess.run([sys.executable, "-m", "streamprep", "verify", str(run)], capture_output=True,
                          env=_env()).returncode == 0


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


# (file to tamper with, how, the file verify must name)
TAMPER = {
    "blend_bit_flip": ("blend.json", _flip(0.5), "blend.json"),
    "blend_weight": ("blend.json", _json_edit(lambda b: b["train"].__setitem__(
        0, str(round(float(b["train"][0]) + 0.1, 12)))), "blend.json"),
    "blend_prefix": ("blend.json", _json_edit(lambda b: b["train"].__setitem__(1, b["train"][3])), "blend.json"),
    "tokenizer_json": ("tokenizer/tokenizer.json", _set("added_tokens", 0, "content", value="<|end|>"),
                       "tokenizer/tokenizer.json"),
    "tokenizer_fingerprint": ("tokenizer/fingerprint.json", _set("eod_id", add=1), "tokenizer/fingerprint.json"),
    "manifest_seed": ("manifest.json", _set("seed", add=1), "manifest.json"),
    "manifest_weight": ("manifest.json", _set("datasets", "c4", "weight", value=0.494), "manifest.json"),
    "manifest_bucket_bounds": ("manifest.json", _set("buckets", 0, "max_tokens", add=1), "manifest.json"),
    "manifest_shard_ids": ("manifest.json", _json_edit(_swap_shard_id), "manifest.json"),
    "mixtures_token_count": ("mixtures.json", _set("sources", "c4", "num_tokens", add=1), "mixtures.json"),
    "mixtures_swapped_shard": ("mixtures.json", _json_edit(_swap_mixture_shard), "mixtures.json"),
    "receipt_input_sha256": ("receipts/c4/part-00001.json", _set("input_sha256", value="0" * 64),
                             "receipts/c4/part-00001.json"),
    "receipt_plan_hash": ("receipts/c4/part-00001.json", _set("plan_hash", value="0123456789abcdef"),
                          "receipts/c4/part-00001.json"),
    "receipt_record_count": ("receipts/dclm/part-00000.json", _set("stats", "num_input_records", add=1),
                             "receipts/dclm/part-00000.json"),
    "bin_byte_flip": ("binidx/dclm/part-00001_text_document.bin", _flip(0.3),
                      "binidx/dclm/part-00001_text_document.bin"),
    "ingest_part": ("ingest/c4/part-00002.jsonl", _flip(0.7), "ingest/c4/part-00002.jsonl"),
    "run_json_manifest_hash": ("run.json", _set("manifest_sha256", value="f" * 64), "manifest.json"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(TAMPER))
def test_every_tampering_is_named(chain_run, case):
    run, touch = chain_run
    rel, edit, named = TAMPER[case]
    touch(rel, edit)
    problems = verify_run(run)
    assert _named(problems, f"{named}: "), problems
    if named == "manifest.json":  # fields with no other witness: the run.json → manifest.json link names it
        assert any(p.startswith("manifest.json: SHA-256 mismatch (run.json says") for p in problems), problems


@pytest.mark.slow
def test_verify_cli_exit_code_on_tampering(chain_run):
    run, touch = chain_run
    touch("blend.json", TAMPER["blend_weight"][1])
    out = subprocess.run([sys.executable, "-m", "streamprep", "verify", str(run)], capture_output=True, text=True,
                         env=_env())
    assert out.returncode == 1 and out.stdout.startswith("blend.json: content differs from manifest.json"), out
    assert out.stdout.splitlines()[-2:] == [  # how to repair it: a finished run's re-run reads no large file whole
        ("to repair: delete each damaged file named above, then re-run the same `streamprep ingest` command; it "
         "rewrites what is missing to the same bytes"), "streamprep: verify: 1 problem(s)"], out


def test_every_bit_flip_in_blend_breaks_its_link(pipeline_run):
    """The issue's 100 bit flips: each changes the digest verify compares with manifest.json's entry, and verify
    itself names blend.json for every tenth of them."""
    from streamprep.exports import chain

    entry = next(e for e in atomic.read_json(pipeline_run / "manifest.json")["files"] if e["path"] == "blend.json")
    original = (pipeline_run / "blend.json").read_bytes()
    rng = random.Random(13)
    try:
        for i in range(100):
            data = bytearray(original)
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            (pipeline_run / "blend.json").write_bytes(bytes(data))
            assert chain.digest(pipeline_run, "blend.json") != (entry["sha256"], entry["size_bytes"])
            if i % 10 == 0:
                assert _named(verify_run(pipeline_run), "blend.json: ")
    finally:
        (pipeline_run / "blend.json").write_bytes(original)
    assert chain.digest(pipeline_run, "blend.json") == (entry["sha256"], entry["size_bytes"])


@pytest.mark.parametrize("rel", ["tokenizer/vocab.txt", "receipts/c4/part-00009.json", "ingest/c4/part-00009.jsonl",
                                 "sft/c4/x_s0000.meta.json"])
def test_unlisted_files_are_reported(chain_run, rel):
    run, touch = chain_run
    touch(rel, data=b"{}")
    assert _named(verify_run(run), f"{rel}: not listed in manifest.json or any receipt"), rel


@pytest.mark.parametrize("damage", ["missing", "not JSON"])
def test_a_part_whose_receipt_is_missing_or_damaged_is_not_called_stale(chain_run, damage):
    """Regression (hunter R50 X2): with a receipt removed (or not JSON), its intact ingest part was "not listed in
    manifest.json or any receipt (stale file?)" under "to repair: delete each damaged file named above", and
    deleting it made the re-run ingest the whole dataset again. manifest.json lists that receipt: the receipt is the
    one problem, which re-running the same command redoes from the part."""
    run, touch = chain_run
    receipt, part = "receipts/c4/part-00001.json", "ingest/c4/part-00001.jsonl"
    assert (run / part).is_file()
    touch(receipt, Path.unlink if damage == "missing" else lambda p: p.write_bytes(b"garbage"))
    problems = verify_run(run)
    assert problems and all(p.startswith(f"{receipt}: ") for p in problems), problems
    if damage == "missing":
        assert problems == [f"{receipt}: missing (listed in manifest.json)"]
    stray = "ingest/c4/part-00000.jsonl.bak"  # beside a part whose receipt is sound, a stray file is still one
    touch(stray, data=b"{}")
    assert verify_run(run)[len(problems):] == [f"{stray}: not listed in manifest.json or any receipt (stale file?)"]


def test_incomplete_or_pre_chain_run_json(chain_run):
    """Regression: on a run not finished (crashed, failed, or running) every receipt, tokenizer file and part was
    reported "not listed ... (stale file?)" beside run.json, and the repair line said to delete each: done on a live
    run it killed the job. It is now one line saying to finish the run, and no repair line."""
    run, touch = chain_run
    touch("receipts/c4/part-00009.json", data=b"{}")  # unlisted: a live run's newest receipt
    touch("run.json", _json_edit(lambda r: (r.pop("manifest_sha256"), r.update(status="failed"))))
    assert verify_run(run) == [
        "run.json: status 'failed', not complete: the run is under way or stopped before its end (`streamprep "
        "status` says which); verify checks a finished run: re-run the same `streamprep ingest` command to finish it"]
    out = subprocess.run([sys.executable, "-m", "streamprep", "verify", str(run)], capture_output=True, text=True)
    assert out.returncode == 1 and "to repair" not in out.stdout
    # regression: a run that failed on an exit-2 error was told to re-run the same command, which fails the same way
    touch("run.json", _json_edit(lambda r: r.update(needs_change=True)))
    assert verify_run(run) == [
        "run.json: status 'failed', not complete: it stopped on an error re-running as is cannot get past (`streamprep "
        "status` shows it); fix what it names and re-run, or start over with a new --run-dir"]
    touch("run.json", _json_edit(lambda r: r.update(status="complete")))
    assert verify_run(run)[0] == "run.json: records no manifest_sha256 (written before the hash chain existed?)"


@pytest.mark.parametrize("rel, edit, why", [
    ("checkpoints/c4.json", lambda p: p.write_bytes(p.read_bytes()[:20]),
     "ValueError: c4.json is not JSON (unexpected end of data: line 1 column 21 (char 20))"),
    ("checkpoints/dclm.json", Path.unlink,
     "ValueError: dclm.json is missing, and dataset 'dclm' ran (its plan, parts or rejects are there)"),
    ("checkpoints/c4.json", _json_edit(lambda c: c.update(sealed=[[None, 0], [5, 0]])),
     "ValueError: c4.json: its `sealed` (an earlier streamprep's) is not a list of [SHA-256 hex, bytes] entries "
     "([[null,0],[5,0]])")])
def test_a_damaged_checkpoint_is_a_problem_as_status_says(chain_run, rel, edit, why):
    """Regression: verify ignored checkpoints/, so a complete run whose checkpoint was truncated or missing passed
    ("all files match", exit 0) while `status` and `audit` refused it (exit 2) and a re-run restarted its dataset.
    And an earlier streamprep's checkpoint listing its sealed parts with a SHA-256 that is null or a number (which a
    resume restarts) showed COMPLETE in `status` and stopped verify with a bare TypeError (exit 1)."""
    from streamprep.layout import NotARunDir
    from streamprep.status import run_status

    run, touch = chain_run
    touch(rel, edit)
    line = (f"{run}: a checkpoint or receipt is damaged ({why}); `streamprep ingest` with the run's config repairs it "
            f"(a checkpoint restarts its dataset, a receipt its shard)")
    assert verify_run(run) == [line]
    with pytest.raises(NotARunDir) as status_error:
        run_status(run)
    assert str(status_error.value) == line
    out = subprocess.run([sys.executable, "-m", "streamprep", "verify", str(run)], capture_output=True, text=True,
                         env=_env())
    assert out.returncode == 1 and out.stdout.splitlines()[0] == line
    assert out.stdout.splitlines()[-1] == "streamprep: verify: 1 problem(s)"


def test_a_sealed_log_record_that_is_not_its_receipts_is_a_problem_saying_what_to_delete(chain_run):
    """Regression: a flipped byte in a `<ds>.sealed` record passed verify ("all files match", exit 0; `status`
    complete), and the resume that hashed that part then failed blaming the intact part. The record is held against
    its part's receipt's input_sha256 (the part is held against the receipt): its line names the log to delete."""
    import hashlib

    run, touch = chain_run

    def flip(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[40 + 5] ^= 1  # part-00001's record, its 6th byte
        path.write_bytes(bytes(data))
    touch("checkpoints/c4.sealed", flip)
    part = hashlib.sha256((run / "ingest/c4/part-00001.jsonl").read_bytes()).hexdigest()
    record = (run / "checkpoints/c4.sealed").read_bytes()[40:72].hex()
    n = max(12, next(i for i, (a, b) in enumerate(zip(record, part)) if a != b) + 4)  # (as `_differing` shows them)
    assert verify_run(run) == [
        f"checkpoints/c4.sealed: the record of part-00001 says SHA-256 {record[:n]}…, its receipt "
        f"receipts/c4/part-00001.json says {part[:n]}… (the part is checked against the receipt): delete "
        f"checkpoints/c4.sealed and re-run the same `streamprep ingest` command, which ingests dataset c4 again"]


def test_a_record_in_an_earlier_streampreps_checkpoint_names_that_checkpoint(chain_run):
    """Regression: a checkpoint an earlier streamprep wrote lists its sealed parts itself (no `<ds>.sealed`), yet a
    record of it that is not its receipt's was named `checkpoints/c4.sealed`, a file that does not exist, and
    deleting it was the advice (the re-run then said complete and did nothing). The line names the checkpoint."""
    import hashlib
    import json

    from streamprep.layout import read_sealed

    run, touch = chain_run
    count = json.loads((run / "checkpoints/c4.json").read_text())["part_index"]
    sealed = read_sealed(run / "checkpoints/c4.sealed", count)
    sealed[1][0] = sealed[1][0][:5] + ("0" if sealed[1][0][5] != "0" else "1") + sealed[1][0][6:]
    touch("checkpoints/c4.json", _json_edit(lambda c: c.update(sealed=sealed)))
    touch("checkpoints/c4.sealed", Path.unlink)
    part = hashlib.sha256((run / "ingest/c4/part-00001.jsonl").read_bytes()).hexdigest()
    assert verify_run(run) == [
        f"checkpoints/c4.json: the record of part-00001 in its `sealed` list says SHA-256 {sealed[1][0][:12]}…, its "
        f"receipt receipts/c4/part-00001.json says {part[:12]}… (the part is checked against the receipt): delete "
        f"checkpoints/c4.json and re-run the same `streamprep ingest` command, which ingests dataset c4 again"]


def test_a_damaged_receipt_is_one_problem_and_a_damaged_checkpoint_keeps_the_manifests_hint(chain_run):
    """Regression: status's check of the records, run first, added a second line for a truncated receipt verify
    names itself, and its problem made a complete run's missing manifest.json read "exports not written yet?"."""
    run, touch = chain_run
    whole = (run / "receipts/c4/part-00000.json").read_bytes()
    receipt = touch("receipts/c4/part-00000.json", lambda p: p.write_bytes(whole[:7]))
    problems = verify_run(run)
    assert not [p for p in problems if "a checkpoint or receipt is damaged" in p]
    assert [p for p in problems if p.startswith("receipts/c4/part-00000.json: ")]
    receipt.write_bytes(whole)
    touch("manifest.json", Path.unlink)
    touch("checkpoints/c4.json", lambda p: p.write_bytes(p.read_bytes()[:5]))
    assert verify_run(run)[0] == ("manifest.json: missing (run.json says the run is complete: re-run the same "
                                  "`streamprep ingest` command to write it again)")


@pytest.mark.parametrize("rel", ["mixtures.json", "blend.json"])
def test_a_missing_mixtures_json_is_one_problem_as_blend_json(chain_run, rel):
    """Regression (hunter R50 X3): a removed mixtures.json was two problems, `mixtures.json: missing (listed in
    manifest.json)` and `mixtures.json: missing` (its own check's), where a removed blend.json is one."""
    run, touch = chain_run
    touch(rel, Path.unlink)
    assert verify_run(run) == [f"{rel}: missing (listed in manifest.json)"]


@pytest.mark.parametrize("edit", [{"phases": {"a": 1}}, {"phases": [{"weights": ["x"]}]},
                                  {"sources": {"c4": None}}, {"sources": {"c4": {"shards": 5}}}])
def test_a_mixtures_json_of_the_wrong_shape_is_reported_not_raised(chain_run, edit):
    """Regression: a hand-edited mixtures.json of the wrong shape stopped verify with a bare `AttributeError: 'str'
    object has no attribute 'get'`, naming no file, and the line saying it differs from manifest.json was lost."""
    run, touch = chain_run
    touch("mixtures.json", _json_edit(lambda m: m.update(edit)))
    problems = verify_run(run)
    assert problems[0].startswith("mixtures.json: content differs from manifest.json")
    assert problems[1].startswith("mixtures.json: is malformed (") and len(problems) == 2


def test_moved_run_has_its_blend_reported(pipeline_run, tmp_path):
    """blend.json holds absolute prefixes: a copied run's blend still points into the old directory, and verify says
    so (regression: it said only "content differs from manifest.json (… bytes …)", nothing about a move). A moved
    blend.json changed besides is reported as changed."""
    moved = tmp_path / "moved"
    shutil.copytree(pipeline_run, moved)
    assert verify_run(moved) == [(f"blend.json: names its shards under {pipeline_run.resolve()}, not this run dir "
                                  f"(copied or moved since): re-running the same `streamprep ingest` command here "
                                  f"rewrites it")]
    blend = moved / "blend.json"
    blend.write_bytes(blend.read_bytes().replace(b'"0.', b'"1.', 1))
    problems = verify_run(moved)
    assert len(problems) == 1 and problems[0].startswith("blend.json: content differs from manifest.json"), problems


def test_moved_run_with_a_quote_in_its_old_path_has_its_blend_reported(pipeline_run, tmp_path):
    """Regression: a run dir whose path holds a `"` or a `\\` (JSON writes `\\"`, `\\\\` in blend.json), copied
    elsewhere, was reported as "blend.json: content differs from manifest.json", not as moved."""
    from streamprep.exports.chain import _run_dir_bytes

    old = tmp_path / 'run "q\\'
    shutil.copytree(pipeline_run, old)  # its blend.json as a run in `old` writes it
    blend = old / "blend.json"
    blend.write_bytes(blend.read_bytes().replace(_run_dir_bytes(pipeline_run), _run_dir_bytes(old)))
    assert verify_run(old) == []
    moved = tmp_path / "moved"
    shutil.copytree(old, moved)
    assert verify_run(moved) == [(f"blend.json: names its shards under {old.resolve()}, not this run dir "
                                  f"(copied or moved since): re-running the same `streamprep ingest` command here "
                                  f"rewrites it")]


@pytest.mark.slow
def test_sft_run_chain(shared_data, tmp_path):
    """SFT: sequence/mask/meta.json files are covered through the receipts the manifest lists."""
    import yaml

    from streamprep import run_from_dict

    raw = yaml.safe_load((REPO / "configs/sft_chat.yaml").read_text())
    raw["datasets"][0]["path"] = str(shared_data / "chat/glaive_toolcall_en_demo300.messages.jsonl")
    raw["tokenizer"]["path"] = str(shared_data / "tokenizers/phi-3-mini")
    raw["execution"] = {"engine": "local"}
    run = tmp_path / "run"
    run_from_dict(raw, run_dir=run, console_log=False)
    assert verify_run(run) == []
    meta = next((run / "sft").rglob("*.meta.json"))
    _set("tokenizer_fingerprint", value="sha256:0")(meta)
    rel = str(meta.relative_to(run))
    assert _named(verify_run(run), f"{rel}: SHA-256 mismatch (receipts/glaive_toolcall/part-00000.json says")


@pytest.mark.slow
def test_rerun_of_a_pre_chain_run_records_the_chain(pipeline_run, tmp_path):
    """A finished run without manifest_sha256 (older streamprep) is not 'complete' for a re-run: exports redone."""
    from streamprep.config import Config
    from streamprep.pipeline import run as run_job

    run = tmp_path / "old"
    shutil.copytree(pipeline_run, run)
    record = atomic.read_json(run / "run.json")
    del record["manifest_sha256"]
    atomic.write_json(run / "run.json", record)
    assert "run.json: records no manifest_sha256 (written before the hash chain existed?)" in verify_run(run)
    result = run_job(Config.from_dict(record["config"]), run, console_log=False)
    assert result.summary["tokenize"]["tokenized"] == 0  # only the exports were redone
    assert verify_run(run) == []
    assert (run / "manifest.json").read_bytes() == (pipeline_run / "manifest.json").read_bytes()


@pytest.mark.slow
def test_a_stray_tokenizer_file_is_never_signed_into_the_manifest(pipeline_run, tmp_path):
    """Regression: a file left in a copied run's tokenizer/ was listed in manifest.json when the re-run redid the
    exports (blend.json's prefixes moved), so identical runs' manifests differed; left after them, verify called the
    same file stale. The manifest lists the run's own tokenizer files only, and verify reports the stray."""
    from streamprep.config import Config
    from streamprep.pipeline import run as run_job

    run = tmp_path / "moved"
    shutil.copytree(pipeline_run, run)
    (run / "tokenizer" / "extra.txt").write_bytes(b"")
    (run / "tokenizer" / "sub").mkdir()
    (run / "tokenizer" / "sub" / "vocab.json").write_bytes(b"{}")
    run_job(Config.from_dict(atomic.read_json(run / "run.json")["config"]), run, console_log=False)
    assert (run / "manifest.json").read_bytes() == (pipeline_run / "manifest.json").read_bytes()
    assert verify_run(run) == [f"{rel}: not listed in manifest.json or any receipt (stale file?)"
                               for rel in ("tokenizer/extra.txt", "tokenizer/sub/vocab.json")]


def test_chained_tokenizer_files_are_the_runs_own(tmp_path):
    """`chain.chained_files` lists the files the run writes in tokenizer/ that are there, not a stray one."""
    from streamprep.exports import chain

    tok = tmp_path / "tokenizer"
    (tok / "sub").mkdir(parents=True)
    for name in ("tokenizer.json", "fingerprint.json", "chat_template.jinja", "extra.txt", "sub/tokenizer.json"):
        (tok / name).write_text("{}")
    assert chain.chained_files(tmp_path, []) == [
        ("tokenizer/tokenizer.json", "tokenizer"), ("tokenizer/fingerprint.json", "tokenizer"),
        ("tokenizer/chat_template.jinja", "tokenizer")]


def test_sft_shard_files_are_checked_against_their_meta(shared_data, tmp_path):
    """Each SFT shard's files against its meta.json: a renamed loss mask (`mask_key: m`) is paired with its
    sequences as `loss_mask` was, and its 0/1 values, trained tokens, documents and values counts are checked.
    Regression: only masks named `loss_mask` were compared with their sequences (by file name)."""
    import numpy as np
    import orjson

    from streamprep import binidx
    from streamprep.sft import load_chat_tokenizer, load_sft_config, prepare_part
    from streamprep.verify import _check_sft, _Checker

    cfg = load_sft_config({"input": {"sources": {
        "answers": {"list_field": "a", "mask_key": "m",
                    "sections": [{"field": "p", "action": "mask"}, {"field": "s", "action": "train"}]},
        "scores": {"list_field": "r", "sections": [{"action": "value"}]}}}})
    part = tmp_path / "p.jsonl"
    part.write_bytes(b"".join(orjson.dumps({"text": f"question {i}", "meta": {}, "record": {
        "a": [{"p": f"Question {i}: ", "s": f"answer {k}"} for k in range(1 + i % 3)],
        "r": [float(k) for k in range(1 + i % 3)]}}) + b"\n" for i in range(6)))
    tok = load_chat_tokenizer(shared_data / "tokenizers/phi-2/tokenizer.json")
    stats = prepare_part(part, tmp_path / "run" / "sft" / "x" / "p", tok, cfg, "sha256:test")
    paths = {f"sft/x/{f}" for f in stats["files"]}
    assert "sft/x/p_s0000_answers_m.idx" in paths and not any("loss_mask" in p for p in paths)

    def problems() -> list[str]:
        c = _Checker(tmp_path / "run")
        _check_sft(c, "receipts/x/p.json", paths)
        return c.problems

    assert problems() == []
    folder = tmp_path / "run" / "sft" / "x"
    mask_prefix, meta_path = folder / "p_s0000_answers_m", folder / "p_s0000.meta.json"
    mask = binidx.IndexedDataset.open(mask_prefix)
    docs = [[np.array(mask[j]) for j in range(a, b)] for a, b in zip(mask.doc_indices[:-1], mask.doc_indices[1:])]
    bins = (mask_prefix.with_suffix(".bin").read_bytes(), mask_prefix.with_suffix(".idx").read_bytes())

    def rewrite(edit) -> None:
        changed = [[s.copy() for s in doc] for doc in docs]
        edit(changed)
        writer = binidx.IndexedDatasetWriter(mask_prefix, np.uint8)
        for doc in changed:
            writer.add_document(doc)
        writer.close()

    rewrite(lambda d: d[2].__setitem__(0, d[2][0][1:]))  # a masked token short: no longer aligned
    assert problems() == [("sft/x/p_s0000_answers_m: loss mask lengths differ from the sequence lengths "
                           "(sft/x/p_s0000_answers_sequence)")]
    rewrite(lambda d: d[0][0].__setitem__(-1, 2))
    assert problems() == ["sft/x/p_s0000_answers_m.bin: loss mask holds values other than 0 and 1"]
    trained = orjson.loads(meta_path.read_bytes())["keys"]["answers"]["loss_mask"]["trained_tokens"]
    rewrite(lambda d: d[0][0].__setitem__(-1, 0))
    assert problems() == [(f"sft/x/p_s0000_answers_m.bin: {trained - 1} trained tokens, "
                           f"sft/x/p_s0000.meta.json says {trained}")]
    mask_prefix.with_suffix(".bin").write_bytes(bins[0])
    mask_prefix.with_suffix(".idx").write_bytes(bins[1])
    assert problems() == []
    meta = orjson.loads(meta_path.read_bytes())
    meta["documents"] += 1
    meta["keys"]["scores"]["value"]["values"] += 1
    meta_path.write_bytes(orjson.dumps(meta))
    assert sorted(problems()) == sorted(
        [f"sft/x/p_s0000_{name}.idx: 6 documents, sft/x/p_s0000.meta.json says 7"
         for name in ("answers_sequence", "answers_m", "scores_value")]
        + ["sft/x/p_s0000_scores_value.idx: 12 values, sft/x/p_s0000.meta.json says 13"])


def _digit_changed(*keys: str, at: int) -> Edit:
    """A receipt's hash with one hex digit changed at `at` (past the 12 a message used to show)."""
    def fn(obj: Any) -> None:
        for k in keys[:-1]:
            obj = obj[k]
        sha = obj[keys[-1]]
        obj[keys[-1]] = sha[:at] + ("0" if sha[at] != "0" else "1") + sha[at + 1:]
    return _json_edit(fn)


@pytest.mark.slow
@pytest.mark.parametrize("keys", [("input_sha256",), ("files", "bin", "sha256")])
def test_a_receipt_hash_edited_is_the_receipt_not_its_intact_file(chain_run, keys):
    """Regression: a receipt whose input_sha256 (or .bin sha256) had a digit changed past the 12th was reported
    as 'ingest/…: SHA-256 mismatch (… says 5609fca00400…, file is 5609fca00400…)': the intact file blamed, with two
    equal digests shown. The receipt differs from what manifest.json signed: that is the one problem named."""
    run, touch = chain_run
    touch("receipts/c4/part-00001.json", _digit_changed(*keys, at=20))
    problems = verify_run(run)
    assert [p.split(":")[0] for p in problems] == ["receipts/c4/part-00001.json"], problems
    assert "content differs from manifest.json" in problems[0]


def test_a_mismatch_shows_digests_long_enough_to_differ():
    from streamprep.verify import _differing

    a, b = "5609fca00400" + "ab" * 26, "5609fca00400" + "ab" * 10 + "cd" + "ab" * 15
    assert _differing(a, b) == f"{a[:36]}…, file is {b[:36]}…" and a[:36] != b[:36]
    assert _differing("0" * 64, "1" * 64) == f"{'0' * 12}…, file is {'1' * 12}…"


@pytest.mark.slow
def test_verify_cli_gives_no_delete_advice_for_a_damaged_checkpoint(chain_run):
    """Regression: a checkpoint with garbage appended got the footer 'delete each damaged file named above' when
    the only path named was the run dir itself (its line already says a re-run repairs it)."""
    run, touch = chain_run
    touch("checkpoints/c4.json", lambda p: p.write_bytes(p.read_bytes() + b"garbage"))
    out = subprocess.run([sys.executable, "-m", "streamprep", "verify", str(run)], capture_output=True, text=True,
                         env=_env())
    lines = out.stdout.splitlines()
    assert out.returncode == 1 and lines[0].startswith(f"{run}: a checkpoint or receipt is damaged"), out
    assert lines[1:] == ["streamprep: verify: 1 problem(s)"], out


@pytest.mark.slow
def test_a_damaged_manifest_does_not_judge_the_receipts(chain_run):
    """Regression: with manifest.json's entry for a receipt edited (run.json's hash of the manifest then fails) and
    that receipt's ingest part damaged, verify named the intact receipt as differing from manifest.json, both
    digests shown the same, and not the damaged part: a manifest run.json refuses does not judge the receipts."""
    run, touch = chain_run
    rel = "receipts/c4/part-00001.json"

    def edit(man: dict) -> None:
        entry = next(e for e in man["files"] if e["path"] == rel)
        entry["sha256"] = entry["sha256"][:20] + ("0" if entry["sha256"][20] != "0" else "1") + entry["sha256"][21:]
    touch("manifest.json", _json_edit(edit))
    touch("ingest/c4/part-00001.jsonl", _flip(0.5))
    problems = verify_run(run)
    assert _named(problems, "manifest.json: SHA-256 mismatch (run.json says"), problems
    assert _named(problems, "ingest/c4/part-00001.jsonl: SHA-256 mismatch"), problems
    assert not [p for p in problems if p.startswith(rel)], problems  # the intact receipt: not blamed by the manifest


def _small_run(shared_data: Path, tmp_path: Path) -> tuple[dict[str, Any], Path, dict[str, str]]:
    """A finished run of two datasets of 200 lines each (5 parts each), and the hashes of what it wrote."""
    from helpers import PHI2, base_config

    from streamprep import run_from_dict

    lines = (shared_data / "web/c4_en_train00000_first1000.jsonl").read_bytes().splitlines(keepends=True)
    for name, chunk in (("a", lines[:200]), ("b", lines[200:400])):
        (tmp_path / f"{name}.jsonl").write_bytes(b"".join(chunk))
    cfg = base_config([{"name": n, "path": str(tmp_path / f"{n}.jsonl")} for n in ("a", "b")],
                      str(shared_data / PHI2), output={"shard_records": 40})
    run = tmp_path / "run"
    run_from_dict(cfg, run_dir=run, console_log=False)
    return cfg, run, _outputs(run)


def _outputs(run: Path) -> dict[str, str]:
    from helpers import tree_hashes

    return tree_hashes(run, "ingest", "rejects", "binidx", "receipts", "parquet", "tokenizer",
                       names=("manifest.json", "mixtures.json", "blend.json"))


def _listed_in_checkpoint(run: Path, name: str, edit: Callable[[list[list[Any]]], None]) -> None:
    """Dataset `name`'s checkpoint as an earlier streamprep wrote it: its sealed parts (after `edit`) listed in it,
    no `<ds>.sealed`."""
    import json

    from streamprep.layout import read_sealed

    ckpt, log = run / f"checkpoints/{name}.json", run / f"checkpoints/{name}.sealed"
    raw = json.loads(ckpt.read_text())
    sealed = read_sealed(log, raw["part_index"])
    edit(sealed)
    ckpt.write_text(json.dumps({**raw, "sealed": sealed}))
    log.unlink()


@pytest.mark.slow
def test_a_listed_sealed_entry_of_the_wrong_type_is_repaired_as_verify_says(shared_data, tmp_path):
    """Regression: a null SHA-256 in an earlier streamprep's `sealed` list stopped verify with a bare TypeError; its
    line now says `streamprep ingest` repairs it, and the re-run (which restarts the dataset) ends with the same
    bytes and a clean verify."""
    from streamprep import run_from_dict

    cfg, run, written = _small_run(shared_data, tmp_path)
    _listed_in_checkpoint(run, "a", lambda sealed: sealed[1].__setitem__(0, None))
    problems = verify_run(run)
    assert len(problems) == 1 and "a checkpoint or receipt is damaged (ValueError: a.json: its `sealed`" in problems[0]
    run_from_dict(cfg, run_dir=run, console_log=False)
    assert verify_run(run) == []
    assert _outputs(run) == written and len(written) > 30


def _flip_part_1(sealed: list[list[Any]]) -> None:
    sha = sealed[1][0]
    sealed[1][0] = sha[:10] + ("0" if sha[10] != "0" else "1") + sha[11:]


@pytest.mark.slow
def test_following_verifys_advice_on_an_earlier_streampreps_sealed_record_ends_with_the_same_bytes(shared_data,
                                                                                                  tmp_path):
    """Regression: a changed record in an earlier streamprep's checkpoint (its own `sealed` list, no `<ds>.sealed`)
    had verify say to delete `checkpoints/a.sealed`, which did not exist, and the re-run said complete and did
    nothing: the same line again. Deleting the checkpoint it names now has the re-run ingest the dataset again,
    to the same bytes."""
    from streamprep import run_from_dict

    cfg, run, written = _small_run(shared_data, tmp_path)
    _listed_in_checkpoint(run, "a", _flip_part_1)
    problems = verify_run(run)
    assert len(problems) == 1 and problems[0].startswith("checkpoints/a.json: the record of part-00001 in its "), \
        problems
    assert problems[0].endswith("delete checkpoints/a.json and re-run the same `streamprep ingest` command, which "
                                "ingests dataset a again")
    (run / "checkpoints/a.json").unlink()
    run_from_dict(cfg, run_dir=run, console_log=False)
    assert verify_run(run) == []
    assert _outputs(run) == written and len(written) > 30


@pytest.mark.slow
def test_a_resume_refusing_a_part_on_an_earlier_streampreps_record_names_a_log_whose_deletion_restarts(shared_data,
                                                                                                      tmp_path):
    """Regression: the resume wrote `<ds>.sealed` from an earlier streamprep's checkpoint list but left the list in
    the checkpoint (a dataset done saves no more), so the refusal's advice, delete the part "(or a.sealed)", did
    nothing for the log: the next resume wrote it again from the list and refused the same part. The resume now
    moves the list into the log, and deleting the log has the same command ingest the dataset again, same bytes."""
    from streamprep import run_from_dict
    from streamprep.config import ConfigError

    cfg, run, written = _small_run(shared_data, tmp_path)
    _listed_in_checkpoint(run, "a", _flip_part_1)
    (run / "receipts/a/part-00001.json").unlink()  # its shard is redone on the resume, its part hashed first
    with pytest.raises(ConfigError, match=r"^ingest/a/part-00001\.jsonl: its SHA-256 is .* its dataset's sealed "
                                          r"log \(a\.sealed in the checkpoint dir\) recorded .* delete the part "
                                          r"\(or a\.sealed\) and re-run the same command"):
        run_from_dict(cfg, run_dir=run, console_log=False)
    (run / "checkpoints/a.sealed").unlink()
    run_from_dict(cfg, run_dir=run, console_log=False)
    assert verify_run(run) == []
    assert _outputs(run) == written and len(written) > 30


def test_verify_cli_escapes_control_characters_in_the_names_it_prints(pipeline_run, tmp_path, capsys):
    """Regression: `streamprep verify` printed each problem raw: stray files named with ESC or BEL, and the run dir
    (named with ESC and CR) in a damaged checkpoint's line, reached the terminal as control sequences, where status,
    audit and logs escape them. Each line is printed escaped, as config.printable escapes an error line."""
    from streamprep.cli import main

    run = tmp_path / "esc\x1b[31mRUN\rx"
    shutil.copytree(pipeline_run, run)
    (run / "parquet" / "\x1b[32mstray.parquet").write_bytes(b"hi\n")
    (run / "ingest" / "c4" / "\x07bell.jsonl").write_bytes(b"hi\n")
    checkpoint = run / "checkpoints" / "c4.json"
    checkpoint.write_bytes(checkpoint.read_bytes() + b"garbage")
    assert main(["verify", str(run)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert "parquet/\\x1b[32mstray.parquet: not listed in manifest.json or any receipt (stale file?)" in lines
    assert "ingest/c4/\\x07bell.jsonl: not listed in manifest.json or any receipt (stale file?)" in lines
    assert any(line.startswith(f"{tmp_path}/esc\\x1b[31mRUN\\rx: a checkpoint or receipt is damaged") for line in lines)
    assert [line for line in lines if not line.isprintable()] == []
