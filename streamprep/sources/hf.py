"""`hf://org/name` dataset repos: resolved to a commit once, then read file by file, each file a unit of work.

1. **Resolve** (network, once): `HfApi.dataset_info(revision=...)` turns the requested branch/tag/sha into a
   commit sha and lists the repo's files. The data files of `subset`/`split` are chosen the way `datasets` does it:
   the `configs:` YAML of the repo's README.md when present, else `datasets`' default data-file patterns
   (`data/{split}-00000-of-00001.*`, `train*`/`*-train-*`, `train/**`, ...), then the builder is inferred from the
   file extensions (or given by the entry's `format`): the most common one, Parquet winning a tie, and as in
   `datasets` the files of the other formats are left out, here with a warning naming them. The selection is
   written to a manifest in the cache.
2. **Plan** (ingest): one unit per data file, in repo-path order (`HFSource.units`); the plan pins the commit.
3. **Download and read, in the workers**: a QC worker given a unit downloads its file with `hf_hub_download`,
   pinned to the commit sha, into `cache_dir` (the standard HF cache layout; a cached file costs no request), at
   most `max_concurrent_downloads` at a time per process, and streams it through
   `datasets.load_dataset(<builder>, data_files=[file], streaming=True)` with the entry's `filter`
   (`FileReader`). The driver keeps the bounded download window by handing units out (`DownloadWindow`): at most
   `prefetch_files` + 1 files and `cache_max_gb` of files no saved checkpoint has passed; a file is deleted from
   the cache once a checkpoint passes its unit, unless `keep_cache`.

`iter_records` streams the same files in order in one process (each downloaded when the stream reaches it).
Positions are `{"revision": sha, "file": i, "record": r, "consumed": n, "state": IterableDataset.state_dict()}`:
`r` records of file `i` (after the filter) and `n` items overall were yielded. Resuming pins the commit in the
position, restores file `i`'s stream with `load_state_dict` (or, without a usable state, re-reads it and skips
`r` records) and goes on with the next record. When the Hub is unreachable, answers 429/5xx after the retries,
or `HF_HUB_OFFLINE=1`, a revision resolved before is served from the cache manifest, so a resumed or repeated run
needs no network for the files still cached (files a checkpoint has passed are deleted unless `keep_cache`).

`datasets`' JSON reader parses a file in chunks of 10 MB (of decompressed text) with pyarrow and fails the rest of
the file at the chunk with a malformed line, or with the damage of a compressed file (`ArrowInvalid`, `EOFError`,
...): that becomes a single `BadRecord` naming the file and the records read before it (a compressed file damaged
in its first chunk fails at `load_dataset`, which reads that chunk to infer the features: the whole file), and the
stream goes on with the next file. `stream_local_with_datasets` runs the same streaming core over local files.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib
import io
import logging
import os
import posixpath
import random
import re
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence
from urllib.parse import quote

from streamprep import atomic, logs
from streamprep.config import ConfigError, DatasetConfig, thaw
from streamprep.sources.base import BadRecord, SourceError, Unit

log = logs.get("sources.hf")

SHA_RE = re.compile(r"^[0-9a-f]{40}\Z")
# the entry's `format` (the same names local sources use) -> datasets builder
FORMAT_TO_BUILDER = {"jsonl": "json", "json": "json", "parquet": "parquet", "txt": "text", "text": "text",
                     "csv": "csv", "arrow": "arrow"}
MANIFEST_VERSION = 1
NOT_READ_NAMED = 20  # data files of a split left out for their format, named in its warning (all are counted)

# `execution.max_concurrent_downloads` is a run-level limit: sources downloading at the same time share it
_SLOTS: dict[int, threading.BoundedSemaphore] = {}
_SLOTS_LOCK = threading.Lock()


def _download_slots(limit: int) -> threading.BoundedSemaphore:
    with _SLOTS_LOCK:
        return _SLOTS.setdefault(limit, threading.BoundedSemaphore(limit))


class HFSourceError(ConfigError):
    """A wrong `hf://` entry: unknown repo, revision, subset or split, or no data files. The CLI exits 2."""


class HFSourceUnavailable(SourceError, OSError):
    """The Hub could not be reached (or a download failed) and the cache cannot stand in: retry later. A
    `SourceError` (a fault of the environment: the job stops, exit 1, naming the file) and an `OSError`."""


@dataclass(frozen=True)
class Snapshot:
    """The data files of one split/subset at one commit."""

    sha: str
    builder: str
    builder_kwargs: dict[str, Any]
    files: list[dict[str, Any]]  # [{"path": repo path, "size": bytes}], sorted by path


# ---- a Hub that pushes back: the retry policy and the run's counters (the transport: hub_http.py) ---
RETRY_BASE_S = 1.0


@dataclass
class RetryPolicy:
    """`execution.hf_retries` / `hf_retry_max_s`: process-wide, since huggingface_hub's HTTP client is."""

    retries: int = 8
    max_s: float = 60.0

    def wait(self, attempt: int, retry_after: float | None) -> float:
        """Seconds before retry number `attempt` (1-based): full jitter over an exponential ceiling, so many
        workers rejected together do not come back together; never less than the server's `Retry-After`,
        never more than `max_s`."""
        jitter = random.uniform(0.0, min(self.max_s, RETRY_BASE_S * 2 ** (attempt - 1)))
        return min(self.max_s, (retry_after or 0.0) + jitter)


class HubStats:
    """Retries by cause ("429", "503", "reset", ...), retries given up, and files/bytes downloaded, for one run.

    Kept in `hub_stats.json` beside the HF cache, which every process downloading for the run (the QC workers
    download their units' files) adds to under an flock, so `streamprep status` and the driver's metrics endpoint
    read the run's totals from it."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.RLock()

    def _read(self) -> dict[str, Any]:
        saved = atomic.read_json(self.path) if self.path.is_file() else {}
        saved = saved if isinstance(saved, dict) else {}
        return {"retries": {str(k): int(v) for k, v in sorted((saved.get("retries") or {}).items())},
                "gave_up": int(saved.get("gave_up", 0)), "files": int(saved.get("files", 0)),
                "bytes": int(saved.get("bytes", 0))}

    def snapshot(self) -> dict[str, Any]:
        with self.lock:
            return self._read()

    def _add(self, cause: str | None = None, gave_up: int = 0, files: int = 0, size: int = 0) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.lock, open(self.path.with_name("hub_stats.flock"), "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # other processes of the run add to the same file
            st = self._read()
            if cause is not None:
                st["retries"][cause] = st["retries"].get(cause, 0) + 1
                st["retries"] = dict(sorted(st["retries"].items()))
            st["gave_up"] += gave_up
            st["files"] += files
            st["bytes"] += size
            atomic.write_json(self.path, st)

    def retried(self, cause: str) -> None:
        self._add(cause=cause)

    def exhausted(self) -> None:
        self._add(gave_up=1)

    def downloaded(self, size: int) -> None:
        self._add(files=1, size=size)


_POLICY = RetryPolicy()
_STATS: dict[Path, HubStats] = {}
_current = threading.local()  # .stats: the HubStats of the source whose request this thread is making


def _install_client() -> None:
    """huggingface_hub's HTTP on the retrying, resuming transport. `hub_http` is loaded by name when first needed:
    it brings httpx, which only a process that talks to the Hub uses (never the job's driver on local files)."""
    importlib.import_module("streamprep.sources.hub_http").install_retrying_client(_POLICY, _current)


def set_retry_policy(retries: int, max_s: float) -> None:
    """Bound the Hub retries of this process (the job sets it from `execution.hf_retries` / `hf_retry_max_s`)."""
    _POLICY.retries, _POLICY.max_s = int(retries), float(max_s)


def hub_stats(cache_dir: str | Path) -> HubStats:
    """The run's Hub counters (one object per HF cache dir, i.e. per run dir)."""
    path = Path(cache_dir).resolve() / "streamprep" / "hub_stats.json"
    with _SLOTS_LOCK:
        if path not in _STATS:
            _STATS[path] = HubStats(path)
        return _STATS[path]


# ---- choosing the data files, with datasets' own conventions ---------------------------------------
def _pattern_resolver(repo_files: Sequence[str], base: str = "") -> Callable[[str], list[str]]:
    """Match a `datasets` data-files pattern against the repo's file list, as `datasets.data_files.resolve_pattern`
    does against a filesystem (fsspec glob semantics, hidden/`__special__` files and README.md etc. skipped
    unless asked for by name)."""
    from datasets.data_files import (FILES_TO_IGNORE, _is_inside_unrequested_special_dir,
                                     _is_unrequested_hidden_file_or_is_inside_unrequested_hidden_dir)
    from fsspec.utils import glob_translate

    def resolve(pattern: str) -> list[str]:
        if "://" in pattern:
            raise FileNotFoundError(f"data files outside the repo are not supported: {pattern}")
        full = posixpath.join(base, pattern.lstrip("/")) if base else pattern.lstrip("/")
        rx = re.compile(glob_translate(full))
        ignore = set(FILES_TO_IGNORE) - {posixpath.basename(full)}
        out = [f for f in repo_files
               if rx.fullmatch(f) and posixpath.basename(f) not in ignore
               and not _is_inside_unrequested_special_dir(f, full)
               and not _is_unrequested_hidden_file_or_is_inside_unrequested_hidden_dir(f, full)]
        if not out:
            raise FileNotFoundError(f"Unable to find '{full}'")
        return out

    return resolve


def select_data_files(repo_id: str, repo_files: Sequence[str], split: str, subset: str | None,
                      card_data: Mapping[str, Any] | None, fmt: str | None = None) -> tuple[list[str], str, dict]:
    """(sorted data files, builder, builder kwargs) of `subset`/`split`, from README `configs:` or default patterns.
    A `configs:` of the wrong shape (`configs: [5]`, a `data_dir` that is a number), which `datasets` reads without
    checking, is a one-line config error naming README.md, not the TypeError it raises deep inside."""
    try:
        return _select_data_files(repo_id, repo_files, split, subset, card_data, fmt)
    except ConfigError:
        raise
    except (TypeError, AttributeError, ValueError) as exc:
        raise HFSourceError(f"hf://{repo_id}: bad 'configs' in README.md: {type(exc).__name__}: "
                            f"{_first_paragraph(exc)}") from None


def _first_paragraph(exc: BaseException) -> str:
    """An error's first paragraph as one line: `datasets` wraps a sentence over lines, then gives examples (the
    line introducing them, ending in ':', is left out)."""
    lines = [line.strip() for line in str(exc).strip().split("\n\n")[0].splitlines()]
    return " ".join(lines[:-1] if len(lines) > 1 and lines[-1].endswith(":") else lines)


def _configs_error(exc: ValueError, card_data: Mapping[str, Any] | None) -> str:
    """`datasets`' complaint about README `configs:` in one line. Its data_files message ends, after the examples,
    on "some symbols like dashes '-' are not allowed in split names", the usual cause, which its first paragraph
    does not name: the split name it refuses is named instead."""
    from datasets.naming import _split_re

    if "not allowed in split names" in str(exc):
        for config in (card_data or {}).get("configs") or []:
            files = config.get("data_files") if isinstance(config, Mapping) else None
            for item in files if isinstance(files, list) else []:
                split = item.get("split") if isinstance(item, Mapping) else None
                if isinstance(split, str) and not re.match(_split_re, split):
                    return (f"config {config.get('config_name')!r}: split name {split!r} is not allowed (letters, "
                            f"digits and '_', with '.' between them)")
    return _first_paragraph(exc)


def _select_data_files(repo_id: str, repo_files: Sequence[str], split: str, subset: str | None,
                       card_data: Mapping[str, Any] | None, fmt: str | None) -> tuple[list[str], str, dict]:
    from datasets.data_files import _get_data_files_patterns, sanitize_patterns
    from datasets.load import infer_module_for_data_files_list
    from datasets.packaged_modules import _EXTENSION_TO_MODULE, _MODULE_TO_EXTENSIONS
    from datasets.utils.metadata import MetadataConfigs

    try:
        configs = MetadataConfigs.from_dataset_card_data(dict(card_data or {}))
        default = configs.get_default_config_name() if configs else None
    except ValueError as exc:
        raise HFSourceError(f"hf://{repo_id}: bad 'configs' in README.md: {_configs_error(exc, card_data)}") from None
    base = ""
    if configs:
        name = subset or default
        if name is None:
            raise HFSourceError(f"hf://{repo_id}: several subsets ({', '.join(configs)}) and no default; set 'subset'")
        if name not in configs:
            raise HFSourceError(f"hf://{repo_id}: unknown subset {name!r} (available: {', '.join(configs)})")
        cfg = configs[name]
        base = (cfg.get("data_dir") or "").strip("/")
        patterns = sanitize_patterns(cfg["data_files"]) if cfg.get("data_files") is not None else None
    elif subset not in (None, "default"):
        raise HFSourceError(f"hf://{repo_id}: unknown subset {subset!r} (README.md declares no 'configs'; "
                            f"leave 'subset' empty)")
    else:
        patterns = None
    resolver = _pattern_resolver(repo_files, base)
    if patterns is None:
        try:
            patterns = _get_data_files_patterns(resolver)
        except FileNotFoundError:
            raise HFSourceError(f"hf://{repo_id}: no data files found{f' under {base}/' if base else ''}") from None
    patterns = {str(k): v for k, v in patterns.items()}  # datasets' defaults are keyed by NamedSplit
    if split not in patterns:
        raise HFSourceError(f"hf://{repo_id}: unknown split {split!r} (available: {', '.join(patterns) or 'none'})")
    known = tuple(ext.lower() for ext in _EXTENSION_TO_MODULE)
    files: set[str] = set()
    for pattern in patterns[split]:
        try:
            matched = resolver(pattern)
        except FileNotFoundError:
            continue
        # a refused file stays whatever its name (a .tgz, no suffix `datasets` knows): it is one reject when read
        files.update(f for f in matched if fmt or _refused(f) or
                     any(f".{s.lower()}" in known for s in posixpath.basename(f).split(".")[1:]))
    if not files:
        raise HFSourceError(f"hf://{repo_id}: split {split!r} matches no data files ({', '.join(patterns[split])})")
    if fmt:
        if fmt not in FORMAT_TO_BUILDER:
            raise HFSourceError(f"hf://{repo_id}: format {fmt!r} not supported for hf:// (use one of "
                                f"{', '.join(sorted(FORMAT_TO_BUILDER))})")
        return sorted(files), FORMAT_TO_BUILDER[fmt], {}
    # files read as no format (`refused`) stay in the split, each one reject when read, and choose no builder: a
    # tar chose `datasets`' webdataset builder, which read its members as records
    refused = {f for f in files if _refused(f)}
    builder, kwargs = infer_module_for_data_files_list(sorted(files - refused) or sorted(files))
    if builder is None and files == refused:  # tars named .tgz, .txz, ...: `datasets` knows no such suffix
        builder = "webdataset"  # never used (each file is a reject), as for a split of .tar files
    if builder is None:
        raise HFSourceError(f"hf://{repo_id}: cannot tell the format of split {split!r}; set 'format'")
    exts = tuple(e.lower() for e in _MODULE_TO_EXTENSIONS.get(builder, []))
    keep = sorted(f for f in files if f in refused or
                  any(f".{s.lower()}" in exts for s in posixpath.basename(f).split(".")[1:]))
    if not_read := sorted(files.difference(keep)):  # `datasets` drops them without a word
        log.warning("data files of another format than the split's are not read", repo=repo_id, split=split,
                    builder=builder, read=len(keep), count=len(not_read), not_read=not_read[:NOT_READ_NAMED])
    return keep, builder, dict(kwargs)


def _local() -> Any:
    """`streamprep.sources.local` (its refusals and line limit), loaded by name when first needed: it brings pyarrow
    and numpy, which `streamprep status` (it imports this module) must not load."""
    return importlib.import_module("streamprep.sources.local")


def _refused(path: str) -> str | None:
    """Why a data file is not read (a tar archive, a Parquet file compressed whole), as a local or s3:// path is
    refused (`local.refused`), else None. But a .zip: `datasets` reads each of its members, where fsspec (local
    paths) reads the first alone."""
    return None if path.lower().endswith(".zip") else _local().refused(path, None)


# ---- streaming through datasets (shared by hf:// and local files) --------------------------------
def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


class LineTooLong(ValueError):
    """A line of a JSON Lines file over `local.MAX_LINE_BYTES` (its 1-based number and its bytes), met by `datasets`'
    JSON reader: it ends the file (the reader cannot skip a line), after the line was read through, never held."""

    def __init__(self, line: int, size: int):
        super().__init__(f"line {line} is {size} bytes")
        self.line, self.size = line, size


class _Raw(io.RawIOBase):
    """A stream with `read` alone (zstandard's reader) as a raw stream, for a BufferedReader over it."""

    def __init__(self, fh: Any):
        self.fh = fh

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        data = self.fh.read(len(buf))
        buf[:len(data)] = data
        return len(data)


class _BoundedLines:
    """What `datasets`' JSON reader gets for a file it opens "rb": the same bytes, through a buffer with a fast
    `readline` (on a zstd stream, which has none, it read the rest of a batch's last line a byte a call: ~3 s/MiB),
    and a line over `local.MAX_LINE_BYTES` raises `LineTooLong` after being read through in pieces (unbounded, a
    270 MiB line cost a worker 2.3 GB). `read(n)` gives n bytes unless at the end, as the streams it wraps do, so
    the reader's batches, and its records, are the same."""

    def __init__(self, fh: Any, bounded: bool = True):
        local = _local()
        self.fh, self.limit, self.piece = fh, local.MAX_LINE_BYTES if bounded else None, local.READ_BUFFER
        self.buf = io.BufferedReader(_Raw(fh), self.piece)
        self.lines = 0  # newlines passed
        self.run = 0  # bytes of the line being read, passed so far

    def __enter__(self) -> "_BoundedLines":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.buf.close()
        self.fh.close()

    def read(self, size: int = -1) -> bytes:
        return self._passed(self.buf.read(size))

    def readline(self, size: int = -1) -> bytes:
        if self.limit is None:
            return self.buf.readline(size)
        room = self.limit - self.run + 1  # one byte more than the limit leaves: a line that passes it shows it
        return self._passed(self.buf.readline(room if size is None or size < 0 else min(size, room)))

    def _passed(self, data: bytes) -> bytes:
        """Count `data`'s lines; raise `LineTooLong` at one over the limit (a line can pass it only when `data` is
        longer than what the limit leaves of the current line: one scan then, else one count)."""
        if self.limit is None:
            return data
        if self.run + len(data) <= self.limit:
            newlines = data.count(b"\n")
            self.lines += newlines
            self.run = len(data) - data.rfind(b"\n") - 1 if newlines else self.run + len(data)
            return data
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if self.run + end + 1 - start > self.limit:
                raise LineTooLong(self.lines + 1, self.run + end + 1 - start)
            self.lines, self.run, start = self.lines + 1, 0, end + 1
        self.run += len(data) - start
        if self.run > self.limit:  # read the line through, holding a piece at a time, to give its length
            size = self.run
            while (piece := self.buf.readline(self.piece)):
                size += len(piece)
                if piece.endswith(b"\n"):
                    break
            raise LineTooLong(self.lines + 1, size)
        return data


def _bound_json_lines() -> None:
    """Have `datasets`' JSON reader open its files through `_BoundedLines` (once a process). Its module's `open`,
    which `datasets` replaces with its streaming `xopen` once (`extend_module_for_streaming`, done here first: a
    no-op after), is wrapped in place."""
    from datasets.download.download_config import DownloadConfig
    from datasets.streaming import extend_module_for_streaming

    module = importlib.import_module("datasets.packaged_modules.json.json")
    extend_module_for_streaming(module.__name__, DownloadConfig())
    inner = module.open
    if getattr(inner, "streamprep_bounded", False):
        return

    def bounded_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        fh = inner(file, mode, *args, **kwargs)
        return _BoundedLines(fh, bounded=not _json_document(file)) if mode == "rb" else fh

    bounded_open.streamprep_bounded = True  # type: ignore[attr-defined]
    module.open = bounded_open


def _json_document(file: Any) -> bool:
    """Whether `file` (a path or a chained URL, `zstd://…::path`) is named a JSON document (`.json`, compressed or
    not), which `datasets` reads whole (an array on one line, maybe): no line of it is a record to bound."""
    name = str(file).split("::")[-1].rsplit("/", 1)[-1].lower()
    for suffix in _local().compressed_suffixes():  # as a local file's format is told (`local.detect_format`)
        name = name.removesuffix(suffix)
    return name.endswith(".json")


def _drop_failed(record: logging.LogRecord) -> bool:
    return not (record.levelno == logging.ERROR and str(record.msg).startswith("Failed to "))


def _quiet_builder(builder: str) -> None:
    """Drop the "Failed to load JSON from file '<cache path>' ..." / "Failed to read schema from ..." lines a
    `datasets` builder logs to stderr before it raises: the raise is a reject naming the repo file (the cache path
    they name is gone once the file is read). Its other messages are left alone."""
    logger = logging.getLogger(f"datasets.packaged_modules.{builder}.{builder}")
    if _drop_failed not in logger.filters:
        logger.addFilter(_drop_failed)


def _too_long(exc: BaseException) -> LineTooLong | None:
    """The `LineTooLong` behind an error of `datasets`, if any."""
    seen: BaseException | None = exc
    while seen is not None and not isinstance(seen, LineTooLong):
        seen = seen.__cause__ or seen.__context__
    return seen


def _matches(flt: Mapping[str, Any]) -> Callable[[dict], bool]:
    items = list(flt.items())
    return lambda ex: all(_same(ex.get(k), v) for k, v in items)


def _same(value: Any, wanted: Any) -> bool:
    """Whether a record's `value` equals a filter's `wanted` as JSON compares them: true and false are no numbers
    (Python's `True == 1` had `filter: {flag: true}` keep the records whose flag is 1, and `{label: 0}` those whose
    label is false), in a list or a mapping too; 1 and 1.0 stay one number. In a mapping a null field is a missing
    one, as at the top level (`ex.get`): a Parquet struct column (or JSON lines read as one table) gives each record
    every field of its file's schema, null where it had none, so one record was kept in a file and not in another."""
    if isinstance(value, bool) or isinstance(wanted, bool):
        return value is wanted
    if isinstance(wanted, list):
        return isinstance(value, list) and len(value) == len(wanted) and all(map(_same, value, wanted))
    if isinstance(wanted, dict):
        return isinstance(value, dict) and {k for k, v in value.items() if v is not None} <= wanted.keys() and \
            all(_same(value.get(k), w) for k, w in wanted.items())
    return value == wanted


def _stream(files: Sequence[str | Path], builder: str, builder_kwargs: Mapping[str, Any], *, split: str,
            flt: Mapping[str, Any] | None, max_records: int | None, start: Mapping[str, Any] | None,
            cache_dir: str | Path | None, extra: Mapping[str, Any],
            names: Sequence[str] | None = None) -> Iterator[tuple[dict[str, Any] | BadRecord, dict[str, Any]]]:
    # Long on purpose: one resumable generator whose position (file, record, consumed, state) the loops share.
    import datasets

    # `load_dataset` of a packaged builder pings S3 to count a "download" (a HEAD with a 3 s timeout, after a DNS
    # lookup that can hang much longer without internet). Streaming cached files must not touch the network, so
    # this telemetry is switched off for the process; nothing else reads the flag.
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False
    _bound_json_lines()
    _quiet_builder(builder)
    start = start or {}
    first, skip_to = int(start.get("file", 0)), int(start.get("record", 0))
    consumed, state = int(start.get("consumed", 0)), start.get("state")
    names = list(names) if names is not None else [str(f) for f in files]

    def open_file(path: Path, filtered: bool = True):
        ds = datasets.load_dataset(builder, data_files={split: [str(path)]}, split=split, streaming=True,
                                   cache_dir=None if cache_dir is None else str(cache_dir), **builder_kwargs)
        return ds.filter(_matches(flt)) if flt and filtered else ds

    def reject(i: int, reason: str) -> tuple[BadRecord, dict[str, Any]]:
        """One counted item for file `i` as a whole (the stream goes on with the next file)."""
        return BadRecord(reason, ""), {**extra, "file": i + 1, "record": 0, "consumed": consumed, "state": None}

    def unreadable(i: int, exc: Exception, n: int | None) -> str:
        """The reason of the reject of file `i`'s rest after `n` records (None: the file could not be opened)."""
        if (long := _too_long(exc)) is not None:  # as a local file's reject says it, but the rest goes with it
            return (f"line {long.line} of {names[i]} is {long.size} bytes, over the {_local().MAX_LINE_BYTES}-byte "
                    f"limit of a record, skipped with the rest of the file (after {n or 0} records)")
        if n is None:
            return f"unreadable {builder} file {names[i]}, skipped: {_one_line(exc)}"
        return f"unreadable {builder} file {names[i]} after {n} records, rest of the file skipped: {_one_line(exc)}"

    for i in range(first, len(files)):
        if max_records is not None and consumed >= max_records:
            return
        if why := _refused(names[i]):  # before its download: none of its bytes is read
            consumed += 1
            yield reject(i, f"unsupported file, skipped: {why}")
            continue
        path = Path(files[i])  # an hf:// file is downloaded here
        whole = not (i == first and skip_to)  # read from its start: its records have not been counted yet
        if whole and _no_rows(path, builder):
            consumed += 1
            yield reject(i, f"empty file {names[i]}")
            continue
        try:
            ds = open_file(path)
        except Exception as exc:  # StopIteration: the json builder found no row to infer the features from
            _raise_if_environment(exc)
            consumed += 1
            yield reject(i, f"empty file {names[i]}" if isinstance(exc, StopIteration) else unreadable(i, exc, None))
            continue
        stateful = hasattr(ds, "state_dict") and hasattr(ds, "load_state_dict")
        n, skip, restored = 0, 0, False
        if i == first and skip_to:
            n = skip_to
            if stateful and state is not None:
                try:
                    ds.load_state_dict(state)
                    restored = True
                except Exception as exc:  # a state from another datasets version or pipeline shape
                    log.warning("cannot restore the stream state; re-reading and skipping", file=names[i],
                                records=skip_to, error=_one_line(exc))
                    skip = skip_to
            else:
                skip = skip_to
        it = iter(ds)
        while True:
            try:
                rec = next(it)
            except StopIteration:
                # a file that gave nothing, not even to the filter (blank lines only, a CSV header, `[]`)
                if whole and n == 0 and (not flt or next(iter(open_file(path, filtered=False)), None) is None):
                    consumed += 1
                    yield reject(i, f"empty file {names[i]}")
                break
            except Exception as exc:
                if restored:  # datasets applies a loaded state lazily: a state it cannot use fails here
                    log.warning("cannot restore the stream state; re-reading and skipping", file=names[i],
                                records=skip_to, error=_one_line(exc))
                    ds, skip, restored = open_file(path), skip_to, False
                    it = iter(ds)
                    continue
                # the builder gave up on this file (e.g. the pyarrow JSON reader on a malformed line)
                _raise_if_environment(exc)
                consumed += 1
                yield reject(i, unreadable(i, exc, n))
                break
            restored = False
            if skip:
                skip -= 1
                continue
            n += 1
            consumed += 1
            item = rec if isinstance(rec, dict) else BadRecord(
                f"record {n} of {names[i]} is a {type(rec).__name__}, not a mapping", repr(rec)[:300])
            yield item, {**extra, "file": i, "record": n, "consumed": consumed,
                         "state": ds.state_dict() if stateful else None}
            if max_records is not None and consumed >= max_records:
                return


def _raise_if_environment(exc: Exception) -> None:
    """A fault of the environment, not of the file's bytes (the file vanished, I/O error, permissions), also when
    `datasets` wraps it, stops the job instead of becoming a reject: a re-run would read the file."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            raise exc
        seen = seen.__cause__ or seen.__context__


def _no_rows(path: Path, builder: str) -> bool:
    """A file with no bytes, or a Parquet file whose footer counts no rows (`datasets` would fail on either, or
    read nothing): an "empty file" reject, as a local source reports it. A footer that cannot be read is left to
    the builder, which reports the file unreadable."""
    if path.stat().st_size == 0:
        return True
    if builder != "parquet":
        return False
    import pyarrow.parquet as pq  # here, not at the top: `streamprep status` imports this module (manifest_sizes)

    try:
        return pq.read_metadata(path).num_rows == 0
    except Exception:  # pyarrow raises ArrowInvalid/OSError subclasses for a bad footer
        return False


def stream_local_with_datasets(files: Sequence[str | Path], builder: str, *, split: str = "train",
                               filter: Mapping[str, Any] | None = None, max_records: int | None = None,
                               start: Mapping[str, Any] | None = None, cache_dir: str | Path | None = None,
                               **builder_kwargs: Any) -> Iterator[tuple[dict[str, Any] | BadRecord, dict[str, Any]]]:
    """Stream local files (in the given order) through `datasets.load_dataset(builder, streaming=True)`.

    `builder` is a `datasets` packaged builder ("json", "parquet", "text", "csv", ...) or one of the entry
    `format` names ("jsonl", "txt"). Items and positions are those of `HFSource.iter_records`, without "revision".
    """
    return _stream(files, FORMAT_TO_BUILDER.get(builder, builder), builder_kwargs, split=split, flt=filter,
                   max_records=max_records, start=start, cache_dir=cache_dir, extra={})


# ---- the source -----------------------------------------------------------------------------------
def parse_repo_id(path: str) -> tuple[str, str | None]:
    """`hf://org/name`, `hf://datasets/org/name` or `...@revision` -> (repo id, revision or None). An `@` with no
    revision after it is refused: it read `main` without a word."""
    rest = path.removeprefix("hf://").strip("/")
    rest = rest.removeprefix("datasets/")
    rest, at, rev = rest.partition("@")
    parts = [p for p in rest.split("/") if p]
    if not 1 <= len(parts) <= 2:
        raise HFSourceError(f"{path}: expected hf://<org>/<name> (a dataset repo id)")
    if at and not rev:
        raise HFSourceError(f"{path}: no revision after '@' (name a branch, tag or commit sha, or drop the '@')")
    return "/".join(parts), rev or None


def requested_revision(path: str, revision: str | None) -> str:
    """The revision an `hf://` entry asks for: its `revision` key or the path's `@rev` (`main` without either). Both
    given must be equal: the key won over a different `@rev` without a word, reading another version of the data."""
    _, path_rev = parse_repo_id(path)
    if revision is not None and path_rev is not None and revision != path_rev:
        raise HFSourceError(f"{path}: 'revision' {revision!r} disagrees with the path's @{path_rev}; give the revision "
                            f"once")
    return revision or path_rev or "main"


def check_entry(key: str, ds: Mapping[str, Any]) -> None:
    """Config validation of an `hf://` entry, without network (the Hub is asked when the job resolves the revision):
    its path names a dataset repo, and a revision given both as `@rev` and as `revision` is the same one."""
    try:
        parse_repo_id(ds["path"])
    except HFSourceError as exc:
        raise ConfigError(f"config: '{key}.path': {exc}") from None
    try:
        requested_revision(ds["path"], ds["revision"])
    except HFSourceError as exc:
        raise ConfigError(f"config: '{key}.revision': {exc}") from None


def _manifest_file(cache_dir: Path, repo_id: str, sha: str, subset: str | None, split: str, fmt: str | None) -> Path:
    """Where the choice of data files of one commit/subset/split (and `format` override) is saved, beside the HF
    cache: datasets of a config that read the same split with another `format` each have their own."""
    stem = quote(split, safe="") + (f".{quote(fmt, safe='')}" if fmt else "")
    return (Path(cache_dir) / "streamprep" / ("datasets--" + repo_id.replace("/", "--")) / sha
            / quote(subset or "_default", safe="") / f"{stem}.json")


@contextmanager
def _exclusive(lock_file: Path) -> Iterator[None]:
    """Hold `lock_file` (an flock: against other threads of this process, each opening it anew, and other
    processes)."""
    lock_file.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_file, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def manifest_sizes(cache_dir: Path, entry: Mapping[str, Any], sha: str) -> list[int] | None:
    """The data file sizes (read order) of a dataset entry (a config mapping) at `sha`, from its saved manifest."""
    try:
        repo_id, _ = parse_repo_id(str(entry["path"]))
        m = atomic.read_json(_manifest_file(cache_dir, repo_id, sha, entry.get("subset"), str(entry.get("split")),
                                            entry.get("format")))
        return [int(f.get("size") or 0) for f in m["files"]]
    except (HFSourceError, OSError, ValueError, KeyError, TypeError):
        return None


class HFSource:
    """One `hf://` dataset entry: its pinned snapshot, planned as one unit per data file (`units`), each read by
    a QC worker through `reader`; `iter_records` streams the files in order in this process."""

    def __init__(self, dataset: DatasetConfig, cache_dir: str | Path, max_concurrent_downloads: int = 8,
                 *, prefetch_files: int = 4, cache_max_gb: float = 10.0, keep_cache: bool = False,
                 endpoint: str | None = None):
        from huggingface_hub import constants

        self.name = dataset.name
        self.repo_id, _ = parse_repo_id(dataset.path)
        self.revision = requested_revision(dataset.path, dataset.revision)
        self.split = dataset.split
        if not self.split:
            raise HFSourceError(f"hf://{self.repo_id}: 'split' is required for hf:// sources")
        self.subset = dataset.subset
        self.format = dataset.format
        # plain lists and dicts, as a record's values are: the config's frozen tuple never equalled a list field
        # (`filter: {tags: [a, b]}` matched nothing), and its MappingProxyType failed to pickle for a worker
        self.filter = thaw(dataset.filter) if dataset.filter else None
        self.max_records = dataset.max_records
        self.cache_dir = Path(cache_dir)
        self.workers = max(1, int(max_concurrent_downloads))
        # the download window ingest keeps for this dataset (DownloadWindow)
        self.prefetch_files = max(1, int(prefetch_files))
        self.cache_max_bytes = int(cache_max_gb * 1024 ** 3)
        self.keep_cache = keep_cache
        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
        self._snap: Snapshot | None = None
        self.stats = hub_stats(self.cache_dir)
        _install_client()

    # -- cache layout: the HF hub cache, plus our manifests beside it --
    @property
    def _meta_dir(self) -> Path:
        return self.cache_dir / "streamprep" / ("datasets--" + self.repo_id.replace("/", "--"))

    def _manifest_path(self, sha: str) -> Path:
        return _manifest_file(self.cache_dir, self.repo_id, sha, self.subset, self.split, self.format)

    def _ref_path(self, revision: str) -> Path:
        return self._meta_dir / "refs" / quote(revision, safe="")

    def _load_manifest(self, sha: str) -> Snapshot | None:
        p = self._manifest_path(sha)
        if not p.is_file():
            return None
        m = atomic.read_json(p)
        if m.get("version") != MANIFEST_VERSION or m.get("format") != self.format:
            return None
        return Snapshot(sha=m["sha"], builder=m["builder"], builder_kwargs=m["builder_kwargs"], files=m["files"])

    def _save_manifest(self, snap: Snapshot) -> None:
        atomic.write_json(self._manifest_path(snap.sha), {
            "version": MANIFEST_VERSION, "repo": self.repo_id, "sha": snap.sha, "subset": self.subset,
            "split": self.split, "format": self.format, "builder": snap.builder,
            "builder_kwargs": snap.builder_kwargs, "files": snap.files})

    # -- resolution --
    def _snapshot(self) -> Snapshot:
        if self._snap is None:
            self._snap = self._named(self.revision)
        return self._snap

    def _named(self, revision: str) -> Snapshot:
        """`_resolve(revision)`, its errors naming the dataset: two entries may read one repo (its splits, its
        subsets)."""
        try:
            return self._resolve(revision)
        except HFSourceError as exc:
            if str(exc).startswith(named := f"dataset {self.name}: "):  # README.md's download names it already
                raise
            raise HFSourceError(f"{named}{exc}") from None

    def _resolve(self, revision: str) -> Snapshot:
        if SHA_RE.match(revision) and (snap := self._load_manifest(revision)) is not None:
            return snap  # a commit never changes: no need to ask the Hub
        import httpx2
        from huggingface_hub import HfApi, constants
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                            RepositoryNotFoundError, RevisionNotFoundError)

        where = f"hf://{self.repo_id}@{revision}"
        _current.stats = self.stats
        try:
            info = HfApi(endpoint=self.endpoint).dataset_info(  # a stall is retried only if it times out
                self.repo_id, revision=revision, files_metadata=True, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
        except RevisionNotFoundError:
            raise HFSourceError(f"hf://{self.repo_id}: revision {revision!r} not found") from None
        except GatedRepoError:
            raise HFSourceError(f"hf://{self.repo_id}: gated dataset; accept its terms on the Hub and set HF_TOKEN") from None
        except RepositoryNotFoundError:
            raise HFSourceError(f"hf://{self.repo_id}: dataset repo not found (or private without a token)") from None
        except (httpx2.HTTPError, HfHubHTTPError, OfflineModeIsEnabled, OSError) as exc:
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if status in (401, 403):  # it answered: "unreachable", exit 1 and "re-run to resume" misled
                raise HFSourceError(f"hf://{self.repo_id}: the Hub refused the request ({_one_line(exc)}); check "
                                    f"HF_TOKEN: a token it does not accept, or one without access to this repo") from None
            # a Hub that answered 429/5xx after every retry was reached: "unreachable" sent one to the network
            status = status or getattr(exc, "status", None)
            failure = f"the Hub answered HTTP {status}" if status else "Hub unreachable"
            cached = self._cached(revision)
            if cached is None:
                raise HFSourceUnavailable(f"{where}: {failure} and no cached copy of this revision "
                                          f"({_one_line(exc)})") from None
            log.warning("the Hub answered an error; using the cached revision" if status else
                        "Hub unreachable; using the cached revision", repo=self.repo_id, revision=revision,
                        sha=cached.sha, error=_one_line(exc))
            return cached
        sha = info.sha
        if not sha:
            raise HFSourceUnavailable(f"{where}: the Hub returned no commit sha")
        # datasets of one config reading the same repo resolve it at the same time, in threads of the driver: one
        # of them writes the manifest (atomic.tmp_path is per process, so two writers would share a temp file)
        with _exclusive(self._meta_dir / "resolve.flock"):
            if (snap := self._load_manifest(sha)) is None:
                sizes = {s.rfilename: s.size for s in info.siblings or []}
                card = self._card_data(sha, sizes)
                files, builder, kwargs = select_data_files(self.repo_id, sorted(sizes), self.split, self.subset,
                                                           card, self.format)
                snap = Snapshot(sha=sha, builder=builder, builder_kwargs=kwargs,
                                files=[{"path": f, "size": sizes[f]} for f in files])
                self._save_manifest(snap)
            if revision != sha:
                atomic.write_bytes(self._ref_path(revision), sha.encode())
        log.info("resolved hf dataset", repo=self.repo_id, revision=revision, sha=sha, split=self.split,
                 subset=self.subset, builder=snap.builder, files=len(snap.files))
        return snap

    def _cached(self, revision: str) -> Snapshot | None:
        ref = self._ref_path(revision)
        sha = ref.read_text().strip() if ref.is_file() else revision
        return self._load_manifest(sha) if SHA_RE.match(sha) else None

    def _card_data(self, sha: str, sizes: Mapping[str, Any]) -> dict[str, Any] | None:
        """The YAML header of README.md at `sha` (where `configs:` lives), or None."""
        if "README.md" not in sizes:
            return None
        from huggingface_hub.repocard import metadata_load

        readme = download(self.name, self.repo_id, "README.md", sha, self.cache_dir, self.endpoint, self.workers,
                          self.stats, data_file=False)
        try:
            return metadata_load(readme)
        except Exception as exc:  # YAML errors: a broken card is a broken repo entry
            raise HFSourceError(f"hf://{self.repo_id}: unreadable README.md YAML: {_one_line(exc)}") from None

    # -- downloads --
    def _download_one(self, item: tuple[str, str]) -> Path:
        path, sha = item
        return download(self.name, self.repo_id, path, sha, self.cache_dir, self.endpoint, self.workers, self.stats)

    # -- units of work --
    def units(self) -> list[Unit]:
        """The plan of this dataset: one `hf` unit per data file of the resolved snapshot, in read order. A unit's
        `path` names the file at its commit (`hf://datasets/<repo>@<sha>/<file>`), `fmt` the builder, `end` the size."""
        snap = self._snapshot()
        return [Unit("hf", i, unit_path(self.repo_id, snap.sha, f["path"]), snap.builder, 0, int(f.get("size") or 0))
                for i, f in enumerate(snap.files)]

    def reader(self, plan: Sequence[Unit]) -> "FileReader":
        """What a worker reads the plan's units with, pinned to the plan's commit (a resume finishes on the data it
        started with, wherever the branch has moved since: the commit's saved manifest, no Hub request)."""
        sha = _unit_file(self.repo_id, plan[0])[0] if plan else self._snapshot().sha
        if self._snap is None or self._snap.sha != sha:
            self._snap = self._named(sha)
        return FileReader(self.name, self.repo_id, str(self.cache_dir), self.endpoint, self.workers,
                          self._snap.builder_kwargs, _split_name(self.split), self.filter,
                          _POLICY.retries, _POLICY.max_s, self.max_records)

    # -- the Source protocol --
    def fingerprint(self) -> dict[str, Any]:
        snap = self._snapshot()
        return {"hf_repo": self.repo_id, "revision": snap.sha, "requested_revision": self.revision,
                "split": self.split, "subset": self.subset, "builder": snap.builder,
                "files": [{"path": f["path"], "size": f["size"]} for f in snap.files]}

    def iter_records(self, start: dict[str, Any] | None = None) -> Iterator[tuple[dict[str, Any] | BadRecord, dict[str, Any]]]:
        """The snapshot's records in order, each file downloaded when the stream reaches it (ingest reads the files
        as units in its workers instead). A position pins its commit: resuming on a moved branch finishes on it."""
        snap = self._snapshot()
        pinned = (start or {}).get("revision")
        if pinned and pinned != snap.sha:
            log.warning("resuming on the checkpoint's commit, not the branch's current one", repo=self.repo_id,
                        checkpoint_sha=pinned, current_sha=snap.sha)
            snap = self._snap = self._named(pinned)
        files = _OnDemand(self, snap)
        yield from _stream(files, snap.builder, snap.builder_kwargs, split=_split_name(self.split), flt=self.filter,
                           max_records=self.max_records, start=start, cache_dir=self.cache_dir / "datasets",
                           extra={"revision": snap.sha}, names=[f["path"] for f in snap.files])


class _OnDemand:
    """A snapshot's data files as local paths, each downloaded when first asked for."""

    def __init__(self, src: HFSource, snap: Snapshot):
        self.src, self.snap = src, snap

    def __len__(self) -> int:
        return len(self.snap.files)

    def __getitem__(self, i: int) -> Path:
        return self.src._download_one((self.snap.files[i]["path"], self.snap.sha))


def download(dataset: str, repo_id: str, path: str, sha: str, cache_dir: Path, endpoint: str, slots: int,
             stats: HubStats, data_file: bool = True) -> Path:
    """Download one repo file at commit `sha` into the HF cache, holding one of this process's `slots` download
    slots; a cached file costs no request. A failure is `HFSourceUnavailable` (exit 1: a re-run resumes), unless
    the Hub refuses the file (`_hub_refusal`) or says the commit itself is gone (`_commit_gone`), which no re-run
    fixes. Only a `data_file` is counted in `stats`' files and bytes (README.md, read for its `configs:`, was one more file in hub_stats)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    hit = try_to_load_from_cache(repo_id, path, cache_dir=cache_dir, revision=sha, repo_type="dataset")
    if isinstance(hit, str):
        return Path(hit)
    _current.stats = stats
    _current.bodies = [] if data_file else None  # filled by the transport with the bodies it received whole
    try:
        with _download_slots(slots):
            got = Path(hf_hub_download(repo_id, path, repo_type="dataset", revision=sha, cache_dir=cache_dir,
                                       endpoint=endpoint))
    except Exception as exc:
        if (refusal := _hub_refusal(exc, path)) is not None:
            raise HFSourceError(f"dataset {dataset}: hf://{repo_id}: {refusal}") from None
        if _commit_gone(exc, repo_id, sha, endpoint):
            raise HFSourceError(f"dataset {dataset}: hf://{repo_id}: commit {sha}, which this run started on, is no "
                                f"longer on the Hub (a force-push or squash removed it); resuming would mix two versions "
                                f"of the data — restore the commit, or start over with a new --run-dir") from None
        raise HFSourceUnavailable(f"hf://{repo_id}@{sha}: download of {path} failed ({_one_line(exc)})") from None
    else:
        # counted once huggingface_hub has checked its size, and only if this call received it, not when another
        # thread or process fetched it meanwhile. The file's GET is the call's last request: a body before it is not
        # the file's (huggingface_hub's agent registry, fetched with the first request headers a process builds)
        if _current.bodies:
            stats.downloaded(_current.bodies[-1])
        return got
    finally:
        _current.bodies = None


def _hub_refusal(exc: Exception, path: str) -> str | None:
    """What to do about the download of `path` the Hub refused (401/403: a gated repo, whose listing it shows anyone
    but whose files it refuses, or a token it does not accept or without access), which no re-run fixes; None for any
    other failure. huggingface_hub raises a refused HEAD as is when gated or 401, and a plain 403 as the `__cause__`
    of a LocalEntryNotFoundError that says to check the connection: the refusal is named instead."""
    from huggingface_hub.errors import GatedRepoError

    for err in (exc, exc.__cause__):
        if isinstance(err, GatedRepoError):
            return f"gated dataset; accept its terms on the Hub and set HF_TOKEN (download of {path}: {_one_line(err)})"
        if getattr(getattr(err, "response", None), "status_code", None) in (401, 403):
            return (f"the Hub refused the download of {path} ({_one_line(err)}); check HF_TOKEN: a token it does not "
                    f"accept, or one without access to this repo")
    return None


def _commit_gone(exc: Exception, repo_id: str, sha: str, endpoint: str) -> bool:
    """Whether a download at commit `sha` failed because the commit is gone from the repo: the file's request was
    answered "revision not found" and so is a request for the commit itself. Asked again, so that one odd 404 (a
    Hub or mirror hiccup) stays a resumable failure; any other answer, or none, leaves it one."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import RevisionNotFoundError

    if not isinstance(exc, RevisionNotFoundError):
        return False
    try:  # with the download's timeout: a stall is then retried, not waited on forever
        HfApi(endpoint=endpoint).dataset_info(repo_id, revision=sha, timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT)
    except RevisionNotFoundError:
        return True
    except Exception:  # unreachable, 5xx after the retries, a refused token: not an answer about the commit
        return False
    return False


def unit_path(repo_id: str, sha: str, path: str) -> str:
    return f"hf://datasets/{repo_id}@{sha}/{path}"


def _unit_file(repo_id: str, unit: Unit) -> tuple[str, str]:
    """(commit sha, repo path) of an `hf` unit."""
    sha, _, path = unit.path.removeprefix(f"hf://datasets/{repo_id}@").partition("/")
    return sha, path


_PREFETCH = ThreadPoolExecutor(1, thread_name_prefix="hf-prefetch")  # one file ahead per process


@dataclass(frozen=True)
class FileReader:
    """How a QC worker reads an `hf` unit: downloads its file (the retrying, Range-resuming client; the Hub
    token is the worker's own HF_TOKEN, never an argument) and streams it through `datasets` as `iter_records`
    does, so its items are the stream's. Sent with each call: plain data."""

    dataset: str  # its name: its readers' hard links are its own
    repo_id: str
    cache_dir: str
    endpoint: str
    slots: int  # execution.max_concurrent_downloads, per process
    builder_kwargs: dict[str, Any]
    split: str
    filter: dict[str, Any] | None
    retries: int
    retry_max_s: float
    max_records: int | None  # no unit's item past this index is ever used: its ordinal is past the cap

    def prefetch(self, units: Sequence[Unit]) -> list[Future]:
        """Start downloading `units` (handed out by the driver already, so inside its window) in a thread of this
        process while it judges its own unit, which waits for them before it returns (`judge_piece`); whichever
        worker reads one later finds it in the cache, or waits for it on `huggingface_hub`'s lock. A failure here
        is only logged: the reader downloads it again."""
        return [_PREFETCH.submit(self._prefetch_one, unit) for unit in units]

    def _prefetch_one(self, unit: Unit) -> None:
        sha, path = _unit_file(self.repo_id, unit)
        cache = Path(self.cache_dir)
        _current.ahead = True  # a request given up here is not counted as given up: the reader asks again
        try:
            download(self.dataset, self.repo_id, path, sha, cache, self.endpoint, self.slots, hub_stats(cache))
        except Exception as exc:  # HFSourceUnavailable and the like: the unit's reader reports it
            log.info("hf prefetch failed; the reader downloads the file", file=path, error=_one_line(exc))
        finally:
            _current.ahead = False

    def read(self, unit: Unit, limit: int | None = None) -> list[dict[str, Any] | BadRecord]:
        """The unit's items (its first `limit`; never more than `max_records`)."""
        if self.max_records is not None:
            limit = self.max_records if limit is None else min(limit, self.max_records)
        sha, path = _unit_file(self.repo_id, unit)
        set_retry_policy(self.retries, self.retry_max_s)
        _install_client()
        cache = Path(self.cache_dir)

        def fetch() -> Path:
            return download(self.dataset, self.repo_id, path, sha, cache, self.endpoint, self.slots, hub_stats(cache))

        with _held(fetch, _reading_dir(cache, self.dataset, unit)) as local:
            return [item for item, _ in _stream([local], unit.fmt, self.builder_kwargs, split=self.split,
                                                flt=self.filter, max_records=limit, start=None,
                                                cache_dir=cache / "datasets", extra={}, names=[path])]


def _reading_dir(cache_dir: Path, dataset: str, unit: Unit) -> Path:
    """Where the reader of `unit` links its file: one directory per dataset and unit (two datasets may read the same
    file at once), so a reader killed mid-way leaves one that the unit's next reader, or the driver's eviction of
    the unit, removes."""
    return cache_dir / "streamprep" / "reading" / hashlib.sha1(f"{dataset}\0{unit.path}".encode()).hexdigest()[:20]


@contextmanager
def _held(fetch: Callable[[], Path], mine: Path) -> Iterator[Path]:
    """The fetched file under a hard link of this reader's own in `mine`, named like it (`datasets` infers
    compression from the name): the driver may delete the blob of another unit with the same content at any moment
    (the HF cache shares a blob between equal files), which must not pull this file away from under the reader. A
    blob deleted between the fetch and the link is fetched again."""
    shutil.rmtree(mine, ignore_errors=True)
    mine.mkdir(parents=True)
    try:
        for _ in range(3):
            got = fetch()
            try:
                os.link(got.resolve(), mine / got.name)
            except FileNotFoundError:
                continue
            yield mine / got.name
            return
        raise HFSourceUnavailable(f"{got}: deleted while being fetched, three times")
    finally:
        shutil.rmtree(mine, ignore_errors=True)


_WINDOWS: list["DownloadWindow"] = []  # the open windows of this process: one per hf:// dataset of the job
_WINDOWS_LOCK = threading.Lock()  # their `held`, and the deleting of their files


class DownloadWindow:
    """The driver's bound on one hf:// dataset's files on disk, kept by handing units out (`fits`, `take`): at most
    `hf_prefetch_files` + 1 units between the oldest one no checkpoint has passed and the newest handed out, and
    at most `hf_cache_max_gb` of their files (the oldest one is always handed out). After a checkpoint at unit
    `n`, `evictor(n)` deletes the files of the units before it from the cache (unless `hf_keep_cache`), then
    `release(n)` lets go of them: the files on disk never exceed the window. Only the event loop calls it; the
    deleting runs in a thread, one call at a time, and lets go of them itself: `held` changes under
    _WINDOWS_LOCK, which `fits` and `fits_ahead` take to read it.

    Datasets of one job reading the same repo share its cache, so a file is deleted only when no other open window
    holds it (nor, with equal content, its blob); a dataset that reaches a file another one has already deleted
    downloads it again. `close` (at the end of the job) removes the window from that count."""

    def __init__(self, src: HFSource, plan: Sequence[Unit]):
        self.plan = plan
        self.repo_id, self.cache_dir, self.name = src.repo_id, src.cache_dir, src.name
        self.files, self.max_bytes, self.keep = src.prefetch_files + 1, src.cache_max_bytes, src.keep_cache
        self.held: dict[int, Unit] = {}  # handed out, not yet passed by a checkpoint
        with _WINDOWS_LOCK:
            _WINDOWS.append(self)

    def fits(self, u: int) -> bool:
        with _WINDOWS_LOCK:  # the deleting thread lets go of units meanwhile ("dictionary changed size")
            if not self.held or u in self.held:
                return True
            return u - min(self.held) < self.files and \
                sum(x.end for x in self.held.values()) + self.plan[u].end <= self.max_bytes

    def fits_ahead(self, u: int, v: int) -> bool:
        """Whether unit `v` can be handed out before the units between `u` (handed out) and it, with room kept for
        them all: they will fit when their turn comes, so an early hand-out never blocks the window."""
        with _WINDOWS_LOCK:
            between = sum(self.plan[w].end for w in range(u + 1, v + 1) if w not in self.held)
            return v - min(self.held, default=u) < self.files and \
                sum(x.end for x in self.held.values()) + between <= self.max_bytes

    def take(self, u: int) -> None:
        with _WINDOWS_LOCK:  # not while another window decides what to delete
            self.held[u] = self.plan[u]

    def evictor(self, before: int) -> Callable[[], None] | None:
        """The deleting, to run in a thread, of the files of the held units before `before`, which a checkpoint
        has passed (None: nothing to delete); `release` then lets go of them."""
        gone = [x for u, x in self.held.items() if u < before]
        if not gone or self.keep:
            return None
        return lambda: self._delete([self._local(x) for x in gone], [_reading_dir(self.cache_dir, self.name, x)
                                                                    for x in gone], before)

    def _delete(self, links: list[Path], readers: list[Path], before: int) -> None:
        """Delete `links` but those a window still holds (this one from `before` on), deciding and deleting under
        the lock `take` waits for: a file another dataset hands out meanwhile is either kept or handed out after.
        This window lets go of the units before `before` under the same lock: two datasets whose checkpoints passed
        one file at once each kept it for the other, which had not let go yet, and it outlived the job."""
        with _WINDOWS_LOCK:
            held = {w._local(x) for w in _WINDOWS if w.cache_dir == self.cache_dir
                    for u, x in w.held.items() if w is not self or u >= before}
            _evict([p for p in links if p not in held], list(held), readers)
            self._release(before)

    def release(self, before: int) -> None:
        with _WINDOWS_LOCK:
            self._release(before)

    def _release(self, before: int) -> None:
        for u in [u for u in self.held if u < before]:
            del self.held[u]

    def close(self) -> None:
        """The job is over: this window holds nothing for the others any more."""
        with _WINDOWS_LOCK:
            if self in _WINDOWS:
                _WINDOWS.remove(self)

    def drop_passed(self, start: int) -> None:
        """Before a (resumed) dataset hands out unit `start`: delete the files of the units before it that a killed
        job left behind (between its checkpoint and its deleting), unless `hf_keep_cache`."""
        if not self.keep:
            self._delete([self._local(x) for x in self.plan[:start]],
                         [_reading_dir(self.cache_dir, self.name, x) for x in self.plan[:start]], 0)

    def _local(self, unit: Unit) -> Path:
        from huggingface_hub.file_download import repo_folder_name

        sha, path = _unit_file(self.repo_id, unit)
        return self.cache_dir / repo_folder_name(repo_id=self.repo_id, repo_type="dataset") / "snapshots" / sha / path


def clear_leftovers(cache_dir: Path) -> None:
    """Before a job downloads anything into its run's HF cache, and once its ingest is over (no reader runs then):
    remove what killed processes left there, the partial downloads (`huggingface_hub` names each attempt's file
    anew, so none is resumed) and the readers' hard links, which would hold disk the download window does not count;
    and the lock files: `huggingface_hub`'s of each blob gone, and `datasets`' of each file's streaming builder, two
    empty files a file that were left behind (200 000 inodes for a dataset of 100 000 files)."""
    cache_dir = Path(cache_dir)
    for partial in cache_dir.glob("datasets--*/blobs/*.incomplete"):
        partial.unlink(missing_ok=True)
    shutil.rmtree(cache_dir / "streamprep" / "reading", ignore_errors=True)
    for lock in cache_dir.glob(".locks/datasets--*/*.lock"):
        if not (cache_dir / lock.parent.name / "blobs" / lock.stem).exists():
            lock.unlink(missing_ok=True)
    for lock in cache_dir.glob("datasets/*.lock"):
        lock.unlink(missing_ok=True)


def _evict(links: list[Path], others: list[Path], readers: list[Path]) -> None:
    """Delete each file's snapshot link and its blob, unless the link of a file still held points to the same
    blob (equal content; a held file still downloading may link it a moment later: its reader holds a hard link
    of its own, `_held`, or fetches the file again), and the hard link a killed reader left behind."""
    for d in readers:
        shutil.rmtree(d, ignore_errors=True)
    shared = {p.resolve() for p in others if p.is_symlink()}
    for link in links:
        if not link.is_symlink():  # a cache without symlinks holds copies
            link.unlink(missing_ok=True)
            continue
        blob = link.resolve()
        if blob not in shared:  # first: a job killed in between leaves a dangling link, not an unlisted blob
            blob.unlink(missing_ok=True)
        link.unlink(missing_ok=True)
        log.debug("hf cache file deleted", file=str(link))


def _split_name(split: str) -> str:
    """A split name `datasets` accepts for a data_files key (e.g. "train"; any \\w+ name)."""
    return split if re.fullmatch(r"\w+(\.\w+)*", split) else "train"
