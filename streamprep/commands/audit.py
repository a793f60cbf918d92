"""`streamprep audit RUN_DIR`: (re)write audit/audit.json + audit.html and print the summary."""
from __future__ import annotations

import argparse
from pathlib import Path

from streamprep import audit
from streamprep.commands import require_run_dir
from streamprep.config import ConfigError
from streamprep.layout import NOT_WRITABLE, RunLayout


def run(args: argparse.Namespace) -> int:
    run_dir = require_run_dir(args.run_dir)
    folder = RunLayout(run_dir).audit_dir
    try:
        print(audit.write_audit(run_dir))
    except OSError as exc:  # a read-only run dir: was a raw PermissionError naming a temporary file, exit 1
        where = Path(exc.filename or "").parent  # audit/ for its files, the run dir when audit/ could not be made
        if exc.errno not in NOT_WRITABLE or where not in (folder, run_dir):
            raise
        raise ConfigError(f"cannot write the audit in {where}: {exc.strerror}; make that folder writable, or audit a "
                          f"copy of the run dir") from None
    return 0
