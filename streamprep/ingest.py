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
from typing import Any, Callable, Iterator, NamedTuple

import aiofiles
import orjson

from quality import DedupDecision, DedupIndex, QualityControl, QualitySettings, Verdict, near_dedup
from streamprep import atomic, logs, stats, units
from streamprep.checkpoints import DatasetFiles, IngestState, load_and_repair, save
from streamprep.config import Config, ConfigError, DatasetConfig, ExecutionConfig, OutputConfig
from streamprep.layout import CheckpointLayout, RunLayout, read_json
from streamprep.modes import Mode, mode_of
from streamprep.sources import BadRecord, open_source
from streamprep.sources.base import SourceError, input_change, one_line
from streamprep.sources.local import REST_OF, _content_fault
from streamprep.units import Unit

log = logs.get("ingest")
REJECT_EXCERPT = 2000
SOURCE_KEYS = ("id", "url", "license", "licence")
STOP = object()  # what the writer gets instead of a batch once a stop is requested
# A dataset's position: the next item is item `item` of unit `unit` (a stream unit continues at `source`);
# `base` counts the items of the unit's file in earlier units; `skip_file`: a file whose rest did not decode.
START: dict[str, Any] = {"unit": 0, "item": 0, "base": 0, "source": None, "skip_file": None}
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
# A worker judges one batch of items and hands back, per item, only what the writer needs, as one list per
# `ItemColumns` field: lists of plain values pickle and unpickle much faster than named tuples, and a kept
# record comes back as its finished ingest line (the writer puts its dataset ordinal in), not as a dict.
SENTINEL_INDEX = -9223372036854763463  # a kept line's `source.index` until the writer knows its ordinal
_SENTINEL = b'"index":%d' % SENTINEL_INDEX


class ItemColumns(NamedTuple):
    """One batch's items in order. `bad`: a BadRecord's reason (None for a judged record); `check` its
    failed_check. `row`: a kept record's ingest line with SENTINEL_INDEX; `excerpt`: what a reject line
    shows (None for a kept record whose excerpt is its text's start); `extra`: the record's source keys."""

    bad: list
    check: list
    keep: list
    row: list
    meta: list
    digest: list
    chars: list
    text_bytes: list
    excerpt: list
    extra: list


Judged = tuple[ItemColumns, dict[str, dict[str, Any]], list]  # items, gate stats, near-dedup signatures
_worker: dict[str, Any] = {}  # this QC worker's quality settings, mode and QualityControl per text field


def _init_worker(quality: QualitySettings, mode: Mode) -> None:
    _worker.clear()
    _worker.update(quality=quality, mode=mode, qc={})


def _init_pool_worker(quality: QualitySettings, mode: Mode) -> None:
    """A QC process (pool worker or Ray actor) yields the cores to the tokenizer when both want them: sealed parts are tokenized as
    they come instead of piling up behind ingest (the job's total work does not change, only its order)."""
    os.nice(QC_NICE)
    _init_worker(quality, mode)


def _judge(name: str, text_field: str, items: list[Any]) -> Judged:
    """One batch of records / BadRecords: screened by the mode, judged by QC, kept ones serialised."""
    qc = _worker["qc"].get(text_field)
    if qc is None:
        qc = _worker["qc"][text_field] = QualityControl(_worker["quality"], text_field=text_field)
    mode: Mode = _worker["mode"]
    screened, judged = mode.screen([(item, None) for item in items], text_field)
    verdicts = iter(qc.evaluate_batch(judged))
    cols = ItemColumns(*([] for _ in ItemColumns._fields))
    signatures = []
    for rec, _ in screened:
        if isinstance(rec, BadRecord):
            for col, v in zip(cols, (rec.reason, rec.check, False, None, None, None, len(rec.raw), 0, rec.raw, None)):
                col.append(v)
            continue
        keep, text, meta, digest, signature = next(verdicts)
        signatures.append(signature)
        extra = None
        if isinstance(rec, dict) and not rec.keys().isdisjoint(SOURCE_KEYS):
            extra = {k: rec[k] for k in SOURCE_KEYS if isinstance(rec.get(k), (str, int))}
        excerpt = _excerpt(rec, text_field)
        row, chars, text_bytes = None, len(excerpt), 0
        if keep:
            source = {"dataset": name, "index": SENTINEL_INDEX, **(extra or {})}
            row = orjson.dumps(mode.kept_row(text, {**meta, "source": source}, rec)) + b"\n"
            chars, text_bytes = len(text), len(text.encode("utf-8"))
            if excerpt == text[:REJECT_EXCERPT]:
                excerpt = None
        for col, v in zip(cols, (None, None, keep, row, meta, digest, chars, text_bytes, excerpt, extra)):
            col.append(v)
    return cols, qc.take_gate_stats(), signatures


def _judge_items(name: str, text_field: str, batches: list[list[Any]]) -> list[Judged]:
    """A QC call of batches the driver read (stream units): gate stats stay per batch, as each batch's
    checkpoint records them."""
    return [_judge(name, text_field, items) for items in batches]


def _judge_unit(name: str, text_field: str, batch: int, unit: Unit, skip: int) -> list[Judged]:
    """Read a range or row-group unit here, past its first `skip` items (applied before a resume), and
    judge it in batches of `batch`. A file whose bytes stop decoding ends with one BadRecord (the writer
    then skips the file's later units, as a stream reader skips the rest of a file)."""
    items = []
    try:
        for item in islice(units.read_unit(unit), skip, None):
            items.append(item)
    except Exception as exc:
        if not _content_fault(exc):
            raise SourceError(f"cannot read input file {unit.path}: {one_line(exc)}") from exc
        items.append(BadRecord(f"{REST_OF}{unit.path} after record {units.RECORD_MARK}, skipped: {one_line(exc)}", ""))
    return [_judge(name, text_field, items[i:i + batch]) for i in range(0, len(items), batch)] or \
        [_judge(name, text_field, [])]


class QCRunner:
    """Runs QC calls (`_judge_items`, `_judge_unit`): in one thread for 1 worker, else in a process pool."""

    def __init__(self, quality: QualitySettings, mode: Mode, workers: int):
        self.workers = max(1, workers)
        self.pool: Executor
        if self.workers == 1:
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="qc")
            self.pool.submit(_init_worker, quality, mode).result()
        else:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(["streamprep.ingest"])  # workers fork with quality already imported
            self.pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_init_pool_worker,
                                            initargs=(quality, mode))

    def submit(self, fn: Callable[..., list[Judged]], *args: Any) -> asyncio.Future:
        return asyncio.wrap_future(self.pool.submit(fn, *args))

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)


class _QCActor:
    """One QC worker on a Ray cluster (`execution.ray_address`)."""

    def __init__(self, quality: QualitySettings, mode: Mode):
        _init_pool_worker(quality, mode)  # its own process: on a shared node the stage workers come first

    def ready(self) -> bool:
        return True

    def run(self, fn: Callable[..., list[Judged]], *args: Any) -> list[Judged]:
        return fn(*args)


class RayQCRunner:
    """QC calls on Ray actors of an existing cluster; each actor answers in order, and the writer awaits
    them in source order, so outputs equal the process-pool run's."""

    def __init__(self, quality: QualitySettings, mode: Mode, workers: int, address: str):
        from streamprep import ray_cluster

        ray_cluster.connect(address, workers)
        self.workers = max(1, workers)
        self.actors = ray_cluster.spread_actors(_QCActor, self.workers, quality, mode)
        self._next = 0
        log.info("quality control on Ray actors", actors=self.workers, address=address)

    def submit(self, fn: Callable[..., list[Judged]], *args: Any) -> asyncio.Future:
        actor = self.actors[self._next % self.workers]
        self._next += 1
        return asyncio.wrap_future(actor.run.remote(fn, *args).future())

    def close(self) -> None:
        import ray

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
        plan = await self._blocking(lambda: self._plan(state))
        if plan is STOP:
            return state
        self.units = plan
        queue: asyncio.Queue = asyncio.Queue(maxsize=self.depth)
        reader = asyncio.create_task(self._read(dict(state.position or START), state.consumed, queue))
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
                if isinstance(item, tuple) and item[2] is not None:
                    item[2].cancel()
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

    def _plan(self, state: IngestState) -> list[Unit]:
        """The dataset's units: planned once and saved beside its checkpoint; a resume reads them back
        (the input identity check has already refused changed files)."""
        path = CheckpointLayout(self.ctx.checkpoint_dir).plan(self.ds.name)
        saved = read_json(path) if state.consumed else None
        if isinstance(saved, list):
            return [Unit(**u) for u in saved]
        files = getattr(self.source, "files", None)
        plan = units.plan_dataset(files, self.ds.format)
        atomic.write_json(path, [u.to_json() for u in plan])
        log.info("units planned", dataset=self.ds.name, units=len(plan), files=len(files or ()),
                 read_by_workers=sum(u.kind != "stream" for u in plan))
        return plan

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

    async def _read(self, pos: dict[str, Any], consumed: int, queue: asyncio.Queue) -> None:
        """Queue items `(unit, positions, QC call, last)` in plan order, then None; a source that raises ends
        the queue with its exception. A range or row-group unit is one call its worker reads itself."""
        try:
            for u in range(pos["unit"], len(self.units)):
                unit, skip = self.units[u], pos["item"] if u == pos["unit"] else 0
                if self.ctx.stop.is_set():
                    return
                if unit.kind != "stream":
                    await queue.put((u, None, self.qc.submit(_judge_unit, self.ds.name, self.ds.text_field,
                                                             self.batch, unit, skip), True))
                    continue
                start = pos["source"] if u == pos["unit"] and pos.get("source") else \
                    None if unit.file < 0 else {"file": unit.file, "record": 0}
                it = self.source.iter_records(start) if unit.file < 0 else \
                    self.source.read_file(unit.file, unit.path, start)
                consumed = await self._read_stream(u, it, consumed, queue)
            await queue.put(None)
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

    async def _read_stream(self, u: int, it: Iterator, consumed: int, queue: asyncio.Queue) -> int:
        """A stream unit read here, in calls of batches cut exactly as one read per batch would cut them.
        `consumed` counts what this reader knows was read (workers' units not included): `max_records` never
        reads fewer records than it needs, and an `hf://` dataset (one stream unit) reads no more."""
        loop = asyncio.get_running_loop()
        cap = self.ds.max_records
        while not self.ctx.stop.is_set():
            n = self.batch * self._batches_per_call()
            n = n if cap is None else min(n, cap - consumed)
            items = await loop.run_in_executor(self.reader_pool, _take, it, n) if n > 0 else []
            if not items:
                await queue.put((u, None, None, True))
                return consumed
            consumed += len(items)
            batches = [items[i:i + self.batch] for i in range(0, len(items), self.batch)]
            await queue.put((u, [[p for _, p in b] for b in batches],
                             self.qc.submit(_judge_items, self.ds.name, self.ds.text_field,
                                            [[r for r, _ in b] for b in batches]), len(items) < n))
            if len(items) < n:
                return consumed
        return consumed

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
        skip_file = (state.position or START)["skip_file"]  # a file whose rest did not decode: its later units are passed over
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
            u, positions, fut, last = got
            unit = self.units[u]
            if fut is not None and not (unit.kind != "stream" and unit.file == skip_file):
                for b, (cols, gates, signatures) in enumerate(await fut):
                    if self.ctx.stop.is_set():  # every batch applied so far is checkpointed
                        return
                    stats.add_gates(state.stats, gates)
                    if self.near is not None:
                        self.near.prepare(signatures)
                    capped = await self._apply(state, dedup, u, cols, positions and positions[b])
                    skip_file = state.position["skip_file"]
                    if capped:
                        state.done = True
                        await self._save(state)
                        return
            if last and u + 1 < len(self.units):  # the next unit starts; `base` counts its file's earlier items
                pos = state.position or START
                same = unit.kind != "stream" and self.units[u + 1].file == unit.file
                state.position = {**START, "unit": u + 1, "base": pos["base"] + pos["item"] if same else 0,
                                  "skip_file": skip_file}

    async def _save(self, state: IngestState) -> None:
        await asyncio.to_thread(save, self.files, state)
        if hasattr(self.source, "checkpointed"):  # the source may drop the data this checkpoint has moved past
            await asyncio.to_thread(self.source.checkpointed, state.position)
        self._checkpointed(state)

    def _checkpointed(self, state: IngestState) -> None:
        if self.ctx.on_checkpoint is not None:
            self.ctx.on_checkpoint(state)

    async def _apply(self, state: IngestState, dedup: DedupDecision, u: int, cols: ItemColumns,
                     positions: list[Any] | None) -> bool:
        """Decide, write and checkpoint one judged batch of unit `u` (`positions`: a stream unit's source
        positions). Returns True when `max_records` or `size_mb` ended the dataset."""
        # Long on purpose: one pass per record updating, in order, the state the checkpoint saves.
        name, cap = self.ds.name, self.ds.max_records
        unit = self.units[u]
        numbered = unit.kind != "stream"  # a worker's reasons number lines from its unit's start
        parts: list[tuple[int, list[bytes]]] = [(state.part_index, [])]
        rejects: list[bytes] = []
        capped = False
        pos = state.position or START
        for j, bad in enumerate(cols.bad):
            if cap is not None and state.consumed >= cap:
                capped = True
                break
            ordinal = state.consumed
            state.consumed += 1
            here = positions[j] if positions else None  # progress reads `file` and `offset` (a range: its start)
            pos = state.position = {**pos, "unit": u, "item": pos["item"] + 1 if pos["unit"] == u else 1,
                                    "source": here, "file": unit.file if unit.file >= 0 else here.get("file", 0),
                                    "offset": unit.start if numbered else here.get("offset")}
            source = {"dataset": name, "index": ordinal}
            if bad is not None:
                reason = units.global_reason(bad, pos["base"] + pos["item"] - 1) if numbered else bad
                keep, meta, excerpt = False, {"failed_check": cols.check[j], "reason": reason}, cols.excerpt[j]
                if numbered and reason.startswith(REST_OF):
                    pos["skip_file"] = unit.file
            else:
                keep, meta, digest = cols.keep[j], cols.meta[j], cols.digest[j]
                twin = self.near.next_twin() if self.near is not None else None
                twin_ds = dedup.twin(digest) if self.dedup_on else None
                if twin_ds is not None:  # the kept copy's dataset: this one, or an earlier one (dedup_scope: run)
                    keep, meta = False, {**meta, "failed_check": "duplicate", "reason": dedup.reason(digest),
                                         "duplicate_of": twin_ds or name}
                elif keep and twin is not None:
                    keep, meta = False, near_dedup.reject_meta(meta, name, twin)
                excerpt = None if keep else cols.excerpt[j]
                if excerpt is None and not keep:  # a kept record's excerpt is its text's start
                    excerpt = orjson.loads(cols.row[j])["text"][:REJECT_EXCERPT]
                if cols.extra[j]:
                    source.update(cols.extra[j])
            chars = cols.chars[j] if keep else len(excerpt)
            stats.add_record(state.stats, keep, meta, chars)
            if keep:
                if self.dedup_on:
                    dedup.keep(digest)
                    state.dedup_count += 1
                if self.near is not None:
                    state.near_dedup_bytes += self.near.add(ordinal)
                line = cols.row[j].replace(_SENTINEL, b'"index":%d' % ordinal, 1)
                parts[-1][1].append(line)
                state.kept += 1
                state.part_lines += 1
                state.part_bytes += len(line)
                state.kept_text_bytes += cols.text_bytes[j]
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
    qc = RayQCRunner(ctx.quality, ctx.mode, workers, ex.ray_address) if ex.ray_address \
        else QCRunner(ctx.quality, ctx.mode, workers)
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
