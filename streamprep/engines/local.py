"""`engine: local`: shard tasks in one worker thread of this process, no Ray or Xenna imported.

One thread is enough: `encode_batch` runs in Rust on every core and releases the GIL, so ingest
and QC go on beside it.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from streamprep.engines.base import Engine, Result
from streamprep.tokenize import ShardTask, TokenizerCache, run_task


class LocalEngine(Engine):
    name = "local"

    def __init__(self, workers: int = 1, ray_address: str | None = None):
        super().__init__()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._futures: list[Future] = []
        self._tokenizers = TokenizerCache()

    def _run(self, task: ShardTask) -> Result:
        result = run_task(task, self._tokenizers.get(task))
        self._done(result)
        return result

    def submit(self, task: ShardTask) -> None:
        self.submitted += 1
        self._futures.append(self._pool.submit(self._run, task))

    def drain(self) -> list[Result]:
        results = [f.result() for f in self._futures]
        self._futures.clear()
        return results

    def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def join(self) -> None:
        self._pool.shutdown(wait=True)
