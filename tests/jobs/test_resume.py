"""Crash safety: checkpoint repair cases, and real kills (SIGKILL / SIGINT) of `streamprep ingest` at random
moments in every phase, each followed by a resume; outputs must equal an uninterrupted run's, byte for byte."""
from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from helpers import base_config, english_docs, log_events, tree_hashes
from streamprep import run_from_dict, version
from streamprep.checkpoints import DatasetFiles, load_checkpoint, repair

COMPARED = ("ingest", "rejects", "binidx", "receipts", "parquet", "tokenizer")
TOP_FILES = ("manifest.json", "mixtures.json")
RESUMED_BY_OTHER = ("resuming a run made with another streamprep: what it wrote stays, beside what this one writes; "
                    "for outputs of this streamprep alone, start over with a new --run-dir")


def _corpus(tmp: Path, n: int) -> list[dict]:
    docs = english_docs(n, seed=3)
    a, b = tmp / "a.jsonl", tmp / "b.jsonl.gz"
    lines = [json.dumps({"text": t, "id": i}) for i, t in enumerate(docs[: n // 2])]
    lines[10:10] = ["{not json", json.dumps({"text": docs[0], "id": "dup"})]
    a.write_text("\n".join(lines) + "\n")
    import gzip

    b.write_bytes(gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in docs[n // 2:]).encode(), mtime=0))
    return [{"name": "alpha", "path": str(a)}, {"name": "beta", "path": str(b)}]


def _config(tmp: Path, n: int) -> dict:
    cfg = base_config(_corpus(tmp, n), None, output={"shard_records": 150})  # 27 shards: many kill windows
    cfg["execution"].update(batch_records=32, unit_mb=0.02)  # ~40 units: kills land inside ingest too
    cfg["tokenizer"]["train"]["sample_mb"] = 0.2  # trained mid-ingest: shards are tokenized while ingest runs
    return cfg


def _compare(a: Path, b: Path) -> None:
    ha, hb = tree_hashes(a, *COMPARED, names=TOP_FILES), tree_hashes(b, *COMPARED, names=TOP_FILES)
    assert sorted(ha) == sorted(hb)
    assert {k for k in ha if ha[k] != hb[k]} == set()
    ba = (a / "blend.json").read_text().replace(str(a), "RUN")
    assert ba == (b / "blend.json").read_text().replace(str(b), "RUN")


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    tmp = tmp_path_factory.mktemp("ref")
    cfg = _config(tmp, 4000)
    run_from_dict(cfg, run_dir=tmp / "run", console_log=False)
    return cfg, tmp / "run"


@pytest.mark.slow
def test_tokenizer_is_trained_on_a_sample_while_ingest_runs(reference: tuple[dict, Path]) -> None:
    """The reference run trains on a 0.2 MB sample: training is queued by the checkpoint whose sealed parts first
    hold it, in ingest's own thread, so before "ingest done" and with parts still to come, whatever the load (when
    training and the first shards then finish is up to the scheduler, and is not asserted)."""
    lines = [json.loads(line) for line in (reference[1] / "logs" / "streamprep.log").read_text().splitlines()]
    events = [ln["event"] for ln in lines]
    queued = lines[events.index("tokenizer training queued")]
    assert events.index("tokenizer training queued") < events.index("ingest done")
    sealed = {ln["dataset"]: ln["parts"] for ln in lines if ln["event"] == "parts sealed"}  # the last count wins
    assert 0 < queued["sealed_parts"] < sum(sealed.values())
    assert events.count("tokenizer trained") == 1 and events.count("shard done") == sum(sealed.values())
    report = json.loads((reference[1] / "run.json").read_text())["summary"]["tokenizer_training"]
    assert report["held_out_documents"] > 0 and 1.0 < report["bytes_per_token"] < 10.0
    assert json.loads((reference[1] / "audit" / "audit.json").read_text())["tokenizer_training"] == report
    assert "<td>bytes_per_token</td><td>" in (reference[1] / "audit" / "audit.html").read_text()


# ---- repair cases, driven through the real pipeline ------------------------------------------
def _ingest_only_then(cfg: dict, run_dir: Path, damage) -> None:
    """Run fully, damage the ingest outputs as a crash would have left them, then resume."""
    run_from_dict(cfg, run_dir=run_dir, console_log=False)
    files = DatasetFiles(run_dir, run_dir / "checkpoints", "alpha")
    damage(files)
    (run_dir / "run.json").write_text((run_dir / "run.json").read_text().replace('"complete"', '"interrupted"'))
    run_from_dict(cfg, run_dir=run_dir, console_log=False)


@pytest.mark.parametrize("case", ["part_longer", "torn_tail", "part_shorter", "part_missing", "checkpoint_truncated",
                                  "extra_part", "rejects_longer", "dedup_longer"])
@pytest.mark.slow
def test_repair_cases_resume_to_identical_outputs(reference: tuple[dict, Path], tmp_path: Path, case: str) -> None:
    """Each case is a state a crash (or power loss) can leave; the resumed run must end byte-identical."""
    cfg, ref = reference

    def damage(files: DatasetFiles) -> None:
        ck = json.loads(files.checkpoint.read_text())
        part = files.part(ck["part_index"] - 1)  # the last sealed part; parts are written whole, so any
        if case == "part_longer":  # change to a sealed one restarts the dataset
            with open(part, "ab") as fh:
                fh.write(part.read_bytes().splitlines(keepends=True)[0] * 3)
        elif case == "torn_tail":
            with open(part, "ab") as fh:
                fh.write(b'{"text": "half a li')
        elif case == "part_shorter":
            data = part.read_bytes()
            part.write_bytes(data[: len(data) // 2])
        elif case == "part_missing":
            part.unlink()
        elif case == "checkpoint_truncated":  # unreadable: the dataset starts over
            files.checkpoint.write_bytes(files.checkpoint.read_bytes()[:40])
        elif case == "extra_part":  # a part sealed after the last checkpoint: removed, then sealed again
            files.part(ck["part_index"]).write_text('{"text": "ghost"}\n')
        elif case == "rejects_longer":
            with open(files.rejects, "ab") as fh:
                fh.write(b'{"failed_check": "ghost"}\n')
        elif case == "dedup_longer":
            with open(files.dedup, "ab") as fh:
                fh.write(b"x" * 32)

    _ingest_only_then(cfg, tmp_path / "run", damage)
    _compare(ref, tmp_path / "run")
    if case == "dedup_longer":  # the log itself is repaired, not merely unread by the rest of the job
        logs = ("checkpoints/alpha.dedup",)
        assert tree_hashes(tmp_path / "run", names=logs) == tree_hashes(ref, names=logs) != {}


@pytest.mark.parametrize("case", ["plan_empty", "plan_missing", "plan_truncated", "inputs_missing",
                                  "unit_past_the_plan", "unit_not_a_number", "part_index_negative", "part_index_huge"])
@pytest.mark.slow
def test_a_checkpoint_no_job_wrote_restarts_its_dataset(reference: tuple[dict, Path], tmp_path: Path,
                                                        case: str) -> None:
    """Regression: a checkpoint of the right types holding a state no job writes was followed. An empty plan or a
    unit past its end ended the dataset where the interruption had left it (exit 0, `verify` passing, the rest
    of its records missing); a negative part index removed sealed parts; a unit that is not a number failed every
    resume; a plan missing or unreadable was made again with the resume's `unit_mb` and the checkpoint's unit applied
    to it (records lost or read twice, exit 0); its inputs file missing, a resume would not see its files changed.
    Now its dataset starts over (logged), and the resumed run ends
    byte-identical."""
    import asyncio

    from helpers import ingest_stopped_after
    from streamprep.config import load
    from streamprep.layout import CheckpointLayout

    cfg, ref = reference
    run = tmp_path / "run"
    state = asyncio.run(ingest_stopped_after(load(cfg), run, "alpha", 900))
    assert not state.done and state.part_index > 0
    files = DatasetFiles(run, run / "checkpoints", "alpha")
    ck = json.loads(files.checkpoint.read_text())
    plan = CheckpointLayout(run / "checkpoints").plan("alpha")
    if case == "plan_empty":
        plan.write_text("[]")
    elif case.startswith("plan_"):  # and a resume with another unit_mb: its plan would have other units
        if case == "plan_missing":
            plan.unlink()
        else:
            plan.write_bytes(plan.read_bytes()[:100])
        cfg = {**cfg, "execution": {**cfg["execution"], "unit_mb": 1}}
    elif case == "inputs_missing":  # whether its files changed since is unknown
        files.inputs.unlink()
    else:
        key, value = {"unit_past_the_plan": ("position", {**ck["position"], "unit": 10**6}),
                      "unit_not_a_number": ("position", {**ck["position"], "unit": "x"}),
                      "part_index_negative": ("part_index", -2), "part_index_huge": ("part_index", 10**9)}[case]
        files.checkpoint.write_text(json.dumps({**ck, key: value}))
    run_from_dict(cfg, run_dir=run, console_log=False)
    _compare(ref, run)
    logged = (run / "logs" / "streamprep.log").read_text()
    if case == "part_index_huge":  # parts its sealed log does not hold: a missing output, named
        assert "outputs shorter than checkpoint; restarting dataset from scratch" in logged
        assert "alpha.sealed has " in logged
    else:
        assert "checkpoint does not hold a state a job writes" in logged


def test_unreadable_checkpoint_restarts_dataset(tmp_path: Path) -> None:
    files = DatasetFiles(tmp_path, tmp_path / "ck", "d")
    files.ingest_dir.mkdir(parents=True)
    files.part(0).write_text("{}\n")
    (tmp_path / "ck").mkdir()
    files.checkpoint.write_text('{"version": 1, "datas')
    state = repair(files, load_checkpoint(files))
    assert state.consumed == 0 and not files.part(0).exists() and not files.checkpoint.exists()


# ---- real processes, real signals ------------------------------------------------------------
def _start(cfg_path: Path, run_dir: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path),
                             "--run-dir", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL, text=True)


def _wait_for(run_dir: Path, marker: str, proc: subprocess.Popen, log_from: int, timeout: float = 60) -> bool:
    """Wait until this process has written `marker` to the run log (any line for "start")."""
    log = run_dir / "logs" / "streamprep.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists():
            with open(log, "rb") as fh:
                fh.seek(log_from)
                new = fh.read().decode(errors="replace")
            if new and (marker == "start" or marker in new):
                return True
        time.sleep(0.02)
    return False


def _log_size(run_dir: Path) -> int:
    log = run_dir / "logs" / "streamprep.log"
    return log.stat().st_size if log.exists() else 0


# (phase marker in the run log, max extra delay): kills land in ingest, in tokenizer training and shard
# tokenization while ingest goes on, and in exports
PHASES = [("tokenizer trained", 0.05), ("shard done", 0.0), ("start", 0.6), ("shard done", 0.3),
          ("writing exports", 0.0), ("start", 0.1)]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["sigkill", "sigint"])
def test_kill_anywhere_then_resume_gives_identical_outputs(reference: tuple[dict, Path], tmp_path: Path,
                                                           sig: signal.Signals) -> None:
    """Episodes of kill/resume cycles, each ending byte-identical to the uninterrupted run, until kills have
    landed in every phase (under load a phase can be over before its marker is seen: then another episode)."""
    cfg, ref = reference
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    rng = random.Random(1000 + int(sig))
    required = {"start", "tokenizer trained", "shard done", "writing exports"}
    killed_in: list[str] = []
    for episode in range(4):
        run_dir = tmp_path / f"run{episode}"
        for marker, delay in PHASES:
            log_from = _log_size(run_dir)
            proc = _start(cfg_path, run_dir)
            reached = _wait_for(run_dir, marker, proc, log_from)
            if reached:
                time.sleep(rng.uniform(0, delay))
            if proc.poll() is None:
                proc.send_signal(sig)
                killed_in.append(marker if reached else "before " + marker)
            _, err = proc.communicate(timeout=120)
            if sig == signal.SIGINT and proc.returncode != 0:
                assert proc.returncode == 1, f"cycle {marker!r}: rc {proc.returncode}\n{err[-3000:]}"
                assert "re-run the same command to resume" in err, err
            if proc.returncode == 0:
                break
        proc = _start(cfg_path, run_dir)
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"final resume: rc {proc.returncode}\n{err[-3000:]}"
        _compare(ref, run_dir)
        assert not (run_dir / ".lock").read_bytes()  # released
        if len(killed_in) >= 5 and required <= set(killed_in):
            break
    assert len(killed_in) >= 5, killed_in
    assert required <= set(killed_in), killed_in


@pytest.mark.slow
def test_a_kill_9_during_the_exports_keeps_the_attempts_seconds_and_tokens_per_s(reference: tuple[dict, Path],
                                                                                tmp_path: Path) -> None:
    """Regressions: run.json took the timings only at an attempt's start and end, so after a kill -9 during the
    exports the resumed run's audit and status had lost the killed attempt's ingest (records/s ~14x too high). And
    tokens/s counted the resume's seconds only: the shards the killed attempt tokenized count too."""
    cfg_path, run_dir = tmp_path / "cfg.yaml", tmp_path / "run"
    cfg_path.write_text(yaml.safe_dump(reference[0]))
    proc = _start(cfg_path, run_dir)
    assert _wait_for(run_dir, "writing exports", proc, 0)
    proc.kill()
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed = json.loads((run_dir / "run.json").read_text())
    assert killed["status"] == "running" and set(killed["timings"]) == {"ingest", "tokenizer", "tokenize"}
    proc = _start(cfg_path, run_dir)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    audit = json.loads((run_dir / "audit" / "audit.json").read_text())
    assert all(audit["timings"][k] >= v for k, v in killed["timings"].items()) and killed["timings"]["ingest"] > 0
    first, resumed = log_events(run_dir, "tokenization done")
    assert first["tokenized"] == resumed["skipped"] > 1 and resumed["tokenized"] == 0
    work = json.loads((run_dir / "run.json").read_text())["tokenize_work"]
    assert work == {**killed["tokenize_work"], "shards": first["tokenized"], "tokens": audit["totals"]["tokens"]}
    assert work["seconds"] == pytest.approx(first["shard_seconds"], abs=0.01)
    assert audit["throughput"]["tokenize_tokens_per_s"] == round(work["tokens"] / work["seconds"], 1)
    assert audit["throughput"]["ingest_records_per_s"] == round(audit["totals"]["read"] / audit["timings"]["ingest"], 1)


@pytest.mark.slow
def test_second_run_on_a_locked_run_dir_exits_2(reference: tuple[dict, Path], tmp_path: Path) -> None:
    cfg, _ = reference
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    first = _start(cfg_path, run_dir)
    try:
        assert _wait_for(run_dir, "start", first, 0)
        second = _start(cfg_path, run_dir)
        _, err = second.communicate(timeout=60)
        assert second.returncode == 2 and "is in use by pid" in err and f"pid {first.pid}" in err
    finally:
        first.kill()
        first.communicate()
    # the killed holder leaves a stale lock file: the next run takes it over and finishes
    proc = _start(cfg_path, run_dir)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert "took over a stale lock" in (run_dir / "logs/streamprep.log").read_text()


@pytest.mark.slow
def test_config_drift_is_refused_naming_keys(reference: tuple[dict, Path], tmp_path: Path) -> None:
    cfg, ref = reference
    changed = json.loads(json.dumps(cfg))
    changed["quality"]["min_chars"] = 50
    changed["tokenizer"]["train"]["vocab_size"] = 700
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(changed))
    proc = subprocess.run([sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path), "--run-dir", str(ref)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "quality.min_chars" in proc.stderr and "tokenizer.train.vocab_size" in proc.stderr
    fresh = subprocess.run([sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path), "--run-dir", str(ref),
                            "--fresh"], capture_output=True, text=True, timeout=120)
    assert fresh.returncode == 2 and "not empty" in fresh.stderr


def test_a_resume_by_another_streamprep_says_so(tmp_path: Path) -> None:
    """A run resumed after an upgrade (round 50 changed the masks of Llama-2-style templates and the normalised text
    of a few inputs) mixes what each code wrote: said, naming both, as run.json records the code of each attempt."""
    cfg = base_config([{"name": "a", "path": _corpus(tmp_path, 200)[0]["path"]}], None)
    run = tmp_path / "run"
    run_from_dict(cfg, run_dir=run, console_log=False)
    record = json.loads((run / "run.json").read_text())
    assert record["code"] == version.source()[0] and not log_events(run, RESUMED_BY_OTHER)
    (run / "manifest.json").unlink()  # something to redo
    (run / "run.json").write_text(json.dumps({**record, "status": "interrupted", "code": "0.0.9+0123456789ab"}))
    run_from_dict(cfg, run_dir=run, console_log=False)
    said = log_events(run, RESUMED_BY_OTHER)
    assert [(e["earlier"], e["now"]) for e in said] == [("0.0.9+0123456789ab", version.source()[0])]
    run_from_dict(cfg, run_dir=run, console_log=False)  # complete, by this code: nothing to say
    assert len(log_events(run, RESUMED_BY_OTHER)) == 1
