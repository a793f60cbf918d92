"""streamprep: raw text corpora -> quality-controlled, tokenized, Megatron-ready data."""
__version__ = "0.1.0"
