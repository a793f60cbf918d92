"""unit_worker.numbered: a piece's kept lines numbered in one pass, byte for byte what a `replace` per row gives."""
from __future__ import annotations

import numpy as np
import orjson
import pytest

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


def test_no_kept_rows_is_an_empty_piece_and_a_row_without_its_sentinel_is_refused():
    lines, offsets = numbered([], [])
    assert lines == b"" and offsets.tolist() == [0]
    with pytest.raises(ValueError, match="0 ordinal sentinels in 1 kept lines"):
        numbered([b'{"text":"x"}\n'], [0])
