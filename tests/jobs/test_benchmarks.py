"""The benchmarks' own logic (benchmarks/*.py), without running their jobs."""
from __future__ import annotations

import json
import subprocess
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


@pytest.fixture
def tiny_repo(benchmarks: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A git repository of one commit, as compare_revisions' REPO (its SHARED an empty folder)."""
    import compare_revisions

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git[:3], "init", "-q"], check=True)
    (repo / "f.txt").write_text("x\n")
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    (tmp_path / "shared").mkdir()
    monkeypatch.setattr(compare_revisions, "REPO", repo)
    monkeypatch.setattr(compare_revisions, "SHARED", tmp_path / "shared")
    return repo


def worktrees(repo: Path) -> list[str]:
    out = subprocess.run(["git", "-C", str(repo), "worktree", "list", "--porcelain"], capture_output=True, text=True,
                         check=True).stdout
    return [line for line in out.splitlines() if line.startswith("worktree ")]


@pytest.mark.parametrize("argv", [["nosuchrev"], ["HEAD", "nosuchrev"]])
def test_compare_revisions_unknown_revision_is_one_line_and_leaves_no_worktree(
        tiny_repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    """Regression: an unknown revision was a CalledProcessError traceback (git's message swallowed), and a HEAD
    checked out before it stayed registered in .git/worktrees."""
    import compare_revisions

    monkeypatch.setattr(sys, "argv", ["compare_revisions.py", *argv])
    with pytest.raises(SystemExit) as exc:
        compare_revisions.main()
    assert exc.value.code == 2
    assert capsys.readouterr().err == f"compare_revisions: unknown revision 'nosuchrev' (no such commit in {tiny_repo})\n"
    assert worktrees(tiny_repo) == [f"worktree {tiny_repo}"]


def test_compare_revisions_base_equal_to_head_gets_two_trees_removed_after_a_failure(
        tiny_repo: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: `compare_revisions.py HEAD` (HEAD against the default HEAD) put both trees at work/HEAD, whose
    second `git worktree add` failed; whatever fails once the trees exist, none stays registered."""
    import compare_revisions

    seen: list[list[Path]] = []

    def failing_compare(config: str, trees: list[Path], *args: object) -> bool:
        seen.append([t for t in trees if (t / "f.txt").read_text() == "x\n"])
        raise RuntimeError("a run failed")

    monkeypatch.setattr(compare_revisions, "compare", failing_compare)
    monkeypatch.setattr(sys, "argv", ["compare_revisions.py", "HEAD", "--config", "c.yaml"])
    with pytest.raises(RuntimeError, match="a run failed"):
        compare_revisions.main()
    assert len(seen[0]) == 2 and seen[0][0] != seen[0][1]
    assert worktrees(tiny_repo) == [f"worktree {tiny_repo}"]
