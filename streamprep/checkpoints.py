"""Per-dataset ingest checkpoints and the repair that makes outputs agree with them on resume.

A checkpoint describes a consistent prefix of three append-only files:
    ingest/<ds>/part-NNNNN.jsonl   (the current part: `part_bytes` bytes, `part_lines` lines)
    rejects/<ds>.jsonl             (`rejects_bytes` bytes)
    <checkpoint_dir>/<ds>.dedup    (`dedup_count` 32-byte digests of kept texts)
    <checkpoint_dir>/<ds>.near     (`near_dedup_bytes` of kept texts' MinHash records, when near_dedup is on)
Ingest appends and fsyncs all three *before* it atomically replaces the checkpoint, so a checkpoint
never runs ahead of its data. `part_start` snapshots the state when the current part began, the last
point from which a damaged part can be rebuilt.
"""
from __future__ import annotations

import copy
import dataclasses
import os
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from streamprep import atomic, logs
from streamprep.layout import CheckpointLayout, RunLayout, planned_parts

VERSION = 2  # 2: positions name a unit of the dataset's plan (streamprep.units)
DIGEST = 32
WRITER = "streamprep"  # the `writer` field: a checkpoint without it was not written by us and is never touched
log = logs.get("checkpoint")


@dataclass
class IngestState:
    dataset: str
    position: dict[str, Any] | None = None   # where the source continues (None = from the start)
    consumed: int = 0                        # items taken from the source (records + parse failures)
    kept: int = 0
    rejected: int = 0
    kept_text_bytes: int = 0                 # for the size_mb cap
    part_index: int = 0                      # current (open) part
    part_lines: int = 0
    part_bytes: int = 0
    rejects_bytes: int = 0
    rejects_sampled: dict[str, int] = field(default_factory=dict)  # lines written per failed_check (bounded sample)
    dedup_count: int = 0
    near_dedup_bytes: int = 0
    stats: dict[str, Any] = field(default_factory=dict)  # audit aggregates (streamprep.stats)
    done: bool = False
    part_start: dict[str, Any] | None = None
    started_at: float = field(default_factory=time.time)
    updated_at: float = 0.0
    inputs: dict[str, Any] | None = None  # the source's identity (file sizes/hashes), checked on resume

    def sealed_parts(self) -> int:
        """Parts that are complete and checkpointed: every part before the open one, and the last part once
        the dataset is done (an empty last part is never written)."""
        return planned_parts(self.part_index, self.part_lines, self.done)

    def snapshot(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("part_start")
        d.pop("inputs")  # constant for the run; not copied into every part_start
        return copy.deepcopy(d)

    def to_json(self) -> dict[str, Any]:
        return {"version": VERSION, "writer": WRITER, **dataclasses.asdict(self)}

    @classmethod
    def from_json(cls, d: Any) -> "IngestState":
        if not isinstance(d, dict):
            raise ValueError(f"a JSON {type(d).__name__}, not an object")
        if d.get("version") != VERSION:
            raise ValueError(f"unsupported checkpoint version {d.get('version')}")
        hints = typing.get_type_hints(cls)
        for k, v in d.items():
            if k in hints and not _has_type(v, hints[k]):
                raise ValueError(f"'{k}' is a {type(v).__name__} ({str(v)[:40]})")
        return cls(**{k: v for k, v in d.items() if k in hints})

    @classmethod
    def from_snapshot(cls, snap: dict[str, Any]) -> "IngestState":
        st = cls(**copy.deepcopy(snap))
        st.part_start = copy.deepcopy(snap)
        return st


@dataclass(frozen=True)
class DatasetFiles:
    """Where one dataset's ingest outputs live."""

    run_dir: Path
    checkpoint_dir: Path
    dataset: str

    @property
    def ingest_dir(self) -> Path:
        return RunLayout(self.run_dir).ingest_dir(self.dataset)

    def part(self, index: int) -> Path:
        return RunLayout(self.run_dir).ingest_part(self.dataset, index)

    @property
    def rejects(self) -> Path:
        return RunLayout(self.run_dir).rejects(self.dataset)

    @property
    def checkpoint(self) -> Path:
        return CheckpointLayout(self.checkpoint_dir).checkpoint(self.dataset)

    @property
    def dedup(self) -> Path:
        return CheckpointLayout(self.checkpoint_dir).dedup_log(self.dataset)

    @property
    def near_dedup(self) -> Path:
        return CheckpointLayout(self.checkpoint_dir).near_log(self.dataset)

    def parts(self) -> list[Path]:
        return sorted(self.ingest_dir.glob("part-*.jsonl")) if self.ingest_dir.is_dir() else []


def _has_type(value: Any, hint: Any) -> bool:
    """isinstance against a field annotation (`int`, `dict[str, Any] | None`, ...); an int is a float too."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    for t in options:
        t = typing.get_origin(t) or t
        if t is type(None):
            ok = value is None
        elif t is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, t) and not (t is int and isinstance(value, bool))
        if ok:
            return True
    return False


def foreign_checkpoints(checkpoint_dir: Path, run_dir: Path, datasets: list[str]) -> list[Path]:
    """Files at our checkpoint names in an external `checkpoint_dir` that streamprep did not write.

    Inside the run dir every file is ours (an unreadable one is repaired); outside it, a file that is not a
    checkpoint of ours (e.g. an input `c4.json`) must be neither parsed into a state nor deleted nor replaced.
    """
    if Path(checkpoint_dir).resolve().is_relative_to(Path(run_dir).resolve()):
        return []
    found = []
    for name in datasets:
        files = DatasetFiles(run_dir, checkpoint_dir, name)
        found += [p for p in (files.checkpoint, files.dedup) if p.is_symlink()]
        if files.checkpoint.exists() and not files.checkpoint.is_symlink() and not _is_ours(files.checkpoint):
            found.append(files.checkpoint)
    return found


def claim(checkpoint_dir: Path, run_id: str) -> str | None:
    """Mark `checkpoint_dir` as holding run `run_id`'s checkpoints; returns the other run's id if it already
    holds another run's (two runs with the same dataset names would overwrite each other's checkpoints)."""
    path = CheckpointLayout(checkpoint_dir).owner
    owner = path.read_text().strip() if path.is_file() else None
    if owner is None:
        atomic.write_bytes(path, run_id.encode() + b"\n")
    return owner if owner not in (None, run_id) else None


def _is_ours(path: Path) -> bool:
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return False
    return isinstance(data, dict) and data.get("writer") == WRITER


def save(files: DatasetFiles, state: IngestState) -> None:
    state.updated_at = time.time()
    atomic.write_bytes(files.checkpoint, orjson.dumps(state.to_json(), option=orjson.OPT_SORT_KEYS) + b"\n")


def _size(p: Path) -> int:
    return p.stat().st_size if p.exists() else -1


def _truncate(p: Path, size: int) -> None:
    with open(p, "rb+") as fh:
        fh.truncate(size)
        fh.flush()
        os.fsync(fh.fileno())


def _clear(files: DatasetFiles) -> None:
    for p in files.parts():
        p.unlink()
    for p in (files.rejects, files.dedup, files.near_dedup, files.checkpoint,
              CheckpointLayout(files.checkpoint_dir).plan(files.dataset)):
        p.unlink(missing_ok=True)


def _logs(files: DatasetFiles, snap: dict[str, Any]) -> tuple[tuple[Path, int], ...]:
    """The append-only logs and the byte length `snap` describes."""
    return ((files.rejects, snap["rejects_bytes"]), (files.dedup, snap["dedup_count"] * DIGEST),
            (files.near_dedup, snap.get("near_dedup_bytes", 0)))


def _consistent(files: DatasetFiles, snap: dict[str, Any]) -> list[str]:
    """Files shorter than `snap` says (cannot be repaired by truncation)."""
    short = []
    for path, want in _logs(files, snap):
        if want and _size(path) < want:
            short.append(f"{path.name} has {max(_size(path), 0)} bytes, checkpoint says {want}")
    for i in range(snap["part_index"]):
        if not files.part(i).exists():
            short.append(f"completed {files.part(i).name} is missing")
    return short


def load_and_repair(files: DatasetFiles) -> IngestState:
    """Load the dataset's checkpoint and bring its files back to exactly what it describes.

    - part longer than checkpointed  -> truncate back;
    - part shorter, torn or missing  -> rebuild it from `part_start` (the state when it began);
    - rejects / dedup log longer      -> truncate; shorter -> back to `part_start`, or restart the dataset;
    - parts beyond the current one    -> removed (written after the last checkpoint);
    - no / unreadable checkpoint      -> start the dataset from scratch (its old outputs removed).
    Every action is logged.
    """
    files.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    if not files.checkpoint.exists():
        if files.parts() or files.rejects.exists() or files.dedup.exists() or files.near_dedup.exists():
            log.warning("no checkpoint, removing partial outputs and starting over", dataset=files.dataset)
            _clear(files)
        return _fresh(files.dataset)
    try:
        state = IngestState.from_json(orjson.loads(files.checkpoint.read_bytes()))
    except (orjson.JSONDecodeError, ValueError, TypeError) as exc:  # also a wrong shape (IngestState.from_json)
        log.warning("unreadable checkpoint, restarting dataset from scratch", dataset=files.dataset,
                    checkpoint=str(files.checkpoint), error=str(exc)[:200])
        _clear(files)
        return _fresh(files.dataset)

    part = files.part(state.part_index)
    size = _size(part)
    if size > state.part_bytes:
        log.warning("part has more than the checkpoint describes: truncating", dataset=files.dataset,
                    part=part.name, size=size, checkpoint_bytes=state.part_bytes, checkpoint_lines=state.part_lines)
        _truncate(part, state.part_bytes)
    elif size < state.part_bytes or (state.part_bytes and not _ends_with_newline(part)):
        log.warning("part is shorter than checkpointed or torn: rebuilding it from its start", dataset=files.dataset,
                    part=part.name, size=max(size, 0), checkpoint_bytes=state.part_bytes)
        inputs = state.inputs
        state = IngestState.from_snapshot(state.part_start or _fresh(files.dataset).snapshot())
        state.inputs = inputs
        part.unlink(missing_ok=True)
    for extra in files.parts():
        if int(extra.stem.split("-")[1]) > state.part_index:
            log.warning("removing part written after the last checkpoint", dataset=files.dataset, part=extra.name)
            extra.unlink()
    short = _consistent(files, state.snapshot())
    if short:
        log.warning("outputs shorter than checkpoint; restarting dataset from scratch", dataset=files.dataset,
                    problems=short)
        _clear(files)
        return _fresh(files.dataset)
    for path, want in _logs(files, state.snapshot()):
        if _size(path) > want:
            log.info("truncating to checkpoint", dataset=files.dataset, file=path.name, size=_size(path), to=want)
            _truncate(path, want)
    if state.consumed:
        log.info("resuming dataset", dataset=files.dataset, consumed=state.consumed, kept=state.kept,
                 part=state.part_index, part_lines=state.part_lines, done=state.done)
    return state


def _ends_with_newline(p: Path) -> bool:
    with open(p, "rb") as fh:
        fh.seek(-1, os.SEEK_END)
        return fh.read(1) == b"\n"


def _fresh(dataset: str) -> IngestState:
    st = IngestState(dataset=dataset)
    st.part_start = st.snapshot()
    return st
