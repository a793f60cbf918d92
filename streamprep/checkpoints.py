"""Per-dataset ingest checkpoints and the repair that makes outputs agree with them on resume.

A checkpoint describes a consistent prefix of a dataset's outputs:
    ingest/<ds>/part-NNNNN.jsonl   the sealed parts `[0, part_index)`, each written whole (atomic), with
                                   their SHA-256 and size in `sealed`, kept in <checkpoint_dir>/<ds>.sealed
    <checkpoint_dir>/<ds>.sealed   (`part_index` records of `SEALED_RECORD` bytes, append-only: a checkpoint written
                                   by streamprep before it has `sealed` inside it, which a resume still reads and
                                   moves into this log)
    <checkpoint_dir>/stage/<ds>/   the kept lines of the open part: `open_pieces` [piece, first line, lines]
    rejects/<ds>.jsonl             (`rejects_bytes` bytes, append-only)
    <checkpoint_dir>/<ds>.dedup    (`dedup_count` 32-byte digests of kept texts, append-only; with P dedup
                                   holders one log each, `<ds>.dedup.<p>-of-<P>`, `dedup_counts[p]` digests)
    <checkpoint_dir>/<ds>.near     (`near_dedup_bytes` of kept texts' MinHash records, when near_dedup is on)
    <checkpoint_dir>/<ds>.inputs   (`inputs`, written once a job before its first checkpoint: a checkpoint written
                                   by streamprep before it has `inputs` inside it, which a resume still reads)
Ingest writes and fsyncs all of these *before* it atomically replaces the checkpoint, so a checkpoint
never runs ahead of its data.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from streamprep import atomic, logs
from streamprep.layout import (SEALED_RECORD, Checkpoint, CheckpointLayout, RunLayout, ingest_bytes, part_index_of,
                               planned_parts, read_json, read_sealed, sealed_entry, sealed_records)

VERSION = 3  # 2: positions name a unit of the plan (streamprep.units); 3: parts written whole from staged pieces
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
    part_index: int = 0                      # current (open) part: parts before it are sealed
    part_lines: int = 0                      # kept lines of the open part, staged in `open_pieces`
    part_bytes: int = 0
    open_pieces: list[list[Any]] = field(default_factory=list)  # [staged piece, first kept line, lines]
    sealed: list[list[Any]] = field(default_factory=list)       # [SHA-256, bytes] of each sealed part, in order;
    #                                                             saved in <ds>.sealed (save), not in the checkpoint
    rejects_bytes: int = 0
    rejects_sampled: dict[str, int] = field(default_factory=dict)  # lines written per failed_check (bounded sample)
    dedup_count: int = 0
    dedup_counts: list[int] = field(default_factory=list)  # per dedup holder when the run has several
    near_dedup_bytes: int = 0
    stats: dict[str, Any] = field(default_factory=dict)  # audit aggregates (streamprep.stats)
    done: bool = False
    started_at: float = field(default_factory=time.time)
    updated_at: float = 0.0
    inputs: dict[str, Any] | None = None  # the source's identity (file sizes/hashes), checked on resume;
    #                                       saved in <ds>.inputs (save_inputs), not with the rest (save)

    def sealed_parts(self) -> int:
        """Parts that are complete and checkpointed: every part before the open one, and the last part once
        the dataset is done (an empty last part is never written)."""
        return planned_parts(self.part_index, self.part_lines, self.done)

    def ingest_bytes(self) -> int:
        """See layout.ingest_bytes (shared with layout.Checkpoint.ingest_bytes, which `status` reads)."""
        return ingest_bytes(self.sealed, self.part_bytes)

    def sealed_text_bytes(self) -> int:
        """A lower bound of the kept text in the sealed parts: the kept text less the open lines' bytes (staged,
        in no part yet). A line holds its text JSON-encoded, never in fewer bytes than the text's UTF-8."""
        return self.kept_text_bytes - self.part_bytes

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
    def inputs(self) -> Path:
        return CheckpointLayout(self.checkpoint_dir).inputs(self.dataset)

    @property
    def sealed_log(self) -> Path:
        return CheckpointLayout(self.checkpoint_dir).sealed_log(self.dataset)

    @property
    def dedup(self) -> Path:
        return CheckpointLayout(self.checkpoint_dir).dedup_log(self.dataset)

    def dedup_logs(self, state: IngestState) -> list[tuple[Path, int]]:
        """The exact-dedup logs `state` describes and the digests each holds: one log, or one per dedup holder."""
        counts = state.dedup_counts
        if not counts:
            return [(self.dedup, state.dedup_count)]
        layout = CheckpointLayout(self.checkpoint_dir)
        return [(layout.dedup_log(self.dataset, p, len(counts)), n) for p, n in enumerate(counts)]

    @property
    def near_dedup(self) -> Path:
        return CheckpointLayout(self.checkpoint_dir).near_log(self.dataset)

    @property
    def stage(self) -> Path:
        return CheckpointLayout(self.checkpoint_dir).stage(self.dataset)

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


def _claim_lines(checkpoint_dir: Path) -> tuple[str, str] | None:
    """The owner file's run id (its first line) and the rest, less its final newline: the run dir (a path may hold a
    newline); None: no owner file. Read as the bytes `claim` wrote: read as text, a '\r' in the run dir's name
    became '\n', so its own claim never named it again."""
    path = CheckpointLayout(checkpoint_dir).owner
    if not path.is_file():
        return None
    run_id, _, rest = path.read_bytes().partition(b"\n")
    return run_id.decode("utf-8", errors="replace").strip(), os.fsdecode(rest.removesuffix(b"\n"))


def owner_of(checkpoint_dir: Path) -> str | None:
    """The run id `claim` wrote in `checkpoint_dir` (None: none, or empty)."""
    lines = _claim_lines(checkpoint_dir)
    return (lines[0] or None) if lines else None


def claimed_from(checkpoint_dir: Path) -> Path | None:
    """The run dir whose job wrote the claim in `checkpoint_dir` (None: no claim, or one an earlier streamprep
    wrote, naming none): a claim its own job left, killed before it wrote run.json, is told from another run's."""
    lines = _claim_lines(checkpoint_dir)
    return Path(lines[1]) if lines and lines[1] else None


def claim(checkpoint_dir: Path, run_id: str, run_dir: Path) -> str | None:
    """Mark `checkpoint_dir` as holding run `run_id`'s checkpoints, written from `run_dir`; returns the other run's
    id if it already holds another run's (two runs with the same dataset names would overwrite each other's
    checkpoints)."""
    owner = owner_of(checkpoint_dir)
    if owner is None:
        atomic.write_bytes(CheckpointLayout(checkpoint_dir).owner,
                           f"{run_id}\n".encode() + os.fsencode(run_dir) + b"\n")
    return owner if owner not in (None, run_id) else None


def _is_ours(path: Path) -> bool:
    try:
        data = orjson.loads(path.read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return False
    return isinstance(data, dict) and data.get("writer") == WRITER


def save(files: DatasetFiles, state: IngestState) -> None:
    """Write `state` but its `inputs` (the bytes of `to_json()` less them, serialized without its deep copy:
    `dataclasses.asdict` over the open pieces of a part cost ~2.5 ms a save at 1 000 of them, the driver's largest
    cost per unit). The inputs are `save_inputs`'s: with them, every save rewrote every file's identity, and a
    dataset of 8 000 small files wrote 5.5 GB of checkpoints. The sealed parts are appended to the sealed log (and
    fsynced) first, the checkpoint keeping their count (`part_index`): listed in it, they were rewritten by every save
    (2 000 one-record parts: 145 kB a checkpoint, 166 MB written)."""
    state.updated_at = time.time()
    have = max(_size(files.sealed_log), 0) // SEALED_RECORD  # repair cut it to the checkpoint's count
    if have < len(state.sealed):
        with atomic.naming(files.sealed_log), open(files.sealed_log, "ab") as fh:
            fh.write(sealed_records(state.sealed[have:]))
            fh.flush()
            os.fsync(fh.fileno())
    shallow = {"version": VERSION, "writer": WRITER, **{f.name: getattr(state, f.name) for f in _STATE_FIELDS}}
    atomic.write_bytes(files.checkpoint, orjson.dumps(shallow, option=orjson.OPT_SORT_KEYS) + b"\n")


def save_inputs(files: DatasetFiles, inputs: dict[str, Any] | None) -> None:
    """Write the dataset's input identity (atomic), before the job's first `save`: the checkpoint that follows
    reads its inputs from here."""
    atomic.write_bytes(files.inputs, orjson.dumps(inputs, option=orjson.OPT_SORT_KEYS) + b"\n")


_STATE_FIELDS = [f for f in dataclasses.fields(IngestState) if f.name not in ("inputs", "sealed")]


def _size(p: Path) -> int:
    return p.stat().st_size if p.exists() else -1


def _truncate(p: Path, size: int) -> None:
    with open(p, "rb+") as fh:
        fh.truncate(size)
        fh.flush()
        os.fsync(fh.fileno())


def _clear(files: DatasetFiles) -> None:
    """The dataset's ingest outputs, and what was tokenized from them: a restart may seal fewer parts, and the
    receipts and shards of the others would stay behind, stale (`verify` named them, a re-run never removed them)."""
    for p in files.parts():
        p.unlink()
    for folder in RunLayout(files.run_dir).tokenized_dirs(files.dataset):
        shutil.rmtree(folder, ignore_errors=True)
    layout = CheckpointLayout(files.checkpoint_dir)
    for p in (files.rejects, *layout.dedup_logs(files.dataset), files.near_dedup, files.checkpoint,
              layout.plan(files.dataset), files.inputs, files.sealed_log):
        p.unlink(missing_ok=True)
    shutil.rmtree(files.stage, ignore_errors=True)


def _logs(files: DatasetFiles, state: IngestState) -> tuple[tuple[Path, int], ...]:
    """The append-only logs and the byte length `state` describes."""
    return ((files.rejects, state.rejects_bytes), *((path, n * DIGEST) for path, n in files.dedup_logs(state)),
            (files.near_dedup, state.near_dedup_bytes), (files.sealed_log, state.part_index * SEALED_RECORD))


def _missing(files: DatasetFiles, state: IngestState, listed: bool) -> list[str]:
    """What the checkpoint needs and the disk lacks (cannot be repaired by truncation). `listed`: its sealed log is
    to be written from the checkpoint's list (`repair`), not read."""
    short = [f"{path.name} has {max(_size(path), 0)} bytes, checkpoint says {want}"
             for path, want in _logs(files, state) if want and _size(path) < want
             and not (listed and path == files.sealed_log)]
    short += [f"sealed {files.part(i).name} is missing or not {size} bytes" for i, (_, size) in enumerate(state.sealed)
              if _size(files.part(i)) != size]
    short += [f"staged piece {name} is missing" for name, _, _ in state.open_pieces
              if not all((files.stage / (name + ext)).is_file() for ext in (".kept", ".kept.off"))]
    return short


COUNTERS = ("consumed", "kept", "rejected", "kept_text_bytes", "part_index", "part_lines", "part_bytes",
            "rejects_bytes", "dedup_count", "near_dedup_bytes")


def _piece(entry: Any) -> bool:
    """An `open_pieces` entry as a job writes it: [staged piece name, first kept line, lines]."""
    return isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and \
        all(type(n) is int and n >= 0 for n in entry[1:])


def _unfit(files: DatasetFiles, state: IngestState, listed: bool) -> str | None:
    """What makes a checkpoint of the right types one no job wrote (a damaged or edited file), which a resume would
    follow into skipping records without a word: a negative or 64-bit-overflowing count, a part index its sealed
    parts do not match, a position that is not a place in its plan (the plan empty, missing or unreadable, or the unit
    past its end). A dataset under way without its plan cannot be resumed: planned again, maybe with another
    `unit_mb`, its units are not the ones the position counts (records were lost or read twice). `listed`: the
    checkpoint lists its sealed parts (an earlier streamprep's), which must then be `[SHA-256, bytes]` each, as many
    as it counts."""
    bad = next((k for k in COUNTERS if not 0 <= getattr(state, k) < 1 << 63), None)
    if bad is not None:
        return f"{bad} is {getattr(state, bad)}"
    if listed and not all(sealed_entry(s) for s in state.sealed):
        return f"sealed {str(state.sealed)[:80]}"
    if listed and len(state.sealed) != state.part_index:  # a sealed log short of it is a missing output (_missing)
        return f"part_index {state.part_index} with {len(state.sealed)} sealed parts"
    if not all(_piece(p) for p in state.open_pieces):  # the resume unpacked one, exit 1 on every re-run
        return f"open_pieces {str(state.open_pieces)[:80]}"
    if not all(type(c) is int and c >= 0 for c in state.dedup_counts):  # the dedup holders compared them
        return f"dedup_counts {str(state.dedup_counts)[:80]}"
    pos = state.position
    plan_path = CheckpointLayout(files.checkpoint_dir).plan(files.dataset)
    plan = read_json(plan_path) if state.consumed else None
    if state.consumed and not state.done and plan is None:
        return f"its plan {plan_path.name} is missing or unreadable"
    if pos is None:
        return None
    if any(not isinstance(pos.get(k, 0), int) or isinstance(pos.get(k, 0), bool) or pos.get(k, 0) < 0
           for k in ("unit", "piece", "base")):
        return f"position {str(pos)[:80]}"
    if plan is not None and (not isinstance(plan, list) or not plan or not all(isinstance(u, dict) for u in plan)
                             or pos.get("unit", 0) > len(plan)):
        return f"position unit {pos.get('unit', 0)} in a plan of {len(plan) if isinstance(plan, list) else 'no'} units"
    return None


def _recorded_inputs(files: DatasetFiles) -> dict[str, Any] | None:
    """The identity in the dataset's inputs file, if it holds one (an object: every job writes one)."""
    inputs = read_json(files.inputs)  # None when missing or unreadable
    return inputs if isinstance(inputs, dict) else None


def _read_inputs(files: DatasetFiles, state: IngestState, raw: dict[str, Any]) -> str | None:
    """Set `state.inputs` from the dataset's inputs file, unless the checkpoint holds them (written by a streamprep
    before the file). What makes the state unfit, if anything: a dataset under way whose inputs file is missing or
    not an object (null too: every job writes an object) cannot tell whether its files changed since (its positions
    are byte offsets into them)."""
    if "inputs" in raw:
        return None
    state.inputs = _recorded_inputs(files)
    if state.inputs is None and state.consumed and not state.done:  # null too: as "nothing recorded", no check
        return f"its inputs file {files.inputs.name} is missing, unreadable or not an object"
    return None


@dataclass
class Loaded:
    """A dataset's checkpoint as read, nothing repaired yet: the ingest first checks its input files against
    `state.inputs`, so an attempt it refuses (a changed file) writes and deletes nothing, and the same command again
    is refused again (a restart that cleared the dataset first forgot the inputs: the next attempt read the new
    files, exit 0)."""
    state: IngestState
    restart: tuple[str, dict[str, Any]] | None = None  # the dataset starts over: why (the warning and its fields)
    listed: bool = False  # the checkpoint lists its sealed parts: `repair` writes the sealed log from the list


def load_checkpoint(files: DatasetFiles) -> Loaded:
    """Read the dataset's checkpoint and judge it against its files (reads only; `repair` acts). A restart keeps
    the inputs recorded, if any (the run's other datasets, and its dedup against them, read the files as they
    were): also one for an unreadable or missing checkpoint, whose `<ds>.inputs` is still there."""
    fresh = IngestState(dataset=files.dataset)
    if not files.checkpoint.exists():
        if files.parts() or files.rejects.exists() or CheckpointLayout(files.checkpoint_dir).dedup_logs(files.dataset) \
                or files.near_dedup.exists() or files.sealed_log.exists() \
                or files.stage.exists():
            fresh.inputs = _recorded_inputs(files)
            return Loaded(fresh, ("no checkpoint, removing partial outputs and starting over", {}))
        return Loaded(fresh)
    try:
        raw = orjson.loads(files.checkpoint.read_bytes())
        state = IngestState.from_json(raw)
    except (orjson.JSONDecodeError, ValueError, TypeError) as exc:  # also a wrong shape (IngestState.from_json)
        fresh.inputs = _recorded_inputs(files)
        return Loaded(fresh, ("unreadable checkpoint, restarting dataset from scratch",
                              {"checkpoint": str(files.checkpoint), "error": str(exc)[:200]}))
    listed = "sealed" in raw  # else the sealed log holds them
    # the inputs first: a restart keeps them, so the job still refuses changed input files
    unfit = _read_inputs(files, state, raw) or _unfit(files, state, listed)
    fresh.inputs = state.inputs
    if unfit:
        return Loaded(fresh, ("checkpoint does not hold a state a job writes, restarting dataset from scratch",
                              {"checkpoint": str(files.checkpoint), "problem": unfit}))
    if not listed:  # as many as its log holds: one short of part_index is _missing's
        state.sealed = read_sealed(files.sealed_log, state.part_index)
    short = _missing(files, state, listed)
    if short:
        return Loaded(fresh, ("outputs shorter than checkpoint; restarting dataset from scratch", {"problems": short}))
    return Loaded(state, listed=listed)


def read_checkpoint(run_dir: Path, ckpt_dir: Path, name: str, record: dict[str, Any]) -> Checkpoint:
    """A dataset's checkpoint for a reader (`status`, `audit`). Missing from a complete run whose dataset ran (its
    plan, parts or rejects are there) raises ValueError (damaged): its dataset showed as not started, all zeros,
    and `audit` rewrote the report with them. (A running job writes a part before its first checkpoint; an optional
    dataset skipped has none of them; one that rejected every record has no part.) So does one a resume starts over
    as no job's (`load_checkpoint`: its version, a field's type, a count out of range, a position not in its plan):
    `status` showed `{}` as a dataset not started and `kept: -5` as is, in a run it called complete, and `verify`
    passed them. Its outputs are not judged here (`_missing`): a running job removes the staged pieces its previous
    checkpoint named."""
    layout = CheckpointLayout(ckpt_dir)
    path = layout.checkpoint(name)
    cp = Checkpoint.load(path)
    raw = read_json(path)  # the file as it is (None: removed since by a running job's restart of the dataset)
    if isinstance(raw, dict):
        files = DatasetFiles(run_dir, ckpt_dir, name)
        try:
            state = IngestState.from_json(raw)
            unfit = _read_inputs(files, state, raw) or _unfit(files, state, "sealed" in raw)
        except (ValueError, TypeError) as exc:
            unfit = str(exc)
        if unfit is not None:
            raise ValueError(f"{path.name} does not hold a state a job writes ({unfit})")
    run = RunLayout(run_dir)
    if not cp.started and record.get("status") == "complete" and (
            layout.plan(name).exists() or run.rejects(name).exists() or any(run.ingest_dir(name).glob("part-*.jsonl"))):
        raise ValueError(f"{path.name} is missing, and dataset {name!r} ran (its plan, parts or rejects are there)")
    return cp


def repair(files: DatasetFiles, loaded: Loaded) -> IngestState:
    """Bring the dataset's files back to exactly what its loaded checkpoint describes:

    - parts from `part_index` on      -> removed (sealed after the last checkpoint; sealed again on resume);
    - rejects / dedup / near logs      -> truncated to the checkpoint's lengths;
    - staged pieces not in `open_pieces` -> removed (judged again on resume);
    - a sealed part of another size, a log or an open piece shorter or missing, or no / an unreadable checkpoint
                                        -> the dataset starts from scratch (its old outputs removed).
    Every action is logged.
    """
    files.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    state = loaded.state
    if loaded.restart is not None:
        event, fields = loaded.restart
        log.warning(event, dataset=files.dataset, **fields)
        _clear(files)
        if state.inputs is not None:  # kept on disk too: a restart stopped before its first checkpoint still has them
            save_inputs(files, state.inputs)
        return state
    if loaded.listed:  # an earlier streamprep's checkpoint: its list moves to the log the next save appends to
        atomic.write_bytes(files.sealed_log, sealed_records(state.sealed))
        # and out of the checkpoint, which a dataset done saves no more: both held the records, the checkpoint's
        # winning, so a part refused on the log's record (tokenize._check_input: "delete … <ds>.sealed") was
        # refused again after the log was deleted, the next resume writing it again from the list
        raw = orjson.loads(files.checkpoint.read_bytes())
        del raw["sealed"]
        atomic.write_bytes(files.checkpoint, orjson.dumps(raw, option=orjson.OPT_SORT_KEYS) + b"\n")
    for extra in files.parts():
        if part_index_of(extra) >= state.part_index:
            log.warning("removing part sealed after the last checkpoint", dataset=files.dataset, part=extra.name)
            extra.unlink()
    for path, want in _logs(files, state):
        if _size(path) > want:
            log.info("truncating to checkpoint", dataset=files.dataset, file=path.name, size=_size(path), to=want)
            _truncate(path, want)
    keep = {name + ext for name, _, _ in state.open_pieces for ext in (".kept", ".kept.off")}
    for staged in files.stage.iterdir() if files.stage.is_dir() else ():
        if staged.name not in keep:
            staged.unlink()
    if state.consumed:
        log.info("resuming dataset", dataset=files.dataset, consumed=state.consumed, kept=state.kept,
                 part=state.part_index, part_lines=state.part_lines, done=state.done)
    return state
