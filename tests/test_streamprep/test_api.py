"""streamprep as a library (`run_from_dict`): called from async code or a worker thread, with Python values in the
config, leaving the caller's event loop, signal handlers and logging as they were, and a Ctrl-C a KeyboardInterrupt."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog

import streamprep
from helpers import REPO, base_config, english_docs, tree_hashes
from streamprep import config as configmod, run_from_dict

OUTPUTS = ("ingest", "rejects", "binidx", "receipts", "parquet")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("api") / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(300)))
    return src


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The outputs of a plain call from the main thread, with no loop running."""
    run_dir = tmp_path_factory.mktemp("api-ref") / "run"
    assert run_from_dict(base_config([{"name": "gen", "path": str(corpus)}], None), run_dir,
                         console_log=False).status == "complete"
    return tree_hashes(run_dir, *OUTPUTS)


def test_a_call_from_a_running_event_loop_works_and_keeps_the_callers_loop(corpus: Path, reference: dict,
                                                                           tmp_path: Path) -> None:
    """Regression: inside a running loop (a Jupyter cell, an async service) `asyncio.run` refused ("cannot be
    called from a running event loop") and left run.json failed; and a call from the main thread cleared the
    caller's current event loop. The ingest's loop now runs in a thread of its own."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        async def job() -> str:
            return run_from_dict(base_config([{"name": "gen", "path": str(corpus)}], None), tmp_path / "in-loop",
                                 console_log=False).status

        assert loop.run_until_complete(job()) == "complete"
        assert asyncio.get_event_loop() is loop  # still the caller's
    finally:
        asyncio.set_event_loop(None)
        loop.close()
    assert tree_hashes(tmp_path / "in-loop", *OUTPUTS) == reference


def test_a_call_from_another_thread_works_and_leaves_the_signals_alone(corpus: Path, reference: dict,
                                                                       tmp_path: Path) -> None:
    """Regression: from a worker thread (`asyncio.to_thread`, a web server's pool) installing the job's signal
    handlers raised "signal only works in main thread", after run.json said "running" (status: crashed)."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with ThreadPoolExecutor(1) as pool:
        result = pool.submit(run_from_dict, base_config([{"name": "gen", "path": str(corpus)}], None),
                             tmp_path / "thread", console_log=False).result(300)
    assert result.status == "complete"
    assert json.loads((tmp_path / "thread/run.json").read_text())["status"] == "complete"
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert tree_hashes(tmp_path / "thread", *OUTPUTS) == reference


def test_the_callers_logging_is_as_it_was_after_a_run(corpus: Path, tmp_path: Path) -> None:
    """Regression: a run replaced the application's structlog set-up for good and left its run log's handler on the
    `streamprep` logger (the file open; a later run's first lines went to the earlier run's log)."""
    structlog.reset_defaults()
    before = structlog.get_config()
    root = logging.getLogger("streamprep")
    state = (list(root.handlers), root.level, root.propagate)
    run_from_dict(base_config([{"name": "gen", "path": str(corpus)}], None), tmp_path / "run", console_log=False)
    assert structlog.get_config() == before
    assert (list(root.handlers), root.level, root.propagate) == state
    assert (tmp_path / "run/logs/streamprep.log").stat().st_size > 0


def test_python_values_in_a_config_dict_mean_what_their_yaml_does(tmp_path: Path) -> None:
    """Regression: a `Path`, a tuple or a numpy integer was refused ("must be a string, got PosixPath")."""
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"text": "x"}) + "\n")
    yaml_like = base_config([{"name": "gen", "path": str(src)}], None)
    yaml_like["output"] = {"shard_records": 200, "parquet": {"length_buckets": [128, 256]}}
    python = base_config([{"name": "gen", "path": src}], None)
    python["output"] = {"shard_records": np.int64(200), "parquet": {"length_buckets": (np.int32(128), 256)}}
    assert configmod.load(python).to_dict() == configmod.load(yaml_like).to_dict()


def test_numpy_arrays_in_a_config_dict_are_lists_and_one_holding_itself_is_refused(tmp_path: Path) -> None:
    """Regression: a numpy array went through `.item()`: `np.array([128, 256])` for `length_buckets` (or an array
    of datasets, an empty one) raised "ValueError: can only convert an array of size 1", naming no key, and
    `weight: np.array([1.0])` was taken as 1.0; a dict or list holding itself was a RecursionError. An array is its
    list now, checked as any list is; a config holding itself is a ConfigError naming the key."""
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"text": "x"}) + "\n")
    yaml_like = base_config([{"name": "gen", "path": str(src)}], None)
    yaml_like["output"] = {"shard_records": 200, "parquet": {"length_buckets": [128, 256]}}
    yaml_like["quality"]["required_metadata"] = ["url"]
    python = base_config([], None)
    python["datasets"] = np.array([{"name": "gen", "path": src}])
    python["output"] = {"shard_records": 200, "parquet": {"length_buckets": np.array([128, 256])}}
    python["quality"]["required_metadata"] = np.array(["url"])
    assert configmod.load(python).to_dict() == configmod.load(yaml_like).to_dict()

    def refused(change: Any) -> str:
        raw = base_config([{"name": "gen", "path": str(src)}], None)
        change(raw)
        with pytest.raises(configmod.ConfigError) as err:
            configmod.load(raw)
        return str(err.value)

    assert refused(lambda raw: raw["datasets"][0].update(weight=np.array([1.0]))) == \
        "config: 'datasets[0].weight' must be a number, got list [1.0]"
    assert refused(lambda raw: raw["run"].update(seed=np.array([], dtype=np.int64))) == \
        "config: 'run.seed' must be an integer, got list []"
    assert refused(lambda raw: raw["run"].update(me=raw)) == \
        "config: 'run.me' is a mapping or list that holds it: a config cannot contain itself"
    loop: list[Any] = ["text"]
    loop.append(loop)
    assert refused(lambda raw: raw.update(quality={"required_fields": loop})) == \
        "config: 'quality.required_fields[1]' is a mapping or list that holds it: a config cannot contain itself"


def test_what_the_api_raises_is_importable_from_the_package() -> None:
    assert streamprep.ConfigError is configmod.ConfigError
    assert issubclass(streamprep.Interrupted, KeyboardInterrupt)
    with pytest.raises(streamprep.ConfigError, match="unknown key 'nope'"):
        run_from_dict({"nope": 1})


def test_a_run_dir_holding_a_nul_is_a_config_error_with_nothing_written(tmp_path: Path) -> None:
    """Regression: `run_dir="runs/a\\0b"` raised ValueError: embedded null byte, not the ConfigError the API promises
    for a bad path (a config's own paths said so already)."""
    src = tmp_path / "docs.jsonl"
    src.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(streamprep.ConfigError, match=r"^run dir .*/a\\x00b: embedded null byte$"):
        run_from_dict(base_config([{"name": "gen", "path": str(src)}], None), tmp_path / "a\0b", console_log=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl"]


SCRIPT = """
import json, sys
import streamprep
from helpers import base_config
cfg = base_config([{"name": "gen", "path": sys.argv[1]}], None)
cfg["execution"]["batch_records"] = 16
try:
    streamprep.run_from_dict(cfg, sys.argv[2], console_log=False)
    print("finished")
except Exception as exc:  # what a caller's loop over jobs catches: a Ctrl-C must not end up here
    print("swallowed", type(exc).__name__)
except KeyboardInterrupt as exc:
    print("interrupted", type(exc).__name__)
"""


@pytest.mark.slow
def test_a_ctrl_c_during_a_library_call_is_a_keyboard_interrupt(tmp_path: Path) -> None:
    """Regression: the run's `Interrupted` was a RuntimeError, so a caller's `except Exception` swallowed a Ctrl-C
    and went on to its next job. It is a KeyboardInterrupt, with the progress saved; a resume completes."""
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(20_000)))
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(src), str(run_dir)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not list((run_dir / "checkpoints").glob("gen.json")) and time.monotonic() < deadline:
        time.sleep(0.05)  # ingest is under way: its first checkpoint is written
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert out.strip() == "interrupted Interrupted", (out, err[-2000:])
    assert json.loads((run_dir / "run.json").read_text())["status"] == "interrupted"
    cfg = base_config([{"name": "gen", "path": str(src)}], None)
    cfg["execution"]["batch_records"] = 16
    assert run_from_dict(cfg, run_dir, console_log=False).status == "complete"


UNGUARDED = """
import sys
import streamprep
from helpers import base_config
cfg = base_config([{"name": "gen", "path": sys.argv[1]}], None)
cfg["execution"]["workers"] = 2
print(streamprep.run_from_dict(cfg, sys.argv[2], console_log=False).status)
"""


@pytest.mark.slow
def test_a_job_at_a_scripts_top_level_says_to_guard_it(corpus: Path, tmp_path: Path) -> None:
    """Regression: a script calling run_from_dict at its top level, without `if __name__ == "__main__":`, started
    the job again in every worker as it imported the script; each failed on the run dir's lock ("in use by pid"),
    and the job said a dedup holder process had ended. The workers now say what to change; guarded, it runs. Such a
    call, a plain statement of the script's, is a ConfigError up front, nothing written (the job said "a dedup
    holder process ended …; re-run the same command to resume", a failed run left behind). (And
    the guarded run's "starting afresh" line went to stdout before the run's logging was set up, console_log or
    not: the output is now the script's own.)"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    script = tmp_path / "job.py"
    script.write_text(UNGUARDED)
    proc = subprocess.run([sys.executable, str(script), str(corpus), str(tmp_path / "run")], env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode != 0 and "in use by pid" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"streamprep.config.ConfigError: config: 'execution.workers' 2 starts processes, which run the job's script "
        f"again as they start, and {script} starts the job at its top level (line 7): put the call under "
        f'`if __name__ == "__main__":`, or use workers: 1'), proc.stderr[-3000:]
    assert not (tmp_path / "run").exists()  # it was a failed run, "re-run the same command to resume"
    script.write_text(UNGUARDED.replace("print(", "try:\n    print(") + "finally:\n    pass\n")  # not judged up front
    proc = subprocess.run([sys.executable, str(script), str(corpus), str(tmp_path / "run")], env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.returncode != 0 and "in use by pid" not in proc.stderr
    assert 'RuntimeError: a streamprep job was started while a worker process imported the script that starts it: ' \
           'put the call under `if __name__ == "__main__":`' in proc.stderr, proc.stderr[-3000:]
    lines = UNGUARDED.strip().splitlines()
    script.write_text("\n".join(lines[:-1] + ['if __name__ == "__main__":', "    " + lines[-1]]) + "\n")
    proc = subprocess.run([sys.executable, str(script), str(corpus), str(tmp_path / "run")], env=env, text=True,
                          capture_output=True, timeout=300)
    assert proc.stdout.strip() == "complete", proc.stderr[-3000:]


def test_a_job_with_workers_from_a_script_read_from_stdin_is_refused_up_front(corpus: Path, tmp_path: Path) -> None:
    """Regression: `python - < job.py` with `workers: 2`: each worker ran the script again from `<stdin>` in the
    current folder, FileNotFoundError tracebacks, then "a dedup holder process ended; re-run the same command to
    resume", a re-run the same. Now a ConfigError says why and what to do, nothing written."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-", str(corpus), str(tmp_path / "run")], input=UNGUARDED, env=env,
                          cwd=tmp_path, text=True, capture_output=True, timeout=120, check=False)
    assert proc.stderr.splitlines()[-1] == (
        f"streamprep.config.ConfigError: config: 'execution.workers' 2 starts processes, which run the job's script "
        f"again from its file, and {tmp_path}/<stdin> is not one (a script read from stdin?): save the script and "
        f"run the file, or use workers: 1"), proc.stderr[-3000:]
    assert "FileNotFoundError" not in proc.stderr and not (tmp_path / "run").exists()


def test_a_signal_before_the_ingest_loop_is_up_stops_it_when_it_is(corpus: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The ingest's loop starts in its own thread: a SIGINT that lands before the loop took over the stop is kept
    and stops it as soon as it is up, with the progress saved."""
    from streamprep import pipeline

    real = pipeline.IngestContext.of

    def of(*args, **kwargs):  # the loop is starting: a signal arrives now
        signal.raise_signal(signal.SIGINT)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline.IngestContext, "of", of)
    with pytest.raises(streamprep.Interrupted):
        run_from_dict(base_config([{"name": "gen", "path": str(corpus)}], None), tmp_path / "run", console_log=False)
    assert json.loads((tmp_path / "run/run.json").read_text())["status"] == "interrupted"
    assert [t.name for t in threading.enumerate() if t.name == "ingest-loop"] == []
