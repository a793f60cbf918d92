"""The asyncio ingest directly: a stop request flushes the batch in hand and checkpoints exactly what is on disk."""
from __future__ import annotations

import pytest

import asyncio
import json
from pathlib import Path

from helpers import base_config, english_docs, ingest_stopped_after, tree_hashes
from streamprep.checkpoints import DatasetFiles, IngestState
from streamprep.config import Config, load
from streamprep.ingest import IngestContext, ingest_all


def _cfg(tmp_path: Path, unit_mb: float = 4.0) -> Config:
    src = tmp_path / "docs.jsonl"
    docs = english_docs(3000, seed=5)
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in docs + docs[:40]))
    raw = base_config([{"name": "d", "path": str(src)}], None, output={"shard_records": 700})
    raw["execution"].update(batch_records=40, workers=2, unit_mb=unit_mb)
    return load(raw)


@pytest.mark.slow
async def test_stop_then_resume_equals_uninterrupted(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, unit_mb=50_000 / 2**20)  # ~25 units: a stop falls between two of them
    ref = tmp_path / "ref"
    await ingest_all(IngestContext.of(cfg, ref, ref / "checkpoints", asyncio.Event()))

    run = tmp_path / "run"
    state = await ingest_stopped_after(cfg, run, "d", 1000)
    assert not state.done and 1000 <= state.consumed < 3040
    files = DatasetFiles(run, run / "checkpoints", "d")
    ck = json.loads(files.checkpoint.read_text())  # the checkpoint describes exactly the bytes on disk
    assert ck["consumed"] == state.consumed and ck["kept"] + ck["rejected"] == ck["consumed"]
    assert [p.name for p in files.parts()] == [f"part-{i:05d}.jsonl" for i in range(ck["part_index"])]
    assert all(len(files.part(i).read_bytes().splitlines()) == 700 for i in range(ck["part_index"]))
    assert ck["part_lines"] == ck["kept"] - 700 * ck["part_index"] == sum(n for _, _, n in ck["open_pieces"])
    # the decider runs ahead of the checkpoint: its digests may be logged already; a resume truncates them
    assert files.dedup.stat().st_size >= 32 * ck["dedup_count"] == 32 * ck["kept"]

    resumed = (await ingest_all(IngestContext.of(cfg, run, run / "checkpoints", asyncio.Event())))["d"]
    assert resumed.done and resumed.kept == 3000 and resumed.rejected == 40
    assert tree_hashes(run, "ingest", "rejects") == tree_hashes(ref, "ingest", "rejects")


async def test_worker_processes_yield_the_cores_to_the_driver(tmp_path: Path) -> None:
    """The executor's worker processes run WORKER_NICE steps nicer than the job's process, so the driver's
    bookkeeping never waits behind them, and each has run the job's set-up before its first call."""
    import os
    import time

    import psutil

    from quality import validate_quality_config
    from streamprep.executor import WORKER_NICE, LocalExecutor
    from streamprep.modes import PRETRAIN
    from streamprep.unit_worker import KEPT, init_worker, judge_piece

    qc = LocalExecutor(2, (init_worker, (validate_quality_config({"min_chars": 20}), PRETRAIN)))
    try:
        calls = await asyncio.gather(*(asyncio.wrap_future(qc.submit(judge_piece, "d", "text", 64, str(tmp_path / f"p{i}"),
                                                                     None, [{"text": t}]))
                                       for i, t in enumerate(english_docs(2))))
        assert [(c.kinds, len(c.digests), len(c.text_bytes)) for c in calls] == [(bytes([KEPT]), 32, 1)] * 2
        workers = [psutil.Process(pid) for pid in qc.processes]
        assert len(workers) == 2
        deadline = time.monotonic() + 20  # a worker that got no batch may still be running its initializer
        while {p.nice() for p in workers} != {os.nice(0) + WORKER_NICE} and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert {p.nice() for p in workers} == {os.nice(0) + WORKER_NICE}
    finally:
        qc.close()


@pytest.mark.slow
def test_stream_qc_calls_carry_several_batches_with_the_same_outputs(tmp_path, monkeypatch):
    """A stream the driver reads (a plug-in source without a file list; here a local file behind one)
    goes to the workers in QC calls of up to QC_CALL_BATCHES batches (one pool round trip for several),
    each a piece with its own checkpoint; the parts, rejects and final checkpoint are exactly those of one
    call per batch."""
    from streamprep import ingest
    from streamprep.sources.local import LocalSource

    src = tmp_path / "mixed.jsonl"
    docs = english_docs(1500, seed=11)
    lines = [json.dumps({"text": t}) for t in docs + docs[:30]]
    for at in (5, 333, 334, 900, 1201):  # unreadable lines inside the batches of grouped calls
        lines.insert(at, "{not json" if at % 2 else "[1, 2]")
    src.write_text("\n".join(lines) + "\n")
    raw = base_config([{"name": "d", "path": str(src)}], None, output={"shard_records": 400})
    raw["execution"].update(batch_records=25, workers=2)
    cfg = load(raw)

    class Stream:  # no `files`: planned as one stream unit, read by the driver
        def __init__(self, ds, *args, **kwargs):
            self.local = LocalSource(ds)

        def fingerprint(self):
            return self.local.fingerprint()

        def iter_records(self, start=None):
            return self.local.iter_records(start)

    calls: list[int] = []  # items per QC call
    saved: list[int] = []  # consumed at each checkpoint
    from streamprep.executor import LocalExecutor

    submit, save = LocalExecutor.submit, ingest.save

    def run(name: str, batches_per_call: int) -> tuple[list[int], list[int], dict]:
        calls.clear(), saved.clear()
        monkeypatch.setattr(ingest, "open_source", Stream)
        monkeypatch.setattr(ingest, "QC_CALL_BATCHES", batches_per_call)
        monkeypatch.setattr(LocalExecutor, "submit", lambda self, fn, *args: (
            calls.append(len(args[-1])) if fn.__name__ == "judge_piece" else None) or submit(self, fn, *args))
        monkeypatch.setattr(ingest, "save", lambda files, state: saved.append(state.consumed) or save(files, state))
        out = tmp_path / name
        state = asyncio.run(ingest_all(IngestContext.of(cfg, out, out / "checkpoints", asyncio.Event())))["d"]
        assert state.done and state.consumed == len(lines)
        ck = json.loads(DatasetFiles(out, out / "checkpoints", "d").checkpoint.read_text())
        for volatile in ("started_at", "updated_at", "position"):
            ck.pop(volatile)
        ck["stats"].pop("gate_us")
        return list(calls), list(saved), {"ck": ck, "files": tree_hashes(out, "ingest", "rejects")}

    one_calls, one_saves, one = run("one", 1)
    grouped_calls, grouped_saves, grouped = run("grouped", 8)

    batches = -(-len(lines) // 25)
    assert one_calls == [25] * (batches - 1) + [len(lines) - 25 * (batches - 1)]
    assert sum(grouped_calls) == len(lines) and max(grouped_calls) == 8 * 25
    assert len(grouped_calls) < batches // 2  # calls grow once the committed mean text size is known
    assert one_saves == [25 * (i + 1) for i in range(batches - 1)] + [len(lines)] * 2  # then the final one
    assert set(grouped_saves) < set(one_saves)  # a checkpoint after each (larger) piece
    assert grouped == one
    assert one["ck"]["rejected"] == 35 and one["ck"]["stats"]["gate_seen"]["schema"] == 1530


async def test_a_pieces_gate_stats_and_counts_change_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a piece's gate stats were added before its rejects were appended (an fsync), its counts after:
    a metrics scrape in between saw more rejects by check than rejected records (2 % of scrapes). While the rejects
    are appended, neither has moved."""
    import inspect

    from streamprep import ingest

    seen: list[tuple[int, int]] = []
    real = ingest._append

    async def append(path: Path, data: bytes) -> None:
        state = inspect.currentframe().f_back.f_locals["state"]  # the committing dataset's live state
        seen.append((sum((state.stats.get("rejects_by_check") or {}).values()), state.rejected))
        await real(path, data)

    monkeypatch.setattr(ingest, "_append", append)
    raw = base_config([{"name": "d", "path": str(tmp_path / "d.jsonl")}], None)
    docs = english_docs(400, seed=3)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs + docs[:60]) + "{bad\n")
    raw["execution"].update(unit_mb=4_000 / 2**20)
    cfg = load(raw)
    states = await ingest_all(IngestContext.of(cfg, tmp_path / "run", tmp_path / "run/checkpoints", asyncio.Event()))
    assert states["d"].rejected == 61 and len(seen) > 1 and all(by_check == rejected for by_check, rejected in seen)


@pytest.mark.parametrize("unit_mb", [4.0, 8_000 / 2**20])
async def test_gates_count_the_records_up_to_max_records_whatever_the_units(tmp_path: Path, unit_mb: float) -> None:
    """Regression: with `max_records` ending a file's dataset inside a unit, the gates counted the whole batches
    judged past the cap, a number that changed with `unit_mb` (read 20, the gates' `seen` 512 or 27); hf:// units
    counted only what a stream read judges already. Now every gate has seen the records read."""
    docs = english_docs(600, seed=2)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    raw = base_config([{"name": "d", "path": str(tmp_path / "d.jsonl"), "max_records": 37}], None)
    raw["execution"].update(unit_mb=unit_mb, batch_records=16)
    state = (await ingest_all(IngestContext.of(load(raw), tmp_path / "run", tmp_path / "run/checkpoints",
                                               asyncio.Event())))["d"]
    seen = {name: n for name, n in state.stats["gate_seen"].items() if name != "duplicate"}  # the driver's count
    assert state.consumed == 37 and len(seen) >= 3 and seen == {name: 37 for name in seen}


@pytest.mark.parametrize("cap", [{"max_records": 37}, {"size_mb": 30_000 / 2**20}])
async def test_a_stop_after_the_capped_piece_reads_no_unit_past_the_cap_on_resume(tmp_path: Path, cap: dict) -> None:
    """Regression: a job stopped after saving the checkpoint of the piece a cap ended the dataset in, before marking
    it done, resumed by judging the next unit whole (for hf:// one more file downloaded), kept nothing of it and
    checkpointed a position past it: `status` counted that file in `bytes_in`, an uninterrupted run did not. The
    resume now ends the dataset at the position the cap left."""
    docs = english_docs(400, seed=4)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    raw = base_config([{"name": "d", "path": str(tmp_path / "d.jsonl"), **cap}], None)
    raw["execution"].update(unit_mb=12_000 / 2**20, batch_records=16, workers=1)
    cfg = load(raw)
    ref = (await ingest_all(IngestContext.of(cfg, tmp_path / "ref", tmp_path / "ref/checkpoints", asyncio.Event())))
    assert ref["d"].done and 0 < ref["d"].position["unit"] < 4

    run, stop = tmp_path / "run", asyncio.Event()

    def stop_at_cap(state: IngestState) -> None:
        if state.consumed == ref["d"].consumed and not state.done:
            stop.set()
    first = await ingest_all(IngestContext.of(cfg, run, run / "checkpoints", stop, on_checkpoint=stop_at_cap))
    assert not first["d"].done and first["d"].consumed == ref["d"].consumed
    resumed = (await ingest_all(IngestContext.of(cfg, run, run / "checkpoints", asyncio.Event())))["d"]
    assert resumed.done and resumed.position == ref["d"].position
    assert tree_hashes(run, "ingest", "rejects") == tree_hashes(tmp_path / "ref", "ingest", "rejects")


async def test_the_finished_line_counts_the_parts_written(tmp_path: Path) -> None:
    """Regression: `dataset ingest finished` logged `parts=part_index + 1`, one more than the dataset has (a dataset
    that kept nothing said parts=1); it now says how many part files there are."""
    from structlog.testing import capture_logs

    docs = english_docs(50, seed=3)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    (tmp_path / "none.jsonl").write_text('{"text": "short"}\n' * 5)
    raw = base_config([{"name": "d", "path": str(tmp_path / "d.jsonl")},
                       {"name": "none", "path": str(tmp_path / "none.jsonl")}], None, output={"shard_records": 20})
    run = tmp_path / "run"
    with capture_logs() as logged:
        states = await ingest_all(IngestContext.of(load(raw), run, run / "checkpoints", asyncio.Event()))
    assert (states["d"].kept, states["none"].kept) == (50, 0)
    finished = {e["dataset"]: e["parts"] for e in logged if e["event"] == "dataset ingest finished"}
    assert finished == {"d": 3, "none": 0}
    assert len(list((run / "ingest/d").glob("part-*.jsonl"))) == 3 and not list(run.glob("ingest/none/part-*"))


async def test_a_full_disk_while_appending_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """aiofiles' write raised an OSError without a filename, and the job's line said "no space left on the disk"
    without the " writing FILE" the operations guide promises."""
    import errno

    import aiofiles.threadpool.binary

    from streamprep import cli, ingest

    async def full(self: object, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(aiofiles.threadpool.binary.AsyncBufferedIOBase, "write", full)
    target = tmp_path / "rejects.jsonl"
    with pytest.raises(OSError) as caught:
        await ingest._append(target, b"x")
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(target))
    assert cli._write_fault(caught.value, "x", "ingest").startswith(f"no space left on the disk writing {target}: ")


async def test_a_failure_deciding_records_is_not_said_to_be_the_inputs(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a dedup holder's OSError on its own log ("Too many open files: '.../d233.dedup'") ended the job
    as "reading or judging the input failed after item 0", blaming the input. It says deciding failed, with the
    item reached and the error as its cause; what was decided before it is committed."""
    import errno

    from streamprep import ingest

    calls, real = [], ingest.DatasetIngest._decide

    def decide(self: ingest.DatasetIngest, *args: object) -> object:
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.EMFILE, "Too many open files", str(tmp_path / "d.dedup"))
        return real(self, *args)

    monkeypatch.setattr(ingest.DatasetIngest, "_decide", decide)
    raw = base_config([{"name": "d", "path": str(tmp_path / "d.jsonl")}], None)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(200, seed=3)))
    raw["execution"].update(unit_mb=4_000 / 2**20)
    run = tmp_path / "run"
    with pytest.raises(Exception) as failed:  # its type asserted below (the old code raised a SourceError)
        await ingest_all(IngestContext.of(load(raw), run, run / "checkpoints", asyncio.Event()))
    consumed = json.loads(DatasetFiles(run, run / "checkpoints", "d").checkpoint.read_text())["consumed"]
    assert consumed > 0 and type(failed.value).__name__ == "DecideError" and str(failed.value) == (
        f"dataset d: deciding its records (exact and near dedup, caps) failed after item {consumed}: OSError: "
        f"[Errno 24] Too many open files: '{tmp_path / 'd.dedup'}'")
    assert isinstance(failed.value.__cause__, OSError) and failed.value.__cause__.errno == errno.EMFILE


async def test_a_failure_of_the_xenna_pipeline_is_not_said_to_be_the_inputs(tmp_path: Path) -> None:
    """Regression: with `ray_address` on a cluster without a dashboard, Xenna's monitor failed the pipeline
    (`ServerUnavailable: … /api/v0/actors`), which failed the calls it held with that error, and the job ended as
    "SourceError: dataset d: reading or judging the input failed after item 0", blaming the input. It ends as the
    pipeline's failure, naming its cause. The pipeline (`XennaEngine`, as `StageExecutor` drives it) fails at the
    first call; no Ray."""
    from streamprep.engines.xenna import XennaEngine
    from streamprep.executor import Executor
    from streamprep.ray_cluster import ClusterFailed

    class ServerUnavailable(Exception):  # Ray's state API client's error, as Xenna's monitor raised it
        pass

    class FailingPipeline(Executor):
        workers = 1

        def __init__(self) -> None:
            self.engine = XennaEngine(None, 1, "127.0.0.1:6379")  # not started: the stage never answers

        def submit(self, fn: object, *args: object):  # type: ignore[no-untyped-def]
            future = self.engine.call(fn, args)
            self.engine._fail_calls(ServerUnavailable("Failed to make request to http://127.0.0.1:8265/api/v0/actors"))
            return future

        def close(self, wait: bool = True) -> None:
            pass

    raw = base_config([{"name": "d", "path": str(tmp_path / "d.jsonl")}], None)
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(20, seed=3)))
    run = tmp_path / "run"
    with pytest.raises(Exception) as failed:  # its type asserted below (the old code raised a SourceError)
        await ingest_all(IngestContext.of(load(raw), run, run / "checkpoints", asyncio.Event(),
                                          executor=FailingPipeline()))
    assert type(failed.value) is ClusterFailed and str(failed.value) == (
        "the xenna pipeline on the Ray cluster failed: ServerUnavailable: Failed to make request to "
        "http://127.0.0.1:8265/api/v0/actors")
    assert type(failed.value.__cause__).__name__ == "ServerUnavailable"


@pytest.mark.parametrize("where", ["flush", "open", "open_near"])
async def test_a_holder_failing_on_its_log_outside_the_decider_is_a_decide_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """Regression: a holder's OSError on its own log while flushing before a checkpoint, or opening the dataset's
    index, ended the job as a bare "OSError: [Errno 24] Too many open files: '…/d.near'", naming no dataset (only
    the decider's calls were a DecideError, as docs/operations.md promises for both)."""
    import errno
    import re

    from streamprep import holders, ingest

    log = tmp_path / "run" / "checkpoints" / ("d.dedup" if where == "open" else "d.near")
    cls, method = (holders.HeldDedup, "flush") if where == "flush" else (holders.Holders, where)
    calls, real = [], getattr(cls, method)

    def failing(*args: object) -> object:
        calls.append(1)
        if len(calls) == 2 or where != "flush":
            raise OSError(errno.EMFILE, "Too many open files", str(log))
        return real(*args)

    monkeypatch.setattr(cls, method, failing)
    raw = base_config([{"name": "d", "path": str(tmp_path / "d.jsonl")}], None)
    raw["quality"]["near_dedup"] = {"enabled": True}
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(200, seed=3)))
    raw["execution"].update(unit_mb=4_000 / 2**20)
    run = tmp_path / "run"
    with pytest.raises(ingest.DecideError) as failed:
        await ingest_all(IngestContext.of(load(raw), run, run / "checkpoints", asyncio.Event()))
    assert re.fullmatch(rf"dataset d: deciding its records \(exact and near dedup, caps\) failed after item \d+: "
                        rf"OSError: \[Errno 24\] Too many open files: '{re.escape(str(log))}'", str(failed.value))
    assert isinstance(failed.value.__cause__, OSError) and failed.value.__cause__.errno == errno.EMFILE
    assert DatasetFiles(run, run / "checkpoints", "d").checkpoint.exists() == (where == "flush")  # one saved before


async def test_a_stop_retrieves_every_worker_call_it_leaves(tmp_path: Path) -> None:
    """Regression: a SIGTERM to the job's whole process group just after 'units planned' printed asyncio's
    `Future exception was never retrieved … BrokenProcessPool` blocks above the stop's message: the reader, stopped
    while it waited for room in its queue, dropped the judge call it held, whose future the executor then settled
    with the pool the workers' SIGTERM broke. Here the workers never answer; the stop comes with the reader waiting."""
    import gc
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    from streamprep.executor import Executor, settle

    class Unanswered(Executor):
        workers = 1

        def __init__(self) -> None:
            self.calls: list[Future] = []

        def submit(self, fn, *args):
            self.calls.append(Future())
            return self.calls[-1]

        def close(self, wait: bool = True) -> None:
            pass

    loop, unretrieved = asyncio.get_running_loop(), []
    loop.set_exception_handler(lambda _, context: unretrieved.append(context["message"]))
    qc = Unanswered()
    ctx = IngestContext.of(_cfg(tmp_path, unit_mb=50_000 / 2**20), tmp_path / "run", tmp_path / "run" / "checkpoints",
                           asyncio.Event(), executor=qc)
    task = asyncio.create_task(ingest_all(ctx))
    while len(qc.calls) < 2 * qc.workers + 1 + 2 and not task.done():  # one awaited, a full queue, one in hand
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)
    assert len(qc.calls) == 5 and not task.done()
    broken = BrokenProcessPool("A process in the process pool was terminated abruptly")
    ctx.stop.set()
    assert not (await task)["d"].done
    while qc.calls:  # the broken pool settles every call it held, then lets it go
        settle(qc.calls.pop(), exc=broken)
    for _ in range(5):
        await asyncio.sleep(0)
    gc.collect()
    loop.set_exception_handler(None)
    assert unretrieved == []


POISON_GATE = """
import os

from quality.gates import Gate, register_gate


class Poison(Gate):
    name = failed_check = "poison"

    def check(self, doc):
        if "POISON" in doc.text:
            os._exit(3)  # a plug-in that ends its worker process on one record
        return None


register_gate(lambda settings, text_field: Poison())
"""


@pytest.mark.slow  # a whole job, in its own interpreter
def test_a_record_that_kills_its_worker_process_fails_the_job_naming_its_dataset_and_unit(tmp_path: Path) -> None:
    """Regression: `engine: local` without Ray, a record whose plug-in gate ends the worker process (os._exit) broke
    five pools in ~11 s, then the job ended on 'BrokenProcessPool: A process in the process pool was terminated
    abruptly…': no dataset (or the other dataset's finalize call, held by the same pool), no unit, no cause. It
    fails at the call's second death naming its dataset, unit (file and range) and what to do."""
    from helpers import ingest_with_plugin

    docs = english_docs(60)
    (tmp_path / "clean.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps({"text": f"{d} POISON" if i == 7 else d}) + "\n"
                                                for i, d in enumerate(docs)))
    cfg = base_config([{"name": "clean", "path": str(tmp_path / "clean.jsonl")},
                       {"name": "bad", "path": str(tmp_path / "bad.jsonl")}], None,
                      execution={"engine": "local", "workers": 2, "batch_records": 8})
    proc = ingest_with_plugin(tmp_path, "poison_gate", POISON_GATE, cfg)
    assert proc.returncode == 1, proc.stderr[-3000:]
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("streamprep: error:")]
    assert line.startswith(f"streamprep: error: SourceError: dataset bad: judging unit {tmp_path / 'bad.jsonl'} [0, ")
    assert "WorkerDied: a worker process died running this call, 2 times (exit code 3, 3)" in line
    assert line.endswith("run without the record (or the plug-in) that kills it, then re-run the same command to "
                         "resume")
