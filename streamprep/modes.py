"""The run's mode: pretraining text or SFT/DPO/GRPO, chosen once from the config's `sft:` section.

Everything that differs between the two is a member here, so the rest of the pipeline asks the mode
instead of testing `if sft`: what QC judges and what a kept ingest row carries, whether EOD is
appended, a shard's prefix, plan-hash key, tokenizer backend, tokenizer and tokenization, which exports apply, and
which shard files `verify` expects. The SFT half lives in streamprep/sft/mode.py and registers itself in
`registry.MODES` under its config section's name (declared in streamprep/plugins.py).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

from streamprep import binidx, registry
from streamprep.backends import ShardEncoder
from streamprep.layout import RunLayout
from streamprep.sources.base import BadRecord
from streamprep.textshard import RUN_COLUMNS_BYTES, LineScan, columns_file, columns_header, tokenize_part


class Mode:
    """Pretraining text: QC judges the record itself; shards are `.bin/.idx` of plain text with EOD."""

    name = "pretrain"
    appends_eod = True     # `tokenizer.append_eod` applies (SFT: the chat template places its own ends)
    text_exports = True    # Parquet/TSV shards and blend.json are written for this mode's shards

    def screen(self, items: list[tuple[Any, Any]], text_field: str) -> tuple[list[tuple[Any, Any]], list[Any]]:
        """A read batch of (record or BadRecord, position) → (the batch to decide on, one per item in order, what QC
        judges).

        The records QC judges are the batch's records that are not BadRecords, in order."""
        return items, [rec for rec, _ in items if not isinstance(rec, BadRecord)]

    def kept_row(self, text: str, meta: dict[str, Any], record: Any) -> dict[str, Any]:
        """The ingest line of a kept record."""
        return {"text": text, "meta": meta}

    def fixed_backend(self, requested: str) -> dict[str, Any] | None:
        """The tokenizer backend record when this mode encodes with one backend whatever `tokenizer.backend` asks
        (no identity check is run for it), else None: `backends.select` chooses."""
        return None

    def plan_key(self) -> dict[str, Any]:
        """What this mode adds to a shard's plan hash (beyond dataset, part, tokenizer, EOD, dtype)."""
        return {}

    def shard_prefix(self, layout: RunLayout, dataset: str, part: str) -> Path:
        return layout.binidx_prefix(dataset, part)

    def load_tokenizer(self, tokenizer_path: str, backend: str = "hf") -> Any:
        """A worker's encoder for shards: the run's chosen backend (streamprep.backends.ShardEncoder)."""
        return ShardEncoder(backend, tokenizer_path)

    def tokenize(self, task: Any, tokenizer: Any) -> tuple[dict[str, Any], dict[str, Path]]:
        """One ingest part → (the receipt's stats, its output files by kind); no receipt written. The stats also
        carry the lines' `scan` for the part's summary (`tokenize.PROCESS_ONLY`: never in the receipt). A task
        of a job with Parquet exports also writes the part's columns file (`ShardTask.columns_path`): in its run's
        order once the run is known (`exports.prepare_part`) when the part is small enough to keep, else now."""
        header = columns_header(task.dataset, task.part, task.input_sha256, task.plan_hash)
        keep = task.columns_path is not None and os.path.getsize(task.input_path) <= RUN_COLUMNS_BYTES
        with columns_file(None if keep else task.columns_path, header) as out:
            scan = LineScan(out, keep)
            shard_stats = tokenize_part(task, tokenizer, scan)
        paths = binidx.prefix_paths(task.prefix) if shard_stats["num_documents"] else ()
        return {**shard_stats, "scan": scan}, dict(zip(("bin", "idx"), paths))


PRETRAIN = Mode()


def mode_of(sft: Any) -> Mode:
    """The mode of a run (`Config.sft`, an SftConfig) or of a shard task (`task.sft`, the validated dict it
    carries as plain data): the one place that tests it. The registered "sft" mode turns a dict into its config."""
    if not sft:
        return PRETRAIN
    return registry.MODES.get("sft")(sft)


def receipt_mode_name(receipt: Mapping[str, Any]) -> str:
    """The mode a receipt was written in (verify reads run dirs without their config)."""
    return "sft" if (receipt.get("stats") or {}).get("sft") is not None else PRETRAIN.name
