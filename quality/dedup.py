"""Exact dedup: the SHA-256 digests of kept (normalised) texts, ≤ 16 bytes resident per kept document.

The truth is an append-only log of full 32-byte digests, in insertion order (ingest keeps it under the
checkpoint dir; a bare `DedupIndex()` uses an anonymous temp file). Resident are only 64-bit digest
prefixes with the uint32 ordinal of their digest in the log, kept as sorted runs, plus a dict of the
latest digests added one at a time (a batch, `add_many`, goes to the log and becomes a run at once). Runs
are merged tiered: once the newest `_TIER` runs are of about one size, they become one, so a digest is
copied about log_8(n / batch) times. In front of the runs, a blocked Bloom filter over the prefixes
(`_PrefixFilter`, four bits in one 64-bit word a digest, 8-32 bits a digest) answers most digests that no
run holds with one word, without a search per run. A prefix hit is settled by reading the full digest
back from the log (pread at ordinal * 32), so two different texts are never taken for duplicates.
Resident: 12 B per digest in the runs, 1-4 B in the filter, plus the bounded buffer. Loading a log is numpy
over the file (`np.fromfile` + one sort), not a Python loop. A log with a path is open only during a call that
reads or writes it: a holder keeps an index per dataset for the whole job, and a descriptor each ran the process
out of them (EMFILE at 1024 datasets, or the 256 of a low `ulimit -n`).
"""
from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import islice
from pathlib import Path
from typing import BinaryIO

import numpy as np

DIGEST_SIZE = 32
_LOAD_CHUNK = 1 << 20
BUFFER = 1 << 16           # digests held in full (dict) before they move to the sorted runs
_TIER = 8                  # this many newest runs of about one size are merged into one
_FILTER_MIN_BITS = 20      # the prefix filter's least size: 2^20 slots (128 KiB)
_BITS = 4                  # bits a digest sets in its filter word (`_PrefixFilter.maybe_one` spells them out)
_FILTER_CHUNK = 1 << 14    # keys the filter takes at a time: its temporaries stay in cache (1 M at once: 4x slower)
_KEY = np.dtype("<u8")     # the first 8 digest bytes, read little-endian
_ORD = np.uint32           # ordinal in the log: 4 G kept documents per index
DUPLICATE_REASON = "exact duplicate of a kept record"
NO_DIGEST = bytes(DIGEST_SIZE)  # a worker Summary's digest of a record with no usable text (no SHA-256 is all zeros)


def digest_words(digests: bytes | Sequence[bytes]) -> np.ndarray:
    """32-byte `digests` (back to back in one bytes, as a worker's Summary carries them, or a sequence of
    them) as rows of four little-endian uint64 words; the first is the index's prefix key."""
    joined = digests if isinstance(digests, bytes) else b"".join(digests)
    n = len(joined) // DIGEST_SIZE if isinstance(digests, bytes) else len(digests)
    if len(joined) != DIGEST_SIZE * n:
        raise ValueError(f"digests must be {DIGEST_SIZE} bytes each")
    return np.frombuffer(joined, _KEY).reshape(n, DIGEST_SIZE // 8)


class DedupIndex:
    """The set of kept digests (the one exact-dedup authority of a dataset)."""

    __slots__ = ("_path", "_fh", "_made", "_n", "_written", "_synced", "_buf", "_runs", "_filter", "_buffer_size")

    def __init__(self, log: Path | None = None, count: int | None = None, buffer: int = BUFFER) -> None:
        """Open the digest log `log` (created at the first flush), or an anonymous temp file when None.
        `count` digests of it are valid (the checkpoint's `dedup_count`; a longer log is truncated);
        all of them when None."""
        self._path, self._buffer_size = log, buffer
        self._fh: BinaryIO | None = None  # the anonymous temp file (a log with a path is opened by `_log`)
        self._made = log is not None and log.exists()
        size = log.stat().st_size if self._made else 0
        if count is None:
            if size % DIGEST_SIZE:
                raise ValueError(f"dedup log {log} length {size} is not a multiple of {DIGEST_SIZE}")
            count = size // DIGEST_SIZE
        elif size < count * DIGEST_SIZE:
            raise ValueError(f"dedup log {log} holds {size // DIGEST_SIZE} digests, {count} expected")
        if size > count * DIGEST_SIZE:
            os.truncate(log, count * DIGEST_SIZE)
        self._n = self._written = self._synced = count
        self._buf: dict[bytes, None] = {}  # the latest digests in full, insertion-ordered, not yet in a run
        self._runs: list[tuple[np.ndarray, np.ndarray]] = [self._load(count)] if count else []  # oldest first
        self._filter = _PrefixFilter(self._runs, count)

    def _load(self, count: int) -> tuple[np.ndarray, np.ndarray]:
        """Prefixes of the first `count` logged digests, sorted, with their ordinals (vectorised; read
        in chunks so the transient peak stays near 28 B per digest rather than the log's size)."""
        keys = np.empty(count, _KEY)
        with self._log() as fh:
            for start in range(0, count, _LOAD_CHUNK):
                n = min(_LOAD_CHUNK, count - start)
                rows = np.fromfile(fh, dtype=np.uint8, count=n * DIGEST_SIZE).reshape(n, DIGEST_SIZE)
                keys[start:start + n] = rows[:, :8].copy().view(_KEY).ravel()
        order = np.argsort(keys)
        return keys[order], order.astype(_ORD)

    @contextmanager
    def _log(self) -> Iterator[BinaryIO]:
        """The log, at its start: the anonymous temp file (kept open: it has no other name), or the log file opened
        for this call only (created at the first write)."""
        if self._path is None:
            if self._fh is None:
                self._fh = tempfile.TemporaryFile()  # noqa: SIM115 - closed with the index
            self._fh.seek(0)
            yield self._fh
            return
        try:
            with open(self._path, "r+b" if self._made else "x+b") as fh:
                self._made = True
                yield fh
        except OSError as exc:
            if exc.filename is None:  # a write or fsync that fails (a full disk) names no file: this log is it
                exc.filename = str(self._path)
            raise

    def __len__(self) -> int:
        return self._n

    def __contains__(self, digest: object) -> bool:
        if not isinstance(digest, bytes) or len(digest) != DIGEST_SIZE:
            return False
        if digest in self._buf:
            return True
        probe = np.frombuffer(digest, _KEY, 1)[0]
        return self._filter.maybe_one(int(probe)) and any(
            self._settle(keys, ords, int(keys.searchsorted(probe)), probe, digest) for keys, ords in self._runs)

    def _settle(self, keys: np.ndarray, ords: np.ndarray, i: int, probe: np.uint64, digest: bytes) -> bool:
        """Whether `digest` (prefix `probe`) is in the run `keys`/`ords`, whose first key >= `probe` is at `i`:
        each equal prefix (a true duplicate, or a rare 64-bit prefix collision) is settled on the full logged
        digest."""
        if i >= len(keys) or keys[i] != probe:
            return False
        with self._log() as fh:
            while i < len(keys) and keys[i] == probe:
                if os.pread(fh.fileno(), DIGEST_SIZE, int(ords[i]) * DIGEST_SIZE) == digest:
                    return True
                i += 1
        return False

    def contains_many(self, words: np.ndarray) -> np.ndarray:
        """`digest in self` for each row of `words` (digests as `digest_words` gives them), at once:
        the buffer probed, the others' prefixes through the filter and then searched in each run, and every
        prefix hit settled on the full digest read back from the log (mapped), all vectorised. The decider's fast
        path (`streamprep.ingest`)."""
        n = len(words)
        if self._buf:  # (empty on the decider's path: add_many spills it)
            blob = words.tobytes()
            found = np.fromiter((blob[i:i + DIGEST_SIZE] in self._buf for i in range(0, len(blob), DIGEST_SIZE)),
                                bool, n)
        else:
            found = np.zeros(n, bool)
        rest = np.flatnonzero(~found)
        rest = rest[self._filter.maybe(words[rest, 0])]  # most new digests stop here
        # probed in key order: each binary search starts where the last one ended, so a large run's upper levels
        # stay in cache (random digests against 5 M keys: ~5x fewer cycles than in piece order)
        rest = rest[np.argsort(words[rest, 0])]
        for keys, ords in reversed(self._runs):  # newest first: the small runs, where recent copies are
            if not len(keys) or not len(rest):
                continue
            probes = words[rest, 0]
            at = keys.searchsorted(probes)
            hits = np.flatnonzero(keys[np.minimum(at, len(keys) - 1)] == probes)
            if len(hits):  # each key equal to a hit's prefix is a candidate (more than one: a prefix collision)
                first = at[hits]
                count = keys.searchsorted(probes[hits], "right") - first
                probe = np.repeat(hits, count)
                cand = np.repeat(first - np.cumsum(count) + count, count) + np.arange(len(probe))
                with self._log() as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as log:
                    logged = np.frombuffer(log, _KEY).reshape(-1, DIGEST_SIZE // 8)[ords[cand]]
                    same = (logged == words[rest[probe]]).all(axis=1)
                found[rest[probe[same]]] = True
            rest = rest[~found[rest]]
        return found

    def add(self, digest: bytes) -> None:
        """Record a kept digest; adding one already present is a no-op (the log stays duplicate-free)."""
        if digest not in self:  # (False for anything but a digest, which add_new refuses)
            self.add_new(digest)

    def add_new(self, digest: bytes) -> None:
        """Record a kept digest known to be absent (just looked up): `add` without its second lookup, which
        was a third of the driver's cost per record decided (`benchmarks/bench_driver_only.py`)."""
        if not isinstance(digest, bytes) or len(digest) != DIGEST_SIZE:
            raise ValueError(f"digest must be {DIGEST_SIZE} bytes, got {digest!r:.80}")
        self._buf[digest] = None
        self._n += 1
        if len(self._buf) >= self._buffer_size:
            self._spill()

    def add_many(self, words: np.ndarray, order: np.ndarray | None = None, keys: np.ndarray | None = None) -> None:
        """`add_new` of each row of `words` in order (digests as `digest_words` gives them; distinct, known
        absent), as one sorted batch: the buffer moves to the runs first (it holds the latest digests), the batch
        is appended to the log and becomes a run. The same log and the same set as one by one, without a dict
        entry per digest. `order`: the permutation of the rows that sorts their prefixes, when the caller has it
        (the run is then not sorted again), and `keys`, those prefixes in that order (not gathered again)."""
        if words.dtype != _KEY or words.ndim != 2 or words.shape[1] != DIGEST_SIZE // 8:
            raise ValueError(f"digests must be rows of {DIGEST_SIZE // 8} {_KEY} words, got {words.dtype} "
                             f"{words.shape}")
        n = len(words)
        if not n:
            return
        if self._buf:
            self._spill()
        self._write(np.ascontiguousarray(words))  # its buffer, not a copy of it
        self._n = self._written = self._n + n
        self._insert(words[:, 0], self._n - n, order, keys)

    def flush(self, fsync: bool = True) -> None:
        """Append the digests added since the last flush to the log, in insertion order; fsync it."""
        pending = self._n - self._written
        if pending:
            self._write(b"".join(islice(self._buf, len(self._buf) - pending, None)))
            self._written = self._n
        if fsync and self._synced < self._n:  # (also what a spill or `add_many` wrote unsynced, by another descriptor:
            with self._log() as fh:           # fsync writes back the file's data, whichever descriptor wrote it)
                os.fsync(fh.fileno())
            self._synced = self._n

    def _write(self, data: bytes | np.ndarray) -> None:
        with self._log() as fh:
            fh.seek(0, os.SEEK_END)
            fh.write(data)
            fh.flush()

    def _spill(self) -> None:
        """Move the buffer to the runs (its digests are in the log first)."""
        self.flush(fsync=False)
        self._insert(digest_words(list(self._buf))[:, 0], self._n - len(self._buf))
        self._buf.clear()

    def _insert(self, keys: np.ndarray, first: int, order: np.ndarray | None = None,
                ordered: np.ndarray | None = None) -> None:
        """Logged digests' prefixes `keys` (ordinals `first`, `first` + 1, ...; sorted by `order`, or here; `ordered`:
        `keys[order]` when the caller has it) as a new sorted run; the newest `_TIER` runs merged into one while the
        oldest of them is at most twice the newest's size (tiered)."""
        if order is None:
            order = np.argsort(keys)
        run = (keys[order] if ordered is None else ordered, (order + first).astype(_ORD))
        self._runs.append(run)
        if self._n > self._filter.room:  # too full for its error rate: remade two or four times larger
            self._filter = _PrefixFilter(self._runs, self._n)
        else:
            self._filter.add(run[0])
        runs = self._runs
        while len(runs) >= _TIER and len(runs[-_TIER][0]) <= 2 * len(runs[-1][0]):
            newest = runs[-_TIER:]
            del runs[-_TIER:]
            runs.append(_merge_runs(newest))


class _PrefixFilter:
    """A blocked Bloom filter over the runs' prefixes: a digest sets `_BITS` bits (from its prefix's low 24 bits) in
    one 64-bit word (chosen by its top bits), and a digest whose bits are not all set is in no run. Sized at 2^b
    bits, the largest power of two within 32 a digest (at least 2^_FILTER_MIN_BITS); remade larger once the digests
    pass one in 8 bits, so it holds 8-32 bits (1-4 B) a digest and lets ~0.5 % of new digests through to the runs at
    10-20 M digests (two bits a digest let ~1.5 % through, one bit 3-12 %)."""

    __slots__ = ("_words", "_shift", "room")

    def __init__(self, runs: list[tuple[np.ndarray, np.ndarray]], count: int) -> None:
        b = max(_FILTER_MIN_BITS, (32 * max(count, 1)).bit_length() - 1)
        self._words = np.zeros(1 << (b - 6), np.uint64)
        self._shift = np.uint64(64 - (b - 6))
        self.room = 1 << (b - 3)  # the digests it holds at 8 bits each; beyond, it is remade
        for keys, _ in runs:
            self.add(keys)

    def _slots(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each key's word and its bits there (`_BITS` 6-bit fields of its low bits)."""
        one, low, bits = np.uint64(1), np.uint64(63), np.zeros(len(keys), np.uint64)
        for field in range(_BITS):
            bits |= one << ((keys >> np.uint64(6 * field)) & low)
        return (keys >> self._shift).astype(np.intp), bits

    def add(self, keys: np.ndarray) -> None:
        """Set the bits of `keys` (a run's, sorted): one buffered `|=` at their words, then `bitwise_or.at` for the
        few keys sharing a word with the next or the previous, whose bits a buffered `|=` keeps only one set of
        (sorted, they are neighbours; 2x quicker than `at` for all, 59 -> 29 ns a key for a piece)."""
        for start in range(0, len(keys), _FILTER_CHUNK):
            word, bits = self._slots(keys[start:start + _FILTER_CHUNK])
            if len(word) > 1 and (word[1:] < word[:-1]).any():  # not sorted after all: the unbuffered way
                np.bitwise_or.at(self._words, word, bits)
                continue
            self._words[word] |= bits
            shared = np.flatnonzero(word[1:] == word[:-1])
            if len(shared):  # (a key in two pairs is set twice: no matter for an OR)
                both = np.concatenate((shared, shared + 1))
                np.bitwise_or.at(self._words, word[both], bits[both])

    def maybe_one(self, key: int) -> bool:
        """`maybe` of one key, in Python ints (a numpy call on one element costs ~1 µs; `_slots`' four fields written
        out, as a loop costs ~0.5 µs more; the membership tests compare the two)."""
        bits = 1 << (key & 63) | 1 << (key >> 6 & 63) | 1 << (key >> 12 & 63) | 1 << (key >> 18 & 63)
        return int(self._words[key >> int(self._shift)]) & bits == bits

    def maybe(self, keys: np.ndarray) -> np.ndarray:
        """Per key, whether a run may hold it (False: none does)."""
        out = np.empty(len(keys), bool)
        for start in range(0, len(keys), _FILTER_CHUNK):
            word, bits = self._slots(keys[start:start + _FILTER_CHUNK])
            out[start:start + _FILTER_CHUNK] = (self._words[word] & bits) == bits
        return out


def _merge_runs(runs: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted runs as one, emptying `runs` (so their arrays go once copied): the runs back to back, ordered by one
    stable argsort, a timsort that finds the runs and merges them in log2(len(runs)) passes. Merging them one into
    the next, as before, copied a key ~4.4 times for 8 runs of one size (8 x 1.15 M keys: 243 -> 44 ns a key)."""
    keys = np.concatenate([k for k, _ in runs])
    ords = np.concatenate([o for _, o in runs])
    runs.clear()
    order = np.argsort(keys, kind="stable")
    keys = keys[order]  # one column at a time: the transient peaks at 28 B a key (the runs hold 12), not 32
    return keys, ords[order]


def prefix_order(keys: np.ndarray) -> np.ndarray:
    """The stable argsort of `keys`, from a quicksort (a stable sort of random uint64 is ~3x slower): equal keys,
    rare, are put back in index order."""
    order = np.argsort(keys)
    eq = np.flatnonzero(keys[order[1:]] == keys[order[:-1]])
    if len(eq):
        tied = np.union1d(eq, eq + 1)  # positions inside runs of equal keys, whose runs are contiguous
        order[tied] = order[tied][np.lexsort((order[tied], keys[order[tied]]))]
    return order


def _sorts(order: np.ndarray, key: np.ndarray) -> bool:
    """Whether `order`, a row per row of a piece, is its `prefix_order`, given `key`, the rows' prefixes in that order:
    keys never going down, equal keys in row order (all that the decision reads of it; a repeated or missing row
    would also have to break one of these)."""
    return not ((key[1:] < key[:-1]) | ((key[1:] == key[:-1]) & (order[1:] <= order[:-1]))).any()


def duplicate_reason(twin: str) -> str:
    """The reject reason of a duplicate whose kept copy is in dataset `twin` ("" for the same dataset)."""
    return f"exact duplicate of a record kept by dataset {twin}" if twin else DUPLICATE_REASON


class DedupDecision:
    """The one exact-dedup decision (QualityControl and ingest both use it): a record is a duplicate
    when its digest is in this dataset's index or, with `dedup_scope: run`, in the final index of a
    dataset listed earlier in the config (`earlier`, in config order)."""

    def __init__(self, own: DedupIndex, earlier: Sequence[tuple[str, DedupIndex]] = ()) -> None:
        self.own, self.earlier = own, list(earlier)

    def twin(self, digest: bytes | None) -> str | None:
        """The dataset that already kept this record ("" for this one), or None when it is new (a None
        digest is never a duplicate)."""
        if digest is None:
            return None
        if digest in self.own:
            return ""
        return next((name for name, index in self.earlier if digest in index), None)

    def reason(self, digest: bytes | None) -> str | None:
        """Why the record is a duplicate, or None when it is new."""
        twin = self.twin(digest)
        return None if twin is None else duplicate_reason(twin)

    def keep(self, digest: bytes) -> None:
        """Record a kept digest that `twin` (or `reason`) has just found new."""
        self.own.add_new(digest)

    @property
    def names(self) -> list[str]:
        """The datasets `twin_many`'s codes stand for: this one (""), then the earlier ones in config order."""
        return ["", *(name for name, _ in self.earlier)]

    def _probe(self, words: np.ndarray, codes: np.ndarray) -> np.ndarray:
        """Set `codes` of the rows an index holds (the index into `names` of the first that does); returns the
        others' rows."""
        new = np.arange(len(words))
        for code, (_, index) in enumerate([("", self.own), *self.earlier]):  # the indexes as they stand
            if not len(new):
                break
            hit = index.contains_many(words if len(new) == len(words) else words[new])
            codes[new[hit]] = code
            new = new[~hit]
        return new

    def probe_many(self, words: np.ndarray) -> np.ndarray:
        """`twin` of each row of `words` against the indexes as they stand (no copies inside the rows looked for,
        nothing added): the index into `names`, or -1. An all-zero row (NO_DIGEST) is never a duplicate."""
        codes = np.full(len(words), -1, np.int64)
        self._probe(words, codes)
        codes[~words.any(axis=1)] = -1
        return codes

    def add_many(self, words: np.ndarray) -> None:
        """`keep` these new digests, in order."""
        self.own.add_many(np.ascontiguousarray(words))

    def twin_many(self, words: np.ndarray, kept: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
        """`twin`, then `keep` when new and `kept`, record by record over a piece's digests in order (`words`, as
        `digest_words` gives them), done at once: per record the index into `names` of the dataset that kept its
        text (this one too when a record earlier in the piece was kept with it), or -1 when it is new. The new
        kept digests are added in order. A NO_DIGEST row (an empty text, never kept) is never a duplicate. `order`:
        the rows sorted by prefix as `prefix_order` sorts them (a worker's Summary carries it), else sorted here; one
        that does not sort the prefixes is not used."""
        codes = np.full(len(words), -1, np.int64)
        zero = np.flatnonzero(words[:, 0] == 0)  # a NO_DIGEST row's prefix, and a real digest's once in 2^64
        if len(zero) and not (real := words[zero].any(axis=1)).all():
            at = np.setdiff1d(np.arange(len(words)), zero[~real])
            codes[at] = self.twin_many(words[at], kept[at])
            return codes
        key = None if order is None or len(order) != len(words) else words[order, 0]  # the prefixes in order
        if key is None or not _sorts(order, key):
            order = key = None
        new = self._probe(words, codes)  # the records no index holds
        if not len(new):
            return codes
        # Records with the same digest inside the piece: the first kept one keeps it, every later one is its
        # duplicate. Groups are runs of equal digests in one sort by prefix, piece order within an equal prefix
        # (a copy, or a 64-bit collision, where the whole digests decide).
        if order is None:
            order = new[prefix_order(words[new, 0])]
            key = words[order, 0]
        elif len(new) < len(words):  # the worker's order, less the rows an index holds
            left = np.zeros(len(words), bool)
            left[new] = True
            keep_on = left[order]
            order, key = order[keep_on], key[keep_on]
        k = kept[order]
        eq = key[1:] == key[:-1]
        if eq.any():  # (a piece without two equal prefixes, most, has no copies inside: every kept record is new)
            same = eq.copy()
            pair = np.flatnonzero(eq)
            same[pair] = (words[order[pair + 1]] == words[order[pair]]).all(axis=1)
            if not same[pair].all():  # a prefix collision: whole digests, then piece order
                # (rows move only inside runs of one prefix, so `key` still gives each position's prefix)
                w = words[order]
                by = np.lexsort((order, *w.T[::-1]))
                w, k, order = w[by], k[by], order[by]
                same = (w[1:] == w[:-1]).all(axis=1)
            group = np.concatenate(([0], np.cumsum(~same)))
            kept_group = group[k]  # the kept records' groups, each group's in piece order
            head = np.diff(kept_group, prepend=-1) != 0
            first = np.full(group[-1] + 1, len(order))  # each group's first kept record, a position here (len: none)
            first[kept_group[head]] = np.flatnonzero(k)[head]
            later = np.arange(len(order)) > first[group]
            codes[order[later]] = 0
            k = k & ~later  # now: kept and new
        fresh = order[k]  # the new kept digests, in prefix order
        added = np.zeros(len(words), bool)
        added[fresh] = True
        add = np.flatnonzero(added)  # ... back in piece order (the log's), without a sort
        rank = np.cumsum(added) - 1  # a row's place in `add`
        # with the order that sorts them and their prefixes in it: the run is neither sorted nor gathered again
        self.own.add_many(words[add], rank[fresh], key[k])
        return codes
