"""Megatron indexed dataset (`PREFIX.bin` + `PREFIX.idx`): writer and reader, byte layout in one place.

Layout of `.idx` (little-endian, no padding), as megatron.core.datasets.indexed_dataset writes it:

    0   9 bytes  magic b"MMIDIDX\\x00\\x00"
    9   uint64   version = 1
    17  uint8    dtype code (DTYPE_CODES)
    18  uint64   S  number of sequences
    26  uint64   D  number of document-index entries (documents + 1)
    34  int32[S] sequence lengths (tokens)
        int64[S] sequence pointers (byte offset of each sequence in .bin)
        int64[D] document indices: 0, then cumulative sequence count after each document

`.bin` is the token ids back to back in that dtype. One sequence per document here (GPT pretraining).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from streamprep.atomic import fsync_dir, naming, tmp_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
CODE_OF: dict[np.dtype, int] = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
UINT16_VOCAB_LIMIT = 65500  # Megatron's DType.optimal_dtype threshold


def optimal_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits with Megatron's margin, else int32 (same rule as preprocess_data.py)."""
    return np.dtype(np.uint16 if vocab_size < UINT16_VOCAB_LIMIT else np.int32)


def prefix_paths(prefix: str | os.PathLike) -> tuple[Path, Path]:
    p = str(prefix)
    return Path(p + ".bin"), Path(p + ".idx")


def index_bytes(lengths: np.ndarray, dtype: np.dtype, doc_indices: np.ndarray | None = None) -> bytes:
    """The exact `.idx` bytes for sequences of `lengths` tokens (one document per sequence by default)."""
    lengths = np.asarray(lengths, dtype=np.int32)
    s = len(lengths)
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(s, dtype=np.int64)
    if s > 1:
        np.cumsum(lengths[:-1].astype(np.int64) * itemsize, out=pointers[1:])
    if doc_indices is None:
        doc_indices = np.arange(s + 1, dtype=np.int64)
    doc_indices = np.asarray(doc_indices, dtype=np.int64)
    header = HEADER.pack(MAGIC, VERSION, CODE_OF[np.dtype(dtype)], s, len(doc_indices))
    return b"".join((header, lengths.tobytes(), pointers.tobytes(), doc_indices.tobytes()))


class IndexedDatasetWriter:
    """Streams sequences into `PREFIX.bin`, then writes `PREFIX.idx`; both appear atomically on `close()`.

    Files are written under temporary names, fsynced, and renamed `.bin` first, `.idx` last, so a
    prefix whose `.idx` exists always has its complete `.bin` beside it. `suspend()` closes the open `.bin`
    (a caller with many writers stays under the process's open-file limit); the next write reopens it to append.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        self.bin_path, self.idx_path = prefix_paths(prefix)
        self.bin_path.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = tmp_path(self.bin_path)
        self._idx_tmp = tmp_path(self.idx_path)
        self._bin: BinaryIO | None = open(self._bin_tmp, "wb")
        self._lengths: list[np.ndarray] = []
        self._doc_ends: list[np.ndarray] = []  # cumulative sequence count after each document
        self._sequences = 0

    def _write(self, token_arrays: list[np.ndarray]) -> int:
        arrays = [np.asarray(a, dtype=self.dtype) for a in token_arrays]
        if any(a.size == 0 for a in arrays):
            raise ValueError("zero-length sequences are not written (drop empty documents upstream)")
        with naming(self.bin_path):
            self._out().write(np.concatenate(arrays).tobytes())
        self._lengths.append(np.fromiter((a.size for a in arrays), dtype=np.int32, count=len(arrays)))
        self._sequences += len(arrays)
        return len(arrays)

    def add_documents(self, token_arrays: list[np.ndarray]) -> None:
        """Append one sequence (= one document) per array, in one write (GPT pretraining)."""
        if token_arrays:
            n = self._write(token_arrays)
            self._doc_ends.append(np.arange(self._sequences - n + 1, self._sequences + 1, dtype=np.int64))

    def add_flat(self, tokens: np.ndarray, lengths: np.ndarray, eod_id: int | None = None) -> None:
        """Append one document per entry of `lengths` from `tokens` (their ids back to back), in one write;
        with `eod_id`, each document gets it appended (scattered into one output buffer, no per-document
        arrays). Every length must be > 0: drop empty documents upstream, where their positions are known."""
        lengths = np.asarray(lengths, dtype=np.int64)
        n = len(lengths)
        if n == 0:
            return
        if (lengths <= 0).any():
            raise ValueError("zero-length sequences are not written (drop empty documents upstream)")
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {len(tokens)} tokens were given")
        if eod_id is None:
            out = np.asarray(tokens, dtype=self.dtype)
        else:
            lengths = lengths + 1
            out = np.empty(len(tokens) + n, dtype=self.dtype)
            ends = np.cumsum(lengths) - 1           # where each document's EOD goes
            body = np.ones(len(out), dtype=bool)
            body[ends] = False
            out[body] = tokens
            out[ends] = eod_id
        with naming(self.bin_path):
            self._out().write(out.tobytes())
        self._lengths.append(lengths.astype(np.int32))
        self._sequences += n
        self._doc_ends.append(np.arange(self._sequences - n + 1, self._sequences + 1, dtype=np.int64))

    def add_document(self, sequences: list[np.ndarray]) -> None:
        """Append one document made of several sequences (e.g. GRPO responses of one prompt)."""
        if not sequences:
            raise ValueError("a document needs at least one sequence")
        self._write(sequences)
        self._doc_ends.append(np.array([self._sequences], dtype=np.int64))

    def _out(self) -> BinaryIO:
        """The `.bin` temporary file, reopened to append after `suspend()`."""
        if self._bin is None:
            self._bin = open(self._bin_tmp, "ab")
        return self._bin

    @property
    def suspended(self) -> bool:
        return self._bin is None

    def suspend(self) -> None:
        """Close the `.bin` temporary file (its bytes so far stay); the next write or `close()` reopens it."""
        if self._bin is not None:
            self._bin.close()
            self._bin = None

    @property
    def num_documents(self) -> int:
        return int(sum(len(x) for x in self._doc_ends))

    def close(self) -> None:
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, dtype=np.int32)
        doc_indices = np.concatenate([np.zeros(1, dtype=np.int64), *self._doc_ends])
        with naming(self.bin_path):
            out = self._out()
            out.flush()
            os.fsync(out.fileno())
            out.close()
        self._bin = None
        with naming(self.idx_path), open(self._idx_tmp, "wb") as fh:
            fh.write(index_bytes(lengths, self.dtype, doc_indices))
            fh.flush()
            os.fsync(fh.fileno())
        with naming(self.idx_path):  # (an error naming a temporary file names its final one)
            os.replace(self._bin_tmp, self.bin_path)
            os.replace(self._idx_tmp, self.idx_path)
        fsync_dir(self.bin_path.parent)

    def abort(self) -> None:
        self.suspend()
        for p in (self._bin_tmp, self._idx_tmp):
            p.unlink(missing_ok=True)


@dataclass(frozen=True)
class IndexedDataset:
    """Minimal reader for verification and exports: header fields, arrays and a memory-mapped `.bin`."""

    dtype: np.dtype
    lengths: np.ndarray
    pointers: np.ndarray
    doc_indices: np.ndarray
    bin_path: Path

    @classmethod
    def open(cls, prefix: str | os.PathLike) -> "IndexedDataset":
        bin_path, idx_path = prefix_paths(prefix)
        raw = idx_path.read_bytes()
        if len(raw) < HEADER.size:
            raise ValueError(f"{idx_path}: truncated header ({len(raw)} bytes)")
        magic, version, code, s, d = HEADER.unpack_from(raw)
        if magic != MAGIC:
            raise ValueError(f"{idx_path}: bad magic {magic!r}")
        if version != VERSION:
            raise ValueError(f"{idx_path}: unsupported version {version}")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path}: unknown dtype code {code}")
        expected = HEADER.size + 12 * s + 8 * d
        if len(raw) != expected:
            raise ValueError(f"{idx_path}: size {len(raw)} != {expected} for S={s} D={d}")
        off = HEADER.size
        lengths = np.frombuffer(raw, np.int32, s, off)
        pointers = np.frombuffer(raw, np.int64, s, off + 4 * s)
        docs = np.frombuffer(raw, np.int64, d, off + 12 * s)
        return cls(np.dtype(DTYPE_CODES[code]), lengths, pointers, docs, bin_path)

    def check(self) -> list[str]:
        """Every inconsistency megatron-core would silently trust (formats.md §1.5); empty when sound."""
        problems = []
        item = self.dtype.itemsize
        total = int(self.lengths.astype(np.int64).sum())
        if self.bin_path.stat().st_size != total * item:
            problems.append(f"{self.bin_path}: {self.bin_path.stat().st_size} bytes, index says {total * item}")
        if len(self.lengths) and (self.lengths <= 0).any():
            problems.append(f"{self.bin_path}: zero or negative sequence length")
        expect_ptr = np.concatenate(([0], np.cumsum(self.lengths[:-1].astype(np.int64) * item))) if len(self.lengths) else self.pointers
        if not np.array_equal(self.pointers, expect_ptr):
            problems.append(f"{self.bin_path}: pointers disagree with lengths")
        if len(self.doc_indices) == 0 or self.doc_indices[0] != 0 or self.doc_indices[-1] != len(self.lengths) \
                or (np.diff(self.doc_indices) < 0).any():
            problems.append(f"{self.bin_path}: bad document indices")
        return problems

    def tokens(self) -> np.ndarray:
        """All token ids, memory-mapped (no copy)."""
        if self.bin_path.stat().st_size == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.bin_path, dtype=self.dtype, mode="r")

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.pointers[i]) // self.dtype.itemsize
        return np.asarray(self.tokens()[start:start + int(self.lengths[i])])
