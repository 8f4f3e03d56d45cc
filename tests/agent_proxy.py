"""A recording HTTP proxy for tests: put between an agent CLI and a real daemon, it forwards
every request as it is (streams included) and keeps each request's method, path and JSON body,
and the text of its answer, so a test can see what the agent sent (its tool results) and what
it was answered (the usage) without touching either side.

    with RecordingProxy(daemon.url) as proxy:
        ... run the agent against proxy.url ...
    bodies = proxy.bodies("/v1/messages")
"""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import ClientSession, ClientTimeout, web

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


class RecordingProxy:
    def __init__(self, target: str):
        self.target = target
        self.requests: list[dict] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._runner: web.AppRunner | None = None

    def bodies(self, path: str) -> list[dict]:
        return [r["body"] for r in self.requests
                if r["path"] == path and isinstance(r["body"], dict)]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        record = {"method": request.method, "path": request.path, "body": body, "answer": ""}
        self.requests.append(record)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        session = ClientSession(auto_decompress=False, timeout=ClientTimeout(total=None))
        async with session, session.request(request.method, self.target + request.path_qs,
                                            data=raw, headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS})
            await response.prepare(request)
            answer = bytearray()
            async for chunk in upstream.content.iter_any():
                answer += chunk
                # kept as it comes: a client may hang up once it has read the end it needs
                record["answer"] = answer.decode(errors="replace")
                await response.write(chunk)
            await response.write_eof()
            return response

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self._started.set()
        self._loop.run_forever()

    def __enter__(self) -> RecordingProxy:
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        if not self._started.wait(30):
            raise RuntimeError("the recording proxy did not start")
        return self

    def __exit__(self, *exc) -> None:
        async def stop() -> None:
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
