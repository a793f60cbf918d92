"""Imported by the workers' forkserver (`forkserver.PRELOAD`). It removes the folder of the forkserver's socket
when the forkserver ends on its own, which it does once the command that started it is gone without stopping it
(kill -9): the command's own exit would have removed the folder. And it loads the run's tokenizer once, before any
worker is forked, so that every worker inherits it instead of loading its own (phi-2: gigatoken ~0.27 CPU-s, HF
`tokenizers` ~0.1 CPU-s, per worker). The backends keep what they load by the file's SHA-256, so a worker asking
for the run's copy of the same file gets the inherited one. Loading starts no thread (forking after it is safe).

Only a peek, as `forkserver.start_for` peeks: the configured local tokenizer.json, nothing when the config names
none (a tokenizer to train) or cannot be read. Any failure is left to the job's own load, which names it."""
from __future__ import annotations

import atexit
import importlib
import multiprocessing.forkserver
import os
import shutil
import signal
import traceback
from pathlib import Path

import yaml

from streamprep import backends, forkserver, tokenizer
from streamprep.config import ConfigError


def configured_tokenizer(config_path: str) -> tuple[Path, str] | None:
    """(the local tokenizer.json `tokenizer.path` names, relative to the config file; `tokenizer.backend`)."""
    raw = yaml.safe_load(Path(config_path).read_text(encoding="utf-8")) or {}
    section = raw.get("tokenizer") or {}
    path, backend = section.get("path"), section.get("backend") or "auto"
    if not isinstance(path, str):
        return None
    try:  # an absolute `path` stays itself
        return tokenizer.source_file(Path(config_path).parent / Path(path).expanduser()), backend
    except ConfigError:  # none there (a tokenizer to train, or a mistake the job's load names)
        return None


def import_optional() -> None:
    """gigatoken and awkward (`forkserver.OPTIONAL_PRELOAD`), skipped whatever their import raises: the job's own
    import (`backends.select`) says why where it needs them (`backend: hf` does not)."""
    for name in forkserver.OPTIONAL_PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a broken install, not the server's to die of
            pass


def load_configured() -> None:
    """Load the tokenizer of the config in `forkserver.CONFIG_ENV`: HF's (every worker's identity check uses it)
    and gigatoken's unless `backend: hf`."""
    try:
        config = os.environ.get(forkserver.CONFIG_ENV)
        found = configured_tokenizer(config) if config else None
        if found is not None:
            backends.hf_tokenizer(found[0])
            if found[1] != "hf":
                backends.gigatoken_backend(found[0])
    except BaseException as exc:  # noqa: BLE001 - a server that raised here would fork no worker; the job reports
        if not isinstance(exc, Exception) and not backends.is_panic(exc):  # the cause (a panic too: file or config)
            raise


def remove_socket_dir_at_exit() -> None:
    """Have this process remove the folder in `forkserver.SOCKET_DIR_ENV` when it exits normally (Python's exit
    handlers), which the forkserver does only when every client is gone. Its workers, forked with this handler,
    end with `os._exit` and skip it; the pid test covers any other child. A command that ends normally removes the
    folder itself and stops the server by a signal, which runs no handler."""
    folder = os.environ.get(forkserver.SOCKET_DIR_ENV)
    if folder:
        server = os.getpid()
        atexit.register(lambda: os.getpid() == server and shutil.rmtree(folder, ignore_errors=True))


def block_stop_signals() -> None:
    """Have the forkserver keep SIGTERM and SIGINT blocked (`forkserver._ensure_running` starts it so; blocked here
    too for a server started otherwise) and what it forks unblock them. A SIGTERM to the job's whole process group
    (GNU `timeout`, `kill -- -PGID`, a systemd stop) ended it with the job's process: every pool worker's sentinel
    (its pipe from here) then read EOF, which the pool took for the workers' deaths, and a new pool was started as
    the job stopped. The job's process stops it (`forkserver.stop`, by SIGKILL). Only in the server (its `main`
    imports this module), not in a process that imports it for its functions: the server is the process-wide one,
    and a SIG_IGN its children inherited left a library caller's own processes forked from it after a job deaf to
    `terminate()` (its `Pool.terminate()` hung for ever), and a pool worker `LocalExecutor.close` terminated before
    its initializer ran. So the signals are blocked, not ignored: a child starts with them blocked, not pending
    (POSIX), and unblocks them as it is forked, when one sent meanwhile takes its action there; streamprep's own
    children then choose theirs (`children.serve_driver`: a dedup holder ignores SIGTERM, workers SIGINT). Python's
    server ignores SIGINT itself once its imports are done, which discards one sent while they ran."""
    if any(f.f_code.co_name == "main" and f.f_code.co_filename == multiprocessing.forkserver.__file__
           for f, _ in traceback.walk_stack(None)):
        stop_signals = {signal.SIGTERM, signal.SIGINT}
        signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)
        os.register_at_fork(after_in_child=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, stop_signals))


remove_socket_dir_at_exit()
block_stop_signals()
import_optional()
load_configured()
