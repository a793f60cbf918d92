"""Local files and fsspec URLs (s3://, gs://, ...): JSONL (plain, .gz, .zst, .bz2, .xz), Parquet, plain text,
globs and directories, streamed record by record.

Positions are `{"file": i, "record": n, "offset": bytes | None, "row_group": g | None, "row": r | None}`:
the next item to read is record `n` of file `i`. Uncompressed text seeks to `offset` (a ranged read on an
object store); compressed files re-read and skip `n` lines; Parquet seeks to row group `g` and skips `r` rows
inside it. A text file opening with a UTF-16/32 byte-order mark is decoded as such (re-read and skipped on
resume, as compressed files are), and a `jsonl` file that is a JSON array written across lines is parsed whole, its
elements the records (`opens_json_array`; re-read and skipped too).

A file whose bytes cannot be decoded (truncated or corrupt compression, corrupt Parquet page, unsupported
type, not a regular file) ends with one `BadRecord` naming it and the record reached; the next file goes on,
and a resume meets the same reject. A file that cannot be read at all (gone, permission, I/O error) raises
`SourceError` (so does a network error): the job stops naming it (docs/operations.md, "Hostile inputs").
"""
from __future__ import annotations

import bz2
import codecs
import errno
import fnmatch
import glob as globmod
import hashlib
import io
import itertools
import lzma
import os
import re
import reprlib
import stat
import threading
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, Callable, Iterator, Mapping, TextIO

import fsspec
import orjson
import pyarrow as pa
import zstandard

from quality.lines import built_in_name, pipeline_name
from streamprep import registry
from streamprep.config import (ConfigError, MissingInput, check_utf8_name, json_kind, load_plugin, resolved_workers,
                               thaw)
from streamprep.sources.base import BadRecord, ReaderError, SourceError, one_line, read_failure

if TYPE_CHECKING:
    from streamprep.config import DatasetConfig

# stores whose paths open with a bucket (an Azure container): a path naming none is refused before any listing
OBJECT_STORES = ("s3://", "gs://", "gcs://", "az://", "abfs://")
IN_MEMORY = "memory://"  # the caller's in-process store, which other worker processes cannot see (check_in_memory)
EXCERPT = 300
PARQUET_BATCH = 1024
FULL_HASH_BYTES = 1 << 20  # a file `identity` hashes is hashed whole up to this size, else by head + tail
HEAD_TAIL_BYTES = 64 * 1024
READ_BUFFER = 1 << 20
# botocore's retries of one S3 request, under s3fs's own 5 attempts (each at most 15 s without a byte), unless the
# dataset's `config_kwargs` or AWS_MAX_ATTEMPTS / AWS_RETRY_MODE say otherwise. botocore's default (legacy, 5) made
# 25 attempts of each request: a store that stopped answering held the job 3 minutes (closing connections) to ~20
# (accepting and never answering) before the job could say so.
S3_RETRIES = {"mode": "standard", "max_attempts": 3}
# A record line longer than this is read through in pieces and rejected, never held: no record of text is near it
# (`quality.max_chars` is 2 M characters by default), and a file without a newline for gigabytes must not cost a
# worker (or the planner) that much memory.
MAX_LINE_BYTES = 256 << 20
ZSTD_READ = 16 * 1024  # compressed bytes read at a time
# ... and decoded at a time: a zstd block of a few bytes expands to 128 KiB, so 16 KiB of a highly compressed file
# were hundreds of MB in one call; a slice gives at most ~32 MiB however the file was made, ~4 KiB of text usually.
ZSTD_SLICE = 1024
# Decode errors of a file's bytes: deterministic, so they become a reject (a resume meets them again).
CONTENT_FAULTS = (EOFError, zlib.error, lzma.LZMAError, zstandard.ZstdError, ValueError, pa.ArrowException)
# Faults of the environment, not of the bytes: the job stops naming the file (a fix + re-run resumes).
REST_OF = "unreadable rest of "  # opens the reject of a file whose bytes stop decoding (the rest is skipped)
ENVIRONMENT_FAULTS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ConnectionError,
                      TimeoutError)
# ... and so is any error of these packages' (by the module of a class it is an instance of): a connection's, even
# where its type is a decoder's, an OSError without an errno (urllib's URLError, which the refusal's OSError is only
# the `reason` of; requests' errors) or a ValueError (a certificate aiohttp refused). A plug-in reader's network
# error was one reject of the file's "unreadable rest", the records after it lost in a run that ended complete.
NETWORK_PACKAGES = frozenset({"urllib", "http", "socket", "ssl", "requests", "urllib3", "aiohttp", "botocore",
                              "httpx", "httpcore"})
# Byte-order marks of UTF-32 before UTF-16: BOM_UTF32_LE starts with BOM_UTF16_LE.
WIDE_BOMS = ((codecs.BOM_UTF32_LE, "utf-32"), (codecs.BOM_UTF32_BE, "utf-32"), (codecs.BOM_UTF16_LE, "utf-16"),
             (codecs.BOM_UTF16_BE, "utf-16"))
# What a wide file's decoder gives for bytes it cannot decode: a lone surrogate, which no valid UTF-16/32 decodes to.
# The decoder works 8 KiB at a time, so an error raised there would lose the lines decoded before it in that chunk.
WIDE_DAMAGE = "\ud800"
# Names of tar archives (after a compression suffix): their member headers are no records (`refused`).
TAR_SUFFIXES = (".tar", ".tgz", ".tbz", ".tbz2", ".txz", ".tzst")
_wide_damage = threading.local()  # the last such error of this thread, for the reject's reason


def only_folders(path: str) -> str:
    """The hint of a glob's `no file/object matches` that matched folders: a glob ending in `/` asked for folders
    alone (`data/**/`), where "`**` reads folders at any depth" sent its writer round in a circle."""
    if path.endswith("/"):
        return f" (only folders do: a glob ending in `/` matches folders alone; `{path}*` reads the files in them)"
    return " (only folders do: `**` reads folders at any depth)"


def _mark_wide_damage(exc: UnicodeError) -> tuple[str, int]:
    _wide_damage.exc = exc
    return WIDE_DAMAGE, exc.end


codecs.register_error("streamprep.wide-damage", _mark_wide_damage)


def wide_encoding(head: bytes) -> str | None:
    """The encoding ("utf-16"/"utf-32", which read the mark for the byte order) of bytes opening with a UTF-16/32
    byte-order mark, else None: how a .txt/.jsonl file or a document is decoded."""
    return next((enc for bom, enc in WIDE_BOMS if head.startswith(bom)), None)


def detect_format(path: str) -> str:
    name = path.lower()
    for suffix in compressed_suffixes():
        if name.endswith(suffix) and _compression(path) is None:  # else its compressed bytes would be read as text
            raise ValueError(f"{path}: {suffix} compression is not available (for .zst: pip install zstandard)")
        name = name.removesuffix(suffix)
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        if why := refused(path, "parquet"):
            raise ValueError(why)
        return "parquet"
    if name.endswith(".txt"):
        return "txt"
    for plugin in registry.SOURCE_FORMATS.entries():  # formats of your own, by their suffixes
        if name.endswith(tuple(plugin.meta.get("suffixes", ()))):
            return plugin.name
    if why := refused(path, None):  # not "set 'format'": that read the archive's headers as records
        raise ValueError(why)
    raise ValueError(f"{path}: unknown file type (expected .jsonl/.json/.ndjson, each also .gz/.zst/.bz2/.xz, .parquet "
                     f"or .txt; set 'format')")


def refused(path: str, fmt: str | None) -> str | None:
    """Why the file at `path` is not read as format `fmt` (None: no format knows its name), else None. An archive
    is refused whatever `format` says: fsspec's zip codec reads a .zip's first member alone (the rest lost unsaid),
    and a tar's member headers read as records glued to each member's first one; so is a Parquet file compressed
    whole, which `format: parquet` read as a damaged Parquet file. A plug-in format reads such bytes as it will."""
    if _compression(path) == "zip":
        return f"{path}: a .zip archive (not read: unpack it, or compress each file as .gz, .zst, .bz2 or .xz)"
    if _plugin_format(fmt):
        return None
    name = path.lower()
    for suffix in compressed_suffixes():
        name = name.removesuffix(suffix)
    if name.endswith(TAR_SUFFIXES):
        return f"{path}: a tar archive (not read: unpack it, or compress each file as .gz, .zst, .bz2 or .xz)"
    if name.endswith(".parquet") and name != path.lower():  # pyarrow reads no compressed stream: "not a parquet file"
        return f"{path}: a Parquet file compressed whole (not read: decompress it; Parquet compresses its own pages)"
    return None


def _plugin_format(fmt: str | None) -> bool:
    """Whether `fmt` is a plug-in's format (registry.SOURCE_FORMATS), read by its own reader, not by this module."""
    return fmt in registry.SOURCE_FORMATS and registry.SOURCE_FORMATS.entry(fmt).target is not None


def check_entry(key: str, ds: dict[str, Any]) -> None:
    """Config validation of a dataset entry of files (its path resolved): the input exists (else MissingInput,
    so an optional dataset is skipped), and a single file's type is known. Every URL (each fsspec scheme this check
    is registered for: http(s)://, memory://, a plug-in's) is listed now, not only a bucket's: an http:// file that
    was not there stopped the job after its run dir was made, with a bare FileNotFoundError naming no key."""
    path = ds["path"]
    check_path(f"{key}.path", path)
    if path.startswith(OBJECT_STORES):
        _check_object_store_path(key, ds)
    elif registry.scheme_of(path):
        _check_listing(key, ds)
    if Path(path).is_file():  # a directory's odd files are rejects instead
        _check_format(f"{key}.path", path, ds["format"])
    _load_formats(key, ds)


def _load_formats(key: str, ds: dict[str, Any]) -> None:
    """The plug-in formats the dataset reads (its `format`, else those its files' names select), loaded now if
    declared as "module:attr" (`config.load_plugin`): one that fails to import blamed the first input file it was
    to read. Only the ones it uses: a broken format another job reads does not fail this one."""
    lazy = [e.name for e in registry.SOURCE_FORMATS.entries() if isinstance(e.target, str)]
    if not lazy:  # the usual case: nothing to list the files for
        return
    if ds["format"] is not None:
        used, where = {ds["format"]}, f"{key}.format"
    else:
        used, where = {_format_or_none(f) for f in expand(ds["path"], ds["storage_options"])}, f"{key}.path"
    for name in lazy:
        if name in used:
            load_plugin(registry.SOURCE_FORMATS, name, where)


def _format_or_none(path: str) -> str | None:
    """`detect_format`, or None for a file no format knows (a directory's such files are rejects)."""
    try:
        return detect_format(path)
    except ValueError:
        return None


def check_in_memory(cfg: dict[str, Any]) -> None:
    """Config check (registry.CHECKS): a `memory://` dataset is read where the job judges its units, which with
    `workers` > 1 or `ray_address` are other processes, where the caller's in-process store is empty: the job
    stopped after its run dir was made, "FileNotFoundError" for a file the caller had put there."""
    execution = cfg["execution"]
    if resolved_workers(execution["workers"]) == 1 and not execution["ray_address"]:
        return
    for i, ds in enumerate(cfg["datasets"]):
        if ds["path"].startswith(IN_MEMORY):
            why = "ray_address names a cluster" if execution["ray_address"] else \
                f"workers is {resolved_workers(execution['workers'])}"
            raise ConfigError(f"config: 'datasets[{i}].path': {ds['path']!r:.80} is the job process's in-memory "
                              f"store, which the worker processes that read units cannot see ({why}): use "
                              f"workers: 1 without ray_address, or a path on disk")


def check_path(key: str, path: str) -> None:
    """A local path, directory or glob named by config key `key` has input files (URLs are checked elsewhere)."""
    if registry.scheme_of(path):
        return
    try:
        _check_local_path(key, path)
    except OSError as exc:  # a folder on the way that cannot be read or listed (permissions)
        raise ConfigError(f"config: '{key}': {path}: cannot read {exc.filename or path}: "
                          f"{exc.strerror or one_line(exc)}") from None


def is_local_glob(path: str) -> bool:
    """A local path with glob characters that names no file as written (`data[1].jsonl` that exists is that file)."""
    return globmod.has_magic(path) and not os.path.lexists(path)


def _check_enterable(pattern: str) -> None:
    """Raise the OSError of the first folder a local glob that matches no file could not enter, unless it is
    missing: glob passes over a folder it cannot enter without a word, which made a glob behind a folder of no
    permission (`unread/*.jsonl`, `outer/*/a.jsonl` over `outer/sub/`) 'no file matches' where a plain path there
    says 'cannot read FOLDER: Permission denied'. Depth by depth, as glob walks: the folder before the first glob
    character, then the folders each segment matched (all below them for `**`), each listed for a segment with glob
    characters or entered for a plain one (a depth's glob misses no folder: every folder above it was entered)."""
    parts = Path(pattern).parts
    first = next(i for i, part in enumerate(parts) if globmod.has_magic(part))
    for depth in range(first, len(parts)):
        segment = parts[depth]
        reached = parts[:depth + 1] if segment == "**" else parts[:depth]  # `**` lists every folder below too
        folders = [Path(*reached)] if len(reached) == first else \
            sorted(map(Path, globmod.glob(os.path.join(*reached), recursive=True)))
        for folder in folders:
            try:
                if globmod.has_magic(segment):
                    os.scandir(folder).close()
                else:
                    os.lstat(folder / segment)
            except (FileNotFoundError, NotADirectoryError):  # nothing there: the glob matches no file, as it says
                pass
            except OSError as exc:  # the folder, not the name glob looked for in it
                raise OSError(exc.errno, exc.strerror, str(folder)) from None


def _check_local_path(key: str, path: str) -> None:
    if is_local_glob(path):
        files = expand(path)
        if not any(os.path.isfile(f) for f in files):
            _check_enterable(path)
            raise MissingInput(f"config: '{key}': no file matches {path}" + (only_folders(path) if files else ""))
    elif not Path(path).exists():
        raise MissingInput(f"config: '{key}': no such file or directory: {path}")
    elif not (Path(path).is_file() or Path(path).is_dir()):  # reading a FIFO/device blocks and cannot resume
        raise MissingInput(f"config: '{key}': {path} is not a regular file or directory (a FIFO, socket or device)")
    elif not (files := expand(path)):  # a file's list is itself: only a directory can be empty
        raise MissingInput(f"config: '{key}': directory has no input files: {path}")
    for f in files:  # no plan or checkpoint could name the file
        check_utf8_name(f"config: '{key}'", f, "the run records each input file by name")


def _no_credentials() -> tuple[type[BaseException], ...]:
    """The stores' "no credentials found at all" errors (botocore's for s3fs, google-auth's for gcsfs): a config
    error, as refused credentials are, rather than a bare exception, exit 1."""
    found: list[type[BaseException]] = []
    try:
        from botocore.exceptions import NoCredentialsError, PartialCredentialsError
        found += [NoCredentialsError, PartialCredentialsError]
    except ImportError:
        pass
    try:
        from google.auth.exceptions import DefaultCredentialsError
        found.append(DefaultCredentialsError)
    except ImportError:
        pass
    return tuple(found)


def _unreachable() -> tuple[type[BaseException], ...]:
    """What a store that cannot be reached raises once its client's retries are spent (botocore's for s3fs,
    aiohttp's for gcsfs), besides Python's own connection errors and timeouts."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    try:
        from botocore.exceptions import ConnectionError as BotoConnectionError, HTTPClientError
        found += [BotoConnectionError, HTTPClientError]
    except ImportError:
        pass
    try:
        from aiohttp import ClientConnectionError
        found.append(ClientConnectionError)
    except ImportError:
        pass
    return tuple(found)


def _status_error() -> tuple[type[BaseException], ...]:
    """What fsspec's http(s) filesystem raises for an error status other than 404 (aiohttp's): it escaped the
    check as a bare `ClientResponseError`, naming no key, and an optional dataset answering 403 was not skipped."""
    try:
        from aiohttp import ClientResponseError
    except ImportError:
        return ()
    return (ClientResponseError,)


def _check_object_store_path(key: str, ds: dict[str, Any]) -> None:
    """List the bucket now: a missing bucket, key or prefix (or refused credentials) is a config error before
    anything is written. A store that cannot be reached is a SourceError naming the key (exit 1: re-run once it is
    back), not the client's bare error. A path naming no
    bucket (`s3://`, `s3://*/prefix/`) is refused before any listing: s3fs's own error was a bare ValueError, exit 1."""
    path = ds["path"]
    scheme, _, rest = path.partition("://")
    bucket = rest.split("/", 1)[0]
    if not bucket or globmod.has_magic(bucket):
        raise ConfigError(f"config: '{key}.path': {path} names no bucket; expected {scheme}://<bucket>/<key, prefix "
                          f"or glob> (a glob cannot stand for the bucket)")
    try:
        _check_listing(key, ds)
    except MissingInput:  # "no object matches s3://nobucket/d/" said nothing of the bucket being the one missing
        if where := _missing_bucket(f"{scheme}://{bucket}", ds["storage_options"]):
            raise MissingInput(f"config: '{key}.path': no bucket named {bucket} at {where}: {path}") from None
        raise


def _missing_bucket(root: str, storage_options: Mapping[str, Any] | None) -> str | None:
    """Where the bucket `root` (`s3://b`) was looked for (the endpoint, else the scheme) when its own listing says it
    does not exist; None when it does, or when the listing fails otherwise (no permission to list it: not known)."""
    try:
        fs, bucket = filesystem(root, storage_options)
        fs.ls(bucket)
    except FileNotFoundError:  # (raised by the listing: `filesystem` itself finds nothing to miss)
        endpoint = getattr(getattr(getattr(fs, "s3", None), "meta", None), "endpoint_url", None)  # s3fs's client
        return endpoint or root.split("://")[0]
    except Exception:  # noqa: BLE001 - the listing's own error (an option it does not take...) is the one to show
        pass
    return None


def _check_listing(key: str, ds: dict[str, Any]) -> None:
    """A URL's listing finds its files (else MissingInput, as for a local path), and a single file's type is known
    (else ConfigError, as for a local path: an optional dataset is skipped only when its input is not there)."""
    path = ds["path"]
    try:
        found = expand(path, ds["storage_options"])
    except (FileNotFoundError, PermissionError, *_no_credentials()) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise MissingInput(f"config: '{key}.path': {path}: {first}") from None
    except TypeError as exc:  # an option the filesystem does not take
        raise MissingInput(f"config: '{key}.storage_options': {exc}") from None
    except ImportError as exc:  # the scheme's fsspec package is not installed (adlfs for az://, abfs://)
        raise ConfigError(f"config: '{key}.path': {path}: {one_line(exc)}") from None
    except ValueError as exc:  # fsspec's glob: "Invalid pattern: '**' can only be an entire path component"
        raise ConfigError(f"config: '{key}.path': {path}: {exc} (on disk `a**` reads as `a*`: write "
                          f"that)") from None
    except _status_error() as exc:  # http(s): refused or not there, as s3's, else the server's trouble
        answer = f"HTTP {exc.status} {exc.message}"
        if exc.status in (401, 403, 410):  # (a 404 is fsspec's FileNotFoundError: no file matches)
            raise MissingInput(f"config: '{key}.path': {path}: {answer}") from None
        if exc.status != 429 and exc.status < 500:
            raise ConfigError(f"config: '{key}.path': {path}: {answer}") from None
        raise SourceError(f"'{key}.path': cannot list {path}: the store cannot be reached ({answer}); re-run once "
                          f"it is reachable") from exc
    except _unreachable() as exc:  # not the input's fault, nor the config's: exit 1, as a read that fails later
        raise SourceError(f"'{key}.path': cannot list {path}: the store cannot be reached ({one_line(exc)}); "
                          f"re-run once it is reachable") from exc
    # http(s): a folder's URL is a page (its index), which isfile finds
    if found == [path] and (_listed_folder(path) or _redirected_to_folder(path, ds["storage_options"])):
        raise ConfigError(f"config: '{key}.path': {path} names a folder, which is not listed over {path.split(':')[0]} "
                          f"(its URL is a page, not a file): name a file, or a glob, `{path.rstrip('/')}/*.jsonl` "
                          f"reads the files the page links to")
    if not found or (globmod.has_magic(path) and all(_listed_folder(f) for f in found)):  # (a prefix's are objects)
        raise MissingInput(f"config: '{key}.path': no object matches {path}" + (only_folders(path) if found else ""))
    if found == [path]:  # a file there but not read is the config's fault, as on disk: not a missing input
        _check_format(f"{key}.path", path, ds["format"])


def _redirected_to_folder(path: str, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether an http(s) URL without its trailing '/' is answered at the same URL with it, as web servers send a
    folder's URL (`…/sub` → `…/sub/`, its index page): that page was read as a file, each of its lines a parse
    reject, and the run "complete". One HEAD, at validation only; not known (an error): False, read as before."""
    if not path.startswith(("http://", "https://")) or path.endswith("/"):
        return False
    try:
        fs, p = filesystem(path, storage_options)
        return fs.info(p).get("url") == path + "/"
    except Exception:  # noqa: BLE001 - the read that follows says what is wrong
        return False


def _check_format(key: str, path: str, fmt: str | None) -> None:
    """A file named alone is read: its type is known (`fmt`, or by its name), and no archive (`refused`)."""
    try:
        if fmt is None:
            detect_format(path)
        elif why := refused(path, fmt):
            raise ValueError(why)
    except ValueError as exc:
        raise ConfigError(f"config: '{key}': {exc}") from None


def expand(path: str, storage_options: Mapping[str, Any] | None = None) -> list[str]:
    """The sorted file list of a path, directory or glob, local or any fsspec URL (a prefix of an object store
    is a directory). A directory's hidden names are left out, a hidden folder's files with it (`.git/`, `.cache/`).
    A folder a glob matches without reaching into it is listed too (an object store's with a trailing '/'), which
    its reader makes a counted reject (`_globbed`)."""
    if "://" not in path:
        if is_local_glob(path):
            # (a set: `d/**/**/*.jsonl` gives a file once per way its `**`s can split the folders above it)
            return sorted(_globbed(set(globmod.glob(path, recursive=True)), os.path.isdir, _holds_anything))
        p = Path(path)
        return sorted(_walk(str(p))) if p.is_dir() else [path]
    fs, stripped = filesystem(path, storage_options)
    folders: set[str] = set()
    objects: list[str] = []  # folders a glob matched that are objects too
    # info first: on HTTP, isdir would GET the page to list its links; and as on disk, an object named with glob
    # characters as written (`br[1].jsonl`) is that object, and such a prefix (`w[1]/`) that prefix (a glob read `w1/`)
    kind = _kind(fs, stripped)
    if kind == "file":
        files = [stripped]
    elif globmod.has_magic(path) and kind != "directory":  # as the glob lists on disk: hidden names skipped, no
        # folder marker, and a trailing '/' matches folders alone (the filesystem strips it)
        dirs_only = "/" * path.endswith("/")
        matched = {p: info.get("type") for p, info in fs.glob(stripped + dirs_only, detail=True).items()
                   if _not_marker(p, info) and glob_shows(stripped, p.rstrip("/"))}
        folders = {p for p, kind in matched.items() if kind == "directory"}
        files = list(_globbed([p for p, kind in matched.items() if kind in ("file", "directory")],
                              folders.__contains__, lambda folder: _holds_objects(fs, folder)))
        root = "/".join(itertools.takewhile(lambda part: not globmod.has_magic(part), stripped.split("/")))
        objects = [] if dirs_only else _objects_among(fs, {f for f in folders if f.startswith(root + "/")})
    else:
        top = stripped.rstrip("/") + "/"  # hidden (a name, or a folder's, below the prefix), or a folder marker
        files = [p for p, info in fs.find(stripped, detail=True).items() if _not_marker(p, info) and not any(
                 n.startswith(".") for n in p.rstrip("/").removeprefix(top).split("/"))] if kind == "directory" or \
            fs.isdir(stripped) else []
    # an object before its folder; a key ending in '/' (not a marker) is listed as its folder, once: its reader's reject
    listed = sorted({(p.rstrip("/"), p in folders or p.endswith("/")) for p in files} | {(p, False) for p in objects})
    return [fs.unstrip_protocol(p) + "/" * folder for p, folder in listed]


def _kind(fs: fsspec.AbstractFileSystem, path: str) -> str | None:
    """The type `info` gives `path` ("file", "directory"), or None where `fs.isfile` would say False for an error
    (none there, as a glob's path usually is): the one request `isfile` made, telling a prefix too."""
    try:
        _drop_cached_folder(fs, path)  # an object named alone is read, though another dataset listed it as a folder
        return fs.info(path).get("type")
    except Exception:  # as fs.isfile: the listing or glob that follows raises what is wrong
        return None


def _not_marker(key: str, info: Mapping[str, Any]) -> bool:
    """Whether a listed key is other than a folder marker, a zero-byte key ending in '/' (`sub/`: S3 consoles, Spark,
    Hadoop). A non-empty one holds data no fsspec store opens (it drops the trailing '/'): it was left out without a
    word; it is listed, and its reader makes it one counted reject naming it (`_unread_folder`)."""
    return not key.endswith("/") or bool(info.get("size"))


def _listed_folder(path: str) -> bool:
    """Whether an entry `expand` listed is a folder (an object store's ends with '/': no request to tell)."""
    return path.endswith("/") if "://" in path else os.path.isdir(path)


def glob_shows(pattern: str, path: str) -> bool:
    """Whether Python's `glob` (recursive, as a local glob is listed) gives `path`, which the glob `pattern` matches
    ('/'-separated): its `*`, `?`, `[...]` and `**` pass over a name starting with '.', unless the pattern's segment
    starts with '.' (`**` always); a segment without glob characters names what it names. fsspec's glob matches
    hidden names, so an object store's glob read `.staging/` and `.b.jsonl` that the same glob on disk leaves out."""
    return _shows(tuple(pattern.split("/")), tuple(path.split("/")))


def _shows(pattern: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    if not pattern:
        return not parts
    head = pattern[0]
    if head == "**":  # no segment, or a name that is not hidden and `**` again
        return _shows(pattern[1:], parts) or (bool(parts) and not parts[0].startswith(".")
                                              and _shows(pattern, parts[1:]))
    if not parts or (parts[0].startswith(".") and globmod.has_magic(head) and not head.startswith(".")):
        return False
    return fnmatch.fnmatchcase(parts[0], head) and _shows(pattern[1:], parts[1:])


def reaches_into(path: str, folder: Path) -> bool:
    """Whether listing the local directory or glob `path` (as `expand` does) could list a file under `folder`
    (resolved): a run dir inside a dataset's folder would have the job read its own outputs as input. Erring on the
    side of refusing: a glob's folders are matched, not its file pattern; and a symlinked folder inside the dataset's
    folder that leads into the run dir is not followed (`**` would)."""
    if registry.scheme_of(path) or not is_local_glob(path):
        return not registry.scheme_of(path) and Path(path).is_dir() and folder.is_relative_to(Path(path).resolve())
    parts = Path(path).parts
    k = next(i for i, part in enumerate(parts) if globmod.has_magic(part))
    static = Path(*parts[:k]).resolve()
    if not folder.is_relative_to(static):
        return False
    pattern, rel = parts[k:-1], folder.relative_to(static).parts  # the pattern's folders, the folder's below it
    if "**" in parts[k:]:  # any depth, but glob's `**` skips hidden folders as its `*` does
        return not any(r.startswith(".") for r in rel)
    return len(pattern) >= len(rel) and all(fnmatch.fnmatchcase(r, g) and (g.startswith(".") or not r.startswith("."))
                                            for r, g in zip(rel, pattern))  # glob's `*` skips hidden names


def _globbed(matched: list[str], is_folder: Callable[[str], bool],
             holds_anything: Callable[[str], bool]) -> Iterator[str]:
    """The files of a glob's matches (local, or an object store's), and each folder it matches without reaching
    inside (`data/*` over `data/sub/`: a `*` names the folder, not its files), which its reader makes one counted
    reject naming it; they were left out without a word. A folder with nothing but hidden names in it holds nothing
    to lose."""
    inside: set[str] = set()   # the folders some match lies in
    for m in matched:
        parent = os.path.dirname(os.path.normpath(m))
        while parent and parent not in inside:
            inside.add(parent)
            parent = os.path.dirname(parent)
    for m in matched:  # a file, or a folder it reaches nothing in
        if not is_folder(m) or (os.path.normpath(m) not in inside and holds_anything(m)):
            yield m


def _holds_anything(folder: str) -> bool:
    try:
        return any(not name.startswith(".") for name in os.listdir(folder))
    except OSError:
        return True   # its reader's reject says why it cannot be listed


def _objects_among(fs: fsspec.AbstractFileSystem, folders: set[str]) -> list[str]:
    """The folders a glob matched that are also an object: a key that is the prefix of other keys (`x.jsonl` and
    `x.jsonl/a.jsonl`) is both, and fsspec's glob keeps one entry per name, the folder, so the object's records
    were never read. Told by its parent's listing, which the glob listed (cached: no request); so only the folders
    below the glob's root (`x.jsonl/**` matches `x.jsonl` too, and means what is under it)."""
    found: list[str] = []
    for parent in sorted({f.rsplit("/", 1)[0] for f in folders}):
        try:
            entries = fs.ls(parent, detail=True)
        except FileNotFoundError:
            continue
        found += [e["name"] for e in entries if e.get("type") == "file" and e["name"] in folders]
    return sorted(set(found))


def _holds_objects(fs: fsspec.AbstractFileSystem, folder: str) -> bool:
    """An object store's `_holds_anything`: a name under `folder` that is neither hidden nor a folder marker. A
    folder of nothing but its marker (`data/empty/`, an S3 console's "Create folder") is not found once a `**` glob's
    listing is cached (s3fs leaves the marker out of it): it holds nothing, as an empty folder on disk; the error
    refused the whole dataset, naming the folder. A non-empty key `folder/` is something (`_not_marker`), which that
    cached listing leaves out too: one found empty there is listed again (a `**` glob's match with nothing matched in
    it, as `x.jsonl/` under `**/*.jsonl`, was left out without the reject a `*` glob gave it)."""
    if not fs.dircache.get(folder, True):  # (a request only for such a folder: one listed fresh is not cached)
        fs.dircache.pop(folder, None)
    try:
        entries = fs.ls(folder, detail=True)
    except FileNotFoundError:
        return False
    return any(_not_marker(e["name"], e) and not e["name"].rstrip("/").rsplit("/", 1)[-1].startswith(".")
               for e in entries)


def _walk(top: str) -> Iterator[str]:
    """The files under a directory, hidden names and hidden folders' files left out, and each folder inside it
    that is not read, which its reader makes one counted reject naming it: a symlinked folder (not descended into:
    it may lead anywhere, the run dir included) and a folder that cannot be listed (permissions; `lost+found` at a
    volume's root, say, should not hold a dataset up). rglob skipped both silently, and their files with them.
    `top` itself that cannot be listed raises."""
    unlisted: list[OSError] = []
    for root, dirs, names in os.walk(top, onerror=unlisted.append):
        dirs[:] = [d for d in dirs if not d.startswith(".")]  # a hidden folder is not walked: `.git/`, `.cache/`
        yield from (os.path.join(root, name) for name in names if not name.startswith("."))
        yield from (os.path.join(root, d) for d in dirs if os.path.islink(os.path.join(root, d)))
    for exc in unlisted:
        if exc.filename == top:
            raise exc
        yield exc.filename


def _unread_folder(path: str, storage_options: Mapping[str, Any] | None = None) -> str:
    """Why a folder among a dataset's files is skipped (`_globbed`, `_walk`). A unit's reader does not know its
    dataset's path, so a folder that can be listed now says both ways it can have been left unread. An object
    store's may be a non-empty key ending in '/' (`_not_marker`): one LIST tells, for a reject only."""
    if "://" in path:  # an object store's: a glob's folder, or a key ending in '/'
        fs, p = filesystem(path, storage_options)
        fs.dircache.pop(p, None)  # (s3fs's listing of a prefix leaves the key out of its folder's)
        try:
            size = next((e.get("size") for e in fs.ls(p, detail=True) if e["name"] == p + "/"), None)
        except OSError:  # not there (or not listed now): a folder, as it was listed
            size = None
        if size:
            return (f"is an object of {size} bytes whose key ends in `/`, which names a folder on an object store "
                    f"(its reader drops the `/`), not read, skipped (copy it to a key without the trailing `/`)")
        return _NOT_READ_INTO
    if os.path.islink(path):
        return "is a symlinked folder, not followed, skipped (name it, or its target, as a dataset path of its own)"
    try:
        os.listdir(path)
    except OSError as exc:
        return f"is a folder that cannot be listed, skipped: {exc.strerror or one_line(exc)}"
    return _NOT_READ_INTO


_NOT_READ_INTO = ("is a folder not read into when the dataset's files were listed, skipped (a glob's `*` names the "
                  "folder, not its files: `**` reads folders at any depth; or it could not be listed then)")


def filesystem(path: str, storage_options: Mapping[str, Any] | None = None) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of `path` and the path inside it. `storage_options` (a dataset's mapping) go to
    the filesystem; without them s3fs and gcsfs read the standard environment (AWS_ENDPOINT_URL,
    AWS_ACCESS_KEY_ID, ..., GOOGLE_APPLICATION_CREDENTIALS)."""
    options = thaw(storage_options or {})  # plain dicts: fsspec may change them
    if path.startswith("s3://") and not (os.environ.get("AWS_MAX_ATTEMPTS") or os.environ.get("AWS_RETRY_MODE")):
        options["config_kwargs"] = {"retries": dict(S3_RETRIES), **(options.get("config_kwargs") or {})}
    return fsspec.core.url_to_fs(path, **options)


def input_filesystem(path: str, storage_options: Mapping[str, Any] | None = None
                     ) -> tuple[fsspec.AbstractFileSystem, str]:
    """`filesystem` of an input file `expand` listed as an object, to size, identify or open it: the object, not the
    size-0 folder s3fs's listing cache may make of it (`_drop_cached_folder`), whose size, identity and bytes were
    none (an `empty file` reject, recorded as 0 bytes)."""
    fs, p = filesystem(path, storage_options)
    if "://" in path:
        _drop_cached_folder(fs, p)
    return fs, p


def _drop_cached_folder(fs: fsspec.AbstractFileSystem, p: str) -> None:
    """Have the next `info` or `open` of `p` find an object `p`, where there is one: once a key that is also the
    prefix of other keys (`x.jsonl` beside `x.jsonl/a.jsonl`) was listed as a folder, s3fs's listing cache gives
    it as a size-0 folder. Its listing as a folder is dropped, and its parent's too unless that names it a file, so
    the store is asked. No request: the parent's listing is read from the cache only."""
    if fs.dircache.pop(p, None) is not None and fs._parent(p) in fs.dircache and fs.info(p).get("type") != "file":
        fs.invalidate_cache(p)


def open_input(path: str, storage_options: Mapping[str, Any] | None = None, *, start: int = 0,
               end: int | None = None, compression: str | None = None) -> BinaryIO:
    """The one place an input file is opened: local path or fsspec URL, bytes [start, end) of the stored file.

    On an object store a read from `start` is a ranged GET, so a resume fetches only what it needs. With
    `compression` the decompressed stream is returned and the range must be the whole file."""
    fs, p = input_filesystem(path, storage_options)
    if compression is not None and (start or end is not None):
        raise ValueError(f"{path}: a byte range of a {compression} file cannot be decoded")
    if end is not None and end - start <= MAX_LINE_BYTES:  # a unit of the plan: exactly its bytes, in one ranged read
        data = fs.cat_file(p, start=start, end=end)
        if len(data) > end - start:  # the whole file (fsspec's answer from a server without ranges): read as the range,
            raise _refused_ranges(path)  # it gave the file's start for every unit's (a plan saved before such a server)
        return io.BytesIO(data)
    fh = fs.open(p, "rb")
    if end is not None:  # a range the plan stretched to a newline far away: streamed, never held whole
        fh.seek(start)
        return io.BufferedReader(_Range(fh, end - start), READ_BUFFER)
    if compression == "zstd":
        return io.BufferedReader(_ZstdReader(fh), io.DEFAULT_BUFFER_SIZE)
    if compression in ("bz2", "xz"):
        return io.BufferedReader(_StreamsReader(fh, compression), io.DEFAULT_BUFFER_SIZE)
    if compression is not None:
        return fsspec.compression.compr[compression](fh, mode="rb")
    if start:
        fh.seek(start)
    return fh


class _ZstdReader(io.RawIOBase):
    """The decoded bytes of a .zst stream, frame after frame. Unlike zstandard's stream_reader, a stream that
    ends inside a frame raises EOFError (as gzip does): a truncated file is a counted reject, not a short file.
    Bytes that fail to decode (a damaged later frame, garbage or zeros after the last frame) raise only once what
    the same read decoded before them is given out, so every line before the damage is kept (as `zstd -dc` does).
    The bytes are decoded ZSTD_SLICE at a time, so the output of one call stays bounded."""

    def __init__(self, fh: BinaryIO):
        super().__init__()
        self.fh, self.dctx = fh, zstandard.ZstdDecompressor()
        self.frame: Any = None
        self.out, self.pos = b"", 0
        self.data = memoryview(b"")  # compressed bytes read and not yet decoded
        self.fault: zstandard.ZstdError | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        while self.pos >= len(self.out):
            if self.fault is not None:
                raise self.fault
            if not self.data:
                self.data = memoryview(self.fh.read(ZSTD_READ))
                if not self.data:
                    if self.frame is not None and not self.frame.eof:
                        raise EOFError("Compressed file ended before the end-of-stream marker was reached")
                    return 0
            data, self.data = self.data[:ZSTD_SLICE], self.data[ZSTD_SLICE:]
            try:
                if self.frame is None or self.frame.eof:
                    self.frame = self.dctx.decompressobj()
                self.out, self.pos = self.frame.decompress(data), 0
                if self.frame.eof and self.frame.unused_data:  # the next frame opens in this slice
                    self.data = memoryview(self.frame.unused_data + self.data.tobytes())
            except zstandard.ZstdError as exc:  # raised by the next call, after the frames decoded before it
                if "too much memory" in str(exc):  # a valid frame whose window passes zstd's 128 MiB default
                    exc = zstandard.ZstdError(f"{exc} (a window over 128 MiB, as `zstd --long=31` writes: "
                                              f"recompress it without --long)")
                self.fault, self.out, self.pos = exc, b"", 0
        n = min(len(buf), len(self.out) - self.pos)
        buf[:n] = self.out[self.pos:self.pos + n]
        self.pos += n
        return n

    def close(self) -> None:
        self.fh.close()
        super().close()


class _StreamsReader(io.RawIOBase):
    """The decoded bytes of a .bz2 or .xz file, stream after stream. BZ2File and LZMAFile end the file quietly at
    bytes after a stream that do not open another one (a damaged later stream: it and every record in it vanished,
    no reject). Here those bytes raise, after everything decoded before them is given out (as gzip and
    `_ZstdReader` do); only the xz format's stream padding (zero bytes, a multiple of 4, which `xz -t` accepts) is
    skipped. A file of no bytes is empty (an "empty file" reject, as for .gz and .zst), not a truncated stream.
    Output is decoded `len(buf)` bytes at a time: a highly compressed block is never held whole."""

    def __init__(self, fh: BinaryIO, compression: str):
        super().__init__()
        self.fh = fh
        self.new: Callable[[], Any] = bz2.BZ2Decompressor if compression == "bz2" else lzma.LZMADecompressor
        self.padded = compression == "xz"
        self.dec: Any = None  # the stream being decoded; None before the first
        self.data = b""  # compressed bytes read and not yet given to a decoder
        self.zeros = 0  # stream padding read since the last stream ended

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        if not len(buf):
            return 0
        while True:
            if self.dec is None or self.dec.eof:  # between streams: the next one, padding or the end
                if not self.data:
                    self.data = self.fh.read(io.DEFAULT_BUFFER_SIZE)
                    if not self.data:
                        self._check_padding()
                        return 0
                if self.padded and self.dec is not None:
                    rest = self.data.lstrip(b"\0")
                    self.zeros += len(self.data) - len(rest)
                    self.data = rest
                    if not rest:
                        continue
                    self._check_padding()
                self.dec, self.zeros = self.new(), 0
            if self.dec.needs_input:
                if not self.data:
                    self.data = self.fh.read(io.DEFAULT_BUFFER_SIZE)
                    if not self.data:
                        raise EOFError("Compressed file ended before the end-of-stream marker was reached")
                data, self.data = self.data, b""
            else:
                data = b""
            out = self.dec.decompress(data, len(buf))  # damage raises here, before any of this call's output
            if self.dec.eof:
                self.data = self.dec.unused_data
            if out:
                buf[:len(out)] = out
                return len(out)

    def _check_padding(self) -> None:
        if self.zeros % 4:
            raise lzma.LZMAError(f"{self.zeros} zero byte(s) after a stream, not xz stream padding (a multiple of 4 bytes)")

    def close(self) -> None:
        self.fh.close()
        super().close()


class _Range(io.RawIOBase):
    """`fh` from where it stands (`size` bytes of it at most), as a raw stream, so that io.BufferedReader gives it
    fast line iteration, peek() and reads of the size asked for. A decoder (`decoded`) raises on the read that
    meets damage and loses what that read had gathered: it is read with `read1`, one decoded chunk at a time, so
    that read gathered nothing and every line decoded before the damage is kept (as `gzip -dc` keeps them)."""

    def __init__(self, fh: BinaryIO, size: int | None = None, decoded: bool = False):
        super().__init__()
        self.fh, self.size, self.left = fh, size, size
        self.read_some = getattr(fh, "read1", fh.read) if decoded else fh.read
        self.base = None if decoded or not fh.seekable() else fh.tell()  # seeking a decoded stream decodes it again

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return self.base is not None

    def tell(self) -> int:
        if self.base is None:
            raise io.UnsupportedOperation("seek")
        return self.fh.tell() - self.base

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Within the range, from its start (or from where it stands): how `bounded_lines` reads a long line again."""
        if self.base is None or whence not in (io.SEEK_SET, io.SEEK_CUR):
            raise io.UnsupportedOperation("seek")
        if whence == io.SEEK_CUR:
            offset += self.tell()
        self.fh.seek(self.base + offset)
        if self.size is not None:
            self.left = max(self.size - offset, 0)
        return offset

    def readinto(self, buf: Any) -> int:
        want = len(buf) if self.left is None else min(len(buf), self.left)
        data = self.read_some(want) if want else b""
        buf[:len(data)] = data
        if self.left is not None:
            self.left -= len(data)
        return len(data)

    def close(self) -> None:
        self.fh.close()
        super().close()


def _compression(path: str) -> str | None:
    return fsspec.utils.infer_compression(path)


def compressed_suffixes() -> tuple[str, ...]:
    """The suffixes of files read decompressed: every one `_compression` knows (fsspec's codecs: .lzma too, whose
    .tar.lzma or .parquet.lzma a list of our own missed), zip aside (an archive), and the four a missing codec is
    named for (.zst without zstandard)."""
    known = (f".{ext}" for ext, codec in fsspec.utils.compressions.items() if codec != "zip")
    return tuple(dict.fromkeys((".gz", ".bz2", ".xz", ".zst", *known)))


def _bad_record_fault(bad: BadRecord) -> str | None:
    """What is wrong with a plug-in reader's BadRecord (a bug of the plug-in, as a KeyError it raises), else None:
    its reason and raw excerpt not strings (bytes stopped the job at its reject line, an int or a dict was written
    as it was), its check not a string, a name streamprep writes itself (`duplicate`: counted and audited as
    exact duplicates; `quality.lines.pipeline_name`, which refuses such a gate too; `parse` is its default) or a
    built-in gate's (`pii`: counted as that gate's rejects; `quality.lines.built_in_name`, as for a gate). A lone
    surrogate in a string is no fault: its reject line escapes it."""
    for field in ("reason", "raw", "check"):
        value = getattr(bad, field)
        if not isinstance(value, str):
            return f"its {field} is {type(value).__name__} {reprlib.repr(value)}, not a string"
    if not bad.check:
        return "its check is empty"
    clash = bad.check != "parse" and (pipeline_name(bad.check) or built_in_name(bad.check))
    return f"its check {bad.check!r} is {clash}" if clash else None


def _network_fault(exc: BaseException) -> bool:
    """Whether `exc` is an error of a network library (NETWORK_PACKAGES), whatever its type."""
    return any(cls.__module__.partition(".")[0] in NETWORK_PACKAGES for cls in type(exc).__mro__)


def _content_fault(exc: Exception) -> bool:
    """Whether `exc` is a fault of the file's bytes (a reject: a resume meets it again), not of reading them."""
    if _network_fault(exc):
        return False
    if isinstance(exc, OSError):  # gzip/bz2/pyarrow decode errors are OSErrors without an errno
        return exc.errno is None and not isinstance(exc, ENVIRONMENT_FAULTS)
    return isinstance(exc, CONTENT_FAULTS)


def no_ranges(path: str, exc: BaseException) -> ConfigError | None:
    """The error for `path` when `exc` is fsspec's HTTP file finding that the server answers a Range request with the
    whole file (a bare ValueError): a read past the first block of a file over 5 MB (a compressed or Parquet one, a
    line file's resume) was a reject of the file's rest, exit 0. Re-running meets it again, so it is no reject nor a
    resumable error: exit 2, naming the file. None for any other exception."""
    if type(exc) is not ValueError or "support range requests" not in str(exc):
        return None
    return _refused_ranges(path)


def _refused_ranges(path: str) -> ConfigError:
    return ConfigError(f"cannot read input file {path}: its server does not support range requests, which reading "
                       f"it over {path.split(':')[0]} needs: download it and read it from disk")


class LongLine:
    """A line over MAX_LINE_BYTES, as `bounded_lines` gives it: its first bytes, and its length as `len()` (so the
    readers count it as they count any line)."""

    __slots__ = ("head", "size")

    def __init__(self, head: bytes, size: int):
        self.head, self.size = head, size

    def __len__(self) -> int:
        return self.size


# What converting a Parquet value to Python can raise for a value it cannot give: bytes that are not UTF-8 in a
# string column, a timestamp or date past Python's year 9999 (OverflowError or ValueError, by type)
_UNCONVERTIBLE = (UnicodeDecodeError, OverflowError, ValueError)


def parquet_rows(batch: pa.RecordBatch, path: str, number: Callable[[int], Any]) -> list[dict[str, Any] | BadRecord]:
    """A Parquet batch's rows as dicts. A value Python cannot hold (bytes that are not UTF-8 in a string column,
    which Parquet stores as written; a timestamp past year 9999, in a column the job may not even read) failed the
    whole batch, and the file's rest with it, at every resume: then row by row, and each such row is one reject
    naming the column and the record (`number`: N of the batch's row r), the rows beside it kept."""
    try:
        return batch.to_pylist()
    except _UNCONVERTIBLE:
        pass
    rows: list[dict[str, Any] | BadRecord] = []
    for r in range(batch.num_rows):
        row = batch.slice(r, 1)
        try:
            rows += row.to_pylist()
        except _UNCONVERTIBLE as exc:
            column = next((name for name, col in zip(row.schema.names, row.columns) if _unconvertible(col)), "?")
            why = f"undecodable bytes in column {column!r}" if isinstance(exc, UnicodeDecodeError) else \
                f"a value Python cannot hold in column {column!r}"
            detail = f"{exc.reason} at byte {exc.start}" if isinstance(exc, UnicodeDecodeError) else \
                f"{type(exc).__name__}: {exc}"
            rows.append(BadRecord(f"{why} at record {number(r)} of {path}: {detail}", ""))
    return rows


def _unconvertible(column: pa.Array) -> bool:
    try:
        column.to_pylist()
    except _UNCONVERTIBLE:
        return True
    return False


def bounded_lines(fh: BinaryIO) -> Iterator[bytes | LongLine]:
    """`fh`'s lines as iterating it gives them, but a line over MAX_LINE_BYTES as a `LongLine`, read through
    READ_BUFFER at a time (~0.1 µs a line more than `for line in fh`). A line longer than READ_BUFFER is measured
    before it is held (`_long_line`): `readline(MAX_LINE_BYTES + 1)` built up to 256 MiB (twice) to find it too long."""
    readline = fh.readline
    rewind = fh.seekable()
    piece = min(READ_BUFFER, MAX_LINE_BYTES + 1)
    while line := readline(piece):
        yield line if len(line) < piece else _long_line(fh, line, rewind)


def _wide_bounded_lines(text: TextIO, encoding: str) -> Iterator[str | LongLine]:
    """`text`'s lines (a UTF-16/32 file decoded), but a line over MAX_LINE_BYTES of the file's bytes as a
    `LongLine`, read through READ_BUFFER characters at a time: `for line in text` held a line of any length (a 300
    MB one was a 157 M-character record, ~570 MB of a worker). A line of READ_BUFFER characters or more is gathered
    (at most MAX_LINE_BYTES held, once, as in a compressed file: a decoded stream is not read back) and measured in
    the file's bytes; a shorter one cannot pass the limit (4 bytes a character at most). Undecodable bytes raise
    their error after the lines before them."""
    readline, width = text.readline, f"{encoding}-le"  # (the byte count of either order, without a mark)
    piece = min(READ_BUFFER, MAX_LINE_BYTES // 4 + 1)
    while line := readline(piece):
        if WIDE_DAMAGE in line:
            raise _wide_damage.exc
        if len(line) < piece or line.endswith("\n"):
            yield line
            continue
        head, size, pieces = line[:EXCERPT].encode("utf-8", "replace"), len(line.encode(width)), [line]
        while not line.endswith("\n") and (line := readline(piece)):
            if WIDE_DAMAGE in line:
                raise _wide_damage.exc
            size += len(line.encode(width))
            if pieces and size <= MAX_LINE_BYTES:
                pieces.append(line)
            else:
                pieces = []
        yield "".join(pieces) if size <= MAX_LINE_BYTES else LongLine(head, size)


def _long_line(fh: BinaryIO, line: bytes, rewind: bool) -> bytes | LongLine:
    """The line `line` (READ_BUFFER bytes of it read) opens, read on READ_BUFFER at a time: whole when it is
    within MAX_LINE_BYTES, else a `LongLine`. A stream that can seek back (`rewind`: an uncompressed file) is
    measured first, holding none of it, and a line within the limit read again; a decoded one (compressed) cannot
    be, so its pieces are kept until the line passes the limit (at most MAX_LINE_BYTES held, once)."""
    head, size = line[:EXCERPT], len(line)
    if rewind:
        start = fh.tell() - size
        while not line.endswith(b"\n") and (line := fh.readline(READ_BUFFER)):
            size += len(line)
        if size > MAX_LINE_BYTES:
            return LongLine(head, size)
        fh.seek(start)
        return fh.read(size)
    pieces = [line]
    while not line.endswith(b"\n") and size <= MAX_LINE_BYTES and (line := fh.readline(READ_BUFFER)):
        pieces.append(line)
        size += len(line)
    if size <= MAX_LINE_BYTES:
        return b"".join(pieces)
    del pieces
    while not line.endswith(b"\n") and (line := fh.readline(READ_BUFFER)):
        size += len(line)
    return LongLine(head, size)


def long_line(line: LongLine, path: str, n: Any) -> BadRecord:
    """The reject of a line over MAX_LINE_BYTES (`n`: its line number, or the mark a range's worker writes)."""
    return BadRecord(f"line {n} of {path} is {line.size} bytes, over the {MAX_LINE_BYTES}-byte limit of a record, "
                     "skipped", line.head.decode("utf-8", "replace"))


def opens_json_array(head: bytes, probe: int | None = None) -> bool:
    """Whether a `jsonl` file whose first bytes are `head` (through its first line that is not blank, or more) may be
    a JSON array written across lines instead, as `json.dump(records, f, indent=2)` writes a `.json` file: that
    line, past a UTF-8 BOM and the blank lines, opens with `[` and does not parse alone (`[` alone, `[{...},`), a
    line no JSON Lines file opens with. An array on one line is a JSON Lines line (a reject: `a JSON list, not an
    object`); its reader tells the rest (`LocalSource._json_array`: a log line such as `[INFO] …` opening JSON
    Lines). `probe`: judge only the file's first `probe` bytes, as the planner reads them (a line not ending in them
    opens an array if it opens with `[`), so that a range's reader decides as the planner did: a first range read
    whole beside the others the planner cut read their records twice."""
    body = head[:probe] if probe is not None else head
    first, newline, _ = body.removeprefix(codecs.BOM_UTF8).lstrip().partition(b"\n")
    if not first.startswith(b"["):
        return False
    if not newline and probe is not None and len(body) >= probe:
        return True
    try:
        orjson.loads(first)
    except orjson.JSONDecodeError:
        return True
    return False


def opening(lines: Iterator[bytes | LongLine]) -> list[bytes | LongLine]:
    """The lines opening a file up to its first that is not blank (`opens_json_array` looks past the blank ones:
    `\n[` is an array too), taken from `lines`."""
    taken: list[bytes | LongLine] = []
    for line in lines:
        taken.append(line)
        if type(line) is not bytes or line.removeprefix(codecs.BOM_UTF8).strip():  # a BOM opening a blank line
            break
    return taken


def reads_as_json_lines(data: bytes, lines: int = 100) -> bool:
    """Whether a file that opens like a JSON array (`opens_json_array`) but is none is JSON Lines after all: one of
    the next `lines` lines after its opening one parses alone as a JSON object (log lines, `[INFO] …`, then
    records), where none of a broken array's does (`  {`, `"text": …,`, `{...},`)."""
    start = data.find(b"\n", re.match(rb"\s*", data).end()) + 1  # past the opening line
    while 0 < start < len(data) and lines > 0:
        end = data.find(b"\n", start)
        line = data[start:] if end < 0 else data[start:end]
        if line.strip():
            lines -= 1
            try:
                if isinstance(orjson.loads(line), dict):
                    return True
            except orjson.JSONDecodeError:
                pass
        start = 0 if end < 0 else end + 1
    return False


def _special(path: str) -> bool:
    """A local FIFO, socket or device: opening one may block forever, and it cannot be resumed."""
    try:
        return "://" not in path and not stat.S_ISREG(Path(path).stat().st_mode)
    except OSError:
        return False  # gone or a broken symlink: opening it / broken_link report that


def broken_link(path: str) -> str | None:
    """What a local symlink that leads to no file is (a loop, a -> b -> a; or a link whose target is missing), or
    None: the same on every run while it stays so, so a counted reject naming it, not a stop: a directory of many
    inputs is not held up by one dead link. Its target appearing later is a changed input (`identity`)."""
    try:
        os.stat(path)
    except OSError as exc:
        dead = _dead_link(path, exc)
        if dead is not None:
            return "is a symlink loop" if "symlink_loop" in dead else \
                f"is a dangling symlink (to {dead['dangling_symlink']})"
    return None


def _dead_link(path: str, exc: OSError) -> dict[str, Any] | None:
    """What the `stat` of `path` that raised `exc` says of a symlink leading to no file (its identity's fields), or
    None for any other fault."""
    if exc.errno == errno.ELOOP:
        return {"symlink_loop": True}
    if exc.errno in (errno.ENOENT, errno.ENOTDIR) and os.path.islink(path):
        return {"dangling_symlink": os.readlink(path)}
    return None


def identity(path: str, storage_options: Mapping[str, Any] | None = None, hashed: bool = False) -> dict[str, Any]:
    """What tells a changed file apart, without reading it (a dataset of many small files must not be read by
    the driver at every start): a local file's size and mtime in nanoseconds; an object's ETag (S3) or
    etag/generation (GCS) and size; else the listing's size and mtime. Only a store that gives neither (plain
    HTTP), or `hashed` (a checkpoint an earlier streamprep wrote recorded hashes), reads the file: a sha256 of
    all of it, or above FULL_HASH_BYTES of its head and tail plus its mtime. Raises SourceError when the file
    cannot be listed or read. An object store's folder (a glob's match, `_globbed`) has no identity but its name."""
    if "://" in path and path.endswith("/"):
        return {"path": path, "folder": True}
    if "://" not in path:
        try:
            st = os.stat(path)  # one stat: a dataset may have millions of files
        except OSError as exc:
            if (dead := _dead_link(path, exc)) is not None:
                return {"path": path, **dead}
            raise SourceError(f"cannot read input file {path}: {one_line(exc)}") from exc
        if not stat.S_ISREG(st.st_mode):
            return {"path": path, "special": True}
        if not hashed:
            return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    try:
        fs, p = input_filesystem(path, storage_options)
        info = fs.info(p)
        size = info.get("size")
        etag = info.get("ETag") or info.get("etag")
        if etag and not hashed:
            version = info.get("VersionId") or info.get("generation")
            return {"path": path, "size": size, "etag": str(etag).strip('"'),
                    **({"version": str(version)} if version else {})}
        mtime = info.get("mtime") or info.get("LastModified")  # local / s3-style listings
        if mtime is not None and size is not None and not hashed:
            return {"path": path, "size": size, "mtime": str(mtime)}
        return _hashed_identity(fs, p, path, size, mtime)
    except OSError as exc:
        raise SourceError(f"cannot read input file {path}: {one_line(exc)}") from exc


def _hashed_identity(fs: Any, p: str, path: str, size: int | None, mtime: Any) -> dict[str, Any]:
    """The identity that reads the file: its sha256 up to FULL_HASH_BYTES, else of its head and tail plus mtime."""
    h = hashlib.sha256()
    with fs.open(p, "rb") as fh:
        if size is None or size <= FULL_HASH_BYTES:
            for block in iter(lambda: fh.read(HEAD_TAIL_BYTES), b""):
                h.update(block)
            return {"path": path, "size": size, "sha256": h.hexdigest()[:32]}
        h.update(fh.read(HEAD_TAIL_BYTES))
        try:
            fh.seek(size - HEAD_TAIL_BYTES)
            tail = fh.read(HEAD_TAIL_BYTES)
        except ValueError as exc:  # a server without range requests: read through to the tail (as the reader will)
            if not no_ranges(path, exc):
                raise
            tail = _tail(fs, p)
        h.update(tail)
    return {"path": path, "size": size, "mtime": str(mtime) if mtime is not None else None,
            "sha256_head_tail": h.hexdigest()[:32]}


def _tail(fs: Any, p: str) -> bytes:
    """The last HEAD_TAIL_BYTES of `p`, read from its start as a stream: its server does not support range requests,
    and a file over fsspec's 5 MB block ended the job on a bare ValueError naming no file (whose advice, unit_mb
    above the file's size, could not help)."""
    tail = b""
    with fs.open(p, "rb", block_size=0) as fh:
        while block := fh.read(1 << 20):
            tail = (tail + block)[-HEAD_TAIL_BYTES:]
    return tail


def _zero_bytes(path: str, storage_options: Mapping[str, Any] | None) -> bool:
    """Whether a file that failed to decode holds 0 bytes: then it is the `empty file` a 0-byte .jsonl or .gz is (and
    an hf:// one), not pyarrow's 'unreadable Parquet file …: Parquet file size is 0 bytes' or a .bz2/.xz's
    'unreadable rest of … after record 0 … EOFError'."""
    try:
        fs, p = input_filesystem(path, storage_options)
        return fs.size(p) == 0
    except OSError:  # gone meanwhile: not known to be empty
        return False


def _undecodable(exc: UnicodeDecodeError, line: bytes, path: str, n: Any) -> BadRecord:
    """The reject of line `n` whose bytes are not UTF-8, naming the cause and the byte (a .txt or a .jsonl line)."""
    return BadRecord(f"undecodable bytes at line {n} of {path}: {exc.reason} at byte {exc.start}",
                     line[:EXCERPT].decode("utf-8", "replace"))


class LocalSource:
    """Files matched by one dataset entry's `path`, read in sorted order."""

    def __init__(self, dataset: DatasetConfig):
        self.path = dataset.path
        self.format = dataset.format
        self.storage_options = thaw(dataset.storage_options or {})
        self.files = expand(self.path, self.storage_options)
        if not self.files:
            raise FileNotFoundError(f"no file matches {self.path}")

    @classmethod
    def open(cls, dataset: DatasetConfig, cache_dir: Path, max_concurrent_downloads: int = 8,
             **options: Any) -> "LocalSource":
        """The scheme registry's constructor (registry.SCHEMES, "" and the fsspec schemes): files need only their
        dataset entry, not the cache or the download limits of remote schemes."""
        return cls(dataset)

    @classmethod
    def reader(cls, fmt: str | None, storage_options: Mapping[str, Any] | None) -> "LocalSource":
        """A source without a file list, for `read_file` alone (a worker reading one unit of the plan)."""
        src = cls.__new__(cls)
        src.path, src.format, src.files = "", fmt, []
        src.storage_options = thaw(storage_options or {})
        return src

    def fingerprint(self, recorded: Mapping[str, Any] | None = None, fresh: bool = False) -> dict[str, Any]:
        """Every file's identity; checkpoints record it so a resume over a changed file is refused. A file whose
        `recorded` identity holds a hash is hashed again, so a checkpoint an earlier streamprep wrote still resumes.
        `fresh`: taken again in the same process (the check before a dataset is done), over the path listed again
        (one listing, as a resume does), so a file added to its folder or glob, or gone from it, meanwhile shows as
        new or gone; else the run was done without the added file and without a word. An object store's identities
        come from the listing its filesystem keeps, which never expires (s3fs, gcsfs): a replaced object kept the
        ETag it had at the start, so its cache is dropped first (one LIST per 1,000 objects)."""
        files = self.files
        if fresh:
            if "://" in self.path:
                filesystem(self.path, self.storage_options)[0].invalidate_cache()
            files = expand(self.path, self.storage_options)   # `identity`'s `info` reads an object store's listing
            files = [f for f in files if "://" in f or os.path.lexists(f)]  # a local file named alone: gone, as an object
        hashed = {f.get("path") for f in (recorded or {}).get("files") or []
                  if isinstance(f, dict) and ("sha256" in f or "sha256_head_tail" in f)}
        return {"files": [identity(f, self.storage_options, f in hashed) for f in files]}

    def iter_records(self, start: dict[str, Any] | None = None) -> Iterator[tuple[dict[str, Any] | BadRecord, dict[str, Any]]]:
        start = start or {"file": 0, "record": 0}
        for i in range(start["file"], len(self.files)):
            path = self.files[i]
            here = start if i == start["file"] else {"file": i, "record": 0}
            yield from self.read_file(i, path, here)

    def read_file(self, i: int, path: str, here: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
        """File `i`'s records from `here`; a failure ends the file with one reject, or raises SourceError (see
        module doc). Ingest reads a compressed or Parquet-less file this way, as one stream unit."""
        nxt = {"file": i + 1, "record": 0}
        if _listed_folder(path):  # a folder `expand` listed as not read
            yield BadRecord(f"{path} {_unread_folder(path, self.storage_options)}", ""), nxt
            return
        if _special(path):
            yield BadRecord(f"{path} is not a regular file (FIFO, socket or device), skipped", ""), nxt
            return
        if "://" not in path and (broken := broken_link(path)):
            yield BadRecord(f"{path} {broken}, skipped", ""), nxt
            return
        try:
            fmt = self.format or detect_format(path)
            if why := refused(path, fmt):
                raise ValueError(why)
        except ValueError as exc:
            yield BadRecord(f"unsupported file, skipped: {exc}", ""), nxt
            return
        reader = self._plugin if _plugin_format(fmt) else {"parquet": self._parquet, "document": self._document}.get(fmt, self._lines)
        record = here.get("record", 0)
        try:
            for item, pos in reader(i, path, fmt, here):
                record = pos.get("record", record) if pos.get("file") == i else record
                yield item, pos
        except ReaderError:
            raise
        except Exception as exc:
            if refused_ranges := no_ranges(path, exc):
                raise refused_ranges from exc
            where = f"{path} after record {record}"
            if not _content_fault(exc):
                raise read_failure(f"cannot read input file {where}: {one_line(exc)}", exc) from exc
            empty = record == 0 and _zero_bytes(path, self.storage_options)
            yield BadRecord(f"empty file {path}" if empty else f"{REST_OF}{where}, skipped: {one_line(exc)}", ""), nxt

    def _lines(self, i: int, path: str, fmt: str, pos: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
        comp = _compression(path)
        n = pos.get("record", 0)
        offset = pos.get("offset") if comp is None else None
        with open_input(path, self.storage_options, start=offset or 0, compression=comp) as raw:
            fh = io.BufferedReader(_Range(raw, decoded=comp is not None),
                                   io.DEFAULT_BUFFER_SIZE if comp else READ_BUFFER)
            if not offset:
                wide = wide_encoding(fh.peek(4)[:4])
                if wide is not None:
                    yield from self._wide_lines(i, path, fmt, n, fh, wide)
                    return
            lines = bounded_lines(fh)
            if not offset and fmt == "jsonl":
                lead = opening(lines)
                raw = b"".join(lead) if all(type(x) is bytes for x in lead) else b""  # as the file holds them
                if raw and opens_json_array(raw):
                    head = raw.removeprefix(codecs.BOM_UTF8)
                    data = head + fh.read(MAX_LINE_BYTES + 1 - len(head))
                    if (array := self._json_array(i, path, n, data)) is not None:
                        del data  # up to MAX_LINE_BYTES, parsed: not held while its records are judged
                        yield from array
                        return
                    lines = bounded_lines(io.BytesIO(raw + data[len(head):]))  # JSON Lines after all
                else:
                    lines = itertools.chain(lead, lines)
            if not offset:
                offset = None if comp else 0
                for _ in range(n):  # compressed (or a position without offset): skip what was consumed
                    line = next(lines, None)
                    if line is None:
                        break
                    if offset is not None:
                        offset += len(line)
            empty = n == 0
            for line in lines:
                empty = False
                n += 1
                if offset is not None:
                    offset += len(line)
                nxt = {"file": i, "record": n, "offset": offset}
                if type(line) is LongLine:
                    yield long_line(line, path, n), nxt
                    continue
                if n == 1 and line.startswith(codecs.BOM_UTF8):  # a UTF-8 BOM opens the file, not the record
                    line = line[len(codecs.BOM_UTF8):]
                yield (self._parse_json(line, path, n) if fmt == "jsonl" else self._parse_text(line, path, n)), nxt
            if empty:
                yield BadRecord(f"empty file {path}", ""), {"file": i + 1, "record": 0}

    @staticmethod
    def _json_array(i: int, path: str, n: int, data: bytes) -> Iterator[tuple[Any, dict[str, Any]]] | None:
        """A `jsonl` file that is a JSON array written across lines (`opens_json_array`; `data`, the file from its
        first line that is not blank, up to MAX_LINE_BYTES + 1 bytes): its elements are its records, parsed whole
        (as the Hub's `datasets` reads a `.json` array); a resume parses it again and skips `n`. Each of its lines was
        a `malformed JSON` reject and nothing was kept: 9 158 rejects for a 300-record ShareGPT file, the run
        "complete". None: no array but JSON Lines after all (`reads_as_json_lines`), read as such."""
        nxt = {"file": i + 1, "record": 0}
        first = data[(k := re.match(rb"\s*", data).end()):k + EXCERPT]
        excerpt = first[:first.find(b"\n") + 1 or None].decode("utf-8", "replace")  # of its first line
        if len(data) > MAX_LINE_BYTES:
            return iter([(BadRecord(f"{path} is a JSON array (its first line opens with `[`) of over {MAX_LINE_BYTES} "
                                    "bytes, the limit of one read whole, skipped: write it as JSON Lines, one object "
                                    "a line (`jq -c '.[]'`)", excerpt), nxt)])
        try:
            records = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            if reads_as_json_lines(data):
                return None
            return iter([(BadRecord(f"{path} opens as a JSON array (its first line opens with `[`) but is not valid "
                                    f"JSON, skipped: {exc}", excerpt), nxt)])
        return LocalSource._elements(i, path, n, records)

    @staticmethod
    def _elements(i: int, path: str, n: int, records: Any) -> Iterator[tuple[Any, dict[str, Any]]]:
        """A parsed JSON array's elements from the `n`-th on, each a record, or a reject naming it."""
        nxt = {"file": i + 1, "record": 0}
        if not records:
            yield BadRecord(f"empty file {path}", ""), nxt
        for k in range(n, len(records)):
            rec = records[k]
            item = rec if isinstance(rec, dict) else BadRecord(
                f"element {k + 1} of the JSON array {path} is {json_kind(rec)}, not an object",
                orjson.dumps(rec)[:EXCERPT].decode("utf-8", "replace"))
            yield item, {"file": i, "record": k + 1, "offset": None}

    def _wide_lines(self, i: int, path: str, fmt: str, n: int, fh: BinaryIO,
                    encoding: str) -> Iterator[tuple[Any, dict[str, Any]]]:
        """A file opening with a UTF-16/32 byte-order mark (else its NUL bytes would pass as UTF-8 text), decoded
        in the byte order the mark gives; a resume re-reads and skips `n` lines. Bytes the encoding cannot
        decode end the file with one reject (UnicodeDecodeError is a content fault), after every line before them."""
        lines = _wide_bounded_lines(io.TextIOWrapper(fh, encoding=encoding, errors="streamprep.wide-damage",
                                                     newline="\n"), encoding)
        for _ in range(n):
            if next(lines, None) is None:
                break
        empty = n == 0
        for line in lines:
            empty = False
            n += 1
            if type(line) is LongLine:
                item: Any = long_line(line, path, n)
            else:
                item = (self._parse_json if fmt == "jsonl" else self._parse_text)(line.encode(), path, n)
            yield item, {"file": i, "record": n, "offset": None}
        if empty:
            yield BadRecord(f"empty file {path}", ""), {"file": i + 1, "record": 0}

    @staticmethod
    def _parse_json(line: bytes, path: str, n: int) -> dict[str, Any] | BadRecord:
        if not line.strip():
            return BadRecord(f"blank line {n} in {path}", "")
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            try:  # orjson says "str is not valid UTF-8: surrogates not allowed" at char 0, whatever the byte and place
                line.decode("utf-8")
            except UnicodeDecodeError as bad:
                return _undecodable(bad, line, path, n)
            return BadRecord(f"malformed JSON at line {n} of {path}: {exc}", line[:EXCERPT].decode("utf-8", "replace"))
        if not isinstance(obj, dict):
            return BadRecord(f"line {n} of {path} is {json_kind(obj)}, not an object",
                             line[:EXCERPT].decode("utf-8", "replace"))
        return obj

    @staticmethod
    def _parse_text(line: bytes, path: str, n: int) -> dict[str, Any] | BadRecord:
        """One `txt` line as a record. A blank line (ASCII whitespace only, as `_parse_json` tells one) is a parse
        reject naming its file and line, as in a `.jsonl`, not a record whose empty text no reject could place."""
        if not line.strip():
            return BadRecord(f"blank line {n} in {path}", "")
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            return _undecodable(exc, line, path, n)
        return {"text": text.rstrip("\r\n")}

    def _document(self, i: int, path: str, fmt: str, pos: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
        """The whole file is one record (for small prose files such as docs), UTF-8 or, opening with a UTF-16/32
        byte-order mark, decoded in the mark's byte order (as the line formats read it); a 0-byte file is an
        `empty file` reject naming it."""
        with open_input(path, self.storage_options, compression=_compression(path)) as fh:
            raw = fh.read()
        nxt = {"file": i + 1, "record": 0}
        if not raw:  # named, as a 0-byte .txt/.jsonl is: its schema reject ("text is empty") named no file
            yield BadRecord(f"empty file {path}", ""), nxt
            return
        try:
            yield {"text": raw.decode(wide_encoding(raw) or "utf-8-sig"), "path": Path(path).name}, nxt
        except UnicodeDecodeError as exc:
            yield BadRecord(f"undecodable bytes in {path}: {exc.reason} at byte {exc.start}", ""), nxt

    def _plugin(self, i: int, path: str, fmt: str, pos: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
        """A registered format (registry.SOURCE_FORMATS): its reader over the file's (decompressed) bytes yields
        records or BadRecords; a resume re-reads the file and skips the `record` items already consumed.

        What the reader raises is judged as a built-in format's faults are (module doc): damaged bytes (damaged
        compression, a ValueError such as a UnicodeDecodeError, its own or a read's) are a reject of the file's
        unreadable rest, an I/O error (a network error too, e.g. urllib3's, not an OSError) stops the job. Any
        other exception (a TypeError, a KeyError: a bug of the plug-in, not of the file) is a ReaderError naming
        the format, its module, the file and the record: it read "cannot read input file … cannot read input file
        …", the plug-in unnamed. So is a BadRecord that no reject line can be made of (`_bad_record_fault`)."""
        entry = registry.SOURCE_FORMATS.entry(fmt)
        read = entry.load()
        n, done = 0, pos.get("record", 0)
        with open_input(path, self.storage_options, compression=_compression(path)) as fh:
            try:
                for n, item in enumerate(read(fh, path), 1):
                    if isinstance(item, BadRecord) and (why := _bad_record_fault(item)):
                        raise ReaderError(f"source format {fmt!r} ({registry.module_of(entry.target)}) yielded a "
                                          f"BadRecord reading {path} as record {n}: {why}")
                    if n > done:
                        yield item, {"file": i, "record": n}
            except Exception as exc:
                if isinstance(exc, (OSError, ReaderError)) or _content_fault(exc) or _network_fault(exc):
                    raise
                raise ReaderError(f"source format {fmt!r} ({registry.module_of(entry.target)}) raised reading {path} "
                                  f"after record {n}: {one_line(exc)}") from exc

    def _parquet(self, i: int, path: str, fmt: str, pos: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
        """Only the footer and the row groups from `row_group` on are read (ranged reads on an object store)."""
        import pyarrow.parquet as pq  # here, not at the top: the job's driver imports this module

        n = pos.get("record", 0)
        with open_input(path, self.storage_options) as fh:
            try:
                pf = pq.ParquetFile(fh)
            except Exception as exc:  # pyarrow raises ArrowInvalid/OSError subclasses for bad files
                if no_ranges(path, exc):  # its footer, at the end of a file over 5 MB: `read_file` says so
                    raise
                why = f"empty file {path}" if _zero_bytes(path, self.storage_options) else \
                    f"unreadable Parquet file {path}: {exc}"
                yield BadRecord(why, ""), {"file": i + 1, "record": 0}
                return
            if pf.metadata.num_rows == 0:
                yield BadRecord(f"empty file {path}", ""), {"file": i + 1, "record": 0}
                return
            g0, skip = pos.get("row_group") or 0, pos.get("row") or 0
            for g in range(g0, pf.num_row_groups):
                rows = 0 if g != g0 else skip
                table = pf.read_row_group(g)
                for batch in table.slice(rows).to_batches(PARQUET_BATCH):
                    for rec in parquet_rows(batch, path, lambda r, first=n + 1: first + r):
                        n += 1
                        rows += 1
                        yield rec, {"file": i, "record": n, "row_group": g, "row": rows}
