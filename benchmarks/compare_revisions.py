"""Do two git revisions write the same bytes? Runs configs at both and compares every file of the run dirs.

    python benchmarks/compare_revisions.py BASE [HEAD] [--config configs/demo.yaml ...] [--engine local] [--workers 2]

Each revision is checked out (`git worktree add --detach`) beside a `shared` link to ../shared; both
read the inputs as the first revision's config resolves them (the demo reads the repo's own docs). The first revision runs each config twice: files that
differ between those two runs are bookkeeping that changes on every run (timestamps, timings, run ids)
and are listed, not compared. Every other file must be byte-identical at the second revision, and both
revisions must write the same set of files, except under checkpoints/ (bookkeeping whose format a revision
may change: listed, not compared). Prints one line per config; exit 1 on any difference; exit 2 with one line
naming a revision git does not know. BASE may equal HEAD (`compare_revisions.py HEAD`: is the run deterministic?);
the worktrees are removed however the run ends.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CHECKPOINTS = "checkpoints"
SHARED = REPO.parent / "shared"
DEFAULT_CONFIGS = ["configs/demo.yaml", "configs/sft_chat.yaml", "configs/sft_instruction.yaml",
                   "configs/dpo.yaml", "configs/grpo.yaml"]


def resolve(rev: str) -> str:
    """`rev`'s commit; SystemExit (exit 2) naming `rev` when git knows no such commit (a typo, a shallow clone)."""
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", "--end-of-options",
                          f"{rev}^{{commit}}"], capture_output=True, text=True)
    if git.returncode:
        print(f"compare_revisions: unknown revision {rev!r} (no such commit in {REPO})", file=sys.stderr)
        raise SystemExit(2)
    return git.stdout.strip()


def checkout(rev: str, tag: str, work: Path, trees: list[Path]) -> None:
    """A worktree of `rev` at work/<tag>-<rev> (distinct when BASE == HEAD; beside work/shared), appended to
    `trees` once git registered it, so that the caller removes it whatever fails later."""
    tree = work / f"{tag}-{rev.replace('/', '_')}"
    git = subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(tree), resolve(rev)],
                         capture_output=True, text=True)
    if git.returncode:  # what a half-made worktree registered goes too
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
        reason = (git.stderr.strip().splitlines() or ["failed"])[-1]
        print(f"compare_revisions: git worktree add of {rev!r}: {reason}", file=sys.stderr)
        raise SystemExit(2)
    trees.append(tree)


def run(tree: Path, inputs: Path, config: str, engine: str, workers: int | None, run_dir: Path) -> None:
    """Run `config` with `tree`'s code on `inputs`' files (its relative paths resolved in the `inputs` tree:
    the demo reads the repo's own docs, which differ between revisions)."""
    cfg = yaml.safe_load((tree / config).read_text())
    cfg.setdefault("execution", {})["engine"] = engine
    if workers is not None:  # else the config's own
        cfg["execution"]["workers"] = workers
    base = (inputs / config).parent
    for ds in cfg["datasets"]:
        ds["path"] = ds["path"] if "://" in ds["path"] else os.path.normpath(base / ds["path"])
    path = tree / config.replace(".yaml", f".compare-{engine}.yaml")  # beside the original: same relative paths
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run([sys.executable, "-m", "streamprep", "ingest", "--config", str(path), "--run-dir",
                           str(run_dir)], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{tree.name} {config}: exit {proc.returncode}: {proc.stderr[-1500:]}")


def hashes(run_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(run_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run_dir.rglob("*")) if p.is_file() and "logs" not in p.relative_to(run_dir).parts}


def compare(config: str, trees: list[Path], engine: str, workers: int | None, work: Path) -> bool:
    name = Path(config).stem
    runs = [(trees[0], "a1"), (trees[0], "a2"), (trees[1], "b")]
    h = {}
    for tree, tag in runs:
        out = work / "run"  # one path for every run: outputs that name their run dir compare equal
        run(tree, trees[0], config, engine, workers, out)
        h[tag] = hashes(out)
        out.rename(work / f"{name}-{tag}")
    volatile = sorted(k for k in h["a1"] if h["a1"][k] != h["a2"].get(k))
    only = sorted(set(h["a1"]) ^ set(h["b"]))
    bookkeeping = [k for k in only if k.startswith(f"{CHECKPOINTS}/")]  # a checkpoint format may add files
    only = [k for k in only if k not in bookkeeping]
    differ = sorted(k for k in h["a1"] if k in h["b"] and k not in volatile and h["a1"][k] != h["b"][k])
    same = len(h["a1"]) - len(volatile) - len(differ) - len(set(h["a1"]) - set(h["b"]))
    print(f"{config}: {same} files byte-identical; changing on every run (not compared): {volatile or 'none'}; "
          f"differ: {differ or 'none'}; only in one revision: {only or 'none'}"
          + (f"; checkpoint files only in one revision (not compared): {bookkeeping}" if bookkeeping else ""))
    return not differ and not only


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base")
    ap.add_argument("head", nargs="?", default="HEAD")
    ap.add_argument("--config", action="append", help=f"default: {' '.join(DEFAULT_CONFIGS)}")
    ap.add_argument("--engine", default="local")
    ap.add_argument("--workers", type=int, default=None, help="execution.workers for every run (default: the config's)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="streamprep-compare-") as tmp:
        work = Path(tmp)
        (work / "shared").symlink_to(SHARED)
        trees: list[Path] = []
        try:
            checkout(a.base, "base", work, trees)
            checkout(a.head, "head", work, trees)
            ok = all([compare(c, trees, a.engine, a.workers, work) for c in a.config or DEFAULT_CONFIGS])
        finally:
            for tree in trees:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], capture_output=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
