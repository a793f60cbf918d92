"""`quality.dedup_scope: run`: a record duplicating one kept by a dataset listed earlier is rejected naming that
dataset, deterministically (worker count, dedup holder count, stop/resume, kill -9 + resume give byte-identical
outputs)."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml

from helpers import base_config, english_docs, ingest_killing_a_holder, ingest_stopped_after, tree_hashes
from quality import dedup
from streamprep.checkpoints import DatasetFiles
from streamprep.layout import CheckpointLayout
from streamprep.config import Config, load
from streamprep.ingest import IngestContext, ingest_all

OPEN = {"min_chars": 0, "expected_language": None, "pii_max_density": 1.0, "profanity_max_density": 1.0,
        "reject_copyright": False}


def _dclm(shared_data: Path, order: tuple[str, str], scope: str, workers: int = 1) -> Config:
    paths = {n: shared_data / "web" / f"dclm_quality_{n}_data.jsonl" for n in order}
    raw = base_config([{"name": n, "path": str(paths[n])} for n in order], None,
                      quality={**OPEN, "dedup_scope": scope}, output={"max_rejects_per_check": None})
    raw["execution"].update(batch_records=16, workers=workers)
    return load(raw)


async def _ingest(cfg: Config, run: Path) -> dict:
    return await ingest_all(IngestContext.of(cfg, run, run / "checkpoints", asyncio.Event()))


def _rejects(run: Path, name: str) -> Counter:
    lines = DatasetFiles(run, run / "checkpoints", name).rejects.read_text().splitlines()
    return Counter((r["failed_check"], r["reason"]) for r in map(json.loads, lines))


async def test_run_scope_rejects_the_281_dclm_copies_naming_the_earlier_dataset(shared_data: Path,
                                                                                tmp_path: Path) -> None:
    states = await _ingest(_dclm(shared_data, ("agreement", "majority"), "run"), tmp_path / "run")
    assert (states["agreement"].kept, states["agreement"].rejected) == (281, 0)
    assert (states["majority"].kept, states["majority"].rejected) == (218, 281)
    assert _rejects(tmp_path / "run", "majority") == {
        ("duplicate", "exact duplicate of a record kept by dataset agreement"): 281}
    assert states["majority"].stats["duplicates_kept_by"] == {"agreement": 281}  # the audit's kept_by
    # listed the other way round, majority wins every one of them
    states = await _ingest(_dclm(shared_data, ("majority", "agreement"), "run"), tmp_path / "rev")
    assert (states["majority"].kept, states["agreement"].kept, states["agreement"].rejected) == (499, 0, 281)
    assert _rejects(tmp_path / "rev", "agreement") == {
        ("duplicate", "exact duplicate of a record kept by dataset majority"): 281}


async def test_dataset_scope_keeps_cross_dataset_copies(shared_data: Path, tmp_path: Path) -> None:
    states = await _ingest(_dclm(shared_data, ("agreement", "majority"), "dataset"), tmp_path / "run")
    assert (states["agreement"].kept, states["majority"].kept, states["majority"].rejected) == (281, 499, 0)


def _overlap(tmp: Path, workers: int, holders: int | None = None) -> Config:
    return load(_overlap_raw(tmp, workers, holders))


def _overlap_raw(tmp: Path, workers: int, holders: int | None = None) -> dict:
    """Three datasets; b repeats half of a, c repeats half of b and a few of a: 2000 cross-dataset duplicates."""
    docs = english_docs(3000, seed=11)
    spans = {"a": docs[:1200], "b": docs[600:1800], "c": docs[1200:2400] + docs[:200]}
    for name, texts in spans.items():  # written once: a rewrite is a new mtime, which a resume refuses
        path, data = tmp / f"{name}.jsonl", "".join(json.dumps({"text": t}) + "\n" for t in texts)
        if not path.is_file() or path.read_text() != data:
            path.write_text(data)
    raw = base_config([{"name": n, "path": str(tmp / f"{n}.jsonl")} for n in spans], None,
                      quality={"expected_language": None, "min_chars": 20, "dedup_scope": "run"},
                      output={"shard_records": 250, "max_rejects_per_check": None})
    raw["execution"].update(batch_records=32, workers=workers, unit_mb=0.01, dedup_holders=holders)  # ~40 units each
    return raw


@pytest.fixture(scope="module")
def overlap_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("overlap")
    cfg = _overlap(tmp, workers=1)
    states = asyncio.run(_ingest(cfg, tmp / "run"))
    assert [(states[n].kept, states[n].rejected) for n in "abc"] == [(1200, 0), (600, 600), (600, 800)]
    assert _rejects(tmp / "run", "c") == {("duplicate", "exact duplicate of a record kept by dataset b"): 600,
                                          ("duplicate", "exact duplicate of a record kept by dataset a"): 200}
    return tmp / "run", cfg


@pytest.mark.slow
async def test_run_scope_same_bytes_with_two_workers_and_after_stops(overlap_reference: tuple[Path, dict],
                                                                    tmp_path: Path) -> None:
    ref, _ = overlap_reference
    want = tree_hashes(ref, "ingest", "rejects")
    cfg = _overlap(tmp_path, workers=2)
    await _ingest(cfg, tmp_path / "w2")
    assert tree_hashes(tmp_path / "w2", "ingest", "rejects") == want
    for stopped_in, at in (("a", 500), ("c", 300)):  # stop while an earlier / the last dataset is deciding
        run = tmp_path / f"stop-{stopped_in}"
        state = await ingest_stopped_after(cfg, run, stopped_in, at)
        assert not state.done
        await _ingest(cfg, run)
        assert tree_hashes(run, "ingest", "rejects") == want


@pytest.mark.slow
def test_run_scope_kill_9_then_resume_gives_identical_outputs(overlap_reference: tuple[Path, dict],
                                                              tmp_path: Path) -> None:
    """SIGKILL `streamprep ingest` at random moments until kills have landed mid-ingest; each episode's final
    resume equals the uninterrupted run's ingest/rejects byte for byte (on a fast machine a run can finish
    its ingest before a kill lands: then another episode, in a fresh run dir)."""
    ref, _ = overlap_reference
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(_overlap_raw(tmp_path, workers=2, holders=2)))  # two holder processes
    rng, mid_ingest = random.Random(5), 0
    for episode in range(6):
        run = tmp_path / f"run{episode}"
        argv = [sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path), "--run-dir", str(run)]
        for _ in range(6):
            proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    stdin=subprocess.DEVNULL, start_new_session=True)  # the kill takes its QC workers
            deadline = time.monotonic() + 60
            while not (run / "checkpoints" / "a.json").exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.15))
            running = proc.poll() is None
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
            states = [json.loads(p.read_text()) for n in "abc" if (p := run / "checkpoints" / f"{n}.json").exists()]
            ingesting = running and any(s["consumed"] for s in states) and not (
                len(states) == 3 and all(s["done"] for s in states))
            mid_ingest += ingesting
            if not ingesting:
                break
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert tree_hashes(run, "ingest", "rejects") == tree_hashes(ref, "ingest", "rejects")
        if mid_ingest >= 3:
            break
    assert mid_ingest >= 3


def _digests(path: Path) -> np.ndarray:
    return np.frombuffer(path.read_bytes(), np.uint64).reshape(-1, 4)


def _same_digests_partitioned(run: Path, ref: Path, parts: int) -> None:
    """Holder `p` of `parts` logged the reference's kept digests whose first word is `p` mod `parts`, in its
    order, and each dataset's checkpoint counts them."""
    for name in "abc":
        ck = json.loads((run / "checkpoints" / f"{name}.json").read_text())
        one = _digests(ref / "checkpoints" / f"{name}.dedup")
        assert len(one) == ck["kept"] == ck["dedup_count"] == sum(ck["dedup_counts"])
        assert len(ck["dedup_counts"]) == parts
        for p in range(parts):
            mine = _digests(run / "checkpoints" / f"{name}.dedup.{p}-of-{parts}")
            assert len(mine) == ck["dedup_counts"][p] and (mine == one[one[:, 0] % np.uint64(parts) == p]).all()
        assert not (run / "checkpoints" / f"{name}.dedup").exists()


@pytest.mark.slow
async def test_three_dedup_holders_write_the_same_bytes(overlap_reference: tuple[Path, dict], tmp_path: Path) -> None:
    """`execution.dedup_holders: 3`: the same ingest and rejects as one index in the job's process; holder `p` logs
    the kept digests whose first word is `p` mod 3, in the one index's order, and the checkpoint counts each. A run
    stopped and resumed with another holder count keeps the 3 it started with."""
    ref, _ = overlap_reference
    want = tree_hashes(ref, "ingest", "rejects")
    run = tmp_path / "p3"
    await _ingest(_overlap(tmp_path, workers=2, holders=3), run)
    assert tree_hashes(run, "ingest", "rejects") == want
    _same_digests_partitioned(run, ref, 3)
    stopped = tmp_path / "stopped"
    assert not (await ingest_stopped_after(_overlap(tmp_path, workers=2, holders=3), stopped, "b", 300)).done
    await _ingest(_overlap(tmp_path, workers=2, holders=2), stopped)
    assert json.loads((stopped / "checkpoints" / "dedup_holders.json").read_text()) == {"holders": 3}
    assert tree_hashes(stopped, "ingest", "rejects") == want


@pytest.mark.slow
async def test_the_job_process_holds_no_dedup_index(overlap_reference: tuple[Path, dict], tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """With two workers the exact-dedup indexes live in a holder process (forked from the forkserver, which this
    patch does not reach): the job's process never builds one, and the outputs are the same."""
    ref, _ = overlap_reference

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a DedupIndex was built in the job's process")

    monkeypatch.setattr(dedup.DedupIndex, "__init__", refuse)
    await _ingest(_overlap(tmp_path, workers=2), tmp_path / "run")
    assert tree_hashes(tmp_path / "run", "ingest", "rejects") == tree_hashes(ref, "ingest", "rejects")


@pytest.mark.slow
async def test_a_killed_dedup_holder_is_replaced_inside_the_job(overlap_reference: tuple[Path, dict],
                                                                tmp_path: Path) -> None:
    """kill -9 of a holder process while the second dataset is decided: a new holder reads the logs back, is sent
    again the calls since their last flush, and the job goes on to the same bytes and the same digest logs."""
    ref, _ = overlap_reference
    run = tmp_path / "run"
    assert await ingest_killing_a_holder(_overlap(tmp_path, workers=2, holders=2), run, "b", 300, holder=1) == 1
    assert tree_hashes(run, "ingest", "rejects") == tree_hashes(ref, "ingest", "rejects")
    _same_digests_partitioned(run, ref, 2)


async def test_restarting_web_leaves_web_dedupe_alone_and_resumes_to_the_same_bytes(tmp_path: Path) -> None:
    """Regression: `web` killed before its first checkpoint restarts, and its restart removed every checkpoint-dir
    file matching `web.dedup*`: `web.dedupe`'s checkpoint, plan, inputs, sealed and dedup logs. The resume then
    failed ('dedup log .../web.dedupe.dedup holds 0 digests, N expected'). Now only `web`'s own files go, and the
    resume writes the uninterrupted run's bytes."""
    docs = english_docs(800, seed=5)
    spans = {"web.dedupe": docs[:500], "web": docs[300:]}  # web repeats 200 of web.dedupe's
    for name, texts in spans.items():
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    raw = base_config([{"name": n, "path": str(tmp_path / f"{n}.jsonl")} for n in spans], None,
                      quality={"expected_language": None, "min_chars": 20, "dedup_scope": "run"},
                      output={"shard_records": 100, "max_rejects_per_check": None})
    raw["execution"].update(batch_records=16, unit_mb=0.01)
    cfg = load(raw)
    states = await _ingest(cfg, tmp_path / "ref")
    assert [(states[n].kept, states[n].rejected) for n in spans] == [(500, 0), (300, 200)]
    run = tmp_path / "run"
    assert not (await ingest_stopped_after(cfg, run, "web", 100)).done
    ck = CheckpointLayout(run / "checkpoints")
    ck.checkpoint("web").unlink()  # as if killed before web's first checkpoint: web starts over
    theirs = {p.name: p.read_bytes() for p in ck.checkpoint_dir.glob("web.dedupe*")}
    assert {"web.dedupe.json", "web.dedupe.dedup", "web.dedupe.sealed"} <= set(theirs)
    await _ingest(cfg, run)
    assert {p.name: p.read_bytes() for p in ck.checkpoint_dir.glob("web.dedupe*")} == theirs
    assert tree_hashes(run, "ingest", "rejects") == tree_hashes(tmp_path / "ref", "ingest", "rejects")
