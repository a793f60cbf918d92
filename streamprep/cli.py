"""`streamprep` command line: a thin layer over the Python API. Errors are one line; exit 2 for bad
config/arguments, 1 for a failure or interruption after which the run can be resumed.

The parser knows every command; a command's code is a module of `streamprep.commands`, named in `COMMANDS` and
imported when that command runs: `--help` and `status` take ~0.1 s, not the ~0.4 s of importing the pipeline."""
from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import NoReturn

from streamprep import forkserver, registry
from streamprep.config import ConfigError, printable
from streamprep.layout import NotARunDir, causes, closed_folder, denied, file_in_the_way, unreadable
from streamprep.registry import Registry
from streamprep.sources.base import in_worker

EPILOG_INGEST = """examples:
  streamprep ingest --config configs/demo.yaml
  streamprep ingest --config cfg.yaml --run-dir /data/runs/web-v2 --fresh
  re-run the command (without --fresh) to resume an interrupted run"""
EPILOG_VERIFY = """examples:
  streamprep verify runs/demo      exit 0 when every file matches manifest.json and the receipts"""
EPILOG_STATUS = """examples:
  streamprep status runs/demo                 per dataset: read/kept/rejected, shards done/planned, state
  streamprep status runs/demo --json | jq .state
  watch -n 5 streamprep status runs/demo      safe while the run is going: reads only, never blocks it
state is one of: running (lock held; shows the pid), complete, resumable (interrupted | failed |
crashed | partial) — resume by re-running the same `streamprep ingest` command (without --fresh); but
with needs_change (shown as FAILED, NEEDS A CHANGE) the last error stops every re-run as is: fix what
it names first."""
EPILOG_LOGS = """examples:
  streamprep logs runs/demo                   the last 20 lines of logs/streamprep.log (JSON lines)
  streamprep logs runs/demo -n 200
  streamprep logs runs/demo --follow          keep printing new lines across log rotation; Ctrl-C to stop
  streamprep logs runs/demo -f | jq -c 'select(.level == "warning")'"""
EPILOG_AUDIT = """examples:
  streamprep audit runs/demo                  (re)write audit/audit.json + audit/audit.html, print the summary
  xdg-open runs/demo/audit/audit.html         one self-contained page: no network needed
works on a finished run and on a partial one (figures then cover what has been processed so far)."""


class _Parser(argparse.ArgumentParser):
    """Bad arguments are one line, as every other exit 2 is (argparse prints its usage block before it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="streamprep", description="Raw text corpora -> quality-controlled, "
                                "tokenized, Megatron-ready training data.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    fmt = argparse.RawDescriptionHelpFormatter

    ing = sub.add_parser("ingest", help="run or resume the whole job", epilog=EPILOG_INGEST, formatter_class=fmt)
    ing.add_argument("--config", required=True, type=_path, help="YAML config file")
    ing.add_argument("--run-dir", type=_path, help="run directory (default: runs/<run.name>)")
    ing.add_argument("--fresh", action="store_true", help="refuse a run dir that is not empty (but for what a job "
                     "stopped before it wrote run.json left); leave it out to resume")

    st = sub.add_parser("status", help="where a run stands: per dataset and stage; complete/resumable/running",
                        epilog=EPILOG_STATUS, formatter_class=fmt)
    st.add_argument("run_dir", metavar="RUN_DIR", type=_path)
    st.add_argument("--json", action="store_true", help="print the status as JSON")

    lg = sub.add_parser("logs", help="print the run log; --follow keeps tailing across rotation",
                        epilog=EPILOG_LOGS, formatter_class=fmt)
    lg.add_argument("run_dir", metavar="RUN_DIR", type=_path)
    lg.add_argument("-n", "--lines", type=_count, default=20, metavar="N", help="how many last lines (default 20)")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C")
    lg.add_argument("--poll-interval", type=float, default=0.2, help=argparse.SUPPRESS)

    au = sub.add_parser("audit", help="(re)write audit/audit.json + audit.html and print the summary",
                        epilog=EPILOG_AUDIT, formatter_class=fmt)
    au.add_argument("run_dir", metavar="RUN_DIR", type=_path)

    ver = sub.add_parser("verify", help="re-check every file against manifest.json and receipts",
                         epilog=EPILOG_VERIFY, formatter_class=fmt)
    ver.add_argument("run_dir", metavar="RUN_DIR", type=_path)
    for command in (ing, st, lg, au, ver):  # after the command too; unset there, so `--debug COMMAND` holds
        command.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return p


def _path(text: str) -> str:
    """A path given on the command line: an empty one (`--run-dir "$RUN"` with RUN unset) was no option at all, the
    job running in runs/<name> of the working directory, or for --config ". is a directory"; a RUN_DIR was the working
    directory (`status "$RUN"` showed the run there, `logs -f` waited for one to start in it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path")
    return text


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


# command -> its `run(args) -> exit code`, as "module:attr" loaded when the command runs (registry.Registry)
COMMANDS = Registry("command")
for _name in ("ingest", "status", "logs", "audit", "verify"):
    COMMANDS.register(_name, f"streamprep.commands.{_name}:run")


INTERRUPTED = "streamprep: interrupted; re-run the same command to resume"
SAME_COMMAND = "re-run the same command"


def _denied_line(exc: BaseException, command: str) -> str | None:
    """The line for a file or folder of the run this process may not read or write (`layout.denied`), else None.
    Every command reads (`status` and `audit` a checkpoint); only `ingest` writes (`audit` says its own)."""
    refused = denied(exc)
    if refused is None:
        return None
    where = Path(os.fsdecode(refused.filename))
    # a folder on the way it may not enter (or list) first: inside it no file is seen, and `ingest` writes in it
    if refused.errno != errno.EROFS and (closed := closed_folder(refused.filename)) is not None:
        return (f"cannot read {closed}: {refused.strerror}; make it readable"
                f"{', writable' if command == 'ingest' else ''} and searchable and re-run the same command")
    if unreadable(refused):
        return f"cannot read {where}: {refused.strerror}; make it readable and re-run the same command"
    if command == "ingest":
        return (f"cannot write {where}: {refused.strerror}; make {where.parent} (and the file, if it is there) "
                f"writable and re-run the same command")
    return None


def said_to(args: argparse.Namespace, line: str) -> str:
    """`line` as said to `ingest --fresh`: once its job wrote run.json, the same command is refused (the run dir is
    not empty), so the advice to re-run the same command says to leave --fresh out, which resumes the run."""
    return line.replace(SAME_COMMAND, "re-run the command without --fresh") if getattr(args, "fresh", False) else line


def entry() -> None:
    """Console entry point: run, then exit without interpreter finalization.

    Once the exit code is decided (every output is already written atomically and fsynced), a Ctrl-C
    arriving while CPython finalizes would otherwise kill the process by signal (rc -2), because
    finalization restores the default SIGINT disposition. Found by sending SIGINT at random moments.
    """
    try:
        code = main()
    except KeyboardInterrupt:  # before the job installed its handlers: nothing unsafe
        print(INTERRUPTED, file=sys.stderr)
        code = 1
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: os._exit(code))
    logging.shutdown()
    _remove_multiprocessing_tmp()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _remove_multiprocessing_tmp() -> None:
    """Run multiprocessing's exit finalizers, which `os._exit` skips: the workers' forkserver's /tmp/pymp-*
    folder (its socket) would otherwise stay behind after every run; then stop the forkserver and the resource
    tracker and wait for them. The workers are already shut down."""
    if "multiprocessing" in sys.modules:
        import multiprocessing.util

        multiprocessing.util._run_finalizers()  # no public API; atexit's _exit_function calls the same
        forkserver.stop()


def main(argv: list[str] | None = None) -> int:
    # numpy's OpenBLAS starts a pool of threads in every process that imports it (this one, the forkserver, each
    # worker), and nothing here calls BLAS; those threads still took ~3 % of a short-document job's CPU on 2 cores
    # (perf: blas_thread_server). One thread, unless the environment says otherwise; set before numpy loads.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    args = _parser().parse_args(argv)
    if registry.PLUGIN_IMPORT_ERRORS:  # every command: a registry it reads may lack what the module registers
        print(f"streamprep: error: {registry.PLUGIN_IMPORT_ERRORS[0]}", file=sys.stderr)
        return 2
    if args.command == "ingest":  # its workers' forkserver imports beside the pipeline's imports, not after
        forkserver.start_for(args.config)
    try:
        return COMMANDS.get(args.command)(args)
    except (ConfigError, NotARunDir) as exc:
        print(said_to(args, f"streamprep: error: {exc}"), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(said_to(args, INTERRUPTED), file=sys.stderr)
        return 1
    except IsADirectoryError as exc:  # a folder where a run keeps one of its files; not ours to remove
        folder = exc.filename2 or exc.filename  # os.replace(tmp, final) names the final path second
        print(f"streamprep: error: {folder} is a folder where the run keeps a file; remove it and re-run",
              file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `streamprep logs RUN -f | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # keep the final flush quiet
        return 0
    except Exception as exc:  # one line unless --debug; the run log has the details
        if args.debug:
            traceback.print_exc()
        if (blocker := file_in_the_way(exc)) is not None:  # the mirror of IsADirectoryError above
            print(f"streamprep: error: {printable(str(blocker))} is a file where the run keeps a folder; remove it "
                  f"and re-run", file=sys.stderr)
            return 2
        if (said := _denied_line(exc, args.command)) is not None:
            print(said_to(args, f"streamprep: error: {printable(said)}"), file=sys.stderr)
            return 2
        # its first line, control characters escaped: a file name in it may hold ESC, CR or BEL (terminal injection)
        cause, where = in_worker(exc)  # a Ray worker's error: what it raised, not Ray's header
        first = f"{type(cause).__name__}: {cause}".split("\n")[0] + where
        print(said_to(args, f"streamprep: error: {printable(_write_fault(exc, first, args.command))}"), file=sys.stderr)
        return 1
    except SystemExit as exc:  # nothing of ours calls sys.exit: a plug-in or library did, inside the job
        if args.debug:
            traceback.print_exc()
        print(said_to(args, f"streamprep: error: SystemExit({exc.code!r}) raised inside the command (a plug-in calling "
                            f"sys.exit?); re-run the same command to resume"), file=sys.stderr)
        return 1


def _write_fault(exc: BaseException, first: str, command: str) -> str:
    """The line for `first` (the error's), saying where and what to do when `exc` or what it wraps (a unit's
    SourceError) is a full disk or quota, or a file grown past the size a file may have: a bare "OSError: [Errno 28]
    No space left on device" (or "[Errno 27] File too large") named no file and, wrapped, blamed the input. The
    write helpers name the file (`atomic.name_file`). Only `ingest` resumes: a read-only command's one write that
    names no file is its output (`status --json > FILE`), which "re-run the same command to resume" did not say."""
    resume = " to resume" if command == "ingest" else ""
    for e in causes(exc):
        if not isinstance(e, OSError):
            continue
        where = f" writing {e.filename}" if e.filename else "" if command == "ingest" else " writing its output"
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            return f"no space left on the disk{where}: free some and re-run the same command{resume} ({first})"
        if e.errno == errno.EFBIG:
            return (f"file too large{where}: raise the limit on a file's size (`ulimit -f`, or the file system's own) "
                    f"and re-run the same command{resume} ({first})")
    return first


if __name__ == "__main__":
    entry()
