"""Exports: Parquet shards + TSV, manifest.json, mixtures.json, built from small real run dirs.

The run dirs hold real text (../shared/data), tokenized with the real phi-2 tokenizer into
`.bin/.idx` exactly as the tokenize stage lays them out (one sequence per kept record, EOD appended,
empty records dropped and listed in the receipt).
"""
from __future__ import annotations

import hashlib
import io
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest

from streamprep import atomic
from streamprep.binidx import IndexedDataset
from streamprep.exports import ExportError, ShardRef, write_exports
from streamprep.exports.index import ShardRecords
from streamprep.exports.mixtures import MixtureConfigError, validate_mixtures
from streamprep.exports.order import bucket_of, order_keys
from streamprep.exports.parquet import BYTES_PER_TOKEN, ShardCountError, iter_cuts, pack
from export_run import (BUCKETS, DATASETS, EOD, SHARD_SIZE, TOKENIZER_INFO, datasets_cfg, export, output_cfg,
                        parquet_entries, relocate)
from helpers import REPO

# -- helpers reading the outputs --------------------------------------------------------------
def expected_records(run: Path, refs: list[ShardRef]) -> dict[tuple[str, int], tuple[str, list[int], int]]:
    """(dataset, source index) -> (text, tokens from .bin, ingest line bytes) for every kept record."""
    out = {}
    for ref in refs:
        lines = ref.ingest_path.read_bytes().splitlines(keepends=True)
        kept = [i for i in range(len(lines)) if i not in set(ref.receipt["stats"]["dropped_empty"])]
        if ref.prefix is None:
            assert not kept
            continue
        ds = IndexedDataset.open(ref.prefix)
        assert len(ds) == len(kept)
        for seq, line_no in enumerate(kept):
            rec = orjson.loads(lines[line_no])
            out[(ref.dataset, rec["meta"]["source"]["index"])] = (rec["text"], ds[seq].tolist(), len(lines[line_no]))
    return out


def rows(run: Path, entry: dict) -> list[dict]:
    return pq.read_table(run / entry["path"]).to_pylist()


def file_hashes(run: Path) -> dict[str, str]:
    out = {}
    for p in sorted(run.rglob("*")):
        rel = p.relative_to(run)
        if p.is_file() and (rel.parts[0] == "parquet" or p.name in ("manifest.json", "mixtures.json")):
            out[str(p.relative_to(run))] = atomic.sha256_file(p)
    return out


# -- tests ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_every_record_once_with_its_tokens_and_text(run):
    run_dir, refs = run
    summary = export(run_dir, refs)
    want = expected_records(run_dir, refs)
    seen: dict[tuple[str, int], int] = {}
    for entry in parquet_entries(run_dir):
        table = pq.read_table(run_dir / entry["path"])
        assert table.schema.names == ["text", "tokens", "n_tokens", "meta"]
        assert str(table.schema.field("tokens").type.value_type) == "int32"
        assert str(table.schema.field("n_tokens").type) == "int32"
        assert table.num_rows == entry["num_records"] > 0
        for r in table.to_pylist():
            meta = orjson.loads(r["meta"])
            key = (meta["source"]["dataset"], meta["source"]["index"])
            assert key[0] == entry["source"], "one source per shard"
            seen[key] = seen.get(key, 0) + 1
            text, tokens, _ = want[key]
            assert r["text"] == text
            assert r["tokens"] == tokens and tokens[-1] == EOD
            assert r["n_tokens"] == len(tokens)
    assert seen.keys() == want.keys()
    assert set(seen.values()) == {1}
    assert ("c4", 100) not in seen and ("c4", 117) not in seen  # the empty records, dropped
    assert summary["records"] == {"c4": 298, "lingua": 240, "dclm": 60}
    assert summary["tokens"]["c4"] == sum(len(v[1]) for k, v in want.items() if k[0] == "c4")


@pytest.mark.slow
def test_buckets_packing_and_tail_merge(run):
    run_dir, refs = run
    export(run_dir, refs)
    want = expected_records(run_dir, refs)
    man = atomic.read_json(run_dir / "manifest.json")
    assert [b["max_tokens"] for b in man["buckets"]] == BUCKETS + [None]
    assert man["buckets"][0]["min_tokens"] == 1 and man["buckets"][3]["min_tokens"] == 129
    groups: dict[tuple[str, int], list[tuple[int, list[int]]]] = {}
    for entry in parquet_entries(run_dir):
        b = entry["bucket"]
        lo = 1 if b == 0 else BUCKETS[b - 1] + 1
        hi = BUCKETS[b] if b < len(BUCKETS) else 10**12
        est = []
        for r in rows(run_dir, entry):
            assert lo <= r["n_tokens"] <= hi, (entry["shard_id"], r["n_tokens"])
            meta = orjson.loads(r["meta"])
            _, tokens, line_bytes = want[(meta["source"]["dataset"], meta["source"]["index"])]
            est.append(BYTES_PER_TOKEN * len(tokens) + line_bytes)
        assert sum(est) == entry["est_bytes"]
        assert entry["path"] == f"parquet/shard_b{b:02d}_s{int(entry['shard_id'][-5:]):05d}.parquet"
        groups.setdefault((entry["source"], b), []).append((int(entry["shard_id"][-5:]), est))
    merged = 0
    for (_src, _b), shards in groups.items():
        shards.sort()
        indices = [i for i, _ in shards]
        assert indices == list(range(indices[0], indices[0] + len(indices))), "a source's shards are consecutive"
        for k, (_, est) in enumerate(shards):
            total = sum(est)
            last = k == len(shards) - 1
            if len(est) > 1:
                assert total <= (1.25 * SHARD_SIZE if last else SHARD_SIZE)
            if not last:  # greedy: the next record did not fit
                assert total + shards[k + 1][1][0] > SHARD_SIZE
            if last and len(shards) > 1:
                prev = shards[k - 1][1]
                assert total >= 0.25 * SHARD_SIZE or (len(prev) == 1 and prev[0] > SHARD_SIZE), "small tail merged"
            merged += last and total > SHARD_SIZE and len(est) > 1
    assert len(groups) >= 6 and sum(len(s) for s in groups.values()) >= 15
    assert merged >= 1, "the data should exercise at least one merged tail"


def test_pack_rule_units():
    assert pack(np.array([50, 50, 50, 50, 10]), 100) == [(0, 2), (2, 5)]    # tail 10 < 25 merged
    assert pack(np.array([50, 50, 50, 50, 30]), 100) == [(0, 2), (2, 4), (4, 5)]
    assert pack(np.array([250, 10, 10]), 100) == [(0, 1), (1, 3)]          # oversized record alone
    assert pack(np.array([10, 250, 10]), 100) == [(0, 1), (1, 2), (2, 3)]  # ... and no tail joins it
    assert pack(np.array([90, 20, 30]), 100) == [(0, 1), (1, 3)]
    assert pack(np.array([10]), 100) == [(0, 1)] and pack(np.array([], dtype=np.int64), 100) == []
    assert bucket_of(np.array([1, 32, 33, 64, 1024, 1025]), BUCKETS).tolist() == [0, 0, 1, 1, 5, 6]


def test_iter_cuts_equals_pack_over_any_blocks():
    """The plan cuts records streamed block by block exactly as the whole list is cut at once (the rule as it was
    written before the stream: a cumulative sum and a binary search per shard)."""
    def whole(est: np.ndarray, limit: int) -> list[tuple[int, int]]:
        cs, cuts, start, base = np.cumsum(est), [], 0, 0
        while start < len(est):
            end = max(int(np.searchsorted(cs, base + limit, side="right")), start + 1)
            cuts.append((start, end))
            base, start = int(cs[end - 1]), end
        if len(cuts) >= 2:
            (ps, pe), (s, e) = cuts[-2], cuts[-1]
            if cs[e - 1] - cs[s - 1] < 0.25 * limit and cs[pe - 1] - (cs[ps - 1] if ps else 0) <= limit:
                cuts[-2:] = [(ps, e)]
        return cuts

    rng = np.random.default_rng(5)
    for _ in range(500):
        n, limit = int(rng.integers(0, 50)), int(rng.integers(1, 300))
        est = rng.integers(1, 200, n)
        bounds = sorted({0, n, *rng.integers(0, n + 1, int(rng.integers(0, 6))).tolist()})
        cuts = list(iter_cuts([est[a:b] for a, b in zip(bounds, bounds[1:])], limit))
        assert [(a, b) for a, b, _ in cuts] == pack(est, limit) == whole(est, limit)
        assert [e for _, _, e in cuts] == [int(est[a:b].sum()) for a, b in whole(est, limit)]


def test_cuts_come_out_while_the_blocks_are_read():
    """`iter_cuts` gives each cut once the next one is made, not after the last block: the shard writers start while
    the driver still merges the records after them; its cuts are those of the blocks given at once."""
    rng = np.random.default_rng(3)
    blocks = [rng.integers(1, 40, 25) for _ in range(40)]  # 1 000 records, ~20 000 estimated bytes
    read: list[int] = []

    def streamed():
        for i, block in enumerate(blocks):
            read.append(i)
            yield block
    given_after = []
    cuts = []
    for cut in iter_cuts(streamed(), 1000):
        given_after.append(len(read))
        cuts.append(cut)
    assert cuts == list(iter_cuts(blocks, 1000)) and len(cuts) > 10
    assert given_after[0] <= 5 and given_after[-3] < len(blocks)  # the first once the second is cut (~2 000 bytes)


@pytest.mark.slow
def test_parquet_shards_are_written_while_the_plan_goes_on(run, monkeypatch):
    """The exports hand each Parquet shard to a worker as the plan cuts it: with one worker, the first shard is written
    before the last one is planned (the pool works at most two calls ahead), and the files are those of a plan made
    whole first."""
    from streamprep.exports import parquet

    run_dir, refs = run
    write_shards = parquet.write_shards
    with monkeypatch.context() as whole_first:  # the baseline: every shard planned before the first is written
        whole_first.setattr(parquet, "write_shards", lambda run_dir, indexes, plans, *args, **kw:
                            write_shards(run_dir, indexes, list(plans), *args, **kw))
        whole = export(run_dir, refs)
    expected = file_hashes(run_dir)
    events: list[str] = []
    cut, write_one = parquet._cut, parquet._write_one

    def noting_cut(*args):
        for plan in cut(*args):
            events.append("plan")
            yield plan

    def noting_write(job):
        events.append("write")
        return write_one(job)

    monkeypatch.setattr(parquet, "_cut", noting_cut)
    monkeypatch.setattr(parquet, "_write_one", noting_write)
    streamed = export(run_dir, refs)
    assert streamed["parquet_shards"] == whole["parquet_shards"] == events.count("write") == events.count("plan") > 3
    assert events.index("write") < len(events) - 1 - events[::-1].index("plan")
    assert file_hashes(run_dir) == expected


def test_order_keys_rule():
    """SplitMix64 output `ordinal` from a state keyed by (seed, bucket): unique per bucket, the same computed in
    pieces as at once, different per seed and bucket."""
    import hashlib

    ords = np.arange(200_000)
    keys = order_keys(7, np.zeros(len(ords), int), ords)
    assert len(np.unique(keys)) == len(ords)
    pieces = np.concatenate([order_keys(7, np.zeros(e - s, int), np.arange(s, e)) for s, e in
                             [(0, 3), (3, 70_001), (70_001, 200_000)]])
    assert np.array_equal(keys, pieces)
    assert not np.array_equal(keys, order_keys(8, np.zeros(len(ords), int), ords))
    assert not np.array_equal(keys, order_keys(7, np.ones(len(ords), int), ords))
    # the rule written out in plain Python integers (docs/exports.md)
    mask = (1 << 64) - 1
    state = int.from_bytes(hashlib.blake2b(b"streamprep-parquet-order:7:0", digest_size=8).digest(), "little")
    for i in (0, 1, 12345, 199_999):
        z = (state + (i + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        assert int(keys[i]) == z ^ (z >> 31)


@pytest.mark.slow
def test_same_seed_byte_identical_other_seed_differs(run, tmp_path):
    run_dir, refs = run
    export(run_dir, refs, seed=1)
    first = file_hashes(run_dir)
    assert len([k for k in first if k.endswith(".parquet")]) >= 15
    export(run_dir, refs, seed=1)  # re-run in place: same bytes
    assert file_hashes(run_dir) == first
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    shutil.rmtree(other / "parquet")
    (other / "manifest.json").unlink()
    export(other, relocate(refs, run_dir, other), seed=1)  # another run dir: same bytes too
    assert file_hashes(other) == first
    export(other, relocate(refs, run_dir, other), seed=2)
    order1 = [(run_dir / e["tsv"]["path"]).read_text() for e in parquet_entries(run_dir)]
    order2 = [(other / e["tsv"]["path"]).read_text() for e in parquet_entries(other)]
    assert order1 != order2
    shas1 = sorted(ln.split("\t")[3] for t in order1 for ln in t.splitlines()[1:])
    shas2 = sorted(ln.split("\t")[3] for t in order2 for ln in t.splitlines()[1:])
    assert shas1 == shas2  # same records, other order / shard membership


@pytest.mark.slow
def test_tsv_beside_each_shard(run):
    run_dir, refs = run
    export(run_dir, refs)
    for entry in parquet_entries(run_dir):
        lines = (run_dir / entry["tsv"]["path"]).read_text().splitlines()
        assert lines[0] == "row\tn_tokens\ttoken_sum\ttext_sha256"
        for i, (line, r) in enumerate(zip(lines[1:], rows(run_dir, entry), strict=True)):
            assert line.split("\t") == [str(i), str(r["n_tokens"]), str(sum(r["tokens"])),
                                        hashlib.sha256(r["text"].encode()).hexdigest()]


@pytest.mark.slow
def test_manifest_lists_parquet_and_binidx(run):
    run_dir, refs = run
    summary = export(run_dir, refs)
    man = atomic.read_json(run_dir / "manifest.json")
    assert man["format"] == "streamprep-manifest" and man["version"] == 1 and man["seed"] == 1234
    assert man["tokenizer"] == TOKENIZER_INFO and man["config_hash"] == "cfghash0123"
    assert set(man["writer"]) == {"streamprep", "pyarrow"}
    ids = [s["shard_id"] for s in man["shards"]]
    assert ids == sorted(ids) and len(ids) == len(set(ids))
    binidx = [s for s in man["shards"] if s["kind"] == "binidx"]
    assert len(binidx) == summary["binidx_shards"] == sum(r.prefix is not None for r in refs) == 6
    for s in binidx:
        assert s["bucket"] is None and set(s["files"]) == {"bin", "idx"}
        for f in s["files"].values():
            assert atomic.sha256_file(run_dir / f["path"]) == f["file_sha256"]
            assert (run_dir / f["path"]).stat().st_size == f["size_bytes"]
        assert (run_dir / (s["path"] + ".bin")).is_file()
    assert "binidx/lingua/part-00002" not in ids  # the shard with 0 documents is not listed
    for s in parquet_entries(run_dir):
        assert {"shard_id", "path", "num_records", "num_tokens", "bucket", "source", "split", "file_sha256",
                "size_bytes", "seed", "tsv"} <= set(s)
        assert atomic.sha256_file(run_dir / s["path"]) == s["file_sha256"]
        assert s["split"] == {"c4": "train", "lingua": "train", "dclm": "valid"}[s["source"]]
    for name in ("c4", "lingua", "dclm"):
        pq_tokens = sum(s["num_tokens"] for s in man["shards"] if s["source"] == name and s["kind"] == "parquet")
        bin_tokens = sum(s["num_tokens"] for s in binidx if s["source"] == name)
        assert pq_tokens == bin_tokens == summary["tokens"][name]
    assert b"time" not in (run_dir / "manifest.json").read_bytes()


@pytest.mark.slow
def test_num_shards_multiple_of(run):
    run_dir, refs = run
    export(run_dir, refs)
    base = {split: sum(1 for e in parquet_entries(run_dir) if e["split"] == split) for split in ("train", "valid")}
    summary = export(run_dir, refs, num_shards_multiple_of=4)
    entries = parquet_entries(run_dir)
    for split in ("train", "valid"):
        n = sum(1 for e in entries if e["split"] == split)
        assert n % 4 == 0 and n >= base[split]
    assert summary["parquet_shards_by_split"]["train"] % 4 == 0
    assert all(e["num_records"] > 0 and e["num_tokens"] > 0 for e in entries)
    seen = [orjson.loads(r["meta"])["source"]["index"] for e in entries if e["source"] == "dclm" for r in rows(run_dir, e)]
    assert sorted(seen) == list(range(60))
    # old shard names that the new layout does not use were removed
    listed = {e["path"] for e in entries} | {e["tsv"]["path"] for e in entries}
    assert {f"parquet/{p.name}" for p in (run_dir / "parquet").iterdir()} == listed


@pytest.mark.slow
def test_num_shards_multiple_of_too_few_records(run):
    run_dir, refs = run
    with pytest.raises(ShardCountError, match=r"num_shards_multiple_of.*'valid' has 60 record"):
        export(run_dir, refs, num_shards_multiple_of=64)


@pytest.mark.slow
def test_restart_removes_stale_shards(run):
    run_dir, refs = run
    export(run_dir, refs, shard_size_bytes=4096)
    many = len(parquet_entries(run_dir))
    (run_dir / "parquet" / ".shard_b00_s00000.parquet.streamprep-tmp.999").write_bytes(b"partial")
    summary = export(run_dir, refs)
    entries = parquet_entries(run_dir)
    assert len(entries) < many and summary["stale_removed"] > 0
    listed = {e["path"] for e in entries} | {e["tsv"]["path"] for e in entries}
    assert {f"parquet/{p.name}" for p in (run_dir / "parquet").iterdir()} == listed


@pytest.mark.slow
def test_mixtures_default_and_phases(run):
    run_dir, refs = run
    export(run_dir, refs)
    mix = atomic.read_json(run_dir / "mixtures.json")
    assert mix["format"] == "streamprep-mixtures"
    assert [p["name"] for p in mix["phases"]] == ["default"]
    assert mix["phases"][0]["weights"] == pytest.approx({"c4": 2 / 3, "lingua": 1 / 3})  # train datasets
    man_ids = {e["shard_id"]: e["source"] for e in parquet_entries(run_dir)}
    for name, src in mix["sources"].items():
        assert sorted(src["shards"]) == sorted(i for i, s in man_ids.items() if s == name)
    phases = {"warmup": {"c4": 3, "lingua": 1}, "final": {"c4": 1, "lingua": 1, "dclm": 2}}
    export(run_dir, refs, mixtures={"phases": phases})
    mix = atomic.read_json(run_dir / "mixtures.json")
    assert [p["name"] for p in mix["phases"]] == ["warmup", "final"]
    assert mix["phases"][0]["weights"] == {"c4": 0.75, "lingua": 0.25}
    assert mix["phases"][1]["weights"] == {"c4": 0.25, "lingua": 0.25, "dclm": 0.5}
    assert mix["phases"][1]["sources"]["dclm"]["shards"] == mix["sources"]["dclm"]["shards"]
    for p in mix["phases"]:
        assert sum(p["weights"].values()) == pytest.approx(1.0)


def test_mixtures_unknown_dataset_named():
    with pytest.raises(MixtureConfigError) as exc:
        validate_mixtures({"p1": {"c4": 1.0, "nope": 2.0}}, ["c4", "wiki"])
    msg = str(exc.value)
    assert "output.mixtures.phases.p1.nope" in msg and "\n" not in msg
    assert isinstance(exc.value, ValueError) and exc.value.key == "output.mixtures.phases.p1.nope"
    for bad in (0, -1.0, float("nan"), float("inf"), "1", True, None):
        with pytest.raises(MixtureConfigError, match=r"phases\.p\.c4"):
            validate_mixtures({"p": {"c4": bad}}, ["c4"])
    # regression: YAML reads an unquoted 1e+15 as a string, and "got '1e+15'" read as a number in range
    with pytest.raises(MixtureConfigError, match=r"weight must be a number in \[1e-15, 1e\+15\], got str '1e\+15'$"):
        validate_mixtures({"p": {"c4": "1e+15"}}, ["c4"])


def test_weights_too_small_for_the_exports_are_refused():
    """Regression: a weight of 5e-324 beside 1e15 passed (it is > 0) and was written as weight 0 in blend.json and
    mixtures.json. Weights are at least 1e-15 now, and the smallest beside the largest keeps a share > 0."""
    from streamprep.exports import blend, mixtures

    with pytest.raises(MixtureConfigError, match=r"^'output\.mixtures\.phases\.p\.a': weight must be a number in "
                                                 r"\[1e-15, 1e\+15\], got 5e-324$"):
        validate_mixtures({"p": {"a": 5e-324, "b": 1e15}}, ["a", "b"])
    validate_mixtures({"p": {"a": 1e-15, "b": 1e15}}, ["a", "b"])
    weights = {"a": 1e-15, "b": 1e15}
    shards = [{"kind": "parquet", "shard_id": f"b00_s{i:05d}", "source": n, "num_records": 1, "num_tokens": t}
              for i, (n, t) in enumerate([("a", 1), ("a", 2**53), ("b", 5)])]
    for phases in ({}, {"p": weights}):  # the default phase (dataset weights) and one of the config's
        assert 0 < mixtures.build(shards, weights, phases, {"a": "train", "b": "train"})["phases"][0]["weights"]["a"] < 1e-29
    out = blend.build([{"dataset": s["source"], "split": "train", "prefix": s["shard_id"], "num_tokens": s["num_tokens"]}
                       for s in shards], weights, 0.0, False)
    assert [float(w) > 0 for w in out["train"][::2]] == [True] * 3


def test_a_mixture_phase_with_no_data_is_said_in_the_log(tmp_path: Path) -> None:
    """Regression: a phase none of whose datasets kept a record was written with empty weights without a word."""
    from types import SimpleNamespace

    from structlog.testing import capture_logs

    from streamprep.exports import mixtures

    ctx = SimpleNamespace(run_dir=tmp_path, parquet=[], binidx=[], sft={}, weights={"a": 1.0, "b": 1.0},
                          split_of={"a": "train", "b": "train"},
                          output=SimpleNamespace(mixtures=SimpleNamespace(phases={"p": {"a": 1.0, "b": 2.0}})))
    with capture_logs() as logged:
        assert mixtures.export(ctx) == ["mixtures.json"]
    assert [(e["event"], e["phase"], e["datasets"]) for e in logged] == [
        ("mixture phase has no data: none of its datasets kept a record", "p", ["a", "b"])]
    assert atomic.read_json(tmp_path / "mixtures.json")["phases"][0]["weights"] == {}
    with pytest.raises(MixtureConfigError, match=r"phases\.empty"):
        validate_mixtures({"empty": {}}, ["c4"])
    validate_mixtures({}, ["c4"])
    validate_mixtures({"a": {"c4": 1}, "b": {"c4": 0.5}}, ["c4"])


@pytest.mark.slow
def test_compression_and_row_groups(run):
    run_dir, refs = run
    export(run_dir, refs, compression="zstd", row_group_size=3)
    entry = max(parquet_entries(run_dir), key=lambda e: e["num_records"])
    md = pq.ParquetFile(run_dir / entry["path"]).metadata
    assert md.num_row_groups == -(-entry["num_records"] // 3)
    assert md.row_group(0).column(0).compression == "ZSTD"


@pytest.mark.slow
def test_parquet_statistics_only_for_the_numeric_columns(run):
    """Min/max statistics of `text` and `meta` were whole documents in the footer and page headers: c4's shards were
    1.14x their estimate in total (some 1.9x); only `tokens` and `n_tokens` keep theirs."""
    run_dir, refs = run
    export(run_dir, refs)
    c4 = [e for e in parquet_entries(run_dir) if e["source"] == "c4"]
    for entry in c4:
        md = pq.ParquetFile(run_dir / entry["path"]).metadata
        for g in range(md.num_row_groups):
            stats = {md.row_group(g).column(i).path_in_schema: md.row_group(g).column(i).statistics
                     for i in range(md.num_columns)}
            assert stats["text"] is None and stats["meta"] is None, entry["shard_id"]
            assert stats["n_tokens"].has_min_max and stats["tokens.list.element"].has_min_max, entry["shard_id"]
    assert sum(e["size_bytes"] for e in c4) <= sum(e["est_bytes"] for e in c4)


def test_mixtures_leave_out_empty_sources():
    from streamprep.exports import mixtures

    shards = [{"kind": "parquet", "shard_id": "b00_s00000", "source": "a", "num_records": 3, "num_tokens": 9}]
    mix = mixtures.build(shards, {"a": 1.0, "b": 3.0}, {}, {"a": "train", "b": "train"})
    assert mix["phases"][0]["weights"] == {"a": 1.0} and mix["phases"][0]["empty_sources"] == ["b"]
    assert mix["sources"]["b"] == {"split": "train", "shards": [], "binidx": [], "num_records": 0, "num_tokens": 0}


def test_a_skipped_optional_dataset_in_a_phase_is_an_empty_source():
    """Regression: a phase naming an optional dataset skipped for want of input (not among the sources) failed; it
    is listed under the phase's `empty_sources`, as a dataset that kept nothing is."""
    from streamprep.exports import mixtures

    shards = [{"kind": "parquet", "shard_id": "b00_s00000", "source": "a", "num_records": 3, "num_tokens": 9}]
    mix = mixtures.build(shards, {"a": 1.0}, {"p1": {"gone": 2.0, "a": 1.0}}, {"a": "train"})
    assert mix["phases"] == [{"name": "p1", "weights": {"a": 1.0}, "config_weights": {"gone": 2.0, "a": 1.0},
                              "empty_sources": ["gone"], "sources": {"a": {"weight": 1.0, "shards": ["b00_s00000"]}}}]
    assert list(mix["sources"]) == ["a"]
    validate_mixtures({"p1": {"gone": 2.0, "a": 1.0}}, ["a"], skipped=["gone"])
    with pytest.raises(MixtureConfigError, match=r"'output\.mixtures\.phases\.p1\.nope': unknown dataset 'nope'"):
        validate_mixtures({"p1": {"nope": 2.0, "a": 1.0}}, ["a"], skipped=["gone"])


# -- per-part summaries: cached beside the receipts, reused, recomputed when damaged; parallel == serial --
def summary_files(run: Path) -> dict[str, bytes]:
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted((run / "receipts").rglob("*.summary"))}


def counting_summarize(monkeypatch) -> list[str]:
    """Patch summarize_part to record which parts it computes."""
    from streamprep.exports import summary

    calls: list[str] = []
    real = summary.summarize_part

    def spy(ref, scan=None):
        calls.append(f"{ref.dataset}/{ref.part}")
        return real(ref, scan)
    monkeypatch.setattr(summary, "summarize_part", spy)
    return calls


@pytest.mark.slow
def test_part_summaries_cached_and_reused(run, monkeypatch):
    run_dir, refs = run
    calls = counting_summarize(monkeypatch)
    export(run_dir, refs)
    first, caches = file_hashes(run_dir), summary_files(run_dir)
    with_docs = sorted(f"receipts/{r.dataset}/{r.part}.summary" for r in refs if r.prefix is not None)
    assert sorted(caches) == with_docs and len(calls) == len(with_docs) == 6  # none for the part with 0 documents
    calls.clear()
    export(run_dir, refs)  # a resumed exports step: every summary comes from its cache
    assert calls == [] and file_hashes(run_dir) == first and summary_files(run_dir) == caches


def prepared_task(run_dir: Path, r: ShardRef, first: int | None, seed: int = 1234, buckets=BUCKETS):
    """The ShardTask fields `prepare_part` reads, as the pipeline sets them (`first`: lines of the parts before)."""
    from types import SimpleNamespace

    from streamprep.layout import RunLayout

    return SimpleNamespace(dataset=r.dataset, split=r.split, part=r.part, input_path=str(r.ingest_path),
                           prefix=str(r.prefix or f"{run_dir}/binidx/{r.dataset}/{r.part}_text_document"),
                           receipt_path=str(r.receipt_path), sft=None, run_dir=str(run_dir), first_ordinal=first,
                           order_seed=seed, length_buckets=tuple(buckets),
                           columns_path=RunLayout(run_dir).part_columns(r.dataset, r.part))


def line_ordinals(refs: list[ShardRef]) -> dict[str, int]:
    """dataset/part -> the lines of its dataset's parts before it: the first ordinal the pipeline gives a task."""
    out, lines = {}, {}
    for r in sorted(refs, key=lambda r: (r.dataset, r.part)):
        out[f"{r.dataset}/{r.part}"] = lines.get(r.dataset, 0)
        lines[r.dataset] = out[f"{r.dataset}/{r.part}"] + len(r.ingest_path.read_bytes().splitlines())
    return out


def counting_runs(monkeypatch) -> list[str]:
    """Patch encode_run to record which parts' runs are made."""
    from streamprep.exports import order

    calls: list[str] = []
    real = order.encode_run

    def spy(ref, *args):
        calls.append(f"{ref.dataset}/{ref.part}")
        return real(ref, *args)
    monkeypatch.setattr(order, "encode_run", spy)
    return calls


@pytest.mark.slow
def test_prepare_part_ahead_of_exports(run, tmp_path, monkeypatch):
    """Each part's summary and sorted run made as its shard finishes: the exports only merge and write, with the
    bytes of exports that made everything themselves. A run made with a first ordinal the receipts contradict
    (c4's part-00002: part-00001 dropped 2 empty records) is remade."""
    from streamprep.exports import prepare_part
    from streamprep.exports.order import run_path

    run_dir, refs = run
    clean = tmp_path / "clean"
    shutil.copytree(run_dir, clean)
    export(clean, relocate(refs, run_dir, clean))
    firsts = line_ordinals(refs)
    for r in refs:  # as each shard finishes: a ShardTask and its receipt
        prepare_part(prepared_task(run_dir, r, firsts[f"{r.dataset}/{r.part}"]), r.receipt)
    assert len(summary_files(run_dir)) == 6
    assert sorted(p.name for p in (run_dir / "parquet" / ".order").rglob("*")) == sorted(
        ["c4", "lingua", "dclm"] + [run_path(run_dir, r.dataset, r.part).name for r in refs if r.prefix is not None])
    calls, runs = counting_summarize(monkeypatch), counting_runs(monkeypatch)
    export(run_dir, refs)
    assert calls == [] and runs == ["c4/part-00002"]
    assert file_hashes(run_dir) == file_hashes(clean)
    assert not (run_dir / "parquet" / ".order").exists()


@pytest.mark.slow
def test_parquet_columns_cut_from_the_columns_files_the_tokenizing_left(run, tmp_path, monkeypatch):
    """Parts whose tokenizing left their columns files (`textshard.LineScan(columns=)`) give the Parquet bytes of
    parts parsed again, without parsing a line; the files are scratch, removed with the rest of the exports'."""
    from streamprep.exports.index import RecordReader
    from streamprep.layout import RunLayout
    from streamprep.textshard import LineScan, columns_file, columns_header

    run_dir, refs = run
    clean = tmp_path / "clean"
    shutil.copytree(run_dir, clean)
    export(clean, relocate(refs, run_dir, clean))
    columned = []
    for r in refs:
        path = RunLayout(run_dir).part_columns(r.dataset, r.part)
        dropped = set(r.receipt["stats"]["dropped_empty"])
        key = (r.receipt["input_sha256"], r.receipt["plan_hash"])
        lines = r.ingest_path.read_bytes().splitlines(keepends=True)
        with columns_file(path, columns_header(r.dataset, r.part, *key)) as out:
            LineScan(out).add(lines, [orjson.loads(line) for line in lines], [i in dropped for i in range(len(lines))])
        columned.append(replace(r, columns=path))
    monkeypatch.setattr(RecordReader, "_parse", lambda *a: pytest.fail("a line was parsed"))
    export(run_dir, columned)
    assert file_hashes(run_dir) == file_hashes(clean)
    assert not (run_dir / "parquet" / ".order").exists()


@pytest.mark.slow
def test_parquet_columns_from_the_run_ordered_files_the_tokenizing_left(run, tmp_path, monkeypatch):
    """Parts whose tokenizing kept their texts and metas (`LineScan(keep=True)`, as for parts of at most
    RUN_COLUMNS_BYTES) leave a columns file in their run's order (format 2): the Parquet rows come from it, with the
    bytes of parts parsed again. c4/part-00002's run is remade by the exports (part-00001 dropped 2 empty records),
    so its file, made for the other order, is not used: only its lines are parsed."""
    from streamprep.exports import prepare_part
    from streamprep.exports.index import RecordReader
    from streamprep.textshard import LineScan

    run_dir, refs = run
    clean = tmp_path / "clean"
    shutil.copytree(run_dir, clean)
    export(clean, relocate(refs, run_dir, clean))
    firsts = line_ordinals(refs)
    for r in refs:  # as each shard finishes: its task, its receipt and the lines its tokenizing parsed
        lines = r.ingest_path.read_bytes().splitlines(keepends=True)
        dropped = set(r.receipt["stats"]["dropped_empty"])
        scan = LineScan(keep=True)
        scan.add(lines, [orjson.loads(line) for line in lines], [i in dropped for i in range(len(lines))])
        prepare_part(prepared_task(run_dir, r, firsts[f"{r.dataset}/{r.part}"]), r.receipt, scan)
    made = sorted(run_dir.glob("parquet/.order/*/*.columns"))
    assert len(made) == 6 and all(b'"version":2' in p.read_bytes().split(b"\n", 1)[0] for p in made)
    parsed: list[str] = []
    real_parse = RecordReader._parse

    def spy(self, ids):
        parsed.extend({f"{self.index.refs[p].dataset}/{self.index.refs[p].part}" for p in self.index.part[ids]})
        return real_parse(self, ids)
    monkeypatch.setattr(RecordReader, "_parse", spy)
    monkeypatch.setattr(RecordReader, "_cut", lambda *a: pytest.fail("no part has a format-1 file"))
    export(run_dir, [replace(r, columns=run_dir / "parquet" / ".order" / r.dataset / f"{r.part}.columns")
                     for r in refs])
    assert set(parsed) == {"c4/part-00002"}
    assert file_hashes(run_dir) == file_hashes(clean)
    assert not (run_dir / "parquet" / ".order").exists()


@pytest.mark.slow
def test_prepared_runs_reused_only_when_current(run, tmp_path, monkeypatch):
    """A prepared run is remade (same output bytes) when it was made for another seed or bucket bounds, when it is
    damaged, truncated or torn, or when its part's summary is not the one it was made from; runs of an earlier
    attempt (merge files, runs) left in the scratch folder are reused or ignored."""
    from streamprep.exports import prepare_part, summary
    from streamprep.exports.order import run_path

    run_dir, refs = run
    clean = tmp_path / "clean"
    shutil.copytree(run_dir, clean)
    export(clean, relocate(refs, run_dir, clean))
    firsts = line_ordinals(refs)
    full = [r for r in refs if r.prefix is not None]
    assert [f"{r.dataset}/{r.part}" for r in full] == ["c4/part-00000", "c4/part-00001", "c4/part-00002",
                                                        "lingua/part-00000", "lingua/part-00001", "dclm/part-00000"]
    for r, seed, buckets in zip(full, [99, 1234, 1234, 1234, 1234, 1234], [BUCKETS] * 3 + [BUCKETS[:-1]] + [BUCKETS] * 2):
        prepare_part(prepared_task(run_dir, r, firsts[f"{r.dataset}/{r.part}"], seed, buckets), r.receipt)
    c4_1 = run_path(run_dir, "c4", "part-00001")
    raw = c4_1.read_bytes()
    c4_1.write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))                       # one flipped bit
    lingua_1 = run_path(run_dir, "lingua", "part-00001")
    lingua_1.write_bytes(lingua_1.read_bytes()[:-8])                        # truncated
    summary.cache_path(full[-1]).write_bytes(b"stale\n")                   # dclm's summary: not the run's any more
    (run_dir / "parquet" / ".order" / "c4" / "b3.order").write_bytes(b"an earlier attempt's merge")
    calls, runs = counting_summarize(monkeypatch), counting_runs(monkeypatch)
    export(run_dir, refs)
    # c4/part-00000: another seed; part-00002: another first ordinal; lingua/part-00000: other bounds
    assert sorted(runs) == sorted(f"{r.dataset}/{r.part}" for r in full) and calls == ["dclm/part-00000"]
    assert file_hashes(run_dir) == file_hashes(clean)
    assert not (run_dir / "parquet" / ".order").exists()
    runs.clear()
    for r in full:  # all current now (the ordinals from the receipts): nothing is remade
        first = firsts[f"{r.dataset}/{r.part}"] - (2 if r.part == "part-00002" else 0) * (r.dataset == "c4")
        prepare_part(prepared_task(run_dir, r, first), r.receipt)
    export(run_dir, refs)
    assert runs == [f"{r.dataset}/{r.part}" for r in full]  # each made once, by prepare_part
    assert file_hashes(run_dir) == file_hashes(clean)


@pytest.mark.slow
def test_damaged_or_stale_summary_recomputed(run, monkeypatch):
    run_dir, refs = run
    export(run_dir, refs)
    first, caches = file_hashes(run_dir), summary_files(run_dir)
    paths = [run_dir / k for k in caches]
    raw = paths[0].read_bytes()
    paths[0].write_bytes(raw[:-1] + bytes([raw[-1] ^ 1]))         # one flipped bit in the payload
    paths[1].write_bytes(paths[1].read_bytes()[:100])             # truncated
    paths[2].write_bytes(b"not json\n" + paths[2].read_bytes())  # garbage header
    head, _, payload = paths[3].read_bytes().partition(b"\n")   # made for another receipt
    paths[3].write_bytes(head.replace(b'"key":"', b'"key":"0') + b"\n" + payload)
    calls = counting_summarize(monkeypatch)
    export(run_dir, refs)
    assert sorted(calls) == sorted(f"{p.parent.name}/{p.stem}" for p in paths[:4])
    assert file_hashes(run_dir) == first and summary_files(run_dir) == caches  # rewritten to the same bytes


@pytest.mark.slow
def test_parallel_equals_serial(run, tmp_path):
    run_dir, refs = run
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    export(run_dir, refs, num_shards_multiple_of=4)
    export(other, relocate(refs, run_dir, other), workers=2, num_shards_multiple_of=4)  # summaries on the pool too
    assert file_hashes(other) == file_hashes(run_dir)
    assert summary_files(other) == summary_files(run_dir)
    assert len([k for k in file_hashes(run_dir) if k.endswith(".parquet")]) >= 16


@pytest.mark.slow
def test_parquet_written_without_importing_pandas(run, tmp_path):
    """Regression: `pa.array(list)` imported pandas in every export worker (~0.3 s each, at the end of the job).
    The string columns are now built from buffers; same rows, and pandas stays out of the process."""
    import pickle
    import subprocess
    import sys

    run_dir, refs = run
    job = tmp_path / "job.pkl"
    job.write_bytes(pickle.dumps((run_dir, refs)))
    code = ("import pickle, sys; sys.path.insert(0, sys.argv[1]); import export_run as t; "
            "run, refs = pickle.loads(open(sys.argv[2], 'rb').read()); assert 'pandas' not in sys.modules; "
            "t.export(run, refs); print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(REPO / "tests"), str(job)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == "False"  # the last line: logs go to stdout too
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    for f in (other / "parquet").glob("*"):
        f.unlink()
    export(other, relocate(refs, run_dir, other))
    assert file_hashes(other) == file_hashes(run_dir)


def test_utf8_column_equals_pyarrow_conversion():
    import pyarrow as pa

    from streamprep.exports.parquet import _utf8

    values = ["", "plain", "naïve café — “quoted”", "日本語\n\ttab", "\x00nul", "😀" * 3]
    encoded = [v.encode() for v in values]
    built = _utf8(b"".join(encoded), np.array([len(v) for v in encoded]))
    assert built.equals(pa.array(values, type=pa.string()))
    assert built.to_pylist() == values
    with pytest.raises(ExportError, match="add up to"):
        _utf8(b"".join(encoded), np.array([len(v) for v in encoded[:-1]]))


@pytest.mark.slow
def test_warmed_pool_started_before_exports_same_bytes(run, tmp_path):
    """The job warms the exports' pool while its last shards are tokenized: its processes exist before the
    first task, and exports on it write the bytes a serial run writes."""
    import time

    from streamprep.executor import LocalExecutor

    run_dir, refs = run
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    export(run_dir, refs)
    with LocalExecutor(2) as pool:
        pool.warm()
        deadline = time.monotonic() + 30
        while len(pool.processes) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(pool.processes) == 2
        write_exports(other, relocate(refs, run_dir, other), output_cfg(), datasets_cfg(), 1234, TOKENIZER_INFO,
                      "cfghash0123", workers=pool)
    assert file_hashes(other) == file_hashes(run_dir)


@pytest.mark.slow
def test_job_process_holds_no_summary_and_no_record_array(run, monkeypatch):
    """The job process loads part summaries only inside a part's task (in this process with 1 worker: one at a
    time, none left when the shards are written) and keeps per part a few numbers (no array per record)."""
    import gc

    from streamprep.exports import order, parquet
    from streamprep.exports.summary import PartSummary

    run_dir, refs = run
    alive_in_build: list[int] = []
    held: list[int] = []
    make_run, write_shards = order.make_run, parquet.write_shards

    def alive() -> int:
        gc.collect()
        return sum(type(o) is PartSummary for o in gc.get_objects())

    def counting_make_run(job):
        out = make_run(job)
        alive_in_build.append(alive())
        return out

    def measuring_write(run_dir, indexes, plans, *args, **kw):
        plans = list(plans)  # the plan as the writers get it, shard by shard, all at once here
        held.append(alive())
        held.append(sum(v.nbytes for idx in indexes for v in vars(idx).values() if isinstance(v, np.ndarray)))
        held.append(sum(r.offsets.nbytes for idx in indexes for r in idx.runs))
        assert not any(isinstance(v, np.ndarray) for p in plans for v in vars(p).values())  # key ranges only
        return write_shards(run_dir, indexes, plans, *args, **kw)

    monkeypatch.setattr(order, "make_run", counting_make_run)
    monkeypatch.setattr(parquet, "write_shards", measuring_write)
    out = export(run_dir, refs)
    n_parts = out["binidx_shards"]
    assert len(alive_in_build) == n_parts == 6 and max(alive_in_build) == 0
    assert held == [0, 8 * (2 * n_parts + len(DATASETS)), 8 * (len(BUCKETS) + 2) * n_parts]
    assert out["parquet_shards"] == len(list((run_dir / "parquet").glob("*.parquet"))) > 0
    assert not (run_dir / "parquet" / ".order").exists()  # the runs are scratch of the exports step


def ordinals(want: dict) -> dict[tuple[str, int], int]:
    """(dataset, source index) -> the record's ordinal in its dataset: kept records in ingest order."""
    out: dict[tuple[str, int], int] = {}
    for name in {k[0] for k in want}:
        for i, key in enumerate(sorted(k for k in want if k[0] == name)):
            out[key] = i
    return out


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1234, 99])
def test_rows_in_keyed_order_and_every_bucket_complete(run, seed):
    """Each (dataset, bucket) holds exactly its records, and its shards, in index order, list them in the order
    of `order_keys(seed, bucket, ordinal)`: a key range a shard, ascending inside it."""
    run_dir, refs = run
    export(run_dir, refs, seed=seed)
    want = expected_records(run_dir, refs)
    ordinal = ordinals(want)
    got: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for entry in sorted(parquet_entries(run_dir), key=lambda e: e["shard_id"]):
        for r in rows(run_dir, entry):
            meta = orjson.loads(r["meta"])
            got.setdefault((entry["source"], entry["bucket"]), []).append(
                (meta["source"]["index"], int(entry["shard_id"][-5:])))
    buckets = {k: int(bucket_of(np.array([len(v[1])]), BUCKETS)[0]) for k, v in want.items()}
    assert sorted(got) == sorted({(k[0], b) for k, b in buckets.items()})
    for (name, b), items in got.items():
        assert sorted(i for i, _ in items) == sorted(k[1] for k, bb in buckets.items() if k[0] == name and bb == b)
        ords = np.array([ordinal[(name, i)] for i, _ in items])
        keys = order_keys(seed, np.full(len(ords), b), ords)
        assert np.all(keys[1:] > keys[:-1]), (name, b)  # rows of the shards in index order: ascending keys


@pytest.mark.slow
def test_small_merge_buffers_same_bytes(run, tmp_path, monkeypatch):
    """The merge's bounded buffers (a few records a part here, many rounds) and its merge of parts in groups
    through scratch files (2 at a time here) give the bytes of one big round."""
    from streamprep.exports import order

    run_dir, refs = run
    other = tmp_path / "other"
    shutil.copytree(run_dir, other)
    export(run_dir, refs, num_shards_multiple_of=4)
    monkeypatch.setattr(order, "MERGE_BYTES", 0)
    monkeypatch.setattr(order, "MIN_CHUNK", 3)
    monkeypatch.setattr(order, "FAN_IN", 2)
    spilled = []
    spill = order._spill
    monkeypatch.setattr(order, "_spill", lambda sources, path: spilled.append(path) or spill(sources, path))
    export(other, relocate(refs, run_dir, other), num_shards_multiple_of=4)
    assert file_hashes(other) == file_hashes(run_dir)
    assert len({p.parent for p in spilled}) >= 5  # c4's 3 parts were merged in 2 groups first, bucket by bucket
    assert not (other / "parquet" / ".order").exists()


@pytest.mark.slow
def test_interrupted_exports_resume_to_the_same_bytes(run, tmp_path, monkeypatch):
    """Exports stopped after some shards were written (runs and shards of the attempt left behind) and run again:
    the bytes of an uninterrupted run, and no scratch left."""
    from streamprep.exports import parquet

    run_dir, refs = run
    clean = tmp_path / "clean"
    shutil.copytree(run_dir, clean)
    export(clean, relocate(refs, run_dir, clean), workers=2)
    write_one, done = parquet._write_one, []

    def dying(job):
        if len(done) == 5:
            raise KeyboardInterrupt
        done.append(job[1].shard_id)
        return write_one(job)
    monkeypatch.setattr(parquet, "_write_one", dying)
    monkeypatch.setattr("streamprep.exports.order.remove_scratch", lambda run_dir, keep_runs=False: None)  # a kill
    with pytest.raises(KeyboardInterrupt):
        export(run_dir, refs)
    assert len(list((run_dir / "parquet").glob("*.parquet"))) == 5 and (run_dir / "parquet" / ".order").is_dir()
    assert not (run_dir / "manifest.json").exists()
    monkeypatch.undo()
    export(run_dir, refs)
    assert file_hashes(run_dir) == file_hashes(clean)
    assert not (run_dir / "parquet" / ".order").exists()


@pytest.mark.slow
def test_shard_rows_read_back_from_the_summaries(run):
    """A shard's rows, in any order and from any parts, equal the full summaries' rows; a job carries the parts
    its rows lie in, not every part of the dataset; a summary changed after its run was made is an error."""
    from streamprep.exports import summary
    from streamprep.exports.order import build_indexes
    from streamprep.executor import LocalExecutor

    run_dir, refs = run
    with LocalExecutor(1) as pool:
        indexes = build_indexes([(n, s, [r for r in refs if r.dataset == n]) for n, s, *_ in DATASETS], pool,
                                1234, BUCKETS, BYTES_PER_TOKEN, run_dir)
    idx = indexes[0]
    assert idx.name == "c4" and len(idx) == 298 and idx.num_tokens == sum(
        r.receipt["stats"]["num_tokens"] for r in refs if r.dataset == "c4")
    full = [summary.summarize_part(r).records for r in idx.refs]
    rng = np.random.default_rng(7)
    part = rng.integers(0, len(idx.refs), 150)
    row = np.array([rng.integers(0, len(full[p])) for p in part])
    got = summary.shard_records(idx.rows_of(part, row))
    for k in ("line", "line_offset", "line_bytes", "token_start", "n_tokens", "token_sum", "text_sha256", "text_bytes",
              "meta_bytes"):
        assert np.array_equal(getattr(got, k), np.stack([full[p][r][k] for p, r in zip(part, row)])), k
    assert [got.refs[p].part for p in got.part] == [idx.refs[p].part for p in part]
    one_part = idx.rows_of(np.full(5, len(idx.refs) - 1), np.arange(5)[::-1])
    assert [r.part for r in one_part.refs] == [idx.refs[-1].part] and len(idx.refs) > 1
    assert np.array_equal(summary.shard_records(one_part).line, full[-1]["line"][:5][::-1])

    victim = summary.cache_path(idx.refs[-1])
    payload = victim.read_bytes().partition(b"\n")[2]
    victim.write_bytes(summary.encode(summary.PartSummary("uint16", np.load(io.BytesIO(payload))[:3]), {}))
    with pytest.raises(ExportError, match=str(victim)):
        summary.shard_records(idx.rows_of(np.array([len(idx.refs) - 1]), np.array([len(full[-1]) - 1])))


def test_tsv_rows_equal_the_per_row_format():
    """The Arrow-formatted TSV lines equal one f-string per row, for any numbers and a row range of a shard."""
    from streamprep.exports.parquet import _tsv_rows

    rng = np.random.default_rng(3)
    n = 1000
    index = ShardRecords(refs=[], dtypes=[], part=np.zeros(n, np.int32), row=np.zeros(n, np.int64),
                         line=np.zeros(n, np.int64),
                         line_offset=np.zeros(n, np.int64), line_bytes=np.zeros(n, np.int64),
                         token_start=np.zeros(n, np.int64), n_tokens=rng.integers(1, 1 << 31, n),
                         token_sum=np.r_[0, 9, rng.integers(0, 1 << 62, n - 2)],
                         text_sha256=rng.integers(0, 256, (n, 32), dtype=np.uint8),
                         text_bytes=np.zeros(n, np.int64), meta_bytes=np.zeros(n, np.int64),
                         column_offset=np.zeros(n, np.int64))
    for start, end in ((0, n), (17, 18), (500, 1000)):
        assert _tsv_rows(index, start, end) == "".join(
            f"{i}\t{index.n_tokens[i]}\t{index.token_sum[i]}\t{index.text_sha256[i].tobytes().hex()}\n"
            for i in range(start, end)).encode()


@pytest.mark.parametrize(("fraction", "split"), [(0.05, "95,5,0"), (0.001, "99.9,0.1,0"), (0.5, "50,50,0"),
                                                 (1e-7, "99.99999,0.00001,0"), (1e-9, "99.9999999,0.0000001,0")])
def test_blend_split_is_exact_and_read_by_megatrons_pattern(fraction: float, split: str) -> None:
    """Regression: the split was printed with `:g` after rounding to 6 decimals: 1e-7 gave "100,1e-05,0", which
    Megatron's `re.findall(r"[.0-9]+", split)` reads as four numbers (its assert fails), 1e-9 gave "100,0,0"."""
    import re

    from streamprep.exports.blend import build

    shards = [{"dataset": "c4", "split": "train", "prefix": "/r/binidx/c4/part-00000_text_document", "num_tokens": 9}]
    blend = build(shards, {"c4": 1.0}, fraction, per_split=False)
    assert blend == {"data_paths": ["1", "/r/binidx/c4/part-00000_text_document"], "split": split}
    train, valid, test = map(float, re.findall(r"[.0-9]+", blend["split"]))
    assert test == 0 and valid / (train + valid) == pytest.approx(fraction, rel=1e-12)
    # regression: with no record kept the list was [], which Megatron's get_blend_from_list refuses (formats.md:
    # an empty split is null, never [])
    assert build([{**shards[0], "num_tokens": 0}], {"c4": 1.0}, fraction, per_split=False) == \
        {"data_paths": None, "split": split}


def test_a_shard_megatrons_split_leaves_without_train_or_valid_is_said_in_the_log(tmp_path: Path) -> None:
    """Regression: with `valid_fraction` 0.05, a dataset's last part of 10 records was listed in data_paths without
    a word; Megatron cuts it at round(0.95 × 10) = 10, and megatron-core's GPTDataset then looped forever over a
    valid piece of 0 tokens (the trainer hung building its datasets). The shards named are Megatron's own."""
    from types import SimpleNamespace

    from structlog.testing import capture_logs

    from streamprep.exports import blend

    def ref(part: int, docs: int) -> SimpleNamespace:
        return SimpleNamespace(dataset="c4", split="train", part=f"part-{part:05d}", prefix=tmp_path / f"p{part}",
                               receipt={"stats": {"num_documents": docs, "num_tokens": docs + 1}})

    ctx = SimpleNamespace(blend=True, run_dir=tmp_path, shards=[ref(0, 100), ref(1, 10)], weights={"c4": 1.0},
                          split_of={"c4": "train"}, output=SimpleNamespace(valid_fraction=0.05))
    with capture_logs() as logged:
        assert blend.export(ctx) == ["blend.json"]
    assert [(e["event"][:40], e["shards"], e["count"]) for e in logged] == [
        ("blend.json: Megatron's split gives these", ["binidx/c4/part-00001"], 1)]
    ctx.output.valid_fraction = 0.1  # round(0.9 × 10) = 9: a valid sequence
    with capture_logs() as logged:
        blend.export(ctx)
    assert logged == []
    config = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_config")
    refs = [ref(n, n) for n in range(1, 60)]
    for fraction in (0.05, 0.5, 0.3, 0.999):
        split = blend.split_percents(fraction)
        named = set(blend.unsplit_shards(refs, split))
        matrix = config.convert_split_vector_to_split_matrix(config.parse_and_normalize_split(split))
        empty = {f"binidx/c4/part-{n:05d}" for n in range(1, 60)
                 if any(round(hi * n) <= round(lo * n) for lo, hi in matrix[:2])}
        assert named == empty and empty, (fraction, sorted(empty))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["order", "parquet", "parquet_open", "tsv"])
def test_a_full_disk_in_the_exports_names_the_file(run, monkeypatch, where):
    """Regression: a full disk writing a bucket's order file (a raw os.pwrite) or a Parquet shard (pyarrow's
    "[Errno 28] Error writing bytes to file") raised an OSError naming no file: the job's line said "no space left on
    the disk" without where."""
    import errno
    import os

    from streamprep.exports import order

    def full(*args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    # regression (parquet_open, tsv): the writer's opening and the TSV's closing flush raised outside the naming, and
    # the writer's opening left the shard's temporary files behind
    if where == "order":
        monkeypatch.setattr(order.os, "pwrite", full)
    elif where == "parquet":
        monkeypatch.setattr(pq.ParquetWriter, "write_table", full)
    elif where == "parquet_open":
        monkeypatch.setattr(pq, "ParquetWriter", full)
    else:  # the TSV's closing flush
        import io

        from streamprep.exports import parquet as parquet_mod

        class FullTsv(io.BytesIO):
            def __exit__(self, *exc: object) -> None:
                raise OSError(errno.ENOSPC, "No space left on device")

        real_open = open
        monkeypatch.setattr(parquet_mod, "open", lambda path, *a, **kw: FullTsv() if atomic.is_tmp_name(Path(
            path).name) and ".tsv" in Path(path).name else real_open(path, *a, **kw), raising=False)
    run_dir, refs = run
    with pytest.raises(OSError) as err:
        export(run_dir, refs)
    name = Path(err.value.filename)
    assert err.value.errno == errno.ENOSPC and name.parent.is_relative_to(run_dir / "parquet")
    assert (name.name.startswith("b") and name.suffix == ".order") if where == "order" else (
        name.name.startswith("shard_") and name.suffix == (".tsv" if where == "tsv" else ".parquet"))
    assert not atomic.is_tmp_name(name.name) and not os.path.exists(atomic.tmp_path(name))
    shard = name.with_suffix(".parquet")  # its shard's own temporary files are gone (others a resume sweeps)
    assert not os.path.exists(atomic.tmp_path(shard)) and not os.path.exists(atomic.tmp_path(shard.with_suffix(".tsv")))


@pytest.mark.slow
def test_a_parquet_folder_it_may_not_write_in_names_the_shard(run, monkeypatch):
    """Regression: a read-only parquet/ failed in pyarrow with "Failed to open local file '….parquet.streamprep-tmp.
    NNN'. Detail: [errno 13] Permission denied", naming only the temporary file. The temporary file is now made by
    Python first: a PermissionError naming the shard. (Simulated: root writes through permission bits.)"""
    import errno

    run_dir, refs = run
    nofollow = atomic.nofollow

    def opener(path: str, flags: int) -> int:
        if Path(path).parent == run_dir / "parquet" and Path(path).name.startswith(".shard_"):
            raise PermissionError(errno.EACCES, "Permission denied", path)
        return nofollow(path, flags)
    monkeypatch.setattr(atomic, "nofollow", opener)
    with pytest.raises(PermissionError) as err:
        export(run_dir, refs)
    name = Path(err.value.filename)
    assert name.parent == run_dir / "parquet" and name.name.startswith("shard_") and name.suffix == ".parquet"
