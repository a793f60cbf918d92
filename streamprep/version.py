"""The package version, in a leaf module: the manifest and run.json record it without importing the package API."""
from __future__ import annotations

import functools

__version__ = "0.1.0"


@functools.cache
def source() -> tuple[str, str]:
    """(`VERSION+HASH`, `DIR on HOST`): this process's streamprep, by a hash of the .py files and the `data/`
    files (their paths relative to the package, sorted, and bytes) of the two packages it ships, `streamprep` and
    `quality` (the gates and dedup a worker judges with, and the word lists the gates read), and where it is. Every
    node of a multi-node job must run the driver's code and data (a worker's other `build_audit` failed the job at
    its end, with a bare TypeError; another PII pattern or profanity list would judge its units otherwise), whatever
    the version says; computed once a process (under 10 ms: ~1 MB of source)."""
    import hashlib
    import importlib.util
    import socket
    from pathlib import Path

    root = Path(__file__).resolve().parent
    quality = importlib.util.find_spec("quality")  # found, not imported
    where = list(quality.submodule_search_locations or []) if quality is not None else []
    roots = [root, *(Path(p).resolve() for p in where[:1])]
    digest = hashlib.sha256()
    for top in roots:
        # a hidden name no install ships left out (.DS_Store, an editor's lock `.#x.py`: a symlink to nothing, an
        # .ipynb_checkpoints/ copy), and anything that is no file to read
        files = {p.relative_to(top).as_posix() for p in [*top.rglob("*.py"), *(top / "data").rglob("*")]
                 if not any(part.startswith(".") for part in p.relative_to(top).parts) and p.is_file()}
        for rel in sorted(files):
            digest.update(f"{top.name}/{rel}\0".encode() + (top / rel).read_bytes() + b"\0")
    return f"{__version__}+{digest.hexdigest()[:12]}", f"{root} on {socket.gethostname()}"
