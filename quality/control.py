"""QualityControl: runs the gates on records, keeps per-gate stats and timings, and owns exact dedup.

`evaluate` is stateless apart from stats (safe to run in worker processes); `clean_record` adds the
dedup gate on top, exactly as ingest replicates it around a process pool:

    v = evaluate(record)
    if decision.reason(v.digest): reject "duplicate"  (dedup is the first gate; quality.dedup.DedupDecision)
    elif v.keep: decision.keep(v.digest); keep
    else: reject with v's reason
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from itertools import islice
from time import perf_counter
from typing import Any, NamedTuple

from quality.dedup import DedupDecision, DedupIndex
from quality.gates import Doc, build_gates
from quality.gates.text import NormalizeStep
from quality.near_dedup import Signer
from quality.normalize import normalize_text
from quality.settings import QualitySettings, load_quality_settings


def _not_a_reason(gate: Any, reason: Any) -> str:
    """A verdict that is neither None (keep) nor a reason string (`False`, a number): a gate bug, which costs the
    record, as a gate that raises does, rather than passing for a reason."""
    return f"{gate.name}: internal error: check returned {type(reason).__name__} {reason!r}, not None or a reason"[:300]


class Verdict(NamedTuple):
    keep: bool
    text: str | None      # the kept text (normalised when config normalize=True); None when rejected
    meta: dict[str, Any]  # signals; on reject also failed_check and reason. Read-only: the chain remembers it
    digest: bytes | None  # SHA-256 of the normalised text; None when the record has no usable text
    signature: bytes | None = None  # MinHash of the kept text when near_dedup is on (for the writer's index)
    text_bytes: int | None = None  # UTF-8 bytes of the kept text when normalisation counted them (it is its text)


MEMO_SIZE = 65_536  # texts whose verdict a QualityControl remembers (~0.7 KB each on C4: ~46 MB at most)


def _copied(items: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Meta items with their nested dicts (`pii`) copied: a remembered verdict and the verdicts it is given to
    share no mutable value."""
    return [(k, dict(v)) if type(v) is dict else (k, v) for k, v in items]


def _counters() -> dict[str, Any]:
    return {"seen": 0, "kept": 0, "rejected": 0, "seconds": 0.0}


class QualityControl:
    """The quality chain for one dataset's records.

    `stats` is a plain dict: {"records": {seen, kept, rejected}, "rejected_by_check": {check: n},
    "gates": {gate: {seen, kept, rejected, seconds}}} with gates in the order they run.
    """

    def __init__(self, config: QualitySettings | Mapping[str, Any] | None = None, text_field: str = "text",
                 dedup: DedupIndex | None = None):
        """`config`: the typed settings, or a raw `quality:` section (validated here)."""
        if not isinstance(text_field, str) or not text_field:
            raise ValueError(f"text_field must be a non-empty string, got {text_field!r}")
        self.settings = config if isinstance(config, QualitySettings) else load_quality_settings(config)
        self.text_field = text_field
        self.dedup = dedup if dedup is not None else DedupIndex()
        self.decision = DedupDecision(self.dedup)
        self.dedup_on = self.settings.dedup == "exact"
        self.gates = build_gates(self.settings, text_field)
        near = self.settings.near_dedup
        self.signer = Signer(near) if near.enabled else None
        gate_names = (["duplicate"] if self.dedup_on else []) + [g.name for g in self.gates]
        self.stats: dict[str, Any] = {
            "records": {"seen": 0, "kept": 0, "rejected": 0},
            "rejected_by_check": {},
            "gates": {name: _counters() for name in gate_names},
        }
        self._chain = [(g, self.stats["gates"][g.name]) for g in self.gates]  # counters are reset in place
        # Verdicts of the gates after normalisation by the normalised text's digest (see `_recall`), when all
        # of them are text-only and one is not cheap: insertion order, the oldest dropped past MEMO_SIZE.
        after = next((i + 1 for i, g in enumerate(self.gates) if isinstance(g, NormalizeStep)), len(self.gates))
        rest = self.gates[after:]
        worth = all(g.text_only for g in rest) and not all(g.cheap for g in rest)
        self._memo_from = after if worth else None
        # digest -> (where the doc left the chain, None: kept; its verdict's meta; that meta's key span the gates
        # after normalisation added)
        self._memo: dict[bytes, tuple[int | None, dict[str, Any], int, int]] = {}

    def _run(self, record: Any) -> Verdict:
        """Every gate but dedup, cheapest first, stopping at the first failure. One clock read per gate:
        each gate's time runs from the previous read (its own bookkeeping included)."""
        doc = Doc(record)
        meta = doc.meta
        meta["domain"] = self.settings.domain
        t0 = perf_counter()
        for gate, counters in self._chain:
            try:
                reason, check = gate.check(doc), gate.failed_check
            except Exception as exc:  # a gate bug must cost one record, not the run
                reason, check = f"{gate.name}: internal error {type(exc).__name__}: {exc}"[:300], "error"
            t1 = perf_counter()
            counters["seconds"] += t1 - t0
            t0 = t1
            counters["seen"] += 1
            if reason is not None:
                if type(reason) is not str:
                    reason, check = _not_a_reason(gate, reason), "error"
                counters["rejected"] += 1
                meta["failed_check"], meta["reason"] = check, reason
                return Verdict(False, None, meta, doc.digest)
            counters["kept"] += 1
        return self._kept(doc)

    def _run_batch(self, records: list[Any]) -> list[Verdict]:
        """`_run` on every record, gate by gate over the batch (one clock read per gate per batch, and a
        gate's `check_batch` may share work across the docs). Same verdicts and counters as `_run` per
        record: a doc leaves the batch at its first failing gate."""
        domain = self.settings.domain
        docs = [Doc(r) for r in records]
        for doc in docs:
            doc.meta["domain"] = domain
        verdicts: list[Verdict | None] = [None] * len(docs)
        failed_at: dict[int, int] = {}  # doc -> the chain position of the gate that rejected it
        alive = list(range(len(docs)))
        judged: list[int] = []  # docs the gates after normalisation saw (not recalled)
        marks: list[int] = []   # and how many meta keys each had then
        for pos, (gate, counters) in enumerate(self._chain):
            if pos == self._memo_from:
                alive = judged = self._recall(docs, alive, verdicts)
                marks = [len(docs[i].meta) for i in judged]
            if not alive:
                break
            t0 = perf_counter()
            batch = [docs[i] for i in alive]
            try:
                reasons = list(gate.check_batch(batch))
                if len(reasons) != len(batch):  # zip() cut the answer short, and a doc kept no verdict: a crash
                    raise ValueError(f"{gate.name}: check_batch gave {len(reasons)} answers for {len(batch)} docs")
                checks = [gate.failed_check] * len(batch)
            except Exception:  # find the record(s) at fault, one by one, as `_run` would
                reasons, checks = [], []
                for doc in batch:
                    try:
                        reasons.append(gate.check(doc))
                        checks.append(gate.failed_check)
                    except Exception as exc:
                        reasons.append(f"{gate.name}: internal error {type(exc).__name__}: {exc}"[:300])
                        checks.append("error")
            survivors = [i for i, reason in zip(alive, reasons) if reason is None]
            if len(survivors) < len(alive):  # most gates keep most docs: the rejects get a second loop
                for i, doc, reason, check in zip(alive, batch, reasons, checks):
                    if reason is not None:
                        if type(reason) is not str:
                            reason, check = _not_a_reason(gate, reason), "error"
                        doc.meta["failed_check"], doc.meta["reason"] = check, reason
                        verdicts[i] = Verdict(False, None, doc.meta, doc.digest)
                        failed_at[i] = pos
            counters["seconds"] += perf_counter() - t0
            counters["seen"] += len(alive)
            counters["kept"] += len(survivors)
            counters["rejected"] += len(alive) - len(survivors)
            alive = survivors
        for i in alive:
            verdicts[i] = self._kept(docs[i])
        self._remember(docs, judged, marks, failed_at)
        return verdicts  # type: ignore[return-value]  # every slot is set above

    def _kept(self, doc: Doc) -> Verdict:
        """A kept doc's verdict: its normalised text (whose UTF-8 size normalisation counted), or with
        `normalize: false` its raw text."""
        if self.settings.normalize:
            return Verdict(True, doc.text, doc.meta, doc.digest, None, doc.text_bytes)  # by position: ~0.2 µs less
        return Verdict(True, doc.raw, doc.meta, doc.digest)

    def _recall(self, docs: list[Doc], alive: list[int], verdicts: list[Verdict | None]) -> list[int]:
        """Docs whose normalised text the gates after normalisation judged before get that verdict again (the
        meta those gates added, copied), each gate's counters as if it had run: the same text meets the same
        text-only gates. Return the others. Web crawls repeat texts a lot; exact dedup drops repeats only
        after QC."""
        memo = self._memo
        rest: list[int] = []
        reached = [0] * (len(self._chain) + 1)  # recalled docs that left at each position (end: kept)
        for i in alive:
            doc = docs[i]
            hit = memo.get(doc.digest) if doc.digest is not None else None
            if hit is None:
                rest.append(i)
                continue
            pos, meta, mark, end = hit
            doc.meta.update(_copied(islice(meta.items(), mark, end)))
            if pos is None:
                verdicts[i] = self._kept(doc)
                reached[-1] += 1
            else:
                verdicts[i] = Verdict(False, None, doc.meta, doc.digest)
                reached[pos] += 1
        if len(rest) < len(alive):
            passing = len(alive) - len(rest)
            for pos in range(self._memo_from or 0, len(self._chain)):
                counters = self._chain[pos][1]
                counters["seen"] += passing
                counters["rejected"] += reached[pos]
                passing -= reached[pos]
                counters["kept"] += passing
        return rest

    def _remember(self, docs: list[Doc], judged: list[int], marks: list[int], failed_at: dict[int, int]) -> None:
        """Store what `_recall` reuses: where each judged doc left the chain (None: kept) and its verdict's meta
        with the span of keys the gates after normalisation added. The meta itself, not a copy (a copy of its
        items cost ~1.2 µs a doc, ~2 % of the default chain on C4): a verdict's meta is read-only to callers,
        who add to a copy (`{**meta, ...}`, as the unit worker does); keys added after `end` are not recalled."""
        memo = self._memo
        for i, mark in zip(judged, marks):
            doc = docs[i]
            if doc.digest is None or doc.digest in memo:
                continue
            if len(memo) >= MEMO_SIZE:
                del memo[next(iter(memo))]
            memo[doc.digest] = (failed_at.get(i), doc.meta, mark, len(doc.meta))

    def _count(self, keep: bool, meta: dict[str, Any]) -> None:
        records = self.stats["records"]
        records["seen"] += 1
        if keep:
            records["kept"] += 1
        else:
            records["rejected"] += 1
            by_check = self.stats["rejected_by_check"]
            by_check[meta["failed_check"]] = by_check.get(meta["failed_check"], 0) + 1

    def evaluate(self, record: Any) -> Verdict:
        """Every gate except the dedup membership test. Never raises; deterministic."""
        verdict = self._run(record)
        self._count(verdict.keep, verdict.meta)
        return verdict

    def evaluate_batch(self, records: list[Any]) -> list[Verdict]:
        """`evaluate` on each record (gate by gate over the batch), plus near-dedup signatures of the kept
        texts (one batched call)."""
        verdicts = self._run_batch(records)
        for v in verdicts:
            self._count(v.keep, v.meta)
        if self.signer is None:
            return verdicts
        kept = [i for i, v in enumerate(verdicts) if v.keep]
        t0 = perf_counter()
        texts = [verdicts[i].text for i in kept]
        if not self.settings.normalize:  # signed as the digest is hashed, normalised: a kept raw text with NBSPs
            code = self.settings.domain == "code"  # for spaces was one long word, no near-duplicate of anything
            texts = [normalize_text(t, code) for t in texts]
        signatures = self.signer.signatures(texts)
        counters = self.stats["gates"].setdefault("near_dedup_signature", _counters())
        counters["seconds"] += perf_counter() - t0
        counters["seen"] += len(kept)
        counters["kept"] += len(kept)
        for i, sig in zip(kept, signatures):
            verdicts[i] = verdicts[i]._replace(signature=sig)
        return verdicts

    def take_gate_stats(self) -> dict[str, dict[str, Any]]:
        """Per-gate counters and seconds since the last call, in run order, then zeroed: QC workers hand
        them to the writer with each batch, so they add up over the whole run."""
        out = {name: dict(c) for name, c in self.stats["gates"].items()}
        for c in self.stats["gates"].values():
            c.update(_counters())
        return out

    def clean_record(self, record: Any) -> tuple[bool, dict[str, Any]]:
        """The full chain including dedup. A kept record's text field is replaced by the kept
        (normalised) text, when the record is a mutable mapping. Never raises."""
        keep, meta = self._clean(record)
        self._count(keep, meta)
        return keep, meta

    def _clean(self, record: Any) -> tuple[bool, dict[str, Any]]:
        v = self._run(record)
        if self.dedup_on and v.digest is not None:
            counters = self.stats["gates"]["duplicate"]
            t0 = perf_counter()
            reason = self.decision.reason(v.digest)
            counters["seconds"] += perf_counter() - t0
            counters["seen"] += 1
            if reason is not None:
                counters["rejected"] += 1
                return False, {**v.meta, "failed_check": "duplicate", "reason": reason}
            counters["kept"] += 1
        if not v.keep:
            return False, v.meta
        if self.dedup_on:
            self.decision.keep(v.digest)
        if isinstance(record, MutableMapping):
            record[self.text_field] = v.text
        return True, v.meta
