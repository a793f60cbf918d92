"""`bench_pipeline.py --against REV`: the same whole job at an older revision of this checkout, in the same minutes."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

BASELINE = "50a34e7"  # the code issue 27 was filed against


@pytest.mark.slow
def test_the_job_against_the_issues_code_writes_the_same_tokens(shared_data: Path, tmp_path: Path) -> None:
    """A gates-off job on 2 000 short documents, then the same job at 50a34e7 (extracted from git history): both
    finish, the benchmark prints their pair's ratio, and their token bytes are the same. Regression: run from the
    repository's root, as here, `python -m streamprep` took this checkout's packages for both jobs (the current
    directory comes before PYTHONPATH); 50a34e7 plans no units (issue 28 came after it), so its run has no plan."""
    if subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{BASELINE}^{{commit}}"],
                      capture_output=True).returncode:
        pytest.skip(f"{BASELINE} (issue 27's baseline) is not in this checkout's git history (a shallow clone?)")
    if shared_data.resolve() != (REPO.parent / "shared" / "data").resolve():
        pytest.skip("the benchmarks read ../shared/data beside the checkout, not STREAMPREP_SHARED_DATA")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_pipeline.py"), "--short-docs", "2000",
                           "--repeats", "1", "--only", "c", "--workers", "2", "--against", BASELINE,
                           "--work", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    line = next(x for x in proc.stdout.splitlines() if f"against {BASELINE}:" in x)
    rev_s, ours_s, ratio = map(float, re.search(r"([\d.]+) s / ([\d.]+) s = ([\d.]+)x", line).groups())
    assert rev_s > 0 and ours_s > 0 and ratio == pytest.approx(rev_s / ours_s, abs=0.01)
    assert line.endswith("token bytes identical: yes"), line
    ours, theirs = tmp_path / "run_c_local_0", tmp_path / "run_c_local_0_at_rev"
    assert (theirs / "binidx").is_dir()
    assert list((ours / "checkpoints").glob("*.plan.json")) and not list((theirs / "checkpoints").glob("*.plan.json"))
