"""Local/fsspec sources: every format, globs, bad input as BadRecord, and exact resume from any position."""
from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import local_source
from streamprep.sources.base import BadRecord
from streamprep.sources.local import LocalSource

RECORDS = [{"text": f"record number {i}", "id": i} for i in range(23)]


def _jsonl(path: Path, records: list, gz: bool = False) -> Path:
    data = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if gz else data)
    return path


def _collect(src: LocalSource, start=None) -> list:
    return list(src.iter_records(start))


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "parquet", "txt"])
def test_formats_stream_all_records_and_resume_anywhere(tmp_path: Path, kind: str) -> None:
    path = tmp_path / f"data.{kind}"
    if kind == "parquet":
        pq.write_table(pa.Table.from_pylist(RECORDS), path, row_group_size=5)
        expect = RECORDS
    elif kind == "txt":
        path.write_text("".join(r["text"] + "\n" for r in RECORDS))
        expect = [{"text": r["text"]} for r in RECORDS]
    else:
        _jsonl(path, RECORDS, gz=kind.endswith("gz"))
        expect = RECORDS
    src = local_source(path)
    items = _collect(src)
    assert [rec for rec, _ in items] == expect
    for k in (0, 1, 4, 5, 11, 22):  # resume from the position after item k: exactly the rest follows
        assert [rec for rec, _ in _collect(src, items[k][1])] == expect[k + 1:]


def test_glob_reads_files_in_sorted_order_and_resumes_across_files(tmp_path: Path) -> None:
    _jsonl(tmp_path / "b.jsonl", RECORDS[10:])
    _jsonl(tmp_path / "a.jsonl.gz", RECORDS[:10], gz=True)
    src = local_source(tmp_path / "*.jsonl*")
    items = _collect(src)
    assert [r for r, _ in items] == RECORDS
    assert [r for r, _ in _collect(src, items[9][1])] == RECORDS[10:]


def test_bad_input_becomes_bad_records_not_exceptions(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"text": "ok one"}\n{"text": broken\n\n[1, 2]\n{"text": "caf\xe9"}\n{"text": "ok two"}\n')
    (tmp_path / "empty.jsonl").write_bytes(b"")
    items = [r for r, _ in _collect(local_source(tmp_path / "*.jsonl"))]
    kinds = [r.reason.split(" ")[0] if isinstance(r, BadRecord) else r["text"] for r in items]
    assert kinds == ["ok one", "malformed", "blank", "line", "undecodable", "ok two", "empty"]
    assert "bad.jsonl" in items[1].reason and "line 2" in items[1].reason


def test_a_jsonl_line_that_is_not_utf8_names_the_byte_as_a_txt_line_does(tmp_path: Path) -> None:
    """Regression: a JSONL line holding a byte that is not UTF-8 was `malformed JSON at line 2 of FILE: str is not
    valid UTF-8: surrogates not allowed: line 1 column 1 (char 0)` (orjson's words: no surrogate, the wrong place).
    It is the reject a .txt line gets, under the same failed_check, read whole or as a range unit."""
    from streamprep import units

    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"text": "ok"}\n{"text": "abc \xff def"}\n{"text": "caf\xc3"}\n{"text": "last"}\n')
    items = [r for r, _ in _collect(local_source(path))]
    want = [f"undecodable bytes at line 2 of {path}: invalid start byte at byte 14",
            f"undecodable bytes at line 3 of {path}: invalid continuation byte at byte 13"]
    assert [(r.reason, r.check) for r in items if isinstance(r, BadRecord)] == [(w, "parse") for w in want]
    assert [r for r in items if not isinstance(r, BadRecord)] == [{"text": "ok"}, {"text": "last"}]
    (unit,) = units.plan_dataset([str(path)], "jsonl", unit_bytes=1 << 20)
    assert [units.global_reason(r.reason, k) if isinstance(r, BadRecord) else r
            for k, r in enumerate(units.read_unit(unit))] == [r.reason if isinstance(r, BadRecord) else r
                                                               for r in items]


def test_undecodable_text_line_is_a_bad_record(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_bytes(b"good line\nbad \xff\xfe line\nlast\n")
    items = [r for r, _ in _collect(local_source(path))]
    assert items[0] == {"text": "good line"} and items[2] == {"text": "last"}
    assert isinstance(items[1], BadRecord) and "undecodable bytes at line 2" in items[1].reason


def test_a_json_line_that_is_no_object_is_named_in_json_words(tmp_path: Path) -> None:
    """Regression: the reject of a line `null` said `is a JSON NoneType, not an object` (Python's type names: `str`,
    `int`, `list` for the others). It names what JSON calls it."""
    path = tmp_path / "a.jsonl"
    path.write_text('null\n[1]\n"s"\n4.5\ntrue\n{"text": "ok"}\n')
    items = [r for r, _ in _collect(local_source(path))]
    assert [i.reason for i in items[:5]] == [f"line {n} of {path} is {what}, not an object" for n, what in
                                            enumerate(["JSON null", "a JSON array", "a JSON string", "a JSON number",
                                                       "JSON true"], 1)]
    assert items[5] == {"text": "ok"}


def test_a_blank_txt_line_is_a_parse_reject_naming_file_and_line_as_a_blank_jsonl_line(tmp_path: Path) -> None:
    """Regression: a blank or whitespace-only .txt line was a record {"text": ""}, a `schema` reject ("text is empty
    after normalisation") naming no file or line. It is now `blank line N in FILE` (failed_check parse), as in a
    .jsonl, read whole, as range units or UTF-16; ASCII whitespace is blank (as .jsonl's rule: bytes.strip), a line
    of other white space is text."""
    import codecs

    from streamprep import units

    lines = ["\t\r", "first line", "", "   ", "second line", "\x0c \x0b", "\u3000", "last line"]
    want = ["blank line 1", "first line", "blank line 3", "blank line 4", "second line", "blank line 6", "\u3000",
            "last line"]
    for name, data in (("a.txt", "\n".join(lines).encode()), ("crlf.txt", "\r\n".join(lines).encode() + b"\r\n"),
                       ("bom.txt", codecs.BOM_UTF8 + "\n".join(lines).encode()),
                       ("wide.txt", codecs.BOM_UTF16_LE + "\n".join(lines).encode("utf-16-le"))):
        path = tmp_path / name
        path.write_bytes(data)
        got = [(r.check, r.reason) if isinstance(r, BadRecord) else r["text"] for r, _ in _collect(local_source(path))]
        assert got == [("parse", f"{w} in {path}") if w.startswith("blank") else w for w in want], name
        plan = units.plan_dataset([str(path)], None, 8)  # a range a line or two (a wide file: one unit)
        assert len(plan) > 1 or name == "wide.txt"
        ranged = [units.global_reason(r.reason, k) if isinstance(r, BadRecord) else r["text"]
                  for k, r in enumerate(i for u in plan for i in units.read_unit(u))]
        assert ranged == [f"{w} in {path}" if w.startswith("blank") else w for w in want], name


def test_document_format_reads_whole_files(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\nfirst doc\n")
    (tmp_path / "b.md").write_text("second\ndoc\n")
    items = [r for r, _ in _collect(local_source(tmp_path / "*.md", "document"))]
    assert items == [{"text": "# A\n\nfirst doc\n", "path": "a.md"}, {"text": "second\ndoc\n", "path": "b.md"}]


def test_an_empty_document_is_an_empty_file_reject_naming_it(tmp_path: Path) -> None:
    """Regression: a 0-byte file read as a document was a record of no text, rejected by the schema check as
    `text is empty after normalisation`, naming no file; docs/operations.md says a 0-byte file is `empty file FILE`."""
    (tmp_path / "a.md").write_text("kept\n")
    (tmp_path / "b.md").write_bytes(b"")
    items = [r for r, _ in _collect(local_source(tmp_path / "*.md", "document"))]
    assert items[0] == {"text": "kept\n", "path": "a.md"}
    assert isinstance(items[1], BadRecord) and items[1].reason == f"empty file {tmp_path / 'b.md'}"


def test_fsspec_urls_go_the_same_way() -> None:
    fs = fsspec.filesystem("memory")
    with fs.open("/bucket/x/part1.jsonl", "wb") as fh:
        fh.write(b'{"text": "from memory"}\n')
    with fs.open("/bucket/x/part2.jsonl", "wb") as fh:
        fh.write(b'{"text": "second file"}\n')
    src = local_source("memory://bucket/x/*.jsonl")
    assert [r["text"] for r, _ in _collect(src)] == ["from memory", "second file"]
    assert [f["size"] for f in src.fingerprint()["files"]] == [24, 24]


GLOBS = ["*", "*.jsonl", ".*", ".*.jsonl", "**", "**/*", "**/*.jsonl", "**/.*", "*/*", ".staging/*", "[.]b*", "?b*",
         "sub/**", ".staging/**", "**/sub/*", "**/.staging/*"]


@pytest.mark.parametrize("pattern", GLOBS)
def test_glob_shows_is_what_glob_lists_on_disk(tmp_path: Path, pattern: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule an object store's glob is listed by (`glob_shows`, over fsspec's matches, which include hidden
    names) is glob's: of what glob matches with hidden names, exactly what it matches without them."""
    import glob

    from streamprep.sources.local import glob_shows

    for name in ("a.jsonl", ".b.jsonl", "sub/c.jsonl", "sub/.e.jsonl", ".staging/d.jsonl", ".staging/in/f.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    every = glob.glob(pattern, recursive=True, include_hidden=True)
    assert sorted(p for p in every if glob_shows(pattern, p.rstrip("/"))) == sorted(glob.glob(pattern, recursive=True))


@pytest.mark.parametrize("name", ["x.jsonl", "x.txt", "x.jsonl.gz", "x.jsonl.zst", "x.jsonl.bz2", "x.jsonl.xz",
                                  "x.parquet"])
def test_a_0_byte_file_is_the_empty_file_reject_whatever_its_format(tmp_path: Path, name: str) -> None:
    """Regression: a 0-byte .parquet was 'unreadable Parquet file …: Parquet file size is 0 bytes' where a 0-byte
    .jsonl (and an hf:// .parquet) is 'empty file …' (docs/hf-sources.md: 'as for a local file'). Read as a
    dataset's file and as the unit its plan gives."""
    from streamprep import units

    path = tmp_path / name
    path.write_bytes(b"")
    want = [f"empty file {path}"]
    assert [r.reason for r, _ in _collect(local_source(path)) if isinstance(r, BadRecord)] == want
    (unit,) = units.plan_dataset([str(path)], None, unit_bytes=1 << 20)
    assert [r.reason for r in units.read_unit(unit) if isinstance(r, BadRecord)] == want


def test_a_recursive_glob_lists_each_file_once(tmp_path: Path) -> None:
    """Regression: `d/**/**/*.jsonl` listed `sub/c.jsonl` twice and `sub/deep/z.jsonl` three times (glob gives a file
    once per way its `**`s can split the folders above it), so their records were read, kept and tokenized again."""
    from streamprep.sources.local import expand

    for name in ("a.jsonl", "sub/c.jsonl", "sub/deep/z.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('{"text": "x"}\n')
    want = [str(tmp_path / n) for n in ("a.jsonl", "sub/c.jsonl", "sub/deep/z.jsonl")]
    assert expand(str(tmp_path / "**/**/*.jsonl")) == want
    assert expand(str(tmp_path / "**/**")) == want  # (a folder it reaches into is not listed)


def test_a_directory_path_leaves_out_hidden_folders_files(tmp_path: Path) -> None:
    """Regression: a directory `path` read the files inside its hidden folders (`.staging/d.jsonl`, and every object
    of a `.git/` as an unknown-type reject) where docs/config.md says names starting with '.' are ignored and
    `d/**` passes over them."""
    from streamprep.sources.local import expand

    for name in ("a.jsonl", ".b.jsonl", "sub/c.jsonl", ".staging/d.jsonl", ".git/objects/ab/cdef", "sub/.x/e.jsonl"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text('{"text": "x"}\n')
    assert expand(str(tmp_path)) == [str(tmp_path / "a.jsonl"), str(tmp_path / "sub/c.jsonl")]
    assert expand(str(tmp_path)) == [f for f in expand(str(tmp_path / "**")) if not os.path.isdir(f)]


def _faults() -> list[tuple[BaseException, bool]]:
    """(an exception a read can raise, whether it is a fault of the file's bytes): decoders raise OSErrors without
    an errno too (gzip's BadGzipFile, bz2's plain OSError), as urllib's URLError, requests' and aiohttp's errors do."""
    import bz2
    import errno
    import urllib.error
    import zlib

    faults: list[tuple[BaseException, bool]] = []
    for data, module in ((b"not gzip", gzip), (b"BZh9 not bzip2", bz2), (gzip.compress(b"x" * 100)[:20], gzip)):
        try:
            module.decompress(data)
        except (OSError, EOFError) as exc:  # BadGzipFile, OSError("Invalid data stream"), EOFError
            faults.append((exc, True))
    faults += [(zlib.error("invalid stored block lengths"), True),
               (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), True),
               (pa.ArrowInvalid("bad page"), True), (OSError(errno.EIO, "Input/output error"), False),
               (ConnectionResetError(errno.ECONNRESET, "reset"), False), (TimeoutError("timed out"), False),
               (urllib.error.URLError(ConnectionRefusedError(errno.ECONNREFUSED, "Connection refused")), False)]
    requests = pytest.importorskip("requests")
    aiohttp = pytest.importorskip("aiohttp")
    return faults + [(requests.ConnectionError("Max retries exceeded"), False),
                     (requests.exceptions.ContentDecodingError("bad gzip body"), False),
                     (aiohttp.ClientOSError("Connection lost"), False)]


def test_a_decoding_error_is_a_content_fault_and_a_network_error_is_none() -> None:
    """Regression: an OSError without an errno was a decoding fault whatever raised it, so a network error (urllib's
    URLError, requests' ConnectionError) was a reject of the file's unreadable rest instead of stopping the job."""
    from streamprep.sources.local import _content_fault

    faults = _faults()
    assert len(faults) == 13
    assert [(type(exc).__name__, _content_fault(exc)) for exc, _ in faults] == \
        [(type(exc).__name__, content) for exc, content in faults]
