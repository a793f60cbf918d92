"""streamprep: raw text corpora -> quality-controlled, tokenized, Megatron-ready data."""
from typing import Any

__version__ = "0.1.0"
__all__ = ["run_from_dict", "run_config_file", "__version__"]


def __getattr__(name: str) -> Any:
    # The API lives in streamprep.pipeline; imported lazily so `import streamprep` stays light.
    if name in ("run_from_dict", "run_config_file"):
        from streamprep import pipeline

        return getattr(pipeline, name)
    raise AttributeError(name)
