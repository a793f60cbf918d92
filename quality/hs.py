"""Hyperscan (SIMD multi-pattern matching over bytes) as the gates use it: compiled databases, and a scratch
space per thread and database (a scratch serves one scan at a time)."""
from __future__ import annotations

import threading

import hyperscan

_local = threading.local()


def database(expressions: list[bytes], flags: int = 0) -> hyperscan.Database:
    """A block-mode database of `expressions`; a match reports its index as the pattern id."""
    db = hyperscan.Database(mode=hyperscan.HS_MODE_BLOCK)
    db.compile(expressions=expressions, ids=list(range(len(expressions))), elements=len(expressions),
               flags=[flags] * len(expressions))
    return db


def scratch(db: hyperscan.Database) -> hyperscan.Scratch:
    """This thread's scratch for `db` (databases live as long as the process: their ids stay theirs)."""
    try:
        return _local.scratches[id(db)]
    except AttributeError:
        _local.scratches = {}
    except KeyError:
        pass
    made = _local.scratches[id(db)] = hyperscan.Scratch(db)
    return made
