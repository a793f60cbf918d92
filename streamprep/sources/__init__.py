"""Pick the reader for a dataset entry: `hf://` repos through `datasets`, everything else through fsspec."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamprep.sources.base import BadRecord, Source

if TYPE_CHECKING:
    from streamprep.config import DatasetConfig

__all__ = ["BadRecord", "Source", "open_source"]


def open_source(dataset: DatasetConfig, hf_cache: Path, max_concurrent_downloads: int = 8,
                **hf_options: Any) -> Source:
    """`hf_options` (prefetch_files, cache_max_gb, keep_cache) go to `HFSource`; local sources ignore them."""
    if dataset.path.startswith("hf://"):
        from streamprep.sources.hf import HFSource

        return HFSource(dataset, hf_cache, max_concurrent_downloads, **hf_options)
    from streamprep.sources.local import LocalSource

    return LocalSource(dataset)
