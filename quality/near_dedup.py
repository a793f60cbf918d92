"""Near-duplicate removal: MinHash over word n-grams with LSH banding (datatrove's scheme).

Two halves, split like exact dedup:
- `Signer` runs in the QC workers: text -> MinHash signature (`num_perm` uint32), computed for a whole
  batch at once (rensa's Rust MinHash over n-gram hashes built with numpy).
- `NearDupIndex` lives in dedup holder 0 (`streamprep.holders`), one per dataset: it holds the band hashes of
  KEPT documents only, in source order, and answers "is this an estimated-Jaccard >= threshold twin of a kept
  document?".

Memory: keys (32-bit band hash << 32 | kept ordinal) as uint64, i.e. 8 bytes per band per document
(14 bands: 112 B/doc), in a few levels of per-band sorted arrays of geometrically growing size (each
batch's keys become a level; small levels merge, so inserting is amortised O(log n) and a lookup is a
handful of vectorised binary searches), plus, for the current batch only, the band hashes two of its
documents share (the only ones by which a document of the batch can be a later one's candidate).
Full signatures stay on disk, in the append-only log that also makes the index crash-safe:

    <checkpoint_dir>/<dataset>.near   records of (uint64 source index, num_perm x uint32 signature)

A band collision is only a candidate: the kept twin's signature is read back from the log (pread) and
the estimated Jaccard (share of equal MinHash values) must reach `threshold`.
"""
from __future__ import annotations

import mmap
import re
import string
from collections.abc import Sequence
from itertools import chain
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from rensa import RMinHash

from quality.figures import shown
from quality.settings import NearDedupSettings

_PUNCT = bytes.maketrans(string.punctuation.encode(), b" " * len(string.punctuation))
_MUL = np.uint64(0x9E3779B97F4A7C15)   # golden-ratio odd multiplier: mixes one more word into an n-gram
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)   # splitmix64 finalizer


def _finalize(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, vectorized: full avalanche so structured inputs spread over 64 bits."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * _M1
        x = (x ^ (x >> np.uint64(27))) * _M2
        return x ^ (x >> np.uint64(31))


def _combine(h: np.ndarray, width: int) -> np.ndarray:
    """Hash of every run of `width` consecutive word hashes (position-sensitive)."""
    m = len(h) - width + 1
    out = h[:m].copy()
    with np.errstate(over="ignore"):
        for k in range(1, width):
            out = out * _MUL ^ h[k:k + m]
    return _finalize(out)


# Letters of the scripts written without spaces between words: Thai, Lao, Tibetan, Myanmar, Khmer, Han, kana, Yi
# (their digits left out; Hangul is spaced). Each is a word of its own, as spaCy's Chinese tokenizer (datatrove's for
# zh) reads Han: split at white space only, a paragraph of them was one word, and a copy with one character changed
# shared no n-gram with it (estimated Jaccard 0).
_UNSPACED = re.compile("[\u0e00-\u0e4f\u0e5a-\u0ecf\u0eda-\u0f1f\u0f2a-\u0fff\u1000-\u103f\u104a-\u108f"
                       "\u109a-\u109f\u1780-\u17df\u17ea-\u17ff\u19e0-\u19ff\u3040-\u30ff\u31f0-\u31ff"
                       "\u3400-\u4dbf\u4e00-\u9fff\ua000-\ua4cf\uf900-\ufaff\uff66-\uff9d\U0001b000-\U0001b2ff"
                       "\U00020000-\U0003ffff]")
# The UTF-8 lead bytes of those letters: a text holding none (most non-ASCII web text: accents, dashes, emoji less
# often) skips the regex, which cost ~50 µs a C4 page.
_UNSPACED_LEADS = (b"\xe0", b"\xe1", *(bytes([b]) for b in range(0xE3, 0xEB)), b"\xef", b"\xf0")


def words(text: str) -> list[bytes]:
    """Lower-cased words with ASCII punctuation removed (datatrove's simplify_text, cheaply); each letter of a script
    written without spaces is a word."""
    lower = text.lower()
    data = lower.encode("utf-8", "surrogatepass")
    if not text.isascii() and any(lead in data for lead in _UNSPACED_LEADS):
        data = _UNSPACED.sub(" \\g<0> ", lower).encode("utf-8", "surrogatepass")
    return data.translate(_PUNCT).split()


class Signer:
    """Batch MinHash signatures; identical texts give identical signatures on any worker."""

    def __init__(self, near: NearDedupSettings):
        self.ngram, self.num_perm, self.seed = near.ngram, near.num_perm, near.seed

    def signatures(self, texts: Sequence[str]) -> list[bytes | None]:
        """One `num_perm * 4`-byte signature per text; None for a text without words."""
        per_doc = [words(t) for t in texts]
        lens = np.fromiter(map(len, per_doc), np.int64, len(per_doc))
        flat = list(chain.from_iterable(per_doc))
        if not flat:
            return [None] * len(texts)
        h = np.asarray(RMinHash.hash_token_sets([flat])[0], dtype=np.uint64)
        starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
        n = self.ngram
        grams = _combine(h, n) if len(h) >= n else np.zeros(0, np.uint64)
        counts = np.where(lens >= n, lens - n + 1, np.minimum(lens, 1))  # a short text is one n-gram
        short = np.flatnonzero((lens > 0) & (lens < n))
        pos = np.repeat(starts, counts) + np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
        shingles = grams[np.minimum(pos, max(len(grams) - 1, 0))] if len(grams) else np.zeros(len(pos), np.uint64)
        offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.uint64)
        for i in short:  # rare: fewer words than the n-gram width
            shingles[offsets[i]] = _combine(h[starts[i]:starts[i] + lens[i]], int(lens[i]))[0]
        matrix = RMinHash.digest_matrix_from_flat_token_hashes(shingles, offsets, self.num_perm, self.seed)
        rows = np.asarray(matrix.to_rows(), dtype="<u4")
        return [rows[i].tobytes() if lens[i] else None for i in range(len(texts))]


def band_hashes(sigs: np.ndarray, bands: int, rows: int) -> np.ndarray:
    """(n, num_perm) uint32 signatures -> (n, bands) uint32 band hashes."""
    x = sigs.reshape(len(sigs), bands, rows).astype(np.uint64)
    h = np.zeros((len(sigs), bands), np.uint64)
    with np.errstate(over="ignore"):
        for r in range(rows):
            h = h * _MUL ^ x[:, :, r]
        h = h + np.arange(bands, dtype=np.uint64)  # the same rows in different bands are different keys
    return (_finalize(h) >> np.uint64(32)).astype(np.uint32)


class Twin(NamedTuple):
    source_index: int   # the kept twin's `meta.source.index`
    jaccard: float      # estimated Jaccard (share of equal MinHash values), as reasons show it (`figures.shown`)


class NearDupIndex:
    """Band index of kept documents for one dataset, backed by its append-only signature log.

    Per batch, in source order: `prepare(signatures)`, then for each of its documents `next_twin()` and,
    if that document is kept, `add(source_index)`; finally `take_log()` gives the bytes to append (before a
    twin is looked for in a later batch: it reads them back) and fsync before the checkpoint.
    """

    GROWTH = 4   # a level is merged into the one before it until that one is GROWTH times larger
    _LOW = np.uint64(0xFFFFFFFF)

    def __init__(self, near: NearDedupSettings, log_path: Path):
        self.bands, self.rows, self.threshold = near.bands, near.rows, near.threshold
        self.num_perm = near.num_perm
        self.dtype = np.dtype([("src", "<u8"), ("sig", "<u4", (self.num_perm,))])
        self.path = log_path
        self.levels: list[np.ndarray] = []  # (bands, m) uint64, each row sorted
        self.flushed = 0                  # records already handed out by `take_log`
        self.pending: list[np.ndarray] = []  # records of earlier batches' kept documents not yet handed out
        self._map: mmap.mmap | None = None   # the log's first `_mapped` records (`_logged`)
        self._mapped = 0
        self._sigs: list[bytes | None] = []
        self._batch: list[tuple[set[int], int] | None] = []  # per document: (level candidates, its row), or None
        self._bh = np.empty((0, self.bands), np.uint32)   # the batch's band hashes, a row per signed document
        self._shared: dict[int, list[tuple[int, int]]] = {}  # row -> its (band, hash) keys another row also has
        self._buffer: dict[tuple[int, int], list[int]] = {}  # such a key -> the ordinals of the kept rows with it
        self._kept: list[tuple[int, int]] = []   # the batch's kept documents: (batch position, source index)
        self._k = -1  # the batch document last passed to `next_twin`

    @property
    def record_size(self) -> int:
        return self.dtype.itemsize

    def __len__(self) -> int:
        return self.flushed + sum(map(len, self.pending)) + len(self._kept)

    LOAD_CHUNK = 1 << 18  # log records read at a time on rebuild: bounded memory beside the index

    def load(self) -> None:
        """Rebuild from the log (already repaired to the checkpoint's length) at numpy speed."""
        n = self.path.stat().st_size // self.record_size if self.path.exists() else 0
        keys = np.empty((self.bands, n), np.uint64)
        for start in range(0, n, self.LOAD_CHUNK):
            data = np.fromfile(self.path, self.dtype, min(self.LOAD_CHUNK, n - start), offset=start * self.record_size)
            ordinals = np.arange(start, start + len(data), dtype=np.uint64)
            keys[:, start:start + len(data)] = \
                band_hashes(data["sig"], self.bands, self.rows).T.astype(np.uint64) << np.uint64(32) | ordinals
        keys.sort(axis=1)
        self.flushed, self.levels = n, [keys] if n else []

    def close(self) -> None:
        self._unmap()

    def nbytes(self) -> int:
        """Bytes held by the sorted levels (the current batch's arrays are bounded by the batch size)."""
        return sum(a.nbytes for a in self.levels)

    def prepare(self, signatures: Sequence[bytes | None]) -> None:
        """Look a batch up in the sorted levels at once, and find the band hashes that two of its documents share
        (one sort per band): only those can make a document of the batch a candidate for a later one, so only
        they are kept per document (most documents share none)."""
        self._absorb()
        self._unmap()
        self._sigs, self._k = list(signatures), -1
        self._batch, self._bh = self._candidates(self._sigs)
        self._shared, self._buffer = {}, {}
        for b in range(self.bands):
            column = self._bh[:, b]
            ranked = np.sort(column)
            repeated = np.unique(ranked[1:][ranked[1:] == ranked[:-1]])
            for row in np.flatnonzero(np.isin(column, repeated)).tolist():
                self._shared.setdefault(row, []).append((b, int(column[row])))

    def _candidates(self, sigs: Sequence[bytes | None]) -> tuple[list[tuple[list[np.ndarray], int] | None], np.ndarray]:
        """Per document, the ordinals sharing a band with it in the sorted levels (arrays, one per band and level
        that has any: as Python sets, a batch of documents alike held ~70 B per candidate, 330 MB for 8 000 pages
        of one template) and its row in the band hashes (None for a document without a signature); and the band
        hashes."""
        present = [s for s in sigs if s is not None]
        if not present:
            return [None] * len(sigs), np.empty((0, self.bands), np.uint32)
        bh = band_hashes(np.frombuffer(b"".join(present), "<u4").reshape(len(present), self.num_perm),
                         self.bands, self.rows)
        cands: list[list[np.ndarray]] = [[] for _ in present]
        for b in range(self.bands):
            # the batch's keys searched in ascending order: numpy's searchsorted then starts each search where the
            # last one ended, so the level is walked once, not probed at random (~3x faster on a large level)
            order = np.argsort(bh[:, b], kind="stable")
            lo_keys = bh[order, b].astype(np.uint64) << np.uint64(32)
            for level in self.levels:
                arr = level[b]
                lo = np.searchsorted(arr, lo_keys, "left")
                hi = np.searchsorted(arr, lo_keys | self._LOW, "right")
                for i in np.flatnonzero(hi > lo):
                    cands[order[i]].append(arr[lo[i]:hi[i]] & self._LOW)
        found: list[tuple[list[np.ndarray], int] | None] = []
        row = 0
        for s in sigs:
            found.append(None if s is None else (cands[row], row))
            row += s is not None
        return found, bh

    def next_twin(self) -> Twin | None:
        """The kept twin of the batch's next document: the highest estimated Jaccard >= threshold among
        kept documents sharing a band (the earliest on ties), or None."""
        self._k += 1
        entry = self._batch[self._k]
        if entry is None:
            return None
        cands, row = entry
        buffered = [o for key in self._shared.get(row, ()) for o in self._buffer.get(key, ())]
        if buffered:
            cands = cands + [np.array(buffered, np.uint64)]
        return self._best(cands, self._sigs[self._k]) if cands else None  # most documents have no candidate

    def twins(self, signatures: Sequence[bytes | None]) -> list[Twin | None]:
        """Each document's kept twin in the index as it stands, adding nothing: the final index of a
        dataset listed earlier, under `dedup_scope: run` (its last batch is logged)."""
        found = self._candidates(signatures)[0]
        return [None if e is None or not e[0] else self._best(e[0], s) for e, s in zip(found, signatures)]

    def _best(self, cands: list[np.ndarray], sig: bytes | None) -> Twin | None:
        """The candidate with the highest estimated Jaccard >= threshold (the earliest on ties), or None.

        Compared all at once: documents alike but below the threshold (pages of one site's template) make every
        earlier one a candidate, ~6 µs each when read and compared one by one, ~30x less so. (The one-by-one
        loop compared each estimate with the best's rounded one, so of equal estimates that rounded down the
        last, not the earliest, was named.)"""
        ordinals = np.unique(np.concatenate(cands))  # sorted: the earliest first
        logged = int(np.searchsorted(ordinals, self.flushed))
        recs = self._logged(ordinals[:logged].astype(np.int64))
        srcs, sigs = recs["src"], recs["sig"]
        if logged < len(ordinals):  # the records not yet handed out, and the batch's kept documents: few
            rest = [self._unlogged(o) for o in ordinals[logged:].tolist()]
            srcs = np.concatenate([srcs, np.array([src for src, _ in rest], np.uint64)])
            sigs = np.concatenate([sigs, np.stack([other for _, other in rest])])
        jaccard = np.count_nonzero(sigs == np.frombuffer(sig, "<u4"), axis=1) / self.num_perm
        i = int(np.argmax(jaccard))  # the first of the highest
        if jaccard[i] < self.threshold:
            return None
        # 4 decimals, unless that reads below the threshold it reached (92/112 = 0.821428… of 0.82142: not 0.8214)
        return Twin(int(srcs[i]), float(shown(float(jaccard[i]), self.threshold)))

    def _logged(self, ordinals: np.ndarray) -> np.ndarray:
        """The log's records at `ordinals` (< `flushed`), through a read-only map of the log, made again once the
        log has grown and dropped at each batch (`prepare`): the pages a batch touched leave the process's RSS."""
        if not len(ordinals):  # every candidate not logged yet: no map needed
            return np.empty(0, self.dtype)
        if self._map is None or self._mapped < self.flushed:
            self._unmap()
            with open(self.path, "rb") as fh:  # (a logged ordinal: the log holds a record or more)
                self._map = mmap.mmap(fh.fileno(), self.flushed * self.record_size, access=mmap.ACCESS_READ)
            self._mapped = self.flushed
        view = np.frombuffer(self._map, self.dtype, count=self._mapped)
        try:
            return view[ordinals]   # a copy: the map may be closed with no view of it left
        finally:
            del view

    def _unmap(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map, self._mapped = None, 0

    def _unlogged(self, ordinal: int) -> tuple[int, np.ndarray]:
        """(source index, signature) of a kept document not in the log yet (>= `flushed`; those are `_logged`):
        from the records not yet handed out, or the batch."""
        i = ordinal - self.flushed
        for records in self.pending:
            if i < len(records):
                return int(records[i]["src"]), records[i]["sig"]
            i -= len(records)
        k, src = self._kept[i]
        return src, np.frombuffer(self._sigs[k], "<u4")

    def add(self, source_index: int) -> int:
        """Enter the document last passed to `next_twin` (it was kept) under the next ordinal; returns the
        bytes it adds to the log, which the caller counts at once (a checkpoint snapshot taken mid-batch,
        such as a part's start, must describe the log up to that record)."""
        entry = self._batch[self._k]
        if entry is None:
            return 0
        ordinal = len(self)
        for key in self._shared.get(entry[1], ()):
            self._buffer.setdefault(key, []).append(ordinal)
        self._kept.append((self._k, source_index))
        return self.record_size

    def _absorb(self) -> None:
        """The batch's kept documents become a level (merged as GROWTH says) and records to hand out."""
        if not self._kept:
            return
        first = len(self) - len(self._kept)
        records = np.empty(len(self._kept), self.dtype)
        records["src"] = [src for _, src in self._kept]
        records["sig"] = np.frombuffer(b"".join([self._sigs[k] for k, _ in self._kept]), "<u4").reshape(-1, self.num_perm)
        rows = [self._batch[k][1] for k, _ in self._kept]
        ordinals = np.arange(first, first + len(rows), dtype=np.uint64)
        self.levels.append(np.sort(self._bh[rows].T.astype(np.uint64) << np.uint64(32) | ordinals, axis=1))
        self.pending.append(records)
        self._kept, self._buffer = [], {}
        while len(self.levels) > 1 and self.levels[-2].shape[1] < self.GROWTH * self.levels[-1].shape[1]:
            last = self.levels.pop()
            self.levels[-1] = np.sort(np.concatenate((self.levels[-1], last), axis=1), axis=1, kind="stable")

    def take_log(self) -> bytes:
        """The records to append (and fsync before the next checkpoint); the batch's keys become a level."""
        self._absorb()
        data = b"".join(records.tobytes() for records in self.pending)
        self.flushed += sum(map(len, self.pending))
        self.pending = []
        return data


class NearDecision:
    """The near-dedup decision of a dataset: its own index and, with `dedup_scope: run`, the final indexes
    of the datasets listed before it (`earlier`, in config order). A document's twin is looked for in those
    first, in config order, then in its own dataset, so the earliest holder in the run's plan order is
    named; within one index the twin is `NearDupIndex`'s (highest estimated Jaccard, earliest on ties).

    Per batch, in source order: `prepare(signatures)`, then `next_twin()` for each of its documents;
    a kept one is then entered with the own index's `add`."""

    def __init__(self, own: NearDupIndex, earlier: Sequence[tuple[str, NearDupIndex]] = ()) -> None:
        self.own, self.earlier = own, list(earlier)
        self._found: list[tuple[str, Twin] | None] = []
        self._k = -1

    def prepare(self, signatures: Sequence[bytes | None]) -> None:
        self.own.prepare(signatures)
        self._k = -1
        self._found = [None] * len(signatures)
        for name, index in self.earlier:
            open_ = [s if f is None else None for s, f in zip(signatures, self._found)]  # still without a twin
            for i, twin in enumerate(index.twins(open_)):
                if twin is not None:
                    self._found[i] = (name, twin)

    def next_twin(self) -> tuple[str, Twin] | None:
        """The next document's kept twin with its dataset ("" for this one), or None."""
        self._k += 1
        own = self.own.next_twin()  # always: the own index follows the batch document by document
        found = self._found[self._k]
        return found if found is not None else ("", own) if own is not None else None


def reject_meta(meta: dict[str, Any], dataset: str, twin: Twin) -> dict[str, Any]:
    """A near-duplicate reject's meta: the estimated Jaccard and the kept twin's `meta.source` id."""
    return {**meta, "failed_check": "near_duplicate",
            "reason": f"near duplicate of {dataset}#{twin.source_index} (estimated Jaccard {twin.jaccard})",
            "jaccard": twin.jaccard, "near_duplicate_of": {"dataset": dataset, "index": twin.source_index}}
