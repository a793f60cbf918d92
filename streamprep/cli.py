"""`streamprep` command line: a thin layer over the Python API. Errors are one line; exit 2 for bad
config/arguments, 1 for a failure or interruption after which the run can be resumed."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
from pathlib import Path

import orjson

from streamprep import audit
from streamprep.config import ConfigError
from streamprep.layout import RunLayout
from streamprep.logtail import tail
from streamprep.pipeline import Interrupted, run_config_file
from streamprep.status import NotARunDir, format_status, run_status
from streamprep.verify import verify_run

EPILOG_INGEST = """examples:
  streamprep ingest --config configs/demo.yaml
  streamprep ingest --config cfg.yaml --run-dir /data/runs/web-v2 --fresh
  re-run the same command to resume an interrupted run"""
EPILOG_VERIFY = """examples:
  streamprep verify runs/demo      exit 0 when every file matches manifest.json and the receipts"""
EPILOG_STATUS = """examples:
  streamprep status runs/demo                 per dataset: read/kept/rejected, shards done/planned, state
  streamprep status runs/demo --json | jq .state
  watch -n 5 streamprep status runs/demo      safe while the run is going: reads only, never locks it
state is one of: running (lock held; shows the pid), complete, resumable (interrupted | failed |
crashed | partial) — resume by re-running the same `streamprep ingest` command."""
EPILOG_LOGS = """examples:
  streamprep logs runs/demo                   the last 20 lines of logs/streamprep.log (JSON lines)
  streamprep logs runs/demo -n 200
  streamprep logs runs/demo --follow          keep printing new lines across log rotation; Ctrl-C to stop
  streamprep logs runs/demo -f | jq -c 'select(.level == "warning")'"""
EPILOG_AUDIT = """examples:
  streamprep audit runs/demo                  (re)write audit/audit.json + audit/audit.html, print the summary
  xdg-open runs/demo/audit/audit.html         one self-contained page: no network needed
works on a finished run and on a partial one (figures then cover what has been processed so far)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="streamprep", description="Raw text corpora -> quality-controlled, "
                                "tokenized, Megatron-ready training data.")
    p.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    fmt = argparse.RawDescriptionHelpFormatter

    ing = sub.add_parser("ingest", help="run or resume the whole job", epilog=EPILOG_INGEST, formatter_class=fmt)
    ing.add_argument("--config", required=True, help="YAML config file")
    ing.add_argument("--run-dir", help="run directory (default: runs/<run.name>)")
    ing.add_argument("--fresh", action="store_true", help="refuse to reuse a non-empty run dir")
    ing.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    st = sub.add_parser("status", help="where a run stands: per dataset and stage; complete/resumable/running",
                        epilog=EPILOG_STATUS, formatter_class=fmt)
    st.add_argument("run_dir", metavar="RUN_DIR")
    st.add_argument("--json", action="store_true", help="print the status as JSON")
    st.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    lg = sub.add_parser("logs", help="print the run log; --follow keeps tailing across rotation",
                        epilog=EPILOG_LOGS, formatter_class=fmt)
    lg.add_argument("run_dir", metavar="RUN_DIR")
    lg.add_argument("-n", "--lines", type=_count, default=20, metavar="N", help="how many last lines (default 20)")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines until Ctrl-C")
    lg.add_argument("--poll-interval", type=float, default=0.2, help=argparse.SUPPRESS)
    lg.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    au = sub.add_parser("audit", help="(re)write audit/audit.json + audit.html and print the summary",
                        epilog=EPILOG_AUDIT, formatter_class=fmt)
    au.add_argument("run_dir", metavar="RUN_DIR")
    au.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)

    ver = sub.add_parser("verify", help="re-check every file against manifest.json and receipts",
                         epilog=EPILOG_VERIFY, formatter_class=fmt)
    ver.add_argument("run_dir", metavar="RUN_DIR")
    ver.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return p


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def _require_run_dir(path: str) -> Path:
    run_dir = Path(path)
    if not RunLayout(run_dir).run_json.is_file():
        raise ConfigError(f"{run_dir}: not a streamprep run directory (no run.json)")
    return run_dir


def _ingest(args: argparse.Namespace) -> int:
    result = run_config_file(args.config, args.run_dir, args.fresh)
    summary = _audit_summary(Path(result.run_dir)) if result.status == "complete" else None
    if summary:
        print(summary)
    print(f"streamprep: run {result.status}: {result.run_dir}")
    return 0


def _audit_summary(run_dir: Path) -> str | None:
    """The audit summary the run wrote (audit/audit.json); written here if the run did not write one."""
    try:
        return audit.summary_from_file(run_dir) or audit.write_audit(run_dir)
    except Exception as exc:  # the run itself succeeded; a report problem must not turn it into a failure
        print(f"streamprep: warning: audit summary unavailable: {type(exc).__name__}: {exc}".splitlines()[0],
              file=sys.stderr)
        return None


def _status(args: argparse.Namespace) -> int:
    st = run_status(_require_run_dir(args.run_dir))
    if args.json:
        sys.stdout.write(orjson.dumps(st, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(format_status(st))
    return 0


def _logs(args: argparse.Namespace) -> int:
    return tail(_require_run_dir(args.run_dir), args.lines, args.follow, poll_s=max(args.poll_interval, 0.01))


def _audit(args: argparse.Namespace) -> int:
    print(audit.write_audit(_require_run_dir(args.run_dir)))
    return 0


def _verify(args: argparse.Namespace) -> int:
    problems = verify_run(_require_run_dir(args.run_dir))
    for p in problems:
        print(p)
    print(f"streamprep: verify: {len(problems)} problem(s)" if problems else "streamprep: verify: all files match")
    return 1 if problems else 0


COMMANDS = {"ingest": _ingest, "status": _status, "logs": _logs, "audit": _audit, "verify": _verify}


INTERRUPTED = "streamprep: interrupted; re-run the same command to resume"


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
    """Run multiprocessing's exit finalizers, which `os._exit` skips: the QC forkserver's /tmp/pymp-* folder
    (its socket) would otherwise stay behind after every run. Its workers are already shut down."""
    if "multiprocessing" in sys.modules:
        import multiprocessing.util

        multiprocessing.util._run_finalizers()  # no public API; atexit's _exit_function calls the same


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, NotARunDir) as exc:
        print(f"streamprep: error: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"streamprep: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(INTERRUPTED, file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `streamprep logs RUN -f | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # keep the final flush quiet
        return 0
    except Exception as exc:  # one line unless --debug; the run log has the details
        if args.debug:
            traceback.print_exc()
        print(f"streamprep: error: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 1


if __name__ == "__main__":
    entry()
