"""streamprep.forkserver_preload: the workers' forkserver loads the run's tokenizer once, and every worker forked
from it holds that tokenizer before its first call (gigatoken's and HF's), instead of loading its own."""
from __future__ import annotations

import hashlib
import multiprocessing.forkserver
import os
import signal
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import yaml

from helpers import english_docs
from streamprep import forkserver
from streamprep.forkserver_preload import configured_tokenizer
from streamprep.tokenizer import train_bpe


def _config(path: Path, section: dict | None, workers: int = 2) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"execution": {"workers": workers}, **({"tokenizer": section} if section else {})}))
    return path


def test_the_configured_tokenizer_is_the_local_file_relative_to_the_config(tmp_path):
    tok = tmp_path / "tok" / "tokenizer.json"
    tok.parent.mkdir()
    tok.write_text("{}")
    found = configured_tokenizer(str(_config(tmp_path / "conf" / "c.yaml", {"path": "../tok", "backend": "hf"})))
    assert found is not None and found[0].resolve() == tok.resolve() and found[1] == "hf"
    found = configured_tokenizer(str(_config(tmp_path / "c2.yaml", {"path": str(tok)})))
    assert found == (tok, "auto")
    assert configured_tokenizer(str(_config(tmp_path / "c3.yaml", {"path": "missing/tokenizer.json",
                                                                   "if_missing": "train"}))) is None
    assert configured_tokenizer(str(_config(tmp_path / "c4.yaml", None))) is None


def _held() -> tuple[list[str], list[str]]:
    """In a worker: the files (SHA-256) whose gigatoken and HF tokenizers this process holds."""
    from streamprep import backends

    return sorted(backends._built), sorted(backends._loaded)


def test_workers_forked_after_start_for_hold_the_configured_tokenizer(tmp_path):
    tok = tmp_path / "tokenizer.json"
    train_bpe(english_docs(300), vocab_size=400, min_frequency=2).save(str(tok))
    cfg = _config(tmp_path / "c.yaml", {"path": "tokenizer.json"})
    forkserver.stop()  # a server an earlier test started would not load it: it loads once, as it starts
    try:
        assert forkserver.start_for(str(cfg))
        assert forkserver.CONFIG_ENV not in os.environ  # only the server was started with it
        with ProcessPoolExecutor(1, mp_context=forkserver.context()) as pool:
            built, loaded = pool.submit(_held).result(timeout=60)
    finally:
        forkserver.stop()
    key = hashlib.sha256(tok.read_bytes()).hexdigest()
    assert built == [key] and loaded == [key]


def test_a_tokenizer_that_fails_to_load_leaves_the_server_serving(tmp_path):
    (tmp_path / "tokenizer.json").write_text("not json")
    cfg = _config(tmp_path / "c.yaml", {"path": "tokenizer.json"})
    forkserver.stop()
    try:
        assert forkserver.start_for(str(cfg))
        with ProcessPoolExecutor(1, mp_context=forkserver.context()) as pool:
            assert pool.submit(_held).result(timeout=60) == ([], [])
    finally:
        forkserver.stop()


def test_a_tokenizer_that_panics_on_load_leaves_the_forkserver_alive(tmp_path, shared_data, monkeypatch):
    """tokenizers panics loading phi-2 with model.continuing_subword_prefix "##" (a BaseException): the forkserver's
    preload raised it and died; the job's own load names the file (config error)."""
    import json

    from streamprep.forkserver_preload import load_configured

    spec = json.loads((shared_data / "tokenizers/phi-2/tokenizer.json").read_text())
    spec["model"]["continuing_subword_prefix"] = "##"
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    monkeypatch.setenv(forkserver.CONFIG_ENV, str(_config(tmp_path / "c.yaml", {"path": str(tmp_path)})))
    load_configured()  # returns, as for any other file it cannot load



def test_only_the_forkserver_ignores_sigterm_a_process_forked_from_it_ends_by_it(tmp_path):
    """Regression: the forkserver ignores SIGTERM (a stop of the job's whole process group leaves it to the job's
    process), and every process forked from it inherited that: a library caller's own process forked from the
    process-wide server after a job stayed alive after `terminate()` (its `Pool.terminate()` hung for ever), and so
    did a pool worker terminated by `LocalExecutor.close` before its initializer ran (here: at once after its
    start). Only the server ignores it."""
    forkserver.stop()
    ctx, procs = forkserver.context(), []
    try:
        assert forkserver.start_for(str(_config(tmp_path / "c.yaml", None)))
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        for _ in range(5):
            procs.append(ctx.Process(target=time.sleep, args=(60,), daemon=True))
            procs[-1].start()
            os.kill(server, signal.SIGTERM)  # the server's copy of a group's SIGTERM
            procs[-1].terminate()
            procs[-1].join(10)
            assert procs[-1].exitcode == -signal.SIGTERM
        assert multiprocessing.forkserver._forkserver._forkserver_pid == server  # alive, serving: the same server
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
        forkserver.stop()


def _signals(pid: int, field: str) -> set[int]:
    """The signals of `field` (SigBlk, SigIgn) in /proc/PID/status."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            mask = int(line.split()[1], 16)
            return {sig for sig in range(1, 65) if mask >> (sig - 1) & 1}
    raise AssertionError(f"no {field} for {pid}")


def test_the_forkserver_starts_deaf_to_sigint_and_sigterm_and_its_children_hear_them():
    """Regression: Python's forkserver ignores SIGINT only once its preload is imported (~0.85 s), and SIGTERM was
    blocked by the last module of it: a Ctrl-C in the CLI's first second printed a KeyboardInterrupt traceback from
    the server's imports beside the job's one line, and a SIGTERM to the job's process group then ended the server.
    It starts with both blocked; a process forked from it has neither blocked."""
    forkserver.stop()
    try:
        ctx = forkserver.context()
        multiprocessing.forkserver.ensure_running()  # started by `context` already
        server = multiprocessing.forkserver._forkserver._forkserver_pid
        blocked = _signals(server, "SigBlk")  # at once: its preload is still being imported
        os.kill(server, signal.SIGINT)  # a Ctrl-C's and a group stop's copies, as it imports
        os.kill(server, signal.SIGTERM)
        with ProcessPoolExecutor(1, mp_context=ctx) as pool:
            child = pool.submit(os.getpid).result(timeout=60)
            child_blocked = _signals(child, "SigBlk")
        assert multiprocessing.forkserver._forkserver._forkserver_pid == server  # alive, serving: the same server
    finally:
        forkserver.stop()
    assert {signal.SIGINT, signal.SIGTERM} <= blocked
    assert not {signal.SIGINT, signal.SIGTERM} & child_blocked
