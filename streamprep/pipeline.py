"""The whole job: ingest + QC → tokenizer → tokenize stage → exports → audit, resumable at every step.

`run_from_dict` / `run_config_file` are the Python API; the CLI is a thin layer over them.
"""
from __future__ import annotations

import ast
import asyncio
import functools
import multiprocessing
import multiprocessing.spawn
import os
import platform
import shutil
import signal
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import Future
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from streamprep import atomic, config as configmod, logs, version
from streamprep.version import __version__
from streamprep import audit, backends, engines, metrics, registry, tokenizer as tokmod
from streamprep.checkpoints import DatasetFiles, IngestState, claim, claimed_from, foreign_checkpoints, owner_of
from streamprep.config import Config, ConfigError, printable
from streamprep.engines import Engine
from streamprep.executor import Executor
from streamprep.exports import chain, export_run
from streamprep.feeder import ShardFeeder, Wait
from streamprep.ingest import IngestContext, completed_parts, ingest_all, worker_executor
from streamprep.layout import (AUDIT, BINIDX, INGEST, LOGS, PARQUET, RECEIPTS, REJECTS, SFT, TOKENIZER, Checkpoint,
                               CheckpointLayout, RunLayout, needs_change, part_index_of, part_name, read_json)
from streamprep.lock import RunLock, RunLocked
from streamprep.modes import mode_of
from streamprep.progress import ProgressReporter
from streamprep.unit_worker import late_gates
from streamprep.sources.base import error_text, one_line
from streamprep.sources.hf import set_retry_policy
from streamprep.sources.local import reaches_into
from streamprep.tokenize import ShardTask, make_task, read_receipt, receipt_problem, token_dtype
from streamprep.tokenizer import TokenizerInfo

log = logs.get("pipeline")
VERSIONED = ("tokenizers", "gigatoken", "awkward", "pyarrow", "datasets", "huggingface_hub", "numpy", "ray",
             "cosmos-xenna", "langdetect", "pycld2")


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal after saving its progress; re-running the command resumes it. A
    KeyboardInterrupt, as a Ctrl-C is to any Python code: a caller's `except Exception` does not swallow it."""


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


# Where an exception raised by a signal handler can leave a lock held for good: the import machinery. A weakref
# callback of its module locks takes the global import lock, and an exception there is printed and dropped.
IMPORT_MACHINERY = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")
STOP_RETRY_S = 0.01  # how soon a stop deferred out of the import machinery is tried again
SAME_STOP_S = 1.0  # the same signal again this soon after the first is its copy to the process group (GNU `timeout`)


class Signals:
    """First SIGINT/SIGTERM asks the job to stop cleanly; a second one exits at once (writes are atomic). The same
    signal again within SAME_STOP_S of the first is the same stop: GNU `timeout` (`-s INT` too) sends its signal to
    the job's process, then to its whole process group, and the copy made the job exit at once, its progress not
    saved (a terminal's Ctrl-C reaches the job once: a second press a second later still exits at once)."""

    def __init__(self, fresh: bool = False) -> None:
        # written with os.write, past cli.said_to: under `ingest --fresh` the same command is refused (the run dir
        # is not empty), and leaving --fresh out resumes
        resume = "re-run the command without --fresh" if fresh else "re-run the same command"
        self._second = f"streamprep: second signal, exiting now; {resume} to resume\n".encode()
        self.count = 0
        self.on_first: Callable[[], None] | None = None
        self.asked = threading.Event()  # set at the first: the executor replaces no pool its workers' end broke
        self._first: tuple[int, float] | None = None  # the first signal and when it came
        self._old: dict[int, Any] = {}

    def handle(self, signum: int, frame: Any = None) -> None:
        if self._first is not None and self._first[0] == signum and time.monotonic() - self._first[1] < SAME_STOP_S:
            return
        self.count += 1
        self._first = self._first or (signum, time.monotonic())
        if self.count > 1:
            os.write(2, self._second)
            os._exit(1)
        log.warning("signal received: saving progress and stopping", signal=signal.Signals(signum).name)
        self.asked.set()
        if self.on_first is not None:
            self.on_first()
        else:
            self._interrupt(frame)

    def _interrupt(self, frame: Any) -> None:
        """Raise KeyboardInterrupt where the main thread was stopped, unless it was inside the import machinery:
        then again STOP_RETRY_S later (SIGALRM), until it is out. Regression: a SIGINT during the exports with
        `workers: 1` hung the job, 1 run in ~150: raised in that callback, the interrupt was dropped with the
        import lock held, and the worker thread's next import waited for it for ever."""
        if any(f.f_code.co_filename in IMPORT_MACHINERY for f, _ in traceback.walk_stack(frame)):
            if signal.SIGALRM not in self._old:
                self._old[signal.SIGALRM] = signal.signal(signal.SIGALRM, lambda _s, f: self._interrupt(f))
            signal.setitimer(signal.ITIMER_REAL, STOP_RETRY_S)
            return
        raise KeyboardInterrupt

    def install(self) -> None:
        """Only the main thread may; a job run from another thread (`run_from_dict` in a worker thread of an
        application) leaves the signals to the application, whose Ctrl-C stops the process as it would."""
        if threading.current_thread() is not threading.main_thread():
            log.info("not in the main thread: signals are left to the application")
            return
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self.handle)

    def restore(self) -> None:
        if signal.SIGALRM in self._old:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for s, h in self._old.items():
            signal.signal(s, h)


def resolve_run_dir(config: Config, run_dir: str | Path | None) -> Path:
    if run_dir and "://" in str(run_dir):  # Path() would make `s3://b/out` a local folder `s3:/b/out`
        raise ConfigError(f"run dir {str(run_dir)!r:.80} must be a local (or mounted) folder: its files are renamed "
                          f"into place atomically")
    path = Path(run_dir) if run_dir else Path("runs") / config.run.name
    try:
        resolved = path.expanduser().resolve()  # as the config's paths are: no shell expands `--run-dir=~/x`'s `~`
    except (OSError, RuntimeError, ValueError) as exc:  # RuntimeError: a symlink loop (Python 3.11), `~nosuchuser/…`;
        raise ConfigError(f"run dir {configmod.printable(str(path))}: {exc}") from None  # ValueError: a NUL
    configmod.check_utf8_name("run dir", resolved, "run.json names it")  # the working directory's name too
    return resolved


def _check_writable_dir(path: Path, what: str) -> None:
    """`path` is, or can be created as, a directory we can write: its nearest existing ancestor must be a
    writable directory (not a regular file, not a read-only location)."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{what} {path}: {existing} is not a directory")
    if (lacks := _lacks(existing, os.R_OK | os.W_OK | os.X_OK if existing == path else os.W_OK | os.X_OK)):
        raise ConfigError(f"{what} {path}: {existing} is not {_words(lacks, 'or')}; make it {_words(lacks, 'and')} "
                          f"and re-run")


def _lacks(folder: Path, need: int) -> list[str]:
    """What of `need` (os.R_OK, W_OK, X_OK) this process may not do in `folder`, in words: a folder it may not list
    or enter (`chmod 000`) was called one to make writable, and made so it still failed, on reading it."""
    return [word for bit, word in ((os.R_OK, "readable"), (os.W_OK, "writable"), (os.X_OK, "searchable"))
            if need & bit and not os.access(folder, bit)]


def _words(words: list[str], conjunction: str) -> str:
    """"a", "a or b", "a, b or c"."""
    return f" {conjunction} ".join([", ".join(words[:-1]), words[-1]] if len(words) > 1 else words)


def _check_written_folders(config: Config, run_dir: Path, finished: bool = False) -> None:
    """Each folder a resume writes in, where it exists, must be writable: a read-only one (`ingest/<ds>`,
    `checkpoints/`) failed with a raw PermissionError naming a temporary file, at every re-run. Only the job's own
    folders: not what else a user keeps in a `run.checkpoint_dir` of theirs, nor Megatron's index cache in binidx/.
    `finished` (run.json says complete): only those a re-run that finds it still complete writes in, its log and
    its checkpoint dir's lock (a finished run whose outputs were made read-only was refused, where it writes
    nothing in them); `Job.run` checks the rest once the run has something to redo."""
    layout, ckpt = RunLayout(run_dir), Path(_checkpoint_dir(config, run_dir))
    names = [d.name for d in config.datasets]
    own = [*(run_dir / n for n in (INGEST, REJECTS, RECEIPTS, TOKENIZER, BINIDX, SFT, PARQUET, AUDIT, LOGS)),
           layout.exports_scratch, *(layout.exports_scratch / n for n in names),
           *(p for n in names for p in (layout.ingest_dir(n), *layout.tokenized_dirs(n)))]
    kept = [ckpt, ckpt / "stage", *(CheckpointLayout(ckpt).stage(n) for n in names)]
    if finished:
        own, kept = [layout.logs_dir], [ckpt]
    checks = [(run_dir, "run dir", own), (ckpt, "'run.checkpoint_dir'", kept)] if config.run.checkpoint_dir \
        else [(run_dir, "run dir", own + kept)]
    for root, what, folders in checks:
        for folder in folders:
            if folder.is_dir() and not folder.is_symlink() and (
                    lacks := _lacks(folder, os.R_OK | os.W_OK | os.X_OK)):
                raise ConfigError(f"{what} {root}: {folder} is not {_words(lacks, 'or')}; make it "
                                  f"{_words(lacks, 'and')} and re-run")


PID_WIDEST = "4194304"  # Linux's highest pid_max: the widest process number a temporary name ends with


def _widest_paths(run_dir: Path, checkpoint_dir: Path, dataset: str) -> list[Path]:
    """The longest paths the run writes for `dataset`, its part, unit and holder numbers at their widest, as
    temporary names (`atomic.tmp_path`, any process's)."""
    layout, ck, part = RunLayout(run_dir), CheckpointLayout(checkpoint_dir), part_name(99999)
    files = [layout.binidx_prefix(dataset, part).with_suffix(".idx"),
             layout.sft_prefix(dataset, part).with_suffix(".idx"), layout.part_columns(dataset, part),
             layout.receipt(dataset, part), layout.ingest_part(dataset, 99999), layout.rejects(dataset),
             ck.stage(dataset) / "u9999999-9999999.kept.off", ck.dedup_log(dataset, 4095, 4096),
             ck.checkpoint(dataset), ck.inputs(dataset), ck.plan(dataset), layout.tokenizer_backend_fallback]
    return [p.with_name(f".{p.name}{atomic.TMP_MARK}{PID_WIDEST}") for p in files]


def _check_path_lengths(config: Config, run_dir: Path, checkpoint_dir: Path) -> None:
    """Refuse a run dir (or checkpoint dir) so deep, or a dataset name so long, that a file the run writes would have
    a path longer than the file system takes (PATH_MAX) or a name longer (NAME_MAX): "OSError: [Errno 36] File name
    too long" ended the job after run.json, checkpoints/ and tokenizer/ were written, and every re-run the same."""
    limits: dict[Path, tuple[int, int]] = {}
    for ds in config.datasets:
        for path in _widest_paths(run_dir, checkpoint_dir, ds.name):
            root, what = ((checkpoint_dir, "'run.checkpoint_dir'") if path.is_relative_to(checkpoint_dir)
                          else (run_dir, "run dir"))
            if root not in limits:
                existing = next(p for p in (root, *root.parents) if os.path.isdir(p))  # (False when too long)
                try:
                    limits[root] = os.pathconf(existing, "PC_PATH_MAX"), os.pathconf(existing, "PC_NAME_MAX")
                except (OSError, ValueError):  # a file system that does not say: nothing to check against
                    limits[root] = sys.maxsize, sys.maxsize
            path_max, name_max = limits[root]
            size = len(os.fsencode(path))
            long_name = next((n for n in path.parts if len(os.fsencode(n)) > name_max), None)
            if size >= path_max or long_name is not None:  # (PATH_MAX counts the terminating NUL)
                over = (f"a path of {size} bytes (at most {path_max - 1})" if long_name is None else
                        f"a name of {len(os.fsencode(long_name))} bytes (at most {name_max})")
                raise ConfigError(f"{what} {root}: too long for the files of dataset {ds.name!r}: "
                                  f"{path.relative_to(root)} there would be {over} on its file system; choose a "
                                  f"shorter {what} or dataset name")


def _start_files(run_dir: Path, checkpoint_dir: Path) -> list[Path]:
    """What a job writes at its start from its config alone, before its first record: the tokenizer's copy and the
    backend chosen for it, the holder count, the checkpoint dir's owner. No output: an attempt that failed having
    written nothing else (an hf:// split that does not exist, say) is started afresh, these removed first (the
    corrected config may name another tokenizer), and the Hub's download cache kept for it."""
    layout, ck = RunLayout(run_dir), CheckpointLayout(checkpoint_dir)
    return [layout.tokenizer_dir, layout.tokenizer_backend, layout.tokenizer_backend_fallback, ck.dedup_holders,
            ck.owner]


def _wrote_outputs(run_dir: Path, checkpoint_dir: Path, within: list[Path] | None = None) -> bool:
    """Whether a run left anything besides run.json, its logs, its locks, the Hub's download cache and its start
    files (`_start_files`): a stage's output or a dataset's checkpoint; looked for `within` these paths (files or
    folders; by default the run dir and the checkpoint dir)."""
    layout = RunLayout(run_dir)
    bookkeeping = {layout.run_json, layout.logs_dir, layout.lock, layout.hf_cache,
                   CheckpointLayout(checkpoint_dir).lock, *_start_files(run_dir, checkpoint_dir)}
    for root in (run_dir, checkpoint_dir) if within is None else within:
        files = root.rglob("*") if root.is_dir() and not root.is_symlink() else [root]
        if any(p.is_file() and not any(p == b or b in p.parents for b in bookkeeping) for p in files):
            return True
    return False


def _preflight(config: Config, run_dir: Path, fresh: bool) -> dict[str, Any] | None:
    """Refusals that must happen before anything is written. Returns the previous run.json, if any."""
    _check_path_lengths(config, run_dir, _checkpoint_dir(config, run_dir).resolve())
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run dir {run_dir} is not a directory")
    # what a job stopped before it wrote run.json left is no run yet: its command, --fresh too, starts it again
    if fresh and run_dir.exists() and any(run_dir.iterdir()) and not RunLayout(run_dir).only_a_start():
        raise ConfigError(f"--fresh: run dir {run_dir} is not empty (choose a new --run-dir or remove it; to resume "
                          f"a run there, re-run without --fresh)")
    _check_writable_dir(run_dir, "run dir")
    if config.run.checkpoint_dir:
        _check_writable_dir(Path(config.run.checkpoint_dir), "'run.checkpoint_dir'")
        ckpt, inside = Path(config.run.checkpoint_dir).resolve(), run_dir.resolve()
        if ckpt.is_relative_to(inside) and ckpt != RunLayout(run_dir).local_checkpoints.resolve():
            # its <dataset>.json met the run's own files (run.json, blend.json; tokenizer/, parquet/, ingest/)
            raise ConfigError(f"config: 'run.checkpoint_dir': {ckpt} is the run dir or a folder inside it, where the "
                              f"checkpoint files would meet the run's own; leave it unset (RUN_DIR/checkpoints) or "
                              f"choose a folder outside the run dir")
    layout, checkpoints = RunLayout(run_dir), CheckpointLayout(_checkpoint_dir(config, run_dir))
    try:
        previous = read_json(layout.run_json)
    except (OSError, ValueError):  # `_read_run_json` names it below
        previous = None
    _check_written_folders(config, run_dir, finished=isinstance(previous, dict) and previous.get("status") == "complete")
    for where, folder in (("run dir", run_dir), ("'run.checkpoint_dir'", checkpoints.checkpoint_dir.resolve())):
        inside = next((d for d in config.datasets if reaches_into(d.path, folder)), None)
        if inside is not None:  # its run.json, logs and parts would be listed as input, and changed at each resume
            raise ConfigError(f"{where} {folder} is inside dataset {inside.name}'s path {inside.path}: the job would "
                              f"read its own outputs as input; choose a {where} outside it")
    folder = next((p for p in (layout.lock, checkpoints.lock, layout.logs_dir / logs.LOG_NAME) if p.is_dir()), None)
    if folder is not None:  # opening it failed with a bare IsADirectoryError, at every re-run
        raise ConfigError(f"{folder} is a folder where the run keeps a file of its own (a lock or its log); remove it")
    run_json = layout.run_json
    if not run_json.exists():
        return _adopted(config, run_dir)
    previous = _read_run_json(run_json)
    status = previous.get("status")
    if status == "failed" and not _wrote_outputs(run_dir, Path(previous.get("checkpoint_dir") or run_dir)):
        return None   # started afresh (`_forget_failed_start`)
    changed = configmod.drift_keys(previous["config"], config.to_dict(), exports_redone=status != "complete")
    if changed:
        _refuse_optional_change(previous["config"], previous.get("optional_skipped"), config, status != "complete")
        _refuse_tokenizer_switch(previous["config"], config, changed)
        shown = ", ".join(changed[:8]) + (f" (+{len(changed) - 8} more)" if len(changed) > 8 else "")
        raise ConfigError(f"config changed since this run started ({shown}); resuming would mix outputs — "
                          f"use a new --run-dir (with --fresh) to start over")
    _refuse_moved_checkpoints(previous, _checkpoint_dir(config, run_dir))
    was, now = previous.get("plugins"), plugin_modules()  # absent: recorded by a version before plug-ins were
    # an earlier streamprep listed the imported plug-ins' modules by registry family, then gates; and a module
    # STREAMPREP_PLUGINS named twice twice, though imported once (its first mention)
    if was is not None and list(dict.fromkeys(was)) not in (now, plugin_modules(by_family=True)):
        raise ConfigError(f"plug-ins changed since this run started (was {','.join(was) or 'none'!r}, now "
                          f"{','.join(now) or 'none'!r}: the modules STREAMPREP_PLUGINS names, then those of plug-ins "
                          f"registered before the job, each in the order registered); plug-ins decide verdicts and "
                          f"bytes as the config does, their order too (which gate runs first, which of two "
                          f"registrations of a name stands): resume with the same, in the same order, or use a new "
                          f"--run-dir")
    return previous


def _refuse_optional_change(old: Mapping[str, Any], skipped: list[str] | None, config: Config,
                            exports_redone: bool) -> None:
    """An optional dataset whose input appeared or went missing since the run started changes the datasets the
    run holds (and, under `dedup_scope: run`, what the others keep): refused, as any config change, but naming
    that cause (the YAML may be byte-identical, and 'config changed (datasets)' sent the user looking there), and
    the keys that changed besides, if any (else putting the input back only led to a second refusal). `skipped`:
    the optional datasets the run started without for want of input (run.json's `optional_skipped`), so that one
    added to the YAML since is the config change it is, not an input that appeared; None (a run.json from before
    that record) cannot tell the two apart, and the line says both."""
    was = {d["name"] for d in old.get("datasets") or ()}
    now = {d.name for d in config.datasets}
    missing = {name: why for name, why in config.skipped}
    came = sorted(d.name for d in config.datasets if d.optional and d.name not in was
                  and (skipped is None or d.name in skipped))
    went = sorted(name for name in was - now if name in missing)
    if not came and not went:
        return
    then = ("but was missing when this run started" if skipped is not None else "and the dataset was not in this "
            "run when it started (its input missing then, or the dataset added to the config since)")
    what = [f"optional dataset {name}'s input is there now {then}" for name in came]
    what += [f"optional dataset {name}'s input was there when this run started and is missing now ({missing[name]})"
             for name in went]
    new = config.to_dict()
    besides = configmod.drift_keys({**old, "datasets": [d for d in old["datasets"] if d["name"] not in went]},
                                   {**new, "datasets": [d for d in new["datasets"] if d["name"] not in came]},
                                   exports_redone=exports_redone)
    also = f"; and the config changed ({', '.join(besides[:8])}{' …' * (len(besides) > 8)})" if besides else ""
    unsure = " (or the config, for a dataset added since)" * (skipped is None and bool(came))
    raise ConfigError(f"{'; '.join(what)}{also}: resuming would change the datasets this run holds — put the input "
                      f"back as it was{' and the config' * bool(besides)}{unsure}, or use a new --run-dir (with "
                      f"--fresh) to start over")


def _refuse_tokenizer_switch(old: Mapping[str, Any], config: Config, changed: list[str]) -> None:
    """With `tokenizer.if_missing: train` both times, a `tokenizer.path` that appeared since the run trained its
    tokenizer (or went since it loaded it) is resolved otherwise (config: None means train) and drifts: it was
    refused as 'config changed since this run started (tokenizer.path)', the YAML byte-identical. Refused naming
    that cause, and the keys that changed besides, if any."""
    was, now = (old.get("tokenizer") or {}), config.tokenizer
    if "tokenizer.path" not in changed or not was.get("if_missing") == now.if_missing == "train":
        return
    if was.get("path") is None and now.path is not None:
        cause, fix = (f"'tokenizer.path' {now.path} exists, and this run trained its tokenizer (tokenizer.if_missing: "
                      f"train) because the path it named when it started did not"), "remove it"
    elif isinstance(was.get("path"), str) and now.path is None and not Path(was["path"]).exists():
        cause, fix = (f"'tokenizer.path' {was['path']}, which this run loaded its tokenizer from, is missing now "
                      f"(tokenizer.if_missing: train would train another)"), "put it back"
    else:
        return
    besides = [key for key in changed if key != "tokenizer.path"]
    also = f"; and the config changed ({', '.join(besides[:8])}{' …' * (len(besides) > 8)})" if besides else ""
    raise ConfigError(f"config: {cause}{also}: {fix}{' and the config as it was' * bool(besides)} to resume, or use "
                      f"a new --run-dir (with --fresh) to start over")


def _refuse_moved_checkpoints(previous: dict[str, Any], checkpoint_dir: Path) -> None:
    """A resume whose `run.checkpoint_dir` is not where the run's checkpoints are found no checkpoint there and
    started every dataset over, removing its parts, while the checkpoints sat in the old folder. Refused when the
    folder run.json names still holds this run's checkpoints (its owner file) and the new one does not: a run dir
    copied or moved with its own checkpoints, or checkpoints moved to the new folder, go on."""
    was = previous.get("checkpoint_dir")
    run_id = previous.get("run_id")
    if not isinstance(was, str) or not run_id or Path(was).resolve() == checkpoint_dir.resolve():
        return
    if checkpoint_dir.exists() and not checkpoint_dir.is_dir():  # a file in the way: the job's mkdir names it
        return
    if owner_of(Path(was)) == run_id and owner_of(checkpoint_dir) != run_id:
        raise ConfigError(f"config: 'run.checkpoint_dir' changed since this run started: its checkpoints are in {was}, "
                          f"not {checkpoint_dir}; resume with the same run.checkpoint_dir, move them there, or use a "
                          f"new --run-dir")


def plugin_modules(by_family: bool = False) -> list[str]:
    """What run.json records of the plug-ins: the modules STREAMPREP_PLUGINS names, then the modules of the plug-ins
    the caller registered before the job (`Registry.late`, and gates), which decide verdicts and bytes as much: a
    resume without them was not refused. Both in the order they registered (`registry.registration_order`), all
    families together, which decides the gates' order and which of two registrations of a name stands: a module
    registering as it is imported gives its import order, so that `import a, b` resumes a run
    STREAMPREP_PLUGINS=a,b started (listed by registry family, they were refused as another order), and
    `b.install(); a.install()` is told from `a.install(); b.install()`; `by_family`: that earlier list."""
    if by_family:
        late = [m for reg in registry.FAMILIES for _, m in reg.late()] + [m for _, m in late_gates()]
    else:
        ordered = [(e.order, registry.module_of(e.target)) for reg in registry.FAMILIES for e in reg.late_entries()]
        ordered += [((registry.GATES_AT_START + i + 1, -1), m) for i, (_, m) in enumerate(late_gates())]
        late = [m for _, m in sorted(ordered, key=lambda om: om[0])]
    late = [m for m in dict.fromkeys(late) if m not in registry.PLUGIN_MODULES]
    return list(registry.PLUGIN_MODULES) + late


def _forget_failed_start(config: Config, run_dir: Path) -> bool:
    """Under the run's lock, before a run that starts afresh: remove the start files (`_start_files`) of an earlier
    attempt that failed having written no output, which the new config would otherwise meet (its checkpoint dir's
    owner, another run id, refused it). A tokenizer the config reads from there is kept. Whether there was one."""
    run_json = RunLayout(run_dir).run_json
    previous = _read_run_json(run_json) if run_json.exists() else {}
    checkpoint_dir = Path(previous.get("checkpoint_dir") or _checkpoint_dir(config, run_dir))
    if previous.get("status") != "failed" or _wrote_outputs(run_dir, checkpoint_dir):
        return False
    source = Path(config.tokenizer.path).resolve() if config.tokenizer.path else None
    for path in _start_files(run_dir, checkpoint_dir):
        if source is not None and (source == path or source.is_relative_to(path)):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)
    return True


def _read_run_json(path: Path) -> dict[str, Any]:
    """The previous run's record; unreadable or of the wrong shape is a ConfigError saying what to do."""
    try:
        record = atomic.read_json(path)
        why = None if isinstance(record, dict) and isinstance(record.get("config"), dict) \
            and isinstance(record["config"].get("run"), dict) else "no 'config' mapping in it"
    except (OSError, ValueError) as exc:
        why = f"{type(exc).__name__}: {exc}".splitlines()[0]
    if why:
        raise ConfigError(f"{path} is unreadable ({why}); it records the config this run started with — to resume "
                          f"with that same config, remove it and re-run the same command (the checkpoints keep the "
                          f"progress), or use a new --run-dir")
    return record


def _adopted(config: Config, run_dir: Path) -> dict[str, Any] | None:
    """The start of a run.json for a run dir whose run.json was removed (the recovery `_read_run_json` names): the
    run's own checkpoints (inside the run dir) say which run they belong to, so the run goes on as that run
    instead of being refused as another run's. Its config cannot be checked for drift: the message says
    "with that same config". A checkpoint dir outside the run dir may be another run's: not adopted, but for the
    claim this run dir's job left there when killed before it wrote run.json or any output, which refused every
    re-run of its command as another run's (nothing of it to check the config against)."""
    checkpoint_dir = _checkpoint_dir(config, run_dir)
    if (run_id := owner_of(checkpoint_dir)) is None:
        return None
    if checkpoint_dir.is_relative_to(run_dir):
        return {"run_id": run_id, "created_at": time.time(), "adopted_checkpoints": True}
    if claimed_from(checkpoint_dir) == run_dir and not _wrote_outputs(run_dir, checkpoint_dir):
        return {"run_id": run_id, "created_at": time.time()}
    return None


def _not_importing_main() -> None:
    """A job started from a script's top level, without `if __name__ == "__main__":`, ran again in each of its
    worker processes as they imported the script (forkserver children do), each failing on the run dir's lock: the
    job saw its workers die and said "a dedup holder process ended". multiprocessing's own check, on the flag it
    sets while a child imports the main module, turns that into an error saying what to change."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError('a streamprep job was started while a worker process imported the script that starts '
                           'it: put the call under `if __name__ == "__main__":` (each worker imports the main '
                           'module, as with any multiprocessing code)')


def _main_file_workers_run(config: Config) -> None:
    """A job that forks local processes (`workers` >= 2, or dedup holders) from a script read from stdin
    (`python - < job.py`): each child runs the script again from its path, `<stdin>` in the current folder, fails
    to find it, and the job said "a dedup holder process ended; re-run the same command to resume", a re-run the
    same. Refused up front, nothing written; a script deleted since it started is the same."""
    execution = config.execution
    workers = configmod.resolved_workers(execution.workers)
    holding = config.quality.dedup != "none" or config.quality.near_dedup.enabled
    key, value, instead = ("workers", workers, 1) if workers > 1 else ("dedup_holders", execution.dedup_holders, 0)
    if execution.ray_address or not (workers > 1 or (holding and execution.dedup_holders)):
        return
    main_path = multiprocessing.spawn.get_preparation_data("streamprep").get("init_main_from_path")
    if main_path is not None and not os.path.isfile(main_path):
        raise ConfigError(f"config: 'execution.{key}' {value} starts processes, which run the job's script again "
                          f"from its file, and {main_path} is not one (a script read from stdin?): save the script "
                          f"and run the file, or use {key}: {instead}")
    if main_path is not None and (line := _unguarded_call(main_path)) is not None:
        raise ConfigError(f"config: 'execution.{key}' {value} starts processes, which run the job's script again as "
                          f"they start, and {main_path} starts the job at its top level (line {line}): put the call "
                          f'under `if __name__ == "__main__":`, or use {key}: {instead}')


def _unguarded_call(main_path: str) -> int | None:
    """The line of the script's top-level statement running now, when that is a plain statement of the script's own
    (no `if`, `try`, `with` or loop around it): each worker runs it again as it imports the script, and the job
    failed in them ("a dedup holder process ended; re-run the same command to resume"), its run dir left failed.
    None when a compound statement holds the call (it may be the `__name__` guard: the workers say so if not)."""
    frame, line = sys._getframe(), None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__" \
                and os.path.realpath(frame.f_code.co_filename) == os.path.realpath(main_path):
            line = frame.f_lineno
        frame = frame.f_back
    if line is None:
        return None
    try:
        module = ast.parse(Path(main_path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None
    held = next((s for s in module.body if s.lineno <= line <= (s.end_lineno or s.lineno)), None)
    return line if held is not None and not hasattr(held, "body") and not hasattr(held, "cases") else None


def run_from_dict(raw: dict[str, Any], run_dir: str | Path | None = None, fresh: bool = False,
                  base_dir: str | Path = ".", console_log: bool = True) -> RunResult:
    """Validate `raw` (the YAML structure as a dict; relative paths against `base_dir`) and run the job."""
    return run(configmod.load(raw, base_dir), run_dir, fresh, console_log)


def run_config_file(path: str | Path, run_dir: str | Path | None = None, fresh: bool = False,
                    console_log: bool = True, process_exits: bool = False) -> RunResult:
    return run(configmod.load_file(path), run_dir, fresh, console_log, process_exits)


# One job at a time in a process: two at once (run_from_dict from two threads) swapped the process-wide `streamprep`
# logger's handlers under each other (one run's lines in the other's log, a finished run's handler left installed).
_ONE_JOB = threading.Lock()


def run(config: Config, run_dir: str | Path | None = None, fresh: bool = False,
        console_log: bool = True, process_exits: bool = False) -> RunResult:
    """The job. `process_exits`: the process ends when it returns (the CLI), so a stop need not wait for a call
    running in a thread of it (`workers: 1`'s tokenizer training): nothing of it outlives the process."""
    _not_importing_main()
    _main_file_workers_run(config)
    if not _ONE_JOB.acquire(blocking=False):
        raise ConfigError("another streamprep job is running in this process (run_from_dict from another thread): "
                          "one job at a time per process, as its log, signal handlers and metrics are the process's; "
                          "run the next when it returns, or in another process")
    try:
        return _run(config, run_dir, fresh, console_log, process_exits)
    finally:
        _ONE_JOB.release()


def _run(config: Config, run_dir: str | Path | None, fresh: bool, console_log: bool, process_exits: bool) -> RunResult:
    run_dir = resolve_run_dir(config, run_dir)
    try:
        previous = _preflight(config, run_dir, fresh)
    except PermissionError as exc:  # the run dir, or the checkpoint dir, behind a folder we may not read
        raise ConfigError(f"run dir {run_dir}: cannot read {exc.filename or run_dir}: {exc.strerror or exc}") from None
    metrics.check_port(config.execution)
    checkpoint_dir = _checkpoint_dir(config, run_dir)
    before = _held_before(run_dir, checkpoint_dir) if previous is None else []  # a resume takes nothing back
    locks = [RunLock(RunLayout(run_dir).lock), RunLock(CheckpointLayout(checkpoint_dir).lock, "checkpoint dir")]
    held = False
    try:
        for lock in locks:
            try:
                lock.acquire()
            except RunLocked as exc:
                raise ConfigError(str(exc)) from None
        held = True
        afresh = previous is None and _forget_failed_start(config, run_dir)
        _refuse_unsafe_paths(config, run_dir, checkpoint_dir)
        with logs.configured(run_dir, console=console_log):  # (a line logged before went to stdout, console or not)
            if afresh:
                log.info("previous attempt failed before writing any output; starting afresh", run_dir=str(run_dir))
            for lock in locks:
                if lock.taken_over:
                    log.warning("took over a stale lock from a process that is gone", lock=str(lock.path),
                                previous=lock.taken_over)  # the run dir's, then the checkpoint dir's: say which
            job = Job(config, run_dir, previous, console_log, process_exits, fresh)
            with metrics.serving(config.execution, run_dir, config.datasets):
                return job.run()
    except ConfigError:
        if held:  # the log is closed by now; the locks are still ours
            _take_back(before, run_dir, checkpoint_dir)
        raise
    finally:
        for lock in locks:
            lock.release()


def _held_before(run_dir: Path, checkpoint_dir: Path) -> list[tuple[Path, frozenset[str] | None]]:
    """The run's folders (the run dir, and the checkpoint dir when it is outside it), each with the names it held
    before this attempt (None: absent). What an attempt refused by a config error may take back (`_take_back`)."""
    roots = [run_dir] + ([] if checkpoint_dir.resolve().is_relative_to(run_dir) else [checkpoint_dir])
    return [(d, frozenset(os.listdir(d)) if d.is_dir() else None) for d in roots if d.is_dir() or not d.exists()]


def _take_back(before: list[tuple[Path, frozenset[str] | None]], run_dir: Path, checkpoint_dir: Path) -> None:
    """After a config error found once a new run had started (an hf:// repo, revision, subset or split the Hub does
    not have, known only when ingest asks it): remove what this attempt made in the run's folders, as for a local
    path that does not exist, where nothing is written: a folder it created goes, and in one that was there, each
    name it added. It left a run dir marked resumable that `--fresh` then refused, and a checkpoint dir claimed by
    a run that no longer exists. Never what was there before it, nor once the attempt wrote output (a stage's
    files, a checkpoint: `_wrote_outputs`, over what it added)."""
    added = [folder / name for folder, names in before if names is not None and folder.is_dir()
             for name in sorted(set(os.listdir(folder)) - names)] + [folder for folder, names in before if names is None]
    if _wrote_outputs(run_dir, checkpoint_dir, within=added):
        return
    for p in added:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _stale(what: str) -> bool:
    log.warning("finished run has a missing, changed or unreadable file; redoing what is needed", file=what)
    return False


def _checkpoint_dir(config: Config, run_dir: Path) -> Path:
    return Path(config.run.checkpoint_dir or RunLayout(run_dir).local_checkpoints)


def _refuse_unsafe_paths(config: Config, run_dir: Path, checkpoint_dir: Path) -> None:
    """Refuse (before writing) a run whose writes would land on files that are not ours."""
    names = [d.name for d in config.datasets]
    foreign = foreign_checkpoints(checkpoint_dir, run_dir, names)
    if foreign:
        raise ConfigError(f"run.checkpoint_dir: {foreign[0]} exists and is not a streamprep checkpoint; "
                          f"refusing to overwrite it (choose an empty run.checkpoint_dir)")
    escaping = atomic.escaping_symlinks(run_dir)
    if escaping:
        raise ConfigError(f"run dir: {escaping[0]} is a symlink leading outside the run dir; refusing to write "
                          f"through it (remove it)")


class Job:
    def __init__(self, config: Config, run_dir: Path, previous: dict[str, Any] | None, console_log: bool = True,
                 process_exits: bool = False, fresh: bool = False):
        self.config, self.run_dir = config, run_dir  # each stage is handed only the sections it reads
        self.process_exits = process_exits
        self.mode = mode_of(config.sft)
        self.checkpoint_dir = _checkpoint_dir(config, run_dir)
        self.record = previous or {"run_id": uuid.uuid4().hex[:12], "created_at": time.time()}
        self.earlier_code = self.record.get("code")  # the streamprep its last attempt ran (`_say_code_changed`)
        cfg = config.to_dict()
        self.sft_section = cfg.get("sft")  # plain form, as shard tasks carry it to the workers and hash it
        self.record.update({"config": configmod.public(cfg), "config_hash": configmod.config_hash(cfg), "versions": _versions(),
                            "code": version.source()[0], "checkpoint_dir": str(self.checkpoint_dir),
                            "plugins": plugin_modules(),
                            "optional_skipped": [name for name, _ in config.skipped]})  # (_refuse_optional_change)
        self.timings: dict[str, float] = dict(self.record.get("timings") or {})  # summed over resumed attempts
        self._record_lock = threading.Lock()  # a stage ends in the feeder's thread too: one run.json writer at a time
        self.signals = Signals(fresh)  # its second-signal line names the command that resumes
        self._backend_of: tuple[TokenizerInfo, str] | None = None  # _shard_backend's last tokenizer and choice
        self.executor: Executor | None = None  # the job's, from run() on
        self.progress: dict[str, Any] = {}  # dataset -> live IngestState, read by the progress reporter
        self.reporter = ProgressReporter(self.progress, self.config.execution.progress_interval_s,
                                         tty=None if console_log else False, datasets=config.datasets)

    def _save_record(self, status: str | None = None, **extra: Any) -> None:
        """run.json with `status` (None: the one it has) and the timings so far."""
        with self._record_lock:
            self.record.update(status=status or self.record["status"], updated_at=time.time(), timings=self.timings,
                               **extra)
            atomic.write_json(RunLayout(self.run_dir).run_json, self.record)

    def _record_end(self, status: str, **extra: Any) -> None:
        """run.json's status as the run ends on an error or a stop, unless it cannot be written (a full disk): then
        the error that ended the run is still the one raised, and `status` says "crashed"."""
        try:
            self._save_record(status, **extra)
        except OSError as exc:
            log.warning("run.json not updated", status=status, error=one_line(exc))

    def _say_code_changed(self) -> None:
        """A warning when this attempt resumes a run its last attempt made with another streamprep (an upgrade, an
        edit): outputs are byte-identical across stops only under the same code, and what the earlier code wrote
        (parts, shards) stays as it wrote it, beside what this one writes."""
        if self.earlier_code not in (None, self.record["code"]):
            log.warning("resuming a run made with another streamprep: what it wrote stays, beside what this one "
                        "writes; for outputs of this streamprep alone, start over with a new --run-dir",
                        earlier=self.earlier_code, now=self.record["code"])

    def _timed(self, name: str, fn: Callable[[], Any]) -> Any:
        """`fn()`, its seconds added to the stage's; a stage that finishes writes them to run.json at once, so a
        `kill -9` later in the attempt loses only the unfinished stage's time (a stop or a failure writes it all)."""
        t0 = time.monotonic()
        try:
            out = fn()
        finally:
            self.timings[name] = round(self.timings.get(name, 0.0) + time.monotonic() - t0, 3)
        try:
            self._save_record()
        except OSError as exc:  # bookkeeping: a full disk stops the run where it writes its outputs, not here
            log.warning("run.json timings not updated", stage=name, error=one_line(exc))
        return out

    def run(self) -> RunResult:
        complete = self.record.get("status") == "complete"
        if complete and self._still_complete():
            log.info("run already complete; nothing to do", run_dir=str(self.run_dir))
            return RunResult(self.run_dir, "complete", self.record.get("summary", {}))
        if complete:  # the start checked only the folders a finished run writes in
            _check_written_folders(self.config, self.run_dir)
        other = claim(self.checkpoint_dir, self.record["run_id"], self.run_dir)
        if other:
            raise ConfigError(f"run.checkpoint_dir: {self.checkpoint_dir} holds the checkpoints of another run "
                              f"(run_id {other}, see {CheckpointLayout(self.checkpoint_dir).owner.name} there); choose another run.checkpoint_dir")
        if complete:
            self._drop_changed_receipts()
        self._sweep_tmp("removed temporary files of an interrupted run")
        for stale in ("error", "needs_change"):  # the last attempt's failure, not this one's (a complete run kept them)
            self.record.pop(stale, None)
        self._save_record("running", started_at=time.time())
        self._say_code_changed()
        for name, why in self.config.skipped:
            log.warning("optional dataset skipped: its input is missing", dataset=name, reason=why)
        ex = self.config.execution
        if any(d.path.startswith("hf://") for d in self.config.datasets):
            set_retry_policy(ex.hf_retries, ex.hf_retry_max_s)
        self.signals.install()
        # our handlers stay installed until the audit is written (a late signal is handled too)
        with ExitStack() as job:
            job.callback(self.signals.restore)
            try:
                # one executor runs the job's calls: units, tokenize tasks (engine: local), exports, the audit
                executor = self.executor = job.enter_context(worker_executor(ex, self.config.quality, self.mode))
                executor.stop_asked = self.signals.asked
                if not (executor.stoppable or self.process_exits):
                    # `workers: 1` in a library caller's process: a stop waits for the call running in the worker
                    # thread (queued ones are cancelled); left running, it wrote shards, receipts and a trained
                    # tokenizer into the run dir after the call returned, under the next call's temporary names
                    job.callback(executor.close, True)
                executor.warm()  # the workers start while the engine, the tokenizer and the plan are prepared
                with self._engine(executor) as engine:  # a long-lived engine comes up while ingest starts
                    with self.reporter.in_thread():
                        states, tasks, results, info = self._ingest_and_tokenize(engine, executor)
                    engine.stop()  # Xenna and its Ray cluster wind down while the exports are written
                    summary = self._timed("exports", lambda: self._exports(tasks, states, info, executor))
                summary["tokenize"] = results
                if (training := tokmod.training_report(self.run_dir)) is not None:
                    summary["tokenizer_training"] = training
            except (KeyboardInterrupt, Interrupted):
                self._record_end("interrupted")
                # the terminal's, and a library caller's to print: a run dir may hold ESC or CR
                raise Interrupted(f"interrupted; progress saved in {printable(str(self.run_dir))} — "
                                  f"re-run the same command to resume") from None
            except BaseException as exc:
                log.error("run failed", error=error_text(exc)[:2000])  # the log has it too, with
                self._record_end("failed", error=error_text(exc)[:500],  # what led to it
                                 needs_change=needs_change(exc))  # exit 2: re-running as is fails the same way
                raise
            # run.json is the root of verify's hash chain: it records manifest.json's SHA-256
            self._save_record("complete", finished_at=time.time(), summary=summary,
                              manifest_sha256=summary["exports"]["manifest_sha256"])
            # after run.json is final (the audit reports its timings), on a worker: it reads rejected records
            try:
                audit.write_audit(self.run_dir, executor=executor)
            except OSError as exc:  # the run is complete: a report that cannot be written does not undo that
                log.warning("audit not written; `streamprep audit RUN_DIR` writes it", error=one_line(exc))
            except (KeyboardInterrupt, Interrupted):  # nor does a stop now: it said "interrupted", exit 1, with
                log.warning("audit not written: interrupted; `streamprep audit RUN_DIR` writes it")  # run.json complete
            except Exception as exc:  # a bug (or a worker's other streamprep): exit 1, and the log says what it was
                log.error("audit failed", error=error_text(exc)[:2000])
                raise
        # every writer of the job has ended: a temporary file left now is one whose writer died during the run (a
        # worker killed mid-write, a stage worker lost with its node) while its call ran again elsewhere
        self._sweep_tmp("removed temporary files of writers that died during the run")
        log.info("run complete", run_dir=str(self.run_dir), **{k: v for k, v in summary.items() if k != "tokenize"})
        return RunResult(self.run_dir, "complete", summary)

    def _sweep_tmp(self, event: str) -> None:
        """Remove the temporary files (`atomic.tmp_path` names) no writer of this run holds; the run's lock is held."""
        orphans = atomic.sweep_tmp(self.run_dir)
        if self.checkpoint_dir.exists() and not self.checkpoint_dir.is_relative_to(self.run_dir):
            orphans += atomic.sweep_tmp(self.checkpoint_dir)
        if orphans:
            log.info(event, count=len(orphans))

    # -- stages ------------------------------------------------------------------------------
    def _engine(self, executor: Executor) -> Engine:
        return engines.create(self.config.execution, executor)

    def _ingest_and_tokenize(self, engine: Engine, executor: Executor) -> tuple[dict[str, IngestState],
                                                                                 list[ShardTask], dict[str, Any],
                                                                                 TokenizerInfo]:
        """Ingest with the engine already up: each sealed part is tokenized while ingest goes on; the configured
        tokenizer is prepared by the feeder while ingest starts."""
        feeder = ShardFeeder(engine, self._task, {d.name: self._files(d.name) for d in self.config.datasets},
                             lambda wait: self._timed("tokenizer", lambda: self._given_tokenizer(wait)),
                             self._train_tokenizer,
                             self._sample_ready())
        self.reporter.watch_shards(lambda: (feeder.sealed, engine.completed))
        try:
            states = self._timed("ingest", lambda: self._ingest(feeder.on_checkpoint, executor))
            self.reporter.phase = "tokenize"
            info = self._timed("tokenizer", lambda: feeder.finish(states))
            tasks = self._plan(states, feeder)
            results = self._timed("tokenize", lambda: self._tokenize(engine, tasks))
        finally:
            feeder.close()
        return states, tasks, results, info

    def _ingest(self, on_checkpoint: Callable[[IngestState], None], executor: Executor) -> dict[str, IngestState]:
        """The ingest's event loop runs in a thread of its own: the calling thread may run a loop already (Jupyter,
        an async service), where `asyncio.run` refuses, and keeps its current loop, which `asyncio.run` clears."""
        asked = threading.Event()  # a signal before the loop is up stops it as soon as it is
        self.signals.on_first = asked.set

        async def main() -> dict[str, IngestState]:
            ctx = IngestContext.of(self.config, self.run_dir, self.checkpoint_dir, asyncio.Event(), self.progress,
                                   on_checkpoint, executor)
            loop = asyncio.get_running_loop()
            self.signals.on_first = lambda: loop.call_soon_threadsafe(ctx.stop.set)
            if asked.is_set():
                ctx.stop.set()
            try:
                return await ingest_all(ctx)
            finally:
                self.signals.on_first = None
                if ctx.stop.is_set():
                    raise Interrupted("stopped during ingest")

        outcome: dict[str, Any] = {}

        def loop_thread() -> None:
            try:
                outcome["states"] = asyncio.run(main())
            except BaseException as exc:
                outcome["error"] = exc

        thread = threading.Thread(target=loop_thread, name="ingest-loop")
        thread.start()
        thread.join()
        self.signals.on_first = None
        if "error" in outcome:
            raise outcome["error"]
        return outcome["states"]

    def _files(self, name: str) -> DatasetFiles:
        return DatasetFiles(self.run_dir, self.checkpoint_dir, name)

    def _parts(self, states: dict[str, IngestState]) -> dict[str, list[Path]]:
        return {d.name: completed_parts(self._files(d.name), states[d.name]) for d in self.config.datasets}

    def _given_tokenizer(self, wait: Wait) -> TokenizerInfo | None:
        """`tokenizer.path` (or a tokenizer this run already trained), None if it is to be trained: the feeder
        thread prepares it while ingest starts, waiting for the backend check through `wait` (`ShardFeeder.wait`)."""
        tok = self.config.tokenizer
        select = functools.partial(self._select, wait)
        if tok.path:
            return tokmod.prepare(tok, self.run_dir, select=select)
        trained = tokmod.saved_tokenizer(tok, self.run_dir, select)  # a resumed run reuses what it trained
        if trained is None or (tok.train.sample_mb is not None and tokmod.training_report(self.run_dir) is None):
            return None
        return trained

    def _sample_ready(self) -> Callable[[dict[str, IngestState]], bool] | None:
        sample_mb = self.config.tokenizer.train.sample_mb
        if sample_mb is None:
            return None
        shares = tokmod.sample_shares(self.config.datasets, sample_mb)
        return lambda states: tokmod.sample_ready(shares, {n: s.sealed_text_bytes() for n, s in states.items()},
                                                  {n: s.done for n, s in states.items()})

    def _train_tokenizer(self, states: dict[str, IngestState]) -> Future[TokenizerInfo]:
        """Train on the sample (`sample_mb`, held-out report) or, after ingest, on all kept text: on a worker,
        which reads the texts from the sealed parts (and keeps the backend it checks for its shards). The
        feeder waits for it unless the job stops (the executor's close then stops the worker)."""
        assert self.executor is not None
        tok = self.config.tokenizer
        sample_mb = tok.train.sample_mb
        if sample_mb is None:
            parts = [p for ps in self._parts(states).values() for p in ps]
            if not parts:
                raise ConfigError("no records were kept, so there is no text to train a tokenizer on "
                                  "(check the quality settings or the sources)")
            log.info("training the tokenizer on all kept text", parts=len(parts),
                     parts_mb=round(sum(p.stat().st_size for p in parts) / 2**20, 2))
            return self.executor.submit(tokmod.train_on_parts, tok, self.run_dir, parts)
        sealed = {n: [self._files(n).part(i) for i in range(s.sealed_parts())] for n, s in states.items()}
        shares = tokmod.sample_shares(self.config.datasets, sample_mb)
        if not any(sealed[n] for n, share in shares.items() if share > 0):  # trained on no text, it had 256 ids
            raise ConfigError("no records were kept, so there is no text to train a tokenizer on "
                              "(check the quality settings or the sources)")
        log.info("training the tokenizer on a sample while ingest goes on", sample_mb=sample_mb)
        return self.executor.submit(tokmod.train_on_sample, tok, self.run_dir, sealed, shares)

    def _select(self, wait: Wait, requested: str, path: Path, texts: Sequence[str]) -> dict[str, Any]:
        """`backends.select` on a worker: the driver loads no gigatoken, and the worker that built it for the
        identity check keeps it for its shards (`backends.load`). A mode with one backend (SFT: hf) selects nothing.
        `wait` gives up on a stop: the feeder's close waits for this thread."""
        fixed = self.mode.fixed_backend(requested)
        if fixed is not None:
            return fixed
        assert self.executor is not None
        return wait(self.executor.submit(backends.select, requested, path, list(texts)))

    def _task(self, name: str, part: Path, sha256: str, info: TokenizerInfo) -> ShardTask:
        dtype = token_dtype(self.config.output.dtype, max(info.vocab_size, info.id_bound))
        eod = info.eod_id if self.config.tokenizer.append_eod and self.mode.appends_eod else None
        split = next(d.blend_split for d in self.config.datasets if d.name == name)
        backend = self._shard_backend(info)
        task = make_task(self.run_dir, name, split, part, info.path, info.fingerprint, eod, dtype,
                         self.sft_section, backend, sha256)
        if not self.mode.text_exports:
            return task
        # ingest seals every part but a dataset's last with exactly `shard_records` lines, in order, so the lines
        # before this part are known now; the exports check this ordinal against the receipts (records that
        # tokenized to nothing are not counted there) and remake the part's run if it differs
        lines_per_part = self.config.output.part_lines
        return replace(task, first_ordinal=part_index_of(part) * lines_per_part,
                       order_seed=self.config.run.seed, length_buckets=tuple(self.config.output.parquet.length_buckets))

    def _shard_backend(self, info: TokenizerInfo) -> str:
        """The backend shard tasks load, with run.json's `tokenizer_backend`: set once per tokenizer, not per part."""
        if self._backend_of is None or self._backend_of[0] is not info:
            # a mode with one backend (SFT: hf) even when the run's checkpoints recorded another (an older streamprep)
            fixed = self.mode.fixed_backend(str(info.backend.get("requested")))
            self.record["tokenizer_backend"] = fixed if fixed is not None else dict(info.backend)
            self._backend_of = (info, fixed["name"] if fixed is not None else info.backend_name)
        return self._backend_of[1]

    def _plan(self, states: dict[str, IngestState], feeder: ShardFeeder) -> list[ShardTask]:
        """Every sealed part's task in config then part order; the feeder planned (and hashed) each one
        as it was sealed, and every one must have reached the engine."""
        parts = [(name, p.stem) for name, ps in self._parts(states).items() for p in ps]
        unsent = [f"{name}/{part}" for name, part in parts if (name, part) not in feeder.tasks]
        if unsent:
            raise RuntimeError(f"{len(unsent)} sealed part(s) were never handed to the engine: {unsent[0]}")
        return [feeder.tasks[key] for key in parts]

    def _tokenize(self, engine: Engine, tasks: list[ShardTask]) -> dict[str, Any]:
        """Wait for the shards still running, then check every planned shard has a current receipt."""
        t0 = time.monotonic()
        results = engines.drain(engine, self.config.execution.engine)
        skipped = sum(1 for r in results if r.get("skipped"))
        self._add_tokenize_work([r for r in results if not r.get("skipped")])
        log.info("tokenization done", engine=engine.name, shards=len(tasks), tokenized=len(results) - skipped,
                 skipped=skipped, tail_wait_seconds=round(time.monotonic() - t0, 2),
                 shard_seconds=round(sum(r.get("seconds", 0.0) for r in results), 2),
                 shards_local=sum(1 for r in results if r.get("where") == "local"))
        missing = [f"{t.dataset}/{t.part}: {p}" for t in tasks if (p := receipt_problem(t, read_receipt(t), False))]
        if missing:
            raise RuntimeError(f"tokenization left {len(missing)} shard(s) incomplete: {'; '.join(missing[:5])}")
        return {"shards": len(tasks), "tokenized": len(results) - skipped, "skipped": skipped}

    def _add_tokenize_work(self, done: list[dict[str, Any]]) -> None:
        """run.json's `tokenize_work`, summed over attempts: the shards tokenized (not skipped as done), their tokens
        and their workers' seconds, the audit's tokens/s. Tokenizing runs during ingest, so no stage's time is it; a
        shard whose result a stop or a kill lost before this point is in neither sum, so the rate stays true."""
        work = self.record.get("tokenize_work") or {"shards": 0, "tokens": 0, "seconds": 0.0}
        self.record["tokenize_work"] = {"shards": work["shards"] + len(done),
                                        "tokens": work["tokens"] + sum(r["tokens"] for r in done),
                                        "seconds": round(work["seconds"] + sum(r["seconds"] for r in done), 3)}

    def _exports(self, tasks: list[ShardTask], states: dict[str, IngestState], info: TokenizerInfo,
                 executor: Executor) -> dict[str, Any]:
        log.info("writing exports", shards=len(tasks))
        return {"kept": {n: s.kept for n, s in states.items()}, "rejected": {n: s.rejected for n, s in states.items()},
                **export_run(self.run_dir, tasks, info.to_json(), self.config.output, self.config.datasets,
                             self.config.run.seed, self.record["config_hash"], workers=executor,
                             blend=self.mode.text_exports)}

    def _drop_changed_receipts(self) -> None:
        """A finished run re-run: remove each receipt whose bytes differ from those its manifest.json (the one
        run.json signs) lists, so its shard is redone and the receipt written again from the shard. A shard whose
        files still match its receipt is skipped, so a receipt edited in its stats (or before a check of its own
        fields) was kept, and the exports signed it into a new manifest: `verify` then passed a changed receipt."""
        layout = RunLayout(self.run_dir)
        manifest = read_json(layout.manifest)
        if not isinstance(manifest, dict) or atomic.sha256_file(layout.manifest) != self.record.get("manifest_sha256"):
            return  # a manifest run.json does not sign says nothing about the receipts
        receipts = layout.receipts_dir.resolve()
        for entry in manifest.get("files") or []:
            rel = entry.get("path") if isinstance(entry, dict) and entry.get("role") == "receipt" else None
            path = self.run_dir / rel if isinstance(rel, str) else None
            if path is None or not path.resolve().is_relative_to(receipts) or not path.is_file():
                continue  # a missing one is redone anyway
            if chain.digest(self.run_dir, rel) != (entry.get("sha256"), entry.get("size_bytes")):
                log.warning("receipt differs from manifest.json; its shard is redone", file=rel)
                path.unlink()

    def _still_complete(self) -> bool:
        """A finished run re-run: a cheap check that what it wrote is still there: the ingest parts its checkpoints
        sealed and every file its receipts and its manifest list, at their sizes; the small files the manifest
        hashes (blend.json, which holds the run dir's path, mixtures.json, receipts, tokenizer/) by their SHA-256; no
        Parquet shard it does not list. Anything else sends the job through its stages, which redo what is needed
        (a damaged receipt, manifest or Parquet shard had the re-run say "complete" and `verify` fail, or fail every
        re-run). The large files are not read: a byte changed in one is `verify`'s to find (docs/operations.md)."""
        layout = RunLayout(self.run_dir)
        expected: list[tuple[str, Any]] = []  # (run-dir-relative path, size)
        for name in (d.name for d in self.config.datasets):
            try:  # its sealed parts from the sealed log (or, an earlier streamprep's, from inside it), all it counts
                cp = Checkpoint.load(CheckpointLayout(self.checkpoint_dir).checkpoint(name))
                sealed = cp.raw.get("sealed") if len(cp.raw.get("sealed") or ()) == cp.part_index else None
            except (OSError, ValueError, TypeError) as exc:  # naming the file: "alpha.sealed is missing and …"
                return _stale(f"checkpoints/{name}.json: {exc}")
            if not isinstance(sealed, list):
                return _stale(f"checkpoints/{name}.json")
            expected += [(str(layout.ingest_part(name, i).relative_to(self.run_dir)), s[1] if isinstance(s, list)
                          and len(s) == 2 else None) for i, s in enumerate(sealed)]
        for path in sorted(layout.receipts_dir.rglob("*.json")):
            rec = read_json(path)
            files = rec.get("files") if isinstance(rec, dict) else None
            if not isinstance(files, dict) or not all(isinstance(e, dict) for e in files.values()):
                return _stale(str(path.relative_to(self.run_dir)))
            expected += [(e.get("path"), e.get("bytes")) for e in files.values()]
        manifest = read_json(layout.manifest)
        if not isinstance(manifest, dict) or atomic.sha256_file(layout.manifest) != self.record.get("manifest_sha256"):
            return _stale("manifest.json")
        shards = manifest.get("shards") or []  # a .bin/.idx shard is listed by its prefix (its files by its receipt)
        files, parquet = manifest.get("files") or [], [s for s in shards if not isinstance(s, dict)
                                                         or s.get("kind") == "parquet"]
        for entry in [*files, *parquet]:
            if not isinstance(entry, dict):
                return _stale("manifest.json")
            # a file holding the run dir's path (blend.json) is listed by its run-dir-free form: its size is not on disk
            expected.append((entry.get("path"), None if entry.get("run_dir_relative") else entry.get("size_bytes")))
            if isinstance(entry.get("tsv"), dict):
                expected.append((entry["tsv"].get("path"), entry["tsv"].get("size_bytes")))
        for rel, size in expected:
            path = self.run_dir / rel if isinstance(rel, str) else None
            if path is None or not path.is_file() or (size is not None and path.stat().st_size != size):
                return _stale(str(rel))
        for entry in files:  # small: a changed byte, or a run dir moved since (blend.json names its shards' paths)
            if chain.digest(self.run_dir, entry["path"]) != (entry.get("sha256"), entry.get("size_bytes")):
                return _stale(entry["path"])
        listed = {rel for rel, _ in expected}
        for path in sorted(layout.parquet_dir.glob("shard_*")) if layout.parquet_dir.is_dir() else []:
            if str(path.relative_to(self.run_dir)) not in listed:  # the exports remove what they no longer list
                return _stale(str(path.relative_to(self.run_dir)))
        return not self.mode.text_exports or layout.blend.is_file()
