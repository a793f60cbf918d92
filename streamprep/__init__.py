"""streamprep: raw text corpora -> quality-controlled, tokenized, Megatron-ready data."""
from streamprep import plugins  # noqa: F401  (fills the registries before any config is validated)
from streamprep.version import __version__
from streamprep.pipeline import run_config_file, run_from_dict

__all__ = ["run_from_dict", "run_config_file", "__version__"]
