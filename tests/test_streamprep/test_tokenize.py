"""A shard task's retry removes exactly the temporary files a killed writer of that task left."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from streamprep import atomic
from streamprep.tokenize import drop_tmp_files


def test_drop_tmp_files_removes_this_tasks_temporary_files_and_nothing_else(tmp_path: Path) -> None:
    bins, receipts = tmp_path / "binidx", tmp_path / "receipts"
    bins.mkdir()
    receipts.mkdir()
    kept = [bins / "part-00007_text_document.bin", bins / "part-00070_text_document.bin",  # another task's output
            bins / ".part-00007_text_document.idx.streamprep-tmp.abc",  # not a name atomic.tmp_path makes
            bins / f".part-00070_text_document.bin{atomic.TMP_MARK}12", receipts / "part-00007.json"]
    stale = [atomic.tmp_path(bins / "part-00007_text_document.bin"),
             bins / f".part-00007_text_document.idx{atomic.TMP_MARK}9",
             receipts / f".part-00007.json{atomic.TMP_MARK}31"]
    for p in kept + stale:
        p.touch()
    task = SimpleNamespace(prefix=str(bins / "part-00007_text_document"),
                           receipt_path=str(receipts / "part-00007.json"))
    drop_tmp_files(task)  # type: ignore[arg-type]
    assert [p.exists() for p in kept] == [True] * len(kept) and not any(p.exists() for p in stale)
    nowhere = SimpleNamespace(prefix=str(tmp_path / "none/p"), receipt_path=str(tmp_path / "none/r.json"))
    drop_tmp_files(nowhere)  # type: ignore[arg-type]  # directories not made yet: nothing to drop, no error
