"""streamprep.layout: the run-dir paths other modules and stored relative paths depend on."""
from __future__ import annotations

import errno
from pathlib import Path

from streamprep.config import ConfigError
from streamprep.layout import Checkpoint, CheckpointLayout, RunLayout, completed_receipt, needs_change, read_json


def test_paths_match_the_run_dir_contract(tmp_path: Path) -> None:
    lay = RunLayout(tmp_path)
    rel = lambda p: p.relative_to(tmp_path).as_posix()  # noqa: E731
    assert [rel(lay.run_json), rel(lay.manifest), rel(lay.blend), rel(lay.mixtures), rel(lay.lock)] == \
        ["run.json", "manifest.json", "blend.json", "mixtures.json", ".lock"]
    assert rel(lay.ingest_part("c4", 7)) == "ingest/c4/part-00007.jsonl"
    assert rel(lay.receipt("c4", 7)) == rel(lay.receipt("c4", "part-00007")) == "receipts/c4/part-00007.json"
    assert rel(lay.binidx_prefix("c4", 12)) == "binidx/c4/part-00012_text_document"
    assert rel(lay.sft_prefix("chat", "part-00001")) == "sft/chat/part-00001"
    assert rel(lay.rejects("c4")) == "rejects/c4.jsonl"
    assert [rel(lay.tokenizer_json), rel(lay.tokenizer_fingerprint), rel(lay.tokenizer_training)] == \
        ["tokenizer/tokenizer.json", "tokenizer/fingerprint.json", "tokenizer/training.json"]
    assert [rel(lay.audit_json), rel(lay.hf_cache), rel(lay.logs_dir), rel(lay.parquet_dir)] == \
        ["audit/audit.json", "cache/hf", "logs", "parquet"]


def test_checkpoint_dir_names(tmp_path: Path) -> None:
    ck = CheckpointLayout(tmp_path)
    assert [p.name for p in (ck.checkpoint("c4"), ck.dedup_log("c4"), ck.near_log("c4"), ck.lock, ck.owner)] == \
        ["c4.json", "c4.dedup", "c4.near", ".streamprep.lock", ".streamprep-run"]


def test_no_module_but_layout_names_run_or_checkpoint_files() -> None:
    """The map has one owner: no other module spells a part stem, a checkpoint-dir suffix or a lock name
    (inside RunLayout.hf_cache the HF source keeps its own cache format, named after repos, not datasets)."""
    import re

    import streamprep

    spelled = re.compile(r'part-\{|f"\{(dataset|name|ds)[^}]*\}\.(json|dedup|near)"|"\.(streamprep\.lock|streamprep-run|lock)"')
    root = Path(streamprep.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py")
                 if p.name != "layout.py" and spelled.search(p.read_text())]
    assert offenders == []


def test_checkpoint_dir_honours_run_json_and_falls_back_when_moved(tmp_path: Path) -> None:
    lay = RunLayout(tmp_path)
    external = tmp_path.parent / f"{tmp_path.name}-ckpt"
    external.mkdir()
    configured = {"config": {"run": {"checkpoint_dir": str(external)}}}
    assert lay.checkpoints({"checkpoint_dir": str(external), **configured}) == external
    assert lay.checkpoints({}) == tmp_path / "checkpoints"
    (tmp_path / "checkpoints").mkdir()
    assert lay.checkpoints({"checkpoint_dir": str(tmp_path / "gone"), **configured}) == tmp_path / "checkpoints"
    # regression: a copy of a run dir read the original's checkpoints, whose absolute path its run.json records
    assert lay.checkpoints({"checkpoint_dir": str(external), "config": {"run": {"checkpoint_dir": None}}}) \
        == tmp_path / "checkpoints"


def test_planned_parts_and_strict_readers(tmp_path: Path) -> None:
    """Regression: a checkpoint or receipt that is not a JSON object read as "not started" / "pending", so `status`
    showed a finished dataset at 0 and `audit` rewrote a good report with zeros. The readers say it is damaged."""
    import pytest

    assert Checkpoint({"part_index": 2, "part_lines": 5, "done": True}).planned_parts == 3
    assert Checkpoint({"part_index": 2, "part_lines": 5, "done": False}).planned_parts == 2
    assert Checkpoint({"part_index": 2, "part_lines": 0, "done": True}).planned_parts == 2
    bad = CheckpointLayout(tmp_path).checkpoint("c4")
    assert Checkpoint.load(bad).started is False  # none yet
    bad.write_bytes(b"{not json")
    assert read_json(bad) is None
    with pytest.raises(ValueError, match=r"^c4.json is not JSON"):
        Checkpoint.load(bad)
    bad.write_bytes(b"[]")
    with pytest.raises(ValueError, match=r"^c4.json is a JSON array, not an object$"):
        Checkpoint.load(bad)
    rec = tmp_path / "r.json"
    assert completed_receipt(rec) is None
    rec.write_bytes(b'{"status": "compl')
    with pytest.raises(ValueError, match=r"^r.json is not JSON"):
        completed_receipt(rec)
    rec.write_bytes(b'{"status": "running"}')
    assert completed_receipt(rec) is None
    rec.write_bytes(b'{"status": "completed", "stats": {}}')
    assert completed_receipt(rec) == {"status": "completed", "stats": {}}


def test_no_dataset_name_shares_a_file_with_the_checkpoint_dirs_own(tmp_path: Path) -> None:
    """Regression: a dataset named `dedup_holders`, `tokenizer_backend` or `c4.plan` (beside `c4`) had its
    checkpoint overwrite the holders' record, the backend record or c4's plan, and its resume restarted datasets.
    Every fixed name the checkpoint dir holds is refused as a dataset name, and so is `<name>.plan`."""
    import pytest

    from streamprep.config import RESERVED_NAMES, ConfigError, validate

    ck, run = CheckpointLayout(tmp_path), RunLayout(tmp_path)
    fixed = {p.name for p in (ck.dedup_holders, run.tokenizer_backend, run.tokenizer_backend_fallback)}
    assert fixed == {f"{n}.json" for n in RESERVED_NAMES}
    assert ck.plan("c4") == ck.checkpoint("c4.plan")  # why `<name>.plan` is refused
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')
    for name in (*RESERVED_NAMES, "Tokenizer_Backend", "c4.plan", "x.PLAN"):
        with pytest.raises(ConfigError, match=rf"^config: 'datasets\[0\].name': '{name}' would share a file name"):
            validate({"datasets": [{"name": name, "path": str(data)}]})
    validate({"datasets": [{"name": "planner", "path": str(data)}, {"name": "c4.plans", "path": str(data)}]})


def test_needs_change_is_what_the_cli_exits_2_on(tmp_path: Path) -> None:
    """run.json's `needs_change`: the errors re-running as is cannot get past, not the ones a resume does."""
    (tmp_path / "ingest").write_text("a file where a folder goes")
    try:
        (tmp_path / "ingest" / "c4").mkdir(parents=True)
    except (FileExistsError, NotADirectoryError) as exc:
        in_the_way = exc
    assert needs_change(ConfigError("no records were kept")) and needs_change(in_the_way)
    assert needs_change(IsADirectoryError(errno.EISDIR, "Is a directory", str(tmp_path)))
    assert not needs_change(OSError(errno.ENOSPC, "No space left on device"))
    assert not needs_change(RuntimeError("boom")) and not needs_change(KeyboardInterrupt())


def test_a_datasets_dedup_logs_and_restart_leave_a_dataset_named_after_it_alone(tmp_path: Path) -> None:
    """Regression: `dedup_logs("web")` globbed `web.dedup*`, so it listed `web.dedupe`'s checkpoint, plan, inputs,
    sealed and dedup logs, and `web` restarted without a checkpoint (killed before its first) deleted them all."""
    from streamprep.checkpoints import DatasetFiles, load_checkpoint, repair

    ck = CheckpointLayout(tmp_path / "ck")
    ck.checkpoint_dir.mkdir()
    others = ("web.dedupe", "web.dedup", "web.dedup.0-of-x", "web.near", "web.sealed", "web.dedup.dedup")
    theirs = [p for o in others for p in (ck.checkpoint(o), ck.dedup_log(o), ck.dedup_log(o, 1, 2), ck.near_log(o),
                                         ck.plan(o), ck.inputs(o), ck.sealed_log(o))]
    for p in theirs:
        p.write_bytes(b"theirs")
    own = [ck.dedup_log("web"), ck.dedup_log("web", 0, 2), ck.dedup_log("web", 1, 2)]
    for p in own:
        p.write_bytes(b"\0" * 8)
    assert ck.dedup_logs("web") == sorted(own)
    assert ck.dedup_logs("web.dedupe") == sorted([ck.dedup_log("web.dedupe"), ck.dedup_log("web.dedupe", 1, 2)])
    files = DatasetFiles(tmp_path, ck.checkpoint_dir, "web")
    state = repair(files, load_checkpoint(files))  # no checkpoint: starts over
    assert state.consumed == 0 and ck.dedup_logs("web") == []
    assert [p for p in theirs if not p.is_file() or p.read_bytes() != b"theirs"] == []


def test_only_a_start_takes_a_lock_file_streamprep_left_and_no_other(tmp_path: Path) -> None:
    """Regression: a folder holding only a user's own `.lock` ('my lock data') was taken for what a job stopped at its
    start left, and `ingest --fresh` took its lock there, overwriting the file. Only a regular file, empty or holding
    the record RunLock writes, is a start's lock."""
    import os

    from streamprep.lock import RunLock

    layout = RunLayout(tmp_path / "run")
    held = RunLock(layout.lock).acquire()  # its record, as a job killed at its start leaves it
    assert layout.only_a_start()
    held.release()  # empty, as a job stopped at its start leaves it
    assert layout.only_a_start()
    (tmp_path / "empty").write_bytes(layout.lock.read_bytes())
    for theirs in (b"my lock data", b"{}", b'{"pid": 1}', b"[]", b'{"pid": 1, "host": "h", "started": "t", "x": 1}'):
        layout.lock.write_bytes(theirs)
        assert not layout.only_a_start(), theirs
    layout.lock.unlink()
    os.symlink(tmp_path / "empty", layout.lock)  # a link to an empty file: not one RunLock made
    assert not layout.only_a_start()


def test_only_a_start_takes_logs_holding_only_what_a_start_logs(tmp_path: Path) -> None:
    """Regression: only_a_start took any `logs/` beside a released `.lock` (an old run's log and its rotated backups,
    a user's notes.txt), and `ingest --fresh` then appended to that log and rotated the backups away. logs/ may hold
    nothing, or a streamprep.log whose every line is one a job logs before its run.json (layout.START_EVENTS)."""
    import json
    import os

    layout = RunLayout(tmp_path / "run")
    logs = layout.logs_dir
    logs.mkdir(parents=True)
    layout.lock.write_bytes(b"")
    assert layout.only_a_start()  # an empty logs/: the log is created at its first line
    start = "".join(json.dumps({"event": e, "level": "info", "timestamp": "t", "component": "pipeline"}) + "\n"
                    for e in ("took over a stale lock from a process that is gone",
                              "removed temporary files of an interrupted run", "metrics server listening"))
    (logs / "streamprep.log").write_text(start * 3)  # three starts, each stopped before run.json
    assert layout.only_a_start()
    not_a_start = {"streamprep.log.1": "x\n", "notes.txt": "mine\n", "streamprep.log": start + '{"event": "old"}\n'}
    for name, text in not_a_start.items():
        (logs / name).write_text(text)
        assert not layout.only_a_start(), name
        (logs / name).unlink()
    for text in ("not json\n", "[]\n", "\n", start[:-1]):  # a user's lines; a line cut short
        (logs / "streamprep.log").write_text(text)
        assert not layout.only_a_start(), text
    (logs / "streamprep.log").unlink()
    os.symlink(tmp_path / "elsewhere", logs / "streamprep.log")  # a link: the job would write through it
    (tmp_path / "elsewhere").write_text(start)
    assert not layout.only_a_start()
    (logs / "streamprep.log").unlink()
    logs.rmdir()
    logs.write_text("")  # a file named logs: the job's mkdir fails on it
    assert not layout.only_a_start()
