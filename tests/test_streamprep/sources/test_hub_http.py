"""The Hub's retrying transport on its own, over httpx's MockTransport (the whole downloads, against a stand-in
Hub, are `test_hf.py`'s): what is retried, what is counted, when it gives up, and what its error names."""
from __future__ import annotations

import threading

import httpx2
import pytest

from streamprep.sources.hub_http import (RESET_ERRORS, HubFileChanged, HubRetriesExhausted, _RetryingTransport,
                                         _retry_after)


class Policy:
    """`hf.RetryPolicy` without the sleeping: the waits asked for are recorded."""

    def __init__(self, retries: int):
        self.retries, self.waits = retries, []

    def wait(self, attempt: int, retry_after: float | None) -> float:
        self.waits.append((attempt, retry_after))
        return 0.0


class Stats:
    def __init__(self) -> None:
        self.retries: list[str] = []
        self.gave_up = 0

    def retried(self, cause: str) -> None:
        self.retries.append(cause)

    def exhausted(self) -> None:
        self.gave_up += 1


def _transport(answers: list, retries: int = 4) -> tuple[_RetryingTransport, Policy, Stats, list[str]]:
    """A transport over a mock that gives `answers` in turn (a status, (status, Retry-After) or an exception)."""
    seen: list[str] = []

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request.method)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        status, retry_after = answer if isinstance(answer, tuple) else (answer, None)
        return httpx2.Response(status, headers={"Retry-After": retry_after} if retry_after else {}, content=b"body")

    current, stats, policy = threading.local(), Stats(), Policy(retries)
    current.stats = stats
    return _RetryingTransport(httpx2.MockTransport(handler), policy, current), policy, stats, seen


def test_429_and_5xx_and_resets_are_retried_and_counted_by_cause() -> None:
    reset = RESET_ERRORS[0]("connection reset by peer")
    transport, policy, stats, seen = _transport([(429, "7"), 503, reset, 200])
    with httpx2.Client(transport=transport) as client:
        response = client.get("https://hub.test/api/datasets/org/name?token=x")
    assert response.status_code == 200 and response.content == b"body"
    assert seen == ["GET"] * 4 and stats.retries == ["429", "503", "reset"] and stats.gave_up == 0
    assert policy.waits == [(1, 7.0), (2, None), (3, None)]  # Retry-After read as seconds


def test_it_gives_up_after_the_policy_s_retries_naming_the_request_but_not_its_query() -> None:
    transport, _, stats, seen = _transport([503, 503, 503], retries=2)
    with httpx2.Client(transport=transport) as client, pytest.raises(HubRetriesExhausted) as err:
        client.get("https://hub.test/datasets/org/name/resolve/main/x.jsonl?token=secret")
    assert str(err.value) == "GET /datasets/org/name/resolve/main/x.jsonl: HTTP 503 after 2 retries"
    assert len(seen) == 3 and stats.retries == ["503", "503"] and stats.gave_up == 1


def test_a_request_that_is_not_idempotent_is_sent_once() -> None:
    transport, _, stats, seen = _transport([503])
    with httpx2.Client(transport=transport) as client:
        assert client.post("https://hub.test/api/x", content=b"{}").status_code == 503
    assert seen == ["POST"] and stats.retries == []


def test_retry_after_reads_seconds_or_an_http_date() -> None:
    assert _retry_after("7") == 7.0 and _retry_after(" 7 ") == 7.0
    assert _retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # in the past: no wait
    assert _retry_after(None) is None and _retry_after("") is None and _retry_after("soon") is None


def test_a_request_that_times_out_is_retried_and_counted_as_a_timeout() -> None:
    """Regression: a Hub that stalled (no byte for huggingface_hub's 10 s) was left to huggingface_hub's own loop,
    5 resumes 1 s apart, outside `hf_retries`, unlogged and uncounted."""
    transport, policy, stats, seen = _transport([httpx2.ReadTimeout("timed out"), 200])
    with httpx2.Client(transport=transport) as client:
        assert client.get("https://hub.test/api/datasets/org/name").content == b"body"
    assert seen == ["GET", "GET"] and stats.retries == ["timeout"] and policy.waits == [(1, None)]
    transport, _, stats, _ = _transport([httpx2.ReadTimeout("timed out")] * 3, retries=2)
    with httpx2.Client(transport=transport) as client, pytest.raises(HubRetriesExhausted) as err:
        client.get("https://hub.test/datasets/org/name/resolve/main/x.jsonl")
    assert str(err.value) == "GET /datasets/org/name/resolve/main/x.jsonl: timed out after 2 retries"
    assert stats.retries == ["timeout", "timeout"] and stats.gave_up == 1


def test_a_body_that_stalls_mid_transfer_is_resumed_where_it_stopped() -> None:
    """The first answer's body stops after 4 bytes with a read timeout; the transport asks for the rest with a
    Range and hands over the whole file once."""
    data = b"0123456789"
    ranges: list[str | None] = []

    class Stalling(httpx2.SyncByteStream):
        def __iter__(self):
            yield data[:4]
            raise httpx2.ReadTimeout("timed out")

    def handler(request: httpx2.Request) -> httpx2.Response:
        ranges.append(request.headers.get("Range"))
        if len(ranges) == 1:
            return httpx2.Response(200, headers={"ETag": '"e"'}, stream=Stalling())
        start = int(request.headers["Range"].removeprefix("bytes=").rstrip("-"))
        return httpx2.Response(206, headers={"Content-Range": f"bytes {start}-9/10"}, content=data[start:])

    current, stats, policy = threading.local(), Stats(), Policy(4)
    current.stats = stats
    with httpx2.Client(transport=_RetryingTransport(httpx2.MockTransport(handler), policy, current)) as client:
        assert client.get("https://hub.test/datasets/org/name/resolve/main/x.jsonl").content == data
    assert ranges == [None, "bytes=4-"] and stats.retries == ["timeout"]


@pytest.mark.parametrize("first, resumed, handed_over", [
    ('"e"', (200, '"e"'), b"0123456789"),  # a server that ignores Range, same file: its resent bytes are skipped
    ('"e"', (206, None), b"0123456789"),   # a 206 without an ETag: If-Range matched
    ('"e"', (200, '"f"'), "the file changed between a cut at byte 4 and its resume (ETag \"e\", then \"f\")"),
    ('"e"', (200, None), "the file changed between a cut at byte 4 and its resume (ETag \"e\", then none)"),
    ('"e"', (206, '"f"'), "the file changed between a cut at byte 4 and its resume (ETag \"e\", then \"f\")"),
    (None, (200, None), "cut at byte 4, and with no ETag the rest cannot be asked for as the same file"),
    ('W/"e"', (200, 'W/"e"'), "cut at byte 4, and with no ETag the rest cannot be asked for as the same file"),
])
def test_a_resume_goes_on_only_with_the_same_version_of_the_file(first, resumed, handed_over) -> None:
    """Regression: any 200 to a resume was read as "the server ignored Range" and its first bytes skipped, so a file
    that changed between the cut and the resume (If-Range answered with the whole new version) was spliced, half
    old and half new. The rest is used only if its ETag is the first answer's (a strong one, or no resume is asked
    for); else `HubFileChanged`, not counted as given up."""
    data = b"0123456789"  # what a changed file's answer holds does not matter: its ETag says it changed
    sent: list[dict] = []

    class Cut(httpx2.SyncByteStream):
        def __iter__(self):
            yield data[:4]
            raise RESET_ERRORS[0]("connection reset by peer")

    def handler(request: httpx2.Request) -> httpx2.Response:
        sent.append({k: request.headers.get(k) for k in ("Range", "If-Range")})
        if len(sent) == 1:
            return httpx2.Response(200, headers={"ETag": first} if first else {}, stream=Cut())
        status, etag = resumed
        headers = {"ETag": etag} if etag else {}
        if status == 206:
            headers["Content-Range"] = "bytes 4-9/10"
        return httpx2.Response(status, headers=headers, content=data[4 if status == 206 else 0:])

    current, stats, policy = threading.local(), Stats(), Policy(4)
    current.stats = stats
    with httpx2.Client(transport=_RetryingTransport(httpx2.MockTransport(handler), policy, current)) as client:
        if isinstance(handed_over, bytes):
            assert client.get("https://hub.test/datasets/org/name/resolve/main/x.jsonl").content == handed_over
        else:
            with pytest.raises(HubFileChanged) as err:
                client.get("https://hub.test/datasets/org/name/resolve/main/x.jsonl")
            assert str(err.value) == (f"GET /datasets/org/name/resolve/main/x.jsonl: {handed_over}; re-run to "
                                      f"download it whole")
    asked = [] if first in (None, 'W/"e"') else [{"Range": "bytes=4-", "If-Range": first}]
    assert sent == [{"Range": None, "If-Range": None}, *asked] and stats.gave_up == 0
