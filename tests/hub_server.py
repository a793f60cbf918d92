"""A loopback stand-in for the Hugging Face Hub: just the endpoints `huggingface_hub` 2.x calls to list and download
the files of a dataset repo.

- `GET  /api/datasets/{org}/{name}/revision/{rev}` repo info: `id`, `sha`, `siblings` (with sizes when `?blobs=true`)
- `GET  /api/datasets/{org}/{name}/tree/{rev}[/{path}]` tree listing (used by `snapshot_download`)
- `HEAD /datasets/{org}/{name}/resolve/{rev}/{path}` metadata: `X-Repo-Commit`, `ETag`, `Content-Length`
  (no `X-Xet-*` headers, so the client takes the plain HTTP download path, unless `xet` is set: then each file
  names a Xet hash and a token route this server does not serve, as the Hub names a file stored in Xet)
- `GET  /datasets/{org}/{name}/resolve/{rev}/{path}` the bytes (honours a simple `Range: bytes=N-`, and `If-Range`:
  the whole file, 200, when it names another ETag than the file's)
- `GET  /api/agent-harnesses` an empty registry (huggingface_hub fetches it for its user agent unless
  telemetry is disabled)

Errors carry the Hub's `X-Error-Code` header (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`), which
`huggingface_hub` turns into its typed exceptions. Every other path is a loud 404, recorded in `unknown`.
The server counts requests per (method, path) and the most requests it ever had in flight at once; `delay`
makes each file transfer (HEAD and GET on `/resolve/`) sleep, so parallel downloads overlap visibly; `rate`
(bytes/s, per response) throttles file bodies, so a test can watch a download still running. `bytes_sent` counts
file body bytes written.

Faults, for a Hub that pushes back: `fault_cycle` is applied to the GETs of data files (`/resolve/`, README.md
excepted), the n-th such GET getting `fault_cycle[n % len]`; `api_faults` are consumed in order by the API calls and
HEADs. A fault is None (served normally), `"429"` (with `Retry-After: retry_after`), `"503"`, `"401"`, `"403"`,
`"404-revision"` (the Hub's "revision not found", as a hiccup when the commit is there), `"reset"`: the
headers and half the body are sent, then the connection is reset (RST), `"reset-edit"`: a `"reset"` after which the
file's bytes in its commit become `edits[path]` (a mirror whose file changed between a cut and its resume),
`"short"`: a body 100 bytes short, with a Content-Length that says so (huggingface_hub's size check, against the
HEAD's, fails), or `"hang"`: no answer at all until `stop()` (a Hub that stalls). `faults_served` counts the
faults served by kind; `ranges` lists (path, start byte) of every `Range` GET; `authorizations` the
`Authorization` headers seen. A repo in `gated` is served as the Hub serves a gated repo to who has not accepted its
terms: its listing and README.md to anyone, each other file refused (HEAD and GET), 401 without a token, 403 with one,
`X-Error-Code: GatedRepo`.
"""
from __future__ import annotations

import hashlib
import json
import re
import socket
import struct
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

API_RE = re.compile(r"^/api/datasets/(?P<repo>[^/]+/[^/]+)/(?P<kind>revision|tree)/(?P<rest>.+)$")
RESOLVE_RE = re.compile(r"^/datasets/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<path>.+)$")


@dataclass
class Repo:
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # sha -> {path: bytes}
    refs: dict[str, str] = field(default_factory=dict)                   # branch -> sha

    def resolve(self, rev: str) -> str | None:
        rev = unquote(rev)
        if rev in self.refs:
            return self.refs[rev]
        return rev if rev in self.commits else None


def git_blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """Serves dataset repos added with `add_dataset` on 127.0.0.1 (random port) until `stop()`."""

    def __init__(self, delay: float = 0.0, rate: float = 0.0):
        self.delay = delay
        self.rate = rate
        self.bytes_sent = 0
        self.repos: dict[str, Repo] = {}
        self.requests: Counter[tuple[str, str]] = Counter()
        self.unknown: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.fault_cycle: list[str | None] = []
        self.api_faults: list[str] = []
        self.retry_after = "1"
        self.edits: dict[str, bytes] = {}  # path -> new bytes, put in place by a "reset-edit" fault
        self.faults_served: Counter[str] = Counter()
        self.ranges: list[tuple[str, int]] = []
        self.authorizations: set[str] = set()
        self.gated: set[str] = set()  # repo ids whose files but README.md are refused
        self.xet = False  # name each file's Xet hash and token route, as the Hub does for a file stored in Xet
        self._data_gets = 0
        self._stopped = threading.Event()  # ends the requests a `"hang"` fault holds

    def _next_fault(self, path: str, head: bool) -> str | None:
        with self._lock:
            if RESOLVE_RE.match(path) and not head and not path.endswith("/README.md"):
                if not self.fault_cycle:
                    return None
                fault = self.fault_cycle[self._data_gets % len(self.fault_cycle)]
                self._data_gets += 1
            else:
                fault = self.api_faults.pop(0) if self.api_faults else None
            if fault:
                self.faults_served[fault] += 1
            return fault

    # ---- content ---------------------------------------------------------------------------------
    def add_dataset(self, repo_id: str, files: dict[str, bytes], branch: str = "main") -> str:
        """Commit `files` (the whole tree) to `branch` of `repo_id`; returns the new commit sha."""
        repo = self.repos.setdefault(repo_id, Repo())
        h = hashlib.sha1(repo_id.encode())
        for path in sorted(files):
            h.update(path.encode() + b"\0" + git_blob_sha(files[path]).encode())
        h.update(str(len(repo.commits)).encode())
        sha = h.hexdigest()
        repo.commits[sha] = dict(files)
        repo.refs[branch] = sha
        return sha

    def sha_of(self, repo_id: str, branch: str = "main") -> str:
        return self.repos[repo_id].refs[branch]

    def file_requests(self, method: str = "GET") -> Counter[str]:
        """Requests per repo file path for `method` on `/resolve/` URLs."""
        out: Counter[str] = Counter()
        for (m, path), n in self.requests.items():
            match = RESOLVE_RE.match(path)
            if m == method and match:
                out[unquote(match["path"])] += n
        return out

    def api_requests(self) -> int:
        return sum(n for (_, path), n in self.requests.items() if path.startswith("/api/"))

    def reset_counts(self) -> None:
        with self._lock:
            self.requests.clear()
            self.max_in_flight = 0
            self.bytes_sent = 0

    # ---- life cycle ------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> "FakeHub":
        hub = self

        class Handler(_Handler):
            server_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None


class _Handler(BaseHTTPRequestHandler):
    server_hub: FakeHub
    fault: str | None = None
    protocol_version = "HTTP/1.0"  # one request per connection: nothing lingers after stop()

    def log_message(self, fmt: str, *args) -> None:  # quiet; unknown paths are reported in do_*
        pass

    def do_GET(self) -> None:
        self._dispatch(head=False)

    def do_HEAD(self) -> None:
        self._dispatch(head=True)

    def _dispatch(self, head: bool) -> None:
        hub = self.server_hub
        url = urlsplit(self.path)
        with hub._lock:
            hub.requests[(self.command, url.path)] += 1
            if auth := self.headers.get("Authorization"):
                hub.authorizations.add(auth)
        fault = hub._next_fault(url.path, head) if url.path != "/api/agent-harnesses" else None
        if fault == "hang":
            hub._stopped.wait()
            return
        if fault in ("401", "403"):  # as the Hub refuses a token it does not accept, or one without access
            self._send(int(fault), b'{"error": "Invalid credentials in Authorization header"}',
                       {"Content-Type": "application/json", "X-Error-Message": "Invalid credentials in Authorization header"})
            return
        if fault == "404-revision":  # the Hub's answer for a commit it does not have, whether or not it has it
            self._error(404, "RevisionNotFound", "Invalid rev id")
            return
        if fault in ("429", "503"):
            self._send(int(fault), b'{"error": "slow down"}', {"Content-Type": "application/json",
                                                               **({"Retry-After": hub.retry_after} if fault == "429" else {})})
            return
        self.fault = fault
        if match := RESOLVE_RE.match(url.path):
            # in flight = waiting for its answer: counted only before the response is written, since a
            # client may start its next request while this thread is still finishing the last one
            with hub._lock:
                hub.in_flight += 1
                hub.max_in_flight = max(hub.max_in_flight, hub.in_flight)
            try:
                if hub.delay:
                    time.sleep(hub.delay)
            finally:
                with hub._lock:
                    hub.in_flight -= 1
            self._resolve(match["repo"], match["rev"], unquote(match["path"]), head)
        elif url.path == "/api/agent-harnesses" and not head:
            self._send(200, b'{"standardEnvVars": [], "harnesses": {}}', {"Content-Type": "application/json"})
        elif (match := API_RE.match(url.path)) and not head:
            self._api(match["repo"], match["kind"], match["rest"], parse_qs(url.query))
        else:
            hub.unknown.append(f"{self.command} {self.path}")
            print(f"fake hub: unknown request {self.command} {self.path}", file=sys.stderr)
            self._send(404, b'{"error": "unknown endpoint in the fake hub"}', {"Content-Type": "application/json"})

    # ---- endpoints -------------------------------------------------------------------------------
    def _repo(self, repo_id: str) -> Repo | None:
        repo = self.server_hub.repos.get(repo_id)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
        return repo

    def _api(self, repo_id: str, kind: str, rest: str, query: dict) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        rev, _, sub = rest.partition("/") if kind == "tree" else (rest, "", "")
        sha = repo.resolve(rev)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {unquote(rev)}")
            return
        files = repo.commits[sha]
        if kind == "revision":
            with_sizes = query.get("blobs", ["false"])[0].lower() in ("1", "true")
            siblings = [{"rfilename": p, **({"size": len(files[p]), "blobId": git_blob_sha(files[p])} if with_sizes else {})}
                        for p in sorted(files)]
            body = {"id": repo_id, "sha": sha, "private": False, "disabled": False, "gated": False,
                    "lastModified": "2024-01-01T00:00:00.000Z", "tags": [], "siblings": siblings}
        else:
            prefix = unquote(sub).strip("/")
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            body = []
            for p in sorted(files):
                if prefix and not p.startswith(prefix + "/"):
                    continue
                rel = p[len(prefix) + 1:] if prefix else p
                if not recursive and "/" in rel:
                    continue
                body.append({"type": "file", "oid": git_blob_sha(files[p]), "size": len(files[p]), "path": p})
        self._send(200, json.dumps(body).encode(), {"Content-Type": "application/json"})

    def _resolve(self, repo_id: str, rev: str, path: str, head: bool) -> None:
        repo = self._repo(repo_id)
        if repo is None:
            return
        sha = repo.resolve(rev)
        if sha is None:
            self._error(404, "RevisionNotFound", f"Invalid rev id: {unquote(rev)}")
            return
        if repo_id in self.server_hub.gated and path != "README.md":
            self._error(403 if self.headers.get("Authorization") else 401, "GatedRepo",
                        f"Access to dataset {repo_id} is restricted. You must have access to it and be authenticated.")
            return
        data = repo.commits[sha].get(path)
        if data is None:
            self._error(404, "EntryNotFound", f"{path} does not exist at {sha}", {"X-Repo-Commit": sha})
            return
        headers = {"X-Repo-Commit": sha, "ETag": f'"{git_blob_sha(data)}"', "Accept-Ranges": "bytes",
                   "Content-Type": "application/octet-stream"}
        if self.server_hub.xet:  # a route this server does not serve: a client that takes it fails
            headers["X-Xet-Hash"] = hashlib.sha256(data).hexdigest()
            headers["X-Xet-Refresh-Route"] = f"/api/datasets/{repo_id}/xet-read-token/{sha}"
        status, body = 200, data
        rng = self.headers.get("Range")
        if self.headers.get("If-Range", headers["ETag"]) != headers["ETag"]:
            rng = None  # the file changed since the client's first answer: sent whole
        if rng and (m := re.fullmatch(r"bytes=(\d+)-", rng.strip())) and not head:
            start = int(m[1])
            with self.server_hub._lock:
                self.server_hub.ranges.append((path, start))
            status, body = 206, data[start:]
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if self.fault == "short" and not head:
            body = body[:-100]
        if self.fault == "reset-edit" and not head:  # before the cut: the resume always finds the new bytes
            repo.commits[sha][path] = self.server_hub.edits[path]
        self._send(status, b"" if head else body, headers, length=len(data) if head else len(body), rate=True,
                   reset=self.fault in ("reset", "reset-edit"))

    # ---- plumbing --------------------------------------------------------------------------------
    def _error(self, status: int, code: str, message: str, extra: dict | None = None) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, body, {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message,
                                  **(extra or {})})

    def _send(self, status: int, body: bytes, headers: dict[str, str], length: int | None = None,
              rate: bool = False, reset: bool = False) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body) if length is None else length))
        self.end_headers()
        if not body or self.command == "HEAD":
            return
        hub = self.server_hub
        if reset:  # half the body, then a TCP reset (SO_LINGER 0): the client reads ECONNRESET mid-body
            self.wfile.write(body[:len(body) // 2])
            self.wfile.flush()
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            return
        step = max(1, int(hub.rate / 20)) if rate and hub.rate else len(body)  # throttled: 20 writes a second
        try:
            for at in range(0, len(body), step):
                chunk = body[at:at + step]
                self.wfile.write(chunk)
                if rate:
                    with hub._lock:
                        hub.bytes_sent += len(chunk)
                if step < len(body):
                    time.sleep(len(chunk) / hub.rate)
        except (BrokenPipeError, ConnectionResetError):  # the client went away mid-transfer
            pass
