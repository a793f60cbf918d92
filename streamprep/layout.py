"""The one map of a run directory: every path under RUN_DIR is named here and nowhere else.

Paths stored relative to the run dir (receipts, manifest) come from the same accessors, so renaming a
file means changing one line. Read-only helpers (`read_json`, `Checkpoint`, `completed_receipt`) let
status/audit/verify read the run without each keeping its own tolerant JSON loader.
"""
from __future__ import annotations

import errno
import glob
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from streamprep.atomic import is_tmp_name
from streamprep.config import ConfigError, json_kind
from streamprep.lock import is_lock_file

# Names relative to the run dir; receipts, the manifest and verify's messages store/print them as-is.
RUN_JSON, MANIFEST, BLEND, MIXTURES = "run.json", "manifest.json", "blend.json", "mixtures.json"
INGEST, REJECTS, RECEIPTS, TOKENIZER = "ingest", "rejects", "receipts", "tokenizer"
BINIDX, SFT, PARQUET, AUDIT, LOGS, CHECKPOINTS = "binidx", "sft", "parquet", "audit", "logs", "checkpoints"
EXPORTS_SCRATCH, COLUMNS_SUFFIX = ".order", ".columns"
LOCK, CACHE = ".lock", "cache"
LOG_NAME = "streamprep.log"  # in logs/, beside its rotated backups (streamprep.log.1 …)
# The run log's lines a job can write before its first run.json (pipeline._run and Job.run, metrics.MetricsServer):
# a log holding any other line, or a longer one, is an earlier run's or a user's (`RunLayout.only_a_start`)
START_EVENTS = frozenset({"took over a stale lock from a process that is gone",
                          "removed temporary files of an interrupted run",
                          "metrics server listening", "metrics server stopped"})
START_LINE_MAX = 1 << 16
# A tokenizer's files beside its tokenizer.json that the run copies with it (tokenizer.prepare)
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
# The run's own names at the top of its run dir: an output writer plug-in may return no path under one (the manifest
# would list a file the run writes or rewrites), and must leave the files under the SETTLED ones as they were (the
# shards, ingest parts, receipts and records the manifest chains, fixed before the writers run; exports.write_exports)
SETTLED = (RUN_JSON, MANIFEST, BLEND, MIXTURES, INGEST, REJECTS, RECEIPTS, TOKENIZER, BINIDX, SFT, PARQUET)
OWN = frozenset({*SETTLED, AUDIT, LOGS, CHECKPOINTS, LOCK, CACHE})
# In the checkpoint dir, which may be a user's directory outside the run: distinct dot-names for the lock and
# the claim (the run_id whose checkpoints it holds, and its run dir), so a user's own `.lock` is never taken for ours.
CHECKPOINT_LOCK, CHECKPOINT_OWNER = ".streamprep.lock", ".streamprep-run"
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)  # a write refused for want of rights, not of room


class NotARunDir(ValueError):
    """The path is not a streamprep run directory (the CLI maps it to exit 2)."""


def causes(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and what it wraps (`__cause__`, in turn): a unit's SourceError wraps the OSError that decides the line."""
    while exc is not None:
        yield exc
        exc = exc.__cause__


def file_in_the_way(exc: BaseException) -> Path | None:
    """The file standing where a folder is needed, when `exc` (or what it wraps) is mkdir's FileExistsError or a
    NotADirectoryError under it: a raw error, exit 1 as if a re-run could resume, where none ever would."""
    for e in causes(exc):
        mkdir = isinstance(e, FileExistsError) and e.filename2 is None  # (os.link's names two files)
        if (mkdir or isinstance(e, NotADirectoryError)) and e.filename:
            path = Path(os.fsdecode(e.filename))
            for p in (path, *path.parents):
                if p.exists() or p.is_symlink():
                    return p if not p.is_dir() else None
    return None


def denied(exc: BaseException) -> OSError | None:
    """The error (`exc` or what it wraps) of a local file or folder the job may not read or write (permissions, a
    read-only file system), naming it: the write helpers name the file, not its temporary name (`atomic.name_file`)."""
    for e in causes(exc):
        if (isinstance(e, OSError) and e.errno in NOT_WRITABLE and isinstance(e.filename, (str, bytes))
                and "://" not in os.fsdecode(e.filename)):
            return e
    return None


def unreadable(err: OSError) -> bool:
    """Whether `err` (of `denied`) was a read refused, not a write: the file or folder it names is there and this
    process may not read it. The error does not say which call failed, and an unreadable checkpoint was called a
    file to make writable. (Writes name a file whose folder refuses them, or a readable file kept read-only.)"""
    where = os.fsdecode(err.filename)
    return err.errno != errno.EROFS and os.path.lexists(where) and not os.access(where, os.R_OK)


def closed_folder(path: str | bytes | Path, top: Path | None = None) -> Path | None:
    """The folder that keeps `path` out of sight: the first on its way, from the top (`top`, else the root), that
    this process may not enter (search), or `path` itself when it is a folder it may not list. Inside such a folder
    a file cannot even be looked at: `unreadable` saw no file there, and a `chmod 000` folder of the run was a raw
    PermissionError naming a file in it (a reader's command), or a write to make the folder writable (`ingest`)."""
    where = Path(os.fsdecode(path))
    ways = [p for p in (*reversed(where.parents), where) if top is None or p == top or top in p.parents]
    for folder in ways:
        need = os.R_OK | os.X_OK if folder == where else os.X_OK
        if folder.is_dir() and not os.access(folder, need):  # (its own folder is searchable: stat sees it)
            return folder
    return None


def needs_change(exc: BaseException) -> bool:
    """Whether `exc` is one the CLI exits 2 on: re-running as is ends the same way (a config error, inputs changed
    under a resume or a sealed part since it was sealed, no kept text to train a tokenizer on, a folder or file in
    the way of the run's own, a folder it may not write in or a file it may not read), so run.json records it and
    `status` does not call the run resumable as it stands."""
    return (isinstance(exc, (ConfigError, NotARunDir, IsADirectoryError)) or file_in_the_way(exc) is not None
            or denied(exc) is not None)


def damaged_record(run_dir: Path, exc: Exception) -> NotARunDir:
    """What `status` and `audit` say of a checkpoint or receipt of the wrong shape: one line, and how to repair it."""
    return NotARunDir(f"{run_dir}: a checkpoint or receipt is damaged ({type(exc).__name__}: {exc}); `streamprep "
                      f"ingest` with the run's config repairs it (a checkpoint restarts its dataset, a receipt its "
                      f"shard)")


def part_name(index: int) -> str:
    """`part-00007`: the stem shared by an ingest part, its receipt and its binidx/sft outputs."""
    return f"part-{index:05d}"


def part_index_of(path: Path) -> int:
    """7 for `.../part-00007.jsonl` (or any file named by `part_name`)."""
    return int(path.stem.split("-")[1])


def _stem(part: int | str) -> str:
    """A part given by index or by its stem ("part-00007")."""
    return part if isinstance(part, str) else part_name(part)


def read_json(path: Path) -> Any:
    """The parsed JSON at `path`, or None if it is missing or unreadable (the run may be mid-write)."""
    try:
        return orjson.loads(Path(path).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None


@dataclass(frozen=True)
class CheckpointLayout:
    """Every name in a checkpoint dir (RunLayout.checkpoints: RUN_DIR/checkpoints or `run.checkpoint_dir`)."""

    checkpoint_dir: Path

    def checkpoint(self, dataset: str) -> Path:
        return Path(self.checkpoint_dir) / f"{dataset}.json"

    def dedup_log(self, dataset: str, part: int = 0, parts: int = 1) -> Path:
        """The dataset's exact-dedup log; with `parts` dedup holders, holder `part`'s (`streamprep.holders`)."""
        return Path(self.checkpoint_dir) / (f"{dataset}.dedup" if parts == 1 else f"{dataset}.dedup.{part}-of-{parts}")

    def dedup_logs(self, dataset: str) -> list[Path]:
        """Whatever exact-dedup logs of the dataset exist, of one holder or several: named exactly as `dedup_log`
        names them. The glob alone matches another dataset's files too (`web` took `web.dedupe.json`, `.sealed`,
        ..., and a restart of `web` deleted them)."""
        exact = re.compile(rf"{re.escape(dataset)}\.dedup(\.[0-9]+-of-[0-9]+)?")
        return sorted(p for p in Path(self.checkpoint_dir).glob(f"{glob.escape(dataset)}.dedup*")
                      if exact.fullmatch(p.name))

    @property
    def dedup_holders(self) -> Path:
        """The run's dedup holder count, fixed when it started."""
        return Path(self.checkpoint_dir) / "dedup_holders.json"

    def near_log(self, dataset: str) -> Path:
        return Path(self.checkpoint_dir) / f"{dataset}.near"

    def plan(self, dataset: str) -> Path:
        """The dataset's units of work (streamprep.units), written once."""
        return Path(self.checkpoint_dir) / f"{dataset}.plan.json"

    def inputs(self, dataset: str) -> Path:
        """The dataset's input identity (file sizes/hashes, or the hf:// commit), written once a job: it never
        changes within one, so the checkpoint saved after every unit does not carry it. No `.json` suffix: a
        dataset named `<other>.inputs` has its checkpoint at `<other>.inputs.json`."""
        return Path(self.checkpoint_dir) / f"{dataset}.inputs"

    def sealed_log(self, dataset: str) -> Path:
        """The dataset's sealed parts, `SEALED_RECORD` bytes each, append-only: the checkpoint saved after every unit
        counts them (`part_index`) rather than listing them, which made its bytes grow with parts × units."""
        return Path(self.checkpoint_dir) / f"{dataset}.sealed"

    def stage(self, dataset: str) -> Path:
        """Where workers stage the dataset's judged pieces and kept lines until parts are assembled."""
        return Path(self.checkpoint_dir) / "stage" / dataset

    @property
    def lock(self) -> Path:
        return Path(self.checkpoint_dir) / CHECKPOINT_LOCK

    @property
    def owner(self) -> Path:
        return Path(self.checkpoint_dir) / CHECKPOINT_OWNER


def planned_parts(part_index: int, part_lines: int, done: bool) -> int:
    """Parts sealed for tokenization: every part before the open one, and the last part once the dataset
    is done (an empty last part is never written)."""
    return part_index + (1 if done and part_lines else 0)


def ingest_bytes(sealed: list[list[Any]], part_bytes: int) -> int:
    """Bytes of the kept lines a dataset's state holds: its sealed parts' sizes (`[SHA-256, bytes]` each) and the open
    part's staged lines. Not the part files on disk: after a crash they hold parts sealed after the checkpoint (or a
    part it had not sealed yet), which the resume removes, so a count of them disagreed with `kept` and went down."""
    return sum(int(size) for _, size in sealed) + int(part_bytes)


SEALED_RECORD = 40  # a sealed part in <ds>.sealed: its SHA-256 (32 bytes) and its size (8 bytes, big-endian)


def sealed_records(sealed: list[list[Any]]) -> bytes:
    """`[SHA-256 hex, bytes]` entries as sealed-log records."""
    return b"".join(bytes.fromhex(sha) + int(size).to_bytes(8, "big") for sha, size in sealed)


def sealed_entry(entry: Any) -> bool:
    """A `[SHA-256 hex, bytes]` entry, as a sealed-log record holds one."""
    return (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and len(entry[0]) == 64
            and all(c in "0123456789abcdef" for c in entry[0]) and isinstance(entry[1], int)
            and not isinstance(entry[1], bool) and 0 <= entry[1] < 1 << 64)


def read_sealed(path: Path, count: int) -> list[list[Any]]:
    """The first `count` entries (`[SHA-256 hex, bytes]`) of a sealed log, or as many whole ones as it holds (a
    missing log: none). Records past `count` are an attempt's that no checkpoint acknowledged."""
    try:
        with open(path, "rb") as fh:
            whole = os.fstat(fh.fileno()).st_size // SEALED_RECORD
            data = fh.read(max(min(count, whole), 0) * SEALED_RECORD)
    except FileNotFoundError:
        return []
    return [[data[i:i + 32].hex(), int.from_bytes(data[i + 32:i + SEALED_RECORD], "big")]
            for i in range(0, len(data), SEALED_RECORD)]


@dataclass(frozen=True)
class Checkpoint:
    """The fields of a dataset checkpoint that readers use; an absent checkpoint reads as all zero."""
    raw: dict[str, Any]
    listed: bool = False  # its `sealed` is its own list (an earlier streamprep's), not the sealed log's records

    @classmethod
    def load(cls, path: Path) -> "Checkpoint":
        """The checkpoint at `path`, all zero when there is none yet. One that is not a JSON object raises
        ValueError: a reader (`status`, `audit`) says it is damaged rather than show its dataset as not started. Its
        `sealed` parts are the first `part_index` of the sealed log beside it, and its `inputs` the inputs file's (a
        checkpoint written before those files holds them itself). A log holding fewer than `part_index`, or a dataset
        under way without an inputs object, raises ValueError too: a resume restarts that dataset, and a reader showed
        its bytes as the log's few parts' (a complete run's dataset at 0.0 MB) or it as resumable. So does a `sealed`
        list inside it whose entries are not `[SHA-256 hex, bytes]` (a resume restarts that dataset too): `status`
        showed it complete and `verify` failed on a SHA-256 that was null (TypeError, exit 1)."""
        raw = _strict_json(path) or {}
        own = raw.get("sealed", [])
        if not isinstance(own, list) or not all(sealed_entry(s) for s in own):
            raise ValueError(f"{path.name}: its `sealed` (an earlier streamprep's) is not a list of [SHA-256 hex, "
                             f"bytes] entries ({orjson.dumps(own).decode()[:80]})")
        listed = "sealed" in raw
        if raw:
            beside, name = CheckpointLayout(path.parent), path.name.removesuffix(".json")
            count = raw.get("part_index", 0)
            count = count if isinstance(count, int) else 0
            log, inputs = beside.sealed_log(name), beside.inputs(name)
            raw = {"sealed": read_sealed(log, count), "inputs": read_json(inputs), **raw}
            if len(raw["sealed"]) < count:
                held = f"holds {len(raw['sealed'])} sealed parts" if log.exists() else "is missing"
                raise ValueError(f"{log.name} {held} and {path.name} counts {count}")
            if raw.get("consumed") and not raw.get("done") and not isinstance(raw["inputs"], dict):
                raise ValueError(f"{inputs.name} is missing or not an object and dataset {name!r} is under way")
        return cls(raw, listed)

    @property
    def started(self) -> bool:
        return bool(self.raw)

    @property
    def done(self) -> bool:
        return bool(self.raw.get("done"))

    @property
    def part_index(self) -> int:
        return int(self.raw.get("part_index", 0))

    @property
    def part_lines(self) -> int:
        return int(self.raw.get("part_lines", 0))

    @property
    def planned_parts(self) -> int:
        """See the module-level `planned_parts` (shared with checkpoints.IngestState.sealed_parts)."""
        return planned_parts(self.part_index, self.part_lines, self.done)

    @property
    def ingest_bytes(self) -> int:
        """See the module-level `ingest_bytes` (shared with checkpoints.IngestState.ingest_bytes)."""
        return ingest_bytes(self.raw.get("sealed") or [], self.raw.get("part_bytes", 0))


def completed_receipt(path: Path) -> dict[str, Any] | None:
    """The receipt at `path` if it records a completed shard, else None; ValueError if it is not a JSON object."""
    rec = _strict_json(path)
    return rec if rec is not None and rec.get("status") == "completed" else None


def _strict_json(path: Path) -> dict[str, Any] | None:
    """The JSON object at `path`, None when there is no file; ValueError naming it when there is one and it is not
    a JSON object (writes are atomic: a reader never sees half a file)."""
    try:
        data = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"{path.name} is not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path.name} is {json_kind(data)}, not an object")
    return data


def run_record(run_dir: Path) -> dict[str, Any]:
    """run.json as `status` and `audit` read it: NotARunDir (one line, exit 2) when there is none, or when it lacks
    what they read: the config and its datasets, a `checkpoint_dir` path."""
    record = read_json(RunLayout(run_dir).run_json)
    if not isinstance(record, dict):
        raise NotARunDir(f"{run_dir}: not a streamprep run directory (no readable run.json)")
    cfg = record.get("config")
    datasets = cfg.get("datasets") if isinstance(cfg, dict) else None
    if not (isinstance(datasets, list) and all(isinstance(d, dict) and isinstance(d.get("name"), str) for d in datasets)
            and isinstance(cfg.get("run"), dict) and isinstance(record.get("checkpoint_dir"), (str, type(None)))):
        raise NotARunDir(f"{RunLayout(run_dir).run_json} is damaged (no 'config' with its datasets, or a "
                         f"'checkpoint_dir' that is not a path); `streamprep ingest` with the run's config repairs it "
                         f"once it is removed")
    return record


@dataclass(frozen=True)
class RunLayout:
    """Every path of one run directory."""
    run_dir: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "run_dir", Path(self.run_dir))

    # top-level files
    @property
    def run_json(self) -> Path:
        return self.run_dir / RUN_JSON

    @property
    def manifest(self) -> Path:
        return self.run_dir / MANIFEST

    @property
    def blend(self) -> Path:
        return self.run_dir / BLEND

    @property
    def mixtures(self) -> Path:
        return self.run_dir / MIXTURES

    @property
    def lock(self) -> Path:
        return self.run_dir / LOCK

    # folders
    @property
    def tokenizer_dir(self) -> Path:
        return self.run_dir / TOKENIZER

    @property
    def tokenizer_json(self) -> Path:
        return self.tokenizer_dir / "tokenizer.json"

    @property
    def tokenizer_fingerprint(self) -> Path:
        return self.tokenizer_dir / "fingerprint.json"

    @property
    def tokenizer_training(self) -> Path:
        return self.tokenizer_dir / "training.json"

    @property
    def tokenizer_files(self) -> list[Path]:
        """Every file the run writes in tokenizer/ (whether or not this run has it): the manifest lists those there,
        and nothing else found in the folder, which `verify` reports as a stale file."""
        return [self.tokenizer_json, self.tokenizer_fingerprint, self.tokenizer_training,
                *(self.tokenizer_dir / side for side in TOKENIZER_SIDE_FILES)]

    @property
    def receipts_dir(self) -> Path:
        return self.run_dir / RECEIPTS

    @property
    def parquet_dir(self) -> Path:
        return self.run_dir / PARQUET

    @property
    def exports_scratch(self) -> Path:
        """parquet/.order: hidden files the exports read (parts' runs and columns), removed when they end."""
        return self.parquet_dir / EXPORTS_SCRATCH

    def part_columns(self, dataset: str, part: str) -> Path:
        """A tokenized part's texts and canonical metas, for its Parquet rows (`textshard.columns_file`)."""
        return self.exports_scratch / dataset / f"{part}{COLUMNS_SUFFIX}"

    @property
    def audit_dir(self) -> Path:
        return self.run_dir / AUDIT

    @property
    def audit_json(self) -> Path:
        return self.audit_dir / "audit.json"

    @property
    def hf_cache(self) -> Path:
        return self.run_dir / CACHE / "hf"

    @property
    def logs_dir(self) -> Path:
        return self.run_dir / LOGS

    @property
    def local_checkpoints(self) -> Path:
        return self.run_dir / CHECKPOINTS

    def only_a_start(self) -> bool:
        """Whether the run dir holds its `.lock`, no run.json, and else only what a job makes before it writes
        run.json, in order: the checkpoint dir's lock and owner file when that dir is the default `checkpoints/`
        inside it, and `logs/` holding at most the log lines a start writes (`_start_log`); and the temporary file
        of run.json or of that owner file, written at that moment (a kill then leaves it). Its job is starting, or
        stopped in that moment: the same command starts it again, with `--fresh` too, as status says; a folder
        holding anything else, or a lock file streamprep did not write (a user's own `.lock`, which the job would
        overwrite), is no such run's."""
        if not is_lock_file(self.lock) or os.path.lexists(self.run_json):
            return False
        names = {n for n in os.listdir(self.run_dir) if not is_tmp_name(n)}
        if not names <= {self.lock.name, self.logs_dir.name, self.local_checkpoints.name}:
            return False
        if self.logs_dir.name in names and not self._start_log():
            return False
        ckpt = self.local_checkpoints
        if ckpt.name not in names:
            return True
        marks = CheckpointLayout(ckpt)
        return ckpt.is_dir() and not ckpt.is_symlink() and \
            {n for n in os.listdir(ckpt) if not is_tmp_name(n)} <= {marks.lock.name, marks.owner.name}

    def _start_log(self) -> bool:
        """Whether logs/ holds at most the log a job writes before run.json: each line one of START_EVENTS. Its few
        lines never reach the rotation size, so a rotated backup (streamprep.log.1), an earlier run's log or a
        user's file is no start's: the job would append to it and rotate it away."""
        names = os.listdir(self.logs_dir) if self.logs_dir.is_dir() and not self.logs_dir.is_symlink() else None
        if names is None or not set(names) <= {LOG_NAME}:
            return False
        if not names:
            return True
        path = self.logs_dir / LOG_NAME
        if path.is_symlink() or not path.is_file():
            return False
        with open(path, "rb") as fh:
            while line := fh.readline(START_LINE_MAX):
                try:
                    event = orjson.loads(line)
                except orjson.JSONDecodeError:
                    return False
                if not line.endswith(b"\n") or not isinstance(event, dict) or event.get("event") not in START_EVENTS:
                    return False
        return True

    @property
    def tokenizer_backend(self) -> Path:
        """Which backend encodes the run's tokenizer and why (streamprep.backends.select): bookkeeping, not an
        artifact, so the outputs are the same bytes whichever backend ran."""
        return self.local_checkpoints / "tokenizer_backend.json"

    @property
    def tokenizer_backend_fallback(self) -> Path:
        """The first shard whose worker's identity check sent it to HF, and why."""
        return self.local_checkpoints / "tokenizer_backend_fallback.json"

    def checkpoints(self, record: dict[str, Any]) -> Path:
        """RUN_DIR/checkpoints unless the run's config named a `run.checkpoint_dir`: then run.json's
        `checkpoint_dir`, or RUN_DIR/checkpoints when that path is gone (a moved run dir). A copy of a run dir reads
        its own checkpoints, not the original's (run.json records their absolute path)."""
        local = self.local_checkpoints
        given = record.get("checkpoint_dir")
        if given and ((record.get("config") or {}).get("run") or {}).get("checkpoint_dir"):
            p = Path(given)
            p = p if p.is_absolute() else self.run_dir / p
            if p.is_dir() or not local.is_dir():
                return p
        return local

    # per dataset / part
    @property
    def ingest_root(self) -> Path:
        return self.run_dir / INGEST

    def ingest_dir(self, dataset: str) -> Path:
        return self.ingest_root / dataset

    def ingest_part(self, dataset: str, index: int) -> Path:
        return self.ingest_dir(dataset) / f"{part_name(index)}.jsonl"

    def rejects(self, dataset: str) -> Path:
        return self.run_dir / REJECTS / f"{dataset}.jsonl"

    def tokenized_dirs(self, dataset: str) -> tuple[Path, ...]:
        """The folders of what was tokenized from a dataset's parts: receipts, `.bin/.idx` shards, SFT shards."""
        return self.receipts_dir / dataset, self.run_dir / BINIDX / dataset, self.run_dir / SFT / dataset

    def receipt(self, dataset: str, part: int | str) -> Path:
        return self.receipts_dir / dataset / f"{_stem(part)}.json"

    def binidx_prefix(self, dataset: str, part: int | str) -> Path:
        return self.run_dir / BINIDX / dataset / f"{_stem(part)}_text_document"

    def sft_prefix(self, dataset: str, part: int | str) -> Path:
        return self.run_dir / SFT / dataset / _stem(part)
