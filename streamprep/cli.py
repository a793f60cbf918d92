"""`streamprep` command line: a thin layer over the Python API. Errors are one line; exit 2 for bad
config/arguments, 1 for a failure or interruption after which the run can be resumed."""
from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

EPILOG_INGEST = """examples:
  streamprep ingest --config configs/demo.yaml
  streamprep ingest --config cfg.yaml --run-dir /data/runs/web-v2 --fresh
  re-run the same command to resume an interrupted run"""
EPILOG_VERIFY = """examples:
  streamprep verify runs/demo      exit 0 when every file matches manifest.json and the receipts"""


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

    ver = sub.add_parser("verify", help="re-check every file against manifest.json and receipts",
                         epilog=EPILOG_VERIFY, formatter_class=fmt)
    ver.add_argument("run_dir", metavar="RUN_DIR")
    ver.add_argument("--debug", action="store_true", help=argparse.SUPPRESS)
    return p


def _require_run_dir(path: str) -> Path:
    from streamprep.config import ConfigError

    run_dir = Path(path)
    if not (run_dir / "run.json").is_file():
        raise ConfigError(f"{run_dir}: not a streamprep run directory (no run.json)")
    return run_dir


def _ingest(args: argparse.Namespace) -> int:
    from streamprep.pipeline import run_config_file

    result = run_config_file(args.config, args.run_dir, args.fresh)
    print(f"streamprep: run {result.status}: {result.run_dir}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    from streamprep.verify import verify_run

    problems = verify_run(_require_run_dir(args.run_dir))
    for p in problems:
        print(p)
    print(f"streamprep: verify: {len(problems)} problem(s)" if problems else "streamprep: verify: all files match")
    return 1 if problems else 0


COMMANDS = {"ingest": _ingest, "verify": _verify}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from streamprep.config import ConfigError
    from streamprep.pipeline import Interrupted

    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"streamprep: error: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        print(f"streamprep: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("streamprep: interrupted", file=sys.stderr)
        return 1
    except Exception as exc:  # one line unless --debug; the run log has the details
        if args.debug:
            traceback.print_exc()
        print(f"streamprep: error: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
