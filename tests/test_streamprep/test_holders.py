"""The dedup holders' bookkeeping: the holder count a run keeps, a holder process's answers and errors."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from quality.dedup import digest_words
from streamprep.config import SPEC, ExecutionConfig
from streamprep.holders import HeldDedup, HolderLost, Holders, partitions, start
from streamprep.layout import CheckpointLayout


def test_the_holder_count_is_fixed_when_a_run_starts(tmp_path: Path) -> None:
    """A new run writes the configured count and every later start keeps it; a run that an earlier streamprep
    started (a checkpoint, no saved count) keeps its one log per dataset."""
    new, old = tmp_path / "new", tmp_path / "old"
    new.mkdir()
    old.mkdir()
    assert partitions(new, 3, started=False) == 3
    assert partitions(new, 2, started=True) == partitions(new, 1, started=False) == 3
    assert json.loads(CheckpointLayout(new).dedup_holders.read_text()) == {"holders": 3}
    assert partitions(old, 4, started=True) == 1 and partitions(old, 4, started=True) == 1


def test_a_resume_logs_the_holder_count_configured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: `dedup_holders: 0` (held in the job's process: one partition) on a resume of a run started with 2
    logged 'configured=1'. A new run configured 0 holds one partition."""
    from streamprep import holders

    said: list = []
    monkeypatch.setattr(holders.log, "info", lambda event, **kw: said.append((event, kw)))
    assert partitions(tmp_path, 2, started=False) == 2 and partitions(tmp_path, 0, started=True) == 2
    assert said == [("dedup holders kept as this run started", {"holders": 2, "configured": 0})]
    (tmp_path / "fresh").mkdir()
    assert partitions(tmp_path / "fresh", 0, started=False) == 1


def test_no_holder_process_is_started_without_exact_dedup(tmp_path: Path) -> None:
    """`quality.dedup: none` without near-dedup leaves nothing to hold: the job's process stands in (no fork, no pipe), even for a
    configured count; with exact dedup the same config starts holder processes. Found in round 27: a 2 M-record
    job with dedup off forked a holder of ~100 MB that held nothing."""
    defaults = {key: default for key, (_, default) in SPEC["execution"].items()}
    execution = ExecutionConfig.from_dict({**defaults, "workers": 2, "dedup_holders": 3})
    with start(execution, tmp_path / "off", started=False, holding=False) as holders:
        assert holders.where == "inline" and holders.pids == [os.getpid()]
    with start(execution, tmp_path / "on", started=False) as holders:
        assert holders.where == "process" and len(set(holders.pids)) == 3


@pytest.mark.slow
def test_a_holder_process_answers_in_order_and_sends_errors_back(tmp_path: Path) -> None:
    """Two holder processes: the digests split by their first word, a copy found on its holder, and a call that
    fails there (an unopened dataset) raised in the caller, the holder still serving afterwards."""
    digests = [hashlib.sha256(str(i).encode()).digest() for i in range(200)]
    words = digest_words(digests)
    with Holders(2, "process") as holders:
        assert len(set(holders.pids)) == 2
        holders.open("d", tmp_path, [0, 0])
        held = HeldDedup(holders, "d", [], [0, 0])
        assert (held.twin_many(words, np.ones(200, bool)) == -1).all()
        odd = int(np.count_nonzero(words[:, 0] % np.uint64(2)))
        assert held.counts == [200 - odd, odd] and 0 < odd < 200
        again = held.twin_many(words[::-1], np.ones(200, bool))
        assert (again == 0).all() and held.counts == [200 - odd, odd]
        with pytest.raises(KeyError, match="other"):
            HeldDedup(holders, "other", [], [0, 0]).probe_many(words)
        assert (held.probe_many(words) == 0).all()
        held.flush()
        assert [u["digests"] for u in holders.usage()] == [{"d": 200 - odd}, {"d": odd}]
    for p, n in enumerate((200 - odd, odd)):
        assert CheckpointLayout(tmp_path).dedup_log("d", p, 2).stat().st_size == 32 * n


def test_a_holder_actor_that_ends_as_it_starts_is_a_holder_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """It was a bare ActorDiedError out of the job, where a holder lost later is a HolderLost saying to re-run."""
    ray = pytest.importorskip("ray")
    from ray.exceptions import ActorDiedError

    from streamprep import holders

    class Died:
        class ready:  # the actor method's name
            @staticmethod
            def remote() -> str:
                return "ref"

    def get(ref: str, timeout: float) -> None:
        raise ActorDiedError()

    monkeypatch.setattr(holders.ray_cluster, "usable_nodes", lambda: {"node"})
    monkeypatch.setattr(holders.ray_cluster, "place_actor", lambda cls, slot, pin, nodes: Died())
    monkeypatch.setattr(ray, "get", get)
    with pytest.raises(holders.HolderLost, match="a dedup holder actor ended as it started: The actor died"):
        holders._Actor(0)


class _FakeCluster:
    """Nodes and holder actors as `ray_cluster.place_actor` and `ray.get` see them: an actor on a node in `dead`
    is dead (its calls raise ActorDiedError), and Ray still lists a dead node in `usable_nodes` (as it does for
    ~20 s); `placed` records each actor's node."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, nodes: set[str]) -> None:
        import ray
        from ray.exceptions import ActorDiedError

        from streamprep import holders

        self.nodes, self.dead, self.placed = nodes, set(), []
        cluster = self

        class Actor:
            def __init__(self, node: str) -> None:
                self.node, self.holder = node, holders.Holder()

            def __getattr__(self, method: str) -> object:
                class Method:
                    @staticmethod
                    def remote(*args: object) -> tuple:
                        return self, method, args
                return Method

        def place_actor(cls: type, slot: int, pin: bool, nodes: list[str] | None = None) -> Actor:
            nodes = sorted(cluster.nodes) if nodes is None else nodes
            cluster.placed.append(nodes[slot % len(nodes)])
            return Actor(cluster.placed[-1])

        def get(ref: tuple, timeout: float | None = None) -> object:
            actor, method, args = ref
            if actor.node in cluster.dead:
                raise ActorDiedError()
            return getattr(actor.holder, method)(*args)

        monkeypatch.setattr(holders.ray_cluster, "usable_nodes", lambda: set(cluster.nodes))
        monkeypatch.setattr(holders.ray_cluster, "place_actor", place_actor)
        monkeypatch.setattr(ray, "get", get)
        monkeypatch.setattr(ray, "kill", lambda actor: None)


def test_a_holder_actor_lost_with_its_node_is_placed_on_another_node(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    """Regression (round 47): the replacement of a holder lost with its node went to the same node (Ray lists a
    dead node as alive for ~20 s), died there, and the job failed; it goes to a node left and the job goes on."""
    cluster = _FakeCluster(monkeypatch, {"a", "b"})
    with Holders(1, "ray") as held:
        held.open("d", tmp_path, [0])
        cluster.dead.add("a")  # holder 0's node ("a" sorts first), still listed alive
        assert held.all("flush", "d") == [(0, 0)]
        assert cluster.placed == ["a", "b"] and held.replaced == 1


def test_a_holder_that_cannot_be_placed_again_fails_the_job_with_the_advice_to_re_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Regression (round 47): a replacement that ended as it started left the lost holder in its slot, so the
    next call replaced it again (a second warning), and the error had no advice to re-run. It says to re-run, and
    every later call fails the same way with no other replacement."""
    import structlog

    cluster = _FakeCluster(monkeypatch, {"a", "b"})
    with Holders(1, "ray") as held:
        held.open("d", tmp_path, [0])
        cluster.dead |= {"a", "b"}
        with structlog.testing.capture_logs() as logged:
            for _ in range(2):
                with pytest.raises(HolderLost) as failed:
                    held.all("flush", "d")
                assert "ended as it started" in str(failed.value)
                assert str(failed.value).endswith("replacing a lost one; re-run the same command to resume")
        assert held.replaced == 1 and cluster.placed == ["a", "b"]
        assert len([e for e in logged if e["event"].startswith("a dedup holder was lost")]) == 1


def test_a_size_cap_reached_before_the_piece_stops_its_walk_before_the_first_record() -> None:
    """A job stopped after saving the capped piece's checkpoint and before marking its dataset done resumed at
    kept_text_bytes >= the cap, and the walk kept the next record: one more than a run without the stop."""
    from streamprep.holders import walk
    from streamprep.unit_worker import KEPT

    kinds, sizes = bytes([KEPT] * 3), np.array([10, 10, 10])
    args = (kinds, sizes, [b"a" * 32, b"b" * 32, b"c" * 32], [-1, -1, -1], None, 50)
    at_cap = walk(*args, None, 100, 100, True)
    assert (at_cap.n, at_cap.capped, at_cap.size_capped, at_cap.keep) == (0, True, True, b"")
    below = walk(*args, None, 95, 100, True)  # the record that reaches the cap is kept, as before
    assert (below.n, below.size_capped, below.keep) == (1, True, b"\x01")


@pytest.mark.slow
def test_a_holder_replaced_in_the_job_is_logged_without_advice_to_re_run_and_with_its_exit_code(tmp_path: Path) -> None:
    """Regression: the warning of a holder replaced in the job said "re-run the same command to resume" (nothing
    needs re-running) and mostly "exit code None" (read before the process was reaped). The advice is for the job
    that gives up, after REPLACEMENTS."""
    import signal

    import structlog

    from streamprep import holders

    with Holders(1, "process") as held:
        held.open("d", tmp_path, [0])
        with structlog.testing.capture_logs() as logged:
            os.kill(held.pids[0], signal.SIGKILL)
            assert held.all("flush", "d") == [(0, 0)]
        lost = [e for e in logged if e["event"].startswith("a dedup holder was lost")]
        assert [e["error"] for e in lost] == ["a dedup holder process ended (exit code -9)"]
        held.replaced = holders.REPLACEMENTS
        os.kill(held.pids[0], signal.SIGKILL)
        with pytest.raises(holders.HolderLost) as failed:
            held.all("flush", "d")
        assert str(failed.value) == (f"a dedup holder process ended (exit code -9), after {holders.REPLACEMENTS} "
                                     "replaced in this job; re-run the same command to resume")


@pytest.mark.slow
def test_a_holder_lost_as_the_job_stops_is_not_replaced_and_a_failed_start_closes_the_others(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a SIGTERM to the job's whole process group reaching a holder before its start set it to ignore
    SIGTERM ended it as the job stopped; it was replaced, the replacement never closed, and the job hung after
    "interrupted" in `forkserver.stop` (the resource tracker waits for every process holding its pipe). A holder
    lost once the job's stop is asked is not replaced; and a start that fails closes the holders already up."""
    import signal
    import threading

    import psutil

    from streamprep import holders

    def gone(pid: int) -> bool:
        return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE

    stop = threading.Event()
    with Holders(2, "process", stop) as held:
        held.open("d", tmp_path, [0, 0])
        stop.set()
        os.kill(held.pids[0], signal.SIGKILL)
        with pytest.raises(HolderLost, match=r"^a dedup holder process ended \(exit code -9\), as the job stops$"):
            held.all("flush", "d")
        assert held.replaced == 0
    assert gone(held.pids[1])

    started: list[holders._Process] = []
    real = holders._Process.__init__

    def tracked(self: holders._Process) -> None:
        real(self)
        started.append(self)

    def never_ready(self: Holders, method: str, *args: object) -> list:
        raise HolderLost("a dedup holder process ended (exit code -15)")

    monkeypatch.setattr(holders._Process, "__init__", tracked)
    monkeypatch.setattr(Holders, "all", never_ready)
    with pytest.raises(HolderLost):
        Holders(2, "process", stop)
    assert len(started) == 2 and all(not p._proc.is_alive() for p in started)


_MANY_DATASETS = r'''
import hashlib, os, resource, sys
from pathlib import Path
import numpy as np
from quality.dedup import digest_words
from quality.near_dedup import Signer
from quality.settings import NearDedupSettings
from streamprep.holders import HeldDedup, Holders
from streamprep.unit_worker import KEPT

ckpt, n = Path(sys.argv[1]), int(sys.argv[2])
near = NearDedupSettings(enabled=True, threshold=0.8, ngram=3, bands=16, rows=8, seed=1, num_perm=128)
signer = Signer(near)
before = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (before + 24, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
codes, twins = [], []
with Holders(1, "inline") as holders:
    for i in range(n):
        ds, earlier = f"d{i:03d}", [f"d{i - 1:03d}"] if i else []
        # its first record a near copy of the one before's last (a near twin in an earlier dataset), then two new
        texts = [" ".join(hashlib.sha256(f"{j}.{k}".encode()).hexdigest()[:6] for k in range(20))
                 for j in (2 * i - 1, 2 * i, 2 * i + 1)]
        texts[0] += " too"
        digests = [hashlib.sha256(t.encode()).digest() for t in texts]
        holders.open(ds, ckpt, [0])
        holders.open_near(ds, ckpt / f"{ds}.near", 0, near)
        held = HeldDedup(holders, ds, earlier, [0])
        w = holders.walk(ds, earlier, bytes([KEPT] * 3), np.array([10, 10, 10]), digests,
                         held.probe_many(digest_words(digests)).tolist(), signer.signatures(texts), 0, None, 0,
                         None, True)
        held.add_many(digest_words([d for d, k in zip(digests, w.keep) if k]))
        held.flush()
        codes.append(sorted(w.dup.items()))
        twins.append(sorted((j, t[0]) for j, t in w.near.items()))
    print(codes == [[]] * n, twins[0], all(t == [(0, f"d{i - 1:03d}")] for i, t in enumerate(twins) if i))
    print(len(os.listdir("/proc/self/fd")) - before)
'''


def test_a_holder_keeps_no_log_open_between_calls_whatever_the_dataset_count(tmp_path: Path) -> None:
    """Regression: a holder kept each dataset's exact-dedup log (and near-dedup log) open for the whole job, a
    descriptor each: 233 datasets at `ulimit -n 256` (1022 at 1024) ended the job with EMFILE on the next log
    opened. 300 datasets here in a process allowed 24 descriptors more than it had, each dataset's first record a
    near copy of the one before's (`dedup_scope: run`: its log read back), every log written and fsynced."""
    import subprocess
    import sys

    path = os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])
    job = subprocess.run([sys.executable, "-c", _MANY_DATASETS, str(tmp_path), "300"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": path}, timeout=120, check=False)
    assert job.returncode == 0, job.stderr[-2000:]
    assert job.stdout.splitlines()[-2:] == ["True [] True", "0"]  # (after the holder's log line)
    for i in (0, 150, 299):
        assert (tmp_path / f"d{i:03d}.dedup").stat().st_size == 32 * (3 if i == 0 else 2)  # the near copy not kept
        assert (tmp_path / f"d{i:03d}.near").stat().st_size == (8 + 4 * 128) * (3 if i == 0 else 2)
