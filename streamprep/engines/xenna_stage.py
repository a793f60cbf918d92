"""The Xenna stages: thin cosmos-xenna adapters over the job's calls (`executor.Call`) and `engines.base.run_shard`.

With `ray_address` the job's pipeline is [IngestStage, TokenizeStage]: the ingest stage runs the calls (judging,
finalizing and assembling units, then the exports and the audit), the tokenize stage the sealed parts; each
passes the other's items through unchanged, since a Xenna pipeline is one line from its source to its sink. On
the job's own cluster the pipeline is the tokenize stage alone (the calls run on this machine's processes)."""
from __future__ import annotations

import os
import socket
from typing import Any

from cosmos_xenna.pipelines import v1 as xenna

from streamprep import logs, ray_cluster, version
from streamprep.engines.base import PING, run_shard
from streamprep.executor import Call, Setup, set_up_worker, quiet_gc
from streamprep.tokenize import TokenizerCache


class IngestStage(xenna.Stage):
    """A `Call` in, its answer out (with the node it ran on); anything else passes. Each worker is set up as
    a pool worker is (`executor.set_up_worker`: the unit worker's gates, the collector tuned), once."""

    def __init__(self, cpus: float, setup: Setup | None):
        self.cpus, self.setup_call = cpus, setup
        self.source = version.source()  # the driver's streamprep: the stage is built there

    @property
    def required_resources(self) -> xenna.Resources:
        return xenna.Resources(cpus=self.cpus, gpus=0)

    def setup(self, worker_metadata: xenna.WorkerMetadata) -> None:
        ray_cluster.same_source(self.source, version.source())
        set_up_worker(self.setup_call)

    def process_data(self, in_data: list[Any]) -> list[Any]:
        node = _node_id()
        return [{**item.answer(), "node_id": node} if isinstance(item, Call) else item for item in in_data]


class TokenizeStage(xenna.Stage):
    """One ShardTask in, one result dict out; a call's answer passes. The stage starts before a trained
    tokenizer exists, so each worker loads the tokenizer its first task names (and keeps it while the
    fingerprint stays)."""

    def __init__(self, cpus: float = 1.0):
        self.cpus = cpus
        self.tokenizers: TokenizerCache | None = None
        self.source = version.source()  # the driver's streamprep: the stage is built there

    @property
    def required_resources(self) -> xenna.Resources:
        return xenna.Resources(cpus=self.cpus, gpus=0)

    def setup(self, worker_metadata: xenna.WorkerMetadata) -> None:
        ray_cluster.same_source(self.source, version.source())
        logs.forward_from_worker()
        self.tokenizers = TokenizerCache()
        quiet_gc()

    def process_data(self, in_data: list[Any]) -> list[dict[str, Any]]:
        assert self.tokenizers is not None, "setup() runs before process_data()"
        where = {"node": socket.gethostname(), "pid": os.getpid(), "node_id": _node_id()}
        return [item if isinstance(item, dict) else {"ping": True, **where, "events": logs.taken()} if item == PING
                else {**run_shard(item, self.tokenizers.get(item)), **where, "events": logs.taken()}
                for item in in_data]


def _node_id() -> str | None:
    """The Ray node this worker runs on (several nodes can share a host name and IP)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # outside a Ray worker (unit tests)
        return None

