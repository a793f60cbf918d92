"""s3:// sources against a local S3 server (moto's server mode) behind a small HTTP proxy that counts the object
bytes it serves and can cut or refuse connections: same token bytes as from local disk, ranged resume, missing
bucket/key as a config error, retried connection drops, ETag identity (issue 30 item 1). http:// paths against
Python's own http.server (no range support), and az:// / abfs:// without adlfs: listed at validation too.

Nothing here touches the internet: the server and the proxy listen on 127.0.0.1 and the tests start them."""
from __future__ import annotations

import asyncio
import gzip
import hashlib
import http.client
import http.server
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
import zstandard

from helpers import REPO, assert_gone_refused, base_config, english_docs, ingest_stopped_after
from streamprep import run_from_dict
from streamprep.config import ConfigError, dataset, load
from streamprep.sources.base import SourceError, input_change
from streamprep.sources.local import LocalSource, filesystem, open_input

BUCKET = "corpora"
DOCS = english_docs(600, seed=30)
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
FOOTER_READ = 64 * 1024  # pyarrow's speculative read of a Parquet file's tail
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "proxy-connection"}


class Proxy(http.server.ThreadingHTTPServer):
    """Forwards every request to the S3 server. Counts the body bytes of object GETs per key; `drops` cuts the
    next object GETs after half their body (a connection reset mid-object); `down_after` refuses every request
    (closes the connection unanswered) once that many object bytes were served; `refused_ranges` are the Range
    headers of the requests it refused."""

    daemon_threads = True

    def __init__(self, upstream: tuple[str, int]):
        super().__init__(("127.0.0.1", 0), ProxyHandler)
        self.upstream = upstream
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self.lock:
            self.served: dict[str, int] = {}
            self.refused_ranges: set[str | None] = set()
            self.drops, self.dropped, self.down_after, self.refused = 0, 0, None, 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def total(self) -> int:
        return sum(self.served.values())

    def down(self) -> bool:
        return self.down_after is not None and self.total() >= self.down_after


class ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Proxy

    def log_message(self, *args: Any) -> None:
        pass

    def _forward(self) -> None:
        proxy = self.server
        if proxy.down():
            with proxy.lock:
                proxy.refused += 1
                proxy.refused_ranges.add(self.headers.get("Range"))
            self.close_connection = True
            return
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        conn = http.client.HTTPConnection(*proxy.upstream, timeout=30)
        conn.request(self.command, self.path, body=body or None, headers=dict(self.headers.items()))
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        key = self.path.split("?")[0]
        is_object = self.command == "GET" and resp.status in (200, 206) and "?" not in self.path
        cut = False
        if is_object:
            with proxy.lock:
                if proxy.drops > 0 and len(data) > 1024:
                    proxy.drops -= 1
                    proxy.dropped += 1
                    cut = True
        self.send_response_only(resp.status, resp.reason)
        for name, value in resp.getheaders():
            if name.lower() not in HOP_BY_HOP:
                self.send_header(name, value)
        self.send_header("Content-Length", resp.getheader("Content-Length") if self.command == "HEAD"
                         else str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        sent = data[: len(data) // 2] if cut else data
        if is_object:  # counted before the client can have the bytes: a test reading the count after its read
            with proxy.lock:  # once saw 0 (the handler thread had written, not yet counted)
                proxy.served[key] = proxy.served.get(key, 0) + len(sent)
        self.wfile.write(sent)
        if cut:
            self.wfile.flush()
            self.close_connection = True

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward


@pytest.fixture(scope="module")
def s3() -> Iterator[Proxy]:
    """A moto S3 server and the proxy in front of it; the standard AWS_* environment points at the proxy."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    proxy = Proxy(server.get_host_and_port())
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    saved = {k: os.environ.get(k) for k in (*CREDENTIALS, "AWS_ENDPOINT_URL")}
    os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=proxy.url)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    fs = filesystem("s3://x")[0]
    fs.mkdir(BUCKET)
    try:
        yield proxy
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        s3fs.S3FileSystem.clear_instance_cache()
        proxy.shutdown()
        proxy.server_close()
        server.stop()


def _jsonl(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": t, "id": hashlib.md5(t.encode()).hexdigest()[:8]}) + "\n" for t in docs).encode()


def _corpus(local: Path, prefix: str) -> None:
    """The same four files (one per format) on local disk and under s3://BUCKET/prefix/."""
    local.mkdir(parents=True, exist_ok=True)
    (local / "a.jsonl").write_bytes(_jsonl(DOCS[:150]))
    (local / "b.jsonl.gz").write_bytes(gzip.compress(_jsonl(DOCS[150:300]), mtime=0))
    (local / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(_jsonl(DOCS[300:450])))
    pq.write_table(pa.Table.from_pylist([{"text": t} for t in DOCS[450:]]), local / "d.parquet", row_group_size=40)
    _upload(local, prefix)


def _upload(local: Path, prefix: str) -> None:
    fs = filesystem("s3://x")[0]
    for f in sorted(local.iterdir()):
        fs.pipe(f"{BUCKET}/{prefix}/{f.name}", f.read_bytes())


def _tokens(run: Path) -> dict[str, str]:
    """sha256 of every .bin/.idx token file, by path under binidx/."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((run / "binidx").rglob("*")) if p.is_file()}


def _job(path: str, run: Path, **ds: Any) -> dict[str, str]:
    cfg = base_config([{"name": "web", "path": path, **ds}], None)
    result = run_from_dict(cfg, run_dir=run, console_log=False)
    assert result.status == "complete"
    return _tokens(run)


@pytest.fixture(scope="module")
def local_run(s3: Proxy, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The corpus read from local disk (and uploaded under corpus/): the token bytes every s3 run must match."""
    root = tmp_path_factory.mktemp("local")
    _corpus(root / "corpus", "corpus")
    tokens = _job(str(root / "corpus"), root / "run")
    assert len(tokens) >= 2
    return root / "corpus", tokens


@pytest.mark.slow
def test_s3_prefix_and_glob_give_the_same_token_bytes_as_local_disk(s3: Proxy, local_run, tmp_path: Path) -> None:
    local, expected = local_run
    s3.reset()
    assert _job(f"s3://{BUCKET}/corpus/", tmp_path / "prefix") == expected
    sizes = {f.name: f.stat().st_size for f in local.iterdir()}
    assert {k.rsplit("/", 1)[-1]: v for k, v in s3.served.items()} == sizes  # every object read exactly once
    assert _job(f"s3://{BUCKET}/corpus/*.*", tmp_path / "glob") == expected
    src = LocalSource(dataset({"name": "d", "path": f"s3://{BUCKET}/corpus/*.jsonl*"}))
    assert src.files == [f"s3://{BUCKET}/corpus/{n}" for n in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst")]


@pytest.mark.slow
def test_storage_options_instead_of_the_environment_and_kept_out_of_run_json(s3: Proxy, local_run, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import s3fs

    for k in (*CREDENTIALS, "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k)
    s3fs.S3FileSystem.clear_instance_cache()
    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3.url, "region_name": "us-east-1"}}
    try:
        assert _job(f"s3://{BUCKET}/corpus/", tmp_path / "run", storage_options=opts) == local_run[1]
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    text = (tmp_path / "run" / "run.json").read_text()
    recorded = json.loads(text)["config"]["datasets"][0]["storage_options"]
    assert recorded == {**opts, "key": "<redacted>", "secret": "<redacted>"} and "testing" not in text


def test_gs_urls_open_through_gcsfs_with_storage_options() -> None:
    import gcsfs

    fs, path = filesystem("gs://bucket/data/*.jsonl.zst", {"token": "anon"})
    assert isinstance(fs, gcsfs.GCSFileSystem) and path == "bucket/data/*.jsonl.zst"


@pytest.mark.slow
def test_resume_inside_a_file_fetches_only_the_rest(s3: Proxy, tmp_path: Path) -> None:
    """Source level: a position inside plain JSONL is a ranged read from its offset; inside Parquet, the footer
    and the row groups from the position's on. Counted as object bytes served by the proxy."""
    big = _jsonl(english_docs(6000, seed=31))
    table = pa.Table.from_pylist([{"text": t} for t in english_docs(6000, seed=32)])
    pq.write_table(table, tmp_path / "big.parquet", row_group_size=500)
    (tmp_path / "big.jsonl").write_bytes(big)
    _upload(tmp_path, "resume")
    for name in ("big.jsonl", "big.parquet"):
        src = LocalSource(dataset({"name": "d", "path": f"s3://{BUCKET}/resume/{name}"}))
        size = (tmp_path / name).stat().st_size
        s3.reset()
        items = list(src.iter_records())
        footer = 0 if name == "big.jsonl" else FOOTER_READ  # pyarrow reads the footer on its own first
        assert len(items) == 6000 and size <= s3.total() <= size + footer
        s3.reset()
        assert [r for r, _ in src.iter_records(items[4200][1])] == [r for r, _ in items[4201:]]
        if name == "big.jsonl":
            must = size - items[4200][1]["offset"]
            assert s3.total() == must, (s3.total(), must)
        else:
            meta = pq.ParquetFile(tmp_path / name).metadata
            g = items[4200][1]["row_group"]
            start = meta.row_group(g).column(0).data_page_offset
            start = min(start, meta.row_group(g).column(0).dictionary_page_offset or start)
            assert s3.total() <= size - start + FOOTER_READ, (s3.total(), size - start)
            assert s3.total() < size // 2  # row groups 8-11 of 12 and the footer


@pytest.mark.slow
def test_job_resumed_after_a_stop_reads_only_the_rest(s3: Proxy, tmp_path: Path) -> None:
    data = _jsonl(english_docs(3000, seed=33))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "big.jsonl").write_bytes(data)
    _upload(tmp_path / "in", "job")
    cfg = base_config([{"name": "web", "path": f"s3://{BUCKET}/job/big.jsonl"}], None)
    cfg["execution"].update(batch_records=50, unit_mb=0.1)  # ~13 units (byte ranges) of the object
    run = tmp_path / "run"
    state = asyncio.run(asyncio.wait_for(ingest_stopped_after(load(cfg), run, "web", 1500), 120))
    assert not state.done and 0 < state.position["offset"] < len(data)
    s3.reset()
    result = run_from_dict(cfg, run_dir=run, console_log=False)
    assert result.status == "complete"
    # the units from the checkpoint's on, once each: no whole-file re-read, and the saved plan is not redone
    assert s3.total() == len(data) - state.position["offset"]
    assert _tokens(run) == _job(str(tmp_path / "in" / "big.jsonl"), tmp_path / "local")


@pytest.mark.parametrize("path", ["s3://no-such-bucket/x.jsonl", f"s3://{BUCKET}/corpus/missing.jsonl",
                                  f"s3://{BUCKET}/nothing-here/*.jsonl"])
def test_missing_bucket_or_key_is_a_config_error_naming_it(s3: Proxy, tmp_path: Path, path: str) -> None:
    run = tmp_path / "run"
    with pytest.raises(ConfigError, match=rf"'datasets\[0\].path': .*{path.replace('*', '[*]')}"):
        run_from_dict(base_config([{"name": "d", "path": path}], None), run_dir=run, console_log=False)
    assert not run.exists()


@pytest.mark.parametrize("path", ["s3://no-such-bucket/d/", "s3://no-such-bucket/a.jsonl", "s3://no-such-bucket",
                                  "s3://no-such-bucket/*.jsonl"])
def test_a_missing_bucket_is_named_as_the_one_missing(s3: Proxy, tmp_path: Path, path: str) -> None:
    """Regression: `no object matches s3://no-such-bucket/d/`, as for a prefix missing in a bucket that is there,
    which sent its writer looking for the objects rather than the bucket (or the endpoint)."""
    from streamprep.config import MissingInput, validate

    with pytest.raises(MissingInput) as err:
        validate({"datasets": [{"name": "d", "path": path}]}, base_dir=tmp_path)
    assert str(err.value) == f"config: 'datasets[0].path': no bucket named no-such-bucket at {s3.url}: {path}"
    with pytest.raises(MissingInput) as err:  # the bucket is there: the objects are what is missing
        validate({"datasets": [{"name": "d", "path": f"s3://{BUCKET}/no-such-prefix/"}]}, base_dir=tmp_path)
    assert str(err.value) == f"config: 'datasets[0].path': no object matches s3://{BUCKET}/no-such-prefix/"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _cli(cfg: dict, tmp_path: Path, run: Path, timeout: float = 240) -> tuple[int, str]:
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "streamprep", "ingest", "--config", str(cfg_path), "--run-dir",
                           str(run)], capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stderr


@pytest.mark.slow
def test_cli_missing_key_exits_2_and_writes_nothing(s3: Proxy, tmp_path: Path) -> None:
    path = f"s3://{BUCKET}/corpus/missing.jsonl"
    code, err = _cli(base_config([{"name": "d", "path": path}], None), tmp_path, tmp_path / "run", 120)
    assert code == 2 and path in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_connection_drops_mid_object_are_retried(s3: Proxy, local_run, tmp_path: Path) -> None:
    s3.reset()
    s3.drops = 3  # the first three object GETs are cut after half their body
    assert _job(f"s3://{BUCKET}/corpus/", tmp_path / "run") == local_run[1]
    assert s3.dropped == 3


@pytest.mark.slow
def test_store_gone_mid_object_exits_1_then_resumes_to_the_same_bytes(s3: Proxy, tmp_path: Path) -> None:
    """Small read blocks (storage_options) make a 4 MB file many ranged GETs; the store goes away mid-file. After
    the retries (s3fs's; botocore's own are turned off here by config_kwargs to keep the test short) the job
    stops, exit 1, naming the file; once the store is back the same command resumes and the tokens match a run
    from local disk. Regression: the reads of the units queued behind the one that failed were each tried in turn
    (~22 s of retries each here, minutes with the default ones) before the job stopped, since the calls committing
    the units before it queued behind them; they are cancelled."""
    data = _jsonl(english_docs(6000, seed=34))
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "big.jsonl").write_bytes(data)
    _upload(tmp_path / "in", "flaky")
    opts = {"default_block_size": 128 * 1024, "config_kwargs": {"retries": {"max_attempts": 1}}}
    cfg = base_config([{"name": "web", "path": f"s3://{BUCKET}/flaky/big.jsonl", "storage_options": opts}], None)
    cfg["execution"].update(batch_records=50, unit_mb=0.25)  # ~10 units, each one ranged read
    run = tmp_path / "run"
    s3.reset()
    s3.down_after = len(data) // 2
    code, err = _cli(cfg, tmp_path, run)
    last = err.strip().splitlines()[-1]
    assert code == 1 and "cannot read input file s3://corpora/flaky/big.jsonl (bytes " in last, err[-2000:]
    assert s3.refused >= 5  # retried before giving up
    # that unit's read (and one the worker thread took before the cancel reached it), not every queued one in turn
    assert len(s3.refused_ranges) <= 2, s3.refused_ranges
    ck = json.loads((run / "checkpoints" / "web.json").read_text())
    assert not ck["done"] and ck["consumed"] > 0
    s3.reset()
    code, err = _cli(cfg, tmp_path, run)
    assert code == 0, err[-2000:]
    assert s3.total() < len(data)  # resumed inside the file
    assert _tokens(run) == _job(str(tmp_path / "in" / "big.jsonl"), tmp_path / "local")


def test_planning_an_object_reads_one_probe_a_cut(s3: Proxy, tmp_path: Path) -> None:
    """Regression: the planner's reads went through fsspec's read-ahead cache, which fetched a block past each, so
    planning a file cost twice the bytes its docstring gave (2 x PROBE_BYTES a cut) and, in a store going away
    mid-job, spent the bytes the units needed (the store-gone test above then failed before any checkpoint)."""
    from streamprep import units

    (tmp_path / "in").mkdir()
    data = _jsonl(english_docs(3000, seed=35))  # lines far shorter than a probe: each cut is one read
    (tmp_path / "in" / "cut.jsonl").write_bytes(data)
    _upload(tmp_path / "in", "plan")
    s3.reset()
    planned = units.plan_dataset([f"s3://{BUCKET}/plan/cut.jsonl"], None, 256 * 1024, None)
    assert len(planned) >= 5 and b"".join(data[u.start:u.end] for u in planned) == data
    # the head, then one probe at each of the len - 1 cuts (the last may meet the end of the file)
    assert (len(planned) - 1) * units.PROBE_BYTES < s3.total() <= len(planned) * units.PROBE_BYTES


def test_identity_is_the_etag_without_reading_the_object(s3: Proxy, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "x.jsonl").write_bytes(_jsonl(DOCS[:20]))
    _upload(tmp_path / "in", "ident")
    src = LocalSource(dataset({"name": "d", "path": f"s3://{BUCKET}/ident/"}))
    s3.reset()
    before = src.fingerprint()
    assert s3.total() == 0
    f = before["files"][0]
    assert f["path"] == f"s3://{BUCKET}/ident/x.jsonl" and len(f["etag"]) == 32 and f["size"] > 0
    import s3fs

    other = s3fs.S3FileSystem(skip_instance_cache=True)  # another client: the job's filesystem hears nothing of it
    other.pipe(f"{BUCKET}/ident/x.jsonl", _jsonl(DOCS[:20]).replace(b"Document 1:", b"Document X:"))  # same size
    # regression: taken again in the same process (the check before a dataset is done), the identity came from
    # s3fs's listing of the start, which never expires: a job read a replaced object and ended complete, exit 0
    assert input_change(before, src.fingerprint()) is None  # the listing s3fs keeps
    assert input_change(before, src.fingerprint(fresh=True)) == f"input file {f['path']} changed (etag)"
    assert input_change(before, src.fingerprint()) == f"input file {f['path']} changed (etag)"
    # regression: the listing taken again was thrown away, so an object added under the prefix meanwhile was
    # not read, without a word, exit 0 (the resume refused it as new); one gone was a read error
    src = LocalSource(dataset({"name": "d", "path": f"s3://{BUCKET}/ident/"}))
    before = src.fingerprint()
    other.pipe(f"{BUCKET}/ident/y.jsonl", _jsonl(DOCS[:5]))
    assert input_change(before, src.fingerprint(fresh=True)) == f"input file s3://{BUCKET}/ident/y.jsonl is new"
    other.rm(f"{BUCKET}/ident/x.jsonl")
    assert input_change(before, src.fingerprint(fresh=True)) == f"input file {f['path']} is gone"


def test_open_input_reads_a_byte_range(s3: Proxy, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    data = _jsonl(DOCS[:50])
    (tmp_path / "in" / "r.jsonl").write_bytes(data)
    _upload(tmp_path / "in", "range")
    for path in (str(tmp_path / "in" / "r.jsonl"), f"s3://{BUCKET}/range/r.jsonl"):
        with open_input(path, start=100, end=5000) as fh:
            assert fh.read() == data[100:5000]
        with open_input(path, start=100, end=5000) as fh:
            assert b"".join(fh) == data[100:5000]


@pytest.mark.parametrize("entry, want", [
    ({"path": "data.jsonl", "storage_options": {"anon": True}}, r"'datasets\[0\].storage_options' applies to fsspec"),
    ({"path": "hf://org/x", "split": "train", "storage_options": {"anon": True}}, "applies to fsspec URLs"),
    ({"path": "s3://b/x.jsonl", "storage_options": [1]}, r"'datasets\[0\].storage_options' must be a mapping"),
    ({"path": "s3://b/x.jsonl", "storage_options": {"": 1}}, "must map option names to values"),
])
def test_storage_options_misuse_is_a_config_error(entry: dict, want: str) -> None:
    from streamprep.config import validate

    with pytest.raises(ConfigError, match=want):
        validate(base_config([{"name": "d", **entry}], None))


@pytest.mark.parametrize("path", ["s3://", "s3://*/corpus/", "s3:///corpus/", "s3://corp*/x.jsonl", "gs://**/x.jsonl"])
def test_a_path_naming_no_bucket_is_a_config_error_and_writes_nothing(tmp_path: Path, path: str) -> None:
    """Regression: `s3://` and `s3://*/prefix/` were `ValueError: Cannot traverse all of S3` (s3fs's), exit 1, as if a
    re-run could help; a path naming no bucket is refused at validation, naming the key, before any listing."""
    run = tmp_path / "run"
    scheme = path.split("://")[0]
    with pytest.raises(ConfigError) as err:
        run_from_dict(base_config([{"name": "d", "path": path}], None), run_dir=run, console_log=False)
    assert str(err.value) == (f"config: 'datasets[0].path': {path} names no bucket; expected {scheme}://<bucket>/<key, "
                              f"prefix or glob> (a glob cannot stand for the bucket)")
    assert not run.exists()


def test_an_object_named_with_glob_characters_is_that_object_as_on_disk(s3: Proxy, tmp_path: Path) -> None:
    """Regression: `s3://b/br[1].jsonl` that exists was "no object matches", and `s3://b/lit/a*.jsonl` that exists
    also read `ab.jsonl`; on disk a name with glob characters that exists as written is that file (docs/config.md)."""
    from streamprep.sources.local import expand

    fs = filesystem("s3://x")[0]
    for key in ("lit/br[1].jsonl", "lit/a*.jsonl", "lit/ab.jsonl"):
        fs.pipe(f"{BUCKET}/{key}", _jsonl(DOCS[:3]))
    fs.invalidate_cache()
    assert expand(f"s3://{BUCKET}/lit/br[1].jsonl") == [f"s3://{BUCKET}/lit/br[1].jsonl"]
    assert expand(f"s3://{BUCKET}/lit/a*.jsonl") == [f"s3://{BUCKET}/lit/a*.jsonl"]
    assert expand(f"s3://{BUCKET}/lit/?b.jsonl") == [f"s3://{BUCKET}/lit/ab.jsonl"]  # no such object: a glob


def test_no_credentials_at_all_is_a_config_error_naming_the_path(s3: Proxy, tmp_path: Path, monkeypatch) -> None:
    """Regression: with no AWS credentials anywhere the job said `NoCredentialsError: Unable to locate
    credentials`, exit 1, naming neither the dataset nor the path (refused ones were already exit 2)."""
    import s3fs

    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    s3fs.S3FileSystem.clear_instance_cache()
    path, run = f"s3://{BUCKET}/corpus/", tmp_path / "run"
    try:
        with pytest.raises(ConfigError, match=rf"^config: 'datasets\[0\].path': {path}: Unable to locate credentials$"):
            run_from_dict(base_config([{"name": "d", "path": path}], None), run_dir=run, console_log=False)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert not run.exists()


def test_a_folder_marker_object_is_a_folder_not_a_reject(s3: Proxy, tmp_path: Path) -> None:
    """Regression: the zero-byte `sub/` key an S3 console's "Create folder" (or Spark, Hadoop) writes was listed as a
    file and counted as a reject, `unsupported file, skipped: s3://…/sub/`, in every audit."""
    from streamprep.sources.local import expand

    fs = filesystem("s3://x")[0]
    fs.pipe(f"{BUCKET}/marked/sub/", b"")
    fs.pipe(f"{BUCKET}/marked/sub/a.jsonl", _jsonl(DOCS[:3]))
    fs.invalidate_cache()
    assert expand(f"s3://{BUCKET}/marked/") == [f"s3://{BUCKET}/marked/sub/a.jsonl"]
    assert expand(f"s3://{BUCKET}/marked/**") == [f"s3://{BUCKET}/marked/sub/a.jsonl"]  # regression: a glob listed it


HIDDEN_TREE = ("a.jsonl", ".b.jsonl", "sub/c.jsonl", ".staging/d.jsonl")


def _tree(local: Path, prefix: str) -> None:
    """HIDDEN_TREE on local disk and under s3://BUCKET/prefix/."""
    fs = filesystem("s3://x")[0]
    for name in HIDDEN_TREE:
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(_jsonl(DOCS[:2]))
        fs.pipe(f"{BUCKET}/{prefix}/{name}", _jsonl(DOCS[:2]))
    fs.invalidate_cache()


@pytest.mark.parametrize("pattern", ["*.jsonl", "**/*.jsonl", "*/*.jsonl", "**/*", ".*.jsonl", ".staging/*",
                                     "**/.b*", "?b.jsonl"])
def test_an_object_store_glob_skips_hidden_names_as_on_disk(s3: Proxy, tmp_path: Path, pattern: str) -> None:
    """Regression: `s3://b/tree/*` read `.b.jsonl` and `tree/**/*.jsonl` also `.staging/d.jsonl`, which the same glob
    on disk leaves out (docs/operations.md, "Object stores": as on disk); a pattern spelling the dot reads them."""
    from streamprep.sources.local import expand

    _tree(tmp_path / "tree", "hidden")
    on_disk = [Path(f).relative_to(tmp_path / "tree").as_posix() for f in expand(str(tmp_path / "tree" / pattern))]
    prefix = f"s3://{BUCKET}/hidden/"
    assert [f.removeprefix(prefix) for f in expand(prefix + pattern)] == on_disk


def test_an_object_store_glob_with_a_partial_double_star_is_a_config_error(s3: Proxy, tmp_path: Path) -> None:
    """Regression: `s3://b/tree/a**.jsonl` ended the job with fsspec's bare 'ValueError: Invalid pattern: '**' can
    only be an entire path component', exit 1, naming no key."""
    from streamprep.config import ConfigError
    from streamprep.sources.local import check_entry

    _tree(tmp_path / "tree", "partial")
    with pytest.raises(ConfigError) as err:
        check_entry("datasets[0]", {"path": f"s3://{BUCKET}/partial/a**.jsonl", "storage_options": None,
                                      "format": None})
    assert str(err.value) == (f"config: 'datasets[0].path': s3://{BUCKET}/partial/a**.jsonl: Invalid pattern: '**' "
                              f"can only be an entire path component (on disk `a**` reads as `a*`: write that)")


def test_an_object_store_prefix_leaves_out_hidden_folders_as_a_directory_does(s3: Proxy, tmp_path: Path) -> None:
    """Regression: a prefix read `.staging/d.jsonl` (only a hidden last name was left out), as a directory on disk
    did; both leave out a hidden folder's files now, as docs/config.md says and a glob's `**` does."""
    from streamprep.sources.local import expand

    _tree(tmp_path / "tree", "prefix")
    on_disk = [Path(f).relative_to(tmp_path / "tree").as_posix() for f in expand(str(tmp_path / "tree"))]
    assert on_disk == ["a.jsonl", "sub/c.jsonl"]
    assert [f.removeprefix(f"s3://{BUCKET}/prefix/") for f in expand(f"s3://{BUCKET}/prefix/")] == on_disk
    assert [f.removeprefix(f"s3://{BUCKET}/prefix/") for f in expand(f"s3://{BUCKET}/prefix")] == on_disk


@pytest.mark.parametrize("pattern", ["*", ".*", "**", "s*", "**/s*", "*/", "**/"])
def test_an_object_store_glob_lists_the_folders_it_matches_as_on_disk(s3: Proxy, tmp_path: Path, pattern: str) -> None:
    """Regression: a folder an s3:// glob matched without reaching into it (`tree/*` over `tree/sub/`) was dropped
    without a word; on disk it is listed, and its reader makes it a counted reject. An object store's is listed
    with a trailing '/' (its reader knows it without a request); a folder reached into is not listed, on either."""
    from streamprep.sources.local import expand

    _tree(tmp_path / "tree", "folders")
    on_disk = [Path(f).relative_to(tmp_path / "tree").as_posix() + "/" * os.path.isdir(f)
               for f in expand(f"{tmp_path / 'tree'}/{pattern}")]  # (a Path drops a trailing '/')
    prefix = f"s3://{BUCKET}/folders/"
    assert [f.removeprefix(prefix) for f in expand(prefix + pattern)] == on_disk
    assert any(f.endswith("/") for f in on_disk) == (pattern != "**")


@pytest.mark.parametrize("pattern", ["**", "**/", "**/*", "*", "*/"])
def test_an_object_store_glob_passes_over_a_folder_of_nothing_but_its_marker_as_on_disk(s3: Proxy, tmp_path: Path,
                                                                                        pattern: str) -> None:
    """Regression: `s3://b/data/**` over `data/empty/` (a 0-byte marker alone: an S3 console's "Create folder") was
    exit 2, `config: 'datasets[0].path': s3://b/data/**: b/data/empty`, and with `optional: true` the dataset was
    skipped, its files lost; on disk an empty folder is passed over. s3fs's listing cache is dropped first: a fresh
    process lists it so."""
    from streamprep.sources.local import check_entry, expand

    local, fs = tmp_path / "tree", filesystem("s3://x")[0]
    (local / "empty").mkdir(parents=True)
    fs.pipe(f"{BUCKET}/marker/empty/", b"")
    for name in ("a.jsonl", "sub/b.jsonl"):
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(_jsonl(DOCS[:2]))
        fs.pipe(f"{BUCKET}/marker/{name}", _jsonl(DOCS[:2]))
    on_disk = [Path(f).relative_to(local).as_posix() + "/" * os.path.isdir(f) for f in expand(f"{local}/{pattern}")]
    prefix = f"s3://{BUCKET}/marker/"
    fs.invalidate_cache()
    assert [f.removeprefix(prefix) for f in expand(prefix + pattern)] == on_disk
    assert "empty/" not in on_disk and (pattern != "**" or on_disk == ["a.jsonl", "sub/b.jsonl"])
    if not pattern.endswith("/"):  # (a glob of folders alone is its own config error)
        fs.invalidate_cache()
        check_entry("datasets[0]", {"path": prefix + pattern, "storage_options": None, "format": None})


def test_a_folder_an_object_store_glob_matches_is_a_counted_reject_as_on_disk(s3: Proxy, tmp_path: Path) -> None:
    """Regression: `s3://corpora/spark/*.parquet` over Spark's `t.parquet/` folder read u.parquet alone, no reject, no
    log; on disk that folder is one counted reject naming it. A glob matching folders alone said only 'no object
    matches', without the hint of a local glob's error."""
    local = tmp_path / "spark"
    (local / "t.parquet").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist([{"text": t} for t in DOCS[:3]]), local / "t.parquet" / "part-00000.parquet")
    pq.write_table(pa.Table.from_pylist([{"text": t} for t in DOCS[3:6]]), local / "u.parquet")
    fs = filesystem("s3://x")[0]
    for f in ("t.parquet/part-00000.parquet", "u.parquet"):
        fs.pipe(f"{BUCKET}/spark/{f}", (local / f).read_bytes())
    fs.invalidate_cache()
    reasons = {}
    for where, path in (("disk", f"{local}/*.parquet"), ("s3", f"s3://{BUCKET}/spark/*.parquet")):
        run = tmp_path / where
        result = run_from_dict(base_config([{"name": "web", "path": path}], None), run_dir=run, console_log=False)
        assert result.status == "complete"
        rejects = [json.loads(x) for x in (run / "rejects" / "web.jsonl").read_text().splitlines()]
        reasons[where] = [(r["failed_check"], r["reason"]) for r in rejects]
    why = ("is a folder not read into when the dataset's files were listed, skipped (a glob's `*` names the folder, "
           "not its files: `**` reads folders at any depth; or it could not be listed then)")
    assert reasons == {"disk": [("parse", f"{local}/t.parquet {why}")],
                       "s3": [("parse", f"s3://{BUCKET}/spark/t.parquet/ {why}")]}
    assert _tokens(tmp_path / "s3") == _tokens(tmp_path / "disk")
    for path in (f"s3://{BUCKET}/spark/t*.parquet", f"s3://{BUCKET}/spark/*/"):
        with pytest.raises(ConfigError) as err:
            run_from_dict(base_config([{"name": "web", "path": path}], None), run_dir=tmp_path / "r", console_log=False)
        assert str(err.value) == f"config: 'datasets[0].path': no object matches {path}" + (
            f" (only folders do: a glob ending in `/` matches folders alone; `{path}*` reads the files in them)"
            if path.endswith("/") else " (only folders do: `**` reads folders at any depth)")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("store", ["refuses connections", pytest.param("closes them unanswered", marks=pytest.mark.slow)])
def test_a_store_that_cannot_be_reached_at_start_names_the_key_and_says_to_re_run(s3: Proxy, tmp_path: Path,
                                                                                  store: str) -> None:
    """Regression: listing a dataset on a store that cannot be reached ended the job with botocore's bare
    `EndpointConnectionError: Could not connect to the endpoint URL: "…"`, exit 1, naming neither the dataset's key
    nor what to do (docs/operations.md, "Object stores": exit 1, re-run once it is back). botocore's retries are
    turned off here (config_kwargs) to keep it short."""
    import socket

    opts: dict[str, Any] = {"config_kwargs": {"retries": {"max_attempts": 1}}}
    if store == "refuses connections":
        with socket.socket() as sock:  # a port nothing listens on
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        opts["client_kwargs"] = {"endpoint_url": f"http://127.0.0.1:{port}"}
    path, run = f"s3://{BUCKET}/unreached/*.jsonl", tmp_path / "run"
    s3.reset()
    s3.down_after = 0
    try:
        code, err = _cli(base_config([{"name": "web", "path": path, "storage_options": opts}], None), tmp_path, run,
                         120)
    finally:
        s3.reset()
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"streamprep: error: SourceError: 'datasets[0].path': cannot list {path}: the store cannot be "
                          f"reached (") and err.rstrip().endswith("); re-run once it is reachable"), err
    assert not run.exists()


def test_a_0_byte_parquet_object_is_an_empty_file_as_a_0_byte_jsonl(s3: Proxy) -> None:
    """Regression: 'unreadable Parquet file s3://…: Parquet file size is 0 bytes' (hf:// and a .jsonl: 'empty file')."""
    fs = filesystem("s3://x")[0]
    for name in ("x.parquet", "x.jsonl"):
        fs.pipe(f"{BUCKET}/empty/{name}", b"")
    fs.invalidate_cache()
    src = LocalSource(dataset({"name": "d", "path": f"s3://{BUCKET}/empty/"}))
    assert [r.reason for r, _ in src.iter_records()] == [f"empty file s3://{BUCKET}/empty/{n}"
                                                         for n in ("x.jsonl", "x.parquet")]


@pytest.mark.parametrize("name", ["z.parquet.gz", "arc.tar", "arc.jsonl.tar.gz", "x.csv"])
def test_an_optional_object_refused_by_its_type_is_the_config_error_a_local_file_gives(s3: Proxy, tmp_path: Path,
                                                                                       name: str) -> None:
    """Regression: an s3:// path naming one object of a type not read (an archive, a Parquet file compressed whole,
    an unknown type) under `optional: true` was skipped as a missing input, exit 0 with the dataset left out; the
    same file on disk is exit 2. Only an input that is not there is missing: both are the same config error."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / name).write_bytes(b"not read")
    (tmp_path / "in" / "good.jsonl").write_bytes(_jsonl(DOCS[:5]))
    _upload(tmp_path / "in", "refused")
    errors = []
    for path in (str(tmp_path / "in" / name), f"s3://{BUCKET}/refused/{name}"):
        run = tmp_path / f"run{len(errors)}"
        cfg = base_config([{"name": "main", "path": str(tmp_path / "in" / "good.jsonl")},
                           {"name": "extra", "path": path, "optional": True}], None)
        with pytest.raises(ConfigError) as err:
            run_from_dict(cfg, run_dir=run, console_log=False)
        assert not run.exists()
        assert str(err.value).startswith(f"config: 'datasets[1].path': {path}: "), err.value
        errors.append(str(err.value).replace(path, "PATH"))
    assert errors[0] == errors[1]


@pytest.mark.slow
def test_an_object_deleted_after_planning_stops_the_job_with_the_resume_s_refusal(s3: Proxy, tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """Regression: an object removed between the plan and the read of its units stopped the job with `cannot read
    input file s3://… (bytes A-B): FileNotFoundError: The specified key does not exist.`, exit 1, run.json saying
    to re-run to resume, and the re-run was then refused, exit 2, `… is gone since this run started`. The first
    failure is that refusal (needs_change); once the object is put back the same command resumes to the same bytes."""
    from streamprep import units

    (tmp_path / "in").mkdir()
    for i in range(3):
        (tmp_path / "in" / f"f{i}.jsonl").write_bytes(_jsonl(DOCS[i * 150:(i + 1) * 150]))
    _upload(tmp_path / "in", "deleted")
    victim = f"s3://{BUCKET}/deleted/f1.jsonl"
    fs = filesystem("s3://x")[0]
    real = units.plan_dataset

    def planned_then_deleted(*args: Any, **kwargs: Any) -> Any:
        plan = real(*args, **kwargs)
        fs.rm(victim)
        return plan

    monkeypatch.setattr(units, "plan_dataset", planned_then_deleted)
    cfg = base_config([{"name": "web", "path": f"s3://{BUCKET}/deleted/"}], None)
    run = tmp_path / "run"
    assert_gone_refused(cfg, run, "web", victim)
    monkeypatch.setattr(units, "plan_dataset", real)
    assert_gone_refused(cfg, run, "web", victim)
    fs.pipe(victim, (tmp_path / "in" / "f1.jsonl").read_bytes())  # the same bytes: the same ETag and size
    assert run_from_dict(cfg, run_dir=run, console_log=False).status == "complete"
    assert _tokens(run) == _job(str(tmp_path / "in"), tmp_path / "local")


@pytest.fixture(scope="module")
def http_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """(a folder, the http:// URL it is served at): `python -m http.server`'s handler, which answers a Range
    request with the whole file (no range support)."""
    import functools

    root = tmp_path_factory.mktemp("www")
    (root / "sub").mkdir()
    (root / "sub" / "a.jsonl").write_bytes(_jsonl(DOCS[:150]))

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True

        def handle_error(self, *args: Any) -> None:  # a client that stops reading the whole file it did not ask for
            pass

    server = Server(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_http_path_is_listed_at_validation_as_an_s3_one(http_dir: tuple[Path, str], tmp_path: Path) -> None:
    """Regression: only s3://, gs:// and gcs:// paths were listed while the config was validated. A missing http://
    file stopped the job after its run dir was made (exit 1, a bare `FileNotFoundError` naming no key), and so did
    a port where nothing listens (a bare `ClientConnectorError`); a folder's URL ran to "complete" with nothing read
    but a reject calling it a glob's folder; an optional one was not skipped."""
    import socket

    from streamprep.config import MissingInput, validate

    root, url = http_dir
    good = {"name": "a", "path": f"{url}/sub/a.jsonl"}
    assert validate({"datasets": [good]}, base_dir=tmp_path)["datasets"][0]["path"] == good["path"]
    assert validate({"datasets": [{"name": "g", "path": f"{url}/sub/*.jsonl"}]}, base_dir=tmp_path)["datasets"]
    missing, folder = f"{url}/nope.jsonl", f"{url}/sub/"
    cases = {missing: (MissingInput, f"config: 'datasets[0].path': no object matches {missing}"),
             folder: (ConfigError, f"config: 'datasets[0].path': {folder} names a folder, which is not listed over "
                                   f"http (its URL is a page, not a file): name a file, or a glob, `{folder}*.jsonl` "
                                   f"reads the files the page links to")}
    for path, (kind, message) in cases.items():
        run = tmp_path / "run"
        with pytest.raises(kind) as err:
            run_from_dict(base_config([{"name": "web", "path": path}], None), run_dir=run, console_log=False)
        assert str(err.value) == message and not run.exists()
    cfg = validate({"datasets": [{"name": "gone", "path": missing, "optional": True}, good]}, base_dir=tmp_path)
    assert [d["name"] for d in cfg["datasets"]] == ["a"]
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        unreached = f"http://127.0.0.1:{sock.getsockname()[1]}/a.jsonl"
    with pytest.raises(SourceError) as err:
        validate({"datasets": [{"name": "web", "path": unreached}]}, base_dir=tmp_path)
    assert str(err.value).startswith(f"'datasets[0].path': cannot list {unreached}: the store cannot be reached (")


def test_an_http_folder_url_without_its_trailing_slash_is_the_folder_s_config_error(http_dir: tuple[Path, str],
                                                                                     tmp_path: Path) -> None:
    """Regression: `…/sub` (`format: jsonl`), which the server redirects to `…/sub/` (its index page), was read as a
    file: each line of the page a parse reject, and the run "complete" (exit 0). It is the config error `…/sub/` gets, nothing
    written; a file's URL still validates."""
    from streamprep.config import validate

    root, url = http_dir
    run = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        run_from_dict(base_config([{"name": "web", "path": f"{url}/sub", "format": "jsonl", "optional": True}], None), run_dir=run,
                      console_log=False)
    assert str(err.value) == (f"config: 'datasets[0].path': {url}/sub names a folder, which is not listed over http "
                              f"(its URL is a page, not a file): name a file, or a glob, `{url}/sub/*.jsonl` reads "
                              f"the files the page links to")
    assert not run.exists()
    assert validate({"datasets": [{"name": "a", "path": f"{url}/sub/a.jsonl"}]}, base_dir=tmp_path)["datasets"]


@pytest.fixture
def status_server() -> Iterator[str]:
    """The URL of a server answering every request under `/e<status>/` with that error status."""

    class Refusing(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self.send_error(int(self.path.split("/")[1].removeprefix("e")))

        do_HEAD = do_GET

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("name", ["a.jsonl", "*.jsonl", ""])
def test_an_http_error_status_at_validation_names_the_key_as_s3_s_refusals_do(status_server: str, http_dir,
                                                                              tmp_path: Path, capsys, name: str) -> None:
    """Regression: a server answering 403, 500 or 503 when the config was checked stopped the job with aiohttp's bare
    `ClientResponseError: 403, message='Forbidden', …`, exit 1, naming no key; an optional dataset was not skipped.
    401/403/410 are a config error naming the key (exit 2; an optional dataset skipped), as s3's AccessDenied, and
    404 the missing input it was;
    429 and 5xx the store that cannot be reached (exit 1: re-run); another 4xx a config error not skipped."""
    from streamprep.cli import main
    from streamprep.config import MissingInput, validate

    good = {"name": "ok", "path": f"{http_dir[1]}/sub/a.jsonl"}
    for status in (401, 403, 404, 410, 400, 429, 500, 503):
        path = f"{status_server}/e{status}/{name}"
        try:
            validate({"datasets": [{"name": "web", "path": path, "format": "jsonl"}]}, base_dir=tmp_path)
        except (ConfigError, SourceError) as exc:
            err = exc
        else:
            raise AssertionError(f"{status}: validated")
        reason = {401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 410: "Gone", 400: "Bad Request",
                  429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable"}[status]
        optional = {"datasets": [{"name": "web", "path": path, "format": "jsonl", "optional": True}, good]}
        if status in (429, 500, 503):
            assert type(err) is SourceError and str(err) == (f"'datasets[0].path': cannot list {path}: the store "
                                                             f"cannot be reached (HTTP {status} {reason}); re-run "
                                                             f"once it is reachable")
            with pytest.raises(SourceError):
                validate(optional, base_dir=tmp_path)
            continue
        if status == 404:  # fsspec's own FileNotFoundError: no file there
            assert str(err) == f"config: 'datasets[0].path': no object matches {path}"
        else:
            assert str(err) == f"config: 'datasets[0].path': {path}: HTTP {status} {reason}", status
        if status == 400:
            assert type(err) is ConfigError
            with pytest.raises(ConfigError):
                validate(optional, base_dir=tmp_path)
        else:
            assert isinstance(err, MissingInput)
            assert [d["name"] for d in validate(optional, base_dir=tmp_path)["datasets"]] == ["ok"]
    for status, code in ((403, 2), (503, 1)):
        cfg_path = tmp_path / "c.yaml"
        cfg_path.write_text(yaml.safe_dump(base_config([{"name": "web", "path": f"{status_server}/e{status}/{name}",
                                                         "format": "jsonl"}], None)))
        run = tmp_path / f"run{status}"
        assert main(["ingest", "--config", str(cfg_path), "--run-dir", str(run)]) == code
        assert "'datasets[0].path'" in capsys.readouterr().err and not run.exists()


def test_a_file_larger_than_unit_mb_on_a_server_without_ranges_is_a_config_error(http_dir: tuple[Path, str],
                                                                                tmp_path: Path) -> None:
    """Regression: planning such a file's byte ranges stopped the job with fsspec's `ValueError: The HTTP server
    doesn't appear to support range requests…`, exit 1, which a re-run met again every time. Now it is a config
    error (exit 2) saying so and what to change; with unit_mb above its size the file is read whole."""
    root, url = http_dir
    path, size = f"{url}/sub/a.jsonl", (root / "sub" / "a.jsonl").stat().st_size
    cfg = base_config([{"name": "web", "path": path}], None)
    cfg["execution"]["unit_mb"] = 0.01
    assert size > 0.01 * (1 << 20)
    with pytest.raises(ConfigError) as err:
        run_from_dict(cfg, run_dir=tmp_path / "run", console_log=False)
    assert str(err.value) == (f"cannot plan the units of input file {path}: its server does not support range "
                              f"requests, which reading a file larger than execution.unit_mb (0.01 MB) in ranges "
                              f"needs: set unit_mb above its size ({size} bytes), or download it and read it from disk")
    assert not (tmp_path / "run").exists()  # a config error met before any output: nothing written
    assert _job(path, tmp_path / "whole") == _job(str(root / "sub" / "a.jsonl"), tmp_path / "local")


def test_a_file_over_5_mb_on_a_server_without_ranges_is_read_or_named(http_dir: tuple[Path, str],
                                                                     tmp_path: Path) -> None:
    """Regression: past fsspec's first block (5 MB) such a server's file could not be read. Its identity (head and
    tail, a server without ETag) ended every job on a bare `ValueError: The HTTP server doesn't appear to support
    range requests…`, exit 1, naming no file, so the config error's advice (unit_mb above the file's size) did not
    help; and with an ETag, a .gz or Parquet file's rest was one parse reject, the run complete, exit 0. The identity
    reads through to the tail; a file that cannot be read without ranges is a config error naming it (exit 2)."""
    import random
    import string

    root, url = http_dir
    (root / "big").mkdir()
    rng = random.Random(0)  # random words: a .gz over 5 MB; the others repeat one text (one kept, cheap to tokenize)
    noise = [" ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(20))
             for _ in range(70_000)]
    (root / "big" / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(noise), compresslevel=1))
    same = [DOCS[0]] * 13_000
    (root / "big" / "a.jsonl").write_bytes(_jsonl(same))
    pq.write_table(pa.table({"text": same}), root / "big" / "a.parquet", compression="none", use_dictionary=False)
    assert all((root / "big" / name).stat().st_size > 5 << 20 for name in ("a.jsonl", "a.jsonl.gz", "a.parquet"))
    cfg = base_config([{"name": "web", "path": f"{url}/big/a.jsonl"}], None)
    cfg["execution"]["unit_mb"] = 16  # above its size, as the planner's config error says
    result = run_from_dict(cfg, run_dir=tmp_path / "whole", console_log=False)
    assert (result.status, result.summary["kept"], result.summary["rejected"]) == ("complete", {"web": 1},
                                                                                   {"web": 12_999})
    for name in ("a.jsonl.gz", "a.parquet"):
        path = f"{url}/big/{name}"
        with pytest.raises(ConfigError) as err:
            run_from_dict(base_config([{"name": "web", "path": path}], None), run_dir=tmp_path / name,
                          console_log=False)
        assert str(err.value) == (f"cannot read input file {path}: its server does not support range requests, "
                                  f"which reading it over http needs: download it and read it from disk")


def test_a_planned_range_read_from_a_server_without_ranges_is_a_config_error_not_the_files_start(
        http_dir: tuple[Path, str]) -> None:
    """Regression: a unit's range was taken as fsspec's `cat_file` gave it, and from a server that answers a Range with
    the whole file that is the whole file: a plan saved while the file was served with ranges (another mirror or
    proxy on a resume) read the file's start for every unit, records read again and the rest never, exit 0. The
    planner's probe catches such a server only when it plans."""
    from streamprep import units
    from streamprep.sources.base import Unit

    root, url = http_dir
    path = f"{url}/sub/a.jsonl"
    size = (root / "sub" / "a.jsonl").stat().st_size
    cut = _jsonl(DOCS[:150]).index(b"\n", size // 2) + 1
    with pytest.raises(ConfigError) as err:
        list(units.read_unit(Unit("range", 0, path, "jsonl", cut, size)))
    assert str(err.value) == (f"cannot read input file {path}: its server does not support range requests, which "
                              f"reading it over http needs: download it and read it from disk")
    assert len(list(units.read_unit(Unit("range", 0, path, "jsonl", 0, size)))) == 150  # the whole file is fine


def test_a_range_unit_streamed_from_a_server_without_ranges_is_a_config_error_not_a_reject(
        http_dir: tuple[Path, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: a unit too long to fetch in one read (over MAX_LINE_BYTES, 256 MiB: a file taken whole on the
    planner's advice, unit_mb above its size) is streamed through fsspec's file, which on a server without ranges
    fails past its first block (5 MB); the unit's worker took that for a fault of the bytes: one reject of the rest,
    the run "complete", exit 0, most of the file unread. It is the config error naming the file, as for a whole file.
    (MAX_LINE_BYTES lowered to 1 MiB here, so a 13 MB file is such a unit; workers: 1 reads in this process.)"""
    from streamprep.sources import local

    root, url = http_dir
    (root / "stream").mkdir()
    (root / "stream" / "a.jsonl").write_bytes(_jsonl([DOCS[0]] * 30_000))  # past the first block and its read-ahead
    assert (root / "stream" / "a.jsonl").stat().st_size > 10 << 20
    monkeypatch.setattr(local, "MAX_LINE_BYTES", 1 << 20)
    path = f"{url}/stream/a.jsonl"
    cfg = base_config([{"name": "web", "path": path}], None)
    cfg["execution"]["unit_mb"] = 16
    with pytest.raises(ConfigError) as err:
        run_from_dict(cfg, run_dir=tmp_path / "run", console_log=False)
    assert str(err.value) == (f"cannot read input file {path}: its server does not support range requests, which "
                              f"reading it over http needs: download it and read it from disk")


@pytest.mark.parametrize("path", ["az://container/data/*.jsonl", "abfs://container/a.jsonl"])
def test_an_azure_path_without_adlfs_is_a_config_error_naming_the_key(path: str, tmp_path: Path) -> None:
    """Regression: az:// and abfs:// were not listed at validation; without adlfs the job made its run dir and
    stopped with a bare ImportError, exit 1. They are listed as every fsspec URL is: a config error."""
    import importlib.util

    from streamprep.config import validate

    if importlib.util.find_spec("adlfs") is not None:
        pytest.skip("adlfs is installed: the listing would need an Azure account")
    with pytest.raises(ConfigError) as err:
        validate({"datasets": [{"name": "web", "path": path, "optional": True}]}, base_dir=tmp_path)
    assert str(err.value) == (f"config: 'datasets[0].path': {path}: ImportError: Install adlfs to access Azure "
                              f"Datalake Gen2 and Azure Blob Storage")


def _ingested(path: str, run: Path) -> tuple[dict[str, Any], list[str], dict[str, Any]]:
    """A job over `path`: its summary, its rejects' reasons and its inputs (path: size and etag)."""
    result = run_from_dict(base_config([{"name": "web", "path": path}], None), run_dir=run, console_log=False)
    assert result.status == "complete"
    rejects = run / "rejects" / "web.jsonl"
    reasons = [json.loads(x)["reason"] for x in rejects.read_text().splitlines()] if rejects.exists() else []
    inputs = {f["path"]: (f.get("size"), f.get("etag"))
              for f in json.loads((run / "checkpoints" / "web.inputs").read_text())["files"]}
    return result.summary, reasons, inputs


def test_a_key_that_is_also_a_prefix_is_read_as_the_object_it_is(s3: Proxy, tmp_path: Path) -> None:
    """Regression: `x.jsonl` beside `x.jsonl/inner.jsonl` lost its records. Once the prefix was listed, s3fs's
    cache called it a size-0 folder: `s3://…/both/` made it one reject, `empty file s3://…/x.jsonl`, recorded in
    `<ds>.inputs` as 0 bytes; `s3://…/both/*.jsonl` listed only the folder, one reject naming `x.jsonl/`."""
    fs, prefix = filesystem("s3://x")[0], f"s3://{BUCKET}/both/"
    objects = {"a.jsonl": _jsonl(DOCS[:3]), "x.jsonl": _jsonl(DOCS[3:7]), "x.jsonl/inner.jsonl": _jsonl(DOCS[7:12])}
    for name, data in objects.items():
        fs.pipe(f"{BUCKET}/both/{name}", data)
    fs.invalidate_cache()
    want = {prefix + name: (len(data), hashlib.md5(data).hexdigest()) for name, data in objects.items()}
    summary, reasons, inputs = _ingested(prefix, tmp_path / "prefix")
    assert inputs == want and reasons == []
    assert summary["kept"]["web"] + summary["rejected"]["web"] == 12
    summary, reasons, inputs = _ingested(prefix + "*.jsonl", tmp_path / "glob")
    assert inputs == {**{k: v for k, v in want.items() if "inner" not in k}, prefix + "x.jsonl/": (None, None)}
    assert reasons == [f"{prefix}x.jsonl/ is a folder not read into when the dataset's files were listed, skipped (a "
                       f"glob's `*` names the folder, not its files: `**` reads folders at any depth; or it could "
                       f"not be listed then)"]
    assert summary["kept"]["web"] + summary["rejected"]["web"] == 3 + 4 + 1
    from streamprep.sources.local import expand

    assert expand(prefix + "**") == sorted(want)  # the object, and its folder reached into


def test_a_key_that_is_also_a_prefix_is_read_as_the_object_after_another_dataset_s_glob_listed_it(
        s3: Proxy, tmp_path: Path) -> None:
    """Regression: a dataset naming `x.jsonl` (beside `x.jsonl/inner.jsonl`) was listed as that folder once another
    dataset's `**` glob had listed it in the same process (s3fs's listing cache called it a folder): the job read
    `x.jsonl/inner.jsonl` in its place and stopped on it as "gone during the run", every re-run. Its parent's listing
    cached with it (`d/y.jsonl`) or not (`x.jsonl`, at the glob's root), the object is read."""
    from streamprep.sources.local import expand

    fs, prefix = filesystem("s3://x")[0], f"s3://{BUCKET}/stale/"
    objects = {"x.jsonl": _jsonl(DOCS[:4]), "x.jsonl/inner.jsonl": _jsonl(DOCS[4:9]), "d/y.jsonl": _jsonl(DOCS[9:12]),
               "d/y.jsonl/inner.jsonl": _jsonl(DOCS[12:20]), "w1/other.jsonl": _jsonl(DOCS[20:22])}
    for name, data in objects.items():
        fs.pipe(f"{BUCKET}/stale/{name}", data)
    fs.invalidate_cache()
    assert expand(prefix + "**/other.jsonl") == [prefix + "w1/other.jsonl"]
    assert (expand(prefix + "x.jsonl"), expand(prefix + "d/y.jsonl")) == ([prefix + "x.jsonl"], [prefix + "d/y.jsonl"])
    fs.invalidate_cache()
    cfg = base_config([{"name": "other", "path": prefix + "**/other.jsonl"}, {"name": "x", "path": prefix + "x.jsonl"},
                       {"name": "y", "path": prefix + "d/y.jsonl"}], None)
    result = run_from_dict(cfg, run_dir=tmp_path / "run", console_log=False)
    assert result.status == "complete"
    assert {ds: result.summary["kept"][ds] + result.summary["rejected"][ds] for ds in ("other", "x", "y")} == {
        "other": 2, "x": 4, "y": 3}
    for ds, name in (("x", "x.jsonl"), ("y", "d/y.jsonl")):
        files = json.loads((tmp_path / "run" / "checkpoints" / f"{ds}.inputs").read_text())["files"]
        assert [(f["path"], f["size"]) for f in files] == [(prefix + name, len(objects[name]))]


def test_a_non_empty_key_ending_in_a_slash_is_a_counted_reject_naming_it(s3: Proxy, tmp_path: Path) -> None:
    """Regression: `data.jsonl/` holding records was left out of a prefix and of a glob without a reject, as a folder
    marker is; docs/operations.md leaves out only zero-byte keys ending in `/`. No fsspec store opens it (the
    trailing `/` is dropped): it is one counted reject saying so. The marker `empty/` is still passed over."""
    from streamprep.sources.local import expand

    fs, prefix = filesystem("s3://x")[0], f"s3://{BUCKET}/slash/"
    data = _jsonl(DOCS[3:8])
    for key, body in (("a.jsonl", _jsonl(DOCS[:3])), ("data.jsonl/", data), ("empty/", b"")):
        fs.pipe(f"{BUCKET}/slash/{key}", body)
    for pattern in ("", "*.jsonl", "**", "*", "**/*.jsonl"):  # the last left it out (s3fs's cached listing)
        fs.invalidate_cache()
        assert expand(prefix + pattern) == [prefix + "a.jsonl", prefix + "data.jsonl/"], pattern
    fs.invalidate_cache()
    summary, reasons, inputs = _ingested(prefix, tmp_path / "run")
    assert reasons == [f"{prefix}data.jsonl/ is an object of {len(data)} bytes whose key ends in `/`, which names a "
                       f"folder on an object store (its reader drops the `/`), not read, skipped (copy it to a key "
                       f"without the trailing `/`)"]
    assert list(inputs) == [prefix + "a.jsonl", prefix + "data.jsonl/"]
    assert summary["kept"]["web"] + summary["rejected"]["web"] == 3 + 1


def test_a_prefix_named_with_glob_characters_is_that_prefix_as_on_disk(s3: Proxy, tmp_path: Path) -> None:
    """Regression: `s3://b/w[1]/` was read as a glob: exit 2, `no object matches s3://b/w[1]/ (only folders do: …;
    `s3://b/w[1]/*` reads the files in them)`, and that path read `w1/other.jsonl`, another folder. On disk a name
    with glob characters that exists as written is that name (docs/config.md); a prefix is too."""
    from streamprep.sources.local import check_entry, expand

    fs, local = filesystem("s3://x")[0], tmp_path / "br"
    for key in ("w[1]/a.jsonl", "w1/other.jsonl"):
        (local / key).parent.mkdir(parents=True, exist_ok=True)
        (local / key).write_bytes(_jsonl(DOCS[:3]))
        fs.pipe(f"{BUCKET}/br/{key}", _jsonl(DOCS[:3]))
    prefix = f"s3://{BUCKET}/br/"
    for name in ("w[1]/", "w[1]"):
        on_disk = [Path(f).relative_to(local).as_posix() for f in expand(f"{local}/{name}")]
        fs.invalidate_cache()
        assert [f.removeprefix(prefix) for f in expand(prefix + name)] == on_disk == ["w[1]/a.jsonl"]
        check_entry("datasets[0]", {"path": prefix + name, "storage_options": None, "format": None})
    assert expand(prefix + "w[12]/") == [prefix + "w1/"]  # no such prefix: a glob, as on disk
