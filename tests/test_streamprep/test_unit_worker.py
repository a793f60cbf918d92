"""unit_worker: a piece's kept lines numbered in one pass (byte for byte what a `replace` per row gives), its summary,
and the driver-only benchmark's stand-in for the worker calls."""
from __future__ import annotations

import dataclasses

import numpy as np
import orjson
import pytest

from helpers import base_config
from streamprep.unit_worker import BAD, KEPT, REJECTED, SENTINEL_INDEX, _SENTINEL, numbered


def _row(text: str, **extra: object) -> bytes:
    meta = {"chars": len(text), "source": {"dataset": "web", "index": SENTINEL_INDEX, **extra}}
    return orjson.dumps({"text": text, "meta": meta}, option=orjson.OPT_APPEND_NEWLINE)


def test_numbered_lines_equal_a_replace_per_row_and_their_offsets_are_the_lines():
    hostile = f'a text quoting its own sentinel: "index":{SENTINEL_INDEX}, and again "index":{SENTINEL_INDEX}'
    rows = [_row("plain"), _row(hostile, url=f'http://x/"index":{SENTINEL_INDEX}'), _row("é ünïcode"), _row("")]
    ordinals = [0, 7, 123456789012, 3]
    lines, offsets = numbered(rows, ordinals)
    expected = [row.replace(_SENTINEL, b'"index":%d' % n, 1) for row, n in zip(rows, ordinals)]
    assert lines == b"".join(expected)
    assert offsets.tolist() == np.cumsum([0] + [len(line) for line in expected]).tolist()
    parsed = [orjson.loads(line) for line in lines.splitlines()]
    assert [p["meta"]["source"]["index"] for p in parsed] == ordinals
    assert parsed[1]["text"] == hostile and parsed[1]["meta"]["source"]["url"].endswith(str(SENTINEL_INDEX))


def test_an_sft_record_spelling_the_sentinel_after_the_meta_keeps_it_and_the_meta_is_numbered():
    """An SFT kept row carries the record itself after the meta: a field `index` of the sentinel's value there is
    the record's own data, left as it is (the first occurrence, the meta's, is numbered, as before)."""
    meta = {"source": {"dataset": "chat", "index": SENTINEL_INDEX}}
    sft = orjson.dumps({"text": "hi", "meta": meta, "record": {"index": SENTINEL_INDEX}}) + b"\n"
    rows, ordinals = [_row("plain"), sft, _row("last")], [4, 5, 6]
    lines, offsets = numbered(rows, ordinals)
    expected = [row.replace(_SENTINEL, b'"index":%d' % n, 1) for row, n in zip(rows, ordinals)]
    assert lines == b"".join(expected)
    assert offsets.tolist() == np.cumsum([0] + [len(line) for line in expected]).tolist()
    parsed = orjson.loads(expected[1])
    assert parsed["meta"]["source"]["index"] == 5 and parsed["record"]["index"] == SENTINEL_INDEX


def test_no_kept_rows_is_an_empty_piece():
    lines, offsets = numbered([], [])
    assert lines == b"" and offsets.tolist() == [0]


def test_a_piece_summary_takes_all_kept_batches_whole_and_the_others_item_by_item(tmp_path):
    """judge_piece's summary: a batch whose items were all read and kept is taken as its columns; a batch with an
    unreadable line or a reject goes item by item. Same kinds, digests, kept sizes and checks in item order."""
    import hashlib

    from streamprep import config, unit_worker
    from streamprep.modes import PRETRAIN
    from streamprep.units import Unit

    lines = [b'{"text": "alpha one"}', b'{"text": "beta two"}', b'{"text": "gamma"}', b"{not json",
             b'{"text": "delta four"}', b'{"text": ""}']
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cfg = base_config([{"name": "web", "path": str(path)}], None)
    cfg["quality"] = {"dedup": "none", "expected_language": None, "min_chars": 1, "normalize": False,
                      "pii_max_density": 1.0, "profanity_max_density": 1.0, "reject_copyright": False}
    quality = config.load(cfg).quality
    unit_worker.init_worker(quality, PRETRAIN)
    unit = Unit("range", 0, str(path), "jsonl", 0, path.stat().st_size)
    s = unit_worker.judge_piece("web", "text", 2, str(tmp_path / "u0"), unit)  # batches of 2: kept, mixed, mixed
    assert s.kinds == bytes([KEPT, KEPT, KEPT, BAD, KEPT, REJECTED])
    texts = [b"alpha one", b"beta two", b"gamma", b"delta four", b""]
    assert s.digests == b"".join(hashlib.sha256(t).digest() for t in texts[:4]) + bytes(32)  # NO_DIGEST: no text
    assert s.digest_list() == [hashlib.sha256(t).digest() for t in texts[:4]] + [None]
    assert s.text_bytes.dtype == np.int64 and s.text_bytes.tolist() == [9, 8, 5, 10]
    assert len(s.checks) == 2 and s.checks[1] == "schema"
    assert s.order is None  # no exact dedup: nothing for the decider to sort
    unit_worker.init_worker(dataclasses.replace(quality, dedup="exact"), PRETRAIN)
    exact = unit_worker.judge_piece("web", "text", 2, str(tmp_path / "u1"), unit)
    keys = np.frombuffer(exact.digests, np.uint64)[::4]  # each digest's first 8 bytes, the index's prefix
    assert exact.order.dtype == np.uint32 and exact.order.tolist() == np.argsort(keys, kind="stable").tolist()


@pytest.mark.parametrize("normalize", [True, False])
def test_kept_sizes_are_the_utf8_bytes_of_the_kept_text(tmp_path, normalize):
    """A kept text's size is its UTF-8 bytes: with `normalize: true` the normalised text's (as normalisation counted
    them when it hashed it), else the raw text's."""
    from streamprep import config, unit_worker
    from streamprep.modes import PRETRAIN
    from streamprep.units import Unit
    from quality.normalize import normalize_text

    texts = ["caf\u00e9  au  lait", "na\u00efve \u201cquotes\u201d \u2014 dash",
             "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac  text", "plain ascii", "emoji \U0001f600  here",
             "e\u0301 composed"]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts))
    cfg = base_config([{"name": "web", "path": str(path)}], None)
    cfg["quality"] = {"dedup": "none", "expected_language": None, "min_chars": 1, "normalize": normalize,
                      "pii_max_density": 1.0, "profanity_max_density": 1.0, "reject_copyright": False}
    unit_worker.init_worker(config.load(cfg).quality, PRETRAIN)
    unit = Unit("range", 0, str(path), "jsonl", 0, path.stat().st_size)
    s = unit_worker.judge_piece("web", "text", 4, str(tmp_path / "u0"), unit)
    kept = [normalize_text(t) for t in texts] if normalize else texts
    assert kept != texts or not normalize  # normalisation changed some: the sizes below tell the two apart
    assert s.kinds == bytes([KEPT] * len(texts))
    assert s.text_bytes.tolist() == [len(t.encode("utf-8")) for t in kept]

@pytest.mark.slow
def test_the_driver_only_benchmark_fakes_the_worker_calls_the_driver_makes(tmp_path):
    """Regression: judge_piece gained an argument (`ahead`, the hf prefetch) and benchmarks/bench_driver_only.py's
    fake worker, which stands in for it, failed every call with a TypeError; nothing ran the benchmark to see it."""
    import subprocess
    import sys

    from helpers import REPO

    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_driver_only.py"), "--units", "20", "40",
                           "--records", "10", "--slope-records", "40"], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.split()[:2] in (["20", "10"], ["40", "10"])]
    assert len(rows) == 2 and all(int(row[3].replace(",", "")) > 0 for row in rows)  # units/hour, both sizes


def test_an_sft_record_holding_values_json_cannot_hold_is_kept_without_them():
    """Regression: an `sft:` kept row carries the record, and a Parquet `binary` or `decimal128` column's value
    (bytes, Decimal) stopped the job and its resume (`TypeError: Type is not JSON serializable: bytes`). Such a value
    is left out, as pretraining leaves out every column but the text; a record without one is written as before."""
    from datetime import timedelta
    from decimal import Decimal

    from streamprep import unit_worker
    from streamprep.sft.config import load_sft_config
    from streamprep.sft.mode import SftMode

    mode = SftMode(load_sft_config({"input": {"sections": [{"field": "prompt", "action": "mask"},
                                                           {"field": "answer", "action": "train"}]}}))
    unit_worker.init_worker({"dedup": "none", "expected_language": None, "min_chars": 1, "reject_copyright": False},
                            mode)
    plain = {"id": "p", "prompt": "What is two plus two?", "answer": "It is four.", "n": 1.5}
    odd = {**plain, "id": "o", "blob": b"\x00\x01binary", "price": Decimal("1.25"), "tags": [b"a", "b"],
           "extra": {"wait": timedelta(days=1), "tag": "x"}, "turns": [{"raw": b"y", "k": 1}]}
    cols, _, _ = unit_worker._judge("chat", "text", [plain, odd])
    assert cols.keep == [True, True]
    text = "What is two plus two?\n\nIt is four."
    meta = {**cols.meta[0], "source": {"dataset": "chat", "index": SENTINEL_INDEX, "id": "p"}}
    assert cols.row[0] == orjson.dumps({"text": text, "meta": meta, "record": plain}, option=orjson.OPT_APPEND_NEWLINE)
    written = orjson.loads(cols.row[1])
    assert written["text"] == text and written["meta"]["source"]["id"] == "o"
    assert written["record"] == {**plain, "id": "o", "extra": {"tag": "x"}, "turns": [{"k": 1}]}


def test_a_whole_file_unit_whose_file_vanished_says_so_once(tmp_path):
    """Regression: the reader's SourceError was wrapped in another naming the same file: 'cannot read input file
    F: SourceError: cannot read input file F after record 0: FileNotFoundError...'. It is raised as it is."""
    from streamprep.sources.base import SourceError
    from streamprep.unit_worker import _read
    from streamprep.units import Unit

    gone = tmp_path / "b.jsonl.gz"
    with pytest.raises(SourceError) as err:
        _read(Unit("file", 1, str(gone), "jsonl"), None)
    assert str(err.value).startswith(f"cannot read input file {gone} after record 0: FileNotFoundError")
    assert str(err.value).count("cannot read input file") == 1


def test_a_reject_holding_a_lone_surrogate_is_written_with_it_escaped(tmp_path):
    """Regression: a plug-in reader's `json.loads` gives a lone surrogate for a `"\\ud800"` escape; the schema gate
    rejects such a text, but its reject line (the text's excerpt; an id of another reject) stopped the job, every
    run: `TypeError: str is not valid UTF-8: surrogates not allowed`. The line is written with the surrogate
    escaped, the reject counted; a line without one is the same bytes as before. An id past 64 bits (`json.loads`
    gives one too) stopped it likewise: it is left out of `source`, as an id of another type is."""
    from streamprep import unit_worker
    from streamprep.modes import PRETRAIN
    from streamprep.unit_worker import Decision, finalize_piece, judge_piece

    unit_worker.init_worker({"dedup": "none", "expected_language": None, "min_chars": 20, "normalize": False,
                             "pii_max_density": 1.0, "profanity_max_density": 1.0, "reject_copyright": False},
                            PRETRAIN)
    long = "An ordinary sentence, long enough to keep."
    items = [{"text": long}, {"text": long + "\ud800"}, {"text": "short", "id": "b\udc00"}, {"text": "tiny", "id": "c"},
             {"text": "small", "id": 2**64}]
    stage = str(tmp_path / "piece")
    assert judge_piece("d", "text", 4, stage, None, items=items).kinds == bytes([KEPT] + [REJECTED] * 4)
    rejects, st, _ = finalize_piece("d", stage, Decision(5, 0, None, bytes([1, 0, 0, 0, 0]), {}, {},
                                                         frozenset({1, 2, 3, 4})))
    lines = rejects.splitlines()
    assert [orjson.loads(line)["reason"] for line in lines] == [
        f"schema: text has an unpaired surrogate at char {len(long)}", "schema: 5 chars < min_chars 20",
        "schema: 4 chars < min_chars 20", "schema: 5 chars < min_chars 20"]
    assert orjson.loads(lines[0])["text"] == long + "\\ud800"
    assert orjson.loads(lines[1])["source"] == {"dataset": "d", "index": 2, "id": "b\\udc00"}
    assert lines[2] == orjson.dumps({"failed_check": "schema", "meta": orjson.loads(lines[2])["meta"],
                                     "reason": "schema: 4 chars < min_chars 20",
                                     "source": {"dataset": "d", "id": "c", "index": 3}, "text": "tiny"})
    assert orjson.loads(lines[3])["source"] == {"dataset": "d", "index": 4}
    assert st["rejects_by_check"] == {"schema": 4}


def test_a_kept_record_s_id_or_url_holding_a_lone_surrogate_is_written_escaped():
    """Regression: a lone surrogate in a kept record's `id` or `url` (a plug-in reader's `json.loads` of
    `"\\ud800"`) was escaped in reject lines but dropped from the kept row: its `source` was just the dataset and
    index. It is written escaped, as a reject line writes it; in an `sft:` row the record's column too."""
    from streamprep import unit_worker
    from streamprep.modes import PRETRAIN
    from streamprep.sft.config import load_sft_config
    from streamprep.sft.mode import SftMode

    unit_worker.init_worker({"dedup": "none", "expected_language": None, "min_chars": 1}, PRETRAIN)
    cols, _, _ = unit_worker._judge("d", "text", [{"text": "kept one", "id": "\ud800id5", "url": "http://x/\udc00/1"}])
    assert cols.keep == [True]
    assert orjson.loads(cols.row[0])["meta"]["source"] == {"dataset": "d", "index": SENTINEL_INDEX,
                                                           "id": "\\ud800id5", "url": "http://x/\\udc00/1"}
    mode = SftMode(load_sft_config({"input": {"sections": [{"field": "prompt", "action": "mask"},
                                                           {"field": "answer", "action": "train"}]}}))
    unit_worker.init_worker({"dedup": "none", "expected_language": None, "min_chars": 1, "reject_copyright": False},
                            mode)
    record = {"id": "s\udc00", "prompt": "What is two plus two?", "answer": "It is four."}
    cols, _, _ = unit_worker._judge("chat", "text", [record])
    written = orjson.loads(cols.row[0])
    assert cols.keep == [True] and written["meta"]["source"]["id"] == "s\\udc00"
    assert written["record"] == {**record, "id": "s\\udc00"}


def test_a_plugin_bad_record_with_a_lone_surrogate_is_one_counted_reject_escaped(tmp_path):
    """Regression: a reader's BadRecord whose reason and raw excerpt hold lone surrogates stopped the job at its
    reject line; it is one reject under its own check, the surrogates escaped."""
    from streamprep import unit_worker
    from streamprep.modes import PRETRAIN
    from streamprep.sources.base import BadRecord
    from streamprep.unit_worker import BAD, Decision, finalize_piece, judge_piece

    unit_worker.init_worker({"dedup": "none", "expected_language": None, "min_chars": 1}, PRETRAIN)
    stage = str(tmp_path / "piece")
    items = [BadRecord("line 1 \ud800", "raw \udc00", check="toy"), {"text": "kept"}]
    assert judge_piece("d", "text", 4, stage, None, items=items).kinds == bytes([BAD, KEPT])
    rejects, st, _ = finalize_piece("d", stage, Decision(2, 0, None, bytes([0, 1]), {}, {}, frozenset({0})))
    line = orjson.loads(rejects)
    assert (line["failed_check"], line["reason"], line["text"]) == ("toy", "line 1 \\ud800", "raw \\udc00")
    assert st["rejects_by_check"] == {"toy": 1}
