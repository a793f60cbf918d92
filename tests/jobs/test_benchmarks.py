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


def log_lines(*events: dict) -> list[dict]:
    return [{"timestamp": "2026-12-01T00:00:00Z", **e} for e in events]


def test_bench_pipeline_says_how_many_shards_the_xenna_stage_ran_or_why_none(benchmarks: Path) -> None:
    """Regression: `--engines local,xenna` printed "xenna whole job = 1.66 x local throughput" for a job whose
    shards all went to the local workers before Ray came up (its log: shards_local 2 of 2, ray_up false)."""
    import bench_pipeline

    never = bench_pipeline.where_tokenized(log_lines(
        {"event": "tokenization done", "shards": 2, "shards_local": 2},
        {"event": "job done before the xenna stage was needed; not starting it", "ray_up": False}))
    assert never == {"shards": 2, "shards_local": 2,
                     "no_stage": "the job was done before the stage was needed; Ray never came up"}
    ran = bench_pipeline.where_tokenized(log_lines({"event": "tokenization done", "shards": 9, "shards_local": 4},
                                                   {"event": "xenna stage answering", "shards_local": 3}))
    assert bench_pipeline.xenna_shards([ran, never]) == (
        "run 0: the xenna stage ran 5 of 9 shards; run 1: the xenna stage ran 0 of 2 shards "
        "(the job was done before the stage was needed; Ray never came up)")


def test_bench_driver_gives_no_driver_share_for_one_worker(benchmarks: Path) -> None:
    """Regression: `workers 1: ... driver 1.86 of 1.86 CPU-s (100.0 %) ... one driver feeds ~1 cores`, while with
    `workers: 1` the job's worker is a thread in the driver's process."""
    import bench_driver

    m = {"seconds": 3.0, "driver": 1.86, "tree": 1.9}
    one = bench_driver.share_line(1, m, 0.005)
    assert one == ("workers 1: 3.00 s wall; 1.90 CPU-s, 1.86 of them in the driver's process, whose thread is the "
                   "job's one worker (no driver share: see workers 2)")
    assert bench_driver.share_line(2, m, 0.005).startswith("workers 2: 3.00 s wall; driver 1.86 of 1.90 CPU-s (97.9 %)")
