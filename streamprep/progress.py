"""Live progress of a run: a `rich` display on a TTY, one structured log line per interval otherwise.

The reporter only reads: the live `progress` dict (dataset -> IngestState, mutated in place by the
ingest writer on the same event loop; its bytes written are `IngestState.ingest_bytes`, as `status` counts them)
and the source file sizes (when the dataset configs are given: a byte-based ETA for local files).

    reporter = ProgressReporter(ctx.progress, config.execution.progress_interval_s,
                                datasets=config.datasets)
    task = asyncio.create_task(reporter.run())
    ...                                   # ingest
    task.cancel(); await asyncio.gather(task, return_exceptions=True)
    with reporter.in_thread():            # or shown by a thread while the job runs synchronously
        reporter.watch_shards(lambda: (feeder.sealed, engine.completed))   # tokenization during ingest
    print(reporter.final_line())
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

from streamprep import logs
from streamprep.sources.local import expand

if TYPE_CHECKING:
    from streamprep.config import DatasetConfig

log = logs.get("progress")
WINDOW_S = 15.0        # rates and ETAs use the last WINDOW_S seconds
TTY_REFRESH_S = 0.5


def _local_sizes(ds: DatasetConfig) -> list[int] | None:
    """Sizes of a local dataset's files in read order, or None (remote, or not listable)."""
    path = ds.path
    if "://" in path:
        return None
    try:
        return [Path(p).stat().st_size for p in expand(path)]
    except Exception:  # progress is best effort: no total means no byte-based ETA
        return None


class _Track:
    """What the reporter remembers about one dataset between ticks."""

    def __init__(self, now: float):
        self.first_t = now
        self.first_read: int | None = None
        self.samples: deque[tuple[float, int, float]] = deque()   # (t, consumed, fraction or -1)
        self.sizes: list[int] | None = None
        self.sizes_known = False
        self.done_rate: float | None = None   # a finished dataset shows its average rate, frozen


class ProgressFigures:
    """The data side: reads the live state and turns it into figures (`snapshot`); shows nothing."""

    def __init__(self, progress: dict[str, Any], *, datasets: Sequence[DatasetConfig] = ()):
        self.progress = progress
        self.datasets = {d.name: d for d in datasets}
        self.started = time.monotonic()
        self._tracks: dict[str, _Track] = {}
        self._shard_counts: Callable[[], tuple[int, int]] | None = None
        self.phase = "ingest"  # the job moves it on ("tokenize": waiting for the last shards)
        self._shard_samples: deque[tuple[float, int]] = deque()

    # ---- inputs --------------------------------------------------------------------------------------
    def watch_shards(self, counts: Callable[[], tuple[int, int]]) -> None:
        """Tokenization, live during ingest: `counts()` gives (parts sealed, shards tokenized) so far;
        called on every tick from the reporter's thread, so it must be cheap and thread-safe."""
        self._shard_counts = counts

    # ---- figures -------------------------------------------------------------------------------------
    def _fraction(self, name: str, st: Any, track: _Track) -> float | None:
        if st.done:
            return 1.0
        ds = self.datasets.get(name)
        fracs = []
        if ds is not None and ds.max_records:
            fracs.append(st.consumed / ds.max_records)
        if ds is not None and ds.size_mb:
            fracs.append(st.kept_text_bytes / (ds.size_mb * 1024 * 1024))
        if ds is not None and not track.sizes_known:
            track.sizes, track.sizes_known = _local_sizes(ds), True
        total = sum(track.sizes) if track.sizes else 0
        if total:
            pos = st.position or {}
            i = int(pos.get("file", 0))
            done = sum(track.sizes[:i])
            off = pos.get("offset")
            if isinstance(off, int) and i < len(track.sizes):
                done += min(off, track.sizes[i])
            fracs.append(done / total)
        return min(max(fracs), 1.0) if fracs else None

    def snapshot(self) -> dict[str, Any]:
        """The figures shown right now: per dataset and totals (also what the plain log line carries)."""
        now = time.monotonic()
        rows = {name: self._dataset_row(name, st, now) for name, st in self._states()}
        for name in self.datasets:
            rows.setdefault(name, {"read": 0, "kept": 0, "rejected": 0, "mb": 0.0, "rec_s": None, "fraction": None,
                                   "eta_s": None, "done": False, "waiting": True})
        out = {"phase": self.phase, "elapsed_s": round(now - self.started, 1), "datasets": rows,
               "totals": _totals(rows)}
        shards = self._shard_figures(now)
        if shards is not None:
            out["shards"] = shards
        return out

    def _states(self) -> list[tuple[str, Any]]:
        for _ in range(3):  # the dict may grow while another thread iterates it
            try:
                return list(self.progress.items())
            except RuntimeError:
                continue
        return []

    def _dataset_row(self, name: str, st: Any, now: float) -> dict[str, Any]:
        """One dataset's figures; its rate and ETA over the last WINDOW_S seconds (frozen once done)."""
        track = self._tracks.get(name)
        if track is None:
            track = self._tracks[name] = _Track(now)
            track.first_read = int(st.consumed)
        frac = self._fraction(name, st, track)
        track.samples.append((now, int(st.consumed), -1.0 if frac is None else frac))
        while len(track.samples) > 2 and now - track.samples[0][0] > WINDOW_S:
            track.samples.popleft()
        t0, c0, f0 = track.samples[0]
        dt = now - t0
        rate = (st.consumed - c0) / dt if dt >= 0.5 else None
        eta = None
        if st.done:
            if track.done_rate is None:
                span = now - track.first_t
                track.done_rate = (st.consumed - (track.first_read or 0)) / span if span >= 0.5 else 0.0
            rate = track.done_rate or None
            eta = 0.0
        elif frac is not None and f0 >= 0 and dt >= 0.5 and frac > f0:
            eta = (1.0 - frac) / ((frac - f0) / dt)
        return {"read": int(st.consumed), "kept": int(st.kept), "rejected": int(st.rejected),
                "mb": round(st.ingest_bytes() / 1e6, 2), "rec_s": _r(rate),
                "fraction": None if frac is None else round(frac, 4), "eta_s": _r(eta), "done": bool(st.done)}

    def _shard_figures(self, now: float) -> dict[str, Any] | None:
        """Tokenization during ingest (sealed / done / pending, rate, ETA), or None before a part is sealed."""
        sealed, done = self._shard_counts() if self._shard_counts is not None else (0, 0)
        if sealed <= 0:
            return None
        self._shard_samples.append((now, done))
        while len(self._shard_samples) > 2 and now - self._shard_samples[0][0] > WINDOW_S:
            self._shard_samples.popleft()
        t0, d0 = self._shard_samples[0]
        rate = (done - d0) / (now - t0) if now - t0 >= 0.5 else None
        pending = max(sealed - done, 0)
        eta = 0.0 if not pending else (pending / rate if rate else None)
        return {"sealed": sealed, "done": done, "pending": pending, "per_s": _r(rate), "eta_s": _r(eta)}


class ProgressReporter(ProgressFigures):
    """The display side: a rich table on a TTY, a structured log line per interval otherwise."""

    def __init__(self, progress: dict[str, Any], interval_s: float, tty: bool | None = None, *,
                 datasets: Sequence[DatasetConfig] = (), console: Any = None, refresh_s: float = TTY_REFRESH_S):
        super().__init__(progress, datasets=datasets)
        self.interval_s = max(float(interval_s), 0.05)
        self.console = console
        if tty is None:
            tty = console.is_terminal if console is not None else sys.stderr.isatty()
        self.tty = bool(tty)
        self.refresh_s = refresh_s

    # ---- output --------------------------------------------------------------------------------------
    def log_line(self) -> dict[str, Any]:
        """Emit one plain structured progress line (what non-TTY runs get every interval)."""
        snap = self.snapshot()
        t = snap["totals"]
        fields: dict[str, Any] = {"phase": snap["phase"], "read": t["read"], "kept": t["kept"], "rejected": t["rejected"],
                                  "mb_written": t["mb"], "rec_s": t["rec_s"], "eta_s": t["eta_s"],
                                  "datasets": {n: {k: v for k, v in r.items() if k not in ("waiting",)}
                                               for n, r in snap["datasets"].items()}}
        if "shards" in snap:
            s = snap["shards"]
            fields.update(shards_sealed=s["sealed"], shards_done=s["done"], shards_pending=s["pending"],
                          shards_eta_s=s["eta_s"])
        log.info("progress", **fields)
        return fields

    def render(self) -> Any:
        """The rich renderable for the TTY display."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        snap = self.snapshot()
        table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left",
                      title=f"streamprep {snap['phase']} · {_dur(snap['elapsed_s'])}")
        for col, just in (("dataset", "left"), ("read", "right"), ("kept", "right"), ("rejected", "right"),
                          ("MB out", "right"), ("rec/s", "right"), ("progress", "left"), ("ETA", "right")):
            # the bar's column alone may narrow (rich narrows the columns that wrap first): `_Bar` draws it shorter
            table.add_column(col, justify=just, no_wrap=col != "progress")
        rows = list(snap["datasets"].items())
        for name, r in rows:
            table.add_row(name, f"{r['read']:,}", f"{r['kept']:,}", f"{r['rejected']:,}", f"{r['mb']:.1f}",
                          _num(r["rec_s"]), _Bar(r["fraction"], r["done"], r.get("waiting", False)), _dur(r["eta_s"]))
        if len(rows) > 1:
            t = snap["totals"]
            table.add_row(Text("total", style="bold"), f"{t['read']:,}", f"{t['kept']:,}", f"{t['rejected']:,}",
                          f"{t['mb']:.1f}", _num(t["rec_s"]), "", _dur(t["eta_s"]))
        parts: list[Any] = [table]
        if "shards" in snap:
            s = snap["shards"]
            frac = s["done"] / s["sealed"] if s["sealed"] else None
            parts.append(Text(f"tokenize  {s['done']:,}/{s['sealed']:,} sealed parts · {s['pending']:,} pending  "
                              f"{_bar(frac, False)}  ETA {_dur(s['eta_s'])}"))
        return Group(*parts)

    def final_line(self) -> str:
        """One line for the end of a phase or run: totals, MB written, overall rate, shards."""
        snap = self.snapshot()
        t = snap["totals"]
        elapsed = max(time.monotonic() - self.started, 1e-9)
        new = sum(r["read"] - (self._tracks[n].first_read or 0) for n, r in snap["datasets"].items()
                  if n in self._tracks)
        line = (f"ingest: {len(snap['datasets'])} dataset(s) · read {t['read']:,} · kept {t['kept']:,} · rejected "
                f"{t['rejected']:,} · {t['mb']:.1f} MB written · {new / elapsed:,.0f} rec/s over {_dur(elapsed)}")
        if "shards" in snap:
            line += f"; tokenize: {snap['shards']['done']:,}/{snap['shards']['sealed']:,} shards"
        return line

    # ---- running ------------------------------------------------------------------------------------
    async def run(self) -> None:
        """Show progress until cancelled (cancel the task to stop; the display is closed cleanly)."""
        if self.tty:
            await self._run_live()
        else:
            await self._run_plain()

    async def _run_plain(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.log_line()

    async def _run_live(self) -> None:
        from rich.console import Console
        from rich.live import Live

        console = self.console or Console(file=sys.stderr)
        redirect = console.file is sys.stderr
        live = Live(self.render(), console=console, auto_refresh=False, transient=False,
                    redirect_stdout=False, redirect_stderr=redirect)
        swapped: list[tuple[logging.StreamHandler, Any]] = []
        original = sys.stderr
        with live:
            if redirect and sys.stderr is not original:  # console log lines go above the display, not through it
                for h in logging.getLogger("streamprep").handlers:
                    if type(h) is logging.StreamHandler and h.stream in (original, sys.__stderr__):
                        swapped.append((h, h.setStream(sys.stderr)))
            try:
                while True:
                    live.update(self.render(), refresh=True)
                    await asyncio.sleep(self.refresh_s)
            finally:
                with contextlib.suppress(Exception):
                    live.update(self.render(), refresh=True)
                for h, old in swapped:
                    h.setStream(old)

    @contextlib.contextmanager
    def in_thread(self) -> Iterator["ProgressReporter"]:
        """Run the reporter in a background thread (own event loop) while a synchronous phase runs."""
        ready = threading.Event()
        holder: dict[str, Any] = {}

        def main() -> None:
            async def runner() -> None:
                holder["loop"], holder["task"] = asyncio.get_running_loop(), asyncio.current_task()
                ready.set()
                with contextlib.suppress(asyncio.CancelledError):
                    await self.run()

            asyncio.run(runner())

        t = threading.Thread(target=main, name="progress", daemon=True)
        t.start()
        ready.wait(5)
        try:
            yield self
        finally:
            if "loop" in holder:
                holder["loop"].call_soon_threadsafe(holder["task"].cancel)
            t.join(5)


def _totals(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Sums over the datasets; the rate of those still running; an ETA only when every dataset has one."""
    totals: dict[str, Any] = {k: sum(r[k] for r in rows.values()) for k in ("read", "kept", "rejected")}
    totals["mb"] = round(sum(r["mb"] for r in rows.values()), 2)
    active = [r for r in rows.values() if not r["done"]] or list(rows.values())
    rates = [r["rec_s"] for r in active if r["rec_s"] is not None]
    totals["rec_s"] = _r(sum(rates)) if rates else None
    etas = [r["eta_s"] for r in rows.values()]
    totals["eta_s"] = _r(max(etas)) if rows and all(e is not None for e in etas) else None
    return totals


def _r(v: float | None) -> float | None:
    return None if v is None else round(v, 1)


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:,.0f}"


def _dur(s: float | None) -> str:
    if s is None:
        return "–"
    s = int(round(s))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class _Bar:
    """A dataset's progress bar, drawn as wide as its column is, at most `BAR_WIDTH`: at 80 columns, with figures in
    millions, the table kept the bar whole and cut every figure to an ellipsis (`12,345,…`, `2500…`, `E…`)."""

    def __init__(self, frac: float | None, done: bool, waiting: bool):
        self.frac, self.done, self.waiting = frac, done, waiting

    def __rich_measure__(self, console: Any, options: Any) -> Any:
        from rich.measure import Measurement

        return Measurement(len(_bar(self.frac, self.done, self.waiting, 0)),
                           len(_bar(self.frac, self.done, self.waiting)))

    def __rich_console__(self, console: Any, options: Any) -> Any:
        from rich.text import Text

        tail = len(_bar(self.frac, self.done, self.waiting, 0))  # " 50%" / " done" after the bar
        yield Text(_bar(self.frac, self.done, self.waiting, max(min(BAR_WIDTH, options.max_width - tail), 0)).strip(),
                   no_wrap=True, overflow="crop")


BAR_WIDTH = 20


def _bar(frac: float | None, done: bool, waiting: bool = False, width: int = BAR_WIDTH) -> str:
    if waiting:
        return "waiting"
    if done:
        return "█" * width + " done"
    if frac is None:
        return "running"
    n = int(round(frac * width))
    return "█" * n + "░" * (width - n) + f" {100 * frac:3.0f}%"
