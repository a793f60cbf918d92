"""`streamprep status` (read-only, correct while a real run is going) and the live ProgressReporter."""
from __future__ import annotations

import asyncio
import hashlib
import io
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import PHI2, REPO, base_config, deny_reading, english_docs, make_inputs
from streamprep import logs, run_from_dict
from streamprep.checkpoints import IngestState
from streamprep.config import dataset
from streamprep.layout import RunLayout
from streamprep.progress import ProgressReporter
from streamprep.status import format_status, run_status



@pytest.fixture(scope="module")
def done_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("status")
    inputs = make_inputs(root / "data")
    assert run_from_dict(inputs["config"], root / "run", console_log=False).status == "complete"
    return root / "run"


def _snapshot(run_dir: Path) -> dict[str, tuple]:
    out = {}
    for p in sorted(run_dir.rglob("*")):
        st = p.lstat()
        out[str(p.relative_to(run_dir))] = (st.st_mtime_ns, st.st_size,
                                            hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None)
    return out


def test_status_of_a_complete_run_and_it_writes_nothing(done_run, capsys):
    from streamprep.cli import main

    before = _snapshot(done_run)
    st = run_status(done_run)
    assert main(["status", str(done_run)]) == 0
    human = capsys.readouterr().out
    assert main(["status", str(done_run), "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert _snapshot(done_run) == before  # read-only: no file created, changed or even touched
    assert st["state"] == "complete" and st["stage"] == "done" and st["lock"] is None
    assert as_json["state"] == "complete" and set(as_json["datasets"]) == {"a", "b"}
    for d in st["datasets"].values():
        ing, tok = d["ingest"], d["tokenize"]
        assert ing["done"] and ing["read"] == ing["kept"] + ing["rejected"]
        assert tok["planned_final"] and tok["shards_done"] == tok["shards_planned"] == ing["parts"] > 0
        assert tok["documents"] == ing["kept"] - tok["empty_tokens"]
    assert st["totals"]["tokens"] == sum(d["tokenize"]["tokens"] for d in st["datasets"].values()) > 0
    assert "COMPLETE" in human and "dataset" in human and "total" in human
    a = st["datasets"]["a"]["ingest"]
    assert f"{a['read']:,}" in human and f"{st['datasets']['a']['tokenize']['shards_done']}/" in human


def test_status_json_gives_run_and_checkpoint_dir_absolute_from_a_relative_path(done_run, capsys, monkeypatch):
    """Regression: `cd /tmp; streamprep status hunt/runs/a --json` gave "run_dir": "/tmp/hunt/runs/a" but
    "checkpoint_dir": "hunt/runs/a/checkpoints", relative to the caller's cwd. Both are absolute now."""
    from streamprep.cli import main

    monkeypatch.chdir(done_run.parent.parent)
    rel = done_run.relative_to(done_run.parent.parent)
    assert main(["status", str(rel), "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["run_dir"], st["checkpoint_dir"]) == (str(done_run.resolve()), str(done_run.resolve() / "checkpoints"))


def test_status_names_a_run_dir_with_control_characters_escaped(done_run, tmp_path):
    """Regression: status's "run PATH" line printed a run dir named with ESC raw to the terminal; it is escaped now,
    as the "last error" line is (and the "follow it with" line of a running run)."""
    from streamprep.lock import RunLock

    run_dir = _copy_run(done_run, tmp_path / "r\x1b[31mX")
    assert format_status(run_status(run_dir)).startswith(f"run {tmp_path}/r\\x1b[31mX  (name ")
    lock = RunLock(RunLayout(run_dir).lock).acquire()
    try:
        text = format_status(run_status(run_dir))
    finally:
        lock.release()
    assert "\x1b" not in text and f"streamprep logs {tmp_path}/r\\x1b[31mX --follow" in text


def _copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock"))
    rec = json.loads((dst / "run.json").read_text())
    rec["checkpoint_dir"] = str(dst / "checkpoints")
    (dst / "run.json").write_text(json.dumps(rec))
    return dst


@pytest.mark.parametrize("recorded,reason", [("interrupted", "interrupted"), ("failed", "failed"),
                                             ("running", "crashed")])
def test_resumable_states(done_run, tmp_path, recorded, reason):
    run_dir = _copy_run(done_run, tmp_path / "run")
    rec = json.loads((run_dir / "run.json").read_text())
    rec["status"], rec["error"] = recorded, "RuntimeError: boom \x1b[2J\r" if recorded == "failed" else None
    (run_dir / "run.json").write_text(json.dumps(rec))
    (run_dir / "receipts" / "a" / "part-00001.json").unlink()
    st = run_status(run_dir)
    assert (st["state"], st["resumable_reason"], st["stage"]) == ("resumable", reason, "tokenize")
    assert st["datasets"]["a"]["stage"] == "tokenize"
    tok = st["datasets"]["a"]["tokenize"]
    assert tok["shards_done"] == tok["shards_planned"] - 1
    text = format_status(st)
    assert f"RESUMABLE ({reason})" in text and "to resume" in text
    if recorded == "failed":  # regression: the error's control characters reached the terminal
        assert "last error: RuntimeError: boom \\x1b[2J\\r\n" in text and "\x1b" not in text


def test_a_run_that_failed_on_an_exit_2_error_is_not_called_resumable(tmp_path):
    """Regression: a job that ended on an error re-running cannot get past (exit 2: no kept text to train a
    tokenizer on) showed as RESUMABLE (failed), stage exports, its dataset tokenized with no tokenizer made, and
    "to resume: re-run the same ... command", which fails the same way forever."""
    from streamprep.config import ConfigError

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in english_docs(20)))
    cfg = base_config([{"name": "a", "path": str(tmp_path / "a.jsonl")}], None, quality={"min_chars": 1_000_000})
    with pytest.raises(ConfigError, match="no records were kept"):
        run_from_dict(cfg, tmp_path / "run", console_log=False)
    rec = json.loads((tmp_path / "run" / "run.json").read_text())
    assert (rec["status"], rec["needs_change"]) == ("failed", True)
    st = run_status(tmp_path / "run")
    assert (st["state"], st["resumable_reason"], st["needs_change"]) == ("resumable", "failed", True)
    assert st["stage"] == "tokenize" and st["datasets"]["a"]["stage"] == "tokenize"  # no tokenizer was made
    text = format_status(st)
    assert "state: FAILED, NEEDS A CHANGE (re-running as is fails the same way)" in text
    assert "last error: ConfigError: no records were kept" in text
    assert "to go on: fix what the last error names" in text and "RESUMABLE" not in text and "to resume" not in text


def test_the_needs_change_hint_allows_the_exports_only_key_the_error_says_to_lower(tmp_path):
    """Regression: after a ShardCountError (exit 2: "Lower it ... or add data") the hint said a changed config is
    refused in this run dir, yet lowering that exports-only key and re-running here is accepted and completes."""
    from streamprep.exports import ShardCountError

    docs = english_docs(41)
    for name, rows in (("train", docs[:40]), ("one", docs[40:])):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in rows))
    cfg = base_config({"train": [{"name": "web", "path": str(tmp_path / "train.jsonl")}],
                       "test": [{"name": "one", "path": str(tmp_path / "one.jsonl")}]}, None,
                      output={"shard_records": 200, "num_shards_multiple_of": 2})
    with pytest.raises(ShardCountError, match="Lower it"):
        run_from_dict(cfg, tmp_path / "run", console_log=False)
    st = run_status(tmp_path / "run")
    assert (st["state"], st["needs_change"], st["stage"]) == ("resumable", True, "exports")
    text = format_status(st)
    assert "a changed config is refused here but for the keys only the exports read" in text
    cfg["output"]["num_shards_multiple_of"] = 1  # what the error says to do, in the same run dir
    assert run_from_dict(cfg, tmp_path / "run", console_log=False).status == "complete"


def test_a_later_attempt_drops_the_last_failures_error_and_needs_change(tmp_path):
    """Regression: run.json kept an earlier attempt's `needs_change: true` and `error` once a later attempt completed
    (status complete beside them, and `status --json` showed the old error)."""
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in english_docs(20)))
    cfg = base_config([{"name": "a", "path": str(tmp_path / "a.jsonl")}], None)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "binidx").touch()  # a file where the run needs a folder: exit 2, re-running as is fails the same way
    with pytest.raises(OSError):
        run_from_dict(cfg, run_dir, console_log=False)
    rec = json.loads((run_dir / "run.json").read_text())
    assert (rec["status"], rec["needs_change"]) == ("failed", True) and "binidx" in rec["error"]
    (run_dir / "binidx").unlink()
    assert run_from_dict(cfg, run_dir, console_log=False).status == "complete"
    rec = json.loads((run_dir / "run.json").read_text())
    assert rec["status"] == "complete" and "needs_change" not in rec and "error" not in rec
    st = run_status(run_dir)
    assert (st["state"], st["needs_change"], st["error"]) == ("complete", False, None)


def test_an_ordinary_failure_stays_resumable(done_run, tmp_path):
    """A failure a re-run gets past (exit 1) records needs_change false, over an earlier attempt's true."""
    run_dir = _copy_run(done_run, tmp_path / "run")
    rec = json.loads((run_dir / "run.json").read_text())
    rec.update(status="failed", error="OSError: gone", needs_change=False)
    (run_dir / "run.json").write_text(json.dumps(rec))
    st = run_status(run_dir)
    assert (st["state"], st["needs_change"]) == ("resumable", False)
    assert "RESUMABLE (failed)" in format_status(st) and "to resume" in format_status(st)


def test_mid_ingest_checkpoint_counts_planned_shards_so_far(done_run, tmp_path):
    run_dir = _copy_run(done_run, tmp_path / "run")
    ck_path = run_dir / "checkpoints" / "a.json"
    ck = json.loads(ck_path.read_text())
    ck.update(done=False, part_index=2, part_lines=5)
    ck_path.write_text(json.dumps(ck))
    st = run_status(run_dir)
    tok = st["datasets"]["a"]["tokenize"]
    assert st["stage"] == "ingest" and st["datasets"]["a"]["stage"] == "ingest"
    assert tok["shards_planned"] == 2 and not tok["planned_final"]
    assert "2/2+" in format_status(st)


@pytest.mark.parametrize("cap", [{"max_records": 10}, {"size_mb": 0.002}], ids=["max_records", "size_mb"])
def test_bytes_in_of_a_capped_dataset_is_the_files_its_position_passed_not_every_file(tmp_path, shared_data, cap):
    """Regression: once a dataset was done, `bytes_in` (and streamprep_source_read_bytes_total) was every input
    byte, also for a dataset a cap ended in its first file of three: 3x the bytes read. Now the files its position
    passed (its unit here is the whole first file); a dataset read to its end still counts every file."""
    docs = english_docs(120)
    for name, first, per_file in (("capped", 0, 30), ("whole", 90, 10)):
        (tmp_path / name).mkdir()
        for k in range(3):
            part = docs[first + k * per_file:first + (k + 1) * per_file]
            (tmp_path / name / f"{'abc'[k]}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    cfg = base_config([{"name": "capped", "path": str(tmp_path / "capped/*.jsonl"), **cap},
                       {"name": "whole", "path": str(tmp_path / "whole/*.jsonl")}], str(shared_data / PHI2))
    assert run_from_dict(cfg, tmp_path / "run", console_log=False).status == "complete"
    st = run_status(tmp_path / "run")
    capped, whole = st["datasets"]["capped"]["ingest"], st["datasets"]["whole"]["ingest"]
    assert capped["done"] and 0 < capped["read"] < 30
    assert capped["bytes_in"] == (tmp_path / "capped/a.jsonl").stat().st_size
    assert whole["done"] and whole["bytes_in"] == sum(p.stat().st_size for p in (tmp_path / "whole").iterdir())
    assert st["totals"]["bytes_in"] == capped["bytes_in"] + whole["bytes_in"]


def test_a_damaged_checkpoint_neither_hangs_nor_crashes_status(done_run, tmp_path):
    """Regression: status counted parts and receipts over `range(part_index + 1)`, so a checkpoint saying a billion
    parts hung it, and a counter of the wrong type (`kept: "x"`) was a bare ValueError, exit 1. Now: the files on
    disk are counted, and a record of the wrong shape is one line saying how to repair it, exit 2 (a billion parts
    the sealed log does not hold is one too)."""
    import threading

    from streamprep.cli import main
    from streamprep.layout import NotARunDir

    run_dir = _copy_run(done_run, tmp_path / "run")
    ck_path = run_dir / "checkpoints" / "a.json"
    good = json.loads(ck_path.read_text())
    ck_path.write_text(json.dumps({**good, "part_index": 10**9}))
    out: dict = {}

    def status() -> None:
        try:
            run_status(run_dir)
        except NotARunDir as exc:
            out["error"] = str(exc)

    worker = threading.Thread(target=status, daemon=True)
    worker.start()
    worker.join(20)
    assert not worker.is_alive(), "status hung on a part index of a billion"
    assert "(ValueError: a.sealed holds " in out["error"] and "a.json counts 1000000000)" in out["error"]
    ck_path.write_text(json.dumps({**good, "kept": "x"}))
    with pytest.raises(NotARunDir, match=r"a checkpoint or receipt is damaged \(ValueError: .*\); `streamprep ingest` "
                                         r"with the run's config repairs it"):
        run_status(run_dir)
    assert main(["status", str(run_dir)]) == 2
    assert main(["audit", str(run_dir)]) == 2  # the audit reads the same records: the same line


def _crashed_mid_part(done_run: Path, tmp_path: Path) -> tuple[Path, int]:
    """A copy of `done_run` as `kill -9` leaves it: dataset a's checkpoint has part 0 sealed and 7 lines of part 1
    staged, and part 1, sealed after that checkpoint, is on disk whole. Returns the run dir and the checkpoint's
    kept lines' bytes."""
    run_dir = _copy_run(done_run, tmp_path / "run")
    ck_path = run_dir / "checkpoints" / "a.json"
    ck = json.loads(ck_path.read_text())
    part0, part1 = (run_dir / "ingest" / "a" / f"part-0000{i}.jsonl" for i in (0, 1))
    staged = part1.read_bytes().splitlines(keepends=True)[:7]
    stage = run_dir / "checkpoints" / "stage" / "a"
    stage.mkdir(parents=True, exist_ok=True)
    (stage / "piece.kept").write_bytes(b"".join(staged))
    (stage / "piece.kept.off").write_bytes(b"")
    kept = len(part0.read_bytes().splitlines()) + len(staged)
    assert "sealed" not in ck  # its sealed log holds them all; records past part_index are unacknowledged
    ck.update(done=False, part_index=1, part_lines=len(staged), kept=kept,
              part_bytes=len(b"".join(staged)), open_pieces=[["piece", 0, len(staged)]])
    ck_path.write_text(json.dumps(ck))
    sealed = (run_dir / "checkpoints" / "a.sealed").read_bytes()
    assert len(sealed) > 40 and int.from_bytes(sealed[32:40], "big") == part0.stat().st_size
    assert part1.stat().st_size > ck["part_bytes"]
    return run_dir, part0.stat().st_size + ck["part_bytes"]


def test_status_ingest_bytes_after_a_crash_are_the_checkpoints_kept_lines(done_run, tmp_path):
    """Regression: `bytes` (ingest MB) summed the part files on disk up to the checkpoint's open part: after a crash
    that counted a part sealed after the checkpoint (which the resume removes) and never the open part's staged
    lines, so it disagreed with `kept` either way. Now: the sealed parts' sizes plus the staged lines' bytes."""
    run_dir, kept_bytes = _crashed_mid_part(done_run, tmp_path)
    ing = run_status(run_dir)["datasets"]["a"]["ingest"]
    assert (ing["bytes"], ing["parts"], ing["parts_sealed"]) == (kept_bytes, 2, 1)
    full = run_status(done_run)["datasets"]["a"]["ingest"]["bytes"]
    assert full == sum(p.stat().st_size for p in (done_run / "ingest" / "a").glob("part-*.jsonl"))


def test_the_ingest_bytes_counter_never_goes_down_across_a_resumes_repair(done_run, tmp_path):
    """Regression: a resumed process's metrics endpoint first read the crashed run's part files (a part sealed after
    the checkpoint included), then, once the resume removed that part, less: the counter
    `streamprep_ingest_written_bytes_total` went down within one process. Now it is the checkpoint's figure, before
    the repair and after it."""
    from streamprep.checkpoints import DatasetFiles, load_checkpoint, repair
    from streamprep.metrics import JobCollector, job_snapshot

    run_dir, kept_bytes = _crashed_mid_part(done_run, tmp_path)
    collector = JobCollector(job_snapshot(run_dir, None))

    def written() -> float:
        fam = next(f for f in collector.collect() if f.name == "streamprep_ingest_written_bytes")
        return next(s.value for s in fam.samples if s.labels == {"dataset": "a"})

    before = written()  # the resumed process, before dataset a's ingest starts: its checkpoint
    files = DatasetFiles(run_dir, run_dir / "checkpoints", "a")
    repair(files, load_checkpoint(files))
    assert not (run_dir / "ingest" / "a" / "part-00001.jsonl").exists()  # the part sealed after the checkpoint
    assert (before, written()) == (kept_bytes, kept_bytes)


def test_the_tokenize_eta_is_at_this_attempts_rate(done_run, tmp_path):
    """Regression: the ETA took the rate of the last 20 receipts of every attempt: a resumed run whose earlier receipts
    were written two hours before showed 1 201 s for one pending shard of under a second. Now only the receipts
    written since this attempt started (run.json's `started_at`) count: 2 s apart here, one shard pending, 2 s."""
    import os

    from streamprep.lock import RunLock

    run_dir = _copy_run(done_run, tmp_path / "run")
    receipts = sorted((run_dir / "receipts").rglob("*.json"))
    receipts.pop().unlink()  # its part sealed and not tokenized yet
    now = time.time()
    earlier, this = receipts[:-2], receipts[-2:]
    assert len(earlier) >= 2
    for i, path in enumerate(earlier):  # the first attempt, killed two hours ago
        os.utime(path, (now - 7200 + i, now - 7200 + i))
    for i, path in enumerate(this):
        os.utime(path, (now - 10 + 2 * i, now - 10 + 2 * i))
    rec = json.loads((run_dir / "run.json").read_text())
    rec.update(status="running", started_at=now - 60)
    (run_dir / "run.json").write_text(json.dumps(rec))
    lock = RunLock(RunLayout(run_dir).lock).acquire()
    try:
        totals = run_status(run_dir)["totals"]
        rec["started_at"] = now - 5  # no two receipts of this attempt yet: unknown
        (run_dir / "run.json").write_text(json.dumps(rec))
        assert run_status(run_dir)["totals"]["tokenize_eta_s"] is None
    finally:
        lock.release()
    assert (totals["shards_pending"], totals["tokenize_eta_s"]) == (1, 2.0)


@pytest.mark.parametrize("damage", ["checkpoint not JSON", "checkpoint a list", "receipt truncated", "receipt a list",
                                    "checkpoint missing", "checkpoint missing, nothing kept", "sealed log missing",
                                    "sealed log short"])
def test_a_checkpoint_or_receipt_that_is_not_a_json_object_is_damaged_for_status_and_audit(done_run, tmp_path,
                                                                                          capsys, damage):
    """Regression: these read as "not started" / "pending" (exit 0): `status` showed the finished dataset at 0 read
    and `audit` rewrote audit.json with those zeros. Now the documented line, exit 2, and the audit is untouched.
    (A checkpoint missing from a complete run whose dataset ran too: it was the last left so, and one that kept
    nothing, no part written, after that: its plan is there. A sealed log missing or short of the checkpoint's
    count too: the dataset showed its bytes as the log's few parts', 'ingest MB 0.0' for a complete one, exit 0.)"""
    from streamprep.cli import main

    run_dir = _copy_run(done_run, tmp_path / "run")
    target = run_dir / ("checkpoints/a.json" if damage.startswith("checkpoint") else "checkpoints/a.sealed"
                        if damage.startswith("sealed") else "receipts/a/part-00000.json")
    if damage == "sealed log short":
        target.write_bytes(target.read_bytes()[:-40])
    elif damage.startswith("checkpoint missing") or damage == "sealed log missing":
        target.unlink()
        if damage.endswith("nothing kept"):
            for part in (run_dir / "ingest/a").glob("part-*.jsonl"):
                part.unlink()
    else:
        target.write_bytes(b"[]" if damage.endswith("a list") else target.read_bytes()[:30])
    audit = (run_dir / "audit" / "audit.json").read_bytes()
    for command in ("status", "audit"):
        capsys.readouterr()
        assert main([command, str(run_dir)]) == 2, command
        err = capsys.readouterr().err
        assert f"{run_dir}: a checkpoint or receipt is damaged (ValueError: {target.name} " in err, (command, err)
    assert (run_dir / "audit" / "audit.json").read_bytes() == audit


@pytest.mark.parametrize("edit", [{"kept": -5}, {"version": 99}, {"done": "yes"}, {"part_index": 1.5}, "{}",
                                  {"position": {"unit": 10**6}}, {"open_pieces": [["u0000001-0000000", 0]]},
                                  {"dedup_counts": ["x"]}])
def test_a_checkpoint_a_resume_starts_over_is_damaged_for_status_audit_and_verify(done_run, tmp_path, capsys, edit):
    """Regression: a checkpoint of the right JSON shape holding a state no job writes (a negative count, another
    version, a field of the wrong type, no field at all, a position past its plan; regression: an `open_pieces`
    entry not [piece, line, lines] or a `dedup_counts` entry no count, whose resume ended on a bare ValueError or
    TypeError, exit 1, on every re-run), which the resume starts over, was shown as is: `status` called the run complete with `kept -5` (or `{}` as a dataset not started), `audit`
    rewrote its report with it and `verify` said every file matched. Now the documented line, exit 2 (verify: 1)."""
    from streamprep.cli import main

    run_dir = _copy_run(done_run, tmp_path / "run")
    ck_path = run_dir / "checkpoints" / "a.json"
    good = json.loads(ck_path.read_text())
    ck_path.write_text(edit if isinstance(edit, str) else json.dumps({**good, **edit}))
    audit = (run_dir / "audit" / "audit.json").read_bytes()
    for command, code in (("status", 2), ("audit", 2), ("verify", 1)):
        capsys.readouterr()
        assert main([command, str(run_dir)]) == code, command
        said = capsys.readouterr()
        assert "a checkpoint or receipt is damaged (ValueError: a.json does not hold a state a job writes (" in (
            said.err + said.out), (command, said)
    assert (run_dir / "audit" / "audit.json").read_bytes() == audit


@pytest.mark.parametrize("rel", ["checkpoints/a.json", "receipts/a/part-00000.json"])
def test_a_checkpoint_or_receipt_it_may_not_read_is_one_line_for_status_and_audit_a_problem_for_verify(
        done_run, tmp_path, capsys, monkeypatch, rel):
    """Regression: `status` and `audit` on a checkpoint (or receipt) made unreadable (`chmod 000`) were a raw
    "PermissionError: [Errno 13] Permission denied: …", exit 1; `verify` stopped there too, the other files
    unchecked. The line names it, to make readable, exit 2; `verify` lists it as a problem and goes on.
    (Simulated as `chmod 000` would: root reads through permission bits.)"""

    from streamprep.cli import main

    run_dir = _copy_run(done_run, tmp_path / "run")
    refused = run_dir / rel
    shard = run_dir / "binidx/a/part-00000_text_document.bin"
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    deny_reading(monkeypatch, refused)
    audit = (run_dir / "audit" / "audit.json").read_bytes()
    for command in ("status", "audit"):
        capsys.readouterr()
        assert main([command, str(run_dir)]) == 2, command
        assert capsys.readouterr().err.splitlines() == [
            f"streamprep: error: cannot read {refused}: Permission denied; make it readable and re-run the same "
            f"command"], command
    assert (run_dir / "audit" / "audit.json").read_bytes() == audit
    assert main(["verify", str(run_dir)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"{rel}: cannot read: PermissionError: [Errno 13] Permission denied: '{rel}'" in out, out
    assert any(line.startswith("binidx/a/part-00000_text_document.bin: SHA-256 mismatch") for line in out), out


@pytest.mark.parametrize("closed", ["checkpoints", "receipts/a", "."])
def test_a_folder_of_the_run_it_may_not_enter_or_list_is_one_line_naming_it(done_run, tmp_path, closed):
    """Regression: a folder of the run made `chmod 000` (the checkpoints, a dataset's receipts, the run dir) was a
    raw "PermissionError: [Errno 13] Permission denied: …/checkpoints/a.json", exit 1, for status, audit, verify and
    logs (the file inside could not be seen to be there, so it was not called unreadable); with receipts/a so,
    `status` called the run COMPLETE with no shard tokenized (its listing passed over the folder in silence). The
    line names the folder, to make readable and searchable, exit 2. (Real permissions: `streamprep_obeying_permissions`
    drops root's override.)"""
    from helpers import streamprep_obeying_permissions

    run_dir = _copy_run(done_run, tmp_path / "run")
    folder = run_dir / closed
    folder.chmod(0)
    try:
        for command in ("status", "audit", *(("verify", "logs") if closed == "." else ())):
            proc = streamprep_obeying_permissions([command, str(run_dir)])
            assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", (
                f"streamprep: error: cannot read {folder}: Permission denied; make it readable and searchable and "
                f"re-run the same command\n")), command
    finally:
        folder.chmod(0o755)


@pytest.mark.parametrize("gone", ["a.sealed", "a.inputs"])
def test_a_dataset_under_way_without_its_sealed_log_or_inputs_is_damaged_not_resumable(done_run, tmp_path, gone):
    """Regression: status showed such a dataset as under way, the run RESUMABLE, with its bytes the log's (none),
    while the resume restarts it from scratch. It is damaged, as a missing checkpoint is, naming the file."""
    from streamprep.layout import NotARunDir

    run_dir, _ = _crashed_mid_part(done_run, tmp_path)
    assert run_status(run_dir)["datasets"]["a"]["ingest"]["parts_sealed"] == 1
    (run_dir / "checkpoints" / gone).unlink()
    with pytest.raises(NotARunDir, match=rf"a checkpoint or receipt is damaged \(ValueError: {gone} is missing"):
        run_status(run_dir)


@pytest.mark.parametrize("field, value", [("config", "x"), ("config", None), ("checkpoint_dir", 7)])
def test_a_run_json_without_its_config_or_with_a_bad_checkpoint_dir_is_one_line_for_status_and_audit(
        done_run, tmp_path, capsys, field, value):
    """Regression: `config: "x"` or `checkpoint_dir: 7` was a bare AttributeError / TypeError, exit 1; a run.json
    without `config` listed the checkpoint dir's files (`a.plan`, `tokenizer_backend`) as datasets, and `audit`
    rewrote audit.json over them."""
    from streamprep.cli import main

    run_dir = _copy_run(done_run, tmp_path / "run")
    rec = json.loads((run_dir / "run.json").read_text())
    if value is None:
        del rec[field]
    else:
        rec[field] = value
    (run_dir / "run.json").write_text(json.dumps(rec))
    audit = (run_dir / "audit" / "audit.json").read_bytes()
    for command in ("status", "audit"):
        capsys.readouterr()
        assert main([command, str(run_dir)]) == 2, command
        assert capsys.readouterr().err.startswith(f"streamprep: error: {run_dir / 'run.json'} is damaged"), command
    assert (run_dir / "audit" / "audit.json").read_bytes() == audit


def test_a_copied_run_dir_reads_its_own_checkpoints(done_run, tmp_path):
    """Regression: run.json records its checkpoint dir's absolute path, so `status` of a copy read the original's."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(done_run, copy, ignore=shutil.ignore_patterns(".lock"))
    (copy / "checkpoints" / "a.json").write_text(
        json.dumps({**json.loads((copy / "checkpoints" / "a.json").read_text()), "kept": 7}))
    assert run_status(copy)["datasets"]["a"]["ingest"]["kept"] == 7 != run_status(done_run)["datasets"]["a"]["ingest"]["kept"]


HOLD = """
import sys, time
from streamprep.layout import RunLayout
from streamprep.lock import RunLock
RunLock(RunLayout(sys.argv[1]).lock).acquire()
print("held", flush=True)
time.sleep(60)
"""


def _held_running_copy(done_run: Path, tmp_path: Path) -> tuple[Path, subprocess.Popen]:
    """A copy of the finished run whose run.json says `running`, its lock held by another process (`HOLD`)."""
    run_dir = _copy_run(done_run, tmp_path / "run")
    rec = json.loads((run_dir / "run.json").read_text())
    rec["status"] = "running"
    (run_dir / "run.json").write_text(json.dumps(rec))
    return run_dir, subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)


def test_lock_held_by_another_process_then_killed(done_run, tmp_path):
    run_dir, proc = _held_running_copy(done_run, tmp_path)
    try:
        assert proc.stdout.readline().strip() == "held"
        st = run_status(run_dir)
        assert st["state"] == "running" and st["lock"]["pid"] == proc.pid
        assert f"pid {proc.pid}" in format_status(st)
        from streamprep.lock import RunLock, RunLocked
        with pytest.raises(RunLocked):  # status left the holder's exclusive lock alone
            RunLock(RunLayout(run_dir).lock).acquire()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    st = run_status(run_dir)  # the holder record is still in .lock, but nobody holds it
    assert (st["state"], st["resumable_reason"], st["lock"]) == ("resumable", "crashed", None)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10)
    return proc.pid


def test_a_resume_is_not_refused_by_status_testing_a_crashed_runs_lock(tmp_path):
    """Regression: on a crashed run's `.lock` (its holder record left behind) `status` tests the lock with a shared
    flock held for an instant; a resume whose exclusive flock landed in that instant was refused, exit 2, "run dir …
    is in use by pid <the dead pid>" (5 of 3000 in a loop). A refused acquire now waits that instant out when the
    record names a pid gone from this host; a live holder is still refused at once, a dead-pid holder that stays, at
    the end of the wait."""
    import fcntl
    import os
    import socket
    import threading

    from streamprep import lock as lockmod
    from streamprep.lock import RunLock, RunLocked

    path = tmp_path / ".lock"
    host = socket.gethostname()
    path.write_bytes(json.dumps({"pid": _dead_pid(), "host": host, "started": "2020-01-01T00:00:00Z"}).encode())
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # status's test of the lock, here held 50 ms
    unlock = threading.Timer(0.05, fcntl.flock, (fd, fcntl.LOCK_UN))
    unlock.start()
    try:
        RunLock(path).acquire().release()
    finally:
        unlock.join()
        os.close(fd)

    for pid, refused_within in ((os.getpid(), 0.2), (_dead_pid(), lockmod.PASSING_HOLDER_WAIT_S + 0.3)):
        path.write_bytes(json.dumps({"pid": pid, "host": host, "started": "x"}).encode())
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a holder that stays
        try:
            t0 = time.monotonic()
            with pytest.raises(RunLocked, match=f"in use by pid {pid} "):
                RunLock(path).acquire()
            assert time.monotonic() - t0 < refused_within
        finally:
            os.close(fd)


def test_the_audit_of_a_killed_run_says_crashed_as_status_does(done_run, tmp_path, capsys):
    """Regression: the audit of a run killed with kill -9 (run.json still `running`, nobody holding the lock) said
    "status running" in audit.json and audit.html, while `status` said RESUMABLE (crashed)."""
    from streamprep.audit import build_audit
    from streamprep.cli import main

    assert json.loads((done_run / "audit" / "audit.json").read_text())["run"]["status"] == "complete"  # the job's own
    run_dir, proc = _held_running_copy(done_run, tmp_path)
    try:
        assert proc.stdout.readline().strip() == "held"
        assert build_audit(run_dir)[0]["run"]["status"] == "running"  # a live holder: it is running
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    assert run_status(run_dir)["resumable_reason"] == "crashed"
    assert main(["audit", str(run_dir)]) == 0
    capsys.readouterr()
    assert json.loads((run_dir / "audit" / "audit.json").read_text())["run"]["status"] == "crashed"
    assert "status crashed" in (run_dir / "audit" / "audit.html").read_text()


def _poll_during_run(cfg: dict, tmp_path: Path) -> tuple[list[dict], subprocess.Popen, str, str]:
    """Run `streamprep ingest` on `cfg` and poll `run_status` until it exits."""
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path),
                             "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    seen = []
    try:
        while proc.poll() is None:
            if (run_dir / "run.json").is_file():
                try:
                    seen.append(run_status(run_dir))
                except Exception as exc:  # noqa: BLE001 - any failure here is the test failing
                    pytest.fail(f"status failed during the run: {exc!r}")
            time.sleep(0.03)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return seen, proc, out, err


@pytest.mark.slow
def test_status_while_a_real_run_is_in_progress(tmp_path):
    """Poll status during a real `streamprep ingest`: it sees the run (pid), consistent counts, no disturbance."""
    data = tmp_path / "s.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in english_docs(1000, seed=5)))
    cfg = base_config([{"name": "s", "path": str(data)}], None, output={"shard_records": 400})
    cfg["execution"]["batch_records"] = 8
    run_dir = tmp_path / "run"
    seen, proc, out, err = _poll_during_run(cfg, tmp_path)
    assert proc.returncode == 0, err[-2000:]
    running = [s for s in seen if s["state"] == "running"]
    assert running, f"never saw the run in progress ({len(seen)} polls)"
    assert all(s["lock"]["pid"] == proc.pid for s in running)
    reads = [s["datasets"]["s"]["ingest"]["read"] for s in seen]
    assert reads == sorted(reads)
    for s in seen:
        ing = s["datasets"]["s"]["ingest"]
        assert ing["read"] == ing["kept"] + ing["rejected"]
    assert any(0 < r < 1000 for r in reads) or any(s["stage"] == "tokenize" for s in running)
    final = run_status(run_dir)
    assert final["state"] == "complete" and final["datasets"]["s"]["ingest"]["read"] == 1000
    assert "counts add up" in out  # `ingest` ends with the audit summary


@pytest.mark.slow
def test_status_shows_tokenization_advancing_during_ingest(tmp_path, shared_data):
    """With `tokenizer.path`, sealed parts are tokenized while ingest still runs; status shows it."""
    data = tmp_path / "s.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in english_docs(3000, seed=6)))
    cfg = base_config([{"name": "s", "path": str(data)}], str(shared_data / PHI2), output={"shard_records": 100})
    cfg["execution"].update(batch_records=8, unit_mb=0.02)  # ~60 units: ingest goes on while parts are tokenized
    seen, proc, _, err = _poll_during_run(cfg, tmp_path)
    assert proc.returncode == 0, err[-2000:]
    overlap = [s for s in seen if s["state"] == "running" and not s["datasets"]["s"]["ingest"]["done"]
               and s["totals"]["shards_done"] > 0]
    assert overlap, "never saw a tokenized shard while ingest was running"
    for s in seen:
        t = s["totals"]
        assert t["shards_pending"] == t["shards_planned"] - t["shards_done"] >= 0
    assert "sealed part(s) pending" in format_status(overlap[-1]) or overlap[-1]["totals"]["shards_pending"] == 0


# ---- ProgressReporter --------------------------------------------------------------------------------------
async def _simulate(prog: dict, path: Path, size: int, steps: int = 12, dt: float = 0.05) -> None:
    st = IngestState("web")
    prog["web"] = st
    for i in range(1, steps + 1):
        st.consumed += 50
        st.kept += 40
        st.rejected += 10
        st.part_bytes += 20_000
        st.position = {"file": 0, "record": st.consumed, "offset": size * i // (steps + 2)}
        await asyncio.sleep(dt)
    st.done = True
    await asyncio.sleep(dt)


def _source(tmp_path: Path) -> tuple[list[dict], Path, int]:
    path = tmp_path / "web.jsonl"
    path.write_bytes(b"x" * 100_000)
    return [dataset({"name": "web", "path": str(path)}), dataset({"name": "later", "path": str(path)})], path, 100_000


@pytest.mark.slow
@pytest.mark.asyncio
async def test_progress_plain_lines_every_interval(tmp_path):
    datasets, path, size = _source(tmp_path)
    logs.configure(tmp_path, console=False)
    try:
        prog: dict = {}
        rep = ProgressReporter(prog, 0.1, tty=False, datasets=datasets)
        task = asyncio.create_task(rep.run())
        await _simulate(prog, path, size)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        logs.configure(None, console=False)
    lines = [json.loads(x) for x in (tmp_path / "logs" / "streamprep.log").read_text().splitlines()]
    lines = [x for x in lines if x["event"] == "progress"]
    assert len(lines) >= 4 and all(x["component"] == "progress" for x in lines)
    reads = [x["read"] for x in lines]
    assert reads == sorted(reads) and all(x["read"] == x["kept"] + x["rejected"] for x in lines)
    web = [x["datasets"]["web"] for x in lines]
    assert any(w["eta_s"] is not None and w["eta_s"] > 0 for w in web), web  # byte-based ETA from the file size
    assert any(w["rec_s"] for w in web) and web[-1]["mb"] > 0
    assert lines[-1]["datasets"]["later"].get("read") == 0  # configured but not started yet
    line = rep.final_line()
    assert "read 600" in line and "kept 480" in line and "rejected 120" in line and "MB written" in line


@pytest.mark.slow
@pytest.mark.asyncio
async def test_progress_tty_display_and_shards(tmp_path):
    from rich.console import Console

    datasets, path, size = _source(tmp_path)
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, color_system=None)
    prog: dict = {}
    rep = ProgressReporter(prog, 10, datasets=datasets, console=console, refresh_s=0.05)
    assert rep.tty is True
    task = asyncio.create_task(rep.run())
    await _simulate(prog, path, size)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    out = buf.getvalue()
    for word in ("dataset", "read", "kept", "rejected", "MB out", "rec/s", "ETA", "web", "waiting", "done", "%"):
        assert word in out, word
    # tokenization advancing during ingest, shown from a thread: parts sealed / tokenized / pending
    counts = [1, 0]
    pending = []
    with rep.in_thread():
        rep.watch_shards(lambda: (counts[0], counts[1]))
        for sealed, done in ((2, 0), (3, 1), (4, 2), (4, 4)):
            time.sleep(0.08)
            counts[:] = [sealed, done]
            pending.append(rep.snapshot()["shards"]["pending"])
        time.sleep(0.15)
    assert pending == [2, 2, 2, 0]
    snap = rep.snapshot()
    assert snap["phase"] == "ingest" and snap["shards"] == {**snap["shards"], "sealed": 4, "done": 4, "pending": 0}
    assert "4/4 sealed parts · 0 pending" in buf.getvalue()
    counts[:] = [5, 2]
    assert "tokenize: 2/5 shards" in rep.final_line()
    assert rep.snapshot()["shards"]["pending"] == 3


def test_the_tty_display_narrows_the_bar_not_the_figures_on_an_80_column_terminal():
    """Regression: the table kept each dataset's 20-character bar whole, so at 80 columns, with figures in millions,
    it cut every figure to an ellipsis (`12,345,…`, `2500…`, the ETA header `E…`). Now the bar is drawn shorter."""
    from rich.console import Console

    prog = {"project_docs": IngestState(dataset="project_docs", consumed=12_345_678, kept=11_234_567,
                                        rejected=1_111_111, part_bytes=25_000_000_000, done=True),
            "c4": IngestState(dataset="c4", consumed=2_345_678, kept=2_234_567, rejected=111_111,
                              part_bytes=5_000_000_000, position={"file": 0, "offset": 500})}
    datasets = [dataset({"name": "project_docs", "path": "x.jsonl"}),
                dataset({"name": "c4", "path": "y.jsonl", "max_records": 4_691_356})]
    for width in (80, 120):
        buf = io.StringIO()
        console = Console(file=buf, width=width, color_system=None)
        console.print(ProgressReporter(prog, 10, tty=True, datasets=datasets, console=console).render())
        table = buf.getvalue().splitlines()[1:5]
        assert "…" not in "".join(table), (width, table)
        assert table[0].split() == ["dataset", "read", "kept", "rejected", "MB", "out", "rec/s", "progress", "ETA"]
        for name, figures in (("project_docs", "12,345,678 11,234,567 1,111,111 25000.0"),
                              ("c4", "2,345,678 2,234,567 111,111 5000.0"),
                              ("total", "14,691,356 13,469,134 1,222,222 30000.0")):
            assert next(line for line in table if line.startswith(name)).split()[1:5] == figures.split()
        assert (" done " in table[1] and " 50% " in table[2]) and ("█" * 20 in table[1]) is (width == 120)
