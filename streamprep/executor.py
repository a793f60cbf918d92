"""The job's executor: one way to run every call a job hands out, on this machine or on a Ray cluster.

A job's work outside the driver is a sequence of calls, each a module-level function and its picklable
arguments: judging, finalizing and assembling a unit's pieces (`streamprep.unit_worker`), tokenizing a
sealed part with its exports summary and sorted run (`engines.base.run_shard`, with `engine: local`), the
exports' Parquet shards (`streamprep.exports`) and the audit. One `Executor` runs them all for the whole job:

- `LocalExecutor`: `workers` processes forked from a forkserver (or one thread of the job's process for
  `workers: 1`), which end with the job's process;
- `RayExecutor`: `workers` actors spread over an existing Ray cluster (`execution.ray_address`, `engine:
  local`), so the driver's machine runs only the planning and the bookkeeping;
- `engines.xenna.StageExecutor` (`ray_address`, `engine: xenna`): the job is one Xenna pipeline, and each call
  is a `Call` task of its ingest stage.

With `engine: xenna` the tokenize calls go to the Xenna stage instead (`engines.xenna`), which runs the
same `run_shard`. Every call writes its files atomically and depends only on its arguments, so an executor
may run a call again (after a worker process died, or an actor or a pipeline was lost with its node) without
changing a byte, and results come back in whatever order calls finish: callers wait for them in plan order.
"""
from __future__ import annotations

import gc
import importlib
import itertools
import os
import pickle
import signal
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from concurrent.futures import Future, InvalidStateError, ProcessPoolExecutor, ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable, Iterable, Iterator

from streamprep import forkserver, logs, ray_cluster, version
from streamprep.children import serve_driver

log = logs.get("executor")
# Worker processes run this much nicer than the job's process: the driver's bookkeeping (the decider, the
# checkpoints) comes first on a shared core, so it never waits behind the workers it feeds.
WORKER_NICE = 10
POOL_RESTARTS = 4  # process pools replaced after a worker process died, per job; then the job fails (and resumes)
CALL_KILLS = 2  # a call whose worker process died running it this many times fails (`WorkerDied`), not run again
FORKSERVER_GONE_S = 0.2  # before a new pool, after a worker could not start (a forkserver still dying)
STOP_SEEN_S = 0.5  # how long a pool whose worker died by SIGTERM waits for the job's own stop before it is replaced
Setup = tuple[Callable[..., None], tuple]  # run once in each worker before its first call: fn, args
# CPython's cyclic collector, tuned for a worker (and the job's process): its calls allocate and free a few small
# containers per record (parsed dicts, metas, rows), so a young-generation pass came every 700 of them and the
# full passes walked everything the imports left (numpy, pyarrow, the gates' tables): ~6 % of a 300 k
# short-document job's CPU (perf: gc_collect_main, visit_decref, visit_reachable). With what is loaded frozen
# and a young generation of GC_YOUNG, most temporaries are freed before a pass sees them; cycles are still found.
GC_YOUNG = 100_000


class WorkerDied(BrokenProcessPool):
    """A worker process died with the pool holding this call (running or queued) and no pool is left to run it on
    (POOL_RESTARTS used): a call that kills the process running it (a plug-in's os._exit, a crash in native code, the
    OOM killer) breaks every pool it runs on. The job names the dataset and unit of the call (`ingest`)."""


def quiet_gc() -> None:
    """Freeze what this process has loaded so far (out of every collection's walk; `gc.freeze`) and collect the
    young generation every GC_YOUNG allocations instead of 700. Call it once set-up is done."""
    gc.freeze()
    gc.set_threshold(GC_YOUNG)


class Executor(ABC):
    """Runs calls `fn(*args)`; `submit` may be called from any thread, and returns at once."""

    workers: int
    stoppable = True  # close(wait=False) stops a running call (its process or actor), so a job may stop without it
    stop_asked: threading.Event | None = None  # set by the job's first stop signal (`pipeline.Signals`)

    @abstractmethod
    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Queue one call; its future holds the result or the call's exception."""

    def map(self, fn: Callable[[Any], Any], jobs: Iterable[Any]) -> Iterator[Any]:
        """Results of `fn` over `jobs` in job order, at most 2 calls per worker ahead of the one awaited."""
        pending: deque[Future] = deque()
        for job in jobs:
            pending.append(self.submit(fn, job))
            if len(pending) >= 2 * self.workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()

    def warm(self) -> None:
        """Start the workers now rather than at their first call."""

    @abstractmethod
    def close(self, wait: bool = True) -> None:
        """Cancel what has not started, wait for what runs (or, not `wait`, stop it), end the workers."""

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        """A job ending on an error or a signal wants no result of the calls still running: one stalled in a read or
        a download would otherwise hold its stop for as long as that takes (a minute and more on a Hub that hangs)."""
        self.close(wait=exc_type is None)


_running: Any = None  # in a pool worker: its pool's `running` slots (pid, call key), and the one it took
_slot = 0


def _start_worker(driver: int, env: dict[str, str], setup: Setup | None, running: Any, slots: Any) -> None:
    """A pool worker's start: take the job's environment `env`, ignore SIGINT and end with the job's `driver`
    process (`children.serve_driver`), take a slot in `running` (a number read from the pipe `slots`: one read
    each) to say which call it runs (`_tracked`), yield the cores to the driver, then the job's own set-up."""
    global _running, _slot
    if os.environ != env:  # forked from a forkserver that a library caller's earlier job started: its environment
        os.environ.clear()  # was that moment's, so an HF_TOKEN (or AWS_*) set since never reached the workers
        os.environ.update(env)
    serve_driver(driver)
    _slot = 2 * int.from_bytes(os.read(slots.fileno(), 4), "little")
    running[_slot] = os.getpid()
    _running = running
    os.nice(WORKER_NICE)
    for name in forkserver.PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:  # skipped, as the forkserver skips it: a job that needs it names it
            pass
    _no_named_semaphore_for_progress_bars()
    set_up_worker(setup)


def _no_named_semaphore_for_progress_bars() -> None:
    """tqdm's write lock without its multiprocessing part in this worker. tqdm creates that part (a named POSIX
    semaphore, registered with the job's resource tracker) the first time a bar or `thread_map` runs, which
    `datasets` does for every hf:// file a worker opens; a job that fails or stops terminates its workers
    (`close(wait=False)`), so it was never unlinked, and the tracker printed "There appear to be N leaked
    semaphore objects" after the job's one-line error. A worker draws no bar: tqdm's thread lock is enough."""
    from tqdm.std import TqdmDefaultWriteLock

    TqdmDefaultWriteLock.mp_lock = None


def set_up_worker(setup: Setup | None) -> None:
    """The job's own set-up of a worker (pool process, Ray actor, Xenna ingest stage worker), then its collector
    tuned for the calls. Its log events go back with its answers (`logs.forward_from_worker`)."""
    logs.forward_from_worker()
    if setup is not None:
        setup[0](*setup[1])
    quiet_gc()


def again(fn: Callable[..., Any]) -> Callable[..., Any]:
    """What an executor runs when it runs a call again (its worker died): `fn.again` when `fn` names one (a call
    that must first undo what a killed attempt left, e.g. `engines.local.run_local`), else `fn` itself."""
    return getattr(fn, "again", fn)


def _tracked(key: int, fn: Callable[..., Any], *args: Any) -> tuple[Any, list[dict[str, Any]]]:
    """`with_events` in a pool worker, its call's `key` in the worker's slot while it runs: a worker that dies
    leaves there the call it died on (`LocalExecutor._blame`)."""
    _running[_slot + 1] = key
    try:
        return with_events(fn, *args)
    finally:
        _running[_slot + 1] = 0


def with_events(fn: Callable[..., Any], *args: Any) -> tuple[Any, list[dict[str, Any]]]:
    """`fn(*args)` in a worker, and the log events it made, for the job's process to write (`logs.replay`); a call
    that raises carries them on its exception (`worker_events`)."""
    try:
        result = fn(*args)
    except Exception as exc:
        try:
            exc.worker_events = logs.taken()  # type: ignore[attr-defined]
        except AttributeError:  # an exception type without a __dict__: its events are lost with it
            pass
        raise
    return result, logs.taken()


def replay_events_of(exc: BaseException | None) -> None:
    """Write the log events a worker's failed call carried (`with_events`), its own or Ray's wrapped cause's."""
    logs.replay(getattr(exc, "worker_events", None) or getattr(getattr(exc, "cause", None), "worker_events", ()))


@dataclass(frozen=True)
class Call:
    """One executor call as the task of a serving pipeline (`engines.xenna`): `key` pairs it with its answer."""

    key: int
    fn: Callable[..., Any]
    args: tuple

    def answer(self) -> dict[str, Any]:
        """Run the call here: {"call": key, "fn": name, "result": ...}, or "error" with the exception it raised
        (made picklable: the answer crosses Ray, and an unpicklable one would fail the whole pipeline)."""
        out: dict[str, Any] = {"call": self.key, "fn": self.fn.__name__}
        try:
            out["result"] = self.fn(*self.args)
        except Exception as exc:
            out["error"] = picklable_error(exc)
        out["events"] = logs.taken()
        return out


def picklable_error(exc: Exception) -> Exception:
    """`exc`, or a RuntimeError naming it when it cannot be pickled: an answer that carries it crosses processes,
    and an unpicklable one would fail the whole call (a pipeline, a holder's pipe)."""
    try:
        pickle.dumps(exc)
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")


def stop_seen(stop_asked: threading.Event | None, exitcodes: Iterable[int | None]) -> bool:
    """Whether the job is stopping (`stop_asked`, its first stop signal), so that what died (a pool's worker, a
    dedup holder) is not replaced. A SIGTERM to the job's whole process group (GNU `timeout`, `kill -- -PGID`, a
    systemd stop) ends such a process as it reaches the job's, whose handler may run a moment after: one dead by
    SIGTERM (of `exitcodes`) waits STOP_SEEN_S for it. One SIGTERMed alone is replaced as after kill -9, that much
    later."""
    if stop_asked is None:
        return False
    return stop_asked.wait(STOP_SEEN_S if any(code == -signal.SIGTERM for code in exitcodes) else 0)


class LocalExecutor(Executor):
    """Calls on this machine: in one thread for 1 worker, else on a pool of `workers` processes.

    A pool process that dies (kill -9, the OOM killer) breaks the whole pool: a new pool takes its place and
    every call the broken one held runs again there, up to POOL_RESTARTS times a job; the job goes on,
    nothing duplicated. A call a worker died running CALL_KILLS times fails instead (`WorkerDied`)."""

    def __init__(self, workers: int, setup: Setup | None = None):
        self.workers = max(1, workers)
        self.restarts = 0
        self._setup = setup
        self._lock = threading.Lock()
        self._closed = False
        self._threads: ThreadPoolExecutor | None = None
        self._pool: ProcessPoolExecutor | None = None
        self._running: Any = None  # the pool's slots: (pid, key of the call it runs) per worker process
        self._keys = itertools.count(1)
        self._killed: dict[int, list[int]] = {}  # call key -> exit codes of the worker processes that died running it
        self.stoppable = self.workers > 1  # a thread runs on after close: a stop must wait for its call
        if self.workers == 1:
            init = setup or (int, ())
            self._threads = ThreadPoolExecutor(1, thread_name_prefix="worker", initializer=init[0], initargs=init[1])
        else:
            self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        ctx = forkserver.context()
        # no lock: its named semaphore lived as long as the pool object, past the job's end, where the resource
        # tracker's stop unlinked it and its collection printed a 'sem_unlink FileNotFoundError' traceback
        self._running = ctx.Array("q", 2 * self.workers, lock=False)
        slots, numbers = ctx.Pipe(duplex=False)
        with numbers:
            os.write(numbers.fileno(), b"".join(i.to_bytes(4, "little") for i in range(self.workers)))
        return ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_start_worker,
                                   initargs=(os.getpid(), dict(os.environ), self._setup, self._running, slots))

    @property
    def processes(self) -> list[int]:
        """The pids of the pool's worker processes (none for the thread)."""
        return list(self._pool._processes) if self._pool is not None else []  # type: ignore[attr-defined]

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._threads is not None:
            return self._threads.submit(fn, *args)
        outer: Future = Future()
        self._send(outer, next(self._keys), fn, args)
        return outer

    def _send(self, outer: Future, key: int, fn: Callable[..., Any], args: tuple) -> None:
        with self._lock:
            pool = self._pool
        assert pool is not None
        try:
            inner = pool.submit(_tracked, key, fn, *args)
        except BrokenProcessPool as exc:  # broken before this call reached it
            self._retry(outer, key, pool, exc, fn, args)
            return
        except (OSError, EOFError) as exc:  # no worker could start: a forkserver killed a moment ago still looked
            # alive to multiprocessing (refused, or it died before it answered the new worker's pid: EOFError); the
            # call was lost, raised in the broken pool's callback, and its caller waited for ever (or the job ended
            # on a bare 'EOFError: unexpected EOF')
            self._retry(outer, key, pool, exc, fn, args, pause=FORKSERVER_GONE_S)
            return
        except Exception as exc:  # shut down (RuntimeError: the job is ending), or anything else: never a lost call
            settle(outer, exc=exc)
            return
        inner.add_done_callback(lambda f: self._answered(outer, key, f, pool, fn, args))

    def _answered(self, outer: Future, key: int, inner: Future, pool: ProcessPoolExecutor, fn: Callable[..., Any],
                  args: tuple) -> None:
        if inner.cancelled():  # cancelled by close(), or by the replacement of a broken pool
            if self._closed or pool is self._pool:
                outer.cancel()
            else:
                self._send(outer, key, fn, args)
            return
        exc = inner.exception()
        if isinstance(exc, BrokenProcessPool) and not self._closed:
            self._retry(outer, key, pool, exc, fn, args)
        elif exc is not None:
            replay_events_of(exc)
            settle(outer, exc=exc)
        else:
            result, events = inner.result()
            logs.replay(events)
            settle(outer, result=result)

    def _retry(self, outer: Future, key: int, pool: ProcessPoolExecutor, exc: BaseException, fn: Callable[..., Any],
               args: tuple, pause: float = 0.0) -> None:
        """Run the call again on a new pool; the first call to see `pool` broken replaces it (after `pause`), once it
        has blamed the calls its dead workers ran. A call whose worker died CALL_KILLS times fails (`WorkerDied`)."""
        with self._lock:
            if pool is self._pool:
                exitcodes = [p.exitcode for p in list(pool._processes.values())]  # type: ignore[attr-defined]
                self._blame(pool)
                # a broken pool may hold live workers (the forkserver killed: each worker's sentinel fired): they
                # blocked on its abandoned queues, held the resource tracker's pipe, and the job hung at exit
                _signal_workers(pool, signal.SIGKILL)
                if self._closed or stop_seen(self.stop_asked, exitcodes):
                    settle(outer, exc=exc)
                    return
                if self.restarts >= POOL_RESTARTS:
                    codes = sorted({c for c in exitcodes if c not in (None, 0)})
                    died = WorkerDied(f"a worker process died (exit code {', '.join(map(str, codes)) or '?'}) "
                                      f"with this call in its pool, {self.restarts + 1} pools in a row: a call that "
                                      f"kills the process running it (a plug-in's os._exit, a crash in native code, "
                                      f"the OOM killer) breaks every pool it runs on")
                    died.__cause__ = exc
                    settle(outer, exc=died)
                    return
                time.sleep(pause)
                self.restarts += 1
                log.warning("a worker process died; its calls run again on a new pool", restarts=self.restarts,
                            error=str(exc)[:200])
                pool.shutdown(wait=False, cancel_futures=True)
                self._pool = self._new_pool()
            codes = self._killed.get(key, [])
        if len(codes) >= CALL_KILLS:
            died = WorkerDied(f"a worker process died running this call, {len(codes)} times (exit code "
                              f"{', '.join(map(str, codes))}): it kills the process running it (a plug-in's "
                              f"os._exit, a crash in native code, the OOM killer)")
            died.__cause__ = exc
            settle(outer, exc=died)
            return
        self._send(outer, key, again(fn), args)

    def _blame(self, pool: ProcessPoolExecutor) -> None:
        """Count, for each call a worker of the broken `pool` died running (its slot in `_running`), that death
        with its exit code. 255 is not a death: once the forkserver is gone, a live worker's exit code reads 255."""
        running = self._running
        dead = {p.pid: p.exitcode for p in list(pool._processes.values())  # type: ignore[attr-defined]
                if p.exitcode not in (None, 0, 255)}
        for i in range(0, len(running), 2):
            pid, key = running[i], running[i + 1]
            if pid in dead and key:
                self._killed.setdefault(key, []).append(dead[pid])

    def warm(self) -> None:
        if self._pool is not None:
            for _ in range(self.workers):
                self._pool.submit(int)  # a no-op call: each submit starts at most one process

    def close(self, wait: bool = True) -> None:
        """Not `wait`: the pool's processes are terminated (what one was writing is a temporary file the next
        start sweeps, as after kill -9), and the thread of `workers: 1` is left to end on its own (a stalled read
        in it cannot be interrupted; the command exits without it)."""
        self._closed = True
        if not wait and self._pool is not None:
            _signal_workers(self._pool, signal.SIGTERM)
        for pool in (self._threads, self._pool):
            if pool is not None:
                pool.shutdown(wait=wait, cancel_futures=True)


def _signal_workers(pool: ProcessPoolExecutor, sig: int) -> None:
    """Send `sig` to the pool's workers that may be alive, by pid: once the forkserver is gone, multiprocessing
    reads a live worker's exit code as 255 (its status comes through the forkserver) and from then on skips its
    own `kill`/`terminate` of it (and the pool's own clean-up reads them first), so a broken pool's workers lived on,
    blocked on its abandoned queues, as long as the job's process."""
    for process in list(pool._processes.values()):  # type: ignore[attr-defined]
        if process.exitcode in (None, 255):
            try:
                os.kill(process.pid, sig)
            except ProcessLookupError:
                pass


def settle(fut: Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Give `fut` its outcome unless its caller cancelled it meanwhile."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        pass


class _Actor:
    """One worker on a Ray cluster (`execution.ray_address`)."""

    def __init__(self, setup: Setup | None):
        import ray  # only ever imported in a Ray worker process, where it is loaded already

        os.nice(WORKER_NICE)  # its own process: on a shared node the stage workers come first
        set_up_worker(setup)
        self.node = ray.get_runtime_context().get_node_id()  # a restart after a lost node runs this again

    def ready(self) -> tuple[str, tuple[str, str]]:
        """This actor's node, once it is up (`ray_cluster.spread_actors` logs the placement), and its streamprep
        (`version.source()`: `ray_cluster.node_of` refuses another than the driver's)."""
        return self.node, version.source()

    def run(self, fn: Callable[..., Any], *args: Any) -> tuple[str, Any, list[dict[str, Any]]]:
        """(this actor's node, the call's result, its log events): the driver counts where the work ran."""
        return (self.node, *with_events(fn, *args))


class RayExecutor(Executor):
    """Calls on Ray actors of an existing cluster, round robin (the run dir is on the cluster's shared
    filesystem). An actor lost with its node is replaced on a node left and the calls it held run again there,
    up to `ray_cluster.ACTOR_REPLACEMENTS` times a job; with no node left to run on, waiting calls fail after
    `ray_cluster.NO_NODE_WAIT_S` instead of waiting forever."""

    def __init__(self, workers: int, address: str, setup: Setup | None = None):
        self._cluster = ray_cluster
        ray_cluster.connect(address, workers)
        self.workers = max(1, workers)
        self._setup = setup
        self.actors, self.nodes = ray_cluster.spread_actors(_Actor, self.workers, setup)
        self.replaced = 0
        self._next = 0
        self._lock = threading.Lock()
        self._replacing = threading.Lock()  # one replacement at a time: the first call to see an actor dead
        self._waiting: set[Future] = set()
        self._done = threading.Event()
        self.calls: dict[str, dict[str, int]] = {}  # node -> function -> calls answered there
        threading.Thread(target=self._watch, name="ray-executor", daemon=True).start()
        log.info("workers on Ray actors", actors=self.workers, address=address)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        outer: Future = Future()
        with self._lock:
            slot = self._next % self.workers
            self._next += 1
            self._waiting.add(outer)
        self._send(outer, slot, fn, args)
        return outer

    def _send(self, outer: Future, slot: int, fn: Callable[..., Any], args: tuple) -> None:
        actor = self.actors[slot]
        inner = actor.run.remote(fn, *args).future()
        inner.add_done_callback(lambda f: self._answered(outer, f, slot, actor, fn, args))

    def _answered(self, outer: Future, inner: Future, slot: int, actor: Any, fn: Callable[..., Any],
                  args: tuple) -> None:
        from ray.exceptions import RayActorError

        exc = None if inner.cancelled() else inner.exception()
        if isinstance(exc, RayActorError) and not self._done.is_set():  # the actor is gone, not the call's error
            threading.Thread(target=self._resend, args=(outer, slot, actor, exc, fn, args), daemon=True).start()
            return  # (off Ray's callback thread: placing an actor waits for it)
        with self._lock:
            self._waiting.discard(outer)
        if inner.cancelled():
            outer.cancel()
        elif exc is not None:
            replay_events_of(exc)
            settle(outer, exc=exc)
        else:
            node, result, events = inner.result()
            logs.replay(events)
            with self._lock:
                on_node = self.calls.setdefault(node, {})
                on_node[fn.__name__] = on_node.get(fn.__name__, 0) + 1
            settle(outer, result=result)

    def _resend(self, outer: Future, slot: int, actor: Any, exc: BaseException, fn: Callable[..., Any],
                args: tuple) -> None:
        """Run a call whose actor died again, on the actor that takes its slot (placed by the first such call)."""
        import ray

        with self._replacing:
            if self.actors[slot] is actor:
                if self.replaced >= ray_cluster.ACTOR_REPLACEMENTS:
                    self._fail(outer, exc)
                    return
                self.replaced += 1
                log.warning("a worker actor was lost; its calls run again on a new one", slot=slot,
                            replaced=self.replaced, error=str(exc)[:200])
                nodes = ray_cluster.nodes_but(self.nodes[slot])  # not on the lost actor's node: it may be dead
                try:
                    new = ray_cluster.place_actor(_Actor, slot, self._setup, nodes=nodes)
                    node = ray_cluster.node_of(ray.get(new.ready.remote(), timeout=ray_cluster.ACTOR_PLACEMENT_WAIT_S))
                except Exception as err:  # no node to place it on (the watch fails the calls too)
                    self._fail(outer, err)
                    return
                self.actors[slot], self.nodes[slot] = new, node
        self._send(outer, slot, again(fn), args)

    def _fail(self, outer: Future, exc: BaseException) -> None:
        with self._lock:
            self._waiting.discard(outer)
        settle(outer, exc=exc)

    def _watch(self) -> None:
        """Fail the waiting calls once the cluster has had no usable node for a while."""
        while not self._done.wait(1.0):
            with self._lock:
                waiting = list(self._waiting) if self._waiting else []
            if waiting and (why := self._cluster.no_node_left()):
                error = self._cluster.NoNodeLeft(f"workers: {why}; re-run the same command to resume")
                for fut in waiting:
                    settle(fut, exc=error)

    def close(self, wait: bool = True) -> None:  # its actors are killed either way
        import ray

        self._done.set()
        log.info("worker calls per node", calls=self.calls, actors_replaced=self.replaced)  # units on every node?
        if self._cluster.no_node_left():  # the cluster is gone: nothing to ask, nothing to end (Ray would block)
            return
        for a in self.actors:
            ray.kill(a)


def create(workers: int, ray_address: str | None, setup: Setup | None = None) -> Executor:
    """The job's executor: Ray actors with `ray_address`, else this machine's processes."""
    return RayExecutor(workers, ray_address, setup) if ray_address else LocalExecutor(workers, setup)
