"""The built-in plug-ins, declared in the registries (streamprep/registry.py) as "module:attr" strings.

Imported by the package `__init__`, so every process (driver, QC workers, Ray actors) has the registries
filled before a config is validated; nothing here imports a plug-in's module (the local engine never loads
Ray or Xenna). `STREAMPREP_PLUGINS` (comma-separated module names) names
modules of your own to import as well, in every process: their one registration line then runs there too.
"""
from __future__ import annotations

import importlib
import sys

from streamprep.registry import (CHECKS, ENGINES, MODES, PLUGIN_IMPORT_ERRORS, PLUGIN_MODULES, SCHEMES, SECTIONS,
                                 SOURCE_FORMATS, TOKENIZER_BACKENDS, WRITERS)
from streamprep import registry

ENGINES.register("xenna", "streamprep.engines.xenna:XennaEngine")
ENGINES.register("local", "streamprep.engines.local:LocalEngine")

TOKENIZER_BACKENDS.register("auto")  # = streamprep.backends.BACKENDS
TOKENIZER_BACKENDS.register("gigatoken")
TOKENIZER_BACKENDS.register("hf")
TOKENIZER_BACKENDS.closed = ("a plug-in cannot add a tokenizer backend (streamprep/backends.py has auto, gigatoken "
                             "and hf, each checked to give the same ids)")

for _fmt in ("jsonl", "parquet", "txt", "document"):  # read by streamprep.sources.local itself
    SOURCE_FORMATS.register(_fmt, builtin=True)

SCHEMES.register("", "streamprep.sources.local:LocalSource.open", check="streamprep.sources.local:check_entry")
for _scheme in ("s3://", "gs://", "gcs://", "az://", "abfs://", "http://", "https://", "memory://"):
    SCHEMES.register(_scheme, "streamprep.sources.local:LocalSource.open", fsspec=True,
                     check="streamprep.sources.local:check_entry")
SCHEMES.register("hf://", "streamprep.sources.hf:HFSource", requires=("split",),
                 check="streamprep.sources.hf:check_entry",
                 reads=("split", "subset", "revision", "filter"),
                 formats=("jsonl", "json", "parquet", "txt", "text", "csv", "arrow"))  # = hf.FORMAT_TO_BUILDER

SECTIONS.register("quality", "quality.settings:validate_quality_config",
                  load="quality.settings:QualitySettings.from_dict", key_prefix="quality.", required=True)
SECTIONS.register("sft", "streamprep.sft.config:validate_sft_config", load="streamprep.sft.config:SftConfig.from_dict")
SECTIONS.closed = ("a plug-in cannot add a top-level config section (streamprep's own are quality and sft, which "
                   "Config holds); read your plug-in's settings from a file or the environment of its own")

CHECKS.register("output.parquet", "streamprep.exports.parquet:check_options")
# a phase may name an optional dataset skipped for want of input
CHECKS.register("output.mixtures", "streamprep.exports.mixtures:check_options", skipped=True)
CHECKS.register("output.dtype", "streamprep.sft.config:check_output_dtype")  # an sft: run's dtype is its own
CHECKS.register("output.valid_fraction", "streamprep.sft.config:check_valid_fraction")  # an sft: run has no blend
CHECKS.register("output.parquet.sft", "streamprep.sft.config:check_parquet")  # nor Parquet/TSV
CHECKS.register("datasets.memory", "streamprep.sources.local:check_in_memory")  # where workers can read it
CHECKS.register("execution.ray_address", "streamprep.ray_cluster:check_address")
CHECKS.register("execution.engine", "streamprep.engines:check_engine")  # it loads, before anything is written
CHECKS.register("tokenizer", "streamprep.tokenizer:check_section")  # last: it loads the tokenizer
CHECKS.register("sft.template", "streamprep.sft.chat:check_chat_template")  # after it: needs its tokenizer.json
CHECKS.register("quality.gates", "streamprep.unit_worker:check_gates")  # the plug-in gates' names, at start

MODES.register("sft", "streamprep.sft.mode:SftMode.of")

# in this order, before any writer of your own: mixtures.json lists the Parquet shards the first one wrote
# built in: mixtures.json reads what the Parquet writer leaves, and verify checks all three
WRITERS.register("parquet", "streamprep.exports.parquet:export", builtin=True)
WRITERS.register("blend", "streamprep.exports.blend:export", builtin=True)
WRITERS.register("mixtures", "streamprep.exports.mixtures:export", builtin=True)

# gates a caller's module registered before `import streamprep` (quality.gates needs no streamprep): late ones
_gates = sys.modules.get("quality.gates")
_early = list(_gates.EXTRA_GATES) if _gates is not None else []
for _module in registry.named_plugin_modules():
    PLUGIN_MODULES.append(_module)
    try:
        importlib.import_module(_module)
    # reported by config.validate, the CLI and a worker's unit_worker.init_worker (registry.PLUGIN_IMPORT_ERRORS); a
    # SystemExit too (sys.exit, a module parsing argv): every command ended with its code, sys.exit(0) silently as a
    # success
    except (Exception, SystemExit) as _exc:
        _why = (str(_exc).strip().splitlines() or [""])[0]
        PLUGIN_IMPORT_ERRORS.append(f"STREAMPREP_PLUGINS: module {_module!r} failed to import "
                                    f"({type(_exc).__name__}{': ' + _why if _why else ''})")

for _registry in registry.FAMILIES:
    _registry.at_start = {e.name: e.target for e in _registry.entries()}  # what every process has (`late`)
_gates = sys.modules.get("quality.gates")  # imported by a STREAMPREP_PLUGINS module that registers a gate
if _gates is not None:
    # the STREAMPREP_PLUGINS modules' gates first, as a worker has them (it imports the late ones' modules after
    # them, `unit_worker.init_worker`): an early gate counted as theirs ran in this process only, and run.json
    # did not record it
    _late = [f for f in _early if registry.module_of(f) not in PLUGIN_MODULES]
    _at_start = [f for f in _early if registry.module_of(f) in PLUGIN_MODULES] + _gates.EXTRA_GATES[len(_early):]
    _gates.EXTRA_GATES[:] = _at_start + _late
    registry.GATES_AT_START = len(_at_start)
