"""structlog set-up: human lines on the console, JSON lines in a size-rotated run log.

Every line carries `timestamp`, `level` and `component` (the logger name: ingest, tokenize, exports …).
"""
from __future__ import annotations

import logging
import logging.handlers
import sys
from pathlib import Path

import structlog

from streamprep.layout import RunLayout

LOG_NAME = "streamprep.log"
MAX_BYTES = 5 * 1024 * 1024
BACKUPS = 5

_shared = [
    structlog.stdlib.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


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
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), pad_event_to=0)],
            foreign_pre_chain=pre))
        root.addHandler(h)
    if run_dir is not None:
        log_dir = RunLayout(run_dir).logs_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        fh = logging.handlers.RotatingFileHandler(log_dir / LOG_NAME, maxBytes=max_bytes, backupCount=backups,
                                                  encoding="utf-8")
        fh.setFormatter(structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        structlog.processors.dict_tracebacks, structlog.processors.JSONRenderer(sort_keys=True)],
            foreign_pre_chain=pre))
        root.addHandler(fh)


def get(component: str) -> structlog.stdlib.BoundLogger:
    """Logger for one component; the component name is on every line it writes."""
    return structlog.get_logger(f"streamprep.{component}", component=component)  # lazy: binds after configure()
