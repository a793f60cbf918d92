"""RecordReader and the summary fields it relies on, over small hand-made parts: the columns and tokens it
gathers in bulk equal, byte for byte, what parsing each record on its own gives."""
from __future__ import annotations

import io
import json
import os
import resource
from dataclasses import replace
from pathlib import Path

import numpy as np
import orjson
import pytest

from streamprep.exports import columns, summary
from streamprep.exports.index import (ExportError, RecordReader, ShardRecords, ShardRef, canonical_meta,
                                     open_files_budget)
from streamprep.textshard import LineScan, columns_header


def _nested(depth: int) -> dict:
    meta: dict = {}
    for _ in range(depth):
        meta = {"a": meta}
    return meta


RECORDS = [  # (line bytes, tokens): orjson lines as ingest writes them, and lines other writers make
    (orjson.dumps({"text": "plain", "meta": {"z": 1, "a": [1.5, None], "m": {"y": "é", "b": True}}}), [5, 6, 7]),
    (orjson.dumps({"text": "naïve \"quoted\"\n\ttab \\ 😀", "meta": {"b": 2, "a": 1}}), [1, 2]),
    (json.dumps({"meta": {"k": "v", "c": "\u2028"}, "text": "caf\u00e9 ascii-escaped"}).encode(), [9]),
    (orjson.dumps({"text": "no meta"}), [3, 3, 3, 3]),
    (orjson.dumps({"text": "null meta", "meta": None}), [4]),
    (b'{"text":"deep meta","meta":' + orjson.dumps(_nested(253)) + b"}", [8, 8]),  # dumped alone, not in a list
    (b'{ "text" : "spaced", "extra": [1, 2], "meta" : {"b": [], "a": {}} }', [2, 4, 6]),
]


def _part(tmp: Path, name: str, records: list[tuple[bytes, list[int]]], dtype: str) -> tuple[ShardRef, np.ndarray]:
    """One part's ingest lines and `.bin`; its summary's rows computed the way `summarize_part` does."""
    ingest = tmp / f"{name}.jsonl"
    ingest.write_bytes(b"".join(line + b"\n" for line, _ in records))
    counts = np.array([len(t) for _, t in records])
    (tmp / f"{name}.bin").write_bytes(np.concatenate([np.array(t, dtype=dtype) for _, t in records]).tobytes())
    ref = ShardRef("d", "train", name, ingest, tmp / name, {}, tmp / f"{name}.json")
    lengths, digests, text_bytes, meta_bytes = summary._scan_ingest(ref, set())
    rec = np.zeros(len(records), dtype=summary.RECORD)
    rec["line"] = np.arange(len(records))
    rec["line_offset"], rec["line_bytes"] = np.cumsum(lengths) - lengths, lengths
    rec["token_start"], rec["n_tokens"] = np.cumsum(counts) - counts, counts
    rec["text_sha256"] = np.frombuffer(digests, dtype=np.uint8).reshape(-1, 32)
    rec["text_bytes"], rec["meta_bytes"] = text_bytes, meta_bytes
    rec["column_offset"] = np.cumsum(text_bytes + meta_bytes) - (text_bytes + meta_bytes)
    return ref, rec


def _with_columns(ref: ShardRef, key: tuple[str, str] = ("in", "plan")) -> ShardRef:
    """`ref` with the columns file its tokenizing would write (`LineScan(columns=)`), made for receipt `key`."""
    path = ref.ingest_path.with_suffix(".columns")
    with open(path, "wb") as fh:
        fh.write(columns_header(ref.dataset, ref.part, *key))
        lines = ref.ingest_path.read_bytes().splitlines(keepends=True)
        LineScan(fh).add(lines, [orjson.loads(line) for line in lines], [False] * len(lines))
    return replace(ref, columns=path, receipt={"input_sha256": "in", "plan_hash": "plan"})


def _shard(tmp: Path, picks: list[tuple[int, int]]) -> tuple[ShardRecords, list[tuple[dict, list[int]]]]:
    """A shard of (part, row) picks over two parts (token dtypes differ), and each pick's record and tokens."""
    parts = [_part(tmp, "p0", RECORDS, "uint16"), _part(tmp, "p1", RECORDS[::-1], "int32")]
    sources = [RECORDS, RECORDS[::-1]]
    rows = np.stack([parts[p][1][r] for p, r in picks])
    index = ShardRecords(refs=[ref for ref, _ in parts], dtypes=[np.dtype("uint16"), np.dtype("int32")],
                         part=np.array([p for p, _ in picks], dtype=np.int32), row=np.array([r for _, r in picks]),
                         **{k: rows[k] for k in ("line", "line_offset", "line_bytes", "token_start", "n_tokens",
                                                 "token_sum", "text_sha256", "text_bytes", "meta_bytes",
                                                 "column_offset")})
    return index, [(orjson.loads(sources[p][r][0]), sources[p][r][1]) for p, r in picks]


def test_scan_ingest_lengths_of_text_and_canonical_meta(tmp_path):
    ref, rec = _part(tmp_path, "p0", RECORDS, "uint16")
    parsed = [orjson.loads(line) for line, _ in RECORDS]
    assert rec["text_bytes"].tolist() == [len(r["text"].encode()) for r in parsed]
    assert rec["meta_bytes"].tolist() == [len(canonical_meta(r)) for r in parsed]
    assert canonical_meta(parsed[0]) == b'{"a":[1.5,null],"m":{"b":true,"y":"\xc3\xa9"},"z":1}'
    assert canonical_meta(parsed[3]) == b"{}" and canonical_meta(parsed[4]) == b"null"


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_token_sums_equal_each_records_own_sum_across_chunks(tmp_path, monkeypatch, dtype):
    """Per-record sums of the `.bin` read in chunks (one longer than a chunk, records cut at chunk ends) equal
    each record's tokens summed alone, in int64 however large the ids."""
    monkeypatch.setattr(summary, "TOKEN_CHUNK", 100)
    rng = np.random.default_rng(3)
    counts = np.r_[rng.integers(1, 40, 50), 350, rng.integers(1, 3, 30)].astype(np.int64)
    top = np.iinfo(dtype).max
    tokens = rng.integers(top - 5, top, int(counts.sum()), endpoint=True).astype(dtype)
    (tmp_path / "p.bin").write_bytes(tokens.tobytes())
    starts = np.cumsum(counts) - counts
    got = summary._token_sums(tmp_path / "p.bin", np.dtype(dtype), starts, counts)
    assert got.tolist() == [int(tokens[s:s + n].astype(np.int64).sum()) for s, n in zip(starts, counts)]
    assert got.dtype == np.int64 and (dtype == "uint16" or int(got.max()) > np.iinfo(np.int32).max)


@pytest.mark.parametrize("picks", [
    [(1, 3), (0, 0), (0, 6), (1, 0), (0, 2), (1, 6), (0, 1), (1, 2), (0, 4), (1, 5), (0, 3)],  # deep meta absent
    [(0, 5), (1, 1), (0, 1), (0, 5)],                                                           # deep meta, twice
])
def test_columns_and_tokens_equal_each_record_parsed_alone(tmp_path, picks):
    index, expected = _shard(tmp_path, picks)
    ids = np.arange(len(picks))
    with RecordReader(index, max_open=1) as reader:  # every part switch reopens a file
        texts, metas = reader.columns(ids)
        tokens = reader.tokens(ids)
        assert reader.columns(ids[::-1]) == (b"".join(r["text"].encode() for r, _ in expected[::-1]),
                                             b"".join(canonical_meta(r) for r, _ in expected[::-1]))
    assert texts == b"".join(r["text"].encode() for r, _ in expected)
    assert metas == b"".join(canonical_meta(r) for r, _ in expected)
    assert tokens.dtype == np.int32 and tokens.tolist() == [t for _, toks in expected for t in toks]


def test_columns_refuse_lines_unlike_their_summary(tmp_path):
    index, _ = _shard(tmp_path, [(0, 0), (0, 1)])
    ingest = index.refs[0].ingest_path
    data = ingest.read_bytes()
    ingest.write_bytes(data.replace(b'"plain"', b'"plaiN"'))  # same length, still valid: the hash is not reread
    with RecordReader(index) as reader:
        assert reader.columns(np.arange(2))[0].startswith(b"plaiN")
    ingest.write_bytes(data.replace(b'"plain"', b'"plainer"', 1))  # lengths differ: lines cut wrong, or texts
    with RecordReader(index) as reader, pytest.raises(ExportError, match=r"p0\.jsonl: line 1 is not a record"):
        reader.columns(np.arange(2))
    ingest.write_bytes(data.replace(b'"z":1', b'"z":10', 1).replace(b'"plain"', b'"plai"', 1))
    with RecordReader(index) as reader, pytest.raises(ExportError, match="do not match their part summaries"):
        reader.columns(np.arange(1))
    ingest.write_bytes(data[:20])
    with RecordReader(index) as reader, pytest.raises(ExportError, match=r"p0\.jsonl: shorter than"):
        reader.columns(np.arange(2))
    Path(f"{index.refs[0].prefix}.bin").write_bytes(b"\0" * 4)
    with RecordReader(index) as reader, pytest.raises(ExportError, match=r"p0\.bin: shorter than"):
        reader.tokens(np.arange(2))


def test_columns_are_cut_from_the_parts_columns_files_when_every_part_has_a_current_one(tmp_path):
    picks = [(1, 3), (0, 0), (0, 6), (1, 0), (0, 5), (1, 6), (0, 1), (1, 2), (0, 4), (1, 5), (0, 3)]
    index, expected = _shard(tmp_path, picks)
    want = (b"".join(r["text"].encode() for r, _ in expected), b"".join(canonical_meta(r) for r, _ in expected))
    lines = [ref.ingest_path.read_bytes() for ref in index.refs]
    columned = replace(index, refs=[_with_columns(ref) for ref in index.refs])
    for ref in index.refs:  # the lines are not read: texts of the same lengths but other letters
        ref.ingest_path.write_bytes(ref.ingest_path.read_bytes().replace(b"plain", b"PLAIN"))
    ids = np.arange(len(picks))
    with RecordReader(columned, max_open=1) as reader:
        assert reader.columns(ids) == want
        assert reader.columns(ids[::-1])[0] == b"".join(r["text"].encode() for r, _ in expected[::-1])
    # one part's file made for another input: that part's lines are parsed (here, the changed ones), the other
    # part's texts still come from its file
    stale = replace(columned, refs=[_with_columns(columned.refs[0], ("other", "plan")), columned.refs[1]])
    with RecordReader(stale) as reader:
        assert reader.columns(ids)[0] == b"".join(
            r["text"].replace("plain", "PLAIN" if p == 0 else "plain").encode() for (p, _), (r, _) in zip(picks, expected))
    for ref, data in zip(index.refs, lines):
        ref.ingest_path.write_bytes(data)
    missing = replace(columned, refs=[columned.refs[0], replace(columned.refs[1], columns=tmp_path / "none")])
    with RecordReader(missing) as reader:
        assert reader.columns(ids) == want
    _with_columns(index.refs[0])  # current again
    columns = columned.refs[1].columns
    columns.write_bytes(columns.read_bytes()[:-3])
    with RecordReader(columned) as reader, pytest.raises(ExportError, match=r"p1\.columns: shorter than"):
        reader.columns(ids)


def test_npy_header_of_cached_rows_read_once_per_layout(tmp_path):
    """The `.npy` header of a summary is parsed once per distinct header (row count), not once per read."""
    ref, rec = _part(tmp_path, "p0", RECORDS, "uint16")
    ref = ShardRef(ref.dataset, ref.split, ref.part, ref.ingest_path, ref.prefix, {"stats": {}}, ref.receipt_path)
    summary.cache_path(ref).write_bytes(summary.encode(summary.PartSummary("uint16", rec), ref.receipt))
    summary._npy_header.cache_clear()
    for rows in ([0], [6, 2], [3]):
        assert summary._cached_rows(ref, np.array(rows)).tobytes() == rec[rows].tobytes()
    assert summary._npy_header.cache_info().misses == 1 and summary._npy_header.cache_info().hits == 2
    buf = io.BytesIO()
    np.save(buf, np.zeros(2, dtype=summary.RECORD.descr[:-3]))  # a version 1 payload
    summary.cache_path(ref).write_bytes(b"{}\n" + buf.getvalue())
    with pytest.raises(ExportError, match="part summary changed"):
        summary._cached_rows(ref, np.array([0]))


@pytest.mark.parametrize("soft, budget", [(100, 32), (1024, 128), (20000, 1024), (resource.RLIM_INFINITY, 1024)])
def test_open_files_budget_follows_the_limit(monkeypatch, soft, budget):
    monkeypatch.setattr(resource, "getrlimit", lambda which: (soft, resource.RLIM_INFINITY))
    assert open_files_budget() == budget


def test_reader_keeps_its_files_open_across_row_groups(tmp_path, monkeypatch):
    """With a budget above the parts' files, a second row group over the same parts opens no file."""
    index, _ = _shard(tmp_path, [(1, 3), (0, 0), (1, 0), (0, 2)])
    opened: list[str] = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, flags: opened.append(str(path)) or real_open(path, flags))
    with RecordReader(index) as reader:
        for _ in range(2):
            reader.columns(np.arange(4))
            reader.tokens(np.arange(4))
    assert sorted(Path(p).name for p in opened) == ["p0.bin", "p0.jsonl", "p1.bin", "p1.jsonl"]


# -- format 2: a part's columns in its run's order (exports/columns.py) ----------------------------------------
RUNS = [np.array([3, 0, 6, 2, 5, 1, 4]), np.array([6, 5, 0, 1, 2, 3, 4])]  # per part: the `.idx` row at each position


def _with_run_columns(ref: ShardRef, rec: np.ndarray, order: np.ndarray, run: str = "run-sha") -> ShardRef:
    """`ref` with the format-2 columns file its tokenizing worker would write after the run `order`
    (`order.cache_run`), as a shard writer is sent it (the run's SHA-256 under "run")."""
    lines = ref.ingest_path.read_bytes().splitlines(keepends=True)
    scan = LineScan(keep=True)
    scan.add(lines, [orjson.loads(line) for line in lines], [False] * len(lines))
    path = ref.ingest_path.with_suffix(".columns")
    tokens = np.fromfile(f"{ref.prefix}.bin", dtype=np.uint16 if ref.part == "p0" else np.int32)
    columns.write(path, f"{ref.dataset}/{ref.part}", {"input_sha256": "in", "plan_hash": "plan"}, run, order,
                  scan.texts, scan.metas, tokens, rec)
    return replace(ref, columns=path, receipt={"input_sha256": "in", "plan_hash": "plan", "run": "run-sha"})


def _run_shard(tmp: Path, picks: list[tuple[int, int]]) -> tuple[ShardRecords, list[tuple[dict, list[int]]]]:
    """`_shard` of picks given as (part, position in that part's run), every part with a format-2 file."""
    index, expected = _shard(tmp, [(p, int(RUNS[p][pos])) for p, pos in picks])
    recs = [_part(tmp, "p0", RECORDS, "uint16")[1], _part(tmp, "p1", RECORDS[::-1], "int32")[1]]
    return replace(index, refs=[_with_run_columns(ref, rec, run) for ref, rec, run in zip(index.refs, recs, RUNS)]), \
        expected


def _counting_reads(monkeypatch) -> list[int]:
    sizes: list[int] = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: sizes.append(n) or real(fd, n, at))
    return sizes


def test_run_ordered_columns_read_a_range_per_part_and_row_group(tmp_path, monkeypatch):
    """A row group's records of each part are a range of that part's run, in run order (as a shard's rows always
    are): texts, metas and tokens come from the part's format-2 file with one read per part for each of them, plus
    its table row and line numbers, never from the ingest lines or the `.bin`."""
    picks = [(1, 0), (0, 0), (0, 1), (1, 1), (1, 2), (0, 2), (0, 3), (1, 3), (0, 4), (0, 5), (1, 4), (0, 6), (1, 5)]
    index, expected = _run_shard(tmp_path, picks)
    for ref in index.refs:  # neither is read: their bytes no longer match the summaries
        ref.ingest_path.write_bytes(b"")
        Path(f"{ref.prefix}.bin").write_bytes(b"")
    ids = np.arange(len(picks))
    reads = _counting_reads(monkeypatch)
    with RecordReader(index) as reader:
        texts, metas = reader.columns(ids)
        tokens = reader.tokens(ids)
    assert texts == b"".join(r["text"].encode() for r, _ in expected)
    assert metas == b"".join(canonical_meta(r) for r, _ in expected)
    assert tokens.dtype == np.int32 and tokens.tolist() == [t for _, toks in expected for t in toks]
    assert len(reads) == 2 * 6  # per part: its header, its first record's table row, line numbers, texts, metas, tokens


@pytest.mark.parametrize("picks", [
    [(1, 6), (0, 3), (0, 0), (1, 0), (0, 3), (1, 5)],  # out of run order, one record twice
    [(0, 1), (0, 0)],                                  # a range, backwards
    [(0, 0), (0, 2), (0, 1), (0, 3)],                  # the first and last of a range, the middle swapped
])
def test_run_ordered_columns_give_other_rows_too(tmp_path, picks):
    """Rows that are not ranges of the runs in run order (a reader given other rows) are read record by record
    from the same files, with the same bytes as parsing each record alone."""
    index, expected = _run_shard(tmp_path, picks)
    ids = np.arange(len(picks))
    with RecordReader(index) as reader:
        assert reader.columns(ids) == (b"".join(r["text"].encode() for r, _ in expected),
                                       b"".join(canonical_meta(r) for r, _ in expected))
        assert reader.tokens(ids).tolist() == [t for _, toks in expected for t in toks]


def test_run_ordered_columns_used_only_for_their_run(tmp_path):
    """A format-2 file made for another run (its order is another) is not read: that part's lines are parsed; a
    truncated one is refused by name."""
    picks = [(0, 0), (1, 5), (0, 1), (1, 6)]  # p1's last records: their tokens end its file
    index, expected = _run_shard(tmp_path, picks)
    other = replace(index.refs[0], receipt={**index.refs[0].receipt, "run": "another-run"})
    for ref in index.refs:
        ref.ingest_path.write_bytes(ref.ingest_path.read_bytes().replace(b"plain", b"PLAIN"))
    ids = np.arange(len(picks))
    with RecordReader(replace(index, refs=[other, index.refs[1]])) as reader:
        assert reader.columns(ids)[0] == b"".join(
            r["text"].replace("plain", "PLAIN" if p == 0 else "plain").encode() for (p, _), (r, _) in zip(picks, expected))
    path = index.refs[1].columns
    path.write_bytes(path.read_bytes()[:-3])
    with RecordReader(index) as reader, pytest.raises(ExportError, match=r"p1\.columns: shorter than"):
        reader.tokens(ids)
