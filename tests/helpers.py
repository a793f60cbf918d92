"""Small builders shared by tests: configs over real or generated data, run dirs, file hashes."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]  # the checkout (tests/ live in subfolders mirroring the packages)
PHI2 = "tokenizers/phi-2/tokenizer.json"


def base_config(datasets: list[dict[str, Any]], tokenizer: str | None, **over: Any) -> dict[str, Any]:
    """A small local-engine config; `over` replaces whole top-level sections."""
    cfg: dict[str, Any] = {
        "run": {"name": "t", "seed": 7},
        "datasets": datasets,
        "quality": {"expected_language": None, "min_chars": 20},
        "tokenizer": {"path": tokenizer, "train": {"vocab_size": 600, "min_frequency": 2}},
        "output": {"shard_records": 200},
        "execution": {"engine": "local", "workers": 1, "batch_records": 64},
    }
    cfg.update(over)
    return cfg


def tree_hashes(root: Path, *subdirs: str, names: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every file under the given subdirs (and the named top-level files), by relative path."""
    out = {}
    for sub in subdirs:
        base = root / sub
        for p in sorted(base.rglob("*")) if base.exists() else []:
            if p.is_file():
                out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    for n in names:
        if (root / n).exists():
            out[n] = hashlib.sha256((root / n).read_bytes()).hexdigest()
    return out


def english_docs(n: int, seed: int = 0) -> list[str]:
    """Deterministic English-ish documents of 150-600 chars, all distinct."""
    import random

    words = ("the data pipeline reads records from many files and writes clean text for training large "
             "language models while checking quality and removing duplicates before tokenization").split()
    rng = random.Random(seed)
    return [f"Document {i}: " + " ".join(rng.choice(words) for _ in range(rng.randint(25, 90))) + "."
            for i in range(n)]


async def ingest_stopped_after(config: Any, run_dir: Path, dataset: str, consumed: int):
    """Run the asyncio ingest and request a stop once `dataset` has consumed `consumed` items; its final state."""
    import asyncio

    from streamprep.ingest import IngestContext, ingest_all

    ctx = IngestContext.of(config, run_dir, run_dir / "checkpoints", asyncio.Event())
    task = asyncio.create_task(ingest_all(ctx))
    while dataset not in ctx.progress or ctx.progress[dataset].consumed < consumed:
        await asyncio.sleep(0.001)
    ctx.stop.set()
    return (await task)[dataset]


def local_source(path: Any, fmt: str | None = None) -> Any:
    """A LocalSource on `path` (a file, directory or glob), as a dataset entry with defaults would open it."""
    from streamprep.config import dataset
    from streamprep.sources.local import LocalSource

    return LocalSource(dataset({"name": "d", "path": str(path), "format": fmt}))
