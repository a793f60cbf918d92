"""streamprep: raw text corpora -> quality-controlled, tokenized, Megatron-ready data.

The API, `run_from_dict` and `run_config_file` with what they return and raise (`RunResult`; `ConfigError` for a
bad config or path, nothing written; `Interrupted`, a KeyboardInterrupt, once a signal stopped the run with its
progress saved), is the pipeline's and is loaded on first use, as a registry's
"module:attr" targets are: a process that needs one module (a command such as `status`, a QC worker) imports
that module and what it imports, not the whole package (~0.4 s).
"""
from __future__ import annotations

from typing import Any

from streamprep import plugins  # noqa: F401  (fills the registries before any config is validated)
from streamprep.registry import Entry
from streamprep.version import __version__

_API = {name: Entry(name, f"streamprep.{module}:{name}") for module, names in (
    ("pipeline", ("run_from_dict", "run_config_file", "RunResult", "Interrupted")), ("config", ("ConfigError",)))
    for name in names}

__all__ = ["run_from_dict", "run_config_file", "RunResult", "Interrupted", "ConfigError", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _API:
        return _API[name].load()
    raise AttributeError(f"module 'streamprep' has no attribute {name!r}")
