"""streamprep as a citizen of a shared, long-lived Ray cluster (docs/multi-node.md): a job leaves nothing behind
however it ends, two jobs run side by side, and a lost node costs a retry, not a rerun.

One two-node `ray.cluster_utils.Cluster` serves the whole module (a start-up costs ~10 s): a head and a second
raylet, 1 CPU each (Xenna 0.3 runs a 1-CPU task on every node, so a CPU-less head cannot host it). Tests that
remove the second node add one back.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from helpers import PHI2, base_config, english_docs, tree_hashes

OUTPUTS = ("ingest", "binidx", "receipts", "parquet", "tokenizer")
RAY_AGENTS = ("ray::DashboardAgent", "ray::RuntimeEnvAgent", "ray::IDLE")  # Ray's own, per node
GONE_WITHIN_S = 10.0
JOB_TIMEOUT_S = 240
STOP_WITHIN_S = 20.0  # a stop's exit, signal to exit (docs/operations.md: within seconds)


@pytest.fixture(scope="module")
def cluster():
    """A head and one worker node, 1 CPU each; everything it started is reaped at the end."""
    from ray.cluster_utils import Cluster

    from streamprep.ray_cluster import RAY_ENV, ray_processes, stop_and_reap

    os.environ.update(RAY_ENV)
    # Ray's state API takes RAY_ADDRESS over the address it is given: set by an earlier test's connection to the
    # session's cluster, it made every query here ask that cluster (regression: CI saw no actor of these jobs)
    unset = {k: os.environ.pop(k) for k in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS") if k in os.environ}
    before = {p.pid for p in ray_processes()}  # the session fixture's cluster, if up, is not ours to stop
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": True, "dashboard_port": port})
    c.dashboard_url = f"http://127.0.0.1:{port}"
    c.before = before  # processes of Ray's that were up before this module's cluster (the session's): not ours
    try:
        c.add_node(num_cpus=1)
        c.wait_for_nodes()
        yield c
    finally:
        os.environ.update(unset)
        stop_and_reap(c.shutdown, [p for p in ray_processes() if p.pid not in before])
        for p in psutil.process_iter(["cmdline"]):  # nothing titled ray:: may outlive the module (ours only)
            if p.pid not in before and (p.info["cmdline"] or [""])[0].startswith("ray::"):
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass


def _nodes_of(c) -> dict[str, object]:
    return {n.node_id: n for n in c.worker_nodes}


def _restore(c, n: int = 1) -> None:
    """Back to `n` worker nodes (after a test removed some)."""
    while len(c.worker_nodes) < n:
        c.add_node(num_cpus=1)
    c.wait_for_nodes()


def _source(tmp: Path, n: int, files: int = 4) -> dict:
    """`files` JSONL files of English documents, one dataset."""
    src = tmp / "in"
    src.mkdir(exist_ok=True)
    docs = english_docs(n, seed=11)
    per = -(-n // files)
    for i in range(files):
        (src / f"f{i}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs[i * per:(i + 1) * per]))
    return {"name": "gen", "path": str(src)}


def _config(tmp: Path, n: int = 1200, shard_records: int = 50, **execution: object) -> dict:
    cfg = base_config([_source(tmp, n)], None, output={"shard_records": shard_records})
    cfg.pop("quality")  # the default gates
    cfg["execution"].update(**execution)
    return cfg


def _command(cfg: dict, cfg_path: Path, run_dir: Path) -> tuple[list[str], dict[str, str]]:
    import yaml

    cfg_path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return [sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path), "--run-dir", str(run_dir)], env


def _start(cfg: dict, tmp: Path, run_dir: Path) -> subprocess.Popen:
    """The job's driver in its own session; its output goes to files (a pipe would also wait for any
    process the driver left holding it)."""
    cmd, env = _command(cfg, tmp / f"{run_dir.name}.yaml", run_dir)
    with open(tmp / f"{run_dir.name}.err", "ab") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=env, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    proc.err_path = tmp / f"{run_dir.name}.err"  # type: ignore[attr-defined]
    return proc


def _finish(proc: subprocess.Popen, timeout: float = JOB_TIMEOUT_S) -> tuple[int, str, list[str]]:
    """The driver's exit code, its stderr, and the processes of its session that outlived it (killed here)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"the job did not end within {timeout} s (a hang): {proc.err_path.read_text()[-2000:]}")
    deadline = time.monotonic() + GONE_WITHIN_S  # multiprocessing's helpers exit once they see the driver gone
    while (session := _session(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = []
    for p in session:
        try:
            left.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
            p.kill()
        except psutil.NoSuchProcess:
            continue
    return proc.returncode, proc.err_path.read_text(), left


def _session(sid: int) -> list[psutil.Process]:
    """The running processes of session `sid` (a driver started with `_start` and whatever it started)."""
    found = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    return found


def _local_reference(cfg: dict, run_dir: Path) -> dict[str, str]:
    from streamprep import run_from_dict

    local = json.loads(json.dumps(cfg))
    local["execution"] = {**local["execution"], "engine": "local", "workers": 1, "ray_address": None}
    run_from_dict(local, run_dir=run_dir, console_log=False)
    return tree_hashes(run_dir, *OUTPUTS, names=("manifest.json",))


def _job_processes(c) -> list[str]:
    """`ray::` processes on this machine that are not Ray's own per-node agents or idle pooled workers, nor
    older than the module's cluster (the session cluster's, when an earlier test module used it)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "memory_info"]):
        title = " ".join(p.info["cmdline"] or [])
        if title.startswith("ray::") and not title.startswith(RAY_AGENTS) and p.info["pid"] not in c.before:
            out.append(f"{p.info['pid']} {title.split()[0]} {p.info['memory_info'].rss >> 20} MB")
    return out


def _alive_of_jobs(c, driver_pids: set[int]) -> list[str]:
    """Actors (alive, restarting or pending) and placement groups of the jobs whose drivers had `driver_pids`."""
    from ray.util.state import list_actors, list_jobs, list_placement_groups

    jobs = {j.job_id for j in list_jobs(address=c.dashboard_url)
            if j.driver_info is not None and int(j.driver_info.pid) in driver_pids}
    assert jobs, f"the state API at {c.dashboard_url} lists none of the jobs {sorted(driver_pids)}"  # not vacuous
    found = [f"actor {a.class_name} {a.state}" for a in list_actors(address=c.dashboard_url, limit=10000)
             if a.job_id in jobs and a.state != "DEAD"]
    found += [f"placement group {g.placement_group_id} {g.state}"
              for g in list_placement_groups(address=c.dashboard_url, limit=10000)
              if g.creator_job_id in jobs and g.state != "REMOVED"]
    return found


def _assert_nothing_left(c, driver_pids: set[int]) -> float:
    """Within GONE_WITHIN_S: no job process on any node, no actor or placement group of those jobs. Returns the
    seconds it took."""
    t0 = time.monotonic()
    while True:
        left = _job_processes(c) + _alive_of_jobs(c, driver_pids)
        if not left:
            return time.monotonic() - t0
        if time.monotonic() - t0 > GONE_WITHIN_S:
            pytest.fail(f"left behind {GONE_WITHIN_S} s after the job ended: {left}")
        time.sleep(0.25)


def _wait_for_log(run_dir: Path, event: str, proc: subprocess.Popen, count: int = 1, timeout: float = 120) -> list:
    log = run_dir / "logs/streamprep.log"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists():
            lines = [json.loads(x) for x in log.read_text().splitlines() if f'"{event}"' in x]
            if len(lines) >= count:
                return lines
        time.sleep(0.05)
    pytest.fail(f"no {count} {event!r} log line(s) within {timeout} s (exit {proc.poll()})")


def _log(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "logs/streamprep.log").read_text().splitlines()]


@pytest.mark.ray
def test_jobs_in_a_row_and_signalled_jobs_leave_nothing_behind(cluster, tmp_path: Path) -> None:
    """Exit 0 three times in a row, then SIGTERM, SIGINT and kill -9 of the driver mid-stage: each time no
    process, actor or placement group of the job is left on any node within 10 s (Xenna 0.3 left a
    NodeResourceMonitor and a StageWorker per node per job before), and the interrupted runs resume."""
    cfg = _config(tmp_path, 1200, 50, engine="xenna", workers=2, ray_address=cluster.address)
    drivers: set[int] = set()
    for i in range(3):
        proc = _start(cfg, tmp_path, tmp_path / f"ok{i}")
        drivers.add(proc.pid)
        code, err, left = _finish(proc)
        assert code == 0 and not left, (left, err[-3000:])
        _assert_nothing_left(cluster, drivers)
    ok = [tree_hashes(tmp_path / f"ok{i}", *OUTPUTS, names=("manifest.json",)) for i in range(3)]
    assert len(ok[0]) > 20 and ok[0] == ok[1] == ok[2]
    for how in (signal.SIGTERM, signal.SIGINT, signal.SIGKILL):
        run_dir = tmp_path / f"sig{how.name}"
        proc = _start(cfg, tmp_path, run_dir)
        drivers.add(proc.pid)
        _wait_for_log(run_dir, "shard done", proc)  # the stage's workers are up and working
        proc.send_signal(how)
        code, err, left = _finish(proc, 60)
        assert code != 0 and (code == -9) == (how == signal.SIGKILL), (how, code, err[-2000:])
        took = _assert_nothing_left(cluster, drivers)
        print(f"{how.name}: nothing of the job left on the cluster {took:.1f} s after the driver ended")
        assert not left, left  # kill -9 too: the pools' workers exit with the driver (streamprep/children.py)
        code, err, left = _finish(_start(cfg, tmp_path, run_dir))  # the same command resumes it
        assert code == 0 and not left, (left, err[-3000:])
        assert tree_hashes(run_dir, *OUTPUTS, names=("manifest.json",)) == ok[0]
    _assert_nothing_left(cluster, drivers)


@pytest.mark.ray
def test_a_stop_while_the_stage_starts_and_the_backend_check_waits_is_an_interrupt_in_seconds(
        cluster, tmp_path: Path, shared_data: Path) -> None:
    """Regression: on engine xenna with `ray_address` and `tokenizer.path`, a SIGTERM right after 'units planned',
    while the tokenizer's backend check waited for the ingest stage still starting, was aborted 3 s later by Ray's
    crash handler (exit 134, run.json left `running`), and a SIGINT took ~31 s: the feeder's close waited for that
    check. Now each exits 1 within seconds, run.json `interrupted`, and the resume writes an uninterrupted run's
    bytes."""
    cfg = _config(tmp_path, 1200, 50, engine="xenna", workers=2, ray_address=cluster.address)
    cfg["tokenizer"] = {"path": str(shared_data / PHI2)}
    reference = _local_reference(cfg, tmp_path / "local")
    drivers: set[int] = set()
    for how in (signal.SIGTERM, signal.SIGINT):
        run_dir = tmp_path / f"sig{how.name}"
        proc = _start(cfg, tmp_path, run_dir)
        drivers.add(proc.pid)
        _wait_for_log(run_dir, "units planned", proc)
        proc.send_signal(how)
        t0 = time.monotonic()
        code, err, left = _finish(proc, 60)
        took = time.monotonic() - t0
        # the stop gave up the check (a stage starting answers it seconds later, 30 s on a busy machine)
        assert "tokenizer backend" not in [e["event"] for e in _log(run_dir)], \
            "the backend check answered: the stop waited for it (or it came before the signal)"
        status = json.loads((run_dir / "run.json").read_text())["status"]
        assert (code, status) == (1, "interrupted") and took < STOP_WITHIN_S, (how, code, status, took, err[-2000:])
        assert "SIGTERM received" not in err and not left, (err[-2000:], left)  # Ray's crash handler never ran
        print(f"{how.name} after 'units planned': exit 1 {took:.1f} s after the signal")
    proc = _start(cfg, tmp_path, tmp_path / "sigSIGTERM")  # the same command resumes it
    drivers.add(proc.pid)
    code, err, left = _finish(proc)
    assert code == 0 and not left, (left, err[-3000:])
    assert tree_hashes(tmp_path / "sigSIGTERM", *OUTPUTS, names=("manifest.json",)) == reference
    _assert_nothing_left(cluster, drivers)


def _lose_the_second_node(cluster, cfg: dict, tmp_path: Path, run_dir: Path,
                          when: Callable[[subprocess.Popen], object]) -> float:
    """Run `cfg` in `run_dir`, remove the cluster's second node (not gracefully) once `when(proc)` returns, and check
    the job exits 0, leaving nothing, with the bytes of a local run; the node is added back. Returns when it was lost."""
    reference = _local_reference(cfg, tmp_path / "local")
    worker, = _nodes_of(cluster).values()
    proc = _start(cfg, tmp_path, run_dir)
    try:
        when(proc)
        cluster.remove_node(worker, allow_graceful=False)
        t_lost = time.monotonic()
        code, err, left = _finish(proc)
    finally:
        _restore(cluster)
    assert code == 0 and not left, (left, err[-3000:])
    assert tree_hashes(run_dir, *OUTPUTS, names=("manifest.json",)) == reference
    return t_lost


@pytest.mark.ray
def test_a_lost_node_costs_a_retry_not_a_rerun(cluster, tmp_path: Path) -> None:
    """The second raylet dies (not gracefully) while the job's pipeline has shards on it: those shards, and the
    calls its ingest stage held there, run again on the head inside the job. The job exits 0 with outputs
    byte-identical to a local run, each shard once, and the retries counted in `status` and the log."""
    from streamprep.status import format_status, run_status

    cfg = _config(tmp_path, 16000, 100, engine="xenna", workers=2, ray_address=cluster.address)
    run_dir = tmp_path / "lost"
    worker_id = next(iter(_nodes_of(cluster)))

    def a_shard_ran_there(proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + 120
        while not any(x["node"] == worker_id for x in _wait_for_log(run_dir, "shard done", proc)):
            assert time.monotonic() < deadline, "no shard ran on the second node"
            time.sleep(0.02)

    t_lost = _lose_the_second_node(cluster, cfg, tmp_path, run_dir, a_shard_ran_there)
    log = _log(run_dir)
    done = [(x["dataset"], x["part"]) for x in log if x["event"] == "shard done"]
    assert len(done) == len(set(done)) == len(list((run_dir / "receipts/gen").glob("*.json")))  # each shard once
    retried = [x for x in log if x["event"] == "shard retried"]
    restarts = [x for x in log if x["event"] == "xenna stage lost a worker; restarting it on the nodes left"]
    assert restarts, "the stage never noticed its lost worker"
    calls, = [x["calls"] for x in log if x["event"] == "worker calls per node"]
    assert len(calls) == 2 and all(c.get("judge_piece") for c in calls.values()), calls  # units judged on both
    head, = set(calls) - {worker_id}
    assert calls[head].get("build_audit") == 1  # the calls after the loss ran on the node left
    status = run_status(run_dir)
    assert retried, "the lost node's shards were not run again"  # it held some: one had run there just before
    assert status["state"] == "complete" and status["retries"] == len(retried)
    assert f"retries: {len(retried)} shard(s)" in format_status(status)
    print(f"lost node: {len(restarts)} stage restart(s), {len(retried)} shard(s) retried, "
          f"job ended {time.monotonic() - t_lost:.1f} s after the node died")


@pytest.mark.ray
def test_a_lost_node_under_the_local_engine_costs_its_worker_actors_a_replacement(cluster, tmp_path: Path) -> None:
    """Regression: with `engine: local` and `ray_address`, the second node removed mid-ingest: the lost worker actor
    was replaced on that same node (Ray lists a dead node as alive for ~20 s), died with it, and the job failed
    (`ActorDiedError`, once blamed on the input). The replacement goes to a node left; exit 0, a local run's bytes."""
    cfg = _config(tmp_path, 16000, 100, engine="local", workers=2, ray_address=cluster.address, dedup_holders=0)
    run_dir = tmp_path / "lost"
    worker_id = next(iter(_nodes_of(cluster)))
    _lose_the_second_node(cluster, cfg, tmp_path, run_dir, lambda proc: _wait_for_log(run_dir, "units planned", proc))
    log = _log(run_dir)
    assert [x for x in log if x["event"] == "a worker actor was lost; its calls run again on a new one"]
    calls, = [x["calls"] for x in log if x["event"] == "worker calls per node"]
    assert calls and worker_id not in calls, calls  # every call answered ran on the node left


def test_a_worker_actor_lost_as_the_workers_start_names_its_node_and_says_to_re_run(monkeypatch) -> None:
    """Regression (round 47): a node lost while the local engine's worker actors started failed the job with a
    bare ActorDiedError (no node, no advice to re-run)."""
    import ray
    from ray.exceptions import ActorDiedError

    from streamprep import ray_cluster

    class Actor:
        def __init__(self, node: str) -> None:
            self.node = node
            self.ready = type("Method", (), {"remote": staticmethod(lambda: node)})

    def get(node: str) -> tuple:
        if node == "b":  # the node lost as its actor started
            raise ActorDiedError()
        return node, ray_cluster.version.source()

    monkeypatch.setattr(ray_cluster, "usable_nodes", lambda: {"a", "b"})
    monkeypatch.setattr(ray_cluster, "place_actor", lambda cls, slot, *args, nodes: Actor(nodes[slot % len(nodes)]))
    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(ray_cluster.StartLost, match=r"^a worker actor ended as it started, on node b \(lost\?\): The "
                                                    r"actor died .*; re-run the same command to resume$"):
        ray_cluster.spread_actors(object, 2)
    assert ray_cluster.spread_actors(object, 1)[1] == ["a"]


@pytest.mark.ray
def test_a_dedup_holder_actor_killed_mid_ingest_is_replaced_inside_the_job(cluster, tmp_path: Path) -> None:
    """Two dedup holders, Ray actors (one on each node), near-dedup on; kill -9 of holder 0's process (a share of the
    digests and the near-dedup index) while units are judged: the job places a new one, which reads its logs back
    and is sent again the calls since (walks included), and ends with exit 0 and the bytes of a local run."""
    cfg = _config(tmp_path, 16000, 100, engine="local", workers=2, ray_address=cluster.address, dedup_holders=2)
    cfg["quality"] = {"near_dedup": {"enabled": True}}  # the default gates, and near-dedup
    reference = _local_reference(cfg, tmp_path / "local")
    run_dir = tmp_path / "killed"
    proc = _start(cfg, tmp_path, run_dir)
    try:
        up, = _wait_for_log(run_dir, "dedup holders up", proc)
        assert up["where"] == "ray" and len(up["pids"]) == 2
        _wait_for_log(run_dir, "units planned", proc)
        os.kill(up["pids"][0], signal.SIGKILL)  # the nodes of ray.cluster_utils are processes of this machine
    finally:
        code, err, left = _finish(proc)
    assert code == 0 and not left, (left, err[-3000:])
    lost = [x for x in _log(run_dir) if x["event"].startswith("a dedup holder was lost")]
    assert len(lost) == 1 and lost[0]["holder"] == 0, lost
    assert tree_hashes(run_dir, *OUTPUTS, names=("manifest.json",)) == reference


@pytest.mark.ray
def test_two_jobs_at_once_share_the_cluster_without_touching_each_other(cluster, tmp_path: Path) -> None:
    """Two jobs started 2 s apart on one cluster: both exit 0 with the bytes of their runs alone, their actors live
    in their own namespaces, neither's stage loses a worker to the other, and both leave nothing behind."""
    from ray.util.state import list_actors

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    cfgs = {name: _config(tmp_path / name, n, 50, engine="xenna", workers=2, ray_address=cluster.address)
            for name, n in (("a", 1200), ("b", 900))}
    reference = {name: _local_reference(cfg, tmp_path / name / "local") for name, cfg in cfgs.items()}
    seen: dict[str, object] = {}  # every actor the state API showed while the jobs ran (a finished job's dead
    # actors can drop out of its view under load: one CI run saw none for the first job after both ended)
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            try:
                seen.update((a.actor_id, a) for a in list_actors(address=cluster.dashboard_url, limit=10000))
            except Exception:  # the state API is busy or restarting: the next poll sees the same actors
                pass
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    procs = {}
    for name, cfg in cfgs.items():
        procs[name] = _start(cfg, tmp_path, tmp_path / name / "run")
        time.sleep(2.0)
    results = {name: _finish(proc) for name, proc in procs.items()}
    watching.set()
    watcher.join()
    for name, (code, err, left) in results.items():
        assert code == 0 and not left, (name, left, err[-3000:])
        assert tree_hashes(tmp_path / name / "run", *OUTPUTS, names=("manifest.json",)) == reference[name], name
        log = _log(tmp_path / name / "run")
        assert not [x for x in log if x["event"] in ("shard retried", "xenna stage lost a worker; restarting it on "
                                                     "the nodes left")], name
    namespaces = {name: next(x["namespace"] for x in _log(tmp_path / name / "run") if x["event"] == "ray connected")
                  for name in procs}
    assert len(set(namespaces.values())) == 2  # one namespace per job
    for name, ns in namespaces.items():  # each namespace holds one job's actors: its pipeline's stage workers
        mine = [a for a in seen.values() if a.ray_namespace == ns]
        assert len({a.job_id for a in mine}) == 1, (name, mine)
        classes = sorted(a.class_name for a in mine)
        assert classes.count("StageWorker") == 4, (name, classes)  # 2 ingest, 2 tokenize
    _assert_nothing_left(cluster, {p.pid for p in procs.values()})


@pytest.mark.ray
def test_with_no_node_left_the_job_fails_in_bounded_time_and_resumes(cluster, tmp_path: Path) -> None:
    """Every node goes (the head too: GCS and raylets) while the stage works: the job exits 1 within a bounded
    time, never hangs, and the same command on a cluster brought back at the same address finishes with the
    bytes of a local run. Runs last: it replaces the module's cluster."""
    from ray.cluster_utils import Cluster

    address = cluster.address
    cfg = _config(tmp_path, 16000, 100, engine="xenna", workers=2, ray_address=address)
    reference = _local_reference(cfg, tmp_path / "local")
    run_dir = tmp_path / "gone"
    proc = _start(cfg, tmp_path, run_dir)
    _wait_for_log(run_dir, "shard done", proc)
    for node in list(cluster.worker_nodes):
        cluster.remove_node(node, allow_graceful=False)
    cluster.remove_node(cluster.head_node, allow_graceful=False)
    t_gone = time.monotonic()
    code, err, left = _finish(proc, 100)
    took = time.monotonic() - t_gone
    # Ray itself ends a driver whose raylet is gone (exit 1, at once, no clean-up of ours): the exports' process
    # pool, if it was started, is then left on the driver's machine (reported in docs/multi-node.md)
    print(f"no node left: exit {code} {took:.1f} s after the cluster went; left on the driver's machine: {left}")
    assert code == 1, err[-3000:]
    assert took < 60
    port = address.rsplit(":", 1)[1]
    again = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "gcs_server_port": int(port), "include_dashboard": True,
                                                          "dashboard_port": int(cluster.dashboard_url.rsplit(":", 1)[1])})
    cluster.__dict__.update(again.__dict__)  # the module fixture shuts this one down
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    code, err, left = _finish(_start(cfg, tmp_path, run_dir))
    assert code == 0 and not left, (left, err[-3000:])
    assert tree_hashes(run_dir, *OUTPUTS, names=("manifest.json",)) == reference


def test_a_ray_address_that_is_malformed_or_closed_is_a_config_error_before_anything_is_written(
        tmp_path, monkeypatch) -> None:
    """Regression: a closed port had `ray.init` retry for ever (a SIGTERM waited on it), and a malformed address
    failed after the run dir was written (exit 1). The config check connects to the port once, 5 s at most.
    Regressions too: a port where something else answers (a server that says nothing, the dashboard's HTTP) hung
    in `ray.init` after the run dir was written, deaf to SIGTERM, and `auto` with no cluster failed after it: the
    port must answer as a GCS does."""
    import concurrent.futures
    import http.server
    import threading

    import grpc
    import ray._private.services
    from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc

    from streamprep import ray_cluster
    from streamprep.config import ConfigError, validate

    monkeypatch.setattr(ray_cluster, "ADDRESS_CHECK_S", 0.5)

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')

    def check(address: str) -> None:
        validate({"datasets": [{"name": "d", "path": str(data)}], "execution": {"ray_address": address}})

    for bad in ("not-an-address", "host:99999", "ray://:6379", "http://127.0.0.1:6379"):  # the last: "nothing
        # answers at http://127.0.0.1:6379 (Name or service not known)" before
        with pytest.raises(ConfigError, match=r"^config: 'execution.ray_address' must be HOST:PORT"):
            check(bad)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"^config: 'execution.ray_address': 127.0.0.1:{port} answers, but no "
                                              r"Ray GCS answered within 0.5 s; the GCS address is the one `ray start "
                                              r"--head` prints \(port 6379 by default\), not the dashboard's$"):
            check(f"127.0.0.1:{port}")
        # regression: ray:// to a port that is no Ray Client server's passed (a connection was all it asked),
        # then `ray.init` failed after 30 s with "ray client connection timeout", the run dir written
        with pytest.raises(ConfigError, match=rf"^config: 'execution.ray_address': 127.0.0.1:{port} answers, but no "
                                              r"Ray Client server answered within 0.5 s; ray:// needs the Ray Client "
                                              r"server's port \(10001 by default\)$"):
            check(f"ray://127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=rf"^config: 'execution.ray_address': nothing answers at 127.0.0.1:{port} "
                                          r"\(Connection refused\); is the cluster up\?$"):
        check(f"127.0.0.1:{port}")
    web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ConfigError, match=r"answers, but not as a Ray GCS does \("):
            check(f"127.0.0.1:{web.server_address[1]}")
        with pytest.raises(ConfigError, match=r"answers, but not as a Ray Client server does \("):
            check(f"ray://127.0.0.1:{web.server_address[1]}")
    finally:
        web.shutdown()
        web.server_close()

    client = grpc.server(concurrent.futures.ThreadPoolExecutor(1))  # answers Ray Client's ping as its server does
    ray_client_pb2_grpc.add_RayletDriverServicer_to_server(type("Pinged", (ray_client_pb2_grpc.RayletDriverServicer,), {
        "ClusterInfo": lambda self, request, context: ray_client_pb2.ClusterInfoResponse(json="{}")})(), client)
    client_port = client.add_insecure_port("127.0.0.1:0")
    client.start()
    try:
        check(f"ray://127.0.0.1:{client_port}")
    finally:
        client.stop(None)

    def no_cluster(address: str) -> str:
        raise ConnectionError("Could not find any running Ray instance.")

    monkeypatch.setattr(ray._private.services, "canonicalize_bootstrap_address", no_cluster)
    with pytest.raises(ConfigError, match=r"^config: 'execution.ray_address': auto, and no Ray cluster runs on this "
                                          r"machine \(no `ray start`, no RAY_ADDRESS\); is the cluster up\?$"):
        check("auto")


def test_a_cluster_without_a_dashboard_is_a_config_error_for_xenna_only(monkeypatch) -> None:
    """Regression: a cluster started with `--include-dashboard=false` passed the address check, and `engine: xenna`
    failed ~15 s in (its monitor asks Ray's state API, which the dashboard serves), blaming the dataset's input.
    The check now asks the dashboard the cluster registered in its GCS for its session: one line naming
    ray_address, what is missing and where the set-up is. Regression too: any server at the registered address
    passed (such a cluster registers the default port, where another cluster's dashboard may answer, whose state
    API Xenna then asked; or another server, the job failing ~10 s in). `engine: local` (worker actors, which ask
    only the GCS) needs none. The GCS's answers are faked; the dashboards are real HTTP servers, or a closed port."""
    import http.server
    import json
    import threading

    import ray._raylet

    from streamprep import ray_cluster
    from streamprep.config import ConfigError

    registered: list[bytes | None] = []

    class Gcs:  # what a GCS has in its KV: the dashboard's address, and the cluster's session
        def __init__(self, address: str) -> None:
            pass

        def internal_kv_get(self, key: bytes, namespace: bytes, timeout: float) -> bytes | None:
            kv = {(b"dashboard", b"dashboard"): registered[-1], (b"session_name", b"session"): b"session_ours"}
            return kv[key, namespace]

    class Dashboard(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            session = self.server.session  # type: ignore[attr-defined]
            if self.path != "/api/version" or session is None:
                self.send_error(404)
                return
            body = json.dumps({"version": "4", "ray_version": "2", "ray_commit": "x", "session_name": session})
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args) -> None:
            pass

    def serving(session: str | None) -> http.server.HTTPServer:
        server = http.server.HTTPServer(("127.0.0.1", 0), Dashboard)
        server.session = session  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server

    monkeypatch.setattr(ray._raylet, "GcsClient", Gcs)
    monkeypatch.setattr(ray_cluster, "_ask_gcs", lambda where, metadata=(): ("OK", ""))
    monkeypatch.setattr(ray_cluster, "ADDRESS_CHECK_S", 0.5)
    gcs = socket.create_server(("127.0.0.1", 0))
    where = f"127.0.0.1:{gcs.getsockname()[1]}"
    with socket.create_server(("127.0.0.1", 0)) as closed:
        dashboard = f"127.0.0.1:{closed.getsockname()[1]}"

    def check(engine: str) -> str | None:
        try:
            ray_cluster.check_address({"execution": {"ray_address": where, "engine": engine}})
        except ConfigError as exc:
            return str(exc)
        return None

    def refused(why: str) -> str:
        return (f"config: 'execution.ray_address': the Ray cluster at {where} has no dashboard answering here (Ray's "
                f"state API, which `engine: xenna` needs; {why}): start its head "
                f"without --include-dashboard=false, reachable from this machine, or use `engine: local` "
                f"(docs/multi-node.md, Set-up)")

    ours, other, not_ray = serving("session_ours"), serving("session_theirs"), serving(None)
    with gcs:
        try:
            for entry, why in ((dashboard, f"{dashboard}: Connection refused"), (None, "none registered"),
                               (f"127.0.0.1:{other.server_port}", f"127.0.0.1:{other.server_port} is another Ray "
                                f"cluster's dashboard (session session_theirs, this cluster's is session_ours)"),
                               (f"127.0.0.1:{not_ray.server_port}",
                                f"127.0.0.1:{not_ray.server_port} answers HTTP 404, not as Ray's dashboard")):
                registered.append(entry.encode() if entry else None)
                assert check("xenna") == refused(why)
                assert check("local") is None
            registered.append(f"127.0.0.1:{ours.server_port}".encode())
            assert check("xenna") is None
        finally:
            for server in (ours, other, not_ray):
                server.shutdown()
                server.server_close()


TOKEN_CASES = """
import json, os, socket, sys
from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, Config, get_authentication_mode
from streamprep import ray_cluster
from streamprep.config import ConfigError

def ask(where, metadata=()):  # a GCS whose token is "good": refuses a request without it, or with another
    return ("OK", "") if ("authorization", "Bearer good") in metadata else ("UNAUTHENTICATED", "no token")

listening = socket.create_server(("127.0.0.1", 0))
address = f"127.0.0.1:{listening.getsockname()[1]}"
outcomes = {}
for case, env in json.loads(sys.argv[1]).items():
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        os.environ.pop(name, None)
    os.environ.update({"HOME": sys.argv[2], **env})
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
    ray_cluster._ask_gcs = (lambda where, metadata=(): ("OK", "")) if case == "no auth" else ask
    try:
        ray_cluster.check_address({"execution": {"ray_address": address}})
        error = None
    except ConfigError as exc:
        error = str(exc).replace(address, "ADDRESS")
    outcomes[case] = [error, os.environ.get("RAY_AUTH_MODE"), get_authentication_mode() == AuthenticationMode.TOKEN]
print(json.dumps(outcomes))
"""


def test_a_gcs_that_wants_a_token_gets_this_machines_or_is_a_config_error(tmp_path: Path) -> None:
    """Regression: Ray 2.60 sends its auth token to an explicit address only with RAY_AUTH_MODE=token: the check
    took the GCS's refusal as "a GCS", and `ray.init` then retried for 20-40 s after the run dir was written and
    failed with "Failed to connect", naming no token. Now a token Ray finds here (RAY_AUTH_TOKEN, the file
    RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token) that the GCS takes turns token auth on for the job; none, or one
    it refuses, or RAY_AUTH_MODE=disabled, is a config error. The GCS's answers are faked (`_ask_gcs`)."""
    home, good = tmp_path / "home", tmp_path / "good"  # HOME: no ~/.ray/auth_token; `good`'s has the GCS's token
    (good / ".ray").mkdir(parents=True)
    (good / ".ray" / "auth_token").write_text("good")
    cases = {"no auth": {}, "no token": {}, "home file": {"HOME": str(good)},
             "token file": {"RAY_AUTH_TOKEN_PATH": str(good / ".ray" / "auth_token")},
             "token env": {"RAY_AUTH_TOKEN": "good", "RAY_AUTH_TOKEN_PATH": str(tmp_path / "absent")},
             "wrong token": {"RAY_AUTH_TOKEN": "bad"}, "missing file": {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "absent")},
             "disabled": {"RAY_AUTH_MODE": "disabled", "RAY_AUTH_TOKEN": "good"},
             "token mode": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "good"}}
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    done = subprocess.run([sys.executable, "-c", TOKEN_CASES, json.dumps(cases), str(home)], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    outcomes = json.loads(done.stdout.splitlines()[-1])
    key = "config: 'execution.ray_address': the Ray cluster at ADDRESS"
    assert outcomes == {
        "no auth": [None, None, False],
        "no token": [(f"{key} requires token authentication and this machine has no token: copy the head's "
                      "~/.ray/auth_token here, or set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH"), None, False],
        "home file": [None, "token", True],
        "token file": [None, "token", True],
        "token env": [None, "token", True],
        "wrong token": [f"{key} refuses this machine's auth token (RAY_AUTH_TOKEN); use the head's ~/.ray/auth_token",
                        None, False],
        "missing file": [(f"{key} requires token authentication, and RAY_AUTH_TOKEN_PATH is set but file cannot be "
                          f"opened or is empty: {tmp_path / 'absent'}"), None, False],
        "disabled": [(f"{key} requires token authentication, but RAY_AUTH_MODE is 'disabled'; set "
                      "RAY_AUTH_MODE=token (or unset it) for `streamprep`"), "disabled", False],
        "token mode": [None, "token", True],
    }


AUTO_CASES = """
import json, os, socket, sys, types
import ray
from streamprep import ray_cluster

listening = socket.create_server(("", 0))
port = listening.getsockname()[1]
os.makedirs(os.path.join(os.environ["RAY_TMPDIR"], "ray"))
with open(os.path.join(os.environ["RAY_TMPDIR"], "ray", "ray_current_cluster"), "w") as f:
    f.write(f"127.0.0.1:{port}")  # what `ray start` leaves for `auto` to find
seen = {}

def init(address=None, **kwargs):  # what Ray would be asked to attach with
    seen.update(address=address.rpartition(":")[2] if address != "auto" else address,
                mode=os.environ.get("RAY_AUTH_MODE"))
    return types.SimpleNamespace(address_info={"gcs_address": address}, namespace="n")

ray.init = init
ray._private.services.find_gcs_addresses = lambda: []  # Ray's `auto` takes a lone GCS running here over the file
answer = {"no auth": ("OK", ""), "token auth": ("UNAUTHENTICATED", "no token")}[sys.argv[1]]
ray_cluster._ask_gcs = lambda where, metadata=(): ("OK", "") if metadata else answer
ray_cluster.check_address({"execution": {"ray_address": "auto"}})
ray_cluster.connect("auto", 1)
print(json.dumps([seen, str(port)]))
"""


@pytest.mark.parametrize("cluster_auth", ["no auth", "token auth"])
def test_auto_attaches_as_the_address_it_stands_for_with_a_token_file_here(tmp_path: Path, cluster_auth: str) -> None:
    """Regression: with `ray_address: auto` and a ~/.ray/auth_token on the machine, `ray.init("auto")` turned Ray's
    token auth on (Ray does for `auto` whenever a token file exists) against a cluster without it: the dedup holder
    actor died as it was created and the job failed after 8.5 min of stage restarts (HolderLost, naming no auth).
    `auto` now reaches `ray.init` as the address the check resolved (Ray never turns auth on for one by itself),
    token auth off for a cluster that wants none and on for one that refuses a request without it, as with
    HOST:PORT. The GCS's answers and `ray.init` are faked."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("good")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    env.update(HOME=str(home), RAY_TMPDIR=str(tmp_path / "rt"))
    done = subprocess.run([sys.executable, "-c", AUTO_CASES, cluster_auth], capture_output=True, text=True, env=env,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    seen, port = json.loads(done.stdout.splitlines()[-1])
    assert seen == {"address": port, "mode": None if cluster_auth == "no auth" else "token"}


@pytest.mark.ray
def test_a_clusters_gcs_passes_the_address_check_and_its_raylet_does_not(ray_cluster, tmp_path) -> None:
    """The check asks the port for the cluster id: the session cluster's GCS answers (or refuses the missing auth
    token, which only a GCS does); its raylet's port, gRPC without the GCS's services, is a config error, and so is
    the GCS's port given as ray:// (Ray Client's)."""
    import ray

    from streamprep.config import ConfigError, validate

    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "x"}\n')

    def check(address: str) -> None:
        validate({"datasets": [{"name": "d", "path": str(data)}], "execution": {"ray_address": address}})

    gcs = ray_cluster.address_info["gcs_address"]
    check(gcs)
    # regression: ray:// to the GCS's port passed (a connection was all it asked), then `ray.init` failed after 62 s
    # with "ray client connection timeout", the run dir written
    with pytest.raises(ConfigError, match=rf"^config: 'execution.ray_address': ray://{gcs} names a Ray GCS's port; "
                                          rf"ray:// needs the Ray Client server's port \(10001 by default\), or give "
                                          rf"{gcs} without ray://$"):
        check(f"ray://{gcs}")
    node = ray.nodes()[0]
    raylet = f"{node['NodeManagerAddress']}:{node['NodeManagerPort']}"
    with pytest.raises(ConfigError, match=rf"^config: 'execution.ray_address': {raylet} answers, but it is no Ray GCS "
                                          r"\(a gRPC server without the GCS's services: a raylet's port\?\)"):
        check(raylet)


OWN_CLUSTER = """
import os
from streamprep.ray_cluster import init_here, shutdown_ray
ctx = init_here(1)
print(ctx.address_info["gcs_address"] != os.environ["RAY_ADDRESS"])
shutdown_ray()
"""


@pytest.mark.ray
def test_the_jobs_own_cluster_is_new_beside_a_running_one(ray_cluster) -> None:
    """Regression: with a cluster already running on the machine (a user's own, or RAY_ADDRESS set), `engine: xenna`
    never started its own: `ray.init` attached to that one, refused `num_cpus`, and the local workers tokenized
    every shard ("ray did not come up")."""
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.address_info["gcs_address"]}
    out = subprocess.run([sys.executable, "-c", OWN_CLUSTER], capture_output=True, text=True, timeout=180, env=env,
                         check=False)
    assert out.stdout.strip().splitlines()[-1:] == ["True"], out.stderr[-2000:]


ATTACH = """
import signal, sys
from streamprep import ray_cluster
mine = lambda signum, frame: None
signal.signal(signal.SIGTERM, mine)
ray_cluster.connect(sys.argv[1], 1)
print(signal.getsignal(signal.SIGTERM) is mine)
ray_cluster.release()
"""


@pytest.mark.ray
def test_attaching_to_a_cluster_leaves_the_jobs_signal_handlers(ray_cluster) -> None:
    """Regression: `ray.init` in the main thread put Ray's SIGTERM handler (sys.exit(15)) in place of the job's, so
    with `engine: local` and `ray_address` a SIGTERM was "SystemExit(15) raised inside the command (a plug-in
    calling sys.exit?)", run.json `failed`, instead of a stop with the progress saved."""
    out = subprocess.run([sys.executable, "-c", ATTACH, ray_cluster.address_info["gcs_address"]], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.stdout.strip().splitlines()[-1] == "True", out.stderr[-2000:]


IN_A_THREAD = """
import os, signal, sys, time
from concurrent.futures import ThreadPoolExecutor
from streamprep import ray_cluster
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
ray_thread = ThreadPoolExecutor(1)  # as the xenna engine: Ray started and shut down in a thread of its own
ray_thread.submit(ray_cluster.connect, sys.argv[1] or None, 1).result()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(4)  # Ray's crash handler aborted the process 3 s after it ran
ray_thread.submit(ray_cluster.release).result()
os.kill(os.getpid(), signal.SIGTERM)  # after ray.shutdown the default action ended the process
time.sleep(0.5)
print(got == [signal.SIGTERM] * 2)
"""


@pytest.mark.ray
@pytest.mark.parametrize("cluster_of", ["attached", "own"])
def test_ray_started_in_a_thread_leaves_sigterm_to_the_jobs_handler_until_the_end(ray_cluster, cluster_of) -> None:
    """Regression: `ray.init` outside the main thread (the xenna engine's) left Ray's C-level crash handler on SIGTERM,
    unseen by `signal.getsignal`: a SIGTERM ran the job's handler, then aborted the process 3 s later (exit 134,
    run.json `running`); and `ray.shutdown` of the job's own cluster set SIGTERM to the default action, so a SIGTERM
    during the exports ended the job unhandled."""
    address = ray_cluster.address_info["gcs_address"] if cluster_of == "attached" else ""
    out = subprocess.run([sys.executable, "-c", IN_A_THREAD, address], capture_output=True, text=True, timeout=180,
                         check=False)
    assert (out.returncode, out.stdout.strip().splitlines()[-1:]) == (0, ["True"]), out.stderr[-2000:]


def test_a_worker_actor_with_another_streamprep_is_refused_naming_both(tmp_path: Path) -> None:
    """Regression: a node whose streamprep was another than the driver's (an older checkout, another venv) ran the
    job's calls with its own code: the job failed at its end with a bare TypeError from the audit, exit 1. A worker
    actor's `ready()` now answers its streamprep, a hash of its .py and data files (any edit changes it), and another
    than the driver's, or none (an older one), is a ConfigError naming both, before the actor runs a call."""
    import shutil

    from streamprep import version
    from streamprep.config import ConfigError
    from streamprep.ray_cluster import node_of

    mine = version.source()
    assert node_of(("node-a", mine)) == "node-a"
    with pytest.raises(ConfigError) as refused:
        node_of(("node-a", ("0.1.0+0123456789ab", "/opt/venv/streamprep on worker-3")))
    assert str(refused.value) == (f"a Ray node runs another streamprep (0.1.0+0123456789ab, /opt/venv/streamprep on "
                                  f"worker-3) than this driver ({mine[0]}, {mine[1]}): every node needs the same "
                                  f"streamprep (docs/multi-node.md)")
    with pytest.raises(ConfigError, match=r"^a Ray node runs another streamprep \(an older one, no source fingerprint\)"):
        node_of("node-a")  # what an older `_Actor.ready` answers
    copy = tmp_path / "copy"  # another checkout of both packages (streamprep alone would hash the installed quality)
    for package in ("streamprep", "quality"):
        shutil.copytree(Path(version.__file__).parent.parent / package, copy / package,
                        ignore=shutil.ignore_patterns("__pycache__"))
    probe = [sys.executable, "-c", "from streamprep.version import source; print(*source())"]
    env = {**os.environ, "PYTHONPATH": str(copy)}

    def fingerprint() -> list[str]:
        return subprocess.run(probe, env=env, cwd=copy, capture_output=True, text=True, check=True).stdout.split()

    same = fingerprint()
    assert same[:2] == [mine[0], str(copy / "streamprep")]
    (copy / "quality" / "data" / ".DS_Store").write_bytes(b"x")  # a hidden file no install ships: not hashed
    assert fingerprint() == same
    # regressions (hunter R50 W): an editor's lock beside a file being edited (Emacs' `.#x.py`, a symlink to
    # nothing) ended every job (run.json records the fingerprint) on a FileNotFoundError, and a Jupyter
    # `.ipynb_checkpoints/` copy made a resume say it runs another streamprep
    (copy / "streamprep" / ".#pipeline.py").symlink_to("user@host.12345:1700000000")
    (copy / "streamprep" / ".ipynb_checkpoints").mkdir()
    (copy / "streamprep" / ".ipynb_checkpoints" / "pipeline-checkpoint.py").write_text("x = 1\n")
    assert fingerprint() == same
    # regressions: `quality` (the gates, dedup) was not hashed, nor the word lists the gates read (quality/data):
    # a node with other PII patterns or another profanity list passed the check and judged its units otherwise
    for edited in ("streamprep/audit/gather.py", "quality/gates/pii.py", "quality/data/profanity.txt",
                   "quality/data/medical_terms.json", "streamprep/data/unassigned-unicode-14.0.txt"):
        before = fingerprint()
        with (copy / edited).open("a") as f:
            f.write("# an edit\n")
        after = fingerprint()
        assert after[0] != before[0] and after[1:] == before[1:], edited


def test_the_jobs_runtime_env_sends_the_drivers_streamprep_plugins(monkeypatch) -> None:
    """Regression: the job's runtime env set no variable, so a Ray worker had the STREAMPREP_PLUGINS of its node's
    `ray start`: a gate the driver named did not judge there, or one only the node named did, exit 0. It sends the
    driver's modules, "" for none (a node's own is overridden), and leaves them out when a `ray job submit`
    runtime env sets the variable (Ray refuses the two as a conflict; that one reaches the workers)."""
    from streamprep import ray_cluster, registry

    monkeypatch.delenv(ray_cluster.SUBMITTED_JOB_ENV, raising=False)
    hook = {"worker_process_setup_hook": "streamprep.ray_cluster.exit_at_interpreter_shutdown"}
    for modules, value in ((["p_gate", "p_toy"], "p_gate,p_toy"), ([], "")):
        monkeypatch.setattr(registry, "PLUGIN_MODULES", modules)
        assert ray_cluster.job_runtime_env() == {**hook, "env_vars": {"STREAMPREP_PLUGINS": value}}
    submitted = {"runtime_env": {"env_vars": {"STREAMPREP_PLUGINS": "p_gate"}}, "metadata": {}}
    monkeypatch.setenv(ray_cluster.SUBMITTED_JOB_ENV, json.dumps(submitted))
    assert ray_cluster.job_runtime_env() == hook
    monkeypatch.setenv(ray_cluster.SUBMITTED_JOB_ENV, json.dumps({"runtime_env": None, "metadata": {}}))
    assert ray_cluster.job_runtime_env() == {**hook, "env_vars": {"STREAMPREP_PLUGINS": ""}}


PLUGINS_DRIVER = """
import os, sys
from streamprep.executor import RayExecutor

def modules():
    from streamprep import registry
    return registry.PLUGIN_MODULES

ex = RayExecutor(1, sys.argv[1])
try:
    print("workers:", ex.submit(os.getenv, "STREAMPREP_PLUGINS").result(), ex.submit(modules).result())
finally:
    ex.close()
"""


@pytest.mark.ray
def test_worker_actors_import_the_drivers_streamprep_plugins_not_their_nodes(ray_cluster) -> None:
    """The same on a cluster: the session cluster's node was started without STREAMPREP_PLUGINS, the driver has
    it (`json`, a module every process can import); its worker actors have the driver's value and modules."""
    env = {**os.environ, "STREAMPREP_PLUGINS": "json"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run([sys.executable, "-c", PLUGINS_DRIVER, ray_cluster.address_info["gcs_address"]],
                         capture_output=True, text=True, timeout=120, check=False, env=env)
    got = [line for line in out.stdout.splitlines() if line.startswith("workers:")]
    assert got == ["workers: json ['json']"], (out.stdout + out.stderr)[-2000:]


OTHER_DRIVER = """
import sys
from streamprep import version
from streamprep.config import ConfigError
from streamprep.executor import RayExecutor
version.source = lambda: ("0.0.9+0123456789ab", "/driver/streamprep on login")  # this driver's code is another
try:
    RayExecutor(1, sys.argv[1])
except ConfigError as exc:
    print(exc)
"""


@pytest.mark.ray
def test_worker_actors_on_a_node_with_another_streamprep_are_refused_before_any_call(ray_cluster) -> None:
    """The same through Ray: the executor's worker actors answer their node's streamprep, which is not the
    driver's here (the driver's fingerprint is faked), and the executor refuses before any call."""
    from streamprep import version

    out = subprocess.run([sys.executable, "-c", OTHER_DRIVER, ray_cluster.address_info["gcs_address"]],
                         capture_output=True, text=True, timeout=120, check=False)
    mine = version.source()
    assert out.stdout.strip().splitlines()[-1:] == [
        f"a Ray node runs another streamprep ({mine[0]}, {mine[1]}) than this driver (0.0.9+0123456789ab, "
        f"/driver/streamprep on login): every node needs the same streamprep (docs/multi-node.md)"], out.stderr[-2000:]


@contextmanager
def _head_in_temp_dirs() -> Iterator[tuple[subprocess.Popen, Path, Path]]:
    """A `streamprep.ray_head` of 1 CPU in its own process group, its TMPDIR and RAY_TMPDIR fresh folders (short
    paths: Ray's sockets live under them): (the head, TMPDIR, RAY_TMPDIR), all gone after."""
    import shutil
    import tempfile

    from streamprep.ray_cluster import HEAD_TMP_PREFIX, _head_command

    head_tmp = Path(tempfile.mkdtemp(prefix=HEAD_TMP_PREFIX))
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt"))
    env = {**os.environ, "TMPDIR": str(head_tmp), "RAY_TMPDIR": str(ray_tmp)}
    env.pop("RAY_ADDRESS", None)
    head = subprocess.Popen(_head_command(1), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env=env, process_group=0)
    try:
        yield head, head_tmp, ray_tmp
    finally:
        if head.poll() is None:
            os.killpg(head.pid, signal.SIGKILL)
        head.wait()
        shutil.rmtree(head_tmp, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.mark.ray
@pytest.mark.parametrize("gone", ["after", "before"])
def test_a_head_whose_driver_is_gone_removes_its_tmpdir_and_its_clusters_session(gone: str) -> None:
    """Regression: after a kill -9 of the driver its head's TMPDIR (`/tmp/streamprep-ray-head-*`) stayed, and every
    cluster a job started left its session dir (~2 MB) in RAY_TMPDIR/ray. The head, seeing its stdin close as the
    driver dies, removes both once its cluster is down. (And a driver gone before the cluster was up: writing the
    address to it raised BrokenPipeError, which skipped that, both left.)"""
    with _head_in_temp_dirs() as (head, head_tmp, ray_tmp):
        if gone == "after":
            address, session = head.stdout.readline().decode().split()
            assert address and Path(session).is_dir() and Path(session).is_relative_to(ray_tmp)
        else:
            head.stdout.close()  # a driver killed while Ray comes up: nobody reads the address
        head.stdin.close()  # what a driver's death does
        head.wait(timeout=120)
        assert not head_tmp.exists()
        assert list((ray_tmp / "ray").glob("session*")) == []  # no "ray" at all if the start ended before it


@pytest.mark.ray
def test_a_head_whose_driver_goes_while_its_cluster_starts_ends_at_once() -> None:
    """Regression: a kill -9 of the driver's process group while the job's own cluster was starting left that
    cluster running ~15 s on a loaded machine (the head read its stdin only once `ray.init` returned), beside the
    one a quick resume started. Now the head ends the start as its stdin closes: every process of its group gone
    within a few seconds, its TMPDIR and session dir with them."""
    with _head_in_temp_dirs() as (head, head_tmp, ray_tmp):
        def group() -> list[psutil.Process]:  # the head's process group, zombies aside
            found = []
            for p in psutil.process_iter():
                try:
                    if os.getpgid(p.pid) == head.pid and p.status() != psutil.STATUS_ZOMBIE:
                        found.append(p)
                except (psutil.NoSuchProcess, ProcessLookupError):
                    pass
            return found

        deadline = time.monotonic() + 60
        while not any("gcs_server" in " ".join(p.cmdline()) for p in group()):  # Ray is starting: its GCS is up
            assert time.monotonic() < deadline and head.poll() is None, "the head's GCS never started"
            time.sleep(0.05)
        head.stdin.close()  # what the driver's death does
        closed = time.monotonic()
        # the head too: its group can look empty a moment before its exit can be waited for (CI, once: 0.1 s)
        while (group() or head.poll() is None) and time.monotonic() - closed < 5:
            time.sleep(0.05)
        assert (group(), head.poll() is not None) == ([], True), f"alive {time.monotonic() - closed:.1f} s on"
        assert head.stdout.read() == b""  # it never got to say the cluster was up
        assert not head_tmp.exists()
        assert list((ray_tmp / "ray").glob("session*")) == []


HEAD_STAND_IN = """
import os, sys, time
from pathlib import Path
Path(os.environ["RAY_TMPDIR"], "ray", f"session_2026-11-30_05-00-00_000001_{os.getpid()}", "logs").mkdir(parents=True)
time.sleep(60)  # the cluster is coming up: no address printed yet
"""


def test_a_head_stopped_before_it_named_its_session_leaves_no_session_dir(tmp_path: Path, monkeypatch) -> None:
    """Regression: a job that finished before its own Ray cluster was up killed the head, but the session dir the
    head's `ray.init` had made (RAY_TMPDIR/ray/session_<time>_<head pid>, ~50 KB) stayed: the driver only knew
    it from the head's address line. Now the head's own sessions go with it, and no other."""
    from streamprep import ray_cluster

    other = tmp_path / "ray" / "session_2026-11-30_04-00-00_000001_1"  # another cluster's
    other.mkdir(parents=True)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.setattr(ray_cluster, "_head_command", lambda n: [sys.executable, "-c", HEAD_STAND_IN])
    made = lambda: any(p != other for p in (tmp_path / "ray").glob("session_*"))  # noqa: E731
    deadline = time.monotonic() + 30
    assert ray_cluster._start_head(1, lambda: made() or time.monotonic() > deadline) is None
    assert sorted(p.name for p in (tmp_path / "ray").iterdir()) == [other.name]
