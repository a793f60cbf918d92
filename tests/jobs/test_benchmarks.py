"""The benchmarks' own logic (benchmarks/*.py), without running their jobs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from helpers import REPO


@pytest.fixture
def benchmarks(monkeypatch: pytest.MonkeyPatch) -> Path:
    """benchmarks/ importable, as a benchmark run from the checkout has it."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    return REPO / "benchmarks"


@pytest.mark.parametrize("record, choice", [
    ({"requested": "auto", "name": "gigatoken", "version": "0.10.0", "check": {"identical": True}}, "auto"),
    ({"requested": "gigatoken", "name": "gigatoken", "version": "0.10.0"}, "gigatoken"),
    ({"requested": "auto", "name": "hf", "version": "0.21", "fallback_reason": "x"}, "hf"),
    ({"requested": "hf", "name": "hf", "version": "0.21"}, "hf"),
])
def test_bench_pipeline_stage_times_the_backend_the_job_loaded(benchmarks: Path, tmp_path: Path,
                                                               record: dict, choice: str) -> None:
    """Regression: (b) "tokenization stage" always encoded with HF, while the job (tokenizer.backend auto) ran
    gigatoken: the stage alone came out slower than the whole job containing it."""
    import bench_pipeline

    (tmp_path / "run.json").write_text(json.dumps({"tokenizer_backend": record}))
    assert bench_pipeline.job_backend(tmp_path) == choice


def test_bench_pipeline_stage_failure_names_the_stage_and_its_stderr(benchmarks: Path, tmp_path: Path) -> None:
    """Regression: a failed stage process was read as JSON (a json.loads('') traceback naming nothing)."""
    import bench_pipeline

    (tmp_path / "run.json").write_text(json.dumps({"tokenizer_backend": {"name": "hf", "requested": "hf"}}))
    with pytest.raises(SystemExit, match=r"(?s)tokenization stage \(b\) over .* failed \(exit 1\): .*tokenizer\.json"):
        bench_pipeline.stage_alone(tmp_path)  # no tokenizer/tokenizer.json in this run folder


def test_bench_quality_names_the_docs_the_chains_disagree_on(benchmarks: Path) -> None:
    """Regression: with --differ-ok empty, `--against 50a34e7` (as documented) stopped with "the chains disagree on
    1 of 1000 docs" naming no doc, so there was no telling which index --differ-ok needed."""
    import bench_quality

    ours, theirs = [(True, None), (False, "pii"), (True, None)], [(True, None), (True, None), (True, None)]
    assert bench_quality.disagreement(ours, theirs, "50a34e7") == (
        "the chains disagree on 1 of 3 docs (keep, failed_check): [1] (doc 1: this checkout (False, 'pii'), "
        "50a34e7 (True, None)); --differ-ok names []")
    assert bench_quality.disagreement(ours, theirs, "50a34e7", frozenset({1})) is None
    assert bench_quality.disagreement(ours, ours, "50a34e7", frozenset({1})) == (
        "the chains disagree on 0 of 3 docs (keep, failed_check): []; --differ-ok names [1]")
