"""`engine: local`: shard tasks on this machine, one at a time, no Ray or Xenna imported.

One tokenizer at a time is enough: `encode_batch` runs in Rust on every core. With `workers: 1` it runs in a
thread of the driver (one process does everything). With more workers it runs in one child process, as QC
does: the driver then only keeps the books, and its GIL is not shared with the tokenizer's Python parts (part
reading, `.bin` writing). The child ignores SIGINT (the driver stops it) and ends with the driver.
"""
from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor

from streamprep.children import serve_driver
from streamprep.engines.base import Engine, Result, run_shard
from streamprep.tokenize import ShardTask, TokenizerCache

_tokenizers = TokenizerCache()  # the tokenizer of the process running the tasks (driver thread or child)


def _run(task: ShardTask) -> Result:
    return run_shard(task, _tokenizers.get(task))


class LocalEngine(Engine):
    name = "local"

    def __init__(self, workers: int = 1, ray_address: str | None = None):
        super().__init__()
        self._pool: Executor
        if workers > 1:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"),
                                             initializer=serve_driver, initargs=(os.getpid(),))
        else:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._futures: list[Future] = []
        self._counted = threading.Condition()  # tasks answered and counted
        self._answered = 0

    def submit(self, task: ShardTask) -> None:
        self.submitted += 1
        future = self._pool.submit(_run, task)
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
        self._pool.shutdown(wait=False, cancel_futures=True)

    def join(self) -> None:
        self._pool.shutdown(wait=True)
