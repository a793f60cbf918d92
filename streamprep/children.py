"""Pool workers that end with the job's driver.

A process-pool worker is a child of multiprocessing's forkserver, not of the driver, and each holds the
forkserver's "alive" pipe. After a `kill -9` of the driver a worker blocked on the dead driver's call queue
never sees EOF, so it keeps the forkserver alive, and the forkserver the resource tracker: three processes
left behind for good. A worker that watches the driver itself exits with it, and the other two follow.
"""
from __future__ import annotations

import os
import select
import signal
import threading
import time
from typing import Any


def serve_driver(driver: int, on_sigterm: Any = signal.SIG_DFL) -> None:
    """A pool worker's or a dedup holder's start: ignore SIGINT (a terminal's Ctrl-C goes to the driver, which
    stops the pool), take SIGTERM as `on_sigterm` (the forkserver it is forked from ignores it, so that a SIGTERM
    to the job's whole process group leaves the server to the driver, and forks with the default again:
    `forkserver_preload`), and end with the job's `driver` process."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_sigterm)
    exit_with(driver)


def exit_with(pid: int) -> None:
    """End this process as soon as process `pid` exits (a pidfd on Linux ≥ 5.3, else a poll every second)."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while pid_alive(pid):
                time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="exit-with-driver").start()


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (on this host); one we may not signal does."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
