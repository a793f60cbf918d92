"""Quality audit of a run: audit/audit.json, a self-contained audit/audit.html and a short text summary.

Figures come from what the run already keeps — the checkpoints' `stats` (streamprep.stats), the
receipts and the bounded rejects sample — so an audit costs a few file reads, works on a partial run
(it covers what has been processed so far) and never changes the run's outputs. Counts add up by
construction and are checked (`checks` in the JSON):

    read = kept + rejected                       (per dataset; rejected = sum of QC rejects_by_check)
    tokenized documents = kept - empty_tokens    (once every part of the dataset is tokenized)

`empty_tokens` are records QC kept that encoded to no tokens and were dropped at tokenization; they
appear under `rejects_by_check` next to the QC reasons, marked as dropped after QC.
"""
from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from streamprep import atomic, logs
from streamprep.audit.gather import VERSION, build_audit, public_audit
from streamprep.audit.render import render_html, summary_text
from streamprep.layout import RunLayout, read_json
from streamprep.status import finished_audit

if TYPE_CHECKING:
    from streamprep.executor import Executor

__all__ = ["build_audit", "render_html", "summary_from_file", "summary_text", "write_audit"]

log = logs.get("audit")
WRITER_WAIT_S = 60.0  # how long a writer waits for another's audit before writing its own anyway


def summary_from_file(run_dir: str | Path) -> str | None:
    """The summary of the finished run's audit/audit.json; None when there is none, or it is not that run's
    (status.finished_audit): a re-run of a complete run then writes the audit again rather than print a stale one."""
    layout = RunLayout(run_dir)
    path = layout.audit_json
    audit = read_json(path)
    if not isinstance(audit, dict) or audit.get("version") != VERSION \
            or not finished_audit(layout.run_dir, audit, read_json(layout.run_json)):
        return None
    return summary_text(audit, path.with_name("audit.html"))


def write_audit(run_dir: str | Path, executor: Executor | None = None) -> str:
    """Write audit/audit.json and audit/audit.html for `run_dir`; return the short text summary.

    A job passes its executor: gathering reads rejected and dropped records and tokenizes the rejects' sample, so it
    runs in a worker and the driver touches no record bytes."""
    run_dir = Path(run_dir)
    out_dir = RunLayout(run_dir).audit_dir
    with _one_writer(out_dir):
        audit, examples = executor.submit(build_audit, run_dir).result() if executor is not None \
            else build_audit(run_dir)
        public = public_audit(audit)
        # audit.json last: a stop between the two leaves the old one, which a re-run then writes again
        atomic.write_bytes(out_dir / "audit.html", render_html(audit, examples).encode("utf-8"))
        atomic.write_bytes(out_dir / "audit.json", atomic.dumps_json(public))
    return summary_text(public, out_dir / "audit.html")


@contextmanager
def _one_writer(out_dir: Path) -> Iterator[None]:
    """One audit gathered and written at a time (an advisory lock on the audit folder itself, no file of its own):
    a `streamprep audit` that gathered a partial run while the job finished wrote its "[partial run]" report over
    the job's final one. A writer waits for the other's, up to WRITER_WAIT_S (a stopped `audit` must not hold a
    job's end), then writes anyway."""
    out_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        deadline = time.monotonic() + WRITER_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("another audit is being written for too long; writing this one anyway",
                                folder=str(out_dir))
                    break
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # (releases the lock)

