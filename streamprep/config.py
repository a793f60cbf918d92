"""Config loading and validation: one pass, one-line errors naming the key, nothing written on failure."""
from __future__ import annotations

import copy
import glob as globmod
import hashlib
from pathlib import Path
from typing import Any, Mapping

import orjson
import yaml

SPLITS = ("train", "valid", "test")
REMOTE_SCHEMES = ("s3://", "gs://", "gcs://", "az://", "abfs://", "http://", "https://", "memory://")


class ConfigError(ValueError):
    """A bad config, argument or path. The CLI prints it as one line and exits 2."""


# key -> (accepted types, default). A nested dict spec is a section. `None` in types = nullable.
NUM = (int, float)
DATASET_SPEC: dict[str, tuple] = {
    "name": ((str,), None),
    "path": ((str,), None),
    "format": ((str, None), None),          # jsonl | parquet | txt | document; inferred from the extension by default
    "optional": ((bool,), False),           # skip (with a log line) instead of failing when no file matches
    "split": ((str, None), None),           # HF split (required for hf://)
    "subset": ((str, None), None),
    "revision": ((str, None), None),
    "text_field": ((str,), "text"),
    "weight": (NUM, 1.0),
    "filter": ((dict, None), None),
    "size_mb": ((*NUM, None), None),
    "max_records": ((int, None), None),
}
SPEC: dict[str, Any] = {
    "run": {
        "name": ((str,), "run"),
        "seed": ((int,), 1234),
        "checkpoint_dir": ((str, None), None),
    },
    "tokenizer": {
        "path": ((str, None), None),
        "if_missing": ((str,), "error"),    # error | train: train a BPE when `path` does not exist
        "train": {"vocab_size": ((int,), 32000), "min_frequency": ((int,), 2)},
        "append_eod": ((bool,), True),
        "eod_token": ((str, None), None),
    },
    "output": {
        "dtype": ((str,), "auto"),
        "shard_records": ((int, None), 100_000),
        "parquet": {
            "length_buckets": ((list,), [128, 256, 512, 1024, 2048, 4096, 8192]),
            "shard_size_bytes": ((int,), 64 * 1024 * 1024),
            "compression": ((str,), "snappy"),
            "row_group_size": ((int,), 10_000),
        },
        "mixtures": {"phases": ((dict,), {})},
        "valid_fraction": (NUM, 0.0),
        "num_shards_multiple_of": ((int,), 1),
        "max_rejects_per_check": ((int, None), 1000),
    },
    "execution": {
        "engine": ((str,), "xenna"),
        "workers": ((int, None), None),
        "ray_address": ((str, None), None),
        "max_concurrent_downloads": ((int,), 8),
        "hf_prefetch_files": ((int,), 4),
        "hf_cache_max_gb": (NUM, 10.0),
        "hf_keep_cache": ((bool,), False),
        "batch_records": ((int,), 512),
        "progress_interval_s": (NUM, 10.0),
    },
}
# Keys whose change alters outputs; a resume with any of them changed is refused (see drift_keys).
OUTPUT_SECTIONS = ("run.seed", "datasets", "quality", "tokenizer", "output", "sft")


def _type_name(types: tuple) -> str:
    names = {int: "an integer", float: "a number", str: "a string", bool: "true/false", list: "a list",
             dict: "a mapping", None: "null"}
    if int in types and float in types:
        types = tuple(t for t in types if t is not int)  # "a number" already covers integers
    return " or ".join(dict.fromkeys(names[t] for t in types))


def _check_type(key: str, value: Any, types: tuple) -> None:
    if value is None:
        if None in types:
            return
        raise ConfigError(f"config: '{key}' must be {_type_name(types)}, got null")
    ok = any(t is not None and isinstance(value, t) for t in types)
    if isinstance(value, bool) and bool not in types:
        ok = False  # YAML true is not an integer here
    if not ok:
        raise ConfigError(f"config: '{key}' must be {_type_name(types)}, got {type(value).__name__} {value!r:.60}")


def _fill(spec: Mapping[str, Any], given: Any, prefix: str) -> dict[str, Any]:
    if given is None:
        given = {}
    if not isinstance(given, Mapping):
        raise ConfigError(f"config: '{prefix}' must be a mapping, got {type(given).__name__}")
    for key in given:
        if key not in spec:
            raise ConfigError(f"config: unknown key '{prefix}.{key}'" if prefix else f"config: unknown key '{key}'")
    out: dict[str, Any] = {}
    for key, sub in spec.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if isinstance(sub, dict):
            out[key] = _fill(sub, given.get(key), dotted)
        else:
            types, default = sub
            value = given.get(key, copy.deepcopy(default))
            _check_type(dotted, value, types)
            out[key] = float(value) if types == NUM and not isinstance(value, bool) else value
    return out


def _is_remote(path: str) -> bool:
    return path.startswith(REMOTE_SCHEMES) or path.startswith("hf://")


def _resolve_path(path: str, base: Path) -> str:
    if _is_remote(path):
        return path
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else (base / p).resolve())


def _check_local_path(key: str, path: str) -> None:
    if _is_remote(path):
        return
    if globmod.has_magic(path):
        if not any(Path(p).is_file() for p in globmod.glob(path, recursive=True)):
            raise ConfigError(f"config: '{key}': no file matches {path}")
    elif not Path(path).exists():
        raise ConfigError(f"config: '{key}': no such file or directory: {path}")


def _datasets(raw: Any, base: Path) -> list[dict[str, Any]]:
    if raw is None:
        raise ConfigError("config: 'datasets' is required (a list, or a mapping with train/valid/test lists)")
    if isinstance(raw, Mapping):
        for key in raw:
            if key not in SPLITS:
                raise ConfigError(f"config: unknown key 'datasets.{key}' (per-split form takes train, valid, test)")
        entries = [(split, i, e) for split in SPLITS for i, e in enumerate(raw.get(split) or [])]
        where = lambda split, i: f"datasets.{split}[{i}]"  # noqa: E731
    elif isinstance(raw, list):
        entries = [("train", i, e) for i, e in enumerate(raw)]
        where = lambda split, i: f"datasets[{i}]"  # noqa: E731
    else:
        raise ConfigError(f"config: 'datasets' must be a list or a train/valid/test mapping, got {type(raw).__name__}")
    if not entries:
        raise ConfigError("config: 'datasets' is empty")
    out, names, skipped = [], set(), []
    for split, i, entry in entries:
        key = where(split, i)
        ds = _fill(DATASET_SPEC, entry, key)
        for required in ("name", "path"):
            if ds[required] is None:
                raise ConfigError(f"config: '{key}.{required}' is required")
        if not ds["name"].replace("-", "_").replace(".", "_").isidentifier():
            raise ConfigError(f"config: '{key}.name' must be a simple name (letters, digits, _ - .), got {ds['name']!r}")
        if ds["name"] in names:
            raise ConfigError(f"config: '{key}.name': duplicate dataset name {ds['name']!r}")
        names.add(ds["name"])
        if ds["weight"] <= 0:
            raise ConfigError(f"config: '{key}.weight' must be > 0, got {ds['weight']}")
        if ds["format"] not in (None, "jsonl", "parquet", "txt", "document"):
            raise ConfigError(f"config: '{key}.format' must be jsonl, parquet, txt or document, got {ds['format']!r}")
        if ds["path"].startswith("hf://") and not ds["split"]:
            raise ConfigError(f"config: '{key}.split' is required for hf:// sources")
        for cap in ("size_mb", "max_records"):
            if ds[cap] is not None and ds[cap] <= 0:
                raise ConfigError(f"config: '{key}.{cap}' must be > 0, got {ds[cap]}")
        ds["path"] = _resolve_path(ds["path"], base)
        try:
            _check_local_path(f"{key}.path", ds["path"])
        except ConfigError:
            if not ds["optional"]:
                raise
            skipped.append(ds["name"])
            continue
        ds["blend_split"] = split
        out.append(ds)
    if not out:
        raise ConfigError(f"config: 'datasets': no optional dataset has input files ({', '.join(skipped)})")
    return out


def validate(raw: Any, base_dir: str | Path = ".") -> dict[str, Any]:
    """Return the full config with defaults filled and paths absolute, or raise ConfigError."""
    from quality import QualityConfigError, validate_quality_config
    from streamprep.exports.mixtures import MixtureConfigError, validate_mixtures

    if not isinstance(raw, Mapping):
        raise ConfigError(f"config: top level must be a mapping, got {type(raw).__name__}")
    base = Path(base_dir).resolve()
    known = set(SPEC) | {"datasets", "quality", "sft"}
    for key in raw:
        if key not in known:
            raise ConfigError(f"config: unknown key '{key}'")
    cfg: dict[str, Any] = {k: _fill(v, raw.get(k), k) for k, v in SPEC.items()}
    cfg["datasets"] = _datasets(raw.get("datasets"), base)
    try:
        cfg["quality"] = validate_quality_config(raw.get("quality"))
    except QualityConfigError as exc:
        raise ConfigError(f"config: 'quality.{exc.key}': {str(exc).removeprefix(f'{exc.key}: ')}") from None

    if raw.get("sft") is not None:
        from streamprep.sft import SftConfigError, validate_sft_config

        try:
            cfg["sft"] = validate_sft_config(raw["sft"])
        except SftConfigError as exc:
            raise ConfigError(f"config: '{exc.key}': {exc.reason}") from None
    tok = cfg["tokenizer"]
    if tok["if_missing"] not in ("error", "train"):
        raise ConfigError(f"config: 'tokenizer.if_missing' must be error or train, got {tok['if_missing']!r}")
    if tok["path"] is not None:
        tok["path"] = _resolve_path(tok["path"], base)
        if tok["if_missing"] == "train" and not Path(tok["path"]).exists():
            tok["path"] = None
        else:
            _check_local_path("tokenizer.path", tok["path"])
    if tok["train"]["vocab_size"] < 300:
        raise ConfigError("config: 'tokenizer.train.vocab_size' must be >= 300 (256 bytes + special tokens)")
    out = cfg["output"]
    if out["dtype"] not in ("auto", "uint16", "int32"):
        raise ConfigError(f"config: 'output.dtype' must be auto, uint16 or int32, got {out['dtype']!r}")
    if out["shard_records"] is not None and out["shard_records"] <= 0:
        raise ConfigError("config: 'output.shard_records' must be > 0")
    buckets = out["parquet"]["length_buckets"]
    if not buckets or any(not isinstance(b, int) or isinstance(b, bool) or b <= 0 for b in buckets) or buckets != sorted(set(buckets)):
        raise ConfigError("config: 'output.parquet.length_buckets' must be increasing positive integers")
    if not 0.0 <= out["valid_fraction"] < 1.0:
        raise ConfigError("config: 'output.valid_fraction' must be in [0, 1)")
    if out["num_shards_multiple_of"] < 1:
        raise ConfigError("config: 'output.num_shards_multiple_of' must be >= 1")
    try:
        validate_mixtures(out["mixtures"]["phases"], [d["name"] for d in cfg["datasets"]])
    except MixtureConfigError as exc:
        raise ConfigError(f"config: {exc}") from None
    ex = cfg["execution"]
    if ex["engine"] not in ("xenna", "local"):
        raise ConfigError(f"config: 'execution.engine' must be xenna or local, got {ex['engine']!r}")
    if ex["workers"] is not None and ex["workers"] < 1:
        raise ConfigError("config: 'execution.workers' must be >= 1")
    if ex["batch_records"] < 1 or ex["max_concurrent_downloads"] < 1:
        raise ConfigError("config: 'execution.batch_records' and 'execution.max_concurrent_downloads' must be >= 1")
    if ex["hf_prefetch_files"] < 1 or not ex["hf_cache_max_gb"] > 0:
        raise ConfigError("config: 'execution.hf_prefetch_files' must be >= 1 and 'execution.hf_cache_max_gb' > 0")
    if cfg["run"]["checkpoint_dir"] is not None:
        cfg["run"]["checkpoint_dir"] = _resolve_path(cfg["run"]["checkpoint_dir"], base)
    return cfg


def load_file(path: str | Path) -> dict[str, Any]:
    """Read and validate a YAML config file; paths in it are relative to the file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config: no such file: {p}")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"config: {p}: not valid YAML: {first}") from None
    return validate(raw, p.parent)


def output_view(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The part of the config that determines the outputs (execution settings excluded)."""
    return {"run.seed": cfg["run"]["seed"], **{k: cfg.get(k) for k in OUTPUT_SECTIONS if k != "run.seed"}}


def config_hash(cfg: Mapping[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(output_view(cfg), option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def drift_keys(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Dotted keys whose values differ between two output views (what a resume would silently change)."""
    diffs: list[str] = []

    def walk(a: Any, b: Any, key: str) -> None:
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{key}.{k}" if key else k)
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(isinstance(x, Mapping) for x in a + b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{key}[{i}]")
        elif a != b:
            diffs.append(key)

    walk(output_view(old), output_view(new), "")
    return diffs
