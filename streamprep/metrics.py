"""Prometheus metrics of a running job: `execution.metrics_port` (off by default; 0 = any free port, logged).

Nothing is counted for the metrics: a custom collector reads the run's saved files at scrape time and turns them
into series, so ingest needs no per-record metric calls and the numbers are those of `streamprep status --json`.

The interface the collector depends on is one callable, `snapshot() -> dict`, returning the shape of
`streamprep.status.run_status` (what `status --json` prints):

- `datasets[name]["ingest"]`: `read`, `kept`, `rejected`, `rejects_by_check` ({failed_check: n}), `bytes` (kept
  lines' bytes: sealed parts and the open part's staged lines), `bytes_in` (source bytes passed, or None),
  `parts_sealed`, `done`
- `datasets[name]["tokenize"]`: `shards_done`, `shards_pending`, `tokens`, `documents`, `empty_tokens`
- `workers`; `hub`: None or {`retries`: {cause: n}, `gave_up`, `files`, `bytes`}; `run_id`, `name`, `stage`

`job_snapshot` builds it for a running job from `run_status(run_dir, hub=...)`: each dataset's saved checkpoint
(never the in-memory state, which runs up to a unit ahead of it), its receipts, and the run's Hub counters. A
counter then never shows more than a resume after a crash (kill -9) carries over, so it never goes down across
one: Prometheus would take the drop for a counter reset and `increase()` would count the difference twice. See
docs/operations.md for the series.

prometheus_client (~25 ms of imports, its HTTP server included) is imported only once a job serves metrics: the
endpoint is off by default, and every command and job imports this module.
"""
from __future__ import annotations

import contextlib
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from streamprep import logs
from streamprep.config import ConfigError
from streamprep.layout import NotARunDir, RunLayout
from streamprep.sources.hf import hub_stats
from streamprep.status import run_status

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from streamprep.config import DatasetConfig, ExecutionConfig

log = logs.get("metrics")
Snapshot = Callable[[], dict[str, Any]]

# (series, help, key in datasets[name]["ingest"|"tokenize"], unit); all counters, labelled by dataset. A series with
# a unit ends with it, before `_total` (Prometheus' naming rules; OpenMetrics' `# UNIT` requires it)
_PER_DATASET = (
    ("streamprep_records_read", "Items taken from the source (records and unreadable items).", "ingest", "read", ""),
    ("streamprep_records_kept", "Records that passed every quality gate.", "ingest", "kept", ""),
    ("streamprep_records_rejected", "Records rejected (any gate).", "ingest", "rejected", ""),
    ("streamprep_source_read_bytes", "Source bytes the ingest position has passed.", "ingest", "bytes_in", "bytes"),
    ("streamprep_ingest_written_bytes", ("Bytes of kept records: sealed ingest parts and the open part's "
                                         "staged lines."), "ingest", "bytes", "bytes"),
    ("streamprep_parts_sealed", "Ingest parts sealed (complete, handed to tokenization).", "ingest", "parts_sealed",
     ""),
    ("streamprep_parts_tokenized", "Sealed parts tokenized into .bin/.idx shards.", "tokenize", "shards_done", ""),
    ("streamprep_tokens_written", "Tokens written to .bin shards (EOD included).", "tokenize", "tokens", ""),
    ("streamprep_documents_tokenized", "Documents written to .bin shards.", "tokenize", "documents", ""),
)


class JobCollector:
    """Series from `snapshot()` at each scrape (see the module docstring for the interface); a
    prometheus_client `Collector` (a protocol: `collect()` is all it asks for)."""

    def __init__(self, snapshot: Snapshot):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily  # only once serving (module doc)

        st = self.snapshot()
        datasets: Mapping[str, Any] = st.get("datasets") or {}
        for name, doc, section, key, unit in _PER_DATASET:
            fam = CounterMetricFamily(name, doc, labels=["dataset"], unit=unit)
            for ds, d in datasets.items():
                value = d[section].get(key)
                if value is not None:
                    fam.add_metric([ds], value)
            yield fam
        by_check = CounterMetricFamily("streamprep_records_rejected_by_check",
                                       "Records rejected, by the gate that rejected them (failed_check).",
                                       labels=["dataset", "check"])
        for ds, d in datasets.items():
            for check, n in sorted(d["ingest"].get("rejects_by_check", {}).items()):
                by_check.add_metric([ds, check], n)
        yield by_check
        done = GaugeMetricFamily("streamprep_dataset_ingest_done", "1 once the dataset is fully ingested.",
                                 labels=["dataset"])
        queue = GaugeMetricFamily("streamprep_queue_depth", "Work waiting: sealed parts not yet tokenized.",
                                  labels=["queue", "dataset"])
        for ds, d in datasets.items():
            done.add_metric([ds], 1.0 if d["ingest"].get("done") else 0.0)
            queue.add_metric(["tokenize", ds], d["tokenize"].get("shards_pending", 0))
        yield done
        yield queue
        yield GaugeMetricFamily("streamprep_workers", "Worker processes (execution.workers, resolved).",
                                value=st.get("workers") or 0)
        info = GaugeMetricFamily("streamprep_run_info", "Always 1; the run's identity and current stage.",
                                 labels=["run_id", "name", "stage"])
        info.add_metric([str(st.get("run_id")), str(st.get("name")), str(st.get("stage"))], 1.0)
        yield info
        hub = st.get("hub") or {}
        retries = CounterMetricFamily("streamprep_hub_retries", "Hub requests retried, by cause (HTTP status, "
                                      "'reset': connection reset or cut mid-body, or 'timeout': no byte for "
                                      "HF_HUB_DOWNLOAD_TIMEOUT).", labels=["cause"])
        for cause, n in sorted((hub.get("retries") or {}).items()):
            retries.add_metric([cause], n)
        yield retries
        yield CounterMetricFamily("streamprep_hub_retries_exhausted", "Hub requests that failed after hf_retries.",
                                  value=hub.get("gave_up", 0))
        yield CounterMetricFamily("streamprep_hub_files_downloaded", "Data files downloaded from the Hub.",
                                  value=hub.get("files", 0))
        yield CounterMetricFamily("streamprep_hub_downloaded_bytes", "Bytes of data files downloaded from the Hub.",
                                  value=hub.get("bytes", 0), unit="bytes")


def job_snapshot(run_dir: Path, hub: Callable[[], dict[str, Any]] | None) -> Snapshot:
    """`snapshot()` for a running job: the run's saved checkpoints and receipts, as `status --json` reads them;
    `hub()` gives the Hub counters (None: the run reads no hf:// dataset)."""
    def snapshot() -> dict[str, Any]:
        try:
            return run_status(run_dir, hub=hub() if hub else None)
        except NotARunDir:  # the endpoint is up a moment before the job writes run.json
            return {"datasets": {}, "workers": None, "hub": hub() if hub else None, "stage": "starting"}

    return snapshot


class MetricsServer:
    """The HTTP endpoint, from `serve()` until `stop()` (the job stops it when it ends, however it ends)."""

    def __init__(self, port: int, snapshot: Snapshot, addr: str = "0.0.0.0"):
        from prometheus_client import CollectorRegistry, ProcessCollector, start_http_server  # only once serving

        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(JobCollector(snapshot))
        ProcessCollector(registry=self.registry)
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=self.registry)
        except OSError as exc:  # taken since `check_port` (the job has begun writing by now)
            raise _unbound(addr, port, exc) from None
        self.port = int(self._server.server_address[1])
        log.info("metrics server listening", url=f"http://{addr}:{self.port}/metrics", port=self.port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
        log.info("metrics server stopped", port=self.port)


def _unbound(addr: str, port: int, exc: OSError) -> ConfigError:
    return ConfigError(f"execution.metrics_port: cannot listen on {addr}:{port} ({exc.strerror or exc})")


def check_port(execution: ExecutionConfig, addr: str = "0.0.0.0") -> None:
    """Bind the configured port once and let it go, before the job creates its run dir: a port in use is then exit 2
    with nothing written. The server binds it again once the run's log exists, to log where it listens."""
    port = execution.metrics_port
    if not port:  # off, or any free port
        return
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds it
        try:
            probe.bind((addr, port))
            probe.listen()
        except OSError as exc:
            raise _unbound(addr, port, exc) from None


@contextlib.contextmanager
def serving(execution: ExecutionConfig, run_dir: Path,
            datasets: Sequence[DatasetConfig]) -> Iterator[MetricsServer | None]:
    """The endpoint for the duration of a job when `execution.metrics_port` is set; nothing is left listening
    after it. A port that cannot be bound is a ConfigError (exit 2); `check_port` finds it before the run dir exists."""
    if execution.metrics_port is None:
        yield None
        return
    hub = None
    if any(d.path.startswith("hf://") for d in datasets):
        hub = hub_stats(RunLayout(run_dir).hf_cache).snapshot
    server = MetricsServer(execution.metrics_port, job_snapshot(run_dir, hub))
    try:
        yield server
    finally:
        server.stop()
