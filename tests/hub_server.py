"""A local hub with Hugging Face's URL layout, for pull tests, with faults that tests switch on.

    GET  /api/models/OWNER/REPO/tree/main       the file list (path, size, lfs.oid = sha256)
    HEAD /OWNER/REPO/resolve/main/PATH          302 to /cdn/..., X-Linked-Etag and X-Linked-Size
    GET  /OWNER/REPO/resolve/main/PATH          the same redirect, followed by clients
    GET  /cdn/SHA/NAME                          the bytes, with Range support
    GET  /plain/NAME                            the bytes, no hash headers (a plain web server)

It runs in its own thread and event loop, so synchronous tests, async tests and CLI subprocesses
can all use it. Faults: `drops` (close the connection after N bytes, one entry per response),
`hold_after` (stop after N bytes until `release()`), `refuse_ranges` (416 for any Range),
`gated` (a token is required), `published_sha256` (advertise a hash the bytes do not have),
`server_error` (the file list answers this 5xx).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import socket
import threading
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

_CHUNK = 1 << 20
# Where the pull tests publish SmolLM2 on the local hub (see the `hub` fixture in conftest.py).
REPO = "test/SmolLM2-GGUF"
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@functools.cache
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class HubFile:
    repo: str
    path: str
    source: Path
    sha256: str
    size: int


@dataclass
class Hub:
    files: dict[tuple[str, str], HubFile] = field(default_factory=dict)
    gated: dict[str, str] = field(default_factory=dict)  # repo -> the token it wants
    drops: list[int] = field(default_factory=list)  # per response: close after this many bytes
    hold_after: int | None = None  # stop serving after this many bytes of a response until release
    refuse_ranges: bool = False
    server_error: int | None = None  # answer every hub request with this 5xx status
    served_bytes: int = 0
    cdn_requests: list[str | None] = field(default_factory=list)  # Range header of each GET

    def __post_init__(self):
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.url = ""
        self._released: asyncio.Event | None = None
        self._holding = threading.Event()

    # ---- test-side API (any thread) ----------------------------------------------------
    def add(self, repo: str, path: str, source: Path,
            published_sha256: str | None = None) -> HubFile:
        # A published hash spares hashing: tests serving big sparse models only read headers.
        entry = HubFile(repo, path, source, published_sha256 or _sha256(source),
                        source.stat().st_size)
        self.files[(repo, path)] = entry
        return entry

    def release(self) -> None:
        """Let held responses go on (and stop holding new ones)."""
        self.hold_after = None
        if self.loop and self._released:
            self.loop.call_soon_threadsafe(self._released.set)

    @property
    def holding(self) -> bool:
        """True once some response has stopped at hold_after."""
        return self._holding.is_set()

    def start(self) -> Hub:
        ready = threading.Event()

        def run() -> None:
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            self._released = asyncio.Event()
            runner = web.AppRunner(self.app(), handle_signals=False)
            self.loop.run_until_complete(runner.setup())
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            self.loop.run_until_complete(web.SockSite(runner, sock).start())
            self.url = f"http://127.0.0.1:{port}"
            self._runner = runner
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(runner.cleanup())
            self.loop.close()

        self.thread = threading.Thread(target=run, name="test-hub", daemon=True)
        self.thread.start()
        ready.wait(10)
        return self

    def stop(self) -> None:
        if self.loop:
            self.release()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def __enter__(self) -> Hub:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- the server --------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/models/{owner}/{repo}/tree/{rev}", self.tree)
        app.router.add_route("*", "/{owner}/{repo}/resolve/{rev}/{path:.+}", self.resolve)
        app.router.add_get("/cdn/{sha}/{name}", self.cdn)
        app.router.add_get("/plain/{name}", self.plain)
        return app

    def authorized(self, request: web.Request, repo: str) -> bool:
        token = self.gated.get(repo)
        return token is None or request.headers.get("Authorization") == f"Bearer {token}"

    async def tree(self, request: web.Request) -> web.Response:
        repo = f"{request.match_info['owner']}/{request.match_info['repo']}"
        if self.server_error:
            return web.Response(status=self.server_error, text="upstream trouble")
        if not self.authorized(request, repo):
            return web.json_response({"error": "Access to this repo is restricted"}, status=401)
        listing = [{"type": "file", "oid": "0" * 40, "size": f.size, "path": f.path,
                    "lfs": {"oid": f.sha256, "size": f.size, "pointerSize": 134}}
                   for (r, _), f in self.files.items() if r == repo]
        if not listing:
            return web.json_response({"error": "Repository not found"}, status=404)
        listing.append({"type": "file", "oid": "1" * 40, "size": 12, "path": "README.md"})
        return web.json_response(listing)

    async def resolve(self, request: web.Request) -> web.Response:
        repo = f"{request.match_info['owner']}/{request.match_info['repo']}"
        if not self.authorized(request, repo):
            return web.Response(status=401, text="Invalid credentials")
        entry = self.files.get((repo, request.match_info["path"]))
        if entry is None:
            return web.Response(status=404, text="Entry not found")
        name = entry.path.rsplit("/", 1)[-1]
        return web.Response(status=302, headers={
            "Location": f"/cdn/{entry.sha256}/{name}", "X-Linked-Etag": f'"{entry.sha256}"',
            "X-Linked-Size": str(entry.size), "ETag": f'"{entry.sha256}"'})

    async def cdn(self, request: web.Request) -> web.StreamResponse:
        for entry in self.files.values():
            if entry.sha256 == request.match_info["sha"]:
                return await self.serve(request, entry, hash_headers=True)
        return web.Response(status=404)

    async def plain(self, request: web.Request) -> web.StreamResponse:
        for entry in self.files.values():
            if entry.path.rsplit("/", 1)[-1] == request.match_info["name"]:
                return await self.serve(request, entry, hash_headers=False)
        return web.Response(status=404)

    async def serve(self, request: web.Request, entry: HubFile,
                    hash_headers: bool) -> web.StreamResponse:
        range_header = request.headers.get("Range")
        self.cdn_requests.append(range_header)
        start, end = 0, entry.size
        status = 200
        if range_header:
            if self.refuse_ranges:
                return web.Response(status=416)
            first, _, last = range_header.removeprefix("bytes=").partition("-")
            start, end = int(first), (int(last) + 1 if last else entry.size)
            status = 206
        headers = {"Content-Length": str(end - start), "Accept-Ranges": "bytes"}
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{entry.size}"
        if hash_headers:
            headers["ETag"] = f'"{entry.sha256}"'
        response = web.StreamResponse(status=status, headers=headers)
        await response.prepare(request)
        if request.method == "HEAD":
            return response
        drop_after = self.drops.pop(0) if self.drops else None
        sent = 0
        with entry.source.open("rb") as f:
            f.seek(start)
            while sent < end - start:
                want = min(_CHUNK, end - start - sent)
                if drop_after is not None:
                    want = min(want, drop_after - sent)
                if self.hold_after is not None:
                    want = min(want, max(self.hold_after - sent, 0))
                    if want == 0:
                        self._holding.set()
                        await self._released.wait()
                        continue
                if want == 0:  # the drop point: cut the connection mid-body
                    request.transport.close()
                    return response
                data = f.read(want)
                await response.write(data)
                sent += len(data)
                self.served_bytes += len(data)
        await response.write_eof()
        return response
