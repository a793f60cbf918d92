"""blend.json for Megatron-LM (formats.md §2): per-split lists of `weight, absolute prefix` pairs.

A dataset weight `w` means its share of the samples, so each of its shards gets
`w × shard_tokens / dataset_tokens`. Only shards holding ≥ 1 sequence are listed; an empty split is
`null`. With the list form of `datasets` and `output.valid_fraction > 0`, the file instead holds
`{"data_paths": [...], "split": "train,valid,0"}` (Megatron-Bridge / Nemotron layout B), `data_paths` `null` when
no shard holds a sequence (Megatron's `get_blend_from_list([])` raises). Megatron cuts each prefix of that layout
by the split, so a shard too small to give both train and valid a sequence is named in a warning (`unsplit_shards`).
"""
from __future__ import annotations

from decimal import Decimal, localcontext
from pathlib import Path
from typing import Any, Mapping

from streamprep import atomic, layout, logs
from streamprep.exports.context import WriterContext
from streamprep.layout import RunLayout
from streamprep.exports.index import ShardRef

log = logs.get("exports")

SPLITS = ("train", "valid", "test")
SHOWN = 20  # shards a warning names; it counts them all


def _weight(x: float) -> str:
    return f"{x:.12g}"


def split_percents(valid_fraction: float) -> str:
    """"train,valid,0" in percents, exact and positional: Megatron reads the split with `[.0-9]+`, so "1e-05" (what
    `:g` printed for a valid fraction of 1e-7) is three numbers, and rounding printed 1e-9 as "100,0,0"."""
    with localcontext(prec=400):  # exact for any double in (0, 1): at most ~330 digits between 100 and 5e-322
        valid = (Decimal(repr(valid_fraction)) * 100).normalize()
        return f"{(100 - valid).normalize():f},{valid:f},0"


def build(shards: list[dict[str, Any]], weights: Mapping[str, float], valid_fraction: float,
          per_split: bool) -> dict[str, Any]:
    """`shards`: [{dataset, split, prefix (absolute), num_tokens}] in a fixed order; `weights`: dataset → weight."""
    tokens: dict[str, int] = {}
    for s in shards:
        tokens[s["dataset"]] = tokens.get(s["dataset"], 0) + s["num_tokens"]
    lists: dict[str, list[str]] = {k: [] for k in SPLITS}
    for s in shards:
        if s["num_tokens"] <= 0:
            continue
        w = weights[s["dataset"]] * s["num_tokens"] / tokens[s["dataset"]]
        lists[s["split"]] += [_weight(w), str(s["prefix"])]
    if not per_split and valid_fraction > 0:
        return {"data_paths": lists["train"] or None, "split": split_percents(valid_fraction)}  # [] Megatron refuses
    return {k: (v or None) for k, v in lists.items()}


def build_from_refs(refs: list[ShardRef], weights: Mapping[str, float], split_of: Mapping[str, str],
                    valid_fraction: float) -> dict[str, Any]:
    """blend.json for the shards `refs` (in the order given); one list per split when any split is not train."""
    shards = [{"dataset": r.dataset, "split": r.split, "prefix": r.prefix, "num_tokens": r.receipt["stats"]["num_tokens"]}
              for r in refs]
    return build(shards, weights, valid_fraction, any(s != "train" for s in split_of.values()))


def unsplit_shards(refs: list[ShardRef], split: str) -> list[str]:
    """The shards (manifest ids) of which the `{"data_paths", "split"}` layout gives train or valid no sequence:
    Megatron cuts each prefix's N sequences at round(bound × N) for the normalised, cumulated split's bounds, and
    megatron-core's GPTDataset then never finishes building (`_get_num_epochs` adds epochs of 0 tokens; 0.16.1)."""
    weights = [float(x) for x in split.split(",")]
    bounds = [0.0, weights[0] / sum(weights), (weights[0] + weights[1]) / sum(weights)]
    out = []
    for r in refs:
        n = r.receipt["stats"]["num_documents"]
        cuts = [round(b * n) for b in bounds]
        if n > 0 and (cuts[1] <= cuts[0] or cuts[2] <= cuts[1]):
            out.append(f"binidx/{r.dataset}/{r.part}")
    return out


def export(ctx: WriterContext) -> list[str]:
    """The "blend" writer: blend.json for the shards in their order, if the run's mode writes one."""
    if not ctx.blend:
        return []
    blend = build_from_refs(ctx.shards, ctx.weights, ctx.split_of, ctx.output.valid_fraction)
    if "split" in blend and (unsplit := unsplit_shards(ctx.shards, blend["split"])):
        log.warning("blend.json: Megatron's split gives these shards no train or no valid sequence, and "
                    "megatron-core never finishes building such a dataset (docs/exports.md)", split=blend["split"],
                    shards=unsplit[:SHOWN], count=len(unsplit))
    write(ctx.run_dir, blend)
    return [layout.BLEND]


def write(run_dir: Path, blend: dict[str, Any]) -> Path:
    path = RunLayout(run_dir).blend
    atomic.write_json(path, blend)
    return path
