"""HFSource against a loopback Hub stand-in (tests/hub_server.py): real huggingface_hub downloads, real datasets
streaming, no internet (a socket guard refuses every non-loopback connection)."""
from __future__ import annotations

import io
import json
import re
import socket
import stat
import threading
from pathlib import Path
from contextlib import contextmanager
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from hub_server import FakeHub, git_blob_sha
from streamprep.config import ConfigError, DatasetConfig, dataset
from streamprep.sources import open_source
from streamprep.sources.base import BadRecord
from streamprep.sources.hf import HFSource, HFSourceError, HFSourceUnavailable, stream_local_with_datasets

REPO = "org/corpus"
README = b"""---
license: cc-by-4.0
configs:
- config_name: default
  default: true
  data_files:
  - split: train
    path: data/train-*.jsonl
  - split: validation
    path: data/validation-*.parquet
- config_name: fr
  data_files:
  - split: train
    path: fr/*.parquet
---
# corpus
A test corpus.
"""


def jsonl(rows: list[dict]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in rows)


def parquet(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf, row_group_size=2)
    return buf.getvalue()


def train_rows(f: int) -> list[dict]:
    return [{"id": f * 5 + i, "text": f"train doc {f * 5 + i}", "lang": "en" if (f * 5 + i) % 3 else "fr"} for i in range(5)]


TRAIN = [r for f in range(4) for r in train_rows(f)]
VALID = [{"id": 100 + i, "text": f"valid doc {i}", "lang": "en"} for i in range(5)]
FR = [{"id": 200 + i, "text": f"doc fr {i}", "lang": "fr"} for i in range(3)]
CORPUS = {
    "README.md": README,
    ".gitattributes": b"*.parquet filter=lfs diff=lfs merge=lfs -text\n",
    **{f"data/train-{f:05d}.jsonl": jsonl(train_rows(f)) for f in range(4)},
    "data/validation-00000.parquet": parquet(VALID),
    "fr/part-0.parquet": parquet(FR),
}
TRAIN_FILES = [f"data/train-{f:05d}.jsonl" for f in range(4)]


# ---- no internet, ever; and "no network at all" on demand -----------------------------------------------------
_real_connect = socket.socket.connect
_real_connect_ex = socket.socket.connect_ex
_real_getaddrinfo = socket.getaddrinfo
_deny_all = threading.local()
_deny_everywhere = threading.Event()
LOOPBACK = ("127.0.0.1", "::1", "localhost")
blocked: list[str] = []  # every refused attempt, even ones a library swallowed


def _refuse(what: str):
    blocked.append(what)
    raise ConnectionRefusedError(f"test socket guard: {what} refused")


def _check(sock_family, host) -> None:
    if sock_family == getattr(socket, "AF_UNIX", None):
        return
    if getattr(_deny_all, "on", False) or _deny_everywhere.is_set():
        _refuse(f"connection to {host} while the network is off")
    if host not in LOOPBACK:
        _refuse(f"connection to {host}")


def _guarded_connect(self, address):
    _check(self.family, address[0] if isinstance(address, tuple) else address)
    return _real_connect(self, address)


def _guarded_connect_ex(self, address):
    _check(self.family, address[0] if isinstance(address, tuple) else address)
    return _real_connect_ex(self, address)


def _guarded_getaddrinfo(host, *args, **kwargs):
    if host not in (*LOOPBACK, "0.0.0.0") and host is not None:  # 0.0.0.0: a server binding (the metrics endpoint)
        blocked.append(f"DNS lookup of {host}")
        raise socket.gaierror(socket.EAI_NONAME, f"test socket guard: no DNS for {host}")
    return _real_getaddrinfo(host, *args, **kwargs)


@pytest.fixture(autouse=True)
def no_internet(monkeypatch):
    blocked.clear()
    monkeypatch.setattr(socket.socket, "connect", _guarded_connect)
    monkeypatch.setattr(socket.socket, "connect_ex", _guarded_connect_ex)
    monkeypatch.setattr(socket, "getaddrinfo", _guarded_getaddrinfo)
    yield
    assert not blocked, f"network use that should not happen: {blocked}"


@contextmanager
def no_network(all_threads: bool = False):
    """Refuse every connection made from this thread (where the stream is consumed), loopback included; with
    `all_threads`, from every thread (the download window's too)."""
    _deny_all.on = True
    if all_threads:
        _deny_everywhere.set()
    try:
        yield
    finally:
        _deny_all.on = False
        _deny_everywhere.clear()
    assert not blocked, f"network use while processing: {blocked}"


# ---- the Hub stand-in -----------------------------------------------------------------------------------------
@pytest.fixture
def hub(monkeypatch, tmp_path):
    server = FakeHub().start()
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    # huggingface_hub reads HF_ENDPOINT once, at import: point its constants at the stand-in too
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", server.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", server.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    server.sha = server.add_dataset(REPO, CORPUS)
    yield server
    server.stop()
    assert not server.unknown, f"the client called endpoints the stand-in does not serve: {server.unknown}"


def cfg(**kw) -> DatasetConfig:
    return dataset({"name": "corpus", "path": f"hf://{REPO}", "split": "train", **kw})


def records(items) -> list:
    return [rec for rec, _ in items]


def roundtrip(pos: dict) -> dict:
    """What a checkpoint gives back."""
    return json.loads(json.dumps(pos))


# ---- downloads ------------------------------------------------------------------------------------------------
def test_streaming_downloads_each_file_once(hub, tmp_path):
    src = HFSource(cfg(), tmp_path / "cache", max_concurrent_downloads=4)
    assert records(src.iter_records()) == TRAIN
    # the files are in the HF cache under the commit sha (a stream deletes nothing: ingest's window does)
    paths = [tmp_path / "cache" / f"datasets--org--corpus/snapshots/{hub.sha}" / f for f in TRAIN_FILES]
    assert [p.read_bytes() for p in paths] == [CORPUS[f] for f in TRAIN_FILES]
    assert hub.file_requests("GET") == {**{f: 1 for f in TRAIN_FILES}, "README.md": 1}
    # the revision was resolved once, and files were fetched at the commit sha, never at "main"
    assert [p for (m, p) in hub.requests if "/resolve/main/" in p] == []
    assert hub.requests[("GET", f"/api/datasets/{REPO}/revision/main")] == 1

    hub.reset_counts()
    again = HFSource(cfg(), tmp_path / "cache", max_concurrent_downloads=4)
    assert records(again.iter_records()) == TRAIN
    assert hub.file_requests("GET") == {} and hub.file_requests("HEAD") == {}  # cached: only the revision lookup
    assert [p.read_bytes() for p in paths] == [CORPUS[f] for f in TRAIN_FILES]


def test_hub_stats_count_the_data_files_downloaded_not_the_readme(hub, tmp_path):
    """Regression: README.md, downloaded for its `configs:`, was counted as one more data file and its bytes in
    hub_stats.json (so in `status --json` and streamprep_hub_files_downloaded_total / _bytes_total)."""
    src = HFSource(cfg(), tmp_path / "cache", max_concurrent_downloads=4)
    assert records(src.iter_records()) == TRAIN
    assert hub.file_requests("GET") == {**{f: 1 for f in TRAIN_FILES}, "README.md": 1}
    stats = src.stats.snapshot()
    assert (stats["files"], stats["bytes"]) == (4, sum(len(CORPUS[f]) for f in TRAIN_FILES))
    assert json.loads((tmp_path / "cache/streamprep/hub_stats.json").read_text()) == stats


@pytest.mark.slow
def test_hub_stats_count_only_the_files_that_arrived_whole(hub, tmp_path, monkeypatch):
    """Regression: a data file was counted in hub_stats.json's files/bytes (so streamprep_hub_files_downloaded_total)
    when its body ended, before huggingface_hub's size check: a body 100 bytes short failed the download, which was
    deleted, and still counted. So did huggingface_hub's agent registry, fetched with a process's first download when
    telemetry is on: one more "file". A file counts once it passed the check, with its own bytes."""
    from huggingface_hub import constants
    from huggingface_hub.utils import _detect_agent

    src = HFSource(cfg(), tmp_path / "cache")
    src.fingerprint()
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", False)
    monkeypatch.setattr(constants, "AGENT_HARNESSES_PATH", str(tmp_path / "agent_harnesses.json"))
    monkeypatch.setattr(_detect_agent, "_registry", None)  # not fetched yet in this process: the first download does
    hub.fault_cycle = [None, "short"]  # the second data file's body is 100 bytes short
    with pytest.raises(HFSourceUnavailable, match=r"download of data/train-00001.jsonl failed \(OSError: Consistency "
                                                  r"check failed: file should be of size \d+ but has size"):
        records(src.iter_records())
    assert hub.faults_served == {"short": 1} and hub.requests[("GET", "/api/agent-harnesses")] == 1
    stats = src.stats.snapshot()
    assert (stats["files"], stats["bytes"]) == (1, len(CORPUS[TRAIN_FILES[0]]))
    assert json.loads((tmp_path / "cache/streamprep/hub_stats.json").read_text()) == stats
    hub.fault_cycle = []
    assert records(src.iter_records()) == TRAIN
    stats = src.stats.snapshot()
    assert (stats["files"], stats["bytes"]) == (4, sum(len(CORPUS[f]) for f in TRAIN_FILES))


def test_max_concurrent_downloads_is_a_limit(hub, tmp_path):
    hub.delay = 0.05
    assert records(HFSource(cfg(), tmp_path / "cache", max_concurrent_downloads=1).iter_records()) == TRAIN
    assert hub.max_in_flight == 1


@pytest.mark.slow
def test_max_concurrent_downloads_is_shared_by_sources_streaming_together(hub, tmp_path):
    hub.delay = 0.05
    other = [{"text": f"o{i}"} for i in range(4)]
    hub.add_dataset("org/other", {f"data/train-{i}.jsonl": jsonl([r]) for i, r in enumerate(other)})
    sources = [HFSource(cfg(), tmp_path / "cache", 2), HFSource(cfg(path="hf://org/other"), tmp_path / "cache", 2)]
    for s in sources:
        s.fingerprint()  # resolve first (README included): only the data transfers are measured
    hub.reset_counts()
    got: dict[str, list] = {}

    def stream(s: HFSource) -> None:  # each source read in its own thread, as ingest's readers do
        got[s.repo_id] = records(s.iter_records())

    threads = [threading.Thread(target=stream, args=(s,)) for s in sources]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == {REPO: TRAIN, "org/other": other}
    assert sum(hub.file_requests("GET").values()) == 8
    assert hub.max_in_flight == 2


# ---- streaming ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_records_in_order_and_fingerprint(hub, tmp_path):
    src = HFSource(cfg(), tmp_path / "cache")
    items = list(src.iter_records())
    assert records(items) == TRAIN
    assert [pos["consumed"] for _, pos in items] == list(range(1, len(TRAIN) + 1))
    assert {pos["revision"] for _, pos in items} == {hub.sha}
    assert all(json.loads(json.dumps(pos)) == pos for _, pos in items)  # JSON-able checkpoints
    fp = src.fingerprint()
    assert fp == {"hf_repo": REPO, "revision": hub.sha, "requested_revision": "main", "split": "train",
                  "subset": None, "builder": "json",
                  "files": [{"path": f, "size": len(CORPUS[f])} for f in TRAIN_FILES]}


@pytest.mark.slow
def test_a_cached_revision_needs_no_hub(hub, tmp_path):
    src = HFSource(cfg(), tmp_path / "cache")
    fp = src.fingerprint()
    assert records(src.iter_records()) == TRAIN
    assert hub.file_requests("GET") == {**{f: 1 for f in TRAIN_FILES}, "README.md": 1}

    hub.reset_counts()
    hub.stop()  # a second run, with the Hub gone: resolution falls back to the cache, and so do the files
    again = HFSource(cfg(), tmp_path / "cache")
    assert again.fingerprint() == fp
    assert records(again.iter_records()) == TRAIN  # a file not in the cache would fail: "download of ... failed"
    # and a source pinned to the commit sha does not even try the Hub, from any thread
    with no_network(all_threads=True):
        pinned = HFSource(cfg(revision=hub.sha), tmp_path / "cache")
        assert records(pinned.iter_records()) == TRAIN
    assert hub.requests == {}


def test_hf_hub_offline_uses_the_cache(hub, tmp_path, monkeypatch):
    assert records(HFSource(cfg(), tmp_path / "cache").iter_records()) == TRAIN  # a first run fills the cache
    hub.reset_counts()
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    src = HFSource(cfg(), tmp_path / "cache")
    assert src.fingerprint()["revision"] == hub.sha
    assert records(src.iter_records()) == TRAIN
    assert hub.requests == {}
    with pytest.raises(HFSourceUnavailable, match="no cached copy"):
        next(HFSource(cfg(split="validation"), tmp_path / "cache").iter_records())


@pytest.mark.slow
def test_filter_and_max_records(hub, tmp_path):
    cache = tmp_path / "cache"
    en = [r for r in TRAIN if r["lang"] == "en"]
    assert records(HFSource(cfg(filter={"lang": "en"}), cache).iter_records()) == en
    assert records(HFSource(cfg(max_records=7), cache).iter_records()) == TRAIN[:7]
    assert records(HFSource(cfg(filter={"lang": "en"}, max_records=4), cache).iter_records()) == en[:4]
    assert records(HFSource(cfg(filter={"lang": "xx"}), cache).iter_records()) == []
    assert records(HFSource(cfg(max_records=0), cache).iter_records()) == []
    # the cap counts across a resume: the position carries the total consumed
    capped = HFSource(cfg(max_records=7), cache)
    first = list(capped.iter_records())
    assert records(capped.iter_records(roundtrip(first[2][1]))) == TRAIN[3:7]
    assert records(capped.iter_records(roundtrip(first[-1][1]))) == []


def test_a_filter_on_a_list_or_a_mapping_field_matches_and_its_reader_pickles(hub, tmp_path):
    """Regression: a filter value that is a list or a mapping (`filter: {tags: [a, b]}`, `{meta: {lang: en}}`) stayed
    the config's frozen tuple or MappingProxyType: a tuple never equals a record's list, so the dataset read nothing
    and the run was "complete"; a MappingProxyType cannot be pickled, so `workers: 2` stopped the job on a
    TypeError. The reader a worker gets now holds plain lists and dicts, as the records do."""
    import pickle

    rows = [{"text": f"doc {i}", "tags": ["a", "b"] if i % 2 else ["c"], "meta": {"lang": "en" if i % 3 else "fr"}}
            for i in range(12)]
    hub.add_dataset("org/tagged", {"data/train-00000.jsonl": jsonl(rows)})
    for flt, want in [({"tags": ["a", "b"]}, [r for r in rows if r["tags"] == ["a", "b"]]),
                      ({"meta": {"lang": "fr"}}, [r for r in rows if r["meta"]["lang"] == "fr"])]:
        src = HFSource(cfg(path="hf://org/tagged", filter=flt), tmp_path / "cache")
        assert records(src.iter_records()) == want
        units = src.units()
        reader = pickle.loads(pickle.dumps(src.reader(units)))  # as a worker process gets it
        assert [rec for unit in units for rec in reader.read(unit)] == want


def test_a_mapping_filter_takes_a_null_field_for_a_missing_one_whatever_the_file(tmp_path):
    """Regression: inside a mapping the filter wanted the record's keys exactly, while at the top level a missing
    field is null: a Parquet struct column gives each record every field of its file's schema (null where it had
    none), so of two records written alike, {"lang": "en"}, one was kept and the one whose file also had records with
    a `src` dropped. Other fields with values still make a mapping differ."""
    for name, rows in (("a", [{"meta": {"lang": "en"}}]),
                       ("b", [{"meta": {"lang": "en"}}, {"meta": {"lang": "en", "src": "x"}}])):
        pq.write_table(pa.Table.from_pylist([{"text": f"{name}{i}", **r} for i, r in enumerate(rows)]),
                       tmp_path / f"{name}.parquet")
    files = [tmp_path / "a.parquet", tmp_path / "b.parquet"]

    def kept(flt: dict) -> list[str]:
        return [r["text"] for r, _ in stream_local_with_datasets(files, "parquet", filter=flt)]

    assert kept({"meta": {"lang": "en"}}) == ["a0", "b0"]
    assert kept({"meta": {"lang": "en", "src": None}}) == ["a0", "b0"]
    assert kept({"meta": {"lang": "en", "src": "x"}}) == ["b1"]


def test_a_filter_tells_true_from_1(hub, tmp_path):
    """Regression: the filter compared with Python's `==`, where True == 1 and False == 0: `filter: {n: true}` kept
    the records whose number n is 1, and `{flag: 0}` those whose flag is false. A boolean equals only a boolean
    now (in a list or a mapping too); 1 and 1.0 are still one number."""
    rows = [{"text": f"doc {i}", "flag": i % 2 == 1, "n": i % 2, "x": float(i % 2), "bits": [i % 2 == 1],
             "ints": [i % 2]} for i in range(6)]
    hub.add_dataset("org/flags", {"data/train-00000.jsonl": jsonl(rows)})

    def kept(**flt: Any) -> list:
        return [r["text"] for r in records(HFSource(cfg(path="hf://org/flags", filter=flt), tmp_path / "cache")
                                           .iter_records())]

    odd = ["doc 1", "doc 3", "doc 5"]
    assert kept(flag=True) == kept(n=1) == kept(x=1) == kept(bits=[True]) == kept(ints=[1]) == odd
    assert kept(flag=1) == kept(flag=0) == kept(n=True) == kept(n=False) == kept(x=True) == []
    assert kept(bits=[1]) == kept(ints=[True]) == []


@pytest.mark.parametrize("how", ["state_dict", "count"])
@pytest.mark.parametrize("flt", [None, {"lang": "en"}])
def test_resume_from_middle_yields_exactly_the_rest(hub, tmp_path, how, flt):
    src = HFSource(cfg(filter=flt), tmp_path / "cache")
    full = list(src.iter_records())
    assert len(full) > 6
    for k in [1, 3, 5, 6, len(full) - 1, len(full)]:  # mid-file, file boundaries, the end
        pos = roundtrip(full[k - 1][1])
        if how == "count":
            pos["state"] = None  # what a datasets without state_dict support gives: re-read and skip
        else:
            assert pos["state"] is not None
        rest = list(src.iter_records(pos))
        assert records(rest) == records(full[k:]), f"resume after item {k}"
        assert [p["consumed"] for _, p in rest] == [p["consumed"] for _, p in full[k:]]


def test_unusable_state_falls_back_to_skipping(hub, tmp_path):
    src = HFSource(cfg(), tmp_path / "cache")
    full = list(src.iter_records())
    pos = roundtrip(full[7][1])
    pos["state"] = {"something": "else"}
    assert records(src.iter_records(pos)) == records(full[8:])


def test_resume_pins_the_checkpoint_commit(hub, tmp_path):
    src = HFSource(cfg(), tmp_path / "cache")
    full = list(src.iter_records())
    checkpoint = roundtrip(full[8][1])
    old = hub.sha
    changed = dict(CORPUS)
    changed["data/train-00000.jsonl"] = jsonl([{"id": -1, "text": "new", "lang": "en"}])
    new = hub.add_dataset(REPO, changed)  # main moves on while the run is stopped
    resumed = HFSource(cfg(), tmp_path / "cache")
    assert resumed.fingerprint()["revision"] == new
    rest = list(resumed.iter_records(checkpoint))
    assert records(rest) == TRAIN[9:]  # finished on the commit it started on
    assert {p["revision"] for _, p in rest} == {old}
    assert resumed.fingerprint()["revision"] == old
    fresh = HFSource(cfg(), tmp_path / "cache")
    assert records(fresh.iter_records())[0] == {"id": -1, "text": "new", "lang": "en"}


# ---- data-file selection ----------------------------------------------------------------------------------------
def test_readme_configs_pick_split_and_subset(hub, tmp_path):
    cache = tmp_path / "cache"
    valid = HFSource(cfg(split="validation"), cache)
    assert records(valid.iter_records()) == VALID
    assert valid.fingerprint()["builder"] == "parquet"
    assert records(HFSource(cfg(subset="fr"), cache).iter_records()) == FR
    assert records(HFSource(cfg(subset="default"), cache).iter_records()) == TRAIN
    # only the split's files were downloaded
    assert set(hub.file_requests("GET")) == {"README.md", *TRAIN_FILES, "data/validation-00000.parquet",
                                             "fr/part-0.parquet"}


def test_default_patterns_without_readme(hub, tmp_path):
    train = [{"text": f"t{i}"} for i in range(3)]
    test = [{"text": f"x{i}"} for i in range(2)]
    hub.add_dataset("org/plain", {"train.jsonl": jsonl(train), "test.parquet": parquet(test), "LICENSE": b"MIT\n",
                                  "notes/.hidden.jsonl": jsonl([{"text": "hidden"}])})
    cache = tmp_path / "cache"
    assert records(HFSource(cfg(path="hf://org/plain"), cache).iter_records()) == train
    assert records(HFSource(cfg(path="hf://datasets/org/plain", split="test"), cache).iter_records()) == test
    with pytest.raises(HFSourceError, match=r"hf://org/plain: unknown split 'validation' \(available: train, test\)"):
        next(HFSource(cfg(path="hf://org/plain", split="validation"), cache).iter_records())


def test_files_of_another_format_than_the_splits_are_named_in_a_warning(hub, tmp_path):
    """As `datasets` does, a split whose files have two formats reads those of the most common one (Parquet wins a
    tie); the others used to be dropped without a word (the run said `files: 1`, 100 JSONL records gone). A warning
    names them; with `format` every file of the split is read as that format."""
    from structlog.testing import capture_logs

    a, b = [{"text": "from jsonl"}], [{"text": "from parquet"}]
    hub.add_dataset("org/twofmt", {"data/train-00000.jsonl": jsonl(a), "data/train-00001.parquet": parquet(b),
                                   "data/train-00002.parquet": parquet(b)})
    with capture_logs() as logged:
        src = HFSource(cfg(path="hf://org/twofmt"), tmp_path / "cache")
        assert records(src.iter_records()) == b + b
    warned = [e for e in logged if e["log_level"] == "warning"]
    assert [(e["event"], e["builder"], e["read"], e["count"], e["not_read"]) for e in warned] == [
        ("data files of another format than the split's are not read", "parquet", 2, 1, ["data/train-00000.jsonl"])]
    with capture_logs() as logged:
        got = records(HFSource(cfg(path="hf://org/twofmt", format="jsonl"), tmp_path / "cache").iter_records())
    assert got[0] == a[0] and len(got) == 3 and all(isinstance(x, BadRecord) for x in got[1:])
    assert not [e for e in logged if e["log_level"] == "warning"]


def test_sharded_split_pattern_and_format_override(hub, tmp_path):
    rows = [{"text": f"s{i}"} for i in range(4)]
    hub.add_dataset("org/sharded", {"data/train-00000-of-00002.data": jsonl(rows[:2]),
                                    "data/train-00001-of-00002.data": jsonl(rows[2:])})
    src = HFSource(cfg(path="hf://org/sharded", format="jsonl"), tmp_path / "cache")
    assert records(src.iter_records()) == rows
    assert src.fingerprint()["builder"] == "json"


# ---- bad input ----------------------------------------------------------------------------------------------------
def test_malformed_jsonl_file_is_one_bad_record(hub, tmp_path):
    good0, good2 = [{"text": "a"}, {"text": "b"}], [{"text": "c"}]
    hub.add_dataset("org/broken", {"data/train-0.jsonl": jsonl(good0),
                                   "data/train-1.jsonl": b'{"text": "x"}\n{"text": broken\n{"text": "y"}\n',
                                   "data/train-2.jsonl": jsonl(good2)})
    src = HFSource(cfg(path="hf://org/broken"), tmp_path / "cache")
    items = list(src.iter_records())
    assert records(items)[:2] == good0 and records(items)[3:] == good2
    bad, pos = items[2]
    assert isinstance(bad, BadRecord)
    assert "data/train-1.jsonl" in bad.reason and "\n" not in bad.reason
    assert pos["file"] == 2 and pos["record"] == 0
    # resuming right after the bad file goes on with the next file
    assert records(src.iter_records(roundtrip(pos))) == good2


def test_a_damaged_compressed_file_loses_its_chunk_and_the_rest(hub, tmp_path):
    """What docs/hf-sources.md says of a damaged compressed file read over hf://: `datasets`' JSON reader decompresses
    it in chunks of 10 MB of text and fails it from the chunk with the damage on: one reject naming the records read
    before (the whole file when that is the first chunk, whatever was readable in it), where a local path keeps every
    record before the damage."""
    import gzip

    rows = [{"text": f"doc {i} " + "y" * 1000} for i in range(12_000)]  # ~12 MB of text
    whole = jsonl(rows)
    small, big = gzip.compress(jsonl(rows[:100]))[:-500], gzip.compress(whole)[:-1000]
    hub.add_dataset("org/cutgz", {"data/train-0.jsonl.gz": small, "data/train-1.jsonl.gz": big})
    items = records(HFSource(cfg(path="hf://org/cutgz"), tmp_path / "cache").iter_records())
    eof = "EOFError: Compressed file ended before the end-of-stream marker was reached"
    assert items[0] == BadRecord(f"unreadable json file data/train-0.jsonl.gz, skipped: {eof}", "")
    first_chunk = whole[:10 << 20].count(b"\n") + 1  # the chunk, then the rest of its last line
    assert items[1:-1] == rows[:first_chunk]
    assert items[-1] == BadRecord(f"unreadable json file data/train-1.jsonl.gz after {first_chunk} records, rest of "
                                  f"the file skipped: {eof}", "")


def test_empty_files_are_counted_rejects_and_the_stream_goes_on(hub, tmp_path):
    """A data file with no records (0 bytes, blank lines only, an empty .gz, a zero-row or 0-byte Parquet file) is one
    "empty file" reject and the next file is read (the json builder used to raise StopIteration at load_dataset, and
    the 0-byte Parquet file ArrowInvalid: the job crashed); a file the filter empties is not a reject; a Parquet file
    that is not Parquet is one "unreadable" reject."""
    import gzip

    a, b = [{"text": "a", "lang": "en"}], [{"text": "b", "lang": "en"}]
    hub.add_dataset("org/empties", {"data/train-0.jsonl": jsonl(a), "data/train-1.jsonl": b"",
                                    "data/train-2.jsonl": b"\n  \n", "data/train-3.jsonl.gz": gzip.compress(b""),
                                    "data/train-4.jsonl": jsonl([{"text": "f", "lang": "fr"}]),
                                    "data/train-5.jsonl": jsonl(b)})
    src = HFSource(cfg(path="hf://org/empties", filter={"lang": "en"}), tmp_path / "cache")
    items = list(src.iter_records())
    assert records(items) == [a[0], *(BadRecord(f"empty file data/train-{f}.jsonl{'.gz' if f == 3 else ''}", "")
                                      for f in (1, 2, 3)), b[0]]
    assert [(p["file"], p["record"], p["consumed"]) for _, p in items] == [(0, 1, 1), (2, 0, 2), (3, 0, 3), (4, 0, 4),
                                                                           (5, 1, 5)]
    assert records(src.iter_records(roundtrip(items[1][1]))) == records(items[2:])  # resumed after a reject

    no_rows = io.BytesIO()
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), no_rows)
    hub.add_dataset("org/empty-parquet", {"data/train-0.parquet": parquet(a), "data/train-1.parquet": b"",
                                          "data/train-2.parquet": no_rows.getvalue(),
                                          "data/train-3.parquet": b"not parquet", "data/train-4.parquet": parquet(b)})
    got = records(HFSource(cfg(path="hf://org/empty-parquet"), tmp_path / "cache").iter_records())
    assert got[:3] == [a[0], BadRecord("empty file data/train-1.parquet", ""),
                       BadRecord("empty file data/train-2.parquet", "")] and got[4:] == b
    assert got[3].reason.startswith("unreadable parquet file data/train-3.parquet, skipped: ArrowInvalid: ")


def _tar(members: dict[str, bytes]) -> bytes:
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_archives_and_a_parquet_file_compressed_whole_are_one_reject_each_as_on_a_local_path(hub, tmp_path):
    """A tar archive (also compressed) or a Parquet file compressed whole in a split is the reject a local path gives
    (`local.refused`), naming the file: a split of tars was read by `datasets`' webdataset builder (each member one
    record, no 'text'), a .jsonl.tar.gz failed with an internal path, a .parquet.gz as 'magic bytes not found'. A
    .zip is read, every member (`datasets` reads them all)."""
    import gzip
    import zipfile

    a, b = [{"text": "a"}], [{"text": "b"}]
    why = "a tar archive (not read: unpack it, or compress each file as .gz, .zst, .bz2 or .xz)"
    hub.add_dataset("org/tars", {"data/train-0.tar": _tar({"x.jsonl": jsonl(a)})})
    assert records(HFSource(cfg(path="hf://org/tars"), tmp_path / "c1").iter_records()) == [
        BadRecord(f"unsupported file, skipped: data/train-0.tar: {why}", "")]
    zipped = io.BytesIO()
    with zipfile.ZipFile(zipped, "w") as z:
        z.writestr("x.jsonl", jsonl(a))
        z.writestr("y.jsonl", jsonl(b))
    hub.add_dataset("org/mixed-tar", {"data/train-0.jsonl": jsonl(a), "data/train-1.jsonl.tar.gz":
                                      gzip.compress(_tar({"x.jsonl": jsonl(b)})), "data/train-2.jsonl.zip": zipped.getvalue()})
    assert records(HFSource(cfg(path="hf://org/mixed-tar"), tmp_path / "c2").iter_records()) == [
        *a, BadRecord(f"unsupported file, skipped: data/train-1.jsonl.tar.gz: {why}", ""), *a, *b]
    hub.add_dataset("org/pqgz", {"data/train-0.parquet": parquet(a), "data/train-1.parquet.gz": gzip.compress(parquet(b))})
    assert records(HFSource(cfg(path="hf://org/pqgz"), tmp_path / "c3").iter_records()) == [
        *a, BadRecord("unsupported file, skipped: data/train-1.parquet.gz: a Parquet file compressed whole (not read: "
                      "decompress it; Parquet compresses its own pages)", "")]


def test_tars_of_a_one_word_suffix_are_one_reject_each_without_a_format_too(hub, tmp_path):
    """A .tgz, .tbz2, .txz or .tzst in a split with no `format` was left out unsaid (no reject, no count, not in the
    not-read warning: `datasets` knows none of these suffixes), and a split of .tgz alone stopped the job with
    "matches no data files"; each is one reject naming it, as with `format: json` and on a local path."""
    from structlog.testing import capture_logs

    a = [{"text": "a"}]
    why = "a tar archive (not read: unpack it, or compress each file as .gz, .zst, .bz2 or .xz)"
    tars = ["data/train-1.tgz", "data/train-2.tbz2", "data/train-3.txz", "data/train-4.tzst"]
    hub.add_dataset("org/tgz", {"data/train-0.jsonl": jsonl(a), **{t: _tar({"x.jsonl": jsonl(a)}) for t in tars}})
    with capture_logs() as logged:
        got = records(HFSource(cfg(path="hf://org/tgz"), tmp_path / "c1").iter_records())
    assert got == [*a, *(BadRecord(f"unsupported file, skipped: {t}: {why}", "") for t in tars)]
    assert not [e for e in logged if e["log_level"] == "warning"]
    hub.add_dataset("org/onlytgz", {"data/train-0.tgz": _tar({"x.jsonl": jsonl(a)})})
    assert records(HFSource(cfg(path="hf://org/onlytgz"), tmp_path / "c2").iter_records()) == [
        BadRecord(f"unsupported file, skipped: data/train-0.tgz: {why}", "")]


def test_a_line_over_the_limit_in_a_hub_file_is_one_reject_naming_it_read_through_not_held(hub, tmp_path,
                                                                                           monkeypatch):
    """A JSON Lines line over MAX_LINE_BYTES (here 4 KiB) is the `line N of FILE is B bytes, over the limit` reject of
    a local file, for a .zst, .gz or plain file alike, read through in pieces: `datasets` held it whole (a 270 MiB
    line in a .gz cost 2.3 GB). Its reader cannot skip one line: the rest of the file goes with it (here the whole
    file, one chunk), and the next file is read."""
    import gzip

    import zstandard

    from streamprep.sources import local

    monkeypatch.setattr(local, "MAX_LINE_BYTES", 4096)
    a, b, c = [{"text": "a"}], [{"text": "b"}], [{"text": "c" * 4000}]  # c: a line just under the limit
    body = jsonl(a) + b'{"text": "' + b"w" * 5000 + b'"}\n' + jsonl(b)
    hub.add_dataset("org/long", {"data/train-0.jsonl.zst": zstandard.ZstdCompressor().compress(body),
                                 "data/train-1.jsonl.gz": gzip.compress(body), "data/train-2.jsonl": body,
                                 "data/train-3.jsonl": jsonl(c)})
    over = "is 5013 bytes, over the 4096-byte limit of a record, skipped with the rest of the file (after 0 records)"
    assert records(HFSource(cfg(path="hf://org/long"), tmp_path / "cache").iter_records()) == [
        BadRecord(f"line 2 of data/train-{f} {over}", "") for f in ("0.jsonl.zst", "1.jsonl.gz", "2.jsonl")] + c
    # a JSON document (an array, on one line) is read whole, as `datasets` reads it: no line of it is a record
    rows = [{"text": f"row {i} " + "w" * 100} for i in range(60)]  # ~6.5 KB on one line
    for name, data in (("data/train-0.json", json.dumps(rows).encode()),
                       ("data/train-0.json.gz", gzip.compress(json.dumps(rows).encode()))):
        hub.add_dataset(f"org/array{len(name)}", {name: data})
        assert records(HFSource(cfg(path=f"hf://org/array{len(name)}"), tmp_path / "cache").iter_records()) == rows


def test_a_zst_file_is_read_through_a_buffer_not_a_byte_a_call(hub, tmp_path, monkeypatch):
    """`datasets`' JSON reader ends each batch on `readline`, which a zstd stream has not: it fell back on reading a
    byte a call (a 20 MiB line took 64 s on the Hub, 2.6 s on a local path). The stream it gets now has one; the
    records are the same."""
    import zstandard
    from datasets.packaged_modules.json import json as json_module

    def byte_a_call(f):
        raise AssertionError("datasets read a line a byte a call")

    monkeypatch.setattr(json_module, "readline", byte_a_call)
    rows = [{"text": f"doc {i} " + "x" * (i % 500)} for i in range(3000)]
    hub.add_dataset("org/zst", {"data/train-0.jsonl.zst": zstandard.ZstdCompressor().compress(jsonl(rows))})
    assert records(HFSource(cfg(path="hf://org/zst"), tmp_path / "cache").iter_records()) == rows


def test_datasets_own_failed_to_lines_are_not_printed_the_reject_names_the_file(hub, tmp_path, capfd):
    """`datasets` logged "Failed to load JSON from file '<cache path>' ..." / "Failed to read schema from ..." to
    stderr before the raise that becomes the reject, naming a cache path deleted right after."""
    hub.add_dataset("org/bad", {"data/train-0.jsonl": b'{"text": "x"}\n{"text": broken\n'})
    hub.add_dataset("org/badpq", {"data/train-0.parquet": b"not parquet"})
    got = [*records(HFSource(cfg(path="hf://org/bad"), tmp_path / "c1").iter_records()),
           *records(HFSource(cfg(path="hf://org/badpq"), tmp_path / "c2").iter_records())]
    assert [r.reason.split(",")[0] for r in got] == ["unreadable json file data/train-0.jsonl after 0 records",
                                                      "unreadable parquet file data/train-0.parquet"]
    assert "Failed to" not in capfd.readouterr().err


def test_a_file_that_vanishes_stops_the_stream_instead_of_becoming_a_reject(tmp_path, monkeypatch):
    """Only faults of a file's bytes are rejects: one of the environment (the file gone, also wrapped by the
    builder) is raised, so the job stops and a re-run reads the file."""
    import datasets
    import pyarrow

    (tmp_path / "a.jsonl").write_bytes(jsonl(TRAIN[:2]))

    def fails(exc):
        def load_dataset(*a, **k):
            raise exc
        return load_dataset

    gone = FileNotFoundError(2, "No such file or directory")
    wrapped = RuntimeError("the builder failed")
    wrapped.__cause__ = gone
    for exc in (gone, wrapped):
        monkeypatch.setattr(datasets, "load_dataset", fails(exc))
        with pytest.raises(type(exc)):
            list(stream_local_with_datasets([tmp_path / "a.jsonl"], "json"))
    monkeypatch.setattr(datasets, "load_dataset", fails(pyarrow.ArrowInvalid("bad bytes")))
    assert records(stream_local_with_datasets([tmp_path / "a.jsonl"], "json")) == \
        [BadRecord(f"unreadable json file {tmp_path / 'a.jsonl'}, skipped: ArrowInvalid: bad bytes", "")]


@pytest.mark.parametrize("entry, message", [
    (dict(path="hf://org/missing"), r"^dataset corpus: hf://org/missing: dataset repo not found"),
    (dict(revision="v9"), r"^dataset corpus: hf://org/corpus: revision 'v9' not found"),
    (dict(split="dev"), r"^dataset corpus: hf://org/corpus: unknown split 'dev' \(available: train, validation\)"),
    (dict(subset="de"), r"^dataset corpus: hf://org/corpus: unknown subset 'de' \(available: default, fr\)"),
    (dict(split=None), r"hf://org/corpus: 'split' is required"),
    (dict(path="hf://a/b/c"), r"hf://a/b/c: expected hf://<org>/<name>"),
])
def test_errors_are_one_line_and_name_the_repo(hub, tmp_path, entry, message):
    """Regression: what the Hub's answer shows wrong named the repo, not the entry, so of two entries reading one
    repo (its splits, its subsets) the message did not say which was wrong; it names the dataset first."""
    with pytest.raises(HFSourceError, match=message) as err:
        next(HFSource(cfg(**entry), tmp_path / "cache").iter_records())
    assert isinstance(err.value, ConfigError)  # the CLI's exit 2
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("entry, message", [
    (dict(path="hf://org/corpus@v1.0", revision="refs/convert/parquet"),
     "config: 'datasets[0].revision': hf://org/corpus@v1.0: 'revision' 'refs/convert/parquet' disagrees with the "
     "path's @v1.0; give the revision once"),
    (dict(path="hf://org/corpus@"),
     "config: 'datasets[0].path': hf://org/corpus@: no revision after '@' (name a branch, tag or commit sha, or drop "
     "the '@')"),
    (dict(path="hf://a/b/c"), "config: 'datasets[0].path': hf://a/b/c: expected hf://<org>/<name> (a dataset repo id)"),
])
def test_a_revision_given_twice_differently_or_an_empty_at_is_refused_at_validation(tmp_path, entry, message):
    """Regression: `hf://org/c4@v1.0` with `revision: refs/convert/parquet` read refs/convert/parquet, and `hf://org/c4@`
    read main, without a word. Each is a config error naming the key, before anything is written (no Hub asked)."""
    from helpers import base_config
    from streamprep import run_from_dict

    raw = base_config([{"name": "web", "path": f"hf://{REPO}", "split": "train", **entry}], None)
    with pytest.raises(ConfigError) as err:
        run_from_dict(raw, run_dir=tmp_path / "run", console_log=False)
    assert str(err.value) == message
    assert not (tmp_path / "run").exists()


def test_a_revision_given_twice_the_same_is_that_revision(hub, tmp_path):
    """`@rev` and `revision:` naming the same revision are one request, not a conflict; the source also refuses a
    conflict when opened through the API (no config validation there)."""
    from streamprep.config import validate
    from helpers import base_config

    v1 = hub.add_dataset(REPO, {"data/train-00000.jsonl": jsonl(TRAIN[:3])}, branch="v1")
    hub.add_dataset(REPO, CORPUS)  # main moves on
    entry = {"path": f"hf://{REPO}@v1", "revision": "v1"}
    validate(base_config([{"name": "web", "split": "train", **entry}], None))
    src = HFSource(cfg(**entry), tmp_path / "cache")
    assert src.revision == "v1" and records(src.iter_records()) == TRAIN[:3]
    assert src.fingerprint()["revision"] == v1
    with pytest.raises(HFSourceError, match=r"^hf://org/corpus@v1: 'revision' 'main' disagrees with the path's @v1"):
        HFSource(cfg(path=f"hf://{REPO}@v1", revision="main"), tmp_path / "cache")


@pytest.mark.parametrize("status", ["401", "403"])
def test_a_token_the_hub_refuses_is_a_config_error_saying_so(hub, tmp_path, status):
    """Regression: a token the Hub refused (401), or one without access (403), was "Hub unreachable and no cached
    copy", exit 1, which says re-running resumes; the Hub answered, and no re-run fixes a token."""
    hub.api_faults = [status]
    with pytest.raises(HFSourceError) as err:
        next(HFSource(cfg(), tmp_path / "cache").iter_records())
    assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)
    assert str(err.value).startswith("dataset corpus: hf://org/corpus: the Hub refused the request (") and str(err.value).endswith(
        "); check HF_TOKEN: a token it does not accept, or one without access to this repo")
    assert f"{status} " in str(err.value)
    hub.api_faults = [None, status]  # the revision answered, README.md's download refused: named once (regression)
    with pytest.raises(HFSourceError) as err:
        next(HFSource(cfg(), tmp_path / "cache2").iter_records())
    assert str(err.value).startswith("dataset corpus: hf://org/corpus: the Hub refused the download of README.md (")


@pytest.mark.parametrize("token, workers", [(None, 1), ("hf_not_accepted", 2)], ids=["anonymous", "token"])
def test_a_gated_repo_whose_files_the_hub_refuses_is_a_config_error_naming_the_dataset(many, tmp_path, monkeypatch,
                                                                                       token, workers):
    """Regression: the Hub shows a gated repo's listing and README.md to anyone but refuses its files (401 without a
    token, 403 with one that has not accepted the terms); the worker's download failed as `HFSourceUnavailable`,
    exit 1, whose "re-run the same command to resume" no re-run fulfils. Now one line naming the dataset, the repo,
    the file and HF_TOKEN, exit 2; once the Hub lets the files through, the same call finishes the run."""
    from streamprep import atomic, run_from_dict

    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    many.gated.add(MANY_REPO)
    raw = _ingest_config(MANY_REPO, workers=workers)
    raw["datasets"][0].pop("filter")
    run = tmp_path / "run"
    with pytest.raises(HFSourceError) as err:
        run_from_dict(raw, run_dir=run, console_log=False)
    assert re.fullmatch(r"dataset web: hf://org/many: gated dataset; accept its terms on the Hub and set HF_TOKEN "
                        rf"\(download of data/train-0000\d\.jsonl: GatedRepoError: {403 if token else 401} Client "
                        r"Error\.\)", str(err.value)), str(err.value)
    assert atomic.read_json(run / "run.json")["needs_change"] is True
    many.gated.clear()
    assert run_from_dict(raw, run_dir=run, console_log=False).status == "complete"


def test_a_file_the_hub_stores_in_xet_is_downloaded_through_the_retrying_transport(hub, tmp_path):
    """Regression: with hf_xet installed, a file whose HEAD names a Xet hash (most Hub files uploaded since 2025) was
    fetched by hf_xet's own client, outside the retrying transport: not counted in hub_stats nor bounded by
    hf_retries. Here the Xet route is not served, so taking it fails; through the transport the file arrives, its
    bytes are the file's and it is counted, a 429 on it retried and counted."""
    from streamprep.sources.hf import download, hub_stats

    hub.xet, hub.fault_cycle = True, ["429", None]
    cache = tmp_path / "cache"
    HFSource(cfg(), cache)  # as a job's worker does first: the source puts the Hub's HTTP on its transport
    stats = hub_stats(cache)
    got = download("web", REPO, TRAIN_FILES[0], hub.sha, cache, hub.url, 1, stats)
    assert got.read_bytes() == CORPUS[TRAIN_FILES[0]]
    assert not hub.unknown  # the Xet token route was never asked for
    assert stats.snapshot()["files"] == 1 and stats.snapshot()["retries"] == {"429": 1}


@pytest.mark.parametrize("status", ["401", "403"])
def test_a_download_the_hub_refuses_is_a_config_error_saying_so(hub, tmp_path, status):
    """Regression: a file's HEAD answered 401 or 403 was `HFSourceUnavailable` (exit 1, "re-run to resume"); for 403,
    huggingface_hub's "check your connection" LocalEntryNotFoundError. It names the refusal and HF_TOKEN now, exit 2."""
    from streamprep.sources.hf import download, hub_stats

    cache = tmp_path / "cache"
    hub.api_faults = [status]  # the HEAD of the file
    with pytest.raises(HFSourceError) as err:
        download("web", REPO, TRAIN_FILES[0], hub.sha, cache, hub.url, 1, hub_stats(cache))
    assert str(err.value).startswith(f"dataset web: hf://org/corpus: the Hub refused the download of {TRAIN_FILES[0]} "
                                     f"(HfHubHTTPError: ")
    assert f"{status} " in str(err.value) and "connection" not in str(err.value)
    assert str(err.value).endswith("); check HF_TOKEN: a token it does not accept, or one without access to this repo")


@pytest.mark.parametrize("card", [{"configs": [5]}, {"configs": [{"config_name": "default", "data_dir": 5}]},
                                  {"configs": [{"config_name": "default",
                                                "data_files": [{"split": "train", "path": [1, 2]}]}]},
                                  {"configs": [{"config_name": "default", "data_files": [{"split": 5, "path": "x"}]}]}],
                         ids=["not-a-mapping", "data_dir-number", "path-numbers", "split-number"])
def test_a_readme_configs_of_the_wrong_shape_is_one_line_naming_it(card):
    """Regression: `datasets` reads `configs:` without checking its shape; a number where it wants a string raised a
    bare TypeError/AttributeError, exit 1, naming neither the repo nor README.md."""
    from streamprep.sources.hf import select_data_files

    with pytest.raises(HFSourceError, match=r"^hf://org/x: bad 'configs' in README.md: \w+: ") as err:
        select_data_files("org/x", ["data/train.jsonl"], "train", None, card)
    assert isinstance(err.value, ConfigError) and "\n" not in str(err.value)


@pytest.mark.parametrize("item, message", [
    ({"split": "test-clean", "path": "clean/*.jsonl"},
     "config 'default': split name 'test-clean' is not allowed (letters, digits and '_', with '.' between them)"),
    ({"split": "train", "path": "x/*", "paths": "y"},
     "Expected data_files in YAML to be either a string or a list of strings or a list of dicts with two keys: "
     "'split' and 'path', but got [{'split': 'train', 'path': 'x/*', 'paths': 'y'}]")], ids=["dash", "third-key"])
def test_a_readme_configs_that_datasets_refuses_is_one_line_naming_the_cause(item, message):
    """Regression: `datasets`' error on data_files is many lines (the cause, examples, then "PS: some symbols like
    dashes '-' are not allowed in split names"); its first line alone, "Expected data_files in YAML to be either a
    string or a list of strings", hid the cause: a split name `datasets` refuses."""
    from streamprep.sources.hf import select_data_files

    card = {"configs": [{"config_name": "default", "data_files": [item]}]}
    with pytest.raises(HFSourceError) as err:
        select_data_files("org/x", ["clean/a.jsonl", "x/b.jsonl"], "train", None, card)
    assert isinstance(err.value, ConfigError) and str(err.value) == f"hf://org/x: bad 'configs' in README.md: {message}"


def test_hub_down_and_nothing_cached_is_resumable_error(hub, tmp_path):
    hub.stop()
    with pytest.raises(HFSourceUnavailable, match=r"hf://org/corpus@main: Hub unreachable and no cached copy"):
        HFSource(cfg(), tmp_path / "cache").fingerprint()


def test_open_source_routes_hf_paths(hub, tmp_path):
    src = open_source(cfg(max_records=2), tmp_path / "cache", 3)
    assert isinstance(src, HFSource) and src.workers == 3
    assert records(src.iter_records()) == TRAIN[:2]


# ---- local files through the same datasets path -------------------------------------------------------------------
def test_stream_local_with_datasets(tmp_path):
    d = tmp_path / "local"
    d.mkdir()
    (d / "a.jsonl").write_bytes(jsonl(TRAIN[:5]))
    (d / "b.jsonl").write_bytes(jsonl(TRAIN[5:12]))
    files = sorted(d.glob("*.jsonl"))
    cache = tmp_path / "ds_cache"
    with no_network():
        full = list(stream_local_with_datasets(files, "jsonl", cache_dir=cache))
        assert records(full) == TRAIN[:12]
        assert records(stream_local_with_datasets(files, "json", filter={"lang": "fr"}, cache_dir=cache)) == \
            [r for r in TRAIN[:12] if r["lang"] == "fr"]
        assert records(stream_local_with_datasets(files, "json", start=roundtrip(full[6][1]), cache_dir=cache)) == TRAIN[7:12]
        assert records(stream_local_with_datasets(files, "json", max_records=3, cache_dir=cache)) == TRAIN[:3]
        (d / "c.parquet").write_bytes(parquet(VALID))
        assert records(stream_local_with_datasets([d / "c.parquet"], "parquet", cache_dir=cache)) == VALID


# ---- through the whole pipeline --------------------------------------------------------------------------------
WEB_REPO = "org/web"


def _web_rows(f: int) -> list[dict]:
    from helpers import english_docs

    docs = english_docs(300, seed=f)
    return [{"text": t, "lang": "en" if i % 5 else "fr", "id": f"{f}-{i}"} for i, t in enumerate(docs)]


@pytest.mark.slow
async def test_hf_dataset_through_the_pipeline_with_stop_and_resume(hub, tmp_path):
    """hf:// in a config: filter while streaming, parts written, a stop mid-stream resumes to identical outputs."""
    import asyncio

    from helpers import base_config, ingest_stopped_after, tree_hashes
    from streamprep.config import load
    from streamprep.ingest import IngestContext, ingest_all

    hub.add_dataset(WEB_REPO, {f"data/train-{f:05d}.jsonl": jsonl(_web_rows(f)) for f in range(3)})
    raw = base_config([{"name": "web", "path": f"hf://{WEB_REPO}", "split": "train", "filter": {"lang": "en"}}], None,
                      output={"shard_records": 100})
    raw["execution"].update(batch_records=25, workers=1)
    conf = load(raw)

    ref = tmp_path / "ref"
    state = (await ingest_all(IngestContext.of(conf, ref, ref / "checkpoints", asyncio.Event())))["web"]
    assert state.done and state.consumed == 720 and state.kept == 720  # 3 × 300 rows, 1 in 5 filtered out
    assert len(list((ref / "ingest/web").glob("part-*.jsonl"))) == 8

    run = tmp_path / "run"
    stopped = await ingest_stopped_after(conf, run, "web", 300)
    assert not stopped.done and 300 <= stopped.consumed < 720
    resumed = (await ingest_all(IngestContext.of(conf, run, run / "checkpoints", asyncio.Event())))["web"]
    assert resumed.done and resumed.kept == 720
    assert tree_hashes(run, "ingest", "rejects") == tree_hashes(ref, "ingest", "rejects")


# ---- streaming: a bounded download window ahead of the reader -------------------------------------------------
MANY_REPO = "org/many"
MANY_FILES = [f"data/train-{f:05d}.jsonl" for f in range(12)]


def _many_rows(f: int) -> list[dict]:
    return [{"id": f * 40 + i, "text": f"doc {f * 40 + i} " + "x" * 1000} for i in range(40)]


@pytest.fixture
def many(hub):
    """12 data files of ~41 KB, served at 400 KB/s per response (~0.1 s a file)."""
    hub.add_dataset(MANY_REPO, {p: jsonl(_many_rows(f)) for f, p in enumerate(MANY_FILES)})
    hub.rate = 400_000
    return hub


def _many_cfg(**kw) -> DatasetConfig:
    return cfg(path=f"hf://{MANY_REPO}", **kw)


def _data_gets(hub) -> set[str]:
    return {p for p, n in hub.file_requests("GET").items() if p.startswith("data/") and n}


def _cache_bytes(root) -> int:
    """Bytes of blobs (complete or being written) in an HF cache.

    Called from a watcher thread while downloads run: a blob's temp file may be renamed or a passed
    file deleted between listing and stat, so a file that vanished counts as 0 bytes.
    """
    total = 0
    for p in root.glob("datasets--*/blobs/*"):
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            total += st.st_size
    return total


@pytest.mark.slow
def test_a_stream_downloads_each_file_when_it_reaches_it(many, tmp_path):
    src = HFSource(_many_cfg(), tmp_path / "cache", max_concurrent_downloads=2, prefetch_files=2)
    it = src.iter_records()
    first, _ = next(it)
    assert first["id"] == 0
    assert _data_gets(many) == set(MANY_FILES[:1])
    rest = [rec["id"] for rec, _ in it]
    assert [0, *rest] == list(range(480))  # same records, same order as a full download
    assert many.file_requests("GET") == {**{p: 1 for p in MANY_FILES}}


def test_a_stream_with_max_records_downloads_only_the_files_it_reads(many, tmp_path):
    src = HFSource(_many_cfg(max_records=50), tmp_path / "cache", max_concurrent_downloads=8, prefetch_files=2)
    assert [rec["id"] for rec, _ in src.iter_records()] == list(range(50))  # 50 records: files 0 and 1
    assert _data_gets(many) == set(MANY_FILES[:2])


def test_hf_prefetch_config_keys_are_validated(tmp_path):
    from helpers import base_config
    from streamprep.config import validate

    ds = [{"name": "web", "path": "hf://org/x", "split": "train"}]
    ex = validate(base_config(ds, None))["execution"]
    assert (ex["hf_prefetch_files"], ex["hf_cache_max_gb"], ex["hf_keep_cache"]) == (4, 10.0, False)
    for bad in ({"hf_prefetch_files": 0}, {"hf_cache_max_gb": 0}, {"hf_cache_max_gb": -1.5}):
        raw = base_config(ds, None)
        raw["execution"].update(bad)
        with pytest.raises(ConfigError, match=next(iter(bad))):
            validate(raw)


@pytest.mark.slow
async def test_pipeline_streams_and_a_resume_downloads_only_what_it_needs(many, tmp_path):
    """Through ingest: a record is kept before the last file is requested; a stop mid-stream deletes the files the
    checkpoint passed, and the resume fetches only files from the checkpoint's on, to identical outputs."""
    import asyncio

    from helpers import base_config, ingest_stopped_after, tree_hashes
    from streamprep.config import load
    from streamprep.ingest import IngestContext, ingest_all

    raw = base_config([{"name": "many", "path": f"hf://{MANY_REPO}", "split": "train"}], None,
                      output={"shard_records": 100})
    raw["execution"].update(batch_records=20, workers=1, hf_prefetch_files=1, max_concurrent_downloads=2)
    conf = load(raw)

    ref = tmp_path / "ref"
    ctx = IngestContext.of(conf, ref, ref / "checkpoints", asyncio.Event())
    task = asyncio.create_task(ingest_all(ctx))
    while "many" not in ctx.progress or ctx.progress["many"].kept == 0:
        await asyncio.sleep(0.002)
    assert MANY_FILES[-1] not in _data_gets(many), "a record was kept only after the last file was requested"
    assert len(_data_gets(many)) <= 3  # hf_prefetch_files 1: two units handed out, + 1 once the first is committed
    assert (await task)["many"].kept == 480

    run = tmp_path / "run"
    many.reset_counts()
    stopped = await ingest_stopped_after(conf, run, "many", 200)
    assert not stopped.done
    at = stopped.position["file"]
    snap = run / f"cache/hf/datasets--org--many/snapshots/{many.sha_of(MANY_REPO)}/data"
    assert all(not (snap / p.rsplit('/', 1)[1]).exists() for p in MANY_FILES[:at]), "passed files not deleted"
    before = _data_gets(many)
    many.reset_counts()
    resumed = (await ingest_all(IngestContext.of(conf, run, run / "checkpoints", asyncio.Event())))["many"]
    assert resumed.done and resumed.kept == 480
    again = _data_gets(many)
    assert again == set(MANY_FILES[at:]) - before, (at, sorted(before), sorted(again))
    assert tree_hashes(run, "ingest", "rejects") == tree_hashes(ref, "ingest", "rejects")


def test_a_download_failing_mid_stream_stops_at_that_file(many, tmp_path):
    src = HFSource(_many_cfg(), tmp_path / "cache", prefetch_files=1)
    src.fingerprint()  # resolved while the file exists
    del many.repos[MANY_REPO].commits[many.sha_of(MANY_REPO)][MANY_FILES[3]]
    got = []
    with pytest.raises(HFSourceUnavailable, match="download of data/train-00003.jsonl failed"):
        for rec, _ in src.iter_records():
            got.append(rec["id"])
    assert got == list(range(120))  # files 0-2 streamed before the failure surfaced


GONE = (r"^dataset many: hf://org/many: commit {sha}, which this run started on, is no longer on the Hub \(a "
        r"force-push or squash removed it\); resuming would mix two versions of the data — restore the commit, or "
        r"start over with a new --run-dir$")


def _squash(hub, repo: str) -> str:
    """A force-push that drops the branch's commit (a new commit on main, the old one gone); the old sha."""
    old = hub.sha_of(repo)
    hub.add_dataset(repo, {**hub.repos[repo].commits[old], "data/train-99999.jsonl": jsonl(_many_rows(99))})
    del hub.repos[repo].commits[old]
    return old


async def test_a_resume_whose_pinned_commit_is_gone_is_a_config_error_saying_what_to_do(many, tmp_path):
    """Regression: a resume whose pinned commit had been removed from the Hub (force-push, super-squash) failed at its
    first file not cached with `HFSourceUnavailable: … (RevisionNotFoundError: 404 Client Error.)`, exit 1, "re-run to
    resume", which never could. When the Hub says so of the commit itself, it is one line naming the dataset and the
    commit, exit 2 (a ConfigError), saying what to do, as for a changed local input."""
    import asyncio

    from helpers import base_config, ingest_stopped_after
    from streamprep.config import load
    from streamprep.ingest import IngestContext, ingest_all

    raw = base_config([{"name": "many", "path": f"hf://{MANY_REPO}", "split": "train"}], None,
                      output={"shard_records": 100})
    raw["execution"].update(batch_records=20, workers=1, hf_prefetch_files=1)
    conf = load(raw)
    run = tmp_path / "run"
    stopped = await ingest_stopped_after(conf, run, "many", 120)
    assert not stopped.done
    old = _squash(many, MANY_REPO)
    with pytest.raises(HFSourceError, match=GONE.format(sha=old)) as err:
        await ingest_all(IngestContext.of(conf, run, run / "checkpoints", asyncio.Event()))
    assert isinstance(err.value, ConfigError)  # the CLI's exit 2
    assert json.loads((run / "checkpoints" / "many.json").read_text())["consumed"] >= stopped.consumed


def test_a_plan_whose_commit_the_hub_no_longer_has_is_an_error_naming_the_dataset(many, tmp_path):
    """Regression: 86f3081 named the dataset in what the Hub's answer shows wrong only when the branch was resolved;
    the reader of a saved plan (a resume) and a stream pinned to a commit resolved that commit without it, so of two
    entries reading one repo the line did not say which."""
    plan = HFSource(_many_cfg(), tmp_path / "cache").units()
    old = _squash(many, MANY_REPO)
    with pytest.raises(HFSourceError) as err:
        HFSource(_many_cfg(), tmp_path / "other-cache").reader(plan)  # no saved manifest: the Hub is asked
    assert str(err.value) == f"dataset corpus: hf://{MANY_REPO}: revision '{old}' not found"


def test_a_stream_whose_commit_goes_stops_with_the_same_line_but_a_lone_404_stays_resumable(many, tmp_path):
    """The single-stream reader says the same; a "revision not found" for a file while the Hub still has the commit
    (a hiccup: asked again, the commit is there) stays the resumable `HFSourceUnavailable`."""
    src = HFSource(_many_cfg(), tmp_path / "cache", prefetch_files=1)
    sha = src.fingerprint()["revision"]
    many.api_faults = ["404-revision"]  # the first file's HEAD
    with pytest.raises(HFSourceUnavailable, match=rf"^hf://org/many@{sha}: download of data/train-00000.jsonl failed "
                                                  r"\(RevisionNotFoundError: "):
        next(src.iter_records())
    assert many.faults_served["404-revision"] == 1
    got = []
    with pytest.raises(HFSourceError, match=GONE.format(sha=sha).replace("dataset many", "dataset corpus")):
        for rec, _ in src.iter_records():
            got.append(rec["id"])
            if len(got) == 40:
                _squash(many, MANY_REPO)
    assert got == list(range(40))  # file 0's records; file 1, downloaded when the stream reaches it, is gone


# ---- a Hub that pushes back: 429 / 5xx / resets ------------------------------------------------------------------
@pytest.fixture
def quick_retries():
    """Short waits in tests: Retry-After 1 s, at most 1.5 s a wait, 4 retries."""
    from streamprep.sources import hf

    old = (hf._POLICY.retries, hf._POLICY.max_s)
    hf.set_retry_policy(4, 1.5)
    yield hf._POLICY
    hf.set_retry_policy(*old)


@pytest.mark.slow
def test_429_503_and_resets_on_a_cycle_of_downloads(many, tmp_path, quick_retries, monkeypatch):
    """Every data GET in turn is refused (429 + Retry-After, then 503) or cut mid-body: the stream is the same
    and each file is resumed from where it was cut, not fetched again from byte 0."""
    from streamprep.sources import hub_http

    logged: list[dict] = []
    real_warning = hub_http.log.warning
    monkeypatch.setattr(hub_http, "log", type("Spy", (), {  # whatever the logging setup, see what is logged
        "warning": staticmethod(lambda event, **kw: (logged.append({"event": event, **kw}), real_warning(event, **kw))),
        "info": staticmethod(hub_http.log.info), "debug": staticmethod(hub_http.log.debug)})())
    healthy = [rec["id"] for rec, _ in HFSource(_many_cfg(), tmp_path / "healthy").iter_records()]
    many.reset_counts()
    many.rate = 0
    many.fault_cycle = ["429", None, "503", None, "reset", None]
    src = HFSource(_many_cfg(), tmp_path / "cache", max_concurrent_downloads=3, keep_cache=True)
    assert [rec["id"] for rec, _ in src.iter_records()] == healthy == list(range(480))
    snap = tmp_path / f"cache/datasets--org--many/snapshots/{many.sha_of(MANY_REPO)}"
    assert [(snap / p).read_bytes() for p in MANY_FILES] == [jsonl(_many_rows(f)) for f in range(12)]
    served = many.faults_served
    assert served["429"] >= 2 and served["503"] >= 2 and served["reset"] >= 2, served
    # each reset was resumed at the byte it stopped at: the stand-in cuts a body half-way, so a file cut
    # again after a resume stops half-way through the rest
    sizes = {p: len(jsonl(_many_rows(f))) for f, p in enumerate(MANY_FILES)}
    assert len(many.ranges) == served["reset"]
    stopped: dict[str, int] = {}
    for path, start in many.ranges:
        before = stopped.get(path, 0)
        assert start == before + (sizes[path] - before) // 2, many.ranges
        stopped[path] = start
    stats = src.stats.snapshot()
    assert stats["retries"] == {"429": served["429"], "503": served["503"], "reset": served["reset"]}
    assert stats["gave_up"] == 0 and stats["files"] == 12 and stats["bytes"] == sum(sizes.values())
    # counted by cause in the log too, and persisted for `streamprep status`
    retried = [e["cause"] for e in logged if e["event"] == "hub request retried"]
    assert {c: retried.count(c) for c in set(retried)} == dict(served)
    assert json.loads((tmp_path / "cache/streamprep/hub_stats.json").read_text()) == stats


def test_a_file_that_changed_between_a_cut_and_its_resume_is_never_spliced(hub, tmp_path, quick_retries):
    """Regression: a body cut mid-transfer whose resume (`Range` + `If-Range`) was answered 200 with the whole new
    version of the file (a mirror's file changed meanwhile) had its first bytes skipped and the rest appended to the
    old ones: half old, half new, the same size, no error. The download fails, one resumable line naming the file
    and both ETags, with nothing left in the cache; a re-run reads the new version whole."""
    path = "data/train-00000.jsonl"
    old = jsonl([{"id": i, "text": f"old {i:04d}"} for i in range(2000)])
    sha = hub.add_dataset("org/edited", {path: old})
    hub.edits = {path: old.replace(b"old", b"NEW")}  # the same size: only the ETag tells the versions apart
    hub.fault_cycle = ["reset-edit", None]
    quick_retries.max_s = 0.05
    src = HFSource(cfg(path="hf://org/edited"), tmp_path / "cache")
    etags = [f'"{git_blob_sha(old)}"', f'"{git_blob_sha(hub.edits[path])}"']
    with pytest.raises(HFSourceUnavailable) as err:
        records(src.iter_records())
    assert re.fullmatch(rf"hf://org/edited@{sha}: download of {path} failed \(HubFileChanged: GET /datasets/org/"
                        rf"edited/resolve/{sha}/{path}: the file changed between a cut at byte [1-9]\d* and its resume "
                        rf"\(ETag {etags[0]}, then {etags[1]}\); re-run to download it whole\)", str(err.value)), err.value
    assert hub.faults_served == {"reset-edit": 1} and hub.file_requests("GET")[path] == 2
    assert [p.name for p in (tmp_path / "cache").glob("datasets--org--edited/**/*") if p.is_file()] == []
    assert src.stats.snapshot()["gave_up"] == 0 and src.stats.snapshot()["files"] == 0
    hub.fault_cycle = []
    assert [rec["text"] for rec in records(src.iter_records())] == [f"NEW {i:04d}" for i in range(2000)]


@pytest.mark.slow
def test_api_retries_honour_retry_after_as_seconds_or_date(hub, tmp_path, quick_retries, monkeypatch):
    from email.utils import formatdate

    from streamprep.sources import hf

    waits: list[tuple[int, float | None]] = []
    real = hf.RetryPolicy.wait

    def spy(self, attempt, retry_after):
        waits.append((attempt, retry_after))
        return real(self, attempt, retry_after)

    monkeypatch.setattr(hf.RetryPolicy, "wait", spy)
    hub.retry_after = formatdate(__import__("time").time() + 4, usegmt=True)  # an HTTP date, ~4 s ahead
    hub.api_faults = ["503", "429"]
    src = HFSource(cfg(), tmp_path / "cache")
    assert src.fingerprint()["revision"] == hub.sha
    assert [a for a, _ in waits] == [1, 2]
    assert waits[0][1] is None and 1 < waits[1][1] <= 4.01  # the date, read as seconds from now (waited 1.5 s: the cap)
    assert src.stats.snapshot()["retries"] == {"429": 1, "503": 1}
    assert records(src.iter_records()) == TRAIN


def test_backoff_is_jittered_bounded_and_honours_retry_after():
    from streamprep.sources.hf import RetryPolicy

    p = RetryPolicy(retries=8, max_s=5.0)
    waits = [p.wait(3, None) for _ in range(200)]
    assert all(0 <= w <= 4.0 for w in waits) and len({round(w, 3) for w in waits}) > 150  # full jitter over 4 s
    assert all(2.0 <= p.wait(1, 2.0) <= 3.0 for _ in range(50))
    assert all(p.wait(k, 30.0) == 5.0 for k in (1, 5))  # capped by hf_retry_max_s


def test_retries_run_out_with_a_one_line_resumable_error(many, tmp_path, quick_retries):
    quick_retries.retries, quick_retries.max_s = 1, 0.05
    src = HFSource(_many_cfg(), tmp_path / "cache", prefetch_files=1)
    src.fingerprint()
    many.fault_cycle = ["503"]
    with pytest.raises(HFSourceUnavailable, match=r"download of data/train-00000.jsonl failed "
                                                  r"\(HubRetriesExhausted: GET /datasets/org/many/resolve/.*: "
                                                  r"HTTP 503 after 1 retries\)") as err:
        next(src.iter_records())
    assert "\n" not in str(err.value)
    assert src.stats.snapshot()["gave_up"] >= 1
    many.fault_cycle = []
    many.api_faults = ["503", "503"]  # resolution: nothing cached for this split, so the Hub must answer
    with pytest.raises(HFSourceUnavailable, match=r"the Hub answered HTTP 503 and no cached copy .*HTTP 503 after 1 "
                                                  r"retries"):
        HFSource(cfg(split="validation"), tmp_path / "cache").fingerprint()


def test_a_hub_that_answers_only_429_is_not_called_unreachable(hub, tmp_path, quick_retries):
    """Regression: a revision lookup answered 429 (or 5xx) after every retry said "Hub unreachable and no cached copy"
    (or logged "Hub unreachable; using the cached revision"): the Hub was reached and pushed back, so its status is
    named; a Hub not reached at all is still "unreachable"."""
    from structlog.testing import capture_logs

    quick_retries.retries, quick_retries.max_s = 1, 0.05
    hub.api_faults = ["429"] * 2
    with pytest.raises(HFSourceUnavailable) as err:
        HFSource(cfg(), tmp_path / "cache").fingerprint()
    assert str(err.value) == (f"hf://{REPO}@main: the Hub answered HTTP 429 and no cached copy of this revision "
                              f"(HubRetriesExhausted: GET /api/datasets/{REPO}/revision/main: HTTP 429 after 1 retries)")
    sha = HFSource(cfg(), tmp_path / "cache").fingerprint()["revision"]  # now cached
    hub.api_faults = ["503"] * 2
    with capture_logs() as logged:
        assert HFSource(cfg(), tmp_path / "cache").fingerprint()["revision"] == sha
    hub.stop()
    with capture_logs() as logged_down:
        assert HFSource(cfg(), tmp_path / "cache").fingerprint()["revision"] == sha
    assert [(e["event"], e["error"][-24:]) for e in logged if "cached revision" in e["event"]] == [
        ("the Hub answered an error; using the cached revision", "HTTP 503 after 1 retries")]
    assert [e["event"] for e in logged_down if "cached revision" in e["event"]] == [
        "Hub unreachable; using the cached revision"]


@pytest.mark.slow
@pytest.mark.parametrize("asked", ["the revision", "whether the commit is gone"])
def test_a_hub_api_call_that_stalls_is_retried_not_waited_on_forever(many, tmp_path, quick_retries, monkeypatch,
                                                                      asked):
    """Regression: the revision lookup and the question whether a run's commit is gone (`dataset_info`) had no
    timeout: a Hub that took the request and never answered hung the job for good, with no retry. They time out
    after HF_HUB_DOWNLOAD_TIMEOUT as a file's GET does, so the stall is retried (and counted) like one."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DOWNLOAD_TIMEOUT", 1)
    quick_retries.max_s = 0.05
    src = HFSource(_many_cfg(), tmp_path / "cache", prefetch_files=1)
    if asked == "the revision":
        many.api_faults = ["hang"]
        call: Any = src.fingerprint
    else:
        sha = src.fingerprint()["revision"]
        many.api_faults = ["404-revision", "hang"]  # the first file's HEAD, then the question about its commit
        call = lambda: next(src.iter_records())  # noqa: E731
    out: dict[str, Any] = {}

    def ask() -> None:
        try:
            out["value"] = call()
        except Exception as exc:
            out["error"] = exc

    asking = threading.Thread(target=ask, daemon=True)  # the hub fixture's stop() ends a hang the old code waited on
    asking.start()
    asking.join(15)
    assert not asking.is_alive(), "a stalled Hub API call was still waited on after 15 s"
    assert many.faults_served["hang"] == 1 and src.stats.snapshot()["retries"] == {"timeout": 1}
    if asked == "the revision":
        assert out["value"]["revision"] == many.sha_of(MANY_REPO)
    else:  # answered on the retry: the commit is there, so a resumable failure, not "the commit is gone"
        assert isinstance(out.get("error"), HFSourceUnavailable), out
        assert str(out["error"]).startswith(f"hf://org/many@{sha}: download of data/train-00000.jsonl failed "
                                            f"(RevisionNotFoundError: ")


def test_a_download_ahead_that_runs_out_of_retries_is_not_given_up_when_its_reader_gets_the_file(many, tmp_path,
                                                                                                 quick_retries):
    """Regression: a 503 on a file fetched ahead of its reader gave up the prefetch, the reader downloaded the file and
    the run completed, yet `gave_up` (`streamprep_hub_retries_exhausted_total`, "the run then stops") counted 1: an
    alert on it fired on a healthy run. Only a request whose failure reaches the run counts."""
    from streamprep.sources.hf import hub_stats

    quick_retries.retries = 0
    src = HFSource(_many_cfg(), tmp_path / "cache")
    units = src.units()
    reader = src.reader(units)
    many.fault_cycle = ["503", None]  # the download ahead is refused, the reader's is served
    assert reader.prefetch(units[1:2])[0].result() is None  # only logged
    assert [rec["id"] for rec in reader.read(units[1])] == list(range(40, 80))
    assert many.faults_served == {"503": 1}
    assert hub_stats(tmp_path / "cache").snapshot() == {"retries": {}, "gave_up": 0, "files": 1,
                                                        "bytes": len(jsonl(_many_rows(1)))}
    many.fault_cycle = ["503"]  # the reader's own download running out still counts
    with pytest.raises(HFSourceUnavailable, match="HTTP 503 after 0 retries"):
        reader.read(units[2])
    assert hub_stats(tmp_path / "cache").snapshot()["gave_up"] == 1


TOKEN = "hf_SeNtInElToKeN0123456789abcdefXYZ"


def _pipeline_config(rows_repo: str) -> dict:
    from helpers import base_config

    raw = base_config([{"name": "web", "path": f"hf://{rows_repo}", "split": "train"}], None,
                      output={"shard_records": 100})
    raw["execution"].update(batch_records=25, workers=1, hf_retries=4, hf_retry_max_s=1.5,
                            max_concurrent_downloads=2)
    return raw


@pytest.mark.slow
def test_job_on_a_hub_that_pushes_back_gives_identical_tokens_and_never_writes_the_token(hub, tmp_path, monkeypatch,
                                                                                        capfd):
    from helpers import tree_hashes
    from streamprep import run_from_dict
    from streamprep.status import run_status

    hub.add_dataset(WEB_REPO, {f"data/train-{f:05d}.jsonl": jsonl(_web_rows(f)) for f in range(4)})
    raw = _pipeline_config(WEB_REPO)
    assert run_from_dict(raw, tmp_path / "healthy", console_log=True).status == "complete"
    assert hub.authorizations == set()

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.reset_counts()
    hub.fault_cycle = ["429", None, "reset", None, "503", None]
    hub.api_faults = ["503"]  # the revision lookup, once
    import streamprep.audit as audit
    from helpers import port_of, scrape

    scraped: dict = {}
    real_audit = audit.write_audit
    monkeypatch.setattr(audit, "write_audit", lambda rd, **kw: (scraped.update(scrape(port_of(rd))),
                                                                real_audit(rd, **kw))[1])
    raw["execution"]["metrics_port"] = 0
    assert run_from_dict(raw, tmp_path / "pushback", console_log=True).status == "complete"
    assert hub.faults_served["429"] and hub.faults_served["503"] >= 2 and hub.faults_served["reset"]
    assert hub.authorizations == {f"Bearer {TOKEN}"}  # the token was used...
    for sub in ("binidx", "ingest", "receipts"):
        assert tree_hashes(tmp_path / "pushback", sub) == tree_hashes(tmp_path / "healthy", sub), sub
    st = run_status(tmp_path / "pushback")
    assert st["hub"]["retries"] == {k: v for k, v in sorted(hub.faults_served.items())}
    assert {dict(lab)["cause"]: v for (n, lab), v in scraped.items() if n == "streamprep_hub_retries_total"} == \
        st["hub"]["retries"]  # the metrics endpoint serves the same counts, by cause
    assert scraped[("streamprep_hub_downloaded_bytes_total", ())] == st["hub"]["bytes"] > 0
    # ...and never written: not in any file of the run dir, the captured output or the log records
    out, err = capfd.readouterr()
    secret = TOKEN.encode()
    leaks = [str(p) for p in (tmp_path / "pushback").rglob("*") if p.is_file() and secret in p.read_bytes()]
    assert leaks == [] and TOKEN not in out + err
    assert "hub request retried" in (tmp_path / "pushback/logs/streamprep.log").read_text()


# ---- ingest: the snapshot's files are units, downloaded by the workers within the driver's window ---------------
class _Stream:
    """The earlier hf:// path, kept in ingest for sources without a file list: the driver reads the dataset as one
    `stream` unit (HFSource.iter_records, in QC calls of batches). The reference the per-file units must equal."""

    def __init__(self, src: HFSource):
        self.src = src

    def fingerprint(self) -> dict:
        return self.src.fingerprint()

    def iter_records(self, start=None):
        return self.src.iter_records(start)


MIXED_REPO = "org/mixed"


def _mixed_corpus() -> dict[str, bytes]:
    """Five files: a duplicate across files, records the filter drops, a file pyarrow cannot parse (one reject for
    its rest), a record that fails QC (too short)."""
    from helpers import english_docs

    docs = english_docs(900, seed=11)
    rows = [[{"text": t, "lang": "en" if i % 7 else "fr", "id": f"{f}-{i}"} for i, t in enumerate(docs[f * 180:(f + 1) * 180])]
            for f in range(5)]
    rows[3][5] = dict(rows[0][9], id="dup")  # an exact duplicate of an earlier file's record
    rows[1][2] = {"text": "short", "lang": "en", "id": "short"}
    files = {f"data/train-{f:05d}.jsonl": jsonl(r) for f, r in enumerate(rows)}
    files["data/train-00002.jsonl"] = jsonl(rows[2][:50]) + b'{"text": broken\n' + jsonl(rows[2][50:])
    return files


def _ingest_config(repo: str, **execution) -> dict:
    from helpers import base_config

    raw = base_config([{"name": "web", "path": f"hf://{repo}", "split": "train", "filter": {"lang": "en"}}], None,
                      output={"shard_records": 100})
    raw["execution"].update(batch_records=25, **execution)
    return raw


def _ingest(raw: dict, run) -> dict:
    import asyncio

    from streamprep.config import load
    from streamprep.ingest import IngestContext, ingest_all

    async def go():
        return await ingest_all(IngestContext.of(load(raw), run, run / "checkpoints", asyncio.Event()))

    st = asyncio.run(go())["web"]
    assert st.done
    st.stats.pop("gate_us", None)  # time spent in each gate
    return {k: v for k, v in st.to_json().items() if k not in ("inputs", "position", "open_pieces", "started_at", "updated_at")}


def _blobs(cache) -> set[tuple[int, int]]:
    """The distinct data files in an HF cache: blobs (complete or being written) and the readers' own hard links
    to them (one inode each)."""
    out = set()
    for p in [*cache.glob("datasets--*/blobs/*"), *cache.glob("streamprep/reading/*/*")]:
        if p.name.startswith("tmp_"):  # huggingface_hub's empty probe of whether symlinks work here
            continue
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.add((st.st_dev, st.st_ino))
    return out


def _stream_then_units(hub, tmp_path, monkeypatch, repo: str, raw: dict, files: int) -> dict:
    """Ingest `raw` the earlier way (one stream unit), then as one unit per file with 1 and 2 workers: the same
    counters, checkpointed stats, parts and rejects; each file downloaded at most once and deleted after. Returns
    the stream's state."""
    from helpers import tree_hashes
    from streamprep import ingest

    real_open = ingest.open_source
    with monkeypatch.context() as m:
        m.setattr(ingest, "open_source", lambda *a, **k: _Stream(real_open(*a, **k)))
        want = _ingest(raw, tmp_path / "stream")
    assert (json.loads((tmp_path / "stream/checkpoints/web.plan.json").read_text())
            == [{"kind": "stream", "file": -1, "path": "", "fmt": "", "start": 0, "end": 0}])
    for workers in (1, 2):
        hub.reset_counts()
        run = tmp_path / f"units{workers}"
        raw["execution"]["workers"] = workers
        got = _ingest(raw, run)
        assert {k: v for k, v in got["stats"].items() if got["stats"][k] != want["stats"].get(k)} == {}, workers
        assert got == want, workers
        assert tree_hashes(run, "ingest", "rejects") == tree_hashes(tmp_path / "stream", "ingest", "rejects")
        plan = json.loads((run / "checkpoints/web.plan.json").read_text())
        assert [(u["kind"], u["path"]) for u in plan] == \
            [("hf", f"hf://datasets/{repo}@{hub.sha_of(repo)}/data/train-{f:05d}.jsonl") for f in range(files)]
        gets = hub.file_requests("GET")
        assert set(gets.values()) == {1}, gets
        assert _blobs(run / "cache/hf") == set(), "downloaded files left in the cache"
        # regression: two empty lock files a file were left (huggingface_hub's per blob, datasets' per builder)
        assert sorted(run.glob("cache/hf/**/*.lock")) == [], "lock files left in the cache"
    return want


@pytest.mark.slow
@pytest.mark.parametrize("cap", [None, {"max_records": 500}, {"size_mb": 0.1}], ids=["all", "max_records", "size_mb"])
def test_file_units_write_the_stream_paths_bytes(hub, tmp_path, monkeypatch, cap):
    """Parts, rejects, counters and checkpointed stats of an hf:// dataset read as one unit per file, by 1 or 2
    workers, equal the driver-read stream's, with and without a cap."""
    hub.add_dataset(MIXED_REPO, _mixed_corpus())
    raw = _ingest_config(MIXED_REPO, workers=1)
    raw["datasets"][0].update(cap or {})
    want = _stream_then_units(hub, tmp_path, monkeypatch, MIXED_REPO, raw, 5)
    if cap is None:
        assert want["consumed"] == 4 * 154 + 1  # 154 "en" rows a file; file 2 is one reject (pyarrow fails its block)
        assert want["rejected"] == 3  # the short record, the duplicate, the unreadable rest of file 2
        assert set(hub.file_requests("GET")) >= {f"data/train-{f:05d}.jsonl" for f in range(5)}


@pytest.mark.slow
def test_a_size_cap_counts_the_gates_of_the_streams_last_batch_into_the_next_files(hub, tmp_path, monkeypatch):
    """Files of 10 records, batches of 25: `size_mb` stops at record 33, in the stream's batch [25, 50), whose
    gate counters (QC judged all of it) reach into files 3 and 4; the units' counters are the same."""
    from helpers import english_docs

    docs = english_docs(80, seed=5)
    hub.add_dataset("org/tiny", {f"data/train-{f:05d}.jsonl": jsonl([{"text": t} for t in docs[f * 10:(f + 1) * 10]])
                                 for f in range(8)})
    raw = _ingest_config("org/tiny", workers=1)
    raw["datasets"][0].pop("filter")
    raw["datasets"][0]["size_mb"] = sum(len(t.encode()) for t in docs[:33]) / (1 << 20)
    want = _stream_then_units(hub, tmp_path, monkeypatch, "org/tiny", raw, 8)
    assert want["consumed"] == 33 and want["stats"]["gate_seen"]["normalize"] == 50


@pytest.mark.slow
def test_an_empty_file_unit_is_a_counted_reject_and_the_job_goes_on(hub, tmp_path, monkeypatch):
    """An empty data file read as a unit by 1 or 2 workers is one "empty file" reject, the same as in the stream
    (counters, parts, rejects: the same bytes); a file the filter empties is no reject. Without the fix the worker
    raised "generator raised StopIteration" and the job stopped."""
    from helpers import english_docs

    docs = english_docs(60, seed=3)
    hub.add_dataset("org/holes", {
        "data/train-00000.jsonl": jsonl([{"text": t, "lang": "en"} for t in docs[:30]]),
        "data/train-00001.jsonl": b"",
        "data/train-00002.jsonl": jsonl([{"text": "Ceci est un document", "lang": "fr"}]),
        "data/train-00003.jsonl": jsonl([{"text": t, "lang": "en"} for t in docs[30:]])})
    raw = _ingest_config("org/holes", workers=1)
    want = _stream_then_units(hub, tmp_path, monkeypatch, "org/holes", raw, 4)
    assert (want["consumed"], want["kept"], want["rejected"]) == (61, 60, 1)
    for run in ("stream", "units1", "units2"):
        lines = [json.loads(x) for p in sorted((tmp_path / run / "rejects").rglob("*.jsonl")) for x in p.read_text().splitlines()]
        assert [(r["failed_check"], r["reason"], r["source"]["index"]) for r in lines] == \
            [("parse", "empty file data/train-00001.jsonl", 30)], run


def _two_datasets(datasets: list[dict], run, **execution) -> dict:
    import asyncio

    from helpers import base_config
    from streamprep.config import load
    from streamprep.ingest import IngestContext, ingest_all

    raw = base_config(datasets, None, output={"shard_records": 100})
    raw["execution"].update(batch_records=25, workers=2, hf_prefetch_files=1, **execution)

    async def go():
        return await ingest_all(IngestContext.of(load(raw), run, run / "checkpoints", asyncio.Event()))

    return {n: (st.done, st.consumed, st.kept, st.rejected) for n, st in asyncio.run(go()).items()}


@pytest.mark.slow
def test_two_datasets_on_one_repo_share_its_cache(hub, tmp_path):
    """Two datasets of one config read the same split with other filters, a third the same repo's other split, at
    once: each writes the bytes it writes alone. They used to resolve the repo at the same time and write its
    manifest through the same temp file (FileNotFoundError on the rename: the job stopped), and one dataset's
    window deleted the files another was about to read ("deleted while being fetched", or a file read as an
    "unreadable" reject when its reader's link was removed)."""
    from helpers import tree_hashes

    hub.add_dataset(WEB_REPO, {**{f"data/train-{f:05d}.jsonl": jsonl(_web_rows(f)) for f in range(6)},
                               "data/validation-00000.jsonl": jsonl(_web_rows(9))})
    hub.rate = 2_000_000
    entries = [{"name": "en", "path": f"hf://{WEB_REPO}", "split": "train", "filter": {"lang": "en"}},
               {"name": "fr", "path": f"hf://{WEB_REPO}", "split": "train", "filter": {"lang": "fr"}},
               {"name": "val", "path": f"hf://{WEB_REPO}", "split": "validation"}]
    assert _two_datasets(entries, tmp_path / "all") == \
        {"en": (True, 1440, 1440, 0), "fr": (True, 360, 360, 0), "val": (True, 300, 300, 0)}
    for e in entries:
        assert _two_datasets([e], tmp_path / e["name"])[e["name"]][0]
        got = tree_hashes(tmp_path / "all", f"ingest/{e['name']}", f"rejects/{e['name']}")
        assert got and got == tree_hashes(tmp_path / e["name"], f"ingest/{e['name']}", f"rejects/{e['name']}"), e
    assert _blobs(tmp_path / "all/cache/hf") == set(), "downloaded files left in the cache"
    assert sorted(p.name for p in (tmp_path / "all/cache/hf/streamprep").rglob("*.json") if p.parent.name == "_default") \
        == ["train.json", "validation.json"]


@pytest.mark.parametrize("keep", [False, True], ids=["evict", "keep_cache"])
def test_a_resume_deletes_the_files_a_killed_job_left_of_a_done_dataset(many, tmp_path, keep):
    """Regression: a done dataset's files go at the end of the job that finished it, so a job killed after that while
    another dataset still read (e.g. with the files a capped dataset fetched past its cap) left them in the cache,
    and no later job deleted them (a done dataset opens no download window): they stayed after "run complete". The
    next job deletes them when it starts, as it does a resumed dataset's passed files; `hf_keep_cache` keeps them."""
    from streamprep.sources.hf import download, hub_stats

    many.rate = 0
    entry = {"name": "capped", "path": f"hf://{MANY_REPO}", "split": "train", "max_records": 50}
    run, cache = tmp_path / "run", tmp_path / "run/cache/hf"
    ex = {"hf_keep_cache": keep}
    assert _two_datasets([entry], run, **ex)["capped"][:2] == (True, 50)
    sha = many.sha_of(MANY_REPO)
    for p in MANY_FILES[:3]:  # what the killed job had downloaded
        download("capped", MANY_REPO, p, sha, cache, many.url, 2, hub_stats(cache))
    left = _blobs(cache)
    assert len(left) == 3
    many.reset_counts()
    assert _two_datasets([entry], run, **ex)["capped"][:2] == (True, 50)
    assert _blobs(cache) == (left if keep else set())
    assert not _data_gets(many)  # a done dataset downloads nothing


def test_a_units_call_ends_only_after_the_downloads_it_started_ahead(tmp_path):
    """Regression (a blob left in the cache after a job, seen once in CI): a worker's prefetch of a later unit ran
    in a thread after its call had returned and could finish after that unit's file was evicted. The call now waits
    for it, so a unit's eviction, which follows the results of the units before it, follows its prefetch."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from quality import validate_quality_config
    from streamprep.modes import PRETRAIN
    from streamprep.sources.base import Unit
    from streamprep.unit_worker import KEPT, init_worker, judge_piece

    landed, pool = threading.Event(), ThreadPoolExecutor(1)

    class Reader:  # an hf.FileReader whose download ahead is slower than the unit's own read and judging
        def prefetch(self, units):
            return [pool.submit(lambda: (time.sleep(0.5), landed.set())) for _ in units]

        def read(self, unit):
            return [{"text": "A plain English sentence that is long enough to keep."}]

    init_worker(validate_quality_config({"min_chars": 20}), PRETRAIN)
    ahead = (Unit("hf", 1, "hf://datasets/o/r@abc/b.jsonl", "json"),)
    summary = judge_piece("d", "text", 8, str(tmp_path / "p"), Unit("hf", 0, "hf://datasets/o/r@abc/a.jsonl", "json"),
                          options=Reader(), ahead=ahead)
    assert landed.is_set() and summary.kinds == bytes([KEPT])
    pool.shutdown()


def test_a_window_keeps_the_files_another_dataset_holds(many, tmp_path):
    """Two datasets' windows on one cache: a checkpoint of one deletes only the files the other does not hold."""
    from streamprep.sources.hf import DownloadWindow

    cache = tmp_path / "cache"
    a, b = (HFSource(_many_cfg(name=n), cache) for n in ("a", "b"))
    plan = a.units()
    for u in plan[:3]:
        a._download_one((_unit_file(u), many.sha_of(MANY_REPO)))
    wa, wb = DownloadWindow(a, plan), DownloadWindow(b, plan)
    try:
        for u in (0, 1, 2):
            wa.take(u)
        wb.take(1)
        wa.evictor(3)()
        wa.release(3)
        on_disk = lambda: [(p.is_symlink(), p.exists()) for p in map(wa._local, plan[:3])]  # noqa: E731
        assert on_disk() == [(False, False), (True, True), (False, False)]  # file 1: b holds it
        wb.evictor(2)()
        wb.release(2)
        assert on_disk() == [(False, False)] * 3 and _blobs(cache) == set()
    finally:
        wa.close()
        wb.close()


def test_two_windows_passing_one_file_at_once_delete_it(many, tmp_path):
    """Regression: two datasets reading one file (the same split, other filters) whose checkpoints passed it at about
    the same time each ran its deleting before the other let go of it (`release` follows the deleting, on the event
    loop): each saw the other hold the file, and it stayed in the cache after the job, in some runs and not in others.
    A window's deleting lets go of its files under the lock the other's deciding takes."""
    from streamprep.sources.hf import DownloadWindow

    cache = tmp_path / "cache"
    a, b = (HFSource(_many_cfg(name=n), cache) for n in ("a", "b"))
    plan = a.units()
    a._download_one((_unit_file(plan[0]), many.sha_of(MANY_REPO)))
    wa, wb = DownloadWindow(a, plan), DownloadWindow(b, plan)
    try:
        wa.take(0)
        wb.take(0)
        evict_a, evict_b = wa.evictor(1), wb.evictor(1)
        evict_a()
        evict_b()
        wa.release(1)
        wb.release(1)
        assert not wa._local(plan[0]).is_symlink() and _blobs(cache) == set()
    finally:
        wa.close()
        wb.close()


def test_a_window_read_while_its_deleting_lets_go_of_units_in_a_thread(tmp_path):
    """Regression: since the deleting (a thread: `ingest.release_files`) let go of the units itself, the event loop's
    `fits`/`fits_ahead` iterated `held` unlocked while it shrank: `RuntimeError: dictionary changed size during
    iteration` ended the job with a traceback (here within ~130 rounds, with a tiny switch interval)."""
    import sys
    import time
    from types import SimpleNamespace

    from streamprep.sources.base import Unit
    from streamprep.sources.hf import DownloadWindow, unit_path

    n = 64
    plan = [Unit("hf", i, unit_path("org/x", "a" * 40, f"f{i}.jsonl"), "json", 0, 10) for i in range(n)]
    src = SimpleNamespace(repo_id="org/x", cache_dir=tmp_path, name="web", prefetch_files=n, cache_max_bytes=10 ** 9,
                          keep_cache=False)
    window, errors, stop = DownloadWindow(src, plan), [], threading.Event()

    def event_loop_side() -> None:
        while not stop.is_set():
            try:
                window.fits(n - 1)
                window.fits_ahead(0, n - 1)
            except RuntimeError as exc:
                errors.append(repr(exc))
                stop.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the interleaving, likely within a short run
    reader = threading.Thread(target=event_loop_side)
    reader.start()
    try:
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and not stop.is_set():
            for u in range(n):
                window.take(u)
            window._delete([], [], n)  # what evictor()'s call runs in the thread (nothing on disk here)
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(interval)
        window.close()
    assert errors == []


def _unit_file(unit) -> str:
    return unit.path.rsplit("@", 1)[1].split("/", 1)[1]


_WATCHER = """
import os, stat, sys, time
cache, out = sys.argv[1], sys.argv[2]
def listdir(d):  # a folder can go between any two looks: the run removes its readers' folders as it goes
    try:
        return os.listdir(d)
    except FileNotFoundError:
        return []
def files():  # distinct inodes: blobs (complete or being written) and the readers' hard links to them
    seen = set()
    reading = os.path.join(cache, "streamprep", "reading")
    for d in [os.path.join(cache, r, "blobs") for r in listdir(cache) if r.startswith("datasets--")] + [
            os.path.join(reading, k) for k in listdir(reading)]:
        for n in listdir(d):
            if n.startswith("tmp_"):  # huggingface_hub's empty probe of whether symlinks work here
                continue
            try:
                st = os.lstat(os.path.join(d, n))
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                seen.add((st.st_dev, st.st_ino))
    return len(seen)
peak = 0
while not os.path.exists(out + ".stop"):
    peak = max(peak, files())
    time.sleep(0.001)
open(out, "w").write(str(peak))
"""


@contextmanager
def _peak_files(cache, result: list[int]):
    """The most data files on disk at once in an HF cache while the block runs, sampled by a process of its own
    (a thread of this one waits for the GIL the driver holds, and its samples could mix two moments)."""
    import subprocess
    import sys

    out = cache.parent / "peak.txt"
    proc = subprocess.Popen([sys.executable, "-c", _WATCHER, str(cache), str(out)])
    try:
        yield
    finally:
        (cache.parent / "peak.txt.stop").write_text("")
        assert proc.wait(timeout=30) == 0, "the watcher of the cache failed: its traceback is in the captured stderr"
        result.append(int(out.read_text()))


@pytest.mark.slow
@pytest.mark.parametrize("window, bound", [({"hf_prefetch_files": 1}, 2), ({"hf_prefetch_files": 10}, 11),
                                           ({"hf_prefetch_files": 10, "hf_cache_max_gb": 1.5}, 1)],
                         ids=["prefetch1", "prefetch10", "budget"])
def test_the_drivers_window_bounds_the_files_on_disk(many, tmp_path, window, bound):
    """2 workers download their units' files: never more files on disk at once than the window allows (files
    handed out and not yet passed by a checkpoint), each fetched once, downloads overlapping, none left after;
    the run's Hub counters add up both workers' downloads."""
    size = max(len(jsonl(_many_rows(f))) for f in range(12))
    if "hf_cache_max_gb" in window:
        window = dict(window, hf_cache_max_gb=window["hf_cache_max_gb"] * size / 1024 ** 3)
    many.delay = 0.05
    raw = _ingest_config(MANY_REPO, workers=2, max_concurrent_downloads=8, **window)
    raw["datasets"][0].pop("filter")
    run = tmp_path / "run"
    peak: list[int] = []
    (run / "cache").mkdir(parents=True)
    with _peak_files(run / "cache/hf", peak):
        st = _ingest(raw, run)
    assert st["kept"] == 480
    assert many.file_requests("GET") == {p: 1 for p in MANY_FILES}
    hub_stats = json.loads((run / "cache/hf/streamprep/hub_stats.json").read_text())  # summed over the workers
    assert (hub_stats["files"], hub_stats["bytes"]) == (12, sum(len(jsonl(_many_rows(f))) for f in range(12)))
    assert 1 <= peak[0] <= bound, (peak[0], bound)
    if bound > 1:
        assert peak[0] >= 2 and many.max_in_flight >= 2, "the two workers never downloaded at the same time"
    else:
        assert many.max_in_flight == 1
    assert _blobs(run / "cache/hf") == set(), sorted(str(p.relative_to(run)) for p in (run / "cache/hf").rglob("*") if p.is_file() or p.is_symlink())
    reading = run / "cache/hf/streamprep/reading"  # the readers' hard links: gone, with their folder, at the end
    assert not reading.exists() or not any(reading.iterdir())


@pytest.mark.slow
def test_keep_cache_keeps_every_file_and_a_rerun_downloads_nothing(many, tmp_path):
    raw = _ingest_config(MANY_REPO, workers=1, hf_prefetch_files=2, hf_keep_cache=True)
    raw["datasets"][0].pop("filter")
    run = tmp_path / "run"
    first = _ingest(raw, run)
    snap = run / f"cache/hf/datasets--org--many/snapshots/{many.sha_of(MANY_REPO)}"
    assert [(snap / p).read_bytes() for p in MANY_FILES] == [jsonl(_many_rows(f)) for f in range(12)]
    many.reset_counts()
    import shutil

    for sub in ("ingest", "checkpoints", "rejects"):
        shutil.rmtree(run / sub, ignore_errors=True)
    assert _ingest(raw, run) == first
    assert _data_gets(many) == set()


@pytest.mark.slow
def test_max_records_stops_handing_out_units(many, tmp_path):
    """A cap in file 1: the driver hands out no unit once it is decided, so at most the window's files past it
    (hf_prefetch_files 2: files 2 and 3) are fetched; the dataset's files are all deleted at the end."""
    raw = _ingest_config(MANY_REPO, workers=1, hf_prefetch_files=2)
    raw["datasets"][0].pop("filter")
    raw["datasets"][0]["max_records"] = 50
    run = tmp_path / "run"
    st = _ingest(raw, run)
    assert st["consumed"] == 50 and st["kept"] == 50
    assert set(MANY_FILES[:2]) <= _data_gets(many) <= set(MANY_FILES[:4]), sorted(_data_gets(many))
    assert _blobs(run / "cache/hf") == set(), sorted(str(p.relative_to(run)) for p in (run / "cache/hf").rglob("*") if p.is_file() or p.is_symlink())


@pytest.mark.parametrize("flt", [{"lnag": "en"}, {"lang": 1}, {"meta": {"lang": "en"}}],
                         ids=["field-no-record-has", "value-of-another-type", "nested"])
def test_a_filter_that_matches_no_record_says_so(hub, tmp_path, flt):
    """Regression: a filter naming a field no record has (a typo), or a value of another type than the field's, left
    the dataset empty without a word (read 0, exit 0): the filter drops records before they are counted. The job
    now logs a warning naming the dataset and its filter; a filter that matches records says nothing. Regression:
    a nested filter was logged as the config's "mappingproxy({...})", not JSON."""
    from structlog.testing import capture_logs

    raw = _ingest_config(REPO, workers=1)
    for given, read in ((flt, 0), ({"lang": "en"}, 13)):
        raw["datasets"][0]["filter"] = given
        with capture_logs() as logged:
            assert _ingest(raw, tmp_path / f"run-{read}")["consumed"] == read
        warned = [(e["event"], e["dataset"], json.dumps(e["filter"])) for e in logged if e["log_level"] == "warning"]
        assert warned == ([("the filter matched no record: the dataset is empty; check its field names and value "
                            "types", "web", json.dumps(given))] if read == 0 else [])


def test_a_plan_from_the_stream_version_is_refused(hub, tmp_path):
    """A run dir whose hf:// dataset was checkpointed as one stream unit (an earlier streamprep) is refused in one
    line: its position is inside the stream, which per-file units cannot continue."""
    import asyncio

    from streamprep.config import load
    from streamprep.ingest import IngestContext, ingest_all

    raw = _ingest_config(REPO, workers=1)
    run = tmp_path / "run"
    _ingest(raw, run)
    ck = run / "checkpoints"
    (ck / "web.plan.json").write_text(json.dumps([{"kind": "stream", "file": -1, "path": "", "fmt": "", "start": 0,
                                                    "end": 0}]))
    state = json.loads((ck / "web.json").read_text())
    state.update(done=False, position={**state["position"], "unit": 0, "piece": 3})  # inside the one stream unit
    (ck / "web.json").write_text(json.dumps(state))
    with pytest.raises(ConfigError, match=r"dataset web: its checkpoint is from an earlier streamprep that read "
                                          r"hf:// as one stream and cannot be resumed; start over") as err:
        asyncio.run(ingest_all(IngestContext.of(load(raw), run, ck, asyncio.Event())))
    assert "\n" not in str(err.value)


def _cli_job(hub: FakeHub, tmp_path, **execution) -> tuple[Path, dict[str, str]]:
    """A config file for a `streamprep ingest` process on `hub`'s MANY_REPO, and the environment pointing it there."""
    import os
    import sys

    import yaml

    raw = _ingest_config(MANY_REPO, **execution)
    raw["datasets"][0].pop("filter")
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "NO_PROXY": "127.0.0.1,localhost", "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("HF_TOKEN", None)
    return cfg_path, env


@pytest.mark.slow
def test_kill_9_anywhere_then_resume_gives_the_same_bytes(many, tmp_path):
    """`streamprep ingest` on 12 hf:// files (2 workers downloading them, ~0.8 s a file) killed with SIGKILL at
    random moments, mid-download included, then resumed: parts, rejects and token files equal an uninterrupted
    run's, and no downloaded file is left in the cache."""
    import os
    import random
    import signal
    import subprocess
    import sys
    import time

    from helpers import tree_hashes

    many.rate = 50_000
    cfg_path, env = _cli_job(many, tmp_path, workers=2, hf_prefetch_files=2)

    def start(run):
        return subprocess.Popen([sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path), "--run-dir",
                                 str(run)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    ref = tmp_path / "ref"
    proc = start(ref)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    rng = random.Random(7)
    run = tmp_path / "run"
    ck = run / "checkpoints" / "web.json"
    log = run / "logs" / "streamprep.log"

    def consumed() -> int:
        try:
            return json.loads(ck.read_text())["consumed"]
        except (OSError, ValueError):  # not yet written (it is replaced atomically)
            return 0

    inside = []  # items checkpointed when a kill landed inside ingest
    for cycle in range(5):  # the first kill lands before the first commit, the others after one
        seen, before = (log.stat().st_size if log.exists() else 0), consumed()
        proc = start(run)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:  # planned (downloads start), or a unit committed
            if (consumed() > before) if cycle else (log.exists() and b"units planned" in log.read_bytes()[seen:]):
                break
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.5 if cycle else 1.5))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        if 0 < consumed() < 480:
            inside.append(consumed())
    proc = start(run)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()[-3000:]
    assert len(inside) >= 3, inside
    compared = ("ingest", "rejects", "binidx")
    assert tree_hashes(run, *compared) == tree_hashes(ref, *compared)
    assert _blobs(run / "cache/hf") == set(), sorted(str(p.relative_to(run)) for p in (run / "cache/hf").rglob("*")
                                                      if (p.is_file() or p.is_symlink()) and ".locks" not in p.parts)


@pytest.mark.slow
def test_a_worker_downloads_the_next_file_while_it_judges(many, tmp_path, monkeypatch):
    """Downloads overlap the judging: while its worker judges unit 0, unit 1's file (the next it gets, with
    1 worker) is already being fetched; each file is still fetched once."""
    import time

    from streamprep import unit_worker

    seen: list[set] = []
    real = unit_worker._judge

    def judge(name, text_field, items):
        if items and not isinstance(items[0], BadRecord) and items[0]["id"] == 0:
            time.sleep(0.5)  # the prefetch thread has started by now (a file takes ~0.1 s)
            seen.append(_data_gets(many))
        return real(name, text_field, items)

    monkeypatch.setattr(unit_worker, "_judge", judge)
    raw = _ingest_config(MANY_REPO, workers=1, hf_prefetch_files=4)
    raw["datasets"][0].pop("filter")
    assert _ingest(raw, tmp_path / "run")["kept"] == 480
    assert seen == [set(MANY_FILES[:2])]
    assert many.file_requests("GET") == {p: 1 for p in MANY_FILES}


def test_a_job_whose_download_runs_out_of_retries_stops_with_the_hubs_one_line(many, tmp_path):
    """Regression: the worker's `HFSourceUnavailable` reached the user wrapped as a source's bug (`dataset D: reading
    the input failed after item N: HFSourceUnavailable: …`); it is a fault of the environment, as a vanished local
    file is: exit 1 with the Hub's own line, resumable."""
    from streamprep import atomic, run_from_dict

    raw = _pipeline_config(MANY_REPO)
    raw["execution"].update(hf_retries=1, hf_retry_max_s=0.05)
    many.fault_cycle = ["503"]
    with pytest.raises(HFSourceUnavailable, match=r"^hf://org/many@[0-9a-f]{40}: download of data/train-0000\d\.jsonl "
                                                  r"failed \(HubRetriesExhausted: GET .* HTTP 503 after 1 retries\)$"):
        run_from_dict(raw, run_dir=tmp_path / "run", console_log=False)
    assert atomic.read_json(tmp_path / "run" / "run.json")["status"] == "failed"
    many.fault_cycle = []
    assert run_from_dict(raw, run_dir=tmp_path / "run", console_log=False).status == "complete"


def test_a_job_whose_download_fails_with_worker_processes_ends_on_its_one_line_error(many, tmp_path):
    """Regression: a job with `workers: 2` whose download failed (exit 1, resumable) printed the resource tracker's
    `UserWarning: resource_tracker: There appear to be 2 leaked semaphore objects to clean up at shutdown` after
    its one-line error: `datasets` had made tqdm's multiprocessing lock (a named semaphore) in each worker that
    opened a file, and a failing job terminates its workers, so none was unlinked. Past the console's log lines,
    stderr is the one line, and it is the last."""
    import re
    import subprocess
    import sys

    cfg_path, env = _cli_job(many, tmp_path, workers=2, hf_prefetch_files=1, hf_retries=1, hf_retry_max_s=0.05)
    many.fault_cycle = [None, None] + ["503"] * 1000  # two files read, then every download refused
    proc = subprocess.run([sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path), "--run-dir",
                           str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    said = [line for line in lines if not re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z \[", line)]
    assert len(said) == 1 and said[0] == lines[-1], proc.stderr[-3000:]
    assert re.fullmatch(r"streamprep: error: HFSourceUnavailable: hf://org/many@[0-9a-f]{40}: download of "
                        r"data/train-\d{5}\.jsonl failed \(HubRetriesExhausted: .*HTTP 503 after 1 retries\)", said[0])


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_while_a_download_hangs_stops_the_job_within_seconds(many, tmp_path, workers):
    """Regression: the job's executor waited for the call still running at a stop, so SIGTERM while a Hub stalled a
    download took ~56 s (the transport's own timeouts and retries) and up to 6 minutes on a stalled HEAD. A stopping
    job now wants no result of a running call: the pool's processes are terminated, a worker thread is left behind.
    The same command then resumes to every record."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    cfg_path, env = _cli_job(many, tmp_path, workers=workers, hf_prefetch_files=1)
    argv = [sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path), "--run-dir", str(tmp_path / "run")]
    many.fault_cycle = [None, "hang"]  # the second data file's download never answers
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while many.faults_served["hang"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert many.faults_served["hang"] == 1, proc.stderr.read() if proc.poll() is not None else "no download hung"
    time.sleep(0.5)
    children = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    asked = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    took = time.monotonic() - asked
    assert code == 1 and took < 10, (code, took, proc.stderr.read()[-2000:])
    assert "re-run the same command to resume" in proc.stderr.read()
    time.sleep(0.5)
    assert not [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    many.fault_cycle = []
    assert subprocess.run(argv, env=env, capture_output=True, timeout=300).returncode == 0
    assert json.loads((tmp_path / "run" / "checkpoints" / "web.json").read_text())["kept"] == 480


def test_a_split_that_does_not_exist_then_the_right_one_in_the_same_run_dir(many, tmp_path):
    """Regression: the Hub-side refusal (exit 2) came after the job's start had written its tokenizer copy, backend
    and holder count and claimed the checkpoint dir, so the corrected config was refused in that run dir: `config
    changed since this run started (datasets[0].split)`. The attempt takes back what it added (a run dir that held
    nothing is removed whole: test_a_config_error_found_at_the_hub_leaves_nothing_behind); the corrected config
    runs in the same run dir, and once outputs exist a changed config is refused as before."""
    from streamprep import run_from_dict
    from streamprep.verify import verify_run

    raw = _ingest_config(MANY_REPO, workers=1)
    raw["datasets"][0].update(split="dev")
    raw["datasets"][0].pop("filter")
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(HFSourceError, match=r"unknown split 'dev'"):
        run_from_dict(raw, run_dir=run, console_log=False)
    assert [p.name for p in run.iterdir()] == ["notes.txt"]  # no run.json, no claim on the checkpoint dir
    raw["datasets"][0].update(split="train")
    assert run_from_dict(raw, run_dir=run, console_log=False).status == "complete"
    assert verify_run(run) == []
    raw["datasets"][0].update(split="validation")  # outputs exist now: a changed config is refused as before
    with pytest.raises(ConfigError, match=r"config changed since this run started \(datasets\[0\].split\)"):
        run_from_dict(raw, run_dir=run, console_log=False)


@pytest.mark.parametrize("entry, message", [
    (dict(path="hf://org/nope"), "dataset web: hf://org/nope: dataset repo not found (or private without a token)"),
    (dict(revision="v9"), "dataset web: hf://org/many: revision 'v9' not found"),
    (dict(split="dev"), "dataset web: hf://org/many: unknown split 'dev' (available: train)"),
    (dict(subset="fr"), "dataset web: hf://org/many: unknown subset 'fr' (README.md declares no 'configs'; leave "
                        "'subset' empty)"),
])
@pytest.mark.parametrize("before", ["absent", "empty", "checkpoint_dir"])
def test_a_config_error_found_at_the_hub_leaves_nothing_behind(many, tmp_path, entry, message, before):
    """Regression: an hf:// repo, revision, split or subset the Hub does not have was the right one-line error, exit 2,
    but left a run dir with run.json (failed), tokenizer/, checkpoints/ and logs/, `streamprep status` said RESUMABLE,
    and `--fresh` with the corrected config refused it as not empty. The Hub is asked only once the job has started,
    so such an attempt takes back what it wrote in the folders that held nothing before it: nothing is left, as for a
    local path that does not exist, and the corrected config runs with --fresh in the same run dir."""
    from streamprep import run_from_dict

    raw = _ingest_config(MANY_REPO, workers=1)
    raw["datasets"][0].pop("filter")
    run, outside = tmp_path / "run", tmp_path / "ck"
    if before == "empty":
        run.mkdir()
    if before == "checkpoint_dir":
        raw["run"]["checkpoint_dir"] = str(outside)
    with pytest.raises(HFSourceError) as err:
        run_from_dict({**raw, "datasets": [{**raw["datasets"][0], **entry}]}, run_dir=run, console_log=False)
    assert str(err.value) == message
    assert (sorted(run.iterdir()) == [] if before == "empty" else not run.exists())
    assert not outside.exists()
    if "split" in entry:  # the corrected config, in the same run dir, with --fresh
        assert run_from_dict(raw, run_dir=run, fresh=True, console_log=False).status == "complete"


def test_a_config_error_at_the_hub_never_removes_what_the_attempt_did_not_write(many, tmp_path):
    """Only what the attempt added is taken back: a run dir, or a checkpoint dir outside it, holding a file of the
    user's keeps it and loses the rest. Regression: a checkpoint dir that held a file made the take-back skip the
    run dir it had created as well (the user's file counted as the attempt's output), so `--fresh` refused it."""
    from streamprep import run_from_dict

    raw = _ingest_config(MANY_REPO, workers=1)
    raw["datasets"][0].update(path="hf://org/nope")
    run, outside = tmp_path / "run", tmp_path / "ck"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    with pytest.raises(HFSourceError, match="dataset repo not found"):
        run_from_dict(raw, run_dir=run, console_log=False)
    assert [(p.name, p.read_text()) for p in run.iterdir()] == [("notes.txt", "mine")]
    outside.mkdir()
    (outside / "other.txt").write_text("theirs")
    raw["run"]["checkpoint_dir"] = str(outside)
    with pytest.raises(HFSourceError, match="dataset repo not found"):
        run_from_dict(raw, run_dir=tmp_path / "new", console_log=False)
    assert [(p.name, p.read_text()) for p in outside.iterdir()] == [("other.txt", "theirs")]
    assert not (tmp_path / "new").exists()
