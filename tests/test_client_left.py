"""A client that leaves mid-answer ends its request as a cancel (as when aiohttp cancels the
handler for it), not as an error of the server's: the write that finds the connection closed
comes a moment before that cancel on a loaded machine. A reset of another connection while the
client waits is still an error. A real aiohttp server with the daemon's middlewares."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from localllm.daemon.server import cancelled_middleware, error_middleware


async def _client(handler) -> TestClient:
    app = web.Application(middlewares=[cancelled_middleware, error_middleware])
    app.router.add_post("/api/chat", handler)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


async def test_a_write_after_the_client_left_is_a_cancel_not_an_error(caplog):
    async def client_left(request: web.Request) -> web.StreamResponse:
        request.transport.close()  # the client is gone: what aiohttp's write raises then
        raise ConnectionResetError("Cannot write to closing transport")

    client = await _client(client_left)
    try:
        with caplog.at_level(logging.INFO), pytest.raises(aiohttp.ServerDisconnectedError):
            await client.post("/api/chat", json={})
    finally:
        await client.close()
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    assert any(" 499" in r.getMessage() for r in caplog.records)  # the access log's line


async def test_another_connections_reset_is_still_an_error(caplog):
    async def hub_reset(request: web.Request) -> web.StreamResponse:
        raise ConnectionResetError("the hub reset the download")

    client = await _client(hub_reset)
    try:
        with caplog.at_level(logging.INFO):
            response = await client.post("/api/chat", json={})
            body = await response.json()
    finally:
        await client.close()
    assert response.status == 500 and "the hub reset the download" in body["error"]
    assert any("error serving POST /api/chat" in r.getMessage() for r in caplog.records
               if r.levelno >= logging.ERROR)
