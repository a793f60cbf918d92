"""Crash-safe file writes: every file a run produces goes through here (tmp + fsync + rename)."""
from __future__ import annotations

import hashlib
import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import orjson


# What writing a file can fail with for want of room or rights; a write, flush or fsync raising one names no file
WRITE_FAULTS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM, errno.EROFS})
TMP_MARK = ".streamprep-tmp."  # in every temporary name, so a sweep never touches a file we did not create


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename inside it survives power loss."""
    with naming(path):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def name_file(exc: OSError, path: str | os.PathLike) -> None:
    """Make `exc` name the file the run was writing: `path` when it names none (a write's, flush's or fsync's
    error of `WRITE_FAULTS`), the final name when it names a temporary one. The CLI's line then says which file
    (and folder) wants room or rights: a bare "[Errno 28] No space left on device", or ".x.streamprep-tmp.4710",
    did not."""
    if exc.filename is None:
        if exc.errno in WRITE_FAULTS:
            exc.filename = str(path)
        return
    tmp = Path(os.fsdecode(exc.filename))
    if is_tmp_name(tmp.name):
        exc.filename = str(tmp.with_name(tmp.name[1:].rsplit(TMP_MARK, 1)[0]))
        if exc.filename2 is not None and os.fsdecode(exc.filename2) == exc.filename:
            exc.filename2 = None  # os.replace(tmp, final): "final -> final" said nothing more


@contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """Writes of `path` (or of its temporary sibling) in the block: an OSError out of it names `path` (`name_file`)."""
    try:
        yield
    except OSError as exc:
        name_file(exc, path)
        raise


def tmp_path(path: str | os.PathLike) -> Path:
    """Temporary sibling of `path`; unique per process so concurrent writers never share one."""
    p = Path(path)
    return p.with_name(f".{p.name}{TMP_MARK}{os.getpid()}")


def is_tmp_name(name: str) -> bool:
    """True for a name `tmp_path` produces (`.<name>.streamprep-tmp.<pid>`)."""
    return name.startswith(".") and TMP_MARK in name and name.rsplit(TMP_MARK, 1)[1].isdigit()


def sweep_tmp(root: str | os.PathLike) -> list[Path]:
    """Remove temporary files left by killed writers (call only while holding the lock of `root`).

    Only names `tmp_path` makes are removed, and symlinked folders are not descended into.
    """
    removed = []
    for folder, _dirs, names in os.walk(root):  # os.walk does not follow symlinks by default
        for name in names:
            p = Path(folder) / name
            if is_tmp_name(name) and not p.is_symlink() and p.is_file():
                p.unlink()
                removed.append(p)
    return removed


def escaping_symlinks(root: str | os.PathLike) -> list[Path]:
    """Symlinks under `root` that lead outside it: writing through one would change a file that is not ours."""
    top = Path(root).resolve()
    found = []
    for folder, dirs, names in os.walk(top):
        for name in dirs + names:
            p = Path(folder) / name
            if p.is_symlink() and not p.resolve().is_relative_to(top):
                found.append(p)
    return found


def nofollow(path: str, flags: int) -> int:
    """`open(..., opener=nofollow)`: fail rather than write through a symlink planted at `path`."""
    return os.open(path, flags | os.O_NOFOLLOW, 0o666)


def commit(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """fsync `tmp`, rename it over `final`, fsync the directory."""
    with naming(final):
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
    fsync_dir(Path(final).parent)


@contextmanager
def writing(path: str | os.PathLike, buffering: int = -1, durable: bool = True) -> Iterator[BinaryIO]:
    """An open temporary sibling of `path` (no symlink followed) that becomes `path` when the block ends without
    an error (fsync, rename, directory fsync), and is removed when it raises: for files written piece by piece.

    `durable=False` skips both fsyncs, for a scratch file that no later attempt of the job reads (resume removes
    it): the rename still shows readers the whole file or none, and a killed process loses nothing it wrote;
    only a machine crash can, and the resume after one removes the file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = tmp_path(path)
    try:
        with naming(path):
            with open(tmp, "wb", buffering=buffering, opener=nofollow) as fh:
                yield fh
                if durable:
                    fh.flush()
                    os.fsync(fh.fileno())
            os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes, durable: bool = True) -> None:
    """Atomically replace `path` with `data` (`durable`: see `writing`)."""
    with writing(path, durable=durable) as fh:
        fh.write(data)


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
