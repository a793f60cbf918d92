"""The session's sweep of what killed jobs leave (tests/conftest.py) never removes what a live job still uses."""
from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from conftest import sweep


def test_the_sweep_keeps_a_live_pools_semaphore_and_removes_an_orphan(tmp_path: Path) -> None:
    """Regression: its creator maps a semaphore under glibc's temporary name, so a sweep by name removed the
    semaphores of another session's running pool (BrokenProcessPool in a concurrent benchmark)."""
    t0 = time.time() - 1
    shm = Path("/dev/shm")
    before = set(shm.glob("sem.mp-*"))
    lock = multiprocessing.get_context("forkserver").Lock()  # a named semaphore, as a process pool's queues hold
    live, = set(shm.glob("sem.mp-*")) - before
    orphan = shm / "sem.mp-streamprep-test-orphan"
    orphan.write_bytes(bytes(32))  # a semaphore file no process maps: what a SIGKILLed job leaves
    try:
        sweep(t0, tmp=tmp_path)
        assert live.exists() and not orphan.exists()
    finally:
        orphan.unlink(missing_ok=True)
        del lock


def test_the_sweep_keeps_this_processs_own_multiprocessing_folder(tmp_path: Path) -> None:
    """Regression: once a test stopped the session's forkserver, its folder held no bound socket and the sweep
    removed it, and multiprocessing's exit finalizer then failed on the missing folder."""
    import multiprocessing.util

    own = Path(multiprocessing.util.get_temp_dir())
    sweep(time.time() - 1, tmp=own.parent)
    assert own.is_dir()


def test_the_sweep_keeps_another_live_processs_folder_and_removes_a_dead_forkservers(tmp_path: Path) -> None:
    """Regression: a concurrent pytest session's sweep removed this session's pymp-* folder (made at its first
    need, empty until a forkserver binds its socket there), and every later pool here failed to start. An empty
    folder stays; one holding a socket no live process binds (a killed forkserver's) goes."""
    import socket

    t0 = time.time() - 1
    in_use = tmp_path / "pymp-in-use"
    in_use.mkdir()
    dead = tmp_path / "pymp-dead"
    dead.mkdir()
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(dead / "listener-1"))  # closed unbound: the file stays, as a killed forkserver leaves it
    sweep(t0, tmp=tmp_path)
    assert in_use.is_dir() and not dead.exists()
