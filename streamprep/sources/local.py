"""Local and fsspec files (JSONL, JSONL.gz, Parquet, plain text, globs), streamed record by record.

Positions are `{"file": i, "record": n, "offset": bytes | None, "row_group": g | None, "row": r | None}`:
the next item to read is record `n` of file `i`. Uncompressed text seeks to `offset`; gzip re-reads and
skips `n` lines; Parquet seeks to row group `g` and skips `r` rows inside it.

A file whose bytes cannot be decoded (truncated or corrupt compression, corrupt Parquet page, unsupported
type, not a regular file) ends with one `BadRecord` naming it and the record reached; the next file goes on,
and a resume meets the same reject. A file that cannot be read at all (gone, permission, I/O error) raises
`SourceError`: the job stops naming it (docs/operations.md, "Hostile inputs").
"""
from __future__ import annotations

import codecs
import glob as globmod
import hashlib
import lzma
import stat
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import fsspec
import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from streamprep.sources.base import BadRecord, SourceError, one_line

if TYPE_CHECKING:
    from streamprep.config import DatasetConfig

EXCERPT = 300
PARQUET_BATCH = 1024
FULL_HASH_BYTES = 1 << 20  # files up to this size are hashed whole; bigger ones by head + tail (+ mtime)
HEAD_TAIL_BYTES = 64 * 1024
# Decode errors of a file's bytes: deterministic, so they become a reject (a resume meets them again).
CONTENT_FAULTS = (EOFError, zlib.error, lzma.LZMAError, ValueError, pa.ArrowException)
# Faults of the environment, not of the bytes: the job stops naming the file (a fix + re-run resumes).
REST_OF = "unreadable rest of "  # opens the reject of a file whose bytes stop decoding (the rest is skipped)
ENVIRONMENT_FAULTS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, ConnectionError,
                      TimeoutError)


def detect_format(path: str) -> str:
    name = path.lower()
    for suffix in (".gz", ".bz2", ".xz", ".zst"):
        if name.endswith(suffix) and _compression(path) is None:  # else its compressed bytes would be read as text
            raise ValueError(f"{path}: {suffix} compression is not available (for .zst: pip install zstandard)")
        name = name.removesuffix(suffix)
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith(".txt"):
        return "txt"
    raise ValueError(f"{path}: unknown file type (expected .jsonl, .jsonl.gz, .parquet or .txt; set 'format')")


def expand(path: str) -> list[str]:
    """The sorted file list of a path or glob, local or any fsspec URL."""
    if "://" not in path:
        if globmod.has_magic(path):
            return sorted(p for p in globmod.glob(path, recursive=True) if not Path(p).is_dir())
        p = Path(path)
        return sorted(str(x) for x in p.rglob("*") if not x.is_dir() and not x.name.startswith(".")) if p.is_dir() else [path]
    fs, stripped = fsspec.core.url_to_fs(path)
    files = sorted(p for p in (fs.glob(stripped) if globmod.has_magic(path) else [stripped]) if fs.isfile(p))
    return [fs.unstrip_protocol(p) for p in files]


def _compression(path: str) -> str | None:
    return fsspec.utils.infer_compression(path)


def _content_fault(exc: Exception) -> bool:
    if isinstance(exc, OSError):  # gzip/bz2/pyarrow decode errors are OSErrors without an errno
        return exc.errno is None and not isinstance(exc, ENVIRONMENT_FAULTS)
    return isinstance(exc, CONTENT_FAULTS)


def _special(path: str) -> bool:
    """A local FIFO, socket or device: opening one may block forever, and it cannot be resumed."""
    try:
        return "://" not in path and not stat.S_ISREG(Path(path).stat().st_mode)
    except OSError:
        return False  # gone: opening it reports that


def identity(path: str) -> dict[str, Any]:
    """What tells a replaced file apart: size and a sha256 of the whole file, or (above FULL_HASH_BYTES) of
    its head and tail plus its mtime. Raises SourceError when the file cannot be read."""
    if _special(path):
        return {"path": path, "special": True}
    try:
        fs, p = fsspec.core.url_to_fs(path)
        info = fs.info(p)
        size = info.get("size")
        h = hashlib.sha256()
        with fs.open(p, "rb") as fh:
            if size is None or size <= FULL_HASH_BYTES:
                for block in iter(lambda: fh.read(HEAD_TAIL_BYTES), b""):
                    h.update(block)
                return {"path": path, "size": size, "sha256": h.hexdigest()[:32]}
            h.update(fh.read(HEAD_TAIL_BYTES))
            fh.seek(size - HEAD_TAIL_BYTES)
            h.update(fh.read(HEAD_TAIL_BYTES))
        mtime = info.get("mtime") or info.get("LastModified")  # local / s3-style listings
        return {"path": path, "size": size, "mtime": str(mtime) if mtime is not None else None,
                "sha256_head_tail": h.hexdigest()[:32]}
    except OSError as exc:
        raise SourceError(f"cannot read input file {path}: {one_line(exc)}") from exc


class LocalSource:
    """Files matched by one dataset entry's `path`, read in sorted order."""

    def __init__(self, dataset: DatasetConfig):
        self.path = dataset.path
        self.format = dataset.format
        self.files = expand(self.path)
        if not self.files:
            raise FileNotFoundError(f"no file matches {self.path}")

    def fingerprint(self) -> dict[str, Any]:
        """Every file's identity; checkpoints record it so a resume over a replaced file is refused."""
        return {"files": [identity(f) for f in self.files]}

    def iter_records(self, start: dict[str, Any] | None = None) -> Iterator[tuple[dict[str, Any] | BadRecord, dict[str, Any]]]:
        start = start or {"file": 0, "record": 0}
        for i in range(start["file"], len(self.files)):
            path = self.files[i]
            here = start if i == start["file"] else {"file": i, "record": 0}
            yield from self.read_file(i, path, self.format, here)

    @staticmethod
    def read_file(i: int, path: str, fmt: str | None, here: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
        """File `i`'s records from `here`; a failure ends the file with one reject, or raises SourceError (see
        module doc). Ingest reads a compressed or Parquet-less file this way, as one stream unit."""
        nxt = {"file": i + 1, "record": 0}
        if _special(path):
            yield BadRecord(f"{path} is not a regular file (FIFO, socket or device), skipped", ""), nxt
            return
        try:
            fmt = fmt or detect_format(path)
        except ValueError as exc:
            yield BadRecord(f"unsupported file, skipped: {exc}", ""), nxt
            return
        reader = {"parquet": LocalSource._parquet, "document": LocalSource._document}.get(fmt, LocalSource._lines)
        record = here.get("record", 0)
        try:
            for item, pos in reader(i, path, fmt, here):
                record = pos.get("record", record) if pos.get("file") == i else record
                yield item, pos
        except Exception as exc:
            where = f"{path} after record {record}"
            if not _content_fault(exc):
                raise SourceError(f"cannot read input file {where}: {one_line(exc)}") from exc
            yield BadRecord(f"{REST_OF}{where}, skipped: {one_line(exc)}", ""), nxt

    @staticmethod
    def _lines(i: int, path: str, fmt: str, pos: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
        comp = _compression(path)
        n = pos.get("record", 0)
        offset = pos.get("offset") if comp is None else None
        with fsspec.open(path, "rb", compression=comp) as fh:
            if offset:
                fh.seek(offset)
            else:
                for _ in range(n):  # gzip (or a position without offset): skip what was consumed
                    if not fh.readline():
                        break
                offset = None if comp else fh.tell()
            empty = n == 0
            for line in fh:
                empty = False
                n += 1
                if offset is not None:
                    offset += len(line)
                if n == 1 and line.startswith(codecs.BOM_UTF8):  # a UTF-8 BOM opens the file, not the record
                    line = line[len(codecs.BOM_UTF8):]
                nxt = {"file": i, "record": n, "offset": offset}
                parse = LocalSource._parse_json if fmt == "jsonl" else LocalSource._parse_text
                yield parse(line, path, n), nxt
            if empty:
                yield BadRecord(f"empty file {path}", ""), {"file": i + 1, "record": 0}

    @staticmethod
    def _parse_json(line: bytes, path: str, n: int) -> dict[str, Any] | BadRecord:
        if not line.strip():
            return BadRecord(f"blank line {n} in {path}", "")
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            return BadRecord(f"malformed JSON at line {n} of {path}: {exc}", line[:EXCERPT].decode("utf-8", "replace"))
        if not isinstance(obj, dict):
            return BadRecord(f"line {n} of {path} is a JSON {type(obj).__name__}, not an object",
                             line[:EXCERPT].decode("utf-8", "replace"))
        return obj

    @staticmethod
    def _parse_text(line: bytes, path: str, n: int) -> dict[str, Any] | BadRecord:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            return BadRecord(f"undecodable bytes at line {n} of {path}: {exc.reason} at byte {exc.start}",
                             line[:EXCERPT].decode("utf-8", "replace"))
        return {"text": text.rstrip("\r\n")}

    @staticmethod
    def _document(i: int, path: str, fmt: str, pos: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
        """The whole file is one record (for small prose files such as docs)."""
        with fsspec.open(path, "rb", compression=_compression(path)) as fh:
            raw = fh.read()
        nxt = {"file": i + 1, "record": 0}
        try:
            yield {"text": raw.decode("utf-8-sig"), "path": Path(path).name}, nxt
        except UnicodeDecodeError as exc:
            yield BadRecord(f"undecodable bytes in {path}: {exc.reason} at byte {exc.start}", ""), nxt

    @staticmethod
    def _parquet(i: int, path: str, fmt: str, pos: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
        n = pos.get("record", 0)
        with fsspec.open(path, "rb") as fh:
            try:
                pf = pq.ParquetFile(fh)
            except Exception as exc:  # pyarrow raises ArrowInvalid/OSError subclasses for bad files
                yield BadRecord(f"unreadable Parquet file {path}: {exc}", ""), {"file": i + 1, "record": 0}
                return
            if pf.metadata.num_rows == 0:
                yield BadRecord(f"empty file {path}", ""), {"file": i + 1, "record": 0}
                return
            g0, skip = pos.get("row_group") or 0, pos.get("row") or 0
            for g in range(g0, pf.num_row_groups):
                rows = 0 if g != g0 else skip
                table = pf.read_row_group(g)
                for batch in table.slice(rows).to_batches(PARQUET_BATCH):
                    for rec in batch.to_pylist():
                        n += 1
                        rows += 1
                        yield rec, {"file": i, "record": n, "row_group": g, "row": rows}
