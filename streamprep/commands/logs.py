"""`streamprep logs RUN_DIR [-n N] [--follow]`: the run log's last lines, then (with --follow) the new ones."""
from __future__ import annotations

import argparse

from streamprep.commands import require_run_dir
from streamprep.logtail import tail


def run(args: argparse.Namespace) -> int:
    return tail(require_run_dir(args.run_dir), args.lines, args.follow, poll_s=max(args.poll_interval, 0.01))
