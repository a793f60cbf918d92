"""The Ray head of a job that starts its own cluster, as its own process:
`python -m streamprep.ray_head NUM_CPUS NICENESS`, niced and under the idle scheduling policy.

In its own process the start-up can be abandoned: a job that finished before Ray came up kills this
process group at once, where an in-process `ray.init` can be neither interrupted nor killed under the
driver (its core worker ends the whole process once the GCS it waits for is gone). It prints the GCS
address and the cluster's session dir (which the driver removes with it) as its only stdout line, then holds
the cluster until its stdin closes: the driver closing it, or dying. A stdin closing while the cluster still
starts ends the start at once (`_watch_driver`).
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from pathlib import Path

import psutil

from streamprep.ray_cluster import HEAD_TMP_PREFIX, init_here, ray_tmpdir, remove_session, sessions_of, shutdown_ray

_lock = threading.Lock()
_up = False  # the cluster is up: a closed stdin is then the main thread's to act on (`shutdown_ray`)
_driver_gone = threading.Event()


def _watch_driver() -> None:
    """Wait for stdin's EOF (the driver done with the cluster, or dead). Once the cluster is up, tell the main
    thread; while it still starts, end the start here and now: `ray.init` can be neither interrupted nor shut down
    from another thread, and after a kill -9 of the driver (its process group) the cluster came up and ran on for
    ~15 s on a loaded machine, beside the one a quick resume started."""
    while os.read(0, 65536):
        pass
    with _lock:
        if _up:
            _driver_gone.set()
            return
        for p in psutil.Process().children(recursive=True):  # the cluster's processes so far, this process's
            try:                                             # group and not (Ray's workers are the raylet's)
                p.kill()
            except psutil.NoSuchProcess:
                pass
        _remove_own_files()
        os.killpg(0, signal.SIGKILL)  # what started since, and this process: its main thread is inside `ray.init`


def _remove_own_files() -> None:
    """This process's TMPDIR, and the session dirs of the cluster it started (Ray names them after its pid)."""
    for session in sessions_of(os.getpid(), ray_tmpdir()):
        remove_session(str(session))
    tmp = Path(os.environ.get("TMPDIR", ""))
    if tmp.name.startswith(HEAD_TMP_PREFIX):  # the driver removes it too, unless it was killed (kill -9)
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    global _up
    num_cpus, niceness = int(sys.argv[1]), int(sys.argv[2])
    os.nice(niceness)  # before Ray starts: every process of the cluster inherits it
    if hasattr(os, "SCHED_IDLE"):  # Linux: and runs only on cycles no other process wants. Niced alone, its ~20
        # processes still took ~4 CPU-s of start-up from the job's workers (a fifth of a 300 MB job on 2 cores)
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    address_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever Ray prints goes to stderr; stdout carries the address alone
    threading.Thread(target=_watch_driver, name="driver-watch", daemon=True).start()
    ctx = init_here(num_cpus)
    with _lock:  # the watcher, if the driver went during the start, is killing this process meanwhile
        _up = True
    try:
        address_out.write(f"{ctx.address_info['gcs_address']} {ctx.address_info.get('session_dir', '')}\n")
        address_out.flush()
        _driver_gone.wait()  # EOF: the driver is done with the cluster (or gone)
    except BrokenPipeError:  # the driver died while the cluster came up (kill -9): its session dir and this
        pass               # process's TMPDIR were left behind, the error skipping what follows
    shutdown_ray()
    _remove_own_files()


if __name__ == "__main__":
    main()
