"""Where localllm keeps things, written whole and owner-only, and read back whatever they hold.

Every path the program writes to comes from here. platformdirs honours XDG_DATA_HOME,
XDG_CONFIG_HOME, XDG_STATE_HOME, XDG_CACHE_HOME and XDG_RUNTIME_DIR on Linux, so tests point all
of localllm at a temp dir through the environment.

Writes go through a temporary file, fsync and rename (`replace_private`), so a reader sees the
old file or the new one. The daemon's own state files (the tuner's records: workload.json, draft
acceptance, expert-cache hits, eval results, calibration; saved profiles and chats) can still be
left in any shape by a full disk or any local process, and none of them may stop a model from
loading: a file that cannot be read as what it should be is logged once, set aside beside itself
as NAME.bad-TIMESTAMP (never deleted: it may be worth a look) and a fresh one is started.

    with unless_broken(path, "the workload record"):
        return parse(path)          # any content error: set aside, then past the block
    return default
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import platformdirs

from .errors import UserError

APP = "localllm"
log = logging.getLogger("localllm.state")
DEFAULT_TCP_HOST = "127.0.0.1"
DEFAULT_TCP_PORT = 11435


class BadHost(UserError, ValueError):
    """A host value that cannot be listened on; the message says why."""


def write_private(path: Path, data: bytes | Sequence) -> None:
    """Write `path` 0600 from its creation on (no moment in which another user could open it);
    an existing file is narrowed to 0600 too. For secrets (config.toml's api_key) and the store.
    `data`: bytes, or a sequence of buffers written one after the other (no joined copy)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT keeps an existing file's mode
        for part in [data] if isinstance(data, (bytes, bytearray)) else data:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view[:1 << 30]):]  # (one write is capped at 2 GiB)
        os.fsync(fd)  # on disk before a rename makes it the file (replace_private)
    finally:
        os.close(fd)


def replace_private(path: Path, text: str) -> None:
    """Atomically replace `path` with `text`, the new file 0600: a temporary file written and
    fsynced, renamed over it, the folder fsynced."""
    replace_private_parts(path, [text.encode()])


def replace_private_parts(path: Path, parts: Sequence) -> None:
    """replace_private for bytes given as buffers in order (the prompt cache's large files).
    The temporary file's name carries the writer's pid and thread, so two writers never share
    one, and a dead writer's is told apart (`stale_temporary`)."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}-{threading.get_ident()}")
    try:
        write_private(tmp, parts)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # the rename itself on disk
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def stale_temporary(path: Path) -> bool:
    """Whether `path` is a temporary file of `replace_private_parts` whose writer is gone (a
    runner killed while it wrote): safe to delete."""
    name = path.name
    if not name.startswith(".") or ".tmp" not in name:
        return False
    pid = name.rpartition(".tmp")[2].partition("-")[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def set_aside(path: Path, what: str, error: BaseException) -> Path | None:
    """Rename a broken state file to NAME.bad-TIMESTAMP beside it; the new name, or None when
    it was gone already (another reader set it aside first)."""
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for n in range(100):
        aside = path.with_name(f"{path.name}.bad-{stamp}" + (f"-{n}" if n else ""))
        if aside.exists():
            continue
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("%s %s is unreadable (%s) and could not be set aside (%s)", what, path,
                        _why(error), e)
            return None
        log.warning("%s %s was unreadable (%s): set aside as %s, starting a new one", what,
                    path, _why(error), aside.name)
        return aside
    return None


def _why(error: BaseException) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text[:200]}" if text else type(error).__name__


@contextlib.contextmanager
def unless_broken(path: Path, what: str) -> Iterator[None]:
    """Run the block that reads `path`; a content error of any kind (not JSON or TOML, bytes
    that are not UTF-8, nesting too deep, a value of the wrong type or size) sets the file aside
    and is suppressed, so that the code after the block gives the default. Errors of the disk
    itself (OSError) are not the file's content: they pass."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:  # any content at all: that is the point
        set_aside(path, what, e)


# A settings file (config.toml, a tuned profile, a tuner's record) is a few KiB; past this it
# is not one, and reading it whole would hand its size to whoever put it there.
MAX_SETTINGS_BYTES = 4 << 20


def read_regular(path: Path, max_bytes: int = MAX_SETTINGS_BYTES) -> bytes:
    """The bytes of the regular file at `path` (a symlink to one is followed), or OSError: a
    FIFO, a device (a link to /dev/zero) or a folder is refused without reading it (opened
    non-blocking, so a FIFO with no writer cannot hold the caller), and so is a file past
    `max_bytes`, whatever it grows to while read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if info.st_size > max_bytes:
            raise OSError(errno.EFBIG, f"larger than {max_bytes >> 20} MiB", str(path))
        chunks, size = [], 0
        while chunk := os.read(fd, min(1 << 20, max_bytes + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > max_bytes:
                raise OSError(errno.EFBIG, f"larger than {max_bytes >> 20} MiB", str(path))
        return b"".join(chunks)
    finally:
        os.close(fd)


def private_dir(path: Path) -> Path:
    """`path` and any missing parents made 0700; an existing folder is narrowed to 0700 (the
    store, the logs, saved chats and profiles are the user's alone)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if (path.stat().st_mode & 0o777) != 0o700:
        os.chmod(path, 0o700)
    return path


# The size and count of the daemon's and the runners' log files: rotated by open_private_log
# (runner logs) and by the daemon's own handler.
LOG_FILE_BYTES = 10 * 1024 * 1024
LOG_FILE_BACKUPS = 3


def open_private_log(path: Path, max_bytes: int, backups: int, truncate: bool = False):
    """`path` opened for appending (binary), 0600 in a 0700 folder; first, a file past
    `max_bytes` is rotated to `path.1` (.. `path.<backups>`, the oldest dropped)."""
    private_dir(path.parent)
    rotate(path, max_bytes, backups)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if truncate else os.O_APPEND)
    fd = os.open(path, flags, 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT keeps an existing file's mode
    return os.fdopen(fd, "ab" if not truncate else "wb")


def rotate(path: Path, max_bytes: int, backups: int) -> bool:
    """Shift `path` to `path.1`, `.1` to `.2` ... when it is past `max_bytes`."""
    try:
        if path.stat().st_size <= max_bytes:
            return False
    except FileNotFoundError:
        return False
    for i in range(backups - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
    if backups > 0:
        os.replace(path, path.with_name(f"{path.name}.1"))
    else:
        path.unlink()
    return True


def logs_dir() -> Path:
    return state_dir() / "logs"


def data_dir() -> Path:
    return Path(platformdirs.user_data_dir(APP))


def models_dir() -> Path:
    """Root of the model store (blobs + manifests); LOCALLLM_MODELS overrides it, as
    OLLAMA_MODELS does Ollama's."""
    override = os.environ.get("LOCALLLM_MODELS")
    return Path(override) if override else data_dir() / "models"


def config_dir() -> Path:
    return Path(platformdirs.user_config_dir(APP))


def state_dir() -> Path:
    return Path(platformdirs.user_state_dir(APP))


def cache_dir() -> Path:
    return Path(platformdirs.user_cache_dir(APP))


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/localllm; falls back to the state dir where there is no runtime dir."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and Path(base).is_dir():
        return Path(base) / APP
    return state_dir() / "run"


def socket_path() -> Path:
    override = os.environ.get("LOCALLLM_SOCKET")
    return Path(override) if override else runtime_dir() / f"{APP}.sock"


def tcp_address() -> tuple[str, int]:
    """The HTTP address from LOCALLLM_HOST (host, host:port or :port), else 127.0.0.1:11435."""
    return parse_host(os.environ.get("LOCALLLM_HOST", ""))


def parse_host(value: str) -> tuple[str, int]:
    value = value.strip()
    for scheme in ("http://", "https://"):
        value = value.removeprefix(scheme)
    value = value.rstrip("/")
    if not value:
        return DEFAULT_TCP_HOST, DEFAULT_TCP_PORT
    if value.startswith("["):  # [::1]:port
        host, _, rest = value[1:].partition("]")
        port = rest.lstrip(":")
    elif value.count(":") == 1:
        host, port = value.split(":")
    else:
        host, port = value, ""
    try:
        port_number = int(port) if port else DEFAULT_TCP_PORT
    except ValueError:
        raise BadHost(f"bad host address {value!r}: the port must be a number") from None
    if not 0 <= port_number < 65536:
        raise BadHost(f"bad host address {value!r}: the port must be 0 to 65535")
    return host or DEFAULT_TCP_HOST, port_number


def is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "localhost", "::1") or host.startswith("127.")


def listen_address(value: str, api_key: str = "") -> tuple[str, int]:
    """The (host, port) `serve` binds for a host value, checked once here for `serve --host`,
    LOCALLLM_HOST and `config set host`: a port in range, a host that is an IP address or a
    name this machine resolves, and an API key for any address but loopback."""
    import ipaddress
    import socket

    host, port = parse_host(value)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            raise BadHost(f"bad host address {value!r}: {host} is neither an IP address nor "
                          "a name this machine resolves") from None
    if not is_loopback(host) and not api_key:
        raise BadHost(f"refusing to listen on {host} without an API key: set one first "
                      "(`localllm config set api_key KEY` or LOCALLLM_API_KEY), or bind "
                      "127.0.0.1")
    return host, port
