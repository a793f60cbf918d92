"""The hash chain `streamprep verify` walks: run.json → manifest.json → every other artifact.

run.json records manifest.json's SHA-256; manifest.json lists the shards (Parquet + TSV, `.bin/.idx`)
and, under `files`, blend.json, mixtures.json, the run's tokenizer/ files and every receipt with SHA-256 and
size; each receipt lists its shard files (SFT: sequences, loss masks, meta.json) and the SHA-256 of the
ingest part it was tokenized from. So a change to any file a trainer or a later stage reads breaks a link.

blend.json holds absolute prefixes (Megatron wants them), so its digest is taken with the run
directory's path removed: identical runs in different directories keep byte-identical manifests, and a
blend.json that points into another directory no longer matches.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import orjson

from streamprep import layout
from streamprep.layout import RunLayout

# Files whose digest is taken without the run directory's absolute path (see the module docstring).
RUN_DIR_RELATIVE = frozenset({layout.BLEND})


def _run_dir_bytes(run_dir: Path) -> bytes:
    """The run directory + "/" as it appears inside a JSON string written by atomic.write_json."""
    return orjson.dumps(str(run_dir.resolve()) + "/")[1:-1]


def digest(run_dir: Path, rel: str) -> tuple[str, int]:
    """(SHA-256, size) of one small listed file, run-directory-relative for RUN_DIR_RELATIVE files."""
    data = (run_dir / rel).read_bytes()
    if rel in RUN_DIR_RELATIVE:
        data = data.replace(_run_dir_bytes(run_dir), b"")
    return hashlib.sha256(data).hexdigest(), len(data)


def moved_from(run_dir: Path, rel: str, sha: str | None) -> str | None:
    """The other directory a RUN_DIR_RELATIVE file (blend.json) names its shards under when that is all that
    differs (its digest with that directory's path removed is `sha`): the run dir was copied or moved since its
    exports were written. None for any other change."""
    data = (run_dir / rel).read_bytes()
    # a shard prefix as written in JSON: "<dir>/binidx/<dataset>/<part>_text_document"; <dir> as JSON escapes it
    # (a `"` or `\` in it is `\"`, `\\`: a run dir so named was called changed, not moved)
    found = re.search(rb'"(/(?:[^"\\]|\\.)*)/' + layout.BINIDX.encode() + rb'/[^"/]+/[^"/]+"', data)
    if found is None or found.group(1) + b"/" == _run_dir_bytes(run_dir):
        return None
    if hashlib.sha256(data.replace(found.group(1) + b"/", b"")).hexdigest() != sha:
        return None
    return orjson.loads(b'"' + found.group(1) + b'"')


def file_entries(run_dir: Path, rels: list[tuple[str, str]]) -> list[dict[str, Any]]:
    """manifest.json's `files`: one {path, role, sha256, size_bytes[, run_dir_relative]} per (path, role)."""
    out = []
    for rel, role in sorted(rels):
        sha, size = digest(run_dir, rel)
        entry: dict[str, Any] = {"path": rel, "role": role, "sha256": sha, "size_bytes": size}
        if rel in RUN_DIR_RELATIVE:
            entry["run_dir_relative"] = True
        out.append(entry)
    return out


def chained_files(run_dir: Path, receipts: list[Path]) -> list[tuple[str, str]]:
    """(relative path, role) of the receipts and tokenizer files the manifest must cover; the files the output
    writers wrote (blend.json, mixtures.json, a plug-in's) are added by `exports.write_exports`."""
    rels = [(str(p.relative_to(run_dir)), "receipt") for p in receipts]
    # the files the run wrote there, never whatever else lies in the folder (a stray one was signed in, and only on
    # a rerun whose exports were redone: identical runs' manifests differed, and verify then called it stale)
    rels += [(str(p.relative_to(run_dir)), "tokenizer") for p in RunLayout(run_dir).tokenizer_files if p.is_file()]
    return rels
