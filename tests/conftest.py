"""Shared fixtures: the real corpora in ../shared/data (skip without them, fail under CI=true)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("STREAMPREP_SHARED_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """Path to ../shared/data; tests needing it skip with a reason when absent, but fail under CI."""
    if not (SHARED_DATA / "SOURCES.md").is_file():
        msg = f"shared corpora not found at {SHARED_DATA} (set STREAMPREP_SHARED_DATA or clone shared/ beside the repo)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return SHARED_DATA


@pytest.fixture(scope="session")
def ray_cluster():
    """One Ray cluster for every `ray`-marked test (xenna-notes.md §7); everything it started is reaped."""
    import ray

    from streamprep.ray_cluster import OBJECT_STORE_BYTES, RAY_ENV, shutdown_ray

    os.environ.update(RAY_ENV)
    ctx = ray.init(num_cpus=2, include_dashboard=True, log_to_driver=False, object_store_memory=OBJECT_STORE_BYTES)
    os.environ["RAY_ADDRESS"] = ctx.address_info["gcs_address"]
    try:
        yield ctx
    finally:
        shutdown_ray()
        os.environ.pop("RAY_ADDRESS", None)
