"""`engine: xenna`: one long-lived cosmos-xenna pipeline in SERVING mode for the whole job.

`start()` brings Ray and Xenna up in a background thread while ingest works; sealed parts are put on
the serving source queue as they come and results arrive on the sink (xenna 0.3
`pipelines/v1/test_serving.py`). Xenna stops the moment it reads the `None` task, so `drain()` waits for
every submitted result first. Receipts stay the record of completion: a kill while shards are queued or
running resumes exactly.
"""
from __future__ import annotations

import queue
import threading
import time

from streamprep import logs, ray_cluster
from streamprep.engines.base import Engine, Result
from streamprep.tokenize import ShardTask

log = logs.get("tokenize")
POLL_S = 0.2
STOP_WAIT_S = 30.0  # a stop (end of job or Ctrl-C) waits this long for Xenna and Ray to wind down


class XennaEngine(Engine):
    name = "xenna"

    def __init__(self, workers: int = 1, ray_address: str | None = None):
        super().__init__()
        self.workers = max(1, workers)
        self.ray_address = ray_address
        self._source: queue.Queue = queue.Queue()
        self._sink: queue.Queue = queue.Queue()
        self._results: list[Result] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.started_at: float | None = None
        self._stopping: float | None = None
        self.ready_at: float | None = None

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._thread = threading.Thread(target=self._serve, name="xenna", daemon=True)
        self._thread.start()
        threading.Thread(target=self._collect, name="xenna-results", daemon=True).start()

    def _serve(self) -> None:
        try:
            from cosmos_xenna.pipelines import v1 as xenna

            from streamprep.engines.xenna_stage import TokenizeStage

            address = ray_cluster.connect(self.ray_address, self.workers)
            per_worker = ray_cluster.cpus_per_worker(self.workers)
            spec = xenna.PipelineSpec(
                input_data=[],
                stages=[xenna.StageSpec(TokenizeStage(cpus=per_worker), num_workers=self.workers)],
                config=xenna.PipelineConfig(execution_mode=xenna.ExecutionMode.SERVING, cpu_allocation_percentage=1.0,
                                            logging_interval_s=60, num_run_attempts_python=1),
                serving_queues=xenna.ServingQueues(source=self._source, sink=self._sink),
            )
            self.ready_at = time.monotonic()
            log.info("xenna serving stage started", workers=self.workers, cpus_per_worker=per_worker, ray=address,
                     startup_seconds=round(self.ready_at - (self.started_at or self.ready_at), 2))
            xenna.run_pipeline(spec)
        except BaseException as exc:  # surfaced by drain()/stop() in the job's thread
            self._error = exc
        finally:
            ray_cluster.release()  # Ray must be shut down by the thread that started it

    def submit(self, task: ShardTask) -> None:
        self.submitted += 1
        self._source.put(task)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"xenna tokenize stage failed: {type(self._error).__name__}: {self._error}") \
                from self._error
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("xenna tokenize stage stopped before every shard was done")

    def _collect(self) -> None:
        """Move results from the sink as they come, so progress sees shards finish during ingest."""
        while self._thread is not None and (self._thread.is_alive() or not self._sink.empty()):
            try:
                result = self._sink.get(timeout=POLL_S)
            except queue.Empty:
                continue
            with self._lock:
                self._results.append(result)
            try:
                self._done(result)
            except Exception as exc:  # surfaced by drain(), which would otherwise wait for it forever
                self._error = exc

    def drain(self) -> list[Result]:
        while self.completed < self.submitted:
            time.sleep(POLL_S / 4)
            if self.completed < self.submitted:
                self._check_alive()
        with self._lock:
            out, self._results = self._results, []
        return out

    def stop(self) -> None:
        if self._thread is not None and not self._stopping:
            self._stopping = time.monotonic()
            self._source.put(None)  # Xenna's end-of-serving signal; its thread then shuts Ray down

    def join(self) -> None:
        if self._thread is None:
            return
        self._thread.join(timeout=STOP_WAIT_S)
        if self._thread.is_alive():
            log.warning("xenna stage did not stop in time; leaving it to process exit", seconds=STOP_WAIT_S)
        else:
            log.info("xenna stage and its Ray cluster stopped",
                     seconds=round(time.monotonic() - (self._stopping or time.monotonic()), 2))
        self._thread = None
