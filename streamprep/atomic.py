"""Crash-safe file writes: every file a run produces goes through here (tmp + fsync + rename)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import orjson


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it survives power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def tmp_path(path: str | os.PathLike) -> Path:
    """Temporary sibling of `path`; unique per process so concurrent writers never share one."""
    p = Path(path)
    return p.with_name(f".{p.name}.tmp.{os.getpid()}")


def sweep_tmp(root: str | os.PathLike) -> list[Path]:
    """Remove temporary files left by killed writers (call only while holding the run lock)."""
    removed = []
    for p in Path(root).rglob(".*.tmp.*"):
        if p.is_file() and p.name.rsplit(".tmp.", 1)[-1].isdigit():
            p.unlink()
            removed.append(p)
    return removed


def commit(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """fsync `tmp`, rename it over `final`, fsync the directory."""
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    fsync_dir(Path(final).parent)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Atomically replace `path` with `data`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def dumps_json(obj: Any) -> bytes:
    """Canonical JSON bytes (sorted keys, indented, trailing newline) so equal data gives equal files."""
    return orjson.dumps(obj, option=orjson.OPT_SORT_KEYS | orjson.OPT_INDENT_2) + b"\n"


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_bytes(path, dumps_json(obj))


def read_json(path: str | os.PathLike) -> Any:
    return orjson.loads(Path(path).read_bytes())


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()
