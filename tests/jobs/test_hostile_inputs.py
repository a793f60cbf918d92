"""Hostile inputs and faults (issue #13 items 1 and 6): a source that fails never hangs the job, a signal always
stops it, a changed input is noticed on resume, damaged run records give a one-line message.

Every test is bounded (thread join, asyncio.wait_for or subprocess timeout): a regression fails, never hangs."""
from __future__ import annotations

import asyncio
import bz2
import codecs
import dataclasses
import gzip
import hashlib
import http.server
import json
import lzma
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard

from helpers import REPO, assert_gone_refused, base_config, english_docs, local_source, tree_hashes
from streamprep import run_from_dict
from streamprep.checkpoints import DatasetFiles, load_checkpoint, repair
from streamprep.config import Config, ConfigError, load, validate
from streamprep.ingest import IngestContext, ingest_all
from streamprep.sources.base import BadRecord, SourceError, input_change
from streamprep.sources import local as local_mod
from streamprep.sources.local import FULL_HASH_BYTES

RECORDS = [{"text": f"record number {i} " + "filler " * (i % 40), "id": i} for i in range(3000)]
JSONL = "".join(json.dumps(r) + "\n" for r in RECORDS).encode()
def _head(k: int) -> bytes:
    """The first k lines of JSONL (RECORDS[:k])."""
    return b"".join(JSONL.splitlines(keepends=True)[:k])


COMPRESS: dict[str, Callable[[bytes], bytes]] = {
    "gz": lambda b: gzip.compress(b, mtime=0), "bz2": lambda b: bz2.compress(b, 1), "xz": lzma.compress,
    "zst": lambda b: zstandard.ZstdCompressor(write_checksum=True).compress(b)}  # as the zstd CLI writes it


def _lzma_alone(data: bytes) -> bytes:
    """A .lzma file, as `lzma -c` writes it (fsspec decompresses the suffix)."""
    return lzma.compress(data, lzma.FORMAT_ALONE)


def _bounded(fn: Callable[[], Any], timeout: float = 20) -> Any:
    """fn() in a daemon thread; fails the test (instead of hanging it) when it takes longer than `timeout`."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            out["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"still running after {timeout}s (a hang)"
    if "error" in out:
        raise out["error"]
    return out["value"]


def _items(path: Path | str, start: dict | None = None, fmt: str | None = None) -> list[tuple[Any, dict]]:
    return _bounded(lambda: list(local_source(path, fmt).iter_records(start)))


def _split(items: list) -> tuple[list, list[BadRecord]]:
    return [r for r, _ in items if not isinstance(r, BadRecord)], [r for r, _ in items if isinstance(r, BadRecord)]


def _decodable_lines(ext: str, packed: bytes) -> int:
    """The whole lines a streaming decoder gets out of `packed` before it fails or the bytes end (what `gzip -dc`
    prints of a damaged file)."""
    decoder = {"gz": lambda: zlib.decompressobj(31), "bz2": bz2.BZ2Decompressor, "xz": lzma.LZMADecompressor,
               "zst": lambda: zstandard.ZstdDecompressor().decompressobj()}[ext]()
    out = b""
    for i in range(0, len(packed), 1024):
        try:
            out += decoder.decompress(packed[i:i + 1024])
        except (OSError, EOFError, ValueError, zlib.error, zstandard.ZstdError):
            break
    return out.count(b"\n")


# ---- readers: an unreadable rest is one reject naming the file and position; the next file goes on ----------
@pytest.mark.parametrize("ext", sorted(COMPRESS))
def test_truncated_compressed_file_keeps_what_was_read_then_one_reject(tmp_path: Path, ext: str) -> None:
    packed = COMPRESS[ext](JSONL)
    (tmp_path / f"a.jsonl.{ext}").write_bytes(packed[: len(packed) * 2 // 3])
    (tmp_path / "b.jsonl").write_bytes(_head(30))
    after = RECORDS[:30]
    items = _items(tmp_path)
    good, bad = _split(items)
    k = len(good) - len(after)
    assert k == _decodable_lines(ext, packed[: len(packed) * 2 // 3]) > 0  # every line decoded before the damage
    assert good == RECORDS[:k] + after  # a prefix of the file, then the next file
    assert len(bad) == 1 and isinstance(items[k][0], BadRecord)
    assert f"a.jsonl.{ext} after record {k}" in bad[0].reason and "EOFError" in bad[0].reason
    # a resume before the damage meets the same reject; one after it goes on with the next file
    assert _items(tmp_path, items[k - 5][1]) == items[k - 4:]
    assert _split(_items(tmp_path, items[k][1])) == (after, [])


@pytest.mark.parametrize("ext, cut", [("gz", 12), ("gz", 8), ("bz2", 4), ("xz", 4), ("zst", 4), ("gz", -1), ("zst", -1),
                                      ("zst", -2)],
                         ids=["gz-12", "gz-trailer", "bz2", "xz", "zst-checksum", "gz-trailing-garbage",
                              "zst-trailing-garbage", "zst-zero-padding"])
def test_a_file_damaged_at_its_end_keeps_every_line_decoded_before(tmp_path: Path, ext: str, cut: int) -> None:
    """Regression: the read that met the damage lost what it had decoded, up to 8 KiB of lines (53 of 1 000 short
    lines), though `gzip -dc` prints them. Each cut keeps all but at most the last line; garbage after a whole gzip
    member (which `gzip -dc` ignores with a warning) keeps them all, and so do garbage or zeros after a whole zstd
    frame (`zstd -dc` prints every line, then fails): the .zst lost them all, 0 of 1 000 kept."""
    lines = b"".join(json.dumps({"text": f"record number {i} with some words"}).encode() + b"\n" for i in range(1000))
    packed = COMPRESS[ext](lines)
    packed = packed + {-1: b"trailing garbage", -2: bytes(8)}[cut] if cut < 0 else packed[:-cut]
    (tmp_path / f"a.jsonl.{ext}").write_bytes(packed)
    good, bad = _split(_items(tmp_path / f"a.jsonl.{ext}"))
    assert len(good) == (1000 if cut < 0 else _decodable_lines(ext, packed)) >= 999
    assert good == [{"text": f"record number {i} with some words"} for i in range(len(good))]
    assert len(bad) == 1 and bad[0].reason.startswith(f"unreadable rest of {tmp_path / f'a.jsonl.{ext}'} after "
                                                      f"record {len(good)}, skipped: ")


def test_a_zst_with_a_damaged_later_frame_keeps_the_frames_before_it(tmp_path: Path) -> None:
    """Regression: a .zst of 10 frames of 20 records, the 7th frame's header overwritten, kept 0 records (the read
    that decoded frames 1-6 raised at the 7th and lost them all), though `zstd -dc` prints 120 lines. The 120 are
    kept, then one reject; a resume inside them reaches the same records and the same reject."""
    frames = [COMPRESS["zst"](_head(20 * (f + 1))[len(_head(20 * f)):]) for f in range(10)]
    frames[6] = b"\xaa" * 6 + frames[6][6:]
    (tmp_path / "a.jsonl.zst").write_bytes(b"".join(frames))
    items = _items(tmp_path)
    good, bad = _split(items)
    assert good == RECORDS[:120]
    assert [b.reason for b in bad] == [f"unreadable rest of {tmp_path / 'a.jsonl.zst'} after record 120, skipped: "
                                       "ZstdError: zstd decompressor error: Unknown frame descriptor"]
    assert _items(tmp_path, items[99][1]) == items[100:]


@pytest.mark.parametrize("ext, why", [("bz2", "OSError: Invalid data stream"),
                                      ("xz", "LZMAError: Input format not supported by decoder")])
def test_a_bz2_or_xz_with_a_damaged_later_stream_keeps_the_streams_before_it_then_one_reject(
        tmp_path: Path, ext: str, why: str) -> None:
    """Regression: BZ2File and LZMAFile end a file quietly at bytes after a stream that do not open another one: of
    3 streams of 20 records, the 2nd one's first byte flipped, 20 were read and 40 vanished, no reject, no count
    (`xz -t` calls it corrupt, `bzip2 -t` warns of trailing garbage), and so did garbage after the last stream.
    The 20 are kept, then one reject, also for zeros that are not the xz format's stream padding (a multiple of 4
    bytes; bzip2 has none) and for `format: document`; a resume inside the 20 meets the same reject."""
    streams = [COMPRESS[ext](_head(20 * (s + 1))[len(_head(20 * s)):]) for s in range(3)]
    damaged = bytes([streams[1][0] ^ 0xFF]) + streams[1][1:]
    tails = {"a": damaged + streams[2], "b": b"trailing garbage", "c": bytes(3 if ext == "xz" else 4)}
    for name, tail in tails.items():
        (tmp_path / f"{name}.jsonl.{ext}").write_bytes(streams[0] + tail)
    items = _items(tmp_path)
    good, bad = _split(items)
    assert good == RECORDS[:20] * 3
    assert [b.reason.split(", skipped: ")[0] for b in bad] == [
        f"unreadable rest of {tmp_path / f'{name}.jsonl.{ext}'} after record 20" for name in tails]
    assert bad[0].reason.endswith(why) and bad[1].reason.endswith(why)
    assert _items(tmp_path / f"a.jsonl.{ext}", items[9][1]) == items[10:21]
    doc = _items(tmp_path / f"a.jsonl.{ext}", fmt="document")
    assert [r.reason for r, _ in doc] == [f"unreadable rest of {tmp_path / f'a.jsonl.{ext}'} after record 0, "
                                          f"skipped: {why}"]


@pytest.mark.parametrize("ext", ["bz2", "xz"])
def test_a_bz2_or_xz_of_several_streams_is_read_whole(tmp_path: Path, ext: str) -> None:
    """What `bzip2 -dc` / `xz -dc` read without an error is read whole, no reject: streams one after another
    (pbzip2, `cat`), empty ones among them, and for xz stream padding (zero bytes, a multiple of 4) between
    and after them."""
    pad = bytes(8 if ext == "xz" else 0)
    packed = COMPRESS[ext](_head(7)) + pad + COMPRESS[ext](b"") + COMPRESS[ext](_head(30)[len(_head(7)):]) + pad[:4]
    (tmp_path / f"a.jsonl.{ext}").write_bytes(packed)
    assert [r for r, _ in _items(tmp_path)] == RECORDS[:30]


def test_corrupt_or_foreign_zst_is_one_reject_with_the_reason(tmp_path: Path) -> None:
    packed = bytearray(COMPRESS["zst"](_head(400)))
    packed[-2] ^= 0xFF  # the content checksum no longer matches
    (tmp_path / "a.jsonl.zst").write_bytes(bytes(packed))
    (tmp_path / "b.jsonl.zst").write_bytes(_head(8))  # plain JSONL named .zst
    (tmp_path / "c.jsonl.zst").write_bytes(COMPRESS["zst"](_head(3)) + COMPRESS["zst"](_head(6)[len(_head(3)):]))
    good, bad = _split(_items(tmp_path))
    assert good == RECORDS[:6]  # c: two frames, read across
    assert [b.reason.split(", skipped: ")[0] for b in bad] == [f"unreadable rest of {tmp_path / n} after record 0"
                                                                for n in ("a.jsonl.zst", "b.jsonl.zst")]
    assert "ZstdError" in bad[0].reason and "checksum" in bad[0].reason
    assert "ZstdError" in bad[1].reason and "Unknown frame descriptor" in bad[1].reason


def test_a_zst_with_a_window_over_the_decoders_limit_says_how_it_was_written(tmp_path: Path) -> None:
    """Regression: a valid .zst written with `zstd --long=31` (a 2 GiB window) was rejected whole as 'Frame requires
    too much memory for decoding', read as damage; the reason says what it is and what to do (the decoder's
    128 MiB limit is kept: a file must not make a worker reserve 2 GiB)."""
    import zstandard

    params = zstandard.ZstdCompressionParameters(window_log=31, enable_ldm=True, write_content_size=False)
    stream = zstandard.ZstdCompressor(compression_params=params).compressobj()
    (tmp_path / "a.jsonl.zst").write_bytes(stream.compress(_head(3)) + stream.flush())
    good, bad = _split(_items(tmp_path))
    assert good == [] and [b.reason for b in bad] == [
        f"unreadable rest of {tmp_path / 'a.jsonl.zst'} after record 0, skipped: ZstdError: zstd decompressor "
        f"error: Frame requires too much memory for decoding (a window over 128 MiB, as `zstd --long=31` writes: "
        f"recompress it without --long)"]


def test_gz_that_is_not_gzip_is_one_reject(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl.gz").write_bytes(_head(8))
    (tmp_path / "b.jsonl").write_bytes(_head(5))
    good, bad = _split(_items(tmp_path))
    assert good == RECORDS[:5]
    assert len(bad) == 1 and "a.jsonl.gz after record 0" in bad[0].reason and "Not a gzipped file" in bad[0].reason


def test_a_compressed_file_of_no_bytes_is_an_empty_file_whatever_its_codec(tmp_path: Path) -> None:
    """Regression: a 0-byte .bz2 or .xz was `unreadable rest of … after record 0, skipped: EOFError: …`, a 0-byte
    .gz or .zst `empty file …`. Each is `empty file …`, for the line formats and the units that read them."""
    from streamprep import units

    for ext in sorted(COMPRESS):
        (tmp_path / f"a.jsonl.{ext}").write_bytes(b"")
    want = [BadRecord(f"empty file {tmp_path / f'a.jsonl.{ext}'}", "") for ext in sorted(COMPRESS)]
    assert [r for r, _ in _items(tmp_path)] == want
    assert [item for ext in sorted(COMPRESS) for item in units.read_unit(
        units.Unit("file", 0, str(tmp_path / f"a.jsonl.{ext}"), "jsonl"))] == want


def test_parquet_with_a_corrupt_data_page_keeps_earlier_row_groups(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS[:2000]), path, row_group_size=500)
    chunk = pq.ParquetFile(path).metadata.row_group(2).column(0)
    data = bytearray(path.read_bytes())
    mid = (chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size // 2
    data[mid:mid + 64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    (tmp_path / "b.jsonl").write_bytes(_head(5))
    items = _items(tmp_path)
    good, bad = _split(items)
    assert good == RECORDS[:1000] + RECORDS[:5]
    assert len(bad) == 1 and "a.parquet after record 1000" in bad[0].reason
    assert _items(tmp_path, items[700][1]) == items[701:]  # resume inside row group 1: same reject again


def test_parquet_strings_that_are_not_utf8_are_one_reject_each_the_rows_beside_them_kept(tmp_path: Path) -> None:
    """Regression: one string value that is not UTF-8 failed its whole batch, and the file's rest (intact row groups
    too) became one `unreadable rest` reject: 2 of 4 rows read. Read whole (one unit) or as row groups (units whose
    reasons the driver numbers in the file, as `units.global_reason` does here), the same items and reasons."""
    from streamprep import units

    texts = [d.encode() for d in english_docs(12, seed=4)]
    texts[5], texts[9] = b"bad \xff byte " + texts[5], texts[9][:7] + b"\xc3"
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": pa.array(texts, pa.binary()).view(pa.string()), "id": list(range(12))}), path,
                   row_group_size=4)
    whole = [item for item, _ in _items(path)]
    want = [f"undecodable bytes in column 'text' at record {n} of {path}: {why}"
            for n, why in ((6, "invalid start byte at byte 4"), (10, "unexpected end of data at byte 7"))]
    assert [b.reason for b in whole if isinstance(b, BadRecord)] == want
    assert [r["id"] for r in whole if not isinstance(r, BadRecord)] == [i for i in range(12) if i not in (5, 9)]
    plan = units.plan_dataset([str(path)], None, unit_bytes=1)
    assert [u.kind for u in plan] == ["row_group"] * 3
    before, by_units = 0, []
    for unit in plan:
        got = list(units.read_unit(unit))
        by_units += [BadRecord(units.global_reason(g.reason, before + j), g.raw) if isinstance(g, BadRecord) else g
                     for j, g in enumerate(got)]
        before += len(got)
    assert by_units == whole


@pytest.mark.parametrize("kind", ["timestamp", "date32"])
def test_a_parquet_value_python_cannot_hold_is_one_reject_naming_its_column(tmp_path: Path, kind: str) -> None:
    """Regression: a timestamp past year 9999 (or a date32 past Python's range), in a column the job does not even
    read, failed its batch as an environment fault: exit 1, and every resume stopped at the same place. It is one
    reject naming the column and the record, the rows beside it kept."""
    texts = english_docs(12, seed=4)
    big = {"timestamp": pa.array([0] * 7 + [253402300800 * 10] + [0] * 4, pa.timestamp("s")),
           "date32": pa.array([0] * 7 + [2**31 - 1] + [0] * 4, pa.date32())}[kind]
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": texts, "created": big}), path, row_group_size=4)
    items = [item for item, _ in _items(path)]
    bad = [b.reason for b in items if isinstance(b, BadRecord)]
    assert len(bad) == 1 and bad[0].startswith(f"a value Python cannot hold in column 'created' at record 8 of {path}: ")
    assert [r["text"] for r in items if not isinstance(r, BadRecord)] == texts[:7] + texts[8:]


@pytest.mark.parametrize("damaged", [False, True])
def test_a_zip_archive_read_with_a_format_is_one_reject_not_its_first_member(tmp_path: Path, damaged: bool) -> None:
    """Regression: with `format: jsonl` a `.zip` went to fsspec's zip codec, which reads the archive's first member
    alone: of a.jsonl (3 records) + b.jsonl (5), 3 read, the 5 gone without a reject; a damaged one (gzip bytes
    named .zip) was BadZipFile, exit 1, at every resume. Each is one reject saying what to do; the job goes on."""
    import zipfile

    path = tmp_path / "in" / "a.jsonl.zip"
    path.parent.mkdir()
    if damaged:
        path.write_bytes(gzip.compress(_head(3)))
    else:
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("a.jsonl", _head(3))
            z.writestr("b.jsonl", _head(5))
    (tmp_path / "in" / "b.jsonl").write_bytes(_head(2))
    good, bad = _split(_items(tmp_path / "in", fmt="jsonl"))
    assert good == RECORDS[:2] and [b.reason for b in bad] == [
        (f"unsupported file, skipped: {path}: a .zip archive (not read: unpack it, or compress each file as .gz, "
         f".zst, .bz2 or .xz)")]


@pytest.mark.parametrize("name", ["a.jsonl.tar", "a.jsonl.tar.gz", "a.tgz", "a.tar.zst", "a.tar.lzma"])
def test_a_tar_archive_is_one_reject_whatever_the_format_and_exit_2_named_alone(tmp_path: Path, name: str) -> None:
    """Regression: a tar of JSONL read with `format: jsonl` (where the "unknown file type … set 'format'" of a path
    naming it alone led) was read as lines: each member's first record glued to its tar header, a "malformed JSON"
    reject each and one for the padding, the rest kept. It is one reject saying to unpack it, as a .zip is, with
    or without `format` and in byte ranges too; a path naming it alone is a config error (exit 2)."""
    import tarfile

    from streamprep import units
    from streamprep.sources.local import check_entry

    for member, k in (("a.jsonl", 3), ("b.jsonl", 5)):
        (tmp_path / member).write_bytes(_head(k))
    path = tmp_path / "in" / name
    path.parent.mkdir()
    with tarfile.open(path.with_suffix(".plain"), "w") as tar:
        for member in ("a.jsonl", "b.jsonl"):
            tar.add(tmp_path / member, arcname=member)
    packed = path.with_suffix(".plain").read_bytes()
    path.with_suffix(".plain").unlink()
    path.write_bytes(COMPRESS["zst"](packed) if name.endswith(".zst") else COMPRESS["gz"](packed)
                     if name.endswith("gz") else _lzma_alone(packed) if name.endswith(".lzma") else packed)
    (tmp_path / "in" / "b.jsonl").write_bytes(_head(2))
    why = f"{path}: a tar archive (not read: unpack it, or compress each file as .gz, .zst, .bz2 or .xz)"
    for fmt in (None, "jsonl", "txt"):
        good, bad = _split(_items(tmp_path / "in", fmt=fmt))
        assert good == (RECORDS[:2] if fmt != "txt" else [{"text": line} for line in _head(2).decode().splitlines()])
        assert [b.reason for b in bad] == [f"unsupported file, skipped: {why}"]
        plan = units.plan_dataset([str(path)], fmt, 512)  # ranges of an uncompressed one read its headers as lines
        assert [item.reason for u in plan for item in units.read_unit(u)] == [f"unsupported file, skipped: {why}"]
        with pytest.raises(ConfigError) as err:
            check_entry("datasets[0]", {"path": str(path), "format": fmt})
        assert str(err.value) == f"config: 'datasets[0].path': {why}"


def test_a_parquet_file_compressed_whole_is_one_reject_saying_to_decompress_it(tmp_path: Path) -> None:
    """Regression: `a.parquet.gz` was classed Parquet by its name and read as one, compressed bytes and all:
    'unreadable Parquet file …: Either the file is corrupted or this is not a parquet file', a file to be fixed
    for no fault of its bytes. It is one reject saying what to do, as a .zip is; a path naming it alone is exit 2."""
    from streamprep.sources.local import check_entry

    pq.write_table(pa.table({"text": ["alpha beta gamma"]}), tmp_path / "a.parquet")
    path = tmp_path / "in" / "a.parquet.gz"
    path.parent.mkdir()
    path.write_bytes(gzip.compress((tmp_path / "a.parquet").read_bytes()))
    (tmp_path / "in" / "b.jsonl").write_bytes(_head(2))
    why = f"{path}: a Parquet file compressed whole (not read: decompress it; Parquet compresses its own pages)"
    good, bad = _split(_items(tmp_path / "in"))
    assert good == RECORDS[:2] and [b.reason for b in bad] == [f"unsupported file, skipped: {why}"]
    with pytest.raises(ConfigError) as err:
        check_entry("datasets[0]", {"path": str(path), "format": None})
    assert why in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("ext", ["gz", "zst", "lzma"])
@pytest.mark.parametrize("unit_bytes", [64, 64 << 20])
def test_a_parquet_file_compressed_whole_is_the_same_reject_with_format_set(tmp_path: Path, ext: str,
                                                                             unit_bytes: int) -> None:
    """Regression: with `format: parquet` (or any built-in format) `a.parquet.gz` / `.zst` was still read as a
    Parquet file, 'unreadable Parquet file …: Parquet magic bytes not found in footer', exit 0 even named alone;
    only the format-less path said to decompress it. It is that reject whatever the format (and `unit_mb`), and a
    path naming it alone is exit 2."""
    from streamprep import units
    from streamprep.sources.local import check_entry

    pq.write_table(pa.table({"text": ["alpha beta gamma"]}), tmp_path / "a.parquet")
    path = tmp_path / "in" / f"a.parquet.{ext}"
    path.parent.mkdir()
    path.write_bytes({**COMPRESS, "lzma": _lzma_alone}[ext]((tmp_path / "a.parquet").read_bytes()))
    why = f"{path}: a Parquet file compressed whole (not read: decompress it; Parquet compresses its own pages)"
    for fmt in ("parquet", "jsonl"):
        plan = units.plan_dataset([str(path)], fmt, unit_bytes)
        assert [item.reason for u in plan for item in units.read_unit(u)] == [f"unsupported file, skipped: {why}"]
        with pytest.raises(ConfigError) as err:
            check_entry("datasets[0]", {"path": str(path), "format": fmt})
        assert str(err.value) == f"config: 'datasets[0].path': {why}"


def test_a_file_whose_name_has_glob_characters_is_that_file(tmp_path: Path) -> None:
    """Regression: `path: data[1].jsonl` was read as a glob (matching `data1.jsonl`), so the file itself was
    `no file matches`. A name that exists as written is that file; one that does not is still a glob."""
    from streamprep.sources.local import check_path

    (tmp_path / "data[1].jsonl").write_bytes(_head(3))
    (tmp_path / "data1.jsonl").write_bytes(_head(2))
    check_path("datasets[0].path", str(tmp_path / "data[1].jsonl"))
    assert _split(_items(tmp_path / "data[1].jsonl"))[0] == RECORDS[:3]
    assert local_mod.expand(str(tmp_path / "data[0-9].jsonl")) == [str(tmp_path / "data1.jsonl")]


def test_directory_with_unsupported_and_special_files_rejects_each_by_name(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(_head(5))
    (tmp_path / "notes.csv").write_text("a,b\n1,2\n")
    os.mkfifo(tmp_path / "pipe.jsonl")  # opening it would block forever
    zst = b"(\xb5/\xfd" + b"\x00" * 20
    (tmp_path / "z.jsonl.zst").write_bytes(zst)
    items = _items(tmp_path)
    good, bad = _split(items)
    assert good == RECORDS[:5]
    reasons = [b.reason for b in bad]  # in file order: a.jsonl, notes.csv, pipe.jsonl, z.jsonl.zst
    assert len(reasons) == 3
    assert "notes.csv: unknown file type" in reasons[0] and "unsupported file" in reasons[0]
    assert "pipe.jsonl is not a regular file" in reasons[1]
    # a truncated zstd frame: the file's rest is one reject naming it (zstandard is a dependency)
    assert reasons[2] == (f"unreadable rest of {tmp_path / 'z.jsonl.zst'} after record 0, skipped: EOFError: "
                          "Compressed file ended before the end-of-stream marker was reached")
    assert _items(tmp_path / "*") == items  # a glob lists them too
    assert _bounded(lambda: local_source(tmp_path).fingerprint())["files"][2] == \
        {"path": str(tmp_path / "pipe.jsonl"), "special": True}


def test_file_deleted_during_the_run_stops_naming_it(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_bytes(_head(5))
    (tmp_path / "b.jsonl").write_bytes(_head(5))
    it = local_source(tmp_path).iter_records()
    next(it)
    (tmp_path / "b.jsonl").unlink()
    with pytest.raises(SourceError, match=r"cannot read input file .*b\.jsonl after record 0: FileNotFoundError"):
        _bounded(lambda: list(it))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["folder", "one file", "gz"])
def test_a_file_deleted_after_planning_stops_the_job_with_the_resume_s_refusal(tmp_path: Path, monkeypatch,
                                                                                layout: str) -> None:
    """Regression: a file deleted between the plan and the read of its units stopped the job with `cannot read input
    file F (bytes A-B): FileNotFoundError …`, exit 1, run.json saying to re-run to resume, and the re-run was then
    refused, exit 2, `… is gone since this run started`. The first failure is that refusal (needs_change); once the
    file is restored the same command resumes to the bytes of a run that never lost it."""
    from streamprep import units

    docs = [json.dumps({"text": t}) + "\n" for t in english_docs(600, seed=48)]
    (tmp_path / "in").mkdir()
    name = "b.jsonl.gz" if layout == "gz" else "b.jsonl"
    victim = tmp_path / "in" / name
    (tmp_path / "in" / name.replace("b.", "a.")).write_bytes(gzip.compress("".join(docs[:300]).encode(), mtime=0)
                                                             if layout == "gz" else "".join(docs[:300]).encode())
    victim.write_bytes(gzip.compress("".join(docs[300:]).encode(), mtime=0) if layout == "gz"
                       else "".join(docs[300:]).encode())
    kept = victim.read_bytes(), victim.stat().st_mtime_ns
    path = str(victim if layout == "one file" else tmp_path / "in")
    cfg = base_config([{"name": "d", "path": path}], None)
    cfg["execution"].update(unit_mb=0.05)  # a plain file is several byte-range units
    clean = run_from_dict(cfg, run_dir=tmp_path / "clean", console_log=False)
    assert clean.status == "complete"
    real = units.plan_dataset

    def planned_then_deleted(*args: Any, **kwargs: Any) -> Any:
        plan = real(*args, **kwargs)
        victim.unlink()
        return plan

    monkeypatch.setattr(units, "plan_dataset", planned_then_deleted)
    run = tmp_path / "run"
    assert_gone_refused(cfg, run, "d", str(victim))
    monkeypatch.setattr(units, "plan_dataset", real)
    if layout != "one file":  # (a file named alone and missing is refused by the config check: no such file)
        assert_gone_refused(cfg, run, "d", str(victim))
    victim.write_bytes(kept[0])
    os.utime(victim, ns=(kept[1], kept[1]))
    assert run_from_dict(cfg, run_dir=run, console_log=False).status == "complete"
    assert tree_hashes(run, "ingest", "binidx") == tree_hashes(tmp_path / "clean", "ingest", "binidx")


def test_utf8_bom_opens_a_file_without_a_parse_error(tmp_path: Path) -> None:
    bom = b"\xef\xbb\xbf"
    (tmp_path / "a.jsonl").write_bytes(bom + _head(5))
    items = _items(tmp_path / "a.jsonl")
    assert [r for r, _ in items] == RECORDS[:5]
    assert _items(tmp_path / "a.jsonl", items[0][1]) == items[1:]  # offsets count the BOM
    (tmp_path / "t.txt").write_bytes(bom + b"first line\nsecond\n")
    assert [r for r, _ in _items(tmp_path / "t.txt")] == [{"text": "first line"}, {"text": "second"}]
    (tmp_path / "d.md").write_bytes(bom + b"# Title\n")
    assert _items(tmp_path / "d.md", fmt="document")[0][0]["text"] == "# Title\n"


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le"])
def test_utf16_or_32_text_with_a_bom_is_decoded_as_such(tmp_path: Path, encoding: str) -> None:
    bom = {"utf-16-le": codecs.BOM_UTF16_LE, "utf-16-be": codecs.BOM_UTF16_BE, "utf-32-le": codecs.BOM_UTF32_LE}
    lines = ["first line", "zweite Zeile: grüße", "third — 三"]
    (tmp_path / "t.txt").write_bytes(bom[encoding] + "".join(x + "\r\n" for x in lines).encode(encoding))
    items = _items(tmp_path / "t.txt")
    assert [r for r, _ in items] == [{"text": x} for x in lines]  # no NULs, no BOM, no mojibake
    assert _items(tmp_path / "t.txt", items[0][1]) == items[1:]  # a resume re-reads and skips
    (tmp_path / "j.jsonl").write_bytes(bom[encoding] + _head(4).decode().encode(encoding))
    assert [r for r, _ in _items(tmp_path / "j.jsonl")] == RECORDS[:4]
    # regression: `format: document` read it as UTF-8, one reject `undecodable bytes in …: invalid start byte at byte 0`
    assert [r for r, _ in _items(tmp_path / "t.txt", fmt="document")] == \
        [{"text": "".join(x + "\r\n" for x in lines), "path": "t.txt"}]


def test_utf16_text_with_an_odd_tail_keeps_the_lines_then_one_reject(tmp_path: Path) -> None:
    (tmp_path / "t.txt").write_bytes(codecs.BOM_UTF16_LE + "one\ntwo\n".encode("utf-16-le") + b"x")
    good, bad = _split(_items(tmp_path / "t.txt"))
    assert good == [{"text": "one"}, {"text": "two"}]
    assert len(bad) == 1 and "t.txt after record 2" in bad[0].reason and "UnicodeDecodeError" in bad[0].reason
    assert [r.reason for r, _ in _items(tmp_path / "t.txt", fmt="document")] == \
        [f"undecodable bytes in {tmp_path / 't.txt'}: truncated data at byte 18"]


@pytest.mark.parametrize("encoding, damage", [("utf-16-le", b"\x00\xd8"), ("utf-16-be", b"\xdc\x00"),
                                              ("utf-32-le", b"\x00\x00\x11\x00")])
def test_wide_text_damaged_mid_file_keeps_every_line_before_the_damage(tmp_path: Path, encoding: str,
                                                                       damage: bytes) -> None:
    """Regression: bytes the decoder rejects (a lone surrogate, a code point past U+10FFFF) lost the lines decoded
    before them in the same 8 KiB chunk: 300 of 499 good lines were kept."""
    bom = {"utf-16-le": codecs.BOM_UTF16_LE, "utf-16-be": codecs.BOM_UTF16_BE, "utf-32-le": codecs.BOM_UTF32_LE}
    lines = [f"line {i} of the file" for i in range(1, 1001)]
    body = ("".join(x + "\n" for x in lines[:499]) + "line 500 ").encode(encoding) + damage \
        + ("a\n" + "".join(x + "\n" for x in lines[500:])).encode(encoding)
    (tmp_path / "t.txt").write_bytes(bom[encoding] + body)
    good, bad = _split(_items(tmp_path / "t.txt"))
    assert good == [{"text": x} for x in lines[:499]]
    assert len(bad) == 1 and f"{tmp_path / 't.txt'} after record 499, skipped: UnicodeDecodeError" in bad[0].reason


def test_symlink_loop_in_a_directory_is_one_reject_naming_it(tmp_path: Path) -> None:
    data = tmp_path / "in"
    data.mkdir()
    (data / "a.jsonl").write_bytes(_head(5))
    (data / "loop1.jsonl").symlink_to(data / "loop2.jsonl")
    (data / "loop2.jsonl").symlink_to(data / "loop1.jsonl")
    items = _items(data)
    good, bad = _split(items)
    assert good == RECORDS[:5]
    assert [b.reason for b in bad] == [f"{data / n} is a symlink loop, skipped" for n in ("loop1.jsonl", "loop2.jsonl")]
    assert _bounded(lambda: local_source(data).fingerprint())["files"][1] == \
        {"path": str(data / "loop1.jsonl"), "symlink_loop": True}


def test_dangling_symlink_in_a_directory_is_one_reject_naming_it(tmp_path: Path) -> None:
    """Regression: a link whose target is missing stopped every run with exit 1 (`cannot read input file`), so a
    directory holding one could never finish; like a loop it is the same on every run: a counted reject."""
    data = tmp_path / "in"
    data.mkdir()
    (data / "a.jsonl").write_bytes(_head(5))
    (data / "b.jsonl").symlink_to(tmp_path / "gone.jsonl")
    good, bad = _split(_items(data))
    assert good == RECORDS[:5]
    assert [b.reason for b in bad] == [f"{data / 'b.jsonl'} is a dangling symlink (to {tmp_path / 'gone.jsonl'}), "
                                       "skipped"]
    src = local_source(data)
    assert _bounded(src.fingerprint)["files"][1] == {"path": str(data / "b.jsonl"),
                                                     "dangling_symlink": str(tmp_path / "gone.jsonl")}
    before = src.fingerprint()
    (tmp_path / "gone.jsonl").write_bytes(_head(2))  # the target appears: a changed input
    assert input_change(before, src.fingerprint()) is not None


def test_a_folder_that_cannot_be_listed_is_one_reject_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: `Path.rglob` skipped a folder it could not list (permissions), and its files with it, without a
    word. Now it is one counted reject naming it (a root-only `lost+found` at a volume's root does not hold the
    dataset up); the dataset's own folder that cannot be listed is exit 2. (Simulated: the suite may run as root,
    for whom `chmod 000` denies nothing.)"""
    from streamprep.sources.local import check_path

    data = tmp_path / "in"
    (data / "sub").mkdir(parents=True)
    (data / "a.jsonl").write_bytes(_head(5))
    (data / "sub" / "c.jsonl").write_bytes(_head(5))
    denied = {data / "sub"}

    def deny(list_dir: Callable[..., Any]) -> Callable[..., Any]:
        def call(path: Any = ".") -> Any:
            if Path(path) in denied:
                raise PermissionError(13, "Permission denied", str(path))
            return list_dir(path)
        return call
    monkeypatch.setattr(os, "scandir", deny(os.scandir))
    monkeypatch.setattr(os, "listdir", deny(os.listdir))
    check_path("datasets[0].path", str(data))
    assert local_mod.expand(str(data)) == [str(data / "a.jsonl"), str(data / "sub")]
    good, bad = _split(_items(data))
    assert good == RECORDS[:5]
    assert [b.reason for b in bad] == [f"{data / 'sub'} is a folder that cannot be listed, skipped: Permission denied"]
    denied.add(data)
    with pytest.raises(ConfigError) as err:
        check_path("datasets[0].path", str(data))
    assert str(err.value) == f"config: 'datasets[0].path': {data}: cannot read {data}: Permission denied"


def test_a_glob_behind_a_folder_that_cannot_be_entered_is_exit_2_naming_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: glob skips a folder it cannot list without a word, so `unread/*.jsonl` (or `unread/sub/*.jsonl`)
    said 'no file matches' where a plain path there says which folder it cannot read. A glob whose folder is
    missing still matches nothing. (Simulated, as above: root is denied nothing.)"""
    from streamprep.sources.local import check_path

    unread = tmp_path / "unread"
    (unread / "sub").mkdir(parents=True)
    (unread / "a.jsonl").write_bytes(_head(5))
    (unread / "sub" / "b.jsonl").write_bytes(_head(5))
    scandir = os.scandir

    def denied(path: Any = ".") -> Any:
        if Path(path) == unread or unread in Path(path).parents:
            raise PermissionError(13, "Permission denied", str(path))
        return scandir(path)
    monkeypatch.setattr(os, "scandir", denied)
    for pattern, folder in ((f"{unread}/*.jsonl", unread), (f"{unread}/sub/*.jsonl", unread / "sub")):
        with pytest.raises(ConfigError) as err:
            check_path("datasets[0].path", pattern)
        assert str(err.value) == f"config: 'datasets[0].path': {pattern}: cannot read {folder}: Permission denied"
    with pytest.raises(ConfigError) as err:
        check_path("datasets[0].path", f"{tmp_path}/gone/*.jsonl")
    assert str(err.value) == f"config: 'datasets[0].path': no file matches {tmp_path}/gone/*.jsonl"


def test_a_glob_whose_deeper_folder_cannot_be_entered_is_exit_2_naming_it(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: only the folder before a glob's first glob character was checked, so `outer/*/a.jsonl` (or
    `outer/**/a.jsonl`) over an `outer/sub/` of no permission still said 'no file matches'. A glob that matches no
    file names the first folder it could not enter, however deep; one that matches a file lists as glob does; a
    missing folder still matches nothing. (Simulated, as above: root is denied nothing. As `chmod 000` does, the
    folder cannot be listed, nor anything in it looked up.)"""
    from streamprep.sources.local import check_path

    outer = tmp_path / "outer"
    for folder in ("sub", "ok", "ok2"):
        (outer / folder).mkdir(parents=True)
    (outer / "sub" / "a.jsonl").write_bytes(_head(5))
    (outer / "ok" / "b.jsonl").write_bytes(_head(5))
    sub = outer / "sub"

    def deny(call: Callable[..., Any], listing: bool) -> Callable[..., Any]:
        def denied(path: Any = ".", *args: Any, **kw: Any) -> Any:
            if (listing and Path(path) == sub) or (not isinstance(path, int) and sub in Path(path).parents):
                raise PermissionError(13, "Permission denied", str(path))
            return call(path, *args, **kw)
        return denied
    for name, listing in (("scandir", True), ("listdir", True), ("stat", False), ("lstat", False)):
        monkeypatch.setattr(os, name, deny(getattr(os, name), listing))
    for pattern in (f"{outer}/*/a.jsonl", f"{outer}/s*/*.jsonl", f"{outer}/**/a.jsonl", f"{outer}/*/x/*.jsonl"):
        with pytest.raises(ConfigError) as err:
            check_path("datasets[0].path", pattern)
        assert str(err.value) == f"config: 'datasets[0].path': {pattern}: cannot read {sub}: Permission denied"
    check_path("datasets[0].path", f"{outer}/*/*.jsonl")  # ok/b.jsonl matches: listed as glob lists it
    assert local_mod.expand(f"{outer}/*/*.jsonl") == [str(outer / "ok" / "b.jsonl")]
    with pytest.raises(ConfigError) as err:
        check_path("datasets[0].path", f"{outer}/ok*/gone/*.jsonl")
    assert str(err.value) == f"config: 'datasets[0].path': no file matches {outer}/ok*/gone/*.jsonl"


def test_a_folder_the_path_does_not_read_into_is_one_reject_naming_it(tmp_path: Path) -> None:
    """Regression: a symlinked folder inside a dataset's directory, and a folder a glob's `*` matched, were left out
    with their files without a word (rglob does not follow links; `*` names the folder, not its files). Each is now
    one counted reject naming it and saying how to read it; `**` reads both; a glob that matches only folders is
    exit 2 saying so; an empty folder holds nothing to lose and is no reject."""
    from streamprep.sources.local import check_path

    data, other = tmp_path / "in", tmp_path / "other"
    for folder in (data / "sub", data / "empty", other):
        folder.mkdir(parents=True)
    (data / "a.jsonl").write_bytes(_head(5))
    (data / "sub" / "b.jsonl").write_bytes(_head(3))
    (other / "c.jsonl").write_bytes(_head(2))
    (data / "link").symlink_to(other)
    link_why = f"{data / 'link'} is a symlinked folder, not followed, skipped (name it, or its target, as a dataset " \
               "path of its own)"
    good, bad = _split(_items(data))
    assert good == RECORDS[:5] + RECORDS[:3] and [b.reason for b in bad] == [link_why]
    good, bad = _split(_items(f"{data}/*"))
    assert good == RECORDS[:5] and [b.reason for b in bad] == [
        link_why, f"{data / 'sub'} is a folder not read into when the dataset's files were listed, skipped (a glob's "
                  "`*` names the folder, not its files: `**` reads folders at any depth; or it could not be listed then)"]
    good, bad = _split(_items(f"{data}/**"))
    assert good == RECORDS[:5] + RECORDS[:2] + RECORDS[:3] and bad == []
    with pytest.raises(ConfigError) as err:
        check_path("datasets[0].path", f"{data}/*/")
    assert str(err.value) == f"config: 'datasets[0].path': no file matches {data}/*/ (only folders do: a glob ending " \
                             f"in `/` matches folders alone; `{data}/*/*` reads the files in them)"


@pytest.mark.parametrize("where", ["tokenizer", "run_dir", "dataset"])
def test_a_path_behind_a_folder_that_cannot_be_read_is_exit_2_naming_it(tmp_path: Path, where: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a stat of a config-named path behind a folder we may not enter raised PermissionError, exit 1
    (after the run dir existed, for `tokenizer.path`). (Simulated, as above: root is denied nothing.)"""
    from streamprep.pipeline import run

    locked = tmp_path / "locked"
    locked.mkdir()
    stat = os.stat

    def denied(path: Any, *args: Any, **kw: Any) -> Any:
        if str(path).startswith(str(locked) + os.sep):
            raise PermissionError(13, "Permission denied", str(path))
        return stat(path, *args, **kw)
    data = tmp_path / "a.jsonl"
    data.write_bytes(_head(5))
    raw = base_config([{"name": "d", "path": str(locked / "a.jsonl" if where == "dataset" else data)}],
                      str(locked / "tokenizer.json") if where == "tokenizer" else None)
    raw["tokenizer"]["if_missing"] = "train"  # its `exists()` raised before the tokenizer's own check
    run_dir = (locked if where == "run_dir" else tmp_path) / "run"
    monkeypatch.setattr(os, "stat", denied)
    with pytest.raises(ConfigError) as err:
        run(load(raw), run_dir, console_log=False)
    named = {"tokenizer": locked / "tokenizer.json", "dataset": locked / "a.jsonl", "run_dir": run_dir}[where]
    assert f"cannot read {named}: Permission denied" in str(err.value) and "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "locked"]  # nothing written


def test_job_over_a_directory_with_a_symlink_loop_completes_counting_it(tmp_path: Path) -> None:
    cfg, src = _docs_cfg(tmp_path, 300, raw=True)
    data = tmp_path / "in"
    data.mkdir()
    src.rename(data / "docs.jsonl")
    (data / "a").symlink_to(data / "b")
    (data / "b").symlink_to(data / "a")
    (data / "c").symlink_to(tmp_path / "gone")
    cfg["datasets"][0]["path"] = str(data)
    run = tmp_path / "run"
    assert run_from_dict(cfg, run_dir=run, console_log=False).status == "complete"
    ck = json.loads((run / "checkpoints" / "d.json").read_text())
    rejects = [json.loads(x) for x in (run / "rejects" / "d.jsonl").read_text().splitlines()]
    loops = [r["reason"] for r in rejects if r["failed_check"] == "parse"]
    assert loops == [*(f"{data / n} is a symlink loop, skipped" for n in "ab"),
                     f"{data / 'c'} is a dangling symlink (to {tmp_path / 'gone'}), skipped"]
    assert ck["done"] and ck["kept"] == 300 and ck["rejected"] == 3


# ---- input identity ------------------------------------------------------------------------------------------
def test_input_identity_names_a_changed_grown_gone_or_new_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A local file's identity is its size and mtime, read from a stat: the driver reads no input byte for it
    (issue 28), so a dataset of many small files costs a stat each at every start, not a read of all of it."""
    small, big = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    small.write_bytes(_head(80))
    big.write_bytes(JSONL * (FULL_HASH_BYTES // len(JSONL) + 1))

    def unread(*_: object) -> None:
        raise AssertionError("the identity of a local file read it")
    monkeypatch.setattr(local_mod, "_hashed_identity", unread)
    src = local_source(tmp_path / "*.jsonl")
    before = src.fingerprint()
    assert [sorted(f) for f in before["files"]] == [["mtime_ns", "path", "size"]] * 2
    assert input_change(before, src.fingerprint()) is None
    kept = small.stat()
    small.write_bytes(_head(80).replace(b"record number 1 ", b"record number X "))  # same size, same mtime:
    os.utime(small, ns=(kept.st_atime_ns, kept.st_mtime_ns))  # not seen (docs/operations.md says so)
    assert input_change(before, src.fingerprint()) is None
    os.utime(small, (1, 1))  # a touch is a change: nothing tells it from a rewrite
    assert input_change(before, src.fingerprint()) == f"input file {small} changed (mtime_ns)"
    os.utime(small, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    data = big.read_bytes()
    big.write_bytes(data + b"{}\n")
    assert input_change(before, src.fingerprint()) == f"input file {big} changed (mtime_ns, size)"
    big.write_bytes(data)
    (tmp_path / "c.jsonl").write_bytes(b"{}\n")
    assert input_change(before, local_source(tmp_path / "*.jsonl").fingerprint()) \
        .startswith(f"input file {big} changed")
    big.unlink()
    assert input_change(before, local_source(tmp_path / "*.jsonl").fingerprint()) \
        == f"input file {big} is gone"


def test_a_checkpoint_with_hashed_identities_resumes_and_still_sees_a_change(tmp_path: Path) -> None:
    """An earlier streamprep recorded hashes (the whole of a file up to 1 MiB, else head and tail plus mtime): a
    resume of its checkpoint hashes those files again rather than calling an unchanged file changed."""
    small, big = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    small.write_bytes(_head(80))
    big.write_bytes(JSONL * (FULL_HASH_BYTES // len(JSONL) + 1))
    src = local_source(tmp_path / "*.jsonl")
    recorded = {"files": [local_mod.identity(str(f), None, hashed=True) for f in (small, big)]}
    assert [sorted(f) for f in recorded["files"]] == [["path", "sha256", "size"],
                                                      ["mtime", "path", "sha256_head_tail", "size"]]
    assert input_change(recorded, src.fingerprint(recorded)) is None
    os.utime(small, (1, 1))  # a small file was hashed whole: a touch alone was no change
    assert input_change(recorded, src.fingerprint(recorded)) is None
    small.write_bytes(_head(80).replace(b"record number 1 ", b"record number X "))
    assert input_change(recorded, src.fingerprint(recorded)) == f"input file {small} changed (sha256)"


def _docs_cfg(tmp_path: Path, n: int = 1500, raw: bool = False) -> tuple[Any, Path]:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(n, seed=9)))
    cfg = base_config([{"name": "d", "path": str(src)}], None)
    cfg["execution"].update(batch_records=50)
    return (cfg if raw else load(cfg)), src


async def _ingest(cfg: Config, run: Path, stop: asyncio.Event | None = None, timeout: float = 60) -> dict:
    ctx = IngestContext.of(cfg, run, run / "checkpoints", stop or asyncio.Event())
    return await asyncio.wait_for(ingest_all(ctx), timeout)


@pytest.mark.parametrize("form", ["own_file", "inside_checkpoint"])
async def test_resume_over_a_replaced_input_is_refused_naming_it(tmp_path: Path, form: str) -> None:
    """The inputs are in `<ds>.inputs`; a checkpoint an earlier streamprep wrote holds them itself, and is checked
    the same."""
    from helpers import ingest_stopped_after

    cfg, src = _docs_cfg(tmp_path)
    run = tmp_path / "run"
    state = await asyncio.wait_for(ingest_stopped_after(cfg, run, "d", 300), 60)
    assert not state.done and state.inputs["files"][0]["path"] == str(src)
    files = DatasetFiles(run, run / "checkpoints", "d")
    ck = json.loads(files.checkpoint.read_text())
    assert "inputs" not in ck and json.loads(files.inputs.read_text()) == state.inputs
    if form == "inside_checkpoint":
        files.checkpoint.write_text(json.dumps({**ck, "inputs": state.inputs}))
        files.inputs.unlink()
    original, kept = src.read_bytes(), src.stat()
    src.write_bytes(original.replace(b"Document 1:", b"Document X:"))  # same size, new content
    with pytest.raises(ConfigError, match=rf"dataset d: input file {src} changed \(mtime_ns\) since this run started; "
                                          r"resuming would mix old and new data — restore the file \(its mtime too"):
        await _ingest(cfg, run)
    src.write_bytes(original)  # restored, as `cp -p` would: the resume goes on and finishes
    os.utime(src, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert (await _ingest(cfg, run))["d"].done


async def test_a_dataset_under_way_whose_inputs_file_holds_null_starts_over(tmp_path: Path) -> None:
    """Regression: `null` in `<ds>.inputs` read as "no identity recorded", so the resume checked nothing: a record
    appended to a file already planned was never read (exit 0) and the new identity recorded. It is as a missing
    inputs file: the dataset starts over, and ends as a fresh run on the files as they are."""
    from helpers import ingest_stopped_after

    cfg, src = _docs_cfg(tmp_path)
    run = tmp_path / "run"
    assert not (await asyncio.wait_for(ingest_stopped_after(cfg, run, "d", 300), 60)).done
    DatasetFiles(run, run / "checkpoints", "d").inputs.write_text("null\n")
    appended = json.dumps({"text": "An appended record about rivers, mountains and the weather in the valley."})
    src.write_bytes(src.read_bytes() + appended.encode() + b"\n")
    assert (await _ingest(cfg, run))["d"].done
    ref = tmp_path / "ref"
    assert (await _ingest(cfg, ref))["d"].done
    assert tree_hashes(run, "ingest", "rejects") == tree_hashes(ref, "ingest", "rejects")
    assert b"appended record about rivers" in b"".join(p.read_bytes() for p in (run / "ingest" / "d").glob("*.jsonl"))


async def test_a_resume_of_a_checkpoint_with_hashed_identities_goes_on(tmp_path: Path) -> None:
    """The ingest passes the checkpoint's identities to the source: one an earlier streamprep wrote (hashes) is
    compared in its own form, and a touch of the file does not stop the resume."""
    from helpers import ingest_stopped_after

    cfg, src = _docs_cfg(tmp_path)
    run = tmp_path / "run"
    await asyncio.wait_for(ingest_stopped_after(cfg, run, "d", 300), 60)
    ck_path = DatasetFiles(run, run / "checkpoints", "d").checkpoint
    ck = json.loads(ck_path.read_text())
    ck["inputs"] = {"files": [local_mod.identity(str(src), None, hashed=True)]}
    ck_path.write_text(json.dumps(ck))
    os.utime(src, (1, 1))
    state = (await _ingest(cfg, run))["d"]
    assert state.done and state.inputs["files"][0].keys() == {"path", "size", "sha256"}


async def test_a_checkpoint_costs_the_same_whatever_the_number_of_input_files(tmp_path: Path) -> None:
    """Regression: every checkpoint, saved after every unit, held every input file's identity, so the bytes written
    grew with the square of the file count (8 000 one-line files: 5.5 GB). They are written once, to `<ds>.inputs`."""
    sizes = {}
    for n in (20, 400):
        folder = tmp_path / f"in{n}"
        folder.mkdir()
        for i, text in enumerate(english_docs(n, seed=3)):
            (folder / f"f{i:05d}.jsonl").write_text(json.dumps({"text": text}) + "\n")
        cfg = base_config([{"name": "d", "path": str(folder / "*.jsonl")}], None)
        run = tmp_path / f"run{n}"
        assert (await _ingest(load(cfg), run))["d"].done
        sizes[n] = DatasetFiles(run, run / "checkpoints", "d").checkpoint.stat().st_size
    assert sizes[400] - sizes[20] < 200, sizes
    inputs = DatasetFiles(run, run / "checkpoints", "d").inputs
    assert len(json.loads(inputs.read_text())["files"]) == 400


async def test_a_checkpoint_costs_the_same_whatever_the_number_of_sealed_parts(tmp_path: Path) -> None:
    """Regression: every checkpoint, saved after every unit, listed every sealed part's SHA-256 and size, so the bytes
    written grew with parts × units (2 000 one-record parts: 145 kB a checkpoint, 166 MB written). The parts are
    appended to `<ds>.sealed` (32-byte SHA-256, 8-byte size), the checkpoint keeping their count; a resume reads them
    back, the same."""
    from streamprep.layout import Checkpoint

    sizes = {}
    for n in (20, 400):
        src = tmp_path / f"docs{n}.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in english_docs(n, seed=9)))
        cfg = base_config([{"name": "d", "path": str(src)}], None, output={"shard_records": 1})
        run = tmp_path / f"run{n}"
        state = (await _ingest(load(cfg), run))["d"]
        files = DatasetFiles(run, run / "checkpoints", "d")
        assert state.done and state.part_index > n // 2
        sizes[n] = files.checkpoint.stat().st_size
    assert sizes[400] - sizes[20] < 200, sizes
    assert "sealed" not in json.loads(files.checkpoint.read_text())
    log = files.sealed_log.read_bytes()
    parts = [files.part(i).read_bytes() for i in range(state.part_index)]
    assert log == b"".join(hashlib.sha256(p).digest() + len(p).to_bytes(8, "big") for p in parts)
    assert repair(files, load_checkpoint(files)).sealed == state.sealed \
        == [[hashlib.sha256(p).hexdigest(), len(p)] for p in parts]
    assert Checkpoint.load(files.checkpoint).ingest_bytes == state.ingest_bytes() == sum(map(len, parts))  # status


@pytest.mark.parametrize("form", ["log", "inside_checkpoint", "log_longer", "log_short"])
async def test_a_resume_reads_the_sealed_parts_back(tmp_path: Path, form: str) -> None:
    """The sealed parts are in `<ds>.sealed`; a checkpoint an earlier streamprep wrote lists them itself (and has no
    log) and resumes the same, the resume moving its list into the log; records past the checkpoint's count
    (appended by a save that never replaced the checkpoint) are cut off; a log holding fewer than it counts restarts
    the dataset. Each ends byte-identical."""
    cfg = load({**_docs_cfg(tmp_path, n=1500, raw=True)[0], "output": {"shard_records": 50}})
    ref = tmp_path / "ref"
    assert (await _ingest(cfg, ref))["d"].done
    from helpers import ingest_stopped_after

    run = tmp_path / "run"
    state = await asyncio.wait_for(ingest_stopped_after(cfg, run, "d", 700), 60)
    files = DatasetFiles(run, run / "checkpoints", "d")
    ck = json.loads(files.checkpoint.read_text())
    assert not state.done and ck["part_index"] > 0 and "sealed" not in ck
    assert files.sealed_log.stat().st_size == 40 * ck["part_index"]
    if form == "inside_checkpoint":
        files.checkpoint.write_text(json.dumps({**ck, "sealed": state.sealed}))
        files.sealed_log.unlink()
    elif form == "log_longer":
        files.sealed_log.write_bytes(files.sealed_log.read_bytes() + b"x" * 60)
    elif form == "log_short":
        files.sealed_log.write_bytes(files.sealed_log.read_bytes()[:-40])
    resumed = repair(files, load_checkpoint(files))
    if form == "log_short":
        assert resumed.consumed == 0 and not files.sealed_log.exists()
    else:
        assert resumed.sealed == state.sealed and files.sealed_log.stat().st_size == 40 * ck["part_index"]
        # moved, not copied: the log is the one record (deleting it restarts the dataset, as a refusal says)
        assert json.loads(files.checkpoint.read_text()) == ck
    assert (await _ingest(cfg, run))["d"].done
    names = ("checkpoints/d.sealed", "checkpoints/d.dedup")
    assert tree_hashes(run, "ingest", "rejects", names=names) == tree_hashes(ref, "ingest", "rejects", names=names)
    assert len(tree_hashes(ref, "ingest", names=names)) > 3


# ---- ingest: a failing or stalled source ends the dataset; a stop always stops -------------------------------
class FakeSource:
    """`good` records, then `then()` (raise or block) inside the reader thread."""

    def __init__(self, then: Callable[[], None], good: int = 100, block_fingerprint: threading.Event | None = None):
        self.then, self.good, self.block_fingerprint = then, good, block_fingerprint

    def fingerprint(self) -> dict:
        if self.block_fingerprint is not None:
            self.block_fingerprint.wait(30)
        return {"files": []}

    def iter_records(self, start: dict | None = None) -> Iterator[tuple[Any, dict]]:
        n = (start or {}).get("record", 0)
        for i in range(n, self.good):
            yield {"text": english_docs(self.good, seed=1)[i]}, {"record": i + 1}
        self.then()


def _fake(monkeypatch: pytest.MonkeyPatch, source: FakeSource) -> None:
    monkeypatch.setattr("streamprep.ingest.open_source", lambda *a, **k: source)


def _raise() -> None:
    raise RuntimeError("disk on fire")


async def test_reader_exception_ends_ingest_with_an_error_not_a_hang(tmp_path: Path, monkeypatch) -> None:
    cfg, _ = _docs_cfg(tmp_path, 10)
    _fake(monkeypatch, FakeSource(_raise, good=120))  # batches of 50: the third fails inside the reader
    run = tmp_path / "run"
    with pytest.raises(SourceError, match="dataset d: reading or judging the input failed after item 100: RuntimeError: disk on fire"):
        await _ingest(cfg, run)
    ck = json.loads(DatasetFiles(run, run / "checkpoints", "d").checkpoint.read_text())
    assert ck["consumed"] == 100 and not ck["done"]  # the batches before the failure are written and checkpointed


@pytest.mark.slow
@pytest.mark.parametrize("where", ["read", "fingerprint"])
async def test_stop_while_the_source_is_stalled_returns_within_seconds(tmp_path: Path, monkeypatch, where: str) -> None:
    cfg, _ = _docs_cfg(tmp_path, 10)
    release = threading.Event()
    _fake(monkeypatch, FakeSource(lambda: release.wait(30), good=20,
                                  block_fingerprint=release if where == "fingerprint" else None))
    stop = asyncio.Event()
    asyncio.get_running_loop().call_later(0.5, stop.set)
    t0 = time.monotonic()
    try:
        state = (await _ingest(cfg, tmp_path / "run", stop, timeout=10))["d"]
    finally:
        release.set()
    assert time.monotonic() - t0 < 5 and not state.done and state.consumed == 0


@pytest.mark.slow
async def test_stop_while_a_worker_is_stalled_reading_a_unit_returns_within_seconds(tmp_path: Path,
                                                                                    monkeypatch) -> None:
    """Regression (a file replaced by a FIFO mid-run): with the workers stalled reading their units, a SIGINT or
    SIGTERM never stopped the job, only a second one did: the commit waited for a piece's finalizing (or a part's
    assembling), queued behind the stalled reads. The first unit is judged; the next one's read stalls."""
    from streamprep import unit_worker
    from streamprep.ingest import worker_executor
    from streamprep.modes import mode_of

    cfg, _ = _docs_cfg(tmp_path, 1500)
    cfg = dataclasses.replace(cfg, execution=dataclasses.replace(cfg.execution, unit_mb=0.1))
    release, judged = threading.Event(), []
    real = unit_worker.judge_piece

    def stalling(*args, **kwargs):
        judged.append(args[4].start if args[4] is not None else None)
        if len(judged) > 1:
            release.wait(30)
        return real(*args, **kwargs)

    monkeypatch.setattr(unit_worker, "judge_piece", stalling)
    stop = asyncio.Event()
    executor = worker_executor(cfg.execution, cfg.quality, mode_of(cfg.sft))  # workers: 1, a thread: the first
    # unit's finalizing queues behind the second's read
    ctx = IngestContext.of(cfg, tmp_path / "run", tmp_path / "run" / "checkpoints", stop, executor=executor)
    asyncio.get_running_loop().call_later(1.0, stop.set)
    t0 = time.monotonic()
    try:
        state = (await asyncio.wait_for(ingest_all(ctx), 20))["d"]
    finally:
        release.set()
        executor.close(wait=False)
    assert time.monotonic() - t0 < 8 and len(judged) >= 2  # the stop at 1 s, a commit's grace of 2 s
    assert not state.done and state.consumed == 0  # nothing committed past its checkpoint


async def test_a_final_checkpoint_that_cannot_be_saved_keeps_the_pieces_it_names(tmp_path: Path, monkeypatch) -> None:
    """Regression (the checkpoint dir's disk full at a dataset's end): the dataset was marked done before its last
    checkpoint was saved, so the end of ingest removed its staged pieces, which the checkpoint on disk still named;
    the resume found them missing and ingested the whole dataset again. Now it goes on from that checkpoint."""
    import errno

    from streamprep import ingest as ingest_mod

    cfg, _ = _docs_cfg(tmp_path, 300)  # shard_records 200: one part sealed, a short one left open at the end
    run = tmp_path / "run"
    real = ingest_mod.save

    def full(files, state):
        if state.done:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(files, state)

    monkeypatch.setattr(ingest_mod, "save", full)
    with pytest.raises(OSError, match="No space left"):
        await _ingest(cfg, run)
    files = DatasetFiles(run, run / "checkpoints", "d")
    ck = json.loads(files.checkpoint.read_text())
    assert not ck["done"] and ck["open_pieces"]
    assert all((files.stage / f"{name}.kept").exists() for name, _, _ in ck["open_pieces"])
    monkeypatch.setattr(ingest_mod, "save", real)
    from structlog.testing import capture_logs  # (not a patched `log.warning`: that would outlive the test on the
    with capture_logs() as logged:               # module's lazy logger, which then never reached a run log again)
        state = (await _ingest(cfg, run))["d"]
    assert state.done and state.consumed == 300 and state.part_index == 2
    assert [e["event"] for e in logged if e["log_level"] == "warning"] == [
        "removing part sealed after the last checkpoint"]  # not "restarting dataset from scratch"


@pytest.mark.parametrize("change", ["truncate", "rewrite"])
async def test_an_input_changed_during_the_run_stops_it_naming_the_file(tmp_path: Path, monkeypatch,
                                                                         change: str) -> None:
    """Regression: units read their planned bytes of a file however it changed meanwhile: a file cut short lost
    its records without a reject, one rewritten mixed old and new data, exit 0, and the dataset was done with an
    identity that no longer held. Its identity is checked again before the dataset is done: the job stops,
    resumable, naming the file, and the resume refuses it until it is restored."""
    from streamprep import unit_worker

    cfg, src = _docs_cfg(tmp_path, 1500)
    cfg = dataclasses.replace(cfg, execution=dataclasses.replace(cfg.execution, unit_mb=0.1))
    original, real, calls = src.read_bytes(), unit_worker.judge_piece, []

    def changing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # while the second unit is read
            src.write_bytes(original[: len(original) // 3] if change == "truncate" else original.upper())
        return real(*args, **kwargs)

    monkeypatch.setattr(unit_worker, "judge_piece", changing)
    run = tmp_path / "run"
    with pytest.raises(SourceError, match=rf"dataset d: input file {src} changed \([a-z_, ]+\) during the run; what was "
                                          r"read of it may mix old and new data"):
        await _ingest(cfg, run)
    assert not json.loads(DatasetFiles(run, run / "checkpoints", "d").checkpoint.read_text())["done"]
    monkeypatch.setattr(unit_worker, "judge_piece", real)
    with pytest.raises(ConfigError, match=rf"input file {src} changed"):
        await _ingest(cfg, run)


@pytest.mark.parametrize("change", ["add", "remove"])
async def test_a_file_added_to_or_gone_from_a_glob_during_the_run_stops_it_naming_the_file(
        tmp_path: Path, monkeypatch, change: str) -> None:
    """Regression: the check before a dataset is done stat'ed the files listed at the start and never listed its
    glob again, so a file added meanwhile was not read, without a word, exit 0 (the resume refused it as new). The
    glob is listed again: a file added to it, or one read and gone, stops the job, resumable, naming the file."""
    from streamprep import unit_worker

    (tmp_path / "in").mkdir()
    first, second = tmp_path / "in" / "a.jsonl", tmp_path / "in" / "b.jsonl"
    docs = [json.dumps({"text": t}) + "\n" for t in english_docs(1500, seed=9)]
    first.write_text("".join(docs[:100]))   # one unit, read first
    second.write_text("".join(docs[100:]))  # several units
    added = tmp_path / "in" / "c.jsonl"
    cfg = base_config([{"name": "d", "path": str(tmp_path / "in" / "*.jsonl")}], None)
    cfg["execution"].update(batch_records=50, unit_mb=0.1)
    cfg = load(cfg)
    real, calls = unit_worker.judge_piece, []

    def changing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 and change == "add":  # while b.jsonl is read, a.jsonl done
            added.write_text(docs[0])
        elif len(calls) == 2:
            first.unlink()
        return real(*args, **kwargs)

    monkeypatch.setattr(unit_worker, "judge_piece", changing)
    run = tmp_path / "run"
    changed, what = (added, "is new") if change == "add" else (first, "is gone")
    # regression: an added file was told 'what was read of it may mix old and new data — restore the file'
    read, undo = ("it was not read", "remove the file (or move it out of the dataset's path)") if change == "add" \
        else ("what was read of it may mix old and new data", "restore the file")
    with pytest.raises(SourceError) as err:
        await _ingest(cfg, run)
    assert str(err.value) == (f"dataset d: input file {changed} {what} during the run; {read} — {undo} and re-run the "
                              f"same command, or start over with a new --run-dir")
    assert not json.loads(DatasetFiles(run, run / "checkpoints", "d").checkpoint.read_text())["done"]
    monkeypatch.setattr(unit_worker, "judge_piece", real)
    with pytest.raises(ConfigError) as err:
        await _ingest(cfg, run)
    assert str(err.value) == (f"dataset d: input file {changed} {what} since this run started; resuming would mix old "
                              f"and new data — {undo}, or start over with a new --run-dir")


def _snapshot(root: Path) -> dict[str, str]:
    """Every path under `root`: a file's SHA-256, a folder as such (what an attempt wrote or deleted shows)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("damage", ["part", "sealed_log_gone", "sealed_log_short", "count_edited", "unreadable",
                                    "checkpoint_gone"])
async def test_a_dataset_restarted_from_scratch_still_refuses_changed_inputs_and_drops_its_old_shards(
        tmp_path: Path, damage: str) -> None:
    """Regression: a dataset whose checkpoint restarts it (a sealed part deleted, as `verify` advises for a damaged
    one) forgot its inputs' identity, so it read changed inputs without a word (with `dedup_scope: run`, records
    stayed rejected as duplicates of texts no longer in the run); and the restart left its old receipts and shards,
    stale beside the new parts (`verify` failed, a re-run never removed them). Also when its sealed log is missing
    or short, or its checkpoint holds a count no job writes: those restarts forgot the inputs, and a finished run
    re-run completed exit 0 on the new data beside its other datasets' decisions against the old. And the refusal
    held once: the refused attempt had already cleared the dataset (its `<ds>.inputs` too), so the same command
    again read the new data, exit 0 (an unreadable or deleted checkpoint: not even once). A refused attempt now
    writes and deletes nothing; restored, the input resumes to an uninterrupted run's bytes."""
    cfg, src = _docs_cfg(tmp_path, 500)
    original = src.read_bytes()
    run = tmp_path / "run"
    assert (await _ingest(cfg, run))["d"].done
    kept = src.stat()
    files = DatasetFiles(run, run / "checkpoints", "d")
    stale = [run / "receipts/d/part-00002.json", run / "binidx/d/part-00002_text_document.bin"]
    for path in stale:  # what tokenizing the parts left
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    if damage == "part":
        files.part(0).unlink()
    elif damage == "sealed_log_gone":
        files.sealed_log.unlink()
    elif damage == "sealed_log_short":
        files.sealed_log.write_bytes(files.sealed_log.read_bytes()[:-40])
    elif damage == "count_edited":
        files.checkpoint.write_text(json.dumps({**json.loads(files.checkpoint.read_text()), "rejects_bytes": -1}))
    elif damage == "unreadable":
        files.checkpoint.write_text("{")
    else:
        files.checkpoint.unlink()
    src.write_bytes(original[:1000])
    before = _snapshot(run)
    for _ in range(2):  # the same command again: still refused
        with pytest.raises(ConfigError, match=rf"dataset d: input file {src} changed \(mtime_ns, size\) since this "
                                              r"run started"):
            await _ingest(cfg, run)
        assert _snapshot(run) == before
    src.write_bytes(original)  # restored, as `cp -p` would
    os.utime(src, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert (await _ingest(cfg, run))["d"].done
    assert not any(p.exists() for p in stale)
    ref = tmp_path / "ref"
    assert (await _ingest(cfg, ref))["d"].done
    assert tree_hashes(run, "ingest", "rejects") == tree_hashes(ref, "ingest", "rejects")
    assert len(tree_hashes(ref, "ingest")) == 3


async def test_one_failing_dataset_stops_the_others(tmp_path: Path, monkeypatch) -> None:
    cfg, _ = _docs_cfg(tmp_path, 10)
    cfg = dataclasses.replace(cfg, datasets=tuple(dataclasses.replace(cfg.datasets[0], name=n) for n in ("bad", "slow")))
    release = threading.Event()
    sources = {"bad": FakeSource(_raise), "slow": FakeSource(lambda: release.wait(30), good=20)}
    monkeypatch.setattr("streamprep.ingest.open_source", lambda ds, *a, **k: sources[ds.name])
    try:
        with pytest.raises(SourceError, match="dataset bad"):
            await _ingest(cfg, tmp_path / "run", timeout=10)
    finally:
        release.set()


# ---- config, checkpoints and run.json ------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["fifo", "device", "csv"])
def test_fifo_device_or_unknown_single_file_is_a_config_error(tmp_path: Path, kind: str) -> None:
    path = {"fifo": tmp_path / "in.jsonl", "device": Path("/dev/null"), "csv": tmp_path / "in.csv"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "csv":
        path.write_text("a,b\n")
    want = "unknown file type" if kind == "csv" else "not a regular file or directory"
    with pytest.raises(ConfigError, match=rf"'datasets\[0\].path': {path}.*{want}"):
        validate(base_config([{"name": "d", "path": str(path)}], None))


@pytest.mark.parametrize("text", ["[]", "null", '{"version": 1, "dataset": "d", "consumed": "12"}',
                                  '{"version": 1, "dataset": "d", "position": [3]}', '{"version": 1}'])
def test_checkpoint_of_the_wrong_shape_restarts_the_dataset(tmp_path: Path, text: str) -> None:
    files = DatasetFiles(tmp_path, tmp_path / "ck", "d")
    files.ingest_dir.mkdir(parents=True)
    files.part(0).write_text("{}\n")
    files.checkpoint_dir.mkdir()
    files.checkpoint.write_text(text)
    state = repair(files, load_checkpoint(files))
    assert state.consumed == 0 and state.position is None and not files.part(0).exists()
    assert not files.checkpoint.exists()


@pytest.mark.parametrize("text", ["{not json", "[]", "[1]", '"x"', "5", '{"config": 3}', '{"config": {"run": null}}'])
def test_unreadable_run_json_is_one_line_saying_what_to_do(tmp_path: Path, text: str) -> None:
    """(Regression: a run.json of JSON that is not an object, `[1]`, `"x"` or `5`, was a raw AttributeError, exit 1,
    before its shape was checked: the read-only folders' check asked it for its status.)"""
    cfg, _ = _docs_cfg(tmp_path, 10, raw=True)
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(text)
    with pytest.raises(ConfigError) as err:
        run_from_dict(cfg, run_dir=run, console_log=False)
    msg = str(err.value)
    assert "\n" not in msg and f"{run / 'run.json'} is unreadable" in msg and "new --run-dir" in msg
    assert sorted(p.name for p in run.iterdir()) == ["run.json"]  # nothing written


@pytest.mark.slow
def test_truncated_run_json_exits_2_with_a_recovery_that_works(tmp_path: Path) -> None:
    cfg, _ = _docs_cfg(tmp_path, 300, raw=True)
    run = tmp_path / "run"
    assert run_from_dict(cfg, run_dir=run, console_log=False).status == "complete"
    tokens = {p.name: p.read_bytes() for p in (run / "binidx" / "d").iterdir()}
    data = (run / "run.json").read_bytes()
    (run / "run.json").write_bytes(data[: len(data) // 2])  # e.g. a copy cut short
    proc = _cli(cfg, tmp_path, run)
    err = _finish(proc, 120)
    assert proc.returncode == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{run / 'run.json'} is unreadable (JSONDecodeError" in err
    assert "remove it and re-run the same command" in err and "new --run-dir" in err
    (run / "run.json").unlink()  # the recovery the message names: the run goes on from its checkpoints
    assert run_from_dict(cfg, run_dir=run, console_log=False).status == "complete"
    record = json.loads((run / "run.json").read_text())
    assert record["run_id"] == (run / "checkpoints" / ".streamprep-run").read_text().splitlines()[0]
    assert {p.name: p.read_bytes() for p in (run / "binidx" / "d").iterdir()} == tokens


# ---- the CLI end to end: hostile inputs complete with named rejects; SIGTERM while stalled ----------------------
def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cli(cfg: dict, tmp_path: Path, run: Path) -> subprocess.Popen:
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    return subprocess.Popen([sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path), "--run-dir",
                             str(run)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            text=True, env=_env(), cwd=tmp_path)


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    """stderr once the process exits; killed (not left hanging) when it overruns `timeout`."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise


def _sigterm(proc: subprocess.Popen, timeout: float) -> tuple[str, float]:
    """SIGTERM to the job now: (its stderr, seconds until it exited)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    return _finish(proc, timeout), time.monotonic() - t0


@pytest.mark.slow
def test_cli_on_a_hostile_directory_completes_with_each_bad_file_named(tmp_path: Path) -> None:
    data = tmp_path / "in"
    data.mkdir()
    docs = english_docs(400, seed=4)
    lines = [(json.dumps({"text": t}) + "\n").encode() for t in docs]
    (data / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + b"".join(lines[:200]))
    packed = gzip.compress(b"".join(lines[200:]), mtime=0)
    (data / "b.jsonl.gz").write_bytes(packed[:-300])  # truncated
    (data / "c.jsonl.gz").write_bytes(b"plain text, not gzip\n")
    (data / "d.csv").write_text("x,y\n")
    cfg = base_config([{"name": "web", "path": str(data)}], None)
    run = tmp_path / "run"
    proc = _cli(cfg, tmp_path, run)
    err = _finish(proc, 300)
    assert proc.returncode == 0, err[-3000:]
    ck = json.loads((run / "checkpoints" / "web.json").read_text())
    rejects = [json.loads(line) for line in (run / "rejects" / "web.jsonl").read_text().splitlines()]
    reasons = [r["reason"] for r in rejects if r["failed_check"] == "parse"]
    assert any(f"{data / 'b.jsonl.gz'} after record" in r for r in reasons)
    assert any(f"{data / 'c.jsonl.gz'} after record 0" in r for r in reasons)
    assert any("d.csv: unknown file type" in r for r in reasons)
    assert len(reasons) == 3 and ck["done"] and ck["kept"] + ck["rejected"] == ck["consumed"]
    assert ck["consumed"] > 200 + 3  # a.jsonl whole (its BOM is no parse error) and most of b.jsonl.gz
    again = _cli(cfg, tmp_path, run)  # re-running the finished run does not hang either
    err = _finish(again, 120)
    assert again.returncode == 0, err[-3000:]


class _StallingHandler(http.server.BaseHTTPRequestHandler):
    """Answers HEAD; a GET sends its headers and then nothing (a stalled network read)."""

    stalled = threading.Event()
    release = threading.Event()

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()

    def do_GET(self) -> None:
        self.do_HEAD()
        self.wfile.flush()
        self.stalled.set()
        self.release.wait(60)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.slow
def test_sigterm_stops_the_job_within_seconds_while_a_read_is_stalled(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StallingHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/data.jsonl"
    proc = _cli(base_config([{"name": "net", "path": url}], None), tmp_path, tmp_path / "run")
    try:
        assert _StallingHandler.stalled.wait(60), "the job never reached the stalled read"
        time.sleep(0.3)
        err, took = _sigterm(proc, 15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        _StallingHandler.release.set()
        server.shutdown()
    assert proc.returncode == 1 and "re-run the same command to resume" in err, err[-2000:]
    assert took < 10, took
    assert json.loads((tmp_path / "run" / "run.json").read_text())["status"] == "interrupted"


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_during_tokenizer_training_stops_within_seconds_and_the_resume_trains_the_same(
        tmp_path: Path, workers: int) -> None:
    """Regression: the job waited for the worker's training (`.result()` in the feeder thread, joined when the job
    stopped): "signal received: saving progress and stopping" was logged and the process went on until training
    ended (42 s; 20 min and more on a large corpus). Now it stops within seconds, exit 1, and the resume trains
    the same tokenizer and shards as a run never stopped."""
    import random

    rng = random.Random(5)
    words = lambda: " ".join("".join(rng.choices("ACGT", k=8000)) for _ in range(5))
    corpus = tmp_path / "in.jsonl"  # ~10 s of training here
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in [*english_docs(50, seed=2),
                                                                      *(words() for _ in range(150))]))
    cfg = base_config([{"name": "d", "path": str(corpus)}], None)
    cfg["execution"]["workers"] = workers
    run, log = tmp_path / "run", tmp_path / "run" / "logs" / "streamprep.log"
    proc = _cli(cfg, tmp_path, run)
    try:
        deadline = time.monotonic() + 120
        while not (log.is_file() and "ingest done" in log.read_text()) and proc.poll() is None:
            assert time.monotonic() < deadline, "ingest never ended"
            time.sleep(0.1)
        time.sleep(1)
        err, took = _sigterm(proc, 120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 1 and "re-run the same command to resume" in err, err[-2000:]
    assert took < 4, took
    assert json.loads((run / "run.json").read_text())["status"] == "interrupted"
    assert not (run / "tokenizer" / "fingerprint.json").exists()  # stopped before training ended
    again = _cli(cfg, tmp_path, run)
    err = _finish(again, 300)
    assert again.returncode == 0, err[-3000:]
    assert run_from_dict(cfg, run_dir=tmp_path / "whole", console_log=False).status == "complete"
    assert tree_hashes(run, "tokenizer", "binidx") == tree_hashes(tmp_path / "whole", "tokenizer", "binidx")


@pytest.mark.slow
def test_an_interrupted_run_from_dict_with_one_worker_leaves_no_training_running(tmp_path: Path) -> None:
    """Regression: with `workers: 1` the training runs in a thread of the caller's process, which a stop cannot end;
    the stop stopped waiting for it, so `run_from_dict` raised Interrupted with the training still running, and
    seconds later it wrote its tokenizer into the run dir, into a run the caller had started over there meanwhile
    (`verify`: tokenizer.json differs, or a manifest naming the wrong tokenizer). The library's stop waits for it."""
    import random

    from streamprep import Interrupted

    rng = random.Random(5)
    words = lambda: " ".join("".join(rng.choices("ACGT", k=8000)) for _ in range(5))
    corpus = tmp_path / "in.jsonl"  # several seconds of training
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in [*english_docs(50, seed=2),
                                                                      *(words() for _ in range(60))]))
    cfg = base_config([{"name": "d", "path": str(corpus)}], None)
    cfg["execution"]["workers"] = 1
    run, log = tmp_path / "run", tmp_path / "run" / "logs" / "streamprep.log"

    def interrupt() -> None:
        while not (log.is_file() and "training the tokenizer on all kept text" in log.read_text()):
            time.sleep(0.05)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(Interrupted):
        run_from_dict(cfg, run_dir=run, console_log=False)
    assert not [t for t in threading.enumerate() if t.name.startswith("worker") and t.is_alive()
                and (t.join(1) or t.is_alive())]  # the executor's thread ended with its training
    assert (run / "tokenizer" / "fingerprint.json").is_file()  # the training ended before the call returned


def test_a_file_name_that_is_not_utf8_in_a_directory_is_a_config_error_naming_it(tmp_path: Path) -> None:
    """Regression: the plan (JSON) could not hold the name, so every run failed with `TypeError: str is not valid
    UTF-8`, exit 1, after the run dir existed. Now exit 2 before anything is written, naming the file escaped."""
    from streamprep.config import ConfigError, validate

    data = tmp_path / "in"
    data.mkdir()
    (data / "a.jsonl").write_bytes(_head(3))
    with open(os.fsencode(data) + b"/b\xff.jsonl", "wb") as fh:
        fh.write(_head(3))
    with pytest.raises(ConfigError, match=r"^config: 'datasets\[0\].path': .*/in/b\\udcff.jsonl has a name that is "
                                          r"not UTF-8; rename it"):
        validate({"datasets": [{"name": "d", "path": str(data)}]})
