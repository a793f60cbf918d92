"""Tokenization engines, chosen by `execution.engine`: each takes ShardTasks and returns their results.

    engine = create(config.execution, executor)   # its section, and the job's executor (streamprep.executor)
    with engine:                 # start(): a long-lived engine comes up while ingest runs
        engine.submit(task)      # as each part is sealed
        results = engine.drain() # every submitted task done (receipts written)

Add an engine: a module with an `Engine` subclass, and one line `registry.ENGINES.register("name", Cls)`
(the built-ins are declared in streamprep/plugins.py and imported only when chosen: `local` never loads Ray).
"""
from __future__ import annotations

from streamprep.config import ExecutionConfig
from streamprep.engines.base import Engine
from streamprep.executor import Executor
from streamprep.registry import ENGINES


def create(execution: ExecutionConfig, executor: Executor) -> Engine:
    """The engine named by `execution.engine` (validated by config), given the job's executor (`local` runs its
    tasks there; `xenna` only until its stage answers) and as many workers as it has."""
    return ENGINES.get(execution.engine)(executor=executor, workers=executor.workers,
                                         ray_address=execution.ray_address)


__all__ = ["ENGINES", "Engine", "create"]
