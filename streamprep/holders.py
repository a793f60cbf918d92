"""Exact-dedup holders: the run's kept-digest indexes, hash-partitioned over processes (Ray actors with
`execution.ray_address`), so the job's process holds no digest and its memory stays flat in record count.

Holder `p` of `P` owns the digests whose first 8-byte word is `p` mod `P`: one `DedupIndex` per dataset, each
with its own log (`P = 1`: the dataset's `<ds>.dedup`, as ever; else `<ds>.dedup.<p>-of-<P>`). Equal digests
share a holder, so the copies inside a piece are settled there too. The decider stays the clock: piece by piece
in plan order it sends each holder its rows and scatters the answers back, and a holder runs its calls in the
order they were sent, so every index and log grows in plan order whatever the worker count, and the checkpoint
records each holder's count (`IngestState.dedup_counts`). `P` is fixed when a run starts
(`<checkpoint_dir>/dedup_holders.json`); a resume keeps it. Holder 0 also keeps the near-dedup indexes (band
indexes do not split by digest) and walks the pieces that near-dedup or `size_mb` decide record by record
(`walk`), so their indexes leave the job's process too. `docs/units.md`, "Dedup holders".
"""
from __future__ import annotations

import os
import resource
import signal
import threading
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from quality.dedup import DedupDecision, DedupIndex
from quality.near_dedup import NearDecision, NearDupIndex
from quality.settings import NearDedupSettings
from streamprep import atomic, forkserver, logs, ray_cluster
from streamprep.children import serve_driver
from streamprep.config import ExecutionConfig, resolved_workers
from streamprep.executor import picklable_error, quiet_gc, stop_seen
from streamprep.layout import CheckpointLayout, read_json
from streamprep.unit_worker import BAD, KEPT

log = logs.get("holders")


class Walk(NamedTuple):
    """A piece decided record by record (`walk`)."""

    n: int                                   # records walked (a cap stops the walk)
    capped: bool                             # `max_records` or `size_mb` ended the dataset in the piece
    size_capped: bool                        # `size_mb` did, at the last record walked
    keep: bytes                              # one byte per record walked
    dup: dict[int, int]                      # record -> index in the decider's `names` of the dataset keeping its text
    near: dict[int, tuple[str, int, float]]  # record -> (the twin's dataset, "" = this one; its source index; Jaccard)
    near_bytes: int                          # what the records kept add to the near-dedup log


def walk(kinds: bytes, text_bytes: np.ndarray, digests: list[bytes | None], codes: list[int], signatures: list | None,
         consumed: int, cap: int | None, kept_bytes: int, size_cap: int | None, dedup_on: bool,
         near: NearDecision | None = None) -> Walk:
    """A piece's verdicts record by record from the dataset's counters (`consumed`, `kept_bytes`): `codes`, the
    exact-dedup probe of its judged records (the indexes as they stood, nothing added), a copy of a record kept
    earlier in the piece being this dataset's; `near`, the near-dedup decision, into whose own index each record
    kept is added (a twin is looked for among the records kept before it, in this piece too). `max_records` stops
    the walk before a record, `size_mb` after the kept record that reaches it, or before the first record when it
    was reached already: a job stopped after saving the capped piece's checkpoint and before marking the dataset
    done kept one record more on resume than a run without the stop."""
    keep, dup, near_of, kept_here = bytearray(), {}, {}, set()
    sizes, digest_of, code_of = iter(text_bytes.tolist()), iter(digests), iter(codes)
    if near is not None:
        near.prepare(signatures or [None] * len(digests))
    capped = size_capped = False
    near_bytes = 0
    for j, kind in enumerate(kinds):
        if cap is not None and consumed >= cap:
            capped = True
            break
        if size_cap is not None and kept_bytes >= size_cap:
            capped = size_capped = True
            break
        ordinal = consumed
        consumed += 1
        kept = kind == KEPT
        size = next(sizes) if kept else 0
        if kind != BAD:
            digest = next(digest_of)
            twin = near.next_twin() if near is not None else None  # (always: the index follows the piece)
            code = next(code_of, -1)
            if dedup_on and digest in kept_here:
                code = 0  # kept earlier in this piece: by this dataset
            if code >= 0:
                kept, dup[j] = False, code
            elif kept and twin is not None:
                kept, near_of[j] = False, (twin[0], *twin[1])
        keep.append(kept)
        if kept:
            if dedup_on:
                kept_here.add(digest)
            if near is not None:
                near_bytes += near.own.add(ordinal)
            kept_bytes += size
            if size_cap is not None and kept_bytes >= size_cap:
                capped = size_capped = True
                break
    return Walk(len(keep), capped, size_capped, bytes(keep), dup, near_of, near_bytes)


class Holder:
    """One partition's indexes, a `DedupIndex` per dataset, wherever its transport runs it; holder 0 also the
    near-dedup index of each dataset (`NearDupIndex`), whose records it appends to the log after each walk and
    fsyncs at each `flush`. No log stays open between calls (each index opens its own when it reads or writes it):
    the indexes stay for the whole job, and a descriptor each ran the holder out of them at ~1000 datasets."""

    def __init__(self, own_process: bool = False) -> None:
        if own_process:  # as every worker: the near walk's per-record containers made CPython's collector 30 %
            quiet_gc()   # of a holder's CPU (its default threshold of 700 allocations, on 800 000 records)
        self.indexes: dict[str, DedupIndex] = {}
        self.near: dict[str, NearDupIndex] = {}

    def ready(self) -> int:
        return os.getpid()

    def open(self, dataset: str, log_path: str, count: int) -> None:
        """The dataset's index from its log, cut to the checkpoint's `count` digests."""
        self.indexes[dataset] = DedupIndex(Path(log_path), count)

    def _decision(self, dataset: str, earlier: list[str]) -> DedupDecision:
        return DedupDecision(self.indexes[dataset], [(n, self.indexes[n]) for n in earlier])

    def twin_many(self, dataset: str, earlier: list[str], words: np.ndarray, kept: np.ndarray,
                  order: np.ndarray | None = None) -> np.ndarray:
        """`DedupDecision.twin_many` over this partition's rows of a piece (the new kept digests are added)."""
        return self._decision(dataset, earlier).twin_many(words, kept, order).astype(np.int16)

    def probe_many(self, dataset: str, earlier: list[str], words: np.ndarray) -> np.ndarray:
        """`DedupDecision.probe_many`: nothing added."""
        return self._decision(dataset, earlier).probe_many(words).astype(np.int16)

    def add_many(self, dataset: str, words: np.ndarray) -> None:
        self.indexes[dataset].add_many(words)

    def open_near(self, dataset: str, log_path: str, nbytes: int, near: NearDedupSettings) -> None:
        """The dataset's near-dedup index from its log, cut to the checkpoint's `nbytes` (a log written past
        them, by a holder lost while logging, loses that tail: the calls since are sent again)."""
        path = Path(log_path)
        if path.exists() and path.stat().st_size > nbytes:
            os.truncate(path, nbytes)
        index = self.near[dataset] = NearDupIndex(near, path)
        index.load()
        with open(path, "ab", opener=atomic.nofollow):  # (created now, even if it never holds a record)
            pass

    def walk(self, dataset: str, earlier: list[str], *args: Any) -> Walk:
        """`walk` of a piece with the near-dedup indexes here: the dataset's own, and the datasets' listed before it
        (`earlier`: `dedup_scope: run`). The records it keeps are appended to the log at once (a later twin is
        read back from there), and fsynced at the next `flush`."""
        own = self.near[dataset]
        result = walk(*args, near=NearDecision(own, [(name, self.near[name]) for name in earlier]))
        for name in (dataset, *earlier):  # their maps of the log read back (a dataset done would keep its own)
            self.near[name].close()
        if data := own.take_log():
            with atomic.naming(own.path), open(own.path, "ab", opener=atomic.nofollow) as fh:
                fh.write(data)
        return result

    def flush(self, dataset: str) -> tuple[int, int]:
        """Log what the indexes hold (fsynced); returns (digests, near-dedup log bytes): what a new holder reads
        back."""
        count = nbytes = 0
        if (index := self.indexes.get(dataset)) is not None:
            index.flush()
            count = len(index)
        if (near := self.near.get(dataset)) is not None:
            with atomic.naming(near.path), open(near.path, "ab", opener=atomic.nofollow) as fh:
                os.fsync(fh.fileno())  # (writes back what the walks appended)
            nbytes = len(near) * near.record_size
        return count, nbytes

    def usage(self) -> dict[str, Any]:
        """The digests and near-dedup records it holds per dataset, and its process's CPU seconds and peak RSS
        (the job's own when inline)."""
        ru = resource.getrusage(resource.RUSAGE_SELF)
        near = {"near": {name: len(index) for name, index in self.near.items()}} if self.near else {}
        return {"digests": {name: len(index) for name, index in self.indexes.items()}, **near,
                "cpu_s": round(ru.ru_utime + ru.ru_stime, 3), "peak_rss_mb": round(ru.ru_maxrss / 1024, 1)}

    def close(self) -> None:
        for index in self.near.values():
            index.close()


# -- transports: where a holder runs; each takes calls (`send`) and gives their answers (`recv`) in order -------
class _Inline:
    """A holder in the job's process (`dedup_holders: 0`, or the default with one worker)."""

    def __init__(self) -> None:
        self.holder, self._answers = Holder(), deque()

    def send(self, method: str, args: tuple) -> None:
        try:
            self._answers.append((True, getattr(self.holder, method)(*args)))
        except Exception as exc:
            self._answers.append((False, exc))

    def recv(self) -> Any:
        ok, answer = self._answers.popleft()
        if not ok:
            raise answer
        return answer

    def close(self) -> None:
        self.holder.close()


def _serve(conn: Connection, driver: int) -> None:
    """A holder process: answer the calls on `conn` in order until it closes; end with the job's process. It
    ignores SIGTERM: sent to the job's whole process group (GNU `timeout`, `kill -- -PGID`, a systemd stop), it
    ended the holder while the job's process, stopping, still had to flush its logs (a holder replaced as the job
    stopped); that process ends it (`close`)."""
    serve_driver(driver, signal.SIG_IGN)
    holder = Holder(own_process=True)
    while True:
        try:
            call = conn.recv()
        except EOFError:
            return
        if call is None:
            return
        try:
            conn.send((True, getattr(holder, call[0])(*call[1])))
        except Exception as exc:
            conn.send((False, picklable_error(exc)))


class _Process:
    """A holder in a process of its own, forked from the forkserver, on a pipe (an empty call's round trip
    ~0.06 ms here; a one-process pool's was ~0.3 ms, with its threads' CPU in the job's process). One that dies is
    replaced by `Holders`."""

    def __init__(self) -> None:
        ctx = forkserver.context()
        self._conn, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(theirs, os.getpid()), name="dedup-holder", daemon=True)
        self._proc.start()
        theirs.close()

    def send(self, method: str, args: tuple) -> None:
        try:
            self._conn.send((method, args))
        except OSError:  # it has ended: `recv` says so
            pass

    def recv(self) -> Any:
        try:
            ok, answer = self._conn.recv()
        except (EOFError, OSError):  # (a reset, when it died with a call unread)
            self._proc.join(timeout=1)  # reaped, so its exit code is known (it read None before)
            raise HolderLost(f"a dedup holder process ended (exit code {self._proc.exitcode})") from None
        if not ok:
            raise answer
        return answer

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
        self._conn.close()


class _Actor:
    """A holder as a Ray actor on the `slot`-th node (`ray_cluster.place_actor`); an actor runs the calls of
    one caller in the order sent. One lost (with its node, or its process killed) is replaced by `Holders` on a
    node left: the replacement of `lost` is placed on the nodes but its (`ray_cluster.nodes_but`)."""

    def __init__(self, slot: int, lost: _Actor | None = None) -> None:
        import ray  # as below
        from ray.exceptions import RayActorError

        nodes = sorted(ray_cluster.usable_nodes()) if lost is None else ray_cluster.nodes_but(lost.node)
        self.node = ray_cluster.node_for(slot, nodes)  # (None: placed by SPREAD, on any node)
        self._actor, self._refs = ray_cluster.place_actor(Holder, slot, True, nodes=nodes), deque()
        try:
            ray.get(self._actor.ready.remote(), timeout=ray_cluster.ACTOR_PLACEMENT_WAIT_S)  # no node to place it on
        except RayActorError as exc:  # it ended as it started (its node lost, its process killed): was a bare
            raise HolderLost(f"a dedup holder actor ended as it started: {exc}") from exc  # ActorDiedError

    def send(self, method: str, args: tuple) -> None:
        self._refs.append(getattr(self._actor, method).remote(*args))

    def recv(self) -> Any:
        import ray  # as below
        from ray.exceptions import RayActorError

        try:
            return ray.get(self._refs.popleft())
        except RayActorError as exc:
            raise HolderLost(f"a dedup holder actor was lost: {exc}") from exc

    def close(self) -> None:
        import ray  # only with ray_address, where it is loaded already

        try:
            ray.kill(self._actor)
        except Exception as exc:  # gone with its node, or the cluster is
            log.info("dedup holder actor already gone", error=str(exc)[:200])


CHANGING = ("twin_many", "add_many", "walk")  # the calls that change a holder's indexes
OPENS = ("open", "open_near")  # the calls that open an index from its log; `flush` answers their counts in order
REPLACEMENTS = 4  # holders replaced in one job; then the job fails (and a re-run resumes)


class HolderLost(RuntimeError):
    """A dedup holder ended during the job."""


class Holders:
    """The run's `parts` holders, wherever they run; `HeldDedup` is one dataset's view of them. Calls may come
    from any thread (the decider's, the committer's flush): one lock keeps each holder's calls and answers paired.

    A holder lost during the job (its process killed, its node gone with its actor) is replaced in the job, up to
    REPLACEMENTS times: the new one reads each of its logs back to the count last flushed and is sent again the
    calls that changed its indexes since (kept here until the next flush), so it holds what the lost one held."""

    def __init__(self, parts: int, where: str, stop_asked: threading.Event | None = None) -> None:
        self.parts, self.where, self.stop_asked = parts, where, stop_asked
        # holder p, in place of `lost` (None at the start)
        self._make: Callable[[int, Any], Any] = {"inline": lambda p, lost: _Inline(),
                                                 "process": lambda p, lost: _Process(), "ray": _Actor}[where]
        self._holders = [self._make(p, None) for p in range(parts)]
        self._failed: HolderLost | None = None  # a replacement that failed: every later loss fails the same way
        self._lock = threading.Lock()
        # (open call, dataset) -> its arguments, the count (or bytes) as last flushed: what a new holder reads back
        self._opened: list[dict[tuple[str, str], list]] = [{} for _ in range(parts)]
        self._since: list[list[tuple[str, tuple]]] = [[] for _ in range(parts)]  # changing calls since then
        self.replaced = 0
        try:
            self.pids = self.all("ready")  # started now: a holder that cannot start fails the job here
        except BaseException:  # the others go too, now: alive, they held the resource tracker the job's end waits for
            for h in self._holders:
                h.close()
            raise
        log.info("dedup holders up", holders=parts, where=where, pids=self.pids)

    def ask(self, calls: list[tuple[int, str, tuple]]) -> list[Any]:
        """Calls `(holder, method, args)`, sent to all before any answer is awaited: the holders work at once. A
        call that raised raises here, once every answer is in (so none is left to pair with a later call)."""
        with self._lock:
            for p, method, args in calls:
                if method in CHANGING and self.where != "inline":  # (one in the job's process is never lost)
                    self._since[p].append((method, args))
                self._holders[p].send(method, args)
            answers, failed = [], None
            for p, method, args in calls:
                try:
                    answers.append(self._answer(p, method, args))
                except Exception as exc:
                    failed = failed or exc
            if failed is not None:
                raise failed
            return answers

    def _answer(self, p: int, method: str, args: tuple) -> Any:
        try:
            got = self._holders[p].recv()
        except HolderLost as exc:
            got = self._replace(p, method, args, exc)
        if method in OPENS or method == "flush":  # what a new holder would read back of this dataset
            dataset = args[0]
            if method == "flush":
                for opener, flushed in zip(OPENS, got):
                    if (opener, dataset) in self._opened[p]:
                        self._opened[p][opener, dataset][2] = flushed
            else:
                self._opened[p][method, dataset] = list(args)
            self._since[p] = [c for c in self._since[p] if c[1][0] != dataset]
        return got

    def _replace(self, p: int, method: str, args: tuple, exc: HolderLost) -> Any:
        """A new holder `p` in place of a lost one, brought to where the lost one was; the answer to the call
        the lost one did not give (every call sent to it before that one was answered)."""
        if self._failed is not None:  # the slot still has the lost one: placing again would fail again, later
            raise HolderLost(str(self._failed)) from exc
        # a SIGTERM to the job's process group reaching a holder before its start set it to ignore SIGTERM (`_serve`)
        # ended it as the job stopped: its replacement, never closed, held the resource tracker the job's end waits
        # for (the job hung after "interrupted")
        if stop_seen(self.stop_asked, [getattr(self._holders[p], "exitcode", None)]):
            raise HolderLost(f"{exc}, as the job stops") from exc
        if self.replaced >= REPLACEMENTS:  # the advice to re-run only now: a holder replaced needs none
            raise HolderLost(f"{exc}, after {REPLACEMENTS} replaced in this job; re-run the same command to "
                             "resume") from exc
        self.replaced += 1
        log.warning("a dedup holder was lost; a new one reads its logs back and is sent again the calls since",
                    holder=p, replaced=self.replaced, calls=len(self._since[p]), error=str(exc)[:200])
        lost = self._holders[p]
        lost.close()
        calls = [(opener, tuple(args)) for (opener, _), args in self._opened[p].items()]
        calls += self._since[p] if method in CHANGING else [*self._since[p], (method, args)]
        try:
            new = self._holders[p] = self._make(p, lost)  # (an actor that ended as it started: a HolderLost)
            new.send("ready", ())
            self.pids[p] = new.recv()
            for m, a in calls:  # the unanswered call is the last sent to it: a changing one is in `_since` already
                new.send(m, a)
                got = new.recv()
        except HolderLost as again:
            self._failed = HolderLost(f"{again}, replacing a lost one; re-run the same command to resume")
            raise self._failed from again
        return got

    def all(self, method: str, *args: Any) -> list[Any]:
        """`method` on every holder, their answers in holder order."""
        return self.ask([(p, method, args) for p in range(self.parts)])

    def open(self, dataset: str, checkpoint_dir: Path, counts: list[int]) -> None:
        """Open the dataset's index in every holder, each from its log at the checkpoint's count."""
        layout = CheckpointLayout(checkpoint_dir)
        self.ask([(p, "open", (dataset, str(layout.dedup_log(dataset, p, self.parts)), counts[p]))
                  for p in range(self.parts)])

    def open_near(self, dataset: str, log_path: Path, nbytes: int, near: NearDedupSettings) -> None:
        """Open the dataset's near-dedup index in holder 0 from its log at the checkpoint's `nbytes`."""
        self.ask([(0, "open_near", (dataset, str(log_path), nbytes, near))])

    def walk(self, dataset: str, earlier: list[str], *args: Any) -> Walk:
        """`Holder.walk` on holder 0, which keeps the near-dedup indexes."""
        return self.ask([(0, "walk", (dataset, earlier, *args))])[0]

    def usage(self) -> list[dict[str, Any]]:
        """`Holder.usage` of each holder."""
        return self.all("usage")

    def close(self) -> None:
        if self.where != "inline":
            try:
                log.info("dedup holders done", usage=self.usage())
            except Exception as exc:  # a holder that died: the job is failing already
                log.warning("a dedup holder did not answer", error=str(exc)[:200])
        for h in self._holders:
            h.close()

    def __enter__(self) -> "Holders":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class Dedup(Protocol):
    """What the decider asks of exact dedup: `HeldDedup`, or a `DedupDecision` in the process (the tests')."""

    @property
    def names(self) -> list[str]: ...

    def twin_many(self, words: np.ndarray, kept: np.ndarray, order: np.ndarray | None = None) -> np.ndarray: ...

    def probe_many(self, words: np.ndarray) -> np.ndarray: ...

    def add_many(self, words: np.ndarray) -> None: ...


class HeldDedup:
    """One dataset's exact dedup over the holders, with `DedupDecision`'s array interface: the decider's rows
    split by partition, each holder's answer scattered back. `counts`: the digests each holder has been told to
    keep so far (the decider's, ahead of the checkpoint)."""

    def __init__(self, holders: Holders, dataset: str, earlier: list[str], counts: list[int]) -> None:
        self.holders, self.dataset, self.earlier, self.counts = holders, dataset, earlier, list(counts)

    @property
    def names(self) -> list[str]:
        return ["", *self.earlier]

    def _rows(self, words: np.ndarray) -> list[np.ndarray | None]:
        """Each holder's rows of `words` in piece order (None: all of them, one holder): one stable sort of the
        partition numbers (a radix sort of 16-bit keys), ~16 ns a row whatever the holder count (a pass per
        holder cost 8 ns a row for 2, 86 for 64)."""
        parts = self.holders.parts
        if parts == 1:
            return [None]
        part = (words[:, 0] % np.uint64(parts)).astype(np.uint16)
        return np.split(np.argsort(part, kind="stable"), np.cumsum(np.bincount(part, minlength=parts))[:-1])

    def _ask(self, method: str, words: np.ndarray, *more: np.ndarray | None) -> tuple[list, np.ndarray]:
        """`method` on each holder with its rows (and the same rows of `more`); the codes scattered back."""
        rows = [(p, r) for p, r in enumerate(self._rows(words)) if r is None or len(r)]
        answers = self.holders.ask([(p, method, (self.dataset, self.earlier, *((words, *more) if r is None else
                                                                               (words[r], *(m[r] for m in more)))))
                                    for p, r in rows])
        codes = np.empty(len(words), np.int64)
        for (_, r), got in zip(rows, answers):
            codes[slice(None) if r is None else r] = got
        return rows, codes

    def twin_many(self, words: np.ndarray, kept: np.ndarray, order: np.ndarray | None = None) -> np.ndarray:
        """`DedupDecision.twin_many`: per row the index into `names` of the dataset that kept its text, or -1;
        each holder adds its new kept rows. `order` (the worker's sort by prefix) is passed to a lone holder."""
        rows, codes = self._ask("twin_many", words, kept, *([order] if self.holders.parts == 1 else []))
        added = kept & (codes < 0)  # the new kept rows, which their holders added
        for p, r in rows:
            self.counts[p] += int(np.count_nonzero(added if r is None else added[r]))
        return codes

    def probe_many(self, words: np.ndarray) -> np.ndarray:
        """Per row the index into `names` of the dataset whose index holds it, or -1; nothing added."""
        return self._ask("probe_many", words)[1]

    def add_many(self, words: np.ndarray) -> None:
        """Keep these new digests, in order."""
        rows = [(p, words if r is None else words[r]) for p, r in enumerate(self._rows(words))]
        rows = [(p, w) for p, w in rows if len(w)]
        self.holders.ask([(p, "add_many", (self.dataset, w)) for p, w in rows])
        for p, w in rows:
            self.counts[p] += len(w)

    def flush(self) -> None:
        """Every holder's log holds at least what it has been told to keep (before a checkpoint)."""
        self.holders.all("flush", self.dataset)


def partitions(checkpoint_dir: Path, wanted: int, started: bool) -> int:
    """The run's holder count: the one it started with (`dedup_holders.json`), or `wanted` for a new run (1 for 0,
    held in the job's process, and for a run that an earlier streamprep started: its one log per dataset)."""
    path = CheckpointLayout(checkpoint_dir).dedup_holders
    saved = read_json(path)
    if isinstance(saved, dict) and isinstance(saved.get("holders"), int) and saved["holders"] >= 1:
        if saved["holders"] != max(1, wanted):
            log.info("dedup holders kept as this run started", holders=saved["holders"], configured=wanted)
        return saved["holders"]
    parts = 1 if started else max(1, wanted)
    atomic.write_json(path, {"holders": parts})
    return parts


def start(execution: ExecutionConfig, checkpoint_dir: Path, started: bool, holding: bool = True,
          stop_asked: threading.Event | None = None) -> Holders:
    """The job's holders: `execution.dedup_holders` of them (unset: one beside two workers or more, or in the
    job's process for one; 0: in the job's process), Ray actors with `ray_address`. Without exact dedup or
    near-dedup (`holding` False) they would hold nothing: none is started, whatever the count."""
    wanted = execution.dedup_holders if holding else 0
    if wanted is None:
        wanted = 1 if execution.ray_address or resolved_workers(execution.workers) > 1 else 0
    parts = partitions(checkpoint_dir, wanted, started)
    where = "inline" if wanted == 0 else "ray" if execution.ray_address else "process"
    if where == "ray":  # attached now if the engine's thread has not yet (engine: xenna attaches there)
        ray_cluster.connect(execution.ray_address, resolved_workers(execution.workers))
    return Holders(parts, where, stop_asked)
