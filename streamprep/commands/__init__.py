"""The `streamprep` commands, one module each, loaded by name when the command runs (`cli.COMMANDS`): `--help`,
`status` and `logs` then import neither the pipeline nor numpy or pyarrow. Each module's `run(args) -> exit code`
takes the parsed arguments; `cli.main` turns its errors into one line and an exit code."""
from __future__ import annotations

from pathlib import Path

from streamprep.config import ConfigError
from streamprep.layout import RunLayout


def require_run_dir(path: str) -> Path:
    run_dir = Path(path)
    if not RunLayout(run_dir).run_json.is_file():
        raise ConfigError(f"{run_dir}: not a streamprep run directory (no run.json)")
    return run_dir
