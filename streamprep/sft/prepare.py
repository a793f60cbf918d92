"""`prepare_part`: one ingest part (JSONL `{"text", "meta", "record"}`) → SFT/DPO/GRPO shards + stats.

Pure and deterministic: the files depend only on the part's lines, the tokenizer and the config.
A record is written to every output key or to none (keys stay aligned by document index).
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from contextlib import suppress
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import orjson

from streamprep import binidx
from streamprep.sft.chat import ChatTokenizer, encode_units, load_chat_tokenizer
from streamprep.sft.config import SftConfig, layout
from streamprep.sft.output import Shard, domain_dir
from streamprep.sft.records import RecordError, build_record, get_path, record_text

MAX_DROPPED_LISTED = 1000
MAX_OPEN_FILES = 128  # `.bin` files a part keeps open over all its domains' shards (a part may have thousands)
_TOKENIZERS: dict[str, ChatTokenizer] = {}


def tokenizer_for(tokenizer: ChatTokenizer | str | Path) -> ChatTokenizer:
    """The given ChatTokenizer, or one loaded from a path once per process and cached (keyed by the
    path and its tokenizer.json's size and mtime, so a replaced file is reloaded)."""
    if isinstance(tokenizer, ChatTokenizer):
        return tokenizer
    path = Path(tokenizer).resolve()
    st = (path / "tokenizer.json" if path.is_dir() else path).stat()
    key = f"{path}|{st.st_size}|{st.st_mtime_ns}"
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = load_chat_tokenizer(path)
    return _TOKENIZERS[key]


def config_digest(sft_cfg: SftConfig) -> str:
    """Digest of the validated dict (meta.json's `sft_config`, the plan hash): its bytes must not change."""
    return "sha256:" + hashlib.sha256(orjson.dumps(sft_cfg.to_dict(), option=orjson.OPT_SORT_KEYS)).hexdigest()


def _plan(cfg: SftConfig) -> dict[str, dict[str, Any]]:
    return {key: {**layout(cfg, key), "list": src.list_field} for key, src in cfg.input.sources.items()}


def _dtypes(cfg: SftConfig, id_bound: int) -> dict[str, np.dtype]:
    out = cfg.output
    seq = binidx.optimal_dtype(id_bound) if out.dtype == "auto" else np.dtype(out.dtype)
    if id_bound - 1 > np.iinfo(seq).max:
        raise ValueError(f"sft.output.dtype {seq} cannot hold token ids up to {id_bound - 1}")
    return {"sequence": seq, "mask": np.dtype(np.uint8), "value": np.dtype(out.value_dtype)}


class _Stats:
    def __init__(self, plan: dict[str, dict[str, Any]]):
        self.plan = plan
        self.records = 0
        self.documents = 0
        self.dropped: dict[str, int] = {}
        self.dropped_records: list[dict[str, Any]] = []
        self.keys = {k: {"documents": 0, "sequences": 0, "tokens": 0, "trained_tokens": 0, "values": 0} for k in plan}
        self.diag: dict[str, int] = {}

    def drop(self, line: int, reason: str, detail: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        if len(self.dropped_records) < MAX_DROPPED_LISTED:
            self.dropped_records.append({"line": line, "reason": reason, "detail": detail[:300]})

    def bump(self, key: str, n: int = 1) -> None:
        if n:
            self.diag[key] = self.diag.get(key, 0) + n

    def count(self, arrays: dict[str, dict[str, list[np.ndarray]]]) -> None:
        """One written document, per output key."""
        self.documents += 1
        for key, parts in arrays.items():
            ks = self.keys[key]
            ks["documents"] += 1
            ks["sequences"] += len(parts["sequence"])
            ks["tokens"] += sum(len(s) for s in parts["sequence"])
            if self.plan[key]["mask"]:
                ks["trained_tokens"] += int(sum(int(m.sum()) for m in parts["mask"]))
            ks["values"] += sum(len(v) for v in parts["value"])


def encode_record(cfg: SftConfig, tok: ChatTokenizer, record: Any, plan: dict[str, dict[str, Any]],
                  dtypes: dict[str, np.dtype]) -> tuple[dict[str, dict[str, list[np.ndarray]]], dict[str, int]]:
    """One record → per key {"sequence": [...], "mask": [...], "value": [...]} arrays, or RecordError."""
    pre = cfg.preprocessing
    data = build_record(cfg, record)
    chars = len(record_text(data))
    if chars < pre.min_chars:
        raise RecordError("min_chars", f"{chars} characters < {pre.min_chars}")
    if pre.max_chars is not None and chars > pre.max_chars:
        raise RecordError("max_chars", f"{chars} characters > {pre.max_chars}")
    diag: dict[str, int] = {}
    out: dict[str, dict[str, list[np.ndarray]]] = {}
    limit = pre.max_seq_len
    for key, sd in data.items():
        lay = plan[key]
        diag["items_truncated"] = diag.get("items_truncated", 0) + sd.truncated_items
        seqs, masks, vals = [], [], []
        for item in sd.items:
            if lay["value"]:  # each finite in the dtype: checked by build_record (records._numbers)
                vals.append(np.asarray(item.values, dtype=dtypes["value"]))
            if not lay["sequence"]:
                continue
            enc = encode_units(tok, item.units, limit)
            for k, v in enc.diag.items():
                diag[k] = diag.get(k, 0) + v
            ids, mask = enc.ids, enc.mask
            if not ids:
                raise RecordError("empty", f"{key}: encodes to no tokens")
            if limit is not None and len(ids) > limit:
                if pre.overlong == "drop":
                    raise RecordError("overlong", f"{key}: {len(ids)} tokens > max_seq_len {limit}")
                ids, mask = ids[:limit], mask[:limit]
                diag["sequences_truncated"] = diag.get("sequences_truncated", 0) + 1
            if lay["mask"] and lay["can_train"] and not mask.any():
                raise RecordError("no_trained_tokens", f"{key}: no trained token"
                                  + (" left after truncation" if limit is not None and len(enc.ids) > limit else ""))
            seqs.append(np.asarray(ids, dtype=dtypes["sequence"]))
            masks.append(np.asarray(mask, dtype=np.uint8))
        out[key] = {"sequence": seqs, "mask": masks, "value": vals}
    return out, diag


def prepare_part(input_path: str | Path, out_prefix: str | Path, tokenizer_dir: ChatTokenizer | str | Path,
                 cfg: SftConfig, fingerprint: str) -> dict[str, Any]:
    """Prepare one ingest part. Files go to `out_prefix.parent[/<domain>]/<out_prefix.name>_sNNNN_*`.

    `tokenizer_dir`: a directory / tokenizer.json path (loaded once per process and cached) or a
    ChatTokenizer from `load_chat_tokenizer`. `cfg`: the typed `sft:` section (`load_sft_config`).
    `fingerprint` is recorded in every meta.json. Returns stats; `files` are relative to out_prefix.parent.
    """
    t0 = time.perf_counter()
    tok = tokenizer_for(tokenizer_dir)
    plan = _plan(cfg)
    dtypes = _dtypes(cfg, tok.id_bound)
    out_prefix = Path(out_prefix)
    header = {"source_part": Path(input_path).name, "tokenizer_fingerprint": fingerprint,
              "vocab_size": tok.vocab_size, "sft_config": config_digest(cfg)}
    stats = _Stats(plan)
    shards = _Shards(out_prefix, plan, dtypes, header, cfg.output.max_tokens_per_shard)
    domain_key = cfg.output.domain_key
    try:
        for record, arrays in _encoded_records(input_path, cfg, tok, plan, dtypes, stats):
            shards.add(_domain_of(record, domain_key), arrays)
            stats.count(arrays)
        shards.close_all()
    except BaseException:
        shards.abort()
        raise
    for key, lay in plan.items():
        if not lay["mask"]:
            stats.keys[key]["trained_tokens"] = None   # no mask written: nothing counted (docs/sft.md)
    return {"records": stats.records, "documents": stats.documents,
            "dropped": dict(sorted(stats.dropped.items())), "dropped_records": stats.dropped_records,
            "keys": stats.keys, "layout": {k: {kk: vv for kk, vv in v.items()} for k, v in plan.items()},
            "dtypes": {k: str(v) for k, v in dtypes.items()}, "diagnostics": dict(sorted(stats.diag.items())),
            **shards.listing(), "seconds": round(time.perf_counter() - t0, 4)}


def _encoded_records(input_path: str | Path, cfg: SftConfig, tok: ChatTokenizer,
                     plan: dict[str, dict[str, Any]], dtypes: dict[str, np.dtype],
                     stats: _Stats) -> Iterator[tuple[Any, dict[str, dict[str, list[np.ndarray]]]]]:
    """(original record, its arrays) for each ingest line that encodes; the others are counted drops."""
    with open(input_path, "rb") as fh:
        for line_no, line in enumerate(fh):
            if not line.strip():
                continue
            stats.records += 1
            try:
                obj = orjson.loads(line)
                record = obj.get("record") if isinstance(obj, dict) else None
                if record is None:
                    raise RecordError("no_record", "ingest line has no 'record' (the original record)")
                arrays, diag = encode_record(cfg, tok, record, plan, dtypes)
            except orjson.JSONDecodeError as exc:
                stats.drop(line_no, "bad_json", str(exc))
                continue
            except RecordError as exc:
                stats.drop(line_no, exc.reason, exc.detail)
                continue
            for k, v in diag.items():
                stats.bump(k, v)
            yield record, arrays


def _domain_of(record: Any, domain_key: str | None) -> str | None:
    """The shard sub-directory of a record (`output.domain_key`), or None when not split by domain."""
    if domain_key is None:
        return None
    try:
        return domain_dir(get_path(record, domain_key))
    except RecordError:
        return domain_dir(None)


class _Shards:
    """The part's shards: one open per domain, rolled at `max_tokens_per_shard`, numbered per domain.

    At most MAX_OPEN_FILES of their `.bin` files are open at once: past that, the least recently written
    domain's writers are suspended (closed, reopened to append on its next record), so any number of domains
    stays under the open-file limit and the bytes are the same.
    """

    def __init__(self, out_prefix: Path, plan: dict[str, dict[str, Any]], dtypes: dict[str, np.dtype],
                 header: dict[str, Any], max_tokens: int | None):
        self.base, self.name = out_prefix.parent, out_prefix.name
        self.plan, self.dtypes, self.header, self.max_tokens = plan, dtypes, header, max_tokens
        self.open: dict[str | None, Shard] = {}
        self.active: OrderedDict[str | None, int] = OrderedDict()  # open shards whose files are open: their count
        self.next_index: dict[str | None, int] = {}
        self.closed: list[tuple[Shard, dict[str, Any]]] = []

    def add(self, domain: str | None, arrays: dict[str, dict[str, list[np.ndarray]]]) -> None:
        n_tokens = sum(len(s) for parts in arrays.values() for s in parts["sequence"])
        shard = self.open.get(domain)
        if shard is not None and self.max_tokens is not None and shard.documents \
                and shard.tokens + n_tokens > self.max_tokens:
            self._close(domain)
            shard = None
        if shard is None:
            idx = self.next_index.get(domain, 0)
            self.next_index[domain] = idx + 1
            shard = self.open[domain] = Shard(self.base / domain if domain else self.base, self.name, idx, domain,
                                              self.plan, self.dtypes, self.header)
        shard.add(arrays)
        self._touch(domain)

    def _touch(self, domain: str | None) -> None:
        """`domain` was just written: it becomes the most recent; the least recent ones past the cap are suspended."""
        self.active.pop(domain, None)
        self.active[domain] = len(self.open[domain].writers)
        while len(self.active) > 1 and sum(self.active.values()) > MAX_OPEN_FILES:
            self.open[self.active.popitem(last=False)[0]].suspend()

    def _close(self, domain: str | None) -> None:
        shard = self.open.pop(domain)
        self.active.pop(domain, None)
        self.closed.append((shard, shard.close()))

    def close_all(self) -> None:
        for domain in sorted(self.open, key=lambda d: (d is not None, d or "")):
            self._close(domain)

    def abort(self) -> None:
        """Remove the unfinished files, and a domain directory this left empty."""
        for shard in self.open.values():
            shard.abort()
            if shard.domain is not None:
                with suppress(OSError):   # not empty: the part's finished shards are there
                    shard.dir.rmdir()

    def listing(self) -> dict[str, Any]:
        """`shards` (per shard: domain, index, meta.json, counts) and `files`, relative to the output dir."""
        closed = sorted(self.closed, key=lambda sm: (sm[0].domain or "", sm[0].index))
        files = sorted(str(p.relative_to(self.base)) for shard, _ in closed for p in shard.files())
        shards = [{"domain": s.domain, "shard": s.index, "meta": str(s.meta_path.relative_to(self.base)),
                   "documents": m["documents"], "tokens": m["tokens"], "trained_tokens": m["trained_tokens"]}
                  for s, m in closed]
        return {"shards": shards, "files": files}
