"""`execution.metrics_port`: a real job (engine: local) scraped over HTTP while it runs, parsed with
prometheus_client's own parser, its figures checked against `streamprep status --json`."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from helpers import base_config, english_docs, port_of, scrape
from streamprep import run_from_dict, units
from streamprep.config import ConfigError
from streamprep.status import run_status


def write_corpus(path, n: int) -> None:
    docs = english_docs(n, seed=3)
    rows = [{"text": t} for t in docs] + [{"text": "too short"}] * 7 + [{"text": docs[0]}] * 5 + [{"no_text": 1}] * 3
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture
def slow_source(monkeypatch):
    """Local records at ~1 ms each (read by the one worker thread of `workers: 1`), so the job runs long
    enough to be scraped mid-ingest."""
    real = units.read_unit

    def slow(unit, options):
        for item in real(unit, options):
            time.sleep(0.001)
            yield item

    monkeypatch.setattr(units, "read_unit", slow)


@pytest.mark.slow
def test_scraped_while_running_and_equal_to_status_at_the_end(tmp_path, slow_source, monkeypatch):
    write_corpus(tmp_path / "a.jsonl", 1200)
    write_corpus(tmp_path / "b.jsonl", 400)
    raw = base_config([{"name": "a", "path": str(tmp_path / "a.jsonl")}, {"name": "b", "path": str(tmp_path / "b.jsonl")}],
                      None, output={"shard_records": 150})
    raw["execution"].update(metrics_port=0, batch_records=50, unit_mb=0.02)  # ~16 units, committed one by one
    run_dir = tmp_path / "run"

    final: dict = {}

    import streamprep.audit as audit

    real_audit = audit.write_audit

    def audit_then_scrape(rd, **kw):  # the job's last step, with every figure final and the endpoint still up
        final["scrape"] = scrape(port_of(run_dir))
        return real_audit(rd, **kw)

    monkeypatch.setattr(audit, "write_audit", audit_then_scrape)
    mid: list[dict] = []
    ended = threading.Event()

    def scraper() -> None:  # the job runs in the main thread (it installs signal handlers); we watch from here
        while not ended.is_set():
            if port := port_of(run_dir):
                try:
                    mid.append(scrape(port))
                except OSError:  # the job ended between the check and the scrape
                    return
            time.sleep(0.05)

    watcher = threading.Thread(target=scraper)
    watcher.start()
    try:
        result = {"r": run_from_dict(raw, run_dir, console_log=False)}
    finally:
        ended.set()
        watcher.join()
    assert result["r"].status == "complete"
    # scraped while ingest ran: some records read, not all
    total_read = 1215 + 415
    reads = [sum(v for (n, _), v in m.items() if n == "streamprep_records_read_total") for m in mid]
    assert any(0 < r < total_read for r in reads), reads
    assert reads == sorted(reads)  # counters only go up

    st = run_status(run_dir)
    got = final["scrape"]
    for name, d in st["datasets"].items():
        ing, tok = d["ingest"], d["tokenize"]
        lab = (("dataset", name),)
        assert got[("streamprep_records_read_total", lab)] == ing["read"] == (1215 if name == "a" else 415)
        assert got[("streamprep_records_kept_total", lab)] == ing["kept"]
        assert got[("streamprep_records_rejected_total", lab)] == ing["rejected"] == 15
        for check, n in ing["rejects_by_check"].items():
            assert got[("streamprep_records_rejected_by_check_total", (("check", check), ("dataset", name)))] == n
        assert set(ing["rejects_by_check"]) == {"duplicate", "schema"}, ing["rejects_by_check"]
        assert got[("streamprep_source_read_bytes_total", lab)] == ing["bytes_in"] == (tmp_path / f"{name}.jsonl").stat().st_size
        assert got[("streamprep_ingest_written_bytes_total", lab)] == ing["bytes"] > 0
        assert got[("streamprep_parts_sealed_total", lab)] == ing["parts_sealed"] == tok["shards_done"]
        assert got[("streamprep_parts_tokenized_total", lab)] == tok["shards_done"] > 1
        assert got[("streamprep_tokens_written_total", lab)] == tok["tokens"] > 0
        assert got[("streamprep_documents_tokenized_total", lab)] == tok["documents"] == ing["kept"]
        assert got[("streamprep_queue_depth", (("dataset", name), ("queue", "tokenize")))] == 0
        assert got[("streamprep_dataset_ingest_done", lab)] == 1
    assert got[("streamprep_workers", ())] == st["workers"] == 1
    assert got[("streamprep_hub_retries_exhausted_total", ())] == 0 and st["hub"] is None
    # the endpoint is gone with the job: nothing left listening
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port_of(run_dir)), timeout=1).close()


def test_a_scrape_shows_what_a_resume_carries_over_never_the_state_ahead_of_it(tmp_path, monkeypatch):
    """Regression: a scrape read the job's in-memory ingest state, up to a unit ahead of its checkpoint, so after a
    kill -9 the resumed job (which carries over the checkpoint) exposed less than the last scrape: Prometheus took the
    drop for a counter reset and increase() counted the difference twice (5 630 for 4 004 records). Scraped at every
    save, just before it (the state then ahead of the saved one), a scrape now shows what the saved files hold."""
    from streamprep import ingest

    write_corpus(tmp_path / "a.jsonl", 400)
    raw = base_config([{"name": "a", "path": str(tmp_path / "a.jsonl")}], None, output={"shard_records": 100})
    raw["execution"].update(metrics_port=0, batch_records=50, unit_mb=0.02)  # several units, a checkpoint each
    run_dir = tmp_path / "run"
    real_save, seen = ingest.save, []

    def scrape_then_save(files, state) -> None:
        got = scrape(port_of(run_dir))
        saved = run_status(run_dir)["datasets"]["a"]  # what a resume after a kill -9 here would start from
        seen.append({"scraped": (got[("streamprep_records_read_total", (("dataset", "a"),))],
                                 got[("streamprep_records_kept_total", (("dataset", "a"),))],
                                 got[("streamprep_parts_sealed_total", (("dataset", "a"),))]),
                     "saved": (saved["ingest"]["read"], saved["ingest"]["kept"], saved["ingest"]["parts_sealed"]),
                     "live": state.consumed})
        real_save(files, state)

    monkeypatch.setattr(ingest, "save", scrape_then_save)
    assert run_from_dict(raw, run_dir, console_log=False).status == "complete"
    assert sum(s["live"] > s["saved"][0] for s in seen) >= 3, seen  # the live state was ahead at these saves
    assert [s["scraped"] for s in seen] == [s["saved"] for s in seen]


def test_metrics_off_by_default_and_a_taken_port_is_exit_2(tmp_path):
    """Regression: a taken port was found once the run dir, its locks and its log existed; now before any of them."""
    from streamprep.config import validate

    ds = [{"name": "a", "path": str(tmp_path / "a.jsonl")}]
    write_corpus(tmp_path / "a.jsonl", 50)
    assert validate(base_config(ds, None))["execution"]["metrics_port"] is None
    for bad in (-1, 65536, "9100"):
        raw = base_config(ds, None)
        raw["execution"]["metrics_port"] = bad
        with pytest.raises(ConfigError, match="execution.metrics_port"):
            validate(raw)
    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    try:
        raw = base_config(ds, None)
        raw["execution"]["metrics_port"] = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=r"execution.metrics_port: cannot listen on .*:\d+"):
            run_from_dict(raw, tmp_path / "run", console_log=False)
    finally:
        taken.close()
    assert not (tmp_path / "run").exists()


def test_series_with_a_unit_end_with_it_and_declare_it():
    """Regression: the byte counters were `streamprep_source_bytes_read_total`, `..._ingest_bytes_written_total` and
    `..._hub_bytes_downloaded_total`: Prometheus' naming rules put the unit last, before `_total`, and OpenMetrics
    requires it of a series whose `# UNIT` it declares (which none did). Every series counting bytes now ends in
    `_bytes` and declares it."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.openmetrics.exposition import generate_latest

    from streamprep.metrics import JobCollector

    ingest = {"read": 3, "kept": 2, "rejected": 1, "rejects_by_check": {"pii": 1}, "bytes": 5, "bytes_in": 7,
              "parts_sealed": 1, "done": True}
    tokenize = {"shards_done": 1, "shards_pending": 0, "tokens": 4, "documents": 2}
    collector = JobCollector(lambda: {"datasets": {"a": {"ingest": ingest, "tokenize": tokenize}}, "workers": 1,
                                      "hub": {"retries": {"429": 2}, "gave_up": 0, "files": 1, "bytes": 9},
                                      "run_id": "r", "name": "n", "stage": "done"})
    families = {fam.name: fam for fam in collector.collect()}
    counting_bytes = {name for name, fam in families.items() if "bytes" in fam.documentation.lower()}
    assert counting_bytes == {"streamprep_source_read_bytes", "streamprep_ingest_written_bytes",
                              "streamprep_hub_downloaded_bytes"}
    assert all(families[name].unit == "bytes" for name in counting_bytes)
    assert all(fam.unit == "" for name, fam in families.items() if name not in counting_bytes)
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert "# UNIT streamprep_hub_downloaded_bytes bytes\nstreamprep_hub_downloaded_bytes_total 9.0\n" in text
