"""The engine interface: submit shard tasks as they become ready, drain the results, start/stop once."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any, Iterable

from streamprep import logs
from streamprep.executor import Executor, Setup
from streamprep.exports import prepare_part
from streamprep.tokenize import ShardTask, read_receipt, run_task

log = logs.get("tokenize")

Result = dict[str, Any]
PING = "ping"  # a serving engine's first task: its answer tells the driver a stage worker is up


def run_shard(task: ShardTask, tokenizer: Any) -> Result:
    """What every engine's worker does with a task: `run_task`, then the part's exports work (`prepare_part`)
    while the part is warm in this worker's page cache: its summary (tokens read back, text hashes), cached
    beside its receipt, and its sorted run for the Parquet order (the task carries its first ordinal, the seed
    and the bucket bounds). The exports at the end then only merge the runs and write the shards, and the
    driver reads no record for them."""
    result = run_task(task, tokenizer)
    scan = result.pop("scan", None)  # the lines the tokenizing parsed: the summary reads none again
    if not result["skipped"]:
        prepare_part(task, read_receipt(task), scan)
    return result


class Engine(ABC):
    """Runs `run_shard` on ShardTasks. Receipts, not results, are the record of completion:
    a task whose result is lost (a kill) is simply redone or skipped on resume."""

    name = "engine"

    def __init__(self) -> None:
        self.submitted = 0
        self.completed = 0
        self._lock = threading.Lock()

    @classmethod
    def job_executor(cls, workers: int, ray_address: str | None, setup: Setup) -> Executor | None:
        """An executor that runs the job's calls inside this engine (its `engine` attribute is then the job's
        engine), or None for `executor.create`'s."""
        return None

    def start(self) -> None:
        """Bring the engine up; long-lived engines do their slow start-up here, in the background."""

    @abstractmethod
    def submit(self, task: ShardTask) -> None:
        """Queue one task; returns at once."""

    @abstractmethod
    def drain(self) -> list[Result]:
        """Block until every submitted task has a result; raises the first task failure."""

    def stop(self) -> None:
        """Ask the engine to wind down once its submitted work is drained; returns at once, so a
        long-lived engine's shutdown overlaps the exports. Safe to call twice and after a failure."""

    def join(self) -> None:
        """Wait until `stop` has released every worker and cluster."""

    def run(self, tasks: Iterable[ShardTask]) -> list[Result]:
        for task in tasks:
            self.submit(task)
        return self.drain()

    def _done(self, result: Result) -> None:
        """A task's result reached the driver: logged and counted (the progress line reads the count)."""
        log.info("shard done", dataset=result["task"]["dataset"], part=result["task"]["part"],
                 skipped=result["skipped"], engine=self.name, node=result.get("node_id"))
        with self._lock:
            self.completed += 1

    def __enter__(self) -> "Engine":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self.join()
