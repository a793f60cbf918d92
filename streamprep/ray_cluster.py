"""The job's one Ray cluster, shared by the executor's worker actors and the Xenna tokenize stage.

Follows xenna-notes.md: we call `ray.init` ourselves and pin RAY_ADDRESS so Xenna's monitor finds exactly
this cluster. Without `execution.ray_address` the job starts its cluster in a `streamprep.ray_head`
process and attaches to it, so a start-up the job no longer needs is killed instead of waited for; that
cluster ends with the job, every process of it. One we attached to is left running, minus the
`ray::NodeResourceMonitor` / `ray::StageWorker` processes Xenna 0.3 leaves behind.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator

import psutil

from streamprep import logs, registry, version
from streamprep.config import ConfigError

log = logs.get("ray")
GRACE_S = 0.5  # after ray.shutdown its processes get this long to exit, then are killed: the work is done
LEAKED_TITLES = ("ray::NodeResourceMonitor", "ray::StageWorker")
RAY_ENV = {
    "RAY_MAX_LIMIT_FROM_API_SERVER": "40000",
    "RAY_MAX_LIMIT_FROM_DATA_SOURCE": "40000",
    "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1",
    "PYTHON_LOG": os.environ.get("PYTHON_LOG", "warning"),
}
OBJECT_STORE_BYTES = 256 * 1024 * 1024
# A cluster the job starts lives on the driver's machine, whose cores the job's workers already use: there it runs
# at the lowest priority, under SCHED_IDLE (`ray_head`), and comes up (and takes shards over) only on cores the
# workers leave idle.
RAY_NICE = 19
_lock = threading.Lock()
_started_here = False
_head: subprocess.Popen | None = None  # the `streamprep.ray_head` process of a cluster started here
_head_tmp = ""  # its TMPDIR, removed with it
_head_session = ""  # its cluster's session dir (RAY_TMPDIR/ray/session_*), removed with it
_head_ray_tmp = ""  # the RAY_TMPDIR it runs with
_here_session = ""  # the session dir of the cluster `init_here` started in this process
_AUTH = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}  # one per process: Ray caches it
_env_before: dict[str, str | None] = {}  # those variables as they were before the head started
# Every Ray worker process of the job (worker actors, Xenna's actors, tasks) on every node runs this at start-up.
JOB_RUNTIME_ENV = {"worker_process_setup_hook": "streamprep.ray_cluster.exit_at_interpreter_shutdown"}
SUBMITTED_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"  # a `ray job submit` driver's job config (JSON), runtime env too
ACTOR_PLACEMENT_WAIT_S = 120.0  # a replacement worker actor must be up within this
ADDRESS_CHECK_S = 5.0  # the config check's TCP connect to `execution.ray_address`
AUTH_REFUSED = ("UNAUTHENTICATED", "PERMISSION_DENIED")  # how a GCS answers a missing or wrong auth token
HEAD_TMP_PREFIX = "streamprep-ray-head-"  # the TMPDIR of a job's own head process and its cluster
ACTOR_REPLACEMENTS = 4  # worker actors lost with their node and replaced on a node left, per job; then calls fail


def check_address(cfg: dict[str, Any]) -> None:
    """Config check (registry.CHECKS) of `execution.ray_address`: HOST:PORT whose port a Ray GCS answers now,
    ray://HOST:PORT whose port a Ray Client server answers now (and no GCS), or `auto` with a cluster running
    here. A closed port had `ray.init` retry for ever (a stop waiting on it), a malformed one failed after the run
    dir was written, and a port where something else answers (the dashboard's, a raylet's, any server) hung in
    `ray.init` after it, deaf to SIGTERM (or, with ray://, failed after 30 s); `auto` with no cluster failed after
    it too. Each is one line, exit 2, before anything is written. A GCS that wants Ray's auth token gets this
    machine's (`_use_token`)."""
    address = cfg["execution"]["ray_address"]
    if address is None:
        return
    key = "config: 'execution.ray_address'"
    if address == "auto":
        try:
            where = _auto_address()
        except ConnectionError:
            raise ConfigError(f"{key}: auto, and no Ray cluster runs on this machine (no `ray start`, no "
                              f"RAY_ADDRESS); is the cluster up?") from None
    else:
        where = address.removeprefix("ray://")
    host, _, port = where.rpartition(":")
    if not host or "/" in host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{key} must be HOST:PORT (the cluster's GCS), ray://HOST:PORT or auto, got {address!r:.80}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=ADDRESS_CHECK_S).close()
    except OSError as exc:
        raise ConfigError(f"{key}: nothing answers at {where} ({exc.strerror or exc}); is the cluster up?") from None
    code, details = _ask_gcs(where)
    if address.startswith("ray://"):  # Ray Client's server: a GCS there had `ray.init` time out after 60 s
        if code == "OK" or code in AUTH_REFUSED:
            raise ConfigError(f"{key}: {address} names a Ray GCS's port; ray:// needs the Ray Client server's port "
                              f"(10001 by default), or give {where} without ray://")
        code, details = _ask_ray_client(where)  # any other server had `ray.init` time out after 30 s, run dir written
        if code != "OK" and code not in AUTH_REFUSED:
            why = (f"no Ray Client server answered within {ADDRESS_CHECK_S:g} s" if code == "DEADLINE_EXCEEDED" else
                   f"not as a Ray Client server does ({(details or code).splitlines()[0][:120]})")
            raise ConfigError(f"{key}: {where} answers, but {why}; ray:// needs the Ray Client server's port "
                              f"(10001 by default)")
        return
    if code in AUTH_REFUSED:
        _use_token(key, where)
    elif why := _not_a_gcs(code, details):
        raise ConfigError(f"{key}: {where} answers, but {why}; the GCS address is the one `ray start --head` prints "
                          f"(port 6379 by default), not the dashboard's")
    if cfg["execution"].get("engine") == "xenna":
        _check_dashboard(key, where)


def _check_dashboard(key: str, where: str) -> None:
    """A ConfigError unless the dashboard the cluster at `where` registered in its GCS answers here as that
    cluster's: Xenna's monitor lists the cluster's actors through Ray's state API, which the dashboard serves. On a
    cluster started with `--include-dashboard=false` the check passed and the job failed ~15 s in, blaming the
    dataset's input (`ServerUnavailable: Failed to make request to http://127.0.0.1:8265/api/v0/actors`), and a
    re-run the same; such a cluster still registers the default port, where another cluster's dashboard (or any
    server) may answer: its `/api/version` names its session, which must be this cluster's. The worker actors of
    `engine: local` ask only the GCS: they need no dashboard."""
    from ray._private import ray_constants  # Ray: only when configured
    from ray._raylet import GcsClient

    gcs = GcsClient(address=where)
    registered = gcs.internal_kv_get(ray_constants.DASHBOARD_ADDRESS.encode(), ray_constants.KV_NAMESPACE_DASHBOARD,
                                     timeout=ADDRESS_CHECK_S)
    dashboard = registered.decode() if registered else ""
    why = _not_its_dashboard(dashboard, gcs.internal_kv_get(b"session_name", ray_constants.KV_NAMESPACE_SESSION,
                                                            timeout=ADDRESS_CHECK_S)) if dashboard else "none registered"
    if why:
        raise ConfigError(f"{key}: the Ray cluster at {where} has no dashboard answering here (Ray's state API, "
                          f"which `engine: xenna` needs; {why}): start its head without "
                          f"--include-dashboard=false, reachable from this machine, or use `engine: local` "
                          f"(docs/multi-node.md, Set-up)")


def _not_its_dashboard(dashboard: str, session: bytes | None) -> str | None:
    """Why the server at `dashboard` (HOST:PORT) is not the dashboard of the cluster whose session is `session`,
    else None. One that asks for a token (401, 403) is taken as the cluster's: it cannot be asked more."""
    import json
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{dashboard}/api/version", timeout=ADDRESS_CHECK_S) as answer:
            body = answer.read(1 << 16)
    except urllib.error.HTTPError as exc:
        return None if exc.code in (401, 403) else f"{dashboard} answers HTTP {exc.code}, not as Ray's dashboard"
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        return f"{dashboard}: {getattr(reason, 'strerror', None) or reason}"
    try:
        theirs = json.loads(body).get("session_name")
    except (ValueError, AttributeError):
        theirs = None
    if not isinstance(theirs, str):
        return f"{dashboard} answers, but not as Ray's dashboard"
    ours = session.decode(errors="replace") if session else None
    if ours is not None and theirs != ours:
        return f"{dashboard} is another Ray cluster's dashboard (session {theirs}, this cluster's is {ours})"
    return None


def _auto_address() -> str:
    """The GCS address `auto` stands for, as Ray finds it (RAY_ADDRESS, else the cluster `ray start` last started
    on this machine); ConnectionError if none runs."""
    from ray._private.services import canonicalize_bootstrap_address  # Ray: only when configured

    return canonicalize_bootstrap_address("auto")


def _ask_gcs(where: str, metadata: tuple[tuple[str, str], ...] = ()) -> tuple[str, str]:
    """The name of the gRPC status code (and its details) the server at `where` answers a GCS's GetClusterId with,
    `metadata` sent along; "OK" when it gave the cluster id."""
    import grpc  # Ray's dependency: only when configured
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    with grpc.insecure_channel(where) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(gcs_service_pb2.GetClusterIdRequest(),
                                                                             timeout=ADDRESS_CHECK_S, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or ""
    return "OK", ""


def _ask_ray_client(where: str) -> tuple[str, str]:
    """The name of the gRPC status code (and its details) the server at `where` answers Ray Client's ping with
    (what `ray.init("ray://…")` asks first); "OK" when it answered."""
    import grpc  # Ray's dependency: only when configured
    from ray.core.generated import ray_client_pb2, ray_client_pb2_grpc

    ping = ray_client_pb2.ClusterInfoRequest(type=ray_client_pb2.ClusterInfoType.PING)
    with grpc.insecure_channel(where) as channel:
        try:
            ray_client_pb2_grpc.RayletDriverStub(channel).ClusterInfo(ping, timeout=ADDRESS_CHECK_S)
        except grpc.RpcError as exc:
            return exc.code().name, exc.details() or ""
    return "OK", ""


def _not_a_gcs(code: str, details: str) -> str | None:
    """Why a server that answered the cluster-id request with `code` is not a Ray GCS, or None: a GCS answers,
    a raylet has no such service, and a server that is not gRPC (the dashboard's HTTP) fails the HTTP/2 handshake."""
    if code == "OK":
        return None
    if code == "UNIMPLEMENTED":
        return "it is no Ray GCS (a gRPC server without the GCS's services: a raylet's port?)"
    if code == "DEADLINE_EXCEEDED":
        return f"no Ray GCS answered within {ADDRESS_CHECK_S:g} s"
    return f"not as a Ray GCS does ({(details or code).splitlines()[0][:120]})"


def _use_token(key: str, where: str) -> None:
    """The GCS at `where` refused a request without Ray's auth token (only a GCS does): turn token auth on for
    this process and the Ray processes it starts, with the token Ray finds here (RAY_AUTH_TOKEN, else the file
    RAY_AUTH_TOKEN_PATH names, else ~/.ray/auth_token), once the GCS takes it, for `auto` too (`connect` resolves it:
    Ray 2.60 turns it on for `auto` whenever a token file is here, wanted or not). With an explicit address and no RAY_AUTH_MODE=token, `ray.init` retried without a token for
    20-40 s after the run dir was written and failed with a connection error that never named authentication.
    No usable token is one line, exit 2, before anything is written."""
    from ray._raylet import AuthenticationTokenLoader, Config
    from ray.exceptions import AuthenticationError

    mode = os.environ.get("RAY_AUTH_MODE", "")
    if mode and mode.lower() != "token":
        raise ConfigError(f"{key}: the Ray cluster at {where} requires token authentication, but RAY_AUTH_MODE is "
                          f"{mode!r:.40}; set RAY_AUTH_MODE=token (or unset it) for `streamprep`")
    loader = AuthenticationTokenLoader.instance()
    try:
        header = loader.get_token_for_http_header(ignore_auth_mode=True)
    except AuthenticationError as exc:  # RAY_AUTH_TOKEN_PATH names a missing or empty file
        raise ConfigError(f"{key}: the Ray cluster at {where} requires token authentication, and "
                          f"{exc.message.split('. ')[0][:200]}") from None
    if not header:
        raise ConfigError(f"{key}: the Ray cluster at {where} requires token authentication and this machine has no "
                          f"token: copy the head's ~/.ray/auth_token here, or set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH")
    if _ask_gcs(where, tuple(header.items()))[0] in AUTH_REFUSED:
        source = ("RAY_AUTH_TOKEN" if os.environ.get("RAY_AUTH_TOKEN")
                  else os.environ.get("RAY_AUTH_TOKEN_PATH") or "~/.ray/auth_token")
        raise ConfigError(f"{key}: the Ray cluster at {where} refuses this machine's auth token ({source:.200}); use "
                          f"the head's ~/.ray/auth_token")
    if not mode:
        os.environ["RAY_AUTH_MODE"] = "token"
        Config.initialize("")  # Ray read its config when imported: it reads RAY_AUTH_MODE again
        log.info("ray token auth on", address=where)


def job_runtime_env() -> dict[str, Any]:
    """The job's runtime env: JOB_RUNTIME_ENV, and STREAMPREP_PLUGINS set to the modules the driver imported
    (`registry.PLUGIN_MODULES`; "" for none). A Ray worker process has the environment of its node's `ray start`,
    not the driver's, so it judged with the plug-in gates that one named, or none, and without a word. Left out when
    a `ray job submit` runtime env sets the variable already: Ray refuses the two as a conflict, and that one reaches
    the workers too (`unit_worker.init_worker` refuses a worker whose modules differ from the driver's)."""
    submitted = os.environ.get(SUBMITTED_JOB_ENV)
    if submitted and registry.PLUGINS_ENV in ((json.loads(submitted).get("runtime_env") or {}).get("env_vars") or {}):
        return dict(JOB_RUNTIME_ENV)
    return {**JOB_RUNTIME_ENV, "env_vars": {registry.PLUGINS_ENV: ",".join(registry.PLUGIN_MODULES)}}


def connect(address: str | None, num_cpus: int, cancelled: Callable[[], bool] = lambda: False) -> str | None:
    """Attach to `address`, or start the job's own cluster (in a `ray_head` process) and attach to it; once
    per process. Returns its GCS address, or None when `cancelled()` came true while a cluster of our own
    was still starting: it is then killed, and nothing of Ray was loaded here. Call `release()` from the
    same thread."""
    global _started_here
    os.environ.update(RAY_ENV)
    with _lock:
        if not _ray_initialized():
            if not address:
                address = _start_head(num_cpus, cancelled)
                if address is None:
                    return None
                _started_here = True
            elif address == "auto":
                # as the address check resolved it: `ray.init("auto")` turned Ray's token auth on whenever a token file
                # is here, against a cluster without it too (the check turns it on when the GCS asks, `_use_token`)
                address = _auto_address()
            import ray

            handlers = _signal_handlers()
            try:
                with job_signals_kept():
                    ctx = ray.init(address=address, ignore_reinit_error=True, log_to_driver=False,
                                   namespace=f"streamprep-{uuid.uuid4().hex[:12]}",
                                   runtime_env=job_runtime_env())
            except BaseException:
                if _started_here:
                    _stop_head()
                    _started_here = False
                raise
            finally:  # Ray's SIGTERM handler (sys.exit(15)) replaced the job's: a stop became a failure
                _restore(handlers)
            os.environ["RAY_ADDRESS"] = ctx.address_info["gcs_address"]
            log.info("ray connected", address=os.environ["RAY_ADDRESS"], started=_started_here,
                     namespace=ctx.namespace if hasattr(ctx, "namespace") else ray.get_runtime_context().namespace)
        return os.environ.get("RAY_ADDRESS", "")


def _signal_handlers() -> dict[int, Any]:
    """This process's SIGINT and SIGTERM handlers, if it is the main thread (only it may set them)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}


def _restore(handlers: dict[int, Any]) -> None:
    for s, handler in handlers.items():
        if handler is not None and signal.getsignal(s) is not handler:
            signal.signal(s, handler)


JOB_SIGNALS = (signal.SIGINT, signal.SIGTERM)  # a stop of the job: its own handlers (`pipeline.Signals`) take them
SIGACTION_BYTES = 1024  # more than any libc's `struct sigaction`: kept as it was and handed back, never read


@contextlib.contextmanager
def job_signals_kept() -> Iterator[None]:
    """Run Ray's start (`ray.init`) or shutdown, then hand SIGINT and SIGTERM back, at the C level, to what handled
    them before (the job's handlers, `pipeline.Signals`), from any thread. Ray's core worker puts absl's crash handler
    on SIGTERM as it starts, beneath Python's and unseen by `signal.getsignal`: from the xenna engine's thread, where
    nothing replaced it, it ran the job's handler and aborted the process 3 s later (its alarm: exit 134, run.json
    left `running`). `ray.shutdown` sets SIGTERM to the default action: a later SIGTERM killed the job unhandled.
    For SIGTERM absl's handler only printed a stack; it stays on the crash signals (SIGSEGV...)."""
    sigaction = getattr(ctypes.CDLL(None), "sigaction", None) if os.name == "posix" else None
    kept: dict[int, Any] = {}
    for s in JOB_SIGNALS if sigaction is not None else ():
        kept[s] = ctypes.create_string_buffer(SIGACTION_BYTES)
        if sigaction(s, None, kept[s]) != 0:
            del kept[s]
    try:
        yield
    finally:
        for s, action in kept.items():
            sigaction(s, action, None)


def exit_at_interpreter_shutdown() -> None:
    """In a Ray worker process of the job: end the process the moment its interpreter starts shutting down.

    Ray ends an actor (ray.kill, the job's end, its driver's death) by shutting its core worker down and
    letting the interpreter exit, which joins every non-daemon thread first. Xenna 0.3's NodeResourceMonitor and
    StageWorker keep such threads looping forever, so their processes stayed, actor dead and disconnected, with
    no raylet tracking them (~150 MB each, one of each per node per job, outliving even `ray stop` of the
    node). threading's own at-exit hooks run before that join: there the work is over, so exit at once."""
    threading._register_atexit(_exit_now)  # type: ignore[attr-defined]


def _exit_now() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")  # never imported: not initialized (importing it costs the driver ~1 s of GIL)
    # while another thread imports it, the module is there without its functions yet: not initialized either
    is_initialized = getattr(ray, "is_initialized", None)
    return is_initialized is not None and is_initialized()


class HeadStartError(RuntimeError):
    """The job's own Ray head exited before its cluster was up (e.g. Ray's 30 s raylet start-up limit on a
    machine the driver keeps busy)."""


def _start_head(num_cpus: int, cancelled: Callable[[], bool]) -> str | None:
    """Start `streamprep.ray_head` and wait for the GCS address it prints; None, with the head killed, once
    `cancelled()`. Its own process group keeps a terminal's Ctrl-C from it (the driver shuts it down), in the
    driver's session, so RAY_NICE holds against the driver (the kernel's autogroups share CPU per session).
    The cluster takes this process's token, so the driver can attach to it. Ray's own output goes to a
    temporary file; its last line names the cause if the head fails."""
    global _head, _head_tmp, _head_session, _head_ray_tmp, _env_before
    _env_before = {key: os.environ.get(key) for key in _AUTH}
    os.environ.update(_AUTH)
    err = tempfile.TemporaryFile()
    _head_tmp = tempfile.mkdtemp(prefix=HEAD_TMP_PREFIX)
    _head_session, _head_ray_tmp = "", ray_tmpdir()  # Ray's; the head's TMPDIR is its own: what its processes
    env = {**os.environ, "TMPDIR": _head_tmp,  # leave when killed (pymp-*) goes with it
           "RAY_TMPDIR": _head_ray_tmp}
    _head = subprocess.Popen(_head_command(num_cpus), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                             env=env, process_group=0)
    assert _head.stdout is not None
    with err, selectors.DefaultSelector() as sel:
        sel.register(_head.stdout, selectors.EVENT_READ)
        while not sel.select(0.1):
            if cancelled():
                _stop_head()
                return None
        line, _, _head_session = _head.stdout.readline().decode().strip().partition(" ")
        if not line:
            code = _head.wait()
            _stop_head()  # whatever of its cluster it had started
            err.seek(0)
            cause = [x for x in err.read().decode(errors="replace").splitlines() if x.strip()][-1:]
            raise HeadStartError(f"the Ray head process exited (code {code}) before its cluster was up"
                                 + (f": {cause[0].strip()[:300]}" if cause else ""))
    return line


def ray_tmpdir() -> str:
    """The folder Ray keeps its sessions under, as Ray finds it: RAY_TMPDIR, else TMPDIR, else /tmp."""
    return os.environ.get("RAY_TMPDIR") or os.environ.get("TMPDIR") or "/tmp"


def sessions_of(pid: int, ray_tmp: str) -> list[Path]:
    """The session dirs in `ray_tmp` of the clusters process `pid` started: Ray names them
    session_<time>_<pid of the process that started the cluster>."""
    return sorted(Path(ray_tmp, "ray").glob(f"session_*_{pid}"))


def _head_command(num_cpus: int) -> list[str]:
    return [sys.executable, "-m", "streamprep.ray_head", str(max(num_cpus, 1)), str(RAY_NICE)]


def _stop_head() -> None:
    """Kill the head process and every process of its cluster (its process group, and whatever left it). The
    driver has detached (or never attached); a shard still running there has no receipt and is redone on
    resume, so nothing needs a gentle shutdown, which costs seconds."""
    global _head
    head, _head = _head, None
    if head is None:
        return
    try:
        root = psutil.Process(head.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        procs = []

    def kill_group() -> None:
        try:
            os.killpg(head.pid, signal.SIGKILL)  # also what the cluster started after the snapshot above
        except (ProcessLookupError, PermissionError):
            pass

    stop_and_reap(kill_group, procs, grace=0.0)
    head.wait()
    shutil.rmtree(_head_tmp, ignore_errors=True)
    # a head killed before it said its session dir (a job done before its cluster was up) may have made one
    for session in [_head_session] if _head_session else sessions_of(head.pid, _head_ray_tmp):
        remove_session(str(session))
    for key, value in _env_before.items():  # the user's own Ray settings, if any, are back
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def cpus_per_worker(workers: int) -> float:
    """Logical CPUs Xenna's allocator gives one stage worker: half a node share, since two stages share the
    cluster's cores for the whole job (ingest and tokenization overlap): with `ray_address` the ingest stage's
    `workers` and the tokenize stage's, on the job's own cluster the job's workers and the tokenize stage."""
    import ray

    cpus = float(ray.cluster_resources().get("CPU", 1))
    return max(min(cpus / max(workers, 1), 1.0) / 2, 0.05)


def usable_nodes() -> set[str]:
    """Ids of the alive nodes that have CPUs (a head started with `--num-cpus=0` runs none of the job's work).
    The stage runs one worker per such node: the Rust tokenizer already threads over a node's cores (two
    workers on one 2-core node only compete: `git show c594e76:docs/performance.md`)."""
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) > 0}


def address() -> str:
    return os.environ.get("RAY_ADDRESS", "")


class StartLost(RuntimeError):
    """A worker actor ended as the job started them (`spread_actors`): its node lost, or its process killed."""


class ClusterFailed(RuntimeError):
    """A call the job's Xenna pipeline held when the pipeline failed (its Ray cluster, e.g. no dashboard for its
    monitor): not the input's fault, which "reading or judging the input failed" said, naming a dataset."""


class NoNodeLeft(RuntimeError):
    """Every node able to run the job's work is gone, and none came back in NO_NODE_WAIT_S."""


NO_NODE_WAIT_S = 20.0  # how long a job with no usable node waits for one (a raylet restarting) before failing
_no_node_since: float | None = None
_nodes_checked = 0.0


def is_lost_worker(exc: BaseException) -> bool:
    """Whether `exc` (or what it wraps) says a Ray worker, its node or an object it held was lost, rather
    than that the work itself failed (which would fail again on any node)."""
    from ray import exceptions as rx

    lost = (rx.RayActorError, rx.NodeDiedError, rx.WorkerCrashedError, rx.ObjectLostError, rx.OwnerDiedError,
            rx.LocalRayletDiedError, rx.ActorUnavailableError)
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, lost) or _raylet_gone(exc):
            return True
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    return False


def _raylet_gone(exc: BaseException) -> bool:
    """An actor's call failed inside Ray's own client with an OSError ("Broken pipe"): the actor's raylet went
    away under it (a node removed without grace), which Ray reports this way before it marks the node dead."""
    from ray import exceptions as rx

    if not isinstance(exc, rx.RayTaskError) or not isinstance(exc.cause, OSError):
        return False
    frames = [line for line in str(exc).splitlines() if line.lstrip().startswith("File ")]  # the actor's traceback
    return bool(frames) and " in ray._raylet." in frames[-1]


def wait_for_usable_node(cancelled: Callable[[], bool], timeout: float | None = None) -> bool:
    """True as soon as a node can run the job's work; False after `timeout` (NO_NODE_WAIT_S) or once `cancelled()`."""
    deadline = time.monotonic() + (NO_NODE_WAIT_S if timeout is None else timeout)
    while not usable_nodes():
        if cancelled() or time.monotonic() > deadline:
            return False
        time.sleep(0.5)
    return True


def wait_for_node_loss(nodes: set[str], timeout: float, cancelled: Callable[[], bool]) -> set[str]:
    """Those of `nodes` Ray marks dead (or that lose their CPUs) within `timeout`; empty if none does."""
    deadline = time.monotonic() + timeout
    while not (lost := nodes - usable_nodes()):
        if cancelled() or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return lost


def no_node_left() -> str | None:
    """A reason once the job's cluster has had no node able to run its work for NO_NODE_WAIT_S (or its GCS has
    not answered for that long), else None; None too while this process is not attached. Cheap to call often:
    it looks at most once a second. Without it, work waiting on an actor Ray restarts after a lost node waits
    forever for a node that never comes, and a driver whose GCS is gone hangs (Ray's client gives up after 60 s
    but the process stays)."""
    global _no_node_since, _nodes_checked
    now = time.monotonic()
    if not _ray_initialized():
        return None
    if now - _nodes_checked >= 1.0:
        _nodes_checked = now
        if _gcs_answers() and usable_nodes():
            _no_node_since = None
        elif _no_node_since is None:
            _no_node_since = now
    if _no_node_since is not None and now - _no_node_since >= NO_NODE_WAIT_S:
        return f"no Ray node with CPUs (or no GCS) has been alive for {NO_NODE_WAIT_S:.0f} s"
    return None


def _gcs_answers() -> bool:
    """The GCS port accepts a connection within a second (asking Ray itself would block while it is gone)."""
    host, _, port = address().rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except (OSError, ValueError):
        return False


@functools.lru_cache(maxsize=None)
def _actor_class(cls: type) -> Any:
    """`cls` as a Ray actor class, made once per process however many actors it places."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=0)(cls)


def place_actor(cls: type, slot: int, *args: object, nodes: list[str] | None = None) -> Any:
    """An actor of `cls` on the `slot`-th node with CPUs (round robin over their sorted ids, `nodes` when the
    caller has just listed them: the same cluster gets the same placement); SPREAD if no node has CPUs yet.

    It asks Ray for no logical CPU, as Xenna's stage workers do not (its allocator counts cores itself): the
    actors live for the whole job, and Xenna's per-node resource monitor asks for one whole free CPU, which an
    actor holding a share of a 1-CPU node would keep from it for good (the stage never started: the 2-node
    test hung). The affinity is hard: a soft one put both actors on one node of two whenever the job has a
    runtime env (ours: the setup hook), measured with `ray.cluster_utils`. So Ray never moves an actor: one
    lost with its node is replaced by the executor (`executor.RayExecutor`)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = node_for(slot, sorted(usable_nodes()) if nodes is None else nodes)
    where = NodeAffinitySchedulingStrategy(node, soft=False) if node else "SPREAD"
    return _actor_class(cls).options(scheduling_strategy=where).remote(*args)


def node_for(slot: int, nodes: list[str]) -> str | None:
    """The node `place_actor` pins the `slot`-th actor to, of `nodes` (sorted); None (SPREAD) if there is none."""
    return nodes[slot % len(nodes)] if nodes else None


def nodes_but(lost: str | None) -> list[str]:
    """The usable nodes (sorted) to place the replacement of an actor lost on node `lost` on: not that node, as
    Ray lists a node that died as alive for ~20 s, and a replacement placed there died with it, failing the job
    (on a node still up, the new one goes to another)."""
    return sorted(usable_nodes() - {lost})


def spread_actors(cls: type, workers: int, *args: object) -> tuple[list, list[str]]:
    """`workers` actors of `cls` over the nodes (`place_actor`), started before this returns, and the node of
    each (its `ready()`, whose streamprep `node_of` checks)."""
    import ray
    from ray.exceptions import RayActorError

    nodes = sorted(usable_nodes())  # listed once for all of them
    actors = [place_actor(cls, i, *args, nodes=nodes) for i in range(workers)]
    readies, placed = [a.ready.remote() for a in actors], []
    for i, ready in enumerate(readies):
        try:
            placed.append(node_of(ray.get(ready)))
        except RayActorError as exc:  # was a bare ActorDiedError out of the job, naming no node
            raise StartLost(f"a worker actor ended as it started, on node {node_for(i, nodes) or '(any)'} (lost?): "
                            f"{str(exc).splitlines()[0][:200]}; re-run the same command to resume") from exc
    log.info("worker actors placed", nodes=len(nodes), per_node=sorted(Counter(placed).values(), reverse=True))
    return actors, placed


def node_of(ready: Any) -> str:
    """The node of a worker actor's `ready()` answer, (node, its `version.source()`), once `same_source` passed
    it: before the actor runs any of the job's calls."""
    theirs = ready[1] if isinstance(ready, tuple) and len(ready) == 2 else ("an older one", "no source fingerprint")
    same_source(version.source(), theirs)
    return ready[0]


def same_source(driver: tuple[str, str], worker: tuple[str, str]) -> None:
    """A ConfigError unless a Ray worker's streamprep (`version.source()`) is the driver's: a node's other one (an
    older checkout, another venv) failed the job late with whatever its code raised (a bare TypeError at the
    audit, exit 1), or could write other bytes."""
    if worker[0] != driver[0]:
        raise ConfigError(f"a Ray node runs another streamprep ({worker[0]}, {worker[1]}) than this driver "
                          f"({driver[0]}, {driver[1]}): every node needs the same streamprep (docs/multi-node.md)")


def release() -> None:
    """Detach from and end a cluster this process started; from an attached one only reap Xenna's leftovers."""
    global _started_here
    with _lock:
        if _started_here:
            if _ray_initialized():
                import ray

                with job_signals_kept():  # the exports and the audit still run: a stop is still the job's
                    ray.shutdown()  # detach first: the driver's core worker ends the process if its GCS goes away
            _stop_head()
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


def init_here(num_cpus: int) -> object:
    """Start a Ray cluster in this process (what `ray_head` holds for a job; the tests' session cluster);
    returns Ray's context. End it with `shutdown_ray()` from this thread. A new one always (`address="local"`):
    `ray.init` without an address attached to a cluster already running on the machine (a user's own, or
    RAY_ADDRESS's), refused the CPU count, and `engine: xenna` fell back to local workers."""
    global _here_session
    os.environ.update(RAY_ENV)
    import ray

    ctx = ray.init(address="local", num_cpus=num_cpus, include_dashboard=True, log_to_driver=False,
                   object_store_memory=OBJECT_STORE_BYTES)
    _here_session = ctx.address_info.get("session_dir") or ""
    return ctx


def shutdown_ray() -> None:
    """Shut down the Ray cluster this process started and wait for its processes to go, then remove its
    session dir. Call it from the thread that called `ray.init` (from another, Ray waits ~15 s and leaves its
    agents running)."""
    import ray

    stop_and_reap(ray.shutdown)
    remove_session(_here_session)


def remove_session(session_dir: str) -> None:
    """Remove a cluster's session dir (logs, sockets: ~2 MB) once its processes are gone, and Ray's links to it
    (`session_latest`, the metrics discovery file): each cluster a job started left one in RAY_TMPDIR/ray."""
    path = Path(session_dir) if session_dir else None
    if path is None or not path.name.startswith("session_") or path.is_symlink() or not path.is_dir():
        return
    shutil.rmtree(path, ignore_errors=True)
    for link in path.parent.iterdir():
        if link.is_symlink() and Path(os.readlink(link)).is_relative_to(path):
            link.unlink(missing_ok=True)


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


def stop_and_reap(stop: Callable[[], None], procs: list[psutil.Process] | None = None, grace: float = GRACE_S) -> None:
    """Run `stop` (a cluster shutdown), then kill the processes that outlived it (after `grace` seconds):
    `procs`, by default all of this process's Ray processes. Busy stage workers are killed first: a shard they
    were writing has no receipt and is redone on resume."""
    children = ray_processes() if procs is None else procs
    reap_leaked_ray_workers()
    stop()
    for p in _wait_gone(children, grace):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _wait_gone(children, 3.0)


def _wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Poll until every one of `procs` has exited or `timeout` passed; returns those still running. An exited
    child of ours is reaped; a grandchild's zombie counts as gone (its reaper is not us)."""
    deadline = time.monotonic() + timeout
    while True:
        running = [p for p in procs if _running(p)]
        if not running or time.monotonic() >= deadline:
            return running
        time.sleep(0.02)


def _running(p: psutil.Process) -> bool:
    try:
        if p.status() != psutil.STATUS_ZOMBIE:
            return True
    except psutil.NoSuchProcess:
        return False
    try:
        os.waitpid(p.pid, os.WNOHANG)
    except ChildProcessError:  # not our child
        pass
    return False
