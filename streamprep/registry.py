"""Plug-in registries: each family registers its names here, with what runs them and the checks config calls.

A leaf: it imports nothing of streamprep's, so `config.py` (also a leaf) validates through it and the families
import config, never the reverse. The built-ins are declared in `streamprep/plugins.py` (imported by the
package, so every process has them before a config is validated) as "module:attr" strings, loaded on first
use: the local engine never imports Ray or Xenna. A plug-in registers its object
with one line (docs/architecture.md, "Where to add …"):

    registry.ENGINES.register("mine", MyEngine)
"""
from __future__ import annotations

import importlib
import itertools
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass
class Entry:
    """One registered plug-in: its target (an object, or "module:attr" loaded on first use) and its metadata."""

    name: str
    target: Any
    meta: Mapping[str, Any] = field(default_factory=dict)
    order: tuple[int, int] = (0, 0)  # `registration_order()` when registered

    def load(self, value: Any = None) -> Any:
        """The target, or the metadata item `value` if it is a "module:attr" string, imported now."""
        obj = self.target if value is None else value
        if isinstance(obj, str) and ":" in obj:
            module, _, attr = obj.partition(":")
            obj = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        return obj


class Registry:
    """The plug-ins of one family, in registration order (the order config's messages list them in)."""

    def __init__(self, family: str):
        self.family = family
        self._entries: dict[str, Entry] = {}
        self.at_start: dict[str, Any] = {}   # name -> target once streamprep/plugins.py has run (`late`)
        self.closed: str | None = None       # why a plug-in cannot register here (set once the built-ins have)

    def register(self, name: str, target: Any = None, **meta: Any) -> Any:
        """Add (or replace) `name`; returns `target`, so it also works as a decorator's last line. An entry
        registered with `builtin=True` is not replaced: code outside the registry reads it (a source format's
        byte-range units), so a replacement would be used in some places only."""
        if self.closed is not None:
            raise ValueError(f"{self.family} {name!r}: {self.closed}")
        if (old := self._entries.get(name)) is not None and old.meta.get("builtin"):
            raise ValueError(f"{self.family} {name!r} is built in; register yours under another name")
        self._entries[name] = Entry(name, target, meta, registration_order())
        return target

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def entries(self) -> list[Entry]:
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"no {self.family} named {name!r} (known: {', '.join(self._entries)})") from None

    def get(self, name: str) -> Any:
        """The loaded target of `name`."""
        return self.entry(name).load()

    def late(self) -> list[tuple[str, str]]:
        """(name, module) of each entry registered, or replaced, after streamprep's start: not by the built-ins or a
        STREAMPREP_PLUGINS module, which every process imports, but by code the caller ran (docs/architecture.md,
        "Where to add")."""
        return [(e.name, module_of(e.target)) for e in self.late_entries()]

    def late_entries(self) -> list[Entry]:
        """The entries `late` names, with their `Entry.order`."""
        return [e for e in self._entries.values() if self.at_start.get(e.name, self) is not e.target]

    def choices(self) -> str:
        """'a, b or c': how a one-line config error lists the names."""
        names = list(self._entries)
        return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


# execution.engine: an `engines.base.Engine` subclass, called as `(executor=, workers=, ray_address=)` (the job's
# executor; `engines.check_engine`)
ENGINES = Registry("engine")
# tokenizer.backend: names only (streamprep/backends.py loads them); never changes bytes. Closed to plug-ins
TOKENIZER_BACKENDS = Registry("tokenizer backend")
# datasets[].format of files (local or fsspec URLs). Built-ins are read by sources.local itself (target None);
# a plug-in's target is `read(fh: BinaryIO, path: str) -> Iterator[dict | sources.base.BadRecord]` over the
# file's bytes, meta `suffixes` (file name endings that select it when `format` is unset)
SOURCE_FORMATS = Registry("source format")
# path prefixes that are not local paths; "" is the local filesystem. Target: `open(dataset: DatasetConfig,
# cache_dir: Path, max_concurrent_downloads: int, **options) -> sources.base.Source` (options: the hf_* download
# limits, prefetch_files, cache_max_gb, keep_cache; ignore what you do not use). meta `formats` (if the scheme has
# its own), `requires` (dataset keys it needs), `reads` (which of `config.SCHEME_KEYS` it reads: split, subset,
# revision, filter; a config giving one to a scheme that does not is an error), `fsspec` (takes storage_options)
# and `check`: `(key, ds)` on the
# dataset entry with its path resolved; raises config.ConfigError, or config.MissingInput (optional: skipped)
SCHEMES = Registry("source scheme")
# config checks that need a family's code, in order, after the schema: `check(cfg)` on the validated dict; meta
# `skipped=True`: `check(cfg, skipped=names)`, also handed the optional datasets left out for want of input
CHECKS = Registry("config check")
# top-level config sections owned by a family: target `validate(raw) -> dict` raising a ValueError with `.key`;
# meta `load` (dict -> frozen section), `key_prefix` (prepended to the error's key), `required`. Streamprep's own
# families only (`closed` once they have registered): `Config` has a field for each, and no plug-in reads a section
SECTIONS = Registry("config section")
# run modes by config section ("sft"): a factory `(section: SftConfig | dict) -> modes.Mode`
MODES = Registry("mode")
# output writers, in registration order (the built-ins first: Parquet + TSV, blend.json, mixtures.json), before the
# manifest that lists their files under the writer's name: `write(ctx: exports.WriterContext) -> list[str]`
# (run-dir-relative paths it wrote)
WRITERS = Registry("output writer")


FAMILIES = (ENGINES, TOKENIZER_BACKENDS, SOURCE_FORMATS, SCHEMES, CHECKS, SECTIONS, MODES, WRITERS)

# A module of STREAMPREP_PLUGINS that failed to import (streamprep/plugins.py): `config.validate`, the CLI and a
# worker process (`unit_worker.init_worker`) report it as a config error, one line, rather than a traceback out of
# `import streamprep` in every process.
PLUGIN_IMPORT_ERRORS: list[str] = []
# The modules STREAMPREP_PLUGINS names, in order: run.json records them, and a resume with others is refused (a
# plug-in gate, format or writer decides verdicts and bytes, as config does).
PLUGIN_MODULES: list[str] = []


PLUGINS_ENV = "STREAMPREP_PLUGINS"  # the modules every process of a job imports (streamprep/plugins.py)


def named_plugin_modules() -> list[str]:
    """The modules STREAMPREP_PLUGINS names now, each once, first mention first (a module is imported once:
    run.json recorded `a,a`, and a resume with `a` was refused)."""
    return list(dict.fromkeys(filter(None, (m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",")))))


def spelled(modules: list[str]) -> str:
    """Plug-in modules as a message names them: comma-separated, or `none`."""
    return ",".join(modules) or "none"


def plugins_changed_since_import() -> str | None:
    """Why STREAMPREP_PLUGINS as it is now is not what `import streamprep` read (None: it is): a caller that set it
    after the import had its workers (forked from what was imported) refuse the job as another process's, or with
    one worker ran without the module, silently."""
    now = named_plugin_modules()
    if now == PLUGIN_MODULES:
        return None
    return (f"STREAMPREP_PLUGINS names {spelled(now)!r} now but named {spelled(PLUGIN_MODULES)!r} when streamprep "
            f"was imported, the moment it is read: set it before `import streamprep`, or set it back (a plug-in's "
            f"module you import yourself reaches the workers too; the variable set after the import still differs)")
# How many gate factories (`quality.gates.EXTRA_GATES`) the STREAMPREP_PLUGINS modules registered, which
# streamprep/plugins.py puts first: those after them were registered by code the caller ran (before or after
# `import streamprep`), as `Registry.late` entries are
GATES_AT_START = 0


_REGISTERED = itertools.count()


def registration_order() -> tuple[int, int]:
    """Where a registration made now stands among all plug-ins' (run.json records their modules so: their order
    decides which gate runs first and which of two registrations of a name stands): after how many gate factories
    (`quality.gates.EXTRA_GATES`, a list quality keeps itself, imported or not), then after how many registrations
    of any family here. Gate factory i stands at (i + 1, -1): after those registered while there were i."""
    gates = sys.modules.get("quality.gates")
    return len(gates.EXTRA_GATES) if gates is not None else 0, next(_REGISTERED)


def module_of(target: Any) -> str:
    """The module that defines a registered target (of a "module:attr" string, that module)."""
    if isinstance(target, str):
        return target.partition(":")[0]
    return str(getattr(target, "__module__", None) or type(target).__module__)


def scheme_of(path: str) -> str:
    """The registered scheme `path` starts with (the longest), else "" (a local path)."""
    found = [name for name in SCHEMES.names() if name and path.startswith(name)]
    return max(found, key=len) if found else ""
