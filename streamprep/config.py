"""Config loading and validation: one pass, one-line errors naming the key, nothing written on failure."""
from __future__ import annotations

import copy
import glob as globmod
import hashlib
import math
import os
import re
import unicodedata
from dataclasses import dataclass, fields, is_dataclass, replace
from decimal import Decimal, InvalidOperation
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, get_type_hints
from urllib.parse import unquote

import orjson
import yaml

from streamprep import registry

SPLITS = ("train", "valid", "test")
# storage_options keys whose values are credentials: run.json records "<redacted>" instead
SECRET_KEY_RE = re.compile(r"key|secret|token|password|credential|session", re.IGNORECASE)


MAX_CONFIG_BYTES = 1 << 20      # a config file larger than this is refused unread
MAX_CONFIG_NODES = 100_000      # YAML nodes after alias expansion (a billion-laughs bomb stops here)
MAX_CONFIG_DEPTH = 64           # YAML nesting
MAX_NAME_CHARS = 64             # run and dataset names become path components
URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")  # s3://, hf://, https://, file://: any scheme, ours or not
NAME_RE = re.compile(r"^\w[\w.-]*\Z")  # starts with a letter, digit or _; no '/', never '.' or '..'
# A number YAML 1.2 reads but PyYAML's YAML 1.1 takes for text: an exponent without a decimal point or a sign (1e-3,
# 1e6, 1.0e3)
TEXT_NUMBER_RE = re.compile(r"[-+]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)[eE][-+]?[0-9]+\Z")
MARKS = ("Mn", "Mc", "Me")  # combining marks: in a composed name after its first letter (Devanagari's vowel signs: हिन्दी)
# The checkpoint dir keeps each dataset's `<name>.json` beside these (streamprep.layout): a dataset so named would
# overwrite one, as would one named `<other>.plan`, whose checkpoint is `<other>.plan.json`, the other's plan.
RESERVED_NAMES = ("dedup_holders", "tokenizer_backend", "tokenizer_backend_fallback")


def printable(text: str) -> str:
    """`text` with each control character escaped (a newline as `\\n`): a YAML key or name may hold one, and an
    error naming it must stay one line."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _not_json(value: Any, key: str) -> tuple[str, Any] | None:
    """The first value under `key` that no JSON record holds, and its key: YAML's `!!set`, `!!binary` and dates
    (a filter's never matched a record, and a set or bytes stopped the job on a traceback when the config was
    hashed)."""
    if isinstance(value, Mapping):
        return next((odd for k, v in value.items() if (odd := _not_json(v, f"{key}.{k}")) is not None), None)
    if isinstance(value, (list, tuple)):
        return next((odd for i, v in enumerate(value) if (odd := _not_json(v, f"{key}[{i}]")) is not None), None)
    return None if value is None or isinstance(value, (str, int, float)) else (key, value)


def json_kind(value: Any) -> str:
    """What a parsed JSON value that is no object is, in JSON's words (a record's reject, a run file's or a
    tokenizer file's error): Python's type names read `is a JSON NoneType` for `null`, `list` for an array."""
    if value is None or isinstance(value, bool):
        return f"JSON {orjson.dumps(value).decode()}"
    return "a JSON " + ("array" if isinstance(value, list) else "string" if isinstance(value, str) else "number")


class ConfigError(ValueError):
    """A bad config, argument or path. The CLI prints it as one line and exits 2."""

    def __init__(self, message: str) -> None:
        super().__init__(printable(message))


class MissingInput(ConfigError):
    """A dataset's input is not there (a scheme's check raises it): an `optional` dataset is skipped instead."""


def load_plugin(reg: registry.Registry, name: str, key: str = "") -> Any:
    """The loaded target of `reg`'s entry `name`, which the job uses (`key`: the config key that chose it): a
    "module:attr" one that fails to import is a config error naming the plug-in and its target, before anything is
    written. It was found where the job first called it: a source format's blamed the input file after the run dir
    was made, a writer's came after the whole ingest and tokenization, an engine's was a bare ModuleNotFoundError."""
    entry = reg.entry(name)
    try:
        return entry.load()
    except (Exception, SystemExit) as exc:  # an import runs the module: anything, sys.exit too (plugins.py)
        why = (str(exc).strip().splitlines() or [""])[0]
        raise ConfigError(f"config: {f'{key!r}: ' if key else ''}{reg.family} {name!r} ({entry.target}) cannot be "
                          f"loaded: {type(exc).__name__}{': ' + why if why else ''}") from None


@dataclass(frozen=True)
class Range:
    """Allowed interval of a number key; `lo_open` / `hi_open` exclude the end point."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def check(self, key: str, value: float | int | None) -> None:
        if value is None:
            return
        low_ok = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        high_ok = self.hi is None or (value < self.hi if self.hi_open else value <= self.hi)
        if not (low_ok and high_ok):
            raise ConfigError(f"config: '{key}' must be {self}, got {value!r}")

    def __str__(self) -> str:
        lo, hi = (f"{x:g}" if isinstance(x, float) else x for x in (self.lo, self.hi))
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {lo}"
        return f"in {'(' if self.lo_open else '['}{lo}, {hi}{')' if self.hi_open else ']'}"


# key -> (accepted types, default). A nested dict spec is a section. `None` in types = nullable.
NUM = (int, float)
DATASET_SPEC: dict[str, tuple] = {
    "name": ((str,), None),
    "path": ((str,), None),
    "storage_options": ((dict, None), None),  # fsspec options for s3:// gs:// ... (else the standard environment)
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
        "train": {"vocab_size": ((int,), 32000), "min_frequency": ((int,), 2),
                  "sample_mb": ((*NUM, None), None)},  # train on this much kept text, while ingest goes on
        "append_eod": ((bool,), True),
        "eod_token": ((str, None), None),
        "backend": ((str,), "auto"),        # auto | gigatoken | hf (streamprep/backends.py); never changes bytes
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
        "hf_retries": ((int,), 8),
        "hf_retry_max_s": (NUM, 60.0),
        "batch_records": ((int,), 512),
        "unit_mb": (NUM, 4.0),
        "dedup_holders": ((int, None), None),
        "progress_interval_s": (NUM, 10.0),
        "metrics_port": ((int, None), None),
    },
}
INT32_MAX = 2**31 - 1
# Every number key of SPEC / DATASET_SPEC has a range (tests/test_streamprep/test_config.py checks that none is missing).
BOUNDS: dict[str, Range] = {
    "run.seed": Range(0, 2**63 - 1),
    # 256 bytes + special tokens, up to 2^20: 4x the largest vocabularies in use (~256 k). The HF trainer reserves
    # ~70 B per entry up front: 2e9 (int32's range, the bound before) aborted the process (a 141 GB allocation)
    "tokenizer.train.vocab_size": Range(300, 1 << 20),
    "tokenizer.train.min_frequency": Range(0, INT32_MAX),
    "tokenizer.train.sample_mb": Range(0, 1 << 30, lo_open=True),
    "output.shard_records": Range(1),
    "output.parquet.shard_size_bytes": Range(1024, 1 << 40),
    "output.parquet.row_group_size": Range(1, INT32_MAX),
    "output.valid_fraction": Range(0, 1, hi_open=True),
    "output.num_shards_multiple_of": Range(1, 1_000_000),
    "output.max_rejects_per_check": Range(0),
    "execution.workers": Range(1, 4096),
    "execution.max_concurrent_downloads": Range(1, 1024),
    "execution.hf_prefetch_files": Range(1, 100_000),
    "execution.hf_cache_max_gb": Range(0, 1 << 30, lo_open=True),
    "execution.hf_retries": Range(0, 1000),
    "execution.hf_retry_max_s": Range(0, 86_400, lo_open=True),
    "execution.metrics_port": Range(0, 65_535),
    "execution.batch_records": Range(1, 1_000_000),
    "execution.unit_mb": Range(0, 1 << 20, lo_open=True),
    "execution.dedup_holders": Range(0, 4096),
    "execution.progress_interval_s": Range(0.1, 86_400),
}
DATASET_BOUNDS: dict[str, Range] = {
    # relative, yet bounded both ways: every share the exports write (w × shard tokens / dataset tokens in
    # blend.json, w / sum in mixtures.json) stays a normal double > 0 (5e-324 beside 1e15 was written as weight 0),
    # and any sum finite
    "weight": Range(1e-15, 1e15),
    "size_mb": Range(0, lo_open=True),
    "max_records": Range(1),
}
# Keys whose change alters outputs; a resume with any of them changed is refused (see drift_keys).
OUTPUT_SECTIONS = ("run.seed", "datasets", "quality", "tokenizer", "output", "sft")
# Keys read only when writing the exports (blend.json, mixtures.json, manifest.json, parquet/).
EXPORT_ONLY = ("run.seed", "datasets[].weight", "output.parquet.", "output.mixtures.", "output.valid_fraction",
               "output.num_shards_multiple_of")


# String keys whose whitespace is their value, so only "" is refused: a token's text (phi-2's "   " is id 50285);
# one not in the vocabulary is refused naming it (tokenizer.check_config)
AS_WRITTEN = ("tokenizer.eod_token",)


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
        hint = (" (YAML reads an unquoted yes/no/on/off as a boolean: quote it)"
                if isinstance(value, bool) and str in types else "")
        raise ConfigError(f"config: '{key}' must be {_type_name(types)}, got {type(value).__name__} {value!r:.60}{hint}")
    if float in types and not isinstance(value, (bool, str)) and not _finite(value):
        raise ConfigError(f"config: '{key}' must be a finite number, got {value!r:.40}")
    if isinstance(value, str) and not (value if key in AS_WRITTEN else value.strip()):
        raise ConfigError(f"config: '{key}' must be a non-empty string, got {value!r:.40}")


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer beyond the float range
        return False


def _is_name(value: str) -> bool:
    """NAME_RE, in composed form (NFC), combining marks allowed after a letter, digit or mark: `\\w` leaves out
    the vowel signs of Devanagari, Bengali, Tamil, Thai… (हिन्दी was refused, though the docs say letters
    (Unicode)). Not composed is no name: Hangul written decomposed is letters (jamo), and looked like its composed
    twin, a second dataset folder of the same name."""
    if len(value) > MAX_NAME_CHARS or not unicodedata.is_normalized("NFC", value):
        return False
    marked = [unicodedata.category(c) in MARKS for c in value]
    if any(m and not (value[i - 1].isalnum() or marked[i - 1]) for i, m in enumerate(marked) if i):
        return False  # `a.` + U+0301
    return bool(NAME_RE.match(value[:1] + "".join("_" if m else c for c, m in zip(value[1:], marked[1:]))))


def _safe_name(key: str, value: str) -> None:
    """Run and dataset names are used as file and directory names. One with a letter written decomposed (`e` +
    U+0301, as macOS writes file names) looks valid in the generic error, so it is named as such; it is not
    normalised: a changed name could alias another run's or dataset's folder."""
    if not _is_name(value):
        composed = unicodedata.normalize("NFC", value)
        if composed != value and _is_name(composed):
            raise ConfigError(f"config: '{key}' {value!r:.80} holds {_not_composed(value, composed)}; write it "
                              f"composed (NFC), {composed!r:.80}")
        raise ConfigError(f"config: '{key}' must be a name of 1-{MAX_NAME_CHARS} letters, digits, _ - . "
                          f"starting with a letter, digit or _, got {value!r:.80}")


def _not_composed(value: str, composed: str) -> str:
    """What composing `value` (NFC: `composed`) changes first, and why: the first mark of `value` was named
    whether or not NFC changes it (`क़ा`, U+0958 U+093E, named U+093E, where U+0958 is the letter NFC writes as
    U+0915 U+093C; Hebrew U+05E9 U+05C1 U+05B8, a letter written decomposed, where its marks are out of order).
    A character NFC writes otherwise (U+212B, U+0958), a mark before one NFC puts first, or else a letter written
    decomposed: the mark that NFC composes into it, or the letter itself (Hangul jamo)."""
    p = next((i for i, (a, b) in enumerate(zip(value, composed)) if a != b), min(len(value), len(composed)) - 1)
    c, first = value[p], composed[p]

    def named(ch: str) -> str:
        what = "the combining mark " if unicodedata.category(ch) in MARKS else ""
        return f"{what}U+{ord(ch):04X} ({unicodedata.name(ch, 'unnamed')})"

    if (nfc := unicodedata.normalize("NFC", c)) != c:
        return f"{named(c)}, which the composed form (NFC) writes as {' '.join(f'U+{ord(x):04X}' for x in nfc)}"
    if unicodedata.combining(c) and unicodedata.combining(first) and first in value[p + 1:]:
        return (f"{named(c)} before U+{ord(first):04X} ({unicodedata.name(first, 'unnamed')}), which the composed "
                f"form (NFC) puts first: combining marks in canonical order")
    odd = next((ch for ch in value[p + 1:] if unicodedata.category(ch) in MARKS
                and value.count(ch) > composed.count(ch)), c)
    return f"{named(odd)}: a letter written decomposed (NFD)"


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
    return registry.scheme_of(path) != ""


def _is_file_url(path: str) -> bool:
    return path[:5].lower() == "file:"


def _resolve_path(path: str, base: Path, key: str) -> str:
    """A local path made absolute (against the config's folder); a URL of a registered scheme as it is. A `file:`
    URL is a local path, in each form RFC 8089 gives it and its scheme in any case (`file:///data/x.jsonl`,
    `file:/data/x.jsonl`, `file://localhost/data/x.jsonl`, `FILE:///…` are `/data/x.jsonl`): each was taken for a
    relative path (`CONFIG_DIR/file:/data/…`). Its percent-escapes are decoded as UTF-8 (`Path.as_uri()`'s `a%20b`
    is `a b`): they were kept, so the URL of a name with a space named no file."""
    if _is_remote(path):
        return path
    if _is_file_url(path):
        rest = path[5:]
        if rest.startswith("//"):
            host, slash, rest = rest[2:].partition("/")
            if host.lower() not in ("", "localhost"):
                raise ConfigError(f"config: '{key}': {path!r:.80} names a host; a local file's URL is file:///PATH "
                                  f"(or give the path itself)")
            rest = slash + rest
        if not rest.startswith("/"):
            raise ConfigError(f"config: '{key}': {path!r:.80} is not a file URL of an absolute path; a local file's "
                              f"URL is file:///PATH (or give the path itself)")
        try:
            path = unquote(rest, errors="strict")
        except UnicodeDecodeError:
            raise ConfigError(f"config: '{key}': {path!r:.80} has percent-escapes that are not UTF-8") from None
    try:
        p = Path(path).expanduser()  # RuntimeError: `~nosuchuser/…`
        resolved = (base / p).resolve()  # an absolute path too: a symlink loop there was a bare RuntimeError later
    except (OSError, RuntimeError, ValueError) as exc:  # RuntimeError: a symlink loop (Python 3.11); ValueError: NUL
        raise ConfigError(f"config: '{key}': {exc}") from None
    out = str(p if p.is_absolute() else resolved)
    # a glob's trailing '/' matches folders alone, as on an object store: Path dropped it, so `d/*/` read d's files
    # and made its folders rejects, where `s3://b/d/*/` is 'no object matches' (a name that exists is as before)
    return out + "/" if path.endswith("/") and globmod.has_magic(out) and not os.path.lexists(out) else out


# Dataset keys that only the schemes declaring them (meta `reads`) read; given to another, each would do nothing.
SCHEME_KEYS = {"split": " (a local dataset's blend.json split comes from the per-split form, "
                        "datasets: {train: [...], valid: [...]}; `split` may only name it, here %r)",
               "subset": "", "revision": "", "filter": " (its files are read whole: filter them first, or drop the key)"}


def _scheme_keys(key: str, ds: dict[str, Any], scheme: registry.Entry, blend_split: str) -> None:
    """Refuse a SCHEME_KEYS key the dataset's scheme does not read. `split` naming the split the dataset is in
    (`blend_split`) says what is so, as the contract's own example does (`split: train` on a local dataset)."""
    for k, hint in SCHEME_KEYS.items():
        if k == "split" and ds[k] == blend_split:
            continue
        if ds[k] is not None and k not in scheme.meta.get("reads", ()):
            readers = [e.name for e in registry.SCHEMES.entries() if k in e.meta.get("reads", ())]
            raise ConfigError(f"config: '{key}.{k}' applies to {' / '.join(readers) or 'no'} datasets only, "
                              f"not to {ds['path']!r:.80}{hint.replace('%r', repr(blend_split))}")


def _storage_options(key: str, ds: dict[str, Any]) -> None:
    opts = ds["storage_options"]
    if opts is None:
        return
    scheme = registry.scheme_of(ds["path"])
    if "://" not in ds["path"] or (scheme and not registry.SCHEMES.entry(scheme).meta.get("fsspec")):
        raise ConfigError(f"config: '{key}.storage_options' applies to fsspec URLs (s3://, gs://, ...), "
                          f"not to {ds['path']!r:.80}")
    if not all(isinstance(k, str) and k for k in opts):
        raise ConfigError(f"config: '{key}.storage_options' must map option names to values")


def public(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """`cfg` as run.json records it: credentials in a dataset's storage_options replaced by "<redacted>"."""
    def hide(value: Any, key: str = "") -> Any:
        if isinstance(value, Mapping):
            return {k: hide(v, k) for k, v in value.items()}
        return "<redacted>" if SECRET_KEY_RE.search(key) and value is not None else value

    out = dict(cfg)
    out["datasets"] = [{**d, "storage_options": hide(d["storage_options"])} if d.get("storage_options") else d
                       for d in cfg["datasets"]]
    return out


def _datasets(raw: Any, base: Path, skipped: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """The entries, validated; an optional one whose input is missing goes to `skipped` (name, why) instead."""
    if raw is None:
        raise ConfigError("config: 'datasets' is required (a list, or a mapping with train/valid/test lists)")
    if isinstance(raw, Mapping):
        for key in raw:
            if key not in SPLITS:
                raise ConfigError(f"config: unknown key 'datasets.{key}' (per-split form takes train, valid, test)")
        for split in SPLITS:  # `train: 5` was a TypeError, exit 1; a mapping was read as its keys ("[0] ... got str")
            if raw.get(split) is not None and not isinstance(raw[split], list):
                raise ConfigError(f"config: 'datasets.{split}' must be a list of dataset entries or null, got "
                                  f"{type(raw[split]).__name__} {raw[split]!r:.60}")
        entries = [(split, i, e) for split in SPLITS for i, e in enumerate(raw.get(split) or [])]
        where = lambda split, i: f"datasets.{split}[{i}]"  # noqa: E731
    elif isinstance(raw, list):
        entries = [("train", i, e) for i, e in enumerate(raw)]
        where = lambda split, i: f"datasets[{i}]"  # noqa: E731
    else:
        raise ConfigError(f"config: 'datasets' must be a list or a train/valid/test mapping, got {type(raw).__name__}")
    if not entries:
        raise ConfigError("config: 'datasets' is empty")
    out, names = [], set()
    for split, i, entry in entries:
        key = where(split, i)
        ds = _fill(DATASET_SPEC, entry, key)
        for required in ("name", "path"):
            if ds[required] is None:
                raise ConfigError(f"config: '{key}.{required}' is required")
        _safe_name(f"{key}.name", ds["name"])
        if ds["name"].casefold() in names:  # case-insensitive: the names become file names
            raise ConfigError(f"config: '{key}.name': duplicate dataset name {ds['name']!r}")
        if ds["name"].casefold() in RESERVED_NAMES or ds["name"].casefold().endswith(".plan"):
            raise ConfigError(f"config: '{key}.name': {ds['name']!r} would share a file name with the checkpoints' "
                              f"own ({', '.join(RESERVED_NAMES)}, and <name>.plan); choose another name")
        names.add(ds["name"].casefold())
        for k, rng in DATASET_BOUNDS.items():
            rng.check(f"{key}.{k}", ds[k])
        if ds["filter"] is not None and not all(isinstance(k, str) and k for k in ds["filter"]):
            raise ConfigError(f"config: '{key}.filter' must map field names to values, got {ds['filter']!r:.80}")
        if ds["filter"] is not None and (odd := _not_json(ds["filter"], f"{key}.filter")) is not None:
            raise ConfigError(f"config: '{odd[0]}' must be what a JSON record holds (text, a number, true/false, "
                              f"null, a list or a mapping), got {type(odd[1]).__name__} {odd[1]!s:.60} (quote it)")
        scheme = registry.SCHEMES.entry(registry.scheme_of(ds["path"]))
        _scheme_keys(key, ds, scheme, split)
        formats = scheme.meta.get("formats") or registry.SOURCE_FORMATS.names()
        if ds["format"] not in (None, *formats):
            raise ConfigError(f"config: '{key}.format' must be {', '.join(formats[:-1])} or {formats[-1]}, "
                              f"got {ds['format']!r}")
        for needed in scheme.meta.get("requires", ()):
            if not ds[needed]:
                raise ConfigError(f"config: '{key}.{needed}' is required for {scheme.name} sources")
        ds["path"] = _resolve_path(ds["path"], base, f"{key}.path")
        _storage_options(key, ds)  # on the path resolved: `file:///x` is the local path /x, where they do nothing
        try:
            if "check" in scheme.meta:
                scheme.load(scheme.meta["check"])(key, ds)
        except MissingInput as exc:
            if not ds["optional"]:
                raise
            skipped.append((ds["name"], str(exc).removeprefix("config: ")))
            continue
        ds["blend_split"] = split
        out.append(ds)
    if not out:
        raise ConfigError(f"config: 'datasets': no optional dataset has input files "
                          f"({', '.join(name for name, _ in skipped)})")
    return out


def validate(raw: Any, base_dir: str | Path = ".", skipped: list[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Return the full config with defaults filled and paths absolute, or raise ConfigError. Sections, names
    and checks that belong to a plug-in family come from the registries (streamprep/registry.py). The optional
    datasets left out for want of input are appended to `skipped` (name, why): the job logs them."""
    if registry.PLUGIN_IMPORT_ERRORS:
        raise ConfigError(f"config: {registry.PLUGIN_IMPORT_ERRORS[0]}")
    if changed := registry.plugins_changed_since_import():
        raise ConfigError(f"config: {changed}")
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config: top level must be a mapping, got {type(raw).__name__}")
    base = Path(base_dir).resolve()
    known = set(SPEC) | {"datasets"} | set(registry.SECTIONS.names())
    for key in raw:
        if key not in known:
            raise ConfigError(f"config: unknown key '{key}'")
    cfg: dict[str, Any] = {k: _fill(v, raw.get(k), k) for k, v in SPEC.items()}
    skipped = [] if skipped is None else skipped
    cfg["datasets"] = _datasets(raw.get("datasets"), base, skipped)
    for sec in registry.SECTIONS.entries():
        if sec.meta.get("required") or sec.name in raw:  # a key left empty is the section's to refuse (`sft:`)
            cfg[sec.name] = _section_of(sec, raw.get(sec.name))
    _safe_name("run.name", cfg["run"]["name"])
    _int64(cfg, "")
    for key, rng in BOUNDS.items():
        section, *path = key.split(".")
        value = cfg[section]
        for part in path:
            value = value[part]
        rng.check(key, value)
    ex = cfg["execution"]
    if ex["engine"] not in registry.ENGINES:
        raise ConfigError(f"config: 'execution.engine' must be {registry.ENGINES.choices()}, got {ex['engine']!r:.40}")
    if cfg["run"]["checkpoint_dir"] is not None:
        if _is_remote(cfg["run"]["checkpoint_dir"]):  # Path() would make `s3://b/ck` a local folder `s3:/b/ck`
            raise ConfigError(f"config: 'run.checkpoint_dir' must be a local (or mounted) folder, got "
                              f"{cfg['run']['checkpoint_dir']!r:.80}: checkpoints are renamed into place atomically")
        cfg["run"]["checkpoint_dir"] = _resolve_path(cfg["run"]["checkpoint_dir"], base, "run.checkpoint_dir")
        check_utf8_name("config: 'run.checkpoint_dir'", cfg["run"]["checkpoint_dir"], "run.json names it")
    if cfg["output"]["valid_fraction"] > 0 and any(d["blend_split"] != "train" for d in cfg["datasets"]):
        raise ConfigError("config: 'output.valid_fraction' splits the training data of a list of datasets; the per-split "
                          "form names its valid/test datasets itself, and blend.json would ignore it (drop one)")
    if cfg["output"]["dtype"] not in ("auto", "uint16", "int32"):
        raise ConfigError(f"config: 'output.dtype' must be auto, uint16 or int32, got {cfg['output']['dtype']!r}")
    names = [name for name, _ in skipped]
    for writer in registry.WRITERS.names():  # every job runs them all
        load_plugin(registry.WRITERS, writer)
    _checks(cfg, "output", names)  # the writers' options, which the exports would otherwise refuse after tokenization
    _tokenizer(cfg["tokenizer"], base)
    _checks(cfg, "tokenizer", names)  # last: it loads the tokenizer, so a bad one or EOD token fails before any work
    _checks(cfg, "", names)
    return cfg


INT64_MAX = 2**63 - 1


def _int64(value: Any, key: str) -> None:
    """Every integer of the config fits 64 bits: run.json, the config hash and the workers' arrays store them so, and
    a larger one (`max_records: 1e30` written out) would fail there, after the run dir exists."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            _int64(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _int64(v, f"{key}[{i}]")
    elif isinstance(value, int) and not isinstance(value, bool) and not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ConfigError(f"config: '{key}': must fit a 64-bit integer (at most {INT64_MAX}), got a "
                          f"{len(str(abs(value)))}-digit integer")


def _section_of(sec: registry.Entry, given: Any) -> dict[str, Any]:
    """A family's own section, validated by the family; its error (a ValueError with `.key`) as one line."""
    try:
        return sec.load()(given)
    except ValueError as exc:
        key = getattr(exc, "key", None)
        if key is None:
            raise
        reason = str(exc).removeprefix(f"{key}: ")
        named = key if key == sec.name else f"{sec.meta.get('key_prefix', '')}{key}"  # the section as a whole
        raise ConfigError(f"config: '{named}': {reason}") from None


def _checks(cfg: dict[str, Any], prefix: str, skipped: list[str]) -> None:
    """The registered checks named `prefix` or `prefix.…` ("": those not run yet), in registration order; one
    registered with `skipped=True` is also handed the names of the optional datasets left out (not in `cfg`)."""
    done = ("output", "tokenizer")
    for check in registry.CHECKS.entries():
        top = check.name.split(".")[0]
        if (top == prefix) if prefix else top not in done:
            if check.meta.get("skipped"):
                check.load()(cfg, skipped=skipped)
            else:
                check.load()(cfg)


def _tokenizer(tok: dict[str, Any], base: Path) -> None:
    """`tokenizer:` choices, and `tokenizer.path` resolved (None: to be trained)."""
    if tok["if_missing"] not in ("error", "train"):
        raise ConfigError(f"config: 'tokenizer.if_missing' must be error or train, got {tok['if_missing']!r}")
    if tok["backend"] not in registry.TOKENIZER_BACKENDS:
        raise ConfigError(f"config: 'tokenizer.backend' must be {registry.TOKENIZER_BACKENDS.choices()}, "
                          f"got {tok['backend']!r:.40}")
    if tok["path"] is not None:
        if URL_RE.match(tok["path"]) and not _is_file_url(tok["path"]):  # Path() would make `s3://b/t.json` `s3:/b/t.json`
            raise ConfigError(f"config: 'tokenizer.path' must be a local (or mounted) tokenizer.json or folder holding "
                              f"one, got {tok['path']!r:.80}: download it first")
        tok["path"] = _resolve_path(tok["path"], base, "tokenizer.path")
        if tok["if_missing"] == "train" and not Path(tok["path"]).exists():
            tok["path"] = None


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts nodes as they would be after alias expansion, and nesting depth.

    Aliases stay allowed (handy for shared sections), but each one counts the full size of the node it
    repeats, so an alias bomb stops after MAX_CONFIG_NODES nodes instead of exhausting memory later
    (validation, run.json). An alias to a node still being built (a recursive structure) is refused.
    """

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._nodes, self._depth = 0, 0
        self._sizes: dict[int, int] = {}  # id(node) -> expanded node count, once the node is complete
        self.text_numbers: set[str] = set()  # plain scalars read as text that YAML 1.2 reads as numbers (`1e-3`)

    def _count(self, n: int) -> None:
        self._nodes += n
        if self._nodes > MAX_CONFIG_NODES:
            raise ConfigError(f"more than {MAX_CONFIG_NODES} YAML nodes (aliases expanded)")

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            target = self.anchors.get(self.peek_event().anchor)
            if target is not None:  # an undefined alias is left to PyYAML's own error
                if id(target) not in self._sizes:
                    raise ConfigError("recursive YAML alias (a node that contains itself)")
                self._count(self._sizes[id(target)])
            return super().compose_node(parent, index)
        self._depth += 1
        if self._depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"YAML nested deeper than {MAX_CONFIG_DEPTH} levels")
        before = self._nodes
        self._count(1)
        node = super().compose_node(parent, index)
        if isinstance(node, yaml.MappingNode):
            self._plain_keys(node)  # first: `on:` beside `"on":` is a key given twice
            self._keys_once(node)
        elif isinstance(node, yaml.ScalarNode) and node.style is None and node.tag == "tag:yaml.org,2002:str" \
                and TEXT_NUMBER_RE.match(node.value):
            self.text_numbers.add(node.value)
        self._sizes[id(node)] = self._nodes - before
        self._depth -= 1
        return node

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """A value PyYAML resolves but cannot build (`seed: 2020-13-45` is read as a date; `!!int abc`) as one line
        naming its line, not the constructor's bare ValueError."""
        try:
            return super().construct_object(node, deep)
        except ConfigError:
            raise
        except (ValueError, TypeError, AttributeError, OverflowError) as exc:
            why = f" ({exc})" if isinstance(exc, (ValueError, OverflowError)) else ""  # else PyYAML's own slip
            raise ConfigError(f"line {node.start_mark.line + 1}: {node.value!r:.60} is not a valid YAML "
                              f"{node.tag.rsplit(':', 1)[-1]}{why}; quote it if it is a string") from None

    @staticmethod
    def _plain_keys(node: yaml.MappingNode) -> None:
        """An unquoted key YAML 1.1 reads as another type (`on:` a boolean, `2024:` an int, `null:` None,
        `2001-01-01:` a date; a dataset named so in a mixture's phase) is its text: every key of a config is a name,
        and True made `unknown dataset True (known: on)`. A `<<` merge key stays one."""
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.style is None \
                    and key_node.tag != "tag:yaml.org,2002:merge":
                key_node.tag = "tag:yaml.org,2002:str"

    @staticmethod
    def _keys_once(node: yaml.MappingNode) -> None:
        """Refuse a key written twice in one mapping: YAML's last-one-wins would drop the first silently (two
        `datasets:` lists, say). Checked on the mapping as written, before a `<<` merge adds keys to it (those
        may be overridden, as YAML means them to be)."""
        seen: dict[tuple[str, str], int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key, line = (key_node.tag, key_node.value), key_node.start_mark.line + 1
                if key in seen:
                    raise ConfigError(f"line {line}: key {key_node.value!r} given twice in one mapping (first on "
                                      f"line {seen[key]}); the later one would silently replace it")
                seen[key] = line


def check_utf8_name(where: str, path: str | Path, why: str) -> None:
    """Refuse a path whose name is not UTF-8 (bytes the file system gave, held as lone surrogates): the run's JSON
    files cannot hold it, so the run failed with a bare TypeError once it had started writing."""
    try:
        str(path).encode()
    except UnicodeEncodeError:
        raise ConfigError(f"{where}: {path} has a name that is not UTF-8; rename it ({why})") from None


def user_path(path: str | Path, prefix: str = "") -> Path:
    """`path` with a leading `~` expanded, as the config's paths are: no shell expands `--config=~/c.yaml`'s, and a
    quoted `"~/runs/x"` named a folder `~`."""
    try:
        return Path(path).expanduser()
    except RuntimeError as exc:  # `~nosuchuser/…`
        raise ConfigError(f"{prefix}{path}: {exc}") from None


def load_file(path: str | Path) -> "Config":
    """Read and validate a YAML config file into a typed Config; paths in it are relative to the file.

    Bounded: at most MAX_CONFIG_BYTES, MAX_CONFIG_NODES nodes after alias expansion, MAX_CONFIG_DEPTH levels.
    """
    p = user_path(path, "config: ")
    if p.is_dir():
        raise ConfigError(f"config: {p} is a directory")
    if not p.is_file():
        raise ConfigError(f"config: {p} is not a regular file (a FIFO, socket or device)" if p.exists()
                          else f"config: no such file: {p}")
    try:
        with open(p, "rb") as fh:
            data = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"config: {p}: cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config: {p}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        loader = _BoundedLoader(data.decode("utf-8"))
        try:
            raw = loader.get_single_data()
        finally:
            loader.dispose()
        text_numbers = loader.text_numbers
    except ConfigError as exc:
        raise ConfigError(f"config: {p}: {exc}") from None
    except yaml.MarkedYAMLError as exc:  # its problem and where: the first line was only the context ("while
        where = f" (line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1})" if exc.problem_mark else ""
        raise ConfigError(f"config: {p}: not valid YAML: {exc.problem or exc.context}{where}") from None  # scanning")
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"config: {p}: not valid YAML: {first}") from None
    if raw is None:  # it said "top level must be a mapping, got NoneType", naming no file
        raise ConfigError(f"config: {p}: empty (no YAML mapping in it)")
    if not isinstance(raw, Mapping):  # `load` says so too, naming no file
        raise ConfigError(f"config: {p}: top level must be a mapping, got {type(raw).__name__}")
    try:
        return load(raw, p.parent)
    except ConfigError as exc:
        text = next((t for t in sorted(text_numbers) if re.search(f"got (str )?'{re.escape(t)}'$", str(exc))), None)
        if text is None or (hint := _as_yaml_number(text, str(exc))) is None:
            raise
        raise ConfigError(f"{exc} ({hint})") from None


def _as_yaml_number(text: str, error: str) -> str | None:
    """Why `text` (`1e-3`) is no number in the config, and how to write it: PyYAML reads YAML 1.1, whose numbers with
    an exponent need a decimal point and a signed exponent, so `must be a number, got str '1e-3'` read as nonsense.
    For an integer key only the integer (a float such as 1.0e+6 is refused there too); none for a key that wants
    no number (`error` says what it wants), or an integer key given a fraction or past 20 digits (none takes one)."""
    if "must be an integer" in error:
        try:
            exact = Decimal(text)
            if exact != exact.to_integral_value() or exact.adjusted() >= 20:
                return None
        except InvalidOperation:  # an exponent past Decimal's own bounds (1e99999999999999999999)
            return None
        return f"YAML 1.1, as the config is read, takes {text} for text: write {int(exact)}"
    if "must be a number" not in error:
        return None
    mantissa, _, exponent = text.lower().partition("e")
    mantissa += "" if "." in mantissa else ".0"
    spelled = f"{mantissa}e{exponent if exponent[0] in '+-' else '+' + exponent}"
    value = float(text)
    plain = str(int(value)) if value.is_integer() and abs(value) < 1e16 else repr(value)
    plainly = f"{plain}, or " if _finite(value) and "e" not in plain else ""
    return f"YAML 1.1, as the config is read, takes {text} for text: write {plainly}{spelled}, with a decimal point " \
           f"and a signed exponent"


def output_view(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The part of the config that determines the outputs (execution settings excluded). `tokenizer.backend`
    is left out: every backend gives the same ids (streamprep/backends.py), so changing it is no drift."""
    view = {"run.seed": cfg["run"]["seed"], **{k: cfg.get(k) for k in OUTPUT_SECTIONS if k != "run.seed"}}
    if isinstance(view["datasets"], list):  # where the bytes come from (endpoint, credentials) is no output
        view["datasets"] = [{k: v for k, v in d.items() if k != "storage_options"} if isinstance(d, Mapping) else d
                            for d in view["datasets"]]
    if isinstance(view.get("tokenizer"), Mapping):
        view["tokenizer"] = {k: v for k, v in view["tokenizer"].items() if k != "backend"}
    return view


def config_hash(cfg: Mapping[str, Any]) -> str:
    return hashlib.sha256(orjson.dumps(output_view(cfg), option=orjson.OPT_SORT_KEYS)).hexdigest()[:16]


def drift_keys(old: Mapping[str, Any], new: Mapping[str, Any], exports_redone: bool = False) -> list[str]:
    """Dotted keys whose values differ between two output views (what a resume would silently change).

    `exports_redone`: the old run did not complete, so its exports will be rewritten in full on resume
    and keys read by the exports only (EXPORT_ONLY) may change, e.g. to fix a value that failed there.
    """
    diffs: list[str] = []
    same_as = {"output.shard_records": SPEC["output"]["shard_records"][1]}  # null means this, in every output

    def walk(a: Any, b: Any, key: str) -> None:
        if key in same_as:
            a, b = (same_as[key] if v is None else v for v in (a, b))
        if isinstance(a, Mapping) and isinstance(b, Mapping):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{key}.{k}" if key else k)
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b) and all(isinstance(x, Mapping) for x in a + b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{key}[{i}]")
        elif a != b:
            diffs.append(key)

    walk(output_view(old), output_view(new), "")
    if exports_redone:
        export_only = tuple(k for k in EXPORT_ONLY if k != "datasets[].weight" or not _samples_by_weight(new))
        diffs = [k for k in diffs if not re.sub(r"\[\d+\]", "[]", k).startswith(export_only)]
    return diffs


def _samples_by_weight(cfg: Mapping[str, Any]) -> bool:
    """The run trains its tokenizer on a sample (`tokenizer.train.sample_mb`), which the dataset weights share out
    (`tokenizer.sample_shares`): a weight changed at a resume kept the tokenizer trained on the old shares while
    run.json recorded the new, a config whose own run trains another tokenizer."""
    tok = cfg.get("tokenizer")
    if not isinstance(tok, Mapping) or tok.get("path") is not None:
        return False
    return (tok.get("train") or {}).get("sample_mb") is not None


# ---- typed, frozen view of a validated config --------------------------------------------------------------
# Field order follows SPEC (to_dict() must reproduce the validated dict key for key, so run.json and
# config_hash stay byte-identical). Defaults are NOT repeated here: they live in SPEC / DATASET_SPEC only.


def _freeze(value: Any) -> Any:
    """Mappings -> read-only MappingProxyType, lists -> tuples (free-form values: dataset filters, mixture phases)."""
    if isinstance(value, Mapping):
        return MappingProxyType({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def thaw(value: Any) -> Any:
    """Inverse of _freeze (and of dataclass nesting): plain dicts and lists, as JSON will see them."""
    if is_dataclass(value):
        return {f.name: thaw(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {k: thaw(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(v) for v in value]
    return value


class FrozenSection:
    """Mixin for the typed config sections (here and in `streamprep.sft.config`): built from the validated dict
    and back, and pickled as that dict (MappingProxyType cannot be pickled)."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Any:
        hints = get_type_hints(cls)
        kw = {}
        for f in fields(cls):  # type: ignore[arg-type]
            hint, value = hints[f.name], d.get(f.name)
            nested = isinstance(hint, type) and issubclass(hint, FrozenSection)
            kw[f.name] = hint.from_dict(value) if nested else _freeze(value)
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        return thaw(self)

    def __reduce__(self) -> tuple[Any, tuple[dict[str, Any]]]:
        return type(self).from_dict, (self.to_dict(),)


@dataclass(frozen=True)
class RunConfig(FrozenSection):
    name: str
    seed: int
    checkpoint_dir: str | None


@dataclass(frozen=True)
class TokenizerTrainConfig(FrozenSection):
    vocab_size: int
    min_frequency: int
    sample_mb: float | None


@dataclass(frozen=True)
class TokenizerConfig(FrozenSection):
    path: str | None
    if_missing: str
    train: TokenizerTrainConfig
    append_eod: bool
    eod_token: str | None
    backend: str


@dataclass(frozen=True)
class ParquetConfig(FrozenSection):
    length_buckets: tuple[int, ...]
    shard_size_bytes: int
    compression: str
    row_group_size: int


@dataclass(frozen=True)
class MixturesConfig(FrozenSection):
    phases: Mapping[str, Mapping[str, float]]


@dataclass(frozen=True)
class OutputConfig(FrozenSection):
    dtype: str
    shard_records: int | None
    parquet: ParquetConfig
    mixtures: MixturesConfig
    valid_fraction: float
    num_shards_multiple_of: int
    max_rejects_per_check: int | None

    @property
    def part_lines(self) -> int:
        """Kept lines a sealed part holds (every part of a dataset but its last): `shard_records`, null meaning
        the default. Ingest seals by it; the exports' keyed order counts ordinals by it."""
        return self.shard_records or SPEC["output"]["shard_records"][1]


def resolved_workers(workers: int | None) -> int:
    """`execution.workers` as a job runs it: unset = one per CPU."""
    return workers or os.cpu_count() or 1


@dataclass(frozen=True)
class ExecutionConfig(FrozenSection):
    engine: str
    workers: int | None
    ray_address: str | None
    max_concurrent_downloads: int
    hf_prefetch_files: int
    hf_cache_max_gb: float
    hf_keep_cache: bool
    hf_retries: int
    hf_retry_max_s: float
    batch_records: int
    unit_mb: float
    dedup_holders: int | None
    progress_interval_s: float
    metrics_port: int | None


@dataclass(frozen=True)
class DatasetConfig(FrozenSection):
    name: str
    path: str
    storage_options: Mapping[str, Any] | None
    format: str | None
    optional: bool
    split: str | None
    subset: str | None
    revision: str | None
    text_field: str
    weight: float
    filter: Mapping[str, Any] | None
    size_mb: float | None
    max_records: int | None
    blend_split: str


@dataclass(frozen=True)
class Config:
    """The whole validated config, read-only; each component should be handed only its own section."""

    run: RunConfig
    tokenizer: TokenizerConfig
    output: OutputConfig
    execution: ExecutionConfig
    datasets: tuple[DatasetConfig, ...]
    # The families' own sections (registry.SECTIONS), typed by their owners: quality.settings.QualitySettings,
    # streamprep.sft.config.SftConfig. Typed Any here: config imports none of them.
    quality: Any
    sft: Any = None
    # optional datasets left out for want of input (name, why), for the job's log; not part of the config's dict
    skipped: tuple[tuple[str, str], ...] = ()

    @classmethod
    def from_dict(cls, cfg: Mapping[str, Any]) -> "Config":
        """From the dict `validate` returns (no re-validation: that happened once, in `validate`)."""
        loaded = {s.name: s.load(s.meta["load"])(cfg[s.name]) for s in registry.SECTIONS.entries() if s.name in cfg}
        return cls(run=RunConfig.from_dict(cfg["run"]), tokenizer=TokenizerConfig.from_dict(cfg["tokenizer"]),
                   output=OutputConfig.from_dict(cfg["output"]), execution=ExecutionConfig.from_dict(cfg["execution"]),
                   datasets=tuple(DatasetConfig.from_dict(d) for d in cfg["datasets"]), **loaded)

    def to_dict(self) -> dict[str, Any]:
        """The plain dict `validate` returned, key order included (run.json, config_hash, drift checks)."""
        out = {k: thaw(getattr(self, k)) for k in ("run", "tokenizer", "output", "execution", "datasets", "quality")}
        if self.sft is not None:
            out["sft"] = thaw(self.sft)
        return out


def plain(value: Any) -> Any:
    """A config built in Python as its YAML would be: paths (`os.PathLike`) as strings, tuples as lists, numpy's
    scalars as Python's and its arrays as lists, then checked as any value is (a `Path` for `datasets[].path`,
    `np.int64(5000)` for `shard_records`, `np.array([128, 256])` for `length_buckets`)."""
    return _plain(value, "", frozenset())


def _plain(value: Any, key: str, within: frozenset[int]) -> Any:
    """`plain` of the value at `key`, inside the mappings and lists whose ids are `within`: one that holds itself,
    which no YAML gives, is a ConfigError naming the key (it recursed to a RecursionError)."""
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        value = value.tolist()  # an array's .item() raised a ValueError, or took [1.0] for 1.0
    if isinstance(value, (Mapping, list, tuple)):
        if id(value) in within:
            raise ConfigError(f"config: '{key}' is a mapping or list that holds it: a config cannot contain itself")
        within |= {id(value)}
        if isinstance(value, Mapping):
            return {k: _plain(v, f"{key}.{k}" if key else str(k), within) for k, v in value.items()}
        return [_plain(v, f"{key}[{i}]", within) for i, v in enumerate(value)]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def load(raw: Any, base_dir: str | Path = ".") -> Config:
    """Validate `raw` (a YAML document's structure, or the same built in Python: `plain`) once and return it as
    frozen, typed sections."""
    skipped: list[tuple[str, str]] = []
    try:
        return replace(Config.from_dict(validate(plain(raw), base_dir, skipped)), skipped=tuple(skipped))
    except PermissionError as exc:  # a path the config names, behind a folder we may not read (a stat raises)
        raise ConfigError(f"config: cannot read {exc.filename or 'a path it names'}: {exc.strerror or exc}") from None


def section(name: str, given: Mapping[str, Any] | None = None) -> Any:
    """One top-level section (run, tokenizer, output, execution) from its YAML mapping with SPEC's defaults,
    typed and type-checked, without the rest of a config (API use: e.g. `write_exports` on its own)."""
    return _SECTIONS[name].from_dict(_fill(SPEC[name], given, name))


def dataset(entry: Mapping[str, Any], blend_split: str = "train") -> DatasetConfig:
    """One dataset entry with DATASET_SPEC's defaults, typed (API use: a source opened on its own; the path is
    taken as given, not resolved or checked)."""
    return DatasetConfig.from_dict({**_fill(DATASET_SPEC, entry, "dataset"), "blend_split": blend_split})


_SECTIONS = {"run": RunConfig, "tokenizer": TokenizerConfig, "output": OutputConfig, "execution": ExecutionConfig}
