"""Nothing outside the run is deleted or overwritten: temp-file sweeps, external checkpoint dirs, the
checkpoint-dir lock, symlinks planted in the run dir; plus run hygiene (no /tmp/pymp-* left, also after a kill -9;
valid SVG)."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from helpers import REPO, base_config, english_docs
from streamprep import atomic, run_from_dict
from streamprep.cli import main
from streamprep.config import ConfigError
from streamprep.layout import CheckpointLayout
from streamprep.lock import RunLock



def _config(tmp: Path, name: str = "alpha", **execution) -> dict:
    path = tmp / f"{name}-input.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(120, seed=5)))
    cfg = base_config([{"name": name, "path": str(path)}], None, output={"shard_records": 100})
    cfg["execution"].update(execution)
    return cfg


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_sweep_removes_only_streamprep_temporaries(tmp_path):
    ours = tmp_path / "sub" / f".part.jsonl{atomic.TMP_MARK}4242"
    ours.parent.mkdir()
    ours.write_bytes(b"x")
    foreign = {"x.json": b"{}", ".foo.tmp.123": b"user", ".bar.json.tmp.77": b"user"}
    for name, data in foreign.items():
        (tmp_path / name).write_bytes(data)
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (outside / f".keep{atomic.TMP_MARK}1").write_bytes(b"not in the swept tree")
    (tmp_path / "link").symlink_to(outside, target_is_directory=True)

    assert atomic.sweep_tmp(tmp_path) == [ours]
    assert not ours.exists()
    assert {n: (tmp_path / n).read_bytes() for n in foreign} == foreign
    assert (outside / f".keep{atomic.TMP_MARK}1").read_bytes() == b"not in the swept tree"


def test_external_checkpoint_dir_keeps_unrelated_files(tmp_path):
    ckpt = tmp_path / "shared-ckpt"
    ckpt.mkdir()
    for name, data in {"x.json": b'{"mine": 1}\n', ".foo.tmp.123": b"user tmp", ".lock": b"user lock"}.items():
        (ckpt / name).write_bytes(data)
    before = _snapshot(ckpt)
    cfg = _config(tmp_path)
    cfg["run"]["checkpoint_dir"] = str(ckpt)

    assert run_from_dict(cfg, run_dir=tmp_path / "run", console_log=False).status == "complete"
    after = _snapshot(ckpt)
    assert {n: after[n] for n in before} == before
    assert json.loads(after["alpha.json"])["writer"] == "streamprep" and after["alpha.json"] != before.get("alpha.json")


def test_later_run_reusing_a_checkpoint_dir_is_refused(tmp_path):
    """Sequential sharing: run B must not 'repair' (delete) run A's checkpoints as if they were its own."""
    ckpt = tmp_path / "shared-ckpt"
    cfg = _config(tmp_path)
    cfg["run"]["checkpoint_dir"] = str(ckpt)
    run_from_dict(cfg, run_dir=tmp_path / "run-a", console_log=False)
    before = _snapshot(ckpt)
    with pytest.raises(ConfigError, match="holds the checkpoints of another run"):
        run_from_dict(cfg, run_dir=tmp_path / "run-b", console_log=False)
    assert _snapshot(ckpt) == before and not (tmp_path / "run-b" / "run.json").exists()


def test_only_a_claim_naming_this_run_dir_with_nothing_written_is_adopted_outside_it(tmp_path):
    """The decision below, without a job: an outside checkpoint dir's claim is the run's to go on with when it names
    this run dir (a path holding a newline too) and no output was written; not another run dir's, not a claim naming
    none (an earlier streamprep's, one line), not once a checkpoint is there."""
    from streamprep import config as configmod, pipeline
    from streamprep.checkpoints import claim, claimed_from, owner_of

    ckpt, run_a = tmp_path / "ck", tmp_path / "run\na"
    cfg = _config(tmp_path)
    cfg["run"]["checkpoint_dir"] = str(ckpt)
    config = configmod.load(cfg, tmp_path)
    ckpt.mkdir()
    assert claim(ckpt, "abc123", run_a) is None and claim(ckpt, "other", tmp_path / "run-b") == "abc123"
    assert (owner_of(ckpt), claimed_from(ckpt)) == ("abc123", run_a)
    assert pipeline._adopted(config, run_a)["run_id"] == "abc123"
    assert pipeline._adopted(config, tmp_path / "run-b") is None
    (ckpt / "alpha.json").write_text("{}")
    assert pipeline._adopted(config, run_a) is None
    (ckpt / "alpha.json").unlink()
    (ckpt / ".streamprep-run").write_text("abc123\n")
    assert (owner_of(ckpt), claimed_from(ckpt), pipeline._adopted(config, run_a)) == ("abc123", None, None)


@pytest.mark.parametrize("name", ["run\ra", "run\r\na", "run\n\ra\n", "ü\x85\u2028b"])
def test_a_claim_names_its_run_dir_whatever_line_ends_its_name_holds(tmp_path, name):
    """Regression: the claim was read as text (universal newlines), so a run dir whose name holds '\\r' was read back
    as another ('\\r' became '\\n'): its own job's claim was never taken back, every re-run refused (exit 2)."""
    from streamprep import config as configmod, pipeline
    from streamprep.checkpoints import claim, claimed_from, owner_of

    ckpt, run_dir = tmp_path / "ck", tmp_path / name
    cfg = _config(tmp_path)
    cfg["run"]["checkpoint_dir"] = str(ckpt)
    ckpt.mkdir()
    assert claim(ckpt, "abc123", run_dir) is None
    assert (ckpt / ".streamprep-run").read_bytes() == f"abc123\n{run_dir}\n".encode()
    assert (owner_of(ckpt), claimed_from(ckpt)) == ("abc123", run_dir)
    assert pipeline._adopted(configmod.load(cfg, tmp_path), run_dir)["run_id"] == "abc123"


@pytest.mark.slow
def test_a_claim_its_own_job_left_before_run_json_is_taken_back_by_the_same_command(tmp_path, monkeypatch, capsys):
    """Regression: with `run.checkpoint_dir` outside the run dir, a job killed after it claimed that folder
    (`.streamprep-run`) and before it wrote run.json left a claim no later run adopted: every re-run of its command,
    with `--fresh` too, was refused (exit 2) as another run's. The claim names its run dir: the same run dir takes it
    (with or without `--fresh`), to the bytes of a run never killed; another run dir, or a claim naming none (an
    earlier streamprep's), is still refused, nothing written."""
    from streamprep import pipeline
    from streamprep.checkpoints import owner_of

    class Killed(BaseException):
        """The job's end at its first run.json write, just after its claim, as a kill -9 there ends it."""

    def killed_at_start(run_dir: Path, ckpt: Path) -> dict:
        cfg = _config(tmp_path)
        cfg["run"]["checkpoint_dir"] = str(ckpt)
        def killed(*args, **kwargs) -> None:
            raise Killed

        with monkeypatch.context() as m:
            m.setattr(pipeline.Job, "_save_record", killed)
            with pytest.raises(Killed):
                run_from_dict(cfg, run_dir=run_dir, console_log=False)
        assert sorted(os.listdir(run_dir)) == [".lock", "logs"]
        assert sorted(os.listdir(ckpt)) == [".streamprep-run", ".streamprep.lock"]
        return cfg

    def tokens(run_dir: Path) -> dict[str, bytes]:
        return {p.name: p.read_bytes() for p in (run_dir / "binidx" / "alpha").iterdir()}

    run_a, ckpt_a = tmp_path / "run-a", tmp_path / "ck-a"
    cfg = killed_at_start(run_a, ckpt_a)
    claimed = _snapshot(ckpt_a)
    with pytest.raises(ConfigError, match=f"{ckpt_a} holds the checkpoints of another run"):
        run_from_dict(cfg, run_dir=tmp_path / "run-b", console_log=False)  # another run dir
    assert _snapshot(ckpt_a) == claimed and not (tmp_path / "run-b").exists()
    cfg_path = tmp_path / "a.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    assert main(["ingest", "--config", str(cfg_path), "--run-dir", str(run_a), "--fresh"]) == 0, capsys.readouterr()
    assert json.loads((run_a / "run.json").read_text())["status"] == "complete"
    assert owner_of(ckpt_a) == json.loads((run_a / "run.json").read_text())["run_id"]

    run_c, ckpt_c = tmp_path / "run-c", tmp_path / "ck-c"
    cfg = killed_at_start(run_c, ckpt_c)
    assert run_from_dict(cfg, run_dir=run_c, console_log=False).status == "complete"  # without --fresh
    assert tokens(run_c) == tokens(run_a) and len(tokens(run_a)) == 4  # 2 parts: .bin, .idx

    (run_c / "run.json").unlink()  # its checkpoints written: not a start, not adopted (docs/operations.md)
    with pytest.raises(ConfigError, match=f"{ckpt_c} holds the checkpoints of another run"):
        run_from_dict(cfg, run_dir=run_c, console_log=False)

    run_d, ckpt_d = tmp_path / "run-d", tmp_path / "ck-d"
    cfg = killed_at_start(run_d, ckpt_d)
    (ckpt_d / ".streamprep-run").write_text(f"{owner_of(ckpt_d)}\n")  # an earlier streamprep's claim: no run dir
    with pytest.raises(ConfigError, match=f"{ckpt_d} holds the checkpoints of another run"):
        run_from_dict(cfg, run_dir=run_d, fresh=True, console_log=False)
    assert sorted(os.listdir(run_d)) == [".lock", "logs"]


def test_a_resume_with_another_checkpoint_dir_is_refused_until_the_checkpoints_move(tmp_path):
    """It found no checkpoint in the new folder and started the dataset over, removing its parts, while the
    run's checkpoints sat in the old one."""
    cfg, run_dir = _config(tmp_path), tmp_path / "run"
    cfg["run"]["checkpoint_dir"] = str(tmp_path / "ck-a")
    assert run_from_dict(cfg, run_dir=run_dir, console_log=False).status == "complete"
    def outputs() -> dict[Path, bytes]:
        return {p: p.read_bytes() for d in ("ingest", "binidx") for p in (run_dir / d).rglob("*") if p.is_file()}

    parts = outputs()
    assert len(parts) == 6
    cfg["run"]["checkpoint_dir"] = str(tmp_path / "ck-b")
    with pytest.raises(ConfigError, match=f"'run.checkpoint_dir' changed.*checkpoints are in {tmp_path / 'ck-a'}"):
        run_from_dict(cfg, run_dir=run_dir, console_log=False)
    assert not (tmp_path / "ck-b").exists()
    assert outputs() == parts

    del cfg["run"]["checkpoint_dir"]  # back to RUN_DIR/checkpoints: refused as well
    with pytest.raises(ConfigError, match="'run.checkpoint_dir' changed"):
        run_from_dict(cfg, run_dir=run_dir, console_log=False)

    shutil.move(tmp_path / "ck-a", tmp_path / "ck-b")  # the checkpoints moved with the config: the run goes on
    cfg["run"]["checkpoint_dir"] = str(tmp_path / "ck-b")
    assert run_from_dict(cfg, run_dir=run_dir, console_log=False).status == "complete"
    assert outputs() == parts


def test_input_at_a_checkpoint_name_is_refused_not_parsed_or_deleted(tmp_path):
    ckpt = tmp_path / "data"
    ckpt.mkdir()
    cfg = _config(ckpt, name="c4")  # writes data/c4-input.jsonl; now also an unrelated c4.json there
    user = b'{"text": "an input record, not a checkpoint"}\n{"text": "second"}\n'
    (ckpt / "c4.json").write_bytes(user)
    cfg["run"]["checkpoint_dir"] = str(ckpt)

    with pytest.raises(ConfigError, match="c4.json.*not a streamprep checkpoint"):
        run_from_dict(cfg, run_dir=tmp_path / "run", console_log=False)
    assert (ckpt / "c4.json").read_bytes() == user
    assert not (tmp_path / "run" / "run.json").exists()


def test_second_run_sharing_a_checkpoint_dir_is_refused(tmp_path, capsys):
    ckpt = tmp_path / "shared-ckpt"
    first = RunLock(CheckpointLayout(ckpt).lock, "checkpoint dir").acquire()  # the first run, still going
    try:
        cfg = _config(tmp_path)
        cfg["run"]["checkpoint_dir"] = str(ckpt)
        with pytest.raises(ConfigError, match=f"checkpoint dir {ckpt} is in use by pid {os.getpid()}"):
            run_from_dict(cfg, run_dir=tmp_path / "run-b", console_log=False)
        cfg_path = tmp_path / "b.yaml"
        cfg_path.write_text(yaml.safe_dump(cfg))
        assert main(["ingest", "--config", str(cfg_path), "--run-dir", str(tmp_path / "run-c")]) == 2
        assert "checkpoint dir" in capsys.readouterr().err
        assert sorted(p.name for p in ckpt.iterdir()) == [CheckpointLayout(ckpt).lock.name]
        assert not (tmp_path / "run-b" / "run.json").exists()
    finally:
        first.release()


def test_symlink_in_run_dir_leading_outside_is_not_written_through(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "rejects").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ConfigError, match="rejects is a symlink leading outside"):
        run_from_dict(_config(tmp_path), run_dir=run_dir, console_log=False)
    assert list(outside.iterdir()) == []


def test_writes_and_appends_do_not_follow_a_symlink(tmp_path):
    from streamprep.ingest import _append

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    target = tmp_path / "run" / "part.jsonl"
    target.parent.mkdir()
    atomic.tmp_path(target).symlink_to(victim)  # a planted temporary name
    with pytest.raises(OSError):
        atomic.write_bytes(target, b"data")
    target.symlink_to(victim)
    with pytest.raises(OSError):
        asyncio.run(_append(target, b"more"))
    assert victim.read_bytes() == b"keep"


def test_a_file_written_piece_by_piece_appears_whole_or_not_at_all(tmp_path):
    """`atomic.writing` (parts, columns files, every `write_bytes`): the final name holds either the old bytes or
    all the new ones; a block that raises leaves the old file and no temporary."""
    target = tmp_path / "deep" / "part.jsonl"
    with atomic.writing(target) as fh:
        fh.write(b"first\n")
        assert not target.exists() and atomic.tmp_path(target).exists()
        fh.write(b"second\n")
    assert target.read_bytes() == b"first\nsecond\n"
    with pytest.raises(RuntimeError, match="mid-write"):
        with atomic.writing(target) as fh:
            fh.write(b"partial")
            raise RuntimeError("mid-write")
    assert target.read_bytes() == b"first\nsecond\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["part.jsonl"]


def test_a_scratch_file_is_renamed_whole_without_fsync_and_a_durable_one_is_synced(tmp_path, monkeypatch):
    """`durable=False` (the judged staging, which a resume removes) writes through the same temporary and rename but
    calls no fsync; the default syncs the file and its directory."""
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    target = tmp_path / "u0-0.judged"
    atomic.write_bytes(target, b"scratch", durable=False)
    assert target.read_bytes() == b"scratch" and synced == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["u0-0.judged"]
    atomic.write_bytes(target, b"kept")
    assert target.read_bytes() == b"kept" and len(synced) == 2  # the file, then its directory


class _SvgAttrs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.svgs: list[dict[str, str | None]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "svg":
            self.svgs.append(dict(attrs))


def _pymp_dirs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("pymp-"))


def _private_tmp_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The environment of a `streamprep ingest` with a temporary directory of its own (where multiprocessing puts
    the forkserver's socket folder), and that directory."""
    private_tmp = tmp_path / "tmpdir"
    private_tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(private_tmp), "PYTHONPATH": str(REPO)}
    env.pop("RAY_ADDRESS", None)
    return env, private_tmp


@pytest.mark.slow
def test_cli_run_leaves_no_pymp_dir_and_audit_svg_is_well_formed(tmp_path):
    env, private_tmp = _private_tmp_env(tmp_path)
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(_config(tmp_path, workers=2)))
    proc = subprocess.run([sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path),
                           "--run-dir", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert _pymp_dirs(private_tmp) == []

    parser = _SvgAttrs()
    parser.feed((tmp_path / "run" / "audit" / "audit.html").read_text())
    assert parser.svgs
    for attrs in parser.svgs:
        assert set(attrs) == {"class", "role", "width", "height", "viewBox".lower()}
        assert attrs["viewbox"] == f"0 0 {attrs['width']} {attrs['height']}"


@pytest.mark.slow
def test_kill_9_of_the_driver_leaves_none_of_its_processes(tmp_path):
    """Regression: after `kill -9` of the driver, its pool workers (children of multiprocessing's forkserver)
    stayed blocked on the dead driver's queue and kept the forkserver and the resource tracker alive for good.
    Every pool worker now exits with the driver, and the other two follow. Regression too: the forkserver's socket
    folder (pymp-*) then stayed in the temporary directory for good; the forkserver now removes it as it ends."""
    import psutil

    from helpers import base_config, english_docs

    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(20_000, seed=4)))
    cfg = base_config([{"name": "d", "path": str(src)}], None, output={"shard_records": 2000})
    cfg["execution"].update(workers=2, unit_mb=0.05)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    env, private_tmp = _private_tmp_env(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "streamprep", "ingest", "--config", str(tmp_path / "cfg.yaml"),
                             "--run-dir", str(tmp_path / "run")], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(psutil.Process(proc.pid).children(recursive=True)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)  # the resource tracker, the forkserver and its workers are up
    assert proc.poll() is None, "the job ended before its pools started"
    assert _pymp_dirs(private_tmp)  # the forkserver's, in use
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    def session() -> list[int]:
        return [p.pid for p in psutil.process_iter() if _sid(p.pid) == proc.pid]

    deadline = time.monotonic() + 10
    while (left := session()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert left == []
    assert _pymp_dirs(private_tmp) == []


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


@pytest.mark.parametrize("layout", ["run dir in the folder", "run dir is the folder", "checkpoint dir in the folder",
                                    "glob reaching the run dir", "glob not reaching it"])
def test_a_run_dir_inside_a_datasets_folder_is_refused_before_anything_is_written(tmp_path, capsys, layout):
    """Regression: the job listed its own run.json, logs and tokenizer as input records (101 160 parse rejects from
    50 lines), and a resume found those inputs changed and exited 2."""
    data = tmp_path / "data"
    (data / "x").mkdir(parents=True)
    (data / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(5)))
    raw = _config(tmp_path)
    raw["datasets"][0]["path"] = str(data / "*/*.json" if layout == "glob reaching the run dir" else
                                     data / "*.jsonl" if layout == "glob not reaching it" else data)
    if layout.startswith("glob"):
        (data / "x" / "b.json").write_text(json.dumps({"text": english_docs(1)[0]}) + "\n")
    run_dir = data if layout == "run dir is the folder" else \
        tmp_path / "run" if layout == "checkpoint dir in the folder" else data / "run"
    if layout == "checkpoint dir in the folder":
        raw["run"]["checkpoint_dir"] = str(data / "ck")
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    before = sorted(tmp_path.rglob("*"))
    code = main(["ingest", "--config", str(cfg), "--run-dir", str(run_dir)])
    if layout == "glob not reaching it":
        assert code == 0
        return
    err = capsys.readouterr().err.strip().splitlines()
    where, folder = ("'run.checkpoint_dir'", data / "ck") if layout.startswith("checkpoint") else ("run dir", run_dir)
    assert code == 2 and err == [f"streamprep: error: {where} {folder} is inside dataset alpha's path "
                                 f"{raw['datasets'][0]['path']}: the job would read its own outputs as input; "
                                 f"choose a {where} outside it"]
    assert sorted(tmp_path.rglob("*")) == before  # nothing written


@pytest.mark.slow
def test_a_finished_run_rerun_repairs_what_is_missing_or_damaged(tmp_path):
    """Regression: a finished run's re-run checked only its shards' sizes and that manifest.json existed, so it
    said "complete" over a deleted Parquet TSV, a truncated manifest.json or a deleted ingest part (and `verify`
    failed after it), and a receipt of the wrong shape failed every re-run (AttributeError, exit 1). Each now sends
    the job through its stages, which redo what is needed, to the same bytes."""
    from streamprep.verify import verify_run

    raw, run = _config(tmp_path), tmp_path / "run"
    assert run_from_dict(raw, run_dir=run, console_log=False).status == "complete"
    before = _outputs(run)
    tsv = next((run / "parquet").glob("*.tsv"))
    mixtures = run / "mixtures.json"
    damages = {"a deleted TSV": tsv.unlink,
               "a truncated manifest": lambda: (run / "manifest.json").write_bytes(b'{"version": 1, "fil'),
               "a deleted ingest part": (run / "ingest" / "alpha" / "part-00000.jsonl").unlink,
               "a deleted sealed log": (run / "checkpoints" / "alpha.sealed").unlink,  # which lists the parts
               "a receipt that is a list": lambda: (run / "receipts" / "alpha" / "part-00000.json").write_text("[]"),
               # regression: these two kept the re-run's "nothing to do", and `verify` failing
               "a byte changed in mixtures.json": lambda: mixtures.write_bytes(mixtures.read_bytes().replace(b"1", b"2", 1)),
               "a stale Parquet shard": lambda: shutil.copy(tsv.with_suffix(".parquet"),
                                                            run / "parquet" / "shard_b00_s00099.parquet")}
    for what, damage in damages.items():
        damage()
        assert run_from_dict(raw, run_dir=run, console_log=False).status == "complete", what
        assert verify_run(run) == [], what
        assert _outputs(run) == before, what
    log = (run / "logs" / "streamprep.log").read_text()
    assert log.count("finished run has a missing, changed or unreadable file") == len(damages)
    moved = tmp_path / "moved"  # regression: blend.json kept naming the shards where the run dir was before
    run.rename(moved)
    assert verify_run(moved) != []
    assert run_from_dict(raw, run_dir=moved, console_log=False).status == "complete"
    assert verify_run(moved) == [] and str(moved / "binidx") in (moved / "blend.json").read_text()


def _outputs(run: Path) -> dict[str, str]:
    """The hashes of a run's outputs that a redone shard must give again."""
    from helpers import tree_hashes

    return tree_hashes(run, "ingest", "binidx", "parquet", "receipts", "tokenizer",
                       names=("manifest.json", "mixtures.json", "blend.json"))


@pytest.mark.slow
def test_a_finished_run_rerun_redoes_a_receipt_changed_since_not_signs_it(tmp_path):
    """Regression: a receipt edited after the run finished (its stats, its EOD id: valid JSON, its shard's files
    untouched) sent the re-run through its stages, which skipped the shard (its files still matched the receipt)
    and signed the changed receipt into a new manifest.json: `verify` then said "all files match". A receipt whose
    bytes differ from the manifest run.json signs is now removed and its shard redone: the run's bytes as before."""
    from streamprep.verify import verify_run

    raw, run = _config(tmp_path), tmp_path / "run"
    assert run_from_dict(raw, run_dir=run, console_log=False).status == "complete"
    before = _outputs(run)
    receipts = [run / "receipts" / "alpha" / f"part-0000{i}.json" for i in (0, 1)]
    first, second = (json.loads(p.read_text()) for p in receipts)
    atomic.write_json(receipts[0], {**first, "stats": {**first["stats"], "tokens_hist": {"1": 1}}})
    atomic.write_json(receipts[1], {**second, "eod_id": second["eod_id"] + 1})
    problems = verify_run(run)
    assert all(any(p.startswith(f"receipts/alpha/{path.name}: content differs from manifest.json") for p in problems)
               for path in receipts)
    assert run_from_dict(raw, run_dir=run, console_log=False).status == "complete"
    assert verify_run(run) == []
    assert _outputs(run) == before
    log = (run / "logs" / "streamprep.log").read_text()
    assert log.count("receipt differs from manifest.json; its shard is redone") == 2


@pytest.mark.slow
def test_a_receipt_whose_counts_disagree_with_its_shard_does_not_keep_a_run_from_finishing(tmp_path):
    """Regression: a receipt whose token count was edited failed every re-run (`ExportError: alpha/part-00000: .idx
    holds N tokens, receipt says N-1`, exit 1, "resumable"): the shard was skipped and the exports refused it. Its
    shard is now redone. A disagreement only its part shows (a dropped line past the part's end, with counts that
    agree) still stops the exports, with an error naming the receipt and the repair, which then works."""
    from streamprep.exports import ExportError
    from streamprep.verify import verify_run

    raw, run = _config(tmp_path), tmp_path / "run"
    assert run_from_dict(raw, run_dir=run, console_log=False).status == "complete"
    before = _outputs(run)
    path = run / "receipts" / "alpha" / "part-00000.json"
    receipt, record = json.loads(path.read_text()), json.loads((run / "run.json").read_text())
    stats, lines = receipt["stats"], receipt["stats"]["num_input_records"]
    atomic.write_json(run / "run.json", {**record, "status": "failed"})  # as the failing re-runs left it
    atomic.write_json(path, {**receipt, "stats": {**stats, "num_tokens": stats["num_tokens"] - 1}})
    assert run_from_dict(raw, run_dir=run, console_log=False).status == "complete"
    assert verify_run(run) == [] and _outputs(run) == before
    atomic.write_json(run / "run.json", {**record, "status": "failed"})
    atomic.write_json(path, {**receipt, "stats": {**stats, "dropped_empty": [lines], "num_input_records": lines + 1}})
    ingest = run / "ingest" / "alpha" / "part-00000.jsonl"
    with pytest.raises(ExportError) as err:
        run_from_dict(raw, run_dir=run, console_log=False)
    assert str(err.value) == (f"alpha/part-00000: it drops line {lines} but {ingest} has {lines} lines; its receipt "
                              f"{path} is damaged: delete it and re-run the same `streamprep ingest` command to redo "
                              f"the shard")
    path.unlink()
    assert run_from_dict(raw, run_dir=run, console_log=False).status == "complete"
    assert verify_run(run) == [] and _outputs(run) == before


@pytest.mark.parametrize("rel", [".lock", "logs/streamprep.log", "checkpoints/.streamprep.lock"])
def test_a_folder_where_the_run_keeps_a_file_is_exit_2_naming_it(tmp_path, capsys, rel):
    """Regression: a folder in place of the run's lock or log file was a bare IsADirectoryError, exit 1, at every
    re-run (a failure the same command cannot resume from)."""
    raw = _config(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    run = tmp_path / "run"
    (run / rel).mkdir(parents=True)
    assert main(["ingest", "--config", str(cfg), "--run-dir", str(run)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"streamprep: error: {run / rel} is a folder where the run keeps a file of its own (a lock or its log); remove it"]


def _completed_run(tmp_path: Path) -> tuple[Path, Path, Callable[[], dict]]:
    """A completed run of `_config`: its config file, its run dir, and the hashes of its outputs (a function)."""
    cfg, run = tmp_path / "c.yaml", tmp_path / "run"
    cfg.write_text(yaml.safe_dump(_config(tmp_path)))
    assert main(["ingest", "--config", str(cfg), "--run-dir", str(run)]) == 0
    return cfg, run, lambda: _outputs(run)


@pytest.mark.slow  # whole jobs (the mark sat on the helper above, where it marked nothing)
def test_a_file_in_place_of_a_folder_of_a_run_is_exit_2_naming_it_and_resumes_once_removed(tmp_path, capsys):
    """Regression: a file where the run keeps a folder was a raw FileExistsError or NotADirectoryError, exit 1, a
    "RESUMABLE" run at every re-run; `status` and `audit` printed it raw too."""
    cfg, run, outputs = _completed_run(tmp_path)
    before = outputs()
    for rel, commands in (("ingest/alpha", ["ingest"]), ("receipts/alpha", ["ingest", "audit"]),
                          ("binidx", ["ingest"]), ("checkpoints", ["ingest", "status", "audit"])):
        shutil.move(run / rel, tmp_path / "aside")
        (run / rel).write_text("junk")
        for command in commands:
            capsys.readouterr()
            args = ["--config", str(cfg), "--run-dir", str(run)] if command == "ingest" else [str(run)]
            assert main([command, *args]) == 2, (rel, command)
            assert capsys.readouterr().err.splitlines()[-1:] == [
                f"streamprep: error: {run / rel} is a file where the run keeps a folder; remove it and re-run"], rel
        (run / rel).unlink()
        shutil.move(tmp_path / "aside", run / rel)
        assert main(["ingest", "--config", str(cfg), "--run-dir", str(run)]) == 0, rel
        assert outputs() == before, rel


def test_a_folder_in_place_of_any_file_of_a_run_is_exit_2_naming_it_and_resumes_once_removed(tmp_path, capsys):
    """Regression: a folder where the run keeps a shard, receipt, checkpoint, ingest part or run-level file was a
    bare IsADirectoryError, exit 1, at every re-run (the message named a temporary file, not the folder)."""
    cfg, run, outputs = _completed_run(tmp_path)
    before = outputs()
    for rel in ("binidx/alpha/part-00000_text_document.bin", "receipts/alpha/part-00001.json",
                "checkpoints/alpha.json", "ingest/alpha/part-00000.jsonl", "manifest.json"):
        (run / rel).unlink()
        (run / rel).mkdir()
        capsys.readouterr()
        assert main(["ingest", "--config", str(cfg), "--run-dir", str(run)]) == 2, rel
        assert capsys.readouterr().err.splitlines()[-1:] == [
            f"streamprep: error: {run / rel} is a folder where the run keeps a file; remove it and re-run"], rel
        (run / rel).rmdir()
        assert main(["ingest", "--config", str(cfg), "--run-dir", str(run)]) == 0, rel
        assert outputs() == before, rel


def test_a_run_dir_on_an_object_store_is_exit_2_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """Regression: `--run-dir s3://bucket/out` ran the job into a local folder `s3:/bucket/out`, exit 0."""
    raw = _config(tmp_path)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    assert main(["ingest", "--config", str(cfg), "--run-dir", "s3://bucket/out"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        ("streamprep: error: run dir 's3://bucket/out' must be a local (or mounted) folder: its files are renamed "
         "into place atomically")]
    assert not (tmp_path / "s3:").exists()


def test_a_lock_whose_record_cannot_be_written_is_still_taken_and_released(tmp_path: Path, monkeypatch) -> None:
    """Regression (a full disk): writing the holder's record raised after the flock was taken, and the open file
    was neither closed nor kept, so the lock stayed held: a second run in the same process was refused ("in use by
    pid ?"), and re-running a finished run on a full disk failed with a bare OSError."""
    import errno

    from streamprep import lock as lockmod

    def full(fd: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    path = tmp_path / ".lock"
    with monkeypatch.context() as m:
        m.setattr(lockmod.os, "write", full)
        held = RunLock(path).acquire()
        with pytest.raises(lockmod.RunLocked):  # it is the lock, record or not
            RunLock(path).acquire()
        held.release()
    RunLock(path).acquire().release()


def test_a_resume_that_takes_over_stale_locks_says_which(tmp_path):
    """Regression: after a kill -9 the resume logged "took over a stale lock from a process that is gone" twice, the
    same words, once for the run dir's lock and once for the checkpoint dir's, without saying which was which."""
    from helpers import log_events
    from streamprep.layout import RunLayout

    cfg, run = _config(tmp_path), tmp_path / "run"
    run_from_dict(cfg, run_dir=run, console_log=False)
    dead = {"pid": 2**22 + 1, "host": "gone", "started": "2020-01-01T00:00:00Z"}  # a record no flock holds
    locks = [RunLayout(run).lock, CheckpointLayout(run / "checkpoints").lock]
    for path in locks:
        path.write_bytes(json.dumps(dead).encode())
    assert run_from_dict(cfg, run_dir=run, console_log=False).status == "complete"
    took = log_events(run, "took over a stale lock from a process that is gone")
    assert [(e["lock"], e["previous"]) for e in took] == [(str(path), dead) for path in locks]


@pytest.mark.slow
@pytest.mark.parametrize("sent", ["to the group", "to the process, then the group",
                                  "SIGINT to the process, then the group"])
def test_sigterm_to_the_jobs_process_group_stops_it_without_restarting_its_workers_or_holders(tmp_path, sent):
    """Regression: a SIGTERM to the job's whole process group (GNU `timeout`, `kill -TERM -- -PGID`, a systemd
    stop) also ended the pool's workers, their forkserver and the dedup holder while the job's process was saving
    its progress: the log said `a worker process died; its calls run again on a new pool` and `a dedup holder was
    lost; …`, and a new pool and holder were started as the job stopped. The forkserver and the holder now ignore
    SIGTERM (the job's process ends them) and a pool its workers' SIGTERM broke is not replaced while the job stops:
    the stop is as clean as a Ctrl-C's, and the same command resumes. GNU `timeout` sends its SIGTERM to the job's
    process, then to the group: the second copy was taken for a second signal and the job exited at once
    (`second signal, exiting now`), its progress not saved; a SIGTERM again within a second is the same stop."""
    src = tmp_path / "d.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(20_000, seed=4)))
    cfg = base_config([{"name": "d", "path": str(src)}], None, output={"shard_records": 2000})
    cfg["execution"].update(workers=2, unit_mb=0.05)
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    command = [sys.executable, "-m", "streamprep", "ingest", "--config", str(tmp_path / "cfg.yaml"),
               "--run-dir", str(tmp_path / "run")]
    log = tmp_path / "run" / "logs" / "streamprep.log"
    with open(tmp_path / "err", "wb") as err:
        proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and (  # the pool and the holder are at work
            not log.exists() or '"parts sealed"' not in log.read_text()):
        time.sleep(0.05)
    assert proc.poll() is None, "the job ended before its workers were at work"
    sig = signal.SIGINT if sent.startswith("SIGINT") else signal.SIGTERM  # `timeout -s INT` sends it so too
    if sent != "to the group":
        os.kill(proc.pid, sig)  # as `timeout` does: the process, then its group; its copy came once the
        stop_by = time.monotonic() + 0.5  # first was handled, 1 run in ~2 (here: then, every time)
        while '"signal received' not in log.read_text() and time.monotonic() < stop_by:
            time.sleep(0.005)
    os.killpg(proc.pid, sig)
    assert proc.wait(timeout=60) == 1
    events = [json.loads(line)["event"] for line in log.read_text().splitlines()]
    assert "signal received: saving progress and stopping" in events
    assert [e for e in events if e.startswith(("a worker process died", "a dedup holder"))] == []
    assert "interrupted; progress saved" in (tmp_path / "err").read_text()
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "interrupted"

    resumed = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "complete"
