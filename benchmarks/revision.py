"""An older revision's packages, taken from this checkout's git history, for the benchmarks' `--against REV`."""
from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

from corpus import REPO


def extract(rev: str, paths: list[str], into: Path) -> Path:
    """`paths` (folders of the repository) as they are at `rev`, extracted into `into`; SystemExit naming `rev`
    when git cannot archive it (a shallow clone, a typo)."""
    git = subprocess.run(["git", "-C", str(REPO), "archive", rev, *paths], capture_output=True)
    if git.returncode:
        raise SystemExit(f"--against {rev}: {git.stderr.decode().strip() or 'git archive failed'}")
    with tarfile.open(fileobj=io.BytesIO(git.stdout)) as archive:
        archive.extractall(into, filter="data")
    return into
