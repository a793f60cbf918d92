"""The `streamprep` commands, one module each, loaded by name when the command runs (`cli.COMMANDS`): `--help`,
`status` and `logs` then import neither the pipeline nor numpy or pyarrow. Each module's `run(args) -> exit code`
takes the parsed arguments; `cli.main` turns its errors into one line and an exit code."""
from __future__ import annotations

import os
from pathlib import Path

from streamprep.atomic import is_tmp_name
from streamprep.config import ConfigError, user_path
from streamprep.layout import CheckpointLayout, RunLayout
from streamprep.lock import holder_if_running


def require_run_dir(path: str) -> Path:
    """`path` as a run dir, or a one-line error. A folder holding only what a job makes before run.json (`_starting`)
    is one whose job is starting, or was killed in that moment: the error says which, not "not a run directory"; a
    folder holding anything else is no run's."""
    run_dir = user_path(path)
    layout = RunLayout(run_dir)
    if not layout.run_json.is_file():
        if layout.lock.is_file() and not os.path.lexists(layout.run_json) and _starting(layout):
            if holder_if_running(layout.lock) is not None:
                raise ConfigError(f"{run_dir}: a job is starting here and has not written run.json yet; try again "
                                  "in a moment")
            raise ConfigError(f"{run_dir}: its job stopped before it wrote run.json; re-run the same streamprep "
                              "ingest command to start it")
        raise ConfigError(f"{run_dir}: not a streamprep run directory (no run.json)")
    return run_dir


def _starting(layout: RunLayout) -> bool:
    """Whether the run dir holds only what a job makes before it writes run.json, in order: its `.lock`, the
    checkpoint dir's lock and owner file when that dir is the default `checkpoints/` inside it, and `logs/`; and the
    temporary file of run.json or of that owner file, written at that moment (a kill then leaves it)."""
    names = {n for n in os.listdir(layout.run_dir) if not is_tmp_name(n)}
    if not names <= {layout.lock.name, layout.logs_dir.name, layout.local_checkpoints.name}:
        return False
    ckpt = layout.local_checkpoints
    if ckpt.name not in names:
        return True
    marks = CheckpointLayout(ckpt)
    return ckpt.is_dir() and not ckpt.is_symlink() and \
        {n for n in os.listdir(ckpt) if not is_tmp_name(n)} <= {marks.lock.name, marks.owner.name}
