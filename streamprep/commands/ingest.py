"""`streamprep ingest`: run or resume the whole job, then print the audit summary and where the run stands."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from streamprep import audit
from streamprep.cli import said_to
from streamprep.config import printable
from streamprep.executor import quiet_gc
from streamprep.pipeline import Interrupted, run_config_file


def run(args: argparse.Namespace) -> int:
    quiet_gc()  # the job's process: the decider's bookkeeping, and with `workers: 1` every call
    try:
        result = run_config_file(args.config, args.run_dir, args.fresh, process_exits=True)
    except Interrupted as exc:  # progress is saved: re-running the command resumes
        print(f"streamprep: {said_to(args, str(exc))}", file=sys.stderr)
        return 1
    summary = _audit_summary(Path(result.run_dir)) if result.status == "complete" else None
    if summary:
        print(summary)
    print(f"streamprep: run {result.status}: {printable(str(result.run_dir))}")
    return 0


def _audit_summary(run_dir: Path) -> str | None:
    """The audit summary the run wrote (audit/audit.json); written here if the run did not write one, or audit/ holds
    another (a partial run's, an earlier attempt's, one a stop cut short: audit.summary_from_file)."""
    try:
        return audit.summary_from_file(run_dir) or audit.write_audit(run_dir)
    except Exception as exc:  # the run itself succeeded; a report problem must not turn it into a failure
        print(f"streamprep: warning: audit summary unavailable: {type(exc).__name__}: {exc}".splitlines()[0],
              file=sys.stderr)
        return None
