"""What a worker does with a piece of a dataset: judge it, then write its lines once the driver has decided.

A *piece* is one unit a worker reads itself (streamprep.units: a range or row group of a file, a whole file, a
file of an `hf://` snapshot, which the worker downloads), or one QC call of batches the driver read (the `stream`
unit of a source without a file list). Two calls per piece, both in a QC worker process (or Ray actor):

    judge_piece     read (or take) the items, screen and judge them, stage the judged columns on disk
                    (`<stage>.judged`) and return a `Summary`: per item its kind, digest, kept text
                    bytes and failed check; no record bytes go back to the driver
    finalize_piece  given the driver's `Decision` (ordinals, dedup and near-dedup verdicts, which rejects
                    are sampled, where a cap stopped), write the piece's kept ingest lines (`<stage>.kept`
                    + `.kept.off`, byte offsets) and return its reject lines and audit stats
    assemble_part   concatenate the kept lines of the pieces that cover one part into the part file
                    (atomic) and return its SHA-256

Kept lines are built here with a placeholder ordinal (SENTINEL_INDEX) and reject reasons with placeholder
line numbers (units.LINE_MARK): only the driver knows what came before the piece in the dataset.
"""
from __future__ import annotations

import hashlib
import importlib
import pickle
import sys
from bisect import bisect_left
from collections import Counter
from concurrent import futures
from itertools import chain, repeat
from typing import Any, NamedTuple

import numpy as np
import orjson

import quality
from quality import QualitySettings, load_quality_settings, near_dedup
from quality.dedup import DIGEST_SIZE, NO_DIGEST, digest_words, duplicate_reason, prefix_order
from quality.lines import escaped
from streamprep import atomic, registry, stats, units
from streamprep.config import ConfigError
from streamprep.modes import Mode
from streamprep.sources.base import (REJECT_EXCERPT, BadRecord, ReaderError, SourceError, excerpt_of, one_line,
                                     read_failure)
from streamprep.sources.local import REST_OF, _content_fault, no_ranges
from streamprep.units import Unit

SOURCE_KEYS = ("id", "url", "license", "licence")
SENTINEL_INDEX = -9223372036854763463  # a kept line's `source.index` until the driver knows its ordinal
_SENTINEL = b'"index":%d' % SENTINEL_INDEX
BAD, REJECTED, KEPT = 0, 1, 2  # an item's kind in a Summary: unreadable, rejected by QC, kept by QC


class ItemColumns(NamedTuple):
    """One batch's judged items in order, one list per field. `bad`: a BadRecord's reason (None for a judged
    record); `check`: its failed_check. `row`: a kept record's ingest line with SENTINEL_INDEX; `meta`: QC's, but
    None for a kept record whose meta the audit's stats do not read and its row holds as it is (`row_meta`: every
    gate off, say; a meta dict per record was half of what a piece's scratch file cost to write and read);
    `chars`: the record's length in characters, for the audit (the kept text's; a reject's, the text it would have
    kept, not its excerpt's; a BadRecord's bounded `raw`'s); `excerpt`: what a reject line shows (None for a kept
    record whose excerpt is its text's start); `extra`: the record's source keys (id, url, licence)."""

    bad: list
    check: list
    keep: list
    row: list
    meta: list
    digest: list
    chars: list
    text_bytes: list
    excerpt: list
    extra: list


class Summary(NamedTuple):
    """What the driver decides a piece on, as columns (one bytes or array each, not an object per record, so the
    driver's unpickling and deciding cost no Python object per record): `kinds` (one byte per item), `digests`
    (32 bytes per judged item, back to back; `NO_DIGEST` for a text with none), `text_bytes` (int64 per kept
    item), `checks` (per item not kept), near-dedup `signatures` (per judged item, or None), `rest_failed`:
    a unit whose file stopped decoding (its file's later units are skipped), and `order`: with exact dedup, the
    judged items sorted by digest prefix (`quality.dedup.prefix_order`, uint32), the one sort the decider needs,
    done here so that the driver does not (~a fifth of its cost per record for a 1 M-record unit)."""

    kinds: bytes
    digests: bytes
    text_bytes: np.ndarray
    checks: list
    signatures: list | None
    rest_failed: bool
    order: np.ndarray | None = None

    def head(self, m: int) -> Summary:
        """The summary of the first `m` items: the part of a piece that `max_records` leaves to decide."""
        kinds = self.kinds[:m]
        judged, kept = m - kinds.count(BAD), kinds.count(KEPT)
        return Summary(kinds, self.digests[:judged * DIGEST_SIZE], self.text_bytes[:kept], self.checks[:m - kept],
                       None if self.signatures is None else self.signatures[:judged], False,
                       None if self.order is None else self.order[self.order < judged])

    def digest_list(self) -> list[bytes | None]:
        """The judged items' digests one by one (None for NO_DIGEST): the record-by-record decider's view."""
        d = self.digests
        return [None if digest == NO_DIGEST else digest
                for digest in (d[i:i + DIGEST_SIZE] for i in range(0, len(d), DIGEST_SIZE))]


class Decision(NamedTuple):
    """The driver's verdict on a piece: items `[0, applied)` are consumed, the first as dataset ordinal
    `ordinal`; `before`: items of the unit's file ahead of the piece (line numbers), None for a stream;
    `keep`: one byte per applied item; `dup`: item -> the dataset that kept its text ("" = this one);
    `near`: item -> (the dataset that kept its twin, "" = this one; the twin's ordinal; Jaccard); `sampled`:
    items whose reject line is written."""

    applied: int
    ordinal: int
    before: int | None
    keep: bytes
    dup: dict[int, str]
    near: dict[int, tuple[str, int, float]]
    sampled: frozenset[int]


_worker: dict[str, Any] = {}  # this worker's quality settings, mode and QualityControl per text field


def _cut(source: dict[str, Any]) -> dict[str, Any]:
    """A reject line's `source` with each string cut as its text is (REJECT_EXCERPT): an `id` or `url` of a megabyte
    made each line, and the audit's examples, that large."""
    return {k: v[:REJECT_EXCERPT] if isinstance(v, str) else v for k, v in source.items()}


def late_plugins() -> list[tuple[str, str, str]]:
    """(family, name, module) of each plug-in a worker runs (a source format or scheme, a quality gate) that this
    process registered after streamprep's start: imported by the caller before the job, not named in
    STREAMPREP_PLUGINS, which only the modules every process imports are. A worker imports their modules
    (`init_worker`); without that, `workers: 2` ran the job without them, and without a word."""
    late = [(reg.family, name, module) for reg in (registry.SOURCE_FORMATS, registry.SCHEMES)
            for name, module in reg.late()]
    return late + [("quality gate", name, module) for name, module in late_gates()]


def late_gates() -> list[tuple[str, str]]:
    """(name, module) of each gate factory registered after streamprep's start (`Registry.late`'s, for the gates,
    which quality keeps itself)."""
    gates = sys.modules.get("quality.gates")
    factories = gates.EXTRA_GATES[registry.GATES_AT_START:] if gates is not None else []
    return [(getattr(f, "__qualname__", type(f).__qualname__), registry.module_of(f)) for f in factories]


def check_gates(cfg: dict[str, Any]) -> None:
    """Config check (registry.CHECKS): the plug-in gates each dataset's QC builds, built here once (their factories
    called) so that one failing to give a gate, or named as the pipeline's own reasons or another gate
    (`quality.gates.plugin_gates`), stops the job before it starts, exit 2, not in its first worker. Without a
    gate plug-in, `quality.gates` is not even imported here."""
    gates = sys.modules.get("quality.gates")
    if gates is None or not gates.EXTRA_GATES:
        return
    settings = load_quality_settings(cfg["quality"])
    for text_field in dict.fromkeys(ds["text_field"] for ds in cfg["datasets"]):
        try:
            gates.plugin_gates(settings, text_field)
        except gates.GatePluginError as exc:
            raise ConfigError(f"config: {str(exc).splitlines()[0]}") from None  # a factory's error: its first line


def _adopt(plugins: list[tuple[str, str, str]]) -> str | None:
    """Import the modules of the job's late plug-ins (`late_plugins`) this process lacks; why one is still missing,
    or None."""
    failed: dict[str, str] = {}
    for module in dict.fromkeys(m for _, _, m in plugins):
        if module not in sys.modules:
            try:
                importlib.import_module(module)
            except (Exception, SystemExit) as exc:  # reported below, for the plug-in it leaves out
                failed[module] = one_line(exc)  # `Type: message`
    have = Counter((family, name) for family, name, _ in late_plugins())
    for family, name, module in plugins:
        if have[(family, name)] > 0:
            have[(family, name)] -= 1
            continue
        why = f"importing {module} there failed ({failed[module]})" if module in failed else \
            _in_script() if module in ("__main__", "__mp_main__") else f"importing {module} there does not register it"
        return (f"plug-in {family} {name!r} (module {module}) is registered in the process that started the job but "
                f"not in its worker processes: {why}; or name its module in STREAMPREP_PLUGINS, which every process "
                f"imports")
    return None


def _other_modules(driver: list[str] | None) -> str | None:
    """Why this worker's STREAMPREP_PLUGINS modules are not the driver's `driver` (in order: it decides the gates'),
    or None. A Ray worker has its node's environment, not the driver's (the job's runtime env sends the driver's,
    `ray_cluster.job_runtime_env`); one that differed judged with other gates, and run.json named the driver's."""
    if driver is None or driver == registry.PLUGIN_MODULES:
        return None
    return (f"STREAMPREP_PLUGINS names {registry.spelled(driver)!r} in the process that started the job but "
            f"{registry.spelled(registry.PLUGIN_MODULES)!r} in its worker processes: give every process of the job "
            f"the same STREAMPREP_PLUGINS")


def _in_script() -> str:
    """Why a plug-in of the script that starts the job is not in this worker: a local worker process runs the script
    again as `__mp_main__` (multiprocessing's spawn and forkserver), so it has what the script registers at its top
    level but not under its main guard; a Ray actor or Xenna stage (or a script of `python -c`) runs none of it."""
    if "__mp_main__" in sys.modules:
        return ('it is registered under the script\'s `if __name__ == "__main__":`, which worker processes skip: '
                'register it at the script\'s top level or in a module')
    return "it is defined in the script that starts the job, which they do not run: move it to a module of its own"


def init_worker(settings: QualitySettings | dict[str, Any], mode: Mode,
                plugins: list[tuple[str, str, str]] | None = None, modules: list[str] | None = None) -> None:
    """This process's settings (a validated `quality:` mapping is taken too, as QualityControl takes it), and the
    plug-ins the job's process registered late (`late_plugins`) and its STREAMPREP_PLUGINS modules
    (`registry.PLUGIN_MODULES`, None: not checked). A STREAMPREP_PLUGINS module that failed to import here
    (`registry.PLUGIN_IMPORT_ERRORS`; the job's process imported it, or config validation stopped the job) is
    missing as a late one is: `workers: 2` judged without its gate, without a word; so were other modules than the
    driver's (`_other_modules`)."""
    missing = f"{registry.PLUGIN_IMPORT_ERRORS[0]} in a worker process, though the process that started the job " \
              f"imported it" if registry.PLUGIN_IMPORT_ERRORS else \
        _other_modules(modules) or _adopt(plugins or [])
    _worker.clear()
    _worker.update(quality=settings if isinstance(settings, QualitySettings) else load_quality_settings(settings),
                   mode=mode, qc={}, missing=missing)


class PluginMissing(ConfigError):
    """A plug-in the job's process registered is not in this worker process (`init_worker`), found before the worker
    reads a record: the job stops as on a config error (one line, exit 2; the run failed, resumable once the
    plug-in reaches the workers), not as "reading or judging the input failed", which blamed the input."""


def _judging() -> None:
    if _worker["missing"] is not None:
        raise PluginMissing(_worker["missing"])


def _judge(name: str, text_field: str, items: list[Any]) -> tuple[ItemColumns, dict[str, dict[str, Any]], list]:
    """One batch of records / BadRecords: screened by the mode, judged by QC, kept ones serialised."""
    qc = _worker["qc"].get(text_field)
    if qc is None:
        # `quality.QualityControl` loads the gates on first use (`quality.__getattr__`): not in the driver, which
        # imports this module for the Summary and Decision it exchanges with the workers
        qc = _worker["qc"][text_field] = quality.QualityControl(_worker["quality"], text_field=text_field)
    mode: Mode = _worker["mode"]
    screened, judged = mode.screen([(item, None) for item in items], text_field)
    verdicts, judged_as = iter(qc.evaluate_batch(judged)), iter(judged)
    rows: list[tuple] = []  # one ItemColumns row per item, transposed at the end
    signatures = []
    for (rec, _), item in zip(screened, items):
        extra = None  # the item's source keys: also on a record the mode screened out (an `sft:` schema reject)
        if isinstance(item, dict) and not item.keys().isdisjoint(SOURCE_KEYS):
            extra = {k: item[k] for k in SOURCE_KEYS if _source_value(item.get(k))}
        if isinstance(rec, BadRecord):
            rows.append((rec.reason, rec.check, False, None, None, None, len(rec.raw), 0, rec.raw, extra))
            continue
        keep, text, meta, digest, signature, text_bytes = next(verdicts)
        seen = next(judged_as)  # what QC read: the record, or for an `sft:` run its text as the mode extracted it
        signatures.append(signature)
        if not keep:
            excerpt = excerpt_of(seen, text_field)
            raw = seen.get(text_field) if isinstance(seen, dict) else seen
            # the record's length as a kept one's counts (the text it would keep), not its excerpt's
            chars = meta["chars"] if qc.settings.normalize and "chars" in meta else \
                len(raw) if isinstance(raw, str) else len(excerpt)
            rows.append((None, None, False, None, meta, digest, chars, 0, excerpt, extra))
            continue
        source = {"dataset": name, "index": SENTINEL_INDEX, **(extra or {})}
        kept = mode.kept_row(text, {**meta, "source": source}, rec)
        try:
            row = orjson.dumps(kept, option=orjson.OPT_APPEND_NEWLINE)
        except TypeError:  # a lone surrogate (an id, a url); an `sft:` record's Parquet binary or decimal column
            row = orjson.dumps(_json_ready(kept), option=orjson.OPT_APPEND_NEWLINE)
        # the excerpt a reject line would show; None when it is the kept text's start (always, unnormalized)
        excerpt = None if isinstance(seen, dict) and seen.get(text_field) is text else excerpt_of(seen, text_field)
        if excerpt is not None and excerpt == text[:REJECT_EXCERPT]:
            excerpt = None
        if text_bytes is None:  # not counted by normalisation (`normalize: false` keeps the raw text)
            text_bytes = len(text) if text.isascii() else len(text.encode("utf-8"))
        stored = None if stats.META_KEYS.isdisjoint(meta) and "source" not in meta else meta
        rows.append((None, None, True, row, stored, digest, len(text), text_bytes, excerpt, extra))
    cols = ItemColumns(*map(list, zip(*rows))) if rows else ItemColumns(*([] for _ in ItemColumns._fields))
    return cols, qc.take_gate_stats(), signatures


def _source_value(value: Any) -> bool:
    """Whether a record's `id`, `url` or licence goes in its lines' `source`: a string, or an int a JSON line holds
    (orjson writes none past 64 bits: a plug-in reader's `json.loads` gives one, and its reject line stopped the
    job); any other value is left out, as a float or a list is."""
    return isinstance(value, str) or isinstance(value, int) and -2**63 <= value < 2**64


_LEFT_OUT = object()


def _json_ready(value: Any) -> Any:
    """`value` without what JSON cannot hold (bytes, Decimal, a timedelta...), left out as pretraining leaves out
    every column but the text: a mapping's key whose value is one, or a list holding one (the list whole, so that
    no element moves; such a list is no section's, which would have rejected the record). A string holding a lone
    surrogate (an `id` or `url` a reader's `json.loads` gave) is kept escaped, as reject lines write it
    (`quality.lines.escaped`). The kept record is written, not the job stopped."""
    if isinstance(value, str):
        return escaped(value)
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            v = _json_ready(v) if isinstance(k, str) else _LEFT_OUT
            if v is not _LEFT_OUT:
                out[escaped(k)] = v
        return out
    if isinstance(value, (list, tuple)):
        items = [_json_ready(v) for v in value]
        return _LEFT_OUT if any(v is _LEFT_OUT for v in items) else items
    try:
        orjson.dumps(value)
    except TypeError:
        return _LEFT_OUT
    return value


def _read(unit: Unit, options: Any) -> list[Any]:
    """A unit's items; a range or row group whose bytes stop decoding ends with one REST_OF reject. An `hf` unit's
    file is downloaded here and read by `options`, its dataset's `hf.FileReader` (a failed download raises
    `HFSourceUnavailable`: the job stops, resumable)."""
    if unit.kind == "hf":
        return options.read(unit)
    items: list[Any] = []
    try:
        items.extend(units.read_unit(unit, options))
    except (ReaderError, SourceError, ConfigError):  # names its file already (a whole-file unit's reader raises a
        raise  # SourceError saying where it stopped, a ConfigError what re-running meets again: `local.no_ranges`)
    except Exception as exc:
        if refused_ranges := no_ranges(unit.path, exc):  # a range past fsspec's first block (a range unit over 5 MB
            raise refused_ranges from exc  # a server without ranges answers whole): not the rest's reject, exit 0
        if not _content_fault(exc):
            groups = units.row_group_range(unit)
            where = f" (bytes {unit.start}-{unit.end})" if unit.kind == "range" else \
                f" (row groups {groups.start}-{groups.stop - 1})" if unit.kind == "row_group" else ""
            raise read_failure(f"cannot read input file {unit.path}{where}: {one_line(exc)}", exc) from exc
        items.append(BadRecord(f"{REST_OF}{unit.path} after record {units.RECORD_MARK}, skipped: {one_line(exc)}", ""))
    return items


def judge_piece(name: str, text_field: str, batch: int, stage: str, unit: Unit | None,
                items: list[Any] | None = None, options: Any = None, ahead: tuple[Unit, ...] = ()) -> Summary:
    """Judge a unit (read here, with the dataset's storage `options`, or for an `hf` unit its `hf.FileReader`)
    or the items the driver read (a source without a file list), in batches
    of `batch`; stage the judged columns at `stage`.judged (atomic) and return the summary the driver decides on.
    An `hf` unit's `ahead` units download meanwhile, and the call ends only once they have: a unit after this one
    is evicted only after this call's result, so no download can land in the cache after its file's eviction."""
    _judging()
    prefetching = options.prefetch(ahead) if ahead else []
    try:
        if items is None:
            items = _read(unit, options)
        judged = [_judge(name, text_field, items[i:i + batch]) for i in range(0, len(items), batch)]
    finally:
        futures.wait(prefetching)
    # scratch for this attempt's finalize_piece only: a resume removes every staged file but the open pieces'
    # kept lines (checkpoints.repair), so it is never read after a crash and needs no fsync (it was
    # the largest file a record costs, ~660 B of a short one)
    atomic.write_bytes(stage + ".judged", pickle.dumps(judged, protocol=pickle.HIGHEST_PROTOCOL), durable=False)
    kinds, digests, text_bytes, checks, signatures = bytearray(), [], [], [], []
    for cols, _, sigs in judged:
        signatures += sigs
        if all(cols.keep):  # every item read and kept (every gate off, say): the batch's columns as they are
            kinds += bytes([KEPT]) * len(cols.keep)
            digests += cols.digest if None not in cols.digest else [d or NO_DIGEST for d in cols.digest]
            text_bytes += cols.text_bytes
            continue
        for bad, check, keep, meta, digest, tb in zip(cols.bad, cols.check, cols.keep, cols.meta, cols.digest,
                                                      cols.text_bytes):
            if bad is not None:
                kinds.append(BAD)
                checks.append(check)
                continue
            digests.append(digest or NO_DIGEST)
            if keep:
                kinds.append(KEPT)
                text_bytes.append(tb)
            else:
                kinds.append(REJECTED)
                checks.append(meta.get("failed_check", "unknown"))
    rest_failed = unit is not None and unit.kind in units.NUMBERED and bool(items) \
        and isinstance(items[-1], BadRecord) and items[-1].reason.startswith(REST_OF)
    near_on = any(s is not None for s in signatures)
    blob = b"".join(digests)
    order = digest_order(blob) if _worker["quality"].dedup == "exact" else None
    return Summary(bytes(kinds), blob, np.array(text_bytes, np.int64), checks, signatures if near_on else None,
                   rest_failed, order)


def digest_order(digests: bytes) -> np.ndarray:
    """`Summary.order` of judged items with these digests (back to back): their rows sorted by prefix, uint32."""
    return prefix_order(digest_words(digests)[:, 0]).astype(np.uint32)


class GatesTo(NamedTuple):
    """The gate counters of a capped unit cover its first `count` items (not its whole batches): for an `hf` unit
    the items a stream read of the dataset judged, for a file's unit those up to the cap; the batch `count` cuts is
    judged again, from the unit re-read."""

    count: int
    text_field: str
    unit: Unit
    options: Any


def judge_gates(name: str, text_field: str, unit: Unit, options: Any, start: int, stop: int) -> tuple[dict, int]:
    """The QC gate counters of items `[start, stop)` of a unit read again (an `hf` unit through `options`, its
    `hf.FileReader`, no further than `stop`; a file's range or row group whole, with its storage `options`), and
    how many items it has up to `stop`."""
    _judging()
    items = options.read(unit, stop) if unit.kind == "hf" else _read(unit, options)[:stop]
    return (_judge(name, text_field, items[start:stop])[1] if start < len(items) else {}), len(items)


def row_meta(row: dict[str, Any]) -> dict[str, Any]:
    """QC's meta of a kept row (parsed), for a record that the decision rejects (a duplicate) and whose meta was not
    stored (`ItemColumns`): the row's meta without the `source` the row added. JSON keeps the keys' order and
    floats exact, so it is the meta QC gave, as JSON writes it."""
    meta = row["meta"]
    del meta["source"]
    return meta


def finalize_piece(name: str, stage: str, d: Decision, gates_to: GatesTo | None = None) -> tuple[bytes, dict[str, Any], int]:
    """Write the piece's kept lines (`stage`.kept, offsets in `.kept.off`) as the driver numbered them;
    return (its sampled reject lines, its audit stats, the kept lines' bytes). The gate counters are those of
    the batches with an applied item, or with `gates_to` those of the unit's first `gates_to.count` items."""
    with open(stage + ".judged", "rb") as fh:
        judged = pickle.load(fh)
    st: dict[str, Any] = {}
    kept, ordinals, rejects = [], [], []  # kept rows (with the sentinel) and their ordinals
    marked = sorted((*d.dup, *d.near))  # items whose meta the decision changes
    at = 0  # the batch's first item
    for cols, gates, _ in judged:
        size = len(cols.bad)
        if gates_to is None:
            if at >= d.applied:
                break
            stats.add_gates(st, gates)
        elif at + size <= gates_to.count:
            stats.add_gates(st, gates)
        elif at < gates_to.count:
            stats.add_gates(st, judge_gates(name, gates_to.text_field, gates_to.unit, gates_to.options, at,
                                            gates_to.count)[0])
        end = min(at + size, d.applied)
        if at < end and 0 not in d.keep[at:end] and bisect_left(marked, at) == bisect_left(marked, end) \
                and cols.bad.count(None) == size:
            # every item kept as judged (every gate off, say): the batch's stats at once, its lines numbered
            stats.add_kept(st, cols.meta[:end - at], cols.chars[:end - at])
            kept += cols.row[:end - at]
            ordinals += range(d.ordinal + at, d.ordinal + end)
            at += size
            continue
        for j in range(at, end):
            t = j - at
            ordinal = d.ordinal + j
            source = {"dataset": name, "index": ordinal}
            bad, keep = cols.bad[t], d.keep[j]
            if bad is not None:
                reason = units.global_reason(bad, d.before + j) if d.before is not None else bad
                meta, excerpt = {"failed_check": cols.check[t], "reason": reason}, cols.excerpt[t]
            else:
                meta, excerpt = cols.meta[t], cols.excerpt[t]
                if not keep and (meta is None or excerpt is None):  # what its reject line lacks, from its kept row
                    row = orjson.loads(cols.row[t])  # once for both
                    meta = row_meta(row) if meta is None else meta
                    excerpt = row["text"][:REJECT_EXCERPT] if excerpt is None else excerpt  # a kept text's start
                elif meta is None:  # kept and not stored: the stats read nothing of it
                    meta = {}
                if j in d.dup:
                    twin = d.dup[j]
                    meta = {**meta, "failed_check": "duplicate", "reason": duplicate_reason(twin),
                            "duplicate_of": twin or name}
                elif j in d.near:
                    twin_ds, src, jaccard = d.near[j]
                    meta = near_dedup.reject_meta(meta, twin_ds or name, near_dedup.Twin(src, jaccard))
                    if twin_ds:  # kept by an earlier dataset (dedup_scope: run)
                        stats.add_near_kept_by(st, twin_ds)
            if cols.extra[t]:
                source.update(cols.extra[t])
            stats.add_record(st, keep, meta, cols.chars[t])
            if keep:
                kept.append(cols.row[t])
                ordinals.append(ordinal)
            elif j in d.sampled:
                rejects.append(reject_line({"failed_check": meta.get("failed_check", "unknown"),
                                            "reason": meta.get("reason"), "meta": meta, "source": _cut(source),
                                            "text": excerpt}))
        at += size
    lines, offsets = numbered(kept, ordinals)
    atomic.write_bytes(stage + ".kept", lines)
    atomic.write_bytes(stage + ".kept.off", offsets.tobytes())
    return b"".join(rejects), st, int(offsets[-1])


def reject_line(reject: dict[str, Any]) -> bytes:
    """A reject's line; a string in it with a lone surrogate (a plug-in reader's `json.loads` gives one for a
    `"\\ud800"` escape: the schema gate rejects such a text, and an id or a meta field may hold one too) written
    escaped (`quality.lines.escaped`), so that the job goes on with the reject counted: orjson refused the line."""
    try:
        return orjson.dumps(reject, option=orjson.OPT_SORT_KEYS | orjson.OPT_APPEND_NEWLINE)
    except orjson.JSONEncodeError:
        return orjson.dumps(escaped(reject), option=orjson.OPT_SORT_KEYS | orjson.OPT_APPEND_NEWLINE)


def numbered(rows: list[bytes], ordinals: list[int]) -> tuple[bytes, np.ndarray]:
    """Kept lines as `_judge` wrote them, each with its dataset ordinal in place of the sentinel, joined, and their
    byte offsets (len + 1): one split of the joined rows at the sentinel instead of a `replace` per row (~1.3 µs a
    short record). A row holds the sentinel once, in its meta (inside a JSON string every quote is escaped, so no
    text or field value can spell its quoted key), unless an SFT row's own record, written after the meta, has a
    field `index` of that very value: then row by row, the first occurrence as before."""
    numbers = [b'"index":%d' % ordinal for ordinal in ordinals]
    parts = b"".join(rows).split(_SENTINEL)
    if len(parts) == len(rows) + 1:
        lines = b"".join(chain.from_iterable(zip(parts, numbers))) + parts[-1]
    else:
        lines = b"".join(map(bytes.replace, rows, repeat(_SENTINEL), numbers, repeat(1)))
    offsets = np.zeros(len(rows) + 1, np.int64)
    np.cumsum(np.fromiter(map(len, rows), np.int64, len(rows)) + np.fromiter(map(len, numbers), np.int64, len(rows))
              - len(_SENTINEL), out=offsets[1:])
    return lines, offsets


def assemble_part(path: str, slices: list[tuple[str, int, int]]) -> tuple[str, int]:
    """Write part `path` from kept lines `[first, first + n)` of each staged piece, in order (atomic);
    return its SHA-256 and size."""
    h, size = hashlib.sha256(), 0
    with atomic.writing(path) as out:
        for stage, first, n in slices:
            off = np.fromfile(stage + ".kept.off", np.int64)
            with open(stage + ".kept", "rb") as fh:
                fh.seek(int(off[first]))
                data = fh.read(int(off[first + n] - off[first]))
            h.update(data)
            out.write(data)
            size += len(data)
    return h.hexdigest(), size
