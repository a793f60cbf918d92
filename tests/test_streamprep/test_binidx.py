"""The .bin/.idx writer against formats.md's worked example and megatron-core's own reader."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from streamprep.binidx import IndexedDataset, IndexedDatasetWriter, index_bytes, optimal_dtype

# formats.md §1.4: preprocess_data.py output for "1 2 3", "4 5", "6", "7 8 9 10" with EOD 100.
EXPECTED_IDX = bytes.fromhex(
    "4d4d49444944580000" "0100000000000000" "08" "0400000000000000" "0500000000000000"
    "04000000030000000200000005000000"
    "0000000000000000" "0800000000000000" "0e00000000000000" "1200000000000000"
    "0000000000000000" "0100000000000000" "0200000000000000" "0300000000000000" "0400000000000000")
DOCS = [[1, 2, 3, 100], [4, 5, 100], [6, 100], [7, 8, 9, 10, 100]]


def test_worked_example_is_byte_identical(tmp_path: Path) -> None:
    w = IndexedDatasetWriter(tmp_path / "out_text_document", np.uint16)
    w.add_documents([np.array(d) for d in DOCS[:2]])
    w.add_documents([np.array(d) for d in DOCS[2:]])
    w.close()
    assert (tmp_path / "out_text_document.idx").read_bytes() == EXPECTED_IDX
    assert (tmp_path / "out_text_document.bin").read_bytes() == np.array(sum(DOCS, []), np.uint16).tobytes()
    assert len(EXPECTED_IDX) == 122
    ds = IndexedDataset.open(tmp_path / "out_text_document")
    assert ds.check() == [] and [list(ds[i]) for i in range(4)] == DOCS
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out_text_document.bin", "out_text_document.idx"]


def test_dtype_threshold_matches_megatron() -> None:
    assert optimal_dtype(65499) == np.uint16 and optimal_dtype(65500) == np.int32
    assert index_bytes(np.array([1]), np.int32)[17] == 4


@pytest.mark.slow
def test_megatron_core_reads_our_files(tmp_path: Path) -> None:
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 70000, size=rng.integers(1, 50)) for _ in range(40)]
    w = IndexedDatasetWriter(tmp_path / "x", np.int32)
    w.add_documents(docs)
    w.close()
    ds = indexed.IndexedDataset(str(tmp_path / "x"))
    assert len(ds) == 40
    assert all(np.array_equal(ds[i], d) for i, d in enumerate(docs))
    assert list(ds.document_indices) == list(range(41))


def test_check_catches_inconsistencies(tmp_path: Path) -> None:
    w = IndexedDatasetWriter(tmp_path / "y", np.uint16)
    w.add_documents([np.array([1, 2]), np.array([3])])
    w.close()
    with open(tmp_path / "y.bin", "ab") as fh:
        fh.write(b"\0\0")
    assert "index says 6" in IndexedDataset.open(tmp_path / "y").check()[0]
    (tmp_path / "y.idx").write_bytes((tmp_path / "y.idx").read_bytes()[:-3])
    with pytest.raises(ValueError, match="size"):
        IndexedDataset.open(tmp_path / "y")


def test_empty_documents_are_refused_and_abort_leaves_nothing(tmp_path: Path) -> None:
    w = IndexedDatasetWriter(tmp_path / "z", np.uint16)
    with pytest.raises(ValueError, match="zero-length"):
        w.add_documents([np.array([], dtype=np.uint16)])
    w.abort()
    assert list(tmp_path.iterdir()) == []
