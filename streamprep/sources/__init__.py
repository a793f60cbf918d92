"""Open the reader of a dataset entry through its scheme (registry.SCHEMES): `hf://` repos, fsspec URLs, local paths."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamprep import registry
from streamprep.sources.base import BadRecord, Source

if TYPE_CHECKING:
    from streamprep.config import DatasetConfig

__all__ = ["BadRecord", "Source", "open_source"]


def open_source(dataset: DatasetConfig, cache_dir: Path, max_concurrent_downloads: int = 8,
                **options: Any) -> Source:
    """The source its path's scheme registers; `options` (prefetch_files, cache_max_gb, keep_cache) are the
    download limits a remote scheme such as `hf://` takes, the others ignore them."""
    return registry.SCHEMES.get(registry.scheme_of(dataset.path))(dataset, cache_dir, max_concurrent_downloads,
                                                                   **options)
