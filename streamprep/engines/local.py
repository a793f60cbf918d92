"""`engine: local`: shard tasks on the job's executor (`streamprep.executor`), no Ray or Xenna imported.

A task is one more call on the workers that judge the units: with `workers: 1` the job's one worker thread,
else its worker processes, each keeping the tokenizer its first task loaded (`encode_batch` runs in Rust on
every core). The driver then only keeps the books: its GIL is not shared with the tokenizer's Python parts
(part reading, `.bin` writing), and the tokenizer needs no process of its own.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future

from streamprep.engines.base import Engine, Result, run_shard
from streamprep.executor import Executor
from streamprep.tokenize import ShardTask, TokenizerCache, drop_tmp_files

_tokenizers = TokenizerCache()  # the tokenizer of the worker running the tasks (thread or process)


def run_local(task: ShardTask) -> Result:
    """One task in a worker of the job's executor. The job's start swept every temporary file, so a first
    attempt has none of its own to drop (a scan of the output folders per task grew with the square of the
    shard count): only `run_local_again` does."""
    return run_shard(task, _tokenizers.get(task))


def run_local_again(task: ShardTask) -> Result:
    """`run_local` run again after its worker died (`executor.again`): first drop what the dead attempt left."""
    drop_tmp_files(task)
    return run_local(task)


run_local.again = run_local_again  # type: ignore[attr-defined]


class LocalEngine(Engine):
    name = "local"

    def __init__(self, executor: Executor, workers: int = 1, ray_address: str | None = None):
        super().__init__()
        self._executor = executor
        self._futures: list[Future] = []
        self._counted = threading.Condition()  # tasks answered and counted
        self._answered = 0

    def submit(self, task: ShardTask) -> None:
        self.submitted += 1
        future = self._executor.submit(run_local, task)
        future.add_done_callback(self._finished)
        self._futures.append(future)

    def _finished(self, future: Future) -> None:
        """Logged and counted in the driver, whichever process ran the task (after its future is resolved, so
        `drain` waits for the count too)."""
        if not future.cancelled() and future.exception() is None:
            self._done(future.result())
        with self._counted:
            self._answered += 1
            self._counted.notify_all()

    def drain(self) -> list[Result]:
        results = [f.result() for f in self._futures]
        with self._counted:
            self._counted.wait_for(lambda: self._answered >= self.submitted)
        self._futures.clear()
        return results

    def stop(self) -> None:
        for future in self._futures:  # not started yet: the executor's own close waits for the running ones
            future.cancel()
