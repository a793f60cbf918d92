"""`hf://org/name` dataset repos: pinned, parallel pre-download into a cache, then network-free streaming.

1. **Resolve** (network, once): `HfApi.dataset_info(revision=...)` turns the requested branch/tag/sha into a
   commit sha and lists the repo's files. The data files of `subset`/`split` are chosen the way `datasets` does it:
   the `configs:` YAML of the repo's README.md when present, else `datasets`' default data-file patterns
   (`data/{split}-00000-of-00001.*`, `train*`/`*-train-*`, `train/**`, ...), then the builder is inferred from the
   file extensions (or given by the entry's `format`). The selection is written to a manifest in the cache.
2. **Download ahead** (network, background threads): the data files are fetched in stream order with
   `hf_hub_download`, pinned to the commit sha, into `cache_dir` (the standard HF cache layout), at most
   `max_concurrent_downloads` at a time in the whole process (sources downloading together share the limit), at
   most `prefetch_files` files ahead of the file being read and `cache_max_gb` of files no saved checkpoint has
   passed (`_Window`). Ingest calls `checkpointed(position)` after each save: files before the position's file are
   deleted unless `keep_cache`.
3. **Stream** (no network in the reader): each file, in repo-path order, once local, through
   `datasets.load_dataset(<builder>, data_files=[file], streaming=True)` with the entry's `filter`.

Positions are `{"revision": sha, "file": i, "record": r, "consumed": n, "state": IterableDataset.state_dict()}`:
`r` records of file `i` (after the filter) and `n` items overall were yielded. Resuming pins the commit in the
position, restores file `i`'s stream with `load_state_dict` (or, without a usable state, re-reads it and skips
`r` records) and goes on with the next record. When the Hub is unreachable (or `HF_HUB_OFFLINE=1`) a revision
resolved before is served from the cache manifest, so a resumed or repeated run needs no network for the files
still cached (files a checkpoint has passed are deleted unless `keep_cache`).

`datasets`' JSON reader parses a file in blocks with pyarrow and fails a whole file on one malformed line
(it raises `ArrowInvalid` for the block): that becomes a single `BadRecord` naming the file, and the stream
goes on with the next file. `stream_local_with_datasets` runs the same streaming core over local files.
"""
from __future__ import annotations

import posixpath
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence
from urllib.parse import quote

from streamprep import atomic, logs
from streamprep.config import ConfigError, DatasetConfig
from streamprep.sources.base import BadRecord

log = logs.get("sources.hf")

SHA_RE = re.compile(r"^[0-9a-f]{40}$")
# the entry's `format` (the same names local sources use) -> datasets builder
FORMAT_TO_BUILDER = {"jsonl": "json", "json": "json", "parquet": "parquet", "txt": "text", "text": "text",
                     "csv": "csv", "arrow": "arrow"}
MANIFEST_VERSION = 1

# `execution.max_concurrent_downloads` is a run-level limit: sources downloading at the same time share it
_SLOTS: dict[int, threading.BoundedSemaphore] = {}
_SLOTS_LOCK = threading.Lock()


def _download_slots(limit: int) -> threading.BoundedSemaphore:
    with _SLOTS_LOCK:
        return _SLOTS.setdefault(limit, threading.BoundedSemaphore(limit))


class HFSourceError(ConfigError):
    """A wrong `hf://` entry: unknown repo, revision, subset or split, or no data files. The CLI exits 2."""


class HFSourceUnavailable(OSError):
    """The Hub could not be reached (or a download failed) and the cache cannot stand in: retry later."""


@dataclass(frozen=True)
class Snapshot:
    """The data files of one split/subset at one commit."""

    sha: str
    builder: str
    builder_kwargs: dict[str, Any]
    files: list[dict[str, Any]]  # [{"path": repo path, "size": bytes}], sorted by path


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
    """(sorted data files, builder, builder kwargs) of `subset`/`split`, from README `configs:` or default patterns."""
    from datasets.data_files import _get_data_files_patterns, sanitize_patterns
    from datasets.load import infer_module_for_data_files_list
    from datasets.packaged_modules import _EXTENSION_TO_MODULE, _MODULE_TO_EXTENSIONS
    from datasets.utils.metadata import MetadataConfigs

    try:
        configs = MetadataConfigs.from_dataset_card_data(dict(card_data or {}))
        default = configs.get_default_config_name() if configs else None
    except ValueError as exc:
        raise HFSourceError(f"hf://{repo_id}: bad 'configs' in README.md: {str(exc).strip().splitlines()[0]}") from None
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
        files.update(f for f in matched if fmt or any(f".{s.lower()}" in known for s in posixpath.basename(f).split(".")[1:]))
    if not files:
        raise HFSourceError(f"hf://{repo_id}: split {split!r} matches no data files ({', '.join(patterns[split])})")
    if fmt:
        if fmt not in FORMAT_TO_BUILDER:
            raise HFSourceError(f"hf://{repo_id}: format {fmt!r} not supported for hf:// (use one of "
                                f"{', '.join(sorted(FORMAT_TO_BUILDER))})")
        return sorted(files), FORMAT_TO_BUILDER[fmt], {}
    builder, kwargs = infer_module_for_data_files_list(sorted(files))
    if builder is None:
        raise HFSourceError(f"hf://{repo_id}: cannot tell the format of split {split!r}; set 'format'")
    exts = tuple(e.lower() for e in _MODULE_TO_EXTENSIONS.get(builder, []))
    keep = sorted(f for f in files if any(f".{s.lower()}" in exts for s in posixpath.basename(f).split(".")[1:]))
    return keep, builder, dict(kwargs)


# ---- streaming through datasets (shared by hf:// and local files) --------------------------------
def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


def _matches(flt: Mapping[str, Any]) -> Callable[[dict], bool]:
    items = list(flt.items())
    return lambda ex: all(ex.get(k) == v for k, v in items)


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
    start = start or {}
    first, skip_to = int(start.get("file", 0)), int(start.get("record", 0))
    consumed, state = int(start.get("consumed", 0)), start.get("state")
    names = list(names) if names is not None else [str(f) for f in files]
    def open_file(i: int):
        ds = datasets.load_dataset(builder, data_files={split: [str(files[i])]}, split=split, streaming=True,
                                   cache_dir=None if cache_dir is None else str(cache_dir), **builder_kwargs)
        return ds.filter(_matches(flt)) if flt else ds

    for i in range(first, len(files)):
        if max_records is not None and consumed >= max_records:
            return
        ds = open_file(i)
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
                break
            except Exception as exc:
                if restored:  # datasets applies a loaded state lazily: a state it cannot use fails here
                    log.warning("cannot restore the stream state; re-reading and skipping", file=names[i],
                                records=skip_to, error=_one_line(exc))
                    ds, skip, restored = open_file(i), skip_to, False
                    it = iter(ds)
                    continue
                # the builder gave up on this file (e.g. the pyarrow JSON reader on a malformed line)
                consumed += 1
                bad = BadRecord(f"unreadable {builder} file {names[i]} after {n} records, rest of the file "
                                f"skipped: {_one_line(exc)}", "")
                yield bad, {**extra, "file": i + 1, "record": 0, "consumed": consumed, "state": None}
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
    """`hf://org/name`, `hf://datasets/org/name` or `...@revision` -> (repo id, revision or None)."""
    rest = path.removeprefix("hf://").strip("/")
    rest = rest.removeprefix("datasets/")
    rest, _, rev = rest.partition("@")
    parts = [p for p in rest.split("/") if p]
    if not 1 <= len(parts) <= 2:
        raise HFSourceError(f"{path}: expected hf://<org>/<name> (a dataset repo id)")
    return "/".join(parts), rev or None


class HFSource:
    """One `hf://` dataset entry: `iter_records()` streams while downloading ahead; `checkpointed()` frees the cache."""

    def __init__(self, dataset: DatasetConfig, cache_dir: str | Path, max_concurrent_downloads: int = 8,
                 *, prefetch_files: int = 4, cache_max_gb: float = 10.0, keep_cache: bool = False,
                 endpoint: str | None = None, token: str | bool | None = None):
        from huggingface_hub import constants

        self.repo_id, path_rev = parse_repo_id(dataset.path)
        self.revision = dataset.revision or path_rev or "main"
        self.split = dataset.split
        if not self.split:
            raise HFSourceError(f"hf://{self.repo_id}: 'split' is required for hf:// sources")
        self.subset = dataset.subset
        self.format = dataset.format
        self.filter = dataset.filter or None
        self.max_records = dataset.max_records
        self.cache_dir = Path(cache_dir)
        self.workers = max(1, int(max_concurrent_downloads))
        self.prefetch_files = max(1, int(prefetch_files))
        self.cache_max_bytes = int(cache_max_gb * 1024 ** 3)
        self.keep_cache = keep_cache
        self._window: _Window | None = None
        self.endpoint = (endpoint or constants.ENDPOINT).rstrip("/")
        self.token = token
        self._snap: Snapshot | None = None

    # -- cache layout: the HF hub cache, plus our manifests beside it --
    @property
    def _meta_dir(self) -> Path:
        return self.cache_dir / "streamprep" / ("datasets--" + self.repo_id.replace("/", "--"))

    def _manifest_path(self, sha: str) -> Path:
        return self._meta_dir / sha / quote(self.subset or "_default", safe="") / f"{quote(self.split, safe='')}.json"

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
            self._snap = self._resolve(self.revision)
        return self._snap

    def _resolve(self, revision: str) -> Snapshot:
        if SHA_RE.match(revision) and (snap := self._load_manifest(revision)) is not None:
            return snap  # a commit never changes: no need to ask the Hub
        import httpx2
        from huggingface_hub import HfApi
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, OfflineModeIsEnabled,
                                            RepositoryNotFoundError, RevisionNotFoundError)

        where = f"hf://{self.repo_id}@{revision}"
        try:
            info = HfApi(endpoint=self.endpoint, token=self.token).dataset_info(
                self.repo_id, revision=revision, files_metadata=True)
        except RevisionNotFoundError:
            raise HFSourceError(f"hf://{self.repo_id}: revision {revision!r} not found") from None
        except GatedRepoError:
            raise HFSourceError(f"hf://{self.repo_id}: gated dataset; accept its terms on the Hub and set HF_TOKEN") from None
        except RepositoryNotFoundError:
            raise HFSourceError(f"hf://{self.repo_id}: dataset repo not found (or private without a token)") from None
        except (httpx2.HTTPError, HfHubHTTPError, OfflineModeIsEnabled, OSError) as exc:
            cached = self._cached(revision)
            if cached is None:
                raise HFSourceUnavailable(f"{where}: Hub unreachable and no cached copy of this revision "
                                          f"({_one_line(exc)})") from None
            log.warning("Hub unreachable; using the cached revision", repo=self.repo_id, revision=revision,
                        sha=cached.sha, error=_one_line(exc))
            return cached
        sha = info.sha
        if not sha:
            raise HFSourceUnavailable(f"{where}: the Hub returned no commit sha")
        if (snap := self._load_manifest(sha)) is None:
            sizes = {s.rfilename: s.size for s in info.siblings or []}
            card = self._card_data(sha, sizes)
            files, builder, kwargs = select_data_files(self.repo_id, sorted(sizes), self.split, self.subset, card,
                                                       self.format)
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

        readme = self._download_one(("README.md", sha))
        try:
            return metadata_load(readme)
        except Exception as exc:  # YAML errors: a broken card is a broken repo entry
            raise HFSourceError(f"hf://{self.repo_id}: unreadable README.md YAML: {_one_line(exc)}") from None

    # -- downloads --
    def _download_one(self, item: tuple[str, str]) -> Path:
        """Download one (repo path, sha) into the HF cache, holding a run-wide download slot; a cached file costs
        no request."""
        from huggingface_hub import hf_hub_download, try_to_load_from_cache

        path, sha = item
        hit = try_to_load_from_cache(self.repo_id, path, cache_dir=self.cache_dir, revision=sha, repo_type="dataset")
        if isinstance(hit, str):
            return Path(hit)
        try:
            with _download_slots(self.workers):
                return Path(hf_hub_download(self.repo_id, path, repo_type="dataset", revision=sha,
                                            cache_dir=self.cache_dir, endpoint=self.endpoint, token=self.token))
        except Exception as exc:
            raise HFSourceUnavailable(f"hf://{self.repo_id}@{sha}: download of {path} failed "
                                      f"({_one_line(exc)})") from None

    # -- the Source protocol --
    def fingerprint(self) -> dict[str, Any]:
        snap = self._snapshot()
        return {"hf_repo": self.repo_id, "revision": snap.sha, "requested_revision": self.revision,
                "split": self.split, "subset": self.subset, "builder": snap.builder,
                "files": [{"path": f["path"], "size": f["size"]} for f in snap.files]}

    def iter_records(self, start: dict[str, Any] | None = None) -> Iterator[tuple[dict[str, Any] | BadRecord, dict[str, Any]]]:
        """A generator: nothing happens until the first `next()`, which runs in ingest's reader thread."""
        snap = self._snapshot()
        pinned = (start or {}).get("revision")
        if pinned and pinned != snap.sha:  # the branch moved since the checkpoint: finish on the data we started
            log.warning("resuming on the checkpoint's commit, not the branch's current one", repo=self.repo_id,
                        checkpoint_sha=pinned, current_sha=snap.sha)
            snap = self._resolve(pinned)
            self._snap = snap
        window = _Window(self, snap, int((start or {}).get("file", 0)))
        self._window = window
        try:
            yield from _stream(window, snap.builder, snap.builder_kwargs, split=_split_name(self.split),
                               flt=self.filter, max_records=self.max_records, start=start,
                               cache_dir=self.cache_dir / "datasets", extra={"revision": snap.sha},
                               names=[f["path"] for f in snap.files])
        finally:
            window.close()

    def checkpointed(self, position: Mapping[str, Any] | None) -> None:
        """A checkpoint at `position` was saved: the files before its file are no longer needed by any resume, so
        they leave the download window (and the cache, unless `keep_cache`)."""
        if position and self._window is not None:
            self._window.release_before(int(position.get("file", 0)))


class _Window:
    """The data files of one stream, downloaded ahead of the reader in a bounded window.

    A background pool (`max_concurrent_downloads` threads, sharing the run-wide slots) fetches files in stream order,
    at most `prefetch_files` files ahead of the one being read and, counting every file not yet passed by a saved
    checkpoint, at most `cache_max_bytes` (the file the reader waits for is always fetched). `window[i]` blocks until
    file `i` is local. Files a checkpoint has moved past are deleted from the cache unless `keep_cache`.
    """

    def __init__(self, src: HFSource, snap: Snapshot, first: int):
        self.src, self.snap = src, snap
        self.sizes = [int(f.get("size") or 0) for f in snap.files]
        self.reading = self.released = self.next = first
        self.held = 0  # bytes of files in [released, next): fetched or being fetched, not passed by a checkpoint
        self.done: dict[int, Path | BaseException] = {}
        self.cond = threading.Condition()
        self.pool = ThreadPoolExecutor(max_workers=src.workers, thread_name_prefix="hf-download")
        self.closed = False
        with self.cond:
            self._schedule()

    def __len__(self) -> int:
        return len(self.snap.files)

    def __getitem__(self, i: int) -> Path:
        with self.cond:
            self.reading = i
            self._schedule()
            while i not in self.done:
                self.cond.wait()
            got = self.done[i]
        if isinstance(got, BaseException):
            raise got
        return got

    def _schedule(self) -> None:
        """Start the downloads the window allows (called with the lock held)."""
        while not self.closed and self.next < len(self.sizes):
            j, size = self.next, self.sizes[self.next]
            if j > self.reading and (j - self.reading > self.src.prefetch_files
                                     or self.held + size > self.src.cache_max_bytes):
                return
            self.held += size
            self.next += 1
            self.pool.submit(self._fetch, j)

    def _fetch(self, j: int) -> None:
        try:
            got: Path | BaseException = self.src._download_one((self.snap.files[j]["path"], self.snap.sha))
        except BaseException as exc:  # handed to the reader, which raises it
            got = exc
        with self.cond:
            self.done[j] = got
            self.cond.notify_all()

    def release_before(self, f: int) -> None:
        with self.cond:
            gone = [i for i in range(self.released, min(f, self.next)) if i in self.done]
            for i in gone:
                self.held -= self.sizes[i]
                path = self.done.pop(i)
                if not self.src.keep_cache and isinstance(path, Path):
                    _evict(path, shared={p.resolve() for p in self.done.values() if isinstance(p, Path)})
            self.released = max(self.released, gone[-1] + 1) if gone else self.released
            self._schedule()

    def close(self) -> None:
        """Stop starting downloads; those in flight finish in the background."""
        with self.cond:
            self.closed = True
        self.pool.shutdown(wait=False, cancel_futures=True)


def _evict(path: Path, shared: set[Path]) -> None:
    """Delete a downloaded file from the HF cache: the snapshot's symlink, and the blob it points to unless another
    fetched file of the window has the same content (`shared`)."""
    blob = path.resolve()
    for p in (path,) if blob in shared else (path, blob):
        try:
            p.unlink()
        except FileNotFoundError:
            pass
    log.debug("hf cache file deleted", file=str(path))


def _split_name(split: str) -> str:
    """A split name `datasets` accepts for a data_files key (e.g. "train"; any \\w+ name)."""
    return split if re.fullmatch(r"\w+(\.\w+)*", split) else "train"
