"""The engine interface: submit shard tasks as they become ready, drain the results, start/stop once."""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterable

from streamprep import logs
from streamprep.tokenize import ShardTask

log = logs.get("tokenize")

Result = dict[str, Any]
PING = "ping"  # a serving engine's first task: its answer tells the driver a stage worker is up


class Engine(ABC):
    """Runs `streamprep.tokenize.run_task` on ShardTasks. Receipts, not results, are the record of completion:
    a task whose result is lost (a kill) is simply redone or skipped on resume."""

    name = "engine"

    def __init__(self) -> None:
        self.on_result: Callable[[Result], None] | None = None  # progress hook, called from any thread
        self.submitted = 0
        self.completed = 0
        self._lock = threading.Lock()

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
        """Counted after `on_result` returned: once `drain` sees every task completed, every hook has run."""
        log.info("shard done", dataset=result["task"]["dataset"], part=result["task"]["part"],
                 skipped=result["skipped"], engine=self.name, node=result.get("node_id"))
        try:
            if self.on_result is not None:
                self.on_result(result)
        finally:
            with self._lock:
                self.completed += 1

    def __enter__(self) -> "Engine":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        self.join()
