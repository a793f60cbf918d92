"""The `streamprep` commands, one module each, loaded by name when the command runs (`cli.COMMANDS`): `--help`,
`status` and `logs` then import neither the pipeline nor numpy or pyarrow. Each module's `run(args) -> exit code`
takes the parsed arguments; `cli.main` turns its errors into one line and an exit code."""
from __future__ import annotations

from pathlib import Path

from streamprep.config import ConfigError, check_utf8_name, user_path
from streamprep.layout import RunLayout
from streamprep.lock import holder_if_running


def require_run_dir(path: str) -> Path:
    """`path` as a run dir, or a one-line error. A folder holding only what a job makes before run.json
    (`RunLayout.only_a_start`) is one whose job is starting, or was killed in that moment: the error says which, not
    "not a run directory"; a folder holding anything else is no run's."""
    run_dir = user_path(path)
    if run_dir.is_dir():  # `audit` writes its name in audit.json, `status --json` prints it: JSON cannot hold it
        check_utf8_name("run dir", run_dir.absolute(), "run.json names it")
    layout = RunLayout(run_dir)
    if not layout.run_json.is_file():
        if layout.only_a_start():
            if holder_if_running(layout.lock) is not None:
                raise ConfigError(f"{run_dir}: a job is starting here and has not written run.json yet; try again "
                                  "in a moment")
            raise ConfigError(f"{run_dir}: its job stopped before it wrote run.json; re-run the same streamprep "
                              "ingest command to start it")
        if not run_dir.exists():  # "no run.json" sent one looking for a run.json in a folder mistyped
            raise ConfigError(f"{run_dir}: no such run directory")
        if not run_dir.is_dir():
            raise ConfigError(f"{run_dir}: not a directory (a streamprep run directory holds run.json)")
        raise ConfigError(f"{run_dir}: not a streamprep run directory (no run.json)")
    return run_dir
