"""SFT through the whole pipeline: ingest keeps the original record, the stage writes sequence + loss mask."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml

from streamprep import run_from_dict
from streamprep.binidx import IndexedDataset
from streamprep.verify import verify_run
from helpers import REPO



@pytest.mark.slow
def test_sft_chat_config_end_to_end(shared_data: Path, tmp_path: Path) -> None:
    raw = yaml.safe_load((REPO / "configs/sft_chat.yaml").read_text())
    raw["datasets"][0]["path"] = str(shared_data / "chat/glaive_toolcall_en_demo300.messages.jsonl")
    raw["tokenizer"]["path"] = str(shared_data / "tokenizers/phi-3-mini")
    raw["execution"] = {"engine": "local"}
    result = run_from_dict(raw, run_dir=tmp_path / "run", console_log=False)
    kept = result.summary["kept"]["glaive_toolcall"]
    assert kept + result.summary["rejected"]["glaive_toolcall"] == 300 and kept > 200
    line = json.loads((tmp_path / "run/ingest/glaive_toolcall/part-00000.jsonl").open().readline())
    assert isinstance(line["record"]["messages"], list)  # the original record travels to the stage
    receipt = json.loads((tmp_path / "run/receipts/glaive_toolcall/part-00000.json").read_text())
    paths = sorted(e["path"] for e in receipt["files"].values())
    seq = [p for p in paths if p.endswith("_sequence.idx")]
    assert len(seq) == 1
    seqs = IndexedDataset.open(tmp_path / "run" / seq[0][:-4])
    mask = IndexedDataset.open(tmp_path / "run" / seq[0].replace("_sequence.idx", "_loss_mask"))
    assert len(seqs) == len(mask) == receipt["stats"]["num_documents"] <= kept
    assert np.array_equal(seqs.lengths, mask.lengths) and seqs.check() == [] and mask.check() == []
    trained = sum(int(mask[i].sum()) for i in range(len(mask)))
    assert 0.4 < trained / int(seqs.lengths.sum()) < 0.8  # assistant turns trained, the rest masked
    assert verify_run(tmp_path / "run") == []
    # regression: the records the shards dropped were in no count, and every SFT audit said "counts do not add up"
    audit = json.loads((tmp_path / "run/audit/audit.json").read_text())
    dropped = receipt["stats"]["sft"]["dropped"]
    assert audit["checks"]["ok"] and sum(dropped.values()) == kept - receipt["stats"]["num_documents"] > 0
    assert audit["datasets"]["glaive_toolcall"]["records"]["sft_dropped"] == dropped
    assert audit["datasets"]["glaive_toolcall"]["checks"]["tokens_hist_counts_match"] is None  # no histogram in SFT
    # regression: those drops were counts only: no example in the audit's report, no line in the run's log
    from streamprep.audit.gather import build_audit
    part = (tmp_path / "run/ingest/glaive_toolcall/part-00000.jsonl").read_text().splitlines()
    listed = receipt["stats"]["sft"]["dropped_records"]
    for reason, n in dropped.items():
        shown = build_audit(tmp_path / "run")[1]["glaive_toolcall"][f"sft:{reason}"]
        lines = [d["line"] for d in listed if d["reason"] == reason][:3]
        assert len(shown) == min(3, n) and [x["text"] for x in shown] == [json.loads(part[i])["text"] for i in lines]
    logged = [json.loads(line) for line in (tmp_path / "run/logs/streamprep.log").open()]
    assert [e["dropped"] for e in logged if e["event"] == "sft shards dropped records"] == [dropped]
    again = run_from_dict(raw, run_dir=tmp_path / "run", console_log=False)
    assert again.status == "complete"
    # regression: a reject line showed the record's text field, which a chat record has none of: "None" for every
    # PII, duplicate or schema reject; now the text QC judged (or the record, as JSON)
    rejects = [json.loads(line) for line in (tmp_path / "run/rejects/glaive_toolcall.jsonl").open()]
    assert {r["failed_check"] for r in rejects} >= {"pii", "duplicate"}
    assert all(r["text"] != "None" and len(r["text"]) > 20 for r in rejects)
    # regression: without its role_map the template leaves the function calls and tool turns out, which only each
    # receipt's diagnostics counted: the audit says how many, in its JSON and its summary
    assert "sft_messages_not_rendered" not in audit["datasets"]["glaive_toolcall"]["records"]
    del raw["sft"]["input"]["sections"][0]["role_map"]
    run_from_dict(raw, run_dir=tmp_path / "bare", console_log=False)
    receipts = [json.loads(p.read_text()) for p in sorted((tmp_path / "bare/receipts/glaive_toolcall").glob("*.json"))]
    unrendered = sum(r["stats"]["sft"]["diagnostics"].get("messages_not_rendered", 0) for r in receipts)
    audit = json.loads((tmp_path / "bare/audit/audit.json").read_text())
    assert audit["datasets"]["glaive_toolcall"]["records"]["sft_messages_not_rendered"] == unrendered > 0
    from streamprep.audit import summary_from_file
    assert f"messages its chat template did not render (neither trained nor in the sequences; sft role_map?): " \
           f"{unrendered:,}" in summary_from_file(tmp_path / "bare")


def test_sft_section_errors_name_the_key(tmp_path: Path) -> None:
    from streamprep.config import ConfigError, validate

    data = tmp_path / "a.jsonl"
    data.write_text('{"messages": []}\n')
    with pytest.raises(ConfigError, match=r"'sft\.input\.sections\[0\]\.field'"):
        validate({"datasets": [{"name": "a", "path": str(data)}],
                  "sft": {"input": {"sections": [{"field": 3, "action": "train"}]}}})


def _instruction_run(shared_data: Path, tmp_path: Path) -> tuple[dict, Path]:
    """A small instruction-SFT config over two datasets (phi-2, no chat template) and its run dir."""
    raw: dict = {"run": {"name": "sft_small", "seed": 1}, "datasets": [],
                 "quality": {"expected_language": None, "min_chars": 10, "required_fields": ["prompt", "answer"]},
                 "tokenizer": {"path": str(shared_data / "tokenizers/phi-2/tokenizer.json"), "append_eod": False},
                 "execution": {"engine": "local", "workers": 1},
                 "sft": {"input": {"sections": [{"field": "prompt", "action": "mask"},
                                                {"field": "answer", "action": "train"}]}}}
    for name, n in (("a", 5), ("b", 3)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"Question {name} number {i}: what is {i} + {i}? ",
                                            "answer": f"It is {2 * i}."}) + "\n" for i in range(n)))
        raw["datasets"].append({"name": name, "path": str(path)})
    return raw, tmp_path / "run"


@pytest.mark.slow
def test_sft_run_counts_its_records_in_manifest_and_mixtures(shared_data: Path, tmp_path: Path) -> None:
    """Regression: an SFT run's manifest.json, mixtures.json and `run complete` said every dataset had 0 records and
    0 tokens (its shards were left out of the exports' counts), and the log warned that the mixture had no data."""
    raw, run = _instruction_run(shared_data, tmp_path)
    result = run_from_dict(raw, run_dir=run, console_log=False)
    receipts = {n: json.loads((run / f"receipts/{n}/part-00000.json").read_text())["stats"] for n in ("a", "b")}
    assert {n: s["num_documents"] for n, s in receipts.items()} == {"a": 5, "b": 3}
    manifest = json.loads((run / "manifest.json").read_text())
    mixtures = json.loads((run / "mixtures.json").read_text())
    for n, stats in receipts.items():
        assert manifest["datasets"][n]["num_records"] == mixtures["sources"][n]["num_records"] == stats["num_documents"]
        assert manifest["datasets"][n]["num_tokens"] == mixtures["sources"][n]["num_tokens"] == stats["num_tokens"] > 0
    assert mixtures["phases"][0]["weights"] == {"a": 0.5, "b": 0.5} and mixtures["phases"][0]["empty_sources"] == []
    assert result.summary["exports"]["records"] == {"a": 5, "b": 3}
    events = [json.loads(line)["event"] for line in (run / "logs/streamprep.log").open()]
    assert "mixture phase has no data: none of its datasets kept a record" not in events
    assert verify_run(run) == []


@pytest.mark.slow
def test_sft_run_records_hf_as_its_backend_from_the_start(shared_data: Path, tmp_path: Path, monkeypatch) -> None:
    """Regression: an SFT run ran gigatoken's selection and identity check (SFT always encodes with hf) and recorded
    gigatoken in checkpoints/tokenizer_backend.json and the log, which `status` showed until the first shard was
    planned, and for good when the run was killed before; a forced gigatoken was even loaded at config time."""
    from streamprep import backends
    from streamprep.config import validate
    from streamprep.layout import RunLayout
    from streamprep.status import run_status

    raw, run = _instruction_run(shared_data, tmp_path)
    forced = {**raw, "tokenizer": {**raw["tokenizer"], "backend": "gigatoken"}}
    with monkeypatch.context() as m:
        m.setattr(backends, "select", lambda *a, **k: pytest.fail("backends.select called for an SFT config"))
        validate(forced)
    run_from_dict(raw, run_dir=run, console_log=False)
    hf = {"requested": "auto", "name": "hf", "version": backends.installed_version("hf"),
          "reason": "sft: loss masks need character offsets, which only hf gives"}
    assert json.loads(RunLayout(run).tokenizer_backend.read_text()) == hf
    logged = [json.loads(line) for line in (run / "logs/streamprep.log").open()]
    assert [e["name"] for e in logged if e["event"] == "tokenizer backend"] == ["hf"]
    # what status shows of a run killed before its shards were planned: the checkpoint's record
    record = json.loads((run / "run.json").read_text())
    del record["tokenizer_backend"]
    (run / "run.json").write_text(json.dumps(record))
    assert run_status(run)["tokenizer_backend"] == hf


@pytest.mark.slow
def test_sft_over_parquet_with_binary_and_decimal_columns_completes(shared_data: Path, tmp_path: Path) -> None:
    """Regression: an SFT job over Parquet with a `binary` or `decimal128` column stopped, and so did its resume
    (`reading or judging the input failed after item 0: TypeError: Type is not JSON serializable: bytes`): the kept
    line carries the record. Those columns are left out of it, as pretraining leaves them out: the shards are the
    ones the same records without them give."""
    from decimal import Decimal

    import pyarrow as pa
    import pyarrow.parquet as pq

    raw, run = _instruction_run(shared_data, tmp_path)
    raw["datasets"] = raw["datasets"][:1]
    rows = [json.loads(line) for line in Path(raw["datasets"][0]["path"]).read_text().splitlines()]
    table = pa.table({"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows],
                      "blob": [b"\x00\x01binary"] * len(rows),
                      "price": pa.array([Decimal("1.25")] * len(rows), pa.decimal128(5, 2))})
    pq.write_table(table, tmp_path / "a.parquet")
    run_from_dict(raw, run_dir=run, console_log=False)
    raw["datasets"][0]["path"] = str(tmp_path / "a.parquet")
    assert run_from_dict(raw, run_dir=tmp_path / "pq", console_log=False).status == "complete"
    line = json.loads((tmp_path / "pq/ingest/a/part-00000.jsonl").open().readline())
    assert line["record"] == rows[0]
    shards = {p.relative_to(run / "sft"): p.read_bytes() for p in sorted((run / "sft").rglob("*")) if p.is_file()}
    assert shards and {p: (tmp_path / "pq/sft" / p).read_bytes() for p in shards} == shards


@pytest.mark.slow
def test_a_chat_with_nothing_to_train_does_not_take_its_twins_digest(shared_data: Path, tmp_path: Path) -> None:
    """Regression: a chat of user turns only passed QC and took the exact-dedup digest, the shards then dropped it
    (`no_trained_tokens`), and its twin with the answer as an assistant turn was rejected as its duplicate: 0
    documents from 2 records. The untrainable one is a counted reject before dedup; the twin is trained."""
    raw = yaml.safe_load((REPO / "configs/sft_chat.yaml").read_text())
    q, a = "What is the boiling point of water at sea level in Celsius?", "Water boils at 100 degrees Celsius."
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"id": i, "messages": [{"role": "user", "content": q}, {"role": r, "content": a}]})
                            + "\n" for i, r in (("A", "user"), ("B", "assistant"))))
    raw["datasets"] = [{"name": "chat", "path": str(data)}]
    raw["tokenizer"]["path"] = str(shared_data / "tokenizers/phi-3-mini")
    raw["quality"].update(expected_language=None, dedup="exact")
    raw["execution"] = {"engine": "local", "workers": 1}
    result = run_from_dict(raw, run_dir=tmp_path / "run", console_log=False)
    assert result.summary["kept"]["chat"] == 1 and result.summary["rejected"]["chat"] == 1
    rejects = [json.loads(line) for line in (tmp_path / "run/rejects/chat.jsonl").open()]
    assert [(r["failed_check"], r["reason"], r["source"]["index"]) for r in rejects] == \
        [("schema", "sft: no_trained_text: text: nothing to train (no turn or section that trains)", 0)]
    receipt = json.loads((tmp_path / "run/receipts/chat/part-00000.json").read_text())
    assert receipt["stats"]["num_documents"] == 1 and receipt["stats"]["sft"]["dropped"] == {}


@pytest.mark.slow
def test_an_sft_schema_reject_keeps_the_records_source_fields(shared_data: Path, tmp_path: Path) -> None:
    """Regression: a record that does not fit `sft:` lost its id, url and licence in rejects/<dataset>.jsonl
    (`"source": {"dataset": "a", "index": 1}`), which a pretraining schema reject keeps (docs/operations.md)."""
    raw, run = _instruction_run(shared_data, tmp_path)
    raw["datasets"] = raw["datasets"][:1]
    path = Path(raw["datasets"][0]["path"])
    bad = {"id": "c-content-int", "url": "https://example.org/c", "license": "cc-by", "prompt": 5, "answer": "x"}
    path.write_text(path.read_text() + json.dumps(bad) + "\n" + json.dumps({"prompt": [], "answer": "y"}) + "\n")
    run_from_dict(raw, run_dir=run, console_log=False)
    rejects = [json.loads(line) for line in (run / "rejects/a.jsonl").open()]
    assert [(r["failed_check"], r["source"]) for r in rejects] == [
        ("schema", {"dataset": "a", "index": 5, "id": "c-content-int", "url": "https://example.org/c",
                    "license": "cc-by"}),
        ("schema", {"dataset": "a", "index": 6})]


def test_trainable_counts_the_records_sft_shards_drop(shared_data: Path, tmp_path: Path) -> None:
    """Regression: audit.json's `trainable` was kept - empty_tokens, so it still counted the records the SFT shards
    dropped (here `overlong`): 5 trainable in a dataset whose shards hold 3 documents."""
    raw, run = _instruction_run(shared_data, tmp_path)
    raw["sft"]["preprocessing"] = {"max_seq_len": 40, "overlong": "drop"}
    with open(raw["datasets"][0]["path"], "a") as fh:   # a: 5 records that fit, then 2 far past 40 tokens
        for i in range(2):
            fh.write(json.dumps({"prompt": f"Long question {i}?", "answer": "It is long. " * 30}) + "\n")
    run_from_dict(raw, run_dir=run, console_log=False)
    audit = json.loads((run / "audit/audit.json").read_text())
    a, b = (audit["datasets"][n]["records"] for n in ("a", "b"))
    assert a["kept"] == 7 and a["sft_dropped"] == {"overlong": 2} and a["empty_tokens"] == 0
    assert a["trainable"] == a["tokenized_documents"] == 5 and b["trainable"] == b["tokenized_documents"] == 3
    assert audit["totals"]["trainable"] == audit["totals"]["tokenized_documents"] == 8
    assert audit["checks"]["ok"]


def test_status_of_a_finished_sft_run_is_done_without_a_blend(shared_data: Path, tmp_path: Path, capsys) -> None:
    """Regression: `status` (and the metrics' `stage` label) put a finished SFT run at stage `exports`: it waited for a
    blend.json, which only a pretraining run writes (docs/exports.md)."""
    from streamprep.cli import main
    from streamprep.status import run_status

    raw, run = _instruction_run(shared_data, tmp_path)
    assert run_from_dict(raw, run_dir=run, console_log=False).status == "complete"
    assert not (run / "blend.json").exists() and (run / "manifest.json").is_file()
    st = run_status(run)
    assert (st["state"], st["stage"]) == ("complete", "done")
    assert main(["status", str(run)]) == 0
    assert "state: COMPLETE   stage: done" in capsys.readouterr().out
    (run / "manifest.json").unlink()  # exports not finished: the manifest is their last file
    assert run_status(run)["stage"] == "exports"
