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


def test_gates_that_reject_nothing_are_listed_in_the_chains_order() -> None:
    """Ties were broken by name: with no gate rejecting, the audit listed copyright, language, length, normalize,
    pii, profanity, schema."""
    from quality import load_quality_settings
    from quality.gates import build_gates

    for domain, extra in (("general", {}), ("medical", {}), ("code", {})):
        settings = load_quality_settings({"domain": domain, "required_metadata": ["source"], **extra})
        names = [g.name for g in build_gates(settings, "text")]
        assert names == [n for n in stats.CHAIN_ORDER if n in names]  # the constant follows the chain
    names = [*stats.CHAIN_ORDER[:8], "my_plugin_gate", "near_dedup_signature"]
    st = {"gate_seen": {n: 10 for n in sorted(names)}, "gate_rejected": {}, "gate_us": {}}
    assert [row["gate"] for row in stats.gate_table(st)] == names
    st["gate_seen"].update(copyright=10, language=10, my_plugin_gate=7, near_dedup_signature=7)
    st["gate_rejected"] = {"language": 3}  # a tie broken by the rejects first: the gate that rejects ran last
    assert [row["gate"] for row in stats.gate_table(st)][6:] == ["copyright", "language", "my_plugin_gate",
                                                                  "near_dedup_signature"]
