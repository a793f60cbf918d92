"""The job's executor on this machine: order, errors, a dead worker process, and a shard task retried after one."""
from __future__ import annotations

import math
import os
import signal
import threading
import time
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import orjson
import psutil
import pytest

from helpers import PHI2, english_docs
from streamprep import executor as executors
from streamprep.executor import LocalExecutor


def _processes(ex: LocalExecutor, n: int) -> list[int]:
    """The pool's `n` processes, once all have started. The pool starts one for a call only when none is idle, so
    a first worker that answered its warm-up call before the second was sent leaves it unstarted (a busy box):
    warm again until all are up."""
    deadline = time.monotonic() + 30
    while len(ex.processes) < n and time.monotonic() < deadline:
        ex.warm()
        time.sleep(0.02)
    assert len(ex.processes) == n
    return ex.processes


@pytest.mark.parametrize("workers", [1, 2])
def test_map_gives_results_in_job_order_and_a_calls_error_is_its_own(workers: int) -> None:
    with LocalExecutor(workers) as ex:
        assert list(ex.map(math.factorial, range(40))) == [math.factorial(n) for n in range(40)]
        with pytest.raises(ValueError, match="math domain error"):
            ex.submit(math.sqrt, -1).result(30)
        assert ex.submit(math.sqrt, 16).result(30) == 4.0  # the worker survived its call's error
        assert ex.restarts == 0


def test_a_call_its_caller_cancelled_and_a_worker_killed_leave_no_call_unanswered() -> None:
    """Regression (139f897, reverted in round 52): cancelling the pool's own future of a call its caller dropped left
    a cancelled work item in the pool; a worker killed then made the pool's manager thread fail on it
    (`InvalidStateError: CANCELLED`, Python 3.11) before it broke the calls after it, which never answered: a job
    waited for ever. A dropped call of a pool is only the job's future cancelled; every other call answers."""
    with LocalExecutor(2) as ex:
        victim, _ = _processes(ex, 2)
        calls = [ex.submit(time.sleep, 0.3) for _ in range(20)]
        for call in calls[10:15]:
            assert call.cancel()
        os.kill(victim, signal.SIGKILL)
        live = calls[:10] + calls[15:]
        for call in live:
            assert call.result(60) is None


def test_workers_have_the_environment_of_the_job_not_of_the_forkserver(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a pool's workers are forked from the forkserver, which keeps the environment of the moment it
    started (a library caller's first job): a variable set since (HF_TOKEN for a gated repo) never reached them, so a
    later job downloaded anonymously (in the suite, a gated-repo test saw 401 where its token gets 403)."""
    with LocalExecutor(2) as ex:  # the forkserver is up from here on, if it was not before
        assert ex.submit(os.getenv, "STREAMPREP_TEST_LATE").result(60) is None
    monkeypatch.setenv("STREAMPREP_TEST_LATE", "set after the forkserver started")
    monkeypatch.delenv("HOME")
    with LocalExecutor(2) as ex:
        assert ex.submit(os.getenv, "STREAMPREP_TEST_LATE").result(60) == "set after the forkserver started"
        assert ex.submit(os.getenv, "HOME").result(60) is None


def test_worker_processes_freeze_their_imports_and_collect_young_objects_rarely() -> None:
    """Regression (perf: CPython's collector was ~6 % of a short-document job's CPU): a pool worker starts with
    what it loaded frozen out of the collector's walks and a young generation of GC_YOUNG objects."""
    import gc

    with LocalExecutor(2) as ex:
        threshold = ex.submit(gc.get_threshold).result(60)
        frozen = ex.submit(gc.get_freeze_count).result(60)
    assert threshold[0] == executors.GC_YOUNG
    assert frozen > 10_000  # the preloaded modules (quality, pyarrow, gigatoken, ...)


def test_a_killed_worker_process_costs_its_calls_a_retry_on_a_new_pool() -> None:
    """kill -9 of one worker mid-call breaks the whole pool: every call it held runs again on a new one and
    answers, none is lost; the workers are niced and new ones are too."""
    with LocalExecutor(2) as ex:
        victim, other = _processes(ex, 2)
        calls = [ex.submit(time.sleep, 0.5) for _ in range(4)] + [ex.submit(os.getpid)]
        time.sleep(0.2)  # both workers are inside a call
        os.kill(victim, signal.SIGKILL)
        assert [c.result(60) for c in calls[:4]] == [None] * 4
        ran_on = calls[4].result(60)
        assert ex.restarts == 1 and victim not in ex.processes and ran_on in ex.processes
        assert {psutil.Process(p).nice() for p in ex.processes} == {os.nice(0) + executors.WORKER_NICE}
    assert not psutil.pid_exists(other) or psutil.Process(other).status() == psutil.STATUS_ZOMBIE


def test_a_killed_forkserver_leaves_no_worker_of_the_broken_pool_behind() -> None:
    """Regression: kill -9 of the forkserver fired every worker's sentinel, so the pool was broken with its workers
    alive; it was replaced, and they were left, blocked on its abandoned result queue, holding the resource
    tracker's pipe: the command hung at exit (or mid-ingest) after `run complete`. They are killed with it."""
    import multiprocessing.forkserver

    with LocalExecutor(2) as ex:
        old = _processes(ex, 2)
        calls = [ex.submit(time.sleep, 0.5) for _ in range(4)]
        time.sleep(0.2)  # both workers are inside a call
        os.kill(multiprocessing.forkserver._forkserver._forkserver_pid, signal.SIGKILL)
        # one restart, or two when the new pool's first start still found the dying forkserver (refused: the
        # next test), as once in the fast lane beside six busy processes
        assert [c.result(60) for c in calls] == [None] * 4 and ex.restarts in (1, 2)
        assert ex.submit(os.getpid).result(60) in ex.processes and not set(old) & set(ex.processes)
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in old) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in old)


def test_a_killed_forkserver_as_the_job_stops_leaves_no_worker_behind() -> None:
    """Regression: with the job's stop asked, the pool broken by a killed forkserver read its workers' exit codes
    (one dead by SIGTERM waits for the stop); once the forkserver is gone a live worker's reads 255, and its
    terminate at close was then skipped by multiprocessing: the workers lived on, blocked on the abandoned call
    queue, for as long as the job's process (a library caller's). They are signalled by pid."""
    import multiprocessing.forkserver

    ex = LocalExecutor(2)
    ex.stop_asked = threading.Event()
    old = _processes(ex, 2)
    calls = [ex.submit(time.sleep, 0.5) for _ in range(2)]
    time.sleep(0.2)  # both workers are inside a call
    ex.stop_asked.set()
    os.kill(multiprocessing.forkserver._forkserver._forkserver_pid, signal.SIGKILL)
    for call in calls:
        with pytest.raises(BrokenProcessPool):
            call.result(60)
    assert ex.restarts == 0  # the job is stopping: no new pool
    ex.close(wait=False)
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in old) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in old)


@pytest.mark.parametrize("error", [ConnectionRefusedError(111, "Connection refused"), EOFError("unexpected EOF")])
def test_a_worker_that_cannot_start_costs_its_call_a_retry_on_a_new_pool(error: Exception) -> None:
    """Regression (CI, once): right after the forkserver was killed, multiprocessing still took it for alive and a new
    worker's start was refused (ConnectionRefusedError) inside the broken pool's callback: the call was lost and its
    caller waited for ever. It runs again on a new pool, a moment later. So when the dying forkserver closed the
    connection before it answered the worker's pid (EOFError: a job hung, or ended on a bare 'EOFError: unexpected
    EOF', 4 of 8 forkserver kills in review hunt R)."""
    with LocalExecutor(2) as ex:
        _processes(ex, 2)
        real = ex._pool.submit

        def refused(*args, **kwargs):
            raise error

        ex._pool.submit = refused
        assert ex.submit(os.getpid).result(60) in ex.processes and ex.restarts == 1
        assert real is not ex._pool.submit


def test_a_call_run_again_after_its_worker_died_runs_its_again_function() -> None:
    """A call whose worker died runs `fn.again` (`engines.local.run_local_again` drops what the dead attempt left,
    so a first attempt need not scan the output folders); a first attempt and a call without one run `fn`."""
    from helpers import nap

    with LocalExecutor(2) as ex:
        victim = _processes(ex, 2)[0]
        calls = [ex.submit(nap, 0.5) for _ in range(2)]
        time.sleep(0.2)  # both workers are inside a call
        os.kill(victim, signal.SIGKILL)
        assert [c.result(60) for c in calls] == ["again", "again"] and ex.restarts == 1
        assert ex.submit(nap, 0).result(60) == "first"
    assert executors.again(math.sqrt) is math.sqrt


def test_a_pool_that_keeps_dying_fails_its_calls_after_the_restart_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executors, "POOL_RESTARTS", 1)
    with LocalExecutor(2) as ex:
        for expect_retry in (True, False):
            victim = _processes(ex, 2)[0]
            call = ex.submit(time.sleep, 0.5)
            time.sleep(0.2)
            os.kill(victim, signal.SIGKILL)
            if expect_retry:
                assert call.result(60) is None and ex.restarts == 1
            else:
                with pytest.raises(BrokenProcessPool):
                    call.result(60)


def test_a_call_that_kills_its_worker_twice_fails_and_the_calls_beside_it_run_on() -> None:
    """Regression: a call that ends the process running it (a plug-in gate's os._exit on one record) broke every
    pool it ran on, POOL_RESTARTS + 1 times, and then it and every call beside it failed with only 'BrokenProcessPool:
    A process in the process pool was terminated abruptly'. The worker's slot names the call it died running: that
    call fails at its second death with WorkerDied (its exit codes), and the others run again on a new pool."""
    from helpers import exit_in_worker

    with LocalExecutor(2) as ex:
        _processes(ex, 2)
        poison = ex.submit(exit_in_worker, 3)
        beside = ex.submit(time.sleep, 0.3)
        with pytest.raises(BrokenProcessPool) as failed:
            poison.result(60)
        assert beside.result(60) is None
    assert type(failed.value).__name__ == "WorkerDied" and ex.restarts == 2
    assert "a worker process died running this call, 2 times (exit code 3, 3)" in str(failed.value)


@pytest.mark.slow  # tokenizes a part twice
def test_a_shard_task_whose_worker_dies_is_tokenized_again_to_the_same_bytes(tmp_path: Path,
                                                                              shared_data: Path) -> None:
    """`engine: local` tokenizes on the executor's workers: when one dies mid-shard the task runs again on the
    new pool, drops the temporary files the dead writer left, and writes the bytes of an undisturbed run."""
    from streamprep import tokenize
    from streamprep.engines.local import LocalEngine

    texts = english_docs(6000)

    def task(run: Path) -> tokenize.ShardTask:
        part = run / "ingest/d/part-00000.jsonl"
        part.parent.mkdir(parents=True)
        part.write_bytes(b"".join(orjson.dumps({"text": t}) + b"\n" for t in texts))
        return tokenize.make_task(run, "d", "train", part, shared_data / PHI2, "sha256:x", 50256, "uint16")

    ref, hit = task(tmp_path / "ref"), task(tmp_path / "hit")
    with LocalExecutor(1) as ex:
        LocalEngine(ex).run([ref])
    killed: list[int] = []
    with LocalExecutor(2) as ex:
        _processes(ex, 2)
        bin_dir = Path(hit.prefix).parent

        def kill_the_writer() -> None:
            deadline = time.monotonic() + 60
            while not killed and time.monotonic() < deadline:
                if bin_dir.exists() and any(p.name.startswith(".") for p in bin_dir.iterdir()):  # a tmp file: writing
                    pid = int(next(p for p in bin_dir.iterdir() if p.name.startswith(".")).name.rsplit(".", 1)[1])
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                time.sleep(0.002)

        killer = threading.Thread(target=kill_the_writer)
        killer.start()
        [result] = LocalEngine(ex).run([hit])
        killer.join()
        assert killed and ex.restarts == 1 and result["skipped"] is False
    assert Path(hit.prefix + ".bin").read_bytes() == Path(ref.prefix + ".bin").read_bytes()
    assert Path(hit.prefix + ".idx").read_bytes() == Path(ref.prefix + ".idx").read_bytes()
    assert sorted(p.name for p in Path(hit.prefix).parent.iterdir()) == ["part-00000_text_document.bin",
                                                                           "part-00000_text_document.idx"]


@pytest.mark.parametrize("workers", [1, 2])
def test_what_a_worker_logs_reaches_the_run_log(tmp_path: Path, workers: int) -> None:
    """Regression: a pool process writes no run log, and its events went to its stdout: with `workers` > 1 a unit's
    "hub request retried" or a backend's fallback never reached logs/streamprep.log. Its answers carry them, a
    failed call's too, and the job's process writes them under their component with the worker's pid and time."""
    from helpers import log_in_worker
    from streamprep import logs

    logs.configure(tmp_path, console=False)
    try:
        with LocalExecutor(workers) as ex:
            pids = [ex.submit(log_in_worker, n).result(60) for n in range(3)]
            with pytest.raises(ValueError, match="probe 7 failed"):
                ex.submit(log_in_worker, 7, True).result(60)
    finally:
        logs.configure(None, console=False)
    lines = [orjson.loads(line) for line in (tmp_path / "logs/streamprep.log").read_bytes().splitlines()]
    probes = [(e["event"], e["n"], e["level"], e["component"]) for e in lines if e["event"].startswith("probe")]
    assert probes == [("probe event", 0, "warning", "probe"), ("probe event", 1, "warning", "probe"),
                      ("probe event", 2, "warning", "probe"), ("probe event", 7, "warning", "probe"),
                      ("probe failing", 7, "info", "probe")]
    if workers == 1:  # the job's own thread logs as the job does
        assert set(pids) == {os.getpid()} and all("worker" not in e for e in lines)
    else:
        assert os.getpid() not in pids
        assert [e["worker"] for e in lines if e["event"] == "probe event"][:3] == pids
        assert all(e["worker_time"] <= e["timestamp"] for e in lines if e["event"].startswith("probe"))


NO_GIGATOKEN = """
import math
from streamprep.executor import LocalExecutor
with LocalExecutor(2) as ex:
    print("R", ex.submit(math.factorial, 5).result(60), ex.restarts)
"""


@pytest.mark.parametrize("error", ["ModuleNotFoundError('No module named gigatoken')",
                                   "RuntimeError('gigatoken: CPU lacks AVX2')"])
def test_a_preloaded_module_that_cannot_be_imported_is_skipped_by_the_workers(tmp_path: Path, error: str) -> None:
    """gigatoken missing (or broken): every worker's start imported every forkserver.PRELOAD module, so each died and
    every job with workers >= 2 failed ('BrokenProcessPool', no cause named), even with `backend: hf`. One whose
    import raises anything else (a RuntimeError) killed the forkserver itself, which skips only an ImportError
    (`EOFError: unexpected EOF`): gigatoken and awkward are imported by `forkserver_preload`, any failure skipped."""
    import subprocess
    import sys

    from helpers import REPO

    (tmp_path / "gigatoken").mkdir()
    (tmp_path / "gigatoken" / "__init__.py").write_text(f"raise {error}\n")
    out = subprocess.run([sys.executable, "-c", NO_GIGATOKEN], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"})
    assert "R 120 0" in out.stdout.splitlines(), out.stderr[-800:]
