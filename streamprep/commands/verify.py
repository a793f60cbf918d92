"""`streamprep verify RUN_DIR`: re-check every file against manifest.json and the receipts; exit 1 on a mismatch."""
from __future__ import annotations

import argparse

from streamprep.commands import require_run_dir
from streamprep.config import printable
from streamprep.verify import NOT_COMPLETE, REFUSED, verify_run


def run(args: argparse.Namespace) -> int:
    run_dir = require_run_dir(args.run_dir)
    problems = verify_run(run_dir)
    for p in problems:
        print(printable(p))  # a file's name, or the run dir's, may hold ESC or CR: not sent to the terminal raw
    refused = [p for p in problems if REFUSED in p]  # a file or folder it may not read: not damaged, not to delete
    names_a_file = any(not p.startswith(f"{run_dir}: ") and p not in refused for p in problems)
    if refused:
        print("to repair: make each file or folder named above that it cannot read readable (a folder searchable "
              "too), then re-run `streamprep verify`")
    if problems and not problems[0].startswith(NOT_COMPLETE) and names_a_file:
        # a finished run's re-run reads no large file whole: a byte changed in one is found here only (a line
        # about the run dir itself, a damaged checkpoint say, names no file and says how to repair it)
        print(f"to repair{' the rest' if refused else ''}: delete each {'other ' if refused else ''}damaged file named "
              f"above, then re-run the same `streamprep ingest` command; it rewrites what is missing to the same bytes")
    print(f"streamprep: verify: {len(problems)} problem(s)" if problems else "streamprep: verify: all files match")
    return 1 if problems else 0
