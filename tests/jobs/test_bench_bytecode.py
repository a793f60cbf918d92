"""The benchmarks time jobs as installed code runs: with compiled bytecode (`benchmarks/corpus.cache_bytecode`)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO


def test_cache_bytecode_compiles_the_trees_and_lets_the_jobs_keep_theirs(monkeypatch: pytest.MonkeyPatch,
                                                                         tmp_path: Path) -> None:
    """With PYTHONDONTWRITEBYTECODE=1 (this sandbox sets it) every process of a job run from a checkout compiled the
    package's sources again; after the call a tree's modules have their .pyc, the variable is gone for the jobs the
    benchmark starts, and a module such a job imports for the first time is written too."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    import corpus

    monkeypatch.setattr(corpus, "PACKAGES", ())  # this checkout's own packages are not this test's to compile
    tree, later = tmp_path / "pkg", tmp_path / "later"
    for folder in (tree, later):
        folder.mkdir()
        (folder / "mod.py").write_text("VALUE = 42\n")
    line = corpus.cache_bytecode(tree)
    assert "PYTHONDONTWRITEBYTECODE" not in os.environ and not sys.dont_write_bytecode
    assert line == "bytecode: cached, as installed code has it (1 source trees compiled first; " \
                   "PYTHONDONTWRITEBYTECODE unset for the jobs)"
    assert Path(importlib.util.cache_from_source(str(tree / "mod.py"))).is_file()
    job = subprocess.run([sys.executable, "-c", "import mod; print(mod.VALUE)"], cwd=later, capture_output=True,
                         text=True, check=True)
    assert job.stdout == "42\n"
    assert Path(importlib.util.cache_from_source(str(later / "mod.py"))).is_file()
