"""Quality audit on a real (local-engine) run: counts add up against independent sources, the HTML is
self-contained and escapes record text, and it renders in a real headless Chromium."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from helpers import N_A, log_events, make_inputs
from streamprep import run_from_dict
from streamprep.audit import build_audit, render_html, summary_from_file, write_audit

@pytest.fixture(scope="module")
def e2e_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("audit")
    inputs = make_inputs(root / "data")
    result = run_from_dict(inputs["config"], root / "run", console_log=False)
    assert result.status == "complete"
    return {"run_dir": root / "run", **inputs, "summary": result.summary}


def _lines(path: Path) -> list[dict]:
    return [orjson.loads(x) for x in path.read_bytes().splitlines()] if path.exists() else []


def test_counts_add_up_against_independent_sources(e2e_run):
    run_dir = e2e_run["run_dir"]
    text = write_audit(run_dir)
    audit = json.loads((run_dir / "audit" / "audit.json").read_text())
    assert audit["checks"] == {"ok": True, "failed": []}
    assert audit["complete"] is True
    for name, d in audit["datasets"].items():
        r = d["records"]
        assert r["read"] == r["kept"] + r["rejected"]
        qc = {k: v for k, v in d["rejects_by_check"].items() if k not in d["rejects_after_qc"]}
        assert sum(qc.values()) == r["rejected"]
        assert sum(d["rejects_by_check"].values()) == r["rejected"] + r["empty_tokens"]
        assert r["tokenized_documents"] == r["kept"] - r["empty_tokens"]
        # independent sources: ingest parts, rejects file, receipts, .idx-level counts
        parts = sorted((run_dir / "ingest" / name).glob("part-*.jsonl"))
        assert sum(len(p.read_bytes().splitlines()) for p in parts) == r["kept"]
        assert len(_lines(run_dir / "rejects" / f"{name}.jsonl")) == r["rejected"]  # sample not capped here
        receipts = [json.loads(p.read_text()) for p in sorted((run_dir / "receipts" / name).glob("*.json"))]
        assert sum(x["stats"]["num_documents"] for x in receipts) == r["tokenized_documents"]
        assert sum(x["stats"]["num_tokens"] for x in receipts) == d["tokens"]
        assert sum(row["count"] for row in d["lengths"]["chars"]["kept"]) == r["kept"]
        assert sum(row["count"] for row in d["lengths"]["chars"]["rejected"]) == r["rejected"]
        assert sum(row["count"] for row in d["lengths"]["tokens"]["kept"]) == r["tokenized_documents"]
        assert d["shards"]["done"] == d["shards"]["planned"] == len(parts)
    a = audit["datasets"]["a"]
    expect = e2e_run["expect"]
    read_a = N_A + expect["duplicate"] + expect["parse"] + expect["schema"] + expect["empty_tokens"]
    assert a["records"]["read"] == read_a
    for check, n in expect.items():
        assert a["rejects_by_check"].get(check, 0) == n, check
    assert a["rejects_after_qc"] == ["empty_tokens"]
    assert a["duplicates"]["rejected_as_duplicate"] == expect["duplicate"]
    assert a["duplicates"]["kept_by"] == {"a": expect["duplicate"]}  # within the dataset: it kept the copy
    gates = a["gates"]  # per-gate counts and cost flow from the QC workers via the checkpoint
    assert len(gates) >= 3 and 0 < gates[0]["seen"] <= a["records"]["read"]
    for before, after in zip(gates, gates[1:]):  # each gate sees what the one before it let through
        assert after["seen"] == before["seen"] - before["rejected"]
    assert all(x["us_per_record"] > 0 for x in gates)
    assert sum(x["rejected"] for x in gates) + expect["duplicate"] + expect["parse"] == a["records"]["rejected"]
    assert "Quality gates on this run" in (e2e_run["run_dir"] / "audit" / "audit.html").read_text()
    exact = a["duplicates"]["exact_duplicate_examples"]
    assert exact and all(x["kept_by"] == "a" and x["dataset"] == "a" for x in exact)
    assert audit["datasets"]["b"]["records"] == {**audit["datasets"]["b"]["records"], "read": 50, "kept": 50,
                                                 "rejected": 0, "empty_tokens": 0}
    # the run's own summary agrees
    s = e2e_run["summary"]
    for name, d in audit["datasets"].items():
        assert (s["kept"][name], s["rejected"][name], s["empty_tokens"][name]) == \
               (d["records"]["kept"], d["records"]["rejected"], d["records"]["empty_tokens"])
    t = audit["totals"]
    assert t["read"] == t["kept"] + t["rejected"] and t["tokens"] == sum(d["tokens"] for d in audit["datasets"].values())
    assert sum(v for v in audit["tokens_share"].values()) == pytest.approx(1.0, abs=1e-3)
    for key in ("pii", "profanity"):
        dens = a["density"][key]["all"]
        assert set(dens) == {"records", "p50", "p90", "p99"} and dens["p50"] <= dens["p90"] <= dens["p99"]
    assert set(audit["timings"]) >= {"ingest", "tokenize"}
    assert audit["throughput"]["ingest_records_per_s"] > 0
    # the text summary
    assert "counts add up" in text and "empty_tokens 1" in text and "audit.html" in text
    assert summary_from_file(run_dir) == text


def test_tokens_per_s_is_per_second_of_tokenizing_not_of_the_wait_after_ingest(e2e_run):
    """Regression: `tokenize_tokens_per_s` divided every token by `timings.tokenize`, the short wait after ingest
    for the shards still running (tokenizing runs during ingest): 10.6 M tokens/s for shards that took 0.82 s for
    0.46 M tokens. It is now the tokens of the shards tokenized over their tokenizing seconds (run.json's
    `tokenize_work`), which the `tokenization done` line logs too."""
    run_dir = e2e_run["run_dir"]
    audit, _ = build_audit(run_dir)
    work = json.loads((run_dir / "run.json").read_text())["tokenize_work"]
    [done] = log_events(run_dir, "tokenization done")
    receipts = [json.loads(p.read_text()) for p in sorted((run_dir / "receipts").rglob("*.json"))]
    assert work["shards"] == done["tokenized"] == len(receipts) > 1
    assert work["tokens"] == audit["totals"]["tokens"] == sum(r["stats"]["num_tokens"] for r in receipts)
    assert work["seconds"] == pytest.approx(done["shard_seconds"], abs=0.01) and work["seconds"] > 0
    assert audit["throughput"]["tokenize_tokens_per_s"] == round(work["tokens"] / work["seconds"], 1)


def test_html_is_self_contained_and_escapes_record_text(e2e_run):
    run_dir = e2e_run["run_dir"]
    write_audit(run_dir)
    page = (run_dir / "audit" / "audit.html").read_text()
    assert page.startswith("<!DOCTYPE html>")
    assert "<script" not in page.lower()                     # no scripts, and the record's tag is escaped
    assert "&lt;script&gt;alert(&quot;pwn&quot;)&lt;/script&gt; &amp; &#x27;q&#x27; &lt;/pre&gt;&lt;b&gt;x" in page
    for external in ("src=", "href=", "<link", "@import", "url(", "http://", "https://", "<iframe", "<object"):
        assert external not in page.lower(), external
    assert page.count("<svg") >= 6
    for reason in ("duplicate", "parse", "schema", "empty_tokens"):
        assert f"<summary>{reason} — " in page  # examples per reason, incl. a record dropped at tokenization


def test_records_without_a_language_are_not_called_undetected(e2e_run):
    """The HTML said "no language detected: N record(s)" of every record without a language, though most were
    rejected (parse, schema, duplicate) before the detector saw them, or the run had no language gate at all."""
    audit, examples = build_audit(e2e_run["run_dir"])
    a = audit["datasets"]["a"]
    lang, r = a["languages"], a["records"]
    assert lang["undetected"] == r["read"] - sum(lang["kept"].values()) - sum(lang["rejected"].values()) > 0
    assert lang["undetected"] >= sum(a["rejects_by_check"].get(k, 0) for k in ("parse", "schema", "duplicate")) > 0
    page = render_html(audit, examples)
    assert "no language detected" not in page
    assert (f"no language: {lang['undetected']:,} record(s) (rejected before the language gate, no language gate, or "
            "none detected)") in page


def _interrupted_copy(finished: Path, tmp_path: Path) -> Path:
    """A copy of a finished run made to look interrupted before dataset a's second part was tokenized."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir, ignore=shutil.ignore_patterns(".lock", "audit"))
    rec = json.loads((run_dir / "run.json").read_text())
    rec["status"], rec["checkpoint_dir"] = "interrupted", str(run_dir / "checkpoints")
    (run_dir / "run.json").write_text(json.dumps(rec))
    (run_dir / "receipts" / "a" / "part-00001.json").unlink()
    return run_dir


def test_unique_kept_digests_is_null_without_exact_dedup(e2e_run, tmp_path):
    """Regression: with `dedup: none` audit.json said `unique_kept_digests: 0` beside thousands of kept records, as
    if every one were a duplicate; no digest is kept then, so the figure is null. With exact dedup it counts the
    kept records' digests."""
    audit, _ = build_audit(e2e_run["run_dir"])
    a = audit["datasets"]["a"]
    assert a["duplicates"]["unique_kept_digests"] == a["records"]["kept"] > 0
    run_dir = tmp_path / "run"
    shutil.copytree(e2e_run["run_dir"], run_dir, ignore=shutil.ignore_patterns(".lock", "audit"))
    rec = json.loads((run_dir / "run.json").read_text())
    rec["config"]["quality"]["dedup"], rec["checkpoint_dir"] = "none", str(run_dir / "checkpoints")
    (run_dir / "run.json").write_text(json.dumps(rec))
    audit, _ = build_audit(run_dir)
    assert [d["duplicates"]["unique_kept_digests"] for d in audit["datasets"].values()] == [None, None]


def test_audit_of_a_partial_run_marks_it_and_still_adds_up(e2e_run, tmp_path):
    run_dir = _interrupted_copy(e2e_run["run_dir"], tmp_path)
    audit, examples = build_audit(run_dir)
    a = audit["datasets"]["a"]
    assert audit["complete"] is False and a["tokenization_complete"] is False
    assert a["checks"]["tokenized_eq_kept_minus_empty"] is None and audit["checks"]["ok"] is True
    assert a["records"]["read"] == a["records"]["kept"] + a["records"]["rejected"]
    assert "partial run" in write_audit(run_dir)
    assert "partial run" in render_html(audit, examples)


def test_a_partial_runs_summary_says_only_the_checks_it_made(e2e_run, tmp_path):
    """Regression (hunter R50 X4): a partial run's summary said "counts add up: read = kept + rejected; tokenized =
    kept - empty_tokens" where 150 documents were tokenized of 276 kept: that check is made only once every part of a
    dataset is tokenized. The line names it only for those datasets."""
    run_dir = _interrupted_copy(e2e_run["run_dir"], tmp_path)
    assert "\n  counts add up: read = kept + rejected; tokenized = kept - empty_tokens (datasets fully tokenized: 1 " \
           "of 2)\n" in write_audit(run_dir)
    for receipt in (run_dir / "receipts" / "b").glob("part-*.json"):
        receipt.unlink()
    text = write_audit(run_dir)
    assert "[partial run]" in text and "\n  counts add up: read = kept + rejected\n" in text, text


# ---- a real browser ---------------------------------------------------------------------------------------
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--host-resolver-rules=MAP * ~NOTFOUND"]


@pytest.fixture(scope="session")
def chromium() -> str:
    """Debian's chromium: installed here when missing and we are root; skip (fail under CI) otherwise."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    why = "chromium not installed"
    if not found and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        try:
            subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True, timeout=600, env=env)
            subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True, capture_output=True,
                           timeout=1200, env=env)
        except (subprocess.SubprocessError, OSError) as exc:
            why = f"chromium could not be installed: {str(exc)[:200]}"
        found = shutil.which("chromium")
    if not found:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why + " (needs root + apt-get, or install chromium)")
    return found


def read_png(path: Path) -> np.ndarray:
    """A tiny PNG decoder (8-bit gray/RGB/RGBA, not interlaced): (height, width, channels) uint8."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, ihdr = 8, [], None
    while pos < len(data):
        ln, typ = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + ln]
        pos += 12 + ln
        if typ == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif typ == b"IDAT":
            idat.append(body)
        elif typ == b"IEND":
            break
    w, h, depth, ctype, _, _, interlace = ihdr
    assert depth == 8 and interlace == 0 and ctype in (0, 2, 6), ihdr
    bpp = {0: 1, 2: 3, 6: 4}[ctype]
    stride = w * bpp
    rows = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8).reshape(h, stride + 1)
    out = np.zeros((h, stride), dtype=np.uint8)
    prev = np.zeros(stride, dtype=np.int64)
    for y in range(h):
        f, line = rows[y, 0], rows[y, 1:].astype(np.int64)
        if f == 0:
            cur = line
        elif f == 1:  # Sub: a running sum per channel
            cur = np.cumsum(line.reshape(w, bpp), axis=0).reshape(-1) & 0xFF
        elif f == 2:  # Up
            cur = (line + prev) & 0xFF
        else:  # Average / Paeth: sequential within the row
            lb, pb, c_ = line.tolist(), prev.tolist(), bytearray(stride)
            for i in range(stride):
                a = c_[i - bpp] if i >= bpp else 0
                b = pb[i]
                if f == 3:
                    c_[i] = (lb[i] + ((a + b) >> 1)) & 0xFF
                else:
                    c = pb[i - bpp] if i >= bpp else 0
                    p = a + b - c
                    pa, pb_, pc = abs(p - a), abs(p - b), abs(p - c)
                    c_[i] = (lb[i] + (a if pa <= pb_ and pa <= pc else b if pb_ <= pc else c)) & 0xFF
            cur = np.frombuffer(bytes(c_), dtype=np.uint8).astype(np.int64)
        out[y] = cur
        prev = cur
    return out.reshape(h, w, bpp)


@pytest.mark.slow
def test_html_renders_in_headless_chromium(e2e_run, chromium, tmp_path):
    run_dir = e2e_run["run_dir"]
    write_audit(run_dir)
    url = (run_dir / "audit" / "audit.html").resolve().as_uri()
    png = tmp_path / "audit.png"
    shot = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile1'}",
                           "--enable-logging=stderr", "--v=0", f"--screenshot={png}", "--window-size=1200,1600", url],
                          capture_output=True, text=True, timeout=90)
    assert png.is_file(), shot.stderr[-2000:]
    dom = subprocess.run([chromium, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'profile2'}",
                          "--enable-logging=stderr", "--v=0", "--dump-dom", url],
                         capture_output=True, text=True, timeout=90)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for err in (shot.stderr, dom.stderr):  # no console output at all: no JS, no blocked (external) loads
        bad = [ln for ln in err.splitlines() if "CONSOLE" in ln or "Uncaught" in ln or "Refused to" in ln]
        assert not bad, bad
    html_dom = dom.stdout
    assert "<script" not in html_dom.lower()                          # the record's <script> stayed text
    assert "&lt;script&gt;alert(\"pwn\")&lt;/script&gt;" in html_dom
    assert html_dom.count("<svg") >= 6 and "<rect" in html_dom
    img = read_png(png)
    assert img.shape[:2] == (1600, 1200)
    pixels = img.reshape(-1, img.shape[2])[:, :3]
    assert len(np.unique(pixels, axis=0)) > 100, "screenshot is blank"
    for colour in ((0x2E, 0x86, 0xDE), (0xE5, 0x50, 0x39)):  # kept / rejected histogram bars were painted
        assert int((pixels == colour).all(axis=1).sum()) > 500, colour


def test_log2_counts_of_an_array_use_the_bins_of_one_value() -> None:
    """The tokenizer stage counts a batch's lengths at once (stats.add_log2_counts); its bins must be
    `_log2_bin`'s, which the audit reads back."""
    import numpy as np

    from streamprep import stats

    values = [0, 1, 2, 3, 4, 7, 8, 1023, 1024, 65_535, 65_536, 10**6]
    batch: dict[str, int] = {}
    stats.add_log2_counts(batch, np.array(values))
    one: dict[str, dict[str, int]] = {}
    for v in values:
        stats.add_tokens(one, "kept", v)
    assert batch == one["tokens_hist_kept"]


@pytest.mark.slow
def test_a_job_gathers_its_audit_in_a_worker_not_the_driver(tmp_path, monkeypatch):
    """Gathering reads rejected and dropped records and tokenizes the rejects' sample (issue 28: the driver
    touches no record bytes): a job with worker processes gathers its audit in one of them, and it is the
    audit the same run dir gives when gathered here."""
    from streamprep.audit import gather

    inputs = make_inputs(tmp_path / "data")
    inputs["config"]["execution"]["workers"] = 2
    real = gather._rejected_token_hist
    monkeypatch.setattr(gather, "_rejected_token_hist", lambda *a: pytest.fail("the driver read the rejects"))
    assert run_from_dict(inputs["config"], tmp_path / "run", console_log=False).status == "complete"
    by_worker = (tmp_path / "run" / "audit" / "audit.json").read_bytes()
    assert json.loads(by_worker)["datasets"]["a"]["lengths"]["tokens"]["rejected_sample_records"] > 0
    monkeypatch.setattr(gather, "_rejected_token_hist", real)
    write_audit(tmp_path / "run")

    def timeless(audit: bytes) -> dict:  # `generated_at` is the second it was written (a flake in a slow second)
        return {k: v for k, v in json.loads(audit).items() if k != "generated_at"}
    assert timeless((tmp_path / "run" / "audit" / "audit.json").read_bytes()) == timeless(by_worker)


def test_the_rejects_histogram_is_the_same_under_either_backend(e2e_run, tmp_path, shared_data):
    """The audit tokenizes the rejects' sample with the backend the run used (run.json's `tokenizer_backend`;
    here over phi-2, which gigatoken loads): gigatoken's lengths are HF's, so every figure of the report is too."""
    from helpers import PHI2
    from streamprep.audit import gather
    from streamprep.layout import RunLayout

    run = tmp_path / "run"
    shutil.copytree(e2e_run["run_dir"], run)
    shutil.copyfile(shared_data / PHI2, RunLayout(run).tokenizer_json)
    record = json.loads((run / "run.json").read_text())
    lengths = {}
    for name in ("hf", "gigatoken"):
        record["tokenizer_backend"]["name"] = name
        (run / "run.json").write_text(json.dumps(record))
        assert gather._load_encoder(run).name == name
        audit, _ = build_audit(run)
        lengths[name] = {n: d["lengths"] for n, d in audit["datasets"].items()}
    assert lengths["hf"] == lengths["gigatoken"]
    assert sum(v["tokens"]["rejected_sample_records"] for v in lengths["hf"].values()) > 0


def test_html_shows_control_and_bidi_characters_as_escapes() -> None:
    """Regression: HTML escaping left NUL (a parse error), ESC, BEL, C1 controls and the bidi overrides (U+202E
    turns the tags after it around) in the page as they came in a record."""
    from streamprep.audit.render import esc

    assert esc("a\x00b\x1bc\x85d\u202ee\u2066f\tg\nh<i>\"") == \
        "a\\x00b\\x1bc\\x85d\\u202ee\\u2066f\tg\nh&lt;i&gt;&quot;"


def test_a_rejects_source_fields_are_cut_as_its_text_is(tmp_path) -> None:
    """Regression: a record's `id` and `url` were copied whole into its reject line and the audit's examples: 30
    short records with 1 MB ids made a 60 MB rejects file and a 15 MB page."""
    from helpers import base_config, english_docs

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"text": "short", "id": "<" * 1_000_000, "url": f"u{i}" * 400_000}) + "\n"
                            for i in range(5)) + "".join(json.dumps({"text": t}) + "\n" for t in english_docs(30)))
    assert run_from_dict(base_config([{"name": "d", "path": str(data)}], None), run_dir=tmp_path / "run",
                         console_log=False).status == "complete"
    lines = [orjson.loads(line) for line in (tmp_path / "run" / "rejects" / "d.jsonl").read_bytes().splitlines()]
    assert len(lines) == 5 and all(len(r["source"]["id"]) == 2000 and len(r["source"]["url"]) == 2000 for r in lines)
    assert (tmp_path / "run" / "audit" / "audit.html").stat().st_size < 200_000


def test_a_record_without_its_text_field_shows_itself_in_its_reject_line(tmp_path) -> None:
    """Regression: a record missing its text field (or whose text is no string) showed the field's repr as its text,
    "None" or "5", which read as a record whose text is "None" (and the audit's rejects sample tokenized that)."""
    from helpers import base_config, english_docs

    from streamprep.sources.base import excerpt_of

    data = tmp_path / "in.jsonl"
    bad = [{"text": "the text is in the wrong field", "license": "MIT"}, {"body": 5}, {"body": None, "n": [1, 2]}]
    data.write_text("".join(json.dumps(r) + "\n" for r in bad) + "".join(json.dumps({"body": t})
                                                                          + "\n" for t in english_docs(30)))
    assert run_from_dict(base_config([{"name": "d", "path": str(data), "text_field": "body"}], None),
                         run_dir=tmp_path / "run", console_log=False).status == "complete"
    lines = [orjson.loads(line) for line in (tmp_path / "run" / "rejects" / "d.jsonl").read_bytes().splitlines()]
    assert [(r["reason"], r["text"]) for r in lines] == [
        ("schema: no 'body' field", '{"text":"the text is in the wrong field","license":"MIT"}'),
        ("schema: body is int", '{"body":5}'),
        ("schema: body is None", '{"body":null,"n":[1,2]}')]
    deep: dict = {}
    node = deep
    for _ in range(300):  # past orjson's depth limit
        node["a"] = node = {}
    assert excerpt_of(deep, "text").startswith("{'a': {'a': ") and excerpt_of({"text": "é" * 3000}, "text") == "é" * 2000


def test_an_audit_waits_for_one_being_written(e2e_run, tmp_path):
    """A `streamprep audit` that gathered a partial run while the job finished wrote its "[partial run]" report
    over the job's final one: audits are gathered and written one at a time (a lock on the audit folder)."""
    import fcntl
    import threading
    import time

    run_dir = tmp_path / "run"
    shutil.copytree(e2e_run["run_dir"], run_dir, ignore=shutil.ignore_patterns(".lock", "audit"))
    rec = json.loads((run_dir / "run.json").read_text())
    rec["checkpoint_dir"] = str(run_dir / "checkpoints")
    (run_dir / "run.json").write_text(json.dumps(rec))
    audit_dir = run_dir / "audit"
    audit_dir.mkdir()
    other = os.open(audit_dir, os.O_RDONLY)  # another writer, gathering
    fcntl.flock(other, fcntl.LOCK_EX)
    done = threading.Event()
    writer = threading.Thread(target=lambda: (write_audit(run_dir), done.set()))
    writer.start()
    time.sleep(0.5)
    assert not done.is_set() and not (audit_dir / "audit.json").exists()
    os.close(other)
    writer.join(30)
    assert done.is_set() and json.loads((audit_dir / "audit.json").read_text())["complete"] is True


@pytest.mark.parametrize("audit_dir_exists", [True, False])
def test_audit_of_a_read_only_run_dir_is_exit_2_naming_the_folder(e2e_run, tmp_path, monkeypatch, capsys,
                                                                  audit_dir_exists):
    """Regression: `streamprep audit` on a run dir it may not write in was a raw `PermissionError: … audit/.audit.json
    .streamprep-tmp.NNN`, exit 1. (Simulated: root writes through permission bits.)"""
    from streamprep import atomic
    from streamprep.cli import main

    run_dir = tmp_path / "run"
    shutil.copytree(e2e_run["run_dir"], run_dir, ignore=shutil.ignore_patterns(".lock", "audit"))
    audit_dir = run_dir / "audit"
    if audit_dir_exists:
        audit_dir.mkdir()
    refusing = audit_dir if audit_dir_exists else run_dir
    nofollow, mkdir = atomic.nofollow, Path.mkdir

    def denied(path: Any) -> PermissionError:
        return PermissionError(13, "Permission denied", str(path))

    def opener(path: str, flags: int) -> int:
        if Path(path).parent == refusing:
            raise denied(path)
        return nofollow(path, flags)

    def make(self: Path, *args: Any, **kw: Any) -> None:
        if self.parent == refusing and not self.exists():
            raise denied(self)
        mkdir(self, *args, **kw)
    monkeypatch.setattr(atomic, "nofollow", opener)
    monkeypatch.setattr(Path, "mkdir", make)
    assert main(["audit", str(run_dir)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"streamprep: error: cannot write the audit in {refusing}: Permission denied; make that folder writable, or "
        f"audit a copy of the run dir"]
    assert (list(audit_dir.iterdir()) == []) if audit_dir_exists else not audit_dir.exists()  # nothing written


def test_a_rerun_of_a_complete_run_rewrites_an_audit_that_is_not_the_finished_runs(tmp_path, capsys, monkeypatch):
    """Regression (hunter R50 X1): a `streamprep audit` of a partial run, left as the job was stopped or killed
    writing its own final audit, survived the completed run: re-running the command printed that "[partial run]"
    summary (read 931 of 2,120) as the run's and `status` said `audit yes`; after a kill between audit.json and
    audit.html no re-run wrote audit.html. Only the finished run's audit (its run_id and finished_at, with its
    audit.html) counts now: the re-run writes any other again, and until then `status` says `audit no`."""
    import yaml

    from streamprep import atomic
    from streamprep.cli import main
    from streamprep.status import run_status

    inputs = make_inputs(tmp_path / "data")
    cfg_path, run_dir = tmp_path / "cfg.yaml", tmp_path / "run"
    cfg_path.write_text(yaml.safe_dump(inputs["config"]))
    command = ["ingest", "--config", str(cfg_path), "--run-dir", str(run_dir)]
    assert main(command) == 0
    final = capsys.readouterr().out
    assert "counts add up" in final and "partial run" not in final
    audit_json, audit_html = run_dir / "audit" / "audit.json", run_dir / "audit" / "audit.html"
    good = json.loads(audit_json.read_text())

    def partial(audit: dict) -> None:
        audit.update(complete=False, run={**audit["run"], "status": "crashed"},
                     totals={**audit["totals"], "read": 931})

    def earlier_attempt(audit: dict) -> None:
        audit.update(run={**audit["run"], "finished_at": audit["run"]["finished_at"] - 60},
                     totals={**audit["totals"], "read": 931})

    def another_run(audit: dict) -> None:
        audit.update(run={**audit["run"], "run_id": "0123456789ab"}, totals={**audit["totals"], "read": 931})

    for stale in (partial, earlier_attempt, another_run, None):
        audit = json.loads(json.dumps(good))
        if stale is not None:
            stale(audit)
        audit_json.write_text(json.dumps(audit))
        if stale is None:  # the finished run's audit.json, its audit.html gone (a kill between the two writes)
            audit_html.unlink()
        assert run_status(run_dir)["outputs"]["audit"] is False, stale
        assert main(command) == 0
        assert capsys.readouterr().out == final, stale
        assert audit_html.is_file() and json.loads(audit_json.read_text())["totals"] == good["totals"], stale
        assert run_status(run_dir)["outputs"]["audit"] is True, stale

    # a stop between the two writes leaves the old audit.json, never a final one beside an older audit.html
    audit = json.loads(json.dumps(good))
    partial(audit)
    audit_json.write_text(json.dumps(audit))
    written, real = [], atomic.write_bytes

    def stopped_at_the_second(path: Path, data: bytes) -> None:
        if written:
            raise KeyboardInterrupt
        written.append(path)
        real(path, data)
    monkeypatch.setattr(atomic, "write_bytes", stopped_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        write_audit(run_dir)
    monkeypatch.undo()
    assert run_status(run_dir)["outputs"]["audit"] is False
    assert main(command) == 0 and capsys.readouterr().out == final
    assert run_status(run_dir)["outputs"]["audit"] is True
