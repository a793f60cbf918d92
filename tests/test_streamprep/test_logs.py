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
