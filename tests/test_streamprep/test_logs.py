"""The log set-up imports structlog without rich, yet renders what structlog renders with rich loaded up front."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from helpers import REPO

# logs a plain line and one carrying an exception (with a long dict local, which rich renders its own way), then
# prints which of rich's modules were loaded before that exception line
SCRIPT = r"""
import sys
from pathlib import Path
if sys.argv[2] == "rich-first":
    __import__("rich")  # binds no name: the traceback shows the module's globals
from streamprep import logs
logs.configure(Path(sys.argv[1]), console=True)
log = logs.get("probe")
log.info("plain", n=1, path="/x y")
print("rich loaded:", "rich" in sys.modules, flush=True)
def fail(long_local, many):
    raise ValueError("boom")
try:
    fail("x" * 200, dict.fromkeys(range(20)))
except ValueError:
    log.exception("failed", part=3)
log.info("after")
"""
STAMP = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z|0x[0-9a-f]+")  # and addresses in reprs


def _run(tmp_path, mode: str) -> tuple[str, str, str]:
    run_dir = tmp_path / mode
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(run_dir), mode], capture_output=True, text=True,
                          cwd=REPO, env=env, check=True)
    log_file = (run_dir / "logs" / "streamprep.log").read_text()
    return proc.stdout, STAMP.sub("T", proc.stderr), STAMP.sub("T", log_file)


def test_rich_is_loaded_only_by_a_line_with_an_exception_and_the_output_is_unchanged(tmp_path):
    lazy_out, lazy_err, lazy_file = _run(tmp_path, "lazy")
    eager_out, eager_err, eager_file = _run(tmp_path, "rich-first")
    assert lazy_out == "rich loaded: False\n" and eager_out == "rich loaded: True\n"
    assert lazy_err == eager_err and lazy_file == eager_file
    assert "ValueError: boom" in lazy_err and "long_local" in lazy_err  # rich's traceback, locals shown
    lines = lazy_file.splitlines()
    assert len(lines) == 3 and '"event": "failed"' in lines[1] and "... +10" in lines[1]  # rich's repr


def test_a_run_log_that_cannot_be_written_is_said_once_and_the_job_goes_on(tmp_path, capsys) -> None:
    """Regression: with the run log's disk full, logging printed a ~45-line traceback for every line (a thousand
    lines for a 3-second job), and closing the log at the end raised, failing a run that had completed."""
    import logging
    from pathlib import Path

    from streamprep import logs

    handler = logs._RunLog(Path("/dev/full"), maxBytes=1 << 20, backupCount=2, encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(message)s"))
    for n in range(50):
        handler.handle(logging.LogRecord("streamprep.probe", logging.INFO, __file__, 1, f"line {n}", None, None))
    handler.close()  # what was buffered cannot be written either: no error
    err = capsys.readouterr().err
    assert err.splitlines() == ["streamprep: warning: cannot write the run log /dev/full (OSError: [Errno 28] No space "
                                "left on device); the job goes on without it"]


def test_the_console_escapes_control_characters_in_values_and_keeps_a_tracebacks_lines(tmp_path, capsys) -> None:
    """Regression: a log value holding control characters (a run dir named with ESC or BEL) reached the terminal raw
    in the console's line; each is escaped now, a traceback (a worker's `exception`) keeping its lines, and the run
    log's JSON holds the text as it was."""
    import json

    from streamprep import logs

    exception = 'Traceback (most recent call last):\n  File "x\x1b.py", line 1\nValueError: a\x07'
    with logs.configured(tmp_path / "r", console=True):
        logs.replay([{"event": "unit failed", "level": "error", "component": "ingest", "path": "a\x1b[31mb",
                      "exception": exception}])
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and " path=a\\x1b[31mb " in err
    assert err.endswith('\nTraceback (most recent call last):\n  File "x\\x1b.py", line 1\nValueError: a\\x07\n')
    record = json.loads((tmp_path / "r" / "logs" / logs.LOG_NAME).read_text())
    assert (record["path"], record["exception"]) == ("a\x1b[31mb", exception)
