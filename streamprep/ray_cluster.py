"""The job's one Ray cluster, shared by the QC actors and the Xenna tokenize stage.

Follows xenna-notes.md: we call `ray.init` ourselves (or attach to `execution.ray_address`) and pin
RAY_ADDRESS so Xenna's monitor finds exactly this cluster. A cluster we started is shut down with every
process it started; one we attached to is left running, minus the `ray::NodeResourceMonitor` /
`ray::StageWorker` processes Xenna 0.3 leaves behind.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable

import psutil

from streamprep import logs

log = logs.get("ray")
GRACE_S = 0.5  # after ray.shutdown its processes get this long to exit, then are killed: the work is done
LEAKED_TITLES = ("ray::NodeResourceMonitor", "ray::StageWorker")
RAY_ENV = {
    "RAY_MAX_LIMIT_FROM_API_SERVER": "40000",
    "RAY_MAX_LIMIT_FROM_DATA_SOURCE": "40000",
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    "PYTHON_LOG": os.environ.get("PYTHON_LOG", "warning"),
}
RAY_NICE = 5  # a cluster started here runs niced: on a shared box the driver's own tokenizing comes first
_lock = threading.Lock()
_started_here = False
_qc_placed = threading.Event()  # this job's QC actors hold their CPUs (set by ingest, awaited by the stage)
QC_PLACEMENT_WAIT_S = 120.0


def connect(address: str | None, num_cpus: int) -> str:
    """Start (or attach to) the job's cluster once per process; returns its GCS address. The thread that
    starts a cluster must be the one that calls `release()`."""
    global _started_here
    os.environ.update(RAY_ENV)
    import ray

    with _lock:
        if not ray.is_initialized():
            if address:
                ctx = ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
            else:
                _nice_this_thread(RAY_NICE)  # Ray's processes inherit it, and the raylet's workers from them
                ctx = ray.init(num_cpus=max(num_cpus, 1), include_dashboard=True, log_to_driver=False,
                               object_store_memory=256 * 1024 * 1024)
                _started_here = True
            os.environ["RAY_ADDRESS"] = ctx.address_info["gcs_address"]
            log.info("ray connected", address=os.environ["RAY_ADDRESS"], started=_started_here)
        return os.environ.get("RAY_ADDRESS", "")


def _nice_this_thread(increment: int) -> None:
    """Lower the calling thread's priority (Linux: niceness is per thread, and a child process inherits its
    parent thread's). Ray's start-up (GCS, raylet, dashboard, workers: ~20 processes) then takes the cores
    only when the driver leaves them idle; until the stage answers, the driver tokenizes (engines/xenna.py)."""
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)


def cpus_per_worker(workers: int) -> float:
    """Logical CPUs for one QC actor or one stage worker: both pools of `workers` share the cluster for
    the whole job (ingest and tokenization overlap), so together they must fit in its CPUs."""
    import ray

    cpus = float(ray.cluster_resources().get("CPU", 1))
    return max(min(cpus / max(workers, 1), 1.0) / 2, 0.05)


def node_count() -> int:
    """Alive nodes of the cluster: the stage runs one worker per node, since the Rust tokenizer already
    threads over a node's cores (two workers on one 2-core node only compete: docs/performance.md)."""
    import ray

    return max(1, sum(1 for n in ray.nodes() if n.get("Alive")))


def spread_actors(cls: type, workers: int, *args: object) -> list:
    """`workers` actors of `cls`, one logical CPU share each, spread over the nodes and started before this
    returns. The stage is placed after them (`wait_for_qc_actors`) and fills what they left node by node,
    so on N nodes both pools cover all N whoever asked Ray first."""
    import ray

    actor = ray.remote(num_cpus=cpus_per_worker(workers), scheduling_strategy="SPREAD")(cls)
    actors = [actor.remote(*args) for _ in range(workers)]
    ray.get([a.ready.remote() for a in actors])
    _qc_placed.set()
    return actors


def expect_qc_actors() -> None:
    """Called when a job's engine starts: the QC actors it will wait for are this job's, not a previous one's."""
    _qc_placed.clear()


def wait_for_qc_actors(cancelled: Callable[[], bool]) -> bool:
    """Block until this job's QC actors are placed; False after QC_PLACEMENT_WAIT_S or once `cancelled()`
    (a job that failed before QC started stops its engine: that must not wait out the limit)."""
    deadline = time.monotonic() + QC_PLACEMENT_WAIT_S
    while not _qc_placed.wait(0.1):
        if cancelled() or time.monotonic() > deadline:
            return False
    return True


def release() -> None:
    """Shut down a cluster this process started; from an attached one only reap Xenna's leftovers."""
    global _started_here
    with _lock:
        if _started_here:
            shutdown_ray()
            log.info("ray cluster shut down")
            os.environ.pop("RAY_ADDRESS", None)
            _started_here = False
        elif leaked := reap_leaked_ray_workers():
            log.info("reaped leaked xenna processes", count=leaked)


def reap_leaked_ray_workers() -> int:
    """Kill this process's descendants that Xenna 0.3 leaves alive after run_pipeline."""
    killed = 0
    for child in psutil.Process().children(recursive=True):
        try:
            title = " ".join(child.cmdline())
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if title.startswith(LEAKED_TITLES):
            try:
                child.kill()
                killed += 1
            except psutil.NoSuchProcess:
                pass
    return killed


def shutdown_ray() -> None:
    """Shut down the Ray cluster this process started and wait for its processes to go. Call it from the
    thread that called `ray.init` (from another, Ray waits ~15 s and leaves its agents running)."""
    import ray

    stop_and_reap(ray.shutdown)


def ray_processes() -> list[psutil.Process]:
    """This process's Ray processes: children running Ray's programs (gcs_server, raylet, dashboard, log and
    autoscaler monitors: an argument under Ray's package dir) or titled `ray::` / `ray-dashboard`, and all
    their descendants. Never another child, such as the exports' process pool running meanwhile."""
    import ray

    ray_dir = os.path.dirname(ray.__file__) + os.sep
    found: list[psutil.Process] = []
    for child in psutil.Process().children():
        try:
            args = child.cmdline()
            if any(a.startswith(ray_dir) for a in args) or (args and args[0].startswith(("ray::", "ray-dashboard"))):
                found += [child, *child.children(recursive=True)]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def stop_and_reap(stop: Callable[[], None], procs: list[psutil.Process] | None = None) -> None:
    """Run `stop` (a cluster shutdown), then kill the processes that outlived it (after GRACE_S): `procs`,
    by default all of this process's Ray processes. Busy stage workers are killed first: a shard they were
    writing has no receipt and is redone on resume."""
    children = ray_processes() if procs is None else procs
    reap_leaked_ray_workers()
    stop()
    _, alive = psutil.wait_procs(children, timeout=GRACE_S)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=3)
