"""structlog set-up: human lines on the console, JSON lines in a size-rotated run log.

Every line carries `timestamp`, `level` and `component` (the logger name: ingest, tokenize, exports …).

`import structlog` imports rich (~70 ms, a third of a command's imports) only to render exceptions, and our
lines carry none. So structlog is imported with rich hidden, unless something already loaded either, and a
line that does carry an exception loads rich first (`_load_rich`): structlog's renderers look rich up at each
call, so every byte they write, console and file, is what they write when rich is imported up front.
"""
from __future__ import annotations

import logging
import logging.handlers
import os
import pickle
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TextIO

_HIDE_RICH = "structlog" not in sys.modules and "rich" not in sys.modules
if _HIDE_RICH:
    sys.modules["rich"] = None  # type: ignore[assignment]  # `import rich` now fails fast
try:
    import structlog
finally:
    if _HIDE_RICH:
        del sys.modules["rich"]

from streamprep.config import printable
from streamprep.layout import LOG_NAME, RunLayout

MAX_BYTES = 5 * 1024 * 1024
BACKUPS = 5
WORKER_EVENTS_KEPT = 1000  # a worker's events kept between two answers; past that they are counted, not kept
LEVELS = ("debug", "info", "warning", "error", "critical")

_shared = [
    structlog.stdlib.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def _load_rich() -> None:
    """Give structlog the rich its import skipped (see the module docstring); a no-op once done or without rich."""
    if structlog.tracebacks.rich is not None:
        return
    try:  # rich only here: ~70 ms of imports, paid by the first line that carries an exception
        import rich
        import rich.pretty
        from rich.console import Console
        from rich.traceback import Traceback
    except ImportError:  # not installed: structlog's plain renderers, as without rich
        return
    structlog.tracebacks.rich = structlog.dev.rich = rich
    structlog.dev.Console, structlog.dev.Traceback = Console, Traceback


def _rich_for_exceptions(_, __, event_dict: dict) -> dict:
    if event_dict.get("exc_info"):
        _load_rich()
    return event_dict


def _console_exception(colors: bool) -> Callable[[TextIO, Any], None]:
    """The exception renderer structlog's ConsoleRenderer picks by default when rich is installed."""
    def render(sio: TextIO, exc_info: Any) -> None:
        _load_rich()
        if structlog.dev.rich is None:
            structlog.dev.plain_traceback(sio, exc_info)
        else:
            structlog.dev.RichTracebackFormatter(color_system="truecolor" if colors else None)(sio, exc_info)
    return render


def _printable_values(_, __, event_dict: dict) -> dict:
    """The console's: a text value holding control characters (a run dir named with ESC or BEL) reached the terminal
    raw, as a control sequence; each is escaped as an error line escapes it, a traceback's lines kept (the run log's
    JSON escapes them already; any other value the renderer shows as its repr)."""
    for key, value in event_dict.items():
        if isinstance(value, str) and not value.isprintable():
            event_dict[key] = "\n".join(map(printable, value.split("\n"))) if key in ("exception", "stack") \
                else printable(value)
    return event_dict


def _component(_, __, event_dict: dict) -> dict:
    record = event_dict.get("_record")
    event_dict.setdefault("component", record.name.removeprefix("streamprep.") if record else "streamprep")
    return event_dict


def configure(run_dir: Path | None = None, level: str = "INFO", console: bool = True,
              max_bytes: int = MAX_BYTES, backups: int = BACKUPS) -> None:
    """(Re)configure logging for this process; with `run_dir`, also log to RUN_DIR/logs/streamprep.log."""
    structlog.configure(
        processors=[structlog.stdlib.filter_by_level, *_shared,
                    structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger("streamprep")
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    root.setLevel(level)
    root.propagate = False
    pre = [*_shared, _component]
    if console:
        colors = sys.stderr.isatty()
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, _printable_values,
                        structlog.dev.ConsoleRenderer(colors=colors, pad_event_to=0,
                                                      exception_formatter=_console_exception(colors))],
            foreign_pre_chain=pre))
        root.addHandler(h)
    if run_dir is not None:
        log_dir = RunLayout(run_dir).logs_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        fh = _RunLog(log_dir / LOG_NAME, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", delay=True)
        fh.setFormatter(structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        _rich_for_exceptions, structlog.processors.dict_tracebacks,
                        structlog.processors.JSONRenderer(sort_keys=True)],
            foreign_pre_chain=pre))
        root.addHandler(fh)


class _RunLog(logging.handlers.RotatingFileHandler):
    """The run log, which a job outlives: a line it cannot write (a full disk, a folder made read-only) is said once
    on stderr and the job goes on. logging's own handler printed a traceback for every line, ~45 lines each."""

    failed = False

    def handleError(self, record: logging.LogRecord) -> None:
        if not self.failed:
            self.failed = True
            err = sys.exc_info()[1]
            sys.stderr.write(f"streamprep: warning: cannot write the run log {self.baseFilename} "
                             f"({type(err).__name__}: {err}); the job goes on without it\n")

    def close(self) -> None:
        try:
            super().close()
        except OSError:  # its last buffered line, on a disk that is full: said above, or never written
            pass


@contextmanager
def configured(run_dir: Path, console: bool = True) -> Iterator[None]:
    """`configure` for one run, then the logging of the process as it was: a library call (`run_from_dict`) leaves
    neither its structlog set-up in place of the application's nor its run log's file open."""
    saved = structlog.get_config()
    root = logging.getLogger("streamprep")
    handlers, level, propagate = list(root.handlers), root.level, root.propagate
    configure(run_dir, console=console)
    try:
        yield
    finally:
        for h in list(root.handlers):
            root.removeHandler(h)
            h.close()
        for h in handlers:
            root.addHandler(h)
        root.setLevel(level)
        root.propagate = propagate
        structlog.configure(**saved)


def get(component: str) -> structlog.stdlib.BoundLogger:
    """Logger for one component; the component name is on every line it writes."""
    return structlog.get_logger(f"streamprep.{component}", component=component)  # lazy: binds after configure()


_kept: list[dict[str, Any]] | None = None  # a worker process's events since its last answer (`forward_from_worker`)
_dropped = 0


def forward_from_worker() -> None:
    """In a worker process (pool process, Ray actor, Xenna stage worker): keep this process's log events for its
    answers to carry to the job's process (`taken`, `replay`). A worker writes no run log: its lines went to its
    stdout, so a retried Hub request or a backend's fallback in a unit never reached logs/streamprep.log."""
    global _kept, _dropped
    _kept, _dropped = [], 0
    structlog.configure(
        processors=[structlog.processors.add_log_level, structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.format_exc_info, _keep],
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        logger_factory=structlog.ReturnLoggerFactory(),
        cache_logger_on_first_use=False,
    )


def _keep(_, __, event_dict: dict) -> dict:
    global _dropped
    assert _kept is not None, "configured by forward_from_worker"
    if len(_kept) >= WORKER_EVENTS_KEPT:
        _dropped += 1
        raise structlog.DropEvent
    event = {**event_dict, "worker": os.getpid()}
    try:
        pickle.dumps(event)
    except Exception:  # it crosses processes: a field that cannot is kept as its repr
        event = {k: v if isinstance(v, (str, int, float, bool, type(None))) else repr(v) for k, v in event.items()}
    _kept.append(event)
    raise structlog.DropEvent


def taken() -> list[dict[str, Any]]:
    """The events kept since the last call (none in a process that does not forward), for an answer to carry."""
    global _kept, _dropped
    if _kept is None:
        return []
    events, _kept = _kept, []
    if _dropped:
        events.append({"event": "worker log events dropped", "level": "warning", "component": "executor",
                       "dropped": _dropped, "kept": WORKER_EVENTS_KEPT, "worker": os.getpid()})
        _dropped = 0
    return events


def replay(events: Iterable[dict[str, Any]]) -> None:
    """Write a worker's events in the job's process, under their component, with the worker's pid and the time
    the worker logged them (`worker_time`; `timestamp` is when the answer came back)."""
    for event in events:
        fields = dict(event)
        level, text = fields.pop("level", "info"), fields.pop("event", "")
        component = fields.pop("component", "worker")
        fields["worker_time"] = fields.pop("timestamp", None)
        getattr(get(component), level if level in LEVELS else "info")(text, **fields)
