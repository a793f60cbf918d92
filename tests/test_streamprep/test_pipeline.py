"""End to end on the local engine: real corpora and tokenizer, Megatron readback, determinism, skips."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
import types
from pathlib import Path

import numpy as np
import orjson
import pytest
from tokenizers import Tokenizer

from helpers import PHI2, base_config, english_docs, log_events, ray_worker_error, tree_hashes
from streamprep import run_from_dict
from streamprep.pipeline import Signals
from streamprep.exports.summary import SUFFIX

OUTPUTS = ("ingest", "rejects", "binidx", "receipts", "parquet", "tokenizer")


@pytest.fixture(scope="module")
def web_run(tmp_path_factory: pytest.TempPathFactory, shared_data: Path) -> Path:
    run_dir = tmp_path_factory.mktemp("web") / "run"
    cfg = base_config([{"name": "c4", "path": str(shared_data / "web/c4_en_train00000_first1000.jsonl")},
                       {"name": "dclm", "path": str(shared_data / "web/dclm_quality_*.jsonl")}],
                      str(shared_data / PHI2), output={"shard_records": 300})
    cfg["execution"]["workers"] = 2
    run_from_dict(cfg, run_dir=run_dir, console_log=False)
    return run_dir


def _prefixes(run_dir: Path) -> list[Path]:
    return sorted(Path(str(p)[:-4]) for p in (run_dir / "binidx").rglob("*.idx"))


@pytest.mark.slow
def test_megatron_reads_every_shard_and_ids_equal_the_tokenizer(web_run: Path, shared_data: Path) -> None:
    indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    tok = Tokenizer.from_file(str(shared_data / PHI2))
    eod = tok.token_to_id("<|endoftext|>")
    total = 0
    for prefix in _prefixes(web_run):
        ds = indexed.IndexedDataset(str(prefix))
        assert ds.index.dtype == np.uint16  # phi-2: 50 295 < 65 500
        part = web_run / "ingest" / prefix.parent.name / (prefix.name.replace("_text_document", "") + ".jsonl")
        texts = [orjson.loads(line)["text"] for line in part.read_bytes().splitlines()]
        assert len(ds) == len(texts)
        for i, text in enumerate(texts):
            assert ds[i].tolist() == tok.encode(text, add_special_tokens=False).ids + [eod]
        total += len(ds)
    run = json.loads((web_run / "run.json").read_text())
    assert run["status"] == "complete"
    assert total == sum(run["summary"]["kept"].values())


@pytest.mark.slow
def test_dedup_counts_and_run_record(web_run: Path) -> None:
    run = json.loads((web_run / "run.json").read_text())
    assert run["summary"]["kept"]["dclm"] + run["summary"]["rejected"]["dclm"] == 780
    rejects = [json.loads(line) for line in (web_run / "rejects/dclm.jsonl").read_text().splitlines()]
    # the glob reads agreement (281 records) before majority, which repeats all 281: every agreement record
    # that was kept must come back exactly once as a duplicate, and nothing else is a duplicate
    kept = [json.loads(line)["meta"]["source"]["index"] for p in sorted((web_run / "ingest/dclm").glob("*.jsonl"))
            for line in p.read_text().splitlines()]
    kept_agreement = sum(i < 281 for i in kept)
    duplicates = [r for r in rejects if r["failed_check"] == "duplicate"]
    assert kept_agreement > 200 and len(duplicates) == kept_agreement
    assert all(r["source"]["index"] >= 281 for r in duplicates)
    assert set(run["versions"]) >= {"streamprep", "tokenizers", "pyarrow", "ray", "cosmos-xenna"}
    assert set(run["timings"]) >= {"ingest", "tokenizer", "tokenize", "exports"}


@pytest.mark.slow
def test_blend_json_is_megatron_per_split_with_token_weights(web_run: Path) -> None:
    blend = json.loads((web_run / "blend.json").read_text())
    assert set(blend) == {"train", "valid", "test"} and blend["valid"] is None and blend["test"] is None
    pairs = list(zip(blend["train"][::2], blend["train"][1::2]))
    prefixes = {str(p) for p in _prefixes(web_run)}
    assert {p for _, p in pairs} == prefixes and all(Path(p).is_absolute() for _, p in pairs)
    by_ds: dict[str, float] = {}
    for w, p in pairs:
        by_ds[Path(p).parent.name] = by_ds.get(Path(p).parent.name, 0) + float(w)
    assert by_ds == pytest.approx({"c4": 1.0, "dclm": 1.0})  # weight 1.0 each, spread over shards by tokens
    from megatron.core.datasets.utils import get_blend_from_list

    prefixes_out, weights = get_blend_from_list(blend["train"])
    assert len(prefixes_out) == len(pairs) and weights is not None


def test_rerun_of_finished_run_does_no_work(web_run: Path) -> None:
    """Not a redo that writes the same bytes again: no output file is written at all (its mtime kept)."""
    before = tree_hashes(web_run, *OUTPUTS, names=("blend.json", "manifest.json"))
    written = {p: p.stat().st_mtime_ns for p in web_run.rglob("*")
               if p.is_file() and p.parts[len(web_run.parts)] in (*OUTPUTS, "blend.json", "manifest.json")}
    cfg = json.loads((web_run / "run.json").read_text())["config"]
    t0 = time.monotonic()
    result = run_from_dict(_raw(cfg), run_dir=web_run, console_log=False)
    assert result.status == "complete" and time.monotonic() - t0 < 5
    assert tree_hashes(web_run, *OUTPUTS, names=("blend.json", "manifest.json")) == before
    assert len(written) > 10 and {p: p.stat().st_mtime_ns for p in written} == written


def _raw(cfg: dict) -> dict:
    """A run.json config snapshot back into user form (drop derived keys)."""
    datasets = [{k: v for k, v in d.items() if k != "blend_split"} for d in cfg["datasets"]]
    return {**cfg, "datasets": datasets}


@pytest.mark.slow
def test_outputs_identical_across_worker_counts_and_tokenizer_training(tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    docs = english_docs(900)
    lines = [json.dumps({"text": t}) for t in docs] + [json.dumps({"text": docs[5]}), "{broken", json.dumps({"text": 3})]
    src.write_text("\n".join(lines) + "\n")
    hashes = []
    for workers in (1, 2):
        cfg = base_config([{"name": "gen", "path": str(src)}], None)
        cfg["execution"].update(workers=workers, batch_records=50)
        run_dir = tmp_path / f"w{workers}"
        run_from_dict(cfg, run_dir=run_dir, console_log=False)
        hashes.append(tree_hashes(run_dir, *OUTPUTS, names=("manifest.json", "mixtures.json")))
        # each part's exports summary and sorted run were made by the worker that tokenized it, none by the
        # exports at the end (which leave no scratch)
        receipts = sorted((run_dir / "receipts/gen").glob("*.json"))
        assert len(receipts) == 5 and [r.with_suffix(SUFFIX).exists() for r in receipts] == [True] * 5
        log_text = (run_dir / "logs/streamprep.log").read_text()
        assert '"part summaries computed"' not in log_text and '"part runs made by the exports"' not in log_text
        assert not (run_dir / "parquet/.order").exists()
    assert hashes[0] == hashes[1]
    run = json.loads((tmp_path / "w1/run.json").read_text())
    assert run["summary"]["kept"] == {"gen": 900} and run["summary"]["rejected"] == {"gen": 3}
    assert json.loads((tmp_path / "w1/tokenizer/tokenizer.json").read_text())["added_tokens"][1]["content"] == "</s>"


@pytest.mark.slow
def test_an_optional_dataset_without_input_is_skipped_with_a_log_line(tmp_path: Path, shared_data: Path) -> None:
    """Regression: an optional dataset whose path matched nothing was left out without a word (the demo on a bare
    clone dropped C4 and DCLM silently); the job's log now names it and why."""
    data = tmp_path / "a.jsonl"
    data.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in english_docs(30)))
    cfg = base_config([{"name": "gone", "path": str(tmp_path / "nowhere" / "*.jsonl"), "optional": True},
                       {"name": "a", "path": str(data)}], str(shared_data / PHI2))
    run_dir = tmp_path / "run"
    run_from_dict(cfg, run_dir=run_dir, console_log=False)
    skipped = log_events(run_dir, "optional dataset skipped: its input is missing")
    assert [(x["dataset"], x["level"]) for x in skipped] == [("gone", "warning")]
    assert skipped[0]["reason"] == f"'datasets[0].path': no file matches {tmp_path / 'nowhere' / '*.jsonl'}"
    assert [d["name"] for d in json.loads((run_dir / "run.json").read_text())["config"]["datasets"]] == ["a"]


@pytest.mark.slow
@pytest.mark.parametrize("sample_mb", [None, 0.01])
def test_a_tokenizer_is_trained_on_a_worker_not_in_the_driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              sample_mb: float | None) -> None:
    """Issue 28: the driver reads no record. Training a tokenizer read the kept texts in the driver's feeder thread;
    now a worker does (here the driver's own training and part reading are made to fail: the workers are fresh
    processes, which this patch does not reach). The same tokenizer as a `workers: 1` run, which trains in-process."""
    from streamprep import tokenizer as tokmod

    data = tmp_path / "a.jsonl"
    data.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in english_docs(400)))
    cfg = base_config([{"name": "a", "path": str(data)}], None, output={"shard_records": 100})
    cfg["tokenizer"]["train"]["sample_mb"] = sample_mb
    run_from_dict(cfg, run_dir=tmp_path / "w1", console_log=False)
    trained = (tmp_path / "w1" / "tokenizer" / "tokenizer.json").read_bytes()

    def refuse(*_: object, **__: object) -> None:
        raise AssertionError("the driver read kept texts to train the tokenizer")

    monkeypatch.setattr(tokmod, "train_bpe", refuse)
    monkeypatch.setattr(tokmod, "iter_part_texts", refuse)
    cfg["execution"]["workers"] = 2
    run_from_dict(cfg, run_dir=tmp_path / "w2", console_log=False)
    assert (tmp_path / "w2" / "tokenizer" / "tokenizer.json").read_bytes() == trained
    assert tree_hashes(tmp_path / "w2", "binidx") == tree_hashes(tmp_path / "w1", "binidx")
    assert ((tmp_path / "w2" / "tokenizer" / "training.json").is_file()) == (sample_mb is not None)


def test_tokenize_part_refuses_a_vocabulary_that_does_not_fit_the_dtype(tmp_path: Path) -> None:
    """The id bound is checked once against the vocabulary (not per document): 70 000 ids cannot be uint16."""
    from streamprep.tokenize import make_task, tokenize_part

    part = tmp_path / "ingest/d/part-00000.jsonl"
    part.parent.mkdir(parents=True)
    part.write_text('{"text": "hello"}\n')

    class BigVocab:
        vocab_size = 70_000

    task = make_task(tmp_path, "d", "train", part, tmp_path / "tok.json", "sha256:x", 69_999, "uint16")
    with pytest.raises(ValueError, match="token id 69999 does not fit uint16"):
        tokenize_part(task, BigVocab())
    assert not list((tmp_path / "binidx").rglob("*.bin"))


@pytest.mark.slow
def test_tokenize_part_encodes_in_batches_of_at_most_1024_records(tmp_path: Path, shared_data: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Thousands of short documents go to the encoder 1 024 at a time (one call for all of them costs 10-20 %
    more CPU), also when a byte-bounded read holds more; ids, order and dropped empties are those of a
    per-document encode."""
    from streamprep import textshard, tokenize
    from streamprep.backends import ShardEncoder
    from streamprep.binidx import IndexedDataset

    texts = english_docs(2600)
    texts[1500] = ""
    part = tmp_path / "ingest/d/part-00000.jsonl"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts))
    monkeypatch.setattr(textshard, "ENCODE_BYTES", 700_000)  # ~1 900 lines per read: batches split by both bounds
    tok = Tokenizer.from_file(str(shared_data / PHI2))
    calls: list[int] = []

    class Counting(ShardEncoder):
        def encode_batch(self, batch: list[str], check: str | None = None) -> tuple:
            calls.append(len(batch))
            return super().encode_batch(batch, check)

    task = tokenize.make_task(tmp_path, "d", "train", part, shared_data / PHI2, "sha256:x", 50256, "uint16")
    stats = tokenize.tokenize_part(task, Counting("hf", shared_data / PHI2))
    with open(part, "rb") as fh:
        first_read = len(fh.readlines(700_000))
    assert 1024 < first_read < 2048 and calls == [1024, first_read - 1024, 2600 - first_read]
    assert stats["dropped_empty"] == [1500] and stats["num_documents"] == 2599
    ds = IndexedDataset.open(task.prefix)
    expected = [tok.encode(t, add_special_tokens=False).ids + [50256] for t in texts if t]
    assert [ds[i].tolist() for i in range(len(ds))] == expected


def test_local_engine_tokenizes_on_the_jobs_executor_and_starts_no_process(tmp_path: Path, shared_data: Path) -> None:
    """`engine: local` has no worker of its own: a shard task is one more call on the job's executor (its thread
    with `workers: 1`, else its worker processes). No process starts or ends for it, the receipt is written, and
    the shard's bytes are the same either way."""
    import psutil

    from streamprep import tokenize
    from streamprep.engines.local import LocalEngine
    from streamprep.executor import LocalExecutor

    texts = english_docs(300)
    shards = {}
    for workers in (1, 2):
        run = tmp_path / f"w{workers}"
        part = run / "ingest/d/part-00000.jsonl"
        part.parent.mkdir(parents=True)
        part.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts))
        task = tokenize.make_task(run, "d", "train", part, shared_data / PHI2, "sha256:x", 50256, "uint16")
        with LocalExecutor(workers) as executor:
            executor.warm()
            deadline = time.monotonic() + 30
            while len(executor.processes) < (workers if workers > 1 else 0) and time.monotonic() < deadline:
                time.sleep(0.05)
            before = {p.pid for p in psutil.Process().children(recursive=True)}
            engine = LocalEngine(executor)
            [result] = engine.run([task])
            assert {p.pid for p in psutil.Process().children(recursive=True)} == before
            assert set(executor.processes) <= before and len(executor.processes) == (workers if workers > 1 else 0)
        assert result["skipped"] is False and tokenize.read_receipt(task)["status"] == "completed"
        shards[workers] = Path(task.prefix + ".bin").read_bytes()
    assert shards[1] == shards[2] and len(shards[1]) > 2 * 300


def test_a_writer_that_died_during_the_run_leaves_no_temporary_file(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a stage worker lost with its node while it wrote a part's summary left that summary's temporary
    file in receipts/ (the call ran again on the head and the job completed), and the run's outputs differed from a
    clean run's by it (tests/test_streamprep/test_ray_cluster.py, the lost-node test, now and then). The job now
    removes, once its writers have ended, every temporary file a writer left. Here a writer that died is one whose
    temporary file appears beside the first part's receipt while the part is tokenized."""
    from streamprep import atomic
    from streamprep.engines import base

    prepare = base.prepare_part
    left: list[Path] = []

    def dying_writer(task, receipt, scan=None):
        if not left:  # the first part: a writer of another process died mid-write here
            left.append(Path(str(atomic.tmp_path(Path(task.receipt_path).with_suffix(SUFFIX))) + "0"))
            left[0].write_bytes(b"half a summary")
        return prepare(task, receipt, scan)

    monkeypatch.setattr(base, "prepare_part", dying_writer)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(500)))
    run_dir = tmp_path / "run"
    run_from_dict(base_config([{"name": "gen", "path": str(src)}], None), run_dir=run_dir, console_log=False)
    assert left and not left[0].exists() and atomic.is_tmp_name(left[0].name)
    assert not [p for p in run_dir.rglob("*") if atomic.is_tmp_name(p.name)]
    events = [orjson.loads(line) for line in (run_dir / "logs/streamprep.log").read_bytes().splitlines()]
    assert [e["count"] for e in events if e["event"] == "removed temporary files of writers that died during the run"] \
        == [1]


def _fake_frame(filename: str, back: object = None) -> types.SimpleNamespace:
    return types.SimpleNamespace(f_code=types.SimpleNamespace(co_filename=filename), f_back=back, f_lineno=1)


def test_a_stop_asked_inside_the_import_machinery_is_raised_once_the_main_thread_is_out():
    """Regression: a SIGINT during the exports with `workers: 1` hung the job (1 run in ~150): the KeyboardInterrupt,
    raised inside a weakref callback of importlib's module locks, was dropped with the global import lock held, and
    the worker thread's next import waited for it for ever. Now the interrupt waits until the main thread is out of
    the import machinery; elsewhere it is raised at once, as before."""
    signals = Signals()
    inside = _fake_frame("/work/x.py", _fake_frame("<frozen importlib._bootstrap>"))  # a caller is importlib's
    old_alarm = signal.getsignal(signal.SIGALRM)
    try:
        try:
            signals.handle(signal.SIGINT, inside)
        except KeyboardInterrupt:  # caught: pytest would take it for the user's Ctrl-C
            pytest.fail("the interrupt was raised inside the import machinery")
        with pytest.raises(KeyboardInterrupt):  # raised by the retry, in this (ordinary) frame
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                time.sleep(0.001)
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGALRM) is old_alarm and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    with pytest.raises(KeyboardInterrupt):
        Signals().handle(signal.SIGINT, _fake_frame("/work/x.py"))


@pytest.mark.parametrize("second, exits", [("the same signal at once", False), ("the other signal", True),
                                           ("the same signal a second later", True)])
def test_a_second_signal_exits_at_once_unless_it_is_the_firsts_copy(monkeypatch: pytest.MonkeyPatch, second: str,
                                                                    exits: bool) -> None:
    """A second signal exits at once (`os._exit`); the same signal again within SAME_STOP_S is the first's copy to
    the process group (GNU `timeout`), which made the job exit unsaved, and is the same stop."""
    import streamprep.pipeline as pipeline

    clock = iter([100.0, 100.0 + (pipeline.SAME_STOP_S if "later" in second else 0.01)])
    monkeypatch.setattr(pipeline.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(pipeline.os, "_exit", sys.exit)
    signals, stops = Signals(), []
    signals.on_first = lambda: stops.append(1)
    signals.handle(signal.SIGINT)
    try:
        signals.handle(signal.SIGTERM if second == "the other signal" else signal.SIGINT)
        exited = None
    except SystemExit as exc:
        exited = exc.code
    assert (stops, exited, signals.asked.is_set()) == ([1], 1 if exits else None, True)


def test_a_full_disk_at_the_end_neither_undoes_a_run_nor_hides_why_it_failed(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Regressions (a full disk): the audit, written after run.json said complete, raised and the command exited 1
    over a complete run; and when run.json could not take "failed", that second OSError replaced the error that
    ended the run (and the "run failed" line was never logged)."""
    import errno

    from streamprep import audit, pipeline

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(300)))
    cfg = base_config([{"name": "gen", "path": str(src)}], None)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(audit, "write_audit", full)
        assert run_from_dict(cfg, tmp_path / "a", console_log=False).status == "complete"
    assert [e["error"] for e in log_events(tmp_path / "a", "audit not written; `streamprep audit RUN_DIR` writes it")] \
        == ["OSError: [Errno 28] No space left on device"]

    def interrupted(*args, **kwargs):  # a Ctrl-C after run.json said complete
        raise KeyboardInterrupt

    # regression: a stop while the audit was written said "interrupted", exit 1, over a run its run.json called
    # complete (the audit missing); it is the complete run it is, the report skipped and said so
    with monkeypatch.context() as m:
        m.setattr(audit, "write_audit", interrupted)
        assert run_from_dict(cfg, tmp_path / "c", console_log=False).status == "complete"
    assert log_events(tmp_path / "c", "audit not written: interrupted; `streamprep audit RUN_DIR` writes it")
    assert json.loads((tmp_path / "c/run.json").read_text())["status"] == "complete"

    # regression: an audit that failed in a Ray worker (a TypeError: its streamprep another) ended the command, exit
    # 1, with nothing in the log, whose details the error line points at; the log has the cause and its traceback
    with monkeypatch.context() as m:
        m.setattr(audit, "write_audit", lambda *a, **k: (_ for _ in ()).throw(ray_worker_error()))
        with pytest.raises(TypeError):
            run_from_dict(cfg, tmp_path / "d", console_log=False)
    [failed] = [e["error"] for e in log_events(tmp_path / "d", "audit failed")]
    assert failed.startswith("TypeError: build_audit() takes 1 positional argument but 2 were given (in a Ray "
                             "worker, pid 4242)\nray::_Actor.run() (pid=4242, ")
    assert 'line 130, in with_events\n    result = fn(*args)\nTypeError: build_audit()' in failed
    assert "\x1b" not in failed
    real_save = pipeline.Job._save_record

    def save(job, status=None, **extra):
        if status == "failed":
            full()
        real_save(job, status, **extra)

    monkeypatch.setattr(pipeline.Job, "_save_record", save)
    monkeypatch.setattr(pipeline.Job, "_exports", lambda *a: (_ for _ in ()).throw(RuntimeError("exports broke")))
    with pytest.raises(RuntimeError, match="exports broke"):
        run_from_dict(cfg, tmp_path / "b", console_log=False)
    assert [e["error"] for e in log_events(tmp_path / "b", "run failed")] == ["RuntimeError: exports broke"]


def test_a_finished_stage_has_its_seconds_in_run_json_before_the_next_one_starts(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: run.json took the timings only as an attempt started, stopped, failed or completed, so a `kill -9`
    during the exports lost the whole attempt's time and the resumed run's audit (timings summed over attempts)
    gave a throughput ~14x too high. A stage that finishes now writes its seconds to run.json at once."""
    from streamprep import pipeline

    on_disk: list[dict] = []
    exports = pipeline.Job._exports

    def spy(job, *args):  # what a kill -9 here would leave for the resume
        on_disk.append(json.loads((job.run_dir / "run.json").read_text()))
        return exports(job, *args)

    monkeypatch.setattr(pipeline.Job, "_exports", spy)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(300)))
    run_dir = tmp_path / "run"
    run_from_dict(base_config([{"name": "gen", "path": str(src)}], None), run_dir=run_dir, console_log=False)
    [record] = on_disk
    final = json.loads((run_dir / "run.json").read_text())["timings"]
    assert record["status"] == "running" and set(record["timings"]) == {"ingest", "tokenizer", "tokenize"}
    assert record["timings"]["ingest"] > 0
    assert {k: final[k] for k in record["timings"]} == record["timings"] and final["exports"] > 0


def test_a_second_job_at_once_in_the_same_process_is_refused(tmp_path: Path) -> None:
    """Regression: two `run_from_dict` calls from two threads at once swapped the process-wide `streamprep` logger's
    handlers under each other (one run's lines in the other's log, a run without its log, a finished run's
    handler left installed). One job runs at a time in a process; the second is a config error, nothing written."""
    from streamprep import ConfigError, pipeline

    data = tmp_path / "a.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(20, seed=3)))
    cfg = base_config([{"name": "a", "path": str(data)}], None)
    refused = pytest.raises(ConfigError, match=r"^another streamprep job is running in this process \(run_from_dict "
                                               r"from another thread\): one job at a time per process")
    with pipeline._ONE_JOB, refused:  # the lock held as a job running in another thread holds it
        run_from_dict(cfg, run_dir=tmp_path / "run", console_log=False)
    assert not (tmp_path / "run").exists()
    assert run_from_dict(cfg, run_dir=tmp_path / "run", console_log=False).status == "complete"  # released


@pytest.mark.slow
@pytest.mark.parametrize("change", ["appears", "goes"])
def test_an_optional_dataset_whose_input_appears_or_goes_is_named_at_resume(tmp_path: Path, shared_data: Path, change: str) -> None:
    """Regression: an optional dataset whose input appeared (or went missing) since the run started was refused
    as 'config changed since this run started (datasets)' with the YAML byte-identical; the error names it now."""
    from streamprep.config import ConfigError

    data = tmp_path / "b.jsonl"
    data.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in english_docs(20)))
    opt = tmp_path / "opt"
    if change == "goes":
        opt.mkdir()
        (opt / "x.jsonl").write_bytes(data.read_bytes())
    cfg = base_config([{"name": "a", "path": str(opt), "optional": True}, {"name": "b", "path": str(data)}],
                      str(shared_data / PHI2))
    run_dir = tmp_path / "run"
    run_from_dict(cfg, run_dir=run_dir, console_log=False)
    if change == "goes":
        (opt / "x.jsonl").unlink()
        opt.rmdir()
        expect = r"optional dataset a's input was there when this run started and is missing now \("
    else:
        opt.mkdir()
        (opt / "x.jsonl").write_bytes(data.read_bytes())
        expect = r"optional dataset a's input is there now but was missing when this run started: resuming"
    outputs = ("binidx", "ingest", "checkpoints", "receipts", "parquet")
    before = tree_hashes(run_dir, *outputs, names=("run.json", "manifest.json"))
    with pytest.raises(ConfigError, match=expect):
        run_from_dict(cfg, run_dir=run_dir, console_log=False)
    assert tree_hashes(run_dir, *outputs, names=("run.json", "manifest.json")) == before
    # regression: a key changed besides was named only by a second refusal, once the input was put back
    cfg["datasets"][1]["text_field"] = "body"
    with pytest.raises(ConfigError, match=r"; and the config changed \(datasets\[\d\]\.text_field\): resuming would "
                                          r"change the datasets this run holds — put the input back as it was and "
                                          r"the config, or"):
        run_from_dict(cfg, run_dir=run_dir, console_log=False)


def test_an_optional_dataset_added_to_the_config_is_a_config_change_not_an_input_that_appeared(
        tmp_path: Path, shared_data: Path) -> None:
    """Regression: an optional dataset added to the YAML since the run started (its input there all along) was
    refused as "optional dataset a's input is there now but was missing when this run started", sending the user to
    an input that never went. run.json records the optional datasets skipped for want of input
    (`optional_skipped`): one added is the config change it is; a run.json from before that record says both."""
    from streamprep.config import ConfigError

    data = tmp_path / "b.jsonl"
    data.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in english_docs(20)))
    cfg = base_config([{"name": "b", "path": str(data)}], str(shared_data / PHI2))
    run_dir = tmp_path / "run"
    run_from_dict(cfg, run_dir=run_dir, console_log=False)
    record = json.loads((run_dir / "run.json").read_text())
    assert record["optional_skipped"] == []
    cfg["datasets"].insert(0, {"name": "a", "path": str(data), "optional": True})
    with pytest.raises(ConfigError) as refused:
        run_from_dict(cfg, run_dir=run_dir, console_log=False)
    assert str(refused.value) == ("config changed since this run started (datasets); resuming would mix outputs — "
                                  "use a new --run-dir (with --fresh) to start over")
    del record["optional_skipped"]  # as a streamprep before the record wrote it
    (run_dir / "run.json").write_text(json.dumps(record))
    with pytest.raises(ConfigError) as refused:
        run_from_dict(cfg, run_dir=run_dir, console_log=False)
    assert str(refused.value) == (
        "optional dataset a's input is there now and the dataset was not in this run when it started (its input "
        "missing then, or the dataset added to the config since): resuming would change the datasets this run holds "
        "— put the input back as it was (or the config, for a dataset added since), or use a new --run-dir (with "
        "--fresh) to start over")


def test_a_tokenizer_path_that_appears_or_goes_under_if_missing_train_is_named_at_resume(tmp_path: Path) -> None:
    """Regression: with `tokenizer.if_missing: train`, the trained tokenizer saved at tokenizer.path (the same
    bytes) after the run was refused as 'config changed since this run started (tokenizer.path)', the YAML
    byte-identical: the file appearing switched the run from training to loading. The error names that cause."""
    from streamprep.config import ConfigError

    data = tmp_path / "a.jsonl"
    data.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in english_docs(60, seed=3)))
    target = tmp_path / "nonexist" / "trA" / "tokenizer.json"
    cfg = base_config([{"name": "a", "path": str(data)}], str(target))
    cfg["tokenizer"].update(if_missing="train", train={"vocab_size": 400, "min_frequency": 2})
    run_dir = tmp_path / "run"
    assert run_from_dict(cfg, run_dir=run_dir, console_log=False).status == "complete"
    target.parent.mkdir(parents=True)
    target.write_bytes((run_dir / "tokenizer" / "tokenizer.json").read_bytes())
    before = tree_hashes(run_dir, "binidx", "tokenizer", names=("run.json", "manifest.json"))
    tail = "to resume, or use a new --run-dir (with --fresh) to start over"
    with pytest.raises(ConfigError) as refused:
        run_from_dict(cfg, run_dir=run_dir, console_log=False)
    assert str(refused.value) == (f"config: 'tokenizer.path' {target} exists, and this run trained its tokenizer "
                                  f"(tokenizer.if_missing: train) because the path it named when it started did "
                                  f"not: remove it {tail}")
    cfg["output"]["dtype"] = "int32"  # a key changed besides is named with it
    with pytest.raises(ConfigError, match=r"did not; and the config changed \(output\.dtype\): remove it and the "
                                          r"config as it was to resume"):
        run_from_dict(cfg, run_dir=run_dir, console_log=False)
    assert tree_hashes(run_dir, "binidx", "tokenizer", names=("run.json", "manifest.json")) == before
    # and the other way: a run that loaded tokenizer.path, which is gone since
    loaded = tmp_path / "run2"
    del cfg["output"]["dtype"]
    assert run_from_dict(cfg, run_dir=loaded, console_log=False).status == "complete"
    target.unlink()
    with pytest.raises(ConfigError) as refused:
        run_from_dict(cfg, run_dir=loaded, console_log=False)
    assert str(refused.value) == (f"config: 'tokenizer.path' {target}, which this run loaded its tokenizer from, is "
                                  f"missing now (tokenizer.if_missing: train would train another): put it back {tail}")


def test_a_run_dir_too_deep_for_its_files_is_refused_before_anything_is_written(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a run dir of ~4010 characters with a 64-character dataset name failed with "OSError: [Errno 36]
    File name too long: '…/run/checkpoints/nnn…n.json'", exit 1, after run.json, checkpoints/, tokenizer/ and logs/
    were written, and every re-run the same. The longest path the run will write (a temporary name of a dataset's
    file, PATH_MAX) or name (NAME_MAX) is checked at the start: a config error naming the run dir and the dataset."""
    from streamprep import pipeline
    from streamprep.config import ConfigError

    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(50)))
    name = "n" * 64
    cfg = base_config([{"name": name, "path": str(src)}], None)
    deep = tmp_path
    while len(str(deep)) < 3800:
        deep /= "d" * 200
    deep.mkdir(parents=True)
    run = deep / ("r" * (4010 - len(str(deep)) - 1))
    with pytest.raises(ConfigError) as err:
        run_from_dict(cfg, run_dir=run, console_log=False)
    assert str(err.value).startswith(f"run dir {run}: too long for the files of dataset {name!r}: binidx/{name}/"
                                     f".part-99999_text_document.idx.streamprep-tmp.4194304 there would be a path of ")
    assert str(err.value).endswith(" bytes (at most 4095) on its file system; choose a shorter run dir or dataset name")
    assert not run.exists()

    real = os.pathconf
    monkeypatch.setattr(pipeline.os, "pathconf", lambda p, n: 80 if n == "PC_NAME_MAX" else real(p, n))
    with pytest.raises(ConfigError) as err:  # a file system of short names (eCryptfs: 143 bytes)
        run_from_dict(cfg, run_dir=tmp_path / "run", console_log=False)
    assert str(err.value) == (f"run dir {tmp_path / 'run'}: too long for the files of dataset {name!r}: rejects/.{name}"
                              f".jsonl.streamprep-tmp.4194304 there would be a name of 94 bytes (at most 80) on its "
                              f"file system; choose a shorter run dir or dataset name")

    def unknown(path: str, name: str) -> int:  # a file system that does not say (EINVAL)
        raise OSError(22, "Invalid argument")
    monkeypatch.setattr(pipeline.os, "pathconf", unknown)  # regression: the fallback's `sys` was not imported
    assert run_from_dict(cfg, run_dir=tmp_path / "run2", console_log=False).status == "complete"
