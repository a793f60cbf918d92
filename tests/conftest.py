"""Shared fixtures: the real corpora in ../shared/data (skip without them, fail under CI=true)."""
from __future__ import annotations

import multiprocessing
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("STREAMPREP_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path to ../shared/data; tests needing it skip with a reason when absent, but fail under CI."""
    if not (SHARED_DATA / "SOURCES.md").is_file():
        msg = f"shared corpora not found at {SHARED_DATA} (set STREAMPREP_SHARED_DATA or clone shared/ beside the repo)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return SHARED_DATA


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray cluster for every `ray`-marked test (xenna-notes.md §7); everything it started is reaped."""
    from streamprep.ray_cluster import init_here, shutdown_ray

    ctx = init_here(2)
    os.environ["RAY_ADDRESS"] = ctx.address_info["gcs_address"]
    try:
        yield ctx
    finally:
        shutdown_ray()
        os.environ.pop("RAY_ADDRESS", None)


@pytest.fixture(scope="session", autouse=True)
def reap_what_killed_runs_leave():
    """Tests that SIGKILL `streamprep ingest` may leave what its process pool's finalizers would have removed:
    POSIX semaphores (/dev/shm/sem.mp-*) and forkserver socket dirs (pymp-*). The resource tracker and the
    forkserver remove them when only the command is killed; a kill that also reaches them, or lands while the
    command starts them, leaves them. At the end of the session, remove those created during it that no live
    process still uses (mapped, or a socket still bound)."""
    t0 = time.time()
    yield
    sweep(t0)


def sweep(t0: float, shm: Path = Path("/dev/shm"), tmp: Path = Path(tempfile.gettempdir())) -> None:
    """Remove the semaphores and forkserver dirs created since `t0` that no live process uses."""
    # Listed before the live processes are read: one created in between (another session's job on this
    # machine) is then not in the list, instead of looking unused and being removed under its pool.
    sems, dirs = list(shm.glob("sem.mp-*")), list(tmp.glob("pymp-*"))
    mapped = _mapped_shm_inodes()
    for sem in sems:
        if _created_since(sem, t0) and _inode(sem) not in mapped:
            sem.unlink(missing_ok=True)
    bound = _bound_sockets()
    own = multiprocessing.current_process()._config.get("tempdir")  # this process's finalizer removes it
    for d in dirs:
        if _created_since(d, t0) and str(d) != own and _holds_sockets(d) \
                and not any(str(d) in line for line in bound):
            shutil.rmtree(d, ignore_errors=True)


def _holds_sockets(folder: Path) -> bool:
    """Whether `folder` holds a socket file (a forkserver's listener). A live process makes its pymp-* folder at
    its first need and binds a socket there only when it starts a forkserver: an empty folder may be another
    session's in use (regression: a concurrent pytest's sweep removed this session's folder, and every later
    process pool failed to start, FileNotFoundError in multiprocessing.forkserver)."""
    try:
        return any(stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode) for entry in os.scandir(folder))
    except OSError:
        return False


def _created_since(path: Path, t0: float) -> bool:
    try:
        return path.stat().st_mtime >= t0
    except FileNotFoundError:
        return False


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _mapped_shm_inodes() -> set[int]:
    """Inodes of /dev/shm files any live process maps. By inode, not name: glibc's sem_open creates a semaphore
    under a temporary name, maps it, then links it to its real name, so its creator's maps show the temporary
    name "(deleted)" (regression: a sweep by name removed the semaphores of another session's running pool)."""
    import glob

    found: set[int] = set()
    for name in glob.glob("/proc/*/maps"):
        try:
            with open(name) as fh:
                found.update(int(f[4]) for line in fh if "/dev/shm/" in line and len(f := line.split()) >= 6)
        except (OSError, ValueError):  # a process that exited meanwhile, or one we may not read
            continue
    return found


def _bound_sockets() -> list[str]:
    """The lines of the unix-socket table: the paths live processes have bound."""
    try:
        return Path("/proc/net/unix").read_text().splitlines()
    except OSError:
        return []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """`ray` implies `slow`: the fast lane (`-m "not slow"`) never starts a cluster."""
    for item in items:
        if item.get_closest_marker("ray") is not None:
            item.add_marker(pytest.mark.slow)


# -- the tokenized run dir the exports and verify tests export (tests/export_run.py) -------------------------
@pytest.fixture(scope="session")
def base_run(shared_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """A tokenized run dir (no exports yet) and its ShardRefs; built once a session."""
    from export_run import build_run  # numpy, tokenizers: only for the sessions that use it

    run = tmp_path_factory.mktemp("base") / "run"
    return run, build_run(run, shared_data)


@pytest.fixture()
def run(base_run: tuple[Path, list], tmp_path: Path) -> tuple[Path, list]:
    """A private copy of the tokenized run dir (no exports yet)."""
    from export_run import relocate

    src, refs = base_run
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst, relocate(refs, src, dst)
