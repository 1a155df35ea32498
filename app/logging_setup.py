"""Logging, configured once at each entry point (the CLI, the desktop app, `serve`).

Library code (`engine`, `packer`, `expertpack`, and the app's own modules) only does
`log = logging.getLogger(__name__)`; `configure_logging` decides where records go:

- a rotating log file, `expertdesk.log` in the user log directory
  (`platformdirs.user_log_dir("ExpertDesk")`, or `$EXPERTDESK_LOG_DIR`), kept at
  LOG_FILE_BYTES with LOG_FILE_BACKUPS older files;
- stderr (`console=True`).

The level (debug, info, warning, error) is the `--log-level` option, else
`$EXPERTDESK_LOG_LEVEL`, else warning. It applies to ExpertDesk's own loggers;
other libraries log warnings and errors only, so `--log-level debug` stays readable.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from pathlib import Path

LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LEVEL = "warning"
LEVEL_ENV = "EXPERTDESK_LOG_LEVEL"
DIR_ENV = "EXPERTDESK_LOG_DIR"
LOG_FILE = "expertdesk.log"
LOG_FILE_BYTES = 5 * 2**20
LOG_FILE_BACKUPS = 3
OUR_LOGGERS = ("app", "engine", "packer", "expertpack")
FORMAT = "%(asctime)s %(levelname)s %(name)s [%(threadName)s]: %(message)s"

log = logging.getLogger(__name__)


def log_dir() -> Path:
    """`$EXPERTDESK_LOG_DIR`, else the platform's user log directory for ExpertDesk."""
    override = os.environ.get(DIR_ENV)
    if override:
        return Path(override)
    from platformdirs import user_log_dir

    return Path(user_log_dir("ExpertDesk", "ExpertDesk"))


def log_file() -> Path:
    return log_dir() / LOG_FILE


def resolve_level(level: str | int | None = None) -> int:
    """The logging level `level` names (a name from LEVELS or a number); None: the
    environment's `$EXPERTDESK_LOG_LEVEL`, else warning. ValueError for an unknown name."""
    if level is None:
        level = os.environ.get(LEVEL_ENV) or DEFAULT_LEVEL
    if isinstance(level, int):
        return level
    name = str(level).strip().lower()
    if name not in LEVELS:
        raise ValueError(f"unknown log level {level!r}: use one of {', '.join(LEVELS)}")
    return getattr(logging, name.upper())


def _ours_or_warning(record: logging.LogRecord) -> bool:
    """ExpertDesk's records at any level; other libraries' from warning up."""
    return record.levelno >= logging.WARNING or record.name.split(".", 1)[0] in OUR_LOGGERS


class _Stderr(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time (test capture, a redirected stream)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(level: str | int | None = None, *, console: bool = True) -> Path | None:
    """Send log records to the rotating log file (and stderr when `console`) at `level`.

    Idempotent: a second call replaces the handlers of the first. Returns the log file,
    or None where its folder cannot be written (then a warning says so on stderr and
    logging goes on without a file, never stopping the program).
    """
    number = resolve_level(level)
    root = logging.getLogger()
    for handler in [h for h in root.handlers if getattr(h, "_expertdesk", False)]:
        root.removeHandler(handler)
        handler.close()
    formatter = logging.Formatter(FORMAT)
    handlers: list[logging.Handler] = []
    path: Path | None = log_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.handlers.RotatingFileHandler(
            path, maxBytes=LOG_FILE_BYTES, backupCount=LOG_FILE_BACKUPS, encoding="utf-8", delay=True))
    except OSError as exc:
        print(f"expertdesk: warning: cannot write the log file in {path.parent} ({exc.strerror or exc}); "
              f"set {DIR_ENV} to a writable folder", file=sys.stderr)
        path = None
    if console:
        handlers.append(_Stderr())
    for handler in handlers:
        handler._expertdesk = True  # type: ignore[attr-defined]
        handler.setFormatter(formatter)
        handler.setLevel(number)
        handler.addFilter(_ours_or_warning)
        root.addHandler(handler)
    root.setLevel(number)
    log.debug("logging at %s to %s", logging.getLevelName(number), path if path is not None else "stderr only")
    return path
