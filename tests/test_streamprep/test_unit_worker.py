"""unit_worker.numbered: a piece's kept lines numbered in one pass, byte for byte what a `replace` per row gives."""
from __future__ import annotations

import numpy as np
import orjson

from streamprep.unit_worker import SENTINEL_INDEX, _SENTINEL, numbered


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
