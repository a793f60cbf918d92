"""streamprep: raw text corpora -> quality-controlled, tokenized, Megatron-ready data."""
from typing import Any

from streamprep import plugins  # noqa: F401  (fills the registries before any config is validated)
from streamprep.version import __version__
__all__ = ["run_from_dict", "run_config_file", "__version__"]


def __getattr__(name: str) -> Any:
    # The API lives in streamprep.pipeline; imported lazily so `import streamprep` stays light.
    if name in ("run_from_dict", "run_config_file"):
        from streamprep import pipeline

        return getattr(pipeline, name)
    raise AttributeError(name)
