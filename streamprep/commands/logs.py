"""`streamprep logs RUN_DIR [-n N] [--follow]`: the run log's last lines, then (with --follow) the new ones."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from streamprep.commands import require_run_dir
from streamprep.config import user_path
from streamprep.layout import RunLayout
from streamprep.logtail import tail


def run(args: argparse.Namespace) -> int:
    poll_s = max(args.poll_interval, 0.01)
    path = user_path(args.run_dir)
    if args.follow and _not_started(path):  # `logs -f` started before the job: tail waits for it
        return tail(path, args.lines, True, poll_s=poll_s)
    return tail(require_run_dir(args.run_dir), args.lines, args.follow, poll_s=poll_s)


def _not_started(run_dir: Path) -> bool:
    """Whether `run_dir` may yet become a run dir: no run.json in it, and it (or, not there yet, the nearest of its
    parents that is) a folder. A regular file there, or a run.json that is not a file, never becomes one."""
    if os.path.lexists(RunLayout(run_dir).run_json):
        return False
    existing = next((p for p in (run_dir, *run_dir.absolute().parents) if os.path.lexists(p)), None)
    return existing is not None and existing.is_dir()
