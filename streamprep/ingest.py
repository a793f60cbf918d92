"""Asyncio ingest: per dataset, a reader task feeds QC batches; one writer applies dedup in order and
appends kept records to deterministic parts, then checkpoints.

    reader (executor thread) --batch--> QC (thread, or process pool on all cores) --verdicts, in order-->
    writer: dedup authority, part rolling, rejects sample, fsync, checkpoint

Outputs depend only on the input order and the config, never on the worker count or on where a
previous attempt was interrupted: the writer consumes batches strictly in source order.
"""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator

import aiofiles
import orjson

from quality import DedupDecision, DedupIndex, QualityControl, QualitySettings, Verdict, near_dedup
from streamprep import atomic, logs, stats
from streamprep.checkpoints import DatasetFiles, IngestState, load_and_repair, save
from streamprep.config import Config, ConfigError, DatasetConfig, ExecutionConfig, OutputConfig
from streamprep.layout import RunLayout
from streamprep.modes import Mode, mode_of
from streamprep.sources import BadRecord, open_source
from streamprep.sources.base import SourceError, input_change, one_line

log = logs.get("ingest")
REJECT_EXCERPT = 2000
SOURCE_KEYS = ("id", "url", "license", "licence")
STOP = object()  # what the writer gets instead of a batch once a stop is requested
# QC processes run this much nicer than the job: the tokenizer, downstream, comes first on a shared core.
# 10 rather than 5: the first shard came ~20 % sooner, the whole job no slower (docs/performance.md, sixth round).
QC_NICE = 10
# A QC call carries up to QC_CALL_BATCHES batches, about QC_CALL_BYTES of text in all (sized from the mean kept
# text so far): a process-pool round trip costs ~3 ms of the driver's CPU, and a checkpoint still follows every
# batch. 500 k short documents, ingest alone: 18.6-18.9 -> 15.7-17.5 CPU-s, 14.6 -> 11.6-12.1 s; 8 batches saved
# little more and held 75 MB more at the peak, 4 hold 30 MB more (docs/performance.md, eighth round).
QC_CALL_BATCHES = 4
QC_CALL_BYTES = 4 << 20

# ---- QC in worker processes ------------------------------------------------------------------
# A batch's verdicts cross the process boundary as one list per `Verdict` field: lists of plain values pickle
# and unpickle about 3.5x faster than named tuples (short documents: 2.0 against 7.0 µs a record).
VerdictColumns = tuple[list, ...]
_worker_settings: QualitySettings | None = None  # this QC worker's `quality:` section
_WORKER_QC: dict[str, QualityControl] = {}


def _init_worker(quality: QualitySettings) -> None:
    global _worker_settings
    _worker_settings = quality
    _WORKER_QC.clear()


def _init_pool_worker(quality: QualitySettings) -> None:
    """A QC process (pool worker or Ray actor) yields the cores to the tokenizer when both want them: sealed parts are tokenized as
    they come instead of piling up behind ingest (the job's total work does not change, only its order)."""
    os.nice(QC_NICE)
    _init_worker(quality)


def _evaluate(text_field: str, records: list[Any]) -> tuple[VerdictColumns, dict[str, dict[str, Any]]]:
    """One batch's verdicts, as columns, and what each gate did and cost on it (checkpointed with the batch,
    for the audit)."""
    qc = _WORKER_QC.get(text_field)
    if qc is None:
        qc = _WORKER_QC[text_field] = QualityControl(_worker_settings, text_field=text_field)
    verdicts = qc.evaluate_batch(records)
    columns = tuple(map(list, zip(*verdicts))) if verdicts else tuple([] for _ in Verdict._fields)
    return columns, qc.take_gate_stats()


def _evaluate_batches(text_field: str, batches: list[list[Any]]) -> list[tuple[VerdictColumns, dict[str, dict[str, Any]]]]:
    """`_evaluate` on each batch of one QC call: gate stats stay per batch, as each batch's checkpoint records them."""
    return [_evaluate(text_field, records) for records in batches]


class QCRunner:
    """Runs `QualityControl.evaluate` on batches: in one thread for 1 worker, else in a process pool."""

    def __init__(self, quality: QualitySettings, workers: int):
        self.workers = max(1, workers)
        self.pool: Executor
        if self.workers == 1:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="qc")
            self.pool.submit(_init_worker, quality).result()
        else:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["streamprep.ingest"])  # workers fork with quality already imported
            self.pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_pool_worker,
                                            initargs=(quality,))

    def submit(self, text_field: str, batches: list[list[Any]]) -> asyncio.Future:
        return asyncio.wrap_future(self.pool.submit(_evaluate_batches, text_field, batches))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class _QCActor:
    """One QC worker on a Ray cluster (`execution.ray_address`)."""

    def __init__(self, quality: QualitySettings):
        _init_pool_worker(quality)  # its own process: on a shared node the stage workers come first

    def ready(self) -> bool:
        return True

    def evaluate(self, text_field: str, batches: list[list[Any]]) -> list[tuple[VerdictColumns, dict[str, dict[str, Any]]]]:
        return _evaluate_batches(text_field, batches)


class RayQCRunner:
    """QC batches on Ray actors of an existing cluster; each actor answers in order, and the writer awaits
    batches in source order, so outputs equal the process-pool run's. An actor lost with its node is restarted
    by Ray on a node left and its calls retried (QC is a pure function of the batch); with no node left to run
    on, a call fails after `ray_cluster.NO_NODE_WAIT_S` instead of waiting forever."""

    def __init__(self, quality: QualitySettings, workers: int, address: str):
        from streamprep import ray_cluster

        self._cluster = ray_cluster
        ray_cluster.connect(address, workers)
        self.workers = max(1, workers)
        self.actors = ray_cluster.spread_actors(_QCActor, self.workers, quality)
        self._next = 0
        log.info("quality control on Ray actors", actors=self.workers, address=address)

    def submit(self, text_field: str, batches: list[list[Any]]) -> asyncio.Future:
        actor = self.actors[self._next % self.workers]
        self._next += 1
        return asyncio.ensure_future(self._answer(asyncio.wrap_future(actor.evaluate.remote(text_field, batches)
                                                                      .future())))

    async def _answer(self, call: asyncio.Future) -> Any:
        try:
            while not (await asyncio.wait({call}, timeout=1.0))[0]:
                if why := self._cluster.no_node_left():
                    raise self._cluster.NoNodeLeft(f"quality control: {why}; re-run the same command to resume")
            return call.result()
        finally:
            call.cancel()  # (a no-op once it has an answer)

    def close(self) -> None:
        import ray

        if self._cluster.no_node_left():  # the cluster is gone: nothing to ask, nothing to end (Ray would block)
            return
        restarts = self._cluster.actor_restarts(self.actors)
        if restarts:
            log.warning("quality control actors restarted after lost nodes; their calls were retried",
                        restarts=restarts)
        for a in self.actors:
            ray.kill(a)


# ---- per-dataset ingest ----------------------------------------------------------------------
@dataclass
class IngestContext:
    """What ingest reads (its config sections, the run's places) and what its datasets share while running."""

    datasets: tuple[DatasetConfig, ...]
    execution: ExecutionConfig
    output: OutputConfig  # shard_records, max_rejects_per_check
    quality: QualitySettings
    mode: Mode            # what QC judges and what a kept line carries
    run_dir: Path
    checkpoint_dir: Path
    stop: asyncio.Event
    progress: dict[str, IngestState] = field(default_factory=dict)
    on_checkpoint: Callable[[IngestState], None] | None = None  # after every save: hands sealed parts on
    finished: dict[str, DedupIndex] = field(default_factory=dict)  # final dedup index of each done dataset
    _done: dict[str, asyncio.Event] = field(default_factory=dict)

    @classmethod
    def of(cls, config: Config, run_dir: Path, checkpoint_dir: Path, stop: asyncio.Event,
           progress: dict[str, IngestState] | None = None,
           on_checkpoint: Callable[[IngestState], None] | None = None) -> "IngestContext":
        """The context of `config`'s ingest: its sections, nothing else."""
        return cls(config.datasets, config.execution, config.output, config.quality, mode_of(config.sft), run_dir,
                   checkpoint_dir, stop, {} if progress is None else progress, on_checkpoint)

    def publish(self, name: str, index: DedupIndex) -> None:
        """Dataset `name` is done; `index` is its final dedup index (`dedup_scope: run` checks it)."""
        self.finished[name] = index
        self._done.setdefault(name, asyncio.Event()).set()

    async def wait_done(self, name: str) -> bool:
        """Until dataset `name` is done (True) or the job stops first (False)."""
        tasks = [asyncio.ensure_future(self._done.setdefault(name, asyncio.Event()).wait()),
                 asyncio.ensure_future(self.stop.wait())]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for t in tasks:
            t.cancel()
        return name in self.finished

    @property
    def hf_cache(self) -> Path:
        return RunLayout(self.run_dir).hf_cache


def _take(it: Iterator, n: int) -> list:
    return list(islice(it, n))


class DatasetIngest:
    """Ingest of one dataset entry, resumable from its checkpoint."""

    def __init__(self, ds: DatasetConfig, ctx: IngestContext, qc: QCRunner | RayQCRunner, reader_pool: Executor):
        self.ds, self.ctx, self.qc, self.reader_pool = ds, ctx, qc, reader_pool
        self.files = DatasetFiles(ctx.run_dir, ctx.checkpoint_dir, ds.name)
        self.source: Any = None  # opened in run()
        self.shard_records = ctx.output.shard_records or 100_000
        self.max_rejects = ctx.output.max_rejects_per_check
        self.batch = ctx.execution.batch_records
        quality = ctx.quality
        self.dedup_on = quality.dedup != "none"
        near = quality.near_dedup
        self.near = near_dedup.NearDupIndex(near, self.files.near_dedup) if near.enabled else None
        self.run_scope = self.dedup_on and quality.dedup_scope == "run"
        self.size_cap = int(ds.size_mb * 1024 * 1024) if ds.size_mb else None
        self.depth = 2 * qc.workers + 1  # batches in flight between reader and writer: bounded memory
        self.mode = ctx.mode

    async def run(self) -> IngestState:
        name = self.ds.name
        state = await asyncio.to_thread(load_and_repair, self.files)
        self.ctx.progress[name] = state
        self._checkpointed(state)
        if state.done:
            log.info("dataset already ingested", dataset=name, kept=state.kept, rejected=state.rejected)
            if self.run_scope:
                self.ctx.publish(name, await asyncio.to_thread(self._open_index, state))
            return state
        own = await asyncio.to_thread(self._open_index, state)
        if self.near is not None:
            await asyncio.to_thread(self.near.load)
        ex = self.ctx.execution
        self.source = source = open_source(self.ds, self.ctx.hf_cache, ex.max_concurrent_downloads,
                                           prefetch_files=ex.hf_prefetch_files, cache_max_gb=ex.hf_cache_max_gb,
                                           keep_cache=ex.hf_keep_cache)
        if not self.ds.path.startswith("hf://"):  # hf:// pins its commit in the position itself
            inputs = await self._blocking(source.fingerprint)
            if inputs is STOP:
                return state
            self._check_inputs(state, inputs)
        for d in (self.files.ingest_dir, self.files.rejects.parent):
            d.mkdir(parents=True, exist_ok=True)
        it = source.iter_records(state.position)
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.depth)
        reader = asyncio.create_task(self._read(it, state.consumed, queue))
        try:
            earlier = await self._earlier_indexes()
            if earlier is not None:
                await self._write(state, DedupDecision(own, earlier), queue)
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
            if self.near is not None:
                self.near.close()
            while not queue.empty():  # drop batches read ahead; the checkpoint does not include them
                item = queue.get_nowait()
                if isinstance(item, tuple):
                    item[1].cancel()
        log.info("dataset ingest finished" if state.done else "dataset ingest stopped", dataset=name,
                 consumed=state.consumed, kept=state.kept, rejected=state.rejected, parts=state.part_index + 1)
        if state.done and self.run_scope:
            self.ctx.publish(name, own)
        return state

    def _check_inputs(self, state: IngestState, inputs: dict[str, Any]) -> None:
        """Refuse to resume over changed input files (positions are byte offsets into them); record them."""
        why = input_change(state.inputs, inputs) if state.consumed and state.inputs is not None else None
        if why:
            raise ConfigError(f"dataset {self.ds.name}: {why} since this run started; resuming would mix old "
                              f"and new data — restore the file, or start over with a new --run-dir")
        state.inputs = inputs

    def _open_index(self, state: IngestState) -> DedupIndex:
        """The dataset's dedup index, loaded from its digest log (checkpointed `dedup_count` digests)."""
        return DedupIndex(self.files.dedup, state.dedup_count) if self.dedup_on else DedupIndex()

    async def _earlier_indexes(self) -> list[tuple[str, DedupIndex]] | None:
        """`dedup_scope: run`: the final indexes of the datasets listed before this one, once they are all
        done (None if the job stops first). Deciding nothing before then makes the earlier dataset win a
        cross-dataset duplicate whatever the timing; QC still runs ahead (bounded by the queue)."""
        if not self.run_scope:
            return []
        earlier = []
        for ds in self.ctx.datasets:
            if ds.name == self.ds.name:
                break
            if not await self.ctx.wait_done(ds.name):
                return None
            earlier.append((ds.name, self.ctx.finished[ds.name]))
        return earlier

    async def _read(self, it: Iterator, consumed: int, queue: asyncio.Queue) -> None:
        """Batches in source order, then None; a source that raises ends the queue with its exception."""
        try:
            await self._read_batches(it, consumed, queue)
        except Exception as exc:
            await queue.put(exc)

    def _batches_per_call(self) -> int:
        """How many batches the next QC call carries: about QC_CALL_BYTES of text at the mean kept so far. One under
        `size_mb`, whose reads must not run further ahead of the cap (an hf:// source downloads what is read)."""
        state = self.ctx.progress[self.ds.name]
        if not state.kept or self.size_cap is not None:
            return 1
        batch_bytes = self.batch * state.kept_text_bytes / state.kept
        return max(1, min(QC_CALL_BATCHES, int(QC_CALL_BYTES // max(batch_bytes, 1))))

    async def _read_batches(self, it: Iterator, consumed: int, queue: asyncio.Queue) -> None:
        """Queue items: (the call's batches of (record, position), the QC call's future). Batches are cut exactly
        as one read per batch would cut them, whatever the call size."""
        loop = asyncio.get_running_loop()
        cap = self.ds.max_records
        while not self.ctx.stop.is_set():
            n = self.batch * self._batches_per_call()
            n = n if cap is None else min(n, cap - consumed)
            items = await loop.run_in_executor(self.reader_pool, _take, it, n) if n > 0 else []
            if not items:
                await queue.put(None)
                return
            consumed += len(items)
            screened = [self.mode.screen(items[i:i + self.batch], self.ds.text_field)
                        for i in range(0, len(items), self.batch)]
            await queue.put(([batch for batch, _ in screened],
                             self.qc.submit(self.ds.text_field, [records for _, records in screened])))

    async def _or_stop(self, aw: Any) -> Any:
        """`aw`'s result, or STOP as soon as a stop is requested (even while a read or download is stalled)."""
        work = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self.ctx.stop.wait())
        try:
            await asyncio.wait((work, stop), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            done = work.done()
            if not done:
                work.cancel()  # a cancelled queue.get() takes no item
        return work.result() if done else STOP

    async def _blocking(self, fn: Callable[[], Any]) -> Any:
        """`fn()` in a reader thread, or STOP on a stop request; a stalled thread is left behind (its pool is
        not waited for), so a signal stops the job within seconds."""
        return await self._or_stop(asyncio.get_running_loop().run_in_executor(self.reader_pool, fn))

    async def _write(self, state: IngestState, dedup: DedupDecision, queue: asyncio.Queue) -> None:
        while not self.ctx.stop.is_set():
            got = await self._or_stop(queue.get())
            if got is STOP:
                return
            if isinstance(got, Exception):  # everything read before it is written and checkpointed
                if isinstance(got, (SourceError, ConfigError)):
                    raise got
                raise SourceError(f"dataset {self.ds.name}: reading the input failed after item {state.consumed}: "
                                  f"{one_line(got)}") from got
            if got is None:
                state.done = True
                await self._save(state)
                return
            batches, fut = got
            for items, (columns, gates) in zip(batches, await fut):
                if self.ctx.stop.is_set():  # every batch applied so far is checkpointed
                    return
                stats.add_gates(state.stats, gates)
                keeps, texts, metas, digests, signatures = columns  # `Verdict`'s fields
                if self.near is not None:
                    self.near.prepare(signatures)
                if await self._apply(state, dedup, items, zip(keeps, texts, metas, digests)):
                    state.done = True
                    await self._save(state)
                    return

    async def _save(self, state: IngestState) -> None:
        await asyncio.to_thread(save, self.files, state)
        if hasattr(self.source, "checkpointed"):  # the source may drop the data this checkpoint has moved past
            await asyncio.to_thread(self.source.checkpointed, state.position)
        self._checkpointed(state)

    def _checkpointed(self, state: IngestState) -> None:
        if self.ctx.on_checkpoint is not None:
            self.ctx.on_checkpoint(state)

    async def _apply(self, state: IngestState, dedup: DedupDecision, items: list, verdicts: Iterator[tuple]) -> bool:
        """Decide, write and checkpoint one batch (`verdicts`: (keep, text, meta, digest) per record QC judged, in
        order). Returns True when a size cap ended the dataset."""
        # Long on purpose: one pass per record updating, in order, the state the checkpoint saves.
        name = self.ds.name
        parts: list[tuple[int, list[bytes]]] = [(state.part_index, [])]
        rejects: list[bytes] = []
        capped = False
        for rec, pos in items:
            ordinal = state.consumed
            state.consumed += 1
            state.position = pos
            source = {"dataset": name, "index": ordinal}
            if isinstance(rec, BadRecord):
                keep, text, meta, digest = False, None, {"failed_check": rec.check, "reason": rec.reason}, None
                excerpt = rec.raw
            else:
                keep, text, meta, digest = next(verdicts)
                twin = self.near.next_twin() if self.near is not None else None
                twin_ds = dedup.twin(digest) if self.dedup_on else None
                if twin_ds is not None:  # the kept copy's dataset: this one, or an earlier one (dedup_scope: run)
                    keep, meta = False, {**meta, "failed_check": "duplicate", "reason": dedup.reason(digest),
                                         "duplicate_of": twin_ds or name}
                elif keep and twin is not None:
                    keep, meta = False, near_dedup.reject_meta(meta, name, twin)
                excerpt = None if keep else _excerpt(rec, self.ds.text_field)
                if isinstance(rec, dict) and not rec.keys().isdisjoint(SOURCE_KEYS):
                    source.update({k: rec[k] for k in SOURCE_KEYS if isinstance(rec.get(k), (str, int))})
            chars = len(text) if keep else len(excerpt)
            stats.add_record(state.stats, keep, meta, chars)
            if keep:
                if self.dedup_on:
                    dedup.keep(digest)
                    state.dedup_count += 1
                if self.near is not None:
                    state.near_dedup_bytes += self.near.add(ordinal)
                line = orjson.dumps(self.mode.kept_row(text, {**meta, "source": source}, rec)) + b"\n"
                parts[-1][1].append(line)
                state.kept += 1
                state.part_lines += 1
                state.part_bytes += len(line)
                state.kept_text_bytes += len(text.encode("utf-8"))
                if state.part_lines == self.shard_records:  # roll: the next part starts after this record
                    state.part_index += 1
                    state.part_lines = state.part_bytes = 0
                    state.part_start = state.snapshot()
                    parts.append((state.part_index, []))
                if self.size_cap is not None and state.kept_text_bytes >= self.size_cap:
                    capped = True
                    log.info("size_mb cap reached", dataset=name, kept_text_bytes=state.kept_text_bytes)
                    break
            else:
                state.rejected += 1
                check = meta.get("failed_check", "unknown")
                if self.max_rejects is None or state.rejects_sampled.get(check, 0) < self.max_rejects:
                    state.rejects_sampled[check] = state.rejects_sampled.get(check, 0) + 1
                    line = orjson.dumps({"failed_check": check, "reason": meta.get("reason"), "meta": meta,
                                         "source": source, "text": excerpt}, option=orjson.OPT_SORT_KEYS) + b"\n"
                    rejects.append(line)
                    state.rejects_bytes += len(line)
        await self._flush(parts, rejects, dedup.own)
        if self.near is not None and (near_log := self.near.take_log()):
            await _append(self.files.near_dedup, near_log)
        await self._save(state)
        return capped

    async def _flush(self, parts: list[tuple[int, list[bytes]]], rejects: list[bytes], dedup: DedupIndex) -> None:
        """Append and fsync everything the next checkpoint will describe."""
        for index, lines in parts:
            if lines:
                await _append(self.files.part(index), b"".join(lines))
        if rejects:
            await _append(self.files.rejects, b"".join(rejects))
        await asyncio.to_thread(dedup.flush)


async def _append(path: Path, data: bytes) -> None:
    async with aiofiles.open(path, "ab", opener=atomic.nofollow) as fh:
        await fh.write(data)
        await fh.flush()
        await asyncio.to_thread(os.fsync, fh.fileno())


def _excerpt(rec: Any, text_field: str) -> str:
    text = rec.get(text_field) if isinstance(rec, dict) else rec
    if not isinstance(text, str):
        text = repr(text)
    return text[:REJECT_EXCERPT]


async def ingest_all(ctx: IngestContext) -> dict[str, IngestState]:
    """Ingest every dataset concurrently (one producer task each); returns their final states."""
    ex = ctx.execution
    workers = ex.workers or os.cpu_count() or 1
    qc = RayQCRunner(ctx.quality, workers, ex.ray_address) if ex.ray_address else QCRunner(ctx.quality, workers)
    reader_pool = ThreadPoolExecutor(max(1, len(ctx.datasets)), thread_name_prefix="reader")
    t0 = time.monotonic()
    jobs = [asyncio.ensure_future(DatasetIngest(ds, ctx, qc, reader_pool).run()) for ds in ctx.datasets]
    try:
        results = await asyncio.gather(*jobs)
    finally:
        for job in jobs:  # after one dataset failed, the others stop too (checkpoints never run ahead)
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        reader_pool.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(qc.close)
    log.info("ingest done", seconds=round(time.monotonic() - t0, 3), stopped=ctx.stop.is_set())
    return {s.dataset: s for s in results}


def completed_parts(files: DatasetFiles, state: IngestState) -> list[Path]:
    """The sealed ingest parts of a dataset, in order (the last one may be short; never an empty one)."""
    return [files.part(i) for i in range(state.sealed_parts())]
