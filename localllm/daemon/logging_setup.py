"""Where the daemon's log goes, and in what shape.

Every record is one logfmt line: `level=info logger=localllm.scheduler msg="model loaded"
model=smollm2 seconds=1.2` (keys passed with `extra={...}` become fields), so it reads well and
`grep model=smollm2` or a logfmt parser finds things.

- Under systemd (stderr is the journal stream): lines go to stderr with a `<N>` syslog
  priority prefix, which journald turns into the entry's priority (`journalctl -p warning`).
  No timestamp: the journal stamps each entry.
- Otherwise: to a rotating file, `<state dir>/logs/localllm.log` (what `localllm service logs`
  shows), with a timestamp, and the same lines to stderr when that is a terminal (`localllm
  serve` run by hand).
- The runners' stderr (llama.cpp's own log) goes to `runner.log` beside it, rotated at each
  runner start past the same size. Every log is 0600 in a 0700 folder, and no prompt is logged
  at info: a request's text appears in no log.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from datetime import UTC, datetime
from pathlib import Path

from aiohttp.abc import AbstractAccessLogger
from localllm import paths
from localllm.config import Config
from localllm.paths import LOG_FILE_BACKUPS, LOG_FILE_BYTES

from .systemd import journal_stream

# syslog priorities (sd-daemon(3)): journald reads "<N>" at the start of each stderr line.
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3,
             logging.CRITICAL: 2}
_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}
# Attributes every LogRecord has; anything else on a record came from `extra=` and is a field.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


def log_file() -> Path:
    return paths.logs_dir() / "localllm.log"


def _value(value: object) -> str:
    text = str(value)
    if text and not any(c in text for c in ' "=\n\t\\'):
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


class LogfmtFormatter(logging.Formatter):
    def __init__(self, timestamps: bool, priority_prefix: bool) -> None:
        super().__init__()
        self.timestamps = timestamps
        self.priority_prefix = priority_prefix

    def format(self, record: logging.LogRecord) -> str:
        pairs = []
        if self.timestamps:
            stamp = datetime.fromtimestamp(record.created, UTC)
            pairs.append(("ts", stamp.isoformat(timespec="milliseconds")))
        pairs += [("level", record.levelname.lower()), ("logger", record.name),
                  ("msg", record.getMessage())]
        pairs += [(k, v) for k, v in vars(record).items() if k not in _STANDARD]
        line = " ".join(f"{k}={_value(v)}" for k, v in pairs)
        lines = [line]
        if record.exc_info:
            # A traceback stays readable as its own lines, each carrying the record's priority.
            lines += self.formatException(record.exc_info).splitlines()
        if not self.priority_prefix:
            return "\n".join(lines)
        prefix = f"<{_PRIORITY.get(record.levelno, 6)}>"
        return "\n".join(prefix + text for text in lines)


# Our own handler classes, so that calling setup_logging again replaces only what it installed.
class _JournalHandler(logging.StreamHandler):
    pass


class _StderrHandler(logging.StreamHandler):
    pass


class _FileHandler(logging.handlers.RotatingFileHandler):
    """Rotating, and the user's alone: each file (the first, and each after a rotation) is
    created 0600, in a 0700 folder."""

    def _open(self):
        paths.private_dir(Path(self.baseFilename).parent)
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        os.fchmod(fd, 0o600)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)


_OURS = (_JournalHandler, _StderrHandler, _FileHandler)


def _stderr_is_daemon_log() -> bool:
    """Whether stderr is the file a background start sends it to (localllm/client.py)."""
    from localllm.client import daemon_log_path

    try:
        err, log = os.fstat(sys.stderr.fileno()), os.stat(daemon_log_path())
    except (OSError, ValueError, AttributeError):
        return False
    return (err.st_dev, err.st_ino) == (log.st_dev, log.st_ino)


def setup_logging(config: Config) -> None:
    """Route all logging (ours and libraries') per the module docstring; safe to call again
    when the config changes (log_level is applied live)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _OURS):
            root.removeHandler(handler)
            handler.close()
    handlers: list[logging.Handler] = []
    if journal_stream():
        journal = _JournalHandler(sys.stderr)
        journal.setFormatter(LogfmtFormatter(timestamps=False, priority_prefix=True))
        handlers.append(journal)
    else:
        handlers.append(_FileHandler(log_file(), maxBytes=LOG_FILE_BYTES,
                                     backupCount=LOG_FILE_BACKUPS, encoding="utf-8"))
        # A copy on stderr (a terminal running `localllm serve`, a pipe, a container's log),
        # except for a daemon started in the background: its stderr is daemon.log, which would
        # repeat every line of this one.
        if not _stderr_is_daemon_log():
            handlers.append(_StderrHandler(sys.stderr))
        for handler in handlers:
            handler.setFormatter(LogfmtFormatter(timestamps=True, priority_prefix=False))
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(_LEVELS.get(config.log_level, logging.INFO))


ACCESS_LOG = logging.getLogger("localllm.access")


class AccessLogger(AbstractAccessLogger):
    """One info line per HTTP request, when its answer is done (a stream when it ends):
    method, path, status, duration, bytes sent (headers and body) and the client's name
    (User-Agent's first word). Never a body, a header's value past that name, or the query
    string (a client may put a key there)."""

    def log(self, request, response, time: float) -> None:
        agent = request.headers.get("User-Agent", "").split(" ", 1)[0][:60]
        self.logger.info("%s %s %d", request.method, request.path, response.status, extra={
            "status": response.status, "ms": round(time * 1000),
            "bytes": response.body_length, "client": agent or "-"})

