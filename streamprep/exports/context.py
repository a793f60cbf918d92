"""What every output writer (registry.WRITERS: the built-in Parquet, blend.json and mixtures.json ones, then
writers of your own) is handed: the finished shards, their indexes and the export options of the run."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from streamprep.exports.index import DatasetIndex, ShardRef
from streamprep.executor import Executor

if TYPE_CHECKING:
    from streamprep.config import DatasetConfig, OutputConfig


@dataclass(frozen=True)
class WriterContext:
    """The run dir, the finished shards and per dataset its index (records, tokens, its parts and their sorted
    runs), in config order; `split_of` each dataset's train/valid/test; `blend`: the run's mode writes
    blend.json; `workers` the export processes. `sft`: dataset → (documents, tokens) of its SFT shards (not in
    `shards`: their receipts list them). `binidx` holds the manifest's `.bin/.idx` shard entries; `parquet` its
    Parquet ones, filled by the "parquet" writer (the first registered, so the writers after it can read them)."""

    run_dir: Path
    shards: list[ShardRef]
    indexes: list[DatasetIndex]
    datasets: Sequence[DatasetConfig]
    output: OutputConfig
    seed: int
    split_of: Mapping[str, str]
    blend: bool
    workers: Executor
    binidx: list[dict[str, Any]]
    sft: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    parquet: list[dict[str, Any]] = field(default_factory=list)

    @property
    def weights(self) -> dict[str, float]:
        """dataset → weight, in config order."""
        return {d.name: d.weight for d in self.datasets}
