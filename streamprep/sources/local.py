"""Local and fsspec files (JSONL, JSONL.gz, Parquet, plain text, globs), streamed record by record.

Positions are `{"file": i, "record": n, "offset": bytes | None, "row_group": g | None, "row": r | None}`:
the next item to read is record `n` of file `i`. Uncompressed text seeks to `offset`; gzip re-reads and
skips `n` lines; Parquet seeks to row group `g` and skips `r` rows inside it.
"""
from __future__ import annotations

import glob as globmod
from pathlib import Path
from typing import Any, Iterator

import fsspec
import orjson
import pyarrow.parquet as pq

from streamprep.sources.base import BadRecord

EXCERPT = 300
PARQUET_BATCH = 1024


def detect_format(path: str) -> str:
    name = path.lower()
    for suffix in (".gz", ".bz2", ".xz", ".zst"):
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
            return sorted(p for p in globmod.glob(path, recursive=True) if Path(p).is_file())
        p = Path(path)
        return sorted(str(x) for x in p.rglob("*") if x.is_file() and not x.name.startswith(".")) if p.is_dir() else [path]
    fs, stripped = fsspec.core.url_to_fs(path)
    files = sorted(p for p in (fs.glob(stripped) if globmod.has_magic(path) else [stripped]) if fs.isfile(p))
    return [fs.unstrip_protocol(p) for p in files]


def _compression(path: str) -> str | None:
    return fsspec.utils.infer_compression(path)


class LocalSource:
    """Files matched by one dataset entry's `path`, read in sorted order."""

    def __init__(self, dataset_cfg: dict[str, Any]):
        self.path = dataset_cfg["path"]
        self.format = dataset_cfg.get("format")
        self.files = expand(self.path)
        if not self.files:
            raise FileNotFoundError(f"no file matches {self.path}")

    def fingerprint(self) -> dict[str, Any]:
        out = []
        for f in self.files:
            fs, p = fsspec.core.url_to_fs(f)
            info = fs.info(p)
            out.append({"path": f, "size": info.get("size")})
        return {"files": out}

    def iter_records(self, start: dict[str, Any] | None = None) -> Iterator[tuple[dict[str, Any] | BadRecord, dict[str, Any]]]:
        start = start or {"file": 0, "record": 0}
        for i in range(start["file"], len(self.files)):
            path = self.files[i]
            here = start if i == start["file"] else {"file": i, "record": 0}
            fmt = self.format or detect_format(path)
            reader = {"parquet": self._parquet, "document": self._document}.get(fmt, self._lines)
            yield from reader(i, path, fmt, here)

    def _lines(self, i: int, path: str, fmt: str, pos: dict[str, Any]) -> Iterator[tuple[Any, dict[str, Any]]]:
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
                nxt = {"file": i, "record": n, "offset": offset}
                yield (self._parse_json(line, path, n) if fmt == "jsonl" else self._parse_text(line, path, n)), nxt
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
            yield {"text": raw.decode("utf-8"), "path": Path(path).name}, nxt
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
