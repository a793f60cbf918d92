"""The asyncio ingest directly: a stop request flushes the batch in hand and checkpoints exactly what is on disk."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

from helpers import base_config, english_docs, ingest_stopped_after, tree_hashes
from streamprep.checkpoints import DatasetFiles
from streamprep.config import Config, load
from streamprep.ingest import IngestContext, ingest_all


def _cfg(tmp_path: Path) -> Config:
    src = tmp_path / "docs.jsonl"
    docs = english_docs(3000, seed=5)
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs + docs[:40]))
    raw = base_config([{"name": "d", "path": str(src)}], None, output={"shard_records": 700})
    raw["execution"].update(batch_records=40, workers=2)
    return load(raw)


async def test_stop_then_resume_equals_uninterrupted(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    ref = tmp_path / "ref"
    await ingest_all(IngestContext.of(cfg, ref, ref / "checkpoints", asyncio.Event()))

    run = tmp_path / "run"
    state = await ingest_stopped_after(cfg, run, "d", 1000)
    assert not state.done and 1000 <= state.consumed < 3040
    files = DatasetFiles(run, run / "checkpoints", "d")
    ck = json.loads(files.checkpoint.read_text())  # the checkpoint describes exactly the bytes on disk
    assert ck["consumed"] == state.consumed and ck["kept"] + ck["rejected"] == ck["consumed"]
    assert files.part(ck["part_index"]).stat().st_size == ck["part_bytes"]
    assert files.dedup.stat().st_size == 32 * ck["dedup_count"] == 32 * ck["kept"]
    assert sum(len(p.read_bytes().splitlines()) for p in files.parts()) == ck["kept"]

    resumed = (await ingest_all(IngestContext.of(cfg, run, run / "checkpoints", asyncio.Event())))["d"]
    assert resumed.done and resumed.kept == 3000 and resumed.rejected == 40
    assert tree_hashes(run, "ingest", "rejects") == tree_hashes(ref, "ingest", "rejects")


async def test_qc_processes_yield_the_cores_to_the_tokenizer() -> None:
    """QC pool processes run QC_NICE steps nicer than the job, so sealed parts are tokenized as they come
    (measured: first shard 3.5x -> 1.9x one part's ingest, whole job -10 %, docs/performance.md)."""
    import os
    import time

    import psutil

    from quality import validate_quality_config
    from streamprep.ingest import QC_NICE, ItemColumns, QCRunner, _judge_items
    from streamprep.modes import PRETRAIN

    qc = QCRunner(validate_quality_config({}), PRETRAIN, 2)
    try:
        calls = await asyncio.gather(*(qc.submit(_judge_items, "d", "text", [[{"text": t}]]) for t in english_docs(2)))
        assert [[[len(column) for column in columns] for columns, _, _ in batches] for batches in calls] == \
            [[[1] * len(ItemColumns._fields)]] * 2
        workers = [psutil.Process(pid) for pid in qc.pool._processes]  # the pool's own worker processes
        assert len(workers) == 2
        deadline = time.monotonic() + 20  # a worker that got no batch may still be running its initializer
        while {p.nice() for p in workers} != {os.nice(0) + QC_NICE} and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert {p.nice() for p in workers} == {os.nice(0) + QC_NICE}
    finally:
        qc.close()


def test_qc_calls_carry_several_batches_with_the_same_outputs_and_a_checkpoint_per_batch(tmp_path, monkeypatch):
    """A QC call of a stream unit (here a gzip file, which the driver reads) carries up to QC_CALL_BATCHES
    batches (one pool round trip for several); the batches, the checkpoint after each one, the parts and the
    rejects are exactly those of one call per batch."""
    import gzip

    from streamprep import ingest

    src = tmp_path / "mixed.jsonl.gz"
    docs = english_docs(1500, seed=11)
    lines = [json.dumps({"text": t}) for t in docs + docs[:30]]
    for at in (5, 333, 334, 900, 1201):  # unreadable lines inside the batches of grouped calls
        lines.insert(at, "{not json" if at % 2 else "[1, 2]")
    src.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    raw = base_config([{"name": "d", "path": str(src)}], None, output={"shard_records": 400})
    raw["execution"].update(batch_records=25, workers=2)
    cfg = load(raw)

    calls: list[int] = []  # batches per QC call
    saved: list[tuple[int, int, int]] = []  # (consumed, kept, part) at each checkpoint
    submit, save = ingest.QCRunner.submit, ingest.save

    def run(name: str, batches_per_call: int) -> tuple[list[int], list[tuple[int, int, int]], dict]:
        calls.clear(), saved.clear()
        monkeypatch.setattr(ingest, "QC_CALL_BATCHES", batches_per_call)
        monkeypatch.setattr(ingest.QCRunner, "submit",
                            lambda self, fn, *args: calls.append(len(args[-1])) or submit(self, fn, *args))
        monkeypatch.setattr(ingest, "save", lambda files, state: saved.append(
            (state.consumed, state.kept, state.part_index)) or save(files, state))
        out = tmp_path / name
        state = asyncio.run(ingest_all(IngestContext.of(cfg, out, out / "checkpoints", asyncio.Event())))["d"]
        assert state.done and state.consumed == len(lines)
        ck = json.loads(DatasetFiles(out, out / "checkpoints", "d").checkpoint.read_text())
        for volatile in ("started_at", "updated_at", "part_start"):
            ck.pop(volatile)
        ck["stats"].pop("gate_us")
        return list(calls), list(saved), {"ck": ck, "files": tree_hashes(out, "ingest", "rejects")}

    one_calls, one_saves, one = run("one", 1)
    grouped_calls, grouped_saves, grouped = run("grouped", 8)

    batches = -(-len(lines) // 25)
    assert one_calls == [1] * batches
    assert sum(grouped_calls) == batches and max(grouped_calls) == 8
    assert len(grouped_calls) < batches // 4
    assert grouped_saves == one_saves and len(one_saves) == batches + 1  # one per batch, then the final one
    assert grouped == one
    assert one["ck"]["rejected"] == 35 and one["ck"]["stats"]["gate_seen"]["schema"] == 1530
