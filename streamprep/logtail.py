"""`streamprep logs RUN_DIR [-n N] [--follow]`: the run log, followed across rotation like `tail -F`.

The run log is written by a RotatingFileHandler: on rollover it closes streamprep.log, renames
.4 -> .5, … , .1 -> .2, streamprep.log -> .1 and opens a new streamprep.log. The follower keeps its
file open, so after a rename it can still read the rest of the old file. When the name points at a
different inode (or disappears) it drains the open file, then moves to that file's successor in the
chain — the file now one number lower (or streamprep.log itself) — checking that the chain did not
shift while it opened it. Several rollovers between two polls are therefore followed file by file and
every line is printed exactly once, in order, as long as a file is not deleted (rotated past the last
backup) before it is read. A file truncated in place (same inode, smaller size) is read from the start; one
removed (or its folder) and made again by a new job is followed from the new file's start, said once.
"""
from __future__ import annotations

import errno
import os
import sys
import time
from pathlib import Path
from typing import IO, Callable, Iterator

from streamprep.config import printable
from streamprep.layout import RunLayout
from streamprep.logs import LOG_NAME

POLL_S = 0.2
READ_CHUNK = 1 << 16


def log_path(run_dir: str | Path) -> Path:
    return RunLayout(run_dir).logs_dir / LOG_NAME


def _backup(path: Path, i: int) -> Path:
    return path if i == 0 else path.with_name(f"{path.name}.{i}")


def _backups(path: Path) -> list[int]:
    """Numbers of existing rotated files, ascending (1 = newest backup)."""
    out = []
    for p in path.parent.glob(path.name + ".*"):
        suffix = p.name[len(path.name) + 1:]
        if suffix.isdigit():
            out.append(int(suffix))
    return sorted(out)


def _ino(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _ctime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_ctime_ns
    except OSError:
        return None


def _open_log(path: Path) -> IO[bytes] | None:
    """`path` open for reading, or None when it is not there (renamed or made between two looks: a rotation, the
    normal case). One it may not read raises: skipped, `logs` printed nothing (or an older file's lines as the
    newest), exit 0, and `--follow` waited for it in silence."""
    try:
        return open(path, "rb")
    except PermissionError:
        raise
    except OSError:
        return None


def last_lines(run_dir: str | Path, n: int) -> list[str]:
    """The last `n` lines of the log, reaching into rotated files when the current one is shorter."""
    path = log_path(run_dir)
    if n <= 0:
        return []
    if (fh := _open_log(path)) is None:
        return _tail_of(path, b"", None, n)
    with fh:
        return _tail_of(path, fh.read(), fh, n)


class Follower:
    """Yields complete lines appended to the log, across rotations, until `stop()` returns True."""

    def __init__(self, path: Path, start_at_end: bool = True, poll_s: float = POLL_S,
                 warn: Callable[[str], None] | None = None):
        self.path, self.poll_s = path, poll_s
        self.warn = warn or (lambda msg: print(f"streamprep: {msg}", file=sys.stderr))
        self.fh: IO[bytes] | None = None
        self.ino: int | None = None
        self.buf = b""
        self.head = b""  # with start_at_end: the bytes before the start point (complete lines)
        if self._open(path) and start_at_end:
            assert self.fh is not None
            end = os.fstat(self.fh.fileno()).st_size
            data = os.pread(self.fh.fileno(), end, 0)
            cut = data.rfind(b"\n") + 1  # start after the last complete line, never mid-line
            self.head = data[:cut]
            self.fh.seek(cut)

    def _open(self, path: Path) -> bool:
        if (fh := _open_log(path)) is None:
            return False
        self._set(fh)
        return True

    def _set(self, fh: IO[bytes]) -> None:
        if self.fh is not None:
            self.fh.close()
        self.fh, self.ino = fh, os.fstat(fh.fileno()).st_ino

    def _read(self) -> list[bytes]:
        """Complete lines now available in the open file (a trailing partial line is kept for later)."""
        if self.fh is None:
            return []
        chunks = [self.buf]
        while block := self.fh.read(READ_CHUNK):
            chunks.append(block)
        data = b"".join(chunks)
        cut = data.rfind(b"\n") + 1
        self.buf = data[cut:]
        return data[:cut].splitlines() if cut else []

    def _where(self) -> int | None:
        """Where our open file sits in the chain now: 0 = streamprep.log, k = .k; None if not found."""
        for i in [0, *_backups(self.path)]:
            if _ino(_backup(self.path, i)) == self.ino:
                return i
        return None

    def _successor(self) -> bool:
        """Switch to the file written after the one open now; False if it does not exist yet."""
        assert self.fh is not None
        for _ in range(100):  # retries only while the chain shifts under us
            k = self._where()
            if k is None:
                if os.fstat(self.fh.fileno()).st_nlink > 0:
                    time.sleep(0.005)  # still linked: renamed while we looked; look again
                    continue
                # ours is gone: rotated past the last backup (its unlink, which set its ctime, and every backup
                # left renamed by that rollover or later: go on with the oldest), or removed (`rm` of it or of
                # logs/, after every rename of the backups left, if any) and made again by a new job
                gone = os.fstat(self.fh.fileno()).st_ctime_ns
                later = [i for i in _backups(self.path) if (_ctime_ns(_backup(self.path, i)) or -1) >= gone]
                target = _backup(self.path, later[-1]) if later else self.path
            elif k == 0:
                return False  # ours is (again) the current file: nothing to switch to
            else:
                target = _backup(self.path, k - 1)
            if (fh := _open_log(target)) is None:
                return False  # rollover in progress: the new streamprep.log is not there yet
            # valid only if ours was still at .k after the open (names only ever move to higher numbers)
            if k is not None and _ino(_backup(self.path, k)) != self.ino:
                fh.close()
                continue
            if k is None and target != self.path:
                self.warn(f"log rotated faster than it was read; lines may be missing before {target.name}")
            elif k is None:
                self.warn(f"{self.path.name} was removed and created again; following the new one from its start")
            self._set(fh)
            return True
        return False

    def poll(self) -> list[bytes]:
        """One pass: all complete lines available now, following rotations and truncation."""
        out: list[bytes] = []
        if self.fh is None and not self._open(self.path):
            return out
        while True:
            out.extend(self._read())
            cur = _ino(self.path)
            if cur == self.ino:
                assert self.fh is not None
                size = os.fstat(self.fh.fileno()).st_size
                if size < self.fh.tell():
                    self.warn("log truncated; reading it from the start")
                    self.fh.seek(0)
                    self.buf = b""
                    continue
                return out
            # rotated (another inode, or the name is gone for a moment): finish ours, then move on.
            # The handler closes a file before renaming it, so what we read now is all it will ever hold.
            out.extend(self._read())
            if not self._successor():
                return out
            if self.buf:  # a file ending mid-line (writer died mid-write): emit the fragment on its own
                out.append(self.buf)
                self.buf = b""

    def lines(self, stop: Callable[[], bool] = lambda: False) -> Iterator[bytes]:
        while not stop():
            got = self.poll()
            yield from got
            if not got:
                time.sleep(self.poll_s)

    def close(self) -> None:
        if self.fh is not None:
            self.fh.close()
            self.fh = None


def tail(run_dir: str | Path, n: int = 20, follow: bool = False, out: IO[str] | None = None,
         poll_s: float = POLL_S, stop: Callable[[], bool] = lambda: False) -> int:
    """Print the last `n` lines; with `follow`, keep printing new ones until KeyboardInterrupt/`stop()`."""
    out = out or sys.stdout
    path = log_path(run_dir)
    if path.is_dir():  # the CLI's one line: a folder where the run keeps a file
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    if not follow:
        if not path.is_file() and not _backups(path):  # not yet, removed, or a link to nothing: say so
            print(f"streamprep: logs: no log at {printable(str(path))}", file=sys.stderr)
            return 0
        for line in last_lines(run_dir, n):
            out.write(line + "\n")
        out.flush()
        return 0
    if not path.is_file() and not _backups(path):  # said once, as `tail -F` does; then it waits for the log
        started = os.path.lexists(RunLayout(run_dir).run_json)  # (the job writes its log just before run.json)
        what = f"log at {printable(str(path))} yet; waiting for it" if started else \
            f"run at {printable(str(run_dir))} yet (no run.json); waiting for it to start"
        print(f"streamprep: logs: no {what}", file=sys.stderr)
    # open first, so nothing written between printing the tail and following is lost or repeated
    follower = Follower(path, start_at_end=True, poll_s=poll_s)
    try:
        if n > 0:
            for line in _tail_of(path, follower.head, follower.fh, n):
                out.write(line + "\n")
            out.flush()
        for line in follower.lines(stop):
            out.write(line.decode("utf-8", "replace") + "\n")
            out.flush()
    except KeyboardInterrupt:
        pass
    finally:
        follower.close()
    return 0


def _tail_of(path: Path, head: bytes, read: IO[bytes] | None, n: int) -> list[str]:
    """Last `n` lines of `head` (the file open as `read` up to where reading stopped), + older rotated files if
    short."""
    lines = head.decode("utf-8", "replace").splitlines()
    if len(lines) < n:
        for older in _older(path, read):
            lines = older[-(n - len(lines)):] + lines
            if len(lines) >= n:
                break
    return lines[-n:]


def _older(path: Path, read: IO[bytes] | None) -> Iterator[list[str]]:
    """The lines of each rotated file older than the file open as `read` (the one already read), newest first.
    A rollover after it was read renamed it to .1 (or further): the files named before it now are newer ones,
    whose lines the follower prints after, so only those past it are older; rotated past the last backup (gone),
    every file is newer. Names only move to higher numbers, so opening them in ascending order may meet a file
    twice (kept once) but never misses one."""
    handles: list[IO[bytes]] = []
    seen: set[int] = set()
    ino = os.fstat(read.fileno()).st_ino if read is not None else None
    try:
        for i in _backups(path):
            if (fh := _open_log(_backup(path, i))) is None:
                continue
            at = os.fstat(fh.fileno()).st_ino
            if at == ino:  # it and every file named before it: newer
                for newer in handles:
                    newer.close()
                handles, seen = [], {at}
            if at in seen:
                fh.close()
            else:
                seen.add(at)
                handles.append(fh)
        if read is not None and ino not in seen and os.fstat(read.fileno()).st_nlink == 0:
            return  # gone: every file now named is newer than it
        for fh in handles:
            yield fh.read().decode("utf-8", "replace").splitlines()
    finally:
        for fh in handles:
            fh.close()
