"""Exact dedup: the set of SHA-256 digests of kept (normalised) texts, in insertion order.

Insertion order matters because ingest persists the index as an append-only log of 32-byte digests
and rebuilds it with `from_bytes` on resume.
"""
from __future__ import annotations

DIGEST_SIZE = 32


class DedupIndex:
    """The one authority for exact dedup: holds the digests of KEPT records."""

    __slots__ = ("_seen", "_log")

    def __init__(self) -> None:
        self._seen: set[bytes] = set()
        self._log = bytearray()

    def __contains__(self, digest: object) -> bool:
        return digest in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def add(self, digest: bytes) -> None:
        """Record a kept digest; adding one already present is a no-op (the log stays duplicate-free)."""
        if not isinstance(digest, bytes) or len(digest) != DIGEST_SIZE:
            raise ValueError(f"digest must be {DIGEST_SIZE} bytes, got {digest!r:.80}")
        if digest not in self._seen:
            self._seen.add(digest)
            self._log += digest

    def to_bytes(self) -> bytes:
        """The digests concatenated in insertion order."""
        return bytes(self._log)

    @classmethod
    def from_bytes(cls, data: bytes) -> DedupIndex:
        """Rebuild from `to_bytes` output (or an append-only log of it); a torn tail is an error."""
        if len(data) % DIGEST_SIZE:
            raise ValueError(f"dedup log length {len(data)} is not a multiple of {DIGEST_SIZE}")
        index = cls()
        view = memoryview(data)
        for i in range(0, len(data), DIGEST_SIZE):
            index.add(bytes(view[i:i + DIGEST_SIZE]))
        return index
