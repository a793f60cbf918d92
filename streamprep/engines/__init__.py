"""Tokenization engines, chosen by `execution.engine`: each takes ShardTasks and returns their results.

    engine = create(cfg["execution"])
    with engine:                 # start(): a long-lived engine comes up while ingest runs
        engine.submit(task)      # as each part is sealed
        results = engine.drain() # every submitted task done (receipts written)

Add an engine: a module here with an `Engine` subclass, and one line in `ENGINES`.
"""
from __future__ import annotations

from typing import Any, Callable

from streamprep.engines.base import Engine

ENGINES: dict[str, Callable[..., Engine]] = {}


def _local(**kw: Any) -> Engine:
    from streamprep.engines.local import LocalEngine

    return LocalEngine(**kw)


def _xenna(**kw: Any) -> Engine:
    from streamprep.engines.xenna import XennaEngine

    return XennaEngine(**kw)


ENGINES.update(local=_local, xenna=_xenna)


def create(execution: dict[str, Any], workers: int) -> Engine:
    """The engine named by `execution.engine` (validated by config)."""
    return ENGINES[execution["engine"]](workers=workers, ray_address=execution["ray_address"])


__all__ = ["ENGINES", "Engine", "create"]
