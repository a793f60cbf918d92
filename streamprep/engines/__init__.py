"""Tokenization engines, chosen by `execution.engine`: each takes ShardTasks and returns their results.

    engine = create(config.execution, executor)   # its section, and the job's executor (streamprep.executor)
    with engine:                 # start(): a long-lived engine comes up while ingest runs
        engine.submit(task)      # as each part is sealed
        results = engine.drain() # every submitted task done (receipts written)

Add an engine: a module with an `Engine` subclass, and one line `registry.ENGINES.register("name", Cls)`
(the built-ins are declared in streamprep/plugins.py and imported only when chosen: `local` never loads Ray).
"""
from __future__ import annotations

import inspect
from typing import Any

from streamprep import executor as executors, registry
from streamprep.config import ConfigError, ExecutionConfig, load_plugin, resolved_workers
from streamprep.engines.base import Engine, Result
from streamprep.executor import Executor, Setup
from streamprep.registry import ENGINES


class EngineError(RuntimeError):
    """An engine plug-in that broke the interface (what its `drain` returned): a bug to fix in the plug-in, named."""


def check_engine(cfg: dict[str, Any]) -> None:
    """Config check (registry.CHECKS): the engine `execution.engine` names loads (`config.load_plugin`) and is an
    `Engine` subclass taking `create`'s keywords. Another class failed after the run dir was written, as a bare
    AttributeError (`job_executor`) or TypeError (an unexpected keyword)."""
    name = cfg["execution"]["engine"]
    cls = load_plugin(ENGINES, name, "execution.engine")
    where = f"config: 'execution.engine': engine {name!r} ({registry.module_of(cls)})"
    if not (isinstance(cls, type) and issubclass(cls, Engine)):
        raise ConfigError(f"{where} is {getattr(cls, '__qualname__', type(cls).__name__)}, not a subclass of "
                          f"streamprep.engines.base.Engine")
    try:
        inspect.signature(cls).bind(executor=None, workers=1, ray_address=None)
    except TypeError as exc:
        raise ConfigError(f"{where}: {cls.__qualname__}() must take executor=, workers= and ray_address= "
                          f"({exc})") from None


def drain(engine: Engine, name: str) -> list[Result]:
    """`engine.drain()` (`name`: its registry name), checked to be the submitted tasks' results (`run_task`'s dicts):
    a plug-in's None or a list of something else was a bare TypeError or KeyError, the engine unnamed."""
    results = engine.drain()
    if not isinstance(results, (list, tuple)) or not all(
            isinstance(r, dict) and (r.get("skipped") or {"tokens", "seconds"} <= r.keys())
            for r in results):
        got = type(results).__name__ if not isinstance(results, (list, tuple)) else \
            f"a {type(results).__name__} holding {', '.join(sorted({type(r).__name__ for r in results}))}"
        raise EngineError(f"engine {name!r} ({registry.module_of(type(engine))}): drain() returned {got}, not a list "
                          f"of its tasks' results (tokenize.run_task's dicts)")
    return list(results)


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


__all__ = ["ENGINES", "Engine", "EngineError", "check_engine", "create", "create_executor", "drain"]
