"""streamprep: raw text corpora -> quality-controlled, tokenized, Megatron-ready data.

The API, `run_from_dict` and `run_config_file`, is the pipeline's and is loaded on first use, as a registry's
"module:attr" targets are: a process that needs one module (a command such as `status`, a QC worker) imports
that module and what it imports, not the whole package (~0.4 s).
"""
from __future__ import annotations

from typing import Any

from streamprep import plugins  # noqa: F401  (fills the registries before any config is validated)
from streamprep.registry import Entry
from streamprep.version import __version__

_API = {name: Entry(name, f"streamprep.pipeline:{name}") for name in ("run_from_dict", "run_config_file")}

__all__ = ["run_from_dict", "run_config_file", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _API:
        return _API[name].load()
    raise AttributeError(f"module 'streamprep' has no attribute {name!r}")
