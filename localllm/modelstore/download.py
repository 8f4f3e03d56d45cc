"""The download engine: one remote file becomes one verified blob in the store, or nothing does.

- Big files come in several HTTP Range parts at once; each part writes at its own offset of one
  preallocated (sparse) file in the store's tmp/.
- Progress is saved next to the partial file (`download-<key>.json`: each part's range and the
  bytes written), so a dropped connection, a killed process or a reboot resumes where it was.
- Stalls, dropped connections, 408/429 and 5xx are retried with exponential back-off; the retry
  count resets whenever bytes arrive, so a flaky link that keeps making progress never gives up.
- The whole file is hashed before it is published; a mismatch with the pinned or published sha256
  discards it. Only then does it move into blobs/ (store.publish_blob), so the store never holds
  a blob that is not what it is named.
- One file lock per blob in tmp/ (flock, so it holds across processes): a second pull of the same
  blob waits, then finds it published and costs nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable

import aiohttp

from .gguf_header import GGUF_MAGIC, GGUFError, read_header
from .store import ModelStore, StoreError, sha256_file

MiB = 1 << 20
_CHUNK = 1 * MiB


class PullError(StoreError):
    """A pull failed for a reason the user can act on; `status` is what /api/pull answers."""


class RemoteNotFound(PullError):
    status = 404


class AuthRequired(PullError):
    pass


class RangeRefused(PullError):
    pass


class HashMismatch(PullError):
    pass


class NotGGUF(PullError):
    pass


class DiskTooSmall(PullError):
    pass


class DownloadInterrupted(PullError):
    """Retries ran out; the partial file is kept, so the next pull resumes."""


class _Retry(Exception):
    """A transient failure of one request: wait and ask again."""


class _NoRanges(Exception):
    """The server ignored a Range header: download the file in one piece from the start."""


@dataclass(frozen=True)
class RemoteFile:
    url: str
    filename: str  # path inside the repo (or the URL's last segment)
    size: int | None  # None when the server does not say
    sha256: str | None  # pinned or published hash; None when nobody publishes one


def _free_disk(path: Path) -> int:
    return shutil.disk_usage(path).free


@dataclass(frozen=True)
class DownloadOptions:
    connections: int = 4  # parallel Range requests for one big file
    min_part_bytes: int = 64 * MiB  # files smaller than two of these come in one piece
    retries: int = 8  # consecutive failures without a byte arriving before giving up
    backoff_s: float = 0.5  # first wait; doubles per failure up to max_backoff_s
    max_backoff_s: float = 15.0
    stall_timeout_s: float = 60.0  # no byte for this long counts as a failure
    connect_timeout_s: float = 30.0  # a host that does not accept the connection by then fails
    disk_margin_bytes: int = 512 * MiB  # left free after the download
    free_disk: Callable[[Path], int] = _free_disk  # bytes free on the store's filesystem


def sha256_from_headers(headers) -> str | None:
    """The hub's sha256 of an LFS file: X-Linked-Etag on its redirect, or the ETag itself."""
    for name in ("X-Linked-Etag", "ETag"):
        value = headers.get(name)
        if value:
            value = value.removeprefix("W/").strip('"').lower()
            if len(value) == 64 and not value.strip("0123456789abcdef"):
                return value
    return None


def http_error(status: int, label: str, authenticated: bool | str | None) -> PullError:
    """The user-facing error for a final (non-retryable) HTTP status."""
    if status in (401, 403):
        if authenticated:
            return AuthRequired(f"{label}: the hub refused the token in HF_TOKEN (HTTP {status}); "
                                "check it is valid and, for a gated repo, that its terms are "
                                "accepted on the hub")
        return AuthRequired(f"{label} needs a Hugging Face login (HTTP {status}): set HF_TOKEN to "
                            "an access token (gated repos also need their terms accepted)")
    if status == 404:
        return RemoteNotFound(f"{label} was not found (HTTP 404); check the name")
    if status == 416:
        return RangeRefused(f"{label}: the server refused the byte range (HTTP 416): the file "
                            "changed or the partial download is stale; it was discarded, "
                            "pull again")
    return PullError(f"{label}: the server answered HTTP {status}")


class HubUnreachable(PullError):
    """No answer from the host: DNS, a refused or dropped connection, TLS, a timeout or 5xx."""

    status = 502  # the daemon is fine; the host behind it is not


def _host(url: str) -> str:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    return parts.netloc or url


_CHECK = "check the network connection and proxy settings, and hf_endpoint (LOCALLLM_HF_ENDPOINT)"


def network_error(url: str, error: BaseException) -> HubUnreachable:
    """One line for a failure to talk to `url`'s host: which host, what happened, what to check."""
    host = _host(url)
    if isinstance(error, aiohttp.ClientConnectorDNSError):
        why = "its name does not resolve (no internet here, or a typo in the address?)"
    elif isinstance(error, aiohttp.ClientConnectorCertificateError):
        why = (f"its TLS certificate was refused ({error.certificate_error}); check the system "
               "clock and any proxy that intercepts TLS")
    elif isinstance(error, aiohttp.ClientSSLError | aiohttp.ServerFingerprintMismatch):
        why = "the TLS handshake failed; check any proxy that intercepts TLS"
    elif isinstance(error, aiohttp.ClientConnectorError):
        code = error.os_error.errno if error.os_error else None
        why = {errno.ECONNREFUSED: "the connection was refused (nothing listens there?)",
               errno.ENETUNREACH: "the network is unreachable",
               errno.EHOSTUNREACH: "the host is unreachable"}.get(
                   code, f"the connection failed ({error.os_error or error})")
    elif isinstance(error, TimeoutError):
        why = "it did not answer in time"
    elif isinstance(error, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError):
        why = "it closed the connection"
    else:
        why = str(error) or type(error).__name__
    return HubUnreachable(f"cannot reach {host}: {why}; {_CHECK}")


def server_error(url: str, status: int) -> HubUnreachable:
    return HubUnreachable(f"{_host(url)} answered HTTP {status} (a server error on its side); "
                          "try again later, or check hf_endpoint (LOCALLLM_HF_ENDPOINT)")


def _fatal(error: BaseException) -> bool:
    """Failures that waiting does not cure: a name that does not resolve, a refused certificate."""
    return isinstance(error, aiohttp.ClientConnectorDNSError | aiohttp.ClientSSLError
                      | aiohttp.ServerFingerprintMismatch)


@dataclass
class _Part:
    """One byte range of the file and how much of it is on disk (mutable progress record)."""

    start: int
    end: int | None  # exclusive; None while the size is unknown
    done: int = 0

    @property
    def finished(self) -> bool:
        return self.end is not None and self.start + self.done >= self.end


def plan_parts(size: int | None, options: DownloadOptions) -> list[_Part]:
    """Split [0, size) into up to `connections` ranges of at least min_part_bytes (pure)."""
    if not size or size < 2 * options.min_part_bytes or options.connections < 2:
        return [_Part(0, size)]
    count = min(options.connections, size // options.min_part_bytes)
    step = -(-size // count)
    return [_Part(start, min(start + step, size)) for start in range(0, size, step)]


@contextlib.asynccontextmanager
async def blob_lock(path: Path, on_wait: Callable[[], None] | None = None, poll_s: float = 0.25):
    """An exclusive flock on `path`, waited for without blocking the event loop.

    The lock file is removed on release; a waiter that then wins the lock on the removed inode
    notices (the path no longer names its inode) and locks afresh."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if on_wait:
                        on_wait()
                    await asyncio.sleep(poll_s)
            try:
                current = os.stat(path).st_ino
            except FileNotFoundError:
                current = None
            if current == os.fstat(fd).st_ino:
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)


def resumable_bytes(store: ModelStore, since: float = 0.0) -> int:
    """The bytes the downloads saved in tmp/ (those written from `since`, a time.time(), on),
    which the next pull of the same file resumes from."""
    total = 0
    for state in store.tmp.glob("download-*.json"):
        try:
            if state.stat().st_mtime >= since:
                total += sum(int(part[2]) for part in json.loads(state.read_text())["parts"])
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            continue
    return total


class _Transfer:
    """One file's download into tmp/: its parts, state file and open descriptor."""

    def __init__(self, session: aiohttp.ClientSession, store: ModelStore, remote: RemoteFile,
                 label: str, headers: dict[str, str], on_bytes, options: DownloadOptions):
        self.session, self.store, self.remote = session, store, remote
        self.label, self.headers, self.on_bytes, self.options = label, headers, on_bytes, options
        key = remote.sha256 or hashlib.sha256(remote.url.encode()).hexdigest()
        self.partial = store.tmp / f"download-{key}.partial"
        self.state_path = store.tmp / f"download-{key}.json"
        self.parts: list[_Part] = []
        self.fd = -1

    # ---- state -------------------------------------------------------------------------
    def load_state(self) -> bool:
        """Pick up a previous attempt at the same file; False (and a clean slate) otherwise."""
        try:
            doc = json.loads(self.state_path.read_text())
            same = (doc["sha256"] == self.remote.sha256 and doc["size"] == self.remote.size
                    and (self.remote.sha256 or doc["url"] == self.remote.url))
            parts = [_Part(int(s), int(e), int(d)) for s, e, d in doc["parts"]]
        except (OSError, ValueError, KeyError, TypeError):
            same, parts = False, []
        if same and self.remote.size and self.partial.is_file() \
                and self.partial.stat().st_size == self.remote.size:
            self.parts = parts
            return True
        self.discard()
        return False

    def save_state(self) -> None:
        if self.remote.size is None:
            return  # no resume without a known size: a restart begins again
        doc = {"url": self.remote.url, "sha256": self.remote.sha256, "size": self.remote.size,
               "parts": [[p.start, p.end, p.done] for p in self.parts]}
        tmp = self.state_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.state_path)

    async def save_periodically(self, interval_s: float = 0.5) -> None:
        """Bytes on disk are recorded at most this late, so a killed pull loses little."""
        while True:
            await asyncio.sleep(interval_s)
            self.save_state()

    def discard(self) -> None:
        self.partial.unlink(missing_ok=True)
        self.state_path.unlink(missing_ok=True)

    @property
    def completed(self) -> int:
        return sum(p.done for p in self.parts)

    # ---- transfer ----------------------------------------------------------------------
    async def run(self) -> None:
        resumed = self.load_state()
        if not resumed:
            self.parts = plan_parts(self.remote.size, self.options)
        self.check_disk()
        self.fd = os.open(self.partial, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if not resumed and self.remote.size:
                os.ftruncate(self.fd, self.remote.size)
            self.save_state()
            self.on_bytes(self.completed)
            saver = asyncio.create_task(self.save_periodically())
            try:
                await self.fetch_parts()
            except _NoRanges:
                self.parts = [_Part(0, self.remote.size)]
                await self.fetch_parts()
            finally:
                saver.cancel()
        except PullError:
            if self.completed == 0:
                self.discard()  # nothing worth resuming
            raise
        finally:
            os.close(self.fd)
            if self.partial.exists():
                self.save_state()

    def check_disk(self) -> None:
        remaining = (self.remote.size or 0) - self.completed
        free = self.options.free_disk(self.store.tmp)
        if remaining + self.options.disk_margin_bytes > free:
            raise DiskTooSmall(
                f"not enough disk space for {self.label}: it needs {_gib(remaining)} more plus "
                f"{_gib(self.options.disk_margin_bytes)} to spare, {_gib(free)} is free in "
                f"{self.store.root}; free some space or remove models with `localllm rm`")

    async def fetch_parts(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                for part in self.parts:
                    if not part.finished:
                        group.create_task(self.fetch_part(part))
        except ExceptionGroup as group_error:
            raise _first_cause(group_error) from None

    async def fetch_part(self, part: _Part) -> None:
        failures = 0
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.options.connect_timeout_s,
                                        sock_read=self.options.stall_timeout_s)
        while not part.finished:
            before = part.done
            try:
                await self.request_part(part, timeout)
                if part.end is None:  # size unknown: the stream's end is the file's end
                    part.end = part.start + part.done
                if not part.finished:
                    raise _Retry("the connection closed before the range was complete")
            except (TimeoutError, _Retry, aiohttp.ClientError) as error:
                failures = 0 if part.done > before else failures + 1
                if _fatal(error):
                    raise network_error(self.remote.url, error) from None
                if failures > self.options.retries:
                    if isinstance(error, _Retry) or part.done > 0 or self.completed > 0:
                        reason = str(error) or type(error).__name__
                        raise DownloadInterrupted(
                            f"{self.label}: download failed after {self.options.retries} "
                            f"retries ({reason}); run the pull again to resume") from None
                    raise network_error(self.remote.url, error) from None
                if part.end is None:  # unknown size: a stream cannot resume mid-way
                    part.done = 0
                if failures:
                    await asyncio.sleep(min(self.options.max_backoff_s,
                                            self.options.backoff_s * 2 ** (failures - 1)))

    async def request_part(self, part: _Part, timeout: aiohttp.ClientTimeout) -> None:
        offset = part.start + part.done
        headers = dict(self.headers)
        ranged = part.end is not None and (offset > 0 or part.end != self.remote.size)
        if ranged:
            headers["Range"] = f"bytes={offset}-{part.end - 1}"
        async with self.session.get(self.remote.url, headers=headers,
                                    timeout=timeout) as response:
            status = response.status
            if status == 200 and ranged:
                raise _NoRanges()
            if status in (408, 429) or status >= 500:
                raise _Retry(f"{_host(self.remote.url)} answered HTTP {status}")
            if status not in (200, 206):
                error = http_error(status, self.label, "Authorization" in self.headers)
                if isinstance(error, RangeRefused):
                    self.discard()
                raise error
            async for chunk in response.content.iter_chunked(_CHUNK):
                if part.end is not None:
                    chunk = chunk[:part.end - part.start - part.done]
                position = part.start + part.done
                if position == 0 and chunk[:4] != GGUF_MAGIC[:len(chunk[:4])]:
                    self.discard()
                    raise NotGGUF(f"{self.label} is not a GGUF model file")
                os.pwrite(self.fd, chunk, position)
                part.done += len(chunk)
                self.on_bytes(self.completed)
                if part.finished:
                    break


def _first_cause(group: BaseExceptionGroup) -> BaseException:
    """The error that stopped a TaskGroup (its siblings were only cancelled because of it)."""
    leaves = []
    stack: list[BaseException] = [group]
    while stack:
        error = stack.pop(0)
        if isinstance(error, BaseExceptionGroup):
            stack.extend(error.exceptions)
        elif not isinstance(error, asyncio.CancelledError):
            leaves.append(error)
    return next((e for e in leaves if isinstance(e, PullError)), leaves[0] if leaves else group)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / MiB:.0f} MiB"


async def fetch_blob(session: aiohttp.ClientSession, store: ModelStore, remote: RemoteFile, *,
                     label: str, headers: dict[str, str] | None = None,
                     on_bytes: Callable[[int], None] | None = None,
                     on_verify: Callable[[], None] | None = None,
                     options: DownloadOptions = DownloadOptions()) -> tuple[str, int]:
    """Download `remote` into the store as a verified blob; returns (digest, size).

    Costs nothing when the blob is already there. Raises PullError subclasses; on any error the
    store's blobs and manifests are unchanged (a resumable partial may stay in tmp/)."""
    on_bytes = on_bytes or (lambda completed: None)
    if remote.sha256 and store.has_blob(f"sha256:{remote.sha256}"):
        return _existing(store, remote.sha256, on_bytes)
    store.ensure_dirs()
    key = remote.sha256 or hashlib.sha256(remote.url.encode()).hexdigest()
    transfer = _Transfer(session, store, remote, label, headers or {}, on_bytes, options)

    def report_other_download() -> None:  # another process holds the lock: show its progress
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            doc = json.loads(transfer.state_path.read_text())
            on_bytes(sum(int(p[2]) for p in doc["parts"]))

    async with blob_lock(store.tmp / f"download-{key}.lock", report_other_download):
        if remote.sha256 and store.has_blob(f"sha256:{remote.sha256}"):
            return _existing(store, remote.sha256, on_bytes)
        await transfer.run()
        if on_verify:
            on_verify()
        actual = await asyncio.to_thread(sha256_file, transfer.partial)
        if remote.sha256 and actual != remote.sha256:
            transfer.discard()
            raise HashMismatch(f"{label}: the downloaded bytes do not match the published "
                               f"sha256 (expected {remote.sha256[:12]}..., got {actual[:12]}...); "
                               "the download was discarded, pull again or report it to the hub")
        try:
            await asyncio.to_thread(read_header, transfer.partial)
        except GGUFError:
            transfer.discard()
            raise NotGGUF(f"{label} is not a whole GGUF model file") from None
        size = transfer.partial.stat().st_size
        digest = store.publish_blob(transfer.partial, actual)
        transfer.state_path.unlink(missing_ok=True)
        return digest, size


def _existing(store: ModelStore, hexdigest: str, on_bytes) -> tuple[str, int]:
    digest = f"sha256:{hexdigest}"
    size = store.blob_path(digest).stat().st_size
    on_bytes(size)
    return digest, size
