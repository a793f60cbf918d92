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
    from streamprep.ingest import QC_NICE, QCRunner

    qc = QCRunner(validate_quality_config({}), 2)
    try:
        batches = await asyncio.gather(*(qc.submit("text", [{"text": t}]) for t in english_docs(2)))
        assert [[len(column) for column in columns] for columns, _ in batches] == [[1] * 5, [1] * 5]
        workers = [psutil.Process(pid) for pid in qc.pool._processes]  # the pool's own worker processes
        assert len(workers) == 2
        deadline = time.monotonic() + 20  # a worker that got no batch may still be running its initializer
        while {p.nice() for p in workers} != {os.nice(0) + QC_NICE} and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert {p.nice() for p in workers} == {os.nice(0) + QC_NICE}
    finally:
        qc.close()
