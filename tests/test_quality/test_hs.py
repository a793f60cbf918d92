"""quality.hs: the positional scan and its module-level match handlers report what a keyword scan does."""
from __future__ import annotations

import threading

from quality import hs


def test_scan_marks_each_pattern_found_and_appends_every_match_end():
    db = hs.database([b"ab", b"  ", b"x+y"])
    found = [False, False, False]
    hs.scan(db, b"cab  d", hs.flag_match, found)
    assert found == [True, True, False]
    ends: list[tuple[int, int]] = []
    hs.scan(db, b"ab ab xy x+y", hs.append_match, ends)
    assert sorted(ends) == [(0, 2), (0, 5), (2, 8)]  # pattern 2 is a regex: one or more "x", then "y"
    ends.clear()
    hs.scan(db, b"xxy", hs.append_match, ends)
    assert ends == [(2, 3)]


def test_each_thread_scans_with_its_own_scratch():
    db = hs.database([b"needle"])
    mine = hs.scratch(db)
    assert hs.scratch(db) is mine
    other: list = []
    thread = threading.Thread(target=lambda: other.append(hs.scratch(db)))
    thread.start()
    thread.join()
    assert other[0] is not mine
    hits: list[tuple[int, int]] = []
    thread = threading.Thread(target=hs.scan, args=(db, b"a needle here", hs.append_match, hits))
    thread.start()
    thread.join()
    assert hits == [(0, 8)]
