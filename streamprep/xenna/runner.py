"""Run TokenizeStage over shard tasks: through Xenna on Ray, or in-process (`execution.engine: local`).

Ray handling follows xenna-notes.md: we call `ray.init` ourselves (or attach to `ray_address`), pin
RAY_ADDRESS so Xenna's monitor finds exactly this cluster, and after the run kill the
`ray::NodeResourceMonitor` / `ray::StageWorker` processes Xenna 0.3 leaves behind. A cluster we
started is shut down; one we attached to is left running.
"""
from __future__ import annotations

import os
from typing import Any

import psutil

from streamprep import logs
from streamprep.shards import ShardTask

log = logs.get("tokenize")
LEAKED_TITLES = ("ray::NodeResourceMonitor", "ray::StageWorker")
RAY_ENV = {
    "RAY_MAX_LIMIT_FROM_API_SERVER": "40000",
    "RAY_MAX_LIMIT_FROM_DATA_SOURCE": "40000",
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    "PYTHON_LOG": os.environ.get("PYTHON_LOG", "warning"),
}


def run_local(tasks: list[ShardTask], tokenizer_path: str, chat: bool = False) -> list[dict[str, Any]]:
    """Same stage logic, in this process, one task after another (the Rust tokenizer still uses all cores)."""
    from cosmos_xenna.pipelines import v1 as xenna

    from streamprep.xenna.stage import TokenizeStage

    stage = TokenizeStage(tokenizer_path, chat=chat)
    stage.setup(xenna.WorkerMetadata.make_dummy())
    out = []
    for task in tasks:
        out.extend(stage.process_data([task]))
        log.info("shard done", dataset=task.dataset, part=task.part, skipped=out[-1]["skipped"])
    return out


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
    """Shut down the Ray cluster this process started and wait for its processes to go."""
    import ray

    children = psutil.Process().children(recursive=True)
    ray.shutdown()
    _, alive = psutil.wait_procs(children, timeout=5)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=3)


def run_xenna(tasks: list[ShardTask], tokenizer_path: str, workers: int, ray_address: str | None,
              chat: bool = False) -> list[dict[str, Any]]:
    """Run the stage through cosmos-xenna; returns one result per task (order not guaranteed)."""
    os.environ.update(RAY_ENV)
    import ray
    from cosmos_xenna.pipelines import v1 as xenna

    from streamprep.xenna.stage import TokenizeStage

    started = False
    if not ray.is_initialized():
        if ray_address:
            ctx = ray.init(address=ray_address, ignore_reinit_error=True, log_to_driver=False)
        else:
            ctx = ray.init(num_cpus=max(workers, 1), include_dashboard=True, log_to_driver=False,
                           object_store_memory=256 * 1024 * 1024)
            started = True
        os.environ["RAY_ADDRESS"] = ctx.address_info["gcs_address"]
    cpus = float(ray.cluster_resources().get("CPU", 1))
    per_worker = max(min(cpus / max(workers, 1), 1.0), 0.1)
    spec = xenna.PipelineSpec(
        input_data=tasks,
        stages=[xenna.StageSpec(TokenizeStage(tokenizer_path, cpus=per_worker, chat=chat), num_workers=workers)],
        config=xenna.PipelineConfig(return_last_stage_outputs=True, cpu_allocation_percentage=1.0,
                                    logging_interval_s=60, num_run_attempts_python=1),
    )
    log.info("starting xenna pipeline", tasks=len(tasks), workers=workers, cpus_per_worker=per_worker,
             ray=os.environ.get("RAY_ADDRESS"))
    try:
        results = xenna.run_pipeline(spec) or []
    finally:
        if started:  # our own cluster: shutting it down takes Xenna's leftovers with it
            shutdown_ray()
            os.environ.pop("RAY_ADDRESS", None)
        elif leaked := reap_leaked_ray_workers():
            log.info("reaped leaked xenna processes", count=leaked)
    return results
