"""Tokenizer backends: the one place that turns a batch of texts into token ids (pretraining path).

API (small on purpose; tokenize.py and the pipeline are its callers):

    backend = load("hf" | "gigatoken", tokenizer_json)     # a LOCAL tokenizer.json, never a Hub id
    flat, lengths = backend.encode_batch(texts)           # uint32 ids back to back, int64 ids per text
    backend.name, backend.version, backend.vocab_size
    record = select(requested, tokenizer_json, texts)     # `tokenizer.backend` → the backend to use + why
    encoder = ShardEncoder(choice, tokenizer_json)        # a worker's: encode_batch(texts, check=dataset name)
    mismatch(reference, candidate, texts)                 # None, or where two backends' ids differ

Ids never include added special tokens (HF `add_special_tokens=False`; gigatoken inserts none).

`tokenizer.backend: auto` (the default) uses gigatoken only when it loads the run's tokenizer.json AND gives
the same ids as HF `tokenizers` (the reference) on the identity check: PROBES (hard strings), the tokenizer's
added tokens in context and run together (`added_token_probes`) and the texts the caller adds. It runs (1) when the run's
tokenizer is prepared (probes + up to CHECK_DOCS sampled texts for a trained tokenizer; the outcome is recorded
in checkpoints/tokenizer_backend.json and run.json) and (2) in
each tokenize worker, on the first CHECK_DOCS kept texts of the first shard of each dataset it encodes
(ShardEncoder). A job runs check (1) on one of its workers, which keeps the gigatoken tokenizer it built for its
shards (`gigatoken_backend`); with `backend: gigatoken` the config check runs it in the driver too. It reads
gigatoken's ids one text at a time (the same encoder, without awkward's import); the workers' (2) go through
encode_batch, the path their shards take. On a failed load,
a mismatch, an added-token probe HF panics on (its shards drop the documents HF cannot encode, which only HF
finds: `ShardEncoder.encode_or_drop`), or more overlapping added tokens than the check probes (`overlap_probes`),
auto uses HF and logs the reason once; `backend: gigatoken` turns it into an error. The backend
never enters a shard's plan hash: both give the same ids, so a run resumed under the other backend keeps its
shards. A text holding a code point unassigned in Unicode 14.0, or a mark whose NFC HF's Unicode 9 tables get
wrong (NFC_GAP), is encoded by HF whatever the backend (`unsure`): gigatoken's regex classes and NFC follow a
newer Unicode, which no sample can vouch for.

Memory: gigatoken 0.10.0's encode caches grow without bound. When the installed gigatoken has
`set_max_cache_bytes` it is given CACHE_BUDGET_BYTES; otherwise the tokenizer object is rebuilt (its
caches freed; they never change ids) once the process RSS has grown CACHE_BUDGET_BYTES past what it was
right after the tokenizer was last (re)built. Measured (phi-2, unique random words): unbounded +290 MB per
40 MB of text; with a 64 MiB budget the peak stays ~115 MB over the start (a rebuild leaves ~50 MB of
allocator residue once, which does not grow further).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import re
from collections.abc import Iterator
from importlib import metadata, resources
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

import numpy as np
import orjson
import psutil
from tokenizers import Tokenizer

from streamprep import logs

log = logs.get("backends")
BACKENDS = ("auto", "gigatoken", "hf")
CHECK_DOCS = 64                   # texts of a worker's first shard per dataset (and of a training sample) checked
CACHE_BUDGET_BYTES = 512 << 20    # per worker: gigatoken cache bound, or RSS growth before a rebuild
# gigatoken 0.10.0 sizes its tables by the highest id of the file (~70 B an id, entry or not: 722 MB for an added
# token with id 10**7 in phi-2, an abort on a 32 GiB allocation for 2**31-1, which HF renumbers 50295): a file
# whose highest id passes twice its entries and this many is not tried (auto uses HF; a forced gigatoken is refused)
SPARSE_IDS_SLACK = 1 << 16
_ID_LITERALS = re.compile(rb"[:\[,]\s*(\d{5,})")  # the integers of a tokenizer.json that could pass it

# Strings where fast re-implementations of HF tokenizers have diverged (gigatoken issues #35, #37) or could:
# code points whose Unicode properties changed after Unicode 14, combining-mark runs, scripts with their own
# segmentation, math letters, bidi controls, CRLF and whitespace runs, digits, code, special-token lookalikes.
PROBES: tuple[str, ...] = (
    "Emoji after Unicode 14: \U0001FAE8 \U0001FA75 \U0001FABF \U0001F6DD \U0001FAF8\U0001F3FD \u2764\ufe0f\u200d\U0001F525",
    "Family ZWJ: \U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 flags \U0001F1EF\U0001F1F5\U0001F1FA\U0001F1F8",
    "Combining runs: e\u0301\u0302\u0303\u0304 a\u0308\u0308\u0308 Z\u0351\u0357\u0358\u0359\u035a\u035b\u035c\u035d",
    "Hangul: \ud55c\uad6d\uc5b4 \u1100\u1161\u11a8 jamo \u3131\u314f; Thai \u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22; "
    "Devanagari \u0939\u093f\u0928\u094d\u0926\u0940",
    "Math letters: \U0001D400\U0001D401\U0001D6C2\U0001D7D8 \u211d\u2115 \u2202x/\u2202t \u222b\u2211\u221e",
    "Bidi: \u202eevil\u202c \u2067\u05e9\u05dc\u05d5\u05dd\u2069 \u0645\u0631\u062d\u0628\u0627 \u200f\u200e\u061c",
    "CRLF\r\nline\r\n\r\n\ttabs\t\t and   runs of     spaces    \n\n\n\u00a0\u2009\u3000end ",
    "   leading and trailing whitespace   ",
    "Digits 1234567890 3.14159 1,000,000 \u0661\u0662\u0663 \uff11\uff12\uff13 \u00b2\u00b3",
    "def f(x):\n    return {'a': [1, 2, 3], \"b\": x ** 2}  # comment\n\nif __name__ == '__main__':\n\tf(3)\n",
    "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); return 0; }\n",
    "Lookalikes: <|endoftext|> </s> <s> <unk> <pad> [SEP] <|im_start|>user",
    "Contractions: don't I'm we'll they've she'd it's DON'T Y'ALL",
    "CJK: \u6f22\u5b57\u3068\u304b\u306a\u30ab\u30ca\u3002\u4e2d\u6587\u6807\u70b9\uff0c\u7b26\u53f7\uff01",
    "Surrogate-free astral: \U00020000\U0002A6D6 \U0001F600\U0001F64F \U000E0041 tag",
    "\u0000\u0001\u001f\u007f control chars \ufeffBOM \ufffd replacement",
    # letters of Unicode 12-14, the newest the Unicode guard (`unsure`) leaves to gigatoken: a regex engine older
    # than Unicode 14 on either side would split them otherwise
    "Letters of Unicode 12-14: x\u0870's \U00010570\U00010570 \U0001E290 \U00010E80 \U00018B00 \U0001E100 1",
    "",
    " ",
    "\n",
)


class Backend(Protocol):
    name: str
    version: str
    vocab_size: int   # ids of the whole vocabulary, added tokens included

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """(flat uint32 ids of all texts back to back, int64 id count per text)."""
        ...


class BackendError(RuntimeError):
    """A backend cannot be used for this tokenizer (load failure or ids unequal to HF)."""


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "absent"


def installed_version(name: str) -> str:
    """The installed version of the library behind backend `name` ("hf" → tokenizers)."""
    return _version({"hf": "tokenizers", "gigatoken": "gigatoken"}.get(name, name))


_loaded: dict[str, Tokenizer] = {}  # the last tokenizer hf_tokenizer loaded, by the SHA-256 of its file


def hf_tokenizer(tokenizer_json: str | Path) -> Tokenizer:
    """HF `tokenizers`' Tokenizer of a local tokenizer.json, loaded once per process for the same bytes.

    The driver asks for it twice (config check, fingerprint's EOD lookup), a worker up to three times (the
    identity check's reference, the audit's histogram, ShardEncoder's check), from the configured file and from
    the run's copy: one load (~0.1 CPU-s for phi-2) per process. Only the last file is kept. Callers only encode
    and look up, so sharing it cannot change an id. The file's own `truncation` and `padding` (a Hub tokenizer.json
    often carries one) are turned off (`no_truncation`): they cut or padded every document, silently, where a
    shard holds `encode(text)`, as transformers' calls (which turn them off unless asked) and gigatoken (which has
    neither) give."""
    try:
        key = hashlib.sha256(Path(tokenizer_json).read_bytes()).hexdigest()
    except OSError:  # unreadable: tokenizers' own error, as a direct load gives
        return Tokenizer.from_file(str(tokenizer_json))
    if key not in _loaded:
        tok = Tokenizer.from_file(str(tokenizer_json))
        tok.no_truncation()
        tok.no_padding()
        _loaded.clear()
        _loaded[key] = tok
    return _loaded[key]


class HFBackend:
    """HF `tokenizers` (the reference): `encode_batch_fast`, ids copied once into one flat array."""

    name = "hf"

    def __init__(self, tokenizer_json: str | Path):
        self.tokenizer = hf_tokenizer(tokenizer_json)
        self.version = _version("tokenizers")
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        if not texts:
            return np.zeros(0, np.uint32), np.zeros(0, np.int64)
        ids = [e.ids for e in self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.uint32, count=int(lengths.sum()))
        return flat, lengths


def id_bound(tok: Tokenizer) -> int:
    """One past the highest token id, added tokens included: `len(tokenizer)` unless its ids have gaps, when an id can
    pass 65 535 in a smaller vocabulary (a uint16 `.bin` would wrap it into another token's id)."""
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    return max(tok.get_vocab_size(with_added_tokens=True), top + 1)


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc), so RSS shows the rebuild; a no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


# Code points assigned by Unicode 14.0 whose NFC tokenizers 0.23 gets wrong (its tables are Unicode 9's): marks
# given a canonical combining class since, which it never reorders (a\u0898\u0334 stays as it is; gigatoken puts
# the class-1 U+0334 first), and U+11930, which it does not compose with U+11935 into U+11938 (Unicode 13). Found
# by a scan of every assigned code point, HF's NFC and NFD against `unicodedata` 14.0 in mark contexts.
NFC_GAP: tuple[tuple[int, int], ...] = (
    (0x07FD, 0x07FD), (0x0898, 0x089F), (0x08CA, 0x08D3), (0x09FE, 0x09FE), (0x0C3C, 0x0C3C), (0x0D3B, 0x0D3C),
    (0x0EBA, 0x0EBA), (0x1715, 0x1715), (0x1ABF, 0x1ACE), (0x1DF6, 0x1DFA), (0xA82C, 0xA82C), (0x10D24, 0x10D27),
    (0x10EAB, 0x10EAC), (0x10F46, 0x10F50), (0x10F82, 0x10F85), (0x11070, 0x11070), (0x1133B, 0x1133B),
    (0x1145E, 0x1145E), (0x11839, 0x1183A), (0x11930, 0x11930), (0x11938, 0x11938), (0x1193D, 0x1193E),
    (0x11943, 0x11943), (0x119E0, 0x119E0), (0x11A34, 0x11A34), (0x11A47, 0x11A47), (0x11A99, 0x11A99),
    (0x11D42, 0x11D42), (0x11D44, 0x11D45), (0x11D97, 0x11D97), (0x16FF0, 0x16FF1), (0x1E130, 0x1E136),
    (0x1E2AE, 0x1E2AE), (0x1E2EC, 0x1E2EF),
)


@functools.lru_cache(maxsize=1)
def _unsure_table() -> np.ndarray:
    """True at each code point unassigned in Unicode 14.0 (`data/unassigned-unicode-14.0.txt`) or in NFC_GAP,
    once per process."""
    table = np.zeros(0x110000, np.bool_)
    for line in resources.files("streamprep").joinpath("data/unassigned-unicode-14.0.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            lo, hi = (int(x, 16) for x in line.split("-"))
            table[lo:hi + 1] = True
    for lo, hi in NFC_GAP:
        table[lo:hi + 1] = True
    return table


def unsure(texts: Sequence[str]) -> list[int]:
    """Indexes of the texts holding a code point unassigned in Unicode 14.0 or in NFC_GAP. gigatoken follows a
    newer Unicode than HF: a letter assigned since 14.0 (CJK Extension J, …) is a letter to one and not the other,
    so the pre-tokens and ids differ (4 657 code points for phi-2), and an NFC tokenizer (Qwen2's) normalizes the
    NFC_GAP marks otherwise, so its ids differ wherever they stand out of canonical order; no sample can vouch for
    either, so those texts are encoded by HF (for a tokenizer without NFC, needlessly but harmlessly). A pure-ASCII
    text (`isascii` reads a flag) costs nothing; the others one UTF-32 copy, and a table lookup per char from
    U+0378 (the first unassigned): ~750 MB/s of web text here, a quarter of gigatoken's own time."""
    found: list[int] = []
    for chunk in _chunks(texts, [i for i, t in enumerate(texts) if not t.isascii()]):
        cps = np.frombuffer("\n".join([texts[i] for i in chunk]).encode("utf-32-le", "surrogatepass"), np.uint32)
        high = np.flatnonzero(cps >= 0x378)
        hits = high[_unsure_table()[cps[high]]]
        if hits.size:
            starts = np.cumsum([0, *(len(texts[i]) + 1 for i in chunk[:-1])])
            found += [chunk[k] for k in np.unique(np.searchsorted(starts, hits, side="right") - 1).tolist()]
    return found


def _chunks(texts: Sequence[str], idx: list[int], chars: int = 1 << 20) -> Iterator[list[int]]:
    """`idx` in runs of just over `chars` characters of `texts`: a whole shard's UTF-32 copy at once was ~60 MB more
    peak RSS per worker."""
    chunk, size = [], 0
    for i in idx:
        chunk.append(i)
        size += len(texts[i])
        if size > chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class GigatokenBackend:
    """gigatoken (Rust): `encode_batch` → awkward array, whose offsets and content are the lengths and flat ids;
    a text `unsure` finds is encoded by HF instead (`hf_texts` counts them).

    Built from the file's bytes (`Tokenizer.from_json`), so a path is never taken for a Hub id."""

    name = "gigatoken"

    def __init__(self, tokenizer_json: str | Path, budget_bytes: int | None = CACHE_BUDGET_BYTES):
        import gigatoken

        self._path, self._json = tokenizer_json, Path(tokenizer_json).read_bytes()
        if (sparse := _sparse_ids(self._json)) is not None:
            raise BackendError(sparse)
        self._hf: HFBackend | None = None
        self.hf_texts = 0
        self.version = _version("gigatoken")
        self.budget = budget_bytes
        self.rebuilds = 0
        self._bounded = hasattr(gigatoken, "set_max_cache_bytes")
        if self._bounded and budget_bytes is not None:
            gigatoken.set_max_cache_bytes(budget_bytes)
        self._build()
        self.vocab_size = int(self.tokenizer.vocab_size)

    def _build(self) -> None:
        import gigatoken

        self.tokenizer = gigatoken.Tokenizer.from_json(self._json)
        _trim_heap()  # loading leaves freed parse buffers in the heap
        self._baseline = _rss()

    def encode_batch(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        import awkward as ak

        if not texts:
            return np.zeros(0, np.uint32), np.zeros(0, np.int64)
        arr = self.tokenizer.encode_batch(list(texts))
        layout = ak.to_layout(arr)
        if isinstance(layout, ak.contents.ListOffsetArray) and isinstance(layout.content, ak.contents.NumpyArray):
            offsets = np.asarray(layout.offsets.data)
            flat = np.asarray(layout.content.data)[offsets[0]:offsets[-1]]
            lengths = np.diff(offsets).astype(np.int64, copy=False)
        else:  # another layout: the generic (copying) route
            flat, lengths = np.asarray(ak.flatten(arr, axis=1)), np.asarray(ak.num(arr, axis=1), dtype=np.int64)
        flat = flat.astype(np.uint32, copy=False)
        if not self._bounded and self.budget is not None and _rss() - self._baseline > self.budget:
            flat = flat.copy()  # the ids must outlive the tokenizer they came from
            self.tokenizer = None
            _trim_heap()
            self._build()
            self.rebuilds += 1
        return self._with_hf(texts, flat, lengths)

    def _with_hf(self, texts: Sequence[str], flat: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """`flat, lengths` with the ids of the texts `unsure` finds replaced by HF's."""
        which = unsure(texts)
        if not which:
            return flat, lengths
        self.hf_texts += len(which)
        self._hf = self._hf or HFBackend(self._path)
        hf_flat, hf_lengths = self._hf.encode_batch([texts[i] for i in which])
        pieces = np.split(flat, np.cumsum(lengths)[:-1])
        for i, piece in zip(which, np.split(hf_flat, np.cumsum(hf_lengths)[:-1])):
            pieces[i] = piece
        lengths = lengths.copy()
        lengths[which] = hf_lengths
        return np.concatenate(pieces).astype(np.uint32, copy=False), lengths

    def encode_each(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        """encode_batch's result from gigatoken's one-text `encode` (numpy ids): the same encoder without
        awkward, which its batch APIs import, for `select`, which the config check of `backend: gigatoken` runs
        in the driver, which encodes nothing else (awkward's import costs ~0.25 CPU-s)."""
        ids = [self.tokenizer.encode(t) for t in texts]
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flat = np.concatenate(ids).astype(np.uint32, copy=False) if ids else np.zeros(0, np.uint32)
        return self._with_hf(texts, flat, lengths)


def _sparse_ids(tokenizer_json: bytes) -> str | None:
    """Why gigatoken must not load this tokenizer.json for the spread of its ids (SPARSE_IDS_SLACK), else None.
    Its abort (a failed allocation) is no exception: it ended the job's process, and every resume the same. A file
    with no number as large as SPARSE_IDS_SLACK after a `:`, `[` or `,` has no such id: the parse (+17 MiB of peak
    memory for phi-2's, in the job's process and the forkserver) is only for one that has."""
    if max((int(m[1]) for m in _ID_LITERALS.finditer(tokenizer_json)), default=0) < SPARSE_IDS_SLACK:
        return None
    try:
        spec = orjson.loads(tokenizer_json)
        vocab = spec["model"].get("vocab") or {}
        ids = [*(vocab.values() if isinstance(vocab, dict) else range(len(vocab))),
               *(t["id"] for t in spec.get("added_tokens") or [])]
        top = max((i for i in ids if isinstance(i, int)), default=-1)
    except Exception:  # noqa: BLE001 - not a tokenizer.json gigatoken reads: its own load says why
        return None
    if top < 2 * len(ids) + SPARSE_IDS_SLACK:
        return None
    return f"its ids reach {top} for {len(ids)} entries (gigatoken's tables would hold {top + 1} ids)"


_built: dict[str, GigatokenBackend] = {}  # the last gigatoken backend gigatoken_backend built, by file SHA-256


def gigatoken_backend(tokenizer_json: str | Path) -> GigatokenBackend:
    """A GigatokenBackend of a local tokenizer.json, built once per process for the same bytes: the worker that
    ran the run's identity check (`select`) encodes its shards with the tokenizer it built (~0.2 CPU-s for
    phi-2). Sharing it cannot change an id (its caches never do); only the last file is kept."""
    key = hashlib.sha256(Path(tokenizer_json).read_bytes()).hexdigest()
    if key not in _built:
        backend = GigatokenBackend(tokenizer_json)
        _built.clear()
        _built[key] = backend
    return _built[key]


def load(name: str, tokenizer_json: str | Path) -> Backend:
    """The named backend ("hf" or "gigatoken") over a local tokenizer.json."""
    if name == "hf":
        return HFBackend(tokenizer_json)
    if name == "gigatoken":
        return gigatoken_backend(tokenizer_json)
    raise ValueError(f"unknown tokenizer backend {name!r}")


def mismatch(reference: Backend, candidate: Backend, texts: Sequence[str]) -> str | None:
    """None when both give the same ids for every text, else the first difference, in words."""
    if not texts:
        return None
    return _difference(reference, reference.encode_batch(texts), candidate, candidate.encode_batch(texts), texts)


def _difference(reference: Backend, ref_ids: tuple[np.ndarray, np.ndarray], candidate: Backend,
                got_ids: tuple[np.ndarray, np.ndarray], texts: Sequence[str]) -> str | None:
    """mismatch's verdict on ids already encoded: (flat, lengths) of each backend for `texts`. It names the first
    position where the ids part and shows a few on each side of it (the first ids of both are usually the same)."""
    (ref_flat, ref_len), (got_flat, got_len) = ref_ids, got_ids
    if np.array_equal(ref_len, got_len) and np.array_equal(ref_flat, got_flat):
        return None
    ends = np.concatenate(([0], np.cumsum(ref_len)))
    got_ends = np.concatenate(([0], np.cumsum(got_len)))
    for i, text in enumerate(texts):
        a, b = ref_flat[ends[i]:ends[i + 1]], got_flat[got_ends[i]:got_ends[i + 1]]
        if not np.array_equal(a, b):
            common = min(len(a), len(b))
            parted = np.flatnonzero(a[:common] != b[:common])
            at = int(parted[0]) if parted.size else common  # else one is a prefix of the other
            lo, hi = max(0, at - 3), min(at + 4, max(len(a), len(b)))  # the ids shown, none past both ends
            shown = [f"{'...' if lo else ''}{ids[lo:hi].tolist()}{'...' if len(ids) > hi else ''}" for ids in (a, b)]
            return (f"{candidate.name} ids differ from {reference.name} on text {i} ({text[:40]!r}) at id {at} "
                    f"(of {len(a)} vs {len(b)}), ids {lo}-{hi - 1}: {shown[0]} vs {shown[1]}")
    return f"{candidate.name} and {reference.name} disagree on the batch's lengths"  # unreachable in practice


def added_token_probes(tok: Tokenizer) -> list[str]:
    """Texts with each added token beside spaces, newlines, itself and words: where its lstrip / rstrip /
    single_word settings apply, which re-implementations can apply otherwise (a RoBERTa-style `<mask>` with
    lstrip: gigatoken 0.10.0 kept the space HF strips, and PROBES alone passed), and each `normalized` one in its
    normalized form too when that is not its content (`_normal_forms`). Then `overlap_probes`."""
    added = [t for t in tok.get_added_tokens_decoder().values() if t.content]
    if not added:
        return []
    tokens = [t.content for t in added]
    known = set(tokens)
    tokens += [form for form in dict.fromkeys(_normal_forms(tok, added)) if form not in known]
    # one text per context, each token in it apart from the others; whitespace tokens ("\n\n" with rstrip,
    # "\xa0" with single_word) among them: skipping them let such a tokenizer pass and write other ids
    return ["|".join(f"a {t} b" for t in tokens), "|".join(f"a  {t}  b" for t in tokens),
            "|".join(f"a\n{t}\nb" for t in tokens), "|".join(f"x{t}{t}y" for t in tokens),
            "|".join(f"ab{t}{t}{t}" for t in tokens), "|".join(f"1{t}2 {t}." for t in tokens),
            *overlap_probes(tok)]


def _normal_forms(tok: Tokenizer, added: list[Any]) -> list[str]:
    """The normalized forms of the `normalized` added tokens that are not their content (nor empty). HF matches such
    a token by its content under the tokenizer's normalizer, in the normalized text (an NFC tokenizer's "e\u0301"
    is "\u00e9", found in "café"); gigatoken 0.10.0 does not, and a probe of the content alone agreed."""
    if tok.normalizer is None:
        return []
    forms = ((t.content, tok.normalizer.normalize_str(t.content)) for t in added if t.normalized)
    return [form for content, form in forms if form and form != content]


MAX_OVERLAP_PROBES = 4096  # texts of `overlap_probes` at most: 4096 cost the check ~0.1 CPU-s (phi-2 + 410 tokens)


class UnprobedOverlaps(ValueError):
    """More overlapping added tokens than MAX_OVERLAP_PROBES: the check cannot vouch for gigatoken on them."""


def overlap_probes(tok: Tokenizer) -> list[str]:
    """Texts where a `normalized` added token and a not-`normalized` one run together, the end of one the start of
    the other (either first). HF matches the not-normalized tokens over the whole text first, then the normalized
    ones in what is left; gigatoken 0.10.0 takes the leftmost longest of all in one pass ("<xq>" with "<xq"
    normalized and "q>" not: HF "<x" + "q>", gigatoken "<xq" + ">"). Tokens of one flag are matched in one pass by
    both, and one token inside another is in `added_token_probes` already; a normalized token's normalized form
    (`_normal_forms`) runs together with the others too. Tokens' starts are indexed, so the cost follows the
    overlaps found, not the pairs. Every overlap is probed: one left out may be the one that differs (70 that agree
    filled a cap of 64 before "<xq>"), so more than MAX_OVERLAP_PROBES raise UnprobedOverlaps."""
    added = [t for t in tok.get_added_tokens_decoder().values() if t.content]
    norm = {t.content for t in added if t.normalized} | set(_normal_forms(tok, added))
    raw = {t.content for t in added if not t.normalized}
    if not norm or not raw:
        return []
    found = _run_together(norm, raw) | _run_together(raw, norm)
    if len(found) > MAX_OVERLAP_PROBES:
        raise UnprobedOverlaps(f"its added tokens overlap in {len(found)} ways (a normalized one run together with "
                               f"one not), more than the {MAX_OVERLAP_PROBES} the check probes")
    return [f"a {s} b{s}" for s in sorted(found)]


def _run_together(first: set[str], second: set[str]) -> set[str]:
    """x + y[k:] for each x of `first` whose last k characters are the first k of a longer y of `second`, with
    neither inside the other ("<xq" and "q>" give "<xq>")."""
    longest = max(map(len, first))
    starts: dict[str, list[str]] = {}
    for y in second:
        for k in range(1, min(len(y), longest)):
            starts.setdefault(y[:k], []).append(y)
    return {x + y[k:] for x in first for k in range(1, len(x)) for y in starts.get(x[-k:], ())}


def is_panic(exc: BaseException) -> bool:
    """A Rust panic raised through pyo3 (`pyo3_runtime.PanicException`, a BaseException only, not importable):
    `tokenizers` panics on some texts with some added-token settings ("AddedVocabulary bad split")."""
    return type(exc).__name__ == "PanicException" and type(exc).__module__ == "pyo3_runtime"


def panic_reason(hf: HFBackend, text: str) -> str | None:
    """Why HF cannot encode `text` (its panic's first line), or None when it can."""
    try:
        hf.tokenizer.encode(text, add_special_tokens=False)
    except BaseException as exc:  # noqa: BLE001 - a panic is a BaseException only
        if not is_panic(exc):
            raise
        return panic_message(exc)
    return None


def panic_message(exc: BaseException) -> str:
    """A tokenizers panic (`is_panic`) as a drop's reason, its first line: the pretraining and SFT paths say the same."""
    return f"tokenizers panicked: {(str(exc).strip().splitlines() or [''])[0][:200]}"


def _encodable(hf: HFBackend, texts: list[str]) -> list[str]:
    """The texts HF itself encodes. tokenizers panics ("AddedVocabulary bad split") on some added-token settings
    (an added "ab" with rstrip, in "abababab"): such a probe vouches for nothing, and its panic, a BaseException,
    ended the job with a Rust backtrace."""
    out = [text for text in texts if panic_reason(hf, text) is None]
    failed = len(texts) - len(out)
    if failed:
        log.info("identity check: added-token probes hf itself cannot encode are left out", probes=failed)
    return out


def select(requested: str, tokenizer_json: str | Path, texts: Iterable[str] = ()) -> dict[str, Any]:
    """Resolve `tokenizer.backend` for this tokenizer: a record of the choice (name, version, check) to keep.

    `auto`: gigatoken if it loads and its ids equal HF's on PROBES + `texts`, else HF with the reason (also when HF
    panics on an added-token probe: the documents HF cannot encode are dropped, and only HF finds them; and when
    there are too many overlapping added tokens to probe, `UnprobedOverlaps`).
    `gigatoken`: the same check, but a failure raises BackendError. `hf`: no check."""
    if requested not in BACKENDS:
        raise ValueError(f"unknown tokenizer backend {requested!r}")
    if requested == "hf":
        return {"requested": requested, "name": "hf", "version": _version("tokenizers")}
    hf = HFBackend(tokenizer_json)
    try:
        probes, unprobed = added_token_probes(hf.tokenizer), None
    except UnprobedOverlaps as exc:
        probes, unprobed = [], str(exc)
    encodable = _encodable(hf, probes)
    sample = [*PROBES, *encodable, *itertools.islice(texts, CHECK_DOCS)]
    check = None
    if unprobed:
        reason = unprobed
    elif len(encodable) < len(probes):  # HF drops the documents it cannot encode (textshard); gigatoken encodes them
        reason = (f"hf panics on {len(probes) - len(encodable)} of its added-token probes: documents it cannot "
                  f"encode are dropped, which gigatoken cannot tell")
    else:
        try:
            giga = gigatoken_backend(tokenizer_json)
        except Exception as exc:  # ImportError, or gigatoken refusing this tokenizer.json (any exception type)
            first_line = (str(exc).strip().splitlines() or [""])[0][:200]
            reason = f"gigatoken cannot load {Path(tokenizer_json).name}: {type(exc).__name__}: {first_line}"
        else:
            reason = _difference(hf, hf.encode_batch(sample), giga, giga.encode_each(sample), sample)
            check = {"texts": len(sample), "identical": reason is None}
            if reason is None:
                return {"requested": requested, "name": "gigatoken", "version": giga.version, "check": check}
    if requested == "gigatoken":
        raise BackendError(f"tokenizer.backend is gigatoken but {reason}")
    log.warning("tokenizer backend: using hf", reason=reason)
    out = {"requested": requested, "name": "hf", "version": hf.version, "fallback_reason": reason}
    return {**out, "check": check} if check else out


class ShardEncoder:
    """What a tokenize worker encodes pretraining shards with. `choice` (TokenizerInfo.backend_name):
    "hf"; "gigatoken" (forced: a failed check raises BackendError); "auto" (a failed check moves this worker
    to HF for good, logged once; the batch checked is encoded by HF, so its bytes are right).

    The check (gigatoken against HF on the first CHECK_DOCS texts) runs on the first batch of the first shard
    of each dataset this worker encodes: every dataset's text is checked, at a cost paid once per worker and
    dataset (HF encodes ~64 documents) rather than per shard."""

    def __init__(self, choice: str, tokenizer_json: str | Path):
        self.choice, self.path = choice, tokenizer_json
        self.backend: Backend = load("hf" if choice == "hf" else "gigatoken", tokenizer_json)
        self.fallback_reason: str | None = None
        self._reference: HFBackend | None = None
        self._checked: set[str] = set()
        self._refused: str | None = None  # a forced gigatoken's failed check: every later batch is refused too

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def vocab_size(self) -> int:
        return self.backend.vocab_size

    def encode_or_drop(self, texts: Sequence[str], check: str | None = None
                       ) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
        """encode_batch, and {index: reason} of the texts HF (the reference, whatever the backend) cannot encode,
        which get no ids (length 0). Their panic is caught at the batch, free; only a batch that panicked is
        encoded text by text by HF to find them, then the others again as a batch (with the check)."""
        try:
            return (*self.encode_batch(texts, check), {})
        except BaseException as exc:  # noqa: BLE001 - a panic is a BaseException only
            if not is_panic(exc):
                raise
            panic = exc
        hf = self.backend if isinstance(self.backend, HFBackend) else self._reference or HFBackend(self.path)
        failed = {i: why for i, text in enumerate(texts) if (why := panic_reason(hf, text)) is not None}
        if not failed:
            raise panic
        keep = [i for i in range(len(texts)) if i not in failed]
        flat, kept_lengths = self.encode_batch([texts[i] for i in keep], check)
        lengths = np.zeros(len(texts), np.int64)
        lengths[keep] = kept_lengths
        return flat, lengths, failed

    def encode_batch(self, texts: Sequence[str], check: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """`texts` → (flat ids, lengths). `check`: a dataset name; the first time it is seen, the first
        CHECK_DOCS texts are compared against HF before this batch is encoded. A forced gigatoken that failed it
        refuses every later batch: the worker (cached across tasks) had marked the dataset checked and encoded
        the job's next shards with it, unchecked, before the job stopped."""
        if self._refused is not None:
            raise BackendError(self._refused)
        if check is not None and check not in self._checked and self.backend.name == "gigatoken":
            self._reference = self._reference or HFBackend(self.path)
            reason = mismatch(self._reference, self.backend, texts[:CHECK_DOCS])
            if reason is not None:
                if self.choice == "gigatoken":
                    self._refused = f"tokenizer.backend is gigatoken but {reason}"
                    raise BackendError(self._refused)
                log.warning("tokenizer backend: this worker falls back to hf", reason=reason, dataset=check)
                self.backend, self.fallback_reason = self._reference, reason
            self._checked.add(check)
        return self.backend.encode_batch(texts)
