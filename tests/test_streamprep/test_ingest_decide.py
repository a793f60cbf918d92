"""The decider's two paths: a piece decided on arrays gives exactly what the record-by-record loop gives."""
from __future__ import annotations

import asyncio
import hashlib
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
import pytest

from helpers import base_config
from quality import DedupDecision, DedupIndex
from quality.dedup import NO_DIGEST, digest_words, duplicate_reason, prefix_order
from streamprep.checkpoints import IngestState
from streamprep.layout import CheckpointLayout
from streamprep.config import load
from streamprep.holders import HeldDedup, Holders
from streamprep.ingest import Ahead, DatasetIngest, IngestContext
from streamprep.unit_worker import BAD, KEPT, REJECTED, Summary, digest_order
from streamprep.units import Unit

CHECKS = ["min_chars", "language", "pii", "json"]


def _pool(rng: random.Random, n: int) -> list[bytes]:
    """Digests to draw records from; every fifth shares its 8-byte prefix with the one before (collisions)."""
    out: list[bytes] = []
    for i in range(n):
        d = hashlib.sha256(f"{rng.random()}".encode()).digest()
        out.append(out[-1][:8] + d[8:] if i % 5 == 4 else d)
    return out


def _piece(rng: random.Random, pool: list[bytes], n: int) -> Summary:
    """`n` items: unreadable, rejected (some without a digest: an empty text) and kept, digests drawn with
    repeats from `pool` (copies inside the piece, of earlier pieces and of the earlier dataset)."""
    kinds, digests, text_bytes, checks = bytearray(), [], [], []
    for _ in range(n):
        kind = rng.choices((BAD, REJECTED, KEPT), (1, 3, 10))[0]
        kinds.append(kind)
        if kind == BAD:
            checks.append("json")
            continue
        digests.append(NO_DIGEST if kind == REJECTED and rng.random() < 0.2 else rng.choice(pool))
        if kind == KEPT:
            text_bytes.append(rng.randrange(1, 5000))
        else:
            checks.append(rng.choice(CHECKS))
    blob = b"".join(digests)
    # half the pieces carry the worker's sort by prefix (a Summary of exact dedup does), the others are sorted here
    order = digest_order(blob) if rng.random() < 0.5 else None
    return Summary(bytes(kinds), blob, np.array(text_bytes, np.int64), checks, None, False, order)


def _ingest(tmp_path: Path, max_rejects: int | None, **dataset: Any) -> DatasetIngest:
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "unread"}\n')
    raw = base_config([{"name": "early", "path": str(src)}, {"name": "late", "path": str(src), **dataset}], None,
                      output={"max_rejects_per_check": max_rejects})
    raw["quality"].update(dedup="exact", dedup_scope="run")
    cfg = load(raw)
    ctx = IngestContext.of(cfg, tmp_path / "run", tmp_path / "run" / "checkpoints", asyncio.Event())
    return DatasetIngest(cfg.datasets[1], ctx, SimpleNamespace(workers=1), None)


def _index(path: Path, digests: list[bytes]) -> DedupIndex:
    index = DedupIndex(path, buffer=7)  # spills to the sorted runs every 7 digests
    for d in dict.fromkeys(digests):
        index.add(d)
    return index


def _same_index(a: DedupIndex, b: DedupIndex, pool: list[bytes]) -> None:
    """The same digests, logged in the same order (whatever runs hold them), also once reloaded."""
    a.flush()
    b.flush()
    assert len(a) == len(b) and a._path.read_bytes() == b._path.read_bytes()
    members = [d in a for d in pool]
    reloaded = DedupIndex(b._path)
    assert members == [d in b for d in pool] == b.contains_many(digest_words(pool)).tolist()
    assert members == [d in reloaded for d in pool]


@pytest.mark.parametrize("seed, max_rejects, scope", [(1, 3, "run"), (2, None, "run"), (3, 0, "dataset"),
                                                      (4, 1000, "run")])
def test_arrays_decide_as_the_loop(tmp_path: Path, seed: int, max_rejects: int | None, scope: str) -> None:
    rng = random.Random(seed)
    pool = _pool(rng, 1500)
    ing = _ingest(tmp_path, max_rejects)
    earlier = [("early", _index(tmp_path / "early.dedup", rng.sample(pool, 200)))] if scope == "run" else []
    resumed = rng.sample(pool, 20)  # the dataset's own index as a resume finds it
    loop = DedupDecision(_index(tmp_path / "loop.dedup", resumed), earlier)
    arrays = DedupDecision(_index(tmp_path / "arrays.dedup", resumed), earlier)
    state = IngestState("late")
    state.consumed = state.kept = state.dedup_count = len(set(resumed))
    a_loop, a_arrays = Ahead.of(state), Ahead.of(state)
    dups = {"": 0, "early": 0}
    for k in range(40):
        unit = Unit("range", k // 3, "in.jsonl", "jsonl", 0, 10) if k % 4 else Unit("stream", -1)
        a_loop.position["base"] = a_arrays.position["base"] = k  # the decision carries it for line numbers
        s = _piece(rng, pool, rng.choice((0, 1, 5, 60, 200)))
        want, capped = ing._decide_records(a_loop, loop, unit, s)
        got = ing._decide_arrays(a_arrays, arrays, unit, s)
        assert not capped
        assert got == want and list(got.dup.items()) == list(want.dup.items())
        assert a_arrays == a_loop and list(a_arrays.rejects_sampled) == list(a_loop.rejects_sampled)
        assert all(type(c) is str for c in a_arrays.rejects_sampled)
        for twin in got.dup.values():
            dups[twin] += 1
    assert dups[""] > 50 and (dups["early"] > 20 or scope == "dataset")  # both kinds of copies were met
    assert a_loop.kept > 500 and a_loop.rejected > 500, a_loop
    assert sum(a_loop.rejects_sampled.values()) == (
        a_loop.rejected if max_rejects is None else min(a_loop.rejected, (len(CHECKS) + 1) * max_rejects))
    _same_index(loop.own, arrays.own, pool)


@pytest.mark.parametrize("cap", [{"max_records": 1234}, {"size_mb": 0.5}, {"max_records": 1300, "size_mb": 0.5}])
def test_a_cap_inside_a_piece_decides_as_the_loop(tmp_path: Path, cap: dict[str, Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a cap ends the dataset inside a piece the outcome is the loop's: `max_records` alone is decided on
    the arrays (the piece's head up to the cap), `size_mb` record by record (where it stops depends on each
    kept record's dedup verdict)."""
    rng = random.Random(9)
    pool = _pool(rng, 500)
    ing = _ingest(tmp_path, 5, **cap)
    if "size_mb" not in cap:  # the loop is the reference below; _decide itself must not take it
        records = ing._decide_records
        monkeypatch.setattr(ing, "_decide_records", lambda *a: pytest.fail("decided record by record"))
    loop = DedupDecision(_index(tmp_path / "loop.dedup", []))
    mixed = DedupDecision(_index(tmp_path / "mixed.dedup", []))
    a_loop, a_mixed = Ahead.of(IngestState("late")), Ahead.of(IngestState("late"))
    unit = Unit("range", 0, "in.jsonl", "jsonl", 0, 10)
    for _ in range(100):
        s = _piece(rng, pool, 100)
        want, want_capped = (records if "size_mb" not in cap else ing._decide_records)(a_loop, loop, unit, s)
        got, capped = ing._decide(a_mixed, mixed, unit, s)
        assert (got, capped, a_mixed) == (want, want_capped, a_loop)
        if capped:
            break
    assert capped and 0 < got.applied < 100
    _same_index(loop.own, mixed.own, pool)


def test_contains_many_and_add_many_match_one_by_one(tmp_path: Path) -> None:
    rng = random.Random(4)
    pool = _pool(rng, 400)
    one, many = DedupIndex(tmp_path / "one.dedup", buffer=16), DedupIndex(tmp_path / "many.dedup", buffer=16)
    for start in range(0, 300, 37):  # through the runs' merges; one by one in between (the buffer, then a batch)
        fresh = [d for d in dict.fromkeys(pool[start:start + 37]) if d not in one]
        for d in fresh:
            one.add_new(d)
        if start % 2:
            many.add_many(digest_words(fresh))
        else:
            for d in fresh[:5]:
                many.add_new(d)
            many.add_many(digest_words(fresh[5:]))
        assert many.contains_many(digest_words(pool)).tolist() == [d in one for d in pool] == [d in many for d in pool]
    _same_index(one, many, pool)
    for bad in (np.zeros((2, 3), np.uint64), np.zeros((2, 4), np.int64), np.zeros(8, np.uint64)):
        with pytest.raises(ValueError, match="rows of 4"):
            many.add_many(bad)
    with pytest.raises(ValueError):
        digest_words([pool[0], b"short"])


def test_an_all_kept_piece_is_finalized_as_record_by_record(tmp_path: Path) -> None:
    """`finalize_piece` takes a batch whose items are all kept as judged at once (`stats.add_kept`, the lines
    numbered in one pass): its kept lines and audit stats equal the record-by-record fold (`stats.add_record`),
    with languages, densities (zero ones too) and lengths in many bins."""
    import pickle

    from helpers import english_docs
    from quality import validate_quality_config
    from streamprep import stats
    from streamprep.modes import PRETRAIN
    from streamprep.unit_worker import _SENTINEL, Decision, finalize_piece, init_worker, judge_piece

    init_worker(validate_quality_config({"min_chars": 0, "min_language_prob": 0.0, "pii_max_density": 0.99,
                                         "profanity_max_density": 0.99, "reject_copyright": False}), PRETRAIN)
    docs = english_docs(40, seed=5)
    items = [{"text": d[: 60 + 9 * i]} for i, d in enumerate(docs)]
    items.append({"text": "Damn it, send the shit to my address a@b.co before the meeting starts tomorrow."})
    stage = str(tmp_path / "piece")
    assert judge_piece("d", "text", 8, stage, None, items=items).kinds == bytes([KEPT]) * len(items)
    with open(stage + ".judged", "rb") as fh:
        judged = pickle.load(fh)
    decision = Decision(len(items), 100, None, bytes([1]) * len(items), {}, {}, frozenset())
    _, st, size = finalize_piece("d", stage, decision)

    expected: dict = {}
    lines = []
    for cols, gates, _ in judged:
        stats.add_gates(expected, gates)
        for row, meta, chars in zip(cols.row, cols.meta, cols.chars):
            stats.add_record(expected, True, meta, chars)
            lines.append(row.replace(_SENTINEL, b'"index":%d' % (100 + len(lines)), 1))
    assert st == expected and "languages_kept" in st and "profanity_density_hist_kept" in st
    assert Path(stage + ".kept").read_bytes() == b"".join(lines) and size == len(b"".join(lines))


def test_a_duplicate_whose_meta_was_not_stored_reports_the_meta_qc_gave(tmp_path: Path) -> None:
    """With every gate off a kept item's meta is not stored in the piece's scratch file (the stats read none of
    it); an item the decision then rejects as a duplicate reports QC's meta all the same, read from its row, and
    the stats and kept lines equal those of the record-by-record fold."""
    import pickle

    from quality import QualityControl, validate_quality_config
    from streamprep import stats
    from streamprep.modes import PRETRAIN
    from streamprep.unit_worker import _SENTINEL, Decision, finalize_piece, init_worker, judge_piece

    gates_off = validate_quality_config({"dedup": "exact", "expected_language": None, "min_chars": 0,
                                         "normalize": False, "pii_max_density": 1.0, "profanity_max_density": 1.0,
                                         "reject_copyright": False})
    init_worker(gates_off, PRETRAIN)
    texts = ["caf\u00e9  au lait", "plain one", "caf\u00e9  au lait", "x \u201cq\u201d", "plain one", "last"]
    items = [{"text": t, "url": f"http://e/{i}"} for i, t in enumerate(texts)]
    stage = str(tmp_path / "piece")
    assert judge_piece("d", "text", 4, stage, None, items=items).kinds == bytes([KEPT]) * len(items)
    with open(stage + ".judged", "rb") as fh:
        judged = pickle.load(fh)
    assert all(meta is None for cols, _, _ in judged for meta in cols.meta)
    dup = {2: "", 4: "earlier"}
    decision = Decision(len(items), 10, None, bytes(0 if i in dup else 1 for i in range(len(items))), dup, {},
                        frozenset(dup))
    rejects, st, _ = finalize_piece("d", stage, decision)

    qc = QualityControl(gates_off)
    lines = [orjson.loads(line) for line in rejects.splitlines()]
    assert [line["source"]["index"] for line in lines] == [12, 14]
    for line, i in zip(lines, sorted(dup)):
        given = qc.evaluate(items[i]).meta
        assert line["meta"] == {**given, "failed_check": "duplicate", "reason": duplicate_reason(dup[i]),
                                "duplicate_of": dup[i] or "d"}
        assert "sha256" in given and line["source"]["url"] == f"http://e/{i}"
    expected: dict = {}
    for cols, gates, _ in judged:
        stats.add_gates(expected, gates)
    for i, text in enumerate(texts):
        meta = qc.evaluate(items[i]).meta
        if i in dup:
            meta = {**meta, "failed_check": "duplicate", "duplicate_of": dup[i] or "d"}
        stats.add_record(expected, i not in dup, meta, len(text))  # a reject's too: its text's
    assert st == expected
    kept_rows = [row for cols, _, _ in judged for row in cols.row]
    assert Path(stage + ".kept").read_bytes() == b"".join(
        kept_rows[i].replace(_SENTINEL, b'"index":%d' % (10 + i), 1) for i in range(len(items)) if i not in dup)


@pytest.mark.parametrize("normalize", [True, False])
def test_a_rejects_length_in_the_audit_is_the_records_not_its_excerpts(tmp_path: Path, normalize: bool) -> None:
    """`lengths.chars.rejected` counted a rejected record by its reject line's excerpt (at most 2 000 chars): a
    5 400-char text rejected as too long, or a long duplicate, fell in the 1 024-2 047 bin. A reject counts as a
    kept record does: the text it would keep (normalised or raw, as the kept side), or, without one, its excerpt."""
    from quality import validate_quality_config
    from quality.normalize import normalize_text
    from streamprep import stats
    from streamprep.modes import PRETRAIN
    from streamprep.unit_worker import Decision, finalize_piece, init_worker, judge_piece

    init_worker(validate_quality_config({"dedup": "exact", "expected_language": None, "min_chars": 1,
                                         "max_chars": 4000, "normalize": normalize, "profanity_max_density": 1.0,
                                         "reject_copyright": False}), PRETRAIN)
    long = "word  " * 900  # 5 400 chars, 4 499 normalised: past max_chars either way
    pii = "mail jane.doe@example.com  now"  # 30 chars, 29 normalised
    kept = "x " * 1500  # 3 000 chars, 2 999 normalised
    items = [{"text": long}, {"text": pii}, {"text": kept}, {"text": kept}, {"text": 7}]
    stage = str(tmp_path / "piece")
    s = judge_piece("d", "text", 8, stage, None, items=items)
    assert s.kinds == bytes([REJECTED, REJECTED, KEPT, KEPT, REJECTED])
    decision = Decision(len(items), 0, None, bytes([0, 0, 1, 0, 0]), {3: ""}, {}, frozenset())
    _, st, _ = finalize_piece("d", stage, decision)
    texts = [long, pii, kept, kept]
    chars = [len(normalize_text(t)) if normalize else len(t) for t in texts] + [len('{"text":7}')]  # the record's JSON
    assert chars == ([4499, 29, 2999, 2999, 10] if normalize else [5400, 30, 3000, 3000, 10])
    expected: dict = {}
    for i, n in enumerate(chars):
        stats.add_record(expected, i == 2, {}, n)
    assert st["chars_hist_kept"] == expected["chars_hist_kept"] == {"12": 1}
    assert st["chars_hist_rejected"] == expected["chars_hist_rejected"] == {"13": 1, "5": 1, "12": 1, "4": 1}


def test_prefix_order_is_the_stable_argsort() -> None:
    """twin_many's one sort of a piece: a quicksort with ties put back in piece order equals the stable argsort."""
    rng = np.random.default_rng(5)
    for n, span in ((1, 3), (50, 4), (1000, 40), (5000, 2**63)):
        keys = rng.integers(0, span, n).astype(np.uint64)
        assert (prefix_order(keys) == np.argsort(keys, kind="stable")).all()


def test_the_head_of_a_summary_keeps_the_sort_of_its_digests() -> None:
    """`Summary.head(m)` (the piece a `max_records` cap cuts) carries the order of its own judged items: the
    worker's order less the rows past the head, which is `prefix_order` of the head's digests."""
    rng = random.Random(8)
    pool = _pool(rng, 40)
    for _ in range(20):
        s = _piece(rng, pool, 60)
        if s.order is None:
            continue
        for m in (0, 1, 17, 59, 60):
            head = s.head(m)
            assert (head.order == prefix_order(digest_words(head.digests)[:, 0])).all()


def test_an_order_that_does_not_sort_the_piece_is_not_used(tmp_path: Path) -> None:
    """twin_many checks the order a Summary carries: ties out of piece order, a key going down or a row too few
    (each would misgroup the copies) and it sorts the piece itself; the codes and the log are those of no order."""
    rng = random.Random(4)
    pool = _pool(rng, 50)
    digests = [rng.choice(pool) for _ in range(200)]
    words = digest_words(digests)
    kept = np.array([rng.random() < 0.8 for _ in digests])
    good = prefix_order(words[:, 0])
    tie = int(np.flatnonzero(words[good[1:], 0] == words[good[:-1], 0])[0])
    swapped = good.copy()
    swapped[[tie, tie + 1]] = swapped[[tie + 1, tie]]
    down = good.copy()
    down[[0, -1]] = down[[-1, 0]]
    reference = DedupDecision(DedupIndex(tmp_path / "ref.dedup"))
    want = reference.twin_many(words, kept)
    reference.own.flush()
    for i, order in enumerate((good, swapped, down, good[:-1])):
        decision = DedupDecision(DedupIndex(tmp_path / f"{i}.dedup"))
        assert decision.twin_many(words, kept, order.astype(np.uint32)).tolist() == want.tolist()
        decision.own.flush()
        assert (tmp_path / f"{i}.dedup").read_bytes() == (tmp_path / "ref.dedup").read_bytes()


def test_a_digest_with_a_zero_prefix_is_not_taken_for_no_digest(tmp_path: Path) -> None:
    """NO_DIGEST (32 zero bytes) is never a duplicate and never added; a real digest whose first 8 bytes are zero
    is an ordinary one: its second copy is a duplicate."""
    zero_prefix = bytes(8) + hashlib.sha256(b"x").digest()[8:]
    other = hashlib.sha256(b"y").digest()
    decision = DedupDecision(DedupIndex(tmp_path / "d.dedup"))
    blob = b"".join([NO_DIGEST, zero_prefix, NO_DIGEST, zero_prefix, other])
    codes = decision.twin_many(digest_words(blob), np.array([False, True, False, True, True]))
    assert codes.tolist() == [-1, -1, -1, 0, -1]
    assert len(decision.own) == 2 and zero_prefix in decision.own and NO_DIGEST not in decision.own


@pytest.mark.parametrize("parts", [1, 3])
def test_holders_decide_as_the_index_in_the_process(tmp_path: Path, parts: int) -> None:
    """Exact dedup over `parts` holders (`streamprep.holders`, here in this process): the same codes, probes and
    kept digests as one `DedupDecision`, the copies inside a piece and those of an earlier dataset included; holder
    `p` logs the digests whose first word is `p` mod `parts`, in the order the one log has them."""
    rng = random.Random(parts)
    pool = _pool(rng, 600)
    held_dir, one_dir = tmp_path / "held", tmp_path / "one"
    held_dir.mkdir()
    one_dir.mkdir()
    early = rng.sample(pool, 100)
    holders = Holders(parts, "inline")
    for name in ("early", "late"):
        holders.open(name, held_dir, [0] * parts)
    HeldDedup(holders, "early", [], [0] * parts).add_many(digest_words(early))
    held = HeldDedup(holders, "late", ["early"], [0] * parts)
    one = DedupDecision(_index(one_dir / "late.dedup", []), [("early", _index(one_dir / "early.dedup", early))])
    assert held.names == one.names == ["", "early"]
    for k in range(30):
        s = _piece(rng, pool, rng.choice((0, 1, 50, 300)))
        words = digest_words(s.digests)
        kinds = np.frombuffer(s.kinds, np.uint8)
        kept = (kinds == KEPT)[kinds != BAD]
        assert held.probe_many(words).tolist() == one.probe_many(words).tolist()
        if k % 3:
            assert held.twin_many(words, kept, s.order).tolist() == one.twin_many(words, kept, s.order).tolist()
        else:  # the record-by-record path's add: new digests, in order
            fresh = [d for d in dict.fromkeys(pool[k * 10:k * 10 + 40]) if d not in one.own and
                     not any(d in i for _, i in one.earlier)]
            held.add_many(digest_words(fresh))
            one.add_many(digest_words(fresh))
    held.flush()
    one.own.flush()
    logged = digest_words((one_dir / "late.dedup").read_bytes())
    assert len(logged) > 400 and sum(held.counts) == len(logged)
    for p in range(parts):
        log_p = CheckpointLayout(held_dir).dedup_log("late", p, parts)
        mine = logged[logged[:, 0] % np.uint64(parts) == p]
        assert held.counts[p] == len(mine) and log_p.read_bytes() == mine.tobytes()
    assert [u["digests"]["late"] for u in holders.usage()] == held.counts
