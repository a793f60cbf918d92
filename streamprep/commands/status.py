"""`streamprep status RUN_DIR [--json]`: where a run stands; reads only, never blocks the run."""
from __future__ import annotations

import argparse
import sys

import orjson

from streamprep.commands import require_run_dir
from streamprep.status import format_status, run_status


def run(args: argparse.Namespace) -> int:
    st = run_status(require_run_dir(args.run_dir))
    if args.json:
        sys.stdout.write(orjson.dumps(st, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(format_status(st))
    return 0
