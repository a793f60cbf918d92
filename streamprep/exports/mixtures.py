"""mixtures.json (formats.md §4): sources with their shards, and phases of normalised source weights.

`output.mixtures.phases` maps phase name → {dataset name → weight}; phases keep their config order.
Without phases there is one phase `default` holding the train-split datasets with their config weights
(all datasets when none is train). A source with no records is left out of a phase (listed under
`empty_sources`) and the other weights are normalised without it; so is an optional dataset skipped for want of
input (config.py), which is not among the sources at all.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable, Mapping

from streamprep import atomic, layout, logs
from streamprep.config import ConfigError, printable
from streamprep.exports.context import WriterContext
from streamprep.layout import RunLayout

log = logs.get("exports")

FORMAT = "streamprep-mixtures"
VERSION = 1
DEFAULT_PHASE = "default"
# as `datasets[].weight`: weights are relative; any sum of them stays finite and every normalised share a normal
# double > 0 (a denormal beside 1e15 was written as weight 0)
MIN_WEIGHT, MAX_WEIGHT = 1e-15, 1e15


class MixtureConfigError(ValueError):
    """A bad `output.mixtures.phases` entry; `key` is the dotted config key, the message one line."""

    def __init__(self, key: str, message: str):
        key = printable(key)
        super().__init__(f"'{key}': {printable(message)}")
        self.key = key


def check_options(cfg: dict[str, Any], skipped: Iterable[str] = ()) -> None:
    """Config validation (registry.CHECKS): `output.mixtures.phases` against the config's datasets; a phase may
    name an optional dataset `skipped` for want of input (an empty source of it, as the input it lacks would be)."""
    try:
        validate_mixtures(cfg["output"]["mixtures"]["phases"], [d["name"] for d in cfg["datasets"]], skipped)
    except MixtureConfigError as exc:
        raise ConfigError(f"config: {exc}") from None


def validate_mixtures(phases: Any, dataset_names: Iterable[str], skipped: Iterable[str] = ()) -> None:
    """Check phases before any work: known datasets (or `skipped` optional ones) only, weights numbers in
    [MIN_WEIGHT, MAX_WEIGHT], no empty phase."""
    known, absent = list(dataset_names), set(skipped)
    base = "output.mixtures.phases"
    if phases is None:
        return
    if not isinstance(phases, Mapping):
        raise MixtureConfigError(base, f"must be a mapping of phase name to {{dataset: weight}}, got {type(phases).__name__}")
    for phase, weights in phases.items():
        key = f"{base}.{phase}"
        if not isinstance(phase, str) or not phase:
            raise MixtureConfigError(key, "phase names must be non-empty strings")
        if not isinstance(weights, Mapping) or not weights:
            raise MixtureConfigError(key, "must be a non-empty mapping of dataset name to weight")
        for name, w in weights.items():
            wkey = f"{key}.{name}"
            if name not in known and name not in absent:
                raise MixtureConfigError(wkey, f"unknown dataset {name!r} (known: {', '.join(known) or 'none'})")
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not MIN_WEIGHT <= w <= MAX_WEIGHT:  # NaN too
                got = f"{type(w).__name__} {w!r}" if not isinstance(w, (int, float)) else repr(w)  # YAML's '1e+15'
                raise MixtureConfigError(wkey, f"weight must be a number in [{MIN_WEIGHT:g}, {MAX_WEIGHT:g}], "
                                               f"got {got}")


def _normalise(weights: Mapping[str, float]) -> dict[str, float]:
    total = math.fsum(float(w) for w in weights.values())
    return {k: float(w) / total for k, w in weights.items()} if total > 0 else {}


def build(shards: list[dict[str, Any]], weights: Mapping[str, float], phases: Mapping[str, Mapping[str, float]],
          split_of: Mapping[str, str], sft: Mapping[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """`shards`: manifest entries (parquet and binidx). `weights`: dataset → weight, in config order.
    `phases` were validated with the config (validate_mixtures); a name not in `weights` is an optional dataset
    skipped for want of input, an empty source. `sft`: dataset → (documents, tokens) of its SFT shards, which have
    no manifest entry (their receipts list their files) but are the dataset's records."""
    names = list(weights)
    sources: dict[str, dict[str, Any]] = {
        n: {"split": split_of[n], "shards": [], "binidx": [], "num_records": 0, "num_tokens": 0} for n in names}
    for s in sorted(shards, key=lambda s: s["shard_id"]):
        src = sources[s["source"]]
        if s["kind"] == "parquet":
            src["shards"].append(s["shard_id"])
            src["num_records"] += s["num_records"]
            src["num_tokens"] += s["num_tokens"]
        else:
            src["binidx"].append(s["shard_id"])
    for n, (records, tokens) in (sft or {}).items():
        sources[n]["num_records"] += records
        sources[n]["num_tokens"] += tokens
    if phases:
        wanted = [(name, dict(w)) for name, w in phases.items()]
    else:
        train = [n for n in names if split_of[n] == "train"] or names
        wanted = [(DEFAULT_PHASE, {n: weights[n] for n in train})]
    out_phases = []
    for name, phase_weights in wanted:
        present = {k: w for k, w in phase_weights.items() if k in sources and sources[k]["num_records"] > 0}
        norm = _normalise(present)
        out_phases.append({
            "name": name,
            "weights": norm,
            "config_weights": {k: float(w) for k, w in phase_weights.items()},
            "empty_sources": sorted(k for k in phase_weights if k not in present),
            "sources": {k: {"weight": norm[k], "shards": sources[k]["shards"]} for k in norm},
        })
    return {"format": FORMAT, "version": VERSION, "sources": sources, "phases": out_phases}


def export(ctx: WriterContext) -> list[str]:
    """The "mixtures" writer: mixtures.json over every shard, Parquet (written by the "parquet" writer) and .bin/.idx.
    A phase none of whose datasets kept a record is written with no weights, and said in the log: a trainer given
    it has nothing to sample."""
    mixtures = build(ctx.parquet + ctx.binidx, ctx.weights, ctx.output.mixtures.phases, ctx.split_of, ctx.sft)
    for phase in mixtures["phases"]:
        if not phase["weights"]:
            log.warning("mixture phase has no data: none of its datasets kept a record", phase=phase["name"],
                        datasets=phase["empty_sources"])
    write(ctx.run_dir, mixtures)
    return [layout.MIXTURES]


def write(run_dir: Path, mixtures: dict[str, Any]) -> Path:
    path = RunLayout(run_dir).mixtures
    atomic.write_json(path, mixtures)
    return path
