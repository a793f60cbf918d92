"""The tokenization stage: a thin cosmos-xenna adapter over `streamprep.engines.base.run_shard`."""
from __future__ import annotations

import os
import socket
from typing import Any

from cosmos_xenna.pipelines import v1 as xenna

from streamprep.engines.base import PING, run_shard
from streamprep.executor import quiet_gc
from streamprep.tokenize import ShardTask, TokenizerCache


class TokenizeStage(xenna.Stage):
    """One ShardTask in, one result dict out. The stage starts before a trained tokenizer exists, so each
    worker loads the tokenizer its first task names (and keeps it while the fingerprint stays)."""

    def __init__(self, cpus: float = 1.0):
        self.cpus = cpus
        self.tokenizers: TokenizerCache | None = None

    @property
    def required_resources(self) -> xenna.Resources:
        return xenna.Resources(cpus=self.cpus, gpus=0)

    def setup(self, worker_metadata: xenna.WorkerMetadata) -> None:
        self.tokenizers = TokenizerCache()
        quiet_gc()

    def process_data(self, in_data: list[ShardTask]) -> list[dict[str, Any]]:
        assert self.tokenizers is not None, "setup() runs before process_data()"
        where = {"node": socket.gethostname(), "pid": os.getpid(), "node_id": _node_id()}
        return [{"ping": True, **where} if task == PING else {**run_shard(task, self.tokenizers.get(task)), **where}
                for task in in_data]


def _node_id() -> str | None:
    """The Ray node this worker runs on (several nodes can share a host name and IP)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # outside a Ray worker (unit tests)
        return None
