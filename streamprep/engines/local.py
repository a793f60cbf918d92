"""`engine: local`: shard tasks on this machine, one at a time, no Ray or Xenna imported.

One tokenizer at a time is enough: `encode_batch` runs in Rust on every core. With `workers: 1` it runs in a
thread of the driver (one process does everything). With more workers it runs in one child process, as QC
does: the driver then only keeps the books, and its GIL is not shared with the tokenizer's Python parts (part
reading, `.bin` writing). The child ignores SIGINT (the driver stops it) and ends with the driver.
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor

from streamprep.children import exit_with
from streamprep.engines.base import Engine, Result
from streamprep.tokenize import ShardTask, TokenizerCache, run_task

_tokenizers = TokenizerCache()  # the tokenizer of the process running the tasks (driver thread or child)


def _init_child(driver: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    exit_with(driver)


def _run(task: ShardTask) -> Result:
    return run_task(task, _tokenizers.get(task))


class LocalEngine(Engine):
    name = "local"

    def __init__(self, workers: int = 1, ray_address: str | None = None):
        super().__init__()
        self._pool: Executor
        if workers > 1:
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("forkserver"),
                                             initializer=_init_child, initargs=(os.getpid(),))
        else:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._futures: list[Future] = []
        self._hooked = threading.Condition()  # counts finished tasks whose progress hook has run
        self._hooks = 0
        self._hook_error: BaseException | None = None

    def submit(self, task: ShardTask) -> None:
        self.submitted += 1
        future = self._pool.submit(_run, task)
        future.add_done_callback(self._finished)
        self._futures.append(future)

    def _finished(self, future: Future) -> None:
        """Progress hooks run in the driver, whichever process ran the task (after its future is resolved, so
        `drain` waits for them too)."""
        try:
            if not future.cancelled() and future.exception() is None:
                self._done(future.result())
        except BaseException as exc:  # raised by drain(): a failed hook fails the job, as a failed task does
            self._hook_error = exc
        finally:
            with self._hooked:
                self._hooks += 1
                self._hooked.notify_all()

    def drain(self) -> list[Result]:
        results = [f.result() for f in self._futures]
        with self._hooked:
            self._hooked.wait_for(lambda: self._hooks >= self.submitted)
        if self._hook_error is not None:
            raise self._hook_error
        self._futures.clear()
        return results

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def join(self) -> None:
        self._pool.shutdown(wait=True)
