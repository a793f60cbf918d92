"""Tokenization engines, chosen by `execution.engine`: each takes ShardTasks and returns their results.

    engine = create(config.execution)   # an ExecutionConfig: the engine sees only its section
    with engine:                 # start(): a long-lived engine comes up while ingest runs
        engine.submit(task)      # as each part is sealed
        results = engine.drain() # every submitted task done (receipts written)

Add an engine: a module here with an `Engine` subclass, and one line in `ENGINES`.
"""
from __future__ import annotations

import os
from typing import Any, Callable

from streamprep.config import ExecutionConfig
from streamprep.engines.base import Engine

ENGINES: dict[str, Callable[..., Engine]] = {}


def _local(**kw: Any) -> Engine:
    from streamprep.engines.local import LocalEngine

    return LocalEngine(**kw)


def _xenna(**kw: Any) -> Engine:
    from streamprep.engines.xenna import XennaEngine

    return XennaEngine(**kw)


ENGINES.update(local=_local, xenna=_xenna)


def create(execution: ExecutionConfig) -> Engine:
    """The engine named by `execution.engine` (validated by config); `workers` unset = one per CPU."""
    return ENGINES[execution.engine](workers=execution.workers or os.cpu_count() or 1,
                                     ray_address=execution.ray_address)


__all__ = ["ENGINES", "Engine", "create"]
