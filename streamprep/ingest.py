"""Asyncio ingest: per dataset, its units of work (streamprep.units) judged by workers and decided in plan order.

    reader ──unit (or a batch the driver read from a source without files)──▶ worker: judge_piece (stage the judged
       columns; an hf:// unit's file is downloaded by the worker, within the driver's download window)
       ◀──Summary: kind, digest, kept bytes, failed check per item (no record bytes)──
    decider (one per dataset, plan order): ordinals, dedup (the holders'), caps, rejects sample ──Decision──▶
       worker: finalize_piece (kept lines, reject lines, audit stats)
    committer (plan order): stats and rejects appended, each full part assembled by a worker
       (assemble_part), the holders' dedup logs flushed, then checkpoints.save (atomic)

Outputs depend only on the input order and the config, never on the worker count or on where a
previous attempt was interrupted: decisions and commits follow plan order. The driver reads no record:
it sees per-record summaries (kind, 32-byte digest, sizes) and the bounded sample of reject lines.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from itertools import islice
from pathlib import Path
from typing import Any, Callable, Iterator

import aiofiles
import numpy as np

from quality import QualitySettings
from quality.dedup import digest_words
from streamprep import atomic, engines, holders, logs, registry, stats, unit_worker, units
from streamprep.checkpoints import DatasetFiles, IngestState, load_checkpoint, repair, save, save_inputs
from streamprep.config import Config, ConfigError, DatasetConfig, ExecutionConfig, OutputConfig, thaw
from streamprep.executor import Executor, WorkerDied
from streamprep.ray_cluster import ClusterFailed
from streamprep.holders import Dedup, HeldDedup, HolderLost, Holders
from streamprep.layout import CheckpointLayout, RunLayout, read_json
from streamprep.modes import Mode, mode_of
from streamprep.sources import open_source
from streamprep.sources.base import FileGone, SourceError, input_change, one_line
from streamprep.sources.hf import DownloadWindow, HFSource, clear_leftovers
from streamprep.sources.local import LocalSource
from streamprep.unit_worker import BAD, KEPT, Decision, Summary
from streamprep.units import Unit

log = logs.get("ingest")
STOP = object()  # what a coroutine gets instead of an item once a stop is requested
COMMIT_GRACE_S = 2.0  # how long a stop still waits for the piece or part being committed
# A dataset's position: the next piece is piece `piece` of unit `unit` (a stream unit continues at `source`);
# `base` counts the items of the unit's file in earlier units; `skip_file`: a file whose rest did not decode.
START: dict[str, Any] = {"unit": 0, "piece": 0, "base": 0, "source": None, "skip_file": None}
# A stream unit's QC call carries up to QC_CALL_BATCHES batches, about QC_CALL_BYTES of text in all (sized from the mean kept
# text so far): a process-pool round trip costs ~3 ms of the driver's CPU
# (eighth round: `git show c594e76:docs/performance.md`).
QC_CALL_BATCHES = 4
QC_CALL_BYTES = 4 << 20


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
    finished: set[str] = field(default_factory=set)  # the datasets done (their indexes stay in the holders)
    _done: dict[str, asyncio.Event] = field(default_factory=dict)
    executor: Executor | None = None  # the job's; None: ingest makes its own (`worker_executor`) and closes it
    holders: Holders | None = None  # the job's dedup holders; None: ingest starts its own and closes them

    @classmethod
    def of(cls, config: Config, run_dir: Path, checkpoint_dir: Path, stop: asyncio.Event,
           progress: dict[str, IngestState] | None = None,
           on_checkpoint: Callable[[IngestState], None] | None = None,
           executor: Executor | None = None, holders: Holders | None = None) -> "IngestContext":
        """The context of `config`'s ingest: its sections, nothing else."""
        return cls(config.datasets, config.execution, config.output, config.quality, mode_of(config.sft), run_dir,
                   checkpoint_dir, stop, {} if progress is None else progress, on_checkpoint, executor=executor,
                   holders=holders)

    def publish(self, name: str) -> None:
        """Dataset `name` is done: its exact- and near-dedup indexes stay in the holders (`dedup_scope: run`
        checks them)."""
        self.finished.add(name)
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


def _added(why: str) -> bool:
    """Whether the input change `why` (`input_change`) is a file added to the dataset's folder or glob."""
    return why.endswith(" is new")


def _undo(why: str) -> str:
    """What puts the inputs back as the run started on them: an added file is taken out, not 'restored'."""
    return "remove the file (or move it out of the dataset's path)" if _added(why) else "restore the file"


async def _put(queue: asyncio.Queue, item: tuple) -> None:
    """Queue `item`, whose last element is its worker call (or None). A stop that cancels the wait for room lets go
    of that call too: dropped with the item, it was never awaited, and settled by the pool a SIGTERM to the job's
    whole process group broke (BrokenProcessPool) it had asyncio print `Future exception was never retrieved`
    blocks above the stop's message."""
    try:
        await queue.put(item)
    except asyncio.CancelledError:
        call = item[-1]
        if call is not None and not call.cancel() and not call.cancelled():
            call.exception()  # settled meanwhile: retrieved
        raise


def _drop_calls(queue: asyncio.Queue) -> None:
    """Empty `queue`, cancelling the worker calls of its items that have not started."""
    while not queue.empty():
        item = queue.get_nowait()
        if isinstance(item, tuple) and isinstance(item[-1], asyncio.Future):
            item[-1].cancel()


def _take(it: Iterator, n: int) -> list:
    return list(islice(it, n))


class DecideError(RuntimeError):
    """The decider failed (the dedup holders: a log's OSError, a holder lost), not reading or judging the input:
    "reading or judging the input failed" blamed the input for a holder's "Too many open files" on its own log."""


@dataclass
class Ahead:
    """The decider's counters: they run ahead of the checkpoint (which the committer saves in plan order)."""

    consumed: int
    kept: int
    rejected: int
    kept_text_bytes: int
    dedup_count: int
    near_dedup_bytes: int
    rejects_sampled: dict[str, int]
    position: dict[str, Any]
    dedup_counts: list[int]  # per dedup holder, when the run has several

    @classmethod
    def of(cls, st: IngestState) -> "Ahead":
        return cls(st.consumed, st.kept, st.rejected, st.kept_text_bytes, st.dedup_count, st.near_dedup_bytes,
                   dict(st.rejects_sampled), dict(st.position or START), list(st.dedup_counts))

    def snapshot(self) -> "Ahead":
        """The counters as they stand after one piece (the decider goes on changing its own)."""
        return replace(self, rejects_sampled=dict(self.rejects_sampled), position=dict(self.position),
                       dedup_counts=list(self.dedup_counts))

    def onto(self, st: IngestState) -> None:
        """Copy a snapshot (taken after one piece) onto the state the committer checkpoints."""
        for k in ("consumed", "kept", "rejected", "kept_text_bytes", "dedup_count", "near_dedup_bytes"):
            setattr(st, k, getattr(self, k))
        st.rejects_sampled, st.position = dict(self.rejects_sampled), dict(self.position)
        st.dedup_counts = list(self.dedup_counts)


class DatasetIngest:
    """Ingest of one dataset entry, resumable from its checkpoint."""

    def __init__(self, ds: DatasetConfig, ctx: IngestContext, qc: Executor, reader_pool: ThreadPoolExecutor):
        self.ds, self.ctx, self.qc, self.reader_pool = ds, ctx, qc, reader_pool
        self.files = DatasetFiles(ctx.run_dir, ctx.checkpoint_dir, ds.name)
        self.stage_dir = self.files.stage
        self.source: Any = None  # opened in run()
        self._reader: asyncio.Task | None = None  # run()'s reader of the units
        self.units: list[Unit] = []
        self.shard_records = ctx.output.part_lines
        self.max_rejects = ctx.output.max_rejects_per_check
        self.batch = ctx.execution.batch_records
        quality = ctx.quality
        self.dedup_on = quality.dedup != "none"
        self.near = quality.near_dedup if quality.near_dedup.enabled else None  # its index: in holder 0
        # `dedup_scope: run` applies to exact dedup and near-dedup alike
        self.run_scope = (self.dedup_on or self.near is not None) and quality.dedup_scope == "run"
        self.earlier: list[str] = []  # `dedup_scope: run`: the datasets listed before this one
        self.size_cap = int(ds.size_mb * 1024 * 1024) if ds.size_mb else None
        # how the workers open the dataset's files: its storage options (object stores), or an hf.FileReader
        self.options: Any = thaw(ds.storage_options or {})
        self.depth = 2 * qc.workers + 1  # pieces in flight between each pair of steps: bounded memory
        self.window: DownloadWindow | None = None  # hf://: the files handed out and not yet checkpointed past
        self._room = asyncio.Event()  # set when the window lets go of files, or a unit is decided
        self.capped = False  # max_records / size_mb ended the dataset: no more units are handed out
        self._handed = self._decided = 0  # hf:// units handed out / decided, in plan order, set in run()
        self._yield = Yield()  # what this run's decided hf:// units gave, per byte of their files
        self._ahead: Ahead | None = None  # the decider's counters

    async def run(self) -> IngestState:
        name = self.ds.name
        loaded = await asyncio.to_thread(load_checkpoint, self.files)
        state = self.ctx.progress[name] = loaded.state
        if state.done:
            await asyncio.to_thread(repair, self.files, loaded)
            self._checkpointed(state)
            log.info("dataset already ingested", dataset=name, kept=state.kept, rejected=state.rejected)
            await asyncio.to_thread(self._drop_done_files)
            if self.run_scope:
                await asyncio.to_thread(self._open_index, state)
                self.ctx.publish(name)
            return state
        ex = self.ctx.execution
        self.source = source = open_source(self.ds, self.ctx.hf_cache, ex.max_concurrent_downloads,
                                           prefetch_files=ex.hf_prefetch_files, cache_max_gb=ex.hf_cache_max_gb,
                                           keep_cache=ex.hf_keep_cache)
        if not isinstance(source, HFSource):  # hf:// pins its commit in the plan
            inputs = await self._fingerprint(state)
            if inputs is STOP:
                return state
            self._check_inputs(state, inputs)  # before the repair: a refused attempt writes and deletes nothing
        await asyncio.to_thread(repair, self.files, loaded)
        self._checkpointed(state)
        counts = await asyncio.to_thread(self._open_index, state)
        for d in (self.files.ingest_dir, self.files.rejects.parent, self.stage_dir):
            d.mkdir(parents=True, exist_ok=True)
        plan = await self._blocking(lambda: self._plan(state))
        if plan is STOP:
            return state
        await asyncio.to_thread(save_inputs, self.files, state.inputs)  # once: the checkpoints after it lack them
        self.units = plan
        self._handed = self._decided = (state.position or START)["unit"]
        judged: asyncio.Queue = asyncio.Queue(maxsize=self.depth)
        decided: asyncio.Queue = asyncio.Queue(maxsize=self.depth)
        reader = self._reader = asyncio.create_task(self._read(dict(state.position or START), state.consumed, judged))
        decider: asyncio.Task | None = None
        try:
            earlier = await self._earlier_datasets()
            if earlier is not None:
                self.earlier = earlier
                self._ahead = Ahead.of(state)
                dedup = HeldDedup(self.ctx.holders, name, earlier, counts)
                decider = asyncio.create_task(self._decide_all(self._ahead, dedup, judged, decided))
                await self._commit_all(state, dedup, decided)
        finally:
            for task in (reader, decider):
                if task is not None:
                    task.cancel()
            await asyncio.gather(*(t for t in (reader, decider) if t is not None), return_exceptions=True)
            for q in (judged, decided):  # drop work done ahead; the checkpoint does not include it
                _drop_calls(q)
        log.info("dataset ingest finished" if state.done else "dataset ingest stopped", dataset=name,
                 consumed=state.consumed, kept=state.kept, rejected=state.rejected, parts=state.sealed_parts())
        if state.done and self.ds.filter and not state.consumed:  # a field no record has, or a value of another type
            log.warning("the filter matched no record: the dataset is empty; check its field names and value types",
                        dataset=name, filter=thaw(self.ds.filter))  # as JSON: a nested one was "mappingproxy(…)"
        if state.done and self.run_scope:
            self.ctx.publish(name)
        return state

    def _drop_done_files(self) -> None:
        """hf://: delete the files of a dataset done before this job that are still in the cache (unless
        `hf_keep_cache`). A done dataset's files go at the end of the job that finished it, so a job killed after
        that (another dataset still reading) left them, e.g. the files a capped dataset had fetched past its cap;
        no window of this job would ever delete them (`drop_passed` does the same for a resumed dataset)."""
        if not self.ds.path.startswith("hf://"):
            return
        saved = read_json(CheckpointLayout(self.ctx.checkpoint_dir).plan(self.ds.name))
        ex = self.ctx.execution
        source = open_source(self.ds, self.ctx.hf_cache, ex.max_concurrent_downloads,
                             prefetch_files=ex.hf_prefetch_files, cache_max_gb=ex.hf_cache_max_gb,
                             keep_cache=ex.hf_keep_cache)
        if not isinstance(saved, list) or not isinstance(source, HFSource):
            return
        window = DownloadWindow(source, [Unit(**u) for u in saved])
        try:
            window.drop_passed(len(saved))
        finally:
            window.close()

    def _fingerprint(self, state: IngestState, fresh: bool = False) -> Any:
        source = self.source
        return self._blocking(lambda: source.fingerprint(state.inputs, fresh) if isinstance(source, LocalSource)
                              else source.fingerprint())

    async def _inputs_unchanged(self, state: IngestState) -> Any:
        """Before a dataset is done: its input files are still the ones it started on (its path listed again and one
        stat each, as at the start). Units read their bytes as planned, so a file rewritten or cut short meanwhile
        gave a mix of old and new data, or lost records, and a file added to its folder or glob was not read, without
        a word, and the dataset was done with an identity that no longer held."""
        if isinstance(self.source, HFSource) or state.inputs is None:  # hf:// reads its pinned commit
            return None
        inputs = await self._fingerprint(state, fresh=True)
        if inputs is not STOP and (why := input_change(state.inputs, inputs)):
            read = "it was not read" if _added(why) else "what was read of it may mix old and new data"
            raise SourceError(f"dataset {self.ds.name}: {why} during the run; {read} — {_undo(why)} and re-run the "
                              f"same command, or start over with a new --run-dir")
        return inputs

    async def _inputs_as_started(self, state: IngestState) -> Any:
        """After a planned file was not found when read: the resume's identity check (`_check_inputs`), on the path
        listed again, so a file deleted since the run started stops the job with the refusal the re-run would give
        (exit 2), not a read failure saying to re-run; STOP on a stop request."""
        if state.inputs is None:
            return None
        inputs = await self._fingerprint(state, fresh=True)
        if inputs is not STOP:
            self._check_inputs(state, inputs)
        return inputs

    def _check_inputs(self, state: IngestState, inputs: dict[str, Any]) -> None:
        """Refuse to resume over changed input files (positions are byte offsets into them), also a dataset its
        checkpoint restarts (a part deleted: the run's other datasets, and its dedup against them, read the files
        as they were); record them."""
        why = input_change(state.inputs, inputs) if state.inputs is not None else None
        if why:
            mtime = " (its mtime too: cp -p, rsync -t)" if "mtime_ns" in why else ""
            raise ConfigError(f"dataset {self.ds.name}: {why} since this run started; resuming would mix old "
                              f"and new data — {_undo(why)}{mtime}, or start over with a new --run-dir")
        state.inputs = inputs

    def _plan(self, state: IngestState) -> list[Unit]:
        """The dataset's units: planned once and saved beside its checkpoint; a resume reads them back
        (the input identity check has already refused changed files)."""
        path = CheckpointLayout(self.ctx.checkpoint_dir).plan(self.ds.name)
        saved = read_json(path) if state.consumed else None
        hf = isinstance(self.source, HFSource)
        if isinstance(saved, list):
            plan = [Unit(**u) for u in saved]
            if hf and any(u.kind == "stream" for u in plan):
                raise ConfigError(f"dataset {self.ds.name}: its checkpoint is from an earlier streamprep that read "
                                  f"hf:// as one stream and cannot be resumed; start over with a new --run-dir")
        elif hf:
            plan = self.source.units()
            state.inputs = self.source.fingerprint()  # the pinned commit and its files, for status
        else:
            files = getattr(self.source, "files", None)
            plan = units.plan_dataset(files, self.ds.format, int(self.ctx.execution.unit_mb * (1 << 20)), self.options)
        if not isinstance(saved, list):
            atomic.write_json(path, [u.to_json() for u in plan])
            log.info("units planned", dataset=self.ds.name, units=len(plan))
        if hf:
            self.options, self.window = self.source.reader(plan), DownloadWindow(self.source, plan)
            self.window.drop_passed((state.position or START)["unit"])
        return plan

    def _open_index(self, state: IngestState) -> list[int]:
        """Open the dataset's exact-dedup index in the holders, each from its log at the checkpoint's count, and its
        near-dedup index in holder 0 from its log (already repaired to the checkpoint's length); returns the
        counts."""
        parts = self.ctx.holders.parts
        counts = list(state.dedup_counts) or ([0] * parts if not state.dedup_count else [state.dedup_count])
        if len(counts) != parts:
            raise ConfigError(f"dataset {self.ds.name}: its checkpoint has {len(counts)} dedup holder logs and this "
                              f"run has {parts} ({CheckpointLayout(self.ctx.checkpoint_dir).dedup_holders.name}); "
                              f"start over with a new --run-dir")
        if self.dedup_on:
            self._in_holders(state, lambda: self.ctx.holders.open(self.ds.name, self.ctx.checkpoint_dir, counts))
        if self.near is not None:
            self._in_holders(state, lambda: self.ctx.holders.open_near(self.ds.name, self.files.near_dedup,
                                                                       state.near_dedup_bytes, self.near))
        return counts

    def _in_holders(self, state: IngestState, call: Callable[[], Any]) -> Any:
        """`call` on the dedup holders outside the decider (opening the dataset's index, flushing its logs before a
        checkpoint): a failure there, e.g. a holder's OSError on its own digest or .near log, is the DecideError the
        decider's is, naming the dataset, not a bare 'OSError: …/beta.near' (a lost holder stays HolderLost)."""
        try:
            return call()
        except HolderLost:
            raise
        except Exception as exc:
            raise self._decide_error(state, one_line(exc)) from exc

    def _decide_error(self, state: IngestState, what: str) -> DecideError:
        """The job's line for a failure deciding the dataset's records (in the decider, or on the holders beside)."""
        return DecideError(f"dataset {self.ds.name}: deciding its records (exact and near dedup, caps) failed after "
                           f"item {state.consumed}: {what}")

    async def _earlier_datasets(self) -> list[str] | None:
        """`dedup_scope: run`: the datasets listed before this one (their indexes stay in the holders), once they
        are all done (None if the job stops first). Deciding nothing before then makes the earlier dataset win a
        cross-dataset (near-)duplicate whatever the timing; workers still judge ahead (bounded by the queue)."""
        if not self.run_scope:
            return []
        earlier = []
        for ds in self.ctx.datasets:
            if ds.name == self.ds.name:
                break
            if not await self.ctx.wait_done(ds.name):
                return None
            earlier.append(ds.name)
        return earlier

    def _submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future:
        """A worker call on the job's executor, awaitable on this loop."""
        return asyncio.wrap_future(self.qc.submit(fn, *args))

    def _stage(self, u: int, k: int) -> str:
        return str(self.stage_dir / f"u{u:07d}-{k:07d}")

    def _died_on(self, stage: str, what: str, exc: WorkerDied) -> SourceError:
        """The job's error for a call whose worker process died (`executor.WorkerDied`): the bare BrokenProcessPool
        named no dataset, unit or cause."""
        unit = self.units[int(Path(stage).name[1:8])]  # `_stage`'s name: u<unit>-<piece>
        where = ("a stream piece" if unit.kind == "stream"
                 else f"unit {unit.path or unit.kind} [{unit.start}, {unit.end})")
        return SourceError(f"dataset {self.ds.name}: {what} {where}: {one_line(exc)}; run without the record (or "
                           f"the plug-in) that kills it, then re-run the same command to resume")

    # -- reading: units to the workers, in plan order ------------------------------------------------
    async def _read(self, pos: dict[str, Any], consumed: int, queue: asyncio.Queue) -> None:
        """Queue items `(unit, piece, source position after it, last piece of the unit, judge call)` in plan
        order, then None; a failure ends the queue with its exception. An hf:// unit is handed out once the
        download window has room for its file, and none once a cap has ended the dataset: also none when the
        checkpoint is at a cap already (a job stopped after saving the piece a cap ended the dataset in, before marking
        it done), where the next unit was judged whole, for nothing, and its position went past the cap's."""
        try:
            if self._cap_reached(self.ctx.progress[self.ds.name]):
                await queue.put(None)
                return
            for u in range(pos["unit"], len(self.units)):
                unit = self.units[u]
                if self.window is not None:
                    while not (self.window.fits(u) and self._may_need(u)) and not self.capped:
                        self._room.clear()
                        await self._room.wait()
                if self.ctx.stop.is_set() or self.capped:
                    return
                if self.window is not None:
                    self.window.take(u)
                    self._handed = u + 1
                if unit.kind != "stream":
                    await _put(queue, (u, 0, None, True, self._submit(
                        unit_worker.judge_piece, self.ds.name, self.ds.text_field, self.batch, self._stage(u, 0), unit,
                        None, self.options, self._ahead_of(u))))
                    continue
                first = pos["piece"] if u == pos["unit"] else 0
                consumed = await self._read_stream(u, first, pos["source"] if u == pos["unit"] else None,
                                                   consumed, queue)
            await queue.put(None)
        except Exception as exc:
            await queue.put(exc)

    def _cap_reached(self, state: IngestState) -> bool:
        """Whether `max_records` or `size_mb` ends the dataset at `state`'s counters (as the decider ends it)."""
        cap = self.ds.max_records
        return (cap is not None and state.consumed >= cap) or \
            (self.size_cap is not None and state.kept_text_bytes >= self.size_cap)

    def _batches_per_call(self) -> int:
        """How many batches the next QC call carries: about QC_CALL_BYTES of text at the mean kept so far. One under
        `size_mb`, whose reads must not run further ahead of the cap (a remote source fetches what is read)."""
        state = self.ctx.progress[self.ds.name]
        if not state.kept or self.size_cap is not None:
            return 1
        batch_bytes = self.batch * state.kept_text_bytes / state.kept
        return max(1, min(QC_CALL_BATCHES, int(QC_CALL_BYTES // max(batch_bytes, 1))))

    async def _read_stream(self, u: int, k: int, start: dict[str, Any] | None, consumed: int,
                           queue: asyncio.Queue) -> int:
        """A stream unit, read here in QC calls (pieces) of batches cut exactly as one read per batch would
        cut them, and never past `max_records` (a remote source fetches what is read)."""
        loop = asyncio.get_running_loop()
        it = self.source.iter_records(start)
        cap = self.ds.max_records
        while not self.ctx.stop.is_set():
            n = self.batch * self._batches_per_call()
            n = n if cap is None else min(n, cap - consumed)
            items = await loop.run_in_executor(self.reader_pool, _take, it, n) if n > 0 else []
            consumed += len(items)
            last = len(items) < n or not items  # none: the cap was reached with the last call
            fut = self._submit(unit_worker.judge_piece, self.ds.name, self.ds.text_field, self.batch,
                                 self._stage(u, k), None, [r for r, _ in items])
            await _put(queue, (u, k, items[-1][1] if items else start, last, fut))
            if last:
                return consumed
            start, k = items[-1][1], k + 1
        return consumed

    async def _or_stop(self, aw: Any, grace: float = 0.0) -> Any:
        """`aw`'s result, or STOP as soon as a stop is requested (even while a read or download is stalled), or
        `grace` seconds after (a piece being committed: a stop keeps it unless it is stuck behind a stall)."""
        work = asyncio.ensure_future(aw)
        stop = asyncio.ensure_future(self.ctx.stop.wait())
        try:
            await asyncio.wait((work, stop), return_when=asyncio.FIRST_COMPLETED)
            if grace and not work.done():
                await asyncio.wait((work,), timeout=grace)
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

    # -- deciding: in plan order, on summaries -------------------------------------------------------
    async def _decide_all(self, a: Ahead, dedup: HeldDedup, judged: asyncio.Queue, decided: asyncio.Queue) -> None:
        """Queue items `(stage, decision or None, counters after it, finalize call or None)`, then None (the
        dataset ends: all read, or a cap reached); a failure ends the queue with its exception."""
        try:
            while True:
                got = await judged.get()
                if got is None or isinstance(got, Exception):
                    await decided.put(got)
                    return
                u, k, source, last, fut = got
                unit, stage = self.units[u], self._stage(u, k)
                try:
                    summary: Summary = await fut
                except WorkerDied as exc:
                    raise self._died_on(stage, "judging", exc) from exc
                d, capped = None, False
                if not (unit.kind in units.NUMBERED and unit.file == a.position["skip_file"]):
                    try:
                        d, capped = self._decide(a, dedup, unit, summary)
                    except Exception as exc:
                        raise DecideError(one_line(exc)) from exc
                    if self.dedup_on and len(dedup.counts) > 1:
                        a.dedup_counts = list(dedup.counts)
                    # a piece that reaches max_records exactly ends the dataset too: nothing after it is read
                    capped = capped or (self.ds.max_records is not None and a.consumed >= self.ds.max_records)
                    if summary.rest_failed:
                        a.position["skip_file"] = unit.file
                self._advance(a, u, k, source, last, len(summary.kinds))
                self.capped = capped
                if unit.kind == "hf":
                    self._decided = u + 1
                    self._yield.add(unit.end, len(summary.kinds), int(summary.text_bytes.sum()))
                    self._room.set()
                fin = None
                if d and d.applied and capped and unit.kind == "hf":
                    fin = asyncio.ensure_future(self._finalize_capped(u, stage, d, len(summary.kinds), a.consumed))
                elif d and d.applied and capped and unit.kind != "stream" and d.applied < len(summary.kinds):
                    # the gates count the records up to the cap, not the batches judged past it (whose number
                    # changed with unit_mb: "read 20", the gates "seen 512")
                    fin = self._submit(unit_worker.finalize_piece, self.ds.name, stage, d, unit_worker.GatesTo(
                        d.applied, self.ds.text_field, unit, self.options))
                elif d and d.applied:
                    fin = self._submit(unit_worker.finalize_piece, self.ds.name, stage, d)
                await _put(decided, (stage, d, a.snapshot(), fin))
                if capped:
                    await decided.put(None)
                    return
        except Exception as exc:
            # the job ends here: the reads queued behind this one would only hold up the commit of what came before
            # it (the calls finalizing it queue after them), each for as long as a store gone away takes to fail it;
            # those a process pool has taken (workers + 1) run on, their results unused (executor.py)
            if self._reader is not None:
                self._reader.cancel()
            _drop_calls(judged)
            await decided.put(exc)

    def _ahead_of(self, u: int) -> tuple[Unit, ...]:
        """hf:// without a cap: the unit the worker of `u` is likely to get next (`workers` units on, the pool
        serving calls in order), handed out now if the window has room for it and the units between, for that
        worker to download while it judges `u`: downloads overlap the judging, as the driver's reader thread's
        download-ahead once did. Scheduling only."""
        v = u + self.qc.workers
        if self.window is None or self.ds.max_records is not None or self.size_cap is not None \
                or v >= len(self.units) or v in self.window.held or not self.window.fits_ahead(u, v):
            return ()
        self.window.take(v)
        self._handed = v + 1
        return (self.units[v],)

    def _may_need(self, u: int) -> bool:
        """Whether hf:// unit `u` may be needed under the dataset's caps: the units handed out and not decided yet
        are expected to fall short of them, at what this run's decided units gave per byte of file (the first
        unit goes alone). Scheduling only: the decider stops at the exact record whatever was handed out."""
        cap, size_cap = self.ds.max_records, self.size_cap
        if (cap is None and size_cap is None) or u == self._decided:
            return True
        if not self._yield.bytes:
            return False
        pending = sum(self.units[v].end for v in range(self._decided, self._handed))
        a = self._ahead
        return (cap is None or a.consumed + pending * self._yield.items / self._yield.bytes < cap) and \
            (size_cap is None or a.kept_text_bytes + pending * self._yield.kept / self._yield.bytes < size_cap)

    async def _finalize_capped(self, u: int, stage: str, d: Decision, items: int, consumed: int) -> tuple:
        """Finalize the hf:// unit `u` in which a cap ended the dataset after `consumed` items. Its gate counters
        are those of the items a stream read of the dataset judged: up to the cap (`max_records`), or to the end of
        the stream's batch of `batch_records` (`size_mb` stops inside one), which may reach into the next files."""
        end = -(-consumed // self.batch) * self.batch
        if self.ds.max_records is not None:
            end = min(end, self.ds.max_records)
        count = end - d.ordinal
        rejects, st, kept_bytes = await self._submit(
            unit_worker.finalize_piece, self.ds.name, stage, d,
            unit_worker.GatesTo(min(count, items), self.ds.text_field, self.units[u], self.options))
        count -= items
        for v in range(u + 1, len(self.units)):
            if count <= 0:
                break
            self.window.take(v)  # its file goes when the dataset is done
            gates, got = await self._submit(unit_worker.judge_gates, self.ds.name, self.ds.text_field,
                                              self.units[v], self.options, 0, count)
            stats.add_gates(st, gates)
            count -= got
        return rejects, st, kept_bytes

    def _advance(self, a: Ahead, u: int, k: int, source: Any, last: bool, items: int) -> None:
        """The position after piece `k` of unit `u` (`items` read from it). `file` and `offset` say where the
        next item is, for the progress estimate (streamprep.progress)."""
        pos = a.position
        if not last:
            where = source or {}
            a.position = {**pos, "unit": u, "piece": k + 1, "source": source, "file": where.get("file", 0),
                          "offset": where.get("offset")}
            return
        unit, nxt = self.units[u], self.units[u + 1] if u + 1 < len(self.units) else None
        same = unit.kind in units.NUMBERED and nxt is not None and nxt.file == unit.file
        a.position = {**pos, "unit": u + 1, "piece": 0, "source": None, "base": pos["base"] + items if same else 0,
                      "file": nxt.file if nxt else unit.file + 1,
                      "offset": nxt.start if nxt and nxt.kind == "range" else None}

    def _decide(self, a: Ahead, dedup: Dedup, unit: Unit, s: Summary) -> tuple[Decision, bool]:
        """One piece's verdicts in plan order (dedup and caps depend on everything before). Returns the Decision
        and whether `max_records` or `size_mb` ended the dataset in it. On arrays when near-dedup is off and
        `size_mb` cannot end the dataset inside the piece (`max_records` can: the arrays then decide the items
        before it); else record by record."""
        cap, n = self.ds.max_records, len(s.kinds)
        size_left = self.size_cap is None or a.kept_text_bytes + int(s.text_bytes.sum()) < self.size_cap
        if self.near is None and size_left:
            if cap is None or a.consumed + n <= cap:
                return self._decide_arrays(a, dedup, unit, s), False
            return self._decide_arrays(a, dedup, unit, s.head(cap - a.consumed)), True
        return self._decide_records(a, dedup, unit, s)

    def _decide_arrays(self, a: Ahead, dedup: Dedup, unit: Unit, s: Summary) -> Decision:
        """`_decide_records` of a piece that no cap ends, without near-dedup, on numpy arrays: the same Decision,
        counters, dedup index and log (`tests/test_streamprep/test_ingest_decide.py`) at a fraction of the cost
        per record (`docs/performance.md`, "The driver alone")."""
        kinds = np.frombuffer(s.kinds, np.uint8)
        judged, judged_kept = kinds != BAD, kinds == KEPT
        # per item: -1, or the index into `dedup.names` of the dataset that kept its text
        twin = np.full(len(kinds), -1, np.int64)
        if self.dedup_on:
            twin[judged] = dedup.twin_many(digest_words(s.digests), judged_kept[judged], s.order)
        dup = np.flatnonzero(twin >= 0)
        names = np.array(dedup.names, object)
        return self._tally(a, unit, s, judged_kept & (twin < 0), dict(zip(dup.tolist(), names[twin[dup]].tolist())),
                           {})

    def _tally(self, a: Ahead, unit: Unit, s: Summary, keep: np.ndarray, dup: dict[int, str],
               near: dict[int, tuple[str, int, float]]) -> Decision:
        """The Decision on the first `len(keep)` items of a piece, whichever path decided them (`keep` per item; `dup`
        and `near`: the duplicates' verdicts), and the counters and reject sample it moves `a` by."""
        n = len(keep)
        judged_kept = np.frombuffer(s.kinds, np.uint8)[:n] == KEPT
        qc_kept = int(np.count_nonzero(judged_kept))  # the items QC kept: their sizes lead `s.text_bytes`
        checks = np.empty(n, object)
        checks[~judged_kept] = s.checks[:n - qc_kept]
        checks[list(dup)] = "duplicate"
        checks[list(near)] = "near_duplicate"
        n_kept = int(np.count_nonzero(keep))
        ordinal0 = a.consumed
        a.consumed += n
        a.kept += n_kept
        a.rejected += n - n_kept
        a.dedup_count += n_kept if self.dedup_on else 0
        a.kept_text_bytes += int(s.text_bytes[:qc_kept][keep[judged_kept]].sum())
        rejected = np.flatnonzero(~keep)
        sampled = self._sample(a, checks[rejected], rejected)
        before = a.position["base"] if unit.kind in units.NUMBERED else None
        return Decision(n, ordinal0, before, keep.astype(np.uint8).tobytes(), dup, near, sampled)

    def _sample(self, a: Ahead, checks: np.ndarray, at: np.ndarray) -> frozenset[int]:
        """Of rejected items `at` (failed `checks`, in plan order), those whose reject line is written: per check,
        while fewer than `max_rejects` are sampled; `a.rejects_sampled` counts them (keys in first-sample order)."""
        if self.max_rejects is None:
            for check, count in Counter(checks.tolist()).items():
                a.rejects_sampled[check] = a.rejects_sampled.get(check, 0) + count
            return frozenset(at.tolist())
        sampled: list[int] = []
        for check in dict.fromkeys(checks.tolist()):
            room = self.max_rejects - a.rejects_sampled.get(check, 0)
            if room > 0:
                take = at[checks == check][:room].tolist()
                a.rejects_sampled[check] = a.rejects_sampled.get(check, 0) + len(take)
                sampled += take
        return frozenset(sampled)

    def _decide_records(self, a: Ahead, dedup: Dedup, unit: Unit, s: Summary) -> tuple[Decision, bool]:
        """`_decide` record by record (`holders.walk`): a cap may end the dataset at any record, and near-dedup
        compares each kept record with the ones kept before it. The piece's digests are probed at once, the walk
        runs where the near-dedup indexes are (holder 0; here without near-dedup), the records it keeps are added at
        once after it; counters and the reject sample as for `_decide_arrays` (`_tally`)."""
        digests = s.digest_list()
        codes = dedup.probe_many(digest_words(s.digests)).tolist() if self.dedup_on else []
        args = (s.kinds, s.text_bytes, digests, codes, s.signatures, a.consumed, self.ds.max_records,
                a.kept_text_bytes, self.size_cap, self.dedup_on)
        w = self.ctx.holders.walk(self.ds.name, self.earlier, *args) if self.near is not None else holders.walk(*args)
        keep = np.frombuffer(w.keep, np.uint8).astype(bool)
        if self.dedup_on and keep.any():  # the kept digests, in order (each item's place among the judged ones)
            judged = np.cumsum(np.frombuffer(s.kinds, np.uint8)[:w.n] != BAD) - 1
            dedup.add_many(digest_words([digests[i] for i in judged[keep].tolist()]))
        names = dedup.names
        d = self._tally(a, unit, s, keep, {j: names[code] for j, code in w.dup.items()}, w.near)
        a.near_dedup_bytes += w.near_bytes
        if w.size_capped:
            log.info("size_mb cap reached", dataset=self.ds.name, kept_text_bytes=a.kept_text_bytes)
        return d, w.capped

    # -- committing: in plan order, checkpointed -----------------------------------------------------
    async def _commit_all(self, state: IngestState, dedup: HeldDedup, decided: asyncio.Queue) -> None:
        while not self.ctx.stop.is_set():
            got = await self._or_stop(decided.get())
            if got is STOP:
                return
            if isinstance(got, Exception):  # everything decided before it is committed and checkpointed
                if isinstance(got, FileGone) and await self._inputs_as_started(state) is STOP:
                    return
                if isinstance(got, (SourceError, ConfigError, ClusterFailed)):  # the last: the engine's, not the input's
                    raise got
                if isinstance(got, DecideError):
                    raise self._decide_error(state, str(got)) from got.__cause__
                raise SourceError(f"dataset {self.ds.name}: reading or judging the input failed after item "
                                  f"{state.consumed}: {one_line(got)}") from got
            if got is None:
                if await self._inputs_unchanged(state) is STOP or await self._seal_parts(state, final=True) is STOP:
                    return
                state.done = True
                try:
                    await self._save(state, dedup)
                except BaseException:  # not on disk: the dataset's staged pieces are what its checkpoint names
                    state.done = False
                    raise
                return
            stage, d, after, fin = got
            # a stop waits a moment, not for ever: this piece's finalizing may queue behind calls stalled in a read
            try:
                finalized = await self._or_stop(fin, COMMIT_GRACE_S) if fin is not None else (b"", {}, 0)
            except WorkerDied as exc:
                raise self._died_on(stage, "finalizing", exc) from exc
            if finalized is STOP or self.ctx.stop.is_set():  # every piece committed so far is checkpointed
                return
            rejects, st, kept_bytes = finalized
            if rejects:
                await _append(self.files.rejects, rejects)
                state.rejects_bytes += len(rejects)
            # the piece's gate stats with its counts, no await between: a metrics scrape during the append (an
            # fsync) saw the rejects by check ahead of the rejected count
            stats.add_stats(state.stats, st)
            after.onto(state)
            n_kept = sum(d.keep) if d else 0
            if n_kept:
                state.open_pieces.append([Path(stage).name, 0, n_kept])
                state.part_lines += n_kept
                state.part_bytes += kept_bytes
            sealed = await self._seal_parts(state, final=False)
            if sealed is STOP:
                return
            done_with = sealed + ([] if n_kept else [Path(stage).name])
            await self._save(state, dedup)
            staged = [str(self.stage_dir / name) + ext for name in done_with for ext in (".kept", ".kept.off")]
            await asyncio.to_thread(_remove, [stage + ".judged", *staged])

    async def _seal_parts(self, state: IngestState, final: bool) -> Any:
        """Assemble every full part (and, at the end, the last short one) from the open pieces' kept lines,
        in a worker; returns the pieces no longer needed, or STOP (the in-memory state is then ahead of its
        checkpoint, which is not saved again)."""
        done_with: list[str] = []
        while state.part_lines >= self.shard_records or (final and state.part_lines):
            take, slices = min(state.part_lines, self.shard_records), []
            while take:
                name, first, n = state.open_pieces[0]
                m = min(n, take)
                slices.append((str(self.stage_dir / name), first, m))
                take -= m
                if m == n:
                    done_with.append(state.open_pieces.pop(0)[0])
                else:
                    state.open_pieces[0] = [name, first + m, n - m]
            assembled = await self._or_stop(self._submit(unit_worker.assemble_part,
                                                         str(self.files.part(state.part_index)), slices),
                                            COMMIT_GRACE_S)
            if assembled is STOP:
                return STOP
            sha, size = assembled
            state.sealed.append([sha, size])
            state.part_index += 1
            state.part_lines -= sum(n for _, _, n in slices)
            state.part_bytes -= size
        return done_with

    async def _save(self, state: IngestState, dedup: HeldDedup) -> None:
        if self.dedup_on or self.near is not None:  # each log holds at least what the checkpoint counts
            await asyncio.to_thread(self._in_holders, state, dedup.flush)
        await asyncio.to_thread(save, self.files, state)
        if self.window is not None:  # the files of the units this checkpoint has passed leave the window
            await self.release_files(state.position["unit"])
        self._checkpointed(state)

    async def release_files(self, before: int) -> None:
        """hf://: the files of units before `before` are no longer needed by any resume; delete them (unless
        `hf_keep_cache`) and let the reader hand out more."""
        evict = self.window.evictor(before)
        if evict is not None:
            await asyncio.to_thread(evict)
        self.window.release(before)  # once deleted: the files on disk never exceed the window
        self._room.set()

    def _checkpointed(self, state: IngestState) -> None:
        if self.ctx.on_checkpoint is not None:
            self.ctx.on_checkpoint(state)


@dataclass
class Yield:
    """Items and kept text bytes that decided hf:// units gave, and the bytes of their files."""

    bytes: int = 0
    items: int = 0
    kept: int = 0

    def add(self, size: int, items: int, kept: int) -> None:
        self.bytes, self.items, self.kept = self.bytes + size, self.items + items, self.kept + kept


def worker_executor(execution: ExecutionConfig, quality: QualitySettings, mode: Mode) -> Executor:
    """The job's executor (`engines.create_executor`), its workers set up to judge units
    (`unit_worker.init_worker`)."""
    return engines.create_executor(execution, (unit_worker.init_worker, (quality, mode, unit_worker.late_plugins(),
                                                                         list(registry.PLUGIN_MODULES))))


def start_holders(ctx: IngestContext) -> Holders:
    """The job's dedup holders (`streamprep.holders`); a run with a checkpoint and no saved holder count was
    started by an earlier streamprep, with one log per dataset."""
    layout = CheckpointLayout(ctx.checkpoint_dir)
    started = any(layout.checkpoint(ds.name).exists() for ds in ctx.datasets)
    holding = ctx.quality.dedup != "none" or ctx.quality.near_dedup.enabled
    return holders.start(ctx.execution, ctx.checkpoint_dir, started, holding,
                         ctx.executor.stop_asked if ctx.executor is not None else None)


def _remove(paths: list[str]) -> None:
    for p in paths:
        Path(p).unlink(missing_ok=True)


async def _append(path: Path, data: bytes) -> None:
    """`data` appended to `path` and fsynced. An OSError of the write (a full disk) names the file: aiofiles' had
    no filename, and the job's line said "no space left on the disk" without saying where."""
    with atomic.naming(path):
        async with aiofiles.open(path, "ab", opener=atomic.nofollow) as fh:
            await fh.write(data)
            await fh.flush()
            await asyncio.to_thread(os.fsync, fh.fileno())


async def ingest_all(ctx: IngestContext) -> dict[str, IngestState]:
    """Ingest every dataset concurrently (one producer task each); returns their final states."""
    qc = ctx.executor or worker_executor(ctx.execution, ctx.quality, ctx.mode)
    own_holders = ctx.holders is None
    if own_holders:
        ctx.holders = await asyncio.to_thread(start_holders, ctx)
    reader_pool = ThreadPoolExecutor(max(1, len(ctx.datasets)), thread_name_prefix="reader")
    await asyncio.to_thread(clear_leftovers, ctx.hf_cache)  # nothing downloads into the run's cache yet
    t0 = time.monotonic()
    ingests = [DatasetIngest(ds, ctx, qc, reader_pool) for ds in ctx.datasets]
    jobs = [asyncio.ensure_future(d.run()) for d in ingests]
    try:
        results = await asyncio.gather(*jobs)
    finally:
        for job in jobs:  # after one dataset failed, the others stop too (checkpoints never run ahead)
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        reader_pool.shutdown(wait=False, cancel_futures=True)
        if ctx.executor is None:
            await asyncio.to_thread(qc.close)
        if own_holders:
            await asyncio.to_thread(ctx.holders.close)
            ctx.holders = None
        for d in ingests:  # no worker runs now: a done dataset's staged files (units judged past a cap included)
            if (st := ctx.progress.get(d.ds.name)) is not None and st.done:  # and hf:// files go
                await asyncio.to_thread(shutil.rmtree, d.stage_dir, True)
                if d.window is not None:
                    await d.release_files(len(d.units))
        for d in ingests:  # whatever ended, a window holds no file for the other datasets any more
            if d.window is not None:
                d.window.close()
        if any(d.window is not None for d in ingests):
            await asyncio.to_thread(clear_leftovers, ctx.hf_cache)
    log.info("ingest done", seconds=round(time.monotonic() - t0, 3), stopped=ctx.stop.is_set())
    return {s.dataset: s for s in results}


def completed_parts(files: DatasetFiles, state: IngestState) -> list[Path]:
    """The sealed ingest parts of a dataset, in order (the last one may be short; never an empty one)."""
    return [files.part(i) for i in range(state.sealed_parts())]
