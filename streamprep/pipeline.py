"""The whole job: ingest + QC → tokenizer → tokenize stage → exports → audit, resumable at every step.

`run_from_dict` / `run_config_file` are the Python API; the CLI is a thin layer over them.
"""
from __future__ import annotations

import asyncio
import os
import platform
import signal
import time
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable

from streamprep import __version__, atomic, config as configmod, logs
from streamprep.checkpoints import DatasetFiles
from streamprep.config import ConfigError
from streamprep.ingest import IngestContext, completed_parts, ingest_all
from streamprep.lock import RunLock, RunLocked
from streamprep.shards import make_task, read_receipt, receipt_problem, token_dtype

log = logs.get("pipeline")
VERSIONED = ("tokenizers", "pyarrow", "datasets", "huggingface_hub", "numpy", "ray", "cosmos-xenna", "langdetect",
             "pycld2")


class Interrupted(RuntimeError):
    """The run was stopped by a signal after saving its progress; re-running the command resumes it."""


@dataclass
class RunResult:
    run_dir: Path
    status: str
    summary: dict[str, Any] = field(default_factory=dict)


def _versions() -> dict[str, str]:
    out = {"streamprep": __version__, "python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "absent"
    return out


class Signals:
    """First SIGINT/SIGTERM asks the job to stop cleanly; a second one exits at once (writes are atomic)."""

    def __init__(self) -> None:
        self.count = 0
        self.on_first: Callable[[], None] | None = None
        self._old: dict[int, Any] = {}

    def handle(self, signum: int, _frame: Any = None) -> None:
        self.count += 1
        if self.count > 1:
            os.write(2, b"streamprep: second signal, exiting now; re-run the same command to resume\n")
            os._exit(1)
        log.warning("signal received: saving progress and stopping", signal=signal.Signals(signum).name)
        if self.on_first is not None:
            self.on_first()
        else:
            raise KeyboardInterrupt

    def install(self) -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self.handle)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)


def resolve_run_dir(cfg: dict[str, Any], run_dir: str | Path | None) -> Path:
    return Path(run_dir).resolve() if run_dir else (Path("runs") / cfg["run"]["name"]).resolve()


def _preflight(cfg: dict[str, Any], run_dir: Path, fresh: bool) -> dict[str, Any] | None:
    """Refusals that must happen before anything is written. Returns the previous run.json, if any."""
    if fresh and run_dir.exists() and any(run_dir.iterdir()):
        raise ConfigError(f"--fresh: run dir {run_dir} is not empty (choose a new --run-dir or remove it)")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run dir {run_dir} is not a directory")
    run_json = run_dir / "run.json"
    if not run_json.exists():
        return None
    previous = atomic.read_json(run_json)
    changed = configmod.drift_keys(previous["config"], cfg)
    if changed:
        shown = ", ".join(changed[:8]) + (f" (+{len(changed) - 8} more)" if len(changed) > 8 else "")
        raise ConfigError(f"config changed since this run started ({shown}); resuming would mix outputs — "
                          f"use a new --run-dir (with --fresh) to start over")
    return previous


def run_from_dict(raw: dict[str, Any], run_dir: str | Path | None = None, fresh: bool = False,
                  base_dir: str | Path = ".", console_log: bool = True) -> RunResult:
    """Validate `raw` (the YAML structure as a dict; relative paths against `base_dir`) and run the job."""
    return run(configmod.validate(raw, base_dir), run_dir, fresh, console_log)


def run_config_file(path: str | Path, run_dir: str | Path | None = None, fresh: bool = False,
                    console_log: bool = True) -> RunResult:
    return run(configmod.load_file(path), run_dir, fresh, console_log)


def run(cfg: dict[str, Any], run_dir: str | Path | None = None, fresh: bool = False,
        console_log: bool = True) -> RunResult:
    run_dir = resolve_run_dir(cfg, run_dir)
    previous = _preflight(cfg, run_dir, fresh)
    try:
        lock = RunLock(run_dir).acquire()
    except RunLocked as exc:
        raise ConfigError(str(exc)) from None
    try:
        logs.configure(run_dir, console=console_log)
        if lock.taken_over:
            log.warning("took over a stale lock from a process that is gone", previous=lock.taken_over)
        return Job(cfg, run_dir, previous, console_log).run()
    finally:
        lock.release()


class Job:
    def __init__(self, cfg: dict[str, Any], run_dir: Path, previous: dict[str, Any] | None, console_log: bool = True):
        self.cfg, self.run_dir = cfg, run_dir
        self.checkpoint_dir = Path(cfg["run"]["checkpoint_dir"] or run_dir / "checkpoints")
        self.record = previous or {"run_id": uuid.uuid4().hex[:12], "created_at": time.time()}
        self.record.update({"config": cfg, "config_hash": configmod.config_hash(cfg), "versions": _versions(),
                            "checkpoint_dir": str(self.checkpoint_dir)})
        self.timings: dict[str, float] = dict(self.record.get("timings") or {})  # summed over resumed attempts
        self.signals = Signals()
        self.progress: dict[str, Any] = {}  # dataset -> live IngestState, read by the progress reporter
        from streamprep.progress import ProgressReporter

        self.reporter = ProgressReporter(self.progress, cfg["execution"]["progress_interval_s"],
                                         tty=None if console_log else False, datasets=cfg["datasets"], run_dir=run_dir)

    def _save_record(self, status: str, **extra: Any) -> None:
        self.record.update(status=status, updated_at=time.time(), timings=self.timings, **extra)
        atomic.write_json(self.run_dir / "run.json", self.record)

    def _timed(self, name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.monotonic()
        try:
            return fn()
        finally:
            self.timings[name] = round(self.timings.get(name, 0.0) + time.monotonic() - t0, 3)

    def run(self) -> RunResult:
        if self.record.get("status") == "complete" and self._still_complete():
            log.info("run already complete; nothing to do", run_dir=str(self.run_dir))
            return RunResult(self.run_dir, "complete", self.record.get("summary", {}))
        orphans = atomic.sweep_tmp(self.run_dir)
        if self.checkpoint_dir.exists() and not self.checkpoint_dir.is_relative_to(self.run_dir):
            orphans += atomic.sweep_tmp(self.checkpoint_dir)
        if orphans:
            log.info("removed temporary files of an interrupted run", count=len(orphans))
        self._save_record("running", started_at=time.time())
        self.signals.install()
        try:  # our handlers stay installed until the audit is written (a late signal is handled too)
            try:
                with self.reporter.in_thread():
                    states = self._timed("ingest", self._ingest)
                    info = self._timed("tokenizer", lambda: self._tokenizer(states))
                    tasks = self._plan(states, info)
                    results = self._timed("tokenize", lambda: self._tokenize(tasks))
                summary = self._timed("exports", lambda: self._exports(tasks, states, info))
                summary["tokenize"] = results
            except (KeyboardInterrupt, Interrupted):
                self._save_record("interrupted")
                raise Interrupted(f"interrupted; progress saved in {self.run_dir} — "
                                  f"re-run the same command to resume") from None
            except BaseException as exc:
                self._save_record("failed", error=f"{type(exc).__name__}: {exc}"[:500])
                raise
            self._save_record("complete", finished_at=time.time(), summary=summary)
            from streamprep.audit import write_audit

            write_audit(self.run_dir)  # after run.json is final: the audit reports its timings
        finally:
            self.signals.restore()
        log.info("run complete", run_dir=str(self.run_dir), **{k: v for k, v in summary.items() if k != "tokenize"})
        return RunResult(self.run_dir, "complete", summary)

    # -- stages ------------------------------------------------------------------------------
    def _ingest(self) -> dict[str, Any]:
        async def main() -> dict[str, Any]:
            ctx = IngestContext(self.cfg, self.run_dir, self.checkpoint_dir, asyncio.Event(), self.progress)
            loop = asyncio.get_running_loop()
            self.signals.on_first = lambda: loop.call_soon_threadsafe(ctx.stop.set)
            try:
                return await ingest_all(ctx)
            finally:
                self.signals.on_first = None
                if ctx.stop.is_set():
                    raise Interrupted("stopped during ingest")

        return asyncio.run(main())

    def _files(self, name: str) -> DatasetFiles:
        return DatasetFiles(self.run_dir, self.checkpoint_dir, name)

    def _parts(self, states: dict[str, Any]) -> dict[str, list[Path]]:
        return {d["name"]: completed_parts(self._files(d["name"]), states[d["name"]]) for d in self.cfg["datasets"]}

    def _tokenizer(self, states: dict[str, Any]):
        from streamprep import tokenizer as tokmod

        parts = [p for ps in self._parts(states).values() for p in ps]
        if not parts and not self.cfg["tokenizer"]["path"]:
            raise ConfigError("no records were kept, so there is no text to train a tokenizer on "
                              "(check the quality settings or the sources)")
        return tokmod.prepare(self.cfg["tokenizer"], self.run_dir, tokmod.iter_part_texts(parts))

    def _plan(self, states: dict[str, Any], info: Any) -> list:
        dtype = token_dtype(self.cfg["output"]["dtype"], info.vocab_size)
        sft = self.cfg.get("sft")
        eod = info.eod_id if self.cfg["tokenizer"]["append_eod"] and not sft else None
        split_of = {d["name"]: d["blend_split"] for d in self.cfg["datasets"]}
        return [make_task(self.run_dir, name, split_of[name], p, info.path, info.fingerprint, eod, dtype, sft)
                for name, parts in self._parts(states).items() for p in parts]

    def _tokenize(self, tasks: list) -> dict[str, Any]:
        from streamprep.xenna import runner

        pending = [t for t in tasks if receipt_problem(t, read_receipt(t)) is not None]
        log.info("tokenization plan", shards=len(tasks), pending=len(pending), skipped=len(tasks) - len(pending))
        self.reporter.watch_receipts([t.receipt_path for t in pending], already_done=len(tasks) - len(pending))
        ex = self.cfg["execution"]
        chat = bool(self.cfg.get("sft"))
        tokenizer = str(self.run_dir / "tokenizer") if chat else str(self.run_dir / "tokenizer" / "tokenizer.json")
        if pending:
            t0 = time.monotonic()
            if ex["engine"] == "local":
                results = runner.run_local(pending, tokenizer, chat)
            else:
                workers = min(ex["workers"] or os.cpu_count() or 1, len(pending))
                results = runner.run_xenna(pending, tokenizer, workers, ex["ray_address"], chat)
            log.info("tokenization done", engine=ex["engine"], wall_seconds=round(time.monotonic() - t0, 2),
                     shard_seconds=round(sum(r.get("seconds", 0.0) for r in results), 2))
        missing = [f"{t.dataset}/{t.part}: {p}" for t in tasks if (p := receipt_problem(t, read_receipt(t), False))]
        if missing:
            raise RuntimeError(f"tokenization left {len(missing)} shard(s) incomplete: {'; '.join(missing[:5])}")
        return {"shards": len(tasks), "tokenized": len(pending), "skipped": len(tasks) - len(pending)}

    def _exports(self, tasks: list, states: dict[str, Any], info: Any) -> dict[str, Any]:
        from streamprep.exports import export_run

        log.info("writing exports", shards=len(tasks))
        return {"kept": {n: s.kept for n, s in states.items()}, "rejected": {n: s.rejected for n, s in states.items()},
                **export_run(self.run_dir, self.cfg, tasks, info.to_json())}

    def _still_complete(self) -> bool:
        """A finished run re-run: cheap check that its shard files are all still there at their sizes."""
        receipts = list((self.run_dir / "receipts").rglob("*.json"))
        for r in receipts:
            rec = atomic.read_json(r)
            for entry in rec.get("files", {}).values():
                p = self.run_dir / entry["path"]
                if not p.is_file() or p.stat().st_size != entry["bytes"]:
                    log.warning("finished run has a missing or changed shard; redoing what is needed", file=entry["path"])
                    return False
        return (self.run_dir / "manifest.json").is_file() and (
            bool(self.cfg.get("sft")) or (self.run_dir / "blend.json").is_file())
