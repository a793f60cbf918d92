"""Tokenization engines, chosen by `execution.engine`: each takes ShardTasks and returns their results.

    engine = create(config.execution, executor)   # its section, and the job's executor (streamprep.executor)
    with engine:                 # start(): a long-lived engine comes up while ingest runs
        engine.submit(task)      # as each part is sealed
        results = engine.drain() # every submitted task done (receipts written)

Add an engine: a module with an `Engine` subclass, and one line `registry.ENGINES.register("name", Cls)`
(the built-ins are declared in streamprep/plugins.py and imported only when chosen: `local` never loads Ray).
"""
from __future__ import annotations

from typing import Any

from streamprep import executor as executors
from streamprep.config import ExecutionConfig, load_plugin, resolved_workers
from streamprep.engines.base import Engine
from streamprep.executor import Executor, Setup
from streamprep.registry import ENGINES


def check_engine(cfg: dict[str, Any]) -> None:
    """Config check (registry.CHECKS): the engine `execution.engine` names loads (`config.load_plugin`)."""
    load_plugin(ENGINES, cfg["execution"]["engine"], "execution.engine")


def create(execution: ExecutionConfig, executor: Executor) -> Engine:
    """The engine named by `execution.engine` (validated by config), given the job's executor (`local` runs its
    tasks there; `xenna` only until its stage answers) and as many workers as it has; the executor's own engine
    when it is one pipeline with it (`Engine.job_executor`)."""
    if (own := getattr(executor, "engine", None)) is not None:
        return own
    return ENGINES.get(execution.engine)(executor=executor, workers=executor.workers,
                                         ray_address=execution.ray_address)


def create_executor(execution: ExecutionConfig, setup: Setup) -> Executor:
    """The job's executor: the engine's own (`Engine.job_executor`), else `executor.create`'s; `workers` unset =
    one per CPU."""
    workers = resolved_workers(execution.workers)
    own = ENGINES.get(execution.engine).job_executor(workers, execution.ray_address, setup)
    return own if own is not None else executors.create(workers, execution.ray_address, setup)


__all__ = ["ENGINES", "Engine", "check_engine", "create", "create_executor"]
