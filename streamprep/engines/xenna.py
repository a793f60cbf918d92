"""`engine: xenna`: one long-lived cosmos-xenna pipeline in SERVING mode for the whole job.

`start()` brings Ray and Xenna up in a background thread while ingest works; sealed parts are put on
the serving source queue as they come and results arrive on the sink (xenna 0.3
`pipelines/v1/test_serving.py`). Xenna stops the moment it reads the `None` task, so `drain()` waits for
every submitted result first. Receipts stay the record of completion: a kill while shards are queued or
running resumes exactly.

On a cluster the job starts itself (no `ray_address`: this machine is the whole cluster) that cluster is extra
capacity on cores the job's workers leave idle (`ray_head` runs it under SCHED_IDLE), and both take shards
from one queue: the stage up to its room in flight once it has answered its first task, a ping, and the job's
executor (`streamprep.executor`, its worker processes on this machine) up to one shard per worker at any
time. Ray and Xenna's start-up (10-15 s on 2 cores) then never delays a shard, and a stage starved by busy
cores never holds more than its room: when the stage alone took every shard after its ping, or the executor
one at a time before it, workers sat idle at the end while the last shards waited (6.4 s of a 46 s job of
2 M documents; 1.5 s of a 9 s one at 300 MB). Shard bytes do not depend on who tokenized them; results say
`where` they ran ("local" or "stage"), and the summary counts both. If that cluster cannot come up at all (Ray
gives its raylet 30 s, which a start-up on a busy machine can miss), the executor does every shard and the log
says why. Nor
is the stage started when Ray comes up after ingest is done and the remaining local shards take less time
than the cluster took to come up: a stage worker starting on the same busy cores would not answer before
the local workers are through, and its start-up only slows them.

With `ray_address` the job is one Xenna pipeline, [ingest stage, tokenize stage], for its whole life
(`StageExecutor`, the job's executor): the driver's calls (judge, finalize and assemble a unit's pieces, the
exports' shards, the audit) are tasks of the ingest stage, its sealed parts tasks of the tokenize stage, so
every node reads, checks and tokenizes, and the driver's machine plans and keeps the books. The driver stays
between the two stages, where plan-order dedup needs it (docs/units.md): a part is tokenized once its
checkpoint is saved.

A node lost under the stage (its raylet dies, a machine goes) costs no rerun: Xenna 0.3 has no fault
tolerance of its own (its pipeline raises once an actor dies), so the engine starts the serving pipeline again
on the nodes left and hands it every task the dead one held, each counted as a retry in the log and in
`logs/retries.jsonl` (which `streamprep status` reads). A result that arrives twice is kept once. A worker that
dies on a node that stays up, twice with the same tasks in flight, was killed by one of them: the job fails
(`WorkerDied`, naming them) rather than run them again after every wait. With no
node left to run on for `ray_cluster.NO_NODE_WAIT_S`, the job fails, and the same command resumes it. On the
job's own cluster, spare capacity on this machine, a failed stage is not restarted: its shards go back to the
executor, counted as retries, and the job goes on without it.
"""
from __future__ import annotations

import itertools
import queue
import sysconfig
import threading
import time
import traceback
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import orjson

from streamprep import logs, ray_cluster
from streamprep.config import ConfigError
from streamprep.layout import RunLayout, needs_change
from streamprep.engines.base import PING, Engine, Result
from streamprep.engines.local import run_local
from streamprep.executor import Call, Executor, Setup, settle
from streamprep.sources.base import Unit, in_worker, one_line
from streamprep.tokenize import ShardTask, drop_tmp_files

log = logs.get("tokenize")
POLL_S = 0.2
STOP_WAIT_S = 30.0  # a stop (end of job or Ctrl-C) waits this long for Xenna and Ray to wind down
LOST_STOP_WAIT_S = 2.0  # ... and this long once the cluster is gone
MAX_STAGE_RESTARTS = 8  # lost nodes the stage recovers from in one job (a node Ray has not yet marked dead
# can cost a second restart); beyond that the job fails and resumes on the next run
HELD_AT_LIVE_LOSSES = 2  # a task in flight each time a stage worker died this many times on a node that stayed up
# fails the job (`WorkerDied`): a task that kills the process running it would otherwise be run again after every
# NODE_DEATH_WAIT_S, up to MAX_STAGE_RESTARTS times (~11 min, progress stuck)
NODE_DEATH_WAIT_S = 60.0  # after a worker is lost, how long to wait for Ray to mark its node dead (Ray's health
# checks took ~20 s here); restarting before that places the stage on the dead node again
IN_FLIGHT_PER_WORKER = 4  # tasks handed to the stage per worker: Xenna takes all it is given into its own queue,
# and the tasks a failed stage held are what a restart hands again (4 keep a worker busy between answers)
RETRIES_FILE = "retries.jsonl"  # in the run's logs dir: one line per shard handed to a new stage


class WorkerDied(RuntimeError):
    """A stage worker died HELD_AT_LIVE_LOSSES times on a node that stayed up with the same tasks in flight: one of
    them most likely kills the process running it (a plug-in's os._exit, a crash in native code, the OOM killer), and
    no restart gets past it. The input's failure, not the cluster's (`ray_cluster.ClusterFailed`)."""


class XennaEngine(Engine):
    name = "xenna"

    def __init__(self, executor: Executor | None, workers: int = 1, ray_address: str | None = None,
                 setup: Setup | None = None):
        super().__init__()
        self._executor = executor  # the job's, which tokenizes on the job's own cluster; None with `ray_address`
        self.workers = max(1, workers)
        self.ray_address = ray_address
        self._source: queue.Queue = queue.Queue()
        self._sink: queue.Queue = queue.Queue()
        self._results: list[Result] = []
        self._thread: threading.Thread | None = None
        self._helpers: list[threading.Thread] = []  # the collector and the local tokenizer: joined with `_thread`
        self._ended = threading.Event()  # set by `_join`: the collector stops, even if the stage did not
        self._error: BaseException | None = None
        self.started_at: float | None = None
        self._stopping: float | None = None
        self.ready_at: float | None = None
        self._early = ray_address is None  # the job's own cluster: the executor tokenizes too
        self._running_local = 0  # tasks on the executor (under _cv)
        self._cv = threading.Condition()
        self._stage_answered = False
        self._draining = False  # every task is submitted (ingest is done)
        self._local_only: str | None = None  # why the job's own cluster is not used (the executor tokenizes all)
        self._in_flight: dict[Any, Any] = {}  # task key -> task, handed to the stage and not answered (under _cv)
        self._queued: deque = deque()  # tasks for the stage, waiting for room in flight (under _cv)
        self._room = IN_FLIGHT_PER_WORKER  # tasks in flight at most: per stage worker, set when the stage starts
        self._retried: set = set()  # shards handed to a restarted stage (each counted once)
        self._held_at_live_loss: dict[Any, int] = {}  # task key -> stage workers lost on a live node with it in flight
        self._cluster_lost = False
        # with `ray_address` the pipeline also runs the job's calls (`StageExecutor`), in an ingest stage whose
        # workers run `setup`, and it ends with the executor (`close`), after the exports and the audit
        self._serves_calls, self._setup = ray_address is not None, setup
        self._call_keys = itertools.count()
        self._futures: dict[int, Future] = {}  # call key -> its future, until answered (under _cv)
        self.calls_per_node: dict[str, dict[str, int]] = {}  # node -> function -> calls answered there

    @classmethod
    def job_executor(cls, workers: int, ray_address: str | None, setup: Setup) -> Executor | None:
        """With `ray_address` the job is one pipeline: its calls run in the ingest stage (`StageExecutor`)."""
        return StageExecutor(workers, ray_address, setup) if ray_address else None

    def start(self) -> None:
        if self.started_at is not None:  # serving calls, the executor started it before the job's `with engine`
            return
        self.started_at = time.monotonic()
        # Xenna imports loguru in the stage thread, which reads sysconfig's paths while other threads may be first
        # to fill its config vars: on Python 3.11 a reader can see them half-filled (AttributeError: 'userbase',
        # 3 of ~20 runs on a shared cluster). Filled here, before any thread, they are complete.
        sysconfig.get_config_vars()
        self._thread = threading.Thread(target=self._serve, name="xenna", daemon=True)
        self._thread.start()
        self._helpers.append(threading.Thread(target=self._collect, args=(self._thread,), name="xenna-results",
                                              daemon=True))
        if self._early:
            with self._cv:
                self._hand(PING)
            self._helpers.append(threading.Thread(target=self._tokenize_local, name="tokenize-local", daemon=True))
        for helper in self._helpers:
            helper.start()

    def _serve(self) -> None:
        lost: str | None = None  # why the job's own cluster failed under the stage: the executor takes over
        try:
            try:
                address = ray_cluster.connect(self.ray_address, self.workers, lambda: self._stopping is not None)
            except ray_cluster.HeadStartError as exc:
                if not self._early:
                    raise
                self._local_only = str(exc)  # this machine is the whole cluster: the executor does every shard
                log.warning("ray did not come up; the local workers tokenize every shard", reason=self._local_only)
                return
            if address is None or self._stopping is not None:  # the executor did every shard while Ray came up
                log.info("job done before the xenna stage was needed; not starting it",
                         ray_up=address is not None, seconds=round(time.monotonic() - (self.started_at or 0.0), 2))
                return
            if (why := self._local_ends_first()) is not None:
                self._local_only = why
                log.info("not starting the xenna stage: the local workers end the remaining shards first", reason=why)
                return
            from cosmos_xenna.pipelines import v1 as xenna

            from streamprep.engines.xenna_stage import IngestStage, TokenizeStage  # Xenna: it imports cosmos_xenna

            self.ready_at = time.monotonic()
            self._run_stage(xenna, TokenizeStage, IngestStage)
        except BaseException as exc:  # surfaced by drain()/stop() in the job's thread
            if self._early and self._stopping is None and isinstance(exc, Exception):
                lost = f"{type(exc).__name__}: {str(exc)[:300]}"
            else:
                self._error = exc
            if not isinstance(exc, ray_cluster.NoNodeLeft):  # the message alone rarely says where it failed
                log.warning("xenna stage failed", error=f"{type(exc).__name__}: {exc}",
                            where=traceback.format_exc(limit=-6)[-3000:])
        finally:
            ray_cluster.release()  # Ray must be shut down by the thread that started it
            self._fail_calls(self._error or RuntimeError("the xenna pipeline stopped before answering"))
        if lost is not None:  # after the release: no stage worker still writes a shard the executor now takes
            self._take_back(lost)

    def _take_back(self, reason: str) -> None:
        """The job's own cluster failed under the stage: being spare capacity, it takes the job down with it no
        more than a slow start does. The shards it held go back to the front of the queue, in order, each counted
        as a retry, for the executor; what a killed writer of one left goes first (the executor's `run_local`
        drops nothing: a first attempt there)."""
        with self._cv:
            self._local_only = f"the xenna stage failed ({reason}); the local workers tokenize the rest"
            tasks = [t for t in self._in_flight.values() if t != PING]
            self._in_flight.clear()
        for task in tasks:
            if _is_shard(task):
                drop_tmp_files(task)
        with self._cv:
            self._queued.extendleft(reversed(tasks))
            self._cv.notify_all()
        log.warning("xenna stage lost; its shards go to the local workers", shards=len(tasks), reason=reason)
        self._count_retries(tasks, reason)

    def _run_stage(self, xenna: Any, stage_cls: type, ingest_cls: type) -> None:
        """Run the serving pipeline until the job's stop; when it fails because a worker or node died, run it
        again on the nodes left (once one is usable) with the tasks the failed one held."""
        restarts = 0
        since = self.started_at or time.monotonic()  # what a "stage started" line measures from: the job's start
        ingest_workers = self.workers if self._serves_calls else 0  # the job's calls: as many workers as a pool has
        while True:
            nodes = ray_cluster.usable_nodes()
            per_worker = ray_cluster.cpus_per_worker(self.workers)
            stage_workers = max(1, min(self.workers, len(nodes)))
            stages = [xenna.StageSpec(stage_cls(cpus=per_worker), num_workers=stage_workers)]
            if ingest_workers:
                stages.insert(0, xenna.StageSpec(ingest_cls(per_worker, self._setup), num_workers=ingest_workers))
            with self._cv:
                source = self._source
                self._room = IN_FLIGHT_PER_WORKER * (stage_workers + ingest_workers)
                self._pump()
            spec = xenna.PipelineSpec(
                input_data=[],
                stages=stages,
                config=xenna.PipelineConfig(execution_mode=xenna.ExecutionMode.SERVING, cpu_allocation_percentage=1.0,
                                            logging_interval_s=60, num_run_attempts_python=1),
                serving_queues=xenna.ServingQueues(source=source, sink=self._sink),
            )
            log.info("xenna serving stage started", workers=stage_workers, cpus_per_worker=per_worker,
                     ingest_workers=ingest_workers,
                     ray=ray_cluster.address(), restarts=restarts,
                     startup_seconds=round(time.monotonic() - since, 2))
            try:
                xenna.run_pipeline(spec)
                return
            except Exception as exc:
                since = time.monotonic()  # a restart's start-up: from the failure (its waits included)
                if (refused := _refusal(exc)) is not None:  # the job's one line and exit 2, not Xenna's wrapper
                    raise refused from None
                if self._early:  # this machine is the whole cluster: no node to restart on (the executor takes over)
                    raise
                lost = nodes - ray_cluster.usable_nodes()
                if self._stopping is not None or restarts >= MAX_STAGE_RESTARTS \
                        or not (lost or ray_cluster.is_lost_worker(exc)):
                    raise
                restarts += 1
                if not lost:  # the worker is gone, but Ray may not have marked its node dead yet
                    lost = ray_cluster.wait_for_node_loss(nodes, NODE_DEATH_WAIT_S, lambda: self._stopping is not None)
                if self._stopping is not None:  # a stop came while it waited: nothing starts again
                    raise
                if not lost and (held := self._held_again()):
                    raise WorkerDied(
                        f"a stage worker died {HELD_AT_LIVE_LOSSES} times on a node that stayed up, with "
                        f"{_describe(held)} in flight each time: one of them kills the process running it (a plug-in's "
                        f"os._exit, a crash in native code, the OOM killer) ({type(exc).__name__})") from exc
                log.warning("xenna stage lost a worker; restarting it on the nodes left", restarts=restarts,
                            lost_nodes=sorted(lost), error=f"{type(exc).__name__}: {str(exc)[:300]}")
                if not ray_cluster.wait_for_usable_node(lambda: self._stopping is not None):
                    if self._stopping is not None:
                        raise
                    raise ray_cluster.NoNodeLeft(
                        f"no Ray node able to run the stage for {ray_cluster.NO_NODE_WAIT_S:.0f} s after it lost a "
                        f"worker ({type(exc).__name__}); re-run the same command to resume") from exc
                self._retry_in_flight(f"{type(exc).__name__}: {str(exc)[:200]}")

    def _held_again(self) -> list[Any]:
        """After a stage worker died on a node that stayed up: count that death for every task in flight, and return
        those in flight at HELD_AT_LIVE_LOSSES such deaths (a lost node counts for none: its tasks were not at
        fault)."""
        with self._cv:
            tasks = [t for t in self._in_flight.values() if t != PING]
        for task in tasks:
            self._held_at_live_loss[_key(task)] = self._held_at_live_loss.get(_key(task), 0) + 1
        return [t for t in tasks if self._held_at_live_loss[_key(t)] >= HELD_AT_LIVE_LOSSES]

    def _retry_in_flight(self, reason: str) -> None:
        """Hand every task the failed pipeline held to a fresh source queue, in the order first given, and
        count each as a retry. A killed writer may have left a temporary file of that shard: it goes first."""
        with self._cv:
            source: queue.Queue = queue.Queue()
            tasks = list(self._in_flight.values())
            for task in tasks:
                source.put(task)
            if self._stopping is not None:
                source.put(None)
            self._source = source
        for task in tasks:
            if _is_shard(task):
                drop_tmp_files(task)
        self._count_retries(tasks, reason)

    def _count_retries(self, tasks: list[Any], reason: str) -> None:
        """Log each shard handed again and append it to the run's retries file, once a shard; calls are
        counted in one line (each writes its files atomically, so running one again changes nothing)."""
        if calls := [t.fn.__name__ for t in tasks if isinstance(t, Call)]:
            log.warning("calls retried", calls=len(calls), functions=sorted(set(calls)), reason=reason)
        shards = [t for t in tasks if _is_shard(t) and _key(t) not in self._retried]
        self._retried.update(_key(t) for t in shards)
        for task in shards:
            log.warning("shard retried", dataset=task.dataset, part=task.part, reason=reason)
        if shards:
            _record_retries(shards, reason)

    def _local_ends_first(self) -> str | None:
        """On the job's own cluster, once every task is submitted: why the remaining local shards end before
        a stage could take one (they need less time than Ray took to come up), or None."""
        if not self._early or not self._draining:
            return None
        with self._cv:
            left = len(self._queued) + self._running_local
        with self._lock:
            seconds = [r["seconds"] for r in self._results if r["where"] == "local" and not r["skipped"]]
        if not seconds:
            return None
        ray_up = time.monotonic() - (self.started_at or time.monotonic())
        local_left = left * sum(seconds) / len(seconds) / self.workers
        if local_left >= ray_up:
            return None
        return f"{left} shard(s), about {local_left:.1f} s on the local workers; ray took {ray_up:.1f} s to come up"

    def submit(self, task: ShardTask) -> None:
        self.submitted += 1
        with self._cv:
            self._queued.append(task)
            self._pump()
            self._cv.notify_all()

    def call(self, fn: Any, args: tuple) -> Future:
        """Queue one of the job's calls for the ingest stage, in order with the shards (`StageExecutor`)."""
        assert self._serves_calls, "on the job's own cluster the calls run on its executor"
        future: Future = Future()
        call = Call(next(self._call_keys), fn, args)
        with self._cv:
            if self._error is not None or self._stopping is not None:
                settle(future, exc=ray_cluster.ClusterFailed("the xenna pipeline is not running"))
                return future
            self._futures[call.key] = future
            self._queued.append(call)
            self._pump()
        return future

    def _answer(self, result: dict[str, Any]) -> None:
        """A call's answer from the ingest stage: counted where it ran, its future settled."""
        with self._cv:
            future = self._futures.pop(result["call"], None)
            on_node = self.calls_per_node.setdefault(str(result.get("node_id")), {})
            on_node[result["fn"]] = on_node.get(result["fn"], 0) + 1
        if future is not None and "error" in result:
            settle(future, exc=result["error"])
        elif future is not None:
            settle(future, result=result["result"])

    def _fail_calls(self, exc: BaseException) -> None:
        """Every call not answered gets `exc`: the pipeline ended (failed, or no node left) without it. One that
        re-running as is cannot get past (a ConfigError) stays as it is; any other is the pipeline's, not the call's
        (`ray_cluster.ClusterFailed`)."""
        if isinstance(exc, Exception) and not isinstance(exc, WorkerDied) and _needing_change(exc) is None:
            failed = ray_cluster.ClusterFailed(f"the xenna pipeline on the Ray cluster failed: {one_line(exc)}")
            failed.__cause__, exc = exc, failed
        with self._cv:
            futures, self._futures = list(self._futures.values()), {}
        for future in futures:
            settle(future, exc=exc)

    def _pump(self) -> None:
        """Hand queued tasks to the stage, once it may take them, while fewer than `_room` are in flight,
        remembering each until its answer (call with `_cv` held)."""
        if (self._early and not self._stage_answered) or self._local_only is not None:
            return
        while self._queued and len(self._in_flight) < self._room:
            self._hand(self._queued.popleft())

    def _hand(self, task: Any) -> None:
        """Put `task` on the stage's source, remembered in flight until its answer (call with `_cv` held)."""
        self._in_flight[_key(task)] = task
        self._source.put(task)

    def _tokenize_local(self) -> None:
        """On the job's own cluster: hand queued tasks to the executor, up to one per worker at a time, whether
        or not the stage is up."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._stopping or self._error is not None
                                  or (self._queued and self._running_local < self.workers))
                if self._stopping or self._error is not None:
                    return
                task = self._queued.popleft()
                self._running_local += 1
            self._executor.submit(run_local, task).add_done_callback(self._local_done)

    def _local_done(self, future: Future) -> None:
        """A task the executor ran: kept as a local result, or its failure surfaced by drain()."""
        try:
            self._keep({**future.result(), "where": "local"})
        except BaseException as exc:
            self._error = exc
        with self._cv:
            self._running_local -= 1
            self._cv.notify_all()

    def _on_ping(self) -> None:
        """The stage is up: from now on it takes queued tasks too, in order, up to its room."""
        with self._cv:
            self._stage_answered = True
            self._pump()
            self._cv.notify_all()
        log.info("xenna stage answering", seconds=round(time.monotonic() - (self.started_at or 0.0), 2),
                 shards_local=self.completed)

    def _keep(self, result: Result) -> None:
        with self._lock:
            self._results.append(result)
        try:
            self._done(result)
        except Exception as exc:  # surfaced by drain(), which would otherwise wait for it forever
            self._error = exc

    def _check_alive(self) -> None:
        if self._error is not None:
            if (recognised := _needing_change(self._error)) is not None:  # exit 2 and needs_change, as under local
                raise recognised
            raise RuntimeError(f"xenna tokenize stage failed: {type(self._error).__name__}: {self._error}") \
                from self._error
        if self._local_only is not None:
            return
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("xenna tokenize stage stopped before every shard was done")

    def _collect(self, serve: threading.Thread) -> None:
        """Move results from the sink as they come, so progress sees shards finish during ingest; until `serve`
        has ended and its results are moved, or the engine's join."""
        while not self._ended.is_set() and (serve.is_alive() or not self._sink.empty()):
            try:
                result = self._sink.get(timeout=POLL_S)
            except queue.Empty:
                continue
            logs.replay(result.pop("events", ()))  # what the stage's worker logged making it
            with self._cv:
                fresh = self._in_flight.pop(_key(result), None) is not None
                self._pump()
            if not fresh:  # a retried task whose first run answered after all: its result is kept once
                continue
            if "call" in result:
                self._answer(result)
            elif result.get("ping"):
                self._on_ping()
            else:
                self._keep({**result, "where": "stage"})

    def drain(self) -> list[Result]:
        self._draining = True
        while self.completed < self.submitted:
            time.sleep(POLL_S / 4)
            if self.completed < self.submitted:
                self._check_alive()
                # a stage waiting on a cluster that is gone never answers (the executor's own shards do)
                if self._local_only is None and (why := ray_cluster.no_node_left()):
                    self._cluster_lost = True
                    raise ray_cluster.NoNodeLeft(f"xenna tokenize stage: {why}; re-run the same command to resume")
        with self._lock:
            out, self._results = self._results, []
        return out

    def stop(self) -> None:
        if not self._serves_calls:  # serving calls, it ends with the job's executor (`close`)
            self._stop()

    def join(self) -> None:
        if not self._serves_calls:
            self._join()

    def close(self) -> None:
        """End a pipeline that serves the job's calls too, once the exports and the audit are done."""
        self._stop()
        self._join()

    def _stop(self) -> None:
        if self._thread is not None and not self._stopping:
            with self._cv:
                self._stopping = time.monotonic()
                self._cv.notify_all()
                self._source.put(None)  # Xenna's end-of-serving signal; its thread then shuts Ray down

    def _join(self) -> None:
        if self._thread is None:
            return
        wait = LOST_STOP_WAIT_S if self._cluster_lost else STOP_WAIT_S  # Xenna blocks on the gone cluster
        self._thread.join(timeout=wait)
        if self._thread.is_alive():
            log.warning("xenna stage did not stop in time; leaving it to process exit", seconds=wait)
        elif self.ray_address:  # attached: the cluster is not the job's, and keeps running
            log.info("xenna stage stopped; the Ray cluster keeps running", ray=self.ray_address,
                     seconds=round(time.monotonic() - (self._stopping or time.monotonic()), 2))
        else:
            log.info("xenna stage and its Ray cluster stopped",
                     seconds=round(time.monotonic() - (self._stopping or time.monotonic()), 2))
        # The helpers end within a poll now. One left running held the engine, and so the job's executor and its
        # pool, past a failed library job: its semaphores outlived the pool's processes and a later forkserver
        # stop unlinked them ('sem_unlink FileNotFoundError' tracebacks at the test session's exit).
        self._ended.set()
        for helper in self._helpers:
            helper.join(timeout=10 * POLL_S)
        self._thread = None


def _needing_change(exc: BaseException | None) -> BaseException | None:
    """The error in `exc`'s chain that re-running as is cannot get past (`layout.needs_change`: a ConfigError such as
    a sealed part's failed SHA-256, a file or folder in the way, an unwritable folder), as its task raised it (Ray's
    RayTaskError unwrapped): wrapped in the engine's RuntimeError, the job exited 1 and run.json called it resumable,
    where under `engine: local` it is exit 2 with `needs_change`."""
    while exc is not None:
        exc = in_worker(exc)[0]
        if needs_change(exc):
            return exc
        exc = exc.__cause__
    return None


def _refusal(exc: BaseException | None) -> ConfigError | None:
    """The ConfigError a stage worker's setup raised (`ray_cluster.same_source`: its node's streamprep is another),
    which Xenna's pipeline ends with inside its RuntimeError "Actor … failed during setup"."""
    while exc is not None:
        if isinstance(exc, ConfigError):
            return in_worker(exc)[0]  # type: ignore[return-value]  # Ray's RayTaskError(ConfigError): the error
        exc = exc.__cause__
    return None


def _key(item: Any) -> Any:
    """What identifies a task and its result: a ShardTask or a shard's result, a Call or its answer, the ping."""
    if isinstance(item, Call):
        return "call", item.key
    if isinstance(item, dict):
        if "call" in item:
            return "call", item["call"]
        return PING if item.get("ping") else (item["task"]["dataset"], item["task"]["part"])
    return PING if item == PING else (item.dataset, item.part)


def _describe(tasks: list[Any], most: int = 4) -> str:
    """The tasks a log line or an error names: a call by its function, dataset and unit (file and range), a shard by
    its dataset and part."""
    def one(task: Any) -> str:
        if not isinstance(task, Call):
            return f"shard {task.dataset} part {task.part}"
        named = [a for a in task.args if isinstance(a, str)][:1] + [
            f"{u.path} [{u.start}, {u.end})" for u in task.args if isinstance(u, Unit)][:1]
        return f"{task.fn.__name__}({', '.join(named)})"
    more = f" and {len(tasks) - most} more" if len(tasks) > most else ""
    return "; ".join(one(t) for t in tasks[:most]) + more


def _is_shard(task: Any) -> bool:
    return task != PING and not isinstance(task, Call)


class StageExecutor(Executor):
    """The job's executor when `engine: xenna` has `ray_address`: every call is a task of the pipeline's ingest
    stage (`XennaEngine.call`), so the job's engine and executor are one pipeline, started here and stopped at
    `close()`, after the exports and the audit. A call the pipeline held when a node was lost runs again on the
    restarted one, as its shards do; with no node left, the waiting calls fail after
    `ray_cluster.NO_NODE_WAIT_S`."""

    def __init__(self, workers: int, address: str, setup: Setup | None):
        self.workers = max(1, workers)
        self.engine = XennaEngine(None, self.workers, address, setup=setup)
        self.engine.start()
        self._done = threading.Event()
        threading.Thread(target=self._watch, name="stage-executor", daemon=True).start()
        log.info("workers in the xenna ingest stage", workers=self.workers, address=address)

    def submit(self, fn: Any, *args: Any) -> Future:
        return self.engine.call(fn, args)

    def _watch(self) -> None:
        """Fail the waiting calls once the cluster has had no usable node for a while."""
        while not self._done.wait(1.0):
            if self.engine._futures and (why := ray_cluster.no_node_left()):
                self.engine._cluster_lost = True
                self.engine._fail_calls(ray_cluster.NoNodeLeft(f"workers: {why}; re-run the same command to resume"))

    def close(self, wait: bool = True) -> None:  # the pipeline's stop ends its workers either way
        self._done.set()
        log.info("worker calls per node", calls=self.engine.calls_per_node)  # units on every node?
        self.engine.close()


def _record_retries(tasks: list[ShardTask], reason: str) -> None:
    """Append one line per retried shard to the run's retries file (read by `streamprep status`)."""
    path = RunLayout(Path(tasks[0].run_dir)).logs_dir / RETRIES_FILE
    lines = b"".join(orjson.dumps({"at": time.time(), "dataset": t.dataset, "part": t.part, "reason": reason}) + b"\n"
                     for t in tasks)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as fh:
        fh.write(lines)
