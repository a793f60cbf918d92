"""The Hub's HTTP as streamprep's downloads see it: huggingface_hub's client on a transport that retries 429/5xx
and resets with backoff (`hf.RetryPolicy`, process-wide) and resumes a body cut mid-transfer.

Apart from `streamprep.sources.hf` because httpx is most of that module's import time (~40 ms of CPU) and only a
process that talks to the Hub needs it (`hf` imports this module where it installs the client): the job's driver
on local files never does. Its log lines keep the component `sources.hf`.
"""
from __future__ import annotations

import datetime
import email.utils
import re
import threading
import time
from typing import Iterator, Protocol

import httpx2

from streamprep import logs

RETRY_STATUSES = (429, 500, 502, 503, 504)
_IDEMPOTENT = ("GET", "HEAD")
_INSTALL_LOCK = threading.Lock()
_CLIENT_INSTALLED = False
log = logs.get("sources.hf")


class Policy(Protocol):
    """`hf.RetryPolicy`, as the transport reads it."""

    retries: int

    def wait(self, attempt: int, retry_after: float | None) -> float: ...


class HubRetriesExhausted(OSError):
    """A Hub request still failed after `hf_retries` retries. Not an httpx error on purpose: huggingface_hub's own
    backoff, which would start another round of retries, does not catch it. `status`: the HTTP status of the Hub's
    last answer (429/5xx), None if the connection was cut or stalled instead: the Hub answered, or was not reached."""

    status: int | None = None


class HubFileChanged(OSError):
    """A body cut mid-transfer whose rest could be of another version of the file: the resume was answered with
    another ETag than the first answer's, or there was no (strong) ETag to ask for the same version with. The bytes
    already handed over cannot be taken back, so the download fails (a re-run fetches the file whole) rather than
    splice two versions; no retries ran out, so it is not counted as given up."""


def _retry_after(value: str | None) -> float | None:
    """`Retry-After` as seconds: delay-seconds or an HTTP date (RFC 9110); None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.timezone.utc)
    return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())


def install_retrying_client(policy: Policy, current: threading.local) -> None:
    """Route huggingface_hub's HTTP through `_RetryingTransport` (once per process), retrying per `policy` and
    counting in `current.stats`. Its own backoff stays in place but does not trigger for what this transport
    retries: 429/5xx are retried (or given up) underneath it, and a body cut or stalled mid-transfer is resumed
    underneath it, so `hf_hub_download` sees one whole response. A download whose connection is refused is left to
    its loop (5 more tries, 1 s apart).

    Xet is turned off: with hf_xet installed, a file the Hub stores in Xet (most uploaded since 2025) was fetched by
    hf_xet's own client, outside this transport, so its retries were not bounded by `hf_retries` nor counted, and
    hub_stats and the Hub metrics missed its bytes. Such files are then served over plain HTTP, as before Xet."""
    global _CLIENT_INSTALLED
    with _INSTALL_LOCK:
        if _CLIENT_INSTALLED:
            return
        from huggingface_hub import constants, set_client_factory
        from huggingface_hub.utils._http import hf_request_event_hook

        def factory() -> httpx2.Client:  # huggingface_hub's default client, on the retrying transport
            return httpx2.Client(event_hooks={"request": [hf_request_event_hook]}, follow_redirects=True,
                                 timeout=None, transport=_RetryingTransport(httpx2.HTTPTransport(), policy, current))

        set_client_factory(factory)
        constants.HF_HUB_DISABLE_XET = True  # read at each download (file_download, utils._runtime.is_xet_available)
        _CLIENT_INSTALLED = True


# ECONNRESET / EPIPE (ReadError, WriteError) and a connection closed early (RemoteProtocolError). Not ConnectError:
# a Hub that cannot be reached at all falls back to the cache at once.
RESET_ERRORS = (httpx2.ReadError, httpx2.WriteError, httpx2.RemoteProtocolError)
# No byte for huggingface_hub's timeout (HF_HUB_DOWNLOAD_TIMEOUT, 10 s): a Hub that stalls. Retried here, as a reset
# is, or huggingface_hub's own loop would resume it 5 times, 1 s apart, unlogged and outside `hf_retries`. Not
# ConnectTimeout: like a refused connection, a Hub that cannot be reached falls back to the cache at once.
TIMEOUT_ERRORS = (httpx2.ReadTimeout, httpx2.WriteTimeout, httpx2.PoolTimeout)
CUT_ERRORS = RESET_ERRORS + TIMEOUT_ERRORS
CUT_WORDS = {"reset": "connection reset", "timeout": "timed out"}


def _cut(exc: Exception) -> str:
    """The cause a cut connection is retried and counted under."""
    return "timeout" if isinstance(exc, TIMEOUT_ERRORS) else "reset"


def _where(request: httpx2.Request) -> str:
    return f"{request.method} {request.url.path}"  # never the headers (the token) nor the query


class _RetryingTransport(httpx2.BaseTransport):
    """An httpx transport over another: idempotent requests answered 429/5xx (or reset or timed out before an
    answer) are retried per `policy`; a GET body cut or stalled mid-transfer is resumed with `Range: bytes=N-`
    (`_ResumingStream`).
    `current`: the thread-local naming the HubStats of the source whose request a thread makes (.stats, and
    .bodies while it downloads a data file: the sizes of the bodies received whole; .ahead while it downloads a
    file ahead of its reader)."""

    def __init__(self, inner: httpx2.BaseTransport, policy: Policy, current: threading.local):
        self.inner, self.policy, self.current = inner, policy, current

    def backoff(self, request: httpx2.Request, cause: str, attempt: int, retry_after: float | None) -> None:
        """Count, log and sleep before retry `attempt` of `request`."""
        wait = self.policy.wait(attempt, retry_after)
        stats = getattr(self.current, "stats", None)
        if stats is not None:
            stats.retried(cause)
        log.warning("hub request retried", cause=cause, request=_where(request), attempt=attempt,
                    retries=self.policy.retries, wait_s=round(wait, 2), retry_after=retry_after)
        time.sleep(wait)

    def give_up(self, request: httpx2.Request, cause: str, status: int | None = None) -> HubRetriesExhausted:
        """The error to raise; counted as given up unless the thread downloads ahead of a reader (`current.ahead`),
        whose failure the reader retries: the counter is of failures that stop the run."""
        stats = getattr(self.current, "stats", None)
        if stats is not None and not getattr(self.current, "ahead", False):
            stats.exhausted()
        exc = HubRetriesExhausted(f"{_where(request)}: {cause} after {self.policy.retries} retries")
        exc.status = status
        return exc

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = self.send(request)
        if request.method == "GET" and response.status_code in (200, 206):
            return httpx2.Response(response.status_code, headers=response.headers, extensions=response.extensions,
                                   stream=_ResumingStream(self, request, response))
        return response

    def send(self, request: httpx2.Request) -> httpx2.Response:
        """One answer to `request`, retrying 429/5xx, resets and timeouts before the status line."""
        if request.method not in _IDEMPOTENT:
            return self.inner.handle_request(request)
        attempt = 0
        while True:
            try:
                response = self.inner.handle_request(request)
            except CUT_ERRORS as exc:
                cause, retry_after = _cut(exc), None
            else:
                if response.status_code not in RETRY_STATUSES:
                    return response
                cause, retry_after = str(response.status_code), _retry_after(response.headers.get("Retry-After"))
                response.close()
            attempt += 1
            if attempt > self.policy.retries:
                raise self.give_up(request, CUT_WORDS.get(cause) or f"HTTP {cause}",
                                   int(cause) if cause.isdigit() else None)
            self.backoff(request, cause, attempt, retry_after)

    def close(self) -> None:
        self.inner.close()


def _range_start(response: httpx2.Response) -> int:
    """Where a 200/206 body starts in the file."""
    m = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", "")) if response.status_code == 206 else None
    return int(m[1]) if m else 0


class _ResumingStream(httpx2.SyncByteStream):
    """A GET body that survives connection resets and stalls: after a cut it asks for the rest (`Range: bytes=N-`,
    with `If-Range` on the ETag so a changed file is sent whole) and goes on where it stopped, if the answer has the
    same ETag (the same file); bytes a server resends anyway (a 200 instead of a 206) are skipped. Up to
    `hf_retries` cuts in a row without a new byte. A file that changed, or has no strong ETag, is `HubFileChanged`."""

    def __init__(self, transport: _RetryingTransport, request: httpx2.Request, response: httpx2.Response):
        self.transport, self.request, self.response = transport, request, response
        self.stream = response.stream

    def __iter__(self) -> Iterator[bytes]:
        at = first = _range_start(self.response)  # next byte of the file to hand over
        skip, attempt = 0, 0
        etag = self.response.headers.get("ETag")
        etag = etag if etag and not etag.startswith("W/") else None  # a weak one never proves the same bytes
        while True:
            try:
                for chunk in self.stream:
                    if skip:
                        cut, skip = min(skip, len(chunk)), skip - min(skip, len(chunk))
                        chunk = chunk[cut:]
                    if chunk:
                        at += len(chunk)
                        attempt = 0
                        yield chunk
                # a file's body, all of it: `hf.download` counts it once huggingface_hub has checked the file's size
                if (bodies := getattr(self.transport.current, "bodies", None)) is not None:
                    bodies.append(at - first)
                return
            except CUT_ERRORS as exc:
                self.stream.close()
                if not etag:
                    raise HubFileChanged(f"{_where(self.request)}: cut at byte {at}, and with no ETag the rest cannot "
                                         f"be asked for as the same file; re-run to download it whole") from None
                attempt += 1
                if attempt > self.transport.policy.retries:
                    raise self.transport.give_up(self.request, f"{CUT_WORDS[_cut(exc)]} mid-body") from None
                self.transport.backoff(self.request, _cut(exc), attempt, None)
            headers = {k: v for k, v in self.request.headers.items() if k.lower() not in ("range", "if-range")}
            headers["Range"], headers["If-Range"] = f"bytes={at}-", etag
            again = self.transport.send(httpx2.Request("GET", self.request.url, headers=headers,
                                                       extensions=self.request.extensions))
            if again.status_code not in (200, 206):
                again.close()
                raise self.transport.give_up(self.request, f"HTTP {again.status_code} when resuming at byte {at}")
            # a 200 for If-Range: another version, sent whole (a 206 without an ETag: If-Range matched)
            if (now := again.headers.get("ETag", etag if again.status_code == 206 else None)) != etag:
                again.close()
                raise HubFileChanged(f"{_where(self.request)}: the file changed between a cut at byte {at} and its "
                                     f"resume (ETag {etag}, then {now or 'none'}); re-run to download it whole")
            start = _range_start(again)
            if start > at:
                again.close()
                raise self.transport.give_up(self.request, f"resumed at byte {start}, not {at}")
            self.stream, skip = again.stream, at - start
            log.info("hub download resumed", request=_where(self.request), at_byte=at, status=again.status_code)

    def close(self) -> None:
        self.stream.close()
