"""Hands each sealed ingest part to the tokenize engine while ingest goes on.

The ingest writer calls `on_checkpoint(state)` after every checkpoint save (event-loop thread). Parts the
checkpoint has sealed are planned and submitted, in order, by one feeder thread (planning hashes the
part, which must not stall the event loop). Before the tokenizer exists, sealed parts wait:
- `tokenizer.path`: the feeder thread copies it (and chooses its backend) first thing, while ingest starts,
  so it is off the job's serial start and tokenization overlaps ingest from the first part;
- `tokenizer.train.sample_mb`: training starts once every dataset's sealed parts hold its share of the
  sample (or it finished), while ingest continues; the sample is read from those parts;
- otherwise the tokenizer is trained on all kept text after ingest, as before.
What is tokenized never depends on this timing: shard bytes depend on the part and the tokenizer only.
"""
from __future__ import annotations

import copy
import threading
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from streamprep import logs
from streamprep.checkpoints import DatasetFiles, IngestState
from streamprep.engines import Engine
from streamprep.tokenize import ShardTask
from streamprep.tokenizer import TokenizerInfo

log = logs.get("feeder")
Planner = Callable[[str, Path, str, TokenizerInfo], ShardTask]  # dataset, part, its SHA-256, tokenizer
Wait = Callable[[Future], Any]  # a future's result, unless the feeder closes first (`ShardFeeder.wait`)
STOP_POLL_S = 0.1  # how often a wait for a worker (training, the backend check) looks whether the job stops


class ShardFeeder:
    def __init__(self, engine: Engine, plan: Planner, files: dict[str, DatasetFiles],
                 given: Callable[[Wait], TokenizerInfo | None],
                 train: Callable[[dict[str, IngestState]], Future[TokenizerInfo]],
                 sample_ready: Callable[[dict[str, IngestState]], bool] | None):
        """`given(wait)` prepares the configured tokenizer (None: it is to be trained), waiting for a worker's
        call through `wait`: the feeder thread's first call, so every part it hands on comes after it.
        `train(states)` starts the training on a worker."""
        self.engine, self._plan, self._files = engine, plan, files
        self.info: TokenizerInfo | None = None
        self._train, self._sample_ready = train, sample_ready
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="feeder")
        self._futures: list[Future] = []
        self._checkpointed: dict[str, IngestState] = {}  # the last *saved* state of each dataset
        self._sealed: dict[str, int] = {}
        self._waiting: list[tuple[str, Path, str, bool]] = []
        self._training = False
        self._closing = threading.Event()
        self.tasks: dict[tuple[str, str], ShardTask] = {}
        self._given = self._pool.submit(self._take_given, given)
        self._futures.append(self._given)

    def _take_given(self, given: Callable[[Wait], TokenizerInfo | None]) -> None:
        self.info = given(self.wait)

    def wait(self, future: Future) -> Any:
        """`future`'s result, or CancelledError once the feeder closes (a stop, a failure): the tokenizer's backend
        check waits on a worker that, a stage of Xenna's still starting, may answer 30 s later, and the close waited
        for it (a SIGTERM then took that long)."""
        while True:
            try:
                return future.result(timeout=STOP_POLL_S)
            except TimeoutError:
                if self._closing.is_set():
                    raise CancelledError("the feeder closed while waiting for a worker") from None

    @property
    def sealed(self) -> int:
        return sum(self._sealed.values())

    def on_checkpoint(self, state: IngestState) -> None:
        """Called after `state` was saved; never blocks the event loop. A tokenizer that could not be prepared
        fails the job here, at the first checkpoint after, not at the end of ingest."""
        if self._given.done() and (exc := self._given.exception()) is not None:
            raise exc
        name = state.dataset
        self._checkpointed[name] = copy.copy(state)  # the writer mutates `state` before its next save
        # the dataset's first call is ingest's right after the resume's repair: its parts' hashes are the sealed log's
        resumed = name not in self._sealed
        before, now = self._sealed.get(name, 0), state.sealed_parts()
        self._sealed[name] = now
        if now > before:
            log.info("parts sealed", dataset=name, parts=now, new=now - before)
            for i in range(before, now):
                self._later(self._hand_on, name, self._files[name].part(i), state.sealed[i][0], resumed)
        if self._given.done() and self.info is None and not self._training and self._sample_ready is not None \
                and self._sample_ready(dict(self._checkpointed)):
            self._training = True
            log.info("tokenizer training queued", sealed_parts=self.sealed)  # ingest's own thread: before "ingest done"
            self._later(self._train_then_flush, dict(self._checkpointed))

    def _later(self, fn: Callable[..., Any], *args: Any) -> None:
        self._futures.append(self._pool.submit(fn, *args))

    def _hand_on(self, name: str, part: Path, sha256: str, resumed: bool) -> None:
        """`resumed`: `sha256` is the sealed log's, read back by a resume; the worker hashes the part against it."""
        if self.info is None:
            self._waiting.append((name, part, sha256, resumed))
            return
        task = replace(self._plan(name, part, sha256, self.info), check_input=resumed)
        self.tasks[(name, task.part)] = task
        self.engine.submit(task)

    def _train_then_flush(self, states: dict[str, IngestState]) -> None:
        """Wait for the worker's training unless the job is closing: a stop or a failure then waits for no
        training (minutes on a large corpus), which the executor's close stops with its worker (or, a thread of
        a library caller's process, waits for: `Job.run`)."""
        training = self._train(states)
        while True:
            try:
                self.info = training.result(timeout=STOP_POLL_S)
                break
            except TimeoutError:
                if self._closing.is_set():
                    return
        waiting, self._waiting = self._waiting, []
        for name, part, sha256, resumed in waiting:
            self._hand_on(name, part, sha256, resumed)

    def finish(self, states: dict[str, IngestState]) -> TokenizerInfo:
        """After ingest: train on everything if nothing did yet, and wait until every sealed part is submitted."""
        self._given.result()
        if self.info is None and not self._training:
            self._training = True
            self._later(self._train_then_flush, states)
        for f in self._futures:  # raises the first failure of the feeder thread (planning, training)
            f.result()
        assert self.info is not None
        return self.info

    def close(self) -> None:
        """Cancel what has not started and wait for the feeder thread (a training it waits for is abandoned)."""
        self._closing.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
