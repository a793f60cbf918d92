"""The exports' workers: per-part summaries and Parquet shards on all cores, results in a fixed order.

Worker processes are forked from a forkserver (not from the job process, which may hold threads or a
Ray client) and ignore SIGINT: the job process handles the signal and shuts the pool down, cancelling
what has not started; every task writes its files atomically, so stopping anywhere leaves no torn file.
"""
from __future__ import annotations

import importlib
import multiprocessing
import os
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from typing import Any, Callable, Iterable, Iterator

from streamprep.children import serve_driver


# What a warmed worker has loaded. By name, not by import: the writers use this pool (no import cycle), and the
# job's forkserver may already run with the QC pool's preload, which then decides what a fork inherits.
PRELOAD = ("streamprep.exports.parquet", "streamprep.exports.order", "streamprep.exports.summary")


def _init_worker(driver: int) -> None:
    """Ignore SIGINT, end with the job's `driver` process (a killed job leaves no worker); import the writers now,
    so a warmed worker has nothing left to load."""
    serve_driver(driver)
    for name in PRELOAD:
        importlib.import_module(name)


class Workers:
    """`map` in job order: in this process for one worker, else on a pool of `n` processes.

    The processes start at the first `map`, or earlier with `warm()`: the job warms them while its last shards
    are tokenized, so their start-up (a fork and the pyarrow import, ~0.3 s) is not on the end of the job."""

    def __init__(self, n: int):
        self.n = max(1, n)
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> "Workers":
        if self.n > 1:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(list(PRELOAD))
            self._pool = ProcessPoolExecutor(self.n, mp_context=ctx, initializer=_init_worker, initargs=(os.getpid(),))
        return self

    def warm(self) -> None:
        """Start every worker process now, without waiting for them (each submit starts at most one)."""
        if self._pool is not None:
            for _ in range(self.n):
                self._pool.submit(int)  # a no-op task

    def __exit__(self, *exc: Any) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def map(self, fn: Callable[[Any], Any], jobs: Iterable[Any]) -> Iterator[Any]:
        """Results of `fn` over `jobs` in job order; at most 2 jobs per worker are submitted ahead."""
        if self._pool is None:
            yield from map(fn, jobs)
            return
        pending: deque = deque()
        for job in jobs:
            pending.append(self._pool.submit(fn, job))
            if len(pending) >= 2 * self.n:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
