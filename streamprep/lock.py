"""One writer per run dir: an flock on RUN_DIR/.lock, released by the kernel if the holder dies.

The checkpoint dir gets its own lock (CheckpointLayout.lock) so two runs sharing `run.checkpoint_dir`
cannot overwrite each other's checkpoints. The lock files' names are streamprep.layout's.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

import orjson

from streamprep.children import pid_alive
from streamprep.config import ConfigError

# How long a refused acquire waits out a holder that cannot be the run's (a dead pid or no record): `status` tests a
# crashed run's lock with a shared flock held for microseconds, and a job writes its record just after its flock.
PASSING_HOLDER_WAIT_S = 0.5
RECORD_FIELDS = frozenset({"pid", "host", "started"})  # the holder's record `acquire` writes in the lock file


class RunLocked(RuntimeError):
    """Another live process holds the run dir."""


class RunLock:
    def __init__(self, path: Path, what: str = "run dir"):
        self.path = Path(path)
        self.what = what
        self.fd: int | None = None
        self.taken_over: dict[str, Any] | None = None  # the record of a dead holder whose lock we took

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError as exc:
            if not os.path.lexists(self.path):  # creating it: its folder refuses (the CLI's line names that folder)
                raise
            # the open reads and writes it: the CLI's line, told by the file's state, said to make a `chmod 000` lock
            # readable, and then (`chmod 444`) writable
            raise ConfigError(f"cannot read and write {self.path}: {exc.strerror}; make it readable and writable and "
                              f"re-run the same command") from None
        deadline = time.monotonic() + PASSING_HOLDER_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = read_holder(self.path)
                if not _may_be_passing(holder) or time.monotonic() >= deadline:
                    os.close(fd)
                    raise RunLocked(f"{self.what} {self.path.parent} is in use by pid {holder.get('pid', '?')} "
                                    f"on {holder.get('host', '?')} (started {holder.get('started', '?')})") from None
            time.sleep(0.005)
        self.fd = fd  # held from here: `release` ends it whatever happens below
        previous = read_holder(self.path)
        if previous.get("pid"):
            self.taken_over = previous  # a stale lock left by a killed process
        try:  # who holds it, for a run refused meanwhile; the flock is the lock
            os.ftruncate(fd, 0)
            os.write(fd, orjson.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                       "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}))
            os.fsync(fd)
        except OSError:  # a full disk: the run goes on without the record (a finished run verifies, writing nothing)
            pass
        return self

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None


def _may_be_passing(holder: dict[str, Any]) -> bool:
    """Whether the lock's holder may be a brief one rather than a run: its record names no pid (a job between its
    flock and its record) or a pid gone from this host (a killed run's record, the lock tested by `status`)."""
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return True
    return holder.get("host") == socket.gethostname() and not pid_alive(pid)


def read_holder(path: Path) -> dict[str, Any]:
    try:
        return orjson.loads(Path(path).read_bytes() or b"{}")
    except (OSError, orjson.JSONDecodeError):
        return {}


def is_lock_file(path: Path) -> bool:
    """Whether `path` is a lock file as `RunLock` leaves it: a regular file, empty (released, or taken and not yet
    written) or holding its holder's record. A folder may hold a `.lock` of its user's, which taking the lock would
    overwrite: that folder is no start of a run (`RunLayout.only_a_start`)."""
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
        data = Path(path).read_bytes()
        record = orjson.loads(data) if data else None
    except (OSError, orjson.JSONDecodeError):
        return False
    return record is None or isinstance(record, dict) and set(record) == RECORD_FIELDS


def holder_if_running(path: Path) -> dict[str, Any] | None:
    """The record of the live process holding the lock file `path`, else None (does not take the lock)."""
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_holder(path) or {"pid": None}
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
