"""`streamprep audit RUN_DIR`: (re)write audit/audit.json + audit.html and print the summary."""
from __future__ import annotations

import argparse

from streamprep import audit
from streamprep.commands import require_run_dir


def run(args: argparse.Namespace) -> int:
    print(audit.write_audit(require_run_dir(args.run_dir)))
    return 0
