"""The forkserver the local worker processes are forked from: what it preloads, when it starts, when it stops.

`streamprep ingest` starts it before it imports the pipeline (~0.55 s), when its config will run worker
processes, so the forkserver's own imports (PRELOAD, ~0.85 s) run on the other core beside the driver's instead
of after them: the workers begin ~0.7 s sooner. The command stops it (and multiprocessing's resource tracker)
before it exits and waits for both, so nothing of the job outlives it; after a kill -9 of the command the
forkserver, which then ends on its own, removes the folder of its socket (`forkserver_preload`). Light (the
standard library, yaml and the config module the CLI loads anyway): the CLI imports this module for every command.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import signal
import stat
from pathlib import Path

import yaml

from streamprep.config import MAX_CONFIG_BYTES, resolved_workers, user_path

# What a worker process has loaded before its first call, by name: the forkserver imports them once and
# every fork inherits them (the unit worker and its QC chain; the exports' writers and the pyarrow modules they
# import only where they write, so that the job's driver, which imports their modules, does not; tqdm, whose write
# lock each worker sets up (`executor._start_worker`), ~0.01 CPU-s; last, `forkserver_preload`: gigatoken and
# awkward, which its batch encoder imports, ~0.25 CPU-s a process, then the run's tokenizer itself). One that cannot
# be imported is skipped (by the server and by `executor._start_worker`): the job's own import names it where it is
# needed. gigatoken and awkward are `forkserver_preload`'s, which skips any failure: the server skips only an
# ImportError, and a broken install raising anything else (a RuntimeError) ended it, every job with workers >= 2.
PRELOAD = ("streamprep.unit_worker", "quality.control", "streamprep.engines.local", "streamprep.exports.parquet",
           "pyarrow.compute", "pyarrow.parquet", "streamprep.exports.order", "streamprep.exports.summary",
           "tqdm.std", "streamprep.forkserver_preload")
OPTIONAL_PRELOAD = ("gigatoken", "awkward")  # imported by `forkserver_preload`, any failure skipped
# The config whose tokenizer `streamprep.forkserver_preload` loads in the server, and the folder of the server's
# socket (multiprocessing's pymp-* temporary folder), which it removes if it outlives the command (set by `start_for`).
CONFIG_ENV, SOCKET_DIR_ENV = "STREAMPREP_FORKSERVER_CONFIG", "STREAMPREP_FORKSERVER_SOCKET_DIR"


def context() -> multiprocessing.context.BaseContext:
    """The forkserver context, with PRELOAD set, its server started (`_ensure_running`)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    _ensure_running()
    return ctx


def _ensure_running() -> None:
    """Start the forkserver if it is not up, SIGINT and SIGTERM blocked from its first instruction (it inherits this
    thread's signal mask; restored here at once): Python's server ignores SIGINT only once its preload is imported
    (~0.85 s) and `forkserver_preload`, its last import, blocks SIGTERM, so a Ctrl-C in that time printed a
    KeyboardInterrupt traceback from the server's imports beside the job's one line, and a SIGTERM to the job's
    process group ended the server. What it forks unblocks both (`forkserver_preload.block_stop_signals`)."""
    multiprocessing.resource_tracker.ensure_running()  # first: its start unblocks both in this thread as it ends
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def start_for(config_path: str) -> bool:
    """Start the forkserver now when the config at `config_path` will fork local workers (`execution.workers`
    unset or above 1, no `ray_address`). Only a peek: a config it cannot read is left to the job's own load,
    which names the problem; a server started for a config that then fails dies with the command. A leading `~`
    is the home folder, as the load reads it (`--config=~/c.yaml` reaches here as written)."""
    try:
        config_path = str(user_path(config_path))
        st = os.stat(config_path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_CONFIG_BYTES:
            return False  # a FIFO would block this read for ever; `load_file` refuses it, and a file too large
        execution = (yaml.safe_load(Path(config_path).read_text(encoding="utf-8")) or {}).get("execution") or {}
        workers, address = execution.get("workers"), execution.get("ray_address")
    except Exception:  # unreadable, not YAML, not a mapping: the real load reports it
        return False
    if address or not isinstance(workers, (int, type(None))) or resolved_workers(workers) < 2:
        return False
    # the server inherits both; nothing else started later. The folder is the one `ensure_running` puts the socket in
    os.environ[CONFIG_ENV] = str(Path(config_path).resolve())
    os.environ[SOCKET_DIR_ENV] = multiprocessing.util.get_temp_dir()
    try:
        context()
    finally:
        del os.environ[CONFIG_ENV], os.environ[SOCKET_DIR_ENV]
    return True


def stop() -> None:
    """Stop the forkserver and the resource tracker if this process started them, and wait for both (they
    would otherwise exit on their own a moment after this process, seen as left behind). Private API: the
    standard library has no public one; its atexit hook, which `os._exit` skips, does not stop them either.

    The forkserver is sent SIGKILL first (it blocks SIGTERM, `forkserver_preload.block_stop_signals`): asked to stop by
    its closed pipe, it tore down every module it preloaded (~0.28 s here, at the end of every job), and it holds
    nothing to flush or remove (its workers are gone by now; the address and the folder are this process's to
    remove). The resource tracker stops the polite way: it unlinks what leaked."""
    server = multiprocessing.forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:  # already gone
            pass
    for server in (server, multiprocessing.resource_tracker._resource_tracker):
        try:
            server._stop()
        except (AttributeError, OSError):  # another Python's internals, or already gone
            pass
