"""stats.add_kept: a batch's kept records counted at once, the same dict (keys in the same order) as add_record
record by record."""
from __future__ import annotations

from streamprep import stats


def test_add_kept_equals_add_record_per_record_keys_in_the_same_order():
    chars = [0, 1, 5, 300, 2, 4096, 4095, 1, 70_000, 300, 3]
    metas = [{"language": "en", "pii_density": 0.25}, {}, {"profanity_density": 0.0}] + [{}] * 8
    batch: dict = {"chars_hist_kept": {"9": 4}}
    loop: dict = {"chars_hist_kept": {"9": 4}}
    stats.add_kept(batch, metas, chars)
    for meta, n in zip(metas, chars):
        stats.add_record(loop, True, meta, n)
    assert batch == loop
    assert list(batch["chars_hist_kept"]) == list(loop["chars_hist_kept"]) == ["9", "0", "1", "3", "2", "13", "12", "17"]
    empty: dict = {}
    stats.add_kept(empty, [], [])
    assert empty == {}
